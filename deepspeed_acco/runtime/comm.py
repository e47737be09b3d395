"""The communication side of the pipeline (docs/design.md, sections 3 and 6): the lane that runs
jobs in order, the narrow communicator object that the jobs talk to, and the control plane.

A *job* is a plain Python callable made of collectives and shard math. ``Lane.submit`` returns a
:class:`Work` handle immediately; the job runs on a daemon worker thread (CPU/gloo) or is enqueued
by that thread on a side CUDA stream (GPU/nccl). The training thread only ever calls
``Work.wait()`` at a round boundary, which re-raises a failed job's exception with its traceback
and makes the compute stream wait for the job's completion event (no host sync on GPU).

Collectives run on process groups of their own, so collectives issued by the training loop
(logging, evaluation) can never interleave with the jobs'. Each collective is labelled for the
profiler (``acco::reduce_scatter`` ...) and tracked so that a hang is reported by name.
"""
import datetime
import queue
import threading
import time
import traceback
from contextlib import nullcontext
from typing import Any, Callable, List, Optional

import torch
import torch.distributed as dist

# torch 2.13 renamed the flat-tensor collectives; older releases only have the old names.
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

# Extra time the training thread grants the worker beyond the collective timeout before it
# declares the job hung: the process group's own timeout should fire first.
_HANG_GRACE_S = 30.0
_POLL_INTERVAL_S = 0.5


class CommunicationError(RuntimeError):
    """A communication job failed; the message names the job, the collective and the rank."""


class Work:
    """Handle to one submitted job (the ``torch.distributed`` Work idiom)."""

    def __init__(self, label: str, lane: "Lane", communicator: "Communicator"):
        self.label = label
        self.communicator = communicator
        self._lane = lane
        self._finished = threading.Event()
        self._result: Any = None
        self._error: Optional[BaseException] = None
        self._error_traceback = ""
        self._cuda_done: Optional[torch.cuda.Event] = None

    def _finish(self, result: Any = None, error: Optional[BaseException] = None) -> None:
        self._result = result
        self._error = error
        if error is not None:
            self._error_traceback = "".join(traceback.format_exception(error))
        self._finished.set()

    def is_done(self) -> bool:
        """True once the job has finished (on GPU: once its kernels have completed too)."""
        if not self._finished.is_set():
            return False
        return self._cuda_done is None or self._cuda_done.query()

    def wait(self) -> Any:
        """Block until the job has finished on the host; return its result or raise its error.

        On GPU the current stream is made to wait for the job's completion event, so tensors the
        job wrote can be used by subsequent kernels without a host synchronisation.
        """
        while not self._finished.wait(_POLL_INTERVAL_S):
            self._lane.check_hang(self)
        if self._error is not None:
            raise CommunicationError(f"communication job {self.label!r} failed on rank {self._lane.rank}: "
                                     f"{self._error}\n--- worker traceback ---\n{self._error_traceback}") \
                from self._error
        if self._cuda_done is not None:
            torch.cuda.current_stream().wait_event(self._cuda_done)
        return self._result


class CompletedWork:
    """A job that already finished, e.g. the pending job of a loaded checkpoint."""

    def __init__(self, label: str, result: Any):
        self.label = label
        self._result = result

    def is_done(self) -> bool:
        return True

    def wait(self) -> Any:
        return self._result


