"""``python -m deepspeed_acco.bench``: DeepSpeed ZeRO-1 vs ShardedAdamW, DPU, ACCO and CO2 on real text over a slow link.

Trains the same GPT-Neo (built from a config, same initial weights, same data order) with each
method at equal samples, each as a real multi-rank job started by the ``deepspeed`` launcher (or
torchrun), inside a private network namespace whose loopback is rate-limited with ``tc tbf``.
A compute-only run (same processes and batches, no communication) gives the floor. Prints a table
and writes a CSV of every logged step, a summary CSV/JSON/Markdown and PNG plots to ``--out``.

With no arguments (``make demo``) it runs the defaults below in well under 10 minutes on 2 CPU cores.
"""
import argparse
import datetime
import json
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import time
from typing import List, Optional

from . import netns
from .methods import DEFAULT_METHODS, METHODS, resolve_methods
from .models import DEFAULT_PRESET, PRESETS
from .summary import finish, replot

DEFAULT_UPDATES = 50


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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m deepspeed_acco.bench",
                                description=__doc__.split("\n\n")[1],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("what to compare")
    g.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                   help=f"comma-separated, from {', '.join(m for m in METHODS if m != 'compute')}")
    g.add_argument("--no-compute-only", action="store_true", help="skip the compute-only baseline run")
    g.add_argument("--updates", type=int, default=DEFAULT_UPDATES, help="committed updates per method (equal samples)")
    g.add_argument("--world-size", type=int, default=2, help="ranks per job")
    g.add_argument("--local-steps", type=int, default=12, help="CO2: inner steps between parameter averagings")
    g.add_argument("--outer-lr", type=float, default=None, help="CO2: outer learning rate (default: the engine's, 1.0)")
    g.add_argument("--outer-momentum", type=float, default=None,
                   help="CO2: outer momentum (default: the engine's, 0.5)")
    g.add_argument("--gap-penalty", default=None, type=_gap_penalty,
                   help="CO2: a number (constant divisor) or 'adaptive' (default: the engine's, adaptive)")
    g.add_argument("--slow-rank", default="", metavar="R:F",
                   help="make rank R's compute F times slower (ACCO then uses dynamic accumulation)")
    g.add_argument("--no-dynamic-accumulation", action="store_true",
                   help="with --slow-rank: keep ACCO's accumulation fixed")
    g = p.add_argument_group("model and data")
    g.add_argument("--model", default=DEFAULT_PRESET, choices=sorted(PRESETS), help="GPT-Neo preset")
    g.add_argument("--ctx", type=int, default=256, help="context length (tokens = bytes)")
    g.add_argument("--micro-batch", type=int, default=4, help="sequences per micro-batch per rank")
    g.add_argument("--grad-accum", type=int, default=2, help="micro-batches per update per rank (even for ACCO)")
    g.add_argument("--lr", type=float, default=1e-3,
                   help="peak learning rate (1e-3: the best of 5e-4, 1e-3, 2e-3, 3e-3 for DeepSpeed ZeRO-1 at the defaults)")
    g.add_argument("--warmup", type=int, default=10, help="linear warm-up updates (then linear decay to 0)")
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--clip", type=float, default=1.0, help="gradient clipping (0: off)")
    g.add_argument("--bf16", action="store_true", help="bf16 training (DeepSpeed's bf16 section)")
    g.add_argument("--seed", type=int, default=0, help="initial weights and data order")
    g.add_argument("--data", default=None,
                   help="text file, folder of text files, or Hugging Face dataset name[:config] "
                        "(default: this Python's standard library .py files)")
    g.add_argument("--cache-dir", default="default", help="tokenised-corpus cache (default ~/.cache/deepspeed_acco)")
    g.add_argument("--eval-points", type=int, default=5, help="validation points per run (plus the initial weights)")
    g.add_argument("--val-windows", type=int, default=40, help="held-out windows of --ctx bytes per validation")
    g = p.add_argument_group("network and processes")
    g.add_argument("--bandwidth", default="1gbit",
                   help="loopback rate inside the private namespace (tc tbf), e.g. 1gbit, 300mbit; none: no shaping")
    g.add_argument("--sweep-bandwidth", default="", metavar="LIST",
                   help="comma-separated rates: run every method at each and plot speedup vs bandwidth")
    g.add_argument("--launcher", choices=["deepspeed", "torchrun"], default="deepspeed")
    g.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    g.add_argument("--run-timeout", type=float, default=0, help="seconds per job (0: 120 + 20 x updates)")
    g.add_argument("--no-comm-probe", action="store_true",
                   help="skip timing the collectives of one update round on each shaped link")
    g.add_argument("--repeat", type=int, default=1,
                   help="run every job N times, interleaved (rotating the order), and report median timings")
    g = p.add_argument_group("output")
    g.add_argument("--out", default="", help="output folder (default bench_out/<UTC time>)")
    g.add_argument("--no-progress", action="store_true", help="one line per run instead of progress bars")
    g.add_argument("--no-plots", action="store_true")
    g.add_argument("--replot", metavar="DIR", default="",
                   help="rebuild the table, CSVs and plots of an earlier output folder from its logs (runs nothing)")
    return p


