"""Faults injected on the emulated network during training (``python -m deepspeed_acco.bench --fault``).

A fault hits node 1 of a :class:`~deepspeed_acco.bench.network.netns.Cluster` when rank 0 has committed update U
(rank 0's ``rank0.jsonl`` progress log has its row U; :class:`FaultInjector` watches it):

- ``link-down@U``: node 1's NIC (its end of the veth into the switch) goes down and stays down.
  Nothing is reset: the TCP connections between the nodes simply stop carrying packets, as when a
  cable or a switch port fails. Every rank must then exit non-zero within
  ``communication_timeout_s`` + :data:`EXIT_GRACE_S` of the fault, with an error naming the
  collective and the peer (docs/failures.md).
- ``flap:S@U``: the NIC goes down for S seconds (less than the timeout) and comes back. The
  connections survive (TCP retransmits), so training continues without an error, only later, and
  its losses equal an undisturbed run's bitwise (:func:`compare_losses`).
- ``node-kill@U``: every process of node 1 (its launcher and its ranks) gets SIGKILL. The kernel
  closes their sockets, so the survivors' collectives fail; they must exit as for ``link-down``.

With ``--recover`` (node-kill only) the ranks save a checkpoint every ``--save-every`` updates, and
after the kill :func:`recover` relaunches the method from the newest one on the nodes left (fewer
ranks, the optimizer state re-sharded, the same global batch by more accumulation) and compares
its validation loss with an undisturbed run's.

:func:`run_fault_bench` runs each method with the fault (after an undisturbed run for ``flap``),
measures the seconds from the fault to each rank's exit, reads each rank's recorded error
(``failure_rank<R>.txt``, written by :mod:`.train`), checks that no namespace, veth, bridge or
process is left (:func:`leftovers`), and writes ``faults.json`` and ``faults.md``.
"""
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Dict, List, Optional

from ..network import netns
from .runs import Network, worker_args

KINDS = ("link-down", "flap", "node-kill")
# A rank must have exited within communication_timeout_s + EXIT_GRACE_S of the fault. The grace
# covers what follows the engine's hang check: the check fires at most 0.5 s (its poll) after the
# timeout of a collective issued at or after the fault, then the process prints its traceback and
# tears down torch.distributed, on a busy 2-core machine.
EXIT_GRACE_S = 20.0
FAULT_NODE = 1  # the node a fault hits; rank 0 (node 0) keeps the progress log the injector watches
_WATCH_POLL_S = 0.05


@dataclass(frozen=True)
class Fault:
    kind: str
    update: int
    seconds: float = 0.0  # flap: how long the link stays down

    def describe(self) -> str:
        what = {"link-down": f"node {FAULT_NODE}'s link goes down and stays down",
                "flap": f"node {FAULT_NODE}'s link goes down for {self.seconds:g} s, then up",
                "node-kill": f"every process of node {FAULT_NODE} gets SIGKILL"}[self.kind]
        return f"{what}, once rank 0 has committed update {self.update}"

    def spec(self) -> str:
        return f"flap:{self.seconds:g}@{self.update}" if self.kind == "flap" else f"{self.kind}@{self.update}"


def parse_fault(text: str) -> Fault:
    """``link-down@3``, ``flap:5@3``, ``node-kill@3`` -> :class:`Fault`; ValueError naming the fix."""
    m = re.fullmatch(r"(link-down|node-kill|flap:([0-9]*\.?[0-9]+))@([0-9]+)", str(text).strip())
    if not m:
        raise ValueError(f"--fault: expected link-down@U, flap:S@U or node-kill@U (U: the update after which the "
                         f"fault hits, S: seconds down), got {text!r}")
    update = int(m.group(3))
    if update < 1:
        raise ValueError(f"--fault {text}: the update must be >= 1 (training must have started), got {update}")
    if m.group(2) is not None:
        seconds = float(m.group(2))
        if seconds <= 0:
            raise ValueError(f"--fault {text}: the link must be down for more than 0 s")
        return Fault("flap", update, seconds)
    return Fault(m.group(1), update)


