"""The defaults a user gets by changing only the optimizer type (docs/design.md, 2 "Defaults"):
gradients reduced in the model's dtype (DeepSpeed's rule) unless ``communication_data_type`` says
otherwise; ``warmup_sync_updates: "auto"`` for DPU and ACCO, resolved from the LR scheduler; CO2's
eager merge with local_steps 4, ``anchor_merge_steps: 0`` for the paper's rule; DeepSpeed's
loss-scale accessors; and one start-up log line that says what the defaults did for a config
written without them.

The resolution rules are checked in this process; one two-rank job builds the engines and checks
what they run on (buffer dtypes, the warm-up's length, the skip of a non-finite fp16 reduction,
the log line, the resolved N after a checkpoint resume)."""
import logging

import pytest
import torch

from deepspeed_acco.runtime.config import parse_config
from deepspeed_acco.runtime.builder import defaults_note
from deepspeed_acco.runtime.warmup import (lambda_shape, resolve_auto_warmup, schedule_shape,
                                                     warmup_after_resume)
from distributed_utils import run_distributed
from reference_sim import TinyNet, batch, loss_fn, param_groups

WORLD_SIZE = 2


def config(kind="ACCO", precision="fp32", **top):
    params = top.pop("params", {})
    result = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "steps_per_print": 10_000,
              "optimizer": {"type": kind, "params": {"lr": 1e-2, **params}}}
    if precision == "bf16":
        result["bf16"] = {"enabled": True}
    elif precision == "fp16":
        result["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 8, "hysteresis": 1}
    result.update(top)
    return result


# ---- communication dtype: DeepSpeed's rule --------------------------------------------------------
@pytest.mark.parametrize("precision, extra, expected", [
    ("fp32", {}, "fp32"),
    ("bf16", {}, "bf16"),
    ("fp16", {}, "fp16"),
    ("bf16", {"communication_data_type": "fp32"}, "fp32"),
    ("fp16", {"communication_data_type": "bf16"}, "bf16"),
    ("fp32", {"communication_data_type": "bf16"}, "bf16"),
    # compressed gradients quantise fp32 sums: the implied dtype is fp32, an explicit bf16 is refused
    ("bf16", {"zero_optimization": {"zero_quantized_gradients": True}}, "fp32"),
])
def test_gradients_are_reduced_in_the_models_dtype_unless_the_config_says_otherwise(precision, extra, expected):
    for kind in ("ShardedAdamW", "DPU", "ACCO", "CO2"):
        parsed = parse_config(config(kind, precision, **extra), WORLD_SIZE)
        assert parsed.communication_dtype == expected, kind
        assert parsed.communication_dtype_given == ("communication_data_type" in extra)


def test_fp16_reduction_needs_fp16s_loss_scale():
    for precision in ("fp32", "bf16"):
        with pytest.raises(ValueError, match="communication_data_type"):
            parse_config(config("ACCO", precision, communication_data_type="fp16"), WORLD_SIZE)
    with pytest.raises(ValueError, match="communication_data_type"):
        parse_config(config("ACCO", "bf16", communication_data_type="bf16",
                            zero_optimization={"zero_quantized_gradients": True}), WORLD_SIZE)


# ---- warmup_sync_updates "auto" --------------------------------------------------------------------
def _optimizer():
    return torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-3)


def test_auto_warmup_is_a_sixth_of_a_known_run():
    from deepspeed.runtime.lr_schedules import WarmupCosineLR, WarmupDecayLR
    decay = WarmupDecayLR(_optimizer(), total_num_steps=720, warmup_num_steps=10)
    assert resolve_auto_warmup(decay).updates == 120
    assert "a sixth of the scheduler's 720 updates (WarmupDecayLR total_num_steps)" in resolve_auto_warmup(decay).reason
    assert resolve_auto_warmup(WarmupCosineLR(_optimizer(), total_num_steps=240, warmup_num_steps=10)).updates == 40
    assert resolve_auto_warmup(torch.optim.lr_scheduler.OneCycleLR(_optimizer(), 1e-3, total_steps=600)).updates == 100
    # The warm-up ends below a cool-down that the config sets.
    capped = resolve_auto_warmup(decay, sync_after_updates=100)
    assert capped.updates == 99 and "below sync_after_updates (100)" in capped.reason


