"""Study (b) of benchmarks/gpu_study.sh: ACCO's loss against ZeRO-1's at the paper's model size
(docs/gpu_study.md).

One process (world size 1: ACCO's rule is the same there, two half batches, the Peek estimate and
the commit) trains the bench's GPT-Neo (125M on CUDA) on real text (the Python standard library's
sources, deepspeed_acco.bench.workload.data, or ``--data``) with ShardedAdamW (ZeRO-1's math) and ACCO at its
defaults, then CO2 at its defaults if time allows, from the same initial weights on the same
micro-batches in the same order. The schedule follows the ACCO paper's 125M runs scaled to the time
there is: AdamW with lr 6e-4, betas (0.9, 0.95), weight decay 0.1, gradient clipping 1.0, a linear
warm-up over the first 2% of the updates from a tenth of the peak, and a cosine decay back to a
tenth (DeepSpeed's ``WarmupCosineLR``, which gives the very first update lr 0). The committed
parameters are evaluated on fixed held-out windows ``--eval-points`` times; the report gives the
curves and each method's gap to ShardedAdamW at the end.

Without ``--updates`` the run takes as many updates as fit ``--budget-s`` (at least
``--min-updates``): a few updates of the first method time an update and an evaluation, and the
updates are set so that the ``--required`` first methods fit; a later method runs only if the time
left holds it. The results file is rewritten at every evaluation, so a run stopped at its limit keeps
every curve up to there.

    python -m deepspeed_acco.bench.gpu_study.convergence --budget-s 150 --json convergence.json   # on a GPU
    python -m deepspeed_acco.bench.gpu_study.convergence --ctx 64 --updates 8 --eval-points 4      # CPU dry run
"""
import argparse
import sys
import time

from ..workload.methods import MIN_LR_FRACTION
from .common import (Clock, add_common_arguments, build_engine, describe_device, kernel_backend, method_label,
                     release, setup, synchronize, write_json)

METHOD_ORDER = ("sharded", "acco", "co2")
BASELINE = "sharded"
# The ACCO paper's 125M pre-training hyper-parameters (its reference code's configuration), those the
# bench's configs do not already share: peak lr and the warm-up's share of the run.
PAPER_LR = 6e-4
PAPER_WARMUP_FRACTION = 0.02
COSINE_FLOOR = MIN_LR_FRACTION  # the bench's schedules start from and end at lr / 10


def cosine_schedule(updates: int, warmup_fraction: float, min_warmup: int) -> dict:
    """DeepSpeed's ``WarmupCosineLR`` section for a run of ``updates`` (from and down to lr / 10, as the
    bench's schedules)."""
    warmup = max(int(min_warmup), int(round(warmup_fraction * updates)))
    if warmup >= updates:
        raise ValueError(f"--updates {updates}: the warm-up alone takes {warmup} updates; run longer or lower "
                         f"--min-warmup")
    return {"type": "WarmupCosineLR", "params": {"total_num_steps": int(updates), "warmup_num_steps": warmup,
                                                 "warmup_min_ratio": COSINE_FLOOR, "cos_min_ratio": COSINE_FLOOR,
                                                 "warmup_type": "linear"}}


def eval_updates(updates: int, points: int) -> list:
    """The updates after which the committed parameters are evaluated: 0, then ``points`` evenly spaced
    ones ending at ``updates``."""
    points = max(1, min(int(points), int(updates)))
    return sorted({0, *(round(updates * k / points) for k in range(1, points + 1))})


def choose_updates(budget_s: float, required: int, ms_per_update: float, build_s: float, eval_s: float,
                   eval_points: int, minimum: int, maximum: int) -> int:
    """The most updates for which ``required`` runs (each: a build, its evaluations and its updates)
    fit ``budget_s``, within [``minimum``, ``maximum``]."""
    per_run_s = budget_s / max(1, required) - build_s - (eval_points + 1) * eval_s
    fitting = int(per_run_s * 1e3 / ms_per_update) if per_run_s > 0 else 0
    return max(int(minimum), min(int(maximum), fitting))


def gap(final: float, baseline: float) -> dict:
    return {"nats": final - baseline, "relative": final / baseline - 1.0}


