"""The shard-update communication job: reduce-scatter -> shard update -> all-gather (docs/design.md, 3).

One job updates every flat group. It runs on the communication lane, never on the training
thread, and touches only buffers that the schedule has handed over for its duration:
``FlatParamGroup.job_grad`` (input), the rank's :class:`ShardState` and the gather target.

Inside the job, on the reduced shard: undo the loss scale the round's backward used, average by
the global number of contributing micro-batches, clip by the global norm, and skip the update on
every rank if any gradient is non-finite; one small all-reduce carries the squared norm and the
micro-batch count.

The update itself is an :class:`UpdateRule` (AdamW for our four types): ``commit`` changes the
master weights and the rule's state, ``estimate`` (ACCO's Peek) only writes the parameters a
commit would give.

With compressed communication (docs/design.md, 3.7) the reduce-scatter is the quantised one with
error feedback, and the rule writes the new shard into an fp32 buffer from which the all-gather
sends the quantised delta against the model's parameters, which every rank holds identically.
"""
import enum
import math
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

from .. import ops
from .comm import Communicator
from .compression import GroupCompression, compressing
from .flat import FlatParamGroup

# torch.nn.utils.clip_grad_norm_ and DeepSpeed add this to the norm before dividing.
CLIP_EPSILON = 1e-6


class JobKind(enum.Enum):
    COMMIT = "commit"
    """A real update: master weights, the rule's state and the step count change."""
    ESTIMATE = "estimate"
    """The parameters a commit would give (ACCO's Peek); nothing else changes."""


class UpdateRule:
    """An optimizer's update on flat fp32 shards; subclasses name their per-element state."""

    state_names: tuple = ()
    """Names of the rule's per-element fp32 state tensors (DeepSpeed checkpoint keys)."""

    def defaults(self, params) -> Dict:
        """Param-group defaults from the type's params dataclass (the ``torch.optim`` convention)."""
        raise NotImplementedError

    def hyperparameters(self, param_group: Dict) -> Dict[str, float]:
        """What ``commit``/``estimate`` take from a param group, read at launch (schedulers change lr)."""
        raise NotImplementedError

    def commit(self, master, grad, state: Dict[str, torch.Tensor], *, step: int, out, **hyper) -> None:
        raise NotImplementedError

    def estimate(self, master, grad, state: Dict[str, torch.Tensor], *, step: int, out, **hyper) -> None:
        raise ValueError(f"{type(self).__name__} has no read-only estimate")


class AdamWRule(UpdateRule):
    """``torch.optim.AdamW`` on a shard through the fused kernels; Peek as the estimate."""

    state_names = ("exp_avg", "exp_avg_sq")

    def defaults(self, params) -> Dict:
        return dict(lr=params.lr, betas=tuple(params.betas), eps=params.eps, weight_decay=params.weight_decay)

    def hyperparameters(self, param_group: Dict) -> Dict[str, float]:
        beta1, beta2 = param_group["betas"]
        return dict(lr=float(param_group["lr"]), beta1=float(beta1), beta2=float(beta2),
                    eps=float(param_group["eps"]), weight_decay=float(param_group["weight_decay"]))

    def commit(self, master, grad, state, *, step, out, **hyper) -> None:
        ops.adamw_step(master, grad, state["exp_avg"], state["exp_avg_sq"], step=step, out=out, **hyper)

    def estimate(self, master, grad, state, *, step, out, **hyper) -> None:
        ops.adamw_peek(master, grad, state["exp_avg"], state["exp_avg_sq"], step=step, out=out, **hyper)


ADAMW = AdamWRule()


class ShardState:
    """Rank r's shard of one flat group: fp32 master weights and the rule's state, plus job buffers."""

    def __init__(self, flat: FlatParamGroup, communication_dtype: torch.dtype, rule: UpdateRule):
        shard = flat.shard_numel
        device = flat.device
        self.master = flat.shard_of(flat.model_flat).to(torch.float32, copy=True)
        self.state: Dict[str, torch.Tensor] = {name: torch.zeros(shard, dtype=torch.float32, device=device)
                                               for name in rule.state_names}
        self.reduced = torch.zeros(shard, dtype=communication_dtype, device=device)
        self.grad = torch.zeros(shard, dtype=torch.float32, device=device)


@dataclass
class JobResult:
    kind: JobKind
    skipped: bool
    """True when a gradient was non-finite: nothing changed, the gather holds the master weights."""
    local_micro_batches: int
    """Micro-batches this rank contributed in the round the job reduced."""
    global_micro_batches: int
    """Micro-batches, over all ranks, whose gradients this update averaged (with carried ones)."""
    grad_norm: float
    """Global L2 norm of the averaged gradient before clipping (nan/inf when skipped)."""
    timings_s: Dict[str, float] = field(default_factory=dict)


