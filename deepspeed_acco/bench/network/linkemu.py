"""An emulated inter-node link for the collectives of one process (world size 1): docs/gpu_study.md.

One GPU cannot run W ranks, but it can show whether an engine keeps its communication off the
critical path when that communication is slow. After each collective the study process issues, the
emulator holds that collective's stream for as long as the collective would take on a ring of W
ranks joined by links of R bit/s per direction with a per-message latency alpha::

    T(collective) = sequential messages x alpha + bytes one rank's link carries x 8 / R

with the ring counts of docs/bench.md and :mod:`.latency` (:func:`.latency.sequential_messages`,
:func:`.latency.link_bytes`): a reduce-scatter or an all-gather of an N-byte vector sends
(W - 1) / W x N bytes in W - 1 sequential steps, an all-reduce twice that in 2 (W - 1). The study
process plays one of the W ranks and its vectors are the whole model, as a rank's are.

**The delay.** On CUDA it is ``torch.cuda._sleep(cycles)``, a kernel of one thread that spins on the
SM clock, enqueued on the current stream right after the collective: it holds the stream (what
follows on it waits, as it would wait for a slow collective) but not the device (the compute
kernels of other streams keep running). Cycles per second are fitted at start-up against CUDA
events (:func:`calibrate_spin`) and checked on a few delays (:func:`check_spin`); every delay is
timed by events too, so the study reports the link time that really elapsed. On the CPU (the dry
run) the delay is a host sleep on the thread that issued the collective: our engine runs its jobs on
a worker thread there (docs/failures.md), so the sleep delays that job's timeline just as
the spin delays the side stream on CUDA, and DeepSpeed's training thread sleeps after its own
collectives just as its stream would wait.

**What it models:** the link's bandwidth and a per-message latency, per collective, in the order
the engine issues them on each stream. **What it does not:** contention (the W ranks' traffic on a
shared fabric, several collectives sharing one link at once: each stream is delayed on its own),
NCCL's own kernels at W ranks (their SM use and memory traffic, which compete with compute; at
world size 1 NCCL's collectives are local copies), protocol choice (NCCL's tree and LL protocols
for small messages), congestion and jitter. And at world size 1 each "rank" updates the whole
model, not 1/W of it, so the shard update costs W times what it would.

**Where it hooks in** (:meth:`LinkEmulator.installed`):

* our engine: every collective of a job goes through :class:`deepspeed_acco.runtime.comm.Communicator`
  (the one narrow object jobs talk to), so the emulator wraps its ``reduce_scatter``,
  ``all_gather``, ``all_reduce`` and ``all_to_all``. Wrapping torch.distributed alone would miss
  them: ``comm._reduce_scatter_flat`` / ``_all_gather_flat`` are torch's functions bound when
  ``comm`` is imported, and a gloo group of one is a local copy that never calls torch.distributed;
* DeepSpeed: ``deepspeed.comm`` calls torch.distributed's functions by name at call time, except
  the all-gather and reduce-scatter functions its backend binds when it is created
  (``cdb.all_gather_function``, ``cdb.reduce_scatter_function``): the emulator wraps torch.distributed's
  functions and those two attributes. ZeRO-1 skips its parameter all-gather at a data-parallel
  world size of 1 (``all_gather_dp_groups``), so the emulator wraps that function of
  ``deepspeed.runtime.zero.stage_1_and_2`` and charges the all-gather W ranks would run.

Nested calls (our communicator's NCCL all-reduce calls torch.distributed's) are charged once, at
the outermost wrapper. torch.distributed collectives the model does not cover (``reduce``,
``broadcast``, point to point, ...) are recorded as unmodelled, so that a study can refuse a
measurement that issued one instead of reporting a link that was not emulated.
"""
import contextlib
import functools
import inspect
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from .latency import link_bytes, sequential_messages

MODELLED = ("reduce_scatter", "all_gather", "all_reduce", "all_to_all")

# torch.distributed function -> (the collective it is, the argument whose bytes are the vector).
# A list argument counts all its tensors: the vector W ranks would gather or reduce.
DIST_FUNCTIONS: Dict[str, Tuple[str, str]] = {
    "all_reduce": ("all_reduce", "tensor"),
    "reduce_scatter_tensor": ("reduce_scatter", "input"),
    "reduce_scatter_single": ("reduce_scatter", "input"),
    "reduce_scatter": ("reduce_scatter", "input_list"),
    "all_gather_into_tensor": ("all_gather", "output_tensor"),
    "all_gather_single": ("all_gather", "output_tensor"),
    "all_gather": ("all_gather", "tensor_list"),
    "all_to_all_single": ("all_to_all", "input"),
}
# Collectives the ring model does not cover: recorded, never delayed (see the module docstring).
UNMODELLED_DIST_FUNCTIONS = ("reduce", "broadcast", "all_reduce_coalesced", "all_to_all", "gather", "scatter",
                             "send", "recv", "isend", "irecv", "batch_isend_irecv")
