"""Study (a) of benchmarks/gpu_study.sh: does the side stream hide a slow link? (docs/gpu_study.md)

One process (world size 1) trains the bench's GPT-Neo (125M on CUDA, in bf16 where the device has
it) on random byte tokens already on the device, with DeepSpeed's ZeRO-1 and our ShardedAdamW, DPU,
ACCO and CO2, every collective delayed by its time on an emulated ring of W ranks
(deepspeed_acco.bench.network.linkemu). It measures, in this order:

1. the forward + backward floor T_compute: the update's micro-batches, no optimizer, no collective;
2. per method, its update time t_0 with no link (the emulator counts the traffic, delays nothing);
3. the link rates: for each ``--shares`` s, the rate at which DeepSpeed ZeRO-1 (its t_0, and its
   traffic per update) spends s of its update communicating;
4. per method and rate: ms/update; the emulated link time per update L (CUDA events around every
   delay); the method's bound (docs/wire.md, "Where the time goes", with T_comm = L per round:
   ZeRO-1 and ShardedAdamW T_compute + T_comm, DPU max(T_compute, T_comm), ACCO max(T_compute,
   2 T_comm), CO2 max(T_compute, T_comm / H)); and the share of L the method hid,
   1 - (ms/update - t_0) / L.

Each time is a window of ``--updates`` updates between two markers placed right after a ``step()``
that committed an update, with the pipeline already full (``--warmup`` updates before, at every
link): on CUDA two events on the training stream, with no synchronisation in between, so that the
job still in flight at either end neither adds nor hides anything. ``--repeats`` windows follow each
other; the median is reported.

    python -m deepspeed_acco.bench.gpu_study.overlap --json overlap.json                            # on a GPU
    python -m deepspeed_acco.bench.gpu_study.overlap --model tiny --ctx 64 --updates 4 --repeats 1  # CPU dry run
"""
import argparse
import math
import statistics
import sys
import time
from pathlib import Path

from .common import (Clock, add_common_arguments, build_engine, describe_device, kernel_backend, method_label,
                     release, setup, synchronize, write_json)

METHOD_ORDER = ("zero1", "sharded", "dpu", "acco", "co2")
BASELINE = "zero1"


# ----------------------------------------------------------------------------------------------
# The analysis (pure functions, tested on the CPU)


def rounds_per_update(method: str, local_steps: int) -> float:
    """Communication rounds (reduce-scatter + update + all-gather) per update: ACCO 2 (estimate and
    commit), CO2 one per ``local_steps`` inner steps, the others 1."""
    from ..workload.methods import METHODS
    if method == "co2":
        return 1.0 / local_steps
    return METHODS[method].comm_jobs


def bound_ms(method: str, floor_ms: float, link_ms: float, local_steps: int) -> float:
    """The method's bound per update (docs/design.md; deepspeed_acco.bench.reporting.report.bound_seconds), with
    T_compute the floor and T_comm the link time of one round."""
    from ..reporting.report import bound_seconds
    round_ms = link_ms / rounds_per_update(method, local_steps)
    return bound_seconds(method, floor_ms, round_ms, local_steps=local_steps)


def hidden_share(ms: float, no_link_ms: float, link_ms: float):
    """The share of the link time per update that did not lengthen the update (None without a link)."""
    if link_ms <= 0:
        return None
    return 1.0 - (ms - no_link_ms) / link_ms


def communicating_share(ms: float, no_link_ms: float) -> float:
    """The share of an update spent on what the link added: 1 - t_0 / t."""
    return 1.0 - no_link_ms / ms