def committed_updates(rows_path: str) -> int:
    """The last update in a progress log (0 before the first row)."""
    try:
        with open(rows_path) as f:
            lines = [line for line in f if line.endswith("\n")]
    except OSError:
        return 0
    for line in reversed(lines):
        try:
            return int(json.loads(line)["update"])
        except (ValueError, KeyError):
            continue
    return 0


def set_link(cluster: netns.Cluster, node: int, up: bool) -> None:
    subprocess.run(["ip", "-n", cluster.nodes[node], "link", "set", cluster.node_ifname(node), "up" if up else "down"],
                   check=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def link_is_up(cluster: netns.Cluster, node: int) -> bool:
    res = subprocess.run(["ip", "-n", cluster.nodes[node], "-j", "link", "show", "dev", cluster.node_ifname(node)],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        return "UP" in json.loads(res.stdout)[0].get("flags", [])
    except (ValueError, LookupError):
        return False


def _processes(marker: str) -> Dict[int, Optional[int]]:
    """Live processes whose command line contains ``marker`` (a run folder): pid -> RANK (None: a launcher)."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read().decode(errors="replace")
            if marker not in cmd:
                continue
            with open(f"/proc/{name}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
            rank = None
            if "deepspeed_acco.bench.running.train" in cmd and "deepspeed.launcher" not in cmd \
                    and "torch.distributed.run" not in cmd:
                with open(f"/proc/{name}/environ", "rb") as f:
                    env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
                rank = int(env[b"RANK"]) if b"RANK" in env else None
        except (OSError, ValueError):
            continue
        out[int(name)] = rank
    return out


class FaultInjector:
    """Watches rank 0's progress log, injects ``fault`` on node 1 of ``cluster`` at its update, and
    records when each rank of the job (found by ``run_dir`` in its command line) was last seen alive."""

    def __init__(self, fault: Fault, cluster: netns.Cluster, run_dir: str, timeout_s: float):
        self.fault, self.cluster, self.run_dir, self.timeout_s = fault, cluster, run_dir, timeout_s
        self.rows_path = os.path.join(run_dir, "rank0.jsonl")
        self.fault_at: Optional[float] = None
        self.restored_at: Optional[float] = None
        self.seen_update: Optional[int] = None
        self.killed: List[int] = []
        self.errors: List[str] = []
        self.rank_pids: Dict[int, int] = {}
        self.last_seen: Dict[int, float] = {}  # rank -> when it was last seen alive
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="fault-injector", daemon=True)

    def start(self) -> "FaultInjector":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        if self.fault.kind == "flap" and self.fault_at is not None and self.restored_at is None:
            self._restore()

    def deadline(self) -> Optional[float]:
        """When every rank must have exited (link-down, node-kill), or None (flap, or before the fault)."""
        if self.fault_at is None or self.fault.kind == "flap":
            return None
        return self.fault_at + self.timeout_s + EXIT_GRACE_S

    def _watch_ranks(self) -> None:
        now = time.time()
        for pid, rank in _processes(self.run_dir).items():
            if rank is not None:
                self.rank_pids.setdefault(rank, pid)
                if self.rank_pids[rank] == pid:
                    self.last_seen[rank] = now

    def _restore(self) -> None:
        try:
            set_link(self.cluster, FAULT_NODE, True)
            self.restored_at = time.time()
        except subprocess.CalledProcessError as exc:
            self.errors.append(f"link up failed: {exc.stderr}")

    def _inject(self) -> None:
        kind = self.fault.kind
        self.fault_at = time.time()
        if kind in ("link-down", "flap"):
            set_link(self.cluster, FAULT_NODE, False)
        else:
            namespace = self.cluster.nodes[FAULT_NODE]
            for _ in range(20):  # until nothing is left in the node (a process may be starting)
                pids = netns.namespace_pids(namespace)
                if not pids:
                    break
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                        self.killed.append(pid)
                    except ProcessLookupError:
                        pass
                time.sleep(0.05)

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self._watch_ranks()
                if self.fault_at is None:
                    update = committed_updates(self.rows_path)
                    if update >= self.fault.update:
                        self.seen_update = update
                        self._inject()
                elif self.fault.kind == "flap" and self.restored_at is None \
                        and time.time() - self.fault_at >= self.fault.seconds:
                    self._restore()
                self._stop.wait(_WATCH_POLL_S)
        except Exception as exc:  # noqa: BLE001 - reported in the fault record, never silently
            self.errors.append(f"{type(exc).__name__}: {exc}")

    def record(self) -> dict:
        """What happened: when the fault hit, and each rank's exit relative to it (seconds)."""
        exits = {str(r): (None if self.fault_at is None else round(t - self.fault_at, 2))
                 for r, t in sorted(self.last_seen.items())}
        return dict(fault=self.fault.spec(), description=self.fault.describe(), node=FAULT_NODE,
                    injected_after_update=self.seen_update, fault_at=self.fault_at,
                    down_s=None if self.restored_at is None or self.fault_at is None
                    else round(self.restored_at - self.fault_at, 2),
                    killed_pids=self.killed, rank_exit_after_fault_s=exits, injector_errors=self.errors)


def failures(run_dir: str) -> Dict[str, dict]:
    """Each failed rank's recorded error (``failure_rank<R>.txt`` from :mod:`.train`): time and first line."""
    out = {}
    for name in sorted(os.listdir(run_dir)) if os.path.isdir(run_dir) else []:
        m = re.fullmatch(r"failure_rank(\d+)\.txt", name)
        if m:
            with open(os.path.join(run_dir, name), errors="replace") as f:
                at = float(f.readline())
                first = f.readline().strip()
            out[m.group(1)] = dict(at=at, error=first)
    return out


def losses(run_dir: str, rank: int = 0) -> List[float]:
    with open(os.path.join(run_dir, f"rank{rank}.jsonl")) as f:
        return [json.loads(line)["loss"] for line in f if line.endswith("\n")]


def compare_losses(reference_dir: str, run_dir: str) -> dict:
    """Rank 0's per-update training losses and validation losses of two runs, compared exactly."""
    a, b = losses(reference_dir), losses(run_dir)
    val = [json.load(open(os.path.join(d, "rank0.summary.json")))["val"] for d in (reference_dir, run_dir)]
    return dict(updates=[len(a), len(b)], bitwise_equal=a == b and val[0] == val[1],
                first_difference=next((i + 1 for i, (x, y) in enumerate(zip(a, b)) if x != y), None))


def leftovers(run_dir: str, pid: Optional[int] = None) -> dict:
    """What a fault run left: namespaces and host interfaces named after ``pid`` (default: this
    process), and processes whose command line names ``run_dir``."""
    pid = os.getpid() if pid is None else pid
    listing = subprocess.run(["ip", "netns", "list"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    names = [line.split()[0] for line in listing.stdout.splitlines() if line.split()]
    links = subprocess.run(["ip", "-o", "link"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True).stdout
    return dict(namespaces=[n for n in names if n.startswith(f"acco-{pid}-")],
                interfaces=sorted(set(re.findall(rf"\ba{pid}(?:n\d+|s\d+|br)\b", links))),
                processes=sorted(_processes(run_dir)))


def wait_for_no_processes(run_dir: str, seconds: float = 10.0) -> None:
    deadline = time.time() + seconds
    while time.time() < deadline and _processes(run_dir):
        time.sleep(0.1)


# ----------------------------------------------------------------------------------------------
# The bench's --fault mode


def check_fault_args(args, methods: List[str]) -> Fault:
    """Refuse what a fault run cannot do (SystemExit naming the flag and the fix); whether this machine can
    emulate nodes at all is the bench's check (``__main__.require_network``)."""
    from ..workload.methods import parse_variant
    try:
        fault = parse_fault(args.fault)
    except ValueError as exc:
        raise SystemExit(str(exc))
    if args.nodes < 2:
        raise SystemExit(f"--fault hits node {FAULT_NODE}: use --nodes 2 or more (got {args.nodes})")
    theirs = [m for m in methods if not parse_variant(m).method.ours]
    if theirs:
        raise SystemExit(f"--fault: {', '.join(theirs)} run without deepspeed_acco's communication_timeout_s (a dead "
                         f"peer would hang them for DeepSpeed's 30 min timeout); run our methods only, e.g. "
                         f"--methods acco,dpu")
    if args.slow_rank:
        raise SystemExit("--fault with --slow-rank: dynamic accumulation depends on timing, so a flap would change "
                         "the losses; drop --slow-rank")
    if fault.update >= args.updates:
        raise SystemExit(f"--fault {args.fault}: the fault must hit before the last update (--updates {args.updates})")
    if fault.kind == "flap" and args.communication_timeout_s is not None \
            and fault.seconds >= args.communication_timeout_s:
        raise SystemExit(f"--fault {args.fault}: a flap must be shorter than --communication-timeout-s "
                         f"({args.communication_timeout_s:g}), or it is a link loss")
    if args.recover:
        recovery_accumulation(args, fault, methods)
    return fault


def recovery_accumulation(args, fault: Fault, methods: List[str]) -> int:
    """With ``--recover``: the gradient accumulation that keeps the global batch on the nodes left
    (SystemExit naming the flag and the fix where it cannot)."""
    from ..workload.methods import parse_variant
    if fault.kind != "node-kill":
        raise SystemExit(f"--recover relaunches after a lost node: use it with --fault node-kill@U (got {fault.spec()})")
    co2 = [m for m in methods if parse_variant(m).method.name == "co2"]
    if co2:
        raise SystemExit(f"--recover: {', '.join(co2)} cannot continue on fewer ranks (CO2's checkpoints continue only "
                         f"at the same world size: each rank's replica state is its own); run --methods sharded,dpu,acco")
    left = args.nodes - 1
    if (args.grad_accum * args.nodes) % left:
        raise SystemExit(f"--recover keeps the global batch on {left} node(s), so --grad-accum x --nodes "
                         f"({args.grad_accum} x {args.nodes}) must divide by {left}; pick another --grad-accum")
    accumulation = args.grad_accum * args.nodes // left
    if accumulation % 2 and any(parse_variant(m).method.name == "acco" for m in methods):
        raise SystemExit(f"--recover: ACCO on {left} node(s) would accumulate {accumulation} micro-batches, which it "
                         f"cannot split in two halves; pick an --grad-accum that keeps it even")
    return accumulation


def _markdown(meta: dict) -> str:
    fault = meta["fault"]
    lines = [f"# Fault: `{fault}`", "", meta["description"] + ".", "",
             f"Command: `{meta['command']}`", "",
             f"{meta['world']} ranks on {meta['nodes']} emulated nodes, links {meta['link']}; "
             f"communication_timeout_s {meta['timeout_s']:g}, exit grace {EXIT_GRACE_S:g} s. "
             f"Machine: {meta['machine']} (shared with other work: timings are indicative).", ""]
    if fault.startswith("flap"):
        lines += ["| method | fault after update | down (s) | exit codes | updates | losses bitwise equal to the "
                  "undisturbed run | rank 0's train clock, undisturbed -> flap (s) | left behind |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in meta["runs"]:
            cmp = r.get("losses") or {}
            walls = r.get("train_wall_s") or [None, None]
            clock = " -> ".join("n/a" if w is None else f"{w:.1f}" for w in walls)
            lines.append(f"| {r['label']} | {r['injection'].get('injected_after_update')} | "
                         f"{r['injection'].get('down_s')} | {r['returncodes']} | {cmp.get('updates')} | "
                         f"{cmp.get('bitwise_equal')} | {clock} | {r['leftovers_text']} |")
    else:
        lines += ["| method | fault after update | error raised after the fault (s, per rank) | last rank's exit "
                  "after the fault (s) | exit codes | within timeout + grace | left behind |",
                  "|---|---|---|---|---|---|---|"]
        for r in meta["runs"]:
            inj = r["injection"]
            raised = ", ".join(f"{k}: {v['after_fault_s']:.1f}" for k, v in r["failures"].items()
                               if v.get("after_fault_s") is not None) or "none recorded"
            lines.append(f"| {r['label']} | {inj.get('injected_after_update')} | {raised} | {r['last_exit_s']} | "
                         f"{r['returncodes']} | {r['within_limit']} | {r['leftovers_text']} |")
        lines += ["", "Errors (first line, per rank):", ""]
        for r in meta["runs"]:
            for k, v in r["failures"].items():
                lines.append(f"- {r['label']}, rank {k}: `{v['error']}`")
    recovered = [r for r in meta["runs"] if r.get("recovery")]
    if recovered:
        lines += ["", "## Relaunched on the nodes left", "",
                  "Each method saved a checkpoint every {} update(s) while it trained; after the kill the bench "
                  "relaunched it from the newest one (`latest`) on the node(s) left, with the same global batch "
                  "(more accumulation per rank) and the optimizer state re-sharded, up to update {}. The undisturbed "
                  "run is the same method on every node, never interrupted.".format(meta.get("save_every"),
                                                                                     meta.get("updates")), "",
                  "| method | checkpoint used (update) | other entries in the checkpoint folder | ranks, accumulation "
                  "after | validation loss at the checkpoint, recovered / undisturbed | validation loss after update "
                  f"{meta.get('updates')}, recovered / undisturbed | difference | exit codes | left behind |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in recovered:
            rec = r["recovery"]
            diff = "n/a"
            if rec["val_final"] is not None and rec["reference_val_final"]:
                diff = f"{100 * (rec['val_final'] / rec['reference_val_final'] - 1):+.2f}%"
            lines.append(f"| {r['label']} | {rec['checkpoint_update']} | {', '.join(rec['other']) or 'none'} | "
                         f"{rec['world']}, {rec['grad_accum']} | {_fmt(rec['val_at_resume'])} / "
                         f"{_fmt(rec['reference_val_at_resume'])} | {_fmt(rec['val_final'])} / "
                         f"{_fmt(rec['reference_val_final'])} | {diff} | {rec.get('returncodes')} | "
                         f"{rec['leftovers_text']} |")
    else:
        lines += ["", "The bench writes no checkpoint during these runs, so none can be left half-written."]
    lines.append("")
    return "\n".join(lines)


def _fmt(value) -> str:
    return "n/a" if value is None else f"{value:.4f}"


def _summary(run_dir: str) -> Optional[dict]:
    path = os.path.join(run_dir, "rank0.summary.json")
    return json.load(open(path)) if os.path.exists(path) else None


def checkpoint_record(save_dir: str) -> dict:
    """What a killed run left in its checkpoint folder: the tag ``latest`` names, the complete tags,
    and anything else (a staging folder of a save the kill interrupted)."""
    from deepspeed_acco.runtime.checkpoint import LATEST_NAME, MODEL_STATES_NAME
    names = sorted(os.listdir(save_dir)) if os.path.isdir(save_dir) else []
    latest = None
    if LATEST_NAME in names:
        with open(os.path.join(save_dir, LATEST_NAME)) as f:
            latest = f.read().strip()
    complete = [n for n in names if re.fullmatch(r"update\d+", n)
                and os.path.isfile(os.path.join(save_dir, n, MODEL_STATES_NAME))]
    return dict(latest=latest, complete=complete,
                other=[n for n in names if n != LATEST_NAME and n not in complete])


def recover(args, method: str, label: str, run_dir: str, ref_dir: str, base: str, bps, job_timeout: float,
            accumulation: int) -> dict:
    """Relaunch ``method`` from the newest checkpoint of the killed run on the nodes left (the same
    global batch: ``accumulation`` micro-batches per rank, :func:`recovery_accumulation`) up to
    ``--updates``; compare with the undisturbed run."""
    import copy
    from ..network.jobs import run_job
    save_dir = os.path.join(run_dir, "checkpoints")
    record = checkpoint_record(save_dir)
    left_args = copy.copy(args)
    left_args.nodes = args.nodes - 1
    left_args.grad_accum = accumulation
    world = left_args.nodes * args.ranks_per_node
    out = dict(record, world=world, grad_accum=left_args.grad_accum, ok=False, checkpoint_update=None,
               val_at_resume=None, reference_val_at_resume=None, val_final=None, reference_val_final=None,
               leftovers={}, leftovers_text="n/a")
    if record["latest"] is None:
        out["error"] = "the killed run left no checkpoint"
        return out
    out["checkpoint_update"] = int(record["latest"].replace("update", ""))
    rec_dir = os.path.join(base, "recovered")
    with Network(left_args, bps, True, force_private=True) as net:
        ok = run_job(net.placement, args.launcher, worker_args(left_args, method, rec_dir) + ["--resume", save_dir],
                     rec_dir, f"{label} (recovered, {world} rank(s))", threads=args.threads, timeout_s=job_timeout,
                     progress_total=args.updates - out["checkpoint_update"], show_progress=not args.no_progress)
    wait_for_no_processes(rec_dir)
    left = leftovers(rec_dir)
    job = json.load(open(os.path.join(rec_dir, "job.json")))
    summary, reference = _summary(rec_dir), _summary(ref_dir)
    resumed = str(out["checkpoint_update"])
    final = str(args.updates)
    out.update(returncodes=job["returncodes"], job_s=job["job_s"], leftovers=left,
               leftovers_text="nothing" if not any(left.values()) else json.dumps(left))
    if summary is not None:
        out.update(val_at_resume=summary["val"].get(resumed), val_final=summary["val"].get(final),
                   resumed_from_update=summary.get("resumed_from_update"), final_update=summary.get("final_update"))
    if reference is not None:
        out.update(reference_val_at_resume=reference["val"].get(resumed), reference_val_final=reference["val"].get(final))
    out["ok"] = bool(ok and summary is not None and out["val_final"] is not None
                     and summary.get("resumed_from_update") == out["checkpoint_update"] and not any(left.values()))
    return out


def run_fault_bench(args, methods: List[str], out: str, command: str, machine: dict) -> int:
    """Run every method with ``args.fault`` on a fresh emulated cluster each; write faults.json/.md in ``out``."""
    from ..network.jobs import run_job
    from ..workload.methods import parse_variant
    fault = check_fault_args(args, methods)
    bps = netns.parse_bandwidth("100mbit" if args.bandwidth == "auto" else args.bandwidth)
    timeout_s = args.communication_timeout_s
    if timeout_s is None:
        from deepspeed_acco.runtime.optimizers.params import DEFAULT_COMMUNICATION_TIMEOUT_S
        timeout_s = DEFAULT_COMMUNICATION_TIMEOUT_S
    world = args.nodes * args.ranks_per_node
    print(f"fault run: {fault.describe()}; {args.nodes} nodes x {args.ranks_per_node} rank(s), links "
          f"{netns.format_bandwidth(bps)}; communication_timeout_s {timeout_s:g}", flush=True)
    job_timeout = args.run_timeout or (120 + 20 * args.updates + timeout_s + fault.seconds)
    meta = dict(fault=fault.spec(), description=fault.describe(), command=command, nodes=args.nodes, world=world,
                link=netns.format_bandwidth(bps), timeout_s=timeout_s, exit_grace_s=EXIT_GRACE_S,
                machine=f"{machine.get('cpu')}, {machine.get('cores')} cores", runs=[],
                updates=args.updates, save_every=args.save_every if args.recover else None)
    bad = 0
    for method in methods:
        label = parse_variant(method).label
        base = os.path.join(out, "runs", method)
        entry = dict(method=method, label=label)
        if fault.kind == "flap" or args.recover:
            ref_dir = os.path.join(base, "undisturbed")
            with Network(args, bps, True, force_private=True) as net:
                ok = run_job(net.placement, args.launcher, worker_args(args, method, ref_dir), ref_dir,
                             f"{label} (undisturbed)", threads=args.threads, timeout_s=job_timeout,
                             progress_total=args.updates, show_progress=not args.no_progress)
            entry["reference_ok"] = ok
            entry["reference_job_s"] = json.load(open(os.path.join(ref_dir, "job.json")))["job_s"]
        run_dir = os.path.join(base, "fault")
        saving = ["--save-every", str(args.save_every)] if args.recover else []
        with Network(args, bps, True, force_private=True) as net:
            injector = FaultInjector(fault, net.cluster, run_dir, timeout_s)
            ok = run_job(net.placement, args.launcher, worker_args(args, method, run_dir) + saving, run_dir,
                         f"{label} ({fault.spec()})", threads=args.threads, timeout_s=job_timeout,
                         progress_total=args.updates, show_progress=not args.no_progress, fault=injector)
        wait_for_no_processes(run_dir)
        job = json.load(open(os.path.join(run_dir, "job.json")))
        left = leftovers(run_dir)
        inj = injector.record()
        failed = failures(run_dir)
        for v in failed.values():
            v["after_fault_s"] = None if inj["fault_at"] is None else round(v["at"] - inj["fault_at"], 2)
        entry.update(injection=inj, returncodes=job["returncodes"], job_s=job["job_s"], failures=failed,
                     leftovers=left, leftovers_text="nothing" if not any(left.values()) else json.dumps(left))
        if fault.kind == "flap":
            entry["losses"] = compare_losses(ref_dir, run_dir) if ok and entry["reference_ok"] else None
            entry["train_wall_s"] = [json.load(open(os.path.join(d, "rank0.summary.json")))["wall_s"]
                                     if os.path.exists(os.path.join(d, "rank0.summary.json")) else None
                                     for d in (ref_dir, run_dir)]
            good = ok and bool(entry["losses"] and entry["losses"]["bitwise_equal"])
        else:
            exits = [v for v in inj["rank_exit_after_fault_s"].values() if v is not None]
            entry["last_exit_s"] = max(exits) if exits else None
            entry["within_limit"] = bool(exits) and max(exits) <= timeout_s + EXIT_GRACE_S \
                and all(c not in (0, None) for c in job["returncodes"]) and not job.get("fault_overdue")
            good = entry["within_limit"]
        if args.recover:
            entry["recovery"] = recover(args, method, label, run_dir, ref_dir, base, bps, job_timeout,
                                        recovery_accumulation(args, fault, methods))
            good = good and entry["recovery"]["ok"]
        good = good and not any(left.values()) and inj["fault_at"] is not None
        bad += not good
        meta["runs"].append(entry)
        if args.recover:
            rec = entry["recovery"]
            print(f"{label}: relaunched from the checkpoint of update {rec['checkpoint_update']} on {rec['world']} "
                  f"rank(s): validation loss after update {args.updates} {_fmt(rec['val_final'])}, undisturbed "
                  f"{_fmt(rec['reference_val_final'])}; left behind: {rec['leftovers_text']}", flush=True)
        print(f"{label}: {fault.spec()}: " + (
            f"losses bitwise equal: {entry['losses'] and entry['losses']['bitwise_equal']}"
            if fault.kind == "flap" else
            f"last rank exited {entry['last_exit_s']} s after the fault, exit codes {job['returncodes']}")
            + f"; left behind: {entry['leftovers_text']}", flush=True)
    with open(os.path.join(out, "faults.json"), "w") as f:
        json.dump(meta, f, indent=1)
    with open(os.path.join(out, "faults.md"), "w") as f:
        f.write(_markdown(meta))
    print(f"fault report: {os.path.join(out, 'faults.md')}", flush=True)
    return 1 if bad else 0
