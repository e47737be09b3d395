"""A latency model of each method's communication, on paper, from measurements.

The emulated links (:mod:`.netns`) are shaped for bandwidth only: this kernel has no ``netem``, so
packet delay cannot be emulated. This module predicts what latency would do instead, with the
alpha-beta model of a collective::

    T(collective) = sequential messages x alpha + bytes through the busiest link x beta

fitted per collective from ``commprobe --sizes`` (:func:`fit_alpha_beta`), plus a count, read from
the code, of the sequential messages each method's communication sends per update
(:func:`sequential_messages`, :func:`messages_per_update`). At a one-way latency ``L`` every
sequential message costs ``alpha + L`` (:func:`predict_ms_per_update`).

Assumptions of the prediction (they are what "one one-way latency per step" needs):

* TCP connections are warm (gloo keeps one connection per pair of ranks for the life of the
  process group) and their window already covers the bandwidth-delay product, so a large message
  streams at the link rate after its first byte arrives ``L`` late; no loss, no retransmission.
* Each sequential step of a ring (a step that must receive from its neighbour before it can send
  the next) costs one one-way latency; messages that are posted together (all-to-all, the two
  directions of a ring step) cost one latency between them.
* gloo's ring all-reduce keeps only two segments of at most 1 MiB in flight per direction
  (gloo/allreduce.cc, ``maxSegmentSize``), so it streams at the link rate only while
  ``L <= 1 MiB / rate`` (84 ms at 100 Mbit/s, 20 ms at 413 Mbit/s, 8.4 ms at 1 Gbit/s); beyond
  that its bandwidth term grows too and the prediction below is optimistic for it
  (:func:`gloo_all_reduce_window_ok` says when).

"Bytes through the busiest link" counts one direction of one node's link with one rank per node,
as :func:`.report.comm_round_seconds` does for ``nodes >= 2``: a reduce-scatter, an all-gather or an
all-to-all of an ``N``-byte vector sends (W - 1) / W x N bytes out of every node, an all-reduce
twice that.

``python -m deepspeed_acco.bench.latency --probe PROBE.json --report BENCH_OUT [--latencies 0.1,2,20]``
prints the fits and, for the methods of a bench report, the table of predicted ms/update.
"""
import argparse
import json
import math
import os
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from .methods import parse_variant

# ----------------------------------------------------------------------------------------------
# The collectives: how many sequential messages one call sends, and how many bytes cross a link

# What commprobe --sizes times for each collective this module models (the key in each "sizes" entry).
PROBE_KEYS = {
    "all_reduce": "all_reduce_s",                  # torch dist.all_reduce on gloo: gloo's ring all-reduce
    "all_gather": "all_gather_s",                  # torch dist.all_gather_into_tensor: gloo's ring all-gather
    "reduce_scatter": "engine_reduce_scatter_s",   # Communicator.reduce_scatter: our ring of isend/irecv
    "engine_all_gather": "engine_all_gather_s",    # Communicator.all_gather: the same gloo all-gather
    "all_to_all": "all_to_all_s",                  # Communicator.all_to_all: gloo's all_to_all_single
}
COLLECTIVES = tuple(PROBE_KEYS)


