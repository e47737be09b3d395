"""Validation loss by position in the window, for parameter vectors saved by the study tools.

A byte-level model with a long context can lower its loss late in a window by copying from
earlier in the same window (names, indentation, repeated code), which a short context cannot do.
This tool asks whether the long-run gaps between methods (docs/studies/acco_convergence.md) sit in that
part of the loss: for each saved vector (``benchmarks/studies/acco_study.py --save-final``) it prints the
mean next-byte cross-entropy over ``--windows`` held-out windows of the bench's corpus, overall
and per band of target positions, and the paired difference of every vector from the first one
with a standard error over windows.

    python benchmarks/studies/position_loss.py --ctx 256 zero1=z.pt acco=a.pt --windows 1000 --out pos.json
"""
import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
sys.path.insert(0, str(Path(__file__).resolve().parent))

from co2_study import copy_into  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("vectors", nargs="+", help="NAME=PATH of a saved fp32 parameter vector; the first is the reference")
    p.add_argument("--model", default="3m")
    p.add_argument("--ctx", type=int, default=256)
    p.add_argument("--seed", type=int, default=0, help="only builds the model's shape; the weights come from the file")
    p.add_argument("--windows", type=int, default=1000, help="evenly spaced held-out windows")
    p.add_argument("--bands", default="0,16,64,128", help="first target position of each band")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    for item in args.vectors:
        if "=" not in item:
            p.error(f"vector {item!r}: write NAME=PATH")
    args.bands = sorted({int(b) for b in args.bands.split(",")})
    if args.bands[0] != 0 or args.bands[-1] >= args.ctx - 1:
        p.error(f"--bands must start at 0 and stay below ctx - 1 = {args.ctx - 1}")
    return args


def per_window_position_loss(model, windows, batch: int):
    """Cross-entropy of every predicted byte: [windows, ctx - 1] (position j predicts byte j + 1)."""
    import torch
    import torch.nn.functional as F
    model.eval()
    rows = []
    with torch.no_grad():
        for i in range(0, len(windows), batch):
            x = torch.from_numpy(windows[i:i + batch])
            logits = model(input_ids=x).logits[:, :-1].float()
            rows.append(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                                        reduction="none").view(len(x), -1))
    return torch.cat(rows)


def mean_and_se(values):
    """Mean of a 1-d tensor and its standard error (float64)."""
    values = values.double()
    n = len(values)
    se = float(values.std()) / math.sqrt(n) if n > 1 else 0.0
    return float(values.mean()), se


def main(argv=None):
    args = parse_args(argv)
    import torch
    from deepspeed_acco.bench.workload.data import load_corpus, validation_windows
    from deepspeed_acco.bench.workload.models import build_model
    torch.set_num_threads(args.threads)
    corpus = load_corpus(None)
    windows = validation_windows(corpus.val, args.ctx, args.windows)
    model = build_model(args.model, args.ctx, args.seed)
    params = list(model.parameters())
    edges = args.bands + [args.ctx - 1]
    names = [f"{lo}-{hi - 1}" for lo, hi in zip(edges[:-1], edges[1:])]
    losses = {}
    for item in args.vectors:
        name, path = item.split("=", 1)
        copy_into(torch.load(path), params)
        losses[name] = per_window_position_loss(model, windows, args.batch)
    reference = args.vectors[0].split("=", 1)[0]
    result = dict(args=vars(args), windows=len(windows), bands=names, runs={})
    header = f"{'run':>12} | {'all':>14} | " + " | ".join(f"{n:>14}" for n in names)
    print(f"{len(windows)} windows of {args.ctx} bytes; loss (nats/byte), and for the others the relative "
          f"gap to {reference} +- one standard error over windows")
    print(header)
    for name, loss in losses.items():
        row = {}
        cells = []
        for band, (lo, hi) in [("all", (0, args.ctx - 1))] + list(zip(names, zip(edges[:-1], edges[1:]))):
            per_window = loss[:, lo:hi].mean(dim=1)
            mean, se = mean_and_se(per_window)
            entry = dict(loss=mean, se=se)
            if name != reference:
                ref = losses[reference][:, lo:hi].mean(dim=1)
                gap, gap_se = mean_and_se(per_window - ref)
                base = float(ref.mean())
                entry.update(gap=gap / base, gap_se=gap_se / base)
                cells.append(f"{100 * gap / base:+6.2f}% +-{100 * gap_se / base:4.2f}")
            else:
                cells.append(f"{mean:14.4f}")
            row[band] = entry
        result["runs"][name] = row
        print(f"{name:>12} | " + " | ".join(f"{c:>14}" for c in cells))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
