"""Time per update of the bench's GPT-Neo at a compute-bound size: the engine against the floor and the baselines.

The end-to-end step of benchmarks/gpu_check.sh (docs/gpu_check.md). On the first GPU run (an H200,
2026-12-04) this script ran the 125m preset at micro-batches of 8 x 256 tokens, where the forward
and backward alone took 89.5 ms per update and as long with micro-batches of 32: the GPU waited for
Python, so its figures compared host overheads, not the engine. Now one invocation, for each
precision (bf16, what GPU users run, and fp32), runs in order:

* ``floor``: the forward and backward of the update's micro-batches, nothing else;
* ``torch``: a plain PyTorch loop (bf16 autocast, ``torch.optim.AdamW(fused=True)``, clipping);
* ``deepspeed``: DeepSpeed ZeRO-1 with its FusedAdam (CUDA; built by gpu_check.sh's build step);
* ``ShardedAdamW``, ``DPU``, ``ACCO``, ``CO2``: our engine, with the example's configs.

The micro-batch is chosen by measurement (``--micro-batch auto``): doubled from 8 until the floor
grows with it (doubling the micro-batch costs at least ``COMPUTE_BOUND_GROWTH`` times the time),
then doubled once more for margin, since the engines have more host work per micro-batch than the
floor; or given (``--micro-batch N``). Every method runs in this process, one after the other, with
memory checked back at its baseline: our engines after ``destroy()`` and ``del`` with the garbage
collector off (docs/design.md, 2, "Engine surface"; a failure is the script's exit status 1), the others after a
collection. Each reports ms/update (the median of ``--repeats`` timed runs of ``--updates`` updates
between two device synchronisations, after ``--warmup`` updates), tokens/s, model FLOPs utilisation
against the device's bf16 peak (6 N + 12 L T d FLOPs per token, PaLM's count, N without the position
table), and peak memory over the baseline. DPU, ACCO and CO2 run with ``warmup_sync_updates`` 0, so
the timed updates take the overlapped path. At world size 1 NCCL's collectives are local copies:
what differs between the methods is the pipeline's own cost on top of compute, and its memory.

    python benchmarks/e2e_step_time.py                          # CUDA if available, else CPU (tiny model)
    python benchmarks/e2e_step_time.py --micro-batch 64 --precisions bf16 --json /tmp/e2e.json
"""
import argparse
import contextlib
import gc
import json
import os
import socket
import statistics
import sys
import time
import weakref
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

OUR_TYPES = {"ShardedAdamW": "sharded.json", "DPU": "dpu.json", "ACCO": "acco.json", "CO2": "co2.json"}
METHODS = ["floor", "torch", "deepspeed", *OUR_TYPES]
# Doubling the micro-batch must cost at least this much more time for the floor to count as compute-bound.
COMPUTE_BOUND_GROWTH = 1.8
LARGEST_MICRO_BATCH = 1024
# fp32 runs at a quarter of the measured bf16 micro-batch: fp32 matmuls run at a small fraction of the
# bf16 rate (no tensor cores without TF32), so a quarter is at least as compute-bound, and its fp32
# activations take half the memory of the bf16 run's.
FP32_MICRO_BATCH_DIVISOR = 4
# Dense bf16 tensor throughput (no sparsity) from NVIDIA's data sheets, FLOP/s, by device-name fragment.
BF16_PEAK_FLOPS = {"H200": 989.4e12, "H100 SXM": 989.4e12, "H100 80GB HBM3": 989.4e12, "H100 PCIe": 756.5e12,
                   "A100": 312e12}
# Targets for the GPU runs at the compute-bound size (docs/gpu_check.md): ShardedAdamW and ACCO within
# 5% of the plain loop; ACCO's peak memory at most ZeRO-1's plus the 4 bytes/param of its kept half.
TIME_TARGET_RATIO = 1.05
ACCO_EXTRA_BYTES_PER_PARAM = 4


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def bf16_peak_flops(device_name: str, given_tflops: float):
    if given_tflops:
        return given_tflops * 1e12
    for fragment, flops in BF16_PEAK_FLOPS.items():
        if fragment in device_name:
            return flops
    return None  # unknown device: pass --peak-tflops for an MFU


def flops_per_token(model, ctx: int) -> float:
    config = model.config
    positions = model.transformer.wpe.weight.numel()
    matmul_params = sum(p.numel() for p in model.parameters()) - positions
    return 6 * matmul_params + 12 * config.num_layers * ctx * config.hidden_size


