"""DeepSpeed config keys that our optimizer types accept and ignore (docs/design.md, section 2, "Config",
"Rejected by principle").

A key that changes what a DeepSpeed user expects must be implemented or rejected with the usual
``ValueError`` naming the key and the fix, before torch.distributed is initialised. Unknown
top-level keys (a typo) get a warning that names the closest known key. Keys at their default
values, and keys that only tune DeepSpeed's own machinery, stay accepted: HF / Accelerate write
full configs, and a config that works with DeepSpeed ZeRO-1 must keep working when only the
optimizer type changes.

When a key below gets implemented, move its case out of the rejection lists and give it a test of
its behaviour.
"""
import copy
import logging
import warnings

import pytest
import torch
import torch.distributed as dist

import deepspeed_acco
from deepspeed_acco.runtime.config import parse_config

BASE = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 2,
    "optimizer": {"type": "ACCO", "params": {"lr": 1e-3}},
}


def with_keys(optimizer_type="ACCO", **sections):
    config = copy.deepcopy(BASE)
    config["optimizer"]["type"] = optimizer_type
    config.update(copy.deepcopy(sections))
    return config


def assert_rejected(config, key):
    model = torch.nn.Linear(3, 2)
    with pytest.raises(ValueError) as error:
        deepspeed_acco.initialize(model=model, model_parameters=model.parameters(), config=config)
    message = str(error.value)
    assert key in message, f"the message does not name {key!r}: {message}"
    assert ";" in message, f"the message gives no fix: {message}"
    assert not dist.is_initialized(), "validation must happen before torch.distributed is initialised"


# ---- compressed communication (docs/design.md, 3.7) ------
# DeepSpeed's ZeRO++ switches, with our format under optimizer.params. How the engine then trains
# is tested in tests/test_compressed_training.py; here: what each config turns on, and the errors.
ZERO_PLUS_PLUS = {"zero_quantized_gradients": True, "zero_quantized_weights": True}


@pytest.mark.parametrize("optimizer_type", ["ShardedAdamW", "DPU", "ACCO", "CO2"])
def test_zero_quantized_keys_turn_on_int8_compression_for_every_type(optimizer_type):
    off = parse_config(with_keys(optimizer_type), world_size=2).compression
    assert not off.enabled and not off.gradients and not off.weights
    both = parse_config(with_keys(optimizer_type, zero_optimization=dict(ZERO_PLUS_PLUS, stage=1)), world_size=2)
    assert (both.compression.gradients, both.compression.weights) == (True, True)
    assert (both.compression.format.bits, both.compression.format.block_size) == (8, 128)  # true means int8
    assert both.communication_dtype == "fp32"
    for key in ZERO_PLUS_PLUS:
        alone = parse_config(with_keys(optimizer_type, zero_optimization={key: True}), world_size=2).compression
        assert (alone.gradients, alone.weights) == (key == "zero_quantized_gradients", key == "zero_quantized_weights")


def test_quantization_format_params_and_the_bench_fragment():
    config = with_keys(zero_optimization=ZERO_PLUS_PLUS)
    config["optimizer"]["params"].update(quantization_bits=4, quantization_block_size=32)
    compression = parse_config(config, world_size=2).compression
    assert (compression.format.bits, compression.format.block_size) == (4, 32)
    # The fragment tools merge into a config (the bench's +q4) means the same thing.
    from deepspeed_acco.runtime.compression import compression_config
    fragment = compression_config(bits=4, block_size=256)
    merged = with_keys("DPU", zero_optimization=dict(fragment["zero_optimization"], stage=1))
    merged["optimizer"]["params"].update(fragment["optimizer"]["params"])
    compression = parse_config(merged, world_size=3).compression
    assert (compression.gradients, compression.weights, compression.format.bits, compression.format.block_size) == \
        (True, True, 4, 256)
    with pytest.raises(ValueError, match="bits"):
        compression_config(bits=2)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("block_size", [32, 128, 512])
def test_bytes_per_value_for_the_bench_bound(bits, block_size):
    from deepspeed_acco.runtime.compression import QuantizationFormat, job_wire_bytes
    fmt = QuantizationFormat(bits=bits, block_size=block_size)
    numel = 1 << 20  # whole blocks, no padding: the long-chunk rate
    assert fmt.packed_bytes(numel) == numel * fmt.bytes_per_value
    # A flat vector of 4 * numel values on 4 ranks: each rank sends 3 chunks per collective.
    per_job = job_wire_bytes(4 * numel, 4, fmt)
    assert per_job == {"reduce_scatter": 3 * numel * fmt.bytes_per_value, "all_gather": 3 * numel * fmt.bytes_per_value}
    assert job_wire_bytes(4 * numel, 4, None)["all_gather"] / per_job["all_gather"] == 4 / fmt.bytes_per_value
    if block_size >= 128:  # docs/kernels.md's table: 3.88x and 7.53x at block 128
        assert 4 / fmt.bytes_per_value >= (3.5 if bits == 8 else 7.5)


