"""The DeepSpeed JSON config as our engine reads it (docs/design.md, section 2).

The optimizer section selects a registered type (:mod:`deepspeed_acco.runtime.optimizers`), whose
params dataclass parses ``optimizer.params``. The other keys keep DeepSpeed's meaning. A key that
would change what a DeepSpeed user expects is either implemented here or rejected with a
``ValueError`` naming it and the fix; keys that only tune DeepSpeed's own machinery are accepted;
an unknown key gets a warning naming the closest known one; keys DeepSpeed reads that do nothing for
our types are named in one start-up line (:func:`no_effect_note`). Everything is checked before any
collective runs, the ``scheduler`` section included, and every problem of a config is reported in
one ``ValueError``, one line each (docs/design.md, 2, "One pass"; :mod:`.checks`).
"""
import copy
import dataclasses
import difflib
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch

from .checks import (AUTO_WORD, attempt, boolean, collecting, config_error, count_at_most, integer, number,
                     problems_so_far, report, unfilled_auto_error)
from .compression import CompressionConfig, QuantizationFormat
from .optimizers import lookup, type_names
from .optimizers.params import parse_params
from .scheduler_config import check_scheduler_section

logger = logging.getLogger("DeepSpeed").getChild("acco")

_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_DTYPE_NAMES = {"fp32": "fp32", "float32": "fp32", "float": "fp32", "bf16": "bf16", "bfloat16": "bf16",
                "fp16": "fp16", "float16": "fp16", "half": "fp16"}


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
    schedule_class = lookup(section.get("type"))
    return schedule_class.type_name if schedule_class is not None else None


@dataclass(kw_only=True)
class BatchConfig:
    """DeepSpeed's batch-size triangle, resolved: train_batch_size = micro * accumulation * data-parallel ranks."""

    train_batch_size: int
    micro_batch_size: int
    gradient_accumulation_steps: int
    accumulation_source: str = "config"
    """Where gradient_accumulation_steps came from: "config" (the key), "derived" (from train_batch_size and the
    micro-batch) or "default" (absent: DeepSpeed's default, 1); for the messages of the config checks."""
    caller_sets_boundaries: bool = False
    """Whether the HF Trainer or Accelerate drive the engine and decide where each update ends
    (``set_gradient_accumulation_boundary``), known from the ``DummyOptim`` they pass."""


