"""``optimizer.params`` of the DeepSpeed config: parsed from a type's kw_only dataclass.

Each optimizer type declares its params as a kw_only dataclass whose fields carry the names,
defaults and types (``float``, ``int``, ``bool``, ``Tuple[float, float]``, ``Optional[float]``,
``Union[float, str]`` or ``str`` with the allowed words in the field's ``choices`` metadata) and a
docstring per field naming the paper's symbol; :func:`parse_params` checks a JSON object against
it, and the class's ``validate()`` checks ranges. Every mistake raises ``ValueError`` naming the
key and the fix.
"""
import logging
import typing
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Dict, FrozenSet, Optional, Tuple, Union

from ...ops import quantization
from ..checks import (MAX_DURATION_S, at_most, attempt, boolean, collecting, config_error, count_at_most, integer,
                      number, report, unfilled_auto_error)

logger = logging.getLogger("DeepSpeed").getChild("acco")

DEFAULT_COMMUNICATION_TIMEOUT_S = 300.0
AUTO = "auto"


def _parse_value(key: str, annotation, value: Any, choices: Tuple[str, ...]):
    if isinstance(value, str) and value in choices:
        return value
    if value == AUTO:
        raise unfilled_auto_error(key)
    origin = typing.get_origin(annotation)
    arguments = typing.get_args(annotation)
    if annotation is float:
        return number(key, value)
    if annotation is int:
        return integer(key, value)
    if annotation is bool:
        return boolean(key, value)
    if annotation is str:
        raise config_error(key, f"expected one of {list(choices)}, got {value!r}", f"use one of {list(choices)}")
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(arguments):
            raise config_error(key, f"expected a list of {len(arguments)} numbers, got {value!r}",
                               "set e.g. [0.9, 0.999]")
        return tuple(_parse_value(key, item_type, item, ()) for item_type, item in zip(arguments, value))
    if origin is typing.Union:
        if value is None and type(None) in arguments:
            return None
        concrete = [a for a in arguments if a not in (type(None), str)]
        if len(concrete) == 1:
            try:
                return _parse_value(key, concrete[0], value, ())
            except ValueError:
                allowed = [repr(c) for c in choices] + (["null"] if type(None) in arguments else [])
                raise config_error(key, f"expected a number{' or ' + ' or '.join(allowed) if allowed else ''}, "
                                   f"got {value!r}", "fix the value") from None
    raise TypeError(f"params field {key} has an annotation the parser does not know: {annotation!r}")


def parse_params(cls, raw: Dict[str, Any], type_name: str, prefix: str = "optimizer.params"):
    """An instance of the params dataclass ``cls`` from the JSON object ``raw`` (validated).

    For AdamW-based types, the parameters DeepSpeed's own Adam/AdamW accept are read first
    (:func:`check_deepspeed_adam_params`): honoured, or refused with the reason."""
    if not isinstance(raw, dict):
        raise config_error(prefix, f"expected an object, got {raw!r}", "give the parameters as a JSON object")
    deepspeed_keys = {}
    if issubclass(cls, AdamWParams):
        deepspeed_keys = {key: raw[key] for key in raw if key in DEEPSPEED_ADAM_PARAMS}
        raw = {key: value for key, value in raw.items() if key not in deepspeed_keys}
    known = {item.name: item for item in fields(cls)}
    hints = typing.get_type_hints(cls)
    values = {}
    with collecting():  # every key's problem at once (docs/design.md, 2, "One pass")
        for key in sorted(set(raw) - set(known)):
            report(config_error(f"{prefix}.{key}", f"unknown parameter for optimizer type {type_name!r}",
                                f"remove it; {type_name} accepts {sorted(known)}"))
        for key, value in raw.items():
            if key in known:
                with attempt():
                    choices = tuple(known[key].metadata.get("choices", ()))
                    values[key] = _parse_value(f"{prefix}.{key}", hints[key], value, choices)
        # The range checks see the values that parsed; a value refused above keeps its default here.
        parsed = cls(**values)
        parsed.given = frozenset(raw)
        parsed.validate(prefix)
        check_deepspeed_adam_params(deepspeed_keys, parsed, type_name, prefix)
    return parsed