# ----------------------------------------------------------------------------------------------
# Jobs


def _package_root() -> str:
    import deepspeed_acco
    return os.path.dirname(os.path.dirname(os.path.abspath(deepspeed_acco.__file__)))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child_env(args) -> dict:
    env = dict(os.environ)
    root = _package_root()
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["OMP_NUM_THREADS"] = str(args.threads)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    # DeepSpeed JIT-builds a small shared-memory op in every initialize on CPU. A private build folder
    # keeps other DeepSpeed users of this machine (with other compiler flags) from forcing rebuilds.
    if not env.get("TORCH_EXTENSIONS_DIR"):
        from .data import default_cache_dir
        env["TORCH_EXTENSIONS_DIR"] = os.path.join(default_cache_dir(), "torch_extensions")
    return env


def worker_args(args, method: str, run_dir: str) -> List[str]:
    dyn = bool(args.slow_rank) and not args.no_dynamic_accumulation
    out = ["--method", method, "--run-dir", run_dir, "--model", args.model, "--ctx", str(args.ctx),
           "--micro-batch", str(args.micro_batch), "--grad-accum", str(args.grad_accum),
           "--updates", str(args.updates), "--lr", repr(args.lr), "--warmup", str(args.warmup),
           "--weight-decay", repr(args.weight_decay), "--clip", repr(args.clip), "--seed", str(args.seed),
           "--local-steps", str(args.local_steps), "--cache-dir", args.cache_dir or "",
           "--val-windows", str(args.val_windows), "--eval-points", str(args.eval_points),
           "--threads", str(args.threads)]
    for flag, value in (("--outer-lr", args.outer_lr), ("--outer-momentum", args.outer_momentum),
                        ("--gap-penalty", args.gap_penalty)):
        if value is not None:
            out += [flag, str(value)]
    if args.data:
        out += ["--data", args.data]
    if args.slow_rank:
        out += ["--slow-rank", args.slow_rank]
    if dyn and method == "acco":
        out.append("--dynamic-accumulation")
    if args.bf16:
        out.append("--bf16")
    return out


def launcher_cmd(args, port: int) -> List[str]:
    if args.launcher == "deepspeed":
        return [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(args.world_size),
                "--master_port", str(port), "--module", "deepspeed_acco.bench.train"]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.world_size),
            "--master_addr", "127.0.0.1", "--master_port", str(port), "-m", "deepspeed_acco.bench.train"]


def _kill_group(proc: subprocess.Popen) -> None:
    """Terminate the job's process group (the launcher and its ranks; started in a new session)."""
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _loadavg() -> Optional[float]:
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None


def _busy_cores(seconds: float = 1.0) -> Optional[float]:
    """Cores the machine is busy with right now (averaged over ``seconds``, from /proc/stat)."""
    from .train import _system_cpu
    a = _system_cpu()
    time.sleep(seconds)
    b = _system_cpu()
    if a is None or b is None:
        return None
    return (b[0] - a[0] + b[1] - a[1]) / seconds


