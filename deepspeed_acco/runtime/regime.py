"""Your regime: measured compute and communication per update, and each type's predicted time from the
bounds of docs/design.md ("Where the time goes"), so a user can read off their own job which
type would be fastest.

Per update, T_compute is one update's forward + backward + optimizer and T_comm one gradient
reduce-scatter + parameter all-gather of the model. A synchronous update pays T_compute + T_comm;
DPU max(T_compute, T_comm); ACCO max(T_compute, 2 T_comm); CO2 max(T_compute, T_comm' / H), where
T_comm' is its round (it averages fp32 parameters and gathers its fp32 anchor) and H the inner steps
its averaging may take (``anchor_merge_steps``, or ``local_steps`` under the paper's rule). Rounds in
other dtypes scale with the bytes they move: bf16 gradients and parameters 2 + 2 bytes per value,
int8 blocks 1 + 4 / block size each way.

The engine measures T_compute and T_comm on its own jobs (:func:`measure`): the compute part of its
time breakdown plus the jobs' update phase per update, and the jobs' collectives (reduce-scatter,
statistics all-reduce, all-gather) per job, scaled to a round of the model. Synchronous updates
(ShardedAdamW, the synchronous warm-up) measure T_comm cleanly; an overlapped job's collectives
also hold the time its peers took to launch theirs, which makes T_comm an upper estimate.
"""
from dataclasses import dataclass, field
from typing import Dict, Optional

COMMUNICATION_PHASES = ("reduce_scatter", "all_reduce", "all_gather")
"""The job phases that are communication (runtime/jobs.py)."""


def int8_bytes(block_size: int = 128) -> float:
    """Bytes per value of a block-quantised int8 message: one byte, and an fp32 scale per block."""
    return 1.0 + 4.0 / block_size


@dataclass
class Regime:
    """What ``engine.regime()`` returns (seconds per update unless named otherwise)."""

    t_compute_s: float
    t_comm_s: float
    """One reduce-scatter + all-gather of the model in this engine's dtypes (``round_bytes`` per value)."""
    round_bytes: float
    """Bytes per value one round of this engine moves (gradients + parameters)."""
    updates: int
    """Updates the measurement covers."""
    predicted_s: Dict[str, float] = field(default_factory=dict)
    """Each type's predicted time per update, from the bounds (module docstring)."""

    @property
    def communication_share(self) -> float:
        """The share of a synchronous update spent communicating: T_comm / (T_compute + T_comm)."""
        total = self.t_compute_s + self.t_comm_s
        return self.t_comm_s / total if total > 0 else 0.0

    @property
    def fastest(self) -> str:
        """The type predicted fastest per update; types within 1% of it are named with it ("DPU, ACCO":
        where the communication hides under compute, every overlapped type is at T_compute)."""
        best = min(self.predicted_s.values())
        return ", ".join(name for name, seconds in self.predicted_s.items() if seconds <= 1.01 * best)

    def describe(self, type_name: str) -> str:
        synchronous = self.predicted_s["ShardedAdamW"]
        ratios = ", ".join(f"{name} {1e3 * seconds:.0f} ms ({seconds / synchronous:.2f}x)"
                           for name, seconds in self.predicted_s.items())
        return (f"{type_name}: your regime, measured over {self.updates} updates: compute {1e3 * self.t_compute_s:.0f} ms "
                f"and communication {1e3 * self.t_comm_s:.0f} ms per update, so communication is "
                f"{self.communication_share:.0%} of a synchronous update. Predicted per update from the bounds "
                f"(docs/design.md, \"Where the time goes\"; times against a synchronous update): {ratios}. Fastest: "
                f"{self.fastest} (per update; the loss per update differs between types: docs/results.md)")


