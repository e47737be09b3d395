"""CO2: local AdamW steps with one-step asynchronous outer averaging (docs/design.md, 3.5; CO2 paper).

Inner steps: one per full batch. Each replica (with ``group_size`` g > 1: each group of g
consecutive ranks, ZeRO-1 sharded inside the group) runs AdamW on its own copy of the weights;
no gradient crosses groups. The inner steps are jobs on the group's communicator.

Outer rounds: every tau = ``local_steps`` inner steps, boundary k
  (1) waits for J_{k-1}, which computed the anchor x_{k+1},
  (2) hands this replica's displacement y_k - x_k to J_k and resets the replica (its fp32 inner
      master and the model's cast of it) to x_{k+1}; the inner AdamW moments are kept,
  (3) launches J_k on the jobs' communicator, which runs while round k+1 computes:
        ybar_k  = x_k + mean over replicas of (y_k - x_k)     (reduce-scatter, sharded)
        d       = x_k - ybar_k                              (pseudo-gradient of round k)
        m       = clamp(beta_o * m + d / lambda, -c, c)       (clamp only if c is set)
        x_{k+2} = x_{k+1} - alpha_o * m                      (all-gathered in fp32)
so the progress of round k reaches the replicas at boundary k+1: one round late, hidden behind a
whole round of compute. Anchors, y_k and the inner masters are fp32 in every precision; the model
holds their cast. Reducing displacements rather than parameters keeps their precision when the
reduce-scatter runs in bf16. The outer state (x_k, x_{k+1}, m) is sharded over all ranks: O(P / W).
Gap penalty lambda: a constant, or adaptive: 1 + ||x_{k+1} - x_k|| / (max_i ||y^i_k - x_k|| + 1e-12).
"""
import enum
import logging
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple, Union

import torch

from ... import ops
from ..checks import config_error, count_at_most
from ..comm import Communicator, CompletedWork, DeviceReadback, PhaseClock
from .. import wire as wires
from ..compression import (CompressionConfig, GroupCompression, QuantizationFormat, check_group_compressions, compresses,
                           compressing, group_compressions, load_group_compressions, wire_bytes)
from ..flat import FlatParamGroup
from ..jobs import JobKind, correctly_rounded_sqrt
from ..optimizer import ShardedOptimizer
from ..schedule import (BuildContext, CheckpointState, Schedule, check_counts, check_phase, check_vectors,
                        result_to_dict)
from .params import AUTO, AdamWParams, WarmupParams

ADAPTIVE = "adaptive"
# Added to the largest inner displacement so the adaptive penalty is defined for a still model.
DISPLACEMENT_EPSILON = 1e-12
# Why a CO2 checkpoint continues in no other type (and no other type's in CO2).
_OWN_STATE = "CO2 keeps a replica and outer state per rank"
logger = logging.getLogger("DeepSpeed").getChild("acco")


