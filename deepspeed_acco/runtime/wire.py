"""The wire a type's communication jobs use, and its choice from the measured link (docs/wire.md, "The wire").

``communication_data_type`` names the wire:

* ``"fp32"``, ``"bf16"``, ``"fp16"``: gradients reduced in that dtype, parameters gathered in the
  model's (DeepSpeed's meaning); CO2 averages its parameters in it (fp32 by default);
* ``"int8"``, ``"int4"``: block-quantised gradients with error feedback and quantised parameter
  deltas (what DeepSpeed's ZeRO++ keys ``zero_quantized_gradients`` / ``zero_quantized_weights``
  select, runtime/compression.py);
* ``"auto"`` (the default of DPU, ACCO and CO2): the engine starts on the uncompressed wire (the
  model's dtype; fp32 for CO2's averaging), measures its compute and its jobs over its first updates
  (:class:`~deepspeed_acco.runtime.regime.RegimeMonitor`), and once, identically on every rank, keeps
  that wire where its jobs hide behind compute, else takes the least compressed wire whose predicted
  update is within :data:`TOLERANCE` of the fastest prediction (:func:`choose`). The choice holds for
  the rest of the run, the rest of a synchronous warm-up included; checkpoints keep it.

A compressed wire needs buffers an uncompressed one does not (the error-feedback residual, packed
send and receive buffers, an fp32 gradient snapshot): they are allocated only when the choice is made,
and a wire whose buffers would not fit in the memory left is not taken (:func:`fits_in_memory`).
"""
import dataclasses
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from . import regime as bounds

AUTO = "auto"
UNCOMPRESSED = ("fp32", "bf16", "fp16")
COMPRESSED = bounds.COMPRESSED_BITS
WIRES = UNCOMPRESSED + tuple(COMPRESSED)

TOLERANCE = 0.05
"""A compressed wire is taken only when needed: the least compressed one whose predicted update is
within this share of the fastest prediction."""

EARLY_MARGIN = 1.25
"""Under "auto" the wire is chosen before the window's end, as soon as one update and one network job
into it, when the figures so far predict the starting wire at least this much slower than the fastest
one: every further update on it would cost a quarter or more. Closer calls wait for the whole window
(docs/wire.md, "The wire")."""

PROBE_SHARE = 1 / 16
"""CO2 under "auto" times one reduce-scatter and all-gather of this share of its first averaging's bytes
before that averaging (:func:`probe_link`), between :data:`PROBE_MIN_BYTES` and :data:`PROBE_MAX_BYTES`
per rank."""
PROBE_MIN_BYTES = 512 << 10
PROBE_MAX_BYTES = 4 << 20

MEMORY_HEADROOM = 0.10
"""A wire's new buffers must fit in the free memory with this share of it to spare."""

QUANTIZATION_SAMPLE = 1 << 20
"""Values the quantisation kernels are timed on (the time per value is scaled to a job)."""


def bits_of(wire: str) -> Optional[int]:
    """8 or 4 for a compressed wire, None for a dtype."""
    return COMPRESSED.get(wire)


