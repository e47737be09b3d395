"""The shard-update communication job: reduce-scatter -> shard update -> all-gather (docs/design.md, 3).

One job updates every flat group. It runs on the communication lane (a CPU worker thread, or
enqueued on a side stream by the training thread on CUDA) and touches only buffers that the
schedule has handed over for its duration: ``FlatParamGroup.job_grad`` (input), the rank's
:class:`ShardState` and the gather target.

Inside the job, on the reduced shard: undo the loss scale the round's backward used (and, for an
fp16 reduction, the pre-division that keeps fp16 sums in range), average by
the global number of contributing micro-batches, clip by the global norm, and skip the update on
every rank if any gradient is non-finite; one small all-reduce carries the squared norm and the
micro-batch count. All of this stays on the device (:func:`update_decision`): the clip factor and
the skip flag reach the fused kernels as a control tensor, and the job's statistics come back to
the host as a :class:`~deepspeed_acco.runtime.comm.DeviceReadback`, read at the boundary's wait.

The update itself is an :class:`UpdateRule` (AdamW for our four types): ``commit`` changes the
master weights and the rule's state, ``estimate`` (ACCO's Peek) only writes the parameters a
commit would give.

With compressed communication (docs/wire.md, "Compressed communication") the reduce-scatter is the quantised one with
error feedback, and the rule writes the new shard into an fp32 buffer from which the all-gather
sends the quantised delta against the model's parameters, which every rank holds identically.
"""
import enum
import math
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

from .. import ops
from .comm import Communicator, DeviceReadback, PhaseClock
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

    def commit(self, master, grad, state: Dict[str, torch.Tensor], *, step: int, out, control, **hyper) -> None:
        """Update ``master`` and ``state`` from ``grad * control[CONTROL_VALUE]``; write the new parameters to ``out``.

        ``control`` (:func:`deepspeed_acco.ops.make_control`) lives on the device; when its skip flag
        is set nothing changes and ``out`` receives ``master``.
        """
        raise NotImplementedError

    def estimate(self, master, grad, state: Dict[str, torch.Tensor], *, step: int, out, control, **hyper) -> None:
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

    def commit(self, master, grad, state, *, step, out, control, **hyper) -> None:
        ops.adamw_step(master, grad, state["exp_avg"], state["exp_avg_sq"], step=step, out=out, control=control,
                       **hyper)

    def estimate(self, master, grad, state, *, step, out, control, **hyper) -> None:
        ops.adamw_peek(master, grad, state["exp_avg"], state["exp_avg_sq"], step=step, out=out, control=control,
                       **hyper)


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
    """Global L2 norm of the averaged gradient before clipping (nan when skipped)."""
    timings_s: Dict[str, float] = field(default_factory=dict)


def correctly_rounded_sqrt(value: torch.Tensor) -> torch.Tensor:
    """The square root of a 0-dim float64 tensor, correctly rounded, on the tensor's device.

    torch's float64 sqrt on the CPU is a vectorised approximation that is off by one ulp now and
    then; the host's ``math.sqrt`` is exact, and reading a CPU tensor is no synchronisation. CUDA's
    float64 sqrt is IEEE-exact. So CPU results stay bitwise those of the host arithmetic.
    """
    if value.device.type == "cpu":
        return torch.tensor(math.sqrt(value.item()), dtype=torch.float64)
    return torch.sqrt(value)


