"""One pass over the config (docs/design.md, 2, "One pass"; docs/usage.md, "Config mistakes"): the parser checks the
whole config, the ``scheduler`` section included, before torch.distributed is initialised, and reports
every problem in one ``ValueError``, one line each with its key path and fix; a config with one problem
gets that problem's own message. Also: ``fp16.auto_cast``, the start-up line naming the keys accepted
without effect, and the wording of the accumulation and profiler refusals.

Real-world-shaped configs switched to each type are in tests/test_config_real_world.py."""
import copy
import logging

import pytest
import torch
import torch.distributed as dist

import deepspeed_acco
from deepspeed_acco.runtime.config import no_effect_keys, no_effect_note, parse_config
from distributed_utils import run_distributed

BASE = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 2,
    "optimizer": {"type": "ACCO", "params": {"lr": 1e-3}},
}


def with_changes(optimizer_type="ACCO", params=None, **top_level):
    config = copy.deepcopy(BASE)
    config["optimizer"]["type"] = optimizer_type
    config["optimizer"]["params"].update(params or {})
    config.update(copy.deepcopy(top_level))
    return config


def problem_lines(error: ValueError):
    """The lines of a several-problem message (without its header), or the one message."""
    text = str(error)
    lines = text.splitlines()
    if len(lines) == 1:
        return [text.removeprefix("deepspeed_acco config: ")]
    assert lines[0].startswith("deepspeed_acco config: ") and "problems" in lines[0], lines[0]
    return [line.strip() for line in lines[1:]]


def problem_keys(error: ValueError):
    return [line.split(": ", 1)[0] for line in problem_lines(error)]


def refused(config, world_size=2, **options):
    with pytest.raises(ValueError) as error:
        parse_config(config, world_size, **options)
    return error.value