@dataclass
class WireChoice:
    """What the engine decided, as plain data (logged, returned by ``engine.regime()``, checkpointed)."""

    wire: str
    """The wire of the rest of the run: "bf16", "fp32", "fp16", "int8" or "int4"."""
    reason: str
    """Why, in one sentence."""
    decided_at_update: int
    """Committed updates when the choice was made."""
    measured_wire: str
    """The wire the measurement ran on."""
    t_compute_s: float
    t_comm_s: float
    """One job's collectives on ``measured_wire``, the slowest rank's."""
    predicted_s: Dict[str, float] = field(default_factory=dict)
    """This type's predicted seconds per update on each wire it may take."""
    quantization_s: Dict[str, float] = field(default_factory=dict)
    """Measured seconds of one job's quantisation kernels per compressed wire."""
    extra_bytes: Dict[str, int] = field(default_factory=dict)
    """Bytes per rank each compressed wire's buffers add."""
    refused_for_memory: List[str] = field(default_factory=list)
    """Wires that would have been faster but did not fit in memory."""
    type_name: str = ""
    num_parameters: int = 0
    probe_bytes: int = 0
    """Bytes per rank of the probe of the link T_comm came from (CO2 before its first averaging); 0 where
    the jobs measured it."""

    @property
    def message(self) -> str:
        predictions = ", ".join(f"{name} {1e3 * seconds:.0f} ms" for name, seconds in self.predicted_s.items())
        text = (f"{self.type_name}: the wire is {self.wire} for the rest of the run (decided at update "
                f"{self.decided_at_update}; predicted per update: {predictions}): {self.reason}")
        extra = self.extra_bytes.get(self.wire, 0)
        if extra:
            per_parameter = extra / max(1, self.num_parameters)
            text += (f"; its buffers take {extra / 2**20:.1f} MiB more per rank ({per_parameter:.2f} bytes per "
                     f"parameter)")
        if self.refused_for_memory:
            text += f"; not taken for lack of memory: {', '.join(self.refused_for_memory)}"
        return text

    def as_dict(self) -> Dict[str, Any]:
        values = dataclasses.asdict(self)
        values["message"] = self.message
        return values

    @classmethod
    def from_dict(cls, values: Dict[str, Any]) -> "WireChoice":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{key: value for key, value in values.items() if key in names})


def choose(predicted_s: Dict[str, float], candidates: Sequence[str], *, fits: Optional[Dict[str, bool]] = None,
           tolerance: float = TOLERANCE) -> tuple:
    """``(wire, reason, refused_for_memory)``: the first of ``candidates`` (least compressed first, the
    uncompressed wire first of all) whose prediction is within ``tolerance`` of the fastest prediction
    among those that fit in memory (``fits``; missing: fits). The uncompressed wire always fits (it is
    allocated already)."""
    fits = fits or {}
    first = candidates[0]
    usable = [wire for wire in candidates if wire == first or fits.get(wire, True)]
    fastest = min(predicted_s[wire] for wire in usable)
    refused = [wire for wire in candidates if wire not in usable and predicted_s[wire] < fastest]
    for wire in usable:
        if predicted_s[wire] <= (1.0 + tolerance) * fastest:
            break
    hidden = predicted_s[first] <= min(predicted_s[w] for w in candidates)
    if wire == first and hidden:
        reason = f"its jobs hide behind the compute"
    elif wire == first:
        reason = (f"no compressed wire is predicted {tolerance:.0%} faster than it" if not refused else
                  "the faster compressed wires do not fit in memory")
    else:
        others = [w for w in usable if w != wire and predicted_s[w] < predicted_s[wire]]
        reason = (f"{first}'s jobs do not hide behind the compute, and {wire} is the least compressed wire "
                  f"predicted within {tolerance:.0%} of the fastest" + (f" ({', '.join(others)})" if others else ""))
    return wire, reason, refused


def clear_early(predicted_s: Dict[str, float], candidates: Sequence[str], *,
                fits: Optional[Dict[str, bool]] = None, margin: float = EARLY_MARGIN) -> bool:
    """Whether figures measured before the window's end already decide: the starting wire (the first
    candidate) predicted at least ``margin`` (:data:`EARLY_MARGIN`) times
    slower than the fastest wire that fits. Keeping the starting wire is never decided early: staying on
    it costs nothing while the window runs."""
    fits = fits or {}
    usable = [wire for wire in candidates[1:] if fits.get(wire, True)]
    return bool(usable) and predicted_s[candidates[0]] >= margin * min(predicted_s[wire] for wire in usable)


