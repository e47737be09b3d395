"""Config validation (docs/failures.md): every invalid value of every key we own raises ValueError naming
the key, before torch.distributed is initialised or any collective runs."""
import copy

import pytest
import torch
import torch.distributed as dist

import deepspeed_acco
from deepspeed_acco.runtime.config import parse_config, resolve_batch_sizes
from deepspeed_acco.runtime.optimizers.acco import ACCOParams
from deepspeed_acco.runtime.optimizers.co2 import CO2Params

BASE = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 2,
    "optimizer": {"type": "ACCO", "params": {"lr": 1e-3}},
}


def with_changes(optimizer_type="ACCO", params=None, **top_level):
    config = copy.deepcopy(BASE)
    config["optimizer"]["type"] = optimizer_type
    config["optimizer"]["params"].update(params or {})
    for key, value in top_level.items():
        if value is _DELETE:
            config.pop(key, None)
        else:
            config[key] = value
    return config


_DELETE = object()

# (case id, config, the key the message must name)
INVALID = [
    ("unknown-param", with_changes(params={"momentum": 0.9}), "optimizer.params.momentum"),
    ("unknown-section-key", {**BASE, "optimizer": {"type": "ACCO", "params": {}, "extra": 1}}, "optimizer.extra"),
    ("params-not-object", {**BASE, "optimizer": {"type": "ACCO", "params": [1]}}, "optimizer.params"),
    ("negative-lr", with_changes(params={"lr": -1e-3}), "optimizer.params.lr"),
    ("zero-lr", with_changes(params={"lr": 0.0}), "optimizer.params.lr"),
    ("string-lr", with_changes(params={"lr": "fast"}), "optimizer.params.lr"),
    ("nan-lr", with_changes(params={"lr": float("nan")}), "optimizer.params.lr"),
    ("betas-length", with_changes(params={"betas": [0.9]}), "optimizer.params.betas"),
    ("betas-range", with_changes(params={"betas": [0.9, 1.0]}), "optimizer.params.betas"),
    ("eps-zero", with_changes(params={"eps": 0.0}), "optimizer.params.eps"),
    ("weight-decay-negative", with_changes(params={"weight_decay": -0.1}), "optimizer.params.weight_decay"),
    ("overlap-not-bool", with_changes(params={"overlap": "yes"}), "optimizer.params.overlap"),
    ("timeout-zero", with_changes(params={"communication_timeout_s": 0}), "optimizer.params.communication_timeout_s"),
    ("dynamic-not-bool", with_changes(params={"dynamic_accumulation": 1}), "optimizer.params.dynamic_accumulation"),
    ("acco-odd-accumulation", with_changes(gradient_accumulation_steps=3), "gradient_accumulation_steps"),
    ("dynamic-on-dpu", with_changes("DPU", params={"dynamic_accumulation": True}),
     "optimizer.params.dynamic_accumulation"),
    ("co2-param-on-acco", with_changes(params={"local_steps": 4}), "optimizer.params.local_steps"),
    ("local-steps-zero", with_changes("CO2", params={"local_steps": 0}), "optimizer.params.local_steps"),
    ("local-steps-float", with_changes("CO2", params={"local_steps": 2.5}), "optimizer.params.local_steps"),
    ("outer-lr-zero", with_changes("CO2", params={"outer_lr": 0}), "optimizer.params.outer_lr"),
    ("outer-momentum-one", with_changes("CO2", params={"outer_momentum": 1.0}), "optimizer.params.outer_momentum"),
    ("outer-momentum-negative", with_changes("CO2", params={"outer_momentum": -0.1}),
     "optimizer.params.outer_momentum"),
    ("gap-penalty-zero", with_changes("CO2", params={"gap_penalty": 0}), "optimizer.params.gap_penalty"),
    ("gap-penalty-word", with_changes("CO2", params={"gap_penalty": "auto"}), "optimizer.params.gap_penalty"),
    ("clip-negative", with_changes("CO2", params={"clip_threshold": -1}), "optimizer.params.clip_threshold"),
    ("group-size-zero", with_changes("CO2", params={"group_size": 0}), "optimizer.params.group_size"),
    ("group-size-not-divisor", with_changes("CO2", params={"group_size": 2}), "optimizer.params.group_size"),
    ("merge-steps-negative", with_changes("CO2", params={"anchor_merge_steps": -1}),
     "optimizer.params.anchor_merge_steps"),
    ("warmup-auto-on-co2", with_changes("CO2", params={"warmup_sync_updates": "auto"}),
     "optimizer.params.warmup_sync_updates"),
    ("warmup-word", with_changes(params={"warmup_sync_updates": "sixth"}), "optimizer.params.warmup_sync_updates"),
    ("communication-fp16-without-fp16", with_changes(communication_data_type="fp16", bf16={"enabled": True}),
     "communication_data_type"),
    ("merge-steps-past-round", with_changes("CO2", params={"anchor_merge_steps": 13}),
     "optimizer.params.anchor_merge_steps"),
    ("merge-with-adaptive-penalty", with_changes("CO2", params={"anchor_merge_steps": 1, "gap_penalty": "adaptive"}),
     "optimizer.params.gap_penalty"),
    ("nesterov-not-bool", with_changes("CO2", params={"outer_nesterov": "yes"}), "optimizer.params.outer_nesterov"),
    ("warmup-negative", with_changes(params={"warmup_sync_updates": -1}), "optimizer.params.warmup_sync_updates"),
    ("warmup-on-sharded", with_changes("ShardedAdamW", params={"warmup_sync_updates": 2}),
     "optimizer.params.warmup_sync_updates"),
    ("cooldown-not-after-warmup", with_changes(params={"warmup_sync_updates": 5, "sync_after_updates": 5}),
     "optimizer.params.sync_after_updates"),
    ("cooldown-not-int", with_changes(params={"sync_after_updates": 2.5}), "optimizer.params.sync_after_updates"),
    ("cooldown-on-co2", with_changes("CO2", params={"sync_after_updates": 10}), "optimizer.params.sync_after_updates"),
    ("zero-stage-2", with_changes(zero_optimization={"stage": 2}), "zero_optimization.stage"),
    ("zero-stage-3", with_changes(zero_optimization={"stage": 3}), "zero_optimization.stage"),
    ("zero-offload", with_changes(zero_optimization={"stage": 1, "offload_optimizer": {"device": "cpu"}}),
     "zero_optimization.offload_optimizer"),
    ("batch-inconsistent", with_changes(train_batch_size=7), "train_batch_size"),
    ("micro-batch-zero", with_changes(train_micro_batch_size_per_gpu=0), "train_micro_batch_size_per_gpu"),
    ("accumulation-negative", with_changes(gradient_accumulation_steps=-2), "gradient_accumulation_steps"),
    ("no-batch-size", with_changes(train_micro_batch_size_per_gpu=_DELETE), "train_batch_size"),
    ("fp16-and-bf16", with_changes(fp16={"enabled": True}, bf16={"enabled": True}), "fp16"),
    ("bf16-enabled-not-bool", with_changes(bf16={"enabled": "true"}), "bf16.enabled"),
    ("fp16-negative-scale", with_changes(fp16={"enabled": True, "loss_scale": -1}), "fp16.loss_scale"),
    ("communication-dtype", with_changes(communication_data_type="fp8"), "communication_data_type"),
    ("clipping-negative", with_changes(gradient_clipping=-1.0), "gradient_clipping"),
    ("steps-per-print-zero", with_changes(steps_per_print=0), "steps_per_print"),
    ("wall-clock-not-bool", with_changes(wall_clock_breakdown="on"), "wall_clock_breakdown"),
]


