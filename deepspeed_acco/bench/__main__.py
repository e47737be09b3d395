"""``python -m deepspeed_acco.bench``: DeepSpeed ZeRO-1 vs ShardedAdamW, DPU, ACCO and CO2 on real text over slow links.

Trains the same GPT-Neo (built from a config, same initial weights, same data order) with each
method, each as a real multi-rank job started the way a multi-node user starts one (the
``deepspeed`` launcher with a hostfile and ``--no_ssh --node_rank K`` on every node, or torchrun),
on emulated nodes: network namespaces whose full-duplex links into a switch are rate-limited with
``tc tbf`` (``--nodes 1``: one namespace with a shaped loopback, as results before 2026-12-01
used). A compute-only run (same processes and batches, no communication) gives the floor. It
reports two tables: every method at equal samples (``--updates``), and, with ``--target-loss``,
the time each method needs to reach a validation loss (by default DeepSpeed ZeRO-1's after
``--updates``). CSVs, JSON, Markdown and PNG plots go to ``--out``.

With no arguments (``make demo``) it runs the defaults below; on 2 CPU cores with AVX512-BF16 that took
about 8 minutes (docs/bench.md, "How long make demo takes"), and it prints its own estimate.
"""
import argparse
import datetime
import os
import platform
import shlex
import signal
import sys
import time
from typing import Dict, List, Optional

from .network import netns
from .running.faults import check_fault_args, run_fault_bench
from .network.jobs import Placement, probe_comm, run_job
from .workload.methods import (BASELINE, DEFAULT_METHODS, LR_SCHEDULES, METHODS, MODIFIERS, comm_description,
                               parse_variant, resolve_methods)
from .workload.models import DEFAULT_PRESET, PRESETS
from .running.runs import Network, worker_args
from .reporting.summary import finish, replot
from .running.train import _sync_updates

DEFAULT_UPDATES = 50
# --bandwidth auto: ZeRO-1 communicates a third of its update, so T_comm = T_compute / 2, where ACCO
# (two jobs per update) can just hide its communication (2 T_comm <= T_compute); docs/bench.md.
AUTO_SHARE = 1.0 / 3.0
LONG_RUN_S = 20 * 60  # the time estimate warns above this


