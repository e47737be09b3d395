"""Starting the bench's multi-rank jobs the way users start them, on the emulated network.

A :class:`Placement` says where a job's ranks run: ``nodes`` x ``ranks_per_node`` ranks, on the
host's loopback, in one shaped namespace (``--nodes 1``), or on the nodes of a
:class:`~.netns.Cluster`. :func:`node_commands` builds one launcher command per node:

- ``--launcher deepspeed`` on a cluster: DeepSpeed's multi-node launch without ssh, what a user
  types on each machine: ``deepspeed --hostfile HOSTFILE --no_ssh --node_rank K --master_addr
  <node 0> --master_port P --module deepspeed_acco.bench.running.train ...``, with a hostfile listing every
  node with ``slots=R``; node k then runs global ranks k R .. k R + R - 1.
- ``--launcher torchrun`` on a cluster: torchrun's c10d rendezvous, ``torchrun --nnodes N
  --nproc_per_node R --rdzv_backend c10d --rdzv_endpoint <node 0>:P --rdzv_id JOB --local_addr
  <node k>``; node 0 hosts the rendezvous store (``--rdzv_conf is_host=true``: the nodes share the
  machine's hostname, which resolves to none of their addresses, so torchrun cannot tell by itself).
- on one node: ``deepspeed --num_gpus R --master_port P`` / ``torchrun --nproc_per_node R``.

On a cluster every rank gets ``GLOO_SOCKET_IFNAME`` = its node's NIC: gloo otherwise binds to the
address the hostname resolves to (here 127.0.0.1, which the other nodes cannot reach). Ranks of one
node still talk over that node's loopback: the kernel routes traffic to a local address through
``lo``, so only traffic between nodes crosses the shaped link. :func:`run_job` starts every node's
launcher in its own session, shows rank 0's progress, and ends them all on success, failure,
timeout or Ctrl-C.
"""
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from . import netns

MASTER_PORT = 29500
PROBE_PORT = 29501
# NCCL (GPU jobs) must talk over TCP on the emulated network, not through shared memory or
# peer-to-peer copies, which would bypass it (every emulated node is on the same machine).
NCCL_OVER_SOCKETS = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_IB_DISABLE": "1", "NCCL_NET": "Socket"}


def package_root() -> str:
    import deepspeed_acco
    return os.path.dirname(os.path.dirname(os.path.abspath(deepspeed_acco.__file__)))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Placement:
    """Where one job's ranks run. ``cluster``: one launcher per emulated node; else one launcher,
    inside ``namespace`` (shaped loopback) or on the host (``namespace`` None)."""
    nodes: int
    ranks_per_node: int
    cluster: Optional[netns.Cluster] = None
    namespace: Optional[netns.Namespace] = None

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def private_network(self) -> bool:
        return self.cluster is not None or self.namespace is not None

    def describe(self) -> str:
        if self.cluster is not None:
            return f"{self.nodes} nodes x {self.ranks_per_node} rank(s)"
        return f"{self.world_size} rank(s) on one " + ("shaped loopback" if self.namespace else "host loopback")


def child_env(threads: int) -> dict:
    env = dict(os.environ)
    root = package_root()
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["OMP_NUM_THREADS"] = str(threads)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    # DeepSpeed JIT-builds a small shared-memory op in every initialize on CPU. A private build folder
    # keeps other DeepSpeed users of this machine (with other compiler flags) from forcing rebuilds.
    if not env.get("TORCH_EXTENSIONS_DIR"):
        from ..workload.data import default_cache_dir
        env["TORCH_EXTENSIONS_DIR"] = os.path.join(default_cache_dir(), "torch_extensions")
    return env


@dataclass
class NodeCommand:
    node: int
    argv: List[str]
    env: Dict[str, str]


