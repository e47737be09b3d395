"""The CPU that moving bytes costs: the bench's emulated network against the loopback floor.

Each measurement is one duplex bulk TCP transfer (``--megabytes`` each way at once, 10^6 bytes) and
reads the whole machine's CPU from /proc/stat over it, user + system + irq + softirq (steal apart),
per MB delivered in both directions (``deepspeed_acco.bench.network.netns.transfer_cpu``):

* ``loopback``: two processes over a loopback (a private, unshaped namespace's: the same kernel path
  as the host's). No TCP cluster pays less per byte: it is the floor;
* ``cluster RATE``: nodes 0 and 1 of a two-node cluster built as the bench builds it (each node a
  namespace, a veth into a switch namespace's bridge, tbf at RATE per node and direction, or
  unshaped for ``none``).

``--mtu``, ``--gso-size`` and ``--tbf-burst`` set the cluster's MTU (both veth ends and the
bridge), its veths' GSO size and its tbf buckets after the bench has built it, to compare with what
it builds: ``--mtu 1500 --gso-size 65536 --tbf-burst 262144`` is the link it built before.

The machine's other work counts too: each line gives the load average and the machine's busy cores
over the second before, and ``--quiet-below 0.2`` waits (up to ``--quiet-timeout``) until that is
under 0.2 cores. Two figures do not count it. ``procs``: the transfer processes' own user and system
time, which misses the network's softirq work that runs outside them (on an idle core, or in
another process it interrupts). ``perf`` (with ``--perf``, where ``perf`` is installed): samples of
every core (``perf record -a -g``, cpu-clock) within the transfer, counted when they fall in a
transfer process, or in network work (the stack frames of :data:`NETWORK_FRAMES`) that interrupted
another task or ran in ksoftirqd or on an idle core; it is the figure to read on a busy machine
(where other processes' own network traffic can still add a little to it).

    python benchmarks/net_cost.py                                    # loopback, 400mbit and none, 3 each
    python benchmarks/net_cost.py --rates 400mbit --mtu 1500 --gso-size 65536 --tbf-burst 262144 --no-loopback
    python benchmarks/net_cost.py --repeats 5 --quiet-below 0.2        # wait for a quiet machine
"""
import argparse
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from deepspeed_acco.bench.network import netns  # noqa: E402
from deepspeed_acco.bench.network.jobs import child_env  # noqa: E402


NETWORK_FRAMES = re.compile(
    r"net_rx_action|net_tx_action|tcp_tasklet_func|tcp_tsq|qdisc_watchdog|tcp_pace_kick|tcp_delack_timer|"
    r"tcp_write_timer|veth_|br_handle_frame|br_forward|tbf_|__netif_receive_skb|process_backlog|ip_rcv|"
    r"tcp_v4_rcv|__dev_queue_xmit|tcp_write_xmit|tcp_wfree|sock_def_readable|tcp_rcv")
"""Kernel functions of the network's work: a sample with one in its stack, in any task, is the network's."""


class PerfSampler:
    """``perf record -a -g`` (cpu-clock, CLOCK_MONOTONIC) around a measurement; :meth:`attribute`
    counts the samples that belong to the transfers."""

    def __init__(self, hz: int = 2999):
        self.hz = hz
        self.path = f"/tmp/net_cost_{os.getpid()}.perf.data"
        self.proc = None

    def __enter__(self):
        self.proc = subprocess.Popen(["perf", "record", "-a", "-g", "-k", "CLOCK_MONOTONIC", "-e", "cpu-clock",
                                      "-F", str(self.hz), "-o", self.path],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)  # perf is recording
        return self

    def __exit__(self, *exc):
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait()

    def attribute(self, pids, t0: float, t1: float) -> dict:
        """Milliseconds of CPU within [t0, t1] (CLOCK_MONOTONIC seconds): in ``pids``, and network
        work elsewhere (in other tasks, and in the idle task)."""
        script = subprocess.run(["perf", "script", "-i", self.path, "-F", "comm,pid,tid,time,ip,sym"],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True).stdout
        os.unlink(self.path)
        counts = dict(processes=0, elsewhere=0, idle=0)
        for sample in script.split("\n\n"):
            lines = sample.strip().splitlines()
            head = re.match(r"\s*.+?\s+(\d+)/\d+\s+([\d.]+):", lines[0]) if lines else None
            if head is None or not t0 <= float(head.group(2)) <= t1:
                continue
            pid, stack = int(head.group(1)), "\n".join(lines[1:])
            if pid in pids:
                counts["processes"] += 1
            elif NETWORK_FRAMES.search(stack) and (pid == 0 or "irq_exit" in stack or "run_ksoftirqd" in stack):
                counts["idle" if pid == 0 else "elsewhere"] += 1
        return {name: 1e3 * n / self.hz for name, n in counts.items()}


