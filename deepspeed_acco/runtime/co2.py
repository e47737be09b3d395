"""CO2: local AdamW steps with one-step asynchronous outer averaging (DESIGN 3.5; CO2 paper).

Inner steps: one per full batch. Each rank (with ``group_size`` g > 1: each group of g ranks,
ZeRO-1 sharded inside the group) runs AdamW on its own replica; no gradient crosses groups.

Outer rounds: every tau = ``local_steps`` inner steps the boundary k
  (1) waits for J_{k-1}, which computed the anchor x_{k+1},
  (2) hands this replica's parameters y_k to J_k and resets the replica (and its inner fp32
      master shard) to x_{k+1}; the inner AdamW moments are kept,
  (3) launches J_k, which runs while round k+1 computes:
        ybar_k  = mean over ranks of y_k                     (reduce-scatter, sharded)
        d       = x_k - ybar_k                              (pseudo-gradient of round k)
        m       = clamp(beta_o * m + d / lambda, -c, c)       (clamp only if c is set)
        x_{k+2} = x_{k+1} - alpha_o * m                      (all-gathered for boundary k+1)
so the progress of round k reaches the replicas at boundary k+1: one round late, hidden behind a
whole round of compute. The outer state (x_k, x_{k+1}, m) is sharded over all ranks: O(P / W).
Gap penalty lambda: a constant, or adaptive: 1 + ||x_{k+1} - x_k|| / (max_i ||y^i_k - x_k|| + 1e-12).
"""
import contextlib
import math
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Union

import torch

from .. import ops
from .comm import Communicator, Pipeline
from .flat import FlatParamGroup
from .jobs import JobKind, ShardState
from .schedule import Phase, Schedule, ScheduleSettings

ADAPTIVE = "adaptive"
# Added to the largest inner displacement so the adaptive penalty is defined for a still model.
DISPLACEMENT_EPSILON = 1e-12
_KERNEL_OUT_DTYPES = (torch.float32, torch.bfloat16)


class OuterState:
    """One flat group's outer state: this rank's shard (over all W ranks) plus full-size buffers.

    Sharded, fp32:  prev_anchor (x_k), anchor (x_{k+1}), momentum (m), mean (ybar_k)
    Full, per rank: local_params (y_k handed to the job), gather (x_{k+1}, then x_{k+2} from the
                    job), round_start (x_k as the replica began the round; adaptive penalty only)
    """

    def __init__(self, flat: FlatParamGroup, world_size: int, world_rank: int, communication_dtype: torch.dtype,
                 adaptive: bool):
        assert flat.padded_numel % world_size == 0, "outer shards need the flat group padded for all ranks"
        self.flat = flat
        self.shard_numel = flat.padded_numel // world_size
        self.shard_offset = world_rank * self.shard_numel
        start = self.shard_of(flat.model_flat).to(torch.float32, copy=True)
        self.prev_anchor = start.clone()
        self.anchor = start
        self.momentum = torch.zeros_like(start)
        self.mean = torch.zeros(self.shard_numel, dtype=communication_dtype, device=flat.device)
        self.local_params = torch.zeros(flat.padded_numel, dtype=communication_dtype, device=flat.device)
        self.gather = flat.model_flat.clone()
        self.round_start = flat.model_flat.clone() if adaptive else None

    def shard_of(self, full: torch.Tensor) -> torch.Tensor:
        return full[self.shard_offset:self.shard_offset + self.shard_numel]


@dataclass
class OuterResult:
    skipped: bool
    """True if the mean parameters were non-finite: the anchor did not move."""
    penalty: float
    anchor_move: float
    """||x_{k+1} - x_k||, the distance the anchor moved during round k."""
    max_displacement: float
    """max_i ||y^i_k - x_k||, the largest inner displacement of round k (adaptive penalty only)."""
    timings_s: Dict[str, float] = field(default_factory=dict)


@dataclass
class CO2OuterJob:
    """Job J_k: reduce-scatter y_k, outer update on the shard, all-gather x_{k+2}."""

    states: List[OuterState]
    communicator: Communicator
    outer_lr: float
    outer_momentum: float
    gap_penalty: Union[float, str]
    clip_threshold: Optional[float]
    local_displacement_sq: Optional[torch.Tensor]
    """||y^i_k - x_k||^2 of this rank's replica (a 0-dim tensor computed at the boundary without a
    host sync), or None for a constant penalty."""

    def __call__(self) -> OuterResult:
        timings = {}
        start = time.perf_counter()
        for state in self.states:
            self.communicator.reduce_scatter(state.mean, state.local_params)
        timings["reduce_scatter"] = time.perf_counter() - start

        start = time.perf_counter()
        world_size, rank = self.communicator.world_size, self.communicator.rank
        # [displacement of each rank (one-hot), squared anchor move, non-finite count], summed.
        statistics = torch.zeros(world_size + 2, dtype=torch.float64, device=self.states[0].anchor.device)
        if self.local_displacement_sq is not None:
            statistics[rank] = self.local_displacement_sq.double().sqrt()
        anchor_move_sq = sum(float(torch.linalg.vector_norm(s.anchor - s.prev_anchor))**2 for s in self.states)
        nonfinite = sum(float((~torch.isfinite(s.mean)).sum()) for s in self.states)
        statistics[world_size] = anchor_move_sq
        statistics[world_size + 1] = nonfinite
        self.communicator.all_reduce(statistics)
        values = statistics.tolist()
        max_displacement = max(values[:world_size])
        anchor_move = math.sqrt(values[world_size])
        skipped = values[world_size + 1] > 0
        if self.gap_penalty == ADAPTIVE:
            penalty = 1.0 + anchor_move / (max_displacement + DISPLACEMENT_EPSILON)
        else:
            penalty = float(self.gap_penalty)
        timings["statistics"] = time.perf_counter() - start

        start = time.perf_counter()
        for state in self.states:
            out = state.shard_of(state.gather)
            if skipped:
                state.prev_anchor.copy_(state.anchor)  # x_{k+2} = x_{k+1}: the anchor stays
                out.copy_(state.anchor)
                continue
            mean = state.mean if state.mean.dtype == torch.float32 else state.mean.float()
            mean.div_(world_size)
            kernel_out = out if out.dtype in _KERNEL_OUT_DTYPES else torch.empty_like(state.anchor)
            ops.co2_outer_step(state.prev_anchor, state.anchor, state.momentum, mean, outer_lr=self.outer_lr,
                               outer_momentum=self.outer_momentum, penalty=penalty,
                               clip_threshold=self.clip_threshold, out=kernel_out)
            if kernel_out is not out:
                out.copy_(kernel_out)
        timings["update"] = time.perf_counter() - start

        start = time.perf_counter()
        for state in self.states:
            self.communicator.all_gather(state.gather, state.shard_of(state.gather))
        timings["all_gather"] = time.perf_counter() - start
        return OuterResult(skipped=skipped, penalty=penalty, anchor_move=anchor_move,
                           max_displacement=max_displacement, timings_s=timings)