@dataclass
class ShardUpdateJob:
    """One communication job of a shard-update rule, with everything captured at launch."""

    kind: JobKind
    flats: List[FlatParamGroup]
    states: List[ShardState]
    communicator: Communicator
    rule: UpdateRule
    step: int
    """1-based step count of the update this job computes (bias correction)."""
    hyperparameters: List[Dict[str, float]]
    """Per group, read from the param groups at launch."""
    local_micro_batches: int
    loss_scale: float = 1.0
    """The loss scale the reduced round's backward passes used."""
    gradient_clipping: float = 0.0
    keep_reduced: Optional[List[torch.Tensor]] = None
    """Per group, a shard buffer that receives the reduced, unscaled gradient sum (ACCO's first half)."""
    carried: Optional[List[torch.Tensor]] = None
    """Per group, gradient sums of earlier micro-batches added before averaging (ACCO's commit)."""
    carried_micro_batches: int = 0
    """Global micro-batch count of ``carried``."""
    compression: Optional[List[GroupCompression]] = None
    """Per group, the compressed collectives that replace the reduce-scatter and/or the all-gather
    (docs/design.md, 3.7); None: both uncompressed."""

    def __call__(self) -> JobResult:
        timings = {}
        cpu_start = time.thread_time()
        start = time.perf_counter()
        for index, (flat, state) in enumerate(zip(self.flats, self.states)):
            self._reduce_scatter(index, state.reduced, flat.job_grad)
        timings["reduce_scatter"] = time.perf_counter() - start

        start = time.perf_counter()
        squares = []
        for index, state in enumerate(self.states):
            torch.mul(state.reduced, 1.0 / self.loss_scale, out=state.grad)
            if self.keep_reduced is not None:
                self.keep_reduced[index].copy_(state.grad)
            if self.carried is not None:
                state.grad.add_(self.carried[index])
            squares.append(torch.linalg.vector_norm(state.grad).double().square())
        statistics = torch.stack([torch.stack(squares).sum(),
                                  torch.tensor(float(self.local_micro_batches), dtype=torch.float64,
                                               device=squares[0].device)])
        timings["norm"] = time.perf_counter() - start
        start = time.perf_counter()
        self.communicator.all_reduce(statistics)
        timings["all_reduce"] = time.perf_counter() - start
        global_sumsq, round_micro_batches = statistics.tolist()  # the job's one host read
        micro_batches = int(round(round_micro_batches)) + self.carried_micro_batches
        grad_norm = math.sqrt(global_sumsq) / micro_batches if math.isfinite(global_sumsq) and micro_batches \
            else float("nan")
        skipped = not math.isfinite(grad_norm)

        start = time.perf_counter()
        update = self.rule.commit if self.kind is JobKind.COMMIT else self.rule.estimate
        for index, (flat, state, hyper) in enumerate(zip(self.flats, self.states, self.hyperparameters)):
            out = self._update_output(index, flat)
            if skipped:
                # Every rank skips (the statistics were all-reduced); the gather restores the master
                # weights, which matters for ACCO whose model may hold an estimate at this point.
                out.copy_(state.master)
                continue
            scale = 1.0 / micro_batches
            if self.gradient_clipping > 0.0 and grad_norm > self.gradient_clipping:
                scale *= self.gradient_clipping / (grad_norm + CLIP_EPSILON)
            state.grad.mul_(scale)
            update(state.master, state.grad, state.state, step=self.step, out=out, **hyper)
        timings["update"] = time.perf_counter() - start

        start = time.perf_counter()
        for index, flat in enumerate(self.flats):
            self._all_gather(index, flat)
        timings["all_gather"] = time.perf_counter() - start
        # CPU time of this thread: on a CPU cluster it is taken from the model's compute.
        timings["worker_cpu"] = time.thread_time() - cpu_start
        return JobResult(kind=self.kind, skipped=skipped, local_micro_batches=self.local_micro_batches,
                         global_micro_batches=micro_batches, grad_norm=grad_norm, timings_s=timings)

    # ---- the collectives, compressed or not --------------------------------------------------
    def _reduce_scatter(self, index: int, output: torch.Tensor, input: torch.Tensor) -> None:
        compression = compressing(self.compression, index, "gradients")
        if compression is None:
            self.communicator.reduce_scatter(output, input)
        else:  # the residual follows the round's loss scale (fp16)
            compression.reduce_scatter(output, input, loss_scale=self.loss_scale)

    def _update_output(self, index: int, flat: FlatParamGroup) -> torch.Tensor:
        """Where the rule writes this rank's new parameters: its shard of the gather target, or, when
        weights are compressed, an fp32 buffer from which the delta against what the ranks hold is sent."""
        compression = compressing(self.compression, index, "weights")
        return flat.shard_of(flat.gather_target()) if compression is None else compression.new_shard

    def _all_gather(self, index: int, flat: FlatParamGroup) -> None:
        target = flat.gather_target()
        compression = compressing(self.compression, index, "weights")
        if compression is None:
            self.communicator.all_gather(target, flat.shard_of(target))
        else:
            # The model's parameters are what every rank holds, and they stay unchanged while the job
            # runs (installs happen after a wait); for ACCO's commit they are the estimate, so the
            # delta is the small correction theta_{t+1} - theta~_{t+1}.
            compression.all_gather(target, held=flat.model_flat)