def test_auto_warmup_with_only_the_lr_warmup_known_or_nothing():
    from deepspeed.runtime.lr_schedules import WarmupLR
    only_warmup = resolve_auto_warmup(WarmupLR(_optimizer(), warmup_num_steps=10))
    assert only_warmup.updates == 40 and "4 x the scheduler's 10-update LR warm-up" in only_warmup.reason
    nothing = resolve_auto_warmup(None)
    assert nothing.updates == 0 and "no LR scheduler" in nothing.reason
    step_lr = resolve_auto_warmup(torch.optim.lr_scheduler.StepLR(_optimizer(), step_size=100))
    assert step_lr.updates == 0 and "StepLR" in step_lr.reason


@pytest.mark.parametrize("section, updates, reason", [
    # a horizon: a sixth of it (docs/results.md, "At what loss")
    ({"type": "WarmupDecayLR", "params": {"total_num_steps": 720, "warmup_num_steps": 10}}, 120,
     "a sixth of the scheduler's 720 updates (WarmupDecayLR total_num_steps)"),
    ({"type": "WarmupCosineLR", "params": {"total_num_steps": 3000, "warmup_num_steps": 375}}, 500,
     "a sixth of the scheduler's 3000 updates (WarmupCosineLR total_num_steps)"),
    # OneCycle's horizon is its cycle (the 1cycle policy spans the run with it)
    ({"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_first_step_size": 1000}}, 333,
     "a sixth of the scheduler's 2000 updates (OneCycle cycle_first_step_size + cycle_second_step_size)"),
    ({"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_first_step_size": 300,
                                     "cycle_second_step_size": 900, "decay_step_size": 100, "decay_lr_rate": 0.1}},
     200, "a sixth of the scheduler's 1200 updates"),
    # only a warm-up: 4 W, a sixth of a run whose warm-up is a 24th of it; the line says so
    ({"type": "WarmupLR", "params": {"warmup_num_steps": 1000}}, 4000,
     "4 x the scheduler's 1000-update LR warm-up (WarmupLR warmup_num_steps); the run's length is not known to the "
     "engine: this is a sixth of a run of 24000 updates; for a run of another length set warmup_sync_updates to a "
     "sixth of its updates"),
    ({"type": "WarmupLR", "params": {"warmup_num_steps": 3}}, 12, "a sixth of a run of 72 updates"),
    # DeepSpeed's floor of 2 warm-up updates (transformers writes 1 for none) is no warm-up
    ({"type": "WarmupLR", "params": {"warmup_num_steps": 1}}, 0, "DeepSpeed's floor (no warm-up)"),
    ({"type": "WarmupLR", "params": {"warmup_num_steps": 2}}, 0, "DeepSpeed's floor (no warm-up)"),
    # nothing to go by
    ({"type": "LRRangeTest", "params": {"lr_range_test_step_size": 100}}, 0,
     "LRRangeTest, a learning-rate search without a run length"),
    ({"type": "StepLR", "params": {"step_size": 100}}, 0, "StepLR, whose length the engine does not read"),
])
def test_auto_warmup_per_scheduler_section(section, updates, reason):
    """docs/usage.md states the rule per scheduler; the engine builds the scheduler from the section."""
    from deepspeed_acco.runtime.builder import make_lr_scheduler
    parse_config(config(scheduler=section), WORLD_SIZE)  # a valid section
    resolved = resolve_auto_warmup(make_lr_scheduler(_optimizer(), None, section))
    assert resolved.updates == updates and reason in resolved.reason, resolved.reason


