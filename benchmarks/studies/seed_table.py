"""Validation-loss tables over seeds from the bench's ``steps.csv`` files of several run folders.

The bench writes one ``steps.csv`` per invocation (rank 0's ``val_loss`` at every evaluation); runs
of one schedule made by separate invocations (one seed, or some methods, at a time) are combined
here: per method, the mean [min, max] over seeds at every evaluation, the relative gap to the
baseline *of the same seed* at the chosen updates, whether the loss decreased at every evaluation,
and at how many evaluations it was above the lone replica (the compute-only run) of the same seed.

    python benchmarks/studies/seed_table.py docs/results/conv720 docs/results/conv720_seed1 --gaps 300,720

``--paired METHOD=REFERENCE,...`` prints instead, per pair, the gap of METHOD to REFERENCE *of the
same seed* at each ``--gaps`` update: every seed's, and their mean with a 95% Student-t interval (a
paired comparison: both runs of a seed share its initialisation and data order).

A folder written ``FOLDER@TAG`` holds runs of a variant (made with a flag the method's name does
not show, such as ``--local-steps 4``): its methods other than the baselines (``--baseline`` and
the lone replica) become ``METHOD@TAG`` rows, labelled with the tag, e.g.
``docs/results/conv720_eager_local4_seed2@local_steps 4``. ``FOLDER@METHODS=TAG`` tags only the
comma-separated METHODS of a folder that also holds plain runs of other methods, e.g.
``docs/results/conv720_seed3@co2+eager=local_steps 4``.
"""
import argparse
import csv
import os
import sys
from collections import defaultdict
from typing import Dict, List

LABELS = {"compute": "lone replica (no communication)", "zero1": "DeepSpeed ZeRO-1", "acco": "ACCO",
          "co2": "CO2 (defaults)", "co2+eager": "CO2, `anchor_merge_steps` 1", "sharded": "ShardedAdamW",
          "dpu": "DPU", "acco+bf16comm": "ACCO, bf16 wire", "acco+q8": "ACCO, int8 wire",
          "acco+q4": "ACCO, int4 wire", "co2+fp32comm": "CO2, fp32 averaging", "co2+q8": "CO2, int8 averaging",
          "co2+q4": "CO2, int4 averaging"}


def label(method: str) -> str:
    base, _, tag = method.partition("@")
    return LABELS.get(base, base) + (f", {tag}" if tag else "")


def load(folders: List[str], baseline: str = "zero1") -> Dict[str, Dict[int, Dict[int, float]]]:
    """method -> seed -> update -> rank 0's validation loss (the first folder that has it wins)."""
    curves: Dict[str, Dict[int, Dict[int, float]]] = defaultdict(dict)
    for spec in folders:
        folder, _, tag = spec.partition("@")
        tagged = None  # None: every method but the baselines
        if "=" in tag:
            names, _, tag = tag.partition("=")
            tagged = {n.strip() for n in names.split(",") if n.strip()}
        found: Dict[tuple, Dict[int, float]] = defaultdict(dict)
        with open(os.path.join(folder, "steps.csv")) as f:
            for row in csv.DictReader(f):
                if row["rank"] != "0" or not row["val_loss"]:
                    continue
                found[(row["method"], int(row["seed"]))][int(row["update"])] = float(row["val_loss"])
        for (method, seed), curve in found.items():
            if tag and method not in (baseline, "compute") and (tagged is None or method in tagged):
                method = f"{method}@{tag}"
            curves[method].setdefault(seed, curve)
    return curves


def fmt(values: List[float], digits: int = 3, percent: bool = False) -> str:
    if not values:
        return "-"
    f = (lambda v: f"{v:+.1f}%") if percent else (lambda v: f"{v:.{digits}f}")
    mean = sum(values) / len(values)
    return f(mean) if len(values) == 1 else f"{f(mean)} [{f(min(values))}, {f(max(values))}]"


T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}
"""Two-sided 95% quantiles of Student's t by degrees of freedom (n seeds: n - 1)."""