def resolve_batch_sizes(config: Dict[str, Any], data_parallel_size: int) -> BatchConfig:
    """Resolve and check the batch sizes exactly as DeepSpeed does, with ValueErrors instead of asserts."""
    train = config.get("train_batch_size")
    micro = config.get("train_micro_batch_size_per_gpu")
    accumulation = config.get("gradient_accumulation_steps")
    for key, value in (("train_batch_size", train), ("train_micro_batch_size_per_gpu", micro),
                       ("gradient_accumulation_steps", accumulation)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise config_error(key, f"must be a positive integer, got {value!r}", "fix the value")
        if value is not None:
            count_at_most(key, value)
    if train is not None and micro is not None and accumulation is not None:
        if train != micro * accumulation * data_parallel_size:
            raise config_error("train_batch_size", f"{train} != train_micro_batch_size_per_gpu ({micro}) * "
                               f"gradient_accumulation_steps ({accumulation}) * data-parallel ranks "
                               f"({data_parallel_size})", "make the three consistent or omit one of them")
    elif train is not None and micro is not None:
        accumulation, remainder = divmod(train, micro * data_parallel_size)
        if remainder or accumulation < 1:
            raise config_error("train_batch_size", f"{train} is not a multiple of train_micro_batch_size_per_gpu "
                               f"({micro}) * data-parallel ranks ({data_parallel_size})", "adjust one of them")
    elif train is not None and accumulation is not None:
        micro, remainder = divmod(train, accumulation * data_parallel_size)
        if remainder or micro < 1:
            raise config_error("train_batch_size", f"{train} is not a multiple of gradient_accumulation_steps "
                               f"({accumulation}) * data-parallel ranks ({data_parallel_size})", "adjust one of them")
    elif micro is not None:
        accumulation = accumulation or 1
        train = micro * accumulation * data_parallel_size
    elif train is not None:
        accumulation = 1
        micro, remainder = divmod(train, data_parallel_size)
        if remainder or micro < 1:
            raise config_error("train_batch_size", f"{train} is not a multiple of the data-parallel ranks "
                               f"({data_parallel_size})", "adjust it")
    else:
        raise config_error("train_batch_size", "neither train_batch_size nor train_micro_batch_size_per_gpu is set",
                           "set at least one of them")
    return BatchConfig(train_batch_size=train, micro_batch_size=micro, gradient_accumulation_steps=accumulation)


def _deepspeed_default_gradient_clipping() -> float:
    """DeepSpeed's own default, so an unchanged config clips exactly as DeepSpeed does (1.0 in 0.19)."""
    try:
        from deepspeed.runtime.constants import GRADIENT_CLIPPING_DEFAULT
    except ImportError:
        return 0.0
    return float(GRADIENT_CLIPPING_DEFAULT)


@dataclass(kw_only=True)
class EngineConfig:
    """Everything our engine reads from a DeepSpeed config."""

    optimizer_type: str
    params: Any
    """The type's parsed params dataclass."""
    batch: BatchConfig
    world_size: int
    precision: str = "fp32"
    """Model/compute dtype: "fp32", "bf16" or "fp16" (master weights and optimizer state are always fp32)."""
    communication_dtype: str = "fp32"
    """dtype of the gradient reduce-scatter ("fp32", "bf16" or "fp16"; the all-gather uses the model dtype):
    ``communication_data_type`` when given, else the model's dtype, DeepSpeed's rule (docs/precision.md, "Precision")."""
    communication_dtype_given: bool = False
    """Whether ``communication_data_type`` was in the config (False: the dtype follows DeepSpeed's rule)."""
    accumulation_dtype: str = "fp32"
    """dtype of the round's gradient sums (``data_types.grad_accum_dtype``): fp32 by default
    (docs/precision.md, "Precision"); "bf16" (bf16 models only) saves 2 bytes per parameter, as DeepSpeed's
    bf16 default does."""
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    """Quantised reduce-scatter / all-gather (``zero_quantized_gradients`` / ``zero_quantized_weights``, or
    ``communication_data_type`` "int8" / "int4")."""
    wire: str = "fp32"
    """``"auto"`` (the engine chooses once from its measurements, runtime/wire.py) or the wire the config
    fixes: a dtype ("fp32", "bf16", "fp16"), "int8"/"int4" (both collectives compressed), or "custom"
    (ZeRO++'s keys compress one collective only)."""
    gradient_clipping: float = 0.0
    steps_per_print: Optional[int] = 10
    """None: never print (Accelerate sets it to infinity)."""
    wall_clock_breakdown: bool = False
    fp16_loss_scale: Dict[str, Any] = field(default_factory=dict)
    auto_cast: bool = False
    """``fp16.auto_cast`` under fp16: the engine's forward casts floating-point inputs to fp16, as DeepSpeed's."""
    dataloader_drop_last: bool = False
    no_effect: List[str] = field(default_factory=list)
    """Keys of the config that DeepSpeed reads and that do nothing for our types, each with why
    (:func:`no_effect_note`)."""
    raw: Dict[str, Any] = field(default_factory=dict)

    @property
    def model_torch_dtype(self) -> torch.dtype:
        return _TORCH_DTYPES[self.precision]

    @property
    def communication_torch_dtype(self) -> torch.dtype:
        return _TORCH_DTYPES[self.communication_dtype]

    @property
    def accumulation_torch_dtype(self) -> torch.dtype:
        return _TORCH_DTYPES[self.accumulation_dtype]


# ---- top-level keys ------------------------------------------------------------------------------
def _enabled(section: Any, key: str) -> bool:
    if section is None:
        return False
    if isinstance(section, bool):
        return section
    if not isinstance(section, dict):
        raise config_error(key, f"expected an object like {{\"enabled\": true}}, got {section!r}", "fix the section")
    return boolean(f"{key}.enabled", section.get("enabled", False))


def _reject_when(predicate: Callable[[Any], bool], fix: str):
    """A rule for a DeepSpeed feature our engine does not implement: fine while off, an error when on."""
    def check(key: str, value: Any) -> None:
        if predicate(value):
            raise config_error(key, f"{value!r} is not supported with deepspeed_acco's optimizer types", fix)
    return check


def _section_enabled(value: Any) -> bool:
    return bool(value) if not isinstance(value, dict) else bool(value.get("enabled", False))


def _reject_enabled(fix: str):
    """A rule for a DeepSpeed feature section ({"enabled": ...}) our engine does not implement: the error
    names ``KEY.enabled`` and says to turn it off (the rest of the section may stay)."""
    def check(key: str, value: Any) -> None:
        if not _section_enabled(value):
            return
        if isinstance(value, dict):
            raise config_error(f"{key}.enabled", "not supported with deepspeed_acco's optimizer types",
                               f"set enabled to false (or remove the section); {fix}")
        raise config_error(key, f"{value!r} is not supported with deepspeed_acco's optimizer types",
                           f"set it to false (or remove it); {fix}")
    return check


def _truthy(value: Any) -> bool:
    return bool(value)


def _accept(key: str, value: Any) -> None:
    """Keys that tune DeepSpeed's own machinery or the user's model code, not our optimizers' results."""


_OFF = "remove it (or disable it) to use deepspeed_acco's optimizers"
# key -> check(key, value); keys implemented by parse_config are listed with _accept and read there.
TOP_LEVEL_KEYS: Dict[str, Callable[[str, Any], None]] = {
    # implemented (read by parse_config)
    **{key: _accept for key in (
        "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping",
        "optimizer", "scheduler", "bf16", "bfloat16", "fp16", "steps_per_print", "wall_clock_breakdown",
        "zero_optimization", "communication_data_type", "tensorboard", "wandb", "csv_monitor", "comet",
        "dataloader_drop_last", "data_types")},
    # no effect on our optimizers' results: DeepSpeed-internal knobs, or read by the user's model code
    **{key: _accept for key in (
        "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "activation_checkpointing",
        "aio", "autotuning", "disable_python_gc", "log_level", "vocabulary_size", "legacy_fusion", "timers",
        "use_node_local_storage", "checkpoint_config", "use_data_before_expert_parallelism",
        "seq_parallel_communication_data_type")},
    "checkpoint": lambda key, value: _check_checkpoint_section(key, value),
    # DeepSpeed features that change training and that our engine does not implement
    "torch_autocast": _reject_enabled("use \"bf16\" or \"fp16\" instead of torch_autocast"),
    "data_efficiency": _reject_enabled("our optimizer types do not implement DeepSpeed's data efficiency library"),
    "hybrid_engine": _reject_enabled("our optimizer types do not implement DeepSpeed's hybrid engine"),
    "weight_quantization": _reject_when(_truthy, _OFF),
    "compile": _reject_enabled("call torch.compile on your model before initialize instead"),
    "pipeline": _reject_when(_truthy, "pipeline parallelism is not supported; remove the section"),
    "tensor_parallel": _reject_when(lambda v: isinstance(v, dict) and any(
        v.get(k, 1) not in (0, 1) for k in ("autotp_size", "tp_size")), "tensor parallelism is not supported; "
        "remove the section (our optimizers are data-parallel only)"),
    "gradient_allreduce_op": _reject_when(lambda v: str(v).lower() not in ("mean", "avg", "average"),
                                          "set it to \"mean\": every update averages the micro-batches' gradients"),
    "prescale_gradients": _reject_when(_truthy, "set it to false: our jobs average after the reduce-scatter "
                                       "(fp16 reductions are pre-divided, as DeepSpeed's)"),
    "gradient_predivide_factor": _reject_when(lambda v: v != 1.0, "set it to 1.0 (our jobs average after the "
                                              "reduce-scatter)"),
    "disable_allgather": _reject_when(_truthy, "set it to false"),
    "sequence_parallel_size": _reject_when(lambda v: v != 1, "set it to 1: sequence parallelism is not supported"),
    "expert_parallel": _reject_enabled("MoE expert parallelism is not supported"),
    "flops_profiler": _reject_enabled("profile with torch.profiler instead: our communication phases are "
                                      "labelled acco::reduce_scatter, acco::all_gather, ..."),
    "comms_logger": _reject_enabled("profile with torch.profiler instead: every collective of ours is labelled "
                                    "acco::<collective>"),
    "memory_breakdown": _reject_when(_truthy, "set it to false (not reported by our engine)"),
    "dump_state": _reject_when(_truthy, "set it to false (not reported by our engine)"),
}

# Keys that DeepSpeed itself knows; an unknown key outside this set and TOP_LEVEL_KEYS is warned
# about with the closest match. Kept as data: the names DeepSpeed 0.19 reads at the top level.
_OTHER_DEEPSPEED_KEYS = (
    "zero_optimization_stage", "memory_efficient_linear", "monitor_config", "checkpoint_parallel_write_pipeline",
    "random_ltd", "data_sampling", "managed_gradient_accumulation", "datastates_ckpt",
)

# Features DeepSpeed 0.19 removed and refuses at any value (its _REMOVED_TOP_LEVEL_CONFIG_KEYS):
# a job that switches to our types must not start without the feature it asked for either.
REMOVED_BY_DEEPSPEED = ("nebula", "compression_training", "amp", "quantize_training", "sparse_gradients",
                        "eigenvalue", "sparse_attention", "elasticity", "graph_harvesting", "curriculum_learning",
                        "progressive_layer_drop")
REMOVED_ZERO_KEYS_BY_DEEPSPEED = ("mics_shard_size", "mics_hierarchical_params_gather", "zeropp_loco_param")


def _removed_keys():
    """DeepSpeed's own tables of removed keys when it has them, else ours (the same in 0.19)."""
    try:
        from deepspeed.runtime import config as deepspeed_config
        return (tuple(deepspeed_config._REMOVED_TOP_LEVEL_CONFIG_KEYS),
                tuple(deepspeed_config._REMOVED_ZERO_CONFIG_KEYS))
    except (ImportError, AttributeError):
        return REMOVED_BY_DEEPSPEED, REMOVED_ZERO_KEYS_BY_DEEPSPEED

_ZERO_ACCEPTED = {
    "stage", "contiguous_gradients", "reduce_scatter", "reduce_bucket_size", "allgather_partitions",
    "allgather_bucket_size", "overlap_comm", "load_from_fp32_weights", "elastic_checkpoint", "sub_group_size",
    "round_robin_gradients", "ignore_unused_parameters", "legacy_stage1", "use_multi_rank_bucket_allreduce",
    "memory_efficient_linear", "log_trace_cache_warnings", "pipeline_loading_checkpoint", "override_module_apply",
    "cpu_offload", "cpu_offload_params", "cpu_offload_use_pin_memory", "offload_optimizer", "offload_param",
    "zero_quantized_weights", "zero_quantized_gradients", "zero_quantized_nontrainable_weights",
    "zero_hpz_partition_size", "mics_shard_size", "mics_hierarchical_params_gather", "ratio",
    "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold", "stage3_model_persistence_threshold",
    "stage3_max_live_parameters", "stage3_max_reuse_distance", "stage3_gather_16bit_weights_on_model_save",
    "stage3_gather_fp16_weights_on_model_save", "stage3_use_all_reduce_for_fetch_params",
    "stage3_module_granularity_threshold", "gather_16bit_weights_on_model_save", "module_granularity_threshold",
    "use_all_reduce_for_fetch_params", "prefetch_bucket_size", "param_persistence_threshold",
    "model_persistence_threshold", "max_live_parameters", "max_reuse_distance", "zeropp_loco_param",
    "log_trace_cache_warnings", "save_muon_momentum_buffer_in_memory",
}


def _check_checkpoint_section(key: str, value: Any) -> None:
    if not isinstance(value, dict):
        raise config_error(key, f"expected an object, got {value!r}", "fix the section")
    if value.get("load_universal"):
        raise config_error(f"{key}.load_universal", "universal checkpoints are not supported",
                           "remove it; our checkpoints re-shard across world sizes by themselves")


# ---- keys DeepSpeed reads that do nothing for our types (named in one start-up line) ----------------
_BUCKETS = ("each job moves whole shards, in one reduce-scatter and one all-gather from contiguous flat buffers, "
            "so there are no buckets to size")
_NOT_STAGE_1 = "ZeRO-2/3 and offload settings: our types shard like stage 1 and do not offload"
NO_EFFECT_ZERO_KEYS: Dict[str, str] = {
    **{key: _BUCKETS for key in ("reduce_bucket_size", "allgather_bucket_size", "reduce_scatter",
                                 "allgather_partitions", "contiguous_gradients", "use_multi_rank_bucket_allreduce")},
    **{key: _NOT_STAGE_1 for key in (
        "round_robin_gradients", "sub_group_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
        "stage3_model_persistence_threshold", "stage3_max_live_parameters", "stage3_max_reuse_distance",
        "stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save",
        "stage3_use_all_reduce_for_fetch_params", "stage3_module_granularity_threshold",
        "gather_16bit_weights_on_model_save", "module_granularity_threshold", "use_all_reduce_for_fetch_params",
        "prefetch_bucket_size", "param_persistence_threshold", "model_persistence_threshold", "max_live_parameters",
        "max_reuse_distance", "memory_efficient_linear", "override_module_apply", "log_trace_cache_warnings",
        "pipeline_loading_checkpoint", "cpu_offload_use_pin_memory", "ratio", "save_muon_momentum_buffer_in_memory")},
    "load_from_fp32_weights": "our checkpoints always restore the fp32 masters",
    "elastic_checkpoint": "our checkpoints re-shard across world sizes by themselves",
    "ignore_unused_parameters": "a parameter without a gradient adds zero to the update, as with DeepSpeed's default",
    "legacy_stage1": "it selects DeepSpeed's old stage-1 code",
}
"""``zero_optimization`` keys accepted at any value and without effect, with why (docs/usage.md, "Keys
without effect"). ``overlap_comm`` is decided per type (:func:`_overlap_comm_note`)."""

NO_EFFECT_TOP_LEVEL_KEYS: Dict[str, str] = {
    "zero_allow_untested_optimizer": "it lets DeepSpeed's ZeRO wrap an optimizer DeepSpeed has not tested; "
                                     "our types are not wrapped by it",
    "zero_force_ds_cpu_optimizer": _NOT_STAGE_1,
    "aio": _NOT_STAGE_1,
    "disable_python_gc": "our engine leaves Python's garbage collector as it is",
    "timers": "our engine times itself (wall_clock_breakdown, engine.time_breakdown())",
    "legacy_fusion": "our types run their own fused AdamW kernels",
}
"""Top-level keys accepted without effect, with why; named when the config enables them."""


def _overlap_comm_note(value: Any, kind: str) -> str:
    """``zero_optimization.overlap_comm``: DeepSpeed's switch for overlapping its gradient reduction with the
    backward pass. It never changes DeepSpeed's update, and it does not change ours either way
    (docs/usage.md, "Keys without effect")."""
    if kind == "ShardedAdamW":
        return "zero_optimization.overlap_comm (ShardedAdamW is synchronous by definition)"
    if value is False:
        return (f"zero_optimization.overlap_comm false ({kind} overlaps by design, with the same updates as without "
                f"overlap; set optimizer.params.overlap to false to run its jobs synchronously, for debugging)")
    return f"zero_optimization.overlap_comm ({kind} overlaps by design; optimizer.params.overlap switches it)"


def no_effect_keys(config: Dict[str, Any], kind: str, *, client_scheduler: bool = False) -> List[str]:
    """The keys of ``config`` that DeepSpeed reads and that do nothing for optimizer type ``kind``, each with why,
    grouped by reason: "key, key (why)"."""
    groups: Dict[str, List[str]] = {}
    zero = config.get("zero_optimization")
    notes = []
    if isinstance(zero, dict):
        if "overlap_comm" in zero:
            notes.append(_overlap_comm_note(zero["overlap_comm"], kind))
        for key in zero:
            if key in NO_EFFECT_ZERO_KEYS:
                groups.setdefault(NO_EFFECT_ZERO_KEYS[key], []).append(f"zero_optimization.{key}")
    for key, value in config.items():
        if key in NO_EFFECT_TOP_LEVEL_KEYS and _section_enabled(value):
            groups.setdefault(NO_EFFECT_TOP_LEVEL_KEYS[key], []).append(key)
    fp16 = config.get("fp16")
    if isinstance(fp16, dict) and fp16.get("auto_cast") is True and fp16.get("enabled") is not True:
        notes.append("fp16.auto_cast (fp16 is off: inputs are cast only under fp16)")
    bf16 = config.get("bf16", config.get("bfloat16"))
    if isinstance(bf16, dict) and "check_grad_overflow" in bf16:
        notes.append("bf16.check_grad_overflow (an update with non-finite gradients is always skipped)")
    if client_scheduler and config.get("scheduler"):
        notes.append("scheduler (the lr_scheduler passed to initialize replaces it, as in DeepSpeed)")
    return notes + [f"{', '.join(keys)} ({why})" for why, keys in groups.items()]


def no_effect_note(config: "EngineConfig") -> str:
    """The start-up log line naming the keys accepted without effect (docs/design.md, 2, "Rejected by principle"); "" when none."""
    if not config.no_effect:
        return ""
    return (f"{config.optimizer_type}: keys accepted without effect: " + "; ".join(config.no_effect))


def _closest(key: str, candidates) -> str:
    matches = difflib.get_close_matches(key, list(candidates), n=1, cutoff=0.6)
    return matches[0] if matches else ""


def check_top_level_keys(config: Dict[str, Any]) -> None:
    """Reject unsupported features; warn about unknown keys, naming the closest known one."""
    removed, removed_zero = _removed_keys()
    for key in removed:
        if key in config:
            report(config_error(key, "DeepSpeed removed this feature and our optimizer types do not implement it",
                                "remove the key from the config"))
    zero = config.get("zero_optimization")
    for key in removed_zero:
        if isinstance(zero, dict) and key in zero:
            report(config_error(f"zero_optimization.{key}", "DeepSpeed removed this feature", "remove the key"))
    known = set(TOP_LEVEL_KEYS) | set(_OTHER_DEEPSPEED_KEYS)
    for key, value in config.items():
        check = TOP_LEVEL_KEYS.get(key)
        if check is not None:
            with attempt():
                check(key, value)
        elif key not in known:
            closest = _closest(key, known)
            hint = f"; did you mean {closest!r}?" if closest else ""
            logger.warning("deepspeed_acco config: unknown top-level key %r is ignored%s", key, hint)


def _parse_zero(zero: Any, kind: str) -> Tuple[bool, bool]:
    """Check the section; return (zero_quantized_gradients, zero_quantized_weights)."""
    if zero is None:
        return False, False
    if not isinstance(zero, dict):
        raise config_error("zero_optimization", f"expected an object, got {zero!r}", "use {\"stage\": 1} or omit it")
    stage = zero.get("stage", 0)
    if stage == AUTO_WORD:
        report(config_error("zero_optimization.stage", f"\"auto\" is not a stage optimizer type {kind} takes "
                            "(Accelerate fills it with 2, which it refuses)", "set it to 1 (or 0): our optimizers "
                            "shard optimizer states like ZeRO stage 1"))
    elif stage not in (0, 1):
        report(config_error("zero_optimization.stage", f"stage {stage!r} is not supported with optimizer type {kind}",
                            "our optimizers shard optimizer states like ZeRO stage 1: set stage to 0 or 1 (or omit "
                            "it)"))
    for offload_key in ("offload_optimizer", "offload_param"):
        offload = zero.get(offload_key)
        if isinstance(offload, dict) and offload.get("device", "none") not in (None, "none"):
            report(config_error(f"zero_optimization.{offload_key}",
                                f"offloading is not supported with optimizer type {kind}", "remove the offload section"))
    for flag in ("cpu_offload", "cpu_offload_params"):
        if zero.get(flag):
            report(config_error(f"zero_optimization.{flag}", f"offloading is not supported with optimizer type {kind}",
                                "remove it"))
    if zero.get("zero_quantized_nontrainable_weights"):
        report(config_error("zero_optimization.zero_quantized_nontrainable_weights",
                            f"optimizer type {kind} never communicates frozen parameters (every rank holds them "
                            "whole), so there is nothing to quantise", "remove it (or set it to false)"))
    if zero.get("zero_hpz_partition_size", 1) != 1:
        report(config_error("zero_optimization.zero_hpz_partition_size", "hierarchical partitioning is not supported",
                            "set it to 1 (CO2's group_size averages gradients inside a group of ranks instead)"))
    unknown = sorted(set(zero) - _ZERO_ACCEPTED)
    for key in unknown:
        closest = _closest(key, _ZERO_ACCEPTED)
        hint = f"; did you mean {closest!r}?" if closest else ""
        logger.warning("deepspeed_acco config: unknown key zero_optimization.%s is ignored%s", key, hint)
    return tuple(boolean(f"zero_optimization.{flag}", zero.get(flag, False))
                 for flag in ("zero_quantized_gradients", "zero_quantized_weights"))


_FORMAT_PARAMS = ("quantization_bits", "quantization_block_size")


def _parse_compression(zero: Any, params: Any, raw_params: Dict[str, Any], communication_dtype: Optional[str],
                       kind: str, auto: bool = False) -> CompressionConfig:
    """ZeRO++'s switches with our format params (docs/wire.md, "Compressed communication"); ``communication_dtype``: the
    ``communication_data_type`` the config gives (None: not given); ``auto``: the wire is chosen by the
    engine, which may compress (the block size then applies; the bits are the choice's)."""
    gradients, weights = _parse_zero(zero, kind)
    if not (gradients or weights):
        if auto and "quantization_bits" in raw_params:
            raise config_error("optimizer.params.quantization_bits", "the wire is chosen by the engine "
                               "(communication_data_type \"auto\", the default), which picks the bits too",
                               "fix the wire instead: \"communication_data_type\": \"int8\" or \"int4\"")
        for key in _FORMAT_PARAMS:
            if key in raw_params and not (auto and key == "quantization_block_size"):
                raise config_error(f"optimizer.params.{key}", "sets the format of compressed communication, which is "
                                   "off", "set zero_optimization.zero_quantized_gradients and/or "
                                   "zero_quantized_weights to true, or remove it")
        return CompressionConfig()
    if gradients and communication_dtype not in (None, "fp32"):
        raise config_error("communication_data_type", f"{communication_dtype!r} with zero_optimization."
                           "zero_quantized_gradients: the compressed reduce-scatter quantises fp32 gradient sums and "
                           "adds what it receives in fp32", "set it to \"fp32\" or remove it (compression already "
                           "moves int8 or int4 codes)")
    return CompressionConfig(gradients=gradients, weights=weights,
                             format=QuantizationFormat(bits=params.quantization_bits,
                                                       block_size=params.quantization_block_size))


def _compressed_wire(zero: Any, params: Any, raw_params: Dict[str, Any], wire: str, kind: str) -> CompressionConfig:
    """``communication_data_type`` "int8" / "int4": both collectives compressed with that many bits."""
    gradients, weights = _parse_zero(zero, kind)
    bits = _COMPRESSED_WIRES[wire]
    if "quantization_bits" in raw_params and params.quantization_bits != bits:
        raise config_error("optimizer.params.quantization_bits", f"{params.quantization_bits} contradicts "
                           f"communication_data_type {wire!r}", "remove it (the wire names the bits)")
    if (gradients or weights) and not (gradients and weights):
        raise config_error("zero_optimization.zero_quantized_gradients", f"communication_data_type {wire!r} "
                           "compresses both the gradients and the parameters, and ZeRO++'s keys compress only one",
                           "remove zero_quantized_gradients / zero_quantized_weights (the wire covers both), or "
                           "remove communication_data_type")
    return CompressionConfig(gradients=True, weights=True,
                             format=QuantizationFormat(bits=bits, block_size=params.quantization_block_size))


def _parse_steps_per_print(value: Any) -> Optional[int]:
    if value is None or (isinstance(value, float) and value == float("inf")):
        return None  # never (Accelerate passes infinity)
    value = integer("steps_per_print", value)
    if value < 1:
        raise config_error("steps_per_print", f"must be >= 1, got {value}", "use e.g. 10")
    count_at_most("steps_per_print", value)
    return value


def _parse_fp16(section: Dict[str, Any]) -> Dict[str, Any]:
    options = {
        "loss_scale": number("fp16.loss_scale", section.get("loss_scale", 0)),
        "initial_scale_power": integer("fp16.initial_scale_power", section.get("initial_scale_power", 16)),
        "loss_scale_window": integer("fp16.loss_scale_window", section.get("loss_scale_window", 1000)),
        "hysteresis": integer("fp16.hysteresis", section.get("hysteresis", 2)),
        "min_loss_scale": number("fp16.min_loss_scale", section.get("min_loss_scale", 1)),
    }
    if options["loss_scale"] < 0:
        raise config_error("fp16.loss_scale", "must be >= 0", "use 0 for dynamic loss scaling or a positive static scale")
    if options["loss_scale_window"] < 1:
        raise config_error("fp16.loss_scale_window", "must be >= 1", "use e.g. 1000")
    if options["hysteresis"] < 1:
        raise config_error("fp16.hysteresis", "must be >= 1", "use e.g. 2")
    count_at_most("fp16.loss_scale_window", options["loss_scale_window"])
    count_at_most("fp16.hysteresis", options["hysteresis"])
    if not 0 <= options["initial_scale_power"] <= MAX_SCALE_POWER:
        raise config_error("fp16.initial_scale_power", f"must lie in [0, {MAX_SCALE_POWER}], got "
                           f"{options['initial_scale_power']}", "use e.g. 16 (DeepSpeed's default; the first loss "
                           "scale is 2**initial_scale_power, and a larger one only overflows until it has been halved)")
    boolean("fp16.auto_cast", section.get("auto_cast", False))  # implemented: EngineConfig.auto_cast
    if section.get("consecutive_hysteresis"):
        raise config_error("fp16.consecutive_hysteresis", "refilling the hysteresis after every clean update is not "
                           "implemented", "set it to false (DeepSpeed's default)")
    if section.get("fp16_master_weights_and_grads"):
        raise config_error("fp16.fp16_master_weights_and_grads", "our masters and optimizer state are always fp32",
                           "set it to false")
    _warn_unknown("fp16", section, _FP16_KEYS)
    return options


MAX_SCALE_POWER = 64
"""Upper bound of fp16.initial_scale_power (the first dynamic loss scale is 2**initial_scale_power)."""

_FP16_KEYS = {"enabled", "auto_cast", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
              "consecutive_hysteresis", "min_loss_scale", "fp16_master_weights_and_grads", "loss_scale_profile"}
_BF16_KEYS = {"enabled", "immediate_grad_update", "check_grad_overflow", "bf16_master_weights_and_grads",
              "bf16_optimizer_states"}


def _warn_unknown(section_name: str, section: Dict[str, Any], known) -> None:
    for key in sorted(set(section) - set(known)):
        closest = _closest(key, known)
        hint = f"; did you mean {closest!r}?" if closest else ""
        logger.warning("deepspeed_acco config: unknown key %s.%s is ignored%s", section_name, key, hint)


def _check_bf16(section: Any) -> None:
    if not isinstance(section, dict):
        return
    for key in ("bf16_optimizer_states", "bf16_master_weights_and_grads"):
        if section.get(key):
            raise config_error(f"bf16.{key}", "our masters and optimizer state are always fp32", "set it to false")
    _warn_unknown("bf16", section, _BF16_KEYS)


_COMPRESSED_WIRES = {"int8": 8, "int4": 4}


def _parse_communication_dtype(value: Any, precision: str) -> Optional[str]:
    """``communication_data_type`` as one of our wire names ("auto", a dtype, "int8", "int4"), or None
    when the config does not give it (docs/wire.md, "The wire")."""
    if value is None:
        return None
    text = str(value).lower()
    if text == "auto" or text in _COMPRESSED_WIRES:
        return text
    dtype = _DTYPE_NAMES.get(text)
    if dtype is None:
        raise config_error("communication_data_type", f"{value!r} is not supported by our optimizers",
                           "use \"auto\" (DPU, ACCO, CO2: chosen from the link), \"fp32\", \"bf16\", \"fp16\", "
                           "\"int8\" or \"int4\" (or remove it: the default)")
    if dtype == "fp16" and precision != "fp16":
        raise config_error("communication_data_type", f"\"fp16\" with a {precision} model: fp16 gradients stay in "
                           "range only under fp16's loss scale", "use \"bf16\" or \"fp32\", or enable fp16")
    return dtype


def resolve_wire(given: Optional[str], kind: str, compression: CompressionConfig, precision: str) -> str:
    """The wire the config asks for (docs/wire.md, "The wire"): what ``communication_data_type`` gives;
    else what ZeRO++'s keys fix; else "auto" for the overlapped types and the model's dtype for
    ShardedAdamW, which never compresses on its own."""
    if compression.enabled:
        if not (compression.gradients and compression.weights):
            return "custom"
        return f"int{compression.format.bits}"
    if given is not None:
        return given
    return precision if kind == "ShardedAdamW" else "auto"


def resolve_communication_dtype(given: Optional[str], precision: str, compressed_gradients: bool) -> str:
    """The dtype gradients are reduced in (docs/precision.md, "Precision"), DeepSpeed's rule: ``communication_data_type``
    when given, else the model's dtype (bf16 under bf16, fp16 under fp16 with the loss scale, fp32 in fp32).
    With compressed gradients the reduce-scatter quantises fp32 sums, so their buffers are fp32."""
    if given is not None:
        return given
    if compressed_gradients:
        return "fp32"
    return precision


_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def parse_config(config: Dict[str, Any], world_size: int, *, caller_sets_boundaries: bool = False,
                 client_scheduler: bool = False, param_group_count: Optional[int] = None) -> EngineConfig:
    """Validate a DeepSpeed config that selects one of our optimizer types; raise one ValueError naming every
    mistake, one line each (a single mistake: its own message).

    ``caller_sets_boundaries``: the HF Trainer or Accelerate drive the engine (they pass accelerate's
    ``DummyOptim``) and decide where each update ends; ``client_scheduler``: a scheduler passed to
    ``initialize`` replaces the config's section, which is then not checked (as DeepSpeed ignores it);
    ``param_group_count``: the model's parameter groups, for the scheduler's per-group lists."""
    section = config.get("optimizer")
    schedule_class = lookup(section.get("type")) if isinstance(section, dict) else None
    if schedule_class is None:
        raise ValueError("deepspeed_acco config: optimizer.type: not one of ours "
                         f"({', '.join(type_names())}); other types are DeepSpeed's to build")
    kind = schedule_class.type_name
    raw_params = section.get("params", {}) or {}
    with collecting():
        for key in sorted(set(section) - {"type", "params"}):
            report(config_error(f"optimizer.{key}", "unknown key", "keep only \"type\" and \"params\""))
        with attempt():
            check_top_level_keys(config)
        params = batch = None
        before = problems_so_far()
        with attempt():
            params = parse_params(schedule_class.Params, raw_params, kind)
        params_valid = params is not None and problems_so_far() == before
        unfilled = [key for key in _BATCH_KEYS if config.get(key) == AUTO_WORD]
        for key in unfilled:
            report(unfilled_auto_error(key))
        if not unfilled:
            with attempt():
                batch = resolve_batch_sizes(config, world_size)
                source = "config" if "gradient_accumulation_steps" in config else \
                    "derived" if config.get("train_batch_size") is not None and \
                    config.get("train_micro_batch_size_per_gpu") is not None else "default"
                batch = dataclasses.replace(batch, accumulation_source=source,
                                            caller_sets_boundaries=caller_sets_boundaries)
        if params is not None and batch is not None:
            with attempt():
                schedule_class.validate_config(params, batch, world_size)

        precision, fp16_loss_scale, auto_cast = "fp32", {}, False
        with attempt():
            _check_bf16(config.get("bf16", config.get("bfloat16")))
        with attempt():
            bf16 = _enabled(config.get("bf16", config.get("bfloat16")), "bf16")
            fp16 = _enabled(config.get("fp16"), "fp16")
            if bf16 and fp16:
                raise config_error("fp16", "both fp16 and bf16 are enabled", "enable at most one of them")
            precision = "bf16" if bf16 else "fp16" if fp16 else "fp32"
            if fp16:
                fp16_loss_scale = _parse_fp16(config["fp16"])
                auto_cast = bool(config["fp16"].get("auto_cast", False))

        given = communication_dtype = None
        compression = CompressionConfig()
        wire = "fp32"
        with attempt():
            given = _parse_communication_dtype(config.get("communication_data_type"), precision)
            if given == "auto" and kind == "ShardedAdamW":
                raise config_error("communication_data_type", "\"auto\" chooses a compressed wire where the link "
                                   "needs one, and ShardedAdamW, the synchronous baseline, never compresses on its own",
                                   "remove it (the model's dtype), or fix a wire: \"bf16\", \"fp32\", \"int8\", "
                                   "\"int4\"")
        if params_valid:  # the format params (quantization_bits, ...) are read only when valid
            with attempt():
                if given in _COMPRESSED_WIRES:
                    compression = _compressed_wire(config.get("zero_optimization"), params, raw_params, given, kind)
                else:
                    compression = _parse_compression(config.get("zero_optimization"), params, raw_params,
                                                     None if given == "auto" else given, kind,
                                                     auto=given == "auto" or (given is None and kind != "ShardedAdamW"))
                    if given == "auto" and compression.enabled:
                        raise config_error("communication_data_type", "\"auto\" lets the engine choose the wire, and "
                                           "zero_optimization.zero_quantized_gradients / zero_quantized_weights fix it",
                                           "remove one of the two")
        else:
            with attempt():
                _parse_zero(config.get("zero_optimization"), kind)
        if given in _COMPRESSED_WIRES or given == "auto":
            wire = resolve_wire(given if given == "auto" else None, kind, compression, precision)
            given = None
        else:
            wire = resolve_wire(given, kind, compression, precision)
        communication_dtype = resolve_communication_dtype(given, precision, compression.gradients)
        accumulation_dtype = "fp32"
        with attempt():
            data_types = config.get("data_types") or {}
            given_accumulation = data_types.get("grad_accum_dtype") if isinstance(data_types, dict) else None
            accumulation_dtype = "fp32" if given_accumulation is None else \
                _DTYPE_NAMES.get(str(given_accumulation).lower())
            if accumulation_dtype not in ("fp32", "bf16") or (accumulation_dtype == "bf16" and precision != "bf16"):
                raise config_error("data_types.grad_accum_dtype",
                                   f"{given_accumulation!r} with a {precision} model: our engine accumulates gradients "
                                   "in fp32, or in bf16 for a bf16 model", "set it to \"fp32\", to \"bf16\" with "
                                   "bf16.enabled, or remove it")

        clipping, steps_per_print, wall_clock, drop_last = 0.0, 10, False, False
        with attempt():
            clipping = number("gradient_clipping",
                              config.get("gradient_clipping", _deepspeed_default_gradient_clipping()))
            if clipping < 0:
                raise config_error("gradient_clipping", f"must be >= 0, got {clipping}", "use 0 to disable clipping")
        with attempt():
            steps_per_print = _parse_steps_per_print(config.get("steps_per_print", 10))
        with attempt():
            wall_clock = boolean("wall_clock_breakdown", config.get("wall_clock_breakdown", False))
        with attempt():
            drop_last = boolean("dataloader_drop_last", config.get("dataloader_drop_last", False))
        if not client_scheduler:
            with attempt():
                check_scheduler_section(config.get("scheduler"), param_group_count=param_group_count)
    # Past this point the config has no problem (collecting() raised otherwise).
    return EngineConfig(optimizer_type=kind, params=params, batch=batch, world_size=world_size, precision=precision,
                        communication_dtype=communication_dtype, communication_dtype_given=given is not None,
                        accumulation_dtype=accumulation_dtype,
                        compression=compression, wire=wire,
                        gradient_clipping=clipping,
                        steps_per_print=steps_per_print,
                        wall_clock_breakdown=wall_clock,
                        fp16_loss_scale=fp16_loss_scale,
                        auto_cast=auto_cast,
                        dataloader_drop_last=drop_last,
                        no_effect=no_effect_keys(config, kind, client_scheduler=client_scheduler),
                        raw=copy.deepcopy(config))