def sequential_messages(collective: str, world_size: int) -> int:
    """Sequential message steps of one call of ``collective`` among ``world_size`` ranks (0 alone).

    * ``reduce_scatter`` (ours on gloo, runtime.comm.Communicator._ring_reduce_scatter): W - 1
      steps; step s sends to the right neighbour and waits to receive from the left one before it
      adds and sends again.
    * ``all_gather`` / ``engine_all_gather`` (torch's all_gather_into_tensor on gloo: gloo's
      allgather): a ring of W - 1 steps; each step forwards the chunk received in the previous one
      (split in two halves so that two operations are in flight, which does not shorten the chain).
    * ``all_reduce`` (torch's all_reduce of a dense CPU tensor on gloo): ProcessGroupGloo calls
      ``gloo::allreduce`` without choosing an algorithm, which runs the ring: a ring reduce-scatter
      then a ring all-gather, W - 1 dependent steps each, 2 (W - 1) in all. (gloo pipelines
      segments of at most 1 MiB, two in flight, inside each step; that hides the segments' latency
      behind the bandwidth while the window covers the bandwidth-delay product, see the module
      docstring, but not the dependency of a step on the previous one. gloo's shared-memory
      all-reduce applies only when all ranks are on one host as torchrun reports it,
      LOCAL_WORLD_SIZE == world size, never between our emulated nodes.)
    * ``all_to_all`` (gloo's alltoallv, what all_to_all_single runs): every rank posts its W - 1
      sends and receives at once and then waits for all of them; the W - 1 pairwise exchanges are
      concurrent, so one call costs one latency (its volume, (W - 1) / W of the vector per node,
      goes through the link term).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if collective not in PROBE_KEYS:
        raise ValueError(f"unknown collective {collective!r}; choose from {', '.join(COLLECTIVES)}")
    if world_size == 1:
        return 0
    if collective == "all_reduce":
        return 2 * (world_size - 1)
    if collective == "all_to_all":
        return 1
    return world_size - 1


def link_bytes(collective: str, vector_bytes: float, world_size: int) -> float:
    """Bytes one node's link carries in each direction for one call on a vector of ``vector_bytes``
    (all W chunks; the all-to-all's send buffer plus the chunk a rank keeps), one rank per node."""
    if collective not in PROBE_KEYS:
        raise ValueError(f"unknown collective {collective!r}; choose from {', '.join(COLLECTIVES)}")
    share = (world_size - 1) / world_size
    return (2.0 if collective == "all_reduce" else 1.0) * share * vector_bytes


def gloo_all_reduce_window_ok(latency_s: float, link_bps: float, segment_bytes: int = 1 << 20) -> bool:
    """Whether gloo's ring all-reduce (two segments of ``segment_bytes`` in flight) still streams at
    ``link_bps`` with one-way latency ``latency_s``: a pair of segments takes ``2 S / rate`` to send
    and the next may go once the segment two back has arrived, ``L + S / rate`` after it left."""
    return latency_s <= segment_bytes * 8.0 / link_bps


# ----------------------------------------------------------------------------------------------
# Fitting alpha and beta from commprobe --sizes

def fit_alpha_beta(points: Sequence[Tuple[float, float]], messages: int, *, relative: bool = True) -> Dict[str, float]:
    """Least squares of ``t = a + b * bytes`` over ``points`` = [(bytes through the busiest link, seconds)].

    ``messages`` is the collective's sequential message count at the probed world size
    (:func:`sequential_messages`): ``alpha_s = a / messages`` is the cost of one message step,
    ``beta_s_per_byte = b`` the cost of a byte through the link (8 / beta is the rate it streams at).

    ``relative`` (default) weights each point by 1 / t^2, i.e. minimises the relative residuals:
    the sizes span three to four decades, and with plain least squares the noise of the largest
    transfers (a few ms) would swamp an intercept of a fraction of a millisecond. Returns
    ``alpha_s, beta_s_per_byte, intercept_s, r2`` (of the weighted fit), ``max_rel_residual``,
    ``points``, ``messages`` and ``rate_bps`` (8 / beta, inf if beta <= 0).
    """
    pts = [(float(x), float(t)) for x, t in points]
    if len(pts) < 2:
        raise ValueError(f"fit_alpha_beta needs at least 2 (bytes, seconds) points, got {len(pts)}: run "
                         "commprobe with --sizes listing two or more sizes (e.g. --sizes 1000,27600,762000,4000000)")
    if len({x for x, _ in pts}) < 2:
        raise ValueError("fit_alpha_beta needs at least 2 distinct sizes (all points have the same byte count); "
                         "give --sizes distinct element counts")
    if any(t <= 0 or not math.isfinite(t) for _, t in pts) or any(x < 0 or not math.isfinite(x) for x, _ in pts):
        raise ValueError(f"fit_alpha_beta needs finite bytes >= 0 and times > 0, got {pts}")
    if messages < 1:
        raise ValueError(f"messages must be >= 1 (the collective's sequential steps), got {messages}")
    w = [1.0 / t ** 2 if relative else 1.0 for _, t in pts]
    sw = sum(w)
    mx = sum(wi * x for wi, (x, _) in zip(w, pts)) / sw
    mt = sum(wi * t for wi, (_, t) in zip(w, pts)) / sw
    sxx = sum(wi * (x - mx) ** 2 for wi, (x, _) in zip(w, pts))
    sxt = sum(wi * (x - mx) * (t - mt) for wi, (x, t) in zip(w, pts))
    b = sxt / sxx
    a = mt - b * mx
    residual = sum(wi * (t - a - b * x) ** 2 for wi, (x, t) in zip(w, pts))
    total = sum(wi * (t - mt) ** 2 for wi, (_, t) in zip(w, pts))
    return dict(alpha_s=a / messages, beta_s_per_byte=b, intercept_s=a,
                r2=1.0 - residual / total if total > 0 else 1.0,
                max_rel_residual=max(abs(t - a - b * x) / t for x, t in pts),
                points=len(pts), messages=messages, rate_bps=8.0 / b if b > 0 else math.inf)


def shaper_bucket_bytes(probe: dict) -> Optional[int]:
    """The token bucket (bytes) of the tbf that shaped the probe's link, as :func:`.netns.tbf_args`
    sets it for the link's nominal rate; None when the probe does not say what link it ran on."""
    bps = (probe.get("link") or {}).get("nominal_bps")
    if not bps:
        return None
    from .netns import tbf_args
    args = tbf_args(float(bps))
    return int(args[args.index("burst") + 1])


# Sizes that are in neither regime (between one and this many buckets through the link) are left out.
BUCKET_MARGIN = 4


def probe_points(probe: dict, collective: str, bucket_bytes: Optional[int] = None) -> List[Tuple[float, float]]:
    """(bytes the link throttles, seconds) of ``collective`` at the sizes of a ``commprobe --sizes`` JSON.

    Without ``bucket_bytes`` the bytes are those through the busiest link (:func:`link_bytes`). With
    it (the emulated link's tbf bucket, :func:`shaper_bucket_bytes`) the points follow what the
    shaper does: a call whose bytes fit in the bucket passes at the veth's speed, so it counts 0
    throttled bytes and measures the per-message cost alone; a call of ``BUCKET_MARGIN`` buckets or
    more is throttled for (nearly) all of its bytes; the sizes in between, partly carried by the
    bucket, are left out. (A real NIC serialises every byte at its rate; the fit's beta is that
    rate's cost, its alpha the per-message cost.)
    """
    sizes = probe.get("sizes")
    if not sizes:
        raise ValueError("the probe JSON has no \"sizes\": run python -m deepspeed_acco.bench.commprobe with "
                         "--sizes N1,N2,... (element counts) to time the collectives at several sizes")
    world = int(probe["world_size"])
    key = PROBE_KEYS[collective]
    points = []
    for s in sizes:
        if key not in s:
            continue
        x = link_bytes(collective, s["bytes"], world)
        if bucket_bytes is not None:
            if x <= bucket_bytes:
                x = 0.0
            elif x < BUCKET_MARGIN * bucket_bytes:
                continue
        points.append((x, s[key]))
    return points


def fit_probe(probe: dict, *, relative: bool = True, bucket: bool = True) -> Dict[str, Dict[str, float]]:
    """:func:`fit_alpha_beta` of every collective of a ``commprobe --sizes`` JSON; ``bucket``: treat the
    emulated link's token bucket as :func:`probe_points` says (when the probe records its link)."""
    world = int(probe["world_size"])
    if world < 2:
        raise ValueError("a probe of one rank sends no messages; probe on two or more ranks")
    bucket_bytes = shaper_bucket_bytes(probe) if bucket else None
    return {c: dict(fit_alpha_beta(probe_points(probe, c, bucket_bytes), sequential_messages(c, world),
                                   relative=relative), bucket_bytes=bucket_bytes)
            for c in COLLECTIVES}


# ----------------------------------------------------------------------------------------------
# What each method sends per update

@dataclass(frozen=True)
class Call:
    """One collective a method calls: ``count`` times per update, on a vector of ``vector_bytes``,
    among ``ranks`` ranks (one per node)."""
    collective: str
    vector_bytes: float
    count: float
    what: str
    ranks: int

    @property
    def messages(self) -> int:
        return sequential_messages(self.collective, self.ranks)

    @property
    def link_bytes(self) -> float:
        return link_bytes(self.collective, self.vector_bytes, self.ranks)


# DeepSpeed's ZeroStageEnum defaults (deepspeed/runtime/zero/config.py); the bench's ds_config sets neither.
DEEPSPEED_REDUCE_BUCKET_SIZE = 500_000_000
DEEPSPEED_ALLGATHER_BUCKET_SIZE = 500_000_000
# Our jobs' statistics all-reduce: [sum of squared norms, micro-batches], float64 (runtime.jobs).
JOB_STATISTICS_BYTES = 2 * 8


def _model_bytes(precision: str) -> float:
    if precision not in ("fp32", "bf16", "fp16"):
        raise ValueError(f"precision must be fp32, bf16 or fp16, got {precision!r}")
    return 4.0 if precision == "fp32" else 2.0


def method_calls(method: str, world_size: int, n_params: int, *, precision: str = "fp32", local_steps: int = 4,
                 group_size: int = 1, flat_groups: int = 1,
                 reduce_bucket_size: int = DEEPSPEED_REDUCE_BUCKET_SIZE) -> Tuple[List[Call], dict]:
    """The collectives ``method`` (a bench variant name: ``zero1``, ``sharded``, ``dpu``, ``acco``,
    ``acco+q8``, ``co2``, with modifiers ``bf16comm``/``fp32comm``/``q8``/``q4`` on ours) calls per
    update on ``n_params`` values, and how it overlaps them: ``(calls, schedule)``.

    Read from the code (DeepSpeed 0.19 and this package); one rank per node, ``flat_groups`` flat
    groups (the bench passes ``model.parameters()``: one param group, one flat group):

    * ``zero1`` (DeepSpeed's stage_1_and_2 on gloo, not overlapped: ``overlap_comm`` defaults to
      stage 3 only). Backward's epilogue all-reduces the gradient bucket: ``reduce_scatter`` True
      with ``use_multi_rank_bucket_allreduce`` True takes ``allreduce_and_scatter``, one
      ``dist.all_reduce`` per ``reduce_bucket_size`` elements (default 5e8, so
      ceil(P / 5e8) calls), in the gradients' dtype (the model's). ``step`` all-reduces the
      overflow flag (one byte; bf16's ``check_grad_overflow`` defaults to True, fp16 always, fp32
      never) and the squared gradient norm (one fp32), then gathers the parameters with one
      ``all_gather_into_tensor`` per param group (``all_gather_dp_groups`` takes that path whenever
      torch has it; ``allgather_bucket_size`` only splits the older ``all_gather`` fallback).
    * ``sharded`` / ``dpu`` (runtime.jobs.ShardUpdateJob, one job per update): per flat group a
      reduce-scatter of the gradients (model dtype, or ``communication_data_type``), one sum of
      the job's statistics (two float64; on gloo an all-gather and a local sum,
      ``SMALL_ALL_REDUCE_NUMEL``), per flat group an all-gather of the parameters (model dtype). ShardedAdamW waits for it; DPU overlaps it with the next round's compute.
    * ``acco``: two such jobs per update (the estimate and the commit), each overlapped.
    * ``+q8`` / ``+q4`` (runtime.compression): the reduce-scatter becomes one all-to-all of packed
      chunks (1 + 4/128 bytes per value for int8 with block 128) and the all-gather gathers packed
      deltas, in a ring as before.
    * ``co2`` (runtime.optimizers.co2): every ``local_steps`` inner steps one outer job on all ranks:
      reduce-scatter of the displacements (fp32 unless ``communication_data_type`` is given), a
      sum (all-gathered) of W / group_size + 2 float64 statistics, an all-gather of the new anchor (fp32,
      ``OuterState.gather``). The inner steps run on a group of ``group_size`` ranks; with the
      default group_size 1 the group communicator is local and an inner step sends nothing (no
      statistics all-reduce crosses a link). With group_size g > 1 every inner step is a
      ShardedAdamW job among g ranks.

    ``schedule``: ``{"kind": "sequential" | "overlapped" | "co2", "jobs_per_update", "local_steps",
    "merge_steps"}`` for :func:`predict_ms_per_update`.
    """
    if world_size < 1 or n_params < 1:
        raise ValueError(f"world_size and n_params must be >= 1, got {world_size}, {n_params}")
    variant = parse_variant(method)
    base = variant.method.name
    model = _model_bytes(precision)
    grad, param = variant.comm_bytes("bf16" if model == 2.0 else "fp32")
    P, W = float(n_params), world_size
    calls: List[Call] = []

    def job(count: float, ranks: int, grad_bytes: float, param_bytes: float, quantised_grads: bool,
            stats_bytes: float, label: str) -> None:
        rs = "all_to_all" if quantised_grads else "reduce_scatter"
        calls.append(Call(rs, P * grad_bytes, count * flat_groups, f"{label}: gradient {rs}", ranks))
        # runtime.comm.Communicator.all_reduce on gloo: a small tensor is all-gathered and summed
        # (W - 1 sequential messages, not the ring all-reduce's 2 (W - 1)).
        calls.append(Call("all_gather", stats_bytes * ranks, count, f"{label}: statistics (all-gathered, summed)",
                          ranks))
        calls.append(Call("engine_all_gather", P * param_bytes, count * flat_groups, f"{label}: parameter all-gather",
                          ranks))

    quantised = any(m.name in ("q8", "q4") for m in variant.modifiers)
    if base == "zero1":
        buckets = math.ceil(P / reduce_bucket_size)
        calls.append(Call("all_reduce", P * grad, buckets, f"gradient all-reduce ({buckets} bucket(s) of <= "
                          f"{reduce_bucket_size:.0e} elements)", W))
        if precision in ("bf16", "fp16"):
            calls.append(Call("all_reduce", 1, 1, "overflow-flag all-reduce", W))
        calls.append(Call("all_reduce", 4, 1, "gradient-norm all-reduce", W))
        calls.append(Call("all_gather", P * param, flat_groups, "parameter all_gather_into_tensor", W))
        schedule = dict(kind="sequential", jobs_per_update=1)
    elif base in ("sharded", "dpu", "acco"):
        jobs = 2.0 if base == "acco" else 1.0
        job(jobs, W, grad, param, quantised, JOB_STATISTICS_BYTES, "job")
        schedule = dict(kind="sequential" if base == "sharded" else "overlapped", jobs_per_update=jobs)
    elif base == "co2":
        if local_steps < 1 or group_size < 1 or W % group_size:
            raise ValueError(f"co2: local_steps >= 1 and a group_size dividing the world size, got local_steps="
                             f"{local_steps}, group_size={group_size}, world_size={W}")
        weights_modified = any(m.parameter_bytes is not None for m in variant.modifiers)
        outer_param = param if weights_modified else 4.0  # the anchor is gathered in fp32
        job(1.0 / local_steps, W, grad, outer_param, quantised, (W // group_size + 2) * 8, "outer job")
        if group_size > 1:  # every inner step: ShardedAdamW's job among the group, model dtypes
            inner_grad = model if not any(m.gradient_bytes for m in variant.modifiers) else grad
            job(1.0, group_size, inner_grad, model if not weights_modified else param, quantised,
                JOB_STATISTICS_BYTES, "inner step")
        schedule = dict(kind="co2", jobs_per_update=1.0 / local_steps, local_steps=local_steps)
    else:
        raise ValueError(f"{method!r}: the latency model covers zero1, sharded, dpu, acco and co2 (with modifiers); "
                         f"{base} is not modelled")
    return calls, schedule


def messages_per_update(method: str, world_size: int, n_params: int, **options) -> dict:
    """Sequential messages and bytes through the busiest link, per update, of ``method``.

    ``options``: :func:`method_calls`'s. Returns ``{"method", "world_size", "messages",
    "link_bytes", "calls": [...], "schedule": {...}}``; ``messages`` and ``link_bytes`` are per
    update (CO2's outer job counts 1 / local_steps per update; ``schedule`` keeps the per-round
    figures for its prediction)."""
    calls, schedule = method_calls(method, world_size, n_params, **options)
    return dict(method=method, world_size=world_size,
                messages=sum(c.count * c.messages for c in calls),
                link_bytes=sum(c.count * c.link_bytes for c in calls),
                calls=[dict(collective=c.collective, what=c.what, vector_bytes=c.vector_bytes, count=c.count,
                            ranks=c.ranks, messages=c.messages, link_bytes=c.link_bytes) for c in calls],
                schedule=schedule)


def comm_seconds(traffic: dict, fits: Dict[str, Dict[str, float]], *, beta_scale: float = 1.0) -> float:
    """The model's communication time per update at the probed link (no added latency):
    sum over calls of count x (alpha x messages + beta x link bytes), with each collective's fit.
    ``beta_scale`` rescales the per-byte term (probe rate / run rate when the run's link differs)."""
    total = 0.0
    for c in traffic["calls"]:
        fit = fits[c["collective"]]
        total += c["count"] * (max(fit["alpha_s"], 0.0) * c["messages"]
                               + fit["beta_s_per_byte"] * beta_scale * c["link_bytes"])
    return total


# What the bench's own probe (commprobe without --sizes, at the model's size, on the run's link) timed:
# DeepSpeed's collectives by bytes per value, and our engine's reduce-scatter + all-gather pair.
_BENCH_PROBE_SINGLE = {("all_reduce", 4.0): "all_reduce_s", ("all_reduce", 2.0): "all_reduce_model_dtype_s",
                       ("all_gather", 4.0): "all_gather_s", ("all_gather", 2.0): "all_gather_model_dtype_s"}
_BENCH_PROBE_PAIR = {(4.0, 4.0): "engine_round_s", (4.0, 2.0): "engine_round_model_dtype_s",
                     (2.0, 2.0): "engine_round_bf16comm_s"}
# Calls smaller than this (the statistics and flag all-reduces) always take the fitted time.
SMALL_CALL_BYTES = 4096


def measured_comm_seconds(traffic: dict, bench_probe: dict, fits: Dict[str, Dict[str, float]], n_params: int,
                          *, beta_scale: float = 1.0) -> Optional[float]:
    """Communication per update from the bench's own probe at the model's size where it timed the
    method's large collectives (DeepSpeed's all-reduce and all-gather; our engine's reduce-scatter +
    all-gather pair, in the method's dtypes), the small ones from the fit; None when a large one
    was not timed there (e.g. the int8 collectives)."""
    total = 0.0
    calls = traffic["calls"]
    used = set()
    for i, c in enumerate(calls):
        if i in used:
            continue
        if c["vector_bytes"] < SMALL_CALL_BYTES:
            fit = fits[c["collective"]]
            total += c["count"] * (max(fit["alpha_s"], 0.0) * c["messages"]
                                   + fit["beta_s_per_byte"] * beta_scale * c["link_bytes"])
            continue
        per_value = round(c["vector_bytes"] / n_params, 3)
        key = _BENCH_PROBE_SINGLE.get((c["collective"], per_value))
        if key is None and c["collective"] == "reduce_scatter":
            # Our job: its reduce-scatter pairs with the next large all-gather of the same count.
            partner = next((j for j in range(i + 1, len(calls)) if calls[j]["collective"] == "engine_all_gather"
                            and calls[j]["count"] == c["count"] and j not in used), None)
            if partner is not None:
                key = _BENCH_PROBE_PAIR.get((per_value, round(calls[partner]["vector_bytes"] / n_params, 3)))
                used.add(partner)
        if key is None or key not in bench_probe:
            return None
        total += c["count"] * bench_probe[key]
    return total


# ----------------------------------------------------------------------------------------------
# The prediction

def _model_seconds(schedule: dict, t_compute: float, t_comm_update: float) -> float:
    """Per-update time without overhead. ``t_comm_update``: communication per update (CO2: its outer
    job's time divided by local_steps)."""
    kind = schedule["kind"]
    if kind == "sequential":
        return t_compute + t_comm_update
    if kind == "overlapped":
        return max(t_compute, t_comm_update)
    if kind == "co2":
        # The outer job launched at a boundary must be done ``merge_steps`` inner steps later (eager
        # merge, the default H = 1; the paper's rule: local_steps); what it takes beyond that is
        # waited once per round of local_steps updates.
        tau = schedule["local_steps"]
        merge = schedule.get("merge_steps") or tau
        return t_compute + max(0.0, t_comm_update * tau - merge * t_compute) / tau
    raise ValueError(f"unknown schedule kind {kind!r}")


def predict_ms_per_update(traffic: dict, *, t_compute_s: float, t_comm_s: float, latencies_s: Sequence[float],
                          t_measured_s: Optional[float] = None, merge_steps: Optional[int] = 1) -> dict:
    """Predicted seconds per update of one method at each one-way latency in ``latencies_s``.

    ``traffic``: :func:`messages_per_update`'s; ``t_comm_s``: its communication per update at the
    probed link (:func:`comm_seconds`, or a measurement). At latency L, T_comm(L) = t_comm_s +
    messages x L (every sequential message costs alpha + L). Then

    * not overlapped (DeepSpeed ZeRO-1, ShardedAdamW): T = T_compute + T_comm(L);
    * overlapped (DPU, ACCO): T = max(T_compute, T_comm(L)) (ACCO's two jobs per update are both in
      T_comm: each must fit under half an update's compute);
    * CO2: T = T_compute + max(0, tau T_comm(L) - H T_compute) / tau: the outer job (tau T_comm per
      round of tau = local_steps updates) must finish H = ``merge_steps`` inner steps after its
      launch (eager merge, default 1; None: the paper's rule, H = tau);

    plus ``overhead`` = t_measured - (the same model at L = 0), clamped at >= 0, when
    ``t_measured_s`` is given: what the run cost beyond the model at the probed link (the CPU that
    communication takes from compute, the optimizer step, waits the model does not see), assumed
    not to change with latency. It is applied to every method alike, so that each prediction starts
    from its own measurement. Returns ``{"overhead_s", "model_s" (at L = 0), "predicted_s": {L: s}}``.
    """
    if t_compute_s <= 0 or t_comm_s < 0:
        raise ValueError(f"t_compute_s must be > 0 and t_comm_s >= 0, got {t_compute_s}, {t_comm_s}")
    if any(L < 0 for L in latencies_s):
        raise ValueError(f"latencies must be >= 0 seconds, got {list(latencies_s)}")
    schedule = dict(traffic["schedule"], merge_steps=merge_steps)
    model0 = _model_seconds(schedule, t_compute_s, t_comm_s)
    overhead = 0.0 if t_measured_s is None else max(0.0, t_measured_s - model0)
    predicted = {L: _model_seconds(schedule, t_compute_s, t_comm_s + traffic["messages"] * L) + overhead
                 for L in latencies_s}
    return dict(overhead_s=overhead, model_s=model0, predicted_s=predicted)


# ----------------------------------------------------------------------------------------------
# The command line: a bench report + a probe -> markdown

def _check_probe(probe: dict, path: str) -> None:
    if not probe.get("sizes"):
        raise SystemExit(f"{path}: no \"sizes\" in this probe; run python -m deepspeed_acco.bench.commprobe with "
                         "--sizes N1,N2,... on the emulated link first")


def _select_link(results: dict, probe_bps: Optional[float], wanted: Optional[str]) -> Tuple[str, dict]:
    links = results.get("link") or {}
    if not links:
        raise SystemExit("the bench report has no \"link\" section (a run without an emulated network?)")
    if wanted:
        if wanted not in links:
            raise SystemExit(f"--bandwidth {wanted!r}: the report's links are {', '.join(links)}")
        return wanted, links[wanted]
    if probe_bps:  # the link closest to the probe's rate
        label = min(links, key=lambda k: abs(math.log((links[k].get("measured_bps") or probe_bps) / probe_bps)))
        return label, links[label]
    label = next(iter(links))
    return label, links[label]


def _fmt_ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f}" if seconds * 1e3 >= 100 else f"{seconds * 1e3:.1f}"


def _fmt_count(x: float) -> str:
    return f"{x:.0f}" if abs(x - round(x)) < 1e-9 else f"{x:.2f}"


def report_markdown(probe: dict, results: dict, latencies_ms: Sequence[float], *, probe_path: str = "",
                    report_path: str = "", bandwidth: Optional[str] = None, relative: bool = True,
                    bucket: bool = True) -> str:
    """The markdown the CLI prints: the fits, the per-method counts and the predicted table."""
    fits = fit_probe(probe, relative=relative, bucket=bucket)
    bucket_bytes = next(iter(fits.values()))["bucket_bytes"]
    probe_bps = (probe.get("link") or {}).get("measured_bps")
    label, link = _select_link(results, probe_bps, bandwidth)
    run_bps = link.get("measured_bps")
    beta_scale = probe_bps / run_bps if probe_bps and run_bps else 1.0
    args = results.get("args", {})
    world = int(args.get("nodes", 2)) * int(args.get("ranks_per_node", 1))
    if int(args.get("ranks_per_node", 1)) != 1:
        raise SystemExit("the model counts one rank per node; this report ran several ranks per node")
    precision = args.get("precision", "fp32")
    n_params = int(results["n_params"])
    local_steps = int(args.get("local_steps") or 4)
    rows = [r for r in results.get("table", []) if r.get("bandwidth") == label]
    compute = [r for r in rows if r["method"] == "compute"]
    if not compute:
        raise SystemExit(f"the report has no compute-only row at {label}: T_compute is needed (run the bench "
                         "without --no-compute-only)")
    t_compute = compute[0]["ms_per_update"] / 1e3
    lat_s = [L / 1e3 for L in latencies_ms]

    out = [f"# Latency model: {os.path.basename(os.path.normpath(report_path)) or 'report'} at {label}", ""]
    out.append(f"Probe: `{probe_path}` ({probe.get('backend')}, W = {probe.get('world_size')}, link "
               f"{(probe_bps or 0) / 1e6:.0f} Mbit/s measured, best of {probe.get('repeats', '?')} per size, "
               f"{len(probe['sizes'])} sizes {probe['sizes'][0]['numel']}..{probe['sizes'][-1]['numel']} fp32 "
               "values). Bench report: "
               f"`{report_path}` ({label}, {(run_bps or 0) / 1e6:.0f} Mbit/s measured, W = {world}, {precision}, "
               f"P = {n_params} parameters, T_compute = {t_compute * 1e3:.0f} ms/update from its compute-only run).")
    if abs(beta_scale - 1.0) > 1e-9:
        out.append(f"The per-byte costs are scaled by probe rate / run rate = {beta_scale:.3f}.")
    out += ["", "## Fitted alpha and beta (t = messages x alpha + link bytes x beta, least squares on relative "
            "residuals)" if relative else "## Fitted alpha and beta (plain least squares)", ""]
    if bucket_bytes:
        out += [f"The link's tbf bucket holds {bucket_bytes} bytes: calls whose bytes through the link fit in it "
                "count 0 throttled bytes (they pass at the veth's speed and measure alpha), calls of "
                f"{BUCKET_MARGIN} buckets or more count all their bytes (they measure beta), the sizes in between "
                "are left out.", ""]
    out += ["| collective | sequential messages | points | alpha (ms per message) | beta (ns per link byte) | "
            "rate 8/beta (Mbit/s) | r2 | max rel. residual |", "|---|---|---|---|---|---|---|---|"]
    for c, f in fits.items():
        out.append(f"| {c} | {f['messages']} | {f['points']} | {f['alpha_s'] * 1e3:.3f} | "
                   f"{f['beta_s_per_byte'] * 1e9:.2f} | {f['rate_bps'] / 1e6:.1f} | {f['r2']:.4f} | "
                   f"{f['max_rel_residual']:.2f} |")

    # The model against the bench's own probe at the model's size (where it timed the same thing).
    bench_probe = link.get("probe") or {}
    checks = []
    P = n_params - n_params % world
    for key, pieces in (("all_reduce_s", [("all_reduce", 4)]), ("all_gather_s", [("all_gather", 4)]),
                        ("engine_reduce_scatter_s", [("reduce_scatter", 4)]),
                        ("all_reduce_model_dtype_s", [("all_reduce", 2)]),
                        ("all_gather_model_dtype_s", [("all_gather", 2)]),
                        ("engine_round_bf16comm_s", [("reduce_scatter", 2), ("engine_all_gather", 2)]),
                        ("engine_round_s", [("reduce_scatter", 4), ("engine_all_gather", 4)])):
        if key in bench_probe:
            model = sum(max(fits[c]["alpha_s"], 0.0) * sequential_messages(c, world) + fits[c]["beta_s_per_byte"]
                        * beta_scale * link_bytes(c, P * b, world) for c, b in pieces)
            checks.append(f"| {key} | {bench_probe[key] * 1e3:.0f} | {model * 1e3:.0f} | "
                          f"{model / bench_probe[key]:.2f} |")
    if checks:
        out += ["", f"Check against the bench's own probe at P = {P} values on its link ({label}):", "",
                "| probe key | measured ms | model ms | model / measured |", "|---|---|---|---|"] + checks

    table = []
    zero1_pred = None
    for r in rows:
        if r["method"] == "compute":
            continue
        try:
            traffic = messages_per_update(r["method"], world, n_params, precision=precision, local_steps=local_steps)
        except ValueError as exc:
            out.append(f"\n(skipped {r['method']}: {exc})")
            continue
        t_fit = comm_seconds(traffic, fits, beta_scale=beta_scale)
        t_meas = measured_comm_seconds(traffic, bench_probe, fits, n_params, beta_scale=beta_scale)
        t_comm = t_meas if t_meas is not None else t_fit
        pred = predict_ms_per_update(traffic, t_compute_s=t_compute, t_comm_s=t_comm, latencies_s=lat_s,
                                     t_measured_s=r["ms_per_update"] / 1e3)
        table.append((r, traffic, (t_comm, "m" if t_meas is not None else "f", t_fit), pred))
        if r["method"] == "zero1":
            zero1_pred = pred
    heads = ["method", "messages per update", "MB per update (busiest link)", "measured ms/update",
             "T_comm ms/update (m: measured, f: fitted; fit)", "model ms/update at probe", "overhead ms"]
    heads += [f"predicted ms @ {L:g} ms" for L in latencies_ms]
    heads += [f"speedup vs ZeRO-1 @ {L:g} ms" for L in latencies_ms]
    out += ["", "## Predicted ms/update at one-way latency L", "", "| " + " | ".join(heads) + " |",
            "|" + "---|" * len(heads)]
    for r, traffic, t_comm, pred in table:
        cells = [r["method"], _fmt_count(traffic["messages"]), f"{traffic['link_bytes'] / 1e6:.2f}",
                 _fmt_ms(r["ms_per_update"] / 1e3), f"{_fmt_ms(t_comm[0])} {t_comm[1]} ({_fmt_ms(t_comm[2])})",
                 _fmt_ms(pred["model_s"]), _fmt_ms(pred["overhead_s"])]
        cells += [_fmt_ms(pred["predicted_s"][L]) for L in lat_s]
        cells += [f"{zero1_pred['predicted_s'][L] / pred['predicted_s'][L]:.2f}" if zero1_pred else "n/a"
                  for L in lat_s]
        out.append("| " + " | ".join(cells) + " |")
    out += ["", "Messages per update: sequential message steps (a ring of W ranks: W - 1 per reduce-scatter or "
            "all-gather, 2 (W - 1) per gloo all-reduce, 1 per all-to-all); CO2's outer job counts 1/local_steps "
            f"per update (local_steps {local_steps}). T_comm: communication per update at the run's link, from the "
            "bench's own probe at the model's size where it timed the method's large collectives (m), else from the "
            "fit (f); the fitted value in brackets. Model at the probe: T_compute and T_comm combined as the method "
            "overlaps them; overhead = measured - model (>= 0), kept at every latency. "
            "Prediction: every sequential message costs one more one-way latency L, on warm TCP connections "
            "whose window covers the bandwidth-delay product, without loss."]
    if any(not gloo_all_reduce_window_ok(L, run_bps or probe_bps or 1e9) for L in lat_s):
        out.append(f"At {', '.join(f'{L * 1e3:g} ms' for L in lat_s if not gloo_all_reduce_window_ok(L, run_bps or probe_bps or 1e9))} "
                   "gloo's ring all-reduce (two 1 MiB segments in flight) no longer streams at this link's rate, "
                   "so the large all-reduce (DeepSpeed's gradients) takes longer than predicted there.")
    out += ["", "Per-update collectives (W = %d):" % world, ""]
    for r, traffic, _, _ in table:
        parts = [f"{_fmt_count(c['count'])} x {c['what']} ({c['messages']} msg, {c['link_bytes'] / 1e6:.3g} MB)"
                 for c in traffic["calls"]]
        out.append(f"- {r['method']}: " + "; ".join(parts))
    return "\n".join(out) + "\n"


def parse_latencies(text: str) -> List[float]:
    try:
        values = [float(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--latencies: expected comma-separated milliseconds (e.g. 0.1,2,20), got {text!r}") from None
    if not values or any(v < 0 for v in values):
        raise SystemExit(f"--latencies: expected one or more latencies >= 0 ms, got {text!r}")
    return values


DEFAULT_SIZES = "1000,5250,27600,145000,762000,4000000"
BENCH_MODEL_PARAMS = 3287552  # the bench's default model (its results.json n_params): the probe's --numel


def measure(rate: str, out_path: str, sizes: str = DEFAULT_SIZES, repeats: int = 5,
            numel: int = BENCH_MODEL_PARAMS, timeout_s: float = 1200.0) -> dict:
    """Run ``commprobe --sizes`` on a fresh emulated cluster of two nodes (one rank each) whose links
    are shaped to ``rate``, add the link as measured, and write the JSON to ``out_path``. The cluster
    is removed afterwards, whatever happens."""
    import tempfile
    import time
    from . import netns
    from .jobs import Placement, child_env, probe_comm
    ok, why = netns.supported()
    if not ok:
        raise SystemExit(f"--measure needs emulated nodes (network namespaces): {why}")
    bps = netns.parse_bandwidth(rate)
    if bps is None:
        raise SystemExit(f"--measure: give a link rate such as 100mbit, got {rate!r}")
    cluster = netns.Cluster(2, bps)
    probe_out = os.path.join(tempfile.mkdtemp(prefix="acco_latency_probe_"), "probe.json")
    try:
        cluster.create()
        link = netns.measure_cluster(cluster, 1.0, env=child_env(1))
        load_before, started = os.getloadavg()[0], time.time()
        probe = probe_comm(Placement(2, 1, cluster=cluster), numel, probe_out, 1, "bf16",
                           extra_args=["--repeats", str(repeats), "--sizes", sizes], timeout_s=timeout_s)
        if probe is None:
            with open(probe_out + ".log") as f:
                raise SystemExit(f"the probe failed (log {probe_out}.log):\n{f.read()[-3000:]}")
        probe.update(link=dict(topology="cluster", nodes=2, ranks_per_node=1, nominal_bps=bps,
                               measured_bps=link["one_way_bps"], duplex_bps=link["duplex_bps"], qdisc=cluster.qdisc()),
                     repeats=int(repeats), probe_wall_s=time.time() - started, loadavg_before=load_before,
                     loadavg_after=os.getloadavg()[0],
                     command=f"python -m deepspeed_acco.bench.latency --measure {rate} --out {out_path} "
                             f"--sizes {sizes} --repeats {repeats}")
    finally:
        cluster.delete()
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with open(out_path, "w") as f:
        json.dump(probe, f, indent=1)
    return probe


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Predict each method's ms/update at added one-way latency from an "
                                "alpha-beta fit of commprobe --sizes and a bench report.")
    p.add_argument("--measure", metavar="RATE", default="",
                   help="first run the probe on two fresh emulated nodes with links of RATE (e.g. 100mbit) and "
                        "write it to --out (then --probe defaults to it)")
    p.add_argument("--out", default="", help="with --measure: where the probe's JSON goes")
    p.add_argument("--sizes", default=DEFAULT_SIZES, help="with --measure: element counts to time")
    p.add_argument("--repeats", type=int, default=5, help="with --measure: best of N per size")
    p.add_argument("--probe", default="", help="commprobe JSON with \"sizes\"")
    p.add_argument("--report", default="", help="a bench output folder (its results.json)")
    p.add_argument("--latencies", default="0.1,2,20", help="one-way latencies in ms (default 0.1,2,20)")
    p.add_argument("--bandwidth", default=None,
                   help="which of the report's links (e.g. '100 Mbit/s'); default: the one closest to the probe's")
    p.add_argument("--plain-least-squares", action="store_true",
                   help="fit with unweighted least squares instead of relative residuals")
    p.add_argument("--no-bucket", action="store_true",
                   help="fit on all sizes with their full link bytes, ignoring the emulated link's tbf bucket")
    args = p.parse_args(argv)
    if args.measure:
        if not args.out:
            raise SystemExit("--measure needs --out FILE.json (where the probe's timings go)")
        measure(args.measure, args.out, args.sizes, args.repeats)
        print(f"probe written to {args.out}", file=sys.stderr)
        args.probe = args.probe or args.out
        if not args.report:
            return 0
    if not args.probe or not args.report:
        raise SystemExit("give --probe FILE.json (or --measure RATE --out FILE.json) and --report BENCH_OUT")
    with open(args.probe) as f:
        probe = json.load(f)
    _check_probe(probe, args.probe)
    results_path = os.path.join(args.report, "results.json") if os.path.isdir(args.report) else args.report
    with open(results_path) as f:
        results = json.load(f)
    sys.stdout.write(report_markdown(probe, results, parse_latencies(args.latencies), probe_path=args.probe,
                                     report_path=args.report, bandwidth=args.bandwidth,
                                     relative=not args.plain_least_squares, bucket=not args.no_bucket))
    return 0


if __name__ == "__main__":
    sys.exit(main())
