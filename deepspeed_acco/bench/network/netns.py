"""Emulated networks for the bench: private network namespaces shaped with ``tc ... tbf``.

Two layouts, both built only inside namespaces this process creates (nothing is added to the
host's own network):

**Cluster** (:class:`Cluster`, the bench's default ``--nodes 2``). Every node is its own network
namespace with one veth link into a switch namespace that holds a bridge; the node's end of the
link is the node's NIC. Each node gets an address from the RFC 2544 benchmarking range
(``198.18.0.<k+1>/24``, node k) and no default route, so no packet can leave the namespaces. Each
link is shaped with ``tbf`` in both directions, as a NIC is: on the node's interface (what the
node sends) and on the switch's port toward the node (what the node receives). Shaping only the
node's egress would let N - 1 senders deliver to one node at (N - 1) x the rate at once; with the
switch side shaped too a node never receives faster than its link, whatever the number of nodes.
The two directions are separate queues, so a link is full duplex: a node sends and receives at the
full rate at the same time (:func:`measure_cluster` checks both). The links carry 64 KiB frames
(:data:`LINK_MTU`) in packets of up to 256 KiB (:func:`packet_size`): the network runs on the ranks'
cores, and most of its work is per packet. The ranks of one node talk over that node's loopback,
which is not shaped: traffic to the node's own address is routed through ``lo`` by the kernel,
never through the veth.

**Loopback** (:class:`Namespace`, ``--nodes 1``, what results before 2026-12-01 used). All ranks
run in one namespace and talk over its loopback, shaped with ``tbf``: both directions of the
rank-to-rank traffic leave through the same ``lo`` queue, so the configured rate is the *total*
over both directions (a ring all-reduce between two ranks that sends both ways at once gets half of
it each way).

Names carry the creating process's pid, so that a later bench can tell what a killed one left:
namespaces ``acco-<pid>-<n>`` (loopback) and ``acco-<pid>-<n>-sw`` / ``acco-<pid>-<n>-n<k>``
(cluster); interfaces ``a<pid>n<k>`` (node k's NIC), ``a<pid>s<k>`` (its switch port) and
``a<pid>br`` (the bridge). Interfaces are created inside the namespaces, so deleting a namespace
deletes them. Everything is deleted on exit (also on Ctrl-C / SIGTERM, via the caller's
``finally``: :func:`cleanup_all`); :func:`remove_orphans` removes what a bench killed with SIGKILL
left behind, processes included.

``python -m deepspeed_acco.bench.network.netns measure`` / ``transfer`` are the transfer tests themselves
(run inside the namespaces by :func:`measure_rate` and :func:`measure_cluster`).
"""
import itertools
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

_UNITS = {"": 1.0, "bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
          "k": 1e3, "m": 1e6, "g": 1e9, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9}
_counter = itertools.count()
_created: List[str] = []
# Node k's address; 198.18.0.0/15 is reserved for benchmarking (RFC 2544) and never routed.
NODE_SUBNET = "198.18.0"
NODE_PREFIX_LEN = 24
MAX_NODES = 250
# Our namespace names: loopback ``acco-<pid>-<n>``, cluster ``acco-<pid>-<n>-sw`` and ``acco-<pid>-<n>-n<k>``.
_OUR_NAMESPACE = re.compile(r"acco-(\d+)-\d+(?:-(?:sw|n\d+))?")
TRANSFER_PORT = 5201
LINK_MTU = 65535
"""The MTU of the cluster's links (both veth ends and the bridge), the largest a veth takes. The
network's CPU is mostly per packet: a duplex transfer at 400 Mbit/s on 2 cores cost 1.06 ms of CPU
per MB delivered with 1500-byte frames, 0.89 with 64 KiB frames and 0.65 with 256 KiB packets
(:data:`LARGE_PACKET`), against 0.40 over a loopback (docs/bench.md, "The emulated network's CPU")."""
LARGE_PACKET = 4 * 65536
"""The veths' GSO size, the largest packet TCP hands them, on links where such a packet takes at most
:data:`LARGE_PACKET_MAX_S`: four 64 KiB frames (Linux takes more than 64 KiB for IPv4 since 6.3)."""
LARGE_PACKET_MAX_S = 0.010
"""A message queued behind a packet waits for it: packets of :data:`LARGE_PACKET` from about
210 Mbit/s on, 64 KiB (the kernel's GSO size) below."""
SETTLE_BYTES = 1 << 19
"""A transfer's rate is measured after its first 512 KiB, past the bucket that tbf fills while a
link is idle and lets through at once (:func:`tbf_args`)."""



