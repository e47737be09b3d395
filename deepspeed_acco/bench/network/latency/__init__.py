"""A latency model of each method's communication, on paper, from measurements.

The emulated links (:mod:`deepspeed_acco.bench.network.netns`) are shaped for bandwidth only: this kernel
has no ``netem``, so packet delay cannot be emulated. This module predicts what latency would do
instead, with the alpha-beta model of a collective::

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
as :func:`deepspeed_acco.bench.reporting.report.comm_round_seconds` does for ``nodes >= 2``: a
reduce-scatter, an all-gather or an all-to-all of an ``N``-byte vector sends (W - 1) / W x N bytes
out of every node, an all-reduce twice that.

``python -m deepspeed_acco.bench.network.latency --probe PROBE.json --report BENCH_OUT [--latencies 0.1,2,20]``
prints the fits and, for the methods of a bench report, the table of predicted ms/update; the
command line and the markdown are :mod:`.report` (this package's ``__main__`` runs it).
"""
import math
import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from ...workload.methods import parse_variant

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
    """The token bucket (bytes) of the tbf that shaped the probe's link: as its qdisc recorded it
    (``burst 256Kb``), else as :func:`deepspeed_acco.bench.network.netns.tbf_args` sets it for a cluster at
    the link's nominal rate; None when the probe does not say what link it ran on."""
    link = probe.get("link") or {}
    recorded = re.search(r"burst (\d+)([KM]?)b\b", link.get("qdisc") or "")
    if recorded:
        return int(recorded.group(1)) * {"": 1, "K": 1024, "M": 1024 * 1024}[recorded.group(2)]
    bps = link.get("nominal_bps")
    if not bps:
        return None
    from ..netns import packet_size, tbf_args
    args = tbf_args(float(bps), packet_size(float(bps)))
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
        raise ValueError("the probe JSON has no \"sizes\": run python -m deepspeed_acco.bench.reporting.commprobe with "
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

