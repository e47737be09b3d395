"""The communication side of the pipeline: a worker that runs jobs in order, and the narrow
communicator object that the update jobs talk to (DESIGN 2 "communication job", DESIGN 6).

A *job* is a plain Python callable made of collectives and shard math. ``Pipeline.submit``
returns a :class:`Work` handle immediately; the job runs on a daemon worker thread (CPU/gloo) or
is enqueued by that thread on a side CUDA stream (GPU/nccl). The training thread only ever calls
``Work.wait()`` at a round boundary, which re-raises a failed job's exception with its traceback
and makes the compute stream wait for the job's completion event (no host sync on GPU).

Collectives run on a process group of their own, so collectives issued by the training loop
(logging, evaluation) can never interleave with the worker's. Each collective is labelled for
the profiler (``acco::reduce_scatter`` ...) and tracked so that a hang is reported by name.
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

    def __init__(self, label: str, pipeline: "Pipeline"):
        self.label = label
        self._pipeline = pipeline
        self._finished = threading.Event()
        self._result: Any = None
        self._error: Optional[BaseException] = None
        self._error_traceback = ""
        self._cuda_done: Optional[torch.cuda.Event] = None
        self.submitted_at = time.perf_counter()
        self.finished_at: Optional[float] = None

    def _finish(self, result: Any = None, error: Optional[BaseException] = None) -> None:
        self._result = result
        self._error = error
        if error is not None:
            self._error_traceback = "".join(traceback.format_exception(error))
        self.finished_at = time.perf_counter()
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
            self._pipeline.check_hang(self)
        if self._error is not None:
            raise CommunicationError(f"communication job {self.label!r} failed on rank {self._pipeline.rank}: "
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


class Pipeline:
    """Runs communication jobs in submission order off the training thread.

    CPU: a daemon thread executes each job. CUDA: the same thread enqueues the job's kernels and
    collectives on a side stream after waiting (on the device) for an event recorded on the
    training stream at submission; completion is signalled by another event. The thread is a
    daemon so that a job stuck in a dead peer's collective never blocks interpreter exit.
    """

    def __init__(self, rank: int, device: torch.device, communicators: List[Communicator], timeout_s: float):
        self.rank = rank
        self.device = device
        self.communicators = communicators
        self.timeout_s = timeout_s
        self._queue: "queue.Queue[Optional[tuple]]" = queue.Queue()
        self._stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None
        self._thread = threading.Thread(target=self._loop, name=f"acco-comm-rank{rank}", daemon=True)
        self._thread.start()
        self._closed = False

    def submit(self, job: Callable[[], Any], label: str) -> Work:
        """Queue ``job`` behind the jobs already submitted; return its handle at once."""
        if self._closed:
            raise CommunicationError("the communication pipeline is closed")
        work = Work(label, self)
        ready = None
        if self._stream is not None:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        self._queue.put((job, work, ready))
        return work

    def _loop(self) -> None:
        if self._stream is not None:
            torch.cuda.set_device(self.device)
        while True:
            item = self._queue.get()
            if item is None:
                return
            job, work, ready = item
            stream_context = torch.cuda.stream(self._stream) if self._stream is not None else nullcontext()
            try:
                with stream_context, torch.no_grad():
                    if ready is not None:
                        self._stream.wait_event(ready)
                    result = job()
                    if self._stream is not None:
                        work._cuda_done = torch.cuda.Event()
                        work._cuda_done.record(self._stream)
                work._finish(result=result)
            except BaseException as error:  # surfaced to the training thread by Work.wait()
                work._finish(error=error)

    def check_hang(self, work: Work) -> None:
        """Raise if a collective of the running job has exceeded the timeout (called while waiting)."""
        now = time.perf_counter()
        for communicator in self.communicators:
            started = communicator.current_started_at
            if started is not None and now - started > self.timeout_s + _HANG_GRACE_S:
                raise CommunicationError(
                    f"communication job {work.label!r} on rank {self.rank}: collective "
                    f"{communicator.current_collective} on process group {communicator.name!r} has not completed "
                    f"after {now - started:.0f} s (timeout {self.timeout_s:.0f} s); a peer rank is probably dead")

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, join_timeout_s: float = 0.0) -> bool:
        """Stop the worker after the queued jobs; optionally wait for it (never for a hung collective).

        Returns True if the worker has exited.
        """
        if not self._closed:
            self._closed = True
            self._queue.put(None)
        if join_timeout_s > 0:
            self._thread.join(join_timeout_s)
        return not self._thread.is_alive()
