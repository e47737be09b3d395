"""Your regime: measured compute and communication per update, each type's predicted time on each wire
from the bounds of docs/wire.md ("Where the time goes"), and the wire this engine chose from them.

Per update, T_compute is one update's forward + backward + optimizer and T_job one communication job
on a given wire (its reduce-scatter, statistics all-reduce and all-gather, plus the quantisation
kernels' own time on a compressed wire). The bounds per update:

* ShardedAdamW (synchronous ZeRO-1, two passes): T_compute + T_job;
* DPU: max(T_compute, T_job);
* ACCO (two jobs per update): max(T_compute, 2 T_job);
* CO2, whose averaging runs once every ``local_steps`` tau inner steps and may take H of them
  (``anchor_merge_steps``; the whole round under the paper's rule):
  T_compute + max(0, T_job - H T_compute) / tau.

A job on another wire moves other bytes: T_job(wire) = T_comm x bytes(wire) / bytes(measured wire)
+ the quantisation kernels' measured time for that wire (:func:`job_seconds`). Bytes per value of
one job (gradient reduce-scatter + parameter all-gather): uncompressed ZeRO-1 types b_c + b_m (the
gradient dtype and the model's), CO2 b_c + 4 (displacements in fp32 unless
``communication_data_type`` says otherwise, anchors gathered in fp32), int8/int4 blocks
bits / 8 + 4 / block size each way.

The engine measures T_compute and T_comm on its own jobs (:class:`RegimeMonitor`): the compute part
of its time breakdown (device time on CUDA) plus the jobs' update phase per update, and the jobs'
collectives per job. Synchronous updates (ShardedAdamW, the synchronous warm-up) measure T_comm
cleanly; an overlapped job's collectives also hold the time its peers took to launch theirs, which
makes T_comm an upper estimate.
"""
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Sequence

COMMUNICATION_PHASES = ("reduce_scatter", "all_reduce", "statistics", "all_gather")
"""The job phases that are communication (runtime/jobs.py; CO2's outer job calls its all-reduce
``statistics``)."""

TYPES = ("ShardedAdamW", "DPU", "ACCO", "CO2")
"""The types the regime predicts, in the order it lists them."""

CO2_DEFAULT_LOCAL_STEPS = 4
CO2_DEFAULT_AVERAGING_STEPS = 1
"""CO2's defaults (docs/design.md, 3.5), assumed when another type's engine predicts CO2."""

DTYPE_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0}
COMPRESSED_BITS = {"int8": 8, "int4": 4}


def quantized_bytes(bits: int, block_size: int = 128) -> float:
    """Bytes per value of a block-quantised message: the codes and an fp32 scale per block."""
    return bits / 8.0 + 4.0 / block_size


def int8_bytes(block_size: int = 128) -> float:
    """Bytes per value of a block-quantised int8 message: one byte, and an fp32 scale per block."""
    return quantized_bytes(8, block_size)


def round_bytes(type_name: str, wire: str, *, model_dtype: str, block_size: int = 128) -> float:
    """Bytes per value one job of ``type_name`` moves on ``wire`` (gradient reduce-scatter + parameter
    all-gather; CO2: displacement reduce-scatter + anchor all-gather)."""
    if wire in COMPRESSED_BITS:
        return 2.0 * quantized_bytes(COMPRESSED_BITS[wire], block_size)
    gathered = 4.0 if type_name.lower() == "co2" else DTYPE_BYTES[model_dtype]
    return DTYPE_BYTES[wire] + gathered


JOBS_PER_UPDATE = {"shardedadamw": 1.0, "dpu": 1.0, "acco": 2.0}
"""Communication jobs per committed update (CO2: one per ``local_steps`` inner steps)."""


def update_wire_bytes(type_name: str, wire: str, num_parameters: int, world_size: int, *, model_dtype: str = "bf16",
                      local_steps: int = CO2_DEFAULT_LOCAL_STEPS, block_size: int = 128) -> float:
    """Bytes each rank sends per update (CO2: per inner step) for a model of ``num_parameters`` on
    ``world_size`` ranks: every job's reduce-scatter and all-gather send (W - 1) / W of the model in
    their bytes per value (a ring, or the compressed reduce-scatter's all-to-all), padding and
    headers left out (``engine.wire_bytes_per_job()`` counts them)."""
    kind = type_name.lower()
    jobs = 1.0 / max(1, local_steps) if kind == "co2" else JOBS_PER_UPDATE[kind]
    share = (world_size - 1) / world_size
    return jobs * share * num_parameters * round_bytes(type_name, wire, model_dtype=model_dtype, block_size=block_size)


