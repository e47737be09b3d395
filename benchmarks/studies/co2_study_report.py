"""Tables from benchmarks/studies/co2_study.py result files (validation loss per method at several updates).

    python benchmarks/studies/co2_study_report.py DIR [DIR ...] [--at 60,120,240] [--reference zero1] [--lone lone]

Every ``NAME.json`` in the folders is one run; runs named ``NAME.s<seed>`` are grouped into one
row (mean and range over seeds). Reports, per row, the validation loss of the committed
parameters at the requested updates, the gap to the reference (ZeRO-1) at the last update,
whether the loss decreased at every evaluation, and how often it was worse than the lone
replica at the same evaluation (same seed).
"""
import argparse
import glob
import json
import os
import re
from collections import defaultdict


def load(dirs):
    """``NAME.json`` results, and for a run still going (or stopped) the evaluations its
    ``NAME.log`` has printed so far (marked partial)."""
    runs = {}
    for d in dirs:
        for path in sorted(glob.glob(os.path.join(d, "*.json"))):
            with open(path) as f:
                runs[os.path.splitext(os.path.basename(path))[0]] = json.load(f)
        for path in sorted(glob.glob(os.path.join(d, "*.log"))):
            name = os.path.splitext(os.path.basename(path))[0]
            if name in runs:
                continue
            evals = {}
            with open(path) as f:
                for line in f:
                    m = re.match(r"eval @(\d+): (.*)  \(", line)
                    if m:
                        evals[m.group(1)] = {k: float(v) for k, v in
                                             (item.split(" ") for item in m.group(2).split(", "))}
            seed = re.search(r"\.s(\d+)$", name)
            runs[name] = {"evals": evals, "partial": True, "args": {"seed": int(seed.group(1)) if seed else 0}}
    return runs


def split(name):
    m = re.match(r"(.*)\.s(\d+)$", name)
    return (m.group(1), int(m.group(2))) if m else (name, None)


def fmt(values):
    if not values:
        return "-"
    mean = sum(values) / len(values)
    if len(values) == 1:
        return f"{mean:.3f}"
    return f"{mean:.3f} [{min(values):.3f}, {max(values):.3f}]"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dirs", nargs="+")
    p.add_argument("--at", default="")
    p.add_argument("--reference", default="zero1")
    p.add_argument("--lone", default="lone")
    p.add_argument("--key", default="committed", help="committed, ybar or replica0")
    args = p.parse_args(argv)
    runs = load(args.dirs)
    groups = defaultdict(dict)
    for name, run in runs.items():
        base, seed = split(name)
        groups[base][seed if seed is not None else run["args"]["seed"]] = run
    full = [r for r in runs.values() if not r.get("partial")] or list(runs.values())
    updates = sorted({int(u) for r in full for u in r["evals"]})
    at = [int(u) for u in args.at.split(",")] if args.at else updates[1:]
    last = updates[-1]
    ref, lone = groups.get(args.reference, {}), groups.get(args.lone, {})
    header = ["run", "seeds"] + [f"@{u}" for u in at] + [f"vs {args.reference} @{last}", "decreasing at every eval",
                                                         "evals worse than lone"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for base in sorted(groups):
        seeds = groups[base]
        partial = [s for s, r in seeds.items() if r.get("partial")]
        cells = [base + (" (partial: up to update " + ",".join(
            str(max((int(u) for u in seeds[s]["evals"]), default=0)) for s in partial) + ")" if partial else ""),
                 ",".join(str(s) for s in sorted(seeds))]
        for u in at:
            cells.append(fmt([r["evals"][str(u)].get(args.key, r["evals"][str(u)]["committed"])
                              for r in seeds.values() if str(u) in r["evals"]]))
        gaps = [seeds[s]["evals"][str(last)]["committed"] / ref[s]["evals"][str(last)]["committed"] - 1
                for s in seeds if s in ref and str(last) in seeds[s]["evals"] and str(last) in ref[s]["evals"]]
        cells.append("-" if not gaps else (f"{100 * sum(gaps) / len(gaps):+.1f}%" + (
            f" [{100 * min(gaps):+.1f}, {100 * max(gaps):+.1f}]" if len(gaps) > 1 else "")))
        monotone = []
        worse = []
        for s, r in seeds.items():
            values = [r["evals"][str(u)]["committed"] for u in updates if str(u) in r["evals"]]
            monotone.append(all(b < a for a, b in zip(values, values[1:])))
            if s in lone:
                worse.append([u for u in updates[1:] if str(u) in r["evals"] and str(u) in lone[s]["evals"]
                              and r["evals"][str(u)]["committed"] > lone[s]["evals"][str(u)]["committed"]])
        cells.append(f"{sum(monotone)}/{len(monotone)}")
        cells.append("-" if not worse else "; ".join(
            f"{len(w)} of {len(updates) - 1}" + (f" ({','.join(map(str, w))})" if 0 < len(w) <= 4 else "")
            for w in worse))
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
