"""Stability of AdamW's update rule with and without a stale gradient, on one direction of a
quadratic, with the preconditioner frozen (the model of Cohen et al., "Adaptive Gradient Methods at
the Edge of Stability", arXiv 2207.14484).

Along an eigen-direction of the preconditioned Hessian with curvature h, AdamW with a frozen
denominator is heavy-ball momentum: m' = beta1 m + (1 - beta1) g, x' = x - lr m' (weight decay and
bias correction left out). The rules differ only in where g is taken:

- sync (ZeRO-1, ShardedAdamW): g = h x_t.
- DPU (docs/design.md 3.2): g = h x_{t-1}, one update stale.
- ACCO (docs/design.md 3.3): g = h (x~_t + x_t) / 2, where the estimate x~_{t+1} is AdamW's step from x_t
  with the momentum and the gradient taken at x~_t (Peek), without changing the state.

For each rule and beta1 this prints the largest lr * h for which every eigenvalue of the linear
map has modulus below 1, found by bisection on the spectral radius (the error along that direction
grows without bound above it). h is an eigenvalue of the preconditioned Hessian P^-1 H; full-batch
Adam's rises to the synchronous edge and hovers there (Cohen et al.), so a rule with a lower edge
needs a lower preconditioned sharpness: a larger v (smaller steps) or flatter regions
(docs/studies/dpu_convergence.md). For ACCO the estimate's error e = x~ - x obeys e' = -(1 - beta1) lr h / 2 e,
so its eigenvalues are the synchronous ones and that factor: its edge is min(sync, 2 / (1 - beta1)).

    python benchmarks/studies/delay_stability.py
"""
import argparse

import numpy as np


def transition(rule: str, beta: float, a: float, k: float = 1.0) -> np.ndarray:
    """The linear map of one update for curvature ``a`` = lr * h (lr folded into h). ``k``: the
    extrapolation factor of rule "dpu-extrapolated" (DPU's stale gradient taken at
    x_{t-1} + k (x_{t-1} - x_{t-2}) instead of x_{t-1})."""
    b = beta
    c = (1 - b)  # the gradient's weight in the momentum
    if rule == "dpu-extrapolated":  # state (x_t, x_{t-1}, x_{t-2}, m)
        grad = np.array([0, c * a * (1 + k), -c * a * k, 0])
        momentum = grad + np.array([0, 0, 0, b])
        return np.array([np.array([1, 0, 0, 0]) - momentum, [1, 0, 0, 0], [0, 1, 0, 0], momentum])
    if rule == "sync":  # state (x, m): m' = b m + c a x (lr folded in), x' = x - m'
        return np.array([[1 - c * a, -b],
                         [c * a, b]])
    if rule == "dpu":  # state (x_t, x_{t-1}, m): g at x_{t-1}
        return np.array([[1, -c * a, -b],
                         [1, 0, 0],
                         [0, c * a, b]])
    if rule == "acco":  # state (x, x~, m): g = (x~ + x) / 2; x~' = x - (b m + c a x~)
        return np.array([[1 - c * a / 2, -c * a / 2, -b],
                         [1, -c * a, -b],
                         [c * a / 2, c * a / 2, b]])
    raise ValueError(f"unknown rule {rule!r}: expected sync, dpu, acco or dpu-extrapolated")


def spectral_radius(rule: str, beta: float, a: float, k: float = 1.0) -> float:
    return float(max(abs(np.linalg.eigvals(transition(rule, beta, a, k)))))


def edge(rule: str, beta: float, k: float = 1.0) -> float:
    """The largest lr * h with spectral radius < 1 (stable for every smaller one, checked on a grid
    up to 4 / (1 - beta), above every rule's edge)."""
    grid = np.linspace(1e-4, 4.0 / (1.0 - beta), 2001)
    radii = np.array([spectral_radius(rule, beta, a, k) for a in grid])
    unstable = np.nonzero(radii >= 1 - 1e-12)[0]
    if len(unstable) == 0:
        return float("inf")
    lo, up = grid[max(unstable[0] - 1, 0)], grid[unstable[0]]
    for _ in range(60):
        mid = (lo + up) / 2
        if spectral_radius(rule, beta, mid, k) < 1 - 1e-12:
            lo = mid
        else:
            up = mid
    return lo


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--betas", default="0,0.5,0.9", help="comma-separated beta1 values")
    p.add_argument("--extrapolation", default="",
                   help="comma-separated k: also print DPU's edge with its stale gradient taken at the "
                        "extrapolated x_{t-1} + k (x_{t-1} - x_{t-2})")
    args = p.parse_args(argv)
    betas = [float(b) for b in args.betas.split(",")]
    print("| beta1 | sync edge (lr*h) | formula 2(1+b)/(1-b) | DPU edge | ACCO edge | sync / DPU | sync / ACCO |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for b in betas:
        sync, dpu, acco = (edge(r, b) for r in ("sync", "dpu", "acco"))
        print(f"| {b:g} | {sync:.3f} | {2 * (1 + b) / (1 - b):.3f} | {dpu:.3f} | {acco:.3f} | "
              f"{sync / dpu:.1f} | {sync / acco:.1f} |")
    ks = [float(k) for k in args.extrapolation.split(",") if k]
    if ks:
        print()
        print("| beta1 | " + " | ".join(f"DPU edge, extrapolated k={k:g}" for k in ks) + " |")
        print("|---:|" + "---:|" * len(ks))
        for b in betas:
            print(f"| {b:g} | " + " | ".join(f"{edge('dpu-extrapolated', b, k):.3f}" for k in ks) + " |")


if __name__ == "__main__":
    main()
