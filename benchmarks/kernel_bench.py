"""Benchmark of the fused update kernels against torch, DeepSpeed and a plain copy, side by side.

For each flat-shard size, times (median ms per call over interleaved rounds) and reports the
effective bandwidth (nominal bytes moved / time) of:

* ``copy``: ``dst.copy_(src)`` in fp32, the bandwidth roofline measured in the same run;
* deepspeed-acco's ``adamw_step`` (alone, with a bf16 output) and ``adamw_peek`` (fp32, bf16 out),
  and both as the engine's jobs call them (device-side control tensor, bf16 out);
* ``torch.optim.AdamW`` fused and foreach, and fused followed by a separate bf16 cast-copy;
* DeepSpeed's ``DeepSpeedCPUAdam`` (CPU only);
* the ACCO reference's estimate: clone parameters and moments, step, copy out, restore
  (with fresh clones as it does, and with preallocated backups);

and the block-quantisation kernels of compressed communication (block 128; docs/kernels.md):

* ``quantize`` with error feedback into the send buffer, int8 and int4 (read the input and the
  residual, write the residual, the codes and the scales: 12 + 1 + 4/128 bytes per value for
  int8, 12 + 0.5 + 4/128 for int4), and ``quantize_delta`` (fp32 target, bf16 held copy);
* ``dequantize_sum``, the owner's side of the reduce-scatter: its own fp32 chunk plus the packed
  chunks of 1 or 3 peers (4 + k * (1 + 4/128) + 4 bytes per value for int8);
* ``apply_delta`` to a bf16 held copy, in place;

then checks the kernels' targets (docs/kernels.md). Nominal bytes per parameter:
AdamW 28 (read theta, g, m, v; write theta, m, v), +2 or +4 for a bf16/fp32 output, Peek 16 + the
output, copy 8. An estimate is credited with Peek's bytes, since it produces the same result.

    python benchmarks/kernel_bench.py                       # CPU, 1M / 8M / 32M parameters
    python benchmarks/kernel_bench.py --only quant          # only the copy and the quantisation kernels
    python benchmarks/kernel_bench.py --device cuda --sizes 128M,256M --strict
"""
import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
GPU_COPY_FRACTION_TARGET = 0.85
QUANT_BLOCK = 128
# docs/kernels.md, "Compressed communication": quantise + send-buffer packing (and the owner's
# dequantise-sum) at >= 80% of the copy roofline on CPU.
CPU_QUANT_COPY_FRACTION_TARGET = 0.80
QUANT_TARGET_CASES = ("quantize + pack, error feedback (int8)", "quantize + pack, error feedback (int4)",
                      "dequantize_sum: own + 1 peer (int8)")


def parse_size(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text[:-1] if text[-1:] in "KMG" else text) * scale)


class Timer:
    """Per-call wall time on CPU, CUDA events on GPU; samples kept for a median across rounds."""

    def __init__(self, device: str):
        self.cuda = device == "cuda"

    def sample_ms(self, fn, iters: int):
        samples = []
        for _ in range(iters):
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                samples.append((time.perf_counter() - t0) * 1e3)
        return samples


def copy_case(numel: int, device: str):
    src, dst = torch.randn(numel, device=device), torch.empty(numel, device=device)
    return {"copy (fp32, roofline)": (lambda: dst.copy_(src), 8)}


def quantization_cases(numel: int, device: str):
    """name -> (callable, nominal bytes per value) for the compressed-communication kernels."""
    from deepspeed_acco import ops

    gen = torch.Generator(device=device).manual_seed(0)
    values = torch.randn(numel, generator=gen, device=device)
    residual = torch.zeros(numel, device=device)
    scale_bytes = 4 / QUANT_BLOCK
    packed = {bits: torch.empty(1, ops.packed_bytes(numel, bits=bits, block_size=QUANT_BLOCK), dtype=torch.uint8,
                                device=device) for bits in (8, 4)}
    cases = {}
    for bits in (8, 4):
        cases[f"quantize + pack, error feedback (int{bits})"] = (
            lambda bits=bits: ops.quantize(values, packed[bits], residual=residual, bits=bits, block_size=QUANT_BLOCK),
            12 + bits / 8 + scale_bytes)
    held = (values + 1e-3).to(torch.bfloat16)
    cases["quantize_delta, bf16 held (int8)"] = (
        lambda: ops.quantize_delta(values, held, packed[8], bits=8, block_size=QUANT_BLOCK), 4 + 2 + 1 + scale_bytes)
    out = torch.empty(numel, device=device)
    for bits, peers in ((8, 1), (8, 3), (4, 1)):
        ops.quantize(values, packed[bits], bits=bits, block_size=QUANT_BLOCK)
        received = packed[bits].expand(peers, -1).contiguous()  # what the peers sent
        cases[f"dequantize_sum: own + {peers} peer{'s' if peers > 1 else ''} (int{bits})"] = (
            lambda received=received, bits=bits: ops.dequantize_sum(received, out, base=values, bits=bits,
                                                                     block_size=QUANT_BLOCK),
            8 + peers * (bits / 8 + scale_bytes))
    delta = torch.empty(1, ops.packed_bytes(numel, bits=8, block_size=QUANT_BLOCK), dtype=torch.uint8, device=device)
    ops.quantize_delta(values, held, delta, bits=8, block_size=QUANT_BLOCK)
    applied = held.clone()
    # Applying the same delta over and over keeps the values (and the timing) realistic enough.
    cases["apply_delta, bf16 held in place (int8)"] = (
        lambda: ops.apply_delta(delta, applied, bits=8, block_size=QUANT_BLOCK), 2 + 1 + scale_bytes + 2)
    return cases