# Communicator method -> (collective, the argument whose bytes are the vector).
COMMUNICATOR_METHODS: Dict[str, Tuple[str, str]] = {
    "reduce_scatter": ("reduce_scatter", "input"),
    "all_gather": ("all_gather", "output"),
    "all_reduce": ("all_reduce", "tensor"),
    "all_to_all": ("all_to_all", "input"),
}


# ----------------------------------------------------------------------------------------------
# The link: what one collective costs on it


@dataclass(frozen=True)
class Link:
    """A ring of ``world_size`` ranks, each joined to the next by ``rate_bps`` per direction, each
    sequential message costing ``latency_s``. ``rate_bps = math.inf`` and ``latency_s = 0`` is no
    link at all: the emulator then only counts what crosses it."""
    world_size: int
    rate_bps: float
    latency_s: float = 0.0

    def __post_init__(self):
        if int(self.world_size) != self.world_size or self.world_size < 2:
            raise ValueError(f"--world-size: the emulated ring needs at least 2 ranks, got {self.world_size}")
        if not self.rate_bps > 0:
            raise ValueError(f"--rate-gbps: the link rate must be > 0, got {self.rate_bps} bit/s")
        if not 0.0 <= self.latency_s < math.inf:
            raise ValueError(f"--latency-us: the per-message latency must be >= 0, got {self.latency_s} s")

    def seconds(self, collective: str, vector_bytes: float) -> float:
        """The time of one ``collective`` on a vector of ``vector_bytes`` (all W chunks)."""
        if collective not in MODELLED:
            raise ValueError(f"unknown collective {collective!r}; the link models {', '.join(MODELLED)}")
        messages = sequential_messages(collective, self.world_size)
        bits = 8.0 * link_bytes(collective, vector_bytes, self.world_size)
        return messages * self.latency_s + (0.0 if math.isinf(self.rate_bps) else bits / self.rate_bps)

    def traffic(self, collective: str, vector_bytes: float) -> Tuple[int, float]:
        """``(sequential messages, bits through one rank's link)`` of one call."""
        return (sequential_messages(collective, self.world_size),
                8.0 * link_bytes(collective, vector_bytes, self.world_size))


def rate_for_share(share: float, update_s: float, bits_per_update: float, messages_per_update: float,
                   latency_s: float) -> float:
    """The link rate (bit/s) at which a method that takes ``update_s`` per update without a link and
    sends ``bits_per_update`` in ``messages_per_update`` sequential messages, none of it overlapped,
    spends ``share`` of its update communicating: T_comm / (update_s + T_comm) = share."""
    if not 0.0 < share < 1.0:
        raise ValueError(f"--shares: a communication share must lie in (0, 1), got {share}")
    if update_s <= 0 or bits_per_update <= 0:
        raise ValueError(f"need a positive update time and traffic, got {update_s} s and {bits_per_update} bits")
    t_comm = share / (1.0 - share) * update_s
    fixed = messages_per_update * latency_s
    if t_comm <= fixed:
        raise ValueError(f"--shares {share}: the link's latency alone ({messages_per_update:g} messages x "
                         f"{latency_s * 1e6:g} us = {fixed * 1e3:.2f} ms) exceeds the {t_comm * 1e3:.2f} ms that share "
                         f"allows; lower --latency-us or raise the share")
    return bits_per_update / (t_comm - fixed)


# ----------------------------------------------------------------------------------------------
# The spin kernel's clock


@dataclass(frozen=True)
class SpinCalibration:
    """``torch.cuda._sleep``'s speed: ``seconds = overhead_s + cycles / cycles_per_s`` (a line fitted to
    event-timed spins; the intercept is the launch and event cost, not part of a delay)."""
    cycles_per_s: float
    overhead_s: float

    def cycles_for(self, seconds: float) -> int:
        return max(0, int(round(seconds * self.cycles_per_s)))