@dataclass(kw_only=True)
class CO2Params(WarmupParams, AdamWParams):
    """Local AdamW steps with one-step asynchronous outer averaging.

    Defaults (docs/design.md, 3.5): eager merge one inner step into each round (anchor_merge_steps
    1) with local_steps 4, the settings that were level with ZeRO-1 at 720 updates over four seeds
    (docs/studies/co2_convergence.md, 6.6; local_steps 6 was worse, 6.8). The outer rule's
    alpha_o 0.5, beta_o 0, lambda 1, which those runs used, are stable under both rules: applied one
    round late (the paper's rule, anchor_merge_steps 0) it converges along a direction that a round
    of local steps resolves only while alpha_o / lambda < 1 - beta_o
    (docs/studies/co2_convergence.md, 3); the CO2 paper's alpha_o 1,
    beta_o 0.5 sit past that edge and stall.
    """

    local_steps: int = 4
    """tau: inner steps per outer round."""
    outer_lr: float = 0.5
    """alpha_o: outer learning rate."""
    outer_momentum: float = 0.0
    """beta_o: outer momentum."""
    gap_penalty: Union[float, str] = field(default=1.0, metadata={"choices": (ADAPTIVE, )})
    """lambda: constant divisor of the pseudo-gradient, or "adaptive"."""
    clip_threshold: Optional[float] = None
    """c: coordinate-wise clip of the outer momentum; None disables clipping."""
    group_size: int = 1
    """g: consecutive ranks that average gradients every inner step (ZeRO-1 inside the group)."""
    anchor_merge_steps: Optional[int] = 1
    """H (eager merge, the default with H = 1). The replicas keep their own progress at boundary k
    instead of restarting from the anchor; J_k computes x_{k+1} = x_k - alpha_o m_{k+1} from round
    k's own pseudo-gradient, and H inner steps into round k+1 every replica moves to x_{k+1} plus its
    progress since the boundary. The job then has H inner steps to finish instead of tau.
    0 (or null): the paper's rule, replicas restart from an anchor one round old (with an
    "adaptive" gap_penalty and no anchor_merge_steps given, 0)."""
    outer_nesterov: bool = False
    """Step along d / lambda + beta_o m instead of m (DiLoCo's outer Nesterov momentum)."""
    normalize_by_inner_lr: bool = False
    """SlowMo: divide the pseudo-gradient by gamma_k, the mean inner learning rate of round k, and
    multiply the outer step by it."""
    warmup_sync_updates: Union[int, str] = field(default=0, metadata={"choices": (AUTO, )})
    """N synchronous inner steps first (docs/design.md, 3.6); "auto" is for DPU and ACCO only."""

    @property
    def eager_merge(self) -> bool:
        """Whether the anchor is merged within the round (anchor_merge_steps >= 1), else the paper's rule."""
        return bool(self.anchor_merge_steps)

    @property
    def averaging_steps(self) -> int:
        """Inner steps the averaging job may take before it is waited for: ``anchor_merge_steps`` under
        the eager merge, a whole round (``local_steps``) under the paper's rule."""
        return int(self.anchor_merge_steps) if self.eager_merge else int(self.local_steps)

    def validate(self, prefix: str) -> None:
        if self.warmup_sync_updates == AUTO:
            raise config_error(f"{prefix}.warmup_sync_updates", "\"auto\" is derived for DPU and ACCO; a "
                               "synchronous warm-up made CO2 learn more slowly late in a run "
                               "(docs/studies/co2_convergence.md, 6.7)",
                               "use an integer number of synchronous inner steps (default 0)")
        if self.gap_penalty == ADAPTIVE and "anchor_merge_steps" not in self.given:
            self.anchor_merge_steps = 0  # the adaptive penalty is defined for the paper's rule only
        super().validate(prefix)
        if self.local_steps < 1:
            raise config_error(f"{prefix}.local_steps", f"must be >= 1, got {self.local_steps}", "use e.g. 4")
        count_at_most(f"{prefix}.local_steps", self.local_steps)
        if self.outer_lr <= 0:
            raise config_error(f"{prefix}.outer_lr", f"must be > 0, got {self.outer_lr}", "use e.g. 1.0")
        if not 0.0 <= self.outer_momentum < 1.0:
            raise config_error(f"{prefix}.outer_momentum", f"must lie in [0, 1), got {self.outer_momentum}",
                               "use e.g. 0.5")
        if self.gap_penalty != ADAPTIVE and self.gap_penalty <= 0:
            raise config_error(f"{prefix}.gap_penalty", f"must be > 0 or \"adaptive\", got {self.gap_penalty}",
                               "use 1.0 for no penalty or \"adaptive\"")
        if self.clip_threshold is not None and self.clip_threshold <= 0:
            raise config_error(f"{prefix}.clip_threshold", f"must be > 0 or null, got {self.clip_threshold}",
                               "use a positive threshold or null to disable")
        if self.group_size < 1:
            raise config_error(f"{prefix}.group_size", f"must be >= 1, got {self.group_size}", "use 1 (no groups)")
        count_at_most(f"{prefix}.group_size", self.group_size)
        if self.anchor_merge_steps is not None:
            if not 0 <= self.anchor_merge_steps <= self.local_steps:
                default_note = "" if "local_steps" in self.given else " (local_steps' default)"
                raise config_error(f"{prefix}.anchor_merge_steps", f"must lie in [0, local_steps={self.local_steps}"
                                   f"{default_note}], got {self.anchor_merge_steps}",
                                   "use 1 (eager merge, the default), 0 for the paper's rule, or raise local_steps")
            if self.gap_penalty == ADAPTIVE and self.eager_merge:
                raise config_error(f"{prefix}.gap_penalty", "\"adaptive\" measures how far the anchor moved during "
                                   "a round, which it never does with an eager merge (anchor_merge_steps >= 1)",
                                   "use a number, e.g. 1.0, or set anchor_merge_steps to 0 (the paper's rule)")
        self._warn_if_unstable(prefix)

    def _warn_if_unstable(self, prefix: str) -> None:
        """The linear stability bound of the outer iteration (docs/studies/co2_convergence.md, section 3)."""
        if self.gap_penalty == ADAPTIVE:
            return
        ratio = self.outer_lr / float(self.gap_penalty)
        if not self.eager_merge:
            bound, rule = 1.0 - self.outer_momentum, "one round late"
        else:
            bound, rule = 2.0 * (1.0 + self.outer_momentum), "merged within the round"
        if ratio >= bound:
            logger.warning("deepspeed_acco config: %s: outer_lr / gap_penalty = %.3g is outside the stable range "
                           "(< %.3g) of the CO2 outer iteration applied %s; expect the anchor to oscillate instead "
                           "of converging (docs/studies/co2_convergence.md)", prefix, ratio, bound, rule)


class OuterWaitMonitor:
    """Tells the user once when the outer averaging is not hidden behind the inner steps.

    CO2 hides one averaging behind ``local_steps`` inner steps (behind ``anchor_merge_steps`` in
    eager mode). When the link is slower than that, every boundary waits and training runs at the
    network's pace without saying so; this warns after ``patience`` consecutive rounds in which the
    wait took more than ``threshold`` of the round's wall-clock, naming the key to raise.
    """

    def __init__(self, key: str, value: int, *, threshold: float = 0.1, patience: int = 3, clock=time.perf_counter,
                 bound: Optional[Tuple[str, int]] = None):
        self.key, self.value = key, value
        self.bound = bound
        """(key, value) of the setting that caps ``key``: named too when ``value`` already sits at it."""
        self.threshold, self.patience, self.clock = threshold, patience, clock
        self.round_started: Optional[float] = None
        self.consecutive = 0
        self.warned = False

    def record(self, waited_s: float) -> Optional[str]:
        """One outer wait (seconds) at the end of a round; returns the warning when it is given."""
        now = self.clock()
        started, self.round_started = self.round_started, now
        if started is None or self.warned:
            return None
        round_s = max(now - started, 1e-9)
        self.consecutive = self.consecutive + 1 if waited_s > self.threshold * round_s else 0
        if self.consecutive < self.patience:
            return None
        self.warned = True
        raise_what = f"optimizer.params.{self.key} (now {self.value})"
        if self.bound is not None and self.value >= self.bound[1]:
            raise_what += f" together with its upper bound optimizer.params.{self.bound[0]} (now {self.bound[1]})"
        message = (f"CO2: the outer averaging was not hidden in {self.patience} consecutive rounds (the last one "
                   f"waited {waited_s:.2f} s of {round_s:.2f} s): training runs at the link's pace; raise "
                   f"{raise_what} so that one averaging fits under it, or compress it (zero_quantized_weights)")
        logger.warning(message)
        return message