@dataclass(kw_only=True)
class PipelineParams:
    """Switches of the communication pipeline that every optimizer type has."""

    given: ClassVar[FrozenSet[str]] = frozenset()
    """The keys the config gave (set per instance by :func:`parse_params`); the others took their default."""
    overlap: bool = True
    """Run communication jobs on the lane while the model computes. ``False`` runs each job
    synchronously with identical math (for debugging and tests)."""
    communication_timeout_s: float = DEFAULT_COMMUNICATION_TIMEOUT_S
    """How long a collective may take before the job fails with a message naming it (dead peers)."""
    quantization_bits: int = quantization.BITS[0]
    """Bits per value of compressed communication (``zero_optimization.zero_quantized_gradients`` /
    ``zero_quantized_weights``): 8 (int8 codes) or 4 (int4 codes)."""
    quantization_block_size: int = quantization.DEFAULT_BLOCK_SIZE
    """Values that share one fp32 scale in compressed communication: a power of two in [32, 512]."""

    def validate(self, prefix: str) -> None:
        """Range checks (the types were checked by :func:`parse_params`)."""
        if self.communication_timeout_s <= 0:
            raise config_error(f"{prefix}.communication_timeout_s", f"must be > 0, got {self.communication_timeout_s}",
                               f"use e.g. {DEFAULT_COMMUNICATION_TIMEOUT_S}")
        at_most(f"{prefix}.communication_timeout_s", self.communication_timeout_s, MAX_DURATION_S,
                f"use e.g. {DEFAULT_COMMUNICATION_TIMEOUT_S:g} (seconds): it only decides how soon a collective that "
                f"never finishes is reported", limit_text=" (365 days)")
        if self.quantization_bits not in quantization.BITS:
            raise config_error(f"{prefix}.quantization_bits", f"must be 8 or 4, got {self.quantization_bits}",
                               "use 8 (int8, 3.9x fewer bytes than fp32) or 4 (int4, 7.5x)")
        block_size = self.quantization_block_size
        power_of_two = block_size & (block_size - 1) == 0
        if not (quantization.MIN_BLOCK_SIZE <= block_size <= quantization.MAX_BLOCK_SIZE and power_of_two):
            raise config_error(f"{prefix}.quantization_block_size", f"must be a power of two in "
                               f"[{quantization.MIN_BLOCK_SIZE}, {quantization.MAX_BLOCK_SIZE}], got {block_size}",
                               f"use e.g. {quantization.DEFAULT_BLOCK_SIZE}")


@dataclass(kw_only=True)
class AdamWParams(PipelineParams):
    """AdamW hyperparameters shared by our types (``torch.optim.AdamW`` defaults)."""

    lr: float = 1e-3
    """Learning rate (the scheduler, if any, overrides it per update)."""
    betas: Tuple[float, float] = (0.9, 0.999)
    """(beta1, beta2): decay rates of the first and second moment estimates."""
    eps: float = 1e-8
    """Term added to the denominator for numerical stability."""
    weight_decay: float = 1e-2
    """Decoupled weight decay coefficient."""

    def validate(self, prefix: str) -> None:
        with attempt():
            super().validate(prefix)
        if self.lr <= 0:
            report(config_error(f"{prefix}.lr", f"must be > 0, got {self.lr}",
                                "set a positive learning rate, e.g. 1e-3"))
        if not all(0.0 <= beta < 1.0 for beta in self.betas):
            report(config_error(f"{prefix}.betas", f"each beta must lie in [0, 1), got {list(self.betas)}",
                                "use e.g. [0.9, 0.999]"))
        if self.eps <= 0:
            report(config_error(f"{prefix}.eps", f"must be > 0, got {self.eps}", "use e.g. 1e-8"))
        if self.weight_decay < 0:
            report(config_error(f"{prefix}.weight_decay", f"must be >= 0, got {self.weight_decay}",
                                "use 0 to disable weight decay"))