def parse_bandwidth(text) -> Optional[float]:
    """``"1gbit"``, ``"300mbit"``, ``"300M"``, ``"2.5e8"`` -> bits/s; ``"none"``/``"0"``/``None`` -> None (no shaping).

    ``kbps/mbps/gbps`` are bytes per second (tc's convention), everything else bits per second."""
    if text is None:
        return None
    s = str(text).strip().lower().replace(" ", "").replace("/s", "")
    if s in ("", "none", "off", "0", "inf", "unlimited"):
        return None
    m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)([a-z]*)", s)
    if not m or m.group(2) not in _UNITS:
        raise ValueError(f"cannot parse bandwidth {text!r}; use e.g. 1gbit, 300mbit, or none")
    bps = float(m.group(1)) * _UNITS[m.group(2)]
    if bps <= 0:
        return None
    return bps


def format_bandwidth(bps: Optional[float]) -> str:
    if bps is None:
        return "unshaped"
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:g} {unit}"
    return f"{bps:g} bit/s"


def supported() -> Tuple[bool, str]:
    """Whether this process can create shaped namespaces, from the platform, the user and the tools
    alone (no namespace is created: the tests' skip conditions call it); the reason when not."""
    problem = _static_problem(Host())
    return problem is None, (problem or ("", ""))[0]


UNSHAPED_FIX = ("or pass --bandwidth none to run without the emulated network (every rank on this host's loopback; "
                "the timings then show compute, not the network)")


def _try_cluster() -> None:
    with Cluster(2, 1e9):
        pass


@dataclass
class Host:
    """What :func:`shaping_problem` reads of the machine (tests pass a fake one)."""

    platform: str = sys.platform
    euid: Callable[[], int] = os.geteuid if hasattr(os, "geteuid") else (lambda: -1)
    which: Callable[[str], Optional[str]] = shutil.which
    try_cluster: Callable[[], None] = _try_cluster
    """Build and remove a two-node cluster with shaped links, raising what failed."""


def _static_problem(host: Host) -> Optional[Tuple[str, str]]:
    if host.platform != "linux":
        return (f"network namespaces need Linux (this is {host.platform})",
                "run the bench on a Linux machine or virtual machine")
    if host.euid() != 0:
        return ("creating network namespaces needs root (this process is not root)",
                "run it as root, e.g. make venv && sudo .venv/bin/python -m deepspeed_acco.bench, or in a container "
                "started with --privileged")
    for tool in ("ip", "tc"):
        if host.which(tool) is None:
            return (f"'{tool}' (iproute2) is not installed", "install iproute2 (Debian/Ubuntu: apt-get install "
                    "iproute2; Fedora: dnf install iproute iproute-tc)")
    return None


# What a failed command of the trial cluster says is missing, and the fix (matched in order).
_TRIAL_FAILURES = (
    ("netns add", "this process cannot create network namespaces",
     "in a container, start it with --privileged (namespaces need CAP_SYS_ADMIN and CAP_NET_ADMIN)"),
    ("type bridge", "the kernel cannot create a bridge", "load its module: modprobe bridge"),
    ("type veth", "the kernel cannot create veth pairs", "load its module: modprobe veth"),
    (" tbf", "the kernel has no tbf qdisc to shape links with", "load its module: modprobe sch_tbf"),
)


def shaping_problem(host: Optional[Host] = None) -> Optional[str]:
    """Why this process cannot emulate nodes joined by shaped links, with the fix; None when it can.

    Root, Linux and iproute2's ``ip`` and ``tc`` are checked first; then a two-node :class:`Cluster`
    with tbf-shaped links is built and removed, so a missing kernel feature (namespaces in an
    unprivileged container, veth, bridge, sch_tbf) shows before anything runs."""
    host = host or Host()
    problem = _static_problem(host)
    if problem is None:
        try:
            host.try_cluster()
        except (RuntimeError, OSError) as error:
            text = str(error)
            problem = next(((what, fix) for marker, what, fix in _TRIAL_FAILURES if marker in text),
                           ("building a trial two-node cluster failed", "fix what the command reports"))
            problem = (f"{problem[0]} ({text.strip()[:300]})", problem[1])
    if problem is None:
        return None
    what, fix = problem
    return f"{what}; {fix}, {UNSHAPED_FIX}"