def _share(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 < value < 1.0:
        raise argparse.ArgumentTypeError(f"expected a share in (0, 1) such as 0.33, got {text!r}")
    return value
MAX_UPDATES_FACTOR = 3  # --max-updates default: 3 x --updates


def _gap_penalty(text: str):
    """``--gap-penalty``: 'adaptive' or a positive number."""
    if text == "adaptive":
        return text
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected 'adaptive' or a number > 0, got {text!r}")
    return value


def _target_loss(text: str):
    """``--target-loss``: 'auto', 'none' or a positive number (nats/byte)."""
    if text in ("auto", "none"):
        return None if text == "none" else text
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected 'auto', 'none' or a loss > 0 (nats/byte), got {text!r}")
    return value


def _seeds(text: str) -> List[int]:
    """``--seeds``: comma-separated non-negative integers, e.g. 0,1,2."""
    try:
        seeds = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        seeds = []
    if not seeds or any(s < 0 for s in seeds):
        raise argparse.ArgumentTypeError(f"expected comma-separated seeds >= 0 such as 0,1,2, got {text!r}")
    return list(dict.fromkeys(seeds))


def _beta1(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1) such as 0.9, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m deepspeed_acco.bench",
                                description=__doc__.split("\n\n")[1],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("what to compare")
    g.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                   help=f"comma-separated, from {', '.join(m for m in METHODS if m != 'compute')}; each may carry "
                        f"modifiers, METHOD+MODIFIER (e.g. acco+bf16comm): "
                        + "; ".join(f"{m.name}: {m.help}" for m in MODIFIERS.values()))
    g.add_argument("--no-compute-only", action="store_true", help="skip the compute-only baseline run")
    g.add_argument("--updates", type=_positive_int, default=DEFAULT_UPDATES,
                   help="committed updates per method for the equal-samples table; also the LR schedule's horizon "
                        "(warm-up, then linear decay to lr/10 at this update) for every method")
    g.add_argument("--target-loss", type=_target_loss, default="auto",
                   help="time-to-target: each method trains until its validation loss is at or below this value "
                        "(nats/byte; 'auto': DeepSpeed ZeRO-1's after --updates in this run, so ZeRO-1 runs first; "
                        "'none': equal samples only)")
    g.add_argument("--max-updates", type=_positive_int, default=None,
                   help=f"with --target-loss: stop a method here if it has not reached the target "
                        f"(default {MAX_UPDATES_FACTOR} x --updates)")
    g.add_argument("--eval-every", type=_positive_int, default=None,
                   help="evaluate the fixed validation windows every N updates (clock paused; default --updates/10)")
    g.add_argument("--seeds", type=_seeds, default=[0],
                   help="comma-separated seeds (initial weights and data order): every method runs once per seed and "
                        "the report gives the validation-loss gap to ZeRO-1 as mean and range over them")
    g.add_argument("--local-steps", type=_positive_int, default=None,
                   help="CO2: inner steps between parameter averagings (default: the engine's)")
    g.add_argument("--warmup-sync-updates", type=_sync_updates, default=None,
                   help="DPU, ACCO, CO2: the first N updates synchronous (ZeRO-1), then the method's own rule; "
                        "'auto': the engine's rule from the LR schedule (default: the engine's default)")
    g.add_argument("--sync-after-updates", type=int, default=None,
                   help="DPU, ACCO: every update after the first N is synchronous (ZeRO-1), a synchronous "
                        "cool-down")
    g.add_argument("--outer-lr", type=float, default=None, help="CO2: outer learning rate (default: the engine's, 0.5)")
    g.add_argument("--outer-momentum", type=float, default=None,
                   help="CO2: outer momentum (default: the engine's, 0)")
    g.add_argument("--gap-penalty", default=None, type=_gap_penalty,
                   help="CO2: a number (constant divisor) or 'adaptive' (default: the engine's, 1.0)")
    g.add_argument("--slow-rank", default="", metavar="R:F",
                   help="make rank R's compute F times slower (ACCO then uses dynamic accumulation)")
    g.add_argument("--no-dynamic-accumulation", action="store_true",
                   help="with --slow-rank: keep ACCO's accumulation fixed")
    g = p.add_argument_group("model and data")
    g.add_argument("--model", default=DEFAULT_PRESET, choices=sorted(PRESETS), help="GPT-Neo preset")
    g.add_argument("--ctx", type=int, default=256, help="context length (tokens = bytes)")
    g.add_argument("--micro-batch", type=int, default=4, help="sequences per micro-batch per rank")
    g.add_argument("--grad-accum", type=int, default=2, help="micro-batches per update per rank (even for ACCO)")
    g.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="auto",
                   help="training precision (bf16: DeepSpeed's bf16 section, bf16 model, fp32 masters and optimizer "
                        "states); auto: bf16 where the device computes it natively (CUDA with bf16, a CPU with "
                        "AVX512-BF16 or AMX), else fp32 (docs/bench.md)")
    g.add_argument("--keep-denormals", action="store_true",
                   help="keep denormal floats in every rank (default: flushed to zero, torch.set_flush_denormal: "
                        "without it the CPU's compute per update grew 1.6x over 240 updates; docs/bench.md)")
    g.add_argument("--lr", type=float, default=1e-3,
                   help="peak learning rate (1e-3: the best of 5e-4, 1e-3, 2e-3, 3e-3 for DeepSpeed ZeRO-1 at the "
                        "fp32 defaults of 2026-11-29)")
    g.add_argument("--warmup", type=int, default=10, help="linear warm-up updates (then linear decay to lr/10)")
    g.add_argument("--lr-schedule", choices=LR_SCHEDULES, default="decay",
                   help="after the warm-up: decay (DeepSpeed's WarmupDecayLR, linearly to lr/10 at --updates) or "
                        "constant (WarmupLR: lr to the end, to tell effects of the decay from effects of length)")
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--beta1", type=_beta1, default=0.9,
                   help="AdamW's beta1 for every method (beta2 stays 0.95); to study how momentum and a stale "
                        "gradient interact (docs/studies/dpu_convergence.md)")
    g.add_argument("--clip", type=float, default=1.0, help="gradient clipping (0: off)")
    g.add_argument("--data", default=None,
                   help="text file, folder of text files, or Hugging Face dataset name[:config] "
                        "(default: this Python's standard library .py files)")
    g.add_argument("--cache-dir", default="default", help="tokenised-corpus cache (default ~/.cache/deepspeed_acco)")
    g.add_argument("--val-windows", type=int, default=40, help="fixed held-out windows of --ctx bytes per evaluation")
    g = p.add_argument_group("network and processes")
    g.add_argument("--nodes", type=_positive_int, default=2,
                   help="emulated nodes, each a network namespace with its own full-duplex link into a switch; 1: all "
                        "ranks in one namespace on a shaped loopback (both directions share the rate)")
    g.add_argument("--ranks-per-node", type=_positive_int, default=1,
                   help="ranks per node (they talk over the node's unshaped loopback; CO2 then averages gradients "
                        "inside each node every step: group_size = this)")
    g.add_argument("--bandwidth", default="auto",
                   help="link rate, e.g. 1gbit, 300mbit (tc tbf; per node and direction with --nodes >= 2, the "
                        "loopback's total with --nodes 1); none: no shaping; auto: the rate at which DeepSpeed "
                        f"ZeRO-1 spends {AUTO_SHARE:.0%}% of its update communicating on this machine, from the "
                        "compute-only run and a measured round (--comm-share)")
    g.add_argument("--comm-share", type=_share, default=AUTO_SHARE,
                   help="with --bandwidth auto: the share of ZeRO-1's update spent communicating (docs/bench.md)")
    g.add_argument("--sweep-bandwidth", default="", metavar="LIST",
                   help="comma-separated rates: run every method at each and plot speedup vs bandwidth")
    g.add_argument("--launcher", choices=["deepspeed", "torchrun"], default="deepspeed",
                   help="deepspeed: hostfile + --no_ssh --node_rank per node; torchrun: c10d rendezvous per node")
    g.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    g.add_argument("--run-timeout", type=float, default=0,
                   help="seconds per job (0: 120 + 20 x the updates a job may run, or 120 + 3 x DeepSpeed ZeRO-1's "
                        "measured seconds per update x those updates once it has run, whichever is more)")
    g.add_argument("--no-comm-probe", action="store_true",
                   help="skip timing the collectives of one update round on each shaped link")
    g.add_argument("--fault", default="", metavar="KIND@U",
                   help="inject a fault on node 1 once update U is committed, and report how every rank ends "
                        "(docs/faults.md): link-down@U (its link goes down for good), flap:S@U (down for S seconds, "
                        "then up), node-kill@U (SIGKILL to all of its processes); our methods only, no compute-only "
                        "run, no comm probe; --bandwidth auto means 100mbit here")
    g.add_argument("--recover", action="store_true",
                   help="with --fault node-kill@U: checkpoint every --save-every updates, then relaunch from the "
                        "newest checkpoint on the nodes left (fewer ranks, the optimizer state re-sharded, the same "
                        "global batch by more accumulation) up to --updates, next to an undisturbed run "
                        "(docs/faults.md)")
    g.add_argument("--save-every", type=_positive_int, default=1,
                   help="with --recover: save a checkpoint every N committed updates")
    g.add_argument("--communication-timeout-s", type=_positive_float, default=None,
                   help="our methods' communication_timeout_s (default: the engine's, 300 s); fault runs use a "
                        "short one")
    g.add_argument("--repeat", type=_positive_int, default=1,
                   help="run every job N times, interleaved (rotating the order), and report median timings")
    g = p.add_argument_group("output")
    g.add_argument("--out", default="", help="output folder (default bench_out/<UTC time>)")
    g.add_argument("--no-progress", action="store_true", help="one line per run instead of progress bars")
    g.add_argument("--no-plots", action="store_true")
    g.add_argument("--trace", metavar="DIR", default="",
                   help="rank 0 of every run writes its timeline of the last updates before --updates (the bench's "
                        "loop, the engine's boundaries and waits, each communication job's phases) to "
                        "DIR/trace_<method>_rank0.json, a Chrome/Perfetto trace, drawn as DIR/timeline_<method>.png "
                        "(docs/bench.md, 'Where the time goes')")
    g.add_argument("--replot", metavar="DIR", default="",
                   help="rebuild the tables, CSVs and plots of an earlier output folder from its logs (runs nothing)")
    return p