def fit_spin(points: Sequence[Tuple[float, float]]) -> SpinCalibration:
    """Least-squares line through ``(cycles, seconds)`` points of at least two distinct cycle counts."""
    if len({c for c, _ in points}) < 2:
        raise ValueError("calibrating the spin needs timings at two or more cycle counts")
    n = len(points)
    mean_c = sum(c for c, _ in points) / n
    mean_s = sum(s for _, s in points) / n
    slope = sum((c - mean_c) * (s - mean_s) for c, s in points) / sum((c - mean_c) ** 2 for c, _ in points)
    if slope <= 0:
        raise RuntimeError(f"the spin kernel did not take longer for more cycles (slope {slope:g} s/cycle): "
                           f"its clock cannot be calibrated from {list(points)}")
    return SpinCalibration(cycles_per_s=1.0 / slope, overhead_s=mean_s - slope * mean_c)


def spin_check_failures(measured: Sequence[Tuple[float, float]], tolerance: float) -> List[str]:
    """The ``(requested s, measured s)`` pairs whose relative error exceeds ``tolerance``, as sentences."""
    return [f"asked {requested * 1e3:.3f} ms, took {took * 1e3:.3f} ms ({took / requested - 1:+.1%})"
            for requested, took in measured if requested > 0 and abs(took / requested - 1.0) > tolerance]


def _event_seconds(device, run: Callable[[], None]) -> float:
    import torch
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.device(device):
        start.record()
        run()
        end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def calibrate_spin(device, cycles: Sequence[int] = (2_000_000, 8_000_000, 32_000_000), repeats: int = 3,
                   busy_s: float = 0.3) -> SpinCalibration:
    """Fit ``torch.cuda._sleep``'s cycles per second on ``device`` against CUDA events, after
    ``busy_s`` of matrix products: the SM clock of an idle GPU rises once work arrives."""
    import torch
    matrix = torch.randn(2048, 2048, device=device, dtype=torch.float32)
    started = time.perf_counter()
    while time.perf_counter() - started < busy_s:
        matrix = torch.tanh(matrix @ matrix)
        torch.cuda.synchronize(device)
    _event_seconds(device, lambda: torch.cuda._sleep(1000))  # first launch: module load, not the clock
    points = [(c, _event_seconds(device, functools.partial(torch.cuda._sleep, int(c))))
              for _ in range(repeats) for c in cycles]
    return fit_spin(points)


def check_spin(device, calibration: SpinCalibration, delays_s: Sequence[float] = (0.001, 0.01, 0.05),
               tolerance: float = 0.03) -> List[dict]:
    """Time a spin of each of ``delays_s`` with events; raise if one is off by more than ``tolerance``."""
    import torch
    measured = [(d, _event_seconds(device, functools.partial(torch.cuda._sleep, calibration.cycles_for(d))))
                for d in delays_s]
    failures = spin_check_failures(measured, tolerance)
    if failures:
        raise RuntimeError(f"the calibrated spin is off by more than {tolerance:.0%} "
                           f"({calibration.cycles_per_s / 1e9:.3f} GHz fitted): " + "; ".join(failures))
    return [{"requested_s": d, "measured_s": m, "error": m / d - 1.0} for d, m in measured]


def check_stream_only(device, calibration: SpinCalibration, seconds: float = 0.02, slack: float = 1.5) -> float:
    """Run a spin of ``seconds`` on a side stream and one on the current stream at once; raise unless
    they overlap (together under ``slack`` x ``seconds``): a delay must hold its stream, not the device.
    Returns the elapsed seconds of the pair."""
    import torch
    side = torch.cuda.Stream(device=device)
    cycles = calibration.cycles_for(seconds)

    def both():
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            torch.cuda._sleep(cycles)
        torch.cuda._sleep(cycles)
        torch.cuda.current_stream(device).wait_stream(side)
    took = _event_seconds(device, both)
    if took > slack * seconds:
        raise RuntimeError(f"two {seconds * 1e3:g} ms spins on two streams took {took * 1e3:.1f} ms: they did not "
                           f"run concurrently, so the emulated link would hold the device, not its stream")
    return took


# ----------------------------------------------------------------------------------------------
# The emulator


_nesting = threading.local()  # per thread: the depth of wrapped collectives (only the outermost is charged)


def _vector_bytes(value) -> float:
    if isinstance(value, (list, tuple)):
        return float(sum(t.numel() * t.element_size() for t in value))
    return float(value.numel() * value.element_size())


class _DelayedWork:
    """An async collective's handle whose ``wait()`` also waits for the emulated link."""

    def __init__(self, work, wait_link: Callable[[], None]):
        self._work, self._wait_link = work, wait_link

    def wait(self, *args, **kwargs):
        result = self._work.wait(*args, **kwargs) if self._work is not None else True
        self._wait_link()
        return result

    def __getattr__(self, name):
        return getattr(self._work, name)