def interval(values: List[float]) -> tuple:
    """(mean, half-width of its 95% t-interval); half-width None for a single value."""
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, None
    if len(values) - 1 not in T95:
        raise ValueError(f"--paired: at most {max(T95) + 1} seeds (t quantiles tabulated to {max(T95)} degrees of freedom)")
    sd = (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5
    return mean, T95[len(values) - 1] * sd / len(values) ** 0.5


def paired_table(curves, pairs: List[tuple], gaps: List[int]) -> List[str]:
    """Markdown rows: METHOD against REFERENCE of the same seed at each update of ``gaps``."""
    head = ["method", "against", "seeds"] + [x for u in gaps for x in (f"per seed @{u}", f"mean, 95% interval @{u}")]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for method, reference in pairs:
        seeds = sorted(s for s in curves[method] if s in curves[reference])
        cells = [label(method), label(reference), ",".join(map(str, seeds))]
        for u in gaps:
            rel = {s: 100 * (curves[method][s][u] / curves[reference][s][u] - 1) for s in seeds
                   if u in curves[method][s] and u in curves[reference][s]}
            if not rel:
                cells += ["", ""]
                continue
            mean, half = interval(list(rel.values()))
            cells.append(", ".join(f"{v:+.2f}%" for v in rel.values()))
            cells.append(f"{mean:+.2f}%" + ("" if half is None else f" [{mean - half:+.2f}, {mean + half:+.2f}]"))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def updates_to_reach(curve: Dict[int, float], loss: float):
    """The update at which ``curve`` first reaches ``loss`` (linear between evaluations), or None."""
    points = sorted(curve.items())
    for (u0, l0), (u1, l1) in zip(points, points[1:]):
        if l1 <= loss <= l0:
            return u0 + (l0 - loss) / (l0 - l1) * (u1 - u0) if l0 > l1 else u0
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folders", nargs="+", help="bench output folders (each with a steps.csv)")
    p.add_argument("--baseline", default="zero1")
    p.add_argument("--gaps", default="", help="updates at which to report the gap to the baseline (default: the last)")
    p.add_argument("--columns", default="", help="updates to show as columns (default: every evaluation)")
    p.add_argument("--methods", default="", help="comma-separated, in this order (default: all found)")
    p.add_argument("--update-ratio", action="store_true",
                   help="also, at each --gaps update U: the update at which the baseline of the same seed reached "
                        "the method's loss at U (linear between evaluations), divided by U: below 1 the method "
                        "needs more updates than the baseline for that loss")
    p.add_argument("--paired", default="",
                   help="METHOD=REFERENCE,...: instead of the table, each METHOD's gap to REFERENCE of the same "
                        "seed at the --gaps updates, per seed and as a mean with its 95%% t-interval")
    args = p.parse_args(argv)
    curves = load(args.folders, args.baseline)
    if args.paired:
        items = [item.strip() for item in args.paired.split(",") if item.strip()]
        bad = [item for item in items if item.count("=") != 1]
        if bad:
            p.error(f"--paired: {', '.join(bad)}: expected METHOD=REFERENCE, e.g. acco+q8=acco+bf16comm")
        pairs = [tuple(x.strip() for x in item.split("=")) for item in items]
        missing = sorted({m for pair in pairs for m in pair if m not in curves})
        if missing:
            p.error(f"--paired: no runs of {', '.join(missing)} in these folders")
        last = max(u for pair in pairs for m in pair for c in curves[m].values() for u in c)
        gaps = [int(u) for u in args.gaps.split(",") if u] or [last]
        print("\n".join(paired_table(curves, pairs, gaps)))
        return 0
    order = list(LABELS)

    def rank(method: str) -> tuple:  # LABELS order, unknown methods last; a tagged variant after its base
        base, _, tag = method.partition("@")
        return (order.index(base) if base in order else len(order), tag)

    methods = [m for m in args.methods.split(",") if m] or sorted(curves, key=rank)
    missing = [m for m in methods if m not in curves]
    if missing:
        p.error(f"no runs of {', '.join(missing)} in these folders")
    updates = sorted({u for m in methods for c in curves[m].values() for u in c if u > 0})
    columns = [int(u) for u in args.columns.split(",") if u] or updates
    gaps = [int(u) for u in args.gaps.split(",") if u] or [updates[-1]]
    base, lone = curves.get(args.baseline, {}), curves.get("compute", {})
    head = ["method", "seeds"] + [f"@{u}" for u in columns] + [f"vs {args.baseline} @{u}" for u in gaps] + \
        ([f"{args.baseline} updates to its loss / {u}" for u in gaps] if args.update_ratio else []) + \
        ["decreasing at every evaluation", "evaluations above the lone replica"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for m in methods:
        seeds = sorted(curves[m])
        cells = [label(m), ",".join(map(str, seeds))]
        for u in columns:
            cells.append(fmt([curves[m][s][u] for s in seeds if u in curves[m][s]]))
        for u in gaps:
            rel = [100 * (curves[m][s][u] / base[s][u] - 1) for s in seeds
                   if m != args.baseline and s in base and u in base[s] and u in curves[m][s]]
            cells.append(fmt(rel, percent=True) if rel else "")
        for u in gaps if args.update_ratio else []:
            reach = [updates_to_reach(base[s], curves[m][s][u]) for s in seeds
                     if m != args.baseline and s in base and u in curves[m][s]]
            ratios = [r / u for r in reach if r is not None]
            cells.append((fmt(ratios, digits=2) + ("" if len(ratios) == len(reach) else
                                                     f" ({len(reach) - len(ratios)} not reached)")) if reach else "")
        ordered = [[curves[m][s][u] for u in sorted(curves[m][s])] for s in seeds]
        decreasing = sum(all(b < a for a, b in zip(losses, losses[1:])) for losses in ordered)
        cells.append(f"{decreasing} of {len(seeds)}")
        if m == "compute":
            cells.append("")
        else:
            above = []
            named = len(seeds) > 1
            for s in seeds:
                name = f"seed {s}: " if named else ""
                if s not in lone:
                    above.append(f"{name}no lone run")
                    continue
                worse = [u for u in sorted(curves[m][s]) if u > 0 and u in lone[s] and curves[m][s][u] > lone[s][u]]
                above.append(f"{name}{len(worse)}" + (f" ({','.join(map(str, worse))})" if worse else ""))
            cells.append("; ".join(above))
        print("| " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
