"""``warmup_sync_updates: "auto"``: how many updates start synchronous (docs/design.md, 3.6).

The rule, applied once when the engine is built, from the LR scheduler the engine steps (one
scheduler step per committed update):

1. the scheduler knows the run's length T (its updates): N = T // 6, a sixth of the run;
2. it knows only its LR warm-up W (updates): N = 4 * W, a sixth of a run whose warm-up is a
   24th of it;
3. it knows neither (no scheduler, one whose shape says nothing, or a warm-up of at most
   DeepSpeed's floor of 2 updates): N = 0.

Evidence (docs/studies/acco_convergence.md, "What the gap is made of" and "Within 1% of ZeRO-1?"):
a synchronous sixth kept ACCO within 1% of ZeRO-1 at 300 and 720 updates (120 of 720, four
seeds) and at 240 updates (40 of 240, one seed); without it ACCO ended +6.5% at 720. A third
(240 of 720, four seeds) and two thirds (480, one seed) ended no closer to ZeRO-1 than a sixth,
and synchronous updates from ACCO's state at 240 or 480 did not recover what it had lost. So too
short a warm-up costs loss that is not won back, and too long a one costs only speed: its
updates are ShardedAdamW's, never slower than DeepSpeed's ZeRO-1. Rule 2 therefore errs long.
Without the run's length, the warm-up's share of the run is the only hint: 1.4% and 4.2% in the
bench's 720- and 240-update runs (a sixth is 12 W and 4 W), often 3% to 10% under the HF
Trainer's ``warmup_ratio`` (a sixth is 5.6 W to 1.7 W), 16% in DeepSpeedExamples' CIFAR script
on one GPU (1,000 of 6,250 updates: a sixth is 1.04 W). 4 W is a sixth at the measured 4.2% share
and more than a sixth for any larger share, so it falls short only for runs whose warm-up is
under a 24th of them; the start-up line states the run length it assumes, and an integer is the
way to set N for another. What a warm-up shorter than a sixth does to the loss has not been
measured.

Per scheduler (docs/usage.md states the same):
- DeepSpeed's ``WarmupDecayLR`` and ``WarmupCosineLR``: rule 1 with ``total_num_steps``.
- DeepSpeed's ``OneCycle``: rule 1 with its cycle, ``cycle_first_step_size`` +
  ``cycle_second_step_size`` (the 1cycle policy spans the run with one cycle; what follows it is
  a short decay).
- DeepSpeed's ``WarmupLR``: rule 2 with ``warmup_num_steps``; rule 3 where that is at most 2,
  DeepSpeed's floor (it raises 1 to 2, and transformers writes 1 for "no warm-up").
- DeepSpeed's ``LRRangeTest``: rule 3 (a learning-rate search, not a training run).

What the engine reads:
- DeepSpeed's ``WarmupDecayLR`` and ``WarmupCosineLR``: ``total_num_steps`` (T) and
  ``warmup_num_steps`` (W); ``WarmupLR``: ``warmup_num_steps`` only (it stays at its peak);
  ``OneCycle``: its cycle (T) and first step (W).
- torch's ``OneCycleLR`` (``total_steps``), ``CosineAnnealingLR`` (``T_max``), ``PolynomialLR``
  (``total_iters``): T.
- torch's ``LambdaLR`` (the Hugging Face Trainer's schedules): its first param group's lambda is
  evaluated at future steps, without stepping the scheduler. W is the first step after which the
  lambda stops rising; T is the first step after W at which it stops falling (it reaches 0, or a
  floor it keeps, or turns up again as a cosine does past its horizon). Both are found by
  doubling and bisection (a few hundred evaluations). A lambda that does not fall after its
  warm-up (a constant schedule) gives W only. The search assumes the shape of every warm-up and
  decay schedule: rising (or flat) to a peak, then falling. A warm-up-stable-decay schedule reads as
  "stops falling" where its stable stretch begins (rule 2), a cosine with hard restarts gives its
  first cycle as T: an integer is the way to set N for those.
Nothing is read from the scheduler's state, so a resumed engine resolves the same N. Checkpoints
record the N they were written under; a resumed run whose N differs (another total_num_steps, a
checkpoint from before "auto") continues as :func:`warmup_after_resume` says.
"""
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch

