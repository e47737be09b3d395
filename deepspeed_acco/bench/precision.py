"""How fast the bench model computes in bf16 against fp32 on this machine.

``python -m deepspeed_acco.bench.precision`` times one training micro-batch (forward + backward)
of the bench's GPT-Neo preset with the model held in fp32 and in bf16 (what DeepSpeed's ``bf16``
section does: the module is cast to bf16, the optimizer keeps fp32 masters), one torch thread by
default like each bench rank. The two precisions alternate round by round so that a change in
machine load hits both alike, and the medians are printed, of wall-clock and of the process's CPU
time (which other processes on a shared machine inflate much less than wall-clock; they can
still slow it through shared caches and memory bandwidth). The bench's ``--precision`` default
(bf16) rests on this measurement; docs/bench.md records it.
"""
import argparse
import json
import statistics
import sys
import time


def time_micro_batches(preset: str, ctx: int, micro_batch: int, rounds: int, per_round: int, threads: int) -> dict:
    import torch

    from .models import build_model

    torch.set_num_threads(threads)
    models = {"fp32": build_model(preset, ctx, seed=0), "bf16": build_model(preset, ctx, seed=0).to(torch.bfloat16)}
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(1, 256, (micro_batch, ctx), generator=gen)

    def one(model):
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        model.zero_grad(set_to_none=True)

    for model in models.values():  # warm-up: first-call allocations and kernel selection
        one(model)
    times = {name: [] for name in models}
    cpu = {name: [] for name in models}
    for _ in range(rounds):
        for name, model in models.items():
            t, c = time.perf_counter(), time.process_time()
            for _ in range(per_round):
                one(model)
            times[name].append((time.perf_counter() - t) / per_round)
            cpu[name].append((time.process_time() - c) / per_round)
    wall = {name: 1000.0 * statistics.median(v) for name, v in times.items()}
    cpu_ms = {name: 1000.0 * statistics.median(v) for name, v in cpu.items()}
    return dict(preset=preset, ctx=ctx, micro_batch=micro_batch, threads=threads, rounds=rounds,
                fp32_ms=wall["fp32"], bf16_ms=wall["bf16"], bf16_speedup=wall["fp32"] / wall["bf16"],
                fp32_cpu_ms=cpu_ms["fp32"], bf16_cpu_ms=cpu_ms["bf16"],
                bf16_cpu_speedup=cpu_ms["fp32"] / cpu_ms["bf16"],
                fp32_all_ms=[1000.0 * t for t in times["fp32"]], bf16_all_ms=[1000.0 * t for t in times["bf16"]])


def main(argv=None) -> int:
    from .models import DEFAULT_PRESET, PRESETS
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_PRESET, choices=sorted(PRESETS))
    p.add_argument("--ctx", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--rounds", type=int, default=7, help="alternating rounds per precision (median reported)")
    p.add_argument("--per-round", type=int, default=3, help="micro-batches per round")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    args = p.parse_args(argv)
    res = time_micro_batches(args.model, args.ctx, args.micro_batch, args.rounds, args.per_round, args.threads)
    if args.json:
        print(json.dumps(res))
    else:
        print(f"GPT-Neo '{args.model}', micro-batch {args.micro_batch} x ctx {args.ctx}, {args.threads} thread(s), "
              f"forward + backward, medians of {args.rounds} rounds: wall fp32 {res['fp32_ms']:.0f} ms, bf16 "
              f"{res['bf16_ms']:.0f} ms (bf16 {res['bf16_speedup']:.2f}x the speed of fp32); CPU time fp32 "
              f"{res['fp32_cpu_ms']:.0f} ms, bf16 {res['bf16_cpu_ms']:.0f} ms ({res['bf16_cpu_speedup']:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