@pytest.mark.parametrize("case, config, key", INVALID, ids=[case[0] for case in INVALID])
def test_invalid_config_raises_value_error_naming_the_key(case, config, key):
    model = torch.nn.Linear(3, 2)
    with pytest.raises(ValueError) as error:
        deepspeed_acco.initialize(model=model, model_parameters=model.parameters(), config=config)
    message = str(error.value)
    assert key in message, f"{case}: message does not name {key!r}: {message}"
    assert ";" in message, f"{case}: message gives no fix: {message}"
    assert not dist.is_initialized(), "validation must happen before torch.distributed is initialised"


def test_other_input_mistakes():
    model = torch.nn.Linear(3, 2)
    with pytest.raises(ValueError, match="optimizer"):
        deepspeed_acco.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=BASE)
    with pytest.raises(ValueError, match="appears twice"):
        deepspeed_acco.initialize(model=model, model_parameters=[{"params": [model.weight]},
                                                                 {"params": [model.weight, model.bias]}], config=BASE)
    with pytest.raises(ValueError, match="not a parameter of the model"):
        deepspeed_acco.initialize(model=model, model_parameters=[torch.nn.Parameter(torch.zeros(2))], config=BASE)
    with pytest.raises(ValueError, match="does not exist"):
        deepspeed_acco.initialize(model=model, config="/nonexistent/ds_config.json")
    with pytest.raises(ValueError, match="config"):
        deepspeed_acco.initialize(model=model)
    assert not dist.is_initialized()