class Bench:
    """What every method shares: device, model preset, token batches, timing and memory bookkeeping."""

    def __init__(self, args):
        self.args = args
        self.device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        self.cuda = self.device.type == "cuda"
        self.device_name = torch.cuda.get_device_name(self.device) if self.cuda else "CPU"
        self.model_name = args.model or ("125m" if self.cuda else "tiny")
        self.accumulation = args.accumulation
        self.tokens = None

    def set_micro_batch(self, micro_batch: int) -> None:
        self.micro_batch = micro_batch
        generator = torch.Generator().manual_seed(0)
        batches = 2 * self.accumulation
        self.tokens = torch.randint(0, 256, (batches, micro_batch, self.args.ctx), generator=generator).to(self.device)

    def model(self):
        from deepspeed_acco.bench.workload.models import build_model
        return build_model(self.model_name, self.args.ctx, seed=0)

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def time_updates(self, run_update, updates: int, repeats: int, warmup: int) -> list:
        """ms per update of ``run_update()`` over ``repeats`` timed runs, after ``warmup`` updates."""
        for _ in range(warmup):
            run_update()
        samples = []
        for _ in range(repeats):
            self.synchronize()
            started = time.perf_counter()
            for _ in range(updates):
                run_update()
            self.synchronize()
            samples.append((time.perf_counter() - started) * 1e3 / updates)
        return samples

    def allocated(self) -> int:
        if not self.cuda:
            return 0
        torch.cuda.synchronize(self.device)
        clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear_workspaces is not None:  # cuBLAS keeps a workspace per stream for the process's life
            clear_workspaces()
        return torch.cuda.memory_allocated(self.device)

    def back_at(self, baseline: int, patience_s: float = 5.0) -> int:
        """Bytes still allocated over ``baseline``, after up to ``patience_s`` for torch's NCCL watchdog
        to release the tensors it keeps for completed collectives."""
        deadline = time.monotonic() + patience_s
        while True:
            left = self.allocated() - baseline
            if left <= 0 or time.monotonic() > deadline:
                return max(0, left)
            time.sleep(0.1)


# ---- the methods: each builds, times and drops what it built; returns (result, weak references) ---
def run_floor(bench: Bench, precision: str, updates: int, repeats: int, warmup: int):
    model = bench.model().to(bench.device, dtype=torch.bfloat16 if precision == "bf16" else torch.float32)
    batches = iter(range(1 << 62))

    def update():
        for _ in range(bench.accumulation):
            x = bench.tokens[next(batches) % len(bench.tokens)]
            model(input_ids=x, labels=x).loss.backward()
        model.zero_grad(set_to_none=True)

    samples = bench.time_updates(update, updates, repeats, warmup)
    return {"samples_ms": samples}, [weakref.ref(model)]


def run_torch_loop(bench: Bench, precision: str, updates: int, repeats: int, warmup: int):
    config = json.loads((REPO / "examples" / "configs" / "sharded.json").read_text())
    params = config["optimizer"]["params"]
    model = bench.model().to(bench.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=params["lr"], betas=params["betas"], eps=params["eps"],
                                  weight_decay=params["weight_decay"], fused=bench.cuda)
    autocast = torch.autocast(bench.device.type, dtype=torch.bfloat16) if precision == "bf16" \
        else contextlib.nullcontext()
    batches = iter(range(1 << 62))

    def update():
        for _ in range(bench.accumulation):
            x = bench.tokens[next(batches) % len(bench.tokens)]
            with autocast:
                loss = model(input_ids=x, labels=x).loss / bench.accumulation
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config["gradient_clipping"])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    samples = bench.time_updates(update, updates, repeats, warmup)
    return {"samples_ms": samples}, [weakref.ref(model), weakref.ref(optimizer)]


def deepspeed_arch_list_environment():
    """TORCH_CUDA_ARCH_LIST as DeepSpeed's own builders can read it (cuda_ops.deepspeed_arch_list)."""
    from deepspeed_acco.op_builder.cuda_ops import ARCH_LIST_ENV, deepspeed_arch_list
    listed = os.environ.get(ARCH_LIST_ENV)
    return {ARCH_LIST_ENV: deepspeed_arch_list(listed)} if listed else {}