@pytest.mark.parametrize("factory, total, warmup", [
    ("get_linear_schedule_with_warmup", 720, 10),
    ("get_cosine_schedule_with_warmup", 720, 10),
    ("get_linear_schedule_with_warmup", 1000, 0),
    ("get_polynomial_decay_schedule_with_warmup", 300, 30),
    ("get_constant_schedule_with_warmup", None, 25),
])
def test_auto_warmup_reads_the_hf_trainers_lambdalr_without_stepping_it(factory, total, warmup):
    import transformers
    optimizer = _optimizer()
    arguments = {"num_warmup_steps": warmup}
    if total is not None:
        arguments["num_training_steps"] = total
    if factory == "get_polynomial_decay_schedule_with_warmup":
        arguments["lr_end"] = 1e-5  # decays to a floor it then keeps
    scheduler = getattr(transformers, factory)(optimizer, **arguments)
    lr_before, epoch_before = optimizer.param_groups[0]["lr"], scheduler.last_epoch
    shape = schedule_shape(scheduler)
    assert (shape.total_updates, shape.warmup_updates or 0) == (total, warmup)
    expected = total // 6 if total is not None else 4 * warmup
    assert resolve_auto_warmup(scheduler).updates == expected
    assert (optimizer.param_groups[0]["lr"], scheduler.last_epoch) == (lr_before, epoch_before)  # not stepped


def test_lambda_shape_edges():
    assert lambda_shape(lambda step: 1.0) == (None, 0)  # constant: no warm-up, no length
    assert lambda_shape(lambda step: max(0.0, 1.0 - step / 50)) == (50, 0)
    assert lambda_shape(lambda step: min(1.0, step / 7)) == (None, 7)


def test_auto_is_the_default_for_dpu_and_acco_and_an_integer_overrides_it():
    for kind in ("DPU", "ACCO"):
        assert parse_config(config(kind), WORLD_SIZE).params.warmup_sync_updates == "auto"
        assert parse_config(config(kind, params={"warmup_sync_updates": 0}), WORLD_SIZE).params.warmup_sync_updates == 0
        # "auto" with a cool-down is fine: it resolves below it
        parse_config(config(kind, params={"sync_after_updates": 3}), WORLD_SIZE)
    assert parse_config(config("CO2"), WORLD_SIZE).params.warmup_sync_updates == 0
    with pytest.raises(ValueError, match="optimizer.params.warmup_sync_updates.*DPU and ACCO"):
        parse_config(config("CO2", params={"warmup_sync_updates": "auto"}), WORLD_SIZE)


# ---- CO2 -------------------------------------------------------------------------------------------
def test_co2_merges_eagerly_by_default_and_zero_is_the_papers_rule():
    default = parse_config(config("CO2"), WORLD_SIZE).params
    assert (default.anchor_merge_steps, default.local_steps, default.eager_merge) == (1, 4, True)
    assert (default.outer_lr, default.outer_momentum, default.gap_penalty) == (0.5, 0.0, 1.0)  # the eager runs'
    for paper in (0, None):
        params = parse_config(config("CO2", params={"anchor_merge_steps": paper}), WORLD_SIZE).params
        assert not params.eager_merge
    # The adaptive penalty is defined for the paper's rule: an old config with it still runs, under that rule.
    adaptive = parse_config(config("CO2", params={"gap_penalty": "adaptive"}), WORLD_SIZE).params
    assert adaptive.anchor_merge_steps == 0 and not adaptive.eager_merge
    with pytest.raises(ValueError, match="anchor_merge_steps to 0"):
        parse_config(config("CO2", params={"gap_penalty": "adaptive", "anchor_merge_steps": 1}), WORLD_SIZE)