class Communicator:
    """Collectives on one dedicated process group, labelled and tracked for hang reports.

    This is the only object the update jobs use to communicate, so the schedule can be tested
    with a fake that records what was sent when.
    """

    def __init__(self, group, rank: int, world_size: int, name: str, global_ranks: Optional[List[int]] = None,
                 backend: Optional[str] = None):
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.name = name
        self.global_ranks = global_ranks if global_ranks is not None else list(range(world_size))
        """The global rank of each member, for point-to-point messages."""
        # gloo's reduce_scatter runs a whole all-reduce (measured on a 1 Gbit/s link: 213 ms for
        # 3.3M fp32 values against 105 ms for the all-gather of the same size), so on gloo we
        # reduce-scatter with a ring of sends, which moves the minimal (W - 1) / W of the data.
        self.ring_reduce_scatter = backend == "gloo"
        self.current_collective: Optional[str] = None
        self.current_started_at: Optional[float] = None
        self._ring_buffers: dict = {}

    def _run(self, collective: str, fn: Callable[[], Any]) -> None:
        self.current_collective = collective
        self.current_started_at = time.perf_counter()
        try:
            with torch.profiler.record_function(f"acco::{collective}"):
                fn()
        except Exception as error:
            raise CommunicationError(f"collective {collective} on process group {self.name!r} failed on rank "
                                     f"{self.rank} (world size {self.world_size}): {error}") from error
        finally:
            self.current_collective = None
            self.current_started_at = None

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """Sum ``input`` over ranks and keep this rank's equal-size chunk in ``output``."""
        if self.world_size == 1:
            output.copy_(input)
            return
        if self.ring_reduce_scatter:
            self._run("reduce_scatter", lambda: self._ring_reduce_scatter(output, input))
        else:
            self._run("reduce_scatter", lambda: _reduce_scatter_flat(output, input, group=self.group))

    def _ring_reduce_scatter(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """Ring reduce-scatter: W - 1 steps; in step s this rank passes its running sum of chunk
        (rank - s - 1) to the right and adds its own part of chunk (rank - s - 2) to what arrives
        from the left. After the last step it holds the full sum of its own chunk."""
        world_size, rank = self.world_size, self.rank
        chunks = input.view(world_size, -1)
        right = self.global_ranks[(rank + 1) % world_size]
        left = self.global_ranks[(rank - 1) % world_size]
        key = (chunks.shape[1], input.dtype, input.device)
        if key not in self._ring_buffers:
            self._ring_buffers[key] = (torch.empty_like(chunks[0]), torch.empty_like(chunks[0]))
        received, outgoing = self._ring_buffers[key]
        outgoing.copy_(chunks[(rank - 1) % world_size])
        for step in range(world_size - 1):
            send = dist.isend(outgoing, dst=right, group=self.group)
            receive = dist.irecv(received, src=left, group=self.group)
            send.wait()
            receive.wait()
            own = chunks[(rank - step - 2) % world_size]
            torch.add(received, own, out=output if step == world_size - 2 else outgoing)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """Concatenate every rank's ``input`` into ``output`` (``input`` may alias this rank's chunk)."""
        if self.world_size == 1:
            if output.data_ptr() != input.data_ptr():
                output.copy_(input)
            return
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
        self._run(collective, lambda: dist.all_to_all_single(output, input, output_split_sizes=output_split_sizes,
                                                             input_split_sizes=input_split_sizes, group=self.group))

    def exchange(self, sends: List[tuple], receives: List[tuple]) -> None:
        """Point-to-point: post every ``(peer rank, tensor)`` send and receive, then wait for all.

        Peers are ranks of this communicator; a collective in the sense that the peers must post the
        matching calls (checkpoints use it to move shards between layouts).
        """
        if not sends and not receives:
            return

        def run():
            handles = [dist.isend(t, dst=self.global_ranks[peer], group=self.group) for peer, t in sends]
            handles += [dist.irecv(t, src=self.global_ranks[peer], group=self.group) for peer, t in receives]
            for handle in handles:
                handle.wait()
        self._run("exchange", run)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over ranks in place (used for the small per-job statistics)."""
        if self.world_size == 1:
            return
        self._run("all_reduce", lambda: dist.all_reduce(tensor, group=self.group))


def new_communicator(ranks: List[int], timeout_s: float, name: str, backend: Optional[str] = None) -> Communicator:
    """Create a dedicated process group over ``ranks`` (collective: every rank must call it, in order)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    backend = backend or dist.get_backend()
    world_rank = dist.get_rank()
    if len(ranks) == dist.get_world_size():
        group = dist.new_group(backend=backend, timeout=timeout)
    else:
        group = dist.new_group(ranks=ranks, backend=backend, timeout=timeout)
    rank = ranks.index(world_rank) if world_rank in ranks else -1
    return Communicator(group, rank, len(ranks), name, global_ranks=list(ranks), backend=backend)


class ControlPlane:
    """Small host-side agreements between ranks on the training thread (a gloo group of all ranks).

    Used where ranks must agree before touching the lane (checkpoints, evaluation points with
    dynamic accumulation). It never carries tensors of the model and never runs on the lane, so
    it cannot be ordered against the jobs' collectives, on any backend.
    """

    def __init__(self, group, world_size: int):
        self.group = group
        self.world_size = world_size

    def max(self, value: int) -> int:
        """The largest ``value`` over all ranks (collective)."""
        if self.world_size == 1:
            return int(value)
        tensor = torch.tensor([int(value)], dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group)
        return int(tensor.item())

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.group)


