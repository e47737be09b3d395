"""The communication side of the pipeline (docs/design.md, section 3; docs/failures.md): the lane that issues
every job's collectives in one order, the narrow communicator object the jobs talk to, the
control plane, and the timeouts that turn a dead peer into an error naming the collective.

**One ordered lane.** Every collective the engine runs belongs to a *job* (a plain callable made of
collectives and shard math) that the training thread submits with :meth:`Lane.submit`, in the
schedule's program order, which is the same on every rank. ``submit`` returns a :class:`Work`
handle at once; ``Work.wait()`` at a round boundary returns the job's result or re-raises its
error with its traceback.

* CPU (gloo): each communicator has a FIFO worker thread. Jobs of one communicator run in
  submission order; jobs of different communicators (CO2's group steps and its outer averaging)
  run concurrently, which is safe because gloo groups are independent transports.
* CUDA (NCCL): a job runs *inline*, on the training thread, when it is submitted: its kernels and
  NCCL calls are enqueued on the communicator's side stream after that stream waits for the
  training stream, and nothing in a job waits for the device, so ``submit`` returns as soon as the
  work is enqueued and the device overlaps it with the compute that follows. Every NCCL call of
  the engine is therefore issued from the training thread, in program order, identically on every
  rank. NCCL >= 2.26 with ``NCCL_LAUNCH_ORDER_IMPLICIT=1`` (set by :func:`prepare_nccl_environment`
  unless the user chose a value) executes the operations of several communicators on a GPU in
  that host order, which is what NCCL requires of communicators sharing a device. Without it
  (older NCCL, or the variable set to 0) all of the engine's jobs share one side stream, so its
  own collectives are totally ordered on the device; CO2's outer job then no longer overlaps its
  group steps.

**No host synchronisation inside a job.** Jobs keep their statistics on the device and hand back
a :class:`DeviceReadback`: a small tensor that the lane copies to pinned host memory on the job's
stream, without waiting, right after the job. ``Work.wait()`` waits (polling) for the job's
completion event only, then reads the copy; that wait is the one host synchronisation the
pipeline makes, at a round boundary. ``Work.is_done()`` queries the event.

**Timeouts.** A collective that has not completed ``communication_timeout_s`` after it was issued
makes the waiting training thread raise :class:`CommunicationError` naming the job, the
collective and the process group. Our process groups are created with the longer
:func:`process_group_timeout_s`, so this check fires before gloo's own timeout or NCCL's watchdog
(which tears the process down); see :func:`new_communicator` for the NCCL settings.

Each collective is labelled for the profiler (``acco::reduce_scatter`` ...).
"""
import contextlib
import datetime
import inspect
import logging
import os
import queue
import threading
import time
import traceback
import weakref
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch
import torch.distributed as dist

logger = logging.getLogger("DeepSpeed").getChild("acco")

# torch 2.13 renamed the flat-tensor collectives; older releases only have the old names.
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

# How often a waiting training thread looks at a CPU worker (and checks for a hang).
_POLL_INTERVAL_S = 0.5
# Polling a CUDA event: start fine (a job that is nearly done costs microseconds), back off to
# this, so a boundary that really waits overshoots by at most this much.
_EVENT_POLL_MAX_S = 2e-4
_EVENT_POLL_MIN_S = 1e-5

# The process groups' own timeout exceeds communication_timeout_s by this much (at least
# WATCHDOG_GRACE_MIN_S), so our hang check, which polls every _POLL_INTERVAL_S, always fires
# first and names the collective.
WATCHDOG_GRACE_MIN_S = 30.0
WATCHDOG_GRACE_FRACTION = 0.25

# NCCL (>= 2.26) orders the operations of several communicators of one GPU by the order the host
# issued them in, instead of requiring the application to serialise them.
SMALL_ALL_REDUCE_NUMEL = 64
"""On gloo an all-reduce of at most this many values (a job's statistics) is an all-gather and a sum
in rank order: W - 1 sequential messages instead of the ring all-reduce's 2 (W - 1), which is what
matters on a link with latency (docs/results.md, "Latency, on paper")."""
NCCL_LAUNCH_ORDER_ENV = "NCCL_LAUNCH_ORDER_IMPLICIT"
NCCL_LAUNCH_ORDER_MIN_VERSION = (2, 26)

# Settings of the torch NCCL process groups the engine creates (read by ProcessGroupNCCL when a
# group is constructed). Async error handling 3 ("skip clean-up"): when a collective exceeds the
# group's timeout the watchdog tears the process down, so a hang never outlives
# process_group_timeout_s even when the training thread is blocked outside our waits. Blocking
# wait off: a collective must never block the host, which would make every job a host sync.
NCCL_GROUP_ENVIRONMENT = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "TORCH_NCCL_BLOCKING_WAIT": "0"}


class CommunicationError(RuntimeError):
    """A communication job failed; the message names the job, the collective and the rank."""