@dataclass(kw_only=True)
class WarmupParams:
    """Synchronous warm-up for the overlapped types (DPU, ACCO, CO2)."""

    warmup_sync_updates: Union[int, str] = field(default=AUTO, metadata={"choices": (AUTO, )})
    """The first N committed updates are synchronous ZeRO-1 AdamW updates (ShardedAdamW's); the type's
    own rule takes over after them from the committed parameters, without a restart (optimizer
    state, step count and LR schedule carry on). 0: no warm-up. "auto" (the default for DPU and
    ACCO): N from the LR scheduler when the engine is built (docs/design.md, 3.6;
    :mod:`deepspeed_acco.runtime.warmup`)."""

    def validate(self, prefix: str) -> None:
        super().validate(prefix)
        if self.warmup_sync_updates == AUTO:
            return
        if self.warmup_sync_updates < 0:
            raise config_error(f"{prefix}.warmup_sync_updates", f"must be >= 0, got {self.warmup_sync_updates}",
                               "use 0 for no warm-up, or the number of synchronous updates to start with")
        count_at_most(f"{prefix}.warmup_sync_updates", self.warmup_sync_updates)


@dataclass(kw_only=True)
class CooldownParams:
    """Synchronous cool-down for the types whose rule is one update away from ZeRO-1 (DPU, ACCO)."""

    sync_after_updates: Optional[int] = None
    """After N committed updates, every further update is a synchronous ZeRO-1 AdamW update
    (ShardedAdamW's), continuing from the committed parameters with the optimizer state, step count
    and LR schedule carried on; the mirror image of ``warmup_sync_updates``, for the end of a
    decaying schedule. null: the type's own rule to the end."""

    def validate(self, prefix: str) -> None:
        super().validate(prefix)
        after = self.sync_after_updates
        if after is None:
            return
        count_at_most(f"{prefix}.sync_after_updates", after)
        warmup = getattr(self, "warmup_sync_updates", 0)
        if warmup == AUTO:
            if after < 1:
                raise config_error(f"{prefix}.sync_after_updates", f"must be >= 1, got {after}",
                                   "use null for the type's own rule to the end")
            return  # "auto" resolves below it (deepspeed_acco.runtime.warmup)
        if after <= warmup:
            raise config_error(f"{prefix}.sync_after_updates", f"must be greater than warmup_sync_updates "
                               f"({warmup}), got {after}", "use null for the type's own rule to the end, or the "
                               "number of committed updates after which to go synchronous (a run that is "
                               "synchronous throughout is ShardedAdamW)")


# ---- DeepSpeed's Adam/AdamW parameters -------------------------------------------------------
# What DeepSpeed's "Adam"/"AdamW" accept in optimizer.params besides lr, betas, eps and
# weight_decay (deepspeed/runtime/engine.py, _configure_basic_optimizer and
# get_optimizer_configuration; ops/adam/fused_adam.py; ops/adam/cpu_adam.py; torch.optim.AdamW, which
# DeepSpeed builds with torch_adam), so that a config switched from "AdamW" to one of our types
# keeps working or says why it cannot (docs/usage.md, "From DeepSpeed's AdamW").

IMPLEMENTATION_SELECTORS: Dict[str, str] = {
    "torch_adam": "chooses between torch.optim.AdamW and DeepSpeed's fused AdamW",
    "fused": "chooses torch.optim.AdamW's fused implementation",
    "foreach": "chooses torch.optim.AdamW's multi-tensor implementation",
    "capturable": "lets torch.optim.AdamW's step be captured in a CUDA graph",
    "differentiable": "lets autograd run through torch.optim.AdamW's step",
    "set_grad_none": "makes DeepSpeed's FusedAdam.zero_grad() set .grad to None",
}
"""Parameters that choose how DeepSpeed computes the same AdamW update (or what its zero_grad frees):
accepted with a note, since our types run their own fused AdamW kernels (docs/kernels.md) on
gradients the engine accumulates in its own buffers."""