@dataclass
class LinkRecord:
    """What crossed the link between two :meth:`LinkEmulator.take` calls. Reading :meth:`measured_s`
    waits for the delays charged to it (CUDA: their events; CPU: the host sleeps still running on a
    worker), so a study takes records during a run and reads them after."""
    calls: Dict[str, int] = field(default_factory=lambda: {c: 0 for c in MODELLED})
    messages: int = 0
    bits: float = 0.0
    requested_s: float = 0.0
    unmodelled: Dict[str, int] = field(default_factory=dict)
    host_slept_s: float = 0.0
    events: list = field(default_factory=list)
    sleeping: int = 0
    changed: threading.Condition = field(default_factory=threading.Condition)

    def measured_s(self, timeout_s: float = 600.0) -> float:
        """The link time that really elapsed: the events around each spin (CUDA), the host's sleeps (CPU)."""
        with self.changed:
            if not self.changed.wait_for(lambda: self.sleeping == 0, timeout=timeout_s):
                raise RuntimeError(f"{self.sleeping} emulated delays still running after {timeout_s:g} s")
            total = self.host_slept_s
        for start, end in self.events:
            end.synchronize()
            total += start.elapsed_time(end) / 1e3
        return total

    def as_dict(self) -> dict:
        measured = self.measured_s()
        return {"calls": dict(self.calls), "messages": self.messages, "bits": self.bits,
                "requested_s": self.requested_s, "measured_s": measured, "unmodelled": dict(self.unmodelled)}


