"""Time the collectives of one update round, with the job's backend, over the (shaped) link.

``torchrun --nproc_per_node W -m deepspeed_acco.bench.reporting.commprobe --numel P --out FILE`` on every
rank: times ``all_reduce``, ``reduce_scatter_tensor`` and ``all_gather_into_tensor`` of ``P`` fp32
values (the model), and a reduce-scatter followed by an all-gather: the communication round of a
ZeRO-1-style optimizer, once with torch's collectives and once as our engine's communicator runs
it (``engine_round_s``) (ShardedAdamW, DPU, ACCO run one or two per update; DeepSpeed's ZeRO-1 on
CPU runs an all-reduce plus an all-gather). With ``--param-dtype bf16`` (bf16 training) it also
times torch's all-reduce and all-gather in bf16 (``*_model_dtype_s``: DeepSpeed's default under
bf16) and our engine's round as bf16 training runs it (fp32 gradients reduce-scattered, bf16
parameters gathered: ``engine_round_model_dtype_s``) and with ``communication_data_type`` bf16
(``engine_round_bf16comm_s``). Rank 0 writes the best of ``--repeats`` timings, in seconds, as
JSON. The bench runs it once per network so its report can say what one round really costs, next
to the ideal ``bytes / link rate``.

With ``--sizes N1,N2,...`` (element counts) it also times, for each size, torch's ``all_reduce`` and
``all_gather_into_tensor`` of N fp32 values, our communicator's ``reduce_scatter`` (on gloo a ring
of isend/irecv) and ``all_gather``, and its ``all_to_all`` of the same 4 N bytes split as the int8
reduce-scatter splits its send buffer (nothing to itself, an equal slice to every other rank), and
writes them under ``"sizes"``: one entry per size, ``{numel, bytes, <collective>_s, ...}``, from
which :mod:`deepspeed_acco.bench.network.latency` fits a per-message and a per-byte cost for each
collective.
"""
import argparse
import json
import os
import sys
import time
from typing import List


def rate_for_share(share: float, t_compute_s: float, bits_per_round: float, probe_rate_bps: float,
                   probed_round_s: float):
    """The per-direction link rate at which a round takes ``share`` of compute + round.

    A round over a shaped link takes about ``fixed + bits / rate``: ``bits_per_round`` is the volume
    the timed collectives move through the busiest link (report.probe_round_bits: an all-reduce
    counts twice a reduce-scatter), and ``fixed`` (latency, protocol, the reduction's arithmetic) is
    what the round measured at ``probe_rate_bps`` takes beyond ``bits / probe_rate_bps``. Returns ``(rate_bps, fixed_s)``; ``rate_bps`` is None when the fixed part
    alone already exceeds the share (no link rate gets there)."""
    if not 0.0 < share < 1.0:
        raise ValueError(f"the communication share must lie in (0, 1), got {share}")
    fixed = max(0.0, probed_round_s - bits_per_round / probe_rate_bps)
    target = share / (1.0 - share) * t_compute_s  # T_comm with T_comm / (T_compute + T_comm) = share
    if target <= fixed:
        return None, fixed
    return bits_per_round / (target - fixed), fixed


def parse_sizes(text: str) -> List[int]:
    """``"1000,4e6"`` -> [1000, 4000000]; empty -> []. Sizes are element counts, each >= 1."""
    sizes = []
    for item in (x.strip() for x in str(text).split(",") if x.strip()):
        try:
            value = float(item)
        except ValueError:
            raise SystemExit(f"--sizes: {item!r} is not a number; give element counts, e.g. 1000,10000,1e6") from None
        if value < 1 or value != int(value):
            raise SystemExit(f"--sizes: {item!r} is not a positive whole number of elements")
        sizes.append(int(value))
    return sizes