def _with_params(zero, **params):
    config = with_keys(zero_optimization=zero)
    config["optimizer"]["params"].update(params)
    return config


COMPRESSION_MISTAKES = [
    ("optimizer.params.quantization_bits", _with_params(ZERO_PLUS_PLUS, quantization_bits=2)),
    ("optimizer.params.quantization_bits", _with_params(ZERO_PLUS_PLUS, quantization_bits=8.0)),
    ("optimizer.params.quantization_block_size", _with_params(ZERO_PLUS_PLUS, quantization_block_size=100)),
    ("optimizer.params.quantization_block_size", _with_params(ZERO_PLUS_PLUS, quantization_block_size=16)),
    ("optimizer.params.quantization_block_size", _with_params(ZERO_PLUS_PLUS, quantization_block_size=1024)),
    # A format for communication that is not compressed: the user expects int4 and would get fp32.
    ("optimizer.params.quantization_bits", _with_params({"zero_quantized_gradients": False}, quantization_bits=4)),
    ("optimizer.params.quantization_block_size", _with_params({}, quantization_block_size=64)),
    # The compressed reduce-scatter quantises fp32 sums; a bf16 reduce-scatter cannot be quantised too.
    ("communication_data_type", dict(with_keys(zero_optimization={"zero_quantized_gradients": True}),
                                     communication_data_type="bf16")),
    ("zero_optimization.zero_quantized_gradients", with_keys(zero_optimization={"zero_quantized_gradients": "yes"})),
    ("zero_optimization.zero_quantized_weights", with_keys(zero_optimization={"zero_quantized_weights": 1})),
    # Still unsupported: frozen parameters are never communicated; hierarchical partitioning.
    ("zero_optimization.zero_quantized_nontrainable_weights",
     with_keys(zero_optimization=dict(ZERO_PLUS_PLUS, zero_quantized_nontrainable_weights=True))),
    ("zero_optimization.zero_hpz_partition_size", with_keys(zero_optimization=dict(ZERO_PLUS_PLUS,
                                                                                   zero_hpz_partition_size=2))),
]


@pytest.mark.parametrize("key, config", COMPRESSION_MISTAKES, ids=[f"{i}-{case[0]}" for i, case in
                                                                   enumerate(COMPRESSION_MISTAKES)])
def test_compression_mistakes_are_rejected_naming_the_key(key, config):
    assert_rejected(config, key)


def test_bf16_communication_stays_allowed_with_compressed_weights_only():
    config = dict(with_keys(zero_optimization={"zero_quantized_weights": True}), communication_data_type="bf16")
    parsed = parse_config(config, world_size=2)
    assert parsed.communication_dtype == "bf16" and parsed.compression.weights and not parsed.compression.gradients
# ---- end of compressed communication -------------------------------------------------------


# Top-level keys DeepSpeed 0.19 itself rejects as removed features (its
# ``_REMOVED_TOP_LEVEL_CONFIG_KEYS``): a job that switches to our types must not start training
# without the feature it asked for.
REMOVED_BY_DEEPSPEED = [
    ("amp", {"enabled": True, "opt_level": "O1"}),
    ("nebula", {"enabled": True}),
    ("compression_training", {"weight_quantization": {"shared_parameters": {"enabled": True}}}),
    ("quantize_training", {"enabled": True}),
    ("sparse_gradients", True),
    ("eigenvalue", {"enabled": True}),
    ("sparse_attention", {"mode": "fixed"}),
    ("elasticity", {"enabled": True, "max_train_batch_size": 64, "micro_batch_sizes": [2]}),
    ("graph_harvesting", True),
    ("curriculum_learning", {"enabled": True}),
    ("progressive_layer_drop", {"enabled": True}),
]


@pytest.mark.parametrize("key, value", REMOVED_BY_DEEPSPEED, ids=[case[0] for case in REMOVED_BY_DEEPSPEED])
def test_features_deepspeed_removed_are_rejected(key, value):
    assert_rejected(with_keys(**{key: value}), key)