def test_defaults_follow_torch_adamw_and_the_design():
    parsed = parse_config(BASE, world_size=2)
    assert isinstance(parsed.params, ACCOParams)
    adamw = torch.optim.AdamW([torch.zeros(1, requires_grad=True)]).defaults
    assert parsed.params.lr == 1e-3 and parsed.params.betas == adamw["betas"]
    assert parsed.params.eps == adamw["eps"] and parsed.params.weight_decay == adamw["weight_decay"]
    assert parsed.params.overlap is True and parsed.params.dynamic_accumulation is False
    co2 = parse_config(with_changes("co2"), world_size=4).params  # type names are case-insensitive
    assert isinstance(co2, CO2Params)
    assert (co2.local_steps, co2.outer_lr, co2.outer_momentum, co2.gap_penalty, co2.clip_threshold,
            co2.group_size) == (4, 0.5, 0.0, 1.0, None, 1)  # docs/design.md 3.5: eager merge, local_steps 4
    assert (co2.anchor_merge_steps, co2.outer_nesterov, co2.normalize_by_inner_lr, co2.warmup_sync_updates) == \
        (1, False, False, 0)
    assert parsed.params.warmup_sync_updates == "auto" and parsed.params.sync_after_updates is None
    # ACCO's odd accumulation is fine with dynamic accumulation.
    parse_config(with_changes(params={"dynamic_accumulation": True}, gradient_accumulation_steps=3), world_size=2)


@pytest.mark.parametrize("given, expected", [
    (dict(train_batch_size=32, train_micro_batch_size_per_gpu=4), (32, 4, 4)),
    (dict(train_batch_size=32, gradient_accumulation_steps=2), (32, 8, 2)),
    (dict(train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2), (16, 4, 2)),
    (dict(train_micro_batch_size_per_gpu=4), (8, 4, 1)),
    (dict(train_batch_size=8), (8, 4, 1)),
])
def test_batch_size_triangle_like_deepspeed(given, expected):
    batch = resolve_batch_sizes(given, data_parallel_size=2)
    assert (batch.train_batch_size, batch.micro_batch_size, batch.gradient_accumulation_steps) == expected


def test_co2_warns_when_the_outer_rule_is_outside_its_stable_range():
    import logging

    class Records(logging.Handler):
        def __init__(self):
            super().__init__()
            self.messages = []

        def emit(self, record):
            self.messages.append(record.getMessage())

    handler = Records()
    logger = logging.getLogger("DeepSpeed.acco")
    logger.addHandler(handler)
    try:
        parse_config(with_changes("CO2"), world_size=2)  # the defaults are stable
        assert not [m for m in handler.messages if "stable range" in m]
        # The CO2 paper's outer lr 1 and momentum 0.5, applied one round late (its rule,
        # anchor_merge_steps 0), are past the edge.
        parse_config(with_changes("CO2", params={"outer_lr": 1.0, "outer_momentum": 0.5, "gap_penalty": 1.0,
                                                 "anchor_merge_steps": 0}), world_size=2)
        assert [m for m in handler.messages if "stable range" in m and "one round late" in m]
        # Merged within the round the same numbers are stable (the synchronous rule's range).
        handler.messages.clear()
        parse_config(with_changes("CO2", params={"outer_lr": 1.0, "outer_momentum": 0.5, "gap_penalty": 1.0,
                                                 "anchor_merge_steps": 1}), world_size=2)
        assert not [m for m in handler.messages if "stable range" in m]
    finally:
        logger.removeHandler(handler)
