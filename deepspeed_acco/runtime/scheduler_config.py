"""The ``scheduler`` section of the DeepSpeed config, checked by the parser (docs/design.md, 2, "Config").

The engine builds the LR scheduler after the model broadcast and the communicators
(:mod:`.builder`); a mistake found only there would surface after collectives have run, as the
scheduler's own ``TypeError``. So the parser checks the section first, with key paths:

1. ``scheduler.type``: one of DeepSpeed's schedulers (``WarmupLR``, ``WarmupDecayLR``,
   ``WarmupCosineLR``, ``OneCycle``, ``LRRangeTest``) or a class of ``torch.optim.lr_scheduler``;
2. ``scheduler.params``: every parameter the class requires is there (``total_num_steps`` of
   ``WarmupDecayLR``...), no other key, and for DeepSpeed's schedulers each value has the type and
   range DeepSpeed needs; an ``"auto"`` the HF Trainer did not fill is named as such;
3. then the scheduler is built once on a stand-in optimizer with the model's number of parameter
   groups, which catches what the class itself refuses (a list of learning rates of the wrong
   length, ...); DeepSpeed's own log lines are silenced for this trial.

A scheduler passed to ``initialize`` (``lr_scheduler=``) replaces the section, as in DeepSpeed;
the section is then not checked, and the start-up line names it as a key without effect.
"""
import inspect
import logging
import math
from typing import Any, Callable, Dict, Optional

import torch

from .checks import AUTO_WORD, config_error, report, unfilled_auto_error

DEEPSPEED_SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest")


def scheduler_class(name: Any) -> Optional[type]:
    """The class ``scheduler.type`` names: DeepSpeed's first, then torch's (None: neither)."""
    if not isinstance(name, str) or not name:
        return None
    from deepspeed.runtime import lr_schedules
    if name in DEEPSPEED_SCHEDULERS and hasattr(lr_schedules, name):
        return getattr(lr_schedules, name)
    candidate = getattr(torch.optim.lr_scheduler, name, None)
    base = getattr(torch.optim.lr_scheduler, "LRScheduler", None) or torch.optim.lr_scheduler._LRScheduler
    if isinstance(candidate, type) and issubclass(candidate, base) and candidate is not base:
        return candidate
    return None


# ---- value rules for DeepSpeed's schedulers' parameters ----------------------------------------
def _is_number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def _learning_rate(value: Any) -> Optional[str]:
    """A learning rate >= 0, or one per parameter group (a list)."""
    values = value if isinstance(value, (list, tuple)) else [value]
    if not values or not all(_is_number(item) and item >= 0 for item in values):
        return "expected a learning rate >= 0 (or a list of them, one per parameter group)"
    return None


def _positive_integer(value: Any) -> Optional[str]:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return "expected a positive integer (a number of updates)"
    return None


def _nonnegative_integer(value: Any) -> Optional[str]:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return "expected an integer >= 0"
    return None


def _positive_number(value: Any) -> Optional[str]:
    return None if _is_number(value) and value > 0 else "expected a number > 0"


def _nonnegative_number(value: Any) -> Optional[str]:
    return None if _is_number(value) and value >= 0 else "expected a number >= 0"


def _any_number(value: Any) -> Optional[str]:
    return None if _is_number(value) else "expected a finite number"


def _optional(rule: Callable[[Any], Optional[str]]) -> Callable[[Any], Optional[str]]:
    def check(value: Any) -> Optional[str]:
        return None if value is None else rule(value)
    return check


def _flag(value: Any) -> Optional[str]:
    return None if isinstance(value, bool) else "expected true or false"


def _iteration(value: Any) -> Optional[str]:
    if isinstance(value, bool) or not isinstance(value, int) or value < -1:
        return "expected an integer >= -1 (-1: start from the beginning)"
    return None


def _warmup_type(value: Any) -> Optional[str]:
    return None if value in ("log", "linear") else "expected \"log\" or \"linear\""


_RULES: Dict[str, Callable[[Any], Optional[str]]] = {
    "warmup_min_lr": _learning_rate, "warmup_max_lr": _optional(_learning_rate),
    "warmup_num_steps": _positive_integer, "warmup_type": _warmup_type, "last_batch_iteration": _iteration,
    "total_num_steps": _positive_integer, "warmup_min_ratio": _nonnegative_number,
    "cos_min_ratio": _nonnegative_number,
    "cycle_min_lr": _learning_rate, "cycle_max_lr": _learning_rate, "decay_lr_rate": _nonnegative_number,
    "cycle_first_step_size": _positive_number, "cycle_second_step_size": _optional(_nonnegative_number),
    "cycle_first_stair_count": _nonnegative_integer, "cycle_second_stair_count": _optional(_nonnegative_integer),
    "decay_step_size": _nonnegative_number, "cycle_momentum": _flag, "cycle_min_mom": _any_number,
    "cycle_max_mom": _any_number, "decay_mom_rate": _any_number,
    "lr_range_test_min_lr": _learning_rate, "lr_range_test_step_size": _positive_integer,
    "lr_range_test_step_rate": _positive_number, "lr_range_test_staircase": _flag,
}
"""For each parameter of DeepSpeed's schedulers (deepspeed/runtime/lr_schedules.py): why a value is
refused, or None. Ranges are those DeepSpeed's constructors enforce or need to compute a schedule."""

