"""Where the training thread's time goes, and the timeline of what overlapped (docs/design.md, "Where
the time goes").

:class:`TimeBreakdown` adds up, per rank, the training thread's seconds in four parts:

* ``compute``: the forward and backward passes (``engine(...)`` and ``engine.backward``, which also
  adds the micro-batch's gradients to the fp32 accumulator);
* ``blocked``: a round boundary waiting for a communication job's collectives;
* ``optimizer``: a boundary waiting while the job runs its shard update (the optimizer on the
  critical path: every synchronous update, and an overlapped job that is still updating when the
  round ends);
* ``boundary``: the rest of a boundary's ``step()`` (installing the gathered parameters, handing the
  gradients over, launching the next job, the accounting of a commit);

Anything else the training loop does (loading data, logging, evaluating) is the caller's: the
bench measures it as "the rest", so that the parts add up to the wall time.

A wait is split by the job's own phases: on the CPU each job records when each phase started and
ended (``PhaseClock``), on the clock the training thread reads, so the part of a wait during which
the job ran its update is ``optimizer`` and the rest ``blocked``. A CUDA job's phases are event
pairs on its stream, whose durations alone are known: a wait for a job launched synchronously
counts the job's update time as ``optimizer``, an overlapped one's wait is ``blocked``.

:class:`Timeline` records the same intervals as events (the training thread's and each job's
phases) when asked, for a Chrome/Perfetto trace (:func:`chrome_trace`).
"""
import collections
import threading
import time
from typing import Deque, Dict, Iterable, List, Optional, Sequence, Tuple

PARTS = ("compute", "blocked", "optimizer", "boundary")
"""The parts of the training thread's time the engine measures, in the order reports list them."""

UPDATE_PHASE = "update"
"""The job phase that runs the shard update (``ShardUpdateJob``, ``CO2OuterJob``)."""

Span = Tuple[str, float, float]
"""(name, start, end): seconds on ``time.perf_counter``'s clock."""


def overlap_s(start: float, end: float, spans: Iterable[Span], name: str) -> float:
    """Seconds of [start, end] covered by the spans called ``name``."""
    return sum(max(0.0, min(end, span_end) - max(start, span_start))
               for span_name, span_start, span_end in spans if span_name == name)


def split_wait(start: float, end: float, spans: Sequence[Span], *, update_s: float = 0.0,
               synchronous: bool = False) -> Tuple[float, float]:
    """``(blocked, optimizer)`` seconds of a wait from ``start`` to ``end`` for a job whose phases are
    ``spans`` (CPU). Without spans (CUDA), a synchronous job's ``update_s`` (at most the wait) is the
    optimizer's and the rest is blocked."""
    waited = max(0.0, end - start)
    if spans:
        optimizer = min(waited, overlap_s(start, end, spans, UPDATE_PHASE))
    else:
        optimizer = min(waited, update_s) if synchronous else 0.0
    return waited - optimizer, optimizer


class Timeline:
    """Events of the training thread and of the communication jobs, kept while recording.

    ``start(max_events)`` begins (older events are dropped beyond ``max_events``), ``stop()`` ends;
    :func:`chrome_trace` turns :meth:`events` into a trace. Times are ``time.perf_counter`` seconds.
    """

    TRAINING = "training thread"
    COMMUNICATION = "communication job"

    def __init__(self):
        self._events: Optional[Deque[tuple]] = None
        self._lock = threading.Lock()

    @property
    def recording(self) -> bool:
        return self._events is not None

    def start(self, max_events: int = 20000) -> None:
        self._events = collections.deque(maxlen=max_events)

    def stop(self) -> None:
        self._events = None

    def add(self, track: str, name: str, start: float, end: float, **args) -> None:
        events = self._events
        if events is not None:
            with self._lock:
                events.append((track, name, start, end, args))

    def events(self) -> List[tuple]:
        """``(track, name, start_s, end_s, args)`` in recording order."""
        with self._lock:
            return list(self._events or ())


class DeviceTime:
    """Device time of the compute on CUDA: event pairs recorded around forward and backward on the current
    stream, summed once they are complete, so that reading them never waits unless asked to."""

    def __init__(self):
        self.seconds = 0.0
        self._pending: Deque[tuple] = collections.deque()

    def start(self):
        import torch
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def stop(self, started) -> None:
        import torch
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self._pending.append((started, event))

    def collect(self, wait: bool = False) -> float:
        """Add the finished pairs (all of them with ``wait``: waits for the last one) and return the sum."""
        if wait and self._pending:
            self._pending[-1][1].synchronize()
        while self._pending and self._pending[0][1].query():
            started, ended = self._pending.popleft()
            self.seconds += started.elapsed_time(ended) / 1e3
        return self.seconds


