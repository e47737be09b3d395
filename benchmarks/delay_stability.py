"""Stability of AdamW's update rule with and without a stale gradient, on one direction of a
quadratic, with the preconditioner frozen (the model of Cohen et al., "Adaptive Gradient Methods at
the Edge of Stability", arXiv 2207.14484).

Along an eigen-direction of the preconditioned Hessian with curvature h, AdamW with a frozen
denominator is heavy-ball momentum: m' = beta1 m + (1 - beta1) g, x' = x - lr m' (weight decay and
bias correction left out). The rules differ only in where g is taken:

- sync (ZeRO-1, ShardedAdamW): g = h x_t.
- DPU (DESIGN 3.2): g = h x_{t-1}, one update stale.
- ACCO (DESIGN 3.3): g = h (x~_t + x_t) / 2, where the estimate x~_{t+1} is AdamW's step from x_t
  with the momentum and the gradient taken at x~_t (Peek), without changing the state.

For each rule and beta1 this prints the largest lr * h for which every eigenvalue of the linear
map has modulus below 1, found by bisection on the spectral radius (the loss along that direction
grows without bound above it). Training with an adaptive optimizer drives the sharpest directions
up to this edge, so a rule with a lower edge has to train in flatter, higher-loss regions or
oscillate (docs/dpu_convergence.md).

    python benchmarks/delay_stability.py
"""
import argparse

import numpy as np


def transition(rule: str, beta: float, a: float) -> np.ndarray:
    """The linear map of one update for curvature ``a`` = lr * h (lr folded into h)."""
    b = beta
    c = (1 - b)  # the gradient's weight in the momentum
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
    raise ValueError(f"unknown rule {rule!r}: expected sync, dpu or acco")


def spectral_radius(rule: str, beta: float, a: float) -> float:
    return float(max(abs(np.linalg.eigvals(transition(rule, beta, a)))))


def edge(rule: str, beta: float, hi: float = 1e3) -> float:
    """The largest lr * h with spectral radius < 1 (stable for every smaller one, checked on a grid)."""
    grid = np.linspace(1e-4, hi, 200_001)
    radii = np.array([spectral_radius(rule, beta, a) for a in grid[::100]])
    unstable = np.nonzero(radii >= 1 - 1e-12)[0]
    if len(unstable) == 0:
        return float("inf")
    lo, up = grid[::100][max(unstable[0] - 1, 0)], grid[::100][unstable[0]]
    for _ in range(60):
        mid = (lo + up) / 2
        if spectral_radius(rule, beta, mid) < 1 - 1e-12:
            lo = mid
        else:
            up = mid
    return lo


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--betas", default="0,0.5,0.9", help="comma-separated beta1 values")
    args = p.parse_args(argv)
    betas = [float(b) for b in args.betas.split(",")]
    print("| beta1 | sync edge (lr*h) | formula 2(1+b)/(1-b) | DPU edge | ACCO edge | sync / DPU | sync / ACCO |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for b in betas:
        sync, dpu, acco = (edge(r, b, hi=2e3 if r == "sync" else 50.0) for r in ("sync", "dpu", "acco"))
        print(f"| {b:g} | {sync:.3f} | {2 * (1 + b) / (1 - b):.3f} | {dpu:.3f} | {acco:.3f} | "
              f"{sync / dpu:.1f} | {sync / acco:.1f} |")


if __name__ == "__main__":
    main()