def make_cases(numel: int, device: str, only: str = "all"):
    """name -> (callable, nominal bytes per parameter). Every case owns its tensors."""
    cases = copy_case(numel, device)
    if only in ("all", "update"):
        cases.update(update_cases(numel, device))
    if only in ("all", "quant"):
        cases.update(quantization_cases(numel, device))
    return cases


def update_cases(numel: int, device: str):
    """name -> (callable, nominal bytes per parameter) for the fused update rules and their rivals."""
    from deepspeed_acco import ops

    def state():
        gen = torch.Generator(device=device).manual_seed(0)
        param = torch.randn(numel, generator=gen, device=device)
        grad = torch.randn(numel, generator=gen, device=device) * 1e-2
        return param, grad, torch.zeros(numel, device=device), torch.zeros(numel, device=device)

    cases = {}
    p, g, m, v = state()
    step_counter = {"adamw_step": 0}

    def acco_step(out=None):
        step_counter["adamw_step"] += 1
        ops.adamw_step(p, g, m, v, step=step_counter["adamw_step"], out=out, **HYPER)

    out_bf16 = torch.empty(numel, dtype=torch.bfloat16, device=device)
    out_f32 = torch.empty(numel, device=device)
    cases["acco adamw_step"] = (acco_step, 28)
    cases["acco adamw_step + bf16 out"] = (lambda: acco_step(out_bf16), 30)
    cases["acco adamw_peek (fp32 out)"] = (
        lambda: ops.adamw_peek(p, g, m, v, step=10, out=out_f32, **HYPER), 20)
    cases["acco adamw_peek (bf16 out)"] = (
        lambda: ops.adamw_peek(p, g, m, v, step=10, out=out_bf16, **HYPER), 18)
    # What the engine's jobs call: the gradient multiplier and skip flag in a device-side control
    # tensor (read by every thread, never by the host).
    control = ops.make_control(torch.tensor(0.5, device=device), torch.tensor(False, device=device))

    def acco_step_controlled(out=None):
        step_counter["adamw_step"] += 1
        ops.adamw_step(p, g, m, v, step=step_counter["adamw_step"], out=out, control=control, **HYPER)

    cases["acco adamw_step (control) + bf16 out"] = (lambda: acco_step_controlled(out_bf16), 30)
    cases["acco adamw_peek (control, bf16 out)"] = (
        lambda: ops.adamw_peek(p, g, m, v, step=10, out=out_bf16, control=control, **HYPER), 18)

    def torch_adamw(**kwargs):
        param, grad, _, _ = state()
        param = torch.nn.Parameter(param)
        param.grad = grad
        opt = torch.optim.AdamW([param], lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
                                weight_decay=HYPER["weight_decay"], **kwargs)
        return param, opt

    fused_param, fused_opt = torch_adamw(fused=True)
    cases["torch AdamW fused"] = (fused_opt.step, 28)
    foreach_param, foreach_opt = torch_adamw(foreach=True)
    cases["torch AdamW foreach"] = (foreach_opt.step, 28)
    cast_param, cast_opt = torch_adamw(fused=True)
    cast_out = torch.empty(numel, dtype=torch.bfloat16, device=device)

    def fused_then_cast():
        cast_opt.step()
        cast_out.copy_(cast_param.detach())

    cases["torch AdamW fused + bf16 cast-copy"] = (fused_then_cast, 30)

    if device == "cpu":
        cases["DeepSpeedCPUAdam"] = deepspeed_cpu_adam_case(state)

    # The ACCO reference's estimate: save theta, m, v, take a real step, read theta, restore.
    est_param, est_opt = torch_adamw(fused=True)
    est_opt.step()  # creates the moments
    est_state = est_opt.state[est_param]
    est_out = torch.empty(numel, device=device)

    def clone_step_restore():
        saved = [est_param.detach().clone(), est_state["exp_avg"].clone(), est_state["exp_avg_sq"].clone()]
        step_before = est_state["step"].clone()
        est_opt.step()
        est_out.copy_(est_param.detach())
        for live, copy in zip((est_param.detach(), est_state["exp_avg"], est_state["exp_avg_sq"]), saved):
            live.copy_(copy)
        est_state["step"].copy_(step_before)

    backups = [torch.empty(numel, device=device) for _ in range(3)]

    def backup_step_restore():
        lives = (est_param.detach(), est_state["exp_avg"], est_state["exp_avg_sq"])
        for backup, live in zip(backups, lives):
            backup.copy_(live)
        step_before = est_state["step"].clone()
        est_opt.step()
        est_out.copy_(est_param.detach())
        for live, backup in zip(lives, backups):
            live.copy_(backup)
        est_state["step"].copy_(step_before)

    cases["estimate: clone/step/restore"] = (clone_step_restore, 20)
    cases["estimate: preallocated backup/step/restore"] = (backup_step_restore, 20)
    return cases


