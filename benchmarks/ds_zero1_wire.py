"""Bytes on the wire and time per update of DeepSpeed's ZeRO-1 under its communication settings, on gloo.

Runs the bench's DeepSpeed ZeRO-1 (``ds_config("zero1", ...)`` of ``deepspeed_acco.bench.workload.methods``:
the bench's model preset, micro-batches, AdamW and clipping) with one extra piece of
``zero_optimization`` / top-level config per *setting* (:data:`SETTINGS`), one rank per emulated node
(``deepspeed_acco.bench.network.netns.Cluster``: W network namespaces joined by a bridge, optionally
shaped with ``--bandwidth``), and counts, for ``--updates`` updates after ``--warmup`` updates:

* every ``torch.distributed`` collective DeepSpeed calls (wrapped in each rank): how many, of how many
  bytes, and the bytes this rank sends for it on gloo by the algorithm gloo runs (:func:`sent_bytes`);
* the bytes the rank's node really sent: its NIC's ``tx_bytes`` (payload plus TCP/IP headers and the
  acknowledgements it sends for what it receives);
* wall time per update, and the time spent inside the collectives;
* the update's collectives alone: the last update's sequence of collectives replayed ``--replays``
  times on fresh tensors of the same sizes, each after a barrier (the communication without the
  compute around it, which on a shared machine is the steadier time).

``--nodes 1`` puts every rank in one namespace on a shaped loopback instead (the bench's ``--nodes
1``); its ``lo`` counts every rank's bytes, split evenly in the table.

``python benchmarks/ds_zero1_wire.py --world 2 --precision bf16 --out /tmp/ds_wire_w2_bf16.json``
(as root: it creates namespaces; ``--settings default,noallreduce`` picks settings;
``--reduce-scan 1,4,8,32`` measures gloo's reduce alone, per size). Rank 0's numbers
and every rank's bytes are written as JSON; a Markdown table is printed.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

# name -> (config merged into the bench's zero1 config, description). The keys are DeepSpeed's.
SETTINGS = {
    "default": ({}, "DeepSpeed's defaults at stage 1"),
    "noallreduce": ({"zero_optimization": {"use_multi_rank_bucket_allreduce": False}},
                    "use_multi_rank_bucket_allreduce false"),
    "noreducescatter": ({"zero_optimization": {"reduce_scatter": False}}, "reduce_scatter false"),
    "noallreduce_noreducescatter": ({"zero_optimization": {"use_multi_rank_bucket_allreduce": False,
                                                           "reduce_scatter": False}},
                                    "use_multi_rank_bucket_allreduce false, reduce_scatter false"),
    "noallreduce_nocontiguous": ({"zero_optimization": {"use_multi_rank_bucket_allreduce": False,
                                                        "contiguous_gradients": False}},
                                 "use_multi_rank_bucket_allreduce false, contiguous_gradients false"),
    "overlap": ({"zero_optimization": {"overlap_comm": True}}, "overlap_comm true"),
    "noallreduce_overlap": ({"zero_optimization": {"use_multi_rank_bucket_allreduce": False, "overlap_comm": True}},
                            "use_multi_rank_bucket_allreduce false, overlap_comm true"),
    "noallreduce_bucket5e5": ({"zero_optimization": {"use_multi_rank_bucket_allreduce": False,
                                                     "reduce_bucket_size": 500_000}},
                              "use_multi_rank_bucket_allreduce false, reduce_bucket_size 5e5"),
    "noallreduce_bucket1e6": ({"zero_optimization": {"use_multi_rank_bucket_allreduce": False,
                                                     "reduce_bucket_size": 1_000_000}},
                              "use_multi_rank_bucket_allreduce false, reduce_bucket_size 1e6"),
    "noallreduce_bucket1e6_fp32comm": ({"zero_optimization": {"use_multi_rank_bucket_allreduce": False,
                                                              "reduce_bucket_size": 1_000_000},
                                        "communication_data_type": "fp32"},
                                       "use_multi_rank_bucket_allreduce false, reduce_bucket_size 1e6, "
                                       "communication_data_type fp32"),
    "bucket1e6": ({"zero_optimization": {"reduce_bucket_size": 1_000_000}}, "reduce_bucket_size 1e6"),
    "noallreduce_bucket5e5_overlap": ({"zero_optimization": {"use_multi_rank_bucket_allreduce": False,
                                                             "reduce_bucket_size": 500_000, "overlap_comm": True}},
                                      "use_multi_rank_bucket_allreduce false, reduce_bucket_size 5e5, "
                                      "overlap_comm true"),
    "allgatherbucket5e5": ({"zero_optimization": {"allgather_bucket_size": 500_000}}, "allgather_bucket_size 5e5"),
    "fp32comm": ({"communication_data_type": "fp32"}, "communication_data_type fp32"),
    "noallreduce_fp32comm": ({"zero_optimization": {"use_multi_rank_bucket_allreduce": False},
                              "communication_data_type": "fp32"},
                             "use_multi_rank_bucket_allreduce false, communication_data_type fp32"),
    "bf16comm": ({"communication_data_type": "bf16"}, "communication_data_type bf16"),
    "noallreduce_bf16comm": ({"zero_optimization": {"use_multi_rank_bucket_allreduce": False},
                              "communication_data_type": "bf16"},
                             "use_multi_rank_bucket_allreduce false, communication_data_type bf16"),
}

# The torch.distributed functions wrapped in the worker: name -> the argument that holds the data.
COLLECTIVES = {"all_reduce": "tensor", "reduce": "tensor", "broadcast": "tensor",
               "all_gather": "tensor_list", "all_gather_into_tensor": "output_tensor",
               "reduce_scatter": "input_list", "reduce_scatter_tensor": "input",
               "all_to_all_single": "input", "send": "tensor", "isend": "tensor", "gather": "tensor",
               "scatter": "tensor", "barrier": None}


# gloo's reduce cuts the tensor into segments of at most this many bytes (inferred from the bytes its
# reduce sends as the tensor grows: at two ranks the segments are capped from 4 MiB on, 2 W x 1 MiB).
GLOO_REDUCE_MAX_SEGMENT_BYTES = 1 << 20


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def gloo_reduce_sent(nbytes: int, itemsize: int, world: int, rank: int, root: int) -> int:
    """Bytes ``rank`` sends in one gloo ``reduce`` of ``nbytes`` to ``root`` (gloo/reduce.cc): the
    tensor is cut into N segments, N a multiple of W and at least 2 W, of at most
    :data:`GLOO_REDUCE_MAX_SEGMENT_BYTES`; every rank sends N - 2 of them around the ring, then each
    rank but the root sends its chunk of N / W reduced segments to the root. Up to 2 W MiB (N = 2 W)
    that is a reduce-scatter, (W - 1) / W of the tensor, plus 1 / W off the root; past it the ring
    sends more than a reduce-scatter (1 - 2 / N of the tensor)."""
    total = nbytes
    if world <= 1 or total == 0:
        return 0
    cap = itemsize * max(1, GLOO_REDUCE_MAX_SEGMENT_BYTES // itemsize)
    segment = _round_up(min(-(-total // (2 * world)), cap), itemsize)
    segments = _round_up(max(-(-total // segment), 2 * world), world)
    per_rank = segments // world
    sent = 0
    for i in range(segments - 2):
        offset = (((rank + 1) * per_rank + i) * segment) % (segments * segment)
        sent += max(0, min(segment, total - offset))
    if rank != root:
        sent += max(0, min(per_rank * segment, total - rank * per_rank * segment))
    return sent


def sent_bytes(op: str, nbytes: int, world: int, rank: int, root: int = 0, itemsize: int = 4) -> float:
    """Bytes one rank sends for one collective on gloo, ``nbytes`` being the size of the data
    argument (all-gathers: the gathered output; reduce-scatters: the full input).

    * ``all_reduce``: gloo's ring (a reduce-scatter then an all-gather of chunks): 2 (W - 1) / W B;
    * ``reduce``: :func:`gloo_reduce_sent`; for a tensor up to 2 W MiB, (W - 1) / W B (a ring
      reduce-scatter of the whole tensor) plus B / W off the root (its chunk sent to the root);
    * ``all_gather`` / ``all_gather_into_tensor``: a ring, each chunk passed on W - 1 times: (W - 1) / W B;
    * ``reduce_scatter(_tensor)``: counted as an all-reduce (what torch's gloo backend runs for it);
    * ``broadcast``: the root sends B to each other rank (upper bound; not used per update);
    * ``send`` / ``isend``: B; ``barrier``: 0 (a few bytes).
    """
    w = world
    if w <= 1 or op == "barrier":
        return 0.0
    if op in ("all_reduce", "reduce_scatter", "reduce_scatter_tensor"):
        return 2.0 * (w - 1) / w * nbytes
    if op == "reduce":
        return float(gloo_reduce_sent(nbytes, itemsize, w, rank, root))
    if op in ("all_gather", "all_gather_into_tensor", "all_to_all_single"):
        return (w - 1) / w * nbytes
    if op == "broadcast":
        return (w - 1) * nbytes if rank == root else 0.0
    if op in ("send", "isend"):
        return float(nbytes)
    return 0.0  # gather / scatter: not expected


def _nbytes(value) -> int:
    import torch
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


def _tx_bytes(nic: str) -> int:
    with open(f"/sys/class/net/{nic}/statistics/tx_bytes") as f:
        return int(f.read())


def _tcp_counters() -> dict:
    """This network namespace's TCP counters (``/proc/net/snmp``): segments sent and retransmitted."""
    with open("/proc/net/snmp") as f:
        rows = [line.split() for line in f if line.startswith("Tcp:")]
    return {key: int(value) for key, value in zip(rows[0][1:], rows[1][1:]) if key in ("OutSegs", "RetransSegs")}


def replay(sequence, functions, world: int, repeats: int) -> list:
    """Seconds of each of ``repeats`` runs of ``sequence`` (one update's recorded collectives, in
    order, on fresh tensors of the same sizes), each after a barrier: the update's communication on
    the link without the compute around it."""
    import torch
    prepared = []
    for op, _, nbytes, root, _, _, dtype in sequence:
        if op == "barrier" or dtype is None:
            continue
        numel = nbytes // torch.empty((), dtype=dtype).element_size()
        if op == "all_gather_into_tensor":
            out, inp = torch.zeros(numel, dtype=dtype), torch.zeros(numel // world, dtype=dtype)
            prepared.append(lambda out=out, inp=inp: functions[op](out, inp))
        elif op == "reduce":
            x = torch.zeros(numel, dtype=dtype)
            prepared.append(lambda x=x, root=root: functions["reduce"](x, root))
        elif op == "all_reduce":
            x = torch.zeros(numel, dtype=dtype)
            prepared.append(lambda x=x: functions["all_reduce"](x))
        else:
            raise ValueError(f"replay: {op} not handled")
    times = []
    for _ in range(repeats):
        functions["barrier"]()
        t = time.perf_counter()
        for call in prepared:
            call()
        times.append(time.perf_counter() - t)
    return times


def scan_worker(args) -> int:
    """``--reduce-scan``: one gloo ``reduce`` of each size (fp32, to rank 0), the bytes this rank's NIC
    sent for it next to :func:`gloo_reduce_sent`'s count."""
    import torch
    import torch.distributed as tdist
    torch.set_num_threads(1)
    tdist.init_process_group("gloo")
    rank, world = tdist.get_rank(), tdist.get_world_size()
    rows = []
    for megabytes in (float(x) for x in args.reduce_scan.split(",")):
        x = torch.ones(int(megabytes * 1e6 / 4))
        tdist.reduce(x, 0)  # warm-up
        tdist.barrier()
        time.sleep(0.2)
        before = _tx_bytes(args.nic)
        for _ in range(2):
            tdist.reduce(x, 0)
        time.sleep(0.3)
        nbytes = x.numel() * 4
        rows.append(dict(megabytes=megabytes, nic=(_tx_bytes(args.nic) - before) / 2 / nbytes,
                         counted=gloo_reduce_sent(nbytes, 4, world, rank, 0) / nbytes))
        tdist.barrier()
    with open(os.path.join(args.out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(dict(rank=rank, world=world, rows=rows), f)
    tdist.barrier()
    return 0


def worker(args) -> int:
    import functools
    import inspect
    import threading

    import torch
    import torch.distributed as tdist
    torch.set_num_threads(1)
    import deepspeed

    from deepspeed_acco.bench.workload.methods import _merge, ds_config
    from deepspeed_acco.bench.workload.models import build_model

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    extra, _ = SETTINGS[args.setting]
    cfg = ds_config("zero1", world_size=world, micro_batch=args.micro_batch, grad_accum=args.grad_accum, lr=1e-3,
                    total_updates=args.warmup + args.updates, warmup=2, bf16=args.precision == "bf16", torch_adam=True)
    cfg = _merge(cfg, extra)
    deepspeed.init_distributed(dist_backend="gloo")
    model = build_model(args.model, args.ctx, 0)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)

    calls = []  # (op, dtype, nbytes, root, seconds)
    state = threading.local()
    recording = {"on": False}

    def wrap(name, original, argument):
        signature = inspect.signature(original)

        @functools.wraps(original)
        def wrapper(*a, **k):
            if getattr(state, "depth", 0):
                return original(*a, **k)
            state.depth = 1
            t = time.perf_counter()
            try:
                result = original(*a, **k)
            finally:
                state.depth = 0
            if recording["on"]:
                bound = signature.bind(*a, **k)
                data = bound.arguments.get(argument) if argument else None
                root = bound.arguments.get("dst", bound.arguments.get("src", 0))
                group = bound.arguments.get("group")
                dtype = str(getattr(data[0] if isinstance(data, (list, tuple)) else data, "dtype", "")).replace(
                    "torch.", "")
                calls.append((name, dtype, _nbytes(data), int(root or 0), time.perf_counter() - t,
                              tdist.get_world_size(group) if group is not None else world,
                              getattr(data[0] if isinstance(data, (list, tuple)) else data, "dtype", None)))
            return result
        return wrapper

    originals, plain = {}, {}
    for name, argument in COLLECTIVES.items():
        if hasattr(tdist, name):
            plain[name] = getattr(tdist, name)
            originals[getattr(tdist, name)] = wrap(name, getattr(tdist, name), argument)
            setattr(tdist, name, originals[getattr(tdist, name)])
    backend = getattr(sys.modules.get("deepspeed.comm.comm"), "cdb", None)
    for attribute in ("all_gather_function", "reduce_scatter_function"):
        fn = getattr(backend, attribute, None)
        for original, wrapped in list(originals.items()):
            if fn is original:
                setattr(backend, attribute, wrapped)

    gen = torch.Generator().manual_seed(1000 + rank)

    def update():
        for _ in range(args.grad_accum):
            x = torch.randint(0, 256, (args.micro_batch, args.ctx), generator=gen)
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
        return float(loss)

    for _ in range(args.warmup):
        update()
    tdist.barrier()
    time.sleep(0.3)
    tx0, tcp0 = _tx_bytes(args.nic), _tcp_counters()
    recording["on"] = True
    walls, comm = [], []
    for _ in range(args.updates):
        n0 = len(calls)
        t = time.perf_counter()
        loss = update()
        walls.append(time.perf_counter() - t)
        comm.append(sum(c[4] for c in calls[n0:]))
    recording["on"] = False
    time.sleep(0.5)  # let the NIC's queue drain (the last sends were handed to the kernel)
    tx1, tcp1 = _tx_bytes(args.nic), _tcp_counters()
    by_op = {}
    last = calls[n0:]
    rounds = replay(last, plain, world, args.replays)
    for op, dtype, nbytes, root, seconds, group_world, torch_dtype in calls:
        entry = by_op.setdefault(f"{op}[{dtype}]", dict(calls=0, bytes=0, sent=0.0, seconds=0.0))
        entry["calls"] += 1
        entry["bytes"] += nbytes
        itemsize = torch.empty((), dtype=torch_dtype).element_size() if torch_dtype is not None else 1
        entry["sent"] += sent_bytes(op, nbytes, group_world, rank, root, itemsize)
        entry["seconds"] += seconds
    n = args.updates
    out = dict(rank=rank, world=world, setting=args.setting, precision=args.precision, updates=n,
               zero_config=engine.config.get("zero_optimization") if hasattr(engine, "config") else None,
               loss=loss, nic_tx_bytes_per_update=(tx1 - tx0) / n,
               tcp_per_update={key: (tcp1[key] - tcp0[key]) / n for key in tcp0},
               formula_sent_bytes_per_update=sum(e["sent"] for e in by_op.values()) / n,
               calls_per_update={k: v["calls"] / n for k, v in by_op.items()},
               bytes_per_update={k: v["bytes"] / n for k, v in by_op.items()},
               sent_per_update={k: v["sent"] / n for k, v in by_op.items()},
               comm_s_per_update={k: v["seconds"] / n for k, v in by_op.items()},
               wall_s=walls, comm_s=comm, replay_s=rounds,
               last_update_calls=[dict(op=c[0], dtype=c[1], bytes=c[2], root=c[3]) for c in last],
               n_params=sum(p.numel() for p in model.parameters()),
               communication_data_type=str(engine.communication_data_type))
    with open(os.path.join(args.out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f, indent=1)
    tdist.barrier()
    return 0


def places(network, world: int) -> list:
    """(command prefix, master address, interface) of each rank: one rank per node of a
    :class:`~deepspeed_acco.bench.network.netns.Cluster`, or every rank on a shaped loopback
    (:class:`~deepspeed_acco.bench.network.netns.Namespace`, ``--nodes 1``; its ``lo`` counts every rank's bytes)."""
    if hasattr(network, "node_prefix"):
        return [(network.node_prefix(k), network.node_address(0), network.node_ifname(k)) for k in range(world)]
    return [(network.prefix(), "127.0.0.1", "lo")] * world


def run_setting(network, setting: str, args, port: int, out_dir: str) -> list:
    from deepspeed_acco.bench.network.jobs import child_env
    os.makedirs(out_dir, exist_ok=True)
    procs = []
    for k, (prefix, master, nic) in enumerate(places(network, args.world)):
        env = dict(child_env(1), MASTER_ADDR=master, MASTER_PORT=str(port), RANK=str(k),
                   LOCAL_RANK="0", WORLD_SIZE=str(args.world), GLOO_SOCKET_IFNAME=nic)
        argv = prefix + [sys.executable, os.path.abspath(__file__), "--worker", "--setting", setting,
                                         "--precision", args.precision, "--updates", str(args.updates),
                                         "--warmup", str(args.warmup), "--replays", str(args.replays), "--nic", nic,
                                         "--reduce-scan", args.reduce_scan,
                                         "--out-dir", out_dir, "--model", args.model, "--ctx", str(args.ctx),
                                         "--micro-batch", str(args.micro_batch), "--grad-accum", str(args.grad_accum)]
        log = open(os.path.join(out_dir, f"log{k}.txt"), "w")
        procs.append((subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    ok = True
    for proc, log in procs:
        try:
            ok &= proc.wait(timeout=args.timeout) == 0
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            ok = False
        log.close()
    if not ok:
        raise RuntimeError(f"setting {setting} failed; see {out_dir}/log*.txt")
    ranks = []
    for k in range(args.world):
        with open(os.path.join(out_dir, f"rank{k}.json")) as f:
            ranks.append(json.load(f))
    return ranks


def summarize(setting: str, ranks: list, shared: bool = False) -> dict:
    """One row of the table; ``shared``: every rank read the same interface (the loopback), whose
    count is split evenly among them."""
    r0 = ranks[0]
    n_params = r0["n_params"]
    walls = [statistics.median(r["wall_s"]) for r in ranks]
    comms = [statistics.median(r["comm_s"]) for r in ranks]
    return dict(setting=setting, description=SETTINGS[setting][1], world=r0["world"], precision=r0["precision"],
                n_params=n_params, communication_data_type=r0["communication_data_type"],
                calls_per_update=r0["calls_per_update"],
                formula_sent_bytes=[r["formula_sent_bytes_per_update"] for r in ranks],
                nic_tx_bytes=[r["nic_tx_bytes_per_update"] / (len(ranks) if shared else 1) for r in ranks],
                retransmits=[r.get("tcp_per_update", {}).get("RetransSegs") for r in ranks],
                ms_per_update=1000 * max(walls), comm_ms_per_update=1000 * max(comms), loss=r0["loss"],
                replay_ms=1000 * max(statistics.median(r["replay_s"]) for r in ranks),
                replay_min_ms=1000 * max(min(r["replay_s"]) for r in ranks))


def table(rows: list) -> str:
    lines = ["| setting | collectives per update (rank 0) | sent per rank, formula (MB) | NIC tx per rank (MB) | "
             "passes | ms/update | in collectives (ms) | collectives alone (ms) | TCP retransmits |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        model_bytes = r["n_params"] * (2 if r["precision"] == "bf16" else 4)
        w = r["world"]
        mean_sent = sum(r["formula_sent_bytes"]) / len(r["formula_sent_bytes"])
        passes = mean_sent / ((w - 1) / w * model_bytes)
        ops = ", ".join(f"{v:g} {k}" for k, v in sorted(r["calls_per_update"].items()))
        lines.append(f"| {r['setting']} | {ops} | {' / '.join(f'{b / 1e6:.3f}' for b in r['formula_sent_bytes'])} | "
                     f"{' / '.join(f'{b / 1e6:.3f}' for b in r['nic_tx_bytes'])} | {passes:.2f} | "
                     f"{r['ms_per_update']:.0f} | {r['comm_ms_per_update']:.0f} | {r['replay_ms']:.0f} | "
                     f"{' / '.join('?' if x is None else f'{x:g}' for x in r.get('retransmits', []))} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2, help="ranks, one per emulated node")
    p.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated, from {', '.join(SETTINGS)}")
    p.add_argument("--updates", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--bandwidth", default="none", help="each node's link rate per direction (e.g. 300mbit)")
    p.add_argument("--nodes", type=int, choices=[1, 0], default=0,
                   help="0: one rank per emulated node (the bench's --nodes W); 1: every rank on one shaped "
                        "loopback (the bench's --nodes 1, the rate shared by both directions and all ranks)")
    p.add_argument("--model", default="3m")
    p.add_argument("--ctx", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--replays", type=int, default=5, help="timed replays of one update's collectives")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--out", default="ds_zero1_wire.json")
    p.add_argument("--work-dir", default=None)
    p.add_argument("--reduce-scan", default="", metavar="MB,MB,...",
                   help="instead: the bytes one gloo reduce of each size (fp32, MB) sends per rank, measured "
                        "and counted, e.g. 1,4,4.5,8,32")
    p.add_argument("--tabulate", action="store_true",
                   help="run nothing: tabulate the runs already in --work-dir (default: next to --out)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--setting", help=argparse.SUPPRESS)
    p.add_argument("--nic", help=argparse.SUPPRESS)
    p.add_argument("--out-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return scan_worker(args) if args.reduce_scan else worker(args)

    from deepspeed_acco.bench.network import netns
    settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    unknown = [s for s in settings if s not in SETTINGS]
    if unknown:
        raise SystemExit(f"unknown settings {unknown}; choose from {', '.join(SETTINGS)}")
    work = args.work_dir or (os.path.splitext(args.out)[0] + "_runs")
    rows = []
    if args.tabulate:
        for setting in settings:
            folder = os.path.join(work, setting)
            files = sorted(f for f in os.listdir(folder) if f.startswith("rank")) if os.path.isdir(folder) else []
            if files:
                ranks = []
                for name in files:
                    with open(os.path.join(folder, name)) as f:
                        ranks.append(json.load(f))
                rows.append(summarize(setting, sorted(ranks, key=lambda r: r["rank"]), shared=args.nodes == 1))
        print(table(rows))
        return 0
    try:
        bps = netns.parse_bandwidth(args.bandwidth)
        if args.reduce_scan:
            with netns.Cluster(args.world, bps) as network:
                folder = os.path.join(work, "reduce_scan")
                run_setting(network, "default", args, 29690, folder)
            print("| MB | " + " | ".join(f"rank {k}: NIC / counted" for k in range(args.world)) + " |")
            print("|---|" + "---|" * args.world)
            ranks = []
            for k in range(args.world):
                with open(os.path.join(folder, f"rank{k}.json")) as f:
                    ranks.append(json.load(f)["rows"])
            for i, row in enumerate(ranks[0]):
                cells = [f"{r[i]['nic']:.3f} / {r[i]['counted']:.3f}" for r in ranks]
                print(f"| {row['megabytes']:g} | " + " | ".join(cells) + " |")
            return 0
        with (netns.Namespace(bps) if args.nodes == 1 else netns.Cluster(args.world, bps)) as network:
            for i, setting in enumerate(settings):
                ranks = run_setting(network, setting, args, 29700 + i, os.path.join(work, setting))
                rows.append(summarize(setting, ranks, shared=args.nodes == 1))
                print(table(rows[-1:]).splitlines()[-1], flush=True)
                with open(args.out, "w") as f:
                    json.dump(dict(world=args.world, precision=args.precision, bandwidth=args.bandwidth,
                                   nodes=args.nodes, updates=args.updates, warmup=args.warmup, rows=rows), f, indent=1)
    finally:
        netns.cleanup_all()
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