def node_commands(placement: Placement, launcher: str, module: str, module_args: Sequence[str], run_dir: str,
                  threads: int, port: Optional[int] = None, job_id: str = "bench") -> List[NodeCommand]:
    """One launcher command (argv, env) per node that starts ``python -m module module_args`` on every rank."""
    base_env = child_env(threads)
    R = placement.ranks_per_node
    if placement.cluster is None:
        port = port or (MASTER_PORT if placement.namespace is not None else free_port())
        if launcher == "deepspeed":
            argv = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(R),
                    "--master_port", str(port), "--module", module]
        else:
            argv = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(R),
                    "--master_addr", "127.0.0.1", "--master_port", str(port), "-m", module]
        env = dict(base_env)
        if placement.namespace is not None:
            argv = placement.namespace.prefix() + argv
            env.update(NCCL_OVER_SOCKETS, NCCL_SOCKET_IFNAME="lo")
        return [NodeCommand(0, argv + list(module_args), env)]

    cluster = placement.cluster
    port = port or MASTER_PORT
    master = cluster.node_address(0)
    hostfile = os.path.join(run_dir, "hostfile")
    if launcher == "deepspeed":
        with open(hostfile, "w") as f:
            f.write("".join(f"node{k} slots={R}\n" for k in range(placement.nodes)))
    out = []
    for k in range(placement.nodes):
        if launcher == "deepspeed":
            argv = [sys.executable, "-m", "deepspeed.launcher.runner", "--hostfile", hostfile, "--no_ssh",
                    "--node_rank", str(k), "--master_addr", master, "--master_port", str(port), "--module", module]
        else:
            argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(placement.nodes),
                    "--nproc_per_node", str(R), "--rdzv_backend", "c10d", "--rdzv_endpoint", f"{master}:{port}",
                    "--rdzv_id", job_id, "--local_addr", cluster.node_address(k)]
            if k == 0:
                argv += ["--rdzv_conf", "is_host=true"]
            argv += ["-m", module]
        env = dict(base_env, GLOO_SOCKET_IFNAME=cluster.node_ifname(k), NCCL_SOCKET_IFNAME=cluster.node_ifname(k),
                   **NCCL_OVER_SOCKETS)
        out.append(NodeCommand(k, cluster.node_prefix(k) + argv + list(module_args), env))
    return out


def kill_group(proc: subprocess.Popen) -> None:
    """Terminate a launcher's process group (the launcher and its ranks; started in a new session)."""
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


def _loadavg() -> Optional[float]:
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None