def deepspeed_cpu_adam_case(state):
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        param, grad, _, _ = state()
        param = torch.nn.Parameter(param)
        param.grad = grad
        opt = DeepSpeedCPUAdam([param], lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
                               weight_decay=HYPER["weight_decay"], adamw_mode=True)
        opt.step()
        return (opt.step, 28)
    except Exception as err:  # reported in the table rather than aborting the whole run
        return (None, f"unavailable: {type(err).__name__}: {str(err).splitlines()[0][:120]}")


def run_size(numel: int, device: str, rounds: int, min_iters: int, min_time_s: float, only: str = "all"):
    cases = make_cases(numel, device, only)
    timer = Timer(device)
    samples = {name: [] for name in cases}
    runnable = {name: fn for name, (fn, _) in cases.items() if fn is not None}
    for fn in runnable.values():  # warm-up: allocator, page faults, lazy state
        timer.sample_ms(fn, 2)
    for _ in range(rounds):  # interleaved, so drift on a shared machine hits every case alike
        for name, fn in runnable.items():
            first = timer.sample_ms(fn, 1)[0]
            iters = max(min_iters, int(min_time_s * 1e3 / max(first, 1e-3)))
            samples[name] += [first] + timer.sample_ms(fn, iters - 1)
    results = {}
    for name, (fn, nominal) in cases.items():
        if fn is None:
            results[name] = {"error": nominal}
            continue
        ms = statistics.median(samples[name])
        results[name] = {"ms": ms, "min_ms": min(samples[name]), "calls": len(samples[name]),
                         "bytes_per_param": nominal, "gb_s": nominal * numel / (ms * 1e-3) / 1e9}
    del cases
    if device == "cuda":
        torch.cuda.empty_cache()
    return results


def check_targets(results_by_size, device: str):
    """[(target, size label, measured on medians, measured on minima, met on medians)]."""
    checks = []
    for label, results in results_by_size.items():
        if device == "cpu":
            checks += _cpu_targets(label, results)
        else:
            checks += _gpu_targets(label, results)
    return checks


def _cpu_targets(label, results):
    checks = _quant_targets(label, results, CPU_QUANT_COPY_FRACTION_TARGET)
    if "acco adamw_step" not in results:
        return checks
    return _cpu_update_targets(label, results) + checks


def _copy_fraction(results, name, key):
    """Effective bandwidth of ``name`` as a fraction of the copy's, from times ``key`` (ms or min_ms)."""
    copy = results["copy (fp32, roofline)"]
    return (copy[key] / copy["bytes_per_param"]) / (results[name][key] / results[name]["bytes_per_param"])


def _quant_targets(label, results, target):
    checks = []
    for name in QUANT_TARGET_CASES:
        if name not in results:
            continue
        on_median, on_min = _copy_fraction(results, name, "ms"), _copy_fraction(results, name, "min_ms")
        checks.append((f"{name} >= {target:.0%} of copy GB/s", label, f"{on_median:.1%}", f"{on_min:.1%}",
                       on_median >= target))
    return checks


def _cpu_update_targets(label, results):

    def evaluate(key):
        def t(name):
            return results[name].get(key)

        fastest_rival = min(t(n) for n in ("torch AdamW fused", "DeepSpeedCPUAdam") if t(n) is not None)
        estimate = min(t("estimate: clone/step/restore"), t("estimate: preallocated backup/step/restore"))
        return [
            (t("acco adamw_step") / fastest_rival, 1.0, "{:.3f}x the time"),
            (t("torch AdamW fused + bf16 cast-copy") / t("acco adamw_step + bf16 out"), 1.2, "{:.2f}x faster"),
            (estimate / t("acco adamw_peek (fp32 out)"), 4.0, "{:.2f}x faster"),
        ]

    names = ("adamw_step <= min(torch fused, DeepSpeedCPUAdam)", "step + bf16 out >= 1.2x torch fused + cast-copy",
             "peek (fp32 out) >= 4x clone/step/restore (faster variant)")
    checks = []
    for i, (name, (median, bound, fmt), (minimum, _, _)) in enumerate(zip(names, evaluate("ms"), evaluate("min_ms"))):
        met = median <= bound if i == 0 else median >= bound
        checks.append((name, label, fmt.format(median), fmt.format(minimum), met))
    return checks


