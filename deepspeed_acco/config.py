"""Configuration of our optimizer types, read from a standard DeepSpeed JSON config (DESIGN 2).

Every user mistake in a key we own raises ``ValueError`` naming the key and the fix, before any
collective runs. The dataclasses here are the single source of truth for names and defaults.
"""
import copy
import json
import math
import os
from dataclasses import dataclass, field, fields
from typing import Any, Dict, Optional, Tuple, Union

ShardedAdamW = "ShardedAdamW"
DPU = "DPU"
ACCO = "ACCO"
CO2 = "CO2"
OPTIMIZER_TYPES = (ShardedAdamW, DPU, ACCO, CO2)
_CANONICAL_TYPE = {name.lower(): name for name in OPTIMIZER_TYPES}

DEFAULT_COMMUNICATION_TIMEOUT_S = 300.0


@dataclass(kw_only=True)
class AdamWConfig:
    """AdamW hyperparameters and pipeline switches shared by every type (``torch.optim.AdamW`` defaults)."""

    lr: float = 1e-3
    """Learning rate (the scheduler, if any, overrides it per update)."""
    betas: Tuple[float, float] = (0.9, 0.999)
    """(beta1, beta2): decay rates of the first and second moment estimates."""
    eps: float = 1e-8
    """Term added to the denominator for numerical stability."""
    weight_decay: float = 1e-2
    """Decoupled weight decay coefficient."""
    overlap: bool = True
    """Run communication jobs on the side stream/worker while the model computes. ``False`` runs each
    job synchronously with identical math (for debugging and tests)."""
    communication_timeout_s: float = DEFAULT_COMMUNICATION_TIMEOUT_S
    """How long a collective may take before the job fails with a message naming it (dead peers)."""


@dataclass(kw_only=True)
class ShardedAdamWConfig(AdamWConfig):
    """Synchronous ZeRO-1 AdamW (DESIGN 3.1)."""


@dataclass(kw_only=True)
class DPUConfig(AdamWConfig):
    """Delayed parameter update: one-step stale gradients (DESIGN 3.2)."""


@dataclass(kw_only=True)
class ACCOConfig(AdamWConfig):
    """Accumulate while you communicate (DESIGN 3.3, 3.4)."""

    dynamic_accumulation: bool = False
    """Keep accumulating micro-batches until the running job is done instead of waiting for it."""


@dataclass(kw_only=True)
class CO2Config(AdamWConfig):
    """Local AdamW steps with one-step asynchronous outer averaging (DESIGN 3.5)."""

    local_steps: int = 12
    """tau: inner steps per outer round."""
    outer_lr: float = 1.0
    """alpha_o: outer learning rate."""
    outer_momentum: float = 0.5
    """beta_o: outer momentum."""
    gap_penalty: Union[float, str] = "adaptive"
    """lambda: constant divisor of the pseudo-gradient, or "adaptive" (DESIGN 3.5)."""
    clip_threshold: Optional[float] = None
    """c: coordinate-wise clip of the outer momentum; None disables clipping."""
    group_size: int = 1
    """g: consecutive ranks that average gradients every inner step (ZeRO-1 inside the group)."""


_CONFIG_CLASS = {ShardedAdamW: ShardedAdamWConfig, DPU: DPUConfig, ACCO: ACCOConfig, CO2: CO2Config}


def load_config(config: Union[str, os.PathLike, Dict[str, Any]]) -> Dict[str, Any]:
    """Read a DeepSpeed config given as a dict or a JSON file path; returns a deep copy."""
    if isinstance(config, dict):
        return copy.deepcopy(config)
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if not os.path.isfile(path):
            raise ValueError(f"DeepSpeed config file {path!r} does not exist; pass a path to a JSON file or a dict")
        with open(path) as handle:
            try:
                return json.load(handle)
            except json.JSONDecodeError as error:
                raise ValueError(f"DeepSpeed config file {path!r} is not valid JSON: {error}") from error
    raise ValueError(f"config must be a dict or a path to a JSON file, got {type(config).__name__}")


def optimizer_type(config: Dict[str, Any]) -> Optional[str]:
    """Canonical name of our optimizer type selected by the config, or None if it is not one of ours."""
    section = config.get("optimizer")
    if not isinstance(section, dict):
        return None
    name = section.get("type")
    if not isinstance(name, str):
        return None
    return _CANONICAL_TYPE.get(name.lower())


