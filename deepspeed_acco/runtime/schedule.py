"""Round schedules: when a round ends, what the boundary waits for, installs and launches (DESIGN 3).

A *round* is the unit of overlap: the training thread accumulates gradients over some
micro-batches while at most one communication job runs. At a round boundary the schedule
(1) waits for the running job, (2) installs its gathered parameters in the model, (3) hands the
round's gradients to the next job and launches it, (4) returns.

Communication and ordering, per optimizer type (t = update index, theta~ = ACCO estimate):

    ShardedAdamW  round t: full batch at theta_t      | boundary: launch commit t+1, wait, done
    DPU           round t: full batch at theta_{t-1}  | boundary: wait commit t, install theta_t,
                                                      |           launch commit t+1 on g_t
    ACCO          round A_t: half batch at theta~_t   | boundary: wait commit t, install theta_t,
                                                      |           launch estimate theta~_{t+1} on A_t
                  round B_t: half batch at theta_t    | boundary: wait estimate, install theta~_{t+1},
                                                      |           launch commit t+1 on A_t + B_t
    CO2           see :mod:`deepspeed_acco.runtime.co2` (local steps, outer averaging every tau steps)
"""
import abc
import collections
import contextlib
import enum
import time
from dataclasses import dataclass
from typing import Callable, Iterator, List, Optional

from .comm import Communicator, Pipeline, Work
from .jobs import AdamWJob, JobKind, JobResult, ShardState, hyperparameters_of
from .flat import FlatParamGroup

# Boundary waits remembered for the wall_clock_breakdown report.
_RECENT_WAITS = 256


class Phase(enum.Enum):
    """Where the schedule stands between two boundaries."""

    SYNC = "sync"
    """ShardedAdamW: accumulating full batch t at theta_t; no job runs between boundaries."""
    DELAYED = "delayed"
    """DPU: accumulating full batch t at theta_{t-1}; the running job commits theta_t (none in round 0)."""
    FIRST_HALF = "first_half"
    """ACCO A_t: accumulating the first half at theta~_t; the running job commits theta_t (none for t = 0)."""
    SECOND_HALF = "second_half"
    """ACCO B_t: accumulating the second half at theta_t; the running job estimates theta~_{t+1} from A_t."""
    LOCAL = "local"
    """CO2 round k+1: local inner steps from the anchor x_{k+1}; the running job computes x_{k+2}."""


@dataclass(kw_only=True)
class ScheduleSettings:
    overlap: bool
    gradient_clipping: float
    nominal_round_micro_batches: int
    """Micro-batches per round per rank: the accumulation steps (ACCO: half of them)."""
    dynamic_accumulation: bool = False