@contextlib.contextmanager
def environment(values: dict):
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _micro_batch_loop(bench: Bench, engine):
    batches = iter(range(1 << 62))

    def update():
        for _ in range(bench.accumulation):
            x = bench.tokens[next(batches) % len(bench.tokens)]
            engine.backward(engine(input_ids=x, labels=x).loss)
            engine.step()
    return update


def _common_config(config: dict, bench: Bench, precision: str) -> dict:
    config["train_micro_batch_size_per_gpu"] = bench.micro_batch
    config["gradient_accumulation_steps"] = bench.accumulation
    config["steps_per_print"] = 10 ** 9
    config.pop("train_batch_size", None)
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def run_deepspeed(bench: Bench, precision: str, updates: int, repeats: int, warmup: int):
    import deepspeed
    config = _common_config(json.loads((REPO / "examples" / "configs" / "zero1.json").read_text()), bench, precision)
    config["optimizer"]["params"]["torch_adam"] = not bench.cuda  # CUDA: DeepSpeed's FusedAdam
    model = bench.model()
    with environment(deepspeed_arch_list_environment()):
        engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    samples = bench.time_updates(_micro_batch_loop(bench, engine), updates, repeats, warmup)
    references = [weakref.ref(engine), weakref.ref(model)]
    engine.destroy()
    kernels = type(getattr(optimizer, "optimizer", optimizer)).__name__
    return {"samples_ms": samples, "update_kernels": kernels}, references


def run_ours(kind: str):
    def run(bench: Bench, precision: str, updates: int, repeats: int, warmup: int):
        import deepspeed_acco
        from deepspeed_acco import ops
        config = json.loads((REPO / "examples" / "configs" / OUR_TYPES[kind]).read_text())
        config = _common_config(config, bench, precision)
        if kind != "ShardedAdamW":
            config["optimizer"]["params"]["warmup_sync_updates"] = 0
        model = bench.model()
        engine, *_ = deepspeed_acco.initialize(model=model, model_parameters=model.parameters(), config=config)
        samples = bench.time_updates(_micro_batch_loop(bench, engine), updates, repeats, warmup)
        result = {"samples_ms": samples, "update_kernels": ops.backend(engine.device),
                  "wait_ms_per_update": 1e3 * engine.communication_wait_s / max(1, engine.global_steps)}
        references = [weakref.ref(engine), weakref.ref(model), weakref.ref(engine.optimizer)]
        references += [weakref.ref(flat) for flat in engine.optimizer.flats]
        engine.destroy()
        return result, references
    return run


RUNNERS = {"floor": run_floor, "torch": run_torch_loop, "deepspeed": run_deepspeed,
           **{kind: run_ours(kind) for kind in OUR_TYPES}}


def measure(bench: Bench, method: str, precision: str, updates: int, repeats: int, warmup: int) -> dict:
    """Run one method with memory bookkeeping: peak over the baseline, and what is freed without gc."""
    gc.collect()
    if bench.cuda:
        torch.cuda.empty_cache()
    baseline = bench.allocated()
    if bench.cuda:
        torch.cuda.reset_peak_memory_stats(bench.device)
    gc.disable()
    try:
        result, references = RUNNERS[method](bench, precision, updates, repeats, warmup)
        peak = torch.cuda.max_memory_allocated(bench.device) - baseline if bench.cuda else None
        left_without_gc = bench.back_at(baseline)
        alive_without_gc = sum(reference() is not None for reference in references)
    finally:
        gc.enable()
    gc.collect()
    left_after_gc = bench.back_at(baseline)
    ms = statistics.median(result["samples_ms"])
    tokens_per_update = bench.micro_batch * bench.accumulation * bench.args.ctx
    result.update(method=method, precision=precision, micro_batch=bench.micro_batch, ms_per_update=ms,
                  tokens_per_s=tokens_per_update / ms * 1e3,
                  mfu=None if bench.peak_flops is None else bench.flops_per_token * tokens_per_update / (ms * 1e-3)
                  / bench.peak_flops,
                  peak_memory_bytes=peak, freed_without_gc=left_without_gc == 0 and alive_without_gc == 0,
                  alive_without_gc=alive_without_gc,
                  left_without_gc_bytes=left_without_gc, left_after_gc_bytes=left_after_gc)
    return result