def test_a_resumed_warmup_never_restarts_inside_the_rule():
    # (resolved N, saved N, committed updates, the type's rule under way) -> the N the resumed run uses
    assert warmup_after_resume(10, 10, 3, False) == 10  # the same N: exact resume
    assert warmup_after_resume(2, 2, 5, True) == 2  # past both warm-ups
    # past the saved warm-up, before the new one: the warm-up is over at the loaded step
    assert warmup_after_resume(10, 0, 3, True) == 3
    assert warmup_after_resume(10, 3, 3, False) == 3  # the saved warm-up had just ended, no job yet
    # still inside the saved warm-up: the new length holds, longer or shorter
    assert warmup_after_resume(10, 5, 3, False) == 10
    assert warmup_after_resume(2, 5, 3, False) == 2
    # a checkpoint from before the entry: only the rule under way tells
    assert warmup_after_resume(10, None, 3, True) == 3
    assert warmup_after_resume(10, None, 3, False) == 10
    assert warmup_after_resume(0, None, 3, True) == 0


# ---- the start-up line for a config written for the old defaults ------------------------------------
def test_one_line_says_what_changed_for_an_old_config():
    acco = defaults_note(parse_config(config("ACCO", "bf16"), WORLD_SIZE), "a sixth of the scheduler's 720 updates")
    assert acco.startswith("ACCO: gradients are reduced in bf16 (the model's dtype, DeepSpeed's rule; set "
                           "communication_data_type \"fp32\"")
    assert "warmup_sync_updates \"auto\": a sixth of the scheduler's 720 updates" in acco and "\n" not in acco
    co2 = defaults_note(parse_config(config("CO2"), WORLD_SIZE), None)
    assert "anchor_merge_steps 1, the default; 0 for the paper's rule" in co2 and "local_steps is 4" in co2
    explicit = config("ACCO", "bf16", communication_data_type="fp32", params={"warmup_sync_updates": 0})
    assert defaults_note(parse_config(explicit, WORLD_SIZE), None) == ""  # nothing was left to the defaults
    assert defaults_note(parse_config(config("CO2", params={"anchor_merge_steps": 0, "local_steps": 12}),
                                      WORLD_SIZE), None) == ""


# ---- the engines -----------------------------------------------------------------------------------
class _Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _train(engine, rank, micro_batches, start=0, poison=None):
    for index in range(start, start + micro_batches):
        x, y = batch(rank, index)
        if poison is not None and poison == (rank, index):
            x = torch.full_like(x, float("inf"))
        engine.backward(loss_fn(engine(x.to(engine.engine_config.model_torch_dtype)).float(), y))
        engine.step()


