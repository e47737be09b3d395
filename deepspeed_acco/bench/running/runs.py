"""One run of the bench: the emulated network it runs on (:class:`Network`) and the command line of
its worker, :mod:`.train` (:func:`worker_args`). The bench's command line (``__main__``) and its
fault runs (:mod:`.faults`) both start runs through these.
"""
import os
from typing import List, Optional

from ..network import netns
from ..network.jobs import Placement
from ..workload.methods import parse_variant


def worker_args(args, method: str, run_dir: str, *, seed: int = 0, target_loss: Optional[float] = None) -> List[str]:
    """The command line of :mod:`.train` for one run of ``method`` (a variant name) with ``seed``."""
    dyn = bool(args.slow_rank) and not args.no_dynamic_accumulation
    out = ["--method", method, "--run-dir", run_dir, "--model", args.model, "--ctx", str(args.ctx),
           "--micro-batch", str(args.micro_batch), "--grad-accum", str(args.grad_accum),
           "--updates", str(args.updates), "--eval-every", str(args.eval_every), "--precision", args.precision,
           "--lr", repr(args.lr), "--warmup", str(args.warmup), "--lr-schedule", args.lr_schedule, "--weight-decay", repr(args.weight_decay),
           "--beta1", repr(args.beta1),
           "--clip", repr(args.clip), "--seed", str(seed),
           "--cache-dir", args.cache_dir or "", "--val-windows", str(args.val_windows), "--threads", str(args.threads)]
    if getattr(args, "keep_denormals", False):
        out += ["--keep-denormals"]
    if args.local_steps is not None:
        out += ["--local-steps", str(args.local_steps)]
    if args.warmup_sync_updates is not None:
        out += ["--warmup-sync-updates", str(args.warmup_sync_updates)]
    if args.sync_after_updates is not None:
        out += ["--sync-after-updates", str(args.sync_after_updates)]
    if target_loss is not None:
        out += ["--target-loss", repr(float(target_loss)), "--max-updates", str(args.max_updates)]
    base = method.split("+")[0]
    if base == "co2" and args.ranks_per_node > 1:
        out += ["--group-size", str(args.ranks_per_node)]
    for flag, value in (("--outer-lr", args.outer_lr), ("--outer-momentum", args.outer_momentum),
                        ("--gap-penalty", args.gap_penalty)):
        if value is not None:
            out += [flag, str(value)]
    if args.data:
        out += ["--data", args.data]
    if args.communication_timeout_s is not None and parse_variant(method).method.ours:
        out += ["--communication-timeout-s", repr(args.communication_timeout_s)]
    if args.slow_rank:
        out += ["--slow-rank", args.slow_rank]
    if dyn and base == "acco":
        out.append("--dynamic-accumulation")
    if args.trace:
        out += ["--trace", os.path.abspath(args.trace)]
    return out


LOOPBACK_FLOOR_MB = 500
"""MB each way of the loopback transfer whose CPU the report gives as the floor (about 0.3 s here)."""


class Network:
    """The emulated network of one link rate, created on entry and removed on exit."""

    def __init__(self, args, bps: Optional[float], shaping_ok: bool, force_private: bool):
        self.args, self.bps = args, bps
        self.cluster = self.namespace = None
        if shaping_ok and args.nodes >= 2:
            self.cluster = netns.Cluster(args.nodes, bps)
        elif shaping_ok and (bps is not None or force_private):
            self.namespace = netns.Namespace(bps)
        nodes = args.nodes if self.cluster is not None else 1
        ranks = args.ranks_per_node if self.cluster is not None else args.nodes * args.ranks_per_node
        self.placement = Placement(nodes, ranks, cluster=self.cluster, namespace=self.namespace)

    def __enter__(self):
        for net in (self.cluster, self.namespace):
            if net is not None:
                net.create()
        return self

    def __exit__(self, *exc):
        for net in (self.cluster, self.namespace):
            if net is not None:
                net.delete()

    def measure(self, threads: int) -> dict:
        """The link as the ranks get it: bulk TCP transfer rates, and the qdisc."""
        from ..network.jobs import child_env
        env = child_env(threads)
        if self.cluster is not None:
            m = netns.measure_cluster(self.cluster, 1.0, env=env)
            # The floor beside it: the same duplex transfer between two processes over a loopback.
            floor = netns.measure_loopback(LOOPBACK_FLOOR_MB, env=env)
            return dict(topology="cluster", nodes=self.args.nodes, ranks_per_node=self.args.ranks_per_node,
                        nominal_bps=self.bps, measured_bps=m["one_way_bps"], duplex_bps=m["duplex_bps"],
                        duplex_cpu_ms_per_mb=m.get("duplex_cpu_ms_per_mb"),
                        loopback_cpu_ms_per_mb=floor.get("machine_ms_per_mb"), qdisc=self.cluster.qdisc())
        if self.namespace is not None:
            return dict(topology="loopback", nominal_bps=self.bps, qdisc=self.namespace.qdisc(),
                        measured_bps=netns.measure_rate(self.namespace, 1.0, env=env))
        return dict(topology="host", nominal_bps=None, qdisc="host loopback",
                    measured_bps=netns.measure_rate(None, 1.0, env=env))

    @staticmethod
    def describe(link: dict, label: str) -> str:
        if link["topology"] == "cluster":
            shaped = (f"each with a full-duplex link shaped with tc tbf to {label} per direction (node egress and "
                      f"switch port)" if link["nominal_bps"] else "each with an unshaped veth link")
            return (f"link: {link['nodes']} emulated nodes x {link['ranks_per_node']} rank(s), {shaped}; bulk TCP "
                    f"transfer node 1 -> node 0 measured {link['measured_bps'] / 1e6:.0f} Mbit/s, both directions at "
                    f"once {link['duplex_bps'][0] / 1e6:.0f} + {link['duplex_bps'][1] / 1e6:.0f} Mbit/s")
        if link["topology"] == "loopback" and link["nominal_bps"]:
            return (f"link: one namespace, loopback shaped with tc tbf to {label}; bulk TCP transfer measured "
                    f"{link['measured_bps'] / 1e6:.0f} Mbit/s (shared by both directions)")
        return (f"link: {'namespace' if link['topology'] == 'loopback' else 'host'} loopback, unshaped, bulk TCP "
                f"transfer {link['measured_bps'] / 1e9:.1f} Gbit/s")