# ---- timeouts --------------------------------------------------------------------------------
def process_group_timeout_s(communication_timeout_s: float) -> float:
    """The timeout our process groups get: later than the hang check, which fires at ``communication_timeout_s``.

    gloo then raises and NCCL's watchdog tears the process down only if the training thread could
    not run the check (blocked outside a boundary wait, e.g. in a user's ``.item()``).
    """
    grace = max(WATCHDOG_GRACE_MIN_S, WATCHDOG_GRACE_FRACTION * communication_timeout_s)
    return communication_timeout_s + grace


class _CollectiveRecord:
    """One issued collective: when, and (CUDA) the event recorded on the job's stream after it."""

    __slots__ = ("name", "group", "peers", "issued_at", "event", "completed")

    def __init__(self, name: str, group: str, peers: Optional[List[int]] = None):
        self.name = name
        self.group = group
        self.peers = peers or []
        """The global ranks this collective waits on (for the hang report)."""
        self.issued_at = time.perf_counter()
        self.event: Optional[torch.cuda.Event] = None
        self.completed = False

    def finished(self) -> bool:
        if not self.completed and self.event is not None and self.event.query():
            self.completed = True
        return self.completed


def _peer_text(peers: List[int]) -> str:
    """How a hang report names the ranks a collective waits on."""
    if len(peers) == 1:
        return f"peer rank {peers[0]}"
    return f"one of peer ranks {', '.join(map(str, peers))}" if peers else "a peer rank"


# The records of the job running on this thread (the CPU worker, or the training thread while it
# enqueues a CUDA job); communicators append to it.
_running_job = threading.local()