def _worker(rank, world_size, directory):
    import deepspeed_acco
    handler = _Lines()
    logging.getLogger("DeepSpeed.acco").addHandler(handler)
    logging.getLogger("DeepSpeed.acco").setLevel(logging.INFO)
    results = {}

    def build(cfg, lr_scheduler=None):
        model = TinyNet(seed=0)
        engine, optimizer, _, scheduler = deepspeed_acco.initialize(
            model=model, model_parameters=param_groups(model, True, 0.1), config=cfg, lr_scheduler=lr_scheduler)
        return engine, optimizer, scheduler

    # ACCO in bf16 with a scheduler of known length: bf16 reductions, the first 12 // 6 = 2 updates synchronous.
    scheduler_section = {"type": "WarmupDecayLR", "params": {"total_num_steps": 12, "warmup_num_steps": 2,
                                                             "warmup_max_lr": 1e-2}}
    acco_config = config("ACCO", "bf16", scheduler=scheduler_section)
    handler.lines.clear()
    engine, optimizer, _ = build(acco_config)
    syncs = []
    for index in range(8):
        _train(engine, rank, 1, start=index)
        syncs.append((engine.global_steps, engine.schedule.in_sync_warmup))
    engine.save_checkpoint(directory, tag="acco")
    results["acco"] = dict(dtype=engine.communication_data_type, job_grad=engine.optimizer.flats[0].job_grad.dtype,
                           warmup=engine.schedule.warmup_sync_updates,
                           params=engine.engine_config.params.warmup_sync_updates, syncs=syncs,
                           scales=(optimizer.cur_scale, optimizer.loss_scale),
                           notes=[line for line in handler.lines if line.startswith("ACCO:")],
                           note=engine.defaults_note)
    engine.destroy()
    resumed, _, _ = build(acco_config)
    resumed.load_checkpoint(directory, tag="acco")
    results["acco_resumed"] = (resumed.schedule.warmup_sync_updates, resumed.global_steps)
    resumed.destroy()

    # A checkpoint written with warmup_sync_updates 0 while ACCO's estimate job is in flight, resumed under
    # "auto", which now resolves to 60 // 6 = 10 > the saved step: the warm-up cannot restart inside the
    # rule, so N becomes the loaded step (logged once, on rank 0), every update keeps its two half-rounds
    # of train_batch_size samples, and the run continues bitwise as the one that never stopped.
    long_section = {"type": "WarmupDecayLR", "params": {"total_num_steps": 60, "warmup_num_steps": 2,
                                                        "warmup_max_lr": 1e-2}}
    engine, _, _ = build(config("ACCO", scheduler=long_section, params={"warmup_sync_updates": 0}))
    _train(engine, rank, 5)
    saved_at = (engine.global_steps, engine.schedule.phase.value, engine.schedule.running is not None)
    engine.save_checkpoint(directory, tag="acco-rule")

    def continue_run(run):
        counts = []
        for index in range(5, 13):
            _train(run, rank, 1, start=index)
            counts.append((run.global_steps, run.global_samples))
        return counts, torch.cat([shard.master for shard in run.optimizer.shards]).clone()

    straight = continue_run(engine)
    engine.destroy()
    handler.lines.clear()
    resumed, _, _ = build(config("ACCO", scheduler=long_section))
    resolved = resumed.schedule.warmup_sync_updates
    resumed.load_checkpoint(directory, tag="acco-rule")
    used = (resumed.schedule.warmup_sync_updates, resumed.engine_config.params.warmup_sync_updates)
    counts, masters = continue_run(resumed)
    results["acco_rule_resumed"] = dict(
        saved_at=saved_at, resolved=resolved, used=used, counts=counts, straight_counts=straight[0],
        bitwise=torch.equal(masters, straight[1]), batch=resumed.train_batch_size(),
        lines=[line for line in handler.lines if "warmup_sync_updates resolved" in line])
    resumed.destroy()

    # An HF-Trainer-style scheduler given as a callable: 10 // 6 = 1 synchronous update.
    import transformers
    engine, _, scheduler = build(config("DPU"), lr_scheduler=lambda opt: transformers.get_linear_schedule_with_warmup(
        opt, num_warmup_steps=2, num_training_steps=10))
    results["dpu_hf"] = (engine.schedule.warmup_sync_updates, type(scheduler).__name__, scheduler.last_epoch)
    engine.destroy()

    # fp16: reduced in fp16 with the loss scale; a non-finite gradient on one rank skips the update on
    # both, the scale halves (hysteresis 1), the accessors follow it; then updates apply again. Against an
    # fp32 reduction of the same run, the gradient norm (which a pre-division left undone would shrink)
    # and the masters agree to fp16 rounding.
    runs = {}
    for comm in (None, "fp32"):
        extra = {} if comm is None else {"communication_data_type": comm}
        engine, optimizer, _ = build(config("ShardedAdamW", "fp16", **extra))
        scales = [(optimizer.cur_scale, optimizer.loss_scale)]
        _train(engine, rank, 2, poison=(1, 1))
        scales.append((optimizer.cur_scale, optimizer.loss_scale))
        _train(engine, rank, 4, start=2)
        runs[comm] = dict(dtype=engine.communication_data_type, scales=scales, skipped=engine.skipped_steps,
                          steps=engine.global_steps, norm=engine.get_global_grad_norm(),
                          master=torch.cat([shard.master for shard in engine.optimizer.shards]).clone())
        engine.destroy()
    results["fp16"] = runs

    # CO2: eager merge by default, the paper's rule under 0.
    engine, _, _ = build(config("CO2"))
    results["co2_default"] = (engine.schedule.merge_steps, engine.schedule.params.local_steps, engine.defaults_note)
    engine.destroy()
    engine, _, _ = build(config("CO2", params={"anchor_merge_steps": 0}))
    _train(engine, rank, 2 * 5)  # 5 inner steps: one boundary with the restart rule
    results["co2_paper"] = (engine.schedule.merge_steps, engine.global_steps, engine.schedule.outer_rounds)
    engine.destroy()
    return results