def link_counters(placement: Placement) -> Optional[List[dict]]:
    """Bytes each node has sent over its NIC and over its loopback so far (cluster only)."""
    cluster = placement.cluster
    if cluster is None:
        return None
    out = []
    for k in range(placement.nodes):
        counters = dict(node=k)
        for key, dev in (("nic", cluster.node_ifname(k)), ("lo", "lo")):
            res = subprocess.run(["ip", "-n", cluster.nodes[k], "-s", "-j", "link", "show", "dev", dev],
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            try:
                stats = json.loads(res.stdout)[0]["stats64"]
                counters[f"{key}_tx_bytes"] = int(stats["tx"]["bytes"])
                counters[f"{key}_rx_bytes"] = int(stats["rx"]["bytes"])
            except (ValueError, LookupError, TypeError):
                return None
        out.append(counters)
    return out


def _counter_delta(before: Optional[List[dict]], after: Optional[List[dict]]) -> Optional[List[dict]]:
    if not before or not after:
        return None
    return [{key: (a[key] - b[key] if key != "node" else a[key]) for key in a} for b, a in zip(before, after)]


def first_error(run_dir: str) -> Optional[str]:
    """The first line of the first rank's recorded start-up error (``error_rank<R>.txt``), if any."""
    for name in sorted(os.listdir(run_dir)) if os.path.isdir(run_dir) else []:
        if name.startswith("error_rank") and name.endswith(".txt"):
            with open(os.path.join(run_dir, name), errors="replace") as f:
                return f.readline().strip()
    return None


def run_job(placement: Placement, launcher: str, module_args: Sequence[str], run_dir: str, desc: str, *,
            threads: int, timeout_s: float, progress_total: int, show_progress: bool,
            module: str = "deepspeed_acco.bench.running.train", fault=None) -> bool:
    """Run one bench job on ``placement``; True on success. Shows progress from rank 0's log.

    Every node's launcher runs in its own session; when one fails the others get 20 s to notice
    (their ranks' collectives fail) before they are ended too. ``fault``: a
    :class:`~deepspeed_acco.bench.running.faults.FaultInjector`, started with the job; once its fault has hit,
    the launchers are left to exit by themselves until its ``deadline()``, and ended (``fault_overdue`` in job.json)
    only after it."""
    os.makedirs(run_dir, exist_ok=True)
    commands = node_commands(placement, launcher, module, module_args, run_dir, threads,
                             job_id=f"bench{os.getpid()}")
    with open(os.path.join(run_dir, "command.txt"), "w") as f:
        for c in commands:
            f.write(shlex.join(c.argv) + "\n")
    single = len(commands) == 1
    log_paths = [os.path.join(run_dir, "launcher.log" if single else f"launcher_node{c.node}.log") for c in commands]
    rows_path = os.path.join(run_dir, "rank0.jsonl")
    bar = None
    if show_progress:
        from tqdm import tqdm
        bar = tqdm(total=progress_total, desc=f"{desc:<28}", unit="upd", dynamic_ncols=True, leave=True)
        bar.set_postfix_str("starting ranks")
    t_start = time.time()
    load_before = _loadavg()
    counters_before = link_counters(placement)
    procs, logs = [], []
    failed_at = None
    overdue = False
    try:
        if fault is not None:
            fault.start()
        for c, path in zip(commands, log_paths):
            log = open(path, "w")
            logs.append(log)
            procs.append(subprocess.Popen(c.argv, stdout=log, stderr=subprocess.STDOUT, env=c.env,
                                          start_new_session=True, cwd=package_root()))
        seen = 0
        while any(p.poll() is None for p in procs):
            time.sleep(0.5 if fault is None else 0.1)
            if bar is not None:
                n, last = _count_rows(rows_path)
                if n > seen:
                    bar.update(n - seen)
                    seen = n
                    if last is not None:
                        bar.set_postfix_str(f"loss {last['loss']:.3f}, {last['wall_s']:.0f} s")
            if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
                failed_at = time.time()
            deadline = None if fault is None else fault.deadline()
            if deadline is not None:
                if time.time() > deadline:
                    overdue = True
                    print(f"\n{desc}: a rank is still running {deadline - fault.fault_at:.0f} s after the fault; "
                          f"stopping it", file=sys.stderr)
                    break
            elif failed_at is not None and time.time() - failed_at > 20:
                break
            if time.time() - t_start > timeout_s:
                print(f"\n{desc}: timed out after {timeout_s:.0f} s; stopping it", file=sys.stderr)
                break
    finally:
        for p in procs:
            kill_group(p)
        if fault is not None:
            fault.stop()
        for log in logs:
            log.close()
        if bar is not None:
            bar.close()
    codes = [p.returncode for p in procs]
    traffic = _counter_delta(counters_before, link_counters(placement))
    with open(os.path.join(run_dir, "job.json"), "w") as f:
        json.dump(dict(returncode=max(codes, key=lambda c: c != 0) if codes else None, returncodes=codes,
                       job_s=time.time() - t_start, loadavg_before=load_before, loadavg_after=_loadavg(),
                       placement=placement.describe(), launcher=launcher, traffic=traffic,
                       commands=[c.argv for c in commands],
                       **({} if fault is None else dict(fault=fault.record(), fault_overdue=overdue))), f, indent=1)
    ok = len(procs) == len(commands) and all(c == 0 for c in codes) \
        and os.path.exists(os.path.join(run_dir, "rank0.summary.json"))
    if not ok and fault is not None and fault.fault_at is not None:  # expected: bench/running/faults.py reports it
        print(f"{desc:<28} ended after the fault (exit codes {codes}; logs in {run_dir})", flush=True)
    elif not ok:
        reason = first_error(run_dir)
        if reason:
            print(f"\n{desc}: FAILED at start-up: {reason}\n(full traceback in {run_dir}/error_rank*.txt)",
                  file=sys.stderr)
        else:
            for path, code in zip(log_paths, codes):
                with open(path, errors="replace") as f:
                    tail = f.read()[-3000:]
                print(f"\n{desc}: FAILED (exit code {code}); last lines of {path}:\n{tail}\n", file=sys.stderr)
    elif not show_progress:
        n, last = _count_rows(rows_path)
        print(f"{desc:<28} {n} updates, train wall {last['wall_s']:.1f} s, loss {last['loss']:.3f} "
              f"(job {time.time() - t_start:.0f} s incl. start-up)", flush=True)
    return ok


def probe_comm(placement: Placement, n_params: int, out_path: str, threads: int,
               param_dtype: str = "fp32", extra_args: Sequence[str] = (), timeout_s: float = 300.0) -> Optional[dict]:
    """Run :mod:`deepspeed_acco.bench.reporting.commprobe` as a job on ``placement`` (torchrun); None (with a
    note) if it fails.
    ``extra_args``: more of commprobe's flags (``--sizes``, ``--repeats``)."""
    run_dir = os.path.dirname(out_path)
    args = ["--numel", str(n_params), "--out", out_path, "--param-dtype", param_dtype, *extra_args]
    commands = node_commands(placement, "torchrun", "deepspeed_acco.bench.reporting.commprobe", args, run_dir, threads,
                             port=PROBE_PORT if placement.private_network else None, job_id=f"probe{os.getpid()}")
    log_path = out_path + ".log"
    procs = []
    with open(log_path, "w") as log:
        try:
            for c in commands:
                procs.append(subprocess.Popen(c.argv, stdout=log, stderr=subprocess.STDOUT, env=c.env,
                                              start_new_session=True, cwd=package_root()))
            deadline = time.time() + timeout_s
            while any(p.poll() is None for p in procs) and time.time() < deadline:
                time.sleep(0.2)
        finally:
            for p in procs:
                kill_group(p)
    if any(p.returncode != 0 for p in procs) or not os.path.exists(out_path):
        print(f"note: the collective probe failed (see {log_path}); the report uses the ideal link time only",
              flush=True)
        return None
    with open(out_path) as f:
        return json.load(f)