class LinkEmulator:
    """Delays every collective the study process issues by its time on ``link`` (module docstring).

    ``device``: the device the collectives run on (CUDA: a calibrated spin on the current stream;
    CPU: a host sleep). ``calibration`` is required on CUDA. :attr:`link` may be replaced between
    measurements (one engine, several rates). :meth:`take` returns what crossed the link since the
    previous take.
    """

    def __init__(self, link: Link, device, calibration: Optional[SpinCalibration] = None):
        self.link = link
        self.device = device
        self.cuda = getattr(device, "type", str(device)) == "cuda"
        if self.cuda and calibration is None:
            raise ValueError("a CUDA link emulator needs the spin's calibration (calibrate_spin)")
        self.calibration = calibration
        self._lock = threading.Lock()
        self._link_stream = None
        self._record = LinkRecord()

    def take(self) -> LinkRecord:
        """The record since the previous take, and a fresh one from now on (no synchronisation)."""
        with self._lock:
            record, self._record = self._record, LinkRecord()
        return record

    # ---- one collective ----------------------------------------------------------------------
    def charge(self, collective: str, vector_bytes: float, async_op: bool = False, work=None):
        """Account one ``collective`` and delay what follows it; returns the handle to give back."""
        seconds = self.link.seconds(collective, vector_bytes)
        messages, bits = self.link.traffic(collective, vector_bytes)
        with self._lock:
            record = self._record
            record.calls[collective] += 1
            record.messages += messages
            record.bits += bits
            record.requested_s += seconds
            if not self.cuda and seconds > 0 and not async_op:
                with record.changed:  # before take() can hand the record out: it waits for this sleep
                    record.sleeping += 1
        import torch
        with torch.profiler.record_function(f"linkemu::{collective}"):  # names the delay in a trace
            if self.cuda:
                return self._spin(seconds, async_op, work, record)
            return self._sleep(seconds, async_op, work, record)

    def _spin(self, seconds: float, async_op: bool, work, record: LinkRecord):
        import torch
        cycles = self.calibration.cycles_for(seconds)
        if cycles == 0:
            return work
        current = torch.cuda.current_stream(self.device)
        stream = current
        if async_op:  # the link runs beside the caller's stream; its wait() joins it
            if self._link_stream is None:
                self._link_stream = torch.cuda.Stream(device=self.device)
            stream = self._link_stream
            stream.wait_stream(current)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record(stream)
            torch.cuda._sleep(cycles)
            end.record(stream)
        with self._lock:
            record.events.append((start, end))
        if async_op:
            return _DelayedWork(work, lambda: torch.cuda.current_stream(self.device).wait_event(end))
        return work

    def _sleep(self, seconds: float, async_op: bool, work, record: LinkRecord):
        if seconds <= 0:
            return work
        if async_op:  # the link started with the call; wait() sleeps for what is left of it
            deadline = time.perf_counter() + seconds

            def wait_link():
                left = deadline - time.perf_counter()
                if left > 0:
                    self._host_sleep(left, record, counted=False)
            return _DelayedWork(work, wait_link)
        self._host_sleep(seconds, record, counted=True)
        return work

    @staticmethod
    def _host_sleep(seconds: float, record: LinkRecord, counted: bool) -> None:
        """Sleep, and charge the time to the record of the collective's start (even if taken since)."""
        started = time.perf_counter()
        time.sleep(seconds)
        with record.changed:
            record.host_slept_s += time.perf_counter() - started
            if counted:
                record.sleeping -= 1
                record.changed.notify_all()

    # ---- installing the wrappers -------------------------------------------------------------
    def _wrap(self, original: Callable, collective: str, vector_argument: str, method: bool = False) -> Callable:
        signature = inspect.signature(original)

        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            if getattr(_nesting, "depth", 0) or (method and args[0].group is None):
                # Nested in a charged call, or a communicator without a process group, which is a
                # local copy at any world size (CO2's group of one rank): no link to cross.
                return original(*args, **kwargs)
            _nesting.depth = 1
            try:
                result = original(*args, **kwargs)
            finally:
                _nesting.depth = 0
            bound = signature.bind(*args, **kwargs)
            async_op = bool(bound.arguments.get("async_op", False))
            return self.charge(collective, _vector_bytes(bound.arguments[vector_argument]), async_op, result)
        return wrapper

    def _record_only(self, original: Callable, name: str) -> Callable:
        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            if not getattr(_nesting, "depth", 0):
                with self._lock:
                    self._record.unmodelled[name] = self._record.unmodelled.get(name, 0) + 1
            return original(*args, **kwargs)
        return wrapper

    def _deepspeed_zero1_gather(self, original: Callable) -> Callable:
        @functools.wraps(original)
        def wrapper(groups_flat, *args, **kwargs):
            if getattr(_nesting, "depth", 0):
                return original(groups_flat, *args, **kwargs)
            _nesting.depth = 1
            try:
                result = original(groups_flat, *args, **kwargs)
            finally:
                _nesting.depth = 0
            self.charge("all_gather", _vector_bytes(list(groups_flat)))
            return result
        return wrapper

    def _patches(self) -> List[Tuple[object, str, Callable]]:
        """``(owner, attribute, replacement)`` for every hook of the module docstring that exists now."""
        import sys

        import torch.distributed as dist

        from deepspeed_acco.runtime import comm
        patches = []
        for name, (collective, argument) in COMMUNICATOR_METHODS.items():
            patches.append((comm.Communicator, name,
                            self._wrap(getattr(comm.Communicator, name), collective, argument, method=True)))
        wrapped = {}
        for name, (collective, argument) in DIST_FUNCTIONS.items():
            if hasattr(dist, name):
                wrapped[getattr(dist, name)] = self._wrap(getattr(dist, name), collective, argument)
                patches.append((dist, name, wrapped[getattr(dist, name)]))
        for name in UNMODELLED_DIST_FUNCTIONS:
            if hasattr(dist, name):
                patches.append((dist, name, self._record_only(getattr(dist, name), name)))
        ds_comm = sys.modules.get("deepspeed.comm.comm")
        backend = getattr(ds_comm, "cdb", None)
        for attribute in ("all_gather_function", "reduce_scatter_function"):
            bound = getattr(backend, attribute, None)
            if bound in wrapped:
                patches.append((backend, attribute, wrapped[bound]))
        zero = sys.modules.get("deepspeed.runtime.zero.stage_1_and_2")
        if zero is not None and hasattr(zero, "all_gather_dp_groups"):
            patches.append((zero, "all_gather_dp_groups", self._deepspeed_zero1_gather(zero.all_gather_dp_groups)))
        return patches

    @contextlib.contextmanager
    def installed(self) -> Iterator["LinkEmulator"]:
        """Wrap the collectives while the block runs (import DeepSpeed's engine before entering)."""
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() != 1:
            raise RuntimeError(f"the link emulator stands in for the other ranks of a process of world size 1; this "
                               f"process group has {dist.get_world_size()} ranks, whose collectives are real")
        saved = []
        try:
            for owner, attribute, replacement in self._patches():
                saved.append((owner, attribute, owner.__dict__.get(attribute, _MISSING) if isinstance(owner, type)
                              else getattr(owner, attribute)))
                setattr(owner, attribute, replacement)
            yield self
        finally:
            for owner, attribute, original in reversed(saved):
                if original is _MISSING:
                    delattr(owner, attribute)
                else:
                    setattr(owner, attribute, original)


_MISSING = object()
