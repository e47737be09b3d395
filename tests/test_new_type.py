"""A new optimizer type is one file plus one registry line: a synchronous one (tests/toy_sync_sgd.py)
trains on the real pipeline (2 ranks), matches torch.optim.SGD on the averaged gradient, and
checkpoints; a delayed one (tests/toy_delayed_sgd.py) matches one-step-stale SGD by hand and resumes
bitwise from a checkpoint saved with its job in flight, and CO2 refuses both ways to continue from
the other's optimizer state (``Schedule.check_checkpoint_compatible``)."""
import pytest
import torch

from distributed_utils import run_distributed
from reference_sim import Simulator, TinyNet, batch, flat_trainable, loss_fn

LR, MOMENTUM, ACCUMULATION, UPDATES = 0.05, 0.9, 2, 6


def _config():
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": ACCUMULATION,
            "gradient_clipping": 0.0, "steps_per_print": 1000,
            "optimizer": {"type": "SyncSGD", "params": {"lr": LR, "momentum": MOMENTUM}}}


def _worker(rank, world_size, directory):
    import deepspeed_acco
    from toy_sync_sgd import SyncSGD
    deepspeed_acco.register_optimizer_type(SyncSGD)  # the one registry line

    def run(save_at=None, load=False):
        model = TinyNet(seed=0)
        engine, *_ = deepspeed_acco.initialize(model=model, model_parameters=model.parameters(), config=_config())
        start = 0
        if load:
            engine.load_checkpoint(directory, tag="sgd")
            start = save_at
        for index in range(start, UPDATES * ACCUMULATION):
            if index == save_at and not load:
                engine.save_checkpoint(directory, tag="sgd")
            x, y = batch(rank, index)
            engine.backward(loss_fn(engine(x), y))
            engine.step()
        result = (flat_trainable(model), engine.global_steps, type(engine.schedule).__name__)
        engine.destroy()
        return result

    straight = run()
    run(save_at=6)
    resumed = run(save_at=6, load=True)
    return {"straight": straight, "resumed": resumed}


@pytest.mark.slow
def test_a_fifth_type_from_one_file_and_one_registry_line(tmp_path):
    results = run_distributed(_worker, 2, str(tmp_path))
    params, steps, schedule_name = results[0]["straight"]
    assert schedule_name == "SyncSGD" and steps == UPDATES
    assert torch.equal(params, results[1]["straight"][0])
    # Reference: torch.optim.SGD with momentum on the mean gradient of both ranks' micro-batches.
    sim = Simulator(2, two_groups=False)
    sim.optimizer = torch.optim.SGD(sim.trainable, lr=LR, momentum=MOMENTUM, foreach=False)
    for _ in range(UPDATES):
        total, count = sim.gradient_sum(sim.get(), ACCUMULATION)
        sim.adamw([t / count for t in total])
    assert (params - sim.flat()).abs().max().item() <= 1e-6
    # Its momentum buffer went through a checkpoint like AdamW's moments: exact resume.
    assert torch.equal(results[0]["resumed"][0], params)


# ---- a delayed type (tests/toy_delayed_sgd.py) ---------------------------------------------------
ROUNDS = 6
SAVE_AT = 7
"""Micro-step of the save: three rounds ended (the model holds theta_2, the job of theta_3 is in
flight) and one micro-batch of round 3 fed."""


def _delayed_config(kind="DelayedSGD", **params):
    config = _config()
    config["optimizer"] = {"type": kind, "params": params or {"lr": LR, "momentum": MOMENTUM}}
    return config


def _read_checkpoint(directory, tag, rank):
    from deepspeed_acco.runtime import checkpoint
    path = f"{directory}/{tag}"
    module = torch.load(f"{path}/{checkpoint.MODEL_STATES_NAME}", map_location="cpu", weights_only=False)
    model = TinyNet(seed=0)
    model.load_state_dict(module["module"])
    optimizer = torch.load(f"{path}/{checkpoint.optimizer_states_name(rank, False)}", map_location="cpu",
                           weights_only=False)[checkpoint.OPTIMIZER_STATE_KEY][checkpoint.OUR_KEY]
    return {"module_flat": flat_trainable(model), "global_steps": module["global_steps"],
            "pending": optimizer["meta"]["pending"], "round_micro_batches": optimizer["meta"]["round_micro_batches"],
            "sharded": sorted(optimizer["sharded"])}


def _load_error(engine, directory, tag):
    try:
        engine.load_checkpoint(directory, tag=tag)
    except ValueError as error:
        return str(error)
    return None