def _gpu_targets(label, results):
    checks = []
    for name in ("acco adamw_step", "acco adamw_peek (fp32 out)", "acco adamw_step (control) + bf16 out"):
        if name not in results:
            continue
        fractions = []
        for key in ("ms", "min_ms"):
            copy_time = results["copy (fp32, roofline)"][key] / results["copy (fp32, roofline)"]["bytes_per_param"]
            fractions.append(copy_time / (results[name][key] / results[name]["bytes_per_param"]))
        checks.append((f"{name} >= {GPU_COPY_FRACTION_TARGET:.0%} of copy GB/s", label, f"{fractions[0]:.1%}",
                       f"{fractions[1]:.1%}", fractions[0] >= GPU_COPY_FRACTION_TARGET))
    return checks


def format_table(label, numel, results):
    copy = results["copy (fp32, roofline)"]
    lines = [f"\n### {label} fp32 parameters ({numel:,})\n",
             "| case | ms/call (median) | min ms | B/param | GB/s | of copy GB/s |", "|---|---:|---:|---:|---:|---:|"]
    for name, r in results.items():
        if "error" in r:
            lines.append(f"| {name} | {r['error']} | | | | |")
        else:
            lines.append(f"| {name} | {r['ms']:.3f} | {r['min_ms']:.3f} | {r['bytes_per_param']:.4g} | {r['gb_s']:.1f} | "
                         f"{r['gb_s'] / copy['gb_s']:.0%} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--sizes", default=None, help="comma-separated numel, K/M/G suffixes (default: "
                        "1M,8M,32M on CPU, 128M,256M on CUDA)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds over all cases")
    parser.add_argument("--min-iters", type=int, default=5, help="calls per case and round, at least")
    parser.add_argument("--min-time-s", type=float, default=0.25, help="time per case and round, at least")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--strict", action="store_true", help="exit 1 if a target is missed")
    parser.add_argument("--only", choices=("all", "update", "quant"), default="all",
                        help="benchmark only the update rules or only the quantisation kernels (plus the copy)")
    args = parser.parse_args(argv)

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but torch.cuda.is_available() is False")
    # The fused kernels, or an error: a silent fallback would benchmark the reference instead.
    os.environ.setdefault("DEEPSPEED_ACCO_KERNELS", args.device)
    from deepspeed_acco import ops

    backend = ops.backend(args.device)
    sizes = [parse_size(s) for s in (args.sizes or ("1M,8M,32M" if args.device == "cpu" else "128M,256M")).split(",")]

    where = (torch.cuda.get_device_name() if args.device == "cuda" else
             f"{os.cpu_count()} CPUs, torch.get_num_threads()={torch.get_num_threads()}, "
             f"capability {torch.backends.cpu.get_cpu_capability()}")
    print(f"# deepspeed-acco kernel benchmark: device={args.device} ({where}), backend={backend}, "
          f"torch {torch.__version__}")
    print(f"# command: {' '.join([Path(sys.executable).name] + sys.argv)}")
    print(f"# median (and min) ms per call over {args.rounds} interleaved rounds; GB/s = nominal bytes / median time;"
          " targets use medians")

    results_by_size = {}
    for numel in sizes:
        label = f"{numel / (1 << 20):g}M"
        results_by_size[label] = run_size(numel, args.device, args.rounds, args.min_iters, args.min_time_s, args.only)
        print(format_table(label, numel, results_by_size[label]), flush=True)

    checks = check_targets(results_by_size, args.device)
    print("\n### targets\n\n| target | size | on medians | on minima | met (medians) |\n|---|---|---|---|---|")
    for target, label, on_median, on_min, met in checks:
        print(f"| {target} | {label} | {on_median} | {on_min} | {'yes' if met else 'NO'} |")
    missed = [c for c in checks if not c[4]]
    print(f"\n{len(checks) - len(missed)}/{len(checks)} targets met")

    if args.json:
        args.json.write_text(json.dumps({"device": args.device, "backend": backend, "where": where,
                                         "results": results_by_size,
                                         "targets": [dict(zip(("target", "size", "on_medians", "on_minima", "met"), c))
                                                     for c in checks]}, indent=2))
    return 1 if (args.strict and missed) else 0


if __name__ == "__main__":
    sys.exit(main())