def update_bound_s(type_name: str, t_compute_s: float, t_job_s: float, *, local_steps: int = CO2_DEFAULT_LOCAL_STEPS,
                   averaging_steps: int = CO2_DEFAULT_AVERAGING_STEPS) -> float:
    """A type's bound per update (module docstring) from T_compute and one job's time."""
    kind = type_name.lower()
    if kind == "shardedadamw":
        return t_compute_s + t_job_s
    if kind == "dpu":
        return max(t_compute_s, t_job_s)
    if kind == "acco":
        return max(t_compute_s, 2.0 * t_job_s)
    if kind == "co2":
        return t_compute_s + max(0.0, t_job_s - averaging_steps * t_compute_s) / max(1, local_steps)
    raise ValueError(f"no bound for optimizer type {type_name!r}; the bounds are for {', '.join(TYPES)}")


def job_seconds(t_comm_s: float, measured_bytes: float, bytes_per_value: float, quantization_s: float = 0.0) -> float:
    """One job's seconds on a wire that moves ``bytes_per_value`` from a job measured at
    ``measured_bytes`` per value (``t_comm_s``), plus that wire's quantisation kernels."""
    scale = bytes_per_value / measured_bytes if measured_bytes > 0 else 0.0
    return t_comm_s * scale + quantization_s


def uncompressed_wire(type_name: str, model_dtype: str) -> str:
    """A type's wire when nothing is compressed and ``communication_data_type`` is not given: the model's
    dtype (DeepSpeed's rule), fp32 for CO2's parameter averaging."""
    return "fp32" if type_name.lower() == "co2" else model_dtype


def wires_of(type_name: str, model_dtype: str) -> Sequence[str]:
    """The wires a type may run on by default, least compressed first (ShardedAdamW: its own only)."""
    first = uncompressed_wire(type_name, model_dtype)
    return (first, ) if type_name.lower() == "shardedadamw" else (first, "int8", "int4")


@dataclass
class Regime:
    """What ``engine.regime()`` returns (seconds per update unless named otherwise)."""

    t_compute_s: float
    t_comm_s: float
    """One job's collectives in this engine's wire (``round_bytes`` per value), as measured."""
    round_bytes: float
    """Bytes per value one job of this engine moves."""
    updates: int
    """Updates the measurement covers."""
    predicted_s: Dict[str, float] = field(default_factory=dict)
    """Each type on each wire: its predicted time per update, from the bounds (module docstring),
    named "ACCO (int8)"; ShardedAdamW on its own wire only."""
    quantization_s: Dict[str, float] = field(default_factory=dict)
    """Measured seconds of one job's quantisation kernels per compressed wire ("int8", "int4")."""
    wire: Optional[Dict[str, Any]] = None
    """The wire this engine runs on from the decision on (:class:`~deepspeed_acco.runtime.wire.WireChoice`
    as plain data: ``wire``, ``reason``, ``predicted_s``, ``extra_bytes``, ``decided_at_update``, ...)."""
    type_name: str = ""
    wire_name: str = ""
    """The wire the measurement was taken on."""

    @property
    def communication_share(self) -> float:
        """The share of a synchronous update spent communicating: T_comm / (T_compute + T_comm)."""
        total = self.t_compute_s + self.t_comm_s
        return self.t_comm_s / total if total > 0 else 0.0

    @property
    def fastest(self) -> str:
        """The configuration predicted fastest per update; those within 1% of it are named with it
        ("DPU (bf16), ACCO (bf16), ...": where communication hides, every overlapped type is at T_compute)."""
        best = min(self.predicted_s.values())
        return ", ".join(name for name, seconds in self.predicted_s.items() if seconds <= 1.01 * best)

    def describe(self, type_name: str) -> str:
        synchronous = self.predicted_s.get("ShardedAdamW") or min(self.predicted_s.values())
        ratios = ", ".join(f"{name} {1e3 * seconds:.0f} ms ({seconds / synchronous:.2f}x)"
                           for name, seconds in self.predicted_s.items())
        quantization = "".join(f"; the {name} kernels {1e3 * seconds:.1f} ms per job"
                               for name, seconds in self.quantization_s.items())
        updates = f"{self.updates} update{'' if self.updates == 1 else 's'}"
        text = (f"{type_name}: your regime, measured over {updates} on the {self.wire_name} wire "
                f"(the slowest rank's figures): compute {1e3 * self.t_compute_s:.0f} ms and communication "
                f"{1e3 * self.t_comm_s:.0f} ms per update, so communication is {self.communication_share:.0%} of a "
                f"synchronous update{quantization}. Predicted per update from the bounds (docs/wire.md, \"Where "
                f"the time goes\"; times against ShardedAdamW): {ratios}. Fastest: {self.fastest} (per update; the "
                f"loss per update differs between types: docs/results.md)")
        if self.wire is not None:
            text += f". {self.wire['message']}"
        return text