# Keys that change the training math or what the job does, which our engine does not implement:
# (the key the message must name, the config sections that turn it on).
CHANGES_BEHAVIOUR = [
    ("gradient_allreduce_op", {"gradient_allreduce_op": "sum"}),  # DeepSpeed sums instead of averaging
    ("torch_autocast", {"torch_autocast": {"enabled": True, "dtype": "bfloat16"}}),
    ("fp16.auto_cast", {"fp16": {"enabled": True, "auto_cast": True}}),
    ("fp16.consecutive_hysteresis", {"fp16": {"enabled": True, "consecutive_hysteresis": True}}),
    ("fp16.fp16_master_weights_and_grads", {"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}}),
    ("bf16.bf16_master_weights_and_grads", {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}}),
    ("bf16.bf16_optimizer_states", {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True,
                                             "bf16_optimizer_states": True}}),
    # bf16 accumulation is implemented for bf16 models (tests/test_memory.py); fp16, or bf16 under fp32, is not.
    ("data_types.grad_accum_dtype", {"fp16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp16"}}),
    ("data_types.grad_accum_dtype", {"data_types": {"grad_accum_dtype": "bf16"}}),
    ("zero_optimization.cpu_offload", {"zero_optimization": {"stage": 1, "cpu_offload": True}}),  # legacy offload
    ("zero_optimization.zero_hpz_partition_size", {"zero_optimization": {"stage": 1, "zero_hpz_partition_size": 2}}),
    ("checkpoint.load_universal", {"checkpoint": {"load_universal": True}}),
    ("tensor_parallel", {"tensor_parallel": {"autotp_size": 2}}),
    ("sequence_parallel_size", {"sequence_parallel_size": 2}),
]


@pytest.mark.parametrize("key, sections", CHANGES_BEHAVIOUR, ids=[case[0] for case in CHANGES_BEHAVIOUR])
def test_behaviour_changing_keys_are_rejected_unless_implemented(key, sections):
    assert_rejected(with_keys(**sections), key)


# A config as HF / Accelerate write it for ZeRO-1: every key at its default or only tuning
# DeepSpeed's machinery. It must be accepted, with no unknown-key warning.
FULL_DEFAULTS = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 2,
    "optimizer": {"type": "ACCO", "params": {"lr": 1e-3}},
    "gradient_clipping": 1.0,
    "steps_per_print": 100,
    "wall_clock_breakdown": False,
    "prescale_gradients": False,
    "gradient_predivide_factor": 1.0,
    "gradient_allreduce_op": "mean",
    "communication_data_type": "fp32",
    "fp16": {"enabled": False, "auto_cast": False, "loss_scale": 0, "initial_scale_power": 16,
             "loss_scale_window": 1000, "hysteresis": 2, "consecutive_hysteresis": False, "min_loss_scale": 1},
    "bf16": {"enabled": False},
    "torch_autocast": {"enabled": False},
    "data_types": {"grad_accum_dtype": "fp32"},
    "zero_optimization": {"stage": 1, "allgather_partitions": True, "allgather_bucket_size": 2e8,
                          "overlap_comm": True, "reduce_scatter": True, "reduce_bucket_size": 2e8,
                          "contiguous_gradients": True, "round_robin_gradients": False,
                          "zero_quantized_gradients": False, "zero_quantized_weights": False,
                          "offload_optimizer": {"device": "none"}},
    "checkpoint": {"load_universal": False},
    "zero_allow_untested_optimizer": True,
    "flops_profiler": {"enabled": False},
    "activation_checkpointing": {"partition_activations": False},
    "tensorboard": {"enabled": False},
    "csv_monitor": {"enabled": False},
    "comms_logger": {"enabled": False},
    "dataloader_drop_last": False,
    "memory_breakdown": False,
}


class _Messages(logging.Handler):
    def __init__(self):
        super().__init__(level=logging.DEBUG)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def parse_and_collect_warnings(config):
    """Parse ``config`` for two ranks; return every warning raised or logged meanwhile."""
    handler = _Messages()
    loggers = [logging.getLogger(), logging.getLogger("DeepSpeed.acco"), logging.getLogger("DeepSpeed")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.addHandler(handler)
        logger.setLevel(logging.DEBUG)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            parse_config(config, world_size=2)
    finally:
        for logger, level in zip(loggers, levels):
            logger.removeHandler(handler)
            logger.setLevel(level)
    return [str(w.message) for w in caught] + handler.messages


def test_keys_at_their_defaults_are_accepted_without_warnings():
    messages = parse_and_collect_warnings(FULL_DEFAULTS)
    unknown = [m for m in messages if "unknown" in m.lower() or "did you mean" in m.lower()]
    assert not unknown, unknown


def test_a_misspelt_top_level_key_warns_with_the_closest_known_key():
    config = with_keys(gradient_clippping=0.5)
    messages = parse_and_collect_warnings(config)
    naming = [m for m in messages if "gradient_clippping" in m and "gradient_clipping" in m.replace(
        "gradient_clippping", "")]
    assert naming, f"no warning names the misspelt key and 'gradient_clipping': {messages}"
    # Another typo, another suggestion: the warning is computed, not canned.
    messages = parse_and_collect_warnings(with_keys(train_micro_batch_size_per_gp=2))
    assert any("train_micro_batch_size_per_gp" in m and "train_micro_batch_size_per_gpu" in m for m in messages), \
        messages
