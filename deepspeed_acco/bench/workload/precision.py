"""How fast the bench model computes in bf16 against fp32 on this machine.

``python -m deepspeed_acco.bench.workload.precision`` times one training micro-batch (forward + backward)
of the bench's GPT-Neo preset with the model held in fp32 and in bf16 (what DeepSpeed's ``bf16``
section does: the module is cast to bf16, the optimizer keeps fp32 masters), one torch thread by
default like each bench rank. The two precisions alternate round by round so that a change in
machine load hits both alike, and the medians are printed, of wall-clock and of the process's CPU
time (which other processes on a shared machine inflate much less than wall-clock; they can
still slow it through shared caches and memory bandwidth). docs/bench.md records it.

:func:`choose_precision` is the bench's ``--precision auto`` (the default): bf16 where the device
computes bf16 natively (a CUDA device with bf16; a CPU with AVX512-BF16 or AMX, detected from the
CPU's flags and oneDNN), else fp32, because a CPU without them emulates bf16 matmuls at a small
fraction of fp32's speed (about 40x slower on an AVX2-only AMD EPYC).
"""
import argparse
import json
import statistics
import sys
import time


NATIVE_BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_flags(path: str = "/proc/cpuinfo") -> set:
    """The CPU's feature flags (Linux ``/proc/cpuinfo``; empty where it cannot be read)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _onednn_bf16() -> bool:
    """Whether torch's oneDNN says this CPU runs bf16 natively (False where torch cannot tell)."""
    try:
        import torch
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except Exception:  # noqa: BLE001 - an older or differently built torch: rely on the flags
        return False


def _cuda_bf16() -> bool:
    try:
        import torch
        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    except Exception:  # noqa: BLE001
        return False


def choose_precision(requested: str = "auto", *, cuda_available=None, cuda_bf16=_cuda_bf16, flags=cpu_flags,
                     onednn_bf16=_onednn_bf16):
    """``(precision, why)`` for ``--precision`` ``requested`` (auto, bf16 or fp32); ``why`` is the
    sentence the report's header gives. The detectors are parameters so that tests can mock them."""
    if requested in ("bf16", "fp32"):
        return requested, f"{requested}: given with --precision"
    if requested != "auto":
        raise ValueError(f"--precision: expected auto, bf16 or fp32, got {requested!r}")
    if cuda_available is None:
        try:
            import torch
            cuda_available = torch.cuda.is_available()
        except Exception:  # noqa: BLE001
            cuda_available = False
    if cuda_available:
        if cuda_bf16():
            return "bf16", "bf16 (auto): the CUDA device computes bf16 natively"
        return "fp32", "fp32 (auto): this CUDA device has no native bf16"
    known = flags()
    native = [f for f in NATIVE_BF16_CPU_FLAGS if f in known]
    if native:
        return "bf16", f"bf16 (auto): the CPU has {' and '.join(native)}"
    # oneDNN's own check also accepts AVX-512 without BF16 (emulated); it decides only where the
    # CPU's flags cannot be read.
    if not known and onednn_bf16():
        return "bf16", "bf16 (auto): oneDNN reports bf16 support on this CPU (its flags could not be read)"
    return "fp32", ("fp32 (auto): this CPU has no native bf16 (no avx512_bf16 or amx_bf16; a bf16 matmul would run "
                    "about 40x slower than fp32); --precision bf16 forces it")


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