# ---- what jobs hand back ---------------------------------------------------------------------
class PhaseClock:
    """Durations of a job's phases: host time on a CPU worker, CUDA event pairs on the job's stream.

    The events are read in :meth:`seconds`, after the job's completion was seen, so reading them
    is no synchronisation.
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._phases: List[tuple] = []
        self._spans: List[tuple] = []

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._phases.append((name, start, end))
        else:
            started = time.perf_counter()
            yield
            ended = time.perf_counter()
            self._phases.append((name, ended - started))
            self._spans.append((name, started, ended))

    def record(self, name: str, seconds: float) -> None:
        """A duration measured otherwise (the CPU worker's thread time)."""
        self._phases.append((name, seconds))

    def seconds(self) -> Dict[str, float]:
        totals: Dict[str, float] = {}
        for name, *measured in self._phases:
            value = measured[0].elapsed_time(measured[1]) / 1e3 if len(measured) == 2 else measured[0]
            totals[name] = totals.get(name, 0.0) + value
        return totals

    def spans(self) -> List[tuple]:
        """``(name, start, end)`` of each phase on ``time.perf_counter``'s clock (CPU jobs; empty on CUDA,
        whose phases are device events): what the training thread's waits are split by
        (runtime/timeline.py)."""
        return list(self._spans)


class DeviceReadback:
    """A job's result as it leaves the job: values computed on the device, and how to build the result.

    ``values`` is a small tensor on the job's device; ``build(values_as_list, phase_seconds)``
    makes the result object. The lane calls :meth:`start` on the job's stream right after the job
    (a non-blocking copy into pinned memory on CUDA); ``Work.wait`` calls :meth:`finish` once the
    job's completion has been seen, so the read costs no synchronisation. On the CPU the values
    are read directly.
    """

    def __init__(self, values: torch.Tensor, build: Callable[[List[float], Dict[str, float]], Any],
                 clock: Optional[PhaseClock] = None):
        self.values = values
        self.build = build
        self.clock = clock
        self._host: Optional[torch.Tensor] = None

    def start(self) -> None:
        if self.values.is_cuda:
            self._host = torch.empty(self.values.shape, dtype=self.values.dtype, pin_memory=True)
            self._host.copy_(self.values, non_blocking=True)
        else:
            self._host = self.values

    def finish(self) -> Any:
        if self._host is None:  # a job called directly, not through a lane: copy, and wait for the copy here
            self.start()
            if self.values.is_cuda:
                torch.cuda.current_stream(self.values.device).synchronize()
        return self.build(self._host.tolist(), self.clock.seconds() if self.clock is not None else {})


# ---- work handles ----------------------------------------------------------------------------
class Work:
    """Handle to one submitted job (the ``torch.distributed`` Work idiom).

    The handle owns the job, and with it every tensor the job was given, until a wait has seen the
    job complete: a tensor allocated on the training stream and read by the job on a side stream
    is therefore never freed (and its memory reused) while the side stream may still read it.
    """

    def __init__(self, label: str, lane: "Lane", communicator: "Communicator", job: Callable[[], Any]):
        self.label = label
        self.communicator = communicator
        self.collectives: List[_CollectiveRecord] = []
        """The collectives the job has issued so far, oldest first (for the hang check)."""
        # Weak: the lane holds its jobs in flight, so a strong reference back would make a cycle that
        # only the garbage collector frees, and with it every buffer the job was given.
        self._lane = weakref.ref(lane)
        self._rank = lane.rank
        self._device = lane.device
        self._job: Optional[Callable[[], Any]] = job
        self.submitted_at = time.perf_counter()
        self.counted = False
        """Whether a schedule has counted this job's phases (runtime/timeline.py counts each job once)."""
        self._finished = threading.Event()
        self._result: Any = None
        self._error: Optional[BaseException] = None
        self._error_traceback = ""
        self._done_event: Optional[torch.cuda.Event] = None
        self._resolved = False
        self._value: Any = None
        self.phase_spans: List[tuple] = []
        """Once waited: the job's phases as ``(name, start, end)`` (CPU; :meth:`PhaseClock.spans`)."""
        self.phase_seconds: Dict[str, float] = {}
        """Once waited: the job's phase durations (:meth:`PhaseClock.seconds`)."""

    def _finish(self, result: Any = None, error: Optional[BaseException] = None,
                done_event: Optional[torch.cuda.Event] = None) -> None:
        self._result = result
        self._error = error
        self._done_event = done_event
        if error is not None:
            self._error_traceback = "".join(traceback.format_exception(error))
        self._finished.set()

    def oldest_unfinished_collective(self) -> Optional[_CollectiveRecord]:
        for record in list(self.collectives):
            if not record.finished():
                return record
        return None

    def _check_hang(self) -> None:
        lane = self._lane()
        if lane is not None:  # else only a handle kept past its engine's life waits: no lane to check
            lane.check_hang(self)

    def is_done(self) -> bool:
        """True once the job has finished (on GPU: once its kernels have completed too). Never blocks."""
        if not self._finished.is_set():
            return False
        return self._done_event is None or self._done_event.query()

    def wait(self) -> Any:
        """Wait for the job; return its result or raise its error (as :class:`CommunicationError`).

        CPU: waits for the worker. CUDA: polls the job's completion event (the job itself was
        enqueued at submission), then makes the current stream wait for it too. Raises if one of
        the lane's collectives is overdue (:meth:`Lane.check_hang`). Later calls return the same.
        """
        if self._resolved:
            return self._value
        while not self._finished.wait(_POLL_INTERVAL_S):
            self._check_hang()
        if self._error is not None:
            raise CommunicationError(f"communication job {self.label!r} failed on rank {self._rank}: "
                                     f"{self._error}\n--- worker traceback ---\n{self._error_traceback}") \
                from self._error
        if self._done_event is not None:
            delay = _EVENT_POLL_MIN_S
            while not self._done_event.query():
                self._check_hang()
                time.sleep(delay)
                delay = min(2 * delay, _EVENT_POLL_MAX_S)
            torch.cuda.current_stream(self._device).wait_event(self._done_event)
        result = self._result
        if isinstance(result, DeviceReadback) and result.clock is not None:
            self.phase_spans = result.clock.spans()
            self.phase_seconds = result.clock.seconds()
        self._value = result.finish() if isinstance(result, DeviceReadback) else result
        self._resolved = True
        self._job = None
        self._result = None
        return self._value


class CompletedWork:
    """A job that already finished, e.g. the pending job of a loaded checkpoint."""

    def __init__(self, label: str, result: Any):
        self.label = label
        self._result = result
        self.phase_spans: List[tuple] = []
        self.phase_seconds: Dict[str, float] = {}

    def is_done(self) -> bool:
        return True

    def wait(self) -> Any:
        return self._result


# ---- communicators ---------------------------------------------------------------------------
class Communicator:
    """Collectives on one dedicated process group, labelled and recorded for hang reports.

    This is the only object the update jobs use to communicate, so the schedule can be tested
    with a fake that records what was sent when. A group of one rank on gloo (and the group-less
    communicator of CO2 without groups) copies locally; an NCCL group of one runs the real
    collectives, so that the GPU pipeline (NCCL streams, events) is the same at every world size.
    """

    def __init__(self, group, rank: int, world_size: int, name: str, global_ranks: Optional[List[int]] = None,
                 backend: Optional[str] = None):
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.name = name
        self.backend = backend
        self.global_ranks = global_ranks if global_ranks is not None else list(range(world_size))
        """The global rank of each member, for point-to-point messages."""
        self.local = group is None or (world_size == 1 and backend != "nccl")
        """Collectives are local copies (no process group call)."""
        self.point_to_point = backend == "gloo"
        """Run the large collectives as point-to-point messages, receives posted first (gloo): its
        reduce_scatter runs a whole all-reduce (measured on a 1 Gbit/s link: 213 ms for 3.3M fp32
        values against 105 ms for the all-gather of the same size), so the reduce-scatter and the
        all-gather are rings of sends that move the minimal (W - 1) / W of the data, and
        :func:`_point_to_point` says why the receives go first."""
        self._ring_buffers: dict = {}
        self._released = False

    def release(self) -> None:
        """Drop this communicator's reference to its process group (after ``destroy_process_group``).

        The group's backend, and with it gloo's worker threads, is torn down when its last
        reference goes; doing that here, while the interpreter is intact, means no gloo thread
        is left to finish a collective during interpreter finalisation (where releasing the
        tensors of the last job needs the GIL, and a thread that asks for it then is ended by
        Python mid-destructor, which aborts the process). Later collectives raise.
        """
        self.group = None
        self._ring_buffers = {}
        self._released = True

    def _peers(self, members: Optional[List[int]] = None) -> List[int]:
        """Global ranks of ``members`` (this communicator's ranks; default: all) other than this one."""
        members = range(self.world_size) if members is None else members
        return sorted({self.global_ranks[m] for m in members if m != self.rank})

    def _run(self, collective: str, fn: Callable[[], Any], peers: Optional[List[int]] = None) -> None:
        if self._released:
            raise CommunicationError(f"collective {collective} on process group {self.name!r}: the engine was "
                                     f"destroyed (engine.destroy()) and its process groups released")
        peers = self._peers() if peers is None else peers
        record = _CollectiveRecord(collective, self.name, peers)
        records = getattr(_running_job, "records", None)
        if records is not None:
            records.append(record)
        try:
            with torch.profiler.record_function(f"acco::{collective}"):
                fn()
        except Exception as error:
            raise CommunicationError(f"collective {collective} on process group {self.name!r} failed on rank "
                                     f"{self.rank} (world size {self.world_size}, waiting on "
                                     f"{_peer_text(peers)}): {error}") from error
        if self.backend == "nccl":
            # Enqueued, not done: the collective completes when the job's stream passes this event.
            record.event = torch.cuda.Event()
            record.event.record()
        else:
            record.completed = True

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """Sum ``input`` over ranks and keep this rank's equal-size chunk in ``output``."""
        if self.local:
            output.copy_(input)
            return
        if self.point_to_point:  # a ring waits on its two neighbours only
            ring = [(self.rank - 1) % self.world_size, (self.rank + 1) % self.world_size]
            self._run("reduce_scatter", lambda: self._ring_reduce_scatter(output, input), peers=self._peers(ring))
        else:
            self._run("reduce_scatter", lambda: _reduce_scatter_flat(output, input, group=self.group))

    def _ring_reduce_scatter(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """Ring reduce-scatter: W - 1 steps; in step s this rank passes its running sum of chunk
        (rank - s - 1) to the right and adds its own part of chunk (rank - s - 2) to what arrives
        from the left. After the last step it holds the full sum of its own chunk."""
        world_size, rank = self.world_size, self.rank
        chunks = input.view(world_size, -1)
        right, left = (rank + 1) % world_size, (rank - 1) % world_size
        key = (chunks.shape[1], input.dtype, input.device)
        if key not in self._ring_buffers:
            self._ring_buffers[key] = (torch.empty_like(chunks[0]), torch.empty_like(chunks[0]))
        received, outgoing = self._ring_buffers[key]
        outgoing.copy_(chunks[(rank - 1) % world_size])
        for step in range(world_size - 1):
            _point_to_point([(right, outgoing)], [(left, received)], self.group, self.global_ranks)
            own = chunks[(rank - step - 2) % world_size]
            torch.add(received, own, out=output if step == world_size - 2 else outgoing)

    def _ring_all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """Ring all-gather: W - 1 steps; in step s this rank passes chunk (rank - s) to the right and
        receives chunk (rank - s - 1) from the left, straight into ``output`` (no extra buffer)."""
        world_size, rank = self.world_size, self.rank
        chunks = output.view(world_size, -1)
        if chunks[rank].data_ptr() != input.data_ptr():
            chunks[rank].copy_(input)
        right, left = (rank + 1) % world_size, (rank - 1) % world_size
        for step in range(world_size - 1):
            _point_to_point([(right, chunks[(rank - step) % world_size])],
                            [(left, chunks[(rank - step - 1) % world_size])], self.group, self.global_ranks)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """Concatenate every rank's ``input`` into ``output`` (``input`` may alias this rank's chunk)."""
        if self.local:
            if output.data_ptr() != input.data_ptr():
                output.copy_(input)
            return
        if self.point_to_point:  # gloo: the same ring of sends as the reduce-scatter
            ring = [(self.rank - 1) % self.world_size, (self.rank + 1) % self.world_size]
            self._run("all_gather", lambda: self._ring_all_gather(output, input), peers=self._peers(ring))
        else:
            self._run("all_gather", lambda: _all_gather_flat(output, input, group=self.group))

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: List[int],
                   input_split_sizes: List[int], collective: str = "all_to_all") -> None:
        """Send ``input``'s i-th slice (``input_split_sizes[i]`` elements) to rank i and receive rank
        i's slice for this rank into ``output``'s i-th slice; ``collective`` names it in profiles and
        hang reports (the quantised reduce-scatter passes its own name)."""
        if self.world_size == 1:
            if output.data_ptr() != input.data_ptr():
                output.copy_(input)
            return
        if self.point_to_point:  # gloo: point to point, receives posted first (_point_to_point)
            self._run(collective, lambda: self._point_to_point_all_to_all(output, input, output_split_sizes,
                                                                          input_split_sizes))
            return
        self._run(collective, lambda: dist.all_to_all_single(output, input, output_split_sizes=output_split_sizes,
                                                             input_split_sizes=input_split_sizes, group=self.group))

    def _point_to_point_all_to_all(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: List[int],
                                   input_split_sizes: List[int]) -> None:
        outputs = output.split(output_split_sizes)
        inputs = input.split(input_split_sizes)
        if outputs[self.rank].numel():
            outputs[self.rank].copy_(inputs[self.rank])
        peers = [peer for peer in range(self.world_size) if peer != self.rank]
        _point_to_point([(peer, inputs[peer]) for peer in peers if inputs[peer].numel()],
                        [(peer, outputs[peer]) for peer in peers if outputs[peer].numel()],
                        self.group, self.global_ranks)

    def exchange(self, sends: List[tuple], receives: List[tuple]) -> None:
        """Point-to-point: post every ``(peer rank, tensor)`` send and receive, then wait for all.

        Peers are ranks of this communicator; a collective in the sense that the peers must post the
        matching calls (checkpoints use it to move shards between layouts).
        """
        if not sends and not receives:
            return

        def run():
            _point_to_point(sends, receives, self.group, self.global_ranks)
        self._run("exchange", run, peers=self._peers([peer for peer, _ in sends + receives]))

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over ranks in place (the small per-job statistics; CO2's outer averaging).

        On gloo a small tensor (:data:`SMALL_ALL_REDUCE_NUMEL`) is all-gathered and summed in rank
        order on every rank: half the sequential messages of gloo's ring all-reduce, the same sum on
        every rank (bitwise equal to the ring's at two ranks, where either adds the two values)."""
        if self.local:
            return
        if self.backend != "nccl" and tensor.numel() <= SMALL_ALL_REDUCE_NUMEL:
            self._run("all_reduce", lambda: self._gathered_sum(tensor))
            return
        self._run("all_reduce", lambda: dist.all_reduce(tensor, group=self.group))

    def _gathered_sum(self, tensor: torch.Tensor) -> None:
        flat = tensor.reshape(-1).contiguous()
        gathered = torch.empty(self.world_size * flat.numel(), dtype=flat.dtype, device=flat.device)
        dist.all_gather_into_tensor(gathered, flat, group=self.group)
        rows = gathered.view(self.world_size, -1)
        total = rows[0].clone()
        for row in rows[1:]:
            total.add_(row)
        tensor.copy_(total.view_as(tensor))


_P2P_BY_GROUP_RANK = "group_dst" in inspect.signature(dist.isend).parameters
"""Whether torch addresses a point-to-point message by the peer's rank in the group (torch >= 2.6)."""


def _point_to_point(sends: List[tuple], receives: List[tuple], group, global_ranks: List[int]) -> None:
    """Post every ``(peer, tensor)`` receive, then every send, and wait for all of them; a peer is its
    rank in ``group``, whose members are ``global_ranks``.

    The receives go first because gloo's TCP pair sends a large message only once the peer has
    announced the matching receive: when both sides post their send first, each announcement queues
    behind the data already flowing the other way, and on a rate-limited link an exchange took up to
    twice its time (6.6 MB each way at 398 Mbit/s: 224-261 ms, against 133 ms, the link's own time,
    with the receive first; docs/design.md, "The communication job").

    Addressed by group rank, a message needs no lookup in torch's registry of process groups, so a
    job in flight still completes after the script destroyed the process groups
    (``dist.destroy_process_group()`` at its end, before the engine's exit hook; gloo's shutdown
    leaves a group that is still referenced working). By global rank (torch < 2.6) its next
    message fails there, and its peers wait in their step until that rank's process exits or the
    timeout."""
    if _P2P_BY_GROUP_RANK:
        handles = [dist.irecv(tensor, group=group, group_src=peer) for peer, tensor in receives]
        handles += [dist.isend(tensor, group=group, group_dst=peer) for peer, tensor in sends]
    else:
        handles = [dist.irecv(tensor, src=global_ranks[peer], group=group) for peer, tensor in receives]
        handles += [dist.isend(tensor, dst=global_ranks[peer], group=group) for peer, tensor in sends]
    for handle in handles:
        handle.wait()


@contextlib.contextmanager
def _environment(values: Dict[str, str]) -> Iterator[None]:
    """Set environment variables for the duration of the block (torch reads them at group creation)."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def new_communicator(ranks: List[int], timeout_s: float, name: str, backend: Optional[str] = None) -> Communicator:
    """Create a dedicated process group over ``ranks`` (collective: every rank must call it, in order).

    ``timeout_s`` is ``communication_timeout_s``; the group gets :func:`process_group_timeout_s`
    of it, and an NCCL group the settings of :data:`NCCL_GROUP_ENVIRONMENT` (the user's own
    groups keep theirs).
    """
    timeout = datetime.timedelta(seconds=process_group_timeout_s(timeout_s))
    backend = backend or dist.get_backend()
    world_rank = dist.get_rank()
    settings = NCCL_GROUP_ENVIRONMENT if backend == "nccl" else {}
    with _environment(settings):
        if len(ranks) == dist.get_world_size():
            group = dist.new_group(backend=backend, timeout=timeout)
        else:
            group = dist.new_group(ranks=ranks, backend=backend, timeout=timeout)
    rank = ranks.index(world_rank) if world_rank in ranks else -1
    return Communicator(group, rank, len(ranks), name, global_ranks=list(ranks), backend=backend)


def nccl_version() -> Optional[tuple]:
    """The NCCL version torch was built with, or None without CUDA/NCCL."""
    try:
        version = torch.cuda.nccl.version()
    except Exception:  # a CPU-only build of torch has no NCCL
        return None
    if isinstance(version, int):  # NCCL_VERSION_CODE: X*10000 + Y*100 + Z since 2.9, X*1000 + Y*100 + Z before
        major, rest = divmod(version, 10000 if version >= 20900 else 1000)
        return (major, *divmod(rest, 100))
    return tuple(version) if isinstance(version, (tuple, list)) else None


def nccl_communicators_in_use() -> List[str]:
    """Names of this process's torch process groups whose NCCL communicators already exist.

    torch creates a group's NCCL communicator at the group's first collective (or at
    ``init_process_group(device_id=...)``); NCCL reads its environment then or at its first launch.
    """
    from torch.distributed import distributed_c10d

    names = []
    world = distributed_c10d._world
    for group, (backend_name, _store) in list(world.pg_map.items()):
        if "nccl" not in str(backend_name):
            continue
        try:
            backend = group._get_backend(torch.device("cuda"))
        except (RuntimeError, ValueError):  # the group has no CUDA backend
            continue
        is_initialized = getattr(backend, "_is_initialized", None)
        if is_initialized is not None and is_initialized():
            names.append(str(world.pg_names.get(group, "?")))
    return names


# The NCCL process groups that already had communicators when the engine set
# NCCL_LAUNCH_ORDER_IMPLICIT itself (empty: it was set before any NCCL use, or by the user).
_launch_order_set_after: List[str] = []


def prepare_nccl_environment() -> None:
    """Ask NCCL to order several communicators' operations by host issue order (before its first launch).

    Respects a value the user set. NCCL reads the variable once per process, at its first
    communicator or launch: if a torch NCCL group already has a communicator when the engine sets
    it (the script ran an NCCL collective or barrier before ``initialize``, as Accelerate and the HF
    Trainer do, or created its group with ``device_id``), the ordering may not be in effect. Then
    this warns once, with the fix (export the variable in the launch environment), and
    :func:`nccl_orders_by_host` answers False, so the engine's jobs share one side stream.
    """
    if NCCL_LAUNCH_ORDER_ENV in os.environ:
        return
    in_use = nccl_communicators_in_use()
    os.environ[NCCL_LAUNCH_ORDER_ENV] = "1"
    if in_use:
        _launch_order_set_after[:] = in_use
        logger.warning("deepspeed_acco: %s was not set when this process started using NCCL (process groups %s "
                       "already have NCCL communicators), and NCCL reads it only once, so the engine cannot rely on "
                       "NCCL ordering its communicators' launches by host order: its jobs share one side stream, "
                       "and a collective of your own must not run while a job is in flight (docs/gpu.md). To "
                       "keep the ordering, set %s=1 in the environment before launching (e.g. `%s=1 deepspeed "
                       "train.py`, or `export %s=1`), or in the script before any NCCL use.",
                       NCCL_LAUNCH_ORDER_ENV, ", ".join(in_use), NCCL_LAUNCH_ORDER_ENV, NCCL_LAUNCH_ORDER_ENV,
                       NCCL_LAUNCH_ORDER_ENV)


def nccl_orders_by_host() -> bool:
    """Whether NCCL executes operations of different communicators in host issue order."""
    version = nccl_version()
    return (version is not None and version >= NCCL_LAUNCH_ORDER_MIN_VERSION
            and os.environ.get(NCCL_LAUNCH_ORDER_ENV) == "1" and not _launch_order_set_after)


# ---- control plane ---------------------------------------------------------------------------
class ControlPlane:
    """Small host-side agreements between ranks on the training thread (a gloo group of all ranks).

    Used where ranks must agree before touching the lane (checkpoints, evaluation points with
    dynamic accumulation). It never carries tensors of the model and never runs on the lane, so
    it cannot be ordered against the jobs' collectives, on any backend.
    """

    def __init__(self, group, world_size: int):
        self.group = group
        self.world_size = world_size

    def release(self) -> None:
        """Drop the reference to the group after ``destroy_process_group`` (see :meth:`Communicator.release`)."""
        self.group = None

    def _check(self, operation: str) -> None:
        # Only called with world_size > 1, where the group is None only after release().
        if self.group is None:
            raise CommunicationError(f"control plane {operation}: the engine was destroyed (engine.destroy()) "
                                     f"and its process groups released")

    def max(self, value: int) -> int:
        """The largest ``value`` over all ranks (collective)."""
        if self.world_size == 1:
            return int(value)
        self._check("max")
        tensor = torch.tensor([int(value)], dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group)
        return int(tensor.item())

    def max_values(self, values: List[float]) -> List[float]:
        """Each of ``values``' largest value over all ranks (collective; float64)."""
        if self.world_size == 1:
            return [float(v) for v in values]
        self._check("max")
        tensor = torch.tensor([float(v) for v in values], dtype=torch.float64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group)
        return tensor.tolist()

    def barrier(self) -> None:
        if self.world_size > 1:
            self._check("barrier")
            dist.barrier(group=self.group)

    TEXT_BYTES = 2048
    """Bytes of each rank's text that :meth:`texts` carries (longer texts are cut)."""

    def texts(self, text: str) -> List[str]:
        """Every rank's ``text``, in rank order (collective: one all-gather of a small byte tensor).

        How ranks reach one verdict before any of them changes anything (a checkpoint load or save
        that one rank refuses is refused by all, each naming the rank and its reason)."""
        if self.world_size == 1:
            return [text]
        self._check("texts")
        encoded = text.encode("utf-8")[:self.TEXT_BYTES]
        mine = torch.zeros(self.TEXT_BYTES + 2, dtype=torch.uint8)
        mine[0], mine[1] = len(encoded) // 256, len(encoded) % 256
        mine[2:2 + len(encoded)] = torch.tensor(list(encoded), dtype=torch.uint8)
        gathered = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(gathered, mine, group=self.group)
        result = []
        for row in gathered:
            length = int(row[0]) * 256 + int(row[1])
            result.append(bytes(row[2:2 + length].tolist()).decode("utf-8", errors="replace"))
        return result


def new_control_plane(timeout_s: float) -> ControlPlane:
    """A gloo group over all ranks for :class:`ControlPlane` (collective: every rank calls it).

    Its operations block the training thread, so gloo's own timeout is the hang check here:
    ``timeout_s`` exactly.
    """
    world_size = dist.get_world_size()
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s)) if world_size > 1 else None
    return ControlPlane(group, world_size)


# ---- the lane --------------------------------------------------------------------------------
class _Worker:
    """One thread that runs the jobs of one communicator in submission order (CPU)."""

    def __init__(self, name: str):
        self.queue: "queue.Queue[Optional[tuple]]" = queue.Queue()
        self.stopped = False
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        """Let the thread exit once the jobs already queued have run. Never blocks."""
        if not self.stopped:
            self.stopped = True
            self.queue.put(None)

    def _loop(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                return
            self._run(*item)
            # Between jobs the thread holds none: the last one (a bound method of the schedule, say)
            # would keep the schedule and its lane alive while the thread waits, so a lane dropped
            # without close() would never be freed, nor its workers stopped.
            del item

    @staticmethod
    def _run(job: Callable[[], Any], work: "Work") -> None:
        _running_job.records = work.collectives
        try:
            with torch.no_grad():
                result = job()
                if isinstance(result, DeviceReadback):
                    result.start()
            work._finish(result=result)
        except BaseException as error:  # surfaced to the training thread by Work.wait()
            work._finish(error=error)
        finally:
            _running_job.records = None


class LaneThreads:
    """The CPU worker threads of one lane, by communicator.

    Separate from the :class:`Lane` so that they can be stopped when the lane is dropped without
    :meth:`Lane.close` (its engine freed without ``destroy()``) and waited for at interpreter exit:
    a worker that is still inside a collective when the interpreter finalizes is ended by Python
    as it takes the GIL back, from inside torch's C++ frames, which aborts the process
    ("terminate called without an active exception").
    """

    def __init__(self):
        self.workers: Dict[int, _Worker] = {}

    def stop(self) -> None:
        """Let every worker exit after the jobs already queued (never blocks)."""
        for worker in list(self.workers.values()):
            worker.stop()

    def join(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` in all for the workers to exit; True if none is left running."""
        deadline = time.perf_counter() + timeout_s
        for worker in list(self.workers.values()):
            remaining = deadline - time.perf_counter()
            if remaining > 0:
                worker.thread.join(remaining)
        return not any(worker.thread.is_alive() for worker in list(self.workers.values()))


class Lane:
    """Issues every collective the engine runs, in the training thread's program order (module docstring).

    On the CPU, each communicator's jobs run in order on its own worker thread (daemons, so that a
    job stuck in a dead peer's collective never blocks interpreter exit). On CUDA, jobs are
    enqueued inline on a side stream per communicator, or on one shared side stream when NCCL
    cannot order several communicators by host order (``shared_stream``).
    """

    def __init__(self, rank: int, device: torch.device, timeout_s: float, *, shared_stream: Optional[bool] = None):
        self.rank = rank
        self.device = device
        self.timeout_s = timeout_s
        self.inline = device.type == "cuda"
        if shared_stream is None:
            shared_stream = self.inline and not nccl_orders_by_host()
        self.shared_stream = shared_stream
        self.threads = LaneThreads()
        # Dropped without close() (its engine freed without destroy()): the workers still run the
        # jobs every rank queued, then exit; the exit hook waits for them (runtime/engine.py).
        # Never blocks: a finalizer may run at any garbage collection, on any thread.
        weakref.finalize(self, self.threads.stop).atexit = False
        self._streams: Dict[Any, torch.cuda.Stream] = {}
        self._in_flight: List[Work] = []
        self._closed = False
        if self.inline and shared_stream and not _launch_order_set_after:  # else prepare_nccl_environment warned
            logger.warning("deepspeed_acco: NCCL %s cannot order several communicators by host issue order (needs "
                           ">= %s with %s=1); the engine's jobs share one side stream, so CO2's outer averaging does "
                           "not overlap its group steps, and collectives of your own must not run while a job is in "
                           "flight", nccl_version(), ".".join(map(str, NCCL_LAUNCH_ORDER_MIN_VERSION)),
                           NCCL_LAUNCH_ORDER_ENV)

    def submit(self, job: Callable[[], Any], communicator: Communicator, label: str) -> Work:
        """Start ``job`` behind the jobs already submitted for ``communicator``; return its handle at once."""
        if self._closed:
            raise CommunicationError("the communication lane is closed")
        work = Work(label, self, communicator, job)
        self._in_flight = [w for w in self._in_flight if not w.is_done()]
        self._in_flight.append(work)
        if self.inline:
            self._run_inline(job, work, self._stream_for(communicator))
        else:
            self._worker_for(communicator).queue.put((job, work))
        return work

    def _worker_for(self, communicator: Communicator) -> _Worker:
        worker = self.threads.workers.get(id(communicator))
        if worker is None:
            worker = _Worker(name=f"acco-{communicator.name}-rank{self.rank}")
            self.threads.workers[id(communicator)] = worker
        return worker

    def _stream_for(self, communicator: Communicator) -> torch.cuda.Stream:
        key = "shared" if self.shared_stream else id(communicator)
        stream = self._streams.get(key)
        if stream is None:
            stream = torch.cuda.Stream(device=self.device)
            self._streams[key] = stream
        return stream

    def _run_inline(self, job: Callable[[], Any], work: Work, stream: torch.cuda.Stream) -> None:
        """Enqueue ``job`` on ``stream`` after everything the training stream has been given so far."""
        stream.wait_stream(torch.cuda.current_stream(self.device))
        _running_job.records = work.collectives
        try:
            with torch.cuda.stream(stream), torch.no_grad():
                result = job()
                if isinstance(result, DeviceReadback):
                    result.start()
                done = torch.cuda.Event()
                done.record(stream)
            work._finish(result=result, done_event=done)
        except Exception as error:  # surfaced by Work.wait(), at the boundary, as on the CPU
            work._finish(error=error)
        finally:
            _running_job.records = None

    def check_hang(self, waited: Work) -> None:
        """Raise if a collective of a job in flight is overdue (called by a waiting training thread)."""
        now = time.perf_counter()
        for work in list(self._in_flight):
            record = work.oldest_unfinished_collective()
            if record is not None and now - record.issued_at > self.timeout_s:
                culprit = "" if work is waited else f" (of job {work.label!r})"
                raise CommunicationError(
                    f"communication job {waited.label!r} on rank {self.rank}: collective {record.name} on process "
                    f"group {record.group!r}{culprit} has not completed after {now - record.issued_at:.0f} s "
                    f"(communication_timeout_s = {self.timeout_s:g}); {_peer_text(record.peers)} is probably dead, "
                    f"stuck or unreachable")

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, join_timeout_s: float = 0.0) -> bool:
        """Stop the workers after their queued jobs; optionally wait for them (never for a hung collective).

        Returns True if every worker has exited. On CUDA nothing runs on the host, so the jobs in
        flight simply finish on the device (their handles keep their tensors alive).
        """
        self._closed = True
        self.threads.stop()
        return self.threads.join(join_timeout_s)