# ----------------------------------------------------------------------------------------------
# Jobs


def _busy_cores(seconds: float = 1.0) -> Optional[float]:
    """Cores the machine is busy with right now (averaged over ``seconds``, from /proc/stat)."""
    from .running.train import _system_cpu
    a = _system_cpu()
    time.sleep(seconds)
    b = _system_cpu()
    if a is None or b is None:
        return None
    return (b[0] - a[0] + b[1] - a[1]) / seconds


def _busy_warning(world_size: int) -> Optional[str]:
    """A warning when other work is running: the bench's own ranks need the cores to themselves."""
    busy, cores = _busy_cores(), os.cpu_count() or 1
    if busy is not None and busy > 0.3:
        return (f"WARNING: other processes keep {busy:.1f} of the {cores} cores busy before the bench starts; they "
                f"compete with the {world_size} ranks, so timings will be noisy (each run reports it below).")
    return None


# ----------------------------------------------------------------------------------------------
# Setup helpers


def machine_info() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem_gib = None
    try:
        mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        pass
    versions = {}
    for mod in ("torch", "deepspeed", "transformers"):
        try:
            versions[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - informational only
            versions[mod] = "?"
    return dict(cpu=cpu, cores=os.cpu_count(), mem_gib=round(mem_gib, 1) if mem_gib else None,
                os=f"{platform.system()} {platform.release()}", python=platform.python_version(), **versions)


def _install_sigterm():
    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    try:
        signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        pass


def check_args(args, methods: List[str]) -> None:
    """Refuse inconsistent options before anything starts (SystemExit naming the flag and the fix)."""
    if "acco" in [m.split("+")[0] for m in methods] and args.grad_accum % 2 \
            and not (args.slow_rank and not args.no_dynamic_accumulation):
        raise SystemExit(f"--grad-accum: ACCO splits each update's micro-batches in two halves, so it must be even "
                         f"(got {args.grad_accum}) unless ACCO runs with dynamic accumulation (--slow-rank)")
    if args.slow_rank:
        from .running.train import parse_slow_rank
        try:
            r, _ = parse_slow_rank(args.slow_rank)
        except ValueError as exc:
            raise SystemExit(str(exc))
        if r >= args.nodes * args.ranks_per_node:
            raise SystemExit(f"--slow-rank {args.slow_rank}: rank {r} does not exist ({args.nodes} node(s) x "
                             f"{args.ranks_per_node} rank(s))")
    if args.nodes > netns.MAX_NODES:
        raise SystemExit(f"--nodes: at most {netns.MAX_NODES} emulated nodes, got {args.nodes}")
    try:
        for text in [args.bandwidth] + args.sweep_bandwidth.split(","):
            if text.strip() and text != "auto":
                netns.parse_bandwidth(text)
    except ValueError as exc:
        raise SystemExit(f"--bandwidth/--sweep-bandwidth: {exc}")
    if args.bandwidth == "auto" and not args.sweep_bandwidth and args.no_compute_only and not args.fault:
        raise SystemExit("--bandwidth auto derives the link rate from the compute-only run: drop --no-compute-only "
                         "or give a rate (e.g. --bandwidth 300mbit)")
    if args.target_loss == "auto" and BASELINE not in methods:
        raise SystemExit(f"--target-loss auto is DeepSpeed ZeRO-1's validation loss after --updates: add {BASELINE} "
                         f"to --methods, give a loss value, or pass --target-loss none")
    if args.max_updates is not None and args.max_updates < args.updates:
        raise SystemExit(f"--max-updates ({args.max_updates}) must be >= --updates ({args.updates})")
    if not hasattr(args, "precision_why"):  # --precision auto -> bf16 or fp32, once
        from .workload.precision import choose_precision
        args.precision_requested = args.precision
        args.precision, args.precision_why = choose_precision(args.precision)
    if args.eval_every is None:
        args.eval_every = max(1, round(args.updates / 10))
    if args.max_updates is None:
        args.max_updates = MAX_UPDATES_FACTOR * args.updates
    if args.target_loss is None:
        args.max_updates = args.updates


def refused_by_engine(args, methods: List[str]) -> Dict[str, str]:
    """Our methods whose config deepspeed_acco refuses (e.g. a modifier the engine does not support
    yet), with the engine's message; checked before any job starts, with the engine's own parser."""
    from deepspeed_acco.runtime.config import parse_config

    from .workload.methods import BETA2, ds_config
    from .running.train import co2_options
    world = args.nodes * args.ranks_per_node
    out = {}
    for m in methods:
        if not parse_variant(m).method.ours:
            continue
        cfg = ds_config(m, world_size=world, micro_batch=args.micro_batch, grad_accum=args.grad_accum, lr=args.lr,
                        total_updates=args.updates, warmup=args.warmup, weight_decay=args.weight_decay, clip=args.clip,
                        betas=(args.beta1, BETA2), local_steps=args.local_steps, bf16=args.precision == "bf16",
                        warmup_sync_updates=args.warmup_sync_updates, lr_schedule=args.lr_schedule,
                        sync_after_updates=args.sync_after_updates,
                        co2_options=co2_options(argparse.Namespace(
                            outer_lr=args.outer_lr, outer_momentum=args.outer_momentum,
                            gap_penalty=None if args.gap_penalty is None else str(args.gap_penalty),
                            group_size=args.ranks_per_node if m.split("+")[0] == "co2" else 1)),
                        dynamic_accumulation=bool(args.slow_rank) and not args.no_dynamic_accumulation)
        try:
            parse_config(cfg, world_size=world)
        except ValueError as exc:
            out[m] = str(exc)
    return out


def _run_sub(label: str, many_rates: bool, method: str, seeds: List[int], seed: int, rep_tag: str) -> str:
    """A run's folder under runs/: [rate/]method[/seed<S>][/rep<i>]."""
    parts = [label.replace(" ", "").replace("/", "p")] if many_rates else []
    parts.append(method)
    if len(seeds) > 1:
        parts.append(f"seed{seed}")
    if rep_tag:
        parts.append(rep_tag)
    return os.path.join(*parts)


# ----------------------------------------------------------------------------------------------
# --bandwidth auto and the time estimate

AUTO_RATE = "auto"  # placeholder in the list of rates until the compute-only run has been timed


def choose_auto_rate(args, out: str, n_params: int, compute, shaping_ok: bool, meta: dict) -> Optional[float]:
    """``--bandwidth auto``: the per-direction rate at which DeepSpeed ZeRO-1 at its default config
    (``zero1``: gradients all-reduced, parameters all-gathered; ``workload.methods.comm_description``, which
    the report quotes) spends ``--comm-share`` of its update communicating, T_comm / (T_compute + T_comm) = share, with T_compute from the
    compute-only run and T_comm from ZeRO-1's collectives timed on the emulated network at a first
    guess of the rate (a round takes a fixed part plus the bytes the probe moves / rate:
    report.probe_round_bits, commprobe.rate_for_share)."""
    from .reporting import report
    from .reporting.commprobe import rate_for_share
    share = args.comm_share
    if compute is None or not shaping_ok:
        print("note: --bandwidth auto needs the compute-only run and a shaped network; running unshaped", flush=True)
        return None
    t_compute = compute.ms_per_update / 1000.0
    world = args.nodes * args.ranks_per_node
    nodes = args.nodes if args.nodes >= 2 else 1
    # What the probe's collectives move (DeepSpeed all-reduces its gradients on gloo: half as much
    # again as the ideal reduce-scatter + all-gather at two ranks); counting the ideal volume instead
    # took that extra half for a fixed part and left ZeRO-1 at 23-26% instead of 33%.
    bits = report.probe_round_bits(BASELINE, n_params, world, args.precision, nodes)  # s x bit/s
    guess = bits / (share / (1.0 - share) * t_compute)
    with Network(args, guess, shaping_ok, force_private=True) as net:
        probe = probe_comm(net.placement, n_params, os.path.join(out, "commprobe_auto.json"), args.threads,
                           param_dtype=args.precision)
    measured = report.probe_round_seconds(probe, BASELINE, args.precision) if probe else None
    rate, fixed = (guess, 0.0) if measured is None else rate_for_share(share, t_compute, bits, guess, measured)
    info = dict(share=share, t_compute_s=t_compute, probe_bps=guess, probe_round_s=measured, fixed_s=fixed,
                bps=rate, calibrated_on=comm_description(BASELINE))
    meta["auto_bandwidth"] = info
    if rate is None:
        print(f"--bandwidth auto: ZeRO-1's round has a fixed part of {1000 * fixed:.0f} ms on this network, more than "
              f"{share:.0%} of an update ({1000 * t_compute:.0f} ms of compute) allows at any rate; running unshaped",
              flush=True)
        args.bandwidth = "none"
        return None
    rate = float(f"{rate:.3g}")  # three digits: what a report can name and a user can retype
    info["bps"] = rate
    args.bandwidth = f"{rate:.6g}"
    print(f"--bandwidth auto: {netns.format_bandwidth(rate)} per direction, where {info['calibrated_on']} should "
          f"spend {share:.0%} of its update communicating (compute-only {1000 * t_compute:.0f} ms/update; its collectives "
          f"measured {'n/a' if measured is None else f'{1000 * measured:.0f} ms'} at "
          f"{netns.format_bandwidth(guess)}, a fixed part of {1000 * fixed:.0f} ms)", flush=True)
    return rate


def job_timeout_s(run_timeout: float, max_updates: int, updates: int,
                  baseline_s_per_update: Optional[float] = None) -> float:
    """Seconds a job may take before the bench stops it: ``--run-timeout`` if given; else 120 s of
    start-up plus, per update the job may run (``updates``), 20 s (the bound before any job ran,
    over ``max_updates``) or three times DeepSpeed ZeRO-1's measured seconds per update, whichever
    is more. A method that communicates twice per update on a slow link (uncompressed ACCO) takes
    about twice ZeRO-1's time per update; a fixed 20 s stopped ACCO on a 125M model at 100 Mbit/s."""
    if run_timeout:
        return run_timeout
    timeout = 120.0 + 20.0 * max_updates
    if baseline_s_per_update is not None:
        timeout = max(timeout, 120.0 + 3.0 * baseline_s_per_update * updates)
    return timeout


class _Estimate:
    """After the compute-only run and ZeRO-1's, the time the whole invocation should take."""

    def __init__(self, args, methods: List[str], rates, started: float):
        self.args, self.methods, self.rates, self.started = args, methods, rates, started
        self.compute = self.baseline = None

    def report(self, now: float) -> None:
        args = self.args
        if self.baseline is None:
            return
        per_job = self.baseline.job.get("job_s") or (self.baseline.wall_s + max(
            s.get("init_s", 0.0) for s in self.baseline.summaries.values()))
        per_update = self.baseline.wall_s / max(self.baseline.updates, 1)
        jobs_per_rate = len(self.methods) * len(args.seeds)
        total_jobs = jobs_per_rate * len(self.rates) * args.repeat + (0 if args.no_compute_only else args.repeat - 1)
        left = max(total_jobs - 1, 0)
        elapsed = now - self.started
        typical = elapsed + left * per_job
        extra = 0.0
        if args.target_loss is not None and args.max_updates > args.updates:  # methods that miss the target
            extra = left * (args.max_updates - args.updates) * per_update
        line = (f"time estimate: about {typical / 60:.0f} min for this whole invocation ({left} more job(s) of about "
                f"{per_job:.0f} s each, as DeepSpeed ZeRO-1's took)"
                + (f"; up to {(typical + extra) / 60:.0f} min if every method runs to --max-updates "
                   f"{args.max_updates}" if extra > 60 else ""))
        print(line, flush=True)
        if typical > LONG_RUN_S:
            flags = ["--updates (now %d)" % args.updates, "--methods (now %d)" % len(self.methods)]
            if args.target_loss is not None:
                flags.append(f"--max-updates (now {args.max_updates}) or --target-loss none")
            if len(args.seeds) > 1:
                flags.append(f"--seeds (now {len(args.seeds)})")
            if args.repeat > 1:
                flags.append(f"--repeat (now {args.repeat})")
            if len(self.rates) > 1:
                flags.append(f"--sweep-bandwidth (now {len(self.rates)} rates)")
            print(f"WARNING: this invocation will take over {LONG_RUN_S // 60} minutes; shorten it with "
                  + ", ".join(flags) + ", or --model tiny for a quick look", flush=True)


def parse_command(argv=None):
    """``(args, methods)`` of one invocation, after every check :func:`main` makes of its options before
    anything runs (SystemExit naming the flag and the fix). Nothing runs and the machine is not
    examined (:func:`require_network` does that): tests/test_docs_commands.py parses the documents'
    commands with it."""
    args = build_parser().parse_args(argv)
    if args.replot:
        return args, []
    methods = resolve_methods(args.methods)
    if not methods and args.no_compute_only:
        raise SystemExit("nothing to run: --methods is empty and --no-compute-only is set")
    if args.fault:  # equal samples only, its own report (bench/running/faults.py)
        args.target_loss = None
    check_args(args, methods)
    if args.fault:
        check_fault_args(args, methods)
    return args, methods


def require_network(args, host: Optional[netns.Host] = None) -> bool:
    """Whether nodes and shaped links can be emulated here (:func:`netns.shaping_problem`). When they
    cannot, stop with the fix, unless ``--bandwidth none`` was given: then the run goes on unshaped."""
    problem = netns.shaping_problem(host)
    if problem is None:
        return True
    if args.fault or args.bandwidth != "none" or args.sweep_bandwidth:
        raise SystemExit(f"python -m deepspeed_acco.bench emulates nodes joined by shaped links (docs/bench.md, "
                         f"\"What it needs\"), and cannot here: {problem}")
    return False


def main(argv=None) -> int:
    args, methods = parse_command(argv)
    if args.replot:
        return replot(os.path.abspath(args.replot))
    _install_sigterm()
    shaping_ok = require_network(args)
    if args.fault:
        netns.remove_orphans()
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
        out = os.path.abspath(args.out or os.path.join("bench_out", stamp))
        os.makedirs(out, exist_ok=True)
        command = "python -m deepspeed_acco.bench " + shlex.join(argv if argv is not None else sys.argv[1:])
        try:
            return run_fault_bench(args, methods, out, command, machine_info())
        finally:
            netns.cleanup_all()
    if args.target_loss == "auto":  # ZeRO-1 first: its loss is the others' target
        methods = [BASELINE] + [m for m in methods if m != BASELINE]

    precision_why = args.precision_why
    auto_rate = args.bandwidth == "auto" and not args.sweep_bandwidth
    rates = [netns.parse_bandwidth(b) for b in args.sweep_bandwidth.split(",") if b.strip()] \
        if args.sweep_bandwidth else [AUTO_RATE if auto_rate else netns.parse_bandwidth(args.bandwidth)]
    if not shaping_ok and args.nodes > 1:
        print(f"WARNING: --bandwidth none, and no emulated nodes here; running all {args.nodes * args.ranks_per_node} "
              f"ranks over the host loopback, so the timings show compute overheads only, not the network.",
              flush=True)
    if shaping_ok:
        orphans = netns.remove_orphans()
        if orphans:
            print(f"removed {len(orphans)} namespace(s) (and what ran in them) left by an earlier bench that was "
                  f"killed: {', '.join(orphans)}", flush=True)
    refused = refused_by_engine(args, methods)
    for m, why_refused in refused.items():
        print(f"skipping {parse_variant(m).label}: deepspeed_acco refuses its config: {why_refused}", flush=True)
    methods = [m for m in methods if m not in refused]

    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    out = os.path.abspath(args.out or os.path.join("bench_out", stamp))
    os.makedirs(out, exist_ok=True)

    from .workload.data import load_corpus
    from .workload.models import build_model, count_parameters
    corpus = load_corpus(args.data, cache_dir=args.cache_dir or None)  # build the cache once, before the ranks
    n_params = count_parameters(build_model(args.model, args.ctx, args.seeds[0]))
    info = machine_info()
    world = args.nodes * args.ranks_per_node
    tbs = args.micro_batch * args.grad_accum * world
    target_text = {None: "none (equal samples only)", "auto": f"auto (DeepSpeed ZeRO-1's validation loss after "
                   f"{args.updates} updates)"}.get(args.target_loss, f"{args.target_loss}")
    print(f"deepspeed-acco bench -> {out}\n"
          f"  model: GPT-Neo '{args.model}', {n_params:,} parameters, ctx {args.ctx}, byte vocabulary, "
          f"{precision_why}\n"
          f"  data: {corpus.describe()}\n"
          f"  batch: {args.nodes} node(s) x {args.ranks_per_node} rank(s) x micro-batch {args.micro_batch} x "
          f"accumulation {args.grad_accum} = {tbs} samples/update; {args.updates} updates = {args.updates * tbs} "
          f"samples per method (equal samples)\n"
          f"  time to target: {target_text}" + (f"; evaluated every {args.eval_every} updates, at most "
                                                f"{args.max_updates} updates" if args.target_loss is not None else
                                                f"; evaluated every {args.eval_every} updates") + "\n"
          f"  seeds: {', '.join(map(str, args.seeds))}\n"
          f"  machine: {info['cpu']}, {info['cores']} cores; torch {info['torch']}, deepspeed {info['deepspeed']}; "
          f"{args.threads} thread(s) per rank; launcher: {args.launcher}", flush=True)
    busy = _busy_warning(world)
    if busy:
        print(busy, flush=True)

    from .reporting import report
    results, failed = [], []
    meta = dict(command="python -m deepspeed_acco.bench " + shlex.join(argv if argv is not None else sys.argv[1:]),
                date_utc=stamp, machine=info, n_params=n_params, corpus=corpus.describe(), args=vars(args),
                link={}, busy_warning=busy, runs=[], targets={}, refused=refused, precision_why=precision_why)
    by_key = {}
    timeout = job_timeout_s(args.run_timeout, args.max_updates, args.max_updates)
    started = time.perf_counter()
    estimate = _Estimate(args, methods, rates, started)

    def collect(run_dir, method, label, bps, seed, rep):
        meta["runs"].append(dict(dir=os.path.relpath(run_dir, out), method=method, bandwidth=label, bps=bps,
                                 seed=seed, rep=rep))
        return report.add_run(results, by_key, report.load_run(run_dir, method, label, bps, seed=seed))

    try:
        for rep in range(args.repeat):
            tag = "" if args.repeat <= 1 else f"rep{rep}"
            rtag = "" if args.repeat <= 1 else f" (run {rep + 1}/{args.repeat})"
            if not args.no_compute_only:
                run_dir = os.path.join(out, "runs", "compute", tag)
                host = Placement(1, world)
                if run_job(host, args.launcher, worker_args(args, "compute", run_dir, seed=args.seeds[0]), run_dir,
                           METHODS["compute"].label + rtag, threads=args.threads, timeout_s=timeout,
                           progress_total=args.updates, show_progress=not args.no_progress):
                    estimate.compute = collect(run_dir, "compute", "no communication", None, args.seeds[0], rep)
                else:
                    failed.append("compute")
            if AUTO_RATE in rates:
                rates = [choose_auto_rate(args, out, n_params, estimate.compute, shaping_ok, meta)]
            for bps in rates:
                label = netns.format_bandwidth(bps)
                with Network(args, bps, shaping_ok, force_private=len(rates) > 1) as net:
                    link = net.measure(args.threads)
                    if label not in meta["link"]:
                        meta["link"][label] = dict(link, measured_all=[])
                        print(Network.describe(link, label), flush=True)
                    meta["link"][label]["measured_all"].append(link["measured_bps"])
                    if net.placement.private_network and bps is not None and not args.no_comm_probe \
                            and "probe" not in meta["link"][label]:
                        probe = probe_comm(net.placement, n_params, os.path.join(
                            out, f"commprobe_{label.replace(' ', '').replace('/', 'p')}.json"), args.threads,
                            param_dtype=args.precision)
                        meta["link"][label]["probe"] = probe
                        if probe:
                            print(f"comm probe ({probe['backend']}, {net.placement.describe()}, {n_params / 1e6:.2f}M "
                                  f"fp32): reduce-scatter + all-gather {1000 * probe['round_s']:.0f} ms, all-reduce "
                                  f"{1000 * probe['all_reduce_s']:.0f} ms, reduce-scatter "
                                  f"{1000 * probe['reduce_scatter_s']:.0f} ms, all-gather "
                                  f"{1000 * probe['all_gather_s']:.0f} ms; our engine's round "
                                  f"{1000 * probe['engine_round_s']:.0f} ms", flush=True)
                    for seed in args.seeds:
                        order = methods if rep == 0 else methods[rep % len(methods):] + methods[:rep % len(methods)]
                        targets = meta["targets"].setdefault(label, {})
                        for method in order:
                            sub = _run_sub(label, len(rates) > 1, method, args.seeds, seed, tag)
                            run_dir = os.path.join(out, "runs", sub)
                            target = args.target_loss
                            if target == "auto":
                                target = None if method == BASELINE else targets.get(str(seed))
                            elif target is not None:
                                targets[str(seed)] = target
                            desc = (parse_variant(method).label + ("" if len(rates) == 1 else f" @{label}")
                                    + ("" if len(args.seeds) == 1 else f" seed {seed}") + rtag)
                            total = args.updates if target is None else args.max_updates
                            baseline = estimate.baseline
                            timeout = job_timeout_s(args.run_timeout, args.max_updates, total, None if baseline is None
                                                    else baseline.wall_s / max(baseline.updates, 1))
                            if run_job(net.placement, args.launcher,
                                       worker_args(args, method, run_dir, seed=seed, target_loss=target), run_dir,
                                       desc, threads=args.threads, timeout_s=timeout, progress_total=total,
                                       show_progress=not args.no_progress):
                                r = collect(run_dir, method, label, bps, seed, rep)
                                if method == BASELINE and rep == 0 and estimate.baseline is None:
                                    estimate.baseline = r
                                    estimate.report(time.perf_counter())
                                if args.target_loss == "auto" and method == BASELINE and str(seed) not in targets:
                                    targets[str(seed)] = r.val.get(args.updates)
                                    print(f"target: DeepSpeed ZeRO-1's validation loss after {args.updates} updates "
                                          f"= {targets[str(seed)]:.4f}" + ("" if len(args.seeds) == 1 else
                                                                           f" (seed {seed})"), flush=True)
                            else:
                                failed.append(f"{method}@{label}" + (f"/seed{seed}" if len(args.seeds) > 1 else "")
                                              + (f"#{rep}" if tag else ""))
                                if args.target_loss == "auto" and method == BASELINE and str(seed) not in targets:
                                    print("note: DeepSpeed ZeRO-1 failed, so there is no target for the other "
                                          "methods; they run to --updates only", flush=True)
    except KeyboardInterrupt:
        print("\ninterrupted: stopped the running job and removed the emulated network", file=sys.stderr)
        netns.cleanup_all()
        if results:  # keep what finished: the report of the completed runs, marked as partial
            meta["interrupted"] = True
            try:
                finish(args, out, results, failed, meta, rates)
                print(f"interrupted: the report in {out} covers the {len(meta['runs'])} run(s) that finished",
                      file=sys.stderr)
            except Exception as e:  # noqa: BLE001 - the logs stay in runs/ for --replot
                print(f"interrupted: could not write the report of the finished runs ({e}); their logs are in "
                      f"{os.path.join(out, 'runs')}", file=sys.stderr)
        return 130
    finally:
        netns.cleanup_all()

    finish(args, out, results, failed, meta, rates)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
