"""A private network namespace whose loopback is rate-limited with ``tc ... tbf``: a slow link.

Every rank of a job runs inside the namespace (``ip netns exec NAME ...``) and talks over its own
loopback, so the shaping applies to all of their traffic and to nothing else on the machine. Both
directions of the rank-to-rank traffic leave through the same ``lo`` queue, so the configured rate
is the *total* over both directions (a ring all-reduce between two ranks that sends both ways at
once gets half of it each way). :func:`measure_rate` times a bulk TCP transfer inside the
namespace so the bench can print the rate the ranks actually get.

Namespaces are named ``acco-<pid>-<n>`` and deleted on exit (also on Ctrl-C / SIGTERM, via the
caller's ``finally``; :func:`cleanup_all` removes any this process created).

``python -m deepspeed_acco.bench.netns measure`` is the transfer test itself (run inside a
namespace by :func:`measure_rate`).
"""
import itertools
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from typing import List, Optional, Tuple

_UNITS = {"": 1.0, "bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
          "k": 1e3, "m": 1e6, "g": 1e9, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9}
_counter = itertools.count()
_created: List[str] = []


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
    """Whether this process can create shaped namespaces; the reason when not."""
    if sys.platform != "linux":
        return False, f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return False, "creating a network namespace needs root (this process is not root)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"'{tool}' (iproute2) is not installed"
    return True, ""


def _run(cmd: List[str]) -> None:
    res = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {res.stderr.strip() or res.stdout.strip()}")


def tbf_args(bps: float) -> List[str]:
    """tbf parameters: the bucket holds ~4 ms of traffic (at least 4 loopback-sized 64 KiB packets, so
    large GSO packets are never dropped for being bigger than the bucket), and the queue 50 ms."""
    rate_bytes = bps / 8.0
    burst = int(max(4 * 65536, rate_bytes * 0.004))
    return ["rate", f"{int(bps)}bit", "burst", str(burst), "latency", "50ms"]


class Namespace:
    """``with Namespace(bps) as ns: subprocess.Popen(ns.prefix() + cmd)``; ``bps=None``: loopback unshaped."""

    def __init__(self, bps: Optional[float]):
        self.bps = bps
        self.name = f"acco-{os.getpid()}-{next(_counter)}"
        self.created = False

    def create(self) -> "Namespace":
        _run(["ip", "netns", "add", self.name])
        self.created = True
        _created.append(self.name)
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
        res = subprocess.run(["tc", "-n", self.name, "qdisc", "show", "dev", "lo"], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
        return res.stdout.strip()

    def delete(self) -> None:
        if self.created:
            subprocess.run(["ip", "netns", "del", self.name], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            self.created = False
            if self.name in _created:
                _created.remove(self.name)

    def __enter__(self):
        return self.create()

    def __exit__(self, *exc):
        self.delete()


def cleanup_all() -> None:
    """Delete every namespace this process created and has not deleted yet."""
    for name in list(_created):
        subprocess.run(["ip", "netns", "del", name], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _created.remove(name)


def remove_orphans() -> List[str]:
    """Delete namespaces named like ours (``acco-<pid>-<n>``) whose creating process is gone.

    A bench killed with SIGKILL cannot clean up; the next bench removes what it left. Namespaces of
    live processes, and any other name, are never touched. Returns the names removed.
    """
    res = subprocess.run(["ip", "netns", "list"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    removed = []
    for line in res.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = re.fullmatch(r"acco-(\d+)-\d+", name)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            if subprocess.run(["ip", "netns", "del", name], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL).returncode == 0:
                removed.append(name)
    return removed


def measure_rate(ns: Optional[Namespace], seconds: float = 1.0, env=None) -> float:
    """Bits/s of a bulk TCP transfer over the loopback inside ``ns`` (one direction, all of the link)."""
    cmd = [sys.executable, "-m", "deepspeed_acco.bench.netns", "measure", "--seconds", str(seconds)]
    if ns is not None:
        cmd = ns.prefix() + cmd
    res = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         timeout=60 + 4 * seconds)
    if res.returncode != 0:
        raise RuntimeError(f"link measurement failed: {res.stderr.strip()[-500:]}")
    return float(json.loads(res.stdout.strip().splitlines()[-1])["bps"])


def _transfer_test(seconds: float) -> float:
    """Send for ``seconds`` from one socket to another over 127.0.0.1; the receiver's rate, bits/s."""
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    got = {}

    def receive():
        conn, _ = server.accept()
        n, first, last = 0, None, None
        while True:
            data = conn.recv(1 << 20)
            if not data:
                break
            now = time.perf_counter()
            if first is None:
                first = now
            n += len(data)
            last = now
        conn.close()
        got.update(n=n, first=first, last=last)

    th = threading.Thread(target=receive, daemon=True)
    th.start()
    client = socket.create_connection(server.getsockname())
    chunk = b"\x00" * (1 << 20)
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        client.sendall(chunk)
    client.close()
    th.join()
    server.close()
    span = (got["last"] - got["first"]) if got.get("first") is not None else 0.0
    return 8.0 * got["n"] / span if span > 0 else float("inf")


def main(argv=None) -> int:
    import argparse
    p = argparse.ArgumentParser(description="bulk TCP transfer test over 127.0.0.1 (run inside a namespace)")
    p.add_argument("command", choices=["measure"])
    p.add_argument("--seconds", type=float, default=1.0)
    args = p.parse_args(argv)
    print(json.dumps({"bps": _transfer_test(args.seconds)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
