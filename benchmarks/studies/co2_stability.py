"""Linear stability of CO2's outer iteration on a quadratic (docs/studies/co2_convergence.md, section 3).

Model: along one eigen-direction of a quadratic with minimiser x*, a round of local training
started at s ends, on average over replicas, at ybar = x* + (1 - r)(s - x*): the round removes a
fraction r of the error (r ~ 1 for directions one round of local AdamW resolves, r << 1 for slow
ones). With e = x - x*, the pseudo-gradient is d = r e(start), and the outer rules of
benchmarks/studies/co2_study.py become linear recurrences with a = alpha * r / lambda:

  synchronous heavy ball   e_{k+1} = e_k - alpha m_{k+1},      m_{k+1} = beta m_k + (r/lambda) e_k
      z^2 - (1 + beta - a) z + beta = 0                      stable iff 0 < a < 2 (1 + beta)
  synchronous Nesterov     e_{k+1} = e_k - alpha (g_k + beta m_{k+1}),  g_k = (r/lambda) e_k
      z^2 - (1 + beta - a - a beta) z + beta (1 - a) = 0
  delayed heavy ball (DESIGN 3.5)   e_{k+2} = e_{k+1} - alpha m_{k+1}
      z^2 - (1 + beta) z + (beta + a) = 0                    stable iff 0 < a < 1 - beta
  delayed Nesterov         e_{k+2} = e_{k+1} - alpha (g_k + beta m_{k+1})
      z^3 - (1 + beta) z^2 + (beta + a + a beta) z - a beta = 0
  eager with own share w (benchmarks/studies/co2_study.py --eager --eager-weight w): the replicas
      restart from s_{k+1} = X_k - alpha dir(beta m_k + w d_k) while the average moves the
      committed (X, m) one round later; w = 1 with identical replicas is the synchronous
      recurrence, w = 0 the delayed one, w = 1/W the Eager Updates paper's rule.

The rho values come from the eigenvalues of each rule's one-round linear map (round_map), so
no closed form is needed for the eager and Nesterov cases; for the first four rules they agree
with the roots of the polynomials above.

Prints, per rule and (alpha, beta): the largest a that is stable (a_max; the rule is stable for
every direction iff alpha / lambda <= a_max, since r reaches ~1), the spectral radius rho at r = 1
and lambda = 1 (the factor by which a resolved direction's error grows or shrinks per round),
and the oscillation period of the dominant root. Then iterates the adaptive gap penalty
(a nonlinear feedback) on a one-dimensional quadratic, noise-free and with replica noise.

    python benchmarks/studies/co2_stability.py
"""
import argparse
import cmath
import math
import random

import numpy as np


def _direction(momentum: float, g: float, beta: float, nesterov: bool) -> float:
    return g + beta * momentum if nesterov else momentum


def round_map(rule: str, a: float, beta: float, nesterov: bool, weight: float = 1.0):
    """The linear map of one outer round on the rule's state, as a matrix (alpha folded into a = alpha r).

    sync:    state (x, m);           d = r x
    delayed: state (x_k, x_{k+1}, m); d = r x_k, replicas restart from x_{k+1} (DESIGN 3.5)
    eager:   state (X, m, s);        d = r s, s' = X - alpha dir(beta m + w d), then m, X take d
    """
    def step(state):
        if rule == "sync":
            x, m = state
            d = a * x  # alpha folded in: d here is alpha * r * x
            m2 = beta * m + d
            return [x - _direction(m2, d, beta, nesterov), m2]
        if rule == "delayed":
            x_old, x, m = state
            d = a * x_old
            m2 = beta * m + d
            return [x, x - _direction(m2, d, beta, nesterov), m2]
        if rule == "eager":
            x, m, start = state
            d = a * start
            peek = beta * m + weight * d
            new_start = x - _direction(peek, weight * d, beta, nesterov)
            m2 = beta * m + d
            return [x - _direction(m2, d, beta, nesterov), m2, new_start]
        raise ValueError(rule)

    size = 2 if rule == "sync" else 3
    columns = []
    for j in range(size):
        unit = [0.0] * size
        unit[j] = 1.0
        columns.append(step(unit))
    return np.array(columns).T


def spectral_radius(rule: str, a: float, beta: float, nesterov: bool = False, weight: float = 1.0):
    eigenvalues = np.linalg.eigvals(round_map(rule, a, beta, nesterov, weight))
    dominant = max(eigenvalues, key=abs)
    angle = abs(cmath.phase(dominant))
    period = 2 * math.pi / angle if angle > 1e-9 and abs(dominant) > 1e-9 else math.inf
    return float(abs(dominant)), period


def largest_stable_a(rule: str, beta: float, nesterov: bool = False, weight: float = 1.0, upper: float = 8.0) -> float:
    """Largest a in (0, upper] with spectral radius < 1 for every a' in (0, a] (grid + bisection)."""
    def stable(a):
        return spectral_radius(rule, a, beta, nesterov, weight)[0] < 1.0 - 1e-9
    grid = np.linspace(1e-4, upper, 4001)
    last = 0.0
    for a in grid:
        if not stable(a):
            lo, hi = last, a
            for _ in range(50):
                mid = 0.5 * (lo + hi)
                lo, hi = (mid, hi) if stable(mid) else (lo, mid)
            return lo
        last = a
    return upper