def _busy_warning(args) -> Optional[str]:
    """A warning when other work is running: the bench's own ranks need the cores to themselves."""
    busy, cores = _busy_cores(), os.cpu_count() or 1
    if busy is not None and busy > 0.3:
        return (f"WARNING: other processes keep {busy:.1f} of the {cores} cores busy before the bench starts; they "
                f"compete with the {args.world_size} ranks, so timings will be noisy (each run reports it below).")
    return None


def _count_rows(path: str):
    try:
        with open(path) as f:
            lines = [line for line in f if line.endswith("\n")]
    except OSError:
        return 0, None
    last = None
    if lines:
        try:
            last = json.loads(lines[-1])
        except ValueError:
            pass
    return len(lines), last


# Inside a shaped namespace, NCCL (GPU jobs) must talk over TCP on the namespace's loopback, not
# through shared memory or peer-to-peer copies, which would bypass the emulated link.
NCCL_OVER_LOOPBACK = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_IB_DISABLE": "1",
                      "NCCL_NET": "Socket", "NCCL_SOCKET_IFNAME": "lo"}


def run_job(args, method: str, run_dir: str, ns: Optional[netns.Namespace], desc: str) -> bool:
    """Run one method as a multi-rank job; True on success. Shows progress from rank 0's log."""
    os.makedirs(run_dir, exist_ok=True)
    port = 29500 if ns is not None else _free_port()
    cmd = launcher_cmd(args, port) + worker_args(args, method, run_dir)
    if ns is not None:
        cmd = ns.prefix() + cmd
    with open(os.path.join(run_dir, "command.txt"), "w") as f:
        f.write(shlex.join(cmd) + "\n")
    timeout = args.run_timeout or (120 + 20 * args.updates)
    log_path = os.path.join(run_dir, "launcher.log")
    rows_path = os.path.join(run_dir, "rank0.jsonl")
    bar = None
    if not args.no_progress:
        from tqdm import tqdm
        bar = tqdm(total=args.updates, desc=f"{desc:<28}", unit="upd", dynamic_ncols=True, leave=True)
        bar.set_postfix_str("starting ranks")
    t_start = time.time()
    load_before = _loadavg()
    with open(log_path, "w") as log:
        env = _child_env(args)
        if ns is not None:
            env.update(NCCL_OVER_LOOPBACK)
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True, cwd=_package_root())
        try:
            seen = 0
            while proc.poll() is None:
                time.sleep(0.5)
                if bar is not None:
                    n, last = _count_rows(rows_path)
                    if n > seen:
                        bar.update(n - seen)
                        seen = n
                        if last is not None:
                            bar.set_postfix_str(f"loss {last['loss']:.3f}, {last['wall_s']:.0f} s")
                    elif n == seen and seen >= args.updates:
                        bar.set_postfix_str("validating copies")
                if time.time() - t_start > timeout:
                    print(f"\n{desc}: timed out after {timeout:.0f} s; stopping it", file=sys.stderr)
                    _kill_group(proc)
                    break
        finally:
            _kill_group(proc)
            if bar is not None:
                bar.close()
    with open(os.path.join(run_dir, "job.json"), "w") as f:
        json.dump(dict(returncode=proc.returncode, job_s=time.time() - t_start, loadavg_before=load_before,
                       loadavg_after=_loadavg(), command=cmd), f, indent=1)
    ok = proc.returncode == 0 and os.path.exists(os.path.join(run_dir, "rank0.summary.json"))
    if not ok:
        with open(log_path, errors="replace") as f:
            tail = f.read()[-3000:]
        print(f"\n{desc}: FAILED (exit code {proc.returncode}); last lines of {log_path}:\n{tail}\n", file=sys.stderr)
    elif args.no_progress:
        n, last = _count_rows(rows_path)
        print(f"{desc:<28} {n} updates, train wall {last['wall_s']:.1f} s, loss {last['loss']:.3f} "
              f"(job {time.time() - t_start:.0f} s incl. start-up)", flush=True)
    return ok


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