@dataclass(frozen=True)
class MathParam:
    """A DeepSpeed Adam parameter that changes the update: honoured at ``ours``, refused otherwise."""

    ours: Any
    """The value whose update our kernels compute (the default of DeepSpeed's and torch's AdamW)."""
    otherwise: str
    """What another value would do, for the error."""


MATH_PARAMS: Dict[str, MathParam] = {
    "adam_w_mode": MathParam(True, "false makes it Adam with L2 regularisation (the decay is added to the gradient "
                                   "and divided by Adam's denominator), not AdamW's decoupled decay"),
    "bias_correction": MathParam(True, "false drops Adam's bias correction of the moments, which our AdamW "
                                       "always applies (as torch.optim.AdamW does)"),
    "amsgrad": MathParam(False, "true is AMSGrad (a running maximum of the second moment), which our kernels "
                                "do not keep"),
    "maximize": MathParam(False, "true ascends the objective; our types descend the loss"),
    "fp32_optimizer_states": MathParam(True, "false keeps DeepSpeed's CPU-offload Adam moments in bf16; ours are "
                                             "always fp32"),
}

REFUSED_PARAMS: Dict[str, Tuple[str, str]] = {
    "max_grad_norm": ("DeepSpeed refuses it too: clipping is the top-level key \"gradient_clipping\"",
                      "move the value there"),
}
"""Refused at any value: (the problem, the fix)."""

DEEPSPEED_ADAM_PARAMS = frozenset(IMPLEMENTATION_SELECTORS) | frozenset(MATH_PARAMS) | frozenset(REFUSED_PARAMS)
_NULLABLE = frozenset({"fused", "foreach", "fp32_optimizer_states"})
"""Parameters whose null means "DeepSpeed or torch decides", as their signatures default to None."""

_noted = set()
"""The implementation selectors noted in this process (a config may be parsed more than once in a process,
by the registration and then by initialize)."""


def check_deepspeed_adam_params(given: Dict[str, Any], params: "AdamWParams", type_name: str, prefix: str) -> None:
    """Honour or refuse each DeepSpeed Adam/AdamW parameter in ``given`` (``ValueError`` naming the key and
    the fix); each implementation selector is noted once per process."""
    for key, value in given.items():
        with attempt():
            _check_deepspeed_adam_param(key, value, params, type_name, prefix)


def _check_deepspeed_adam_param(key: str, value: Any, params: "AdamWParams", type_name: str, prefix: str) -> None:
    """One parameter of :func:`check_deepspeed_adam_params`."""
    name = f"{prefix}.{key}"
    if key in REFUSED_PARAMS:
        problem, fix = REFUSED_PARAMS[key]
        raise config_error(name, problem, fix)
    if key in IMPLEMENTATION_SELECTORS:
        if not (value is None and key in _NULLABLE):
            boolean(name, value)
        if key not in _noted:
            _noted.add(key)
            logger.warning("deepspeed_acco config: %s: in DeepSpeed it %s; %s runs deepspeed_acco's own fused "
                           "AdamW (the same update), so it has no effect here", name, IMPLEMENTATION_SELECTORS[key],
                           type_name)
        return
    rule = MATH_PARAMS[key]
    if (value is None and key in _NULLABLE) or boolean(name, value) == rule.ours:
        return
    if key == "adam_w_mode" and params.weight_decay == 0:
        return  # without weight decay, Adam and AdamW are the same update
    fix = f"remove it (or set it to {str(rule.ours).lower()})"
    if key == "adam_w_mode":
        fix += (" for AdamW's decoupled weight decay and re-tune weight_decay, or set \"weight_decay\": 0 "
                "(DeepSpeed's FusedAdam default), where Adam and AdamW are the same update")
    raise config_error(name, f"{type_name} implements AdamW: {rule.otherwise}", fix)