class TimeBreakdown:
    """Cumulative seconds of the training thread per part (:data:`PARTS`), and its :class:`Timeline`.

    With ``cuda`` the compute is also timed on the device (:class:`DeviceTime`): the snapshot's
    ``device_compute``, what the regime measures on CUDA, where the host only launches kernels."""

    def __init__(self, cuda: bool = False):
        self.device_time: Optional[DeviceTime] = DeviceTime() if cuda else None
        self.seconds: Dict[str, float] = dict.fromkeys(PARTS, 0.0)
        self.timeline = Timeline()
        self.job_phase_s: Dict[str, float] = {}
        """Summed durations of the waited jobs' phases (reduce_scatter, update, all_gather, ...)."""
        self.job_s = 0.0
        """Summed time from each waited job's submission to the end of its last phase (CPU)."""
        self.jobs = 0
        """Jobs waited for that crossed the network (each counted once, at its first wait)."""

    def add(self, part: str, start: float, end: float, name: Optional[str] = None, **args) -> None:
        """Count [start, end] as ``part``; record it on the training thread's track as ``name``."""
        self.seconds[part] += end - start
        self.timeline.add(Timeline.TRAINING, name or part, start, end, part=part, **args)

    def timed(self, part: str, name: Optional[str] = None) -> "_Timed":
        """``with breakdown.timed("compute", "forward"): ...`` counts the block."""
        return _Timed(self, part, name)

    def wait(self, start: float, end: float, label: str, spans: Sequence[Span], *, update_s: float = 0.0,
             synchronous: bool = False, phases: Optional[Dict[str, float]] = None,
             submitted_at: Optional[float] = None) -> None:
        """Count a boundary's wait for a job (split by :func:`split_wait`); count the job's phases
        (``phases``: durations) once, and record them on the timeline."""
        blocked, optimizer = split_wait(start, end, spans, update_s=update_s, synchronous=synchronous)
        self.seconds["blocked"] += blocked
        self.seconds["optimizer"] += optimizer
        if phases:  # a job whose result carries no phase clock (a gather of CO2's) is not counted
            self.jobs += 1
            for name, seconds in phases.items():
                self.job_phase_s[name] = self.job_phase_s.get(name, 0.0) + seconds
            if spans and submitted_at is not None:
                self.job_s += max(span_end for _, _, span_end in spans) - submitted_at
        timeline = self.timeline
        if timeline.recording:
            timeline.add(Timeline.TRAINING, f"wait: {label}", start, end, part="blocked/optimizer",
                         blocked_ms=round(1e3 * blocked, 3), optimizer_ms=round(1e3 * optimizer, 3))
            if phases:
                for name, span_start, span_end in spans:
                    timeline.add(Timeline.COMMUNICATION, name, span_start, span_end, job=label)

    def snapshot(self, wait_for_device: bool = False) -> Dict[str, float]:
        """The parts' seconds, and the jobs' (``jobs``, ``job_s``, ``job_<phase>_s``); on CUDA also
        ``device_compute`` (the finished part of it, or all of it with ``wait_for_device``)."""
        values = dict(self.seconds, jobs=self.jobs, job_s=self.job_s)
        if self.device_time is not None:
            values["device_compute"] = self.device_time.collect(wait_for_device)
        values.update({f"job_{name}_s": seconds for name, seconds in self.job_phase_s.items()})
        return values


class _Timed:
    __slots__ = ("breakdown", "part", "name", "start", "device_start")

    def __init__(self, breakdown: TimeBreakdown, part: str, name: Optional[str]):
        self.breakdown, self.part, self.name = breakdown, part, name

    def __enter__(self):
        device_time = self.breakdown.device_time
        self.device_start = device_time.start() if device_time is not None and self.part == "compute" else None
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.breakdown.add(self.part, self.start, time.perf_counter(), self.name)
        if self.device_start is not None:
            self.breakdown.device_time.stop(self.device_start)
        return False


def chrome_trace(events: Iterable[tuple], *, process_name: str, pid: int = 0, origin: Optional[float] = None) -> Dict:
    """The events as a Chrome/Perfetto trace (JSON object format; open it in ui.perfetto.dev or
    chrome://tracing): one process, one thread per track, complete ("X") events in microseconds
    from ``origin`` (default: the first event's start)."""
    events = list(events)
    if origin is None:
        origin = min((start for _, _, start, _, _ in events), default=0.0)
    tracks: Dict[str, int] = {}
    trace = [{"name": "process_name", "ph": "M", "pid": pid, "args": {"name": process_name}}]
    for track, name, start, end, args in events:
        if track not in tracks:
            tracks[track] = len(tracks)
            trace.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tracks[track], "args": {"name": track}})
        trace.append({"name": name, "ph": "X", "pid": pid, "tid": tracks[track], "ts": round(1e6 * (start - origin), 1),
                      "dur": round(1e6 * max(0.0, end - start), 1), "args": args})
    return {"traceEvents": trace, "displayTimeUnit": "ms"}