def _run(cmd: List[str]) -> None:
    res = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {res.stderr.strip() or res.stdout.strip()}")


def _add_namespace(name: str) -> None:
    _run(["ip", "netns", "add", name])
    _created.append(name)


def _delete_namespace(name: str) -> None:
    subprocess.run(["ip", "netns", "del", name], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if name in _created:
        _created.remove(name)


def packet_size(bps: Optional[float]) -> int:
    """The largest packet of a cluster's links at ``bps`` (None: unshaped): :data:`LARGE_PACKET` where
    it takes at most :data:`LARGE_PACKET_MAX_S`, else 64 KiB (the kernel's GSO size)."""
    return LARGE_PACKET if bps is None or LARGE_PACKET * 8 / bps <= LARGE_PACKET_MAX_S else 65536


def tbf_args(bps: float, packet: int = 65536) -> List[str]:
    """tbf parameters for packets of up to ``packet`` bytes: the bucket holds ~4 ms of traffic and at
    least one such packet and 64 KiB more (1 KiB for headers and tc's rounding), so that no packet
    is bigger than the bucket (tbf would split or drop it) and a packet its timer releases a little
    late loses no tokens; the queue holds 50 ms."""
    rate_bytes = bps / 8.0
    burst = int(max(packet + 65536 + 1024, rate_bytes * 0.004))
    return ["rate", f"{int(bps)}bit", "burst", str(burst), "latency", "50ms"]


def _qdisc_text(namespace: str, dev: str) -> str:
    res = subprocess.run(["tc", "-n", namespace, "qdisc", "show", "dev", dev], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    return res.stdout.strip()


class Namespace:
    """One namespace whose loopback is shaped (``--nodes 1``): ``with Namespace(bps) as ns:
    subprocess.Popen(ns.prefix() + cmd)``; ``bps=None``: loopback unshaped."""

    def __init__(self, bps: Optional[float]):
        self.bps = bps
        self.name = f"acco-{os.getpid()}-{next(_counter)}"
        self.created = False

    def create(self) -> "Namespace":
        _add_namespace(self.name)
        self.created = True
        try:
            _run(["ip", "-n", self.name, "link", "set", "lo", "up"])
            if self.bps is not None:
                _run(["tc", "-n", self.name, "qdisc", "add", "dev", "lo", "root", "tbf"] + tbf_args(self.bps))
        except Exception:
            self.delete()
            raise
        return self

    def prefix(self) -> List[str]:
        return ["ip", "netns", "exec", self.name]

    def qdisc(self) -> str:
        return _qdisc_text(self.name, "lo")

    def delete(self) -> None:
        if self.created:
            _delete_namespace(self.name)
            self.created = False

    def __enter__(self):
        return self.create()

    def __exit__(self, *exc):
        self.delete()


class Cluster:
    """``num_nodes`` node namespaces, each with one full-duplex link of ``bps`` (None: unshaped)
    into a switch namespace's bridge. ``node_prefix(k) + cmd`` runs ``cmd`` on node k, whose NIC is
    ``node_ifname(k)`` with address ``node_address(k)``."""

    def __init__(self, num_nodes: int, bps: Optional[float]):
        if not 2 <= num_nodes <= MAX_NODES:
            raise ValueError(f"a cluster needs 2 to {MAX_NODES} nodes, got {num_nodes}")
        self.num_nodes, self.bps = num_nodes, bps
        pid = os.getpid()
        self.name = f"acco-{pid}-{next(_counter)}"
        self.switch = f"{self.name}-sw"
        self.nodes = [f"{self.name}-n{k}" for k in range(num_nodes)]
        self._tag = f"a{pid}"
        self.bridge = f"{self._tag}br"
        self.created = False
        self.gso_size = 65536
        """The veths' GSO size: :func:`packet_size`, or 64 KiB where the kernel refused more."""

    def node_ifname(self, k: int) -> str:
        return f"{self._tag}n{k}"

    def port_ifname(self, k: int) -> str:
        return f"{self._tag}s{k}"

    @staticmethod
    def node_address(k: int) -> str:
        return f"{NODE_SUBNET}.{k + 1}"

    def node_prefix(self, k: int) -> List[str]:
        return ["ip", "netns", "exec", self.nodes[k]]

    def create(self) -> "Cluster":
        self.created = True
        try:
            _add_namespace(self.switch)
            _run(["ip", "-n", self.switch, "link", "add", self.bridge, "mtu", str(LINK_MTU), "type", "bridge"])
            _run(["ip", "-n", self.switch, "link", "set", self.bridge, "up"])
            for k, node in enumerate(self.nodes):
                nic, port = self.node_ifname(k), self.port_ifname(k)
                _add_namespace(node)
                _run(["ip", "-n", node, "link", "set", "lo", "up"])
                # Both ends are created inside their namespaces: the host's network never sees them.
                _run(["ip", "-n", node, "link", "add", nic, "mtu", str(LINK_MTU), "type", "veth", "peer", "name", port,
                      "mtu", str(LINK_MTU), "netns", self.switch])
                _run(["ip", "-n", self.switch, "link", "set", port, "master", self.bridge])
                _run(["ip", "-n", self.switch, "link", "set", port, "up"])
                _run(["ip", "-n", node, "addr", "add", f"{self.node_address(k)}/{NODE_PREFIX_LEN}", "dev", nic])
                _run(["ip", "-n", node, "link", "set", nic, "up"])
                if self.bps is not None:
                    tbf = tbf_args(self.bps, packet_size(self.bps))
                    _run(["tc", "-n", node, "qdisc", "add", "dev", nic, "root", "tbf"] + tbf)
                    _run(["tc", "-n", self.switch, "qdisc", "add", "dev", port, "root", "tbf"] + tbf)
            # Before any connection: TCP reads the GSO size when it connects.
            if packet_size(self.bps) > 65536:
                sizes = [_set_gso_size(self.switch, [self.port_ifname(k) for k in range(self.num_nodes)])]
                sizes += [_set_gso_size(node, [self.node_ifname(k)]) for k, node in enumerate(self.nodes)]
                self.gso_size = LARGE_PACKET if all(sizes) else 65536
        except Exception:
            self.delete()
            raise
        return self

    def qdisc(self) -> str:
        """The shaping of node 0's link, both directions (every node's is the same)."""
        return (f"node 0 egress ({self.node_ifname(0)}): {_qdisc_text(self.nodes[0], self.node_ifname(0))}; "
                f"switch port toward node 0 ({self.port_ifname(0)}): "
                f"{_qdisc_text(self.switch, self.port_ifname(0))}")

    def delete(self) -> None:
        if self.created:
            for name in self.nodes + [self.switch]:
                _delete_namespace(name)
            self.created = False

    def __enter__(self):
        return self.create()

    def __exit__(self, *exc):
        self.delete()


_RTM_NEWLINK, _NLM_F_REQUEST, _NLM_F_ACK, _NLMSG_ERROR = 16, 1, 4, 2
_IFLA_GSO_MAX_SIZE, _IFLA_GSO_IPV4_MAX_SIZE = 41, 63


def set_gso_size(devices: List[str], size: int) -> None:
    """Set the GSO size of ``devices`` of this process's namespace, IPv4's included, by rtnetlink
    (iproute2 sets IPv4's only since 6.3). Raises OSError where the kernel refuses the size."""
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE) as sock:
        for seq, dev in enumerate(devices, 1):
            attrs = b"".join(struct.pack("=HHI", 8, kind, size)
                             for kind in (_IFLA_GSO_MAX_SIZE, _IFLA_GSO_IPV4_MAX_SIZE))
            body = struct.pack("=BxHiII", socket.AF_UNSPEC, 0, socket.if_nametoindex(dev), 0, 0) + attrs
            sock.send(struct.pack("=IHHII", 16 + len(body), _RTM_NEWLINK, _NLM_F_REQUEST | _NLM_F_ACK, seq, 0) + body)
            reply = sock.recv(65536)
            kind, = struct.unpack_from("=H", reply, 4)
            error, = struct.unpack_from("=i", reply, 16)
            if kind != _NLMSG_ERROR or error:
                raise OSError(-error, f"setting the GSO size of {dev} to {size}: {os.strerror(-error)}")


def _set_gso_size(namespace: str, devices: List[str], size: int = LARGE_PACKET) -> Optional[int]:
    """:func:`set_gso_size` to ``size`` inside ``namespace``; the size, or None where the
    kernel refused it (before 5.19 no device takes more than 64 KiB; the link works as well, at more
    CPU per MB; between 5.19 and 6.3 IPv4 ignores it)."""
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    res = subprocess.run(["ip", "netns", "exec", namespace, sys.executable, "-m", "deepspeed_acco.bench.network.netns", "gso"]
                         + devices + ["--size", str(size)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=env)
    return size if res.returncode == 0 else None


def cleanup_all() -> None:
    """Delete every namespace this process created and has not deleted yet."""
    for name in list(_created):
        _delete_namespace(name)


def namespace_pids(name: str) -> List[int]:
    res = subprocess.run(["ip", "netns", "pids", name], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    return [int(x) for x in res.stdout.split() if x.isdigit()]


def remove_orphans() -> List[str]:
    """Delete namespaces named like ours whose creating process is gone, with whatever runs in them.

    A bench killed with SIGKILL can clean up neither its namespaces nor its jobs (each job runs in
    its own session, so the ranks outlive it); the next bench ends the processes still inside those
    namespaces (they can only be that bench's launchers and ranks) and deletes the namespaces,
    which deletes their veths and bridge. Namespaces of live processes, and any other name, are
    never touched. Returns the names removed.
    """
    res = subprocess.run(["ip", "netns", "list"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    removed = []
    for line in res.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = _OUR_NAMESPACE.fullmatch(name)
        if not m or os.path.exists(f"/proc/{m.group(1)}"):
            continue
        for pid in namespace_pids(name):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if subprocess.run(["ip", "netns", "del", name], stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL).returncode == 0:
            removed.append(name)
    return removed


# ----------------------------------------------------------------------------------------------
# Transfer tests


def measure_rate(ns: Optional[Namespace], seconds: float = 1.0, env=None) -> float:
    """Bits/s of a bulk TCP transfer over the loopback inside ``ns`` (one direction, all of the link)."""
    cmd = [sys.executable, "-m", "deepspeed_acco.bench.network.netns", "measure", "--seconds", str(seconds)]
    if ns is not None:
        cmd = ns.prefix() + cmd
    res = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         timeout=60 + 4 * seconds)
    if res.returncode != 0:
        raise RuntimeError(f"link measurement failed: {res.stderr.strip()[-500:]}")
    return float(json.loads(res.stdout.strip().splitlines()[-1])["bps"])


def run_transfers(plan, seconds: Optional[float] = None, megabytes: Optional[float] = None,
                  env=None) -> List[dict]:
    """Run ``python -m deepspeed_acco.bench.network.netns transfer`` once per entry of ``plan``, all at once, and
    return what each printed. An entry is ``(prefix, listen, send_to)``: the command prefix that runs it
    (e.g. a node's ``ip netns exec``), the ``ADDR:PORT`` it receives one connection on and the one it
    sends to (either None). Each sender sends for ``seconds``, or ``megabytes`` (10^6 bytes)."""
    limit = 60 + 4 * (seconds if seconds is not None else 0) + (megabytes or 0) / 2
    procs = []
    for prefix, listen, send_to in plan:
        cmd = list(prefix) + [sys.executable, "-m", "deepspeed_acco.bench.network.netns", "transfer"]
        cmd += ["--megabytes", str(megabytes)] if megabytes is not None else ["--seconds", str(seconds)]
        if listen:
            cmd += ["--listen", listen]
        if send_to is not None:
            cmd += ["--send-to", send_to]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    out, problem = [], None
    for proc in procs:
        try:
            stdout, stderr = proc.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            problem = "timed out"
            break
        if proc.returncode != 0:
            problem = f"failed: {stderr.strip()[-500:]}"
            break
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    if problem is not None:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        raise RuntimeError(f"link measurement (bulk TCP transfers) {problem}")
    return out


def transfer_cpu(results: List[dict]) -> Optional[Dict[str, object]]:
    """The CPU that the transfers of :func:`run_transfers` cost, per MB (10^6 bytes) delivered.

    ``machine_ms_per_mb``: the whole machine's CPU (/proc/stat, by kind of :data:`BUSY_KINDS`) from the
    first transfer's connection to the last one's end, per MB delivered in all directions; it holds
    everything the kernel does for the traffic (TCP, veths, bridge, tbf, their softirqs wherever they
    ran) and whatever else ran on the machine meanwhile. ``processes_ms_per_mb``: the transfer
    processes' own user and system time over their transfers, which on a busy machine misses the
    softirq work that ran in other processes' time but counts nothing of theirs. None when the
    processes could not read their CPU."""
    if not results or any(r.get("start") is None or r.get("end") is None for r in results):
        return None
    first = min((r["start"] for r in results), key=lambda mark: mark["t"])
    last = max((r["end"] for r in results), key=lambda mark: mark["t"])
    megabytes = sum(r.get("received_bytes") or 0 for r in results) / 1e6
    if megabytes <= 0 or first["cpu"] is None or last["cpu"] is None:
        return None
    machine = {kind: 1e3 * (last["cpu"][kind] - first["cpu"][kind]) / megabytes for kind in BUSY_KINDS}
    own = sum(r["end"]["own"] - r["start"]["own"] for r in results)
    return dict(megabytes=megabytes, span_s=last["t"] - first["t"], machine_ms_per_mb=machine,
                steal_ms_per_mb=1e3 * (last["cpu"]["steal"] - first["cpu"]["steal"]) / megabytes,
                processes_ms_per_mb=1e3 * own / megabytes)


def measure_cluster(cluster: Cluster, seconds: float = 1.0, env=None) -> Dict[str, object]:
    """Bulk TCP transfers between nodes 1 and 0 of ``cluster``: one direction alone (``one_way_bps``:
    what one node's link carries), then both directions at once (``duplex_bps``: the two receive
    rates; each close to ``one_way_bps`` on a full-duplex link), and the machine's CPU per MB
    delivered while both ran (``duplex_cpu_ms_per_mb``, by kind; :func:`transfer_cpu`)."""
    def at(k):
        return f"{cluster.node_address(k)}:{TRANSFER_PORT}"

    one_way = run_transfers([(cluster.node_prefix(0), at(0), None), (cluster.node_prefix(1), None, at(0))],
                            seconds=seconds, env=env)[0]
    duplex = run_transfers([(cluster.node_prefix(0), at(0), at(1)), (cluster.node_prefix(1), at(1), at(0))],
                           seconds=seconds, env=env)
    out = dict(one_way_bps=float(one_way["received_bps"]), duplex_bps=[float(x["received_bps"]) for x in duplex])
    cpu = transfer_cpu(duplex)
    if cpu is not None:
        out["duplex_cpu_ms_per_mb"] = cpu["machine_ms_per_mb"]
    return out


def measure_loopback(megabytes: float = 200.0, env=None) -> Dict[str, object]:
    """The floor any TCP cluster pays: ``megabytes`` each way at once between two processes over a
    loopback (a private, unshaped namespace's, the same kernel path as the host's, with nothing of
    the host's network touched): the two receive rates (``duplex_bps``) and :func:`transfer_cpu`."""
    with Namespace(None) as ns:
        a, b = f"127.0.0.1:{TRANSFER_PORT}", f"127.0.0.1:{TRANSFER_PORT + 1}"
        res = run_transfers([(ns.prefix(), a, b), (ns.prefix(), b, a)], megabytes=megabytes, env=env)
    out = dict(duplex_bps=[float(x["received_bps"]) for x in res])
    out.update(transfer_cpu(res) or {})
    return out


BUSY_KINDS = ("user", "system", "irq", "softirq")
"""The kinds of :func:`cpu_times` that are this machine's own work (``steal`` is the hypervisor's)."""


def cpu_times() -> Optional[Dict[str, float]]:
    """The whole machine's CPU seconds so far by kind (:data:`BUSY_KINDS`, ``user`` with ``nice``, and
    ``steal``; all cores, from /proc/stat), or None where there is no /proc/stat."""
    try:
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    tick = float(os.sysconf("SC_CLK_TCK"))
    return dict(user=(values[0] + values[1]) / tick, system=values[2] / tick, irq=values[5] / tick,
                softirq=values[6] / tick, steal=(values[7] if len(values) > 7 else 0) / tick)


def _own_cpu() -> float:
    """This process's user + system CPU seconds so far, all its threads."""
    import resource
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _mark() -> dict:
    """A point of a transfer: the monotonic clock (shared by every process of the machine), the
    machine's CPU (:func:`cpu_times`) and this process's (:func:`_own_cpu`)."""
    return dict(t=time.perf_counter(), cpu=cpu_times(), own=_own_cpu())


def _receiver(server: socket.socket, result: dict) -> threading.Thread:
    """Accept one connection on ``server`` and record in ``result`` the rate it delivered (``bps``,
    bits/s, from its first :data:`SETTLE_BYTES` to its last bytes; from its first bytes when it
    delivered fewer), the bytes (``bytes``) and a :func:`_mark` taken on accepting it (``accepted``)."""
    def receive():
        conn, _ = server.accept()
        result["accepted"] = _mark()
        n, first, last, settled = 0, None, None, None
        # Into one buffer, as a collective library receives: recv() would allocate (and map) a new
        # 1 MiB object per call, whose cost counts against the link at rates that deliver a packet a call.
        buffer = bytearray(1 << 20)
        while True:
            got = conn.recv_into(buffer)
            if not got:
                break
            now = time.perf_counter()
            if first is None:
                first = (now, n)
            n += got
            last = now
            if settled is None and n >= SETTLE_BYTES:
                settled = (now, n)
        conn.close()
        start_t, start_n = settled if settled is not None and last > settled[0] else (first or (0.0, 0))
        span = (last - start_t) if first is not None else 0.0
        result["bytes"] = n
        result["bps"] = 8.0 * (n - start_n) / span if span > 0 else float("inf")

    th = threading.Thread(target=receive, daemon=True)
    th.start()
    return th


def _send(address: Tuple[str, int], seconds: float, connect_timeout_s: float = 20.0,
          on_connected: Optional[Callable[[], None]] = None, total_bytes: Optional[int] = None) -> None:
    """Connect to ``address`` (retrying until its listener is up), call ``on_connected``, and send for
    ``seconds``, or ``total_bytes`` when given."""
    deadline = time.perf_counter() + connect_timeout_s
    while True:
        try:
            client = socket.create_connection(address, timeout=5.0)
            break
        except OSError:
            if time.perf_counter() > deadline:
                raise
            time.sleep(0.05)
    if on_connected is not None:
        on_connected()
    chunk = memoryview(b"\x00" * (1 << 20))
    if total_bytes is not None:
        left = int(total_bytes)
        while left > 0:
            client.sendall(chunk[:min(left, len(chunk))])
            left -= len(chunk)
    else:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            client.sendall(chunk)
    client.close()


def _transfer_test(seconds: float) -> float:
    """Send for ``seconds`` from one socket to another over 127.0.0.1; the receiver's rate, bits/s."""
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    got: dict = {}
    th = _receiver(server, got)
    _send(server.getsockname(), seconds)
    th.join()
    server.close()
    return got["bps"]


def _address(text: str) -> Tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def main(argv=None) -> int:
    import argparse
    p = argparse.ArgumentParser(description="bulk TCP transfer tests (run inside the bench's namespaces)")
    p.add_argument("command", choices=["measure", "transfer", "gso"],
                   help="measure: over 127.0.0.1 in one process; transfer: between nodes (--listen / --send-to); "
                        "gso: set the GSO size of DEVICES (--size)")
    p.add_argument("devices", nargs="*", metavar="DEVICES")
    p.add_argument("--size", type=int, default=LARGE_PACKET, help="gso: bytes")
    p.add_argument("--seconds", type=float, default=1.0)
    p.add_argument("--megabytes", type=float, default=None,
                   help="transfer: send this many MB (10^6 bytes) instead of for --seconds")
    p.add_argument("--listen", default=None, metavar="ADDR:PORT", help="transfer: receive one connection here")
    p.add_argument("--send-to", default=None, metavar="ADDR:PORT", help="transfer: send to this listener")
    args = p.parse_args(argv)
    if args.command == "measure":
        print(json.dumps({"bps": _transfer_test(args.seconds)}))
        return 0
    if args.command == "gso":
        set_gso_size(args.devices, args.size)
        return 0
    got: dict = {}
    th = None
    if args.listen:
        server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(_address(args.listen))
        server.listen(1)
        th = _receiver(server, got)
    # The marks bound what this process measured: from its sending connection on (or its receiving
    # one when it only receives), so that no process's start-up is counted, to the end of both.
    marks = {}
    if args.send_to:
        total = None if args.megabytes is None else int(args.megabytes * 1e6)
        _send(_address(args.send_to), args.seconds, on_connected=lambda: marks.update(connected=_mark()),
              total_bytes=total)
    if th is not None:
        th.join(timeout=30 + 2 * args.seconds + (args.megabytes or 0))
    end = _mark()
    start = marks.get("connected") or got.get("accepted")
    if args.send_to and got.get("accepted") and got["accepted"]["t"] < start["t"]:
        start = got["accepted"]
    print(json.dumps(dict(received_bps=got.get("bps"), received_bytes=got.get("bytes", 0), start=start, end=end,
                          pid=os.getpid())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