def time_size(numel: int, comm, timed, world: int, rank: int, device) -> dict:
    """Time every collective :mod:`deepspeed_acco.bench.network.latency` models at ``numel`` fp32 values
    (rounded down to a multiple of the world size, at least one value per rank). ``bytes`` is the size
    of the full fp32 vector; each rank sends (W - 1) / W of it in a reduce-scatter, an all-gather or
    the all-to-all, twice that in an all-reduce."""
    import torch
    import torch.distributed as dist
    n = max(world, numel - numel % world)
    x = torch.ones(n, device=device)
    shard = torch.empty(n // world, device=device)
    full = torch.empty(n, device=device)
    # The int8 reduce-scatter's all-to-all: a packed chunk to every other rank, nothing to itself
    # (runtime.compression.QuantizedReduceScatter); here of a fp32 chunk's 4 n / W bytes.
    chunk_bytes = 4 * (n // world)
    split = [0 if peer == rank else chunk_bytes for peer in range(world)]
    send = torch.zeros((world - 1) * chunk_bytes, dtype=torch.uint8, device=device)
    receive = torch.zeros_like(send)
    return dict(numel=n, bytes=4 * n,
                all_reduce_s=timed(lambda: dist.all_reduce(x)),
                all_gather_s=timed(lambda: dist.all_gather_into_tensor(full, shard)),
                engine_reduce_scatter_s=timed(lambda: comm.reduce_scatter(shard, x)),
                engine_all_gather_s=timed(lambda: comm.all_gather(full, shard)),
                all_to_all_s=timed(lambda: comm.all_to_all(receive, send, output_split_sizes=split,
                                                            input_split_sizes=split)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--numel", type=int, required=True)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", required=True)
    p.add_argument("--param-dtype", choices=["fp32", "bf16"], default="fp32",
                   help="the model's dtype (what the parameter all-gather moves)")
    p.add_argument("--sizes", default="",
                   help="comma-separated element counts: also time each collective at each size (for .latency)")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    sizes = parse_sizes(args.sizes)

    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    n = args.numel - args.numel % world
    x = torch.ones(n, device=device)
    shard = torch.empty(n // world, device=device)
    full = torch.empty(n, device=device)

    def timed(fn):
        fn()  # warm-up (connections, buffers)
        best = float("inf")
        for _ in range(max(1, args.repeats)):
            dist.barrier()
            if cuda:
                torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            if cuda:
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t)
        return best

    out = dict(backend=dist.get_backend(), world_size=world, numel=n, bytes_per_value=4,
               all_reduce_s=timed(lambda: dist.all_reduce(x)),
               reduce_scatter_s=timed(lambda: dist.reduce_scatter_tensor(shard, x)),
               all_gather_s=timed(lambda: dist.all_gather_into_tensor(full, shard)))
    out["round_s"] = timed(lambda: (dist.reduce_scatter_tensor(shard, x), dist.all_gather_into_tensor(full, shard)))
    # The same round as our engine runs it (on gloo its reduce-scatter is a ring of sends).
    from deepspeed_acco.runtime.comm import Communicator
    comm = Communicator(dist.group.WORLD, rank, world, "probe", backend=dist.get_backend())
    out["engine_reduce_scatter_s"] = timed(lambda: comm.reduce_scatter(shard, x))
    out["engine_round_s"] = timed(lambda: (comm.reduce_scatter(shard, x), comm.all_gather(full, shard)))
    if args.param_dtype == "bf16":
        xb, shard_b, full_b = x.to(torch.bfloat16), shard.to(torch.bfloat16), full.to(torch.bfloat16)
        # DeepSpeed communicates in the model's dtype by default.
        out["all_reduce_model_dtype_s"] = timed(lambda: dist.all_reduce(xb))
        out["all_gather_model_dtype_s"] = timed(lambda: dist.all_gather_into_tensor(full_b, shard_b))
        out["engine_round_model_dtype_s"] = timed(lambda: (comm.reduce_scatter(shard, x),
                                                           comm.all_gather(full_b, shard_b)))
        out["engine_round_bf16comm_s"] = timed(lambda: (comm.reduce_scatter(shard_b, xb),
                                                        comm.all_gather(full_b, shard_b)))
    if sizes:
        out["sizes"] = [time_size(numel, comm, timed, world, rank, device) for numel in sizes]
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