def _delayed_worker(rank, world_size, directory):
    import deepspeed_acco
    from toy_delayed_sgd import DelayedSGD
    deepspeed_acco.register_optimizer_type(DelayedSGD)  # the one registry line

    def build(config):
        model = TinyNet(seed=0)
        engine, *_ = deepspeed_acco.initialize(model=model, model_parameters=model.parameters(), config=config)
        return model, engine

    def run(save_at=None, load=False):
        model, engine = build(_delayed_config())
        start = 0
        if load:
            engine.load_checkpoint(directory, tag="delayed")
            start = save_at
        for index in range(start, ROUNDS * ACCUMULATION):
            if index == save_at and not load:
                engine.save_checkpoint(directory, tag="delayed")
            x, y = batch(rank, index)
            engine.backward(loss_fn(engine(x), y))
            engine.step()
        held = flat_trainable(model)
        with engine.committed_parameters():
            committed = flat_trainable(model)
        result = (held, committed, engine.global_steps, type(engine.schedule).__name__)
        engine.destroy()
        return result

    straight = run()
    run(save_at=SAVE_AT)
    saved = _read_checkpoint(directory, "delayed", rank)
    resumed = run(save_at=SAVE_AT, load=True)

    # Checkpoint compatibility is each schedule's call (Schedule.check_checkpoint_compatible).
    _, co2 = build(_delayed_config("CO2", local_steps=2))
    for index in range(4):
        x, y = batch(rank, index)
        co2.backward(loss_fn(co2(x), y))
        co2.step()
    co2.save_checkpoint(directory, tag="co2")
    errors = {"delayed into CO2": _load_error(co2, directory, "delayed")}
    co2.destroy()
    _, delayed = build(_delayed_config())
    errors["CO2 into delayed"] = _load_error(delayed, directory, "co2")
    delayed.destroy()
    _, grouped = build(_delayed_config("CO2", local_steps=2, group_size=2))
    errors["CO2 into CO2 of another group_size"] = _load_error(grouped, directory, "co2")
    grouped.destroy()
    return {"straight": straight, "resumed": resumed, "saved": saved, "errors": errors}


def _stale_sgd_simulation():
    """One-step-stale SGD with momentum by hand: g_0 = g(theta_0; B_0), g_t = g(theta_{t-1}; B_t),
    v_{t+1} = momentum v_t + g_t, theta_{t+1} = theta_t - lr v_{t+1}. Returns theta_0 .. theta_ROUNDS."""
    sim = Simulator(2, two_groups=False)
    thetas = [sim.get()]
    velocity = [torch.zeros_like(t) for t in thetas[0]]
    for t in range(ROUNDS):
        total, count = sim.gradient_sum(thetas[max(t - 1, 0)], ACCUMULATION)
        velocity = [MOMENTUM * v + g / count for v, g in zip(velocity, total)]
        thetas.append([theta - LR * v for theta, v in zip(thetas[-1], velocity)])
    return [torch.cat([t.reshape(-1) for t in theta]) for theta in thetas]


def _held_out_loss(flat):
    model = TinyNet(seed=0)
    with torch.no_grad():
        torch.nn.utils.vector_to_parameters(flat, [p for p in model.parameters() if p.requires_grad])
        return sum(loss_fn(model(x), y).item() for x, y in (batch(rank, 1000) for rank in range(4)))


@pytest.mark.slow
def test_a_delayed_type_from_one_file_trains_one_step_stale_and_resumes_bitwise_from_a_job_in_flight(tmp_path):
    results = run_distributed(_delayed_worker, 2, str(tmp_path))
    held, committed, steps, schedule_name = results[0]["straight"]
    assert schedule_name == "DelayedSGD"
    # The last round's commit is not installed yet: the model holds theta_{R-1}, R-1 updates counted.
    assert steps == ROUNDS - 1
    thetas = _stale_sgd_simulation()
    assert (held - thetas[ROUNDS - 1]).abs().max().item() <= 1e-6
    assert (committed - thetas[ROUNDS]).abs().max().item() <= 1e-6
    assert torch.equal(held, results[1]["straight"][0]) and torch.equal(committed, results[1]["straight"][1])
    assert _held_out_loss(committed) < 0.6 * _held_out_loss(thetas[0])  # it trains (7.3 -> 3.4)

    # The save caught the commit of theta_3 in flight and one micro-batch of round 3: the module file
    # holds the committed theta_3 (counted), the rank's entry the pending result, what the model held
    # (theta_2) and the partial round.
    for rank in (0, 1):
        saved = results[rank]["saved"]
        assert saved["pending"]["kind"] == "commit" and saved["round_micro_batches"] == 1
        assert saved["sharded"] == ["held"] and saved["global_steps"] == 3
        assert (saved["module_flat"] - thetas[3]).abs().max().item() <= 1e-6
        # Loaded into a fresh engine and continued: bitwise the run that never stopped.
        for resumed, straight in zip(results[rank]["resumed"], results[rank]["straight"]):
            assert torch.equal(resumed, straight) if torch.is_tensor(straight) else resumed == straight

    errors = results[0]["errors"]
    assert errors == results[1]["errors"]
    assert "a DelayedSGD checkpoint cannot continue as CO2 (CO2 keeps a replica" in errors["delayed into CO2"]
    assert "a CO2 checkpoint cannot continue as DelayedSGD (CO2 keeps a replica" in errors["CO2 into delayed"]
    assert "the same world size and group_size (saved: 2 ranks, group_size 1)" in \
        errors["CO2 into CO2 of another group_size"]