_WHAT_IT_IS = {
    "total_num_steps": ("the updates of the whole run, over which the learning rate decays",
                        "set it to the run's number of updates (under the HF Trainer, \"auto\" fills in its steps)"),
    "cycle_min_lr": ("the learning rate at both ends of the cycle", "set it, e.g. a tenth of cycle_max_lr"),
    "cycle_max_lr": ("the learning rate at the top of the cycle", "set it, e.g. the optimizer's lr"),
}
"""For a required parameter: (what it is, the fix), for the message when it is missing."""


def _signature(cls: type):
    """(required, accepted) parameter names of the scheduler's constructor, after the optimizer;
    accepted is None when it takes ``**kwargs``."""
    parameters = list(inspect.signature(cls.__init__).parameters.values())[2:]  # self, optimizer
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        accepted = None
    else:
        accepted = [p.name for p in parameters if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                             inspect.Parameter.KEYWORD_ONLY)]
    required = [p.name for p in parameters if p.default is inspect.Parameter.empty
                and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]
    return required, accepted


def check_scheduler_section(section: Any, *, param_group_count: Optional[int] = None) -> None:
    """Report every problem of the ``scheduler`` section (:func:`.checks.report`: collected by the parser)."""
    if section is None or section == {}:
        return
    if not isinstance(section, dict):
        report(config_error("scheduler", f"expected an object like {{\"type\": \"WarmupLR\", \"params\": {{...}}}}, "
                            f"got {section!r}", "fix the section or remove it"))
        return
    for key in sorted(set(section) - {"type", "params"}):
        report(config_error(f"scheduler.{key}", "unknown key", "keep only \"type\" and \"params\""))
    name = section.get("type")
    cls = scheduler_class(name)
    if cls is None:
        report(config_error("scheduler.type", f"unknown scheduler {name!r}",
                            f"use one of DeepSpeed's ({', '.join(DEEPSPEED_SCHEDULERS)}) or a "
                            "torch.optim.lr_scheduler class name"))
        return
    params = section.get("params", {})
    if params is None:
        params = {}
    if not isinstance(params, dict):
        report(config_error("scheduler.params", f"expected an object, got {params!r}",
                            f"give {name}'s parameters as a JSON object"))
        return
    required, accepted = _signature(cls)
    problems = 0
    for key in required:
        if key not in params:
            problems += 1
            what, fix = _WHAT_IT_IS.get(key, ("", "set it"))
            report(config_error(f"scheduler.params.{key}", "missing",
                                f"{name} needs it{': ' + what if what else ''}; {fix}"))
    for key in sorted(params):
        path = f"scheduler.params.{key}"
        if accepted is not None and key not in accepted:
            problems += 1
            report(config_error(path, f"not a parameter of {name}", f"remove it ({name} takes {sorted(accepted)})"))
        elif params[key] == AUTO_WORD:
            problems += 1
            report(unfilled_auto_error(path))
        elif name in DEEPSPEED_SCHEDULERS and key in _RULES:
            problem = _RULES[key](params[key])
            if problem is not None:
                problems += 1
                report(config_error(path, f"{problem}, got {params[key]!r}", "fix the value"))
    if problems:
        return
    _trial(cls, name, params, param_group_count)


def _trial(cls: type, name: str, params: Dict[str, Any], param_group_count: Optional[int]) -> None:
    """Build the scheduler once on a stand-in optimizer; report what the class refuses."""
    groups = param_group_count
    if groups is None:  # a per-group list says how many groups the config expects
        groups = max([len(value) for value in params.values() if isinstance(value, (list, tuple))] or [1])
    stand_in = torch.optim.AdamW([{"params": [torch.zeros(1, requires_grad=True)]} for _ in range(groups)], lr=1e-3)
    deepspeed_logger = logging.getLogger("DeepSpeed")
    level = deepspeed_logger.level
    deepspeed_logger.setLevel(logging.CRITICAL)  # its warnings come once, when the engine builds it
    try:
        cls(stand_in, **params)
    except (TypeError, ValueError, AssertionError, ArithmeticError, KeyError, IndexError) as error:
        report(config_error("scheduler.params", f"{name} refuses them: {error}",
                            "fix the values (a list holds one value per parameter group)"))
    finally:
        deepspeed_logger.setLevel(level)