# ---- what a wire costs --------------------------------------------------------------------------
def quantization_job_s(bits: int, block_size: int, padded_numels: Sequence[int], world_size: int,
                       device: torch.device, sample: int = QUANTIZATION_SAMPLE) -> float:
    """Seconds the quantisation kernels of one compressed job take on this rank: per flat group of P
    values and shards S = P / W, the reduce-scatter quantises (W - 1) S values with error feedback and
    dequantises-and-sums (W - 1) S, the all-gather quantises one shard's delta and applies W S deltas.
    Timed on ``sample`` values (device time on CUDA) and scaled per value."""
    from .. import ops
    n = max(block_size, min(sample, max(padded_numels)))
    n -= n % block_size
    values = torch.randn(n, dtype=torch.float32, device=device)
    residual = torch.zeros_like(values)
    kernel = dict(bits=bits, block_size=block_size)
    packed = torch.zeros(1, ops.packed_bytes(n, **kernel), dtype=torch.uint8, device=device)
    out = torch.zeros_like(values)
    held = values.clone()

    def run() -> None:
        ops.quantize(values, packed, residual=residual, **kernel)
        ops.dequantize_sum(packed, out, base=values, **kernel)
        ops.quantize_delta(out, held, packed, **kernel)
        ops.apply_delta(packed, held, out=held, **kernel)

    run()  # the first call may build or load the kernels
    cuda = device.type == "cuda"
    repeats = 3
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            run()
        end.record()
        end.synchronize()
        per_run = start.elapsed_time(end) / 1e3 / repeats
    else:
        began = time.perf_counter()
        for _ in range(repeats):
            run()
        per_run = (time.perf_counter() - began) / repeats
    # One run handles n values in each of the four kernels.
    return per_run / (4 * n) * quantized_values_per_job(padded_numels, world_size)


def probe_values(job_bytes: float, world_size: int) -> int:
    """fp32 values of the probe for a job that sends ``job_bytes`` per rank: its reduce-scatter and
    all-gather send (W - 1) / W of 8 bytes per value, :data:`PROBE_SHARE` of the job, clamped to
    [:data:`PROBE_MIN_BYTES`, :data:`PROBE_MAX_BYTES`], a multiple of ``world_size``."""
    sent = min(PROBE_MAX_BYTES, max(PROBE_MIN_BYTES, job_bytes * PROBE_SHARE))
    values = int(sent / (8.0 * (world_size - 1) / world_size))
    return max(world_size, values - values % world_size)