def _fail(key: str, problem: str, fix: str) -> None:
    raise ValueError(f"deepspeed_acco config: {key}: {problem}; {fix}")


def _number(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        _fail(key, f"expected a finite number, got {value!r}", "set it to a number")
    return float(value)


def _integer(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        _fail(key, f"expected an integer, got {value!r}", "set it to an integer")
    return value


def _boolean(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        _fail(key, f"expected true or false, got {value!r}", "set it to a JSON boolean")
    return value


def _parse_optimizer_params(kind: str, params: Dict[str, Any]):
    cls = _CONFIG_CLASS[kind]
    known = {f.name for f in fields(cls)}
    prefix = "optimizer.params"
    unknown = sorted(set(params) - known)
    if unknown:
        _fail(f"{prefix}.{unknown[0]}", f"unknown parameter for optimizer type {kind!r}",
              f"remove it; {kind} accepts {sorted(known)}")
    values: Dict[str, Any] = {}
    for key, value in params.items():
        full_key = f"{prefix}.{key}"
        if key == "betas":
            if not isinstance(value, (list, tuple)) or len(value) != 2:
                _fail(full_key, f"expected a pair [beta1, beta2], got {value!r}", "set e.g. [0.9, 0.999]")
            betas = tuple(_number(full_key, b) for b in value)
            if not all(0.0 <= b < 1.0 for b in betas):
                _fail(full_key, f"each beta must lie in [0, 1), got {list(betas)}", "use e.g. [0.9, 0.999]")
            values[key] = betas
        elif key in ("overlap", "dynamic_accumulation"):
            values[key] = _boolean(full_key, value)
        elif key in ("local_steps", "group_size"):
            values[key] = _integer(full_key, value)
        elif key == "gap_penalty":
            if value != "adaptive":
                value = _number(full_key, value)
                if value <= 0:
                    _fail(full_key, f"must be > 0 or \"adaptive\", got {value}",
                          "use 1.0 for no penalty or \"adaptive\"")
            values[key] = value
        elif key == "clip_threshold":
            if value is not None:
                value = _number(full_key, value)
                if value <= 0:
                    _fail(full_key, f"must be > 0 or null, got {value}", "use a positive threshold or null to disable")
            values[key] = value
        else:
            values[key] = _number(full_key, value)
    parsed = cls(**values)
    if parsed.lr <= 0:
        _fail(f"{prefix}.lr", f"must be > 0, got {parsed.lr}", "set a positive learning rate, e.g. 1e-3")
    if parsed.eps <= 0:
        _fail(f"{prefix}.eps", f"must be > 0, got {parsed.eps}", "use e.g. 1e-8")
    if parsed.weight_decay < 0:
        _fail(f"{prefix}.weight_decay", f"must be >= 0, got {parsed.weight_decay}", "use 0 to disable weight decay")
    if parsed.communication_timeout_s <= 0:
        _fail(f"{prefix}.communication_timeout_s", f"must be > 0, got {parsed.communication_timeout_s}",
              f"use e.g. {DEFAULT_COMMUNICATION_TIMEOUT_S}")
    if isinstance(parsed, CO2Config):
        if parsed.local_steps < 1:
            _fail(f"{prefix}.local_steps", f"must be >= 1, got {parsed.local_steps}", "use e.g. 12")
        if parsed.outer_lr <= 0:
            _fail(f"{prefix}.outer_lr", f"must be > 0, got {parsed.outer_lr}", "use e.g. 1.0")
        if not 0.0 <= parsed.outer_momentum < 1.0:
            _fail(f"{prefix}.outer_momentum", f"must lie in [0, 1), got {parsed.outer_momentum}", "use e.g. 0.5")
        if parsed.group_size < 1:
            _fail(f"{prefix}.group_size", f"must be >= 1, got {parsed.group_size}", "use 1 (no groups)")
    return parsed


@dataclass(kw_only=True)
class BatchConfig:
    """DeepSpeed's batch-size triangle, resolved: train_batch_size = micro * accumulation * data-parallel ranks."""

    train_batch_size: int
    micro_batch_size: int
    gradient_accumulation_steps: int


def resolve_batch_sizes(config: Dict[str, Any], data_parallel_size: int) -> BatchConfig:
    """Resolve and check the batch sizes exactly as DeepSpeed does, with ValueErrors instead of asserts."""
    train = config.get("train_batch_size")
    micro = config.get("train_micro_batch_size_per_gpu")
    accumulation = config.get("gradient_accumulation_steps")
    for key, value in (("train_batch_size", train), ("train_micro_batch_size_per_gpu", micro),
                       ("gradient_accumulation_steps", accumulation)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            _fail(key, f"must be a positive integer, got {value!r}", "fix the value")
    if train is not None and micro is not None and accumulation is not None:
        if train != micro * accumulation * data_parallel_size:
            _fail("train_batch_size", f"{train} != train_micro_batch_size_per_gpu ({micro}) * "
                  f"gradient_accumulation_steps ({accumulation}) * data-parallel ranks ({data_parallel_size})",
                  "make the three consistent or omit one of them")
    elif train is not None and micro is not None:
        accumulation, remainder = divmod(train, micro * data_parallel_size)
        if remainder or accumulation < 1:
            _fail("train_batch_size", f"{train} is not a multiple of train_micro_batch_size_per_gpu ({micro}) * "
                  f"data-parallel ranks ({data_parallel_size})", "adjust one of them")
    elif train is not None and accumulation is not None:
        micro, remainder = divmod(train, accumulation * data_parallel_size)
        if remainder or micro < 1:
            _fail("train_batch_size", f"{train} is not a multiple of gradient_accumulation_steps ({accumulation}) "
                  f"* data-parallel ranks ({data_parallel_size})", "adjust one of them")
    elif micro is not None:
        accumulation = accumulation or 1
        train = micro * accumulation * data_parallel_size
    elif train is not None:
        accumulation = 1
        micro, remainder = divmod(train, data_parallel_size)
        if remainder or micro < 1:
            _fail("train_batch_size", f"{train} is not a multiple of the data-parallel ranks ({data_parallel_size})",
                  "adjust it")
    else:
        _fail("train_batch_size", "neither train_batch_size nor train_micro_batch_size_per_gpu is set",
              "set at least one of them")
    if train is None:
        train = micro * accumulation * data_parallel_size
    return BatchConfig(train_batch_size=train, micro_batch_size=micro, gradient_accumulation_steps=accumulation)


def _deepspeed_default_gradient_clipping() -> float:
    """DeepSpeed's own default, so an unchanged config clips exactly as DeepSpeed does (1.0 in 0.19)."""
    try:
        from deepspeed.runtime.constants import GRADIENT_CLIPPING_DEFAULT
    except ImportError:
        return 0.0
    return float(GRADIENT_CLIPPING_DEFAULT)


_DTYPE_NAMES = {"fp32": "fp32", "float32": "fp32", "bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16",
                "float16": "fp16"}


@dataclass(kw_only=True)
class AccoConfig:
    """Everything our engine reads from a DeepSpeed config."""

    optimizer_type: str
    optimizer: AdamWConfig
    batch: BatchConfig
    world_size: int
    precision: str = "fp32"
    """Model/compute dtype: "fp32", "bf16" or "fp16" (master weights and moments are always fp32)."""
    communication_dtype: str = "fp32"
    """dtype of the gradient reduce-scatter ("fp32" or "bf16"); the all-gather uses the model dtype."""
    gradient_clipping: float = 0.0
    steps_per_print: int = 10
    wall_clock_breakdown: bool = False
    fp16_loss_scale: Dict[str, Any] = field(default_factory=dict)
    raw: Dict[str, Any] = field(default_factory=dict)


def _enabled(section: Any, key: str) -> bool:
    if section is None:
        return False
    if not isinstance(section, dict):
        _fail(key, f"expected an object like {{\"enabled\": true}}, got {section!r}", "fix the section")
    return _boolean(f"{key}.enabled", section.get("enabled", False))


def parse_config(config: Dict[str, Any], world_size: int) -> AccoConfig:
    """Validate a DeepSpeed config that selects one of our optimizer types; raise ValueError on mistakes."""
    kind = optimizer_type(config)
    if kind is None:
        raise ValueError("deepspeed_acco config: optimizer.type: not one of ours "
                         f"({', '.join(OPTIMIZER_TYPES)}); deepspeed_acco.initialize delegates other types to DeepSpeed")
    section = config["optimizer"]
    unknown_section_keys = sorted(set(section) - {"type", "params"})
    if unknown_section_keys:
        _fail(f"optimizer.{unknown_section_keys[0]}", "unknown key", "keep only \"type\" and \"params\"")
    params = section.get("params", {}) or {}
    if not isinstance(params, dict):
        _fail("optimizer.params", f"expected an object, got {params!r}", "give the parameters as a JSON object")
    optimizer = _parse_optimizer_params(kind, params)

    zero = config.get("zero_optimization")
    if zero is not None:
        if not isinstance(zero, dict):
            _fail("zero_optimization", f"expected an object, got {zero!r}", "use {\"stage\": 1} or omit it")
        stage = zero.get("stage", 0)
        if stage not in (0, 1):
            _fail("zero_optimization.stage", f"stage {stage!r} is not supported with optimizer type {kind}",
                  "our optimizers shard optimizer states like ZeRO stage 1: set stage to 0 or 1 (or omit it)")
        for offload_key in ("offload_optimizer", "offload_param"):
            offload = zero.get(offload_key)
            if isinstance(offload, dict) and offload.get("device", "none") not in (None, "none"):
                _fail(f"zero_optimization.{offload_key}", f"offloading is not supported with optimizer type {kind}",
                      "remove the offload section")

    if isinstance(optimizer, CO2Config) and world_size % optimizer.group_size:
        _fail("optimizer.params.group_size", f"{optimizer.group_size} does not divide the world size {world_size}",
              "choose a divisor of the number of ranks")
    batch = resolve_batch_sizes(config, world_size)
    if isinstance(optimizer, ACCOConfig) and not optimizer.dynamic_accumulation \
            and batch.gradient_accumulation_steps % 2:
        _fail("gradient_accumulation_steps", f"ACCO splits each batch into two halves, so it must be even, got "
              f"{batch.gradient_accumulation_steps}", "use an even number (e.g. halve train_micro_batch_size_per_gpu "
              "and double gradient_accumulation_steps), or set optimizer.params.dynamic_accumulation to true")

    bf16 = _enabled(config.get("bf16", config.get("bfloat16")), "bf16")
    fp16 = _enabled(config.get("fp16"), "fp16")
    if bf16 and fp16:
        _fail("fp16", "both fp16 and bf16 are enabled", "enable at most one of them")
    precision = "bf16" if bf16 else "fp16" if fp16 else "fp32"
    fp16_loss_scale = {}
    if fp16:
        fp16_section = config["fp16"]
        fp16_loss_scale = {
            "loss_scale": _number("fp16.loss_scale", fp16_section.get("loss_scale", 0)),
            "initial_scale_power": _integer("fp16.initial_scale_power", fp16_section.get("initial_scale_power", 16)),
            "loss_scale_window": _integer("fp16.loss_scale_window", fp16_section.get("loss_scale_window", 1000)),
            "hysteresis": _integer("fp16.hysteresis", fp16_section.get("hysteresis", 2)),
            "min_loss_scale": _number("fp16.min_loss_scale", fp16_section.get("min_loss_scale", 1)),
        }
        if fp16_loss_scale["loss_scale"] < 0:
            _fail("fp16.loss_scale", "must be >= 0", "use 0 for dynamic loss scaling or a positive static scale")

    communication = config.get("communication_data_type")
    if communication is None:
        communication_dtype = "fp32"
    else:
        communication_dtype = _DTYPE_NAMES.get(str(communication).lower())
        if communication_dtype not in ("fp32", "bf16"):
            _fail("communication_data_type", f"{communication!r} is not supported by our optimizers",
                  "use \"fp32\" or \"bf16\"")

    clipping = _number("gradient_clipping", config.get("gradient_clipping", _deepspeed_default_gradient_clipping()))
    if clipping < 0:
        _fail("gradient_clipping", f"must be >= 0, got {clipping}", "use 0 to disable clipping")
    steps_per_print = config.get("steps_per_print", 10)
    if steps_per_print is not None:
        steps_per_print = _integer("steps_per_print", steps_per_print)
        if steps_per_print < 1:
            _fail("steps_per_print", f"must be >= 1, got {steps_per_print}", "use e.g. 10")
    wall_clock_breakdown = _boolean("wall_clock_breakdown", config.get("wall_clock_breakdown", False))
    return AccoConfig(optimizer_type=kind, optimizer=optimizer, batch=batch, world_size=world_size,
                      precision=precision, communication_dtype=communication_dtype, gradient_clipping=clipping,
                      steps_per_print=steps_per_print or 10, wall_clock_breakdown=wall_clock_breakdown,
                      fp16_loss_scale=fp16_loss_scale, raw=copy.deepcopy(config))
