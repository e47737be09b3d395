"""What every optimizer type's schedule shares: rounds, the running job, waits and commit accounting.

A *round* is the unit of overlap (docs/design.md, section 3): the training thread accumulates
gradients over some micro-batches while at most one job per communicator runs. At a round
boundary the type's ``boundary()`` (1) waits for the running job, (2) installs what it gathered,
(3) hands the round's gradients to the next job and launches it, (4) returns.

Each optimizer type is one subclass in :mod:`deepspeed_acco.runtime.optimizers`, with its params
dataclass, its phases (an enum whose docstrings say what the model holds and what runs), its
boundary rule and its in-flight state (``checkpoint_state`` / ``load_checkpoint_state``).

The schedule owns the :class:`~deepspeed_acco.runtime.progress.Progress` record, the loss scale
and the LR scheduler stepping: :func:`account_commit` is the only place that advances them.
"""
import collections
import contextlib
import dataclasses
import enum
import logging
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Dict, Iterator, List, Optional, Type

import torch

from .comm import Communicator, CompletedWork, ControlPlane, Lane, Work
from . import wire as wires
from .compression import (GroupCompression, check_group_compressions, group_compressions, load_group_compressions,
                          wire_bytes)
from .flat import FlatParamGroup
from .jobs import ADAMW, JobKind, JobResult, ShardState, ShardUpdateJob, UpdateRule
from .loss_scale import LossScale
from .optimizer import ShardedOptimizer
from .progress import Progress
from .wire_schedule import WireChoosing
from .registry import lookup
from .timeline import TimeBreakdown
from .warmup import warmup_after_resume

logger = logging.getLogger("DeepSpeed").getChild("acco")

# Boundary waits remembered for the wall_clock_breakdown report.
_RECENT_WAITS = 256


@dataclass(kw_only=True)
class BuildContext:
    """Everything a schedule needs to build itself (made by :mod:`deepspeed_acco.runtime.builder`)."""

    params: Any
    """The type's parsed params dataclass."""
    config: Any
    """The engine's :class:`~deepspeed_acco.runtime.config.EngineConfig`."""
    param_groups: List[Dict]
    rank: int
    world_size: int
    device: torch.device
    lane: Lane
    jobs_communicator: Communicator
    """The process group over all ranks that the jobs use."""
    control: ControlPlane
    loss_scale: LossScale
    new_group_communicator: Callable[[int, str], Communicator]
    """``f(group_size, name)``: the communicator of this rank's group of consecutive ranks (collective)."""


@dataclass
class CheckpointState:
    """A schedule's state as checkpoints see it, in this engine's shard geometry.

    ``fp32_partitions``/``rule_state`` are DeepSpeed's ``single_partition_of_fp32_groups`` and
    base optimizer state (re-shardable); ``sharded`` holds further shards over all ranks (re-shardable);
    ``local`` tensors belong to this rank alone (same world size only); ``meta`` is plain data.
    """

    fp32_partitions: List[torch.Tensor]
    rule_state: Optional[List[Dict[str, torch.Tensor]]]
    sharded: Dict[str, List[torch.Tensor]] = field(default_factory=dict)
    local: Dict[str, Any] = field(default_factory=dict)
    meta: Dict[str, Any] = field(default_factory=dict)


def result_to_dict(result) -> Dict:
    values = dataclasses.asdict(result)
    values.pop("timings_s", None)
    if isinstance(values.get("kind"), JobKind):
        values["kind"] = values["kind"].value
    return values


def job_result_from_dict(values: Dict) -> JobResult:
    return JobResult(**dict(values, kind=JobKind(values["kind"])))


# ---- checks of a checkpoint's in-flight state (Schedule.check_checkpoint_state) ---------------------
def check_phase(meta: Dict[str, Any], phases: Type[enum.Enum]) -> None:
    values = [phase.value for phase in phases]
    if meta.get("phase") not in values:
        raise ValueError(f"the saved phase {meta.get('phase')!r} is not one of {values}")


def check_counts(meta: Dict[str, Any], *keys: str) -> None:
    for key in keys:
        value = meta.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"the saved {key} is {value!r}, not a count")