def adaptive_penalty_iteration(alpha: float, beta: float, r: float, noise: float, rounds: int, seed: int = 0,
                               replicas: int = 2, dims: int = 64):
    """DESIGN 3.5 with the adaptive penalty on sum_j e_j^2 / 2 in ``dims`` directions, every one
    resolved to a fraction r per round, each replica's round ending with N(0, noise^2) per coordinate.
    Returns the per-round (||e||, lambda)."""
    rng = random.Random(seed)
    x_prev = [1.0] * dims
    x = [1.0] * dims  # x_0 = x_1
    m = [0.0] * dims
    out = []
    for _ in range(rounds):
        ys = [[(1 - r) * xp + noise * rng.gauss(0, 1) for xp in x_prev] for _ in range(replicas)]
        ybar = [sum(col) / replicas for col in zip(*ys)]
        largest = max(math.sqrt(sum((yi - xp)**2 for yi, xp in zip(y, x_prev))) for y in ys)
        penalty = 1 + math.sqrt(sum((a - b)**2 for a, b in zip(x, x_prev))) / (largest + 1e-12)
        d = [xp - yb for xp, yb in zip(x_prev, ybar)]
        m = [beta * mi + di / penalty for mi, di in zip(m, d)]
        x_prev, x = x, [xi - alpha * mi for xi, mi in zip(x, m)]
        out.append((math.sqrt(sum(v * v for v in x)), penalty))
    return out


def main(argv=None):
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    settings = [
        # rule, alpha, beta, nesterov, eager weight, note
        ("delayed", 1.0, 0.5, False, 1.0, "DESIGN 3.5 defaults (CO2)"),
        ("delayed", 1.0, 0.0, False, 1.0, "Local SGD one round late"),
        ("delayed", 0.7, 0.2, False, 1.0, ""),
        ("delayed", 0.5, 0.0, False, 1.0, ""),
        ("delayed", 0.5, 0.5, False, 1.0, ""),
        ("delayed", 0.7, 0.9, True, 1.0, "DiLoCo's outer optimizer, one round late"),
        ("sync", 1.0, 0.0, False, 1.0, "synchronous Local SGD"),
        ("sync", 1.0, 0.5, False, 1.0, "the public CO2 reference (its outer step is synchronous)"),
        ("sync", 0.7, 0.9, True, 1.0, "DiLoCo (synchronous)"),
        ("eager", 1.0, 0.0, False, 1.0, "eager, own pseudo-gradient in full"),
        ("eager", 1.0, 0.0, False, 0.5, "eager, own share 1/W (W = 2)"),
        ("eager", 1.0, 0.5, False, 0.5, ""),
        ("eager", 0.7, 0.9, True, 1.0, ""),
        ("eager", 0.7, 0.9, True, 0.5, ""),
    ]
    print("| rule | alpha | beta | Nesterov | eager share w | a_max (stable iff alpha r / lambda < a_max) | "
          "rho at r=1, lambda=1 | period (rounds) | rho at r=0.5 | rho at r=0.1 | note |")
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---|")
    for rule, alpha, beta, nesterov, weight, note in settings:
        a_max = largest_stable_a(rule, beta, nesterov, weight)
        rho, period = spectral_radius(rule, alpha, beta, nesterov, weight)
        rho_half, _ = spectral_radius(rule, 0.5 * alpha, beta, nesterov, weight)
        rho_tenth, _ = spectral_radius(rule, 0.1 * alpha, beta, nesterov, weight)
        print(f"| {rule} | {alpha:g} | {beta:g} | {'yes' if nesterov else 'no'} | "
              f"{weight:g} | {a_max:.3f} | {rho:.3f} | {'-' if math.isinf(period) else f'{period:.1f}'} | "
              f"{rho_half:.3f} | {rho_tenth:.3f} | {note} |")

    print("\nThe adaptive gap penalty (DESIGN 3.5, alpha 1, beta 0.5) on a 64-direction quadratic, "
          "2 replicas, every direction resolved to r per round; ||e|| after rounds 5, 10, 20, 40 "
          "(start 8.0) and the median lambda over rounds 10-40:")
    print("| r | replica noise per coordinate | ||e|| @5 | @10 | @20 | @40 | median lambda |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in (1.0, 0.5, 0.1):
        for noise in (0.0, 0.01, 0.1):
            trace = adaptive_penalty_iteration(1.0, 0.5, r, noise, 40)
            lam = sorted(p for _, p in trace[10:])[len(trace[10:]) // 2]
            print(f"| {r:g} | {noise:g} | {trace[4][0]:.3g} | {trace[9][0]:.3g} | {trace[19][0]:.3g} | "
                  f"{trace[39][0]:.3g} | {lam:.2f} |")


if __name__ == "__main__":
    main()