def predict(t_compute_s: float, t_comm_s: float, *, round_bytes: float, model_bytes: float,
            communication_bytes: float, co2_merge_steps: int = 1, block_size: int = 128) -> Dict[str, float]:
    """Each type's predicted seconds per update from T_compute and T_comm (measured in a round of
    ``round_bytes`` per value): synchronous types with gradients in ``communication_bytes`` and
    parameters in ``model_bytes``, ACCO also with int8 communication, CO2 with fp32 parameters and
    ``co2_merge_steps`` inner steps to average in."""
    per_byte = t_comm_s / round_bytes if round_bytes > 0 else 0.0
    ours = per_byte * (communication_bytes + model_bytes)
    int8 = per_byte * 2 * int8_bytes(block_size)
    co2 = per_byte * 8.0 / max(1, co2_merge_steps)
    return {"ShardedAdamW": t_compute_s + ours, "DPU": max(t_compute_s, ours), "ACCO": max(t_compute_s, 2 * ours),
            "ACCO with int8 communication": max(t_compute_s, 2 * int8), "CO2": max(t_compute_s, co2)}


def measure(before: Dict[str, float], after: Dict[str, float], updates: int, *, round_bytes: float,
            model_bytes: float, communication_bytes: float, co2_merge_steps: int = 1,
            block_size: int = 128) -> Optional[Regime]:
    """The regime between two snapshots of the engine's time breakdown (``engine.time_breakdown()``)
    ``updates`` updates apart; None if no job finished in between."""
    jobs = after.get("jobs", 0) - before.get("jobs", 0)
    if updates <= 0 or jobs <= 0:
        return None

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    t_comm = sum(delta(f"job_{name}_s") for name in COMMUNICATION_PHASES) / jobs
    t_compute = (delta("compute") + delta("job_update_s")) / updates
    regime = Regime(t_compute_s=t_compute, t_comm_s=t_comm, round_bytes=round_bytes, updates=updates)
    regime.predicted_s = predict(t_compute, t_comm, round_bytes=round_bytes, model_bytes=model_bytes,
                                 communication_bytes=communication_bytes, co2_merge_steps=co2_merge_steps,
                                 block_size=block_size)
    return regime


REGIME_UPDATES = 5
"""Updates the regime is measured over when there is no synchronous warm-up to measure it in (it is
logged after the first update plus these, or at the end of a warm-up of at least 3 updates)."""


class RegimeMonitor:
    """The engine's side: a window of updates after the first one, measured and logged once at its
    end (the synchronous warm-up when it lasts at least 3 updates, else :data:`REGIME_UPDATES` updates)."""

    def __init__(self, config):
        sizes = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0}
        self.type_name = config.optimizer_type
        self.model_bytes = sizes[config.precision]
        self.communication_bytes = sizes[config.communication_dtype]
        self.block_size = config.compression.format.block_size
        compressed = int8_bytes(self.block_size)
        if self.type_name.lower() == "co2":  # its jobs average fp32 parameters (docs/design.md, 3.5)
            self.round_bytes = 8.0
        else:
            self.round_bytes = ((compressed if config.compression.gradients else self.communication_bytes)
                                + (compressed if config.compression.weights else self.model_bytes))
        self.co2_merge_steps = config.params.averaging_steps if self.type_name.lower() == "co2" else 1
        """Inner steps CO2's averaging may take: this engine's own if it is a CO2 one, else CO2's
        default (the eager merge's one step)."""
        self._start: Optional[tuple] = None
        self._logged: Optional[Regime] = None

    def _measure(self, steps: int, breakdown: Dict[str, float]) -> Optional[Regime]:
        if self._start is None:
            return None
        start_steps, before = self._start
        return measure(before, breakdown, steps - start_steps, round_bytes=self.round_bytes,
                       model_bytes=self.model_bytes, communication_bytes=self.communication_bytes,
                       co2_merge_steps=self.co2_merge_steps, block_size=self.block_size)

    def regime(self, steps: int, breakdown: Dict[str, float]) -> Optional[Regime]:
        """The logged regime, or before it is logged the one of the updates so far."""
        return self._logged if self._logged is not None else self._measure(steps, breakdown)

    def note(self, steps: int, breakdown: Dict[str, float], warmup_sync_updates: int) -> str:
        """After a commit (``steps`` committed): the message to log once, else ''."""
        if self._start is None:
            self._start = (steps, dict(breakdown))
            return ""
        end = warmup_sync_updates if warmup_sync_updates >= 3 else self._start[0] + REGIME_UPDATES
        if self._logged is not None or steps < end:
            return ""
        self._logged = self._measure(steps, breakdown)
        return self._logged.describe(self.type_name) if self._logged is not None else ""