def check_vectors(entries: Dict[str, Any], key: str, sizes: List[int], optional: bool = False) -> None:
    """``entries[key]``: one floating-point tensor per group with ``sizes[i]`` values."""
    if key not in entries:
        if optional:
            return
        raise ValueError(f"the entry {key!r} is missing")
    values = entries[key]
    if not isinstance(values, (list, tuple)) or len(values) != len(sizes):
        raise ValueError(f"{key!r} has {len(values) if isinstance(values, (list, tuple)) else values!r} entries for "
                         f"{len(sizes)} parameter groups")
    for index, (value, size) in enumerate(zip(values, sizes)):
        if not torch.is_tensor(value) or not value.is_floating_point() or value.numel() != size:
            found = f"{value.numel()} values" if torch.is_tensor(value) else type(value).__name__
            raise ValueError(f"{key}[{index}] has {found}, this engine {size}")


def step_lr_scheduler(lr_scheduler) -> None:
    """One scheduler step. torch's schedulers warn unless ``optimizer.step()`` ran first; our
    updates run inside jobs instead, so that one warning is silenced here and nowhere else."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
        lr_scheduler.step()


def account_commit(result: JobResult, progress: Progress, loss_scale: LossScale, lr_scheduler, *,
                   samples_of_commit: int, schedule_skipped: bool = False) -> None:
    """Advance counters, loss scale and LR schedule for one installed commit.

    ``samples_of_commit`` is added to ``global_samples`` (0 when samples are counted per micro-step).
    The LR schedule steps once per applied update (and per skipped one too with ``schedule_skipped``:
    CO2's replicas skip alone, yet must stay on one schedule), also under dynamic accumulation, whose
    updates hold more samples than ``train_batch_size``: a schedule set in updates (DeepSpeed's, the
    HF Trainer's) advances as its user set it (docs/design.md, 3.4; docs/studies/uneven_ranks.md).
    """
    progress.global_steps += 1
    progress.global_samples += samples_of_commit
    loss_scale.update(result.skipped)
    if result.skipped:
        progress.skipped_steps += 1
    else:
        progress.applied_steps += 1
    if lr_scheduler is None or (result.skipped and not schedule_skipped):
        return
    step_lr_scheduler(lr_scheduler)
    progress.scheduler_steps += 1


class Schedule(WireChoosing):
    """Base class of the optimizer types: the pipeline state they share (the regime and the wire:
    :class:`~deepspeed_acco.runtime.wire_schedule.WireChoosing`)."""

    type_name: ClassVar[str]
    """The optimizer type as written in the DeepSpeed config (matched case-insensitively)."""
    Params: ClassVar[type]
    """kw_only dataclass of the type's ``optimizer.params``."""
    Phase: ClassVar[Type[enum.Enum]]
    """The type's phases; the first member is where training starts."""
    rule: ClassVar[UpdateRule] = ADAMW
    rounds_per_update: ClassVar[int] = 1
    """Rounds per committed update: the round holds gradient_accumulation_steps / this micro-batches."""
    synchronous: ClassVar[bool] = False
    """Jobs gather straight into the model (no gather buffer); only for schedules that wait at once."""
    continues_only_as_itself_reason: ClassVar[Optional[str]] = None
    """Why no other type can continue from this type's checkpointed state (None: any type can continue
    from its committed state). Written into each checkpoint; for a checkpoint written before that,
    the loader reads it from the saved type's class."""

    @classmethod
    def validate_config(cls, params, batch, world_size: int) -> None:
        """Checks that need more than the params (batch sizes, world size); raise ``ValueError``."""

    @classmethod
    def build(cls, context: BuildContext) -> "Schedule":
        """ZeRO-1 over all ranks (CO2 overrides this)."""
        optimizer = ShardedOptimizer(context.param_groups, cls.rule.defaults(context.params),
                                     world_size=context.world_size, rank=context.rank,
                                     communication_dtype=context.config.communication_torch_dtype,
                                     synchronous=cls.synchronous, rule=cls.rule,
                                     accumulation_dtype=context.config.accumulation_torch_dtype)
        return cls(context, optimizer, context.jobs_communicator)

    def __init__(self, context: BuildContext, optimizer: ShardedOptimizer, communicator: Communicator):
        config = context.config
        self.params = context.params
        self.optimizer = optimizer
        self.flats: List[FlatParamGroup] = optimizer.flats
        self.shards: List[ShardState] = optimizer.shards
        self.communicator = communicator
        self.lane = context.lane
        self.control = context.control
        self.loss_scale = context.loss_scale
        self.lr_scheduler = None
        self.progress = Progress()
        self.world_size = context.world_size
        self.rank = context.rank
        self.overlap = bool(getattr(self.params, "overlap", True))
        self.gradient_clipping = config.gradient_clipping
        self.micro_batch_size = config.batch.micro_batch_size
        self.train_batch_size = config.batch.train_batch_size
        self.gradient_accumulation_steps = config.batch.gradient_accumulation_steps
        warmup = getattr(self.params, "warmup_sync_updates", 0)
        # "auto" is resolved from the LR scheduler by the builder (runtime/warmup.py), which
        # sets this; a schedule built without one starts without a warm-up.
        self.warmup_sync_updates = 0 if warmup == "auto" else int(warmup)
        self.sync_after_updates: Optional[int] = getattr(self.params, "sync_after_updates", None)
        self.phase = next(iter(self.Phase))
        self.round_micro_batches = 0
        self.round_loss_scale: Optional[float] = None
        """The loss scale this round's backward passes used (None before the first one)."""
        self.running: Optional[Work] = None
        self.running_kind: Optional[JobKind] = None
        self.jobs_launched = 0
        self.total_wait_s = 0.0
        """Seconds the training thread spent blocked on jobs."""
        self.recent_wait_s = collections.deque(maxlen=_RECENT_WAITS)
        """Blocked seconds of each recent boundary (one entry per boundary)."""
        self._boundary_wait_s = 0.0
        self.time = TimeBreakdown(cuda=context.device.type == "cuda")
        """Where the training thread's time goes (runtime/timeline.py): the engine counts forward and
        backward, the schedule its waits and boundaries."""
        self.on_commit: Optional[Callable[[JobResult], None]] = None
        """Called after each commit's accounting (the engine's logging and monitors)."""
        self.compression: Optional[List[GroupCompression]] = group_compressions(
            config.compression, communicator, [flat.padded_numel for flat in self.flats], context.device)
        """Per group, the compressed collectives of this schedule's jobs (None: uncompressed)."""
        self.device = context.device
        self.precision = config.precision
        self._init_wire(config.wire, context.device)

    # ---- synchronous warm-up ------------------------------------------------------------------
    @property
    def in_sync_warmup(self) -> bool:
        """Whether the next update is one of the first ``warmup_sync_updates`` (synchronous ZeRO-1)."""
        return self.progress.global_steps < self.warmup_sync_updates

    def _cooling_down_after(self, committed: int) -> bool:
        """Whether updates after ``committed`` committed ones are synchronous (``sync_after_updates``)."""
        return self.sync_after_updates is not None and committed >= self.sync_after_updates

    @property
    def in_sync_cooldown(self) -> bool:
        """Whether ``sync_after_updates`` updates are committed: every further one is synchronous."""
        return self._cooling_down_after(self.progress.global_steps)

    def cooldown_starts_with_next_commit(self) -> bool:
        """Whether the commit about to be launched is the last of the type's rule (``sync_after_updates``)."""
        return self._cooling_down_after(self.progress.global_steps + 1)

    @property
    def in_sync_update(self) -> bool:
        """Whether the next update is synchronous (warm-up or cool-down)."""
        return self.in_sync_warmup or self.in_sync_cooldown

    @property
    def current_rounds_per_update(self) -> int:
        return 1 if self.in_sync_update else self.rounds_per_update

    @property
    def nominal_round_micro_batches(self) -> int:
        """Micro-batches per round per rank: the accumulation steps (ACCO: half of them after warm-up)."""
        return max(1, self.gradient_accumulation_steps // self.current_rounds_per_update)

    def _sync_boundary(self, **launch) -> None:
        """A synchronous update (warm-up, cool-down): ShardedAdamW's, waited at once and installed."""
        work = self._launch(JobKind.COMMIT, wait=True, **launch)
        if not self.synchronous:
            self._install_gathered()
        self._account_commit(work.wait())

    # ---- called by the engine --------------------------------------------------------------
    def backward_loss_scale(self) -> float:
        """The loss scale for the next backward pass, remembered as this round's scale."""
        scale = self.loss_scale.scale
        assert self.round_loss_scale in (None, scale), "the loss scale changed inside a round"
        self.round_loss_scale = scale
        return scale

    def micro_batch_done(self) -> bool:
        """Count one micro-batch; run the boundary if it ends the round. Returns True at a boundary."""
        self.count_micro_batch()
        if not self.round_ends():
            return False
        self.end_round()
        return True

    @property
    def uneven_rounds(self) -> bool:
        """Whether ranks may end a round after different numbers of micro-batches (ACCO's dynamic
        accumulation, 3.4): a type whose ``round_ends`` follows timing instead of the count says so.

        Then the samples of an update are counted from each commit's global micro-batch count
        instead of per micro-batch, :meth:`synchronize` first brings every rank to the same job,
        and the engine neither shows the committed parameters through module hooks nor follows
        boundaries a caller sets (:meth:`caller_boundaries_error`).
        """
        return False

    def caller_boundaries_error(self) -> Optional[str]:
        """Why the engine cannot end updates where a caller says (``set_gradient_accumulation_boundary``),
        naming the config key and the fix; None when it can."""
        return None

    def count_micro_batch(self) -> None:
        """Count one micro-batch whose gradients were added to the round in progress."""
        self.progress.micro_steps += 1
        if not self.uneven_rounds:
            self.progress.global_samples += self.micro_batch_size * self.world_size
        self.round_micro_batches += 1

    def round_ends(self) -> bool:
        return self.round_micro_batches >= self.nominal_round_micro_batches

    def next_step_ends_round(self) -> bool:
        """Whether the next ``micro_batch_done`` ends a round (DeepSpeed's accumulation boundary)."""
        return self.round_micro_batches + 1 >= self.nominal_round_micro_batches

    def round_index_in_update(self) -> int:
        """Position (0-based) of the round in progress within its update.

        Assumes the ``Phase`` members are listed in round order, one per round of an update (ACCO:
        first half, second half); a type whose phases are laid out otherwise overrides this.
        """
        return list(self.Phase).index(self.phase) % self.current_rounds_per_update

    def end_round(self) -> None:
        """Run the boundary now, whatever the round's length: wait, install, launch."""
        self._boundary_wait_s = 0.0
        started = time.perf_counter()
        if self.in_sync_update and self.running is None:
            self._sync_boundary()
        else:
            self.boundary()
        self.time.add("boundary", started, time.perf_counter() - self._boundary_wait_s, "boundary",
                      phase=self.phase.value, jobs_launched=self.jobs_launched)
        self.total_wait_s += self._boundary_wait_s
        self.recent_wait_s.append(self._boundary_wait_s)
        self.round_micro_batches = 0
        self.round_loss_scale = None

    def boundary(self) -> None:
        """Wait, install, launch: the optimizer type's rule for the end of a round."""
        raise NotImplementedError

    def drain(self) -> None:
        """Wait for the running job without consuming its result (checkpoints, evaluation)."""
        if self.running is not None:
            self.running.wait()

    def synchronize(self) -> None:
        """Bring every rank to the same job and drain it (collective).

        With uneven rounds (dynamic accumulation) a fast rank may already have launched the next job
        while a slow one is still accumulating; the slow one then ends its round now, so that every
        rank has launched the same jobs and the drain cannot wait for a job a peer never starts.
        """
        if self.uneven_rounds and self.world_size > 1:
            target = self.control.max(self.jobs_launched)
            while self.jobs_launched < target:
                self.end_round()
        self.drain()

    def pending_commit(self) -> Optional[JobResult]:
        """The finished commit whose result is not installed yet (waits for it), or None."""
        if self.running is None or self.running_kind is not JobKind.COMMIT:
            return None
        return self.running.wait()

    @contextlib.contextmanager
    def committed_parameters(self) -> Iterator[None]:
        """Temporarily make the model hold the newest committed parameters (call ``synchronize`` first)."""
        self.drain()
        with self._holding(self.committed_flats()):
            yield

    @contextlib.contextmanager
    def landed_parameters(self) -> Iterator[None]:
        """Temporarily make the model hold the newest committed parameters that have landed on this
        rank (:meth:`landed_flats`); never waits for the running job."""
        with self._holding(self.landed_flats()):
            yield

    @contextlib.contextmanager
    def _holding(self, values: Optional[List[torch.Tensor]]) -> Iterator[None]:
        """The model holds ``values`` (full vectors per group) inside; None: it keeps what it holds."""
        if values is None:
            yield  # the model already holds committed parameters
            return
        saved = [flat.model_flat.clone() for flat in self.flats]
        try:
            for flat, full in zip(self.flats, values):
                flat.install(full)
            yield
        finally:
            for flat, full in zip(self.flats, saved):
                flat.model_flat.copy_(full)

    def landed_flats(self) -> Optional[List[torch.Tensor]]:
        """Full vectors of the newest committed parameters that have landed on this rank, when the
        model does not hold them (None: it does). Never waits for the running job.

        With one round per update (ShardedAdamW, DPU) the model only ever holds installed commits: a
        running commit lands at the next boundary, and until then the model holds the newest landed
        one. With several rounds per update (ACCO) a running commit means that the model holds the
        round's estimate, and the parameters being committed exist only inside the job:
        ``LookupError`` (ask right after the ``step()`` that advanced ``global_steps``, or wait with
        ``committed_parameters()``).
        """
        if self.rounds_per_update == 1 or self.running_kind is not JobKind.COMMIT:
            return None
        raise LookupError(f"{self.type_name}: the model holds an estimate while the commit of update "
                          f"{self.progress.global_steps + 1} runs; the committed parameters exist only inside that "
                          f"job. Ask right after the step() that advances global_steps, or wait for them with "
                          f"engine.committed_parameters()")

    def job_in_flight(self) -> bool:
        """Whether a communication job is running now (never blocks)."""
        return self.running is not None and not self.running.is_done()

    def committed_flats(self) -> Optional[List[torch.Tensor]]:
        """Full vectors of the newest committed parameters when the model does not hold them, else None."""
        if self.pending_commit() is None:
            return None
        return [flat.gather for flat in self.flats]

    def reset(self) -> None:
        """Forget the round in progress and any job: continue from the committed state as loaded."""
        self.drain()
        self.phase = next(iter(self.Phase))
        self.round_micro_batches = 0
        self.round_loss_scale = None
        self.running = None
        self.running_kind = None
        for flat in self.flats:
            flat.grad_accum.zero_()
        for compression in self.compression or ():
            compression.reset()

    # ---- building blocks for the types -----------------------------------------------------
    def _wait(self, work: Work, synchronous: bool = False):
        """Wait for ``work``; its time counts as this boundary's wait, split into blocked and optimizer
        time by the job's phases (``synchronous``: launched to be waited at once; runtime/timeline.py)."""
        # A job's phases are counted once, and only for jobs that cross the network: a job on a local
        # communicator (CO2's inner step without groups, a one-rank gloo group) copies locally.
        first = not getattr(work, "counted", True) and not getattr(getattr(work, "communicator", None), "local", False)
        start = time.perf_counter()
        result = work.wait()
        end = time.perf_counter()
        self._boundary_wait_s += end - start
        phases = getattr(work, "phase_seconds", {})
        self.time.wait(start, end, work.label, getattr(work, "phase_spans", ()), update_s=phases.get("update", 0.0),
                       synchronous=synchronous, phases=phases if first else None,
                       submitted_at=getattr(work, "submitted_at", None))
        if first:
            work.counted = True
        return result

    def _wait_running(self):
        if self.running is None:
            return None
        result = self._wait(self.running)
        self.running = None
        self.running_kind = None
        return result

    def _submit(self, job: Callable[[], Any], communicator: Communicator, label: str, *, wait: bool,
                kind: Optional[JobKind] = None) -> Work:
        """Submit a job to the lane; it becomes the running job unless ``wait`` (then it is done)."""
        work = self.lane.submit(job, communicator, label=label)
        self.jobs_launched += 1
        if wait:
            self._wait(work, synchronous=True)
            return work
        if not self.overlap:
            # Same math, no overlap: the job completes now; its result is still installed at the
            # same point of the schedule as with overlap.
            self._wait(work, synchronous=True)
        self.running = work
        self.running_kind = kind
        return work

    def _shard_update_job(self, kind: JobKind, **options) -> ShardUpdateJob:
        """Hand the round's gradients over and capture everything the job needs, now."""
        predivisor = self._communication_predivisor()
        for flat in self.flats:
            flat.hand_over_grads(predivisor)
        scale = self.round_loss_scale if self.round_loss_scale is not None else self.loss_scale.scale
        return ShardUpdateJob(kind=kind, flats=self.flats, states=self.shards, communicator=self.communicator,
                              rule=self.rule, step=self.progress.applied_steps + 1,
                              hyperparameters=[self.rule.hyperparameters(flat.param_group) for flat in self.flats],
                              local_micro_batches=self.round_micro_batches, loss_scale=scale,
                              gradient_clipping=self.gradient_clipping, compression=self.compression,
                              predivisor=predivisor, **options)

    def _communication_predivisor(self) -> float:
        """fp16 reductions carry means, as DeepSpeed's do (docs/precision.md, "Precision"): the round's gradient sums are
        divided by its nominal micro-batches times the communicator's ranks when cast; other dtypes: 1.
        The divisor must be the same on every rank (the job multiplies the reduced sum back by it), so
        under dynamic accumulation, where ranks contribute different counts, it stays the nominal one: a
        round k times its nominal length carries k times a mean, which the loss scale's overflow rule
        bounds as it does any large gradient."""
        if self.flats[0].job_grad.dtype != torch.float16:
            return 1.0
        return float(self.nominal_round_micro_batches * self.communicator.world_size)

    def _launch(self, kind: JobKind, *, wait: bool = False, **options) -> Work:
        job = self._shard_update_job(kind, **options)
        return self._submit(job, self.communicator, f"{kind.value} of update {job.step}", wait=wait, kind=kind)

    def _install_gathered(self) -> None:
        for flat in self.flats:
            flat.install(flat.gather)

    schedule_skipped_steps: ClassVar[bool] = False
    """Whether the LR schedule also advances on a skipped update (see :func:`account_commit`)."""

    def _commit_samples(self, result: JobResult) -> int:
        """Samples a commit adds to the counters when rounds are uneven (its global micro-batch
        count); 0 otherwise, where they were counted per micro-batch."""
        return result.global_micro_batches * self.micro_batch_size if self.uneven_rounds else 0

    def _account_commit(self, result: JobResult) -> None:
        account_commit(result, self.progress, self.loss_scale, self.lr_scheduler,
                       samples_of_commit=self._commit_samples(result), schedule_skipped=self.schedule_skipped_steps)
        self.decide_wire()
        if self.on_commit is not None:
            self.on_commit(result)

    def committed_view(self):
        """(progress, loss scale, LR-scheduler state, param-group lrs) as if the pending commit were installed.

        Checkpoints write these into DeepSpeed's fields, so that another type, or DeepSpeed, continues
        from the committed state with the right step count and learning rate. Nothing live changes.
        """
        progress, loss_scale = self.progress.copy(), self.loss_scale.copy()
        lrs = [group["lr"] for group in self.optimizer.param_groups]
        scheduler_state = self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None
        result = self.pending_commit()
        if result is None:
            return progress, loss_scale, scheduler_state, lrs
        shadow = _detached_scheduler(self.lr_scheduler, self.optimizer) if self.lr_scheduler is not None else None
        account_commit(result, progress, loss_scale, shadow, samples_of_commit=self._commit_samples(result),
                       schedule_skipped=self.schedule_skipped_steps)
        if shadow is not None:
            scheduler_state = shadow.state_dict()
            lrs = [group["lr"] for group in shadow.optimizer.param_groups]
        return progress, loss_scale, scheduler_state, lrs

    # ---- checkpoints -------------------------------------------------------------------------
    def communicator_for_checkpoints(self) -> Communicator:
        """The communicator over all ranks whose shards the checkpoint's vectors are."""
        return self.communicator

    def rule_state_is_sharded(self) -> bool:
        """Whether masters and rule state are shards over all ranks (DeepSpeed's fields hold them)."""
        return True

    def checkpoint_metadata(self) -> Dict[str, Any]:
        """Plain data a loader checks before it reads any optimizer state (the module file's
        "deepspeed_acco" entry, beside ``optimizer_type``): the warm-up length this run used
        (``"warmup_sync_updates"``, read by :meth:`continue_warmup`) and, for a type that declares
        one, ``"continues_only_as_itself"``, the reason why no other type can continue from this
        state. CO2 adds its group_size."""
        metadata: Dict[str, Any] = {"warmup_sync_updates": self.warmup_sync_updates}
        if self.continues_only_as_itself_reason:
            metadata["continues_only_as_itself"] = self.continues_only_as_itself_reason
        return metadata

    def check_checkpoint_compatible(self, saved: Dict[str, Any], saved_world_size: int) -> None:
        """Raise ``ValueError`` naming the fix when a checkpoint's optimizer state cannot continue here.

        ``saved``: the checkpoint's entry written from :meth:`checkpoint_metadata`, with its
        ``optimizer_type`` (empty for DeepSpeed's own checkpoints). Every other type's committed
        state continues here unless its schedule declared the state its own: in the entry, or for a
        checkpoint written before the entry said so, by the saved type's registered class.
        """
        saved_type = saved.get("optimizer_type")
        reason = saved.get("continues_only_as_itself")
        if "continues_only_as_itself" not in saved:
            reason = getattr(lookup(saved_type), "continues_only_as_itself_reason", None)
        if reason and saved_type != self.type_name:
            raise ValueError(f"load_checkpoint: a {saved_type} checkpoint cannot continue as {self.type_name} "
                             f"({reason}); pass load_optimizer_states=False to start from its weights")

    def continue_warmup(self, saved: Dict[str, Any]) -> None:
        """After a checkpoint of this type was loaded (``saved``: its :meth:`checkpoint_metadata` entry):
        keep the synchronous warm-up from restarting in the middle of the type's rule.

        This run resolved its own N (``warmup_sync_updates``; "auto" follows the LR scheduler, which
        may differ from the saved run's). When the checkpoint is past the saved run's warm-up but
        before this N, the warm-up is over: N becomes the loaded update count, logged once. Otherwise
        (the same N, or a checkpoint still inside its warm-up) N stays as resolved.
        """
        resolved, steps = self.warmup_sync_updates, self.progress.global_steps
        saved_warmup = saved.get("warmup_sync_updates")
        under_way = self.running is not None or self.phase is not next(iter(self.Phase))
        used = warmup_after_resume(resolved, None if saved_warmup is None else int(saved_warmup), steps, under_way)
        if used == resolved:
            return
        self.warmup_sync_updates = used
        if hasattr(self.params, "warmup_sync_updates"):
            self.params.warmup_sync_updates = used
        if self.rank == 0:
            written = (f"written with warmup_sync_updates {saved_warmup}" if saved_warmup is not None else
                       f"written before checkpoints recorded warmup_sync_updates, with {self.type_name}'s rule "
                       f"under way")
            logger.warning("load_checkpoint: the checkpoint is past its synchronous warm-up (%d updates committed, "
                           "%s); warmup_sync_updates resolved to %d for this run, but a warm-up cannot restart in "
                           "the middle of %s's rule, so %d is used (the warm-up is over)",
                           steps, written, resolved, self.type_name, used)

    def checkpoint_state(self) -> CheckpointState:
        """This rank's state after ``synchronize()`` (ShardedAdamW, DPU and ACCO; CO2 overrides)."""
        meta = {"phase": self.phase.value, "round_micro_batches": self.round_micro_batches,
                "round_loss_scale": self.round_loss_scale, "jobs_launched": self.jobs_launched, "pending": None,
                "wire": self.wire_state()}
        local = {}
        if self.round_micro_batches:
            local["grad_accum"] = [flat.unpadded(flat.grad_accum).clone() for flat in self.flats]
        if self.compression is not None:
            local["compression"] = [compression.state_dict() for compression in self.compression]
        sharded = {}
        if self.running is not None:
            result = self.running.wait()
            meta["pending"] = {"kind": self.running_kind.value, "result": result_to_dict(result)}
            if self.running_kind is JobKind.ESTIMATE:
                sharded["estimate"] = [flat.shard_of(flat.gather).clone() for flat in self.flats]
        if not self._model_holds_committed():
            sharded["held"] = [flat.shard_of(flat.model_flat).clone() for flat in self.flats]
        return CheckpointState(fp32_partitions=[shard.master for shard in self.shards],
                               rule_state=[shard.state for shard in self.shards], sharded=sharded, local=local,
                               meta=meta)

    def wire_bytes_per_job(self) -> Dict[str, int]:
        """Bytes this rank sends per update job: {"reduce_scatter": ..., "all_gather": ...} over every
        group, compressed or not (transport headers and the statistics all-reduce left out)."""
        return wire_bytes(self.compression, [flat.shard_numel for flat in self.flats], self.communicator.world_size,
                          self.flats[0].job_grad.dtype, self.flats[0].model_dtype)

    def _model_holds_committed(self) -> bool:
        """Whether the model holds the committed parameters (the masters' cast, or with compressed
        weights the copy gathered from them)."""
        return self.running is None or self.running_kind is not JobKind.COMMIT

    def load_checkpoint_state(self, state: CheckpointState, gather_full: Callable[[List[torch.Tensor]], List[torch.Tensor]]) -> None:
        """Continue exactly from a checkpoint of this same type (``state`` re-sharded to this engine).

        ``gather_full(shards)`` all-gathers one shard per group into full padded vectors (collective).
        """
        meta = state.meta
        self.reset()
        self.restore_wire(meta.get("wire"))
        self.phase = self.Phase(meta["phase"])
        self.jobs_launched = int(meta.get("jobs_launched", 0))
        if meta["round_micro_batches"]:
            self.round_micro_batches = int(meta["round_micro_batches"])
            self.round_loss_scale = meta.get("round_loss_scale")
            for flat, values in zip(self.flats, state.local["grad_accum"]):
                flat.grad_accum[:flat.numel].copy_(values)
        pending = meta["pending"]
        if pending is not None:
            kind = JobKind(pending["kind"])
            if kind is JobKind.ESTIMATE:
                outputs = gather_full(state.sharded["estimate"])
            else:
                # A commit's output is the committed parameters as the model will hold them, which is
                # what the module file holds and the model holds now. (Uncompressed that is the cast of
                # the masters; with compressed weights it is within half a quantisation step of them,
                # and only the copy the ranks gathered continues exactly.)
                outputs = [flat.model_flat for flat in self.flats]
            for flat, values in zip(self.flats, outputs):
                flat.gather.copy_(values)
            self.running = CompletedWork(f"{kind.value} restored from a checkpoint", job_result_from_dict(pending["result"]))
            self.running_kind = kind
        if "held" in state.sharded:
            for flat, values in zip(self.flats, gather_full(state.sharded["held"])):
                flat.install(values)
        if not load_group_compressions(self.compression, state.local.get("compression")) and self.rank == 0:
            logger.warning("load_checkpoint: the checkpoint holds error-feedback residuals of compressed gradients, "
                           "which this engine does not compress; they are dropped")
        self.load_type_state(state)

    def load_type_state(self, state: CheckpointState) -> None:
        """Restore the type's own in-flight state beyond the base's, which its ``checkpoint_state``
        added (ACCO's kept first half); called last by ``load_checkpoint_state``."""

    def check_checkpoint_state(self, state: CheckpointState) -> None:
        """Raise ``ValueError`` naming the entry where :meth:`load_checkpoint_state` could not continue
        exactly from ``state``; changes nothing (``load_checkpoint`` checks every file before it changes
        anything). ``state.sharded`` holds the saved partitions (their sizes are checked by the
        loader), ``state.local`` is empty after a re-shard."""
        meta = state.meta
        check_phase(meta, self.Phase)
        check_counts(meta, "round_micro_batches", "jobs_launched")
        if meta["round_micro_batches"] and state.local:
            check_vectors(state.local, "grad_accum", [flat.numel for flat in self.flats])
        pending = meta["pending"]
        if pending is not None:
            kind = JobKind(pending["kind"])
            try:
                job_result_from_dict(pending["result"])
            except TypeError as error:
                raise ValueError(f"the pending job's result {pending['result']!r} does not fit ({error})") from None
            if kind is JobKind.ESTIMATE and "estimate" not in state.sharded:
                raise ValueError("an estimate job is pending but its output ('estimate') is missing")
        check_group_compressions(self.compression, state.local.get("compression"))
        self.check_wire_state(meta.get("wire"), state.local.get("compression"))
        self.check_type_state(state)

    def check_wire_state(self, saved: Optional[Dict[str, Any]], compressions: Optional[List[Dict]]) -> None:
        """Raise ``ValueError`` if :meth:`restore_wire` could not take a checkpoint's wire: a choice that
        names no wire, or residuals whose size does not fit the buffers the choice would allocate here."""
        choice = (saved or {}).get("choice")
        if not choice or self.wire_mode != wires.AUTO:
            return
        if choice.get("wire") not in wires.WIRES:
            raise ValueError(f"the checkpoint's wire choice names {choice.get('wire')!r}, not one of "
                             f"{', '.join(wires.WIRES)}")
        members = self.network_communicator().world_size
        for index, (flat, entry) in enumerate(zip(self.flats, compressions or [])):
            residual = ((entry or {}).get("gradients") or {}).get("residual")
            expected = (members - 1) * (flat.padded_numel // members)
            if residual is not None and getattr(residual, "numel", lambda: -1)() != expected:
                raise ValueError(f"compression[{index}]'s residual has {residual.numel()} values; the {choice['wire']} "
                                 f"wire on {members} ranks holds {expected}")

    def check_type_state(self, state: CheckpointState) -> None:
        """The type's part of :meth:`check_checkpoint_state` (what its :meth:`load_type_state` reads)."""


class _SchedulerView:
    """A stand-in optimizer holding copies of the param-group hyperparameters (no tensors)."""

    def __init__(self, optimizer):
        self.param_groups = [{key: value for key, value in group.items() if key != "params"}
                             for group in optimizer.param_groups]
        self.defaults = dict(getattr(optimizer, "defaults", {}))

    def step(self, closure=None):
        raise RuntimeError("a scheduler view never steps an optimizer")


def _detached_scheduler(lr_scheduler, optimizer):
    """A deep copy of ``lr_scheduler`` driving a :class:`_SchedulerView` instead of ``optimizer``."""
    import copy
    view = _SchedulerView(optimizer)
    return copy.deepcopy(lr_scheduler, memo={id(optimizer): view})