class Phase(enum.Enum):
    LOCAL = "local"
    """Round k+1: inner steps from the anchor x_{k+1}; the running job computes x_{k+2} (none in round 0)."""


class OuterState:
    """One flat group's outer state: this rank's shards over all W ranks, plus full-size fp32 buffers.

    Sharded, fp32:  prev_anchor (x_k), anchor (x_{k+1}), momentum (m)
    Full, per rank: round_start (x of the round in progress, fp32), gather (the job's x_{k+2}, fp32),
                    displacement (y - round_start on this rank's inner shard, zero elsewhere; comm dtype)
    """

    def __init__(self, flat: FlatParamGroup, world_size: int, world_rank: int, communication_dtype: torch.dtype):
        assert flat.padded_numel % world_size == 0, "outer shards need the flat group padded for all ranks"
        self.flat = flat
        self.shard_numel = flat.padded_numel // world_size
        self.shard_offset = world_rank * self.shard_numel
        self.round_start = flat.model_flat.to(torch.float32, copy=True)
        self.gather = self.round_start.clone()
        self.anchor = self.shard_of(self.round_start).clone()
        self.prev_anchor = self.anchor.clone()
        self.momentum = torch.zeros_like(self.anchor)
        self.displacement = torch.zeros(flat.padded_numel, dtype=communication_dtype, device=flat.device)
        self.mean_displacement = torch.zeros(self.shard_numel, dtype=communication_dtype, device=flat.device)

    def shard_of(self, full: torch.Tensor) -> torch.Tensor:
        return full[self.shard_offset:self.shard_offset + self.shard_numel]


@dataclass
class OuterResult:
    skipped: bool
    """True if the mean displacement was non-finite: the anchor did not move."""
    penalty: float
    anchor_move: float
    """||x_{k+1} - x_k||, the distance the anchor moved during round k."""
    max_displacement: float
    """max_i ||y^i_k - x_k||, the largest inner displacement of round k."""
    timings_s: Dict[str, float] = field(default_factory=dict)


def outer_decision(statistics: torch.Tensor, *, num_groups: int,
                   gap_penalty: Union[float, str]) -> Tuple[torch.Tensor, torch.Tensor]:
    """The outer update's penalty and skip flag, decided on the statistics' device (no host sync).

    ``statistics`` = [||y_j - x_k||^2 for each group j, ||x_{k+1} - x_k||^2, non-finite count of the
    mean displacement] (float64, all-reduced). Returns ``(control, summary)``: the kernel's control
    tensor [lambda, skip] and the float64 summary [skipped, penalty, anchor_move, max_displacement].
    Same float64 arithmetic as the host computed before: lambda = 1 + ||x_{k+1} - x_k|| /
    (max_j ||y_j - x_k|| + 1e-12) when adaptive; skipped if anything is non-finite.
    """
    max_displacement = correctly_rounded_sqrt(statistics[:num_groups].max())
    anchor_move = correctly_rounded_sqrt(statistics[num_groups])
    skip = (statistics[num_groups + 1] > 0) | ~torch.isfinite(max_displacement)
    if gap_penalty == ADAPTIVE:
        penalty = anchor_move / (max_displacement + DISPLACEMENT_EPSILON) + 1.0
    else:
        penalty = torch.full_like(anchor_move, float(gap_penalty))
    summary = torch.stack([skip.to(torch.float64), penalty, anchor_move, max_displacement])
    return ops.make_control(penalty, skip), summary


