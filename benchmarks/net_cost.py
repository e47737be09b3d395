"""The CPU that moving bytes costs: the bench's emulated network against the loopback floor.

Each measurement is one duplex bulk TCP transfer (``--megabytes`` each way at once, 10^6 bytes) and
reads the whole machine's CPU from /proc/stat over it, user + system + irq + softirq (steal apart),
per MB delivered in both directions (``deepspeed_acco.bench.netns.transfer_cpu``):

* ``loopback``: two processes over a loopback (a private, unshaped namespace's: the same kernel path
  as the host's). No TCP cluster pays less per byte: it is the floor;
* ``cluster RATE``: nodes 0 and 1 of a two-node cluster built as the bench builds it (each node a
  namespace, a veth into a switch namespace's bridge, tbf at RATE per node and direction, or
  unshaped for ``none``).

``--mtu`` and ``--tbf-burst`` set the cluster's MTU (both veth ends and the bridge) and its tbf
buckets after the bench has built it, to compare other settings with what it builds. The
machine's other work counts too: each line gives the load average and
the machine's busy cores over the second before; ``--quiet-below 0.2`` waits (up to
``--quiet-timeout``) until that is under 0.2 cores first. The transfer processes' own CPU (user and
system, ``procs``) is printed beside: it misses the softirq work that runs outside them (on an idle
core or in another process) but counts nothing of other processes'.

    python benchmarks/net_cost.py                                    # loopback, 400mbit and none, 3 each
    python benchmarks/net_cost.py --rates 400mbit --mtu 1500 --repeats 5 --quiet-below 0.2
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from deepspeed_acco.bench import netns  # noqa: E402
from deepspeed_acco.bench.jobs import child_env  # noqa: E402


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


def tune(cluster: netns.Cluster, mtu, burst) -> None:
    """Set the MTU of every veth end and of the bridge, and/or the tbf buckets (bytes), of ``cluster``."""
    ends = [(cluster.nodes[k], cluster.node_ifname(k)) for k in range(cluster.num_nodes)]
    ends += [(cluster.switch, cluster.port_ifname(k)) for k in range(cluster.num_nodes)]
    if mtu is not None:
        for namespace, dev in ends + [(cluster.switch, cluster.bridge)]:
            subprocess.run(["ip", "-n", namespace, "link", "set", "dev", dev, "mtu", str(mtu)], check=True)
    if burst is not None and cluster.bps is not None:
        args = netns.tbf_args(cluster.bps)
        args[args.index("burst") + 1] = str(burst)
        for namespace, dev in ends:
            subprocess.run(["tc", "-n", namespace, "qdisc", "replace", "dev", dev, "root", "tbf"] + args, check=True)


def measure(what: str, bps, megabytes: float, env, mtu=None, burst=None) -> dict:
    if what == "loopback":
        m = netns.measure_loopback(megabytes, env=env)
        return dict(m, qdisc="loopback, unshaped")
    with netns.Cluster(2, bps) as cluster:
        tune(cluster, mtu, burst)
        at = [f"{cluster.node_address(k)}:{netns.TRANSFER_PORT}" for k in range(2)]
        plan = [(cluster.node_prefix(0), at[0], at[1]), (cluster.node_prefix(1), at[1], at[0])]
        netns.run_transfers(plan, megabytes=1, env=env)  # neighbours resolved, code paths warm
        res = netns.run_transfers(plan, megabytes=megabytes, env=env)
        out = dict(duplex_bps=[float(x["received_bps"]) for x in res], qdisc=cluster.qdisc())
    out.update(netns.transfer_cpu(res) or {})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", default="400mbit,none",
                   help="the cluster's link rates, tc style, comma-separated ('none': unshaped; '' for none)")
    p.add_argument("--no-loopback", action="store_true", help="leave out the loopback floor")
    p.add_argument("--megabytes", type=float, default=200.0, help="MB (10^6 bytes) each way per transfer")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--mtu", type=int, default=None, help="the cluster's MTU instead of the bench's")
    p.add_argument("--tbf-burst", type=int, default=None, help="the tbf buckets in bytes instead of the bench's")
    p.add_argument("--quiet-below", type=float, default=None, metavar="CORES",
                   help="before each measurement, wait until the machine's busy cores are under CORES")
    p.add_argument("--quiet-timeout", type=float, default=600.0)
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
                m = measure(what, bps, args.megabytes, env, args.mtu, args.tbf_burst)
                label = "loopback" if what == "loopback" else f"cluster {netns.format_bandwidth(bps)}"
                row = dict(label=label, repeat=repeat, load=load, background_cores=background, **m)
                rows.append(row)
                cpu = m["machine_ms_per_mb"]
                print(f"{label:<26} load {load:5.2f}, {background:4.2f} cores busy before: "
                      f"{sum(cpu.values()):.3f} ms per MB (user {cpu['user']:.3f}, system {cpu['system']:.3f}, "
                      f"softirq {cpu['softirq']:.3f}, irq {cpu['irq']:.3f}; steal {m['steal_ms_per_mb']:.3f}), "
                      f"procs {m['processes_ms_per_mb']:.3f}; {m['megabytes']:.0f} MB in {m['span_s']:.2f} s, "
                      f"{' + '.join(f'{x / 1e6:.0f}' for x in m['duplex_bps'])} Mbit/s", flush=True)
    finally:
        netns.cleanup_all()
    print(f"\nmedian [min-max] of {args.repeats}, ms of CPU per MB delivered (the machine; the transfer processes)"
          + (f"; --mtu {args.mtu}" if args.mtu else "") + (f"; --tbf-burst {args.tbf_burst}" if args.tbf_burst else ""))
    for label in dict.fromkeys(r["label"] for r in rows):
        mine = [r for r in rows if r["label"] == label]
        machine = [sum(r["machine_ms_per_mb"].values()) for r in mine]
        procs = [r["processes_ms_per_mb"] for r in mine]
        loads = [r["load"] for r in mine]
        print(f"{label:<26} machine {statistics.median(machine):.3f} [{min(machine):.3f}-{max(machine):.3f}], "
              f"procs {statistics.median(procs):.3f} [{min(procs):.3f}-{max(procs):.3f}], "
              f"load {min(loads):.2f}-{max(loads):.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
