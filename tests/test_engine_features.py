"""Multi-process engine features: dynamic accumulation with a slow rank, bf16, worker failures,
LR schedulers and counters (docs/design.md, section 4, layer 3)."""
import time

import pytest
import torch

from distributed_utils import run_distributed
from reference_sim import TinyNet, batch, flat_trainable, loss_fn, param_groups, simulate_acco

SLOW_DELAY_S = 0.08


def _dynamic_worker(rank, world_size, dynamic, num_updates):
    import deepspeed_acco
    model = TinyNet(seed=0)
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "gradient_clipping": 0.0,
              "steps_per_print": 1000,
              "optimizer": {"type": "ACCO", "params": {"lr": 1e-2, "dynamic_accumulation": dynamic,
                                                       "warmup_sync_updates": 0}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                                           "warmup_num_steps": 100, "warmup_type": "linear"}}}
    engine, *_ = deepspeed_acco.initialize(model=model, model_parameters=model.parameters(), config=config)
    rounds, lrs = 0, {0: engine.get_lr()[0]}
    while engine.global_steps < num_updates:
        x, y = batch(rank, engine.micro_steps)
        engine.backward(loss_fn(engine(x), y))
        if rank == 1:
            time.sleep(SLOW_DELAY_S)  # the slow rank: a slower GPU, emulated
        before = engine.global_steps, engine.phase
        engine.step()
        rounds += (engine.global_steps, engine.phase) != before
        lrs[engine.global_steps] = engine.get_lr()[0]
    engine.destroy()  # drains the estimate launched at the last boundary
    in_flight = engine.schedule.running.wait() if engine.schedule.running is not None else None
    return {"micro_steps": engine.micro_steps, "wait_s": engine.communication_wait_s, "rounds": rounds,
            "commits": [(c.global_micro_batches, c.skipped) for c in engine.recent_commits],
            "in_flight_global": in_flight.global_micro_batches if in_flight else 0,
            "global_samples": engine.global_samples, "lrs": lrs}


@pytest.mark.slow
def test_dynamic_accumulation_lets_the_fast_rank_keep_computing_and_the_schedule_counts_updates():
    num_updates = 6
    dynamic = run_distributed(_dynamic_worker, 2, True, num_updates)
    static = run_distributed(_dynamic_worker, 2, False, num_updates)
    fast, slow = dynamic
    # The fast rank contributed more micro-batches than the slow one.
    assert fast["micro_steps"] > 1.5 * slow["micro_steps"], (fast["micro_steps"], slow["micro_steps"])
    # Each update averaged over the global count: every micro-batch of both ranks is in exactly
    # one committed update, except those of the round whose estimate is still in flight.
    counted = sum(count for count, _ in fast["commits"]) + fast["in_flight_global"]
    assert counted == fast["micro_steps"] + slow["micro_steps"]
    assert fast["commits"] == slow["commits"]
    assert fast["global_samples"] == sum(count for count, _ in fast["commits"]) * 4
    # The fast rank barely waits with dynamic accumulation, but waits for the slow rank without it.
    fast_wait_per_round = fast["wait_s"] / fast["rounds"]
    static_wait_per_round = static[0]["wait_s"] / static[0]["rounds"]
    assert fast_wait_per_round < 0.25 * SLOW_DELAY_S, fast_wait_per_round
    assert static_wait_per_round > 0.5 * SLOW_DELAY_S, static_wait_per_round
    assert static[0]["micro_steps"] == static[1]["micro_steps"] == 2 * num_updates + 1
    # Updates of more samples than train_batch_size still step a schedule set in updates once each
    # (docs/design.md, 3.4): the learning rate after k updates is WarmupLR's after k steps.
    assert fast["global_samples"] > num_updates * 4 * 2 * 1.5
    from deepspeed.runtime.lr_schedules import WarmupLR
    plain = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-2)
    expected = WarmupLR(plain, warmup_min_lr=0.0, warmup_max_lr=1e-2, warmup_num_steps=100, warmup_type="linear")
    for step in range(num_updates + 1):
        assert fast["lrs"][step] == slow["lrs"][step] == pytest.approx(plain.param_groups[0]["lr"]), step
        expected.step()