class CO2Schedule(Schedule):
    """Inner AdamW steps on the training thread; the outer averaging job overlapped with a round."""

    initial_phase = Phase.LOCAL

    def __init__(self, flats: List[FlatParamGroup], shards: List[ShardState], communicator: Communicator,
                 pipeline: Pipeline, settings: ScheduleSettings, *, outer_communicator: Communicator, local_steps: int,
                 outer_lr: float, outer_momentum: float, gap_penalty: Union[float, str],
                 clip_threshold: Optional[float], communication_dtype: torch.dtype, **callbacks):
        super().__init__(flats, shards, communicator, pipeline, settings, **callbacks)
        self.outer_communicator = outer_communicator
        self.local_steps = local_steps
        self.outer_lr = outer_lr
        self.outer_momentum = outer_momentum
        self.gap_penalty = gap_penalty
        self.clip_threshold = clip_threshold
        self._communication_dtype = communication_dtype
        self.outers = self._fresh_outer_states()
        self.inner_steps_in_round = 0
        self.outer_rounds = 0
        """Outer boundaries passed (k after boundary k - 1)."""
        self.outer_skips = 0
        self.last_outer: Optional[OuterResult] = None

    def _fresh_outer_states(self) -> List[OuterState]:
        return [OuterState(flat, self.outer_communicator.world_size, self.outer_communicator.rank,
                           self._communication_dtype, adaptive=self.gap_penalty == ADAPTIVE) for flat in self.flats]

    def reset(self) -> None:
        """Start CO2 afresh from the weights the model holds: x_0 = x_1 = them, m = 0."""
        super().reset()
        self.outers = self._fresh_outer_states()
        self.inner_steps_in_round = 0
        self.outer_rounds = 0

    def boundary(self) -> None:
        self._inner_step()
        self.inner_steps_in_round += 1
        if self.inner_steps_in_round == self.local_steps:
            self._outer_boundary()
            self.inner_steps_in_round = 0

    def _inner_step(self) -> None:
        """One AdamW step of this replica (ZeRO-1 within the group), synchronous on this thread."""
        job = self._make_job(JobKind.COMMIT)
        with torch.no_grad():
            result = job()
        self._on_commit(result)

    def _outer_boundary(self) -> None:
        outer = self._wait_running()
        if outer is not None:
            self.last_outer = outer
            self.outer_skips += int(outer.skipped)
        displacement_sq = None
        with torch.no_grad():
            for flat, state, shard in zip(self.flats, self.outers, self.shards):
                if state.round_start is not None:
                    difference = flat.unpadded(flat.model_flat).float() - flat.unpadded(state.round_start).float()
                    part = torch.linalg.vector_norm(difference).square()
                    displacement_sq = part if displacement_sq is None else displacement_sq + part
                state.local_params.copy_(flat.model_flat)  # y_k, handed to J_k
                flat.install(state.gather)  # x_{k+1}
                shard.master.copy_(flat.shard_of(flat.model_flat))  # the inner master restarts there too
                if state.round_start is not None:
                    state.round_start.copy_(state.gather)
        job = CO2OuterJob(states=self.outers, communicator=self.outer_communicator, outer_lr=self.outer_lr,
                          outer_momentum=self.outer_momentum, gap_penalty=self.gap_penalty,
                          clip_threshold=self.clip_threshold, local_displacement_sq=displacement_sq)
        work = self.pipeline.submit(job, label=f"CO2 outer averaging of round {self.outer_rounds}")
        if not self.settings.overlap:
            self._timed_wait(work)
        self.running = work
        self.running_kind = None
        self.outer_rounds += 1

    @contextlib.contextmanager
    def committed_parameters(self):
        """The newest anchor (x_{k+2} once J_k finished, else x_{k+1}), temporarily."""
        self.drain()
        saved = [flat.model_flat.clone() for flat in self.flats]
        try:
            for flat, state in zip(self.flats, self.outers):
                flat.install(state.gather)
            yield
        finally:
            for flat, values in zip(self.flats, saved):
                flat.model_flat.copy_(values)