# ----------------------------------------------------------------------------------------------


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_arguments(parser)
    parser.add_argument("--grad-accum", type=int, default=2, help="micro-batches per update (ACCO: half per round)")
    parser.add_argument("--methods", default=",".join(METHOD_ORDER),
                        help=f"in order of value, a subset of {','.join(METHOD_ORDER)} starting with {BASELINE}")
    parser.add_argument("--required", type=int, default=2,
                        help="the first N methods always run; later ones only if the time left holds them")
    parser.add_argument("--updates", type=int, default=None, help="updates per method (default: what --budget-s holds)")
    parser.add_argument("--budget-s", type=float, default=150.0,
                        help="seconds for the whole study, its imports included (without --updates)")
    parser.add_argument("--min-updates", type=int, default=1000)
    parser.add_argument("--max-updates", type=int, default=3000,
                        help="at most this many (3000 x 8,192 tokens is two passes over the standard library)")
    parser.add_argument("--probe-updates", type=int, default=8, help="updates timed to size the run")
    parser.add_argument("--lr", type=float, default=PAPER_LR)
    parser.add_argument("--warmup-fraction", type=float, default=PAPER_WARMUP_FRACTION)
    parser.add_argument("--min-warmup", type=int, default=2, help="the LR warm-up's least number of updates")
    parser.add_argument("--eval-points", type=int, default=20)
    parser.add_argument("--val-windows", type=int, default=64, help="held-out windows of --ctx tokens")
    parser.add_argument("--seed", type=int, default=0, help="data order (the initial weights are the bench's seed 0)")
    parser.add_argument("--data", default=None,
                        help="corpus (deepspeed_acco.bench.workload.data.load_corpus; default: stdlib)")
    parser.add_argument("--cache-dir", default="default", help="token cache folder ('' for none)")
    args = parser.parse_args(argv)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not args.methods or args.methods[0] != BASELINE or any(m not in METHOD_ORDER for m in args.methods):
        parser.error(f"--methods: {args.methods}; give a subset of {','.join(METHOD_ORDER)} starting with {BASELINE}")
    if args.grad_accum < 2 or args.grad_accum % 2:
        parser.error(f"--grad-accum {args.grad_accum}: ACCO splits each update in two halves; use an even number")
    if args.updates is not None and args.updates < 2:
        parser.error("--updates must be >= 2")
    return args


class Run:
    """One method's training: the engine, the data stream, and what it has measured so far."""

    def __init__(self, method: str, args, device, sampler, windows, updates: int):
        import torch
        self.torch, self.args, self.device, self.sampler, self.windows = torch, args, device, sampler, windows
        started = time.perf_counter()
        self.engine, config = build_engine(method, args, device, grad_accum=args.grad_accum, lr=args.lr,
                                           total_updates=updates, warmup=0,
                                           scheduler=cosine_schedule(updates, args.warmup_fraction, args.min_warmup))
        self.build_s = time.perf_counter() - started
        self.micro = 0
        self.loss_sum = torch.zeros((), device=device, dtype=torch.float32)
        self.micro_since_eval = 0
        self.result = {"method": method, "label": method_label(method), "kernels": kernel_backend(device),
                       "scheduler": config["scheduler"], "optimizer_params": config["optimizer"]["params"],
                       "warmup_sync_updates": getattr(getattr(self.engine, "schedule", None), "warmup_sync_updates",
                                                      None),
                       "build_s": self.build_s, "evals": []}

    def train(self, count: int) -> None:
        engine = self.engine
        target = engine.global_steps + count
        while engine.global_steps < target:
            x = self.torch.from_numpy(self.sampler.micro_batch_at(self.micro)).to(self.device, non_blocking=True)
            self.micro += 1
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
            self.loss_sum += loss.detach().float()
            self.micro_since_eval += 1

    def evaluate(self) -> float:
        """Mean next-byte loss (nats) of the committed parameters on the held-out windows."""
        engine, torch = self.engine, self.torch
        batch = max(1, 2 * self.args.micro_batch)
        with engine.committed_parameters(), torch.no_grad():
            engine.module.eval()
            total = torch.zeros((), device=self.device, dtype=torch.float64)
            for start in range(0, len(self.windows), batch):
                x = self.windows[start:start + batch]
                total += engine(input_ids=x, labels=x).loss.double() * len(x)
            engine.module.train()
        return float(total) / len(self.windows)

    def record(self, clock_s: float) -> dict:
        synchronize(self.device)
        started = time.perf_counter()
        val = self.evaluate()
        train = float(self.loss_sum) / self.micro_since_eval if self.micro_since_eval else None
        self.loss_sum.zero_()
        self.micro_since_eval = 0
        entry = {"update": int(self.engine.global_steps), "val_loss": val, "train_loss": train,
                 "train_s": clock_s, "eval_s": time.perf_counter() - started}
        self.result["evals"].append(entry)
        return entry


def probe(args, device, sampler, windows, log) -> dict:
    """Time an update and an evaluation of the first method (a throwaway engine of the same config)."""
    run = Run(args.methods[0], args, device, sampler, windows, updates=1000)
    try:
        run.train(2)
        synchronize(device)
        started = time.perf_counter()
        run.train(args.probe_updates)
        synchronize(device)
        ms = 1e3 * (time.perf_counter() - started) / args.probe_updates
        started = time.perf_counter()
        run.evaluate()
        eval_s = time.perf_counter() - started
    finally:
        release(run.engine, device)
    log(f"probe: {ms:.1f} ms/update, {eval_s:.2f} s per evaluation, {run.build_s:.1f} s to build an engine")
    return {"ms_per_update": ms, "eval_s": eval_s, "build_s": run.build_s}