def predict(t_compute_s: float, t_comm_s: float, *, measured_bytes: float, model_dtype: str,
            communication_dtype: Optional[str] = None, quantization_s: Optional[Dict[str, float]] = None,
            block_size: int = 128, co2_local_steps: int = CO2_DEFAULT_LOCAL_STEPS,
            co2_averaging_steps: int = CO2_DEFAULT_AVERAGING_STEPS) -> Dict[str, float]:
    """Every type's predicted seconds per update on each of its wires (:func:`wires_of`), from T_compute
    and one job's T_comm measured at ``measured_bytes`` per value. ``communication_dtype``: the gradient
    dtype of the ZeRO-1 types' uncompressed wire (default: the model's); ``quantization_s``: measured
    seconds of one job's quantisation kernels per compressed wire (0 where not given)."""
    quantization_s = quantization_s or {}
    predicted = {}
    for type_name in TYPES:
        for wire in wires_of(type_name, model_dtype):
            if wire == model_dtype and communication_dtype is not None and type_name.lower() != "co2":
                wire = communication_dtype
            t_job = job_seconds(t_comm_s, measured_bytes, round_bytes(type_name, wire, model_dtype=model_dtype,
                                                                        block_size=block_size),
                                quantization_s.get(wire, 0.0))
            name = type_name if type_name == "ShardedAdamW" else f"{type_name} ({wire})"
            predicted[name] = update_bound_s(type_name, t_compute_s, t_job, local_steps=co2_local_steps,
                                             averaging_steps=co2_averaging_steps)
    return predicted


def measured_window(before: Dict[str, float], after: Dict[str, float], updates: int, *,
                    compute_key: str = "compute") -> Optional[tuple]:
    """(T_compute, T_comm per job) between two snapshots of the time breakdown ``updates`` updates
    apart, or None if no job that crossed the network finished in between. ``compute_key``: the
    breakdown's compute part ("device_compute" on CUDA)."""
    jobs = after.get("jobs", 0) - before.get("jobs", 0)
    if updates <= 0 or jobs <= 0:
        return None

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    t_comm = sum(delta(f"job_{name}_s") for name in COMMUNICATION_PHASES) / jobs
    return measured_compute(before, after, updates, compute_key=compute_key), t_comm


def measured_compute(before: Dict[str, float], after: Dict[str, float], updates: int, *,
                     compute_key: str = "compute") -> float:
    """T_compute between two snapshots ``updates`` apart: the compute part and the jobs' update phase."""
    return ((after.get(compute_key, 0.0) - before.get(compute_key, 0.0))
            + (after.get("job_update_s", 0.0) - before.get("job_update_s", 0.0))) / updates