@dataclass
class CO2OuterJob:
    """Job J_k: reduce-scatter the displacements, outer update on the shard, all-gather x_{k+2}."""

    states: List[OuterState]
    communicator: Communicator
    num_groups: int
    group_index: int
    params: CO2Params
    local_displacement_sq: torch.Tensor
    """||y_k - x_k||^2 over this rank's inner shards (a 0-dim float64 tensor, computed on the training
    stream; the job's Work owns it until the job is known complete)."""
    compression: Optional[List[GroupCompression]] = None
    """Per group, the compressed displacement reduce-scatter and/or anchor all-gather (None: fp32)."""
    lr_scales: Optional[List[float]] = None
    """Per group, gamma_k (normalize_by_inner_lr), else None."""

    def __call__(self) -> DeviceReadback:
        device = self.states[0].anchor.device
        clock = PhaseClock(device)
        with clock.phase("reduce_scatter"):
            for index, state in enumerate(self.states):
                compression = compressing(self.compression, index, "gradients")
                if compression is None:
                    self.communicator.reduce_scatter(state.mean_displacement, state.displacement)
                else:  # the residual carries what was not sent of this round's displacement into the next
                    compression.reduce_scatter(state.mean_displacement, state.displacement)

        if self.params.eager_merge:
            # Eager mode: round k's pseudo-gradient moves x_k itself, x_{k+1} = x_k - alpha_o m_{k+1}.
            for state in self.states:
                state.prev_anchor.copy_(state.anchor)

        with clock.phase("statistics"):
            num_groups = self.num_groups
            # [||y_j - x_k||^2 of each group j (this rank adds its shard's part), ||x_{k+1} - x_k||^2,
            #  non-finite count], summed over ranks.
            statistics = torch.zeros(num_groups + 2, dtype=torch.float64, device=device)
            statistics[self.group_index] = self.local_displacement_sq
            statistics[num_groups] = sum(torch.linalg.vector_norm(s.anchor - s.prev_anchor).double().square()
                                         for s in self.states)
            statistics[num_groups + 1] = sum((~torch.isfinite(s.mean_displacement)).sum() for s in self.states)
            self.communicator.all_reduce(statistics)
            control, summary = outer_decision(statistics, num_groups=num_groups, gap_penalty=self.params.gap_penalty)

        with clock.phase("update"):
            for index, state in enumerate(self.states):
                compression = compressing(self.compression, index, "weights")
                # With a compressed gather the new anchor shard goes to an fp32 buffer, and the delta from
                # x_{k+1} as every rank holds it (round_start) is sent.
                out = state.shard_of(state.gather) if compression is None else compression.new_shard
                # ybar_k = x_k + (sum over ranks of the displacement shards) / groups, in fp32. A skipped
                # round (non-finite replicas, decided on every rank alike) keeps x_{k+2} = x_{k+1}.
                mean_params = state.mean_displacement.float().div_(num_groups).add_(state.prev_anchor)
                ops.co2_outer_step(state.prev_anchor, state.anchor, state.momentum, mean_params,
                                   outer_lr=self.params.outer_lr, outer_momentum=self.params.outer_momentum,
                                   clip_threshold=self.params.clip_threshold, out=out, control=control,
                                   nesterov=self.params.outer_nesterov,
                                   lr_scale=self.lr_scales[index] if self.lr_scales is not None else 1.0)

        with clock.phase("all_gather"):
            for index, state in enumerate(self.states):
                compression = compressing(self.compression, index, "weights")
                if compression is None:
                    self.communicator.all_gather(state.gather, state.shard_of(state.gather))
                else:  # round_start stays unchanged until the boundary that waits for this job
                    compression.all_gather(state.gather, held=state.round_start)
        return DeviceReadback(summary, _outer_result, clock)


class _AveragedOverGroups:
    """A warm-up inner step: first sum the round's gradients over every rank, scaled so that the
    group's reduce-scatter totals every rank's gradients once; then the group's usual step."""

    def __init__(self, job, outer_communicator: Communicator, group_size: int):
        self.job = job
        self.outer_communicator = outer_communicator
        self.group_size = group_size

    def __call__(self):
        for flat in self.job.flats:
            self.outer_communicator.all_reduce(flat.job_grad)
            flat.job_grad.div_(self.group_size)
        return self.job()


def _outer_result(summary: List[float], timings_s: Dict[str, float]) -> OuterResult:
    skipped, penalty, anchor_move, max_displacement = summary
    return OuterResult(skipped=bool(skipped), penalty=penalty, anchor_move=anchor_move,
                       max_displacement=max_displacement, timings_s=timings_s)


