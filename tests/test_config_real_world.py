"""Real-world-shaped DeepSpeed configs switched to each of our types (docs/usage.md, "From DeepSpeed's AdamW"):
each is accepted, or refused in one round with every problem named, and applying the fix each line
gives is enough for the next start.

The configs are written here in the shape of public ones: the HF Trainer's ZeRO-1 and ZeRO-2 configs
("auto" everywhere, filled by transformers' own ``HfTrainerDeepSpeedConfig`` from ``TrainingArguments``
and by accelerate's ``DeepSpeedPlugin`` for the mixed precision, as the Trainer does), LLaMA-Factory-like
ZeRO-0/1/2 configs (no optimizer section: the type is added with "auto" params), and
DeepSpeedExamples-like CIFAR and GPT configs (DeepSpeed's Adam, WarmupLR, WarmupDecayLR, OneCycle).
"""
import copy
import json
import pathlib
import re

import pytest

from deepspeed_acco.runtime.config import parse_config

OUR_TYPES = ["ShardedAdamW", "DPU", "ACCO", "CO2"]
EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples" / "configs"

HF_ZERO1 = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "zero_optimization": {"stage": 1, "allgather_partitions": True, "allgather_bucket_size": 2e8,
                          "overlap_comm": True, "reduce_scatter": True, "reduce_bucket_size": 2e8,
                          "contiguous_gradients": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}

HF_ZERO2 = {
    **copy.deepcopy(HF_ZERO1),
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                      "warmup_num_steps": "auto", "total_num_steps": "auto"}},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "allgather_partitions": True, "allgather_bucket_size": 2e8, "overlap_comm": True,
                          "reduce_scatter": True, "reduce_bucket_size": 2e8, "contiguous_gradients": True},
}

LLAMA_FACTORY_BASE = {
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto", "zero_allow_untested_optimizer": True,
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
}
_LF_ZERO = {"allgather_partitions": True, "allgather_bucket_size": 5e8, "overlap_comm": False, "reduce_scatter": True,
            "reduce_bucket_size": 5e8, "contiguous_gradients": True, "round_robin_gradients": True}
LLAMA_FACTORY_ZERO0 = {**LLAMA_FACTORY_BASE, "zero_optimization": {"stage": 0, **_LF_ZERO}}
LLAMA_FACTORY_ZERO2 = {**LLAMA_FACTORY_BASE, "zero_optimization": {"stage": 2, **_LF_ZERO}}
LLAMA_FACTORY_ZERO2_OFFLOAD = {**LLAMA_FACTORY_BASE, "zero_optimization": {
    "stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}, **_LF_ZERO}}

EXAMPLES_CIFAR = {
    "train_batch_size": 16, "steps_per_print": 2000,
    "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 3e-7}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001,
                                                 "warmup_num_steps": 1000}},
    "gradient_clipping": 1.0, "prescale_gradients": False,
    "bf16": {"enabled": True},
    "fp16": {"enabled": False, "fp16_master_weights_and_grads": False, "loss_scale": 0, "loss_scale_window": 500,
             "hysteresis": 2, "min_loss_scale": 1, "initial_scale_power": 15},
    "wall_clock_breakdown": False,
    "zero_optimization": {"stage": 0, "allgather_partitions": True, "reduce_scatter": True,
                          "allgather_bucket_size": 5e7, "reduce_bucket_size": 5e7, "overlap_comm": True,
                          "contiguous_gradients": True, "cpu_offload": False},
}

EXAMPLES_GPT = {
    "train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 10,
    "optimizer": {"type": "Adam", "params": {"lr": 1.5e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1.5e-4,
                                                      "warmup_num_steps": 375, "total_num_steps": 3000}},
    "gradient_clipping": 1.0, "prescale_gradients": False,
    "fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 500, "hysteresis": 2, "min_loss_scale": 1,
             "initial_scale_power": 12},
    "zero_optimization": {"stage": 1, "reduce_bucket_size": 5e8, "allgather_bucket_size": 5e8},
    "activation_checkpointing": {"partition_activations": False, "contiguous_memory_optimization": False},
    "wall_clock_breakdown": True,
    "flops_profiler": {"enabled": True, "profile_step": 10, "module_depth": -1, "top_modules": 3, "detailed": True},
    "comms_logger": {"enabled": True, "verbose": False, "prof_all": True},
}

EXAMPLES_ONE_CYCLE = {
    "train_batch_size": 64, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 4,
    "steps_per_print": 100,
    "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "weight_decay": 0.01}},
    "scheduler": {"type": "OneCycle", "params": {
        "cycle_first_step_size": 1000, "cycle_first_stair_count": 500, "cycle_second_step_size": 1000,
        "cycle_second_stair_count": 500, "decay_step_size": 1000, "cycle_min_lr": 0.0001, "cycle_max_lr": 0.001,
        "decay_lr_rate": 0.001, "cycle_min_mom": 0.85, "cycle_max_mom": 0.99, "decay_mom_rate": 0.0}},
    "bf16": {"enabled": True},
}