# ---- every problem at once ------------------------------------------------------------------------
def test_every_problem_of_a_config_is_named_in_one_error_one_line_each():
    config = with_changes(params={"lr": -1.0, "eps": 0.0, "momentum": 0.9, "max_grad_norm": 1.0},
                          gradient_accumulation_steps=3,
                          zero_optimization={"stage": 2, "offload_optimizer": {"device": "cpu"}},
                          scheduler={"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10}},
                          flops_profiler={"enabled": True, "profile_step": 1},
                          gradient_clipping=-1.0)
    error = refused(config)
    assert set(problem_keys(error)) == {
        "optimizer.params.lr", "optimizer.params.eps", "optimizer.params.momentum", "optimizer.params.max_grad_norm",
        "gradient_accumulation_steps", "zero_optimization.stage", "zero_optimization.offload_optimizer",
        "scheduler.params.total_num_steps", "flops_profiler.enabled", "gradient_clipping"}, str(error)
    assert str(error).startswith("deepspeed_acco config: 10 problems; fix them all, then start again:\n")
    for line in problem_lines(error):
        assert "; " in line, f"no fix: {line}"  # "key: problem; fix"
    assert not dist.is_initialized()


def test_a_single_problem_keeps_its_own_message():
    error = refused(with_changes(params={"lr": -1.0}))
    assert str(error) == ("deepspeed_acco config: optimizer.params.lr: must be > 0, got -1.0; set a positive "
                          "learning rate, e.g. 1e-3")
    error = refused(with_changes(zero_optimization={"stage": 2}))
    assert str(error).startswith("deepspeed_acco config: zero_optimization.stage: stage 2 is not supported")
    assert "\n" not in str(error)


def test_a_key_is_named_once_even_when_two_checks_read_it():
    # An unfilled "auto" is refused where it is read, once per key, with the HF fix.
    config = with_changes(params={"lr": "auto", "betas": "auto"}, train_micro_batch_size_per_gpu="auto",
                          gradient_clipping="auto")
    error = refused(config)
    keys = problem_keys(error)
    assert sorted(keys) == sorted(set(keys)) == sorted(["optimizer.params.lr", "optimizer.params.betas",
                                                        "train_micro_batch_size_per_gpu", "gradient_clipping"])
    assert all("\"auto\" was not filled in" in line and "HF Trainer and Accelerate" in line
               for line in problem_lines(error)), str(error)


def test_the_errors_come_before_any_process_group():
    model = torch.nn.Linear(3, 2)
    config = with_changes(gradient_accumulation_steps=3,
                          scheduler={"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10}})
    with pytest.raises(ValueError) as error:
        deepspeed_acco.initialize(model=model, model_parameters=model.parameters(), config=config)
    assert set(problem_keys(error.value)) == {"gradient_accumulation_steps", "scheduler.params.total_num_steps"}
    assert not dist.is_initialized()


# ---- the scheduler section --------------------------------------------------------------------------
SCHEDULER_MISTAKES = [
    # (case, section, the keys named)
    ("decay-without-horizon", {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 100}},
     ["scheduler.params.total_num_steps"]),
    ("cosine-without-horizon", {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 100}},
     ["scheduler.params.total_num_steps"]),
    ("onecycle-without-range", {"type": "OneCycle", "params": {"cycle_first_step_size": 100}},
     ["scheduler.params.cycle_max_lr", "scheduler.params.cycle_min_lr"]),
    ("unknown-type", {"type": "WarmupLinearLR", "params": {}}, ["scheduler.type"]),
    ("not-a-scheduler-class", {"type": "Optimizer", "params": {}}, ["scheduler.type"]),
    ("unknown-param", {"type": "WarmupLR", "params": {"warmup_num_steps": 10, "total_num_steps": 100}},
     ["scheduler.params.total_num_steps"]),
    ("float-steps", {"type": "WarmupLR", "params": {"warmup_num_steps": 1000.0}}, ["scheduler.params.warmup_num_steps"]),
    ("zero-steps", {"type": "WarmupLR", "params": {"warmup_num_steps": 0}}, ["scheduler.params.warmup_num_steps"]),
    ("negative-lr", {"type": "WarmupLR", "params": {"warmup_max_lr": -1e-3}}, ["scheduler.params.warmup_max_lr"]),
    ("warmup-type", {"type": "WarmupCosineLR", "params": {"total_num_steps": 100, "warmup_type": "cosine"}},
     ["scheduler.params.warmup_type"]),
    ("unfilled-auto", {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto", "warmup_num_steps": "auto"}},
     ["scheduler.params.total_num_steps", "scheduler.params.warmup_num_steps"]),
    ("range-test-step", {"type": "LRRangeTest", "params": {"lr_range_test_step_size": -5}},
     ["scheduler.params.lr_range_test_step_size"]),
    ("torch-missing", {"type": "StepLR", "params": {"gamma": 0.5}}, ["scheduler.params.step_size"]),
    ("torch-unknown", {"type": "StepLR", "params": {"step_size": 10, "warmup": 5}}, ["scheduler.params.warmup"]),
    ("torch-refuses", {"type": "OneCycleLR", "params": {"max_lr": 1e-3}}, ["scheduler.params"]),
    ("params-not-object", {"type": "WarmupLR", "params": [1, 2]}, ["scheduler.params"]),
    ("extra-key", {"type": "WarmupLR", "params": {}, "frequency": 1}, ["scheduler.frequency"]),
    ("not-an-object", "WarmupLR", ["scheduler"]),
]


@pytest.mark.parametrize("case, section, keys", SCHEDULER_MISTAKES, ids=[case[0] for case in SCHEDULER_MISTAKES])
def test_scheduler_mistakes_are_named_with_their_key_path(case, section, keys):
    error = refused(with_changes(scheduler=section))
    assert sorted(problem_keys(error)) == sorted(keys), str(error)


def test_the_missing_horizon_says_what_it_is_and_how_to_set_it():
    error = refused(with_changes(scheduler={"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10}}))
    assert str(error) == ("deepspeed_acco config: scheduler.params.total_num_steps: missing; WarmupDecayLR needs it: "
                          "the updates of the whole run, over which the learning rate decays; set it to the run's "
                          "number of updates (under the HF Trainer, \"auto\" fills in its steps)")


VALID_SCHEDULERS = [
    {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-3, "warmup_num_steps": 1000}},
    {"type": "WarmupDecayLR", "params": {"total_num_steps": 720, "warmup_num_steps": 10, "warmup_type": "linear"}},
    {"type": "WarmupCosineLR", "params": {"total_num_steps": 720, "warmup_num_steps": 10, "cos_min_ratio": 0.1}},
    {"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_first_step_size": 1000,
                                    "cycle_first_stair_count": 500, "cycle_second_step_size": 1000,
                                    "cycle_second_stair_count": 500, "decay_step_size": 1000, "decay_lr_rate": 0.001,
                                    "cycle_min_mom": 0.85, "cycle_max_mom": 0.99, "decay_mom_rate": 0.0}},
    {"type": "LRRangeTest", "params": {"lr_range_test_min_lr": 1e-5, "lr_range_test_step_size": 200,
                                       "lr_range_test_step_rate": 5, "lr_range_test_staircase": False}},
    {"type": "StepLR", "params": {"step_size": 100, "gamma": 0.5}},
    {"type": "WarmupLR"},  # every parameter at DeepSpeed's default
]


@pytest.mark.parametrize("section", VALID_SCHEDULERS, ids=[section["type"] for section in VALID_SCHEDULERS])
def test_valid_scheduler_sections_are_accepted(section):
    parse_config(with_changes(scheduler=section), 2)


def test_per_group_lists_are_checked_against_the_models_parameter_groups():
    section = {"type": "WarmupLR", "params": {"warmup_min_lr": [0, 0], "warmup_max_lr": [1e-3, 1e-4],
                                              "warmup_num_steps": 10}}
    parse_config(with_changes(scheduler=section), 2, param_group_count=2)
    error = refused(with_changes(scheduler=section), param_group_count=3)
    assert problem_keys(error) == ["scheduler.params"] and "expected 3" in str(error), str(error)
    # Through initialize: the model's groups are counted before the config is parsed.
    model = torch.nn.Linear(3, 2)
    with pytest.raises(ValueError, match=r"scheduler\.params: WarmupLR refuses them"):
        deepspeed_acco.initialize(model=model, model_parameters=[{"params": [model.weight]}, {"params": [model.bias]},
                                                                 ], config=with_changes(scheduler=dict(
                                                                     section, params=dict(section["params"],
                                                                                          warmup_min_lr=[0, 0, 0]))))
    assert not dist.is_initialized()


def test_a_scheduler_passed_to_initialize_replaces_the_section_unchecked():
    """As in DeepSpeed: the client's scheduler wins and the section is not read; the start-up line names it."""
    config = with_changes(scheduler={"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10}})
    parsed = parse_config(config, 2, client_scheduler=True)
    assert any(line.startswith("scheduler (the lr_scheduler passed to initialize replaces it") for line in
               parsed.no_effect)


# ---- messages -------------------------------------------------------------------------------------------
def test_the_accumulation_message_says_default_only_when_the_key_is_absent():
    absent = str(refused({"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "ACCO"}}))
    assert "got 1 (DeepSpeed's default when the key is absent)" in absent
    written = str(refused({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
                           "optimizer": {"type": "ACCO"}}))
    assert "got 1;" in written and "default" not in written
    derived = str(refused({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4,
                           "optimizer": {"type": "ACCO"}}))
    assert "got 1 (train_batch_size / (train_micro_batch_size_per_gpu 4 x 2 data-parallel ranks))" in derived
    odd = str(refused(with_changes(gradient_accumulation_steps=3)))
    assert "got 3;" in odd and "default" not in odd


def test_dynamic_accumulation_is_offered_only_outside_the_hf_trainer_and_accelerate():
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "optimizer": {"type": "ACCO"}}
    assert "optimizer.params.dynamic_accumulation to true" in str(refused(config))
    under_hf = str(refused(config, caller_sets_boundaries=True))
    assert "dynamic_accumulation" not in under_hf and "--gradient_accumulation_steps 2" in under_hf
    # Asked for under them, it is refused at once instead of at the first backward.
    dynamic = with_changes(params={"dynamic_accumulation": True})
    parse_config(dynamic, 2)
    error = refused(dynamic, caller_sets_boundaries=True)
    assert problem_keys(error) == ["optimizer.params.dynamic_accumulation"], str(error)
    assert "set_gradient_accumulation_boundary" in str(error) and "set it to false" in str(error)


def test_the_dummy_optim_tells_initialize_that_the_caller_sets_the_boundaries():
    from accelerate.utils import DummyOptim
    model = torch.nn.Linear(3, 2)
    config = with_changes(params={"dynamic_accumulation": True})
    with pytest.raises(ValueError, match="optimizer.params.dynamic_accumulation: the HF Trainer and Accelerate"):
        deepspeed_acco.initialize(model=model, optimizer=DummyOptim(model.parameters()), config=config)
    assert not dist.is_initialized()


@pytest.mark.parametrize("key", ["flops_profiler", "comms_logger"])
def test_profiler_refusals_say_set_enabled_to_false(key):
    section = {"enabled": True, "profile_step": 1, "module_depth": -1, "top_modules": 1, "detailed": True}
    message = str(refused(with_changes(**{key: section})))
    assert message.startswith(f"deepspeed_acco config: {key}.enabled: not supported")
    assert "set enabled to false" in message and "profile_step" not in message, message


# ---- fp16.auto_cast ---------------------------------------------------------------------------------------
def test_auto_cast_is_accepted_under_fp16():
    parsed = parse_config(with_changes(fp16={"enabled": True, "auto_cast": True}), 2)
    assert parsed.auto_cast and parsed.precision == "fp16"
    assert not parse_config(with_changes(fp16={"enabled": True}), 2).auto_cast
    off = parse_config(with_changes(fp16={"enabled": False, "auto_cast": True}), 2)
    assert not off.auto_cast and any(line.startswith("fp16.auto_cast (fp16 is off") for line in off.no_effect)
    assert problem_keys(refused(with_changes(fp16={"enabled": True, "auto_cast": "yes"}))) == ["fp16.auto_cast"]


def test_cast_floating_casts_floating_tensors_through_containers_only():
    from collections import namedtuple
    from deepspeed_acco.runtime.engine import cast_floating
    Pair = namedtuple("Pair", "x y")
    ids = torch.arange(3)
    inputs = (torch.zeros(2), [torch.ones(1, dtype=torch.float64), ids], {"m": torch.zeros(1)}, Pair(torch.zeros(1), 3),
              "text", None)
    cast = cast_floating(inputs, torch.float16)
    assert cast[0].dtype == cast[1][0].dtype == cast[2]["m"].dtype == cast[3].x.dtype == torch.float16
    assert cast[1][1] is ids and isinstance(cast[3], Pair) and cast[3].y == 3 and cast[4:] == ("text", None)
    assert isinstance(cast[1], list) and isinstance(cast, tuple)


# ---- keys accepted without effect ---------------------------------------------------------------------------
def test_keys_without_effect_are_named_with_why():
    zero = {"stage": 1, "overlap_comm": True, "reduce_bucket_size": 5e8, "allgather_bucket_size": 5e8,
            "contiguous_gradients": True, "round_robin_gradients": True, "sub_group_size": 1e9,
            "stage3_max_live_parameters": 1e9, "zero_quantized_gradients": False}
    config = with_changes(zero_optimization=zero, zero_allow_untested_optimizer=True)
    lines = parse_config(config, 2).no_effect
    text = "; ".join(lines)
    assert "zero_optimization.overlap_comm (ACCO overlaps by design" in text
    assert ("zero_optimization.reduce_bucket_size, zero_optimization.allgather_bucket_size, "
            "zero_optimization.contiguous_gradients (each job moves whole shards") in text
    assert ("zero_optimization.round_robin_gradients, zero_optimization.sub_group_size, "
            "zero_optimization.stage3_max_live_parameters (ZeRO-2/3 and offload settings") in text
    assert "zero_allow_untested_optimizer (" in text
    named = {name.strip() for line in lines for name in line.split(" (")[0].split(",")}
    assert not named & {"zero_optimization.stage", "zero_optimization.zero_quantized_gradients"}  # these act
    note = no_effect_note(parse_config(config, 2))
    assert note.startswith("ACCO: keys accepted without effect: ") and "\n" not in note
    assert no_effect_note(parse_config(BASE, 2)) == ""


@pytest.mark.parametrize("kind", ["DPU", "ACCO", "CO2"])
def test_overlap_comm_false_is_named_for_the_overlapped_types(kind):
    """LLaMA-Factory's ZeRO-0 config writes it. DeepSpeed's overlap_comm never changes an update; neither does
    our overlap, so the type keeps overlapping and the line says how to turn it off (docs/usage.md)."""
    config = with_changes(kind, zero_optimization={"stage": 0, "overlap_comm": False})
    parsed = parse_config(config, 2)
    assert parsed.params.overlap is True
    line = [line for line in parsed.no_effect if line.startswith("zero_optimization.overlap_comm")]
    assert line == [f"zero_optimization.overlap_comm false ({kind} overlaps by design, with the same updates as "
                    f"without overlap; set optimizer.params.overlap to false to run its jobs synchronously, for "
                    f"debugging)"]
    sharded = no_effect_keys(with_changes("ShardedAdamW", zero_optimization={"overlap_comm": False}), "ShardedAdamW")
    assert sharded == ["zero_optimization.overlap_comm (ShardedAdamW is synchronous by definition)"]


# ---- the engine: auto_cast in forward, and the start-up line -----------------------------------------------
class _Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append((record.levelno, record.getMessage()))


class _Probe(torch.nn.Module):
    """Records the dtypes its forward receives; its loss needs only elementwise fp16 arithmetic."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.full((4,), 0.5))
        self.seen = None

    def forward(self, x, pair, ids, scale=None):
        self.seen = (x.dtype, pair[0].dtype, pair[1]["y"].dtype, ids.dtype, None if scale is None else scale.dtype)
        return ((self.weight * x).float() ** 2).sum() + (self.weight.float() * scale.float()).sum()


def _auto_cast_worker(rank, world_size):
    import deepspeed_acco
    handler = _Lines()
    logging.getLogger("DeepSpeed.acco").addHandler(handler)
    results = {}
    for auto_cast in (True, False):
        model = _Probe()
        config = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 1000,
                  "optimizer": {"type": "ShardedAdamW", "params": {"lr": 1e-2}},
                  "fp16": {"enabled": True, "auto_cast": auto_cast},
                  "zero_optimization": {"stage": 1, "overlap_comm": True, "reduce_bucket_size": 5e8}}
        engine, *_ = deepspeed_acco.initialize(model=model, model_parameters=model.parameters(), config=config)
        device = engine.device
        x = torch.ones(4, device=device)
        loss = engine(x, (torch.ones(4, device=device), {"y": torch.ones(4, device=device)}),
                      torch.arange(4, device=device), scale=torch.ones(4, device=device))
        engine.backward(loss)
        engine.step()
        results[auto_cast] = (model.seen, loss.dtype, engine.global_steps, x.dtype)
        engine.destroy()
    results["lines"] = [line for line in handler.lines if "accepted without effect" in line[1]]
    return results


@pytest.mark.slow
@pytest.mark.without_deepspeed_ops
def test_auto_cast_casts_the_forwards_floating_inputs_and_the_start_line_names_idle_keys():
    result = run_distributed(_auto_cast_worker, 1)[0]
    half, full, ids = torch.float16, torch.float32, torch.int64
    # As DeepSpeed: positional floating-point inputs, through containers, become fp16; integers and keyword
    # arguments stay as they are; the caller's tensors are not changed.
    assert result[True] == ((half, half, half, ids, full), torch.float32, 1, full)
    assert result[False] == ((full, full, full, ids, full), torch.float32, 1, full)
    assert len(result["lines"]) == 2, result["lines"]  # one line per engine
    level, line = result["lines"][0]
    assert level == logging.WARNING
    assert line.startswith("ShardedAdamW: keys accepted without effect: zero_optimization.overlap_comm "
                           "(ShardedAdamW is synchronous by definition); zero_optimization.reduce_bucket_size "
                           "(each job moves whole shards"), line