def markdown(payload: dict) -> str:
    runs = [r for r in payload["methods"] if r["evals"]]
    if not runs:
        return ""
    base = next((r for r in runs if r["method"] == BASELINE), None)
    lines = [f"### Convergence at {payload['model']}: {payload['updates']} updates of "
             f"{payload['tokens_per_update']:,} tokens, validation loss (nats/byte)", "",
             "| update | " + " | ".join(r["label"] for r in runs) + " |",
             "|---:|" + "---:|" * len(runs)]
    for index, entry in enumerate(runs[0]["evals"]):
        cells = [f"{r['evals'][index]['val_loss']:.4f}" if index < len(r["evals"]) else "" for r in runs]
        lines.append(f"| {entry['update']} | " + " | ".join(cells) + " |")
    lines.append("")
    if base is not None:
        for r in runs:
            if r is base or "final_gap" not in r:
                continue
            g = r["final_gap"]
            lines.append(f"- {r['label']} at update {r['evals'][-1]['update']}: {r['evals'][-1]['val_loss']:.4f} "
                         f"against {base['evals'][-1]['val_loss']:.4f}, gap {g['nats']:+.4f} nats "
                         f"({g['relative']:+.2%})")
    for r in payload["methods"]:
        if r.get("skipped"):
            lines.append(f"- {r['label']}: not run ({r['skipped']})")
    return "\n".join(lines) + "\n"


def run(args) -> dict:
    import torch

    from ..workload.data import WindowSampler, load_corpus, validation_windows
    from ..workload.models import build_model, count_parameters
    clock = Clock()

    def log(text):
        print(f"[{clock():6.1f} s] {text}", flush=True)

    device = setup(args)
    corpus = load_corpus(args.data, cache_dir=args.cache_dir or None)
    sampler = WindowSampler(corpus.train, args.ctx, args.micro_batch, seed=args.seed, rank=0)
    windows = torch.from_numpy(validation_windows(corpus.val, args.ctx, args.val_windows)).to(device)
    n_params = count_parameters(build_model(args.model, args.ctx, seed=0))
    payload = {"device": describe_device(device), "model": args.model, "parameters": n_params,
               "corpus": corpus.describe(), "ctx": args.ctx, "micro_batch": args.micro_batch,
               "grad_accum": args.grad_accum, "tokens_per_update": args.micro_batch * args.grad_accum * args.ctx,
               "precision": args.precision, "precision_why": args.precision_why, "lr": args.lr,
               "val_windows": len(windows), "seed": args.seed, "methods": []}
    log(f"convergence study on {payload['device']}: {args.model} ({n_params / 1e6:.1f}M parameters), "
        f"{payload['tokens_per_update']:,} tokens per update, {args.precision}; {payload['corpus']}")
    updates = args.updates
    if updates is None:
        payload["probe"] = probe(args, device, sampler, windows, log)
        left_s = args.budget_s - clock()
        updates = choose_updates(left_s, min(args.required, len(args.methods)), payload["probe"]["ms_per_update"],
                                 payload["probe"]["build_s"], payload["probe"]["eval_s"], args.eval_points,
                                 args.min_updates, args.max_updates)
        per_run_s = (payload["probe"]["build_s"] + (args.eval_points + 1) * payload["probe"]["eval_s"]
                     + updates * payload["probe"]["ms_per_update"] / 1e3)
        log(f"{updates} updates per method (about {per_run_s:.0f} s each; {left_s:.0f} s of --budget-s left)")
    payload["updates"] = updates
    evals_at = eval_updates(updates, args.eval_points)
    for index, method in enumerate(args.methods):
        estimate_s = (payload["probe"]["build_s"] + len(evals_at) * payload["probe"]["eval_s"]
                      + updates * payload["probe"]["ms_per_update"] / 1e3) if "probe" in payload else 0.0
        if index >= args.required and args.updates is None and clock() + estimate_s > args.budget_s:
            payload["methods"].append({"method": method, "label": method_label(method), "evals": [],
                                       "skipped": f"needs about {estimate_s:.0f} s, {args.budget_s - clock():.0f} s "
                                                  f"of --budget-s left"})
            log(f"{method_label(method)}: not run, {payload['methods'][-1]['skipped']}")
            continue
        run_ = Run(method, args, device, sampler, windows, updates)
        payload["methods"].append(run_.result)
        try:
            trained_s, done = 0.0, 0
            for at in evals_at:
                synchronize(device)
                started = time.perf_counter()
                run_.train(at - done)
                synchronize(device)
                trained_s += time.perf_counter() - started
                done = at
                entry = run_.record(trained_s)
                write_json(args.json, payload)
                log(f"{run_.result['label']} update {entry['update']}: validation {entry['val_loss']:.4f}"
                    + ("" if entry["train_loss"] is None else f", train {entry['train_loss']:.4f}"))
            run_.result["ms_per_update"] = 1e3 * trained_s / updates
        finally:
            release(run_.engine, device)
        base = payload["methods"][0]
        if run_.result is not base and base["evals"]:
            run_.result["final_gap"] = gap(run_.result["evals"][-1]["val_loss"], base["evals"][-1]["val_loss"])
        write_json(args.json, payload)
    print("\n" + markdown(payload), flush=True)
    return payload


def main(argv=None) -> int:
    run(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