# A config a user got wrong in several places at once: every line in one round.
EXAMPLES_GPT_BROKEN = {
    "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3,
    "optimizer": {"type": "AdamW", "params": {"lr": 6e-4, "betas": [0.9, 0.95], "weight_decay": 0.1,
                                              "max_grad_norm": 1.0}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 1000.0, "warmup_max_lr": 6e-4}},
    "zero_optimization": {"stage": 2, "overlap_comm": True},
    "comms_logger": {"enabled": True},
}


# ---- filling "auto" as the HF Trainer and Accelerate do ---------------------------------------------------
class _Model:
    class config:
        hidden_size = 64


def hf_filled(config, tmp_path, *, precision="no", micro=4, accumulation=2, warmup_steps=0, max_steps=120):
    """``config`` after the HF Trainer's filling (transformers' HfTrainerDeepSpeedConfig with these
    TrainingArguments) and Accelerate's mixed-precision step (DeepSpeedPlugin.set_mixed_precision, which
    inserts ``{"enabled": true, "auto_cast": true}`` under fp16 when the config has no fp16 section)."""
    from accelerate.utils import DeepSpeedPlugin
    from transformers import TrainingArguments
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=micro,
                             gradient_accumulation_steps=accumulation, learning_rate=3e-5, weight_decay=0.01,
                             warmup_steps=warmup_steps, max_steps=max_steps, fp16=precision == "fp16",
                             bf16=precision == "bf16", use_cpu=True, report_to=[])
    filling = HfTrainerDeepSpeedConfig(copy.deepcopy(config))
    filling.trainer_config_process(args)
    plugin = DeepSpeedPlugin(hf_ds_config=filling)
    plugin.set_mixed_precision(precision)
    filling.trainer_config_finalize(args, _Model(), max_steps)
    return copy.deepcopy(plugin.deepspeed_config)