def measure(before: Dict[str, float], after: Dict[str, float], updates: int, *, round_bytes: float,
            model_bytes: float, communication_bytes: float, co2_merge_steps: int = 1,
            block_size: int = 128) -> Optional[Regime]:
    """The regime between two snapshots of the engine's time breakdown ``updates`` updates apart (the
    predictions for the ZeRO-1 types' wire in ``communication_bytes``); None if no job finished."""
    window = measured_window(before, after, updates)
    if window is None:
        return None
    t_compute, t_comm = window
    names = {4.0: "fp32", 2.0: "bf16"}
    regime = Regime(t_compute_s=t_compute, t_comm_s=t_comm, round_bytes=round_bytes, updates=updates)
    regime.predicted_s = predict(t_compute, t_comm, measured_bytes=round_bytes, model_dtype=names[model_bytes],
                                 communication_dtype=names[communication_bytes], block_size=block_size,
                                 co2_averaging_steps=co2_merge_steps)
    return regime


DECISION_UPDATES = 4
"""Updates the regime (and the wire choice) is measured over, after the first one: a synchronous
warm-up of at least this many updates measures it cleanly (docs/wire.md, "The wire")."""

DECISION_JOBS = 2
"""Jobs that crossed the network the measurement needs at least (CO2 averages once per round)."""


class RegimeMonitor:
    """A window of updates after the first one (:data:`DECISION_UPDATES` updates holding at least
    :data:`DECISION_JOBS` network jobs), measured once at its end; the schedule then agrees on the
    figures with the other ranks, predicts, chooses the wire (runtime/wire.py) and logs it once."""

    def __init__(self, compute_key: str = "compute"):
        self.compute_key = compute_key
        self._start: Optional[tuple] = None
        self.logged: Optional[Regime] = None
        """The regime measured at the window's end (with the wire choice), once decided."""

    @property
    def decided(self) -> bool:
        return self.logged is not None

    def started(self, steps: int, breakdown: Dict[str, float]) -> bool:
        """Start the window after the first update; whether it had started before this call."""
        if self._start is None:
            if steps >= 1:
                self._start = (steps, dict(breakdown))
            return False
        return True

    def window(self, steps: int, breakdown: Dict[str, float]) -> Optional[tuple]:
        """(updates, T_compute, T_comm) so far, or None before the window has a job."""
        if self._start is None:
            return None
        start_steps, before = self._start
        measured = measured_window(before, breakdown, steps - start_steps, compute_key=self.compute_key)
        return None if measured is None else (steps - start_steps, *measured)

    def compute_so_far(self, steps: int, breakdown: Dict[str, float]) -> Optional[tuple]:
        """(updates, T_compute) in the window so far, whether or not a job has run (CO2 before its
        first averaging, :meth:`~deepspeed_acco.runtime.wire_schedule.WireChoosing.decide_wire_from_probe`);
        None before the window holds an update or once decided."""
        counts = self._counts(steps, breakdown)
        if counts is None or counts[0] < 1:
            return None
        return counts[0], measured_compute(self._start[1], breakdown, counts[0], compute_key=self.compute_key)

    def _counts(self, steps: int, breakdown: Dict[str, float]) -> Optional[tuple]:
        """(updates, network jobs) in the window so far; None before it starts or once decided."""
        if self._start is None or self.decided:
            return None
        start_steps, before = self._start
        return steps - start_steps, breakdown.get("jobs", 0) - before.get("jobs", 0)

    def complete(self, steps: int, breakdown: Dict[str, float]) -> bool:
        """Whether the window is over: the same answer on every rank (update counts and the network
        jobs waited for are the same everywhere)."""
        if not self.started(steps, breakdown):
            return False
        counts = self._counts(steps, breakdown)
        return counts is not None and counts[0] >= DECISION_UPDATES and counts[1] >= DECISION_JOBS

    def early(self, steps: int, breakdown: Dict[str, float]) -> bool:
        """Whether the window holds at least one update and one network job: from there a clear choice
        may be made before it is over (the same answer on every rank, as :meth:`complete`'s)."""
        counts = self._counts(steps, breakdown)
        return counts is not None and counts[0] >= 1 and counts[1] >= 1

    def no_network(self, steps: int, breakdown: Dict[str, float]) -> bool:
        """Whether the window is over without a single job that crossed the network (one rank)."""
        counts = self._counts(steps, breakdown)
        return counts is not None and counts[0] >= DECISION_UPDATES and counts[1] == 0