def choose_micro_batch(bench: Bench) -> dict:
    """The micro-batch from which the bf16 floor is compute-bound, doubled once more (module docstring)."""
    micro_batch, history, chosen = 8, [], None
    while chosen is None:
        bench.set_micro_batch(micro_batch)
        try:
            ms = statistics.median(measure(bench, "floor", "bf16", 2, 3, 1)["samples_ms"])
        except torch.cuda.OutOfMemoryError:
            gc.collect()
            torch.cuda.empty_cache()
            history.append({"micro_batch": micro_batch, "ms_per_update": None, "out_of_memory": True})
            chosen = max(8, micro_batch // 2)  # the largest that fitted
            break
        history.append({"micro_batch": micro_batch, "ms_per_update": ms})
        print(f"# floor at micro-batch {micro_batch}: {ms:.1f} ms/update", flush=True)
        if len(history) >= 2 and ms >= COMPUTE_BOUND_GROWTH * history[-2]["ms_per_update"]:
            chosen = min(2 * micro_batch, LARGEST_MICRO_BATCH)
        elif micro_batch >= LARGEST_MICRO_BATCH:
            chosen = micro_batch
        micro_batch *= 2
    return {"chosen": chosen, "floor_by_micro_batch": history, "growth_required": COMPUTE_BOUND_GROWTH}


def targets(results: list, num_params: int) -> list:
    """The next GPU run's targets (module constants), bf16, where the methods they compare ran."""
    by = {r["method"]: r for r in results if r["precision"] == "bf16" and "error" not in r}
    found = []
    if "torch" in by:
        for kind in ("ShardedAdamW", "ACCO"):
            if kind in by:
                ratio = by[kind]["ms_per_update"] / by["torch"]["ms_per_update"]
                found.append({"target": f"{kind} ms/update within {TIME_TARGET_RATIO - 1:.0%} of the plain loop",
                              "value": f"{ratio:.3f}x", "met": ratio <= TIME_TARGET_RATIO})
    if {"ACCO", "deepspeed"} <= by.keys() and by["ACCO"]["peak_memory_bytes"] is not None:
        extra = (by["ACCO"]["peak_memory_bytes"] - by["deepspeed"]["peak_memory_bytes"]) / num_params
        found.append({"target": f"ACCO peak memory at most ZeRO-1's + {ACCO_EXTRA_BYTES_PER_PARAM} bytes/param",
                      "value": f"{extra:+.2f} bytes/param", "met": extra <= ACCO_EXTRA_BYTES_PER_PARAM})
    return found


def _mib(value):
    return "-" if value is None else f"{value / 2**20:.0f}"


def report(bench: Bench, results: list, found: list) -> None:
    print("\n| method | precision | micro-batch | ms/update | tokens/s | MFU | peak memory over baseline (MiB) | "
          "freed by destroy/del without gc |\n|---|---|---:|---:|---:|---:|---:|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['method']} | {r['precision']} | | failed: {r['error'][:80]} | | | | |")
            continue
        mfu = "-" if r["mfu"] is None else f"{r['mfu']:.1%}"
        freed = "yes" if r["freed_without_gc"] else \
            f"no ({r['alive_without_gc']} objects alive, {_mib(r['left_without_gc_bytes'])} MiB left)"
        print(f"| {r['method']} | {r['precision']} | {r['micro_batch']} | {r['ms_per_update']:.1f} | "
              f"{r['tokens_per_s']:.0f} | {mfu} | "
              f"{_mib(r['peak_memory_bytes'])} | {freed} |")
    print("\n### targets (bf16, at the micro-batch above)")
    for target in found:
        print(f"- {'MET   ' if target['met'] else 'MISSED'} {target['target']}: {target['value']}")
    print(f"targets met: {sum(t['met'] for t in found)}/{len(found)}", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="bench model preset (default: 125m on CUDA, tiny on CPU)")
    parser.add_argument("--ctx", type=int, default=256)
    parser.add_argument("--micro-batch", default="auto", help="'auto' (measured, module docstring) or a number")
    parser.add_argument("--accumulation", type=int, default=2, help="micro-batches per update (even, for ACCO)")
    parser.add_argument("--precisions", default="bf16,fp32", help="comma-separated subset of bf16,fp32")
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of " + ",".join(METHODS))
    parser.add_argument("--warmup", type=int, default=2, help="updates before timing (kernels loaded, caches warm)")
    parser.add_argument("--updates", type=int, default=4, help="updates per timed repeat")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--peak-tflops", type=float, default=0.0, help="the device's dense bf16 peak, if not known")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        parser.error(f"--methods: unknown {unknown}; choose from {METHODS}")
    precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    if not precisions or set(precisions) - {"bf16", "fp32"}:
        parser.error(f"--precisions: {args.precisions!r}; give bf16, fp32 or both, comma-separated")

    # One rank, as a launcher would start it: DeepSpeed's initialize needs the variables (without them it
    # looks for MPI), and our engines then join the same default group.
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(name, value)
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    # What our engine sets at initialize, set before DeepSpeed's run makes the process's first NCCL call
    # (NCCL reads it once): otherwise our engines would find a communicator and share one side stream.
    os.environ.setdefault("NCCL_LAUNCH_ORDER_IMPLICIT", "1")
    bench = Bench(args)
    bench.peak_flops = bf16_peak_flops(bench.device_name, args.peak_tflops)
    probe = bench.model()
    bench.flops_per_token = flops_per_token(probe, args.ctx)
    num_params = sum(p.numel() for p in probe.parameters())
    del probe
    if args.micro_batch == "auto" and bench.cuda:
        choice = choose_micro_batch(bench)
    else:
        choice = {"chosen": 4 if args.micro_batch == "auto" else int(args.micro_batch), "given": True}
    measured = "given" not in choice
    micro_batches = {"bf16": choice["chosen"],
                     "fp32": max(1, choice["chosen"] // FP32_MICRO_BATCH_DIVISOR) if measured else choice["chosen"]}
    choice["by_precision"] = micro_batches
    from deepspeed_acco import ops
    kernels = ops.backend(bench.device)
    print(f"# end-to-end: model {bench.model_name} ({num_params:,} parameters, ctx {args.ctx}), micro-batches "
          f"{micro_batches} x {args.accumulation} per update ({'measured' if measured else 'given'}), "
          f"world size 1 on {bench.device_name}, torch {torch.__version__}; update kernels of our engine: {kernels}; "
          f"bf16 peak {'unknown' if bench.peak_flops is None else f'{bench.peak_flops / 1e12:.0f} TFLOP/s'}",
          flush=True)
    results = []

    def write_json(found=None):  # after every method, so that a run stopped at its time cap keeps what ran
        if args.json:
            args.json.write_text(json.dumps({"device": bench.device_name, "model": bench.model_name,
                                             "parameters": num_params, "ctx": args.ctx, "micro_batch": choice,
                                             "accumulation": args.accumulation, "update_kernels": kernels,
                                             "results": results, "targets": found}, indent=2))

    for precision in precisions:
        bench.set_micro_batch(micro_batches[precision])
        for method in methods:
            try:
                result = measure(bench, method, precision, args.updates, args.repeats, args.warmup)
            except Exception as error:  # one method failing leaves the others' figures
                result = {"method": method, "precision": precision, "error": f"{type(error).__name__}: {error}"}
                print(f"{method:>12} {precision}: FAILED {result['error']}", flush=True)
            else:
                print(f"{method:>12} {precision}: {result['ms_per_update']:8.1f} ms/update "
                      f"(repeats {', '.join(f'{s:.1f}' for s in result['samples_ms'])}), "
                      f"peak {_mib(result['peak_memory_bytes'])} MiB, freed without gc: {result['freed_without_gc']}",
                      flush=True)
            results.append(result)
            write_json()
    found = targets(results, num_params)
    report(bench, results, found)
    write_json(found)
    failed = [r["method"] + "/" + r["precision"] for r in results if "error" in r]
    # Our engines must be freed by destroy() and del alone; what another method leaves behind even after a
    # collection only raises the next baseline (peaks are taken over each method's own), so it is reported.
    leaked = [r["method"] + "/" + r["precision"] for r in results
              if "error" not in r and r["method"] in OUR_TYPES and not r["freed_without_gc"]]
    kept = [f"{r['method']}/{r['precision']} {_mib(r['left_after_gc_bytes'])} MiB" for r in results
            if "error" not in r and r["method"] not in OUR_TYPES and r["left_after_gc_bytes"]]
    if kept:
        print(f"note: still allocated after a collection (the next baseline includes it): {kept}", flush=True)
    if failed or leaked:
        print(f"e2e FAILED: methods that failed {failed}; memory not back at its baseline {leaked}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