class Schedule(abc.ABC):
    """Base class: the pipeline state shared by every AdamW-family schedule.

    ``on_commit(result)`` is called by the boundary as soon as a commit's result is installed and
    before the next job is launched, so the engine's counters and LR scheduler are up to date for
    the hyperparameters the next job captures.
    """

    initial_phase: Phase

    def __init__(self, flats: List[FlatParamGroup], shards: List[ShardState], communicator: Communicator,
                 pipeline: Pipeline, settings: ScheduleSettings, applied_steps: Callable[[], int],
                 on_commit: Callable[[JobResult], None], loss_scale: Callable[[], float]):
        self.flats = flats
        self.shards = shards
        self.communicator = communicator
        self.pipeline = pipeline
        self.settings = settings
        self._applied_steps = applied_steps
        self._on_commit = on_commit
        self._loss_scale = loss_scale
        self.phase = self.initial_phase
        self.round_micro_batches = 0
        self.running: Optional[Work] = None
        self.running_kind: Optional[JobKind] = None
        self.total_wait_s = 0.0
        """Seconds the training thread spent blocked in boundary waits."""
        self.recent_wait_s = collections.deque(maxlen=_RECENT_WAITS)
        self.last_result: Optional[JobResult] = None

    # ---- called by the engine --------------------------------------------------------------
    def micro_batch_done(self) -> bool:
        """Count one micro-batch; run the boundary if it ends the round. Returns True at a boundary."""
        self.round_micro_batches += 1
        if not self.round_ends():
            return False
        self.boundary()
        self.round_micro_batches = 0
        return True

    def round_ends(self) -> bool:
        if self.settings.dynamic_accumulation and self.running is not None:
            # Accumulate while you communicate: end the round as soon as the job is done.
            return self.round_micro_batches >= 1 and self.running.is_done()
        return self.round_micro_batches >= self.settings.nominal_round_micro_batches

    @abc.abstractmethod
    def boundary(self) -> None:
        """Wait, install, launch: the optimizer type's rule for the end of a round."""

    def drain(self) -> None:
        """Wait for the running job without consuming its result (checkpoints, evaluation)."""
        if self.running is not None:
            self.running.wait()

    @contextlib.contextmanager
    def committed_parameters(self) -> Iterator[None]:
        """Temporarily make the model hold the newest committed parameters."""
        self.drain()
        if self.running is None or self.running_kind is not JobKind.COMMIT:
            yield  # the model already holds committed parameters
            return
        saved = [flat.model_flat.clone() for flat in self.flats]
        try:
            for flat in self.flats:
                flat.install(flat.gather)
            yield
        finally:
            for flat, values in zip(self.flats, saved):
                flat.model_flat.copy_(values)

    # ---- building blocks -------------------------------------------------------------------
    def _timed_wait(self, work: Work) -> JobResult:
        start = time.perf_counter()
        result = work.wait()
        waited = time.perf_counter() - start
        self.total_wait_s += waited
        self.recent_wait_s.append(waited)
        return result

    def _wait_running(self) -> Optional[JobResult]:
        if self.running is None:
            return None
        result = self._timed_wait(self.running)
        self.running = None
        self.running_kind = None
        self.last_result = result
        return result

    def _make_job(self, kind: JobKind, **options) -> AdamWJob:
        """Hand the round's gradients over and capture everything the job needs, now."""
        for flat in self.flats:
            flat.hand_over_grads()
        return AdamWJob(kind=kind, flats=self.flats, states=self.shards, communicator=self.communicator,
                        step=self._applied_steps() + 1,
                        hyperparameters=[hyperparameters_of(flat.param_group) for flat in self.flats],
                        local_micro_batches=self.round_micro_batches, loss_scale=self._loss_scale(),
                        gradient_clipping=self.settings.gradient_clipping, **options)

    def _launch(self, kind: JobKind, *, keep_first_half: bool = False, first_half_micro_batches: int = 0,
                synchronous: bool = False) -> Work:
        job = self._make_job(kind, keep_first_half=keep_first_half, first_half_micro_batches=first_half_micro_batches)
        work = self.pipeline.submit(job, label=f"{kind.value} of update {job.step}")
        if synchronous or not self.settings.overlap:
            # Same math, no overlap: the job completes now; its result is still installed at
            # the same point of the schedule as with overlap.
            self._timed_wait(work)
        self.running = work
        self.running_kind = kind
        return work

    def _install_gathered(self) -> None:
        for flat in self.flats:
            flat.install(flat.gather)

    def reset(self) -> None:
        """Forget the round in progress and any job result: start afresh from the committed state."""
        self.drain()
        self.phase = self.initial_phase
        self.round_micro_batches = 0
        self.running = None
        self.running_kind = None
        for flat in self.flats:
            flat.grad_accum.zero_()


class ShardedAdamWSchedule(Schedule):
    """Synchronous ZeRO-1 (DESIGN 3.1): one job per update, waited immediately, gathered in place."""

    initial_phase = Phase.SYNC

    def boundary(self) -> None:
        self._launch(JobKind.COMMIT, synchronous=True)
        self._on_commit(self._wait_running())


class DPUSchedule(Schedule):
    """Delayed parameter update (DESIGN 3.2): round t computes at theta_{t-1} while theta_t is committed."""

    initial_phase = Phase.DELAYED

    def boundary(self) -> None:
        result = self._wait_running()
        if result is not None:
            self._install_gathered()
            self._on_commit(result)
        self._launch(JobKind.COMMIT)


class ACCOSchedule(Schedule):
    """ACCO (DESIGN 3.3, 3.4): two rounds per update, estimate then commit."""

    initial_phase = Phase.FIRST_HALF

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.first_half_micro_batches = 0
        """Global micro-batch count of the first half of the update being committed."""

    def boundary(self) -> None:
        if self.phase is Phase.FIRST_HALF:
            result = self._wait_running()
            if result is not None:
                self._install_gathered()
                self._on_commit(result)
            self._launch(JobKind.ESTIMATE, keep_first_half=True)
            self.phase = Phase.SECOND_HALF
        else:
            estimate = self._wait_running()
            self._install_gathered()
            self.first_half_micro_batches = estimate.global_micro_batches
            self._launch(JobKind.COMMIT, first_half_micro_batches=self.first_half_micro_batches)
            self.phase = Phase.FIRST_HALF