@pytest.mark.slow
def test_engines_run_on_the_defaults(tmp_path):
    results = run_distributed(_worker, WORLD_SIZE, str(tmp_path), timeout_s=600)
    for rank, result in enumerate(results):
        acco = result["acco"]
        assert acco["dtype"] == torch.bfloat16 and acco["job_grad"] == torch.bfloat16
        assert acco["warmup"] == acco["params"] == 2
        # Two synchronous updates of two micro-batches, then ACCO's halves (its commit lands a half later).
        assert acco["syncs"] == [(0, True), (1, True), (1, True), (2, False), (2, False), (2, False), (3, False),
                                 (3, False)]
        assert acco["scales"] == (1.0, 1.0)
        assert result["acco_resumed"] == (2, 3)
        rule = result["acco_rule_resumed"]
        assert rule["saved_at"] == (2, "second_half", True) and rule["resolved"] == 10
        assert rule["used"] == (2, 2)
        assert rule["counts"] == rule["straight_counts"] and rule["bitwise"]
        # one update per two micro-batches (two half-rounds of one), train_batch_size samples each
        assert [steps for steps, _ in rule["counts"]] == [2, 3, 3, 4, 4, 5, 5, 6]
        first_samples = {}
        for steps, samples in rule["counts"]:
            first_samples.setdefault(steps, samples)
        assert [first_samples[s + 1] - first_samples[s] for s in (3, 4, 5)] == [rule["batch"]] * 3 == [16] * 3
        if rank == 0:
            assert rule["lines"] == [
                "load_checkpoint: the checkpoint is past its synchronous warm-up (2 updates committed, written with "
                "warmup_sync_updates 0); warmup_sync_updates resolved to 10 for this run, but a warm-up cannot "
                "restart in the middle of ACCO's rule, so 2 is used (the warm-up is over)"]
        else:
            assert rule["lines"] == []
        assert "the first 2 updates are synchronous (warmup_sync_updates \"auto\": a sixth of the scheduler's 12 " \
               "updates (WarmupDecayLR total_num_steps)" in acco["note"]
        if rank == 0:
            assert acco["notes"] == [acco["note"]]  # logged once, on rank 0
        assert result["dpu_hf"] == (1, "LambdaLR", 0)
        fp16, fp32 = result["fp16"][None], result["fp16"]["fp32"]
        assert fp16["dtype"] == torch.float16 and fp32["dtype"] == torch.float32
        for run in (fp16, fp32):
            assert run["scales"] == [(256.0, 256.0), (128.0, 128.0)]
            assert (run["skipped"], run["steps"]) == (1, 3)
        assert fp16["norm"] == pytest.approx(fp32["norm"], rel=1e-2)
        assert torch.allclose(fp16["master"], fp32["master"], atol=1e-3)
        assert not torch.equal(fp16["master"], fp32["master"])  # the fp16 reduction did round
        merge, local_steps, note = result["co2_default"]
        assert (merge, local_steps) == (1, 4) and "anchor_merge_steps 1, the default" in note
        assert result["co2_paper"] == (None, 5, 1)