def busy_cores(seconds: float = 1.0) -> float:
    """The machine's busy cores (user + system + irq + softirq) over the next ``seconds``."""
    before = netns.cpu_times()
    time.sleep(seconds)
    after = netns.cpu_times()
    return sum(after[k] - before[k] for k in netns.BUSY_KINDS) / seconds


def wait_quiet(below: float, timeout_s: float) -> float:
    """Wait until two seconds in a row had under ``below`` busy cores; the last second's figure."""
    deadline = time.time() + timeout_s
    busy = busy_cores()
    while time.time() < deadline:
        if busy < below:
            busy = busy_cores()
            if busy < below:
                break
        else:
            busy = busy_cores()
    return busy


def tune(cluster: netns.Cluster, mtu=None, burst=None, gso_size=None) -> None:
    """Set the MTU of every veth end and of the bridge, the veths' GSO size and/or the tbf buckets
    (bytes) of ``cluster``."""
    ends = [(cluster.nodes[k], cluster.node_ifname(k)) for k in range(cluster.num_nodes)]
    ends += [(cluster.switch, cluster.port_ifname(k)) for k in range(cluster.num_nodes)]
    if gso_size is not None:
        for namespace, dev in ends:
            if netns._set_gso_size(namespace, [dev], gso_size) is None:
                raise RuntimeError(f"the kernel refused GSO size {gso_size} on {dev}")
    if mtu is not None:
        for namespace, dev in ends + [(cluster.switch, cluster.bridge)]:
            subprocess.run(["ip", "-n", namespace, "link", "set", "dev", dev, "mtu", str(mtu)], check=True)
    if burst is not None and cluster.bps is not None:
        args = netns.tbf_args(cluster.bps)
        args[args.index("burst") + 1] = str(burst)
        for namespace, dev in ends:
            subprocess.run(["tc", "-n", namespace, "qdisc", "replace", "dev", dev, "root", "tbf"] + args, check=True)


def measure(what: str, bps, megabytes: float, env, mtu=None, burst=None, gso_size=None, perf=False) -> dict:
    sampler = PerfSampler() if perf else contextlib.nullcontext()
    if what == "loopback":
        with netns.Namespace(None) as ns:
            a, b = f"127.0.0.1:{netns.TRANSFER_PORT}", f"127.0.0.1:{netns.TRANSFER_PORT + 1}"
            plan = [(ns.prefix(), a, b), (ns.prefix(), b, a)]
            with sampler:
                res = netns.run_transfers(plan, megabytes=megabytes, env=env)
        out = dict(qdisc="loopback, unshaped")
    else:
        with netns.Cluster(2, bps) as cluster:
            tune(cluster, mtu, burst, gso_size)
            at = [f"{cluster.node_address(k)}:{netns.TRANSFER_PORT}" for k in range(2)]
            plan = [(cluster.node_prefix(0), at[0], at[1]), (cluster.node_prefix(1), at[1], at[0])]
            netns.run_transfers(plan, megabytes=1, env=env)  # neighbours resolved, code paths warm
            with sampler:
                res = netns.run_transfers(plan, megabytes=megabytes, env=env)
            out = dict(qdisc=cluster.qdisc())
    out.update(duplex_bps=[float(x["received_bps"]) for x in res], **(netns.transfer_cpu(res) or {}))
    if perf:
        t0, t1 = min(r["start"]["t"] for r in res), max(r["end"]["t"] for r in res)
        parts = sampler.attribute({r["pid"] for r in res}, t0, t1)
        out["perf_ms_per_mb"] = {name: ms / out["megabytes"] for name, ms in parts.items()}
    return out