# ----------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.replot:
        return replot(os.path.abspath(args.replot))
    _install_sigterm()
    methods = resolve_methods(args.methods)
    if args.updates < 1 or args.world_size < 1 or args.repeat < 1:
        raise SystemExit("--updates, --world-size and --repeat must be >= 1")
    if "acco" in methods and args.grad_accum % 2 and not (args.slow_rank and not args.no_dynamic_accumulation):
        raise SystemExit(f"ACCO splits each update's micro-batches in two halves: --grad-accum must be even "
                         f"(got {args.grad_accum}) unless it runs with dynamic accumulation (--slow-rank)")
    if args.slow_rank:
        from .train import parse_slow_rank
        try:
            r, _ = parse_slow_rank(args.slow_rank)
        except ValueError as exc:
            raise SystemExit(str(exc))
        if r >= args.world_size:
            raise SystemExit(f"--slow-rank {args.slow_rank}: rank {r} does not exist (world size {args.world_size})")
    if not methods and args.no_compute_only:
        raise SystemExit("nothing to run")

    try:
        rates = [netns.parse_bandwidth(b) for b in args.sweep_bandwidth.split(",") if b.strip()] \
            if args.sweep_bandwidth else [netns.parse_bandwidth(args.bandwidth)]
    except ValueError as exc:
        raise SystemExit(str(exc))
    shaping_ok, why = netns.supported()
    if any(r is not None for r in rates) and not shaping_ok:
        print(f"WARNING: cannot emulate a slow link here ({why}); running UNSHAPED over the host loopback. "
              f"The timings then show compute overheads only, not the network.", flush=True)
        rates = [None]
    if shaping_ok:
        orphans = netns.remove_orphans()
        if orphans:
            print(f"removed {len(orphans)} namespace(s) left by an earlier bench that was killed: "
                  f"{', '.join(orphans)}", flush=True)

    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    out = os.path.abspath(args.out or os.path.join("bench_out", stamp))
    os.makedirs(out, exist_ok=True)

    from .data import load_corpus
    from .models import build_model, count_parameters
    corpus = load_corpus(args.data, cache_dir=args.cache_dir or None)  # build the cache once, before the ranks
    n_params = count_parameters(build_model(args.model, args.ctx, args.seed))
    info = machine_info()
    tbs = args.micro_batch * args.grad_accum * args.world_size
    print(f"deepspeed-acco bench -> {out}\n"
          f"  model: GPT-Neo '{args.model}', {n_params:,} parameters, ctx {args.ctx}, byte vocabulary\n"
          f"  data: {corpus.describe()}\n"
          f"  batch: {args.world_size} ranks x micro-batch {args.micro_batch} x accumulation {args.grad_accum} "
          f"= {tbs} samples/update; {args.updates} updates = {args.updates * tbs} samples per method\n"
          f"  machine: {info['cpu']}, {info['cores']} cores; torch {info['torch']}, deepspeed {info['deepspeed']}; "
          f"{args.threads} thread(s) per rank; launcher: {args.launcher}", flush=True)
    busy = _busy_warning(args)
    if busy:
        print(busy, flush=True)

    from . import report
    results, failed, link = [], [], {}
    meta = dict(command="python -m deepspeed_acco.bench " + shlex.join(argv if argv is not None else sys.argv[1:]),
                date_utc=stamp, machine=info, n_params=n_params, corpus=corpus.describe(), args=vars(args),
                link={}, busy_warning=busy)
    by_key = {}

    def collect(run_dir, method, label, bps):
        r = report.load_run(run_dir, method, label, bps)
        if (method, label) in by_key:
            by_key[(method, label)].reps.append(r)
        else:
            by_key[(method, label)] = r
            results.append(r)

    try:
        for rep in range(max(1, args.repeat)):
            tag = "" if args.repeat <= 1 else f"rep{rep}"
            rtag = "" if args.repeat <= 1 else f" (run {rep + 1}/{args.repeat})"
            if not args.no_compute_only:
                run_dir = os.path.join(out, "runs", "compute", tag)
                if run_job(args, "compute", run_dir, None, METHODS["compute"].label + rtag):
                    collect(run_dir, "compute", "no communication", None)
                else:
                    failed.append("compute")
            for bps in rates:
                label = netns.format_bandwidth(bps)
                ns = None
                if bps is not None or (shaping_ok and len(rates) > 1):
                    ns = netns.Namespace(bps).create()
                try:
                    measured = netns.measure_rate(ns, 1.0, env=_child_env(args)) if ns is not None else None
                    if label not in link:
                        link[label] = measured
                        meta["link"][label] = dict(nominal_bps=bps, measured_bps=measured, measured_all=[],
                                                   qdisc=ns.qdisc() if ns is not None else "host loopback")
                    meta["link"][label]["measured_all"].append(measured)
                    if ns is not None and bps is not None:
                        print(f"link: namespace {ns.name}, loopback shaped with tc tbf to {label}; "
                              f"bulk TCP transfer measured {measured / 1e6:.0f} Mbit/s "
                              f"(shared by both directions)", flush=True)
                    else:
                        print(f"link: {'namespace' if ns else 'host'} loopback, unshaped" +
                              (f", bulk TCP transfer {measured / 1e9:.1f} Gbit/s" if measured else ""), flush=True)
                    if ns is not None and bps is not None and not args.no_comm_probe \
                            and "probe" not in meta["link"][label]:
                        probe = probe_comm(args, ns, n_params, os.path.join(
                            out, f"commprobe_{label.replace(' ', '').replace('/', 'p')}.json"))
                        meta["link"][label]["probe"] = probe
                        if probe:
                            print(f"comm probe ({probe['backend']}, {args.world_size} ranks, {n_params / 1e6:.2f}M "
                                  f"fp32): reduce-scatter + all-gather {1000 * probe['round_s']:.0f} ms, all-reduce "
                                  f"{1000 * probe['all_reduce_s']:.0f} ms, reduce-scatter "
                                  f"{1000 * probe['reduce_scatter_s']:.0f} ms, all-gather "
                                  f"{1000 * probe['all_gather_s']:.0f} ms; our engine's round "
                                  f"{1000 * probe['engine_round_s']:.0f} ms", flush=True)
                    k = rep % max(1, len(methods))
                    for method in methods[k:] + methods[:k]:  # rotate the order between repeats
                        sub = method if len(rates) == 1 else os.path.join(label.replace(" ", "").replace("/", "p"),
                                                                          method)
                        run_dir = os.path.join(out, "runs", sub, tag)
                        desc = METHODS[method].label + ("" if len(rates) == 1 else f" @{label}") + rtag
                        if run_job(args, method, run_dir, ns, desc):
                            collect(run_dir, method, label, bps)
                        else:
                            failed.append(f"{method}@{label}" + (f"#{rep}" if tag else ""))
                finally:
                    if ns is not None:
                        ns.delete()
    except KeyboardInterrupt:
        print("\ninterrupted: stopped the running job and removed the namespace", file=sys.stderr)
        netns.cleanup_all()
        return 130
    finally:
        netns.cleanup_all()

    finish(args, out, results, failed, meta, link, n_params, rates)
    return 1 if failed else 0


def probe_comm(args, ns: Optional[netns.Namespace], n_params: int, out_path: str) -> Optional[dict]:
    """Run :mod:`.commprobe` as a W-rank job on the link (torchrun); None (with a note) if it fails."""
    port = 29501 if ns is not None else _free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.world_size),
           "--master_addr", "127.0.0.1", "--master_port", str(port), "-m", "deepspeed_acco.bench.commprobe",
           "--numel", str(n_params), "--out", out_path]
    if ns is not None:
        cmd = ns.prefix() + cmd
    env = _child_env(args)
    if ns is not None:
        env.update(NCCL_OVER_LOOPBACK)
    log_path = out_path + ".log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                cwd=_package_root())
        try:
            proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            pass
        finally:
            _kill_group(proc)
    if proc.returncode != 0 or not os.path.exists(out_path):
        print(f"note: the collective probe failed (see {log_path}); the report uses the ideal link time only",
              flush=True)
        return None
    with open(out_path) as f:
        return json.load(f)


if __name__ == "__main__":
    sys.exit(main())