def _bf16_worker(rank, world_size, kind, num_updates):
    import deepspeed_acco
    model = TinyNet(seed=0)
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "gradient_clipping": 0.5,
              "steps_per_print": 1000, "bf16": {"enabled": True},
              "optimizer": {"type": kind, "params": {"lr": 1e-2, "weight_decay": 0.1}}}
    engine, *_ = deepspeed_acco.initialize(model=model, model_parameters=param_groups(model, True, 0.1),
                                           config=config)
    assert next(model.parameters()).dtype == torch.bfloat16
    losses = []
    for index in range(2 * num_updates):
        x, y = batch(rank, index)
        loss = loss_fn(engine(x.bfloat16()).float(), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    with engine.committed_parameters():
        committed = flat_trainable(model).float()
    masters = torch.cat([shard.master for shard in engine.optimizer.shards])
    engine.destroy()
    return {"losses": losses, "committed": committed, "master_shards": masters}


@pytest.mark.slow
def test_bf16_with_clipping_trains_and_matches_the_same_math_reference():
    num_updates = 15
    results = run_distributed(_bf16_worker, 2, "ACCO", num_updates)
    losses = results[0]["losses"]
    assert sum(losses[-6:]) / 6 < 0.8 * sum(losses[:6]) / 6, "bf16 ACCO did not train"
    _, committed, sim = simulate_acco(2, 2, num_updates, clipping=0.5, model_dtype=torch.bfloat16)
    reference = torch.cat([p.reshape(-1) for p in committed])
    ours = results[0]["committed"]
    # Same math; a different summation order could at most flip a bf16 rounding (one ulp).
    difference = (ours - reference.bfloat16().float()).abs().max().item()
    one_ulp = torch.finfo(torch.bfloat16).eps * reference.abs().max().item()
    assert difference <= one_ulp, difference
    moved = (reference - torch.cat([p.reshape(-1) for p in TinyNet(0).parameters() if p.requires_grad])).abs().max()
    assert moved > 10 * difference, "the comparison is not meaningful: parameters barely moved"


def _failing_worker(rank, world_size):
    import deepspeed_acco
    from deepspeed_acco.runtime.comm import CommunicationError
    model = TinyNet(seed=0)
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "steps_per_print": 1000,
              "optimizer": {"type": "DPU", "params": {"lr": 1e-2, "communication_timeout_s": 20}}}
    engine, *_ = deepspeed_acco.initialize(model=model, model_parameters=model.parameters(), config=config)
    if rank == 1:
        original = engine.schedule.communicator.reduce_scatter
        calls = {"n": 0}

        def failing_reduce_scatter(output, input):
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("injected fault in rank 1's communication worker")
            return original(output, input)

        engine.schedule.communicator.reduce_scatter = failing_reduce_scatter
    start = time.monotonic()
    try:
        for index in range(40):
            x, y = batch(rank, index)
            engine.backward(loss_fn(engine(x), y))
            engine.step()
    except CommunicationError as error:
        failed_at = engine.micro_steps
        try:
            engine.step()
        except RuntimeError as again:
            second = str(again)
        return {"error": str(error), "failed_at": failed_at, "seconds": time.monotonic() - start, "again": second}
    return {"error": None}


@pytest.mark.slow
def test_worker_exception_reaches_step_with_traceback_and_peers_fail_fast():
    results = run_distributed(_failing_worker, 2, timeout_s=120)
    faulty, peer = results[1], results[0]
    assert faulty["error"] is not None and "injected fault" in faulty["error"]
    assert "failing_reduce_scatter" in faulty["error"], "the worker traceback is missing"
    assert faulty["failed_at"] == 8  # job 3 launched at micro-step 6, waited at the next boundary
    assert "failed earlier" in faulty["again"]
    # The healthy rank's collective loses its peer: it fails too, naming the collective.
    assert peer["error"] is not None and "collective" in peer["error"], peer["error"]
    assert peer["seconds"] < 60