def probe_link(communicator, values: int, device: torch.device) -> float:
    """Seconds one reduce-scatter and all-gather of ``values`` fp32 values take on ``communicator`` (the
    collectives a job runs), after a small untimed pair that lines the ranks up and opens the
    connections. Every member calls it at the same point, with no job running.

    A link that lets a burst through at once (a token bucket, as ``tc tbf``) makes the probe look
    faster than a whole job: the error only keeps the uncompressed wire longer, since keeping it is
    never decided early (:func:`clear_early`)."""
    world_size = communicator.world_size
    cuda = device.type == "cuda"

    def pair(numel: int) -> float:
        values = torch.zeros(numel, dtype=torch.float32, device=device)
        shard = torch.empty(numel // world_size, dtype=torch.float32, device=device)
        if cuda:
            torch.cuda.synchronize(device)
        began = time.perf_counter()
        communicator.reduce_scatter(shard, values)
        communicator.all_gather(values, shard)
        if cuda:
            torch.cuda.synchronize(device)
        return time.perf_counter() - began

    pair(world_size * 256)  # untimed: lines the ranks up, opens the connections
    return pair(values)


def quantized_values_per_job(padded_numels: Sequence[int], world_size: int) -> int:
    """Values one compressed job's kernels handle on a rank: per group of P values (S = P / W), quantize
    and dequantize_sum on (W - 1) S each, quantize_delta on S, apply_delta on P."""
    return sum(2 * (world_size - 1) * (p // world_size) + p // world_size + p for p in padded_numels)


def compression_extra_bytes(padded_numels: Sequence[int], world_size: int, bits: int, block_size: int, *,
                            model_bytes: int, communication_bytes: int, gather_shared: bool,
                            snapshot: bool = True) -> int:
    """Bytes per rank a switch from an uncompressed wire to ``bits`` adds (runtime/memory.py's formula):
    the compressed collectives' buffers, and for the ZeRO-1 types (``snapshot``) the fp32 gradient
    snapshot and reduced shard in place of the ``communication_bytes`` ones, and an own all-gather output
    where it shared the snapshot (``gather_shared``)."""
    from .memory import _compression_bytes
    total = 0
    for padded in padded_numels:
        total += _compression_bytes(padded, world_size, {"gradients": True, "weights": True, "bits": bits,
                                                         "block_size": block_size})
        if not snapshot:
            continue
        # The gradient snapshot (a buffer of its own, or the accumulator's ping-pong partner) and the
        # reduced shard become fp32; the all-gather gets its own output where it shared the snapshot.
        total += (4 - communication_bytes) * (padded + padded // world_size)
        if gather_shared and model_bytes != 4:  # an fp32 model's gather keeps sharing the fp32 snapshot
            total += model_bytes * padded
    return total


def free_memory_bytes(device: torch.device) -> Optional[int]:
    """Memory this process can still allocate: on CUDA the device's free memory plus what torch's caching
    allocator holds unused; on the CPU the kernel's MemAvailable; None where unknown."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def fits_in_memory(extra_bytes: int, free_bytes: Optional[int], headroom: float = MEMORY_HEADROOM) -> bool:
    """Whether ``extra_bytes`` fit in ``free_bytes`` with ``headroom`` of it to spare (unknown: yes)."""
    return free_bytes is None or extra_bytes <= (1.0 - headroom) * free_bytes


# ---- the engine's side ---------------------------------------------------------------------------
@dataclass
class WireDecision:
    """Inputs of one decision, agreed over the ranks (each figure the largest any rank measured)."""

    t_compute_s: float
    t_comm_s: float
    quantization_s: Dict[str, float]
    extra_bytes: Dict[str, int]
    fits: Dict[str, bool]


def agree(control, decision: WireDecision, wires: Sequence[str]) -> WireDecision:
    """Every rank's figures made the same: the largest time and extra memory, fits only where it fits
    on every rank (one small all-reduce on the control plane)."""
    values = [decision.t_compute_s, decision.t_comm_s]
    values += [decision.quantization_s.get(w, 0.0) for w in wires]
    values += [float(decision.extra_bytes.get(w, 0)) for w in wires]
    values += [0.0 if decision.fits.get(w, True) else 1.0 for w in wires]
    agreed = control.max_values(values)
    n = len(wires)
    quantization = {w: agreed[2 + i] for i, w in enumerate(wires) if w in decision.quantization_s}
    extra = {w: int(agreed[2 + n + i]) for i, w in enumerate(wires) if w in decision.extra_bytes}
    fits = {w: agreed[2 + 2 * n + i] == 0.0 for i, w in enumerate(wires)}
    return WireDecision(t_compute_s=agreed[0], t_comm_s=agreed[1], quantization_s=quantization, extra_bytes=extra,
                        fits=fits)



ENVIRONMENT = "DEEPSPEED_ACCO_WIRE"
"""Fixes the wire of every engine whose config leaves it to "auto": "uncompressed" (the starting wire,
the model's dtype; fp32 for CO2's averaging), "int8" or "int4"; for reproducible comparisons, where a
choice made from timings would differ between runs (the test suite sets "uncompressed")."""


def environment_wire() -> Optional[str]:
    """The wire :data:`ENVIRONMENT` fixes (None: unset or empty); ValueError naming it otherwise."""
    value = os.environ.get(ENVIRONMENT, "").strip().lower()
    if not value:
        return None
    if value not in ("uncompressed", ) + tuple(COMPRESSED):
        raise ValueError(f"{ENVIRONMENT}={value!r}: expected \"uncompressed\", \"int8\" or \"int4\" (or unset it: "
                         f"the engine chooses)")
    return value