def switched(config, optimizer_type):
    """``config`` with our type: the optimizer section's type changed, or one added with "auto" params."""
    result = copy.deepcopy(config)
    section = result.setdefault("optimizer", {"params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                          "weight_decay": "auto"}})
    section["type"] = optimizer_type
    return result


def problem_keys(error):
    lines = str(error).splitlines()
    lines = lines[1:] if len(lines) > 1 else [lines[0].removeprefix("deepspeed_acco config: ")]
    return sorted(line.strip().split(": ", 1)[0] for line in lines)


# ---- the fixes the messages name, applied as a user would ----------------------------------------------------
def _fix(config, key, line):
    """``config`` after the fix that ``line`` (the message's line for ``key``) names."""
    if key == "zero_optimization.stage":
        config["zero_optimization"]["stage"] = 1
    elif key == "zero_optimization.offload_optimizer":
        del config["zero_optimization"]["offload_optimizer"]
    elif key in ("flops_profiler.enabled", "comms_logger.enabled"):
        config[key.split(".")[0]]["enabled"] = False
    elif key == "scheduler.params.total_num_steps":
        config["scheduler"]["params"]["total_num_steps"] = 10_000
    elif key == "scheduler.params.warmup_num_steps":
        config["scheduler"]["params"]["warmup_num_steps"] = int(config["scheduler"]["params"]["warmup_num_steps"])
    elif key == "optimizer.params.max_grad_norm":
        config["gradient_clipping"] = config["optimizer"]["params"].pop("max_grad_norm")
    elif key == "gradient_accumulation_steps":
        two_lines = re.search(r'"train_micro_batch_size_per_gpu": (\d+) and "gradient_accumulation_steps": 2', line)
        if two_lines:  # keeps the samples per update, so train_batch_size stays consistent
            config["train_micro_batch_size_per_gpu"] = int(two_lines.group(1))
            config["gradient_accumulation_steps"] = 2
        else:
            assert "use an even number" in line, line
            config["gradient_accumulation_steps"] += 1
    else:
        raise AssertionError(f"no fix known for {key}")
    return config


# (case, the config switched to a type, filled as its launcher fills it: builder(tmp_path, type), world size,
# under the HF Trainer, {type: the keys refused})
_STAGE_AND_OFFLOAD = ["zero_optimization.offload_optimizer", "zero_optimization.stage"]


def _hf(config, **arguments):
    return lambda tmp, kind: hf_filled(switched(config, kind), tmp, **arguments)


def _plain(config):
    return lambda tmp, kind: switched(config, kind)


CASES = [
    ("hf-zero1", _hf(HF_ZERO1), 1, True, {}),
    ("hf-zero1-bf16-accumulation-1", _hf(HF_ZERO1, precision="bf16", accumulation=1), 1, True,
     {"ACCO": ["gradient_accumulation_steps"]}),
    ("hf-zero2-offload", _hf(HF_ZERO2, warmup_steps=20), 1, True, {kind: _STAGE_AND_OFFLOAD for kind in OUR_TYPES}),
    ("hf-acco-example-fp16", _hf(json.loads((EXAMPLES / "hf_acco.json").read_text()), precision="fp16"), 1, True, {}),
    ("llama-factory-zero0-fp16", _hf(LLAMA_FACTORY_ZERO0, precision="fp16"), 1, True, {}),
    ("llama-factory-zero2-bf16", _hf(LLAMA_FACTORY_ZERO2, precision="bf16"), 1, True,
     {kind: ["zero_optimization.stage"] for kind in OUR_TYPES}),
    ("llama-factory-zero2-offload", _hf(LLAMA_FACTORY_ZERO2_OFFLOAD, precision="bf16", accumulation=1), 1, True,
     {**{kind: _STAGE_AND_OFFLOAD for kind in OUR_TYPES},
      "ACCO": _STAGE_AND_OFFLOAD + ["gradient_accumulation_steps"]}),
    ("examples-cifar", _plain(EXAMPLES_CIFAR), 1, False, {"ACCO": ["gradient_accumulation_steps"]}),
    ("examples-gpt", _plain(EXAMPLES_GPT), 2, False,
     {kind: ["comms_logger.enabled", "flops_profiler.enabled"] for kind in OUR_TYPES}),
    ("examples-one-cycle", _plain(EXAMPLES_ONE_CYCLE), 2, False, {}),
    ("examples-gpt-broken", _plain(EXAMPLES_GPT_BROKEN), 2, False,
     {**{kind: ["comms_logger.enabled", "optimizer.params.max_grad_norm", "scheduler.params.total_num_steps",
                "scheduler.params.warmup_num_steps", "zero_optimization.stage"] for kind in OUR_TYPES},
      "ACCO": ["comms_logger.enabled", "gradient_accumulation_steps", "optimizer.params.max_grad_norm",
               "scheduler.params.total_num_steps", "scheduler.params.warmup_num_steps", "zero_optimization.stage"]}),
]


@pytest.mark.parametrize("optimizer_type", OUR_TYPES)
@pytest.mark.parametrize("case, build, world_size, under_hf, refused", CASES, ids=[case[0] for case in CASES])
def test_real_world_configs_are_accepted_or_refused_in_one_round(tmp_path, case, build, world_size, under_hf, refused,
                                                                 optimizer_type):
    config = build(tmp_path, optimizer_type)
    options = dict(caller_sets_boundaries=under_hf)
    expected = sorted(refused.get(optimizer_type, []))
    if not expected:
        parse_config(config, world_size, **options)
        return
    with pytest.raises(ValueError) as error:
        parse_config(config, world_size, **options)
    assert problem_keys(error.value) == expected, str(error.value)
    message = str(error.value)
    if "gradient_accumulation_steps" in expected:  # dynamic accumulation is offered only outside the HF Trainer
        assert ("dynamic_accumulation" in message) is (not under_hf), message
    # One round: the fixes the lines name make the config start.
    lines = message.splitlines()[1:] or [message.removeprefix("deepspeed_acco config: ")]
    for line in lines:
        config = _fix(config, line.strip().split(": ", 1)[0], line)
    parse_config(config, world_size, **options)


def test_our_hf_example_under_fp16_casts_the_inputs():
    """Accelerate inserts fp16 with auto_cast for `--fp16` when the config has no fp16 section (docs/hf.md)."""
    import tempfile
    with tempfile.TemporaryDirectory() as directory:
        config = hf_filled(json.loads((EXAMPLES / "hf_acco.json").read_text()), directory, precision="fp16")
    assert config["fp16"] == {"enabled": True, "auto_cast": True}
    parsed = parse_config(config, 1, caller_sets_boundaries=True)
    assert parsed.precision == "fp16" and parsed.auto_cast


def test_llama_factorys_overlap_comm_false_is_named_at_start():
    import tempfile
    with tempfile.TemporaryDirectory() as directory:
        parsed = parse_config(hf_filled(switched(LLAMA_FACTORY_ZERO0, "ACCO"), directory), 1,
                              caller_sets_boundaries=True)
    text = "; ".join(parsed.no_effect)
    assert "zero_optimization.overlap_comm false (ACCO overlaps by design" in text
    assert "zero_optimization.round_robin_gradients (ZeRO-2/3 and offload settings" in text
    assert "zero_allow_untested_optimizer (" in text