RUN_FRACTION = 6
"""N = the run's updates // RUN_FRACTION when the scheduler knows the run's length."""
LR_WARMUP_MULTIPLE = 4
"""N = LR_WARMUP_MULTIPLE x the LR warm-up when only the warm-up is known."""
DEEPSPEED_WARMUP_FLOOR = 2
"""DeepSpeed's WarmupLR, WarmupDecayLR and WarmupCosineLR raise a smaller warmup_num_steps to this."""
_SEARCH_LIMIT = 2**40
"""Steps beyond which a LambdaLR probe gives up (the shape is then unknown)."""


@dataclass(frozen=True)
class ScheduleShape:
    """What the engine can know of a run from its LR scheduler."""

    total_updates: Optional[int]
    """T: the updates of the whole schedule (None: not known)."""
    warmup_updates: Optional[int]
    """W: the updates of the LR warm-up (None or 0: none known)."""
    source: str
    """Where it was read, for the log ("WarmupDecayLR total_num_steps", ...)."""


@dataclass(frozen=True)
class AutoWarmup:
    updates: int
    """N, the resolved number of synchronous updates."""
    reason: str
    """Why, in words, for the start-up log line."""


def _positive_int(value) -> Optional[int]:
    try:
        number = int(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return number if number > 0 else None


def _first_true(predicate: Callable[[int], bool], start: int, limit: int = _SEARCH_LIMIT) -> Optional[int]:
    """The first step s >= start where ``predicate`` holds, assuming it is false before and true at that
    step: doubling from ``start``, then bisection. None if it never holds up to ``limit``."""
    if predicate(start):
        return start
    low, offset = start, 1
    while not predicate(start + offset):
        low = start + offset
        offset *= 2
        if start + offset > limit:
            return None
    high = start + offset
    while high - low > 1:
        middle = (low + high) // 2
        if predicate(middle):
            high = middle
        else:
            low = middle
    return high


def lambda_shape(function: Callable[[int], float]) -> Tuple[Optional[int], Optional[int]]:
    """(T, W) of a LambdaLR lambda (see the module docstring); None where not known."""
    def value(step: int) -> float:
        return float(function(step))

    warmup = _first_true(lambda s: value(s + 1) <= value(s), 0)
    if warmup is None:
        return None, None
    horizon = _first_true(lambda s: value(s + 1) >= value(s), warmup)
    if horizon is None or not value(horizon) < value(warmup):
        return None, warmup  # it does not fall after the warm-up: the run's length is not in it
    return horizon, warmup


def schedule_shape(lr_scheduler) -> ScheduleShape:
    """What ``lr_scheduler`` (the engine's, or None) says about the run's length and LR warm-up."""
    if lr_scheduler is None:
        return ScheduleShape(None, None, "no LR scheduler")
    name = type(lr_scheduler).__name__
    schedulers = torch.optim.lr_scheduler
    if name in ("WarmupDecayLR", "WarmupCosineLR") and hasattr(lr_scheduler, "total_num_steps"):
        return ScheduleShape(_positive_int(lr_scheduler.total_num_steps),
                             _positive_int(getattr(lr_scheduler, "warmup_num_steps", None)),
                             f"{name} total_num_steps")
    if name == "WarmupLR" and hasattr(lr_scheduler, "warmup_num_steps"):
        warmup = _positive_int(lr_scheduler.warmup_num_steps)
        if warmup is not None and warmup <= DEEPSPEED_WARMUP_FLOOR:
            return ScheduleShape(None, None, f"{name}, whose warm-up of {warmup} updates is DeepSpeed's floor (no "
                                 f"warm-up) and which holds its learning rate to the end")
        return ScheduleShape(None, warmup, f"{name} warmup_num_steps")
    if name == "OneCycle" and hasattr(lr_scheduler, "total_size"):
        return ScheduleShape(_positive_int(lr_scheduler.total_size), _positive_int(getattr(
            lr_scheduler, "first_step_size", None)), f"{name} cycle_first_step_size + cycle_second_step_size")
    if name == "LRRangeTest":
        return ScheduleShape(None, None, f"{name}, a learning-rate search without a run length")
    for cls, attribute in ((schedulers.OneCycleLR, "total_steps"), (schedulers.CosineAnnealingLR, "T_max"),
                           (getattr(schedulers, "PolynomialLR", ()), "total_iters")):
        if cls and isinstance(lr_scheduler, cls):
            return ScheduleShape(_positive_int(getattr(lr_scheduler, attribute, None)), None, f"{name} {attribute}")
    if isinstance(lr_scheduler, schedulers.LambdaLR) and getattr(lr_scheduler, "lr_lambdas", None):
        try:
            total, warmup = lambda_shape(lr_scheduler.lr_lambdas[0])
        except (ArithmeticError, TypeError, ValueError):
            return ScheduleShape(None, None, f"{name} (its lr_lambdas could not be evaluated ahead)")
        return ScheduleShape(total, warmup or None, f"{name} lr_lambdas read ahead")
    return ScheduleShape(None, None, f"{name}, whose length the engine does not read")


def resolve_auto_warmup(lr_scheduler, sync_after_updates: Optional[int] = None) -> AutoWarmup:
    """N for ``warmup_sync_updates: "auto"`` and the reason, from the engine's LR scheduler."""
    shape = schedule_shape(lr_scheduler)
    if shape.total_updates is not None:
        updates = shape.total_updates // RUN_FRACTION
        reason = f"a sixth of the scheduler's {shape.total_updates} updates ({shape.source})"
    elif shape.warmup_updates:
        updates = LR_WARMUP_MULTIPLE * shape.warmup_updates
        reason = (f"{LR_WARMUP_MULTIPLE} x the scheduler's {shape.warmup_updates}-update LR warm-up "
                  f"({shape.source}); the run's length is not known to the engine: this is a sixth of a run of "
                  f"{RUN_FRACTION * updates} updates; for a run of another length set warmup_sync_updates to a "
                  f"sixth of its updates")
    else:
        updates = 0
        reason = (f"{shape.source}: the run's length is not known to the engine; set warmup_sync_updates to "
                  f"about a sixth of the run's updates")
    if sync_after_updates is not None and updates >= sync_after_updates:
        updates = max(0, sync_after_updates - 1)
        reason += f", kept below sync_after_updates ({sync_after_updates})"
    return AutoWarmup(updates=updates, reason=reason)


def describe_warmup(updates: int, reason: Optional[str]) -> str:
    """The start-up log's words for N ("the first 120 updates are synchronous (...)")."""
    what = "no update is synchronous" if updates == 0 else \
        "the first update is synchronous" if updates == 1 else f"the first {updates} updates are synchronous"
    if reason is None:
        return f"{what} (warmup_sync_updates {updates})"
    return f"{what} (warmup_sync_updates \"auto\": {reason})"



def warmup_after_resume(resolved: int, saved: Optional[int], global_steps: int, rule_under_way: bool) -> int:
    """N for a run that continues a checkpoint of its own type (docs/design.md, 3.6; docs/checkpoints.md).

    ``resolved``: this run's N; ``saved``: the N the checkpoint was written under (None: written
    before checkpoints recorded it); ``global_steps``: the updates the checkpoint committed;
    ``rule_under_way``: whether it holds the type's own rule in progress (a job in flight, or a
    phase other than the first).

    The warm-up comes first and cannot restart mid-way: a checkpoint past the warm-up of its run
    (``global_steps >= saved``, or the rule under way) continues under the type's rule, so a larger
    ``resolved`` becomes ``global_steps`` (the warm-up is over). A checkpoint still inside its
    warm-up continues with ``resolved``. Without ``saved`` only the rule under way tells.
    """
    if global_steps >= resolved:
        return resolved
    past_warmup = rule_under_way or (saved is not None and global_steps >= saved)
    return global_steps if past_warmup else resolved