def new_control_plane(timeout_s: float) -> ControlPlane:
    """A gloo group over all ranks for :class:`ControlPlane` (collective: every rank calls it)."""
    world_size = dist.get_world_size()
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s)) if world_size > 1 else None
    return ControlPlane(group, world_size)


class _Worker:
    """One thread that runs the jobs of one communicator in submission order."""

    def __init__(self, lane: "Lane", name: str):
        self.lane = lane
        self.queue: "queue.Queue[Optional[tuple]]" = queue.Queue()
        self.stream = torch.cuda.Stream(device=lane.device) if lane.device.type == "cuda" else None
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        if self.stream is not None:
            torch.cuda.set_device(self.lane.device)
        while True:
            item = self.queue.get()
            if item is None:
                return
            job, work, ready = item
            stream_context = torch.cuda.stream(self.stream) if self.stream is not None else nullcontext()
            try:
                with stream_context, torch.no_grad():
                    if ready is not None:
                        self.stream.wait_event(ready)
                    result = job()
                    if self.stream is not None:
                        work._cuda_done = torch.cuda.Event()
                        work._cuda_done.record(self.stream)
                work._finish(result=result)
            except BaseException as error:  # surfaced to the training thread by Work.wait()
                work._finish(error=error)


class Lane:
    """Issues every collective the engine runs: jobs go in, each communicator's in submission order.

    The order of the jobs is the program order of the schedule, which is the same on every rank,
    so every process group sees its collectives in the same order everywhere. Jobs of one
    communicator run one after another on that communicator's worker thread; jobs of different
    communicators (CO2's group steps and its outer averaging) may run at the same time. The worker
    threads are daemons, so that a job stuck in a dead peer's collective never blocks interpreter
    exit. On CUDA each worker enqueues its jobs on its own side stream after waiting (on the
    device) for an event recorded on the training stream at submission.
    """

    def __init__(self, rank: int, device: torch.device, timeout_s: float):
        self.rank = rank
        self.device = device
        self.timeout_s = timeout_s
        self._workers = {}
        self._closed = False

    def submit(self, job: Callable[[], Any], communicator: Communicator, label: str) -> Work:
        """Queue ``job`` behind the jobs already submitted for ``communicator``; return its handle at once."""
        if self._closed:
            raise CommunicationError("the communication lane is closed")
        worker = self._workers.get(id(communicator))
        if worker is None:
            worker = _Worker(self, name=f"acco-{communicator.name}-rank{self.rank}")
            self._workers[id(communicator)] = worker
        work = Work(label, self, communicator)
        ready = None
        if worker.stream is not None:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        worker.queue.put((job, work, ready))
        return work

    def check_hang(self, work: Work) -> None:
        """Raise if a collective of ``work``'s communicator has exceeded the timeout (called while waiting)."""
        communicator = work.communicator
        started = communicator.current_started_at
        now = time.perf_counter()
        if started is not None and now - started > self.timeout_s + _HANG_GRACE_S:
            raise CommunicationError(
                f"communication job {work.label!r} on rank {self.rank}: collective "
                f"{communicator.current_collective} on process group {communicator.name!r} has not completed "
                f"after {now - started:.0f} s (timeout {self.timeout_s:.0f} s); a peer rank is probably dead")

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, join_timeout_s: float = 0.0) -> bool:
        """Stop the workers after their queued jobs; optionally wait for them (never for a hung collective).

        Returns True if every worker has exited.
        """
        if not self._closed:
            self._closed = True
            for worker in self._workers.values():
                worker.queue.put(None)
        deadline = time.perf_counter() + join_timeout_s
        for worker in self._workers.values():
            remaining = deadline - time.perf_counter()
            if remaining > 0:
                worker.thread.join(remaining)
        return not any(worker.thread.is_alive() for worker in self._workers.values())