class CO2(Schedule):
    """Inner AdamW steps as group jobs; the outer averaging job overlapped with a round."""

    type_name = "CO2"
    Params = CO2Params
    Phase = Phase
    synchronous = True
    continues_only_as_itself_reason = _OWN_STATE
    # An inner step's non-finite check covers only its own group (no gradient crosses groups), so
    # one replica may skip alone; its LR schedule still advances with the others'.
    schedule_skipped_steps = True

    @classmethod
    def validate_config(cls, params: CO2Params, batch, world_size: int) -> None:
        if world_size % params.group_size:
            raise config_error("optimizer.params.group_size",
                               f"{params.group_size} does not divide the world size {world_size}",
                               "choose a divisor of the number of ranks")

    @classmethod
    def build(cls, context: BuildContext) -> "CO2":
        """ZeRO-1 inside each group for the inner steps, with flat buffers padded for all ranks so the
        outer state shards over all of them."""
        group_size = context.params.group_size
        inner = context.new_group_communicator(group_size, "co2-group")
        optimizer = ShardedOptimizer(context.param_groups, cls.rule.defaults(context.params), world_size=group_size,
                                     rank=context.rank % group_size,
                                     communication_dtype=context.config.communication_torch_dtype, synchronous=True,
                                     rule=cls.rule, padding_world_size=context.world_size,
                                     accumulation_dtype=context.config.accumulation_torch_dtype)
        return cls(context, optimizer, inner, outer_communicator=context.jobs_communicator)

    def __init__(self, context: BuildContext, optimizer: ShardedOptimizer, communicator: Communicator, *,
                 outer_communicator: Communicator):
        super().__init__(context, optimizer, communicator)
        self.outer_communicator = outer_communicator
        self.group_size = self.params.group_size
        self.num_groups = self.world_size // self.group_size
        self.group_index = self.rank // self.group_size
        # The outer job averages parameters, not gradients: DeepSpeed's rule for gradients (the model's
        # dtype) does not apply, and the eager-merge evidence (docs/studies/co2_convergence.md) averaged
        # them in fp32. An explicit communication_data_type still applies to it.
        dtype = context.config.communication_torch_dtype if context.config.communication_dtype_given else torch.float32
        self.outers = [OuterState(flat, outer_communicator.world_size, outer_communicator.rank, dtype)
                       for flat in self.flats]
        self.inner_steps_in_round = 0
        self.outer_rounds = 0
        """Outer boundaries passed (k after boundary k - 1)."""
        self.outer_skips = 0
        self.merge_steps = self.params.anchor_merge_steps if self.params.eager_merge else None
        """H in eager mode; None under the paper's rule (anchor_merge_steps 0 or null)."""
        self.outer_wait_monitor = (OuterWaitMonitor("local_steps", self.params.local_steps) if self.merge_steps is None
                                   else OuterWaitMonitor("anchor_merge_steps", self.merge_steps,
                                                         bound=("local_steps", self.params.local_steps)))
        self.boundary_masters: Optional[List[torch.Tensor]] = None
        """Eager mode: y_k on this rank's inner shards, kept from boundary k until J_k is merged."""
        self.round_lr_sums = [0.0] * len(self.flats)
        """normalize_by_inner_lr: per group, the sum of the inner steps' learning rates this round."""
        # The inner steps' compression (self.compression) is on the group's communicator: none with
        # group_size 1. The outer job's is on all ranks.
        self.outer_compression: Optional[List[GroupCompression]] = group_compressions(
            context.config.compression, outer_communicator, [flat.padded_numel for flat in self.flats], context.device)

    def boundary(self) -> None:
        self._record_inner_lr()
        work = self._launch(JobKind.COMMIT, wait=True)  # one inner step of this replica
        self._account_commit(work.wait())
        self.inner_steps_in_round += 1
        if self.merge_steps is not None and self.running is not None and self.inner_steps_in_round == self.merge_steps:
            self._merge()
        if self.inner_steps_in_round == self.params.local_steps:
            self._outer_boundary()
            self.inner_steps_in_round = 0

    def _record_inner_lr(self) -> None:
        if self.params.normalize_by_inner_lr:
            for index, flat in enumerate(self.flats):
                self.round_lr_sums[index] += float(flat.param_group["lr"])

    def _log_skip(self, outer) -> None:
        if outer is not None and outer.skipped:
            self.outer_skips += 1
            logger.warning("CO2 outer round %d: non-finite replica parameters; the anchor did not move (outer "
                           "rounds skipped so far: %d)", self.outer_rounds - 1, self.outer_skips)

    def _outer_boundary(self) -> None:
        eager = self.merge_steps is not None
        outer = None if eager else self._wait_outer()  # eager mode merged J_{k-1} already
        self._log_skip(outer)
        self.decide_wire()  # no job runs here under the paper's rule, which waits at every boundary
        if self.outer_rounds == 0:
            self.decide_wire_from_probe()  # the first averaging's wire, from a probe of the link
        displacement_sq = torch.zeros((), dtype=torch.float64, device=self.flats[0].device)
        with torch.no_grad():
            for flat, state, shard in zip(self.flats, self.outers, self.shards):
                own = slice(flat.shard_offset, flat.shard_offset + flat.shard_numel)
                moved = shard.master - state.round_start[own]  # y_k - x_k on this rank's inner shard, fp32
                displacement_sq += torch.linalg.vector_norm(moved).double().square()
                state.displacement[own].copy_(moved)
                if eager:
                    continue  # the replica keeps its progress; J_k's anchor is merged H steps later
                if outer is not None:  # x_{k+1} arrived (for k = 0, x_1 = x_0 is already there)
                    state.round_start, state.gather = state.gather, state.round_start
                flat.install(state.round_start)
                shard.master.copy_(state.round_start[own])
        if eager:
            self.boundary_masters = [shard.master.clone() for shard in self.shards]
        lr_scales = None
        if self.params.normalize_by_inner_lr:
            lr_scales = [total / self.params.local_steps for total in self.round_lr_sums]
            self.round_lr_sums = [0.0] * len(self.flats)
        job = CO2OuterJob(states=self.outers, communicator=self.outer_communicator, num_groups=self.num_groups,
                          group_index=self.group_index, params=self.params, local_displacement_sq=displacement_sq,
                          compression=self.outer_compression, lr_scales=lr_scales)
        self._submit(job, self.outer_communicator, f"CO2 outer averaging of round {self.outer_rounds}", wait=False)
        self.outer_rounds += 1

    def _wait_outer(self):
        """Wait for the running outer job (if any); its blocked time, which the schedule's ``_wait``
        already measures, goes to the monitor that says when the averaging is not hidden."""
        waited_before = self._boundary_wait_s
        outer = self._wait_running()
        if outer is not None:
            self.outer_wait_monitor.record(self._boundary_wait_s - waited_before)
        return outer

    def _merge(self) -> None:
        """Eager mode, H inner steps after boundary k: every replica moves to x_{k+1} plus its own
        progress since the boundary (after a skipped round, back to the anchor)."""
        outer = self._wait_outer()
        self._log_skip(outer)
        with torch.no_grad():
            for flat, state, shard, at_boundary in zip(self.flats, self.outers, self.shards, self.boundary_masters):
                own = slice(flat.shard_offset, flat.shard_offset + flat.shard_numel)
                state.round_start, state.gather = state.gather, state.round_start  # x_{k+1}
                if outer.skipped:
                    shard.master.copy_(state.round_start[own])
                else:
                    shard.master.copy_(state.round_start[own] + (shard.master - at_boundary))
        self.boundary_masters = None
        self._install_replica([shard.master for shard in self.shards])

    def _install_replica(self, shards: List[torch.Tensor]) -> None:
        """The model holds the cast of this group's inner masters (all-gathered in the group)."""
        if self.group_size == 1:
            for flat, shard in zip(self.flats, shards):
                flat.install(shard)
            return
        self._wait(self.lane.submit(lambda: self._gather_replica(shards), self.communicator,
                                    label="CO2 replica after a merge"))

    # ---- synchronous warm-up ------------------------------------------------------------------
    def _sync_boundary(self) -> None:
        """A warm-up step: the round's gradients averaged over every rank, then the group's inner
        step; every replica takes the same step. When the warm-up ends, CO2 starts from there."""
        self._record_inner_lr()
        job = self._shard_update_job(JobKind.COMMIT)
        if self.num_groups > 1:
            job.local_micro_batches *= self.num_groups  # the group's count then totals every rank's
            job = _AveragedOverGroups(job, self.outer_communicator, self.group_size)
        work = self._submit(job, self.communicator, "CO2 synchronous warm-up step", wait=True)
        self._account_commit(work.wait())
        if not self.in_sync_warmup:
            self._restart_outer_from_replica()

    def _restart_outer_from_replica(self) -> None:
        """x_0 = x_1 = the replicas' fp32 parameters (identical after the warm-up), m = 0."""
        self._anchors_from_replica("CO2 anchors after the warm-up")
        for compression in self.outer_compression or ():
            compression.reset()
        self.inner_steps_in_round = 0
        self.outer_rounds = 0
        self.round_lr_sums = [0.0] * len(self.flats)

    def _anchors_from_replica(self, label: str) -> None:
        """Anchors (x_k = x_{k+1}, all copies) = the replicas' fp32 parameters, momentum 0. Collective."""
        fulls = self._wait(self.lane.submit(self._gather_masters_fp32, self.communicator, label=label))
        for state, full in zip(self.outers, fulls):
            state.round_start.copy_(full)
            state.gather.copy_(full)
            state.anchor.copy_(state.shard_of(full))
            state.prev_anchor.copy_(state.anchor)
            state.momentum.zero_()

    def _gather_masters_fp32(self) -> List[torch.Tensor]:
        fulls = []
        for flat, shard in zip(self.flats, self.shards):
            full = torch.zeros(flat.padded_numel, dtype=torch.float32, device=flat.device)
            flat.shard_of(full).copy_(shard.master)
            self.communicator.all_gather(full, flat.shard_of(full))
            fulls.append(full)
        return fulls

    def committed_flats(self) -> Optional[List[torch.Tensor]]:
        """The newest anchor: x_{k+2} once J_k has finished, x_0 before the first boundary. During the
        synchronous warm-up the updates are installed at once: the model holds the committed state."""
        if self.in_sync_warmup:
            return None
        return [state.gather if self.running is not None else state.round_start for state in self.outers]

    def landed_flats(self) -> Optional[List[torch.Tensor]]:
        """The newest anchor that has landed on this rank, never waiting for the running outer job:
        ``round_start`` holds it (x_{k+1} after boundary k under the restart rule; x_k until the
        merge and x_{k+1} after it in eager mode; x_0 before the first boundary), while the job
        writes only ``gather``. During the synchronous warm-up the model holds the committed state."""
        if self.in_sync_warmup:
            return None
        return [state.round_start for state in self.outers]

    def pending_commit(self):
        return None  # inner steps are installed when they finish; the outer job has no step count

    def reset(self) -> None:
        """Start CO2 afresh from the weights the model holds: x_0 = x_1 = them, m = 0."""
        super().reset()
        dtype = self.outers[0].displacement.dtype
        self.outers = [OuterState(flat, self.outer_communicator.world_size, self.outer_communicator.rank, dtype)
                       for flat in self.flats]
        for flat, shard in zip(self.flats, self.shards):
            shard.master.copy_(flat.shard_of(flat.model_flat))
        for compression in self.outer_compression or ():
            compression.reset()
        self.inner_steps_in_round = 0
        self.outer_rounds = 0
        self.boundary_masters = None
        self.round_lr_sums = [0.0] * len(self.flats)

    # ---- the wire of the outer averaging (runtime/wire.py) --------------------------------------
    def network_communicator(self) -> Communicator:
        return self.outer_communicator

    def co2_steps(self) -> Dict[str, int]:
        return {"co2_local_steps": int(self.params.local_steps), "co2_averaging_steps": self.params.averaging_steps}

    def wire_extra_bytes(self, bits: int) -> int:
        """The outer averaging's compressed buffers: its displacements are fp32 already under "auto"."""
        return wires.compression_extra_bytes([flat.padded_numel for flat in self.flats], self.world_size, bits,
                                             self.block_size, model_bytes=0, communication_bytes=4,
                                             gather_shared=False, snapshot=False)

    def switch_wire(self, name: str) -> None:
        """Compress the outer averaging from now on (the inner steps, local or inside a group, keep theirs)."""
        bits = wires.bits_of(name)
        assert bits is not None and self.running is None, "a wire is switched between jobs, to a compressed one"
        assert self.outers[0].displacement.dtype == torch.float32, "compressed averaging quantises fp32 displacements"
        config = CompressionConfig(gradients=True, weights=True,
                                   format=QuantizationFormat(bits=bits, block_size=self.block_size))
        self.outer_compression = group_compressions(config, self.outer_communicator,
                                                    [flat.padded_numel for flat in self.flats], self.device)
        self.wire_name = name

    def wire_bytes_per_job(self) -> Dict[str, int]:
        """Bytes this rank sends per outer averaging job J_k (an inner step, with group_size > 1, sends
        what ShardedAdamW's job does on a group of group_size ranks)."""
        return wire_bytes(self.outer_compression, [state.shard_numel for state in self.outers],
                          self.outer_communicator.world_size, self.outers[0].displacement.dtype, torch.float32)

    # ---- checkpoints -------------------------------------------------------------------------
    def communicator_for_checkpoints(self) -> Communicator:
        return self.outer_communicator

    def rule_state_is_sharded(self) -> bool:
        return False  # the inner state is per group; DeepSpeed's partitions hold the anchors

    def checkpoint_metadata(self) -> Dict:
        return dict(super().checkpoint_metadata(), group_size=self.group_size)

    def check_checkpoint_compatible(self, saved: Dict, saved_world_size: int) -> None:
        """Only a CO2 checkpoint of the same world size and group_size continues here."""
        saved_type = saved.get("optimizer_type")
        if saved_type != self.type_name:
            raise ValueError(f"load_checkpoint: a {saved_type or 'DeepSpeed'} checkpoint cannot continue as "
                             f"{self.type_name} ({_OWN_STATE}); pass load_optimizer_states=False to start from its "
                             f"weights")
        if saved_world_size != self.world_size or saved.get("group_size") != self.group_size:
            raise ValueError(f"load_checkpoint: CO2 checkpoints continue only with the same world size and group_size "
                             f"(saved: {saved_world_size} ranks, group_size {saved.get('group_size')}); pass "
                             f"load_optimizer_states=False to start from the weights")

    def checkpoint_state(self) -> CheckpointState:
        if self.in_sync_warmup and self.progress.global_steps > 0:
            # Inside the warm-up the anchors are still x_0: the DeepSpeed partitions (what another
            # loader and zero_to_fp32 read as the committed weights) get the replicas' fp32
            # parameters instead. The switch overwrites the anchors anyway, so this changes nothing
            # for the run that continues.
            self._anchors_from_replica("CO2 anchors for a checkpoint inside the warm-up")
        meta = {"phase": self.phase.value, "round_micro_batches": self.round_micro_batches,
                "round_loss_scale": self.round_loss_scale, "jobs_launched": self.jobs_launched,
                "group_size": self.group_size, "inner_steps_in_round": self.inner_steps_in_round,
                "outer_rounds": self.outer_rounds, "outer_skips": self.outer_skips, "pending": None,
                "round_lr_sums": list(self.round_lr_sums), "wire": self.wire_state()}
        if self.running is not None:
            meta["pending"] = {"result": result_to_dict(self.running.wait())}
        local = {"inner_master": [shard.master.clone() for shard in self.shards],
                 "inner_state": [{name: value.clone() for name, value in shard.state.items()} for shard in self.shards]}
        if self.boundary_masters is not None:
            local["boundary_masters"] = [values.clone() for values in self.boundary_masters]
        if self.round_micro_batches:
            local["grad_accum"] = [flat.unpadded(flat.grad_accum).clone() for flat in self.flats]
        sharded = {"prev_anchor": [s.prev_anchor.clone() for s in self.outers],
                   "momentum": [s.momentum.clone() for s in self.outers]}
        # Compressed gathers leave copies within half a quantisation step of the fp32 values they
        # stand for: keep the exact copies (the outer ones identical on every rank, so sharded; the
        # replica identical within the group) instead of rebuilding them from the masters at load.
        if compresses(self.outer_compression, "weights"):
            sharded["round_start"] = [s.shard_of(s.round_start).clone() for s in self.outers]
            sharded["gathered_anchor"] = [s.shard_of(s.gather).clone() for s in self.outers]
        if compresses(self.compression, "weights"):
            local["replica"] = [flat.shard_of(flat.model_flat).clone() for flat in self.flats]
        for key, compressions in (("compression", self.compression), ("outer_compression", self.outer_compression)):
            if compressions is not None:
                local[key] = [compression.state_dict() for compression in compressions]
        return CheckpointState(fp32_partitions=[s.anchor for s in self.outers], rule_state=None, sharded=sharded,
                               local=local, meta=meta)

    def check_checkpoint_state(self, state: CheckpointState) -> None:
        meta, local = state.meta, state.local
        check_phase(meta, self.Phase)
        check_counts(meta, "round_micro_batches", "jobs_launched", "inner_steps_in_round", "outer_rounds",
                     "outer_skips")
        if len(meta.get("round_lr_sums", self.round_lr_sums)) != len(self.flats):
            raise ValueError(f"round_lr_sums has {len(meta['round_lr_sums'])} entries for {len(self.flats)} groups")
        if meta["pending"] is not None:
            try:
                OuterResult(**meta["pending"]["result"])
            except TypeError as error:
                raise ValueError(f"the pending outer result {meta['pending']['result']!r} does not fit ({error})") \
                    from None
        for key in ("prev_anchor", "momentum"):
            if key not in state.sharded:
                raise ValueError(f"the outer state {key!r} is missing")
        if ("round_start" in state.sharded) != ("gathered_anchor" in state.sharded):
            raise ValueError("of the gathered anchors only one of 'round_start' and 'gathered_anchor' is saved")
        inner = [shard.master.numel() for shard in self.shards]
        check_vectors(local, "inner_master", inner)
        check_vectors(local, "boundary_masters", inner, optional=True)
        check_vectors(local, "replica", [flat.shard_numel for flat in self.flats], optional=True)
        if meta["round_micro_batches"]:
            check_vectors(local, "grad_accum", [flat.numel for flat in self.flats])
        saved_inner = local.get("inner_state")
        if not isinstance(saved_inner, (list, tuple)) or len(saved_inner) != len(self.shards):
            raise ValueError("the inner optimizer state is missing or has another number of groups")
        for index, (shard, saved) in enumerate(zip(self.shards, saved_inner)):
            if sorted(saved) != sorted(shard.state):
                raise ValueError(f"inner_state[{index}] holds {sorted(saved)}, this engine {sorted(shard.state)}")
            for name, value in shard.state.items():
                check_vectors({name: [saved[name]]}, name, [value.numel()])
        check_group_compressions(self.compression, local.get("compression"))
        check_group_compressions(self.outer_compression, local.get("outer_compression"))
        self.check_wire_state(meta.get("wire"), local.get("outer_compression"))

    def load_checkpoint_state(self, state: CheckpointState, gather_full) -> None:
        meta = state.meta
        self.reset()
        self.restore_wire(meta.get("wire"))
        self.jobs_launched = int(meta.get("jobs_launched", 0))
        self.inner_steps_in_round = int(meta["inner_steps_in_round"])
        self.outer_rounds = int(meta["outer_rounds"])
        self.outer_skips = int(meta["outer_skips"])
        self.round_lr_sums = list(meta.get("round_lr_sums", self.round_lr_sums))
        if "boundary_masters" in state.local:
            self.boundary_masters = [values.clone() for values in state.local["boundary_masters"]]
        if meta["round_micro_batches"]:
            self.round_micro_batches = int(meta["round_micro_batches"])
            self.round_loss_scale = meta.get("round_loss_scale")
            for flat, values in zip(self.flats, state.local["grad_accum"]):
                flat.grad_accum[:flat.numel].copy_(values)
        for shard, master, rule_state in zip(self.shards, state.local["inner_master"], state.local["inner_state"]):
            shard.master.copy_(master)
            for name, value in rule_state.items():
                shard.state[name].copy_(value)
        for outer, anchor, prev_anchor, momentum in zip(self.outers, state.fp32_partitions,
                                                         state.sharded["prev_anchor"], state.sharded["momentum"]):
            outer.anchor.copy_(anchor)
            outer.prev_anchor.copy_(prev_anchor)
            outer.momentum.copy_(momentum)
        pending = meta["pending"]
        anchors = gather_full([outer.anchor for outer in self.outers], torch.float32)
        if pending is None:  # before the first boundary: x_0 = x_1, the round started there
            starts = anchors
        else:  # J_k finished: x_{k+2} waits to be installed, round k+1 started at x_{k+1}
            starts = gather_full([outer.prev_anchor for outer in self.outers], torch.float32)
            self.running = CompletedWork("CO2 outer averaging restored from a checkpoint",
                                         OuterResult(**pending["result"]))
        if "round_start" in state.sharded:  # saved with compressed anchor gathers: the copies as gathered
            starts = gather_full(state.sharded["round_start"], torch.float32)
            anchors = gather_full(state.sharded["gathered_anchor"], torch.float32)
        for outer, start, anchor in zip(self.outers, starts, anchors):
            outer.round_start.copy_(start)
            outer.gather.copy_(anchor)
        dropped = not all([load_group_compressions(self.compression, state.local.get("compression")),
                           load_group_compressions(self.outer_compression, state.local.get("outer_compression"))])
        if dropped and self.rank == 0:
            logger.warning("load_checkpoint: the checkpoint holds error-feedback residuals of compressed "
                           "communication, which this engine does not compress; they are dropped")
        # The replica is the cast of the inner masters (its group's shards, all-gathered in the group),
        # or, saved with compressed inner gathers, the shards the model held.
        shards = state.local.get("replica") or [shard.master for shard in self.shards]
        work = self.lane.submit(lambda: self._gather_replica(shards), self.communicator,
                                label="CO2 replica from a checkpoint")
        work.wait()

    def _gather_replica(self, shards: List[torch.Tensor]) -> None:
        for flat, shard in zip(self.flats, shards):
            flat.shard_of(flat.model_flat).copy_(shard)
            self.communicator.all_gather(flat.model_flat, flat.shard_of(flat.model_flat))