def _scheduler_worker(rank, world_size):
    import deepspeed_acco
    model = TinyNet(seed=0)
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "steps_per_print": 1000,
              "optimizer": {"type": "ACCO", "params": {"lr": 1e-2, "warmup_sync_updates": 0}},  # the rule from update 0 ("auto": test_defaults.py)
              "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                                           "warmup_num_steps": 4, "warmup_type": "linear"}}}
    engine, optimizer, _, scheduler = deepspeed_acco.initialize(model=model, model_parameters=model.parameters(),
                                                                config=config)
    lrs = []
    for index in range(16):
        x, y = batch(rank, index)
        engine.backward(loss_fn(engine(x), y))
        engine.step()
        lrs.append((engine.global_steps, engine.get_lr()[0]))
    engine.destroy()
    return {"lrs": lrs, "samples": engine.global_samples, "scheduler": type(scheduler).__name__,
            "optimizer_lr": optimizer.param_groups[0]["lr"]}


@pytest.mark.slow
def test_deepspeed_lr_scheduler_steps_once_per_committed_update():
    result = run_distributed(_scheduler_worker, 2)[0]
    assert result["scheduler"] == "WarmupLR"
    by_step = dict(result["lrs"])
    # The same DeepSpeed scheduler on a plain torch optimizer, stepped once per update.
    from deepspeed.runtime.lr_schedules import WarmupLR
    plain = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-2)
    expected = WarmupLR(plain, warmup_min_lr=0.0, warmup_max_lr=1e-2, warmup_num_steps=4, warmup_type="linear")
    for step in range(max(by_step) + 1):
        assert by_step[step] == pytest.approx(plain.param_groups[0]["lr"]), step
        expected.step()
    assert len(set(by_step.values())) >= 4, "the schedule did not change the learning rate"
    assert max(by_step) == 7  # 16 micro-batches = 8 updates, the last still in flight
    assert result["samples"] == 16 * 4 * 2


def _communication_dtype_worker(rank, world_size):
    import logging

    import deepspeed_acco
    messages = []

    class Records(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    logging.getLogger("DeepSpeed.acco").addHandler(Records())
    logging.getLogger("DeepSpeed.acco").setLevel(logging.INFO)
    results = {}
    for dtype in ("fp32", "bf16"):
        model = TinyNet(seed=0)
        config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "steps_per_print": 4,
                  "wall_clock_breakdown": True, "communication_data_type": dtype,
                  "optimizer": {"type": "ACCO", "params": {"lr": 1e-2}}}
        engine, *_ = deepspeed_acco.initialize(model=model, model_parameters=model.parameters(), config=config)
        assert engine.optimizer.flats[0].job_grad.dtype == (torch.bfloat16 if dtype == "bf16" else torch.float32)
        for index in range(24):
            x, y = batch(rank, index)
            engine.backward(loss_fn(engine(x), y))
            engine.step()
        with engine.committed_parameters():
            results[dtype] = flat_trainable(model)
        engine.destroy()
    results["messages"] = messages
    return results


@pytest.mark.slow
def test_bf16_gradient_communication_and_wall_clock_breakdown():
    result = run_distributed(_communication_dtype_worker, 2)[0]
    difference = (result["fp32"] - result["bf16"]).abs().max().item()
    assert 0 < difference < 5e-3, f"bf16 reduce-scatter should only round the gradients, got {difference}"
    breakdown = [message for message in result["messages"] if "wait per boundary" in message]
    assert breakdown, "wall_clock_breakdown must report the wait per boundary"
    assert "reduce_scatter" in breakdown[-1] and "all_gather" in breakdown[-1]
