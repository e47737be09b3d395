"""DeepSpeed config keys that our optimizer types accept and ignore (docs/design.md, section 2,
"Rejected by principle"; the lists: docs/usage.md, "Every key: ranges, honoured, refused").

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


# ---- compressed communication (docs/wire.md, "Compressed communication") ------
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
    # A format for communication that is not compressed: the user expects int4 and would get fp32. (Under
    # "auto", the default wire of DPU, ACCO and CO2, the bits are the engine's choice; the block size applies.)
    ("optimizer.params.quantization_bits", _with_params({"zero_quantized_gradients": False}, quantization_bits=4)),
    ("optimizer.params.quantization_block_size", dict(_with_params({}, quantization_block_size=64),
                                                      communication_data_type="bf16")),
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


# ---- DeepSpeed's Adam/AdamW parameters (docs/usage.md, "From DeepSpeed's AdamW") ------------------
# A DeepSpeed config whose "AdamW" becomes one of our types keeps its optimizer params: each is
# honoured or refused with the reason (deepspeed_acco/runtime/optimizers/params.py).
from deepspeed_acco.runtime.optimizers import params as optimizer_params  # noqa: E402

OUR_TYPES = ["ShardedAdamW", "DPU", "ACCO", "CO2"]
EXAMPLES = __import__("pathlib").Path(__file__).resolve().parent.parent / "examples" / "configs"


def _adam_config(optimizer_type="ACCO", **params):
    config = with_keys(optimizer_type)
    config["optimizer"]["params"].update(weight_decay=0.1, **params)
    return config


@pytest.mark.parametrize("optimizer_type", OUR_TYPES)
def test_the_deepspeed_adamw_example_switches_by_its_type_alone(optimizer_type):
    """examples/configs/zero1.json is DeepSpeed's own AdamW with torch_adam; only the type changes."""
    import json
    config = json.loads((EXAMPLES / "zero1.json").read_text())
    assert config["optimizer"]["params"]["torch_adam"] is True
    config["optimizer"]["type"] = optimizer_type
    parsed = parse_config(config, world_size=2).params
    assert (parsed.lr, parsed.betas, parsed.eps, parsed.weight_decay) == (1e-3, (0.9, 0.95), 1e-8, 0.1)


@pytest.mark.parametrize("key, value", [("torch_adam", True), ("torch_adam", False), ("fused", True),
                                        ("fused", None), ("foreach", False), ("capturable", False),
                                        ("differentiable", False), ("set_grad_none", True)])
def test_implementation_selectors_are_accepted_with_one_note(monkeypatch, key, value):
    monkeypatch.setattr(optimizer_params, "_noted", set())
    plain = parse_config(_adam_config(), world_size=2).params
    messages = parse_and_collect_warnings(_adam_config(**{key: value}))
    notes = {m for m in messages if f"optimizer.params.{key}" in m}  # the helper's handlers may see it twice
    assert len(notes) == 1 and "no effect" in notes.pop(), messages
    assert parse_config(_adam_config(**{key: value}), world_size=2).params == plain
    assert not [m for m in parse_and_collect_warnings(_adam_config(**{key: value})) if key in m], "noted twice"


@pytest.mark.parametrize("optimizer_type", OUR_TYPES)
def test_math_params_at_adamws_values_are_honoured(optimizer_type):
    """Our update is AdamW with bias correction, no AMSGrad, minimising, fp32 state: these values say so."""
    plain = parse_config(_adam_config(optimizer_type), world_size=2).params
    same = dict(adam_w_mode=True, bias_correction=True, amsgrad=False, maximize=False, fp32_optimizer_states=True)
    assert parse_config(_adam_config(optimizer_type, **same), world_size=2).params == plain


MATH_CHANGERS = [
    ("adam_w_mode", False, "Adam with L2"),
    ("bias_correction", False, "bias correction"),
    ("amsgrad", True, "AMSGrad"),
    ("maximize", True, "ascends"),
    ("fp32_optimizer_states", False, "always fp32"),
    ("max_grad_norm", 1.0, "gradient_clipping"),
    ("torch_adam", "yes", "true or false"),
    ("amsgrad", 0, "true or false"),
]