def _spread(values) -> str:
    return f"{statistics.median(values):.3f} [{min(values):.3f}-{max(values):.3f}]"


def _perf_text(m: dict) -> str:
    perf = m.get("perf_ms_per_mb")
    if not perf:
        return ""
    return (f", perf {sum(perf.values()):.3f} (in the processes {perf['processes']:.3f}, network work interrupting other "
            f"tasks {perf['elsewhere']:.3f}, on idle cores {perf['idle']:.3f})")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", default="400mbit,none",
                   help="the cluster's link rates, tc style, comma-separated ('none': unshaped; '' for none)")
    p.add_argument("--no-loopback", action="store_true", help="leave out the loopback floor")
    p.add_argument("--megabytes", type=float, default=200.0, help="MB (10^6 bytes) each way per transfer")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--mtu", type=int, default=None, help="the cluster's MTU instead of the bench's")
    p.add_argument("--tbf-burst", type=int, default=None, help="the tbf buckets in bytes instead of the bench's")
    p.add_argument("--gso-size", type=int, default=None, help="the veths' GSO size in bytes instead of the bench's")
    p.add_argument("--quiet-below", type=float, default=None, metavar="CORES",
                   help="before each measurement, wait until the machine's busy cores are under CORES")
    p.add_argument("--quiet-timeout", type=float, default=600.0)
    p.add_argument("--perf", action="store_true", help="also attribute perf samples to the transfers")
    p.add_argument("--json", default=None, help="write every measurement here")
    args = p.parse_args(argv)
    problem = netns.shaping_problem()
    if problem:
        print(problem, file=sys.stderr)
        return 2
    netns.remove_orphans()
    env = child_env(1)
    plan = ([] if args.no_loopback else [("loopback", None)])
    plan += [("cluster", rate.strip()) for rate in args.rates.split(",") if rate.strip()]
    rows = []
    try:
        for repeat in range(args.repeats):
            for what, rate in plan:
                if args.quiet_below is not None:
                    background = wait_quiet(args.quiet_below, args.quiet_timeout)
                else:
                    background = busy_cores()
                load = float(open("/proc/loadavg").read().split()[0])
                bps = netns.parse_bandwidth(rate) if rate else None
                m = measure(what, bps, args.megabytes, env, args.mtu, args.tbf_burst, args.gso_size, args.perf)
                label = "loopback" if what == "loopback" else f"cluster {netns.format_bandwidth(bps)}"
                row = dict(label=label, repeat=repeat, load=load, background_cores=background, **m)
                rows.append(row)
                cpu = m["machine_ms_per_mb"]
                rates = " + ".join(f"{x / 1e6:.0f}" for x in m["duplex_bps"])
                print(f"{label:<26} load {load:5.2f}, {background:4.2f} cores busy before: "
                      f"{sum(cpu.values()):.3f} ms per MB (user {cpu['user']:.3f}, system {cpu['system']:.3f}, "
                      f"softirq {cpu['softirq']:.3f}, irq {cpu['irq']:.3f}; steal {m['steal_ms_per_mb']:.3f}), "
                      f"procs {m['processes_ms_per_mb']:.3f}" + _perf_text(m) + f"; {m['megabytes']:.0f} MB in "
                      f"{m['span_s']:.2f} s, {rates} Mbit/s", flush=True)
    finally:
        netns.cleanup_all()
    print(f"\nmedian [min-max] of {args.repeats}, ms of CPU per MB delivered: the machine's, the transfer processes', "
          f"perf's" + "".join(f"; --{name.replace('_', '-')} {value}" for name, value in
                              (("mtu", args.mtu), ("tbf_burst", args.tbf_burst), ("gso_size", args.gso_size)) if value))
    for label in dict.fromkeys(r["label"] for r in rows):
        mine = [r for r in rows if r["label"] == label]
        line = (f"{label:<26} machine {_spread([sum(r['machine_ms_per_mb'].values()) for r in mine])}, "
                f"procs {_spread([r['processes_ms_per_mb'] for r in mine])}")
        if all("perf_ms_per_mb" in r for r in mine):
            line += f", perf {_spread([sum(r['perf_ms_per_mb'].values()) for r in mine])}"
        loads = [r["load"] for r in mine]
        print(line + f"; load {min(loads):.2f}-{max(loads):.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