# ----------------------------------------------------------------------------------------------
# Measuring


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_arguments(parser)
    parser.add_argument("--grad-accum", type=int, default=2,
                        help="micro-batches per update (ACCO computes half of them per round)")
    parser.add_argument("--methods", default=",".join(METHOD_ORDER), help=f"a subset of {','.join(METHOD_ORDER)}")
    parser.add_argument("--world-size", type=int, default=8, help="W, the ranks of the emulated ring")
    parser.add_argument("--shares", default="0.2,0.35,0.5",
                        help="one link per value: the rate at which DeepSpeed ZeRO-1 spends this share of its "
                             "update communicating")
    parser.add_argument("--rates-gbps", default=None, help="the link rates (Gbit/s per direction) instead of --shares")
    parser.add_argument("--latency-us", type=float, default=20.0, help="alpha: each sequential message's latency")
    parser.add_argument("--local-steps", type=int, default=4, help="CO2's inner steps per round (its default)")
    parser.add_argument("--warmup", type=int, default=3, help="updates before the first window at each link")
    parser.add_argument("--updates", type=int, default=12, help="updates per window (a multiple of --local-steps)")
    parser.add_argument("--repeats", type=int, default=3, help="windows per link (the median is reported)")
    parser.add_argument("--trace", type=Path, default=None,
                        help="write a Chrome trace (.json, or .json.gz) of two updates of --trace-method on the "
                             "slowest link")
    parser.add_argument("--trace-method", default="acco", choices=METHOD_ORDER)
    args = parser.parse_args(argv)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in args.methods if m not in METHOD_ORDER]
    if unknown or not args.methods:
        parser.error(f"--methods: {unknown or 'none given'}; choose from {','.join(METHOD_ORDER)}")
    if args.rates_gbps:
        args.rates_bps = [float(x) * 1e9 for x in args.rates_gbps.split(",") if x.strip()]
        args.shares = [None] * len(args.rates_bps)
    else:
        args.rates_bps = None
        args.shares = [float(x) for x in args.shares.split(",") if x.strip()]
        if args.methods[0] != BASELINE:
            parser.error(f"--shares are DeepSpeed ZeRO-1's: --methods must start with {BASELINE} "
                         f"(or give --rates-gbps)")
    if "co2" in args.methods and args.updates % args.local_steps:
        parser.error(f"--updates {args.updates}: CO2 communicates once per {args.local_steps} updates, so a window "
                     f"must hold whole rounds; use a multiple of --local-steps")
    for name in ("grad_accum", "updates", "repeats", "local_steps", "world_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


class Trainer:
    """Feeds an engine (ours or DeepSpeed's) micro-batches of fixed random tokens."""

    def __init__(self, engine, tokens):
        self.engine, self.tokens, self.micro = engine, tokens, 0

    def updates(self, count: int) -> None:
        engine = self.engine
        target = engine.global_steps + count
        while engine.global_steps < target:
            x = self.tokens[self.micro % len(self.tokens)]
            self.micro += 1
            engine.backward(engine(input_ids=x, labels=x).loss)
            engine.step()


def _marker(device):
    import torch
    if device.type == "cuda":
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def _seconds_between(start, end) -> float:
    if isinstance(start, float):
        return end - start
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def time_windows(run_updates, device, args, emulator=None) -> list:
    """``--repeats`` windows of ``--updates`` updates after ``--warmup``: per window the seconds and the
    link's record (module docstring). Read after the last window, so nothing synchronises in between."""
    run_updates(args.warmup)
    if emulator is not None:
        emulator.take()
    marks, records = [_marker(device)], []
    for _ in range(args.repeats):
        run_updates(args.updates)
        marks.append(_marker(device))
        if emulator is not None:
            records.append(emulator.take())
    windows = []
    for index in range(args.repeats):
        window = {"ms": 1e3 * _seconds_between(marks[index], marks[index + 1]) / args.updates}
        if emulator is not None:
            record = records[index].as_dict()
            if record["unmodelled"]:
                raise RuntimeError(f"the timed updates issued collectives the link emulator does not model: "
                                   f"{record['unmodelled']} (deepspeed_acco/bench/network/linkemu.py)")
            window["link_ms"] = 1e3 * record["measured_s"] / args.updates
        windows.append(window)
    return windows


def summarize(windows: list) -> dict:
    """Medians over the windows."""
    out = {"ms": statistics.median(w["ms"] for w in windows), "window_ms": [w["ms"] for w in windows]}
    if "link_ms" in windows[0]:
        out.update(link_ms=statistics.median(w["link_ms"] for w in windows),
                   window_link_ms=[w["link_ms"] for w in windows])
    return out


def traffic_per_update(run_updates, drain, emulator, updates: int, warmup: int) -> dict:
    """Calls, sequential messages and bits per update on the link, counted over ``updates`` updates
    between two drained pipelines, after ``warmup`` updates (an engine's first update carries its
    pipeline's prologue: DPU's first commit comes two rounds in). Exactly the jobs those updates
    launched: the timed windows do not drain, and on the CPU a job's collectives are charged when its
    worker runs them, which may be after the window that launched it."""
    run_updates(warmup)
    drain()
    emulator.take()
    run_updates(updates)
    drain()
    record = emulator.take().as_dict()
    return {"bits": record["bits"] / updates, "messages": record["messages"] / updates,
            "calls": {k: v / updates for k, v in record["calls"].items() if v}}


def floor_ms(args, device, tokens) -> dict:
    """Forward + backward of one update's micro-batches on the bench's model, nothing else."""
    import torch

    from ..workload.models import build_model
    model = build_model(args.model, args.ctx, seed=0).to(device)
    if args.precision == "bf16":
        model = model.to(torch.bfloat16)
    model.train()
    state = {"micro": 0}

    def run_updates(count):
        for _ in range(count * args.grad_accum):
            x = tokens[state["micro"] % len(tokens)]
            state["micro"] += 1
            model(input_ids=x, labels=x).loss.backward()
            if state["micro"] % args.grad_accum == 0:
                model.zero_grad(set_to_none=True)

    return summarize(time_windows(run_updates, device, args))


def calibrate(device, log) -> dict:
    """The spin's clock, checked on three delays and for running beside another stream (linkemu).

    A check that fails gets one more calibration before the study stops."""
    from ..network import linkemu
    for attempt in (1, 2):
        calibration = linkemu.calibrate_spin(device)
        try:
            check = linkemu.check_spin(device, calibration)
            break
        except RuntimeError as error:
            if attempt == 2:
                raise
            log(f"spin check failed, calibrating again: {error}")
    concurrent_s = linkemu.check_stream_only(device, calibration)
    return {"calibration": calibration, "check": check, "two_streams_s": concurrent_s}


def measure_method(method: str, args, device, tokens, emulator, links_for, log, trace=False) -> dict:
    """t_0 (no link), then one point per link of ``links_for(result with t_0)`` (the baseline's links
    come from its own t_0 and traffic)."""
    from ..network.linkemu import Link
    engine, _ = build_engine(method, args, device, grad_accum=args.grad_accum, lr=1e-4, total_updates=10**6,
                             warmup=2, lr_schedule="constant", warmup_sync_updates=0, local_steps=args.local_steps)
    trainer = Trainer(engine, tokens)
    result = {"method": method, "label": method_label(method)}
    ours = method != BASELINE
    if ours:
        result["kernels"] = kernel_backend(device)

    def drain():  # DeepSpeed's ZeRO-1 finishes its collectives inside step(); ours may have a job in flight
        if ours:
            engine.synchronize()
        synchronize(device)
    try:
        with emulator.installed():
            emulator.link = Link(args.world_size, math.inf, 0.0)  # counts the traffic, delays nothing
            result["traffic"] = traffic_per_update(trainer.updates, drain, emulator, args.updates, args.warmup)
            result["no_link"] = summarize(time_windows(trainer.updates, device, args, emulator))
            log(f"{result['label']}: {result['no_link']['ms']:.2f} ms/update without a link, "
                f"{result['traffic']['bits'] / 1e9:.3f} Gbit in {result['traffic']['messages']:.0f} messages "
                f"per update on the link")
            links = links_for(result)
            result["points"] = []
            for link in links:
                emulator.link = link
                point = summarize(time_windows(trainer.updates, device, args, emulator))
                point["rate_gbps"] = link.rate_bps / 1e9
                point["requested_link_ms"] = 1e3 * (result["traffic"]["messages"] * link.latency_s
                                                    + result["traffic"]["bits"] / link.rate_bps)
                result["points"].append(point)
                log(f"{result['label']} at {link.rate_bps / 1e9:.3g} Gbit/s: {point['ms']:.2f} ms/update, link "
                    f"{point['link_ms']:.2f} ms/update (asked {point['requested_link_ms']:.2f})")
            if trace and links:
                try:
                    write_trace(args.trace, trainer, device)
                    result["trace"] = str(args.trace)
                except Exception as error:  # noqa: BLE001 - the measurements above stand without the trace
                    result["trace_error"] = f"{type(error).__name__}: {error}"
                    log(f"no trace: {result['trace_error']}")
    finally:
        release(engine, device)
    return result


def write_trace(path: Path, trainer: Trainer, device) -> None:
    """Two updates under torch.profiler, after the windows (the slowest link is still installed)."""
    import torch
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as profiler:
        trainer.updates(2)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    profiler.export_chrome_trace(str(path))


def analyse(result: dict, floor: float, args) -> None:
    """Add each point's bound, its ratio to it, the hidden share, and the measured communicating share."""
    t0 = result["no_link"]["ms"]
    for point in result.get("points", []):
        point["bound_ms"] = bound_ms(result["method"], floor, point["link_ms"], args.local_steps)
        point["over_bound"] = point["ms"] / point["bound_ms"]
        point["hidden"] = hidden_share(point["ms"], t0, point["link_ms"])
        point["communicating"] = communicating_share(point["ms"], t0)


def markdown(payload: dict) -> str:
    """One table per link: every method's ms/update against its bound, and what it hid."""
    lines = []
    methods = payload["methods"]
    floor = payload["floor"]["ms"]
    for index, link in enumerate(payload["links"]):
        base = next((m for m in methods if m["method"] == BASELINE and len(m.get("points", [])) > index), None)
        target = f"DeepSpeed ZeRO-1 at {link['share']:.0%} by design" if link.get("share") else "given rate"
        measured = (f", {base['points'][index]['communicating']:.0%} measured" if base else "")
        lines += [f"### Link {index + 1}: {link['rate_gbps']:.3g} Gbit/s, W = {payload['world_size']}, "
                  f"{payload['latency_us']:g} us per message ({target}{measured})", "",
                  "| method | ms/update | no link | link ms/update | bound ms | over bound | link hidden |",
                  "|---|---:|---:|---:|---:|---:|---:|",
                  f"| forward + backward floor | {floor:.2f} | | | | | |"]
        for m in methods:
            if len(m.get("points", [])) <= index:
                continue
            p = m["points"][index]
            hidden = "n/a" if p["hidden"] is None else f"{p['hidden']:.0%}"
            lines.append(f"| {m['label']} | {p['ms']:.2f} | {m['no_link']['ms']:.2f} | {p['link_ms']:.2f} | "
                         f"{p['bound_ms']:.2f} | {p['over_bound']:.2f}x | {hidden} |")
        lines.append("")
    return "\n".join(lines)


def run(args) -> dict:
    import torch

    from ..network.linkemu import Link, LinkEmulator, rate_for_share
    from ..workload.models import build_model, count_parameters
    clock = Clock()

    def log(text):
        print(f"[{clock():6.1f} s] {text}", flush=True)

    device = setup(args)
    n_params = count_parameters(build_model(args.model, args.ctx, seed=0))
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (8, args.micro_batch, args.ctx), generator=generator).to(device)
    payload = {"device": describe_device(device), "model": args.model, "parameters": n_params, "ctx": args.ctx,
               "micro_batch": args.micro_batch, "grad_accum": args.grad_accum, "precision": args.precision,
               "precision_why": args.precision_why, "world_size": args.world_size, "latency_us": args.latency_us,
               "local_steps": args.local_steps, "updates_per_window": args.updates, "windows": args.repeats,
               "methods": [], "links": []}
    log(f"overlap study on {payload['device']}: {args.model} ({n_params / 1e6:.1f}M parameters), micro-batch "
        f"{args.micro_batch} x {args.ctx} tokens, {args.grad_accum} per update, {args.precision}; emulated ring of "
        f"{args.world_size} ranks, {args.latency_us:g} us per message")
    calibration = None
    if device.type == "cuda":
        spin = calibrate(device, log)
        calibration = spin["calibration"]
        payload["spin"] = {"cycles_per_s": calibration.cycles_per_s, "overhead_s": calibration.overhead_s,
                           "check": spin["check"], "two_streams_of_20_ms_s": spin["two_streams_s"]}
        log(f"spin kernel: {calibration.cycles_per_s / 1e9:.3f} GHz; check "
            + ", ".join(f"{c['requested_s'] * 1e3:g} ms {c['error']:+.2%}" for c in spin["check"]))
    emulator = LinkEmulator(Link(args.world_size, math.inf, 0.0), device, calibration)
    payload["floor"] = floor_ms(args, device, tokens)
    log(f"forward + backward floor: {payload['floor']['ms']:.2f} ms/update")
    write_json(args.json, payload)
    links = [] if args.rates_bps is None else [Link(args.world_size, r, args.latency_us * 1e-6) for r in args.rates_bps]
    payload["links"] = [{"share": s, "rate_gbps": r / 1e9} for s, r in zip(args.shares, args.rates_bps or [])]

    def links_for(result):
        if not links:  # the baseline, first: the rates at which its t_0 and traffic give each share
            t0, traffic = result["no_link"]["ms"] / 1e3, result["traffic"]
            for share in args.shares:
                rate = rate_for_share(share, t0, traffic["bits"], traffic["messages"], args.latency_us * 1e-6)
                links.append(Link(args.world_size, rate, args.latency_us * 1e-6))
                payload["links"].append({"share": share, "rate_gbps": rate / 1e9})
            log("links: " + ", ".join(f"{l['rate_gbps']:.3g} Gbit/s (ZeRO-1 at {l['share']:.0%})"
                                      for l in payload["links"]))
        return links

    for method in args.methods:
        result = measure_method(method, args, device, tokens, emulator, links_for, log,
                                trace=args.trace is not None and method == args.trace_method)
        analyse(result, payload["floor"]["ms"], args)
        payload["methods"].append(result)
        write_json(args.json, payload)
    print("\n" + markdown(payload), flush=True)
    return payload


def main(argv=None) -> int:
    run(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