@pytest.mark.parametrize("optimizer_type", OUR_TYPES)
@pytest.mark.parametrize("key, value, reason", MATH_CHANGERS, ids=[f"{k}={v!r}" for k, v, _ in MATH_CHANGERS])
def test_params_that_change_the_math_are_refused_with_the_reason(optimizer_type, key, value, reason):
    with pytest.raises(ValueError, match=rf"optimizer\.params\.{key}: .*{reason}.*;") as error:
        parse_config(_adam_config(optimizer_type, **{key: value}), world_size=2)
    assert any(fix in str(error.value).rpartition(";")[2] for fix in ("remove it", "move the value", "set it"))
    assert_rejected(_adam_config(optimizer_type, **{key: value}), f"optimizer.params.{key}")


def test_adam_w_mode_false_without_weight_decay_is_the_same_update():
    """Adam with L2 and AdamW differ only in the decay: with weight_decay 0 the config is accepted, and the
    update equals torch's Adam (DeepSpeed's adam_w_mode false) to rounding."""
    config = _adam_config(adam_w_mode=False)
    with pytest.raises(ValueError, match=r'"weight_decay": 0'):
        parse_config(config, world_size=2)
    config["optimizer"]["params"]["weight_decay"] = 0.0
    params = parse_config(config, world_size=2).params
    from deepspeed_acco.ops import reference
    generator = torch.Generator().manual_seed(0)
    start = torch.randn(7, generator=generator)
    theirs = torch.nn.Parameter(start.clone())
    adam = torch.optim.Adam([theirs], lr=params.lr, betas=params.betas, eps=params.eps, weight_decay=0.0)
    ours, exp_avg, exp_avg_sq = start.clone(), torch.zeros(7), torch.zeros(7)
    for step in range(1, 4):
        grad = torch.randn(7, generator=generator)
        theirs.grad = grad.clone()
        adam.step()
        reference.adamw_step(ours, grad, exp_avg, exp_avg_sq, step=step, lr=params.lr, beta1=params.betas[0],
                             beta2=params.betas[1], eps=params.eps, weight_decay=params.weight_decay)
    torch.testing.assert_close(ours, theirs.detach(), rtol=0, atol=1e-6)


def test_the_deepspeed_params_list_matches_deepspeeds_adam_signatures():
    """Every keyword DeepSpeed's FusedAdam, DeepSpeedCPUAdam and torch's AdamW take (the classes DeepSpeed
    builds for "Adam"/"AdamW") is one of ours or in the honoured-or-refused table: a new DeepSpeed
    parameter fails here until it is decided."""
    import inspect
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
    ours = {item.name for item in __import__("dataclasses").fields(optimizer_params.AdamWParams)}
    taken = set()
    for cls in (FusedAdam, DeepSpeedCPUAdam, torch.optim.AdamW):
        taken |= set(inspect.signature(cls.__init__).parameters) - {"self", "params", "model_params"}
    renamed = {"adamw_mode"}  # DeepSpeedCPUAdam's name; DeepSpeed fills it from adam_w_mode
    undecided = taken - ours - optimizer_params.DEEPSPEED_ADAM_PARAMS - renamed
    assert not undecided, f"DeepSpeed's Adam accepts {sorted(undecided)}: honour or refuse them in params.py"
    assert {"torch_adam", "adam_w_mode", "fp32_optimizer_states"} <= optimizer_params.DEEPSPEED_ADAM_PARAMS


@pytest.mark.parametrize("micro, fix", [(8, '"train_micro_batch_size_per_gpu": 4 and "gradient_accumulation_steps": 2'),
                                        (3, '"gradient_accumulation_steps": 2')])
def test_acco_with_accumulation_1_names_the_two_line_fix(micro, fix):
    """1 is DeepSpeed's and the HF Trainer's default accumulation: the error keeps the samples per update."""
    config = {"train_micro_batch_size_per_gpu": micro, "optimizer": {"type": "ACCO", "params": {"lr": 1e-3}}}
    with pytest.raises(ValueError, match="gradient_accumulation_steps: .*got 1 .*default") as error:
        parse_config(config, world_size=2)
    assert fix in str(error.value) and "--gradient_accumulation_steps 2" in str(error.value)
    if micro % 2 == 0:  # the fix as written parses, with the same samples per update
        fixed = dict(config, train_micro_batch_size_per_gpu=micro // 2, gradient_accumulation_steps=2)
        assert parse_config(fixed, world_size=2).batch.train_batch_size == micro * 2