def update_decision(statistics: torch.Tensor, *, carried_micro_batches: int,
                    gradient_clipping: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """What an update does, decided on the statistics' device (no host synchronisation).

    ``statistics`` = [sum over ranks and groups of ||grad sum||^2, micro-batches of the round over
    ranks] (float64, all-reduced). Returns ``(control, summary)``: the kernels' control tensor
    [gradient multiplier 1 / micro-batches (times the clip factor), skip flag] and the float64
    summary [skipped, grad_norm, global micro-batches] the result is read from.

    The arithmetic is float64, operation for operation what the host computed before (so the fp32
    multiplier is bitwise the same): norm = sqrt(sumsq) / micro-batches, nan if either is
    non-finite or there are no micro-batches; multiplier = 1 / micro-batches, times
    clipping / (norm + 1e-6) when the norm exceeds ``gradient_clipping`` > 0.
    """
    global_sumsq, round_micro_batches = statistics[0], statistics[1]
    micro_batches = torch.round(round_micro_batches) + float(carried_micro_batches)
    defined = torch.isfinite(global_sumsq) & (micro_batches > 0)
    root = correctly_rounded_sqrt(torch.where(defined, global_sumsq, 0.0))
    grad_norm = torch.where(defined, root / micro_batches, float("nan"))
    skip = ~torch.isfinite(grad_norm)
    multiplier = micro_batches.reciprocal()
    if gradient_clipping > 0.0:
        clip = torch.div(torch.full_like(grad_norm, gradient_clipping), grad_norm + CLIP_EPSILON)
        multiplier = torch.where(grad_norm > gradient_clipping, multiplier * clip, multiplier)
    summary = torch.stack([skip.to(torch.float64), grad_norm, micro_batches])
    return ops.make_control(multiplier, skip), summary


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
    predivisor: float = 1.0
    """What the round's gradient sums were divided by when cast to the communication dtype (fp16: the
    round's micro-batches times the ranks, so that fp16 carries means as DeepSpeed's reduction does);
    multiplied back after the reduce-scatter, in fp32."""
    gradient_clipping: float = 0.0
    keep_reduced: Optional[List[torch.Tensor]] = None
    """Per group, a shard buffer that receives the reduced, unscaled gradient sum (ACCO's first half)."""
    carried: Optional[List[torch.Tensor]] = None
    """Per group, gradient sums of earlier micro-batches added before averaging (ACCO's commit)."""
    carried_micro_batches: int = 0
    """Global micro-batch count of ``carried``."""
    compression: Optional[List[GroupCompression]] = None
    """Per group, the compressed collectives that replace the reduce-scatter and/or the all-gather
    (docs/wire.md, "Compressed communication"); None: both uncompressed."""

    def __call__(self) -> DeviceReadback:
        device = self.states[0].master.device
        clock = PhaseClock(device)
        cpu_start = time.thread_time()
        with clock.phase("reduce_scatter"):
            for index, (flat, state) in enumerate(zip(self.flats, self.states)):
                self._reduce_scatter(index, state.reduced, flat.job_grad)

        with clock.phase("norm"):
            squares = []
            unscale = 1.0 / self.loss_scale if self.predivisor == 1.0 else self.predivisor / self.loss_scale
            for index, state in enumerate(self.states):
                torch.mul(state.reduced, unscale, out=state.grad)
                if self.keep_reduced is not None:
                    self.keep_reduced[index].copy_(state.grad)
                if self.carried is not None:
                    state.grad.add_(self.carried[index])
                squares.append(torch.linalg.vector_norm(state.grad).double().square())
            local_micro_batches = torch.full((), float(self.local_micro_batches), dtype=torch.float64, device=device)
            statistics = torch.stack([torch.stack(squares).sum(), local_micro_batches])
        with clock.phase("all_reduce"):
            self.communicator.all_reduce(statistics)

        with clock.phase("update"):
            control, summary = update_decision(statistics, carried_micro_batches=self.carried_micro_batches,
                                               gradient_clipping=self.gradient_clipping)
            # A skipped update (decided on every rank alike, from all-reduced statistics) gathers the
            # master weights, which matters for ACCO, whose model may hold an estimate at this point.
            update = self.rule.commit if self.kind is JobKind.COMMIT else self.rule.estimate
            for index, (flat, state, hyper) in enumerate(zip(self.flats, self.states, self.hyperparameters)):
                update(state.master, state.grad, state.state, step=self.step, out=self._update_output(index, flat),
                       control=control, **hyper)

        with clock.phase("all_gather"):
            for index, flat in enumerate(self.flats):
                self._all_gather(index, flat)
        if not clock.cuda:
            # CPU time of this thread: on a CPU cluster it is taken from the model's compute.
            clock.record("worker_cpu", time.thread_time() - cpu_start)
        return DeviceReadback(summary, self._result, clock)

    def _result(self, summary: List[float], timings_s: Dict[str, float]) -> JobResult:
        skipped, grad_norm, micro_batches = summary
        return JobResult(kind=self.kind, skipped=bool(skipped), local_micro_batches=self.local_micro_batches,
                         global_micro_batches=int(round(micro_batches)), grad_norm=grad_norm, timings_s=timings_s)

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
