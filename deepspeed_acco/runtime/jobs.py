"""The AdamW communication job: reduce-scatter -> shard update -> all-gather (DESIGN 3).

One job updates every flat group. It runs on the communication worker, never on the training
thread, and touches only buffers that the schedule has handed over for its duration:
``FlatParamGroup.job_grad`` (input), the rank's :class:`ShardState` and the gather target.

Inside the job, on the reduced shard: undo the loss scale, average by the global number of
contributing micro-batches, clip by the global norm, and skip the update on every rank if any
gradient is non-finite; one small all-reduce carries the squared norm and the micro-batch count.
"""
import enum
import math
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

from .. import ops
from .comm import Communicator
from .flat import FlatParamGroup

# torch.nn.utils.clip_grad_norm_ and DeepSpeed add this to the norm before dividing.
CLIP_EPSILON = 1e-6
_KERNEL_OUT_DTYPES = (torch.float32, torch.bfloat16)


class JobKind(enum.Enum):
    COMMIT = "commit"
    """A real AdamW step: master weights, moments and the step count change."""
    ESTIMATE = "estimate"
    """ACCO's Peek: the parameters an AdamW step would give; optimizer state is left untouched."""


class ShardState:
    """Rank r's shard of one flat group: fp32 master weights and AdamW moments, plus job buffers."""

    def __init__(self, flat: FlatParamGroup, communication_dtype: torch.dtype):
        shard = flat.shard_numel
        device = flat.device
        self.master = flat.shard_of(flat.model_flat).to(torch.float32, copy=True)
        self.exp_avg = torch.zeros(shard, dtype=torch.float32, device=device)
        self.exp_avg_sq = torch.zeros(shard, dtype=torch.float32, device=device)
        self.reduced = torch.zeros(shard, dtype=communication_dtype, device=device)
        self.grad = torch.zeros(shard, dtype=torch.float32, device=device)
        # ACCO: the reduced (loss-unscaled) first-half gradient sum, kept from the estimate job
        # for the commit job of the same update. O(params / W), and part of checkpoints.
        self.first_half_sum: Optional[torch.Tensor] = None

    def ensure_first_half_buffer(self) -> torch.Tensor:
        if self.first_half_sum is None:
            self.first_half_sum = torch.zeros_like(self.grad)
        return self.first_half_sum


@dataclass
class JobResult:
    kind: JobKind
    skipped: bool
    """True when a gradient was non-finite: nothing changed, the gather holds the master weights."""
    local_micro_batches: int
    """Micro-batches this rank contributed in the round the job reduced."""
    global_micro_batches: int
    """Micro-batches, over all ranks, whose gradients this update averaged (ACCO commit: both halves)."""
    grad_norm: float
    """Global L2 norm of the averaged gradient before clipping (nan/inf when skipped)."""
    timings_s: Dict[str, float] = field(default_factory=dict)


@dataclass
class AdamWJob:
    """One communication job of the AdamW family, with everything captured at launch."""

    kind: JobKind
    flats: List[FlatParamGroup]
    states: List[ShardState]
    communicator: Communicator
    step: int
    """1-based AdamW step count of the update this job computes (bias correction)."""
    hyperparameters: List[Dict[str, float]]
    """Per group: lr, beta1, beta2, eps, weight_decay, read from the param groups at launch."""
    local_micro_batches: int
    loss_scale: float = 1.0
    gradient_clipping: float = 0.0
    keep_first_half: bool = False
    """ESTIMATE in ACCO: keep the reduced gradient sum for the commit job."""
    first_half_micro_batches: int = 0
    """COMMIT in ACCO: add the kept first-half sum and its global micro-batch count."""

    def __call__(self) -> JobResult:
        timings = {}
        cpu_start = time.thread_time()
        start = time.perf_counter()
        for flat, state in zip(self.flats, self.states):
            self.communicator.reduce_scatter(state.reduced, flat.job_grad)
        timings["reduce_scatter"] = time.perf_counter() - start

        start = time.perf_counter()
        grad_sumsq = 0.0
        for state in self.states:
            torch.mul(state.reduced, 1.0 / self.loss_scale, out=state.grad)
            if self.keep_first_half:
                state.ensure_first_half_buffer().copy_(state.grad)
            if self.first_half_micro_batches:
                state.grad.add_(state.first_half_sum)
            grad_sumsq += float(torch.linalg.vector_norm(state.grad))**2
        statistics = torch.tensor([grad_sumsq, float(self.local_micro_batches)], dtype=torch.float64,
                                  device=self.states[0].grad.device)
        timings["norm"] = time.perf_counter() - start
        start = time.perf_counter()
        self.communicator.all_reduce(statistics)
        timings["all_reduce"] = time.perf_counter() - start
        global_sumsq, round_micro_batches = statistics.tolist()
        micro_batches = int(round(round_micro_batches)) + self.first_half_micro_batches
        grad_norm = math.sqrt(global_sumsq) / micro_batches if math.isfinite(global_sumsq) else float("nan")
        skipped = not math.isfinite(grad_norm)

        start = time.perf_counter()
        if not skipped:
            scale = 1.0 / micro_batches
            if self.gradient_clipping > 0.0 and grad_norm > self.gradient_clipping:
                scale *= self.gradient_clipping / (grad_norm + CLIP_EPSILON)
            for flat, state, hyper in zip(self.flats, self.states, self.hyperparameters):
                state.grad.mul_(scale)
                out = flat.shard_of(flat.gather_target())
                # The kernels write fp32/bf16 straight into the gather buffer; fp16 goes via fp32.
                kernel_out = out if out.dtype in _KERNEL_OUT_DTYPES else torch.empty_like(state.master)
                update = ops.adamw_step if self.kind is JobKind.COMMIT else ops.adamw_peek
                update(state.master, state.grad, state.exp_avg, state.exp_avg_sq, step=self.step, out=kernel_out,
                       **hyper)
                if kernel_out is not out:
                    out.copy_(kernel_out)
        else:
            # Every rank skips (the statistics were all-reduced); the gather restores the master
            # weights, which matters for ACCO whose model may hold an estimate at this point.
            for flat, state in zip(self.flats, self.states):
                flat.shard_of(flat.gather_target()).copy_(state.master)
        timings["update"] = time.perf_counter() - start

        start = time.perf_counter()
        for flat in self.flats:
            target = flat.gather_target()
            self.communicator.all_gather(target, flat.shard_of(target))
        timings["all_gather"] = time.perf_counter() - start
        # CPU time of this thread: on a CPU cluster it is taken from the model's compute.
        timings["worker_cpu"] = time.thread_time() - cpu_start
        return JobResult(kind=self.kind, skipped=skipped, local_micro_batches=self.local_micro_batches,
                         global_micro_batches=micro_batches, grad_norm=grad_norm, timings_s=timings)


def hyperparameters_of(param_group: Dict) -> Dict[str, float]:
    """The AdamW hyperparameters of a param group, as the update functions take them."""
    beta1, beta2 = param_group["betas"]
    return dict(lr=float(param_group["lr"]), beta1=float(beta1), beta2=float(beta2), eps=float(param_group["eps"]),
                weight_decay=float(param_group["weight_decay"]))
