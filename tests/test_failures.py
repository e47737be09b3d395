"""Failure behaviour (docs/failures.md): non-finite gradients, fp16 loss scaling, a dead peer."""
import logging
import os
import pickle
import time

import pytest
import torch

from distributed_utils import run_distributed, run_until_exit
from reference_sim import TinyNet, batch, flat_trainable, loss_fn

ACCUMULATION = 4  # ACCO halves of 2: A_0 = [0, 1], B_0 = [2, 3], A_1 = [4, 5], B_1 = [6, 7], ...


def _config(kind, **extra):
    params = {"lr": 1e-2}
    if kind in ("DPU", "ACCO"):
        params["warmup_sync_updates"] = 0  # the rule from update 0 ("auto": test_defaults.py)
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": ACCUMULATION,
              "steps_per_print": 1000, "optimizer": {"type": kind, "params": params},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                                           "warmup_num_steps": 10, "warmup_type": "linear"}}}
    config.update(extra)
    return config


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _state(engine):
    shards = engine.optimizer.shards
    return {"master": torch.cat([s.master for s in shards]), "exp_avg": torch.cat([s.state['exp_avg'] for s in shards]),
            "exp_avg_sq": torch.cat([s.state['exp_avg_sq'] for s in shards]), "applied": engine.schedule.progress.applied_steps,
            "lr": engine.get_lr()[0]}


def _nan_worker(rank, world_size, kind, poisoned_index, dtype_name):
    import deepspeed_acco
    records = _Records()
    logging.getLogger("DeepSpeed.acco").addHandler(records)
    extra = {"bf16": {"enabled": True}} if dtype_name == "bf16" else {}
    model = TinyNet(seed=0)
    engine, *_ = deepspeed_acco.initialize(model=model, model_parameters=model.parameters(),
                                           config=_config(kind, **extra))
    dtype = next(model.parameters()).dtype
    snapshots = {}
    for index in range(16):
        x, y = batch(rank, index)
        loss = loss_fn(engine(x.to(dtype)).float(), y)
        if rank == 1 and index == poisoned_index:
            loss = loss * float("nan")
        engine.backward(loss)
        engine.step()
        engine.schedule.drain()
        snapshots[index] = _state(engine)
        snapshots[index]["skipped"] = engine.skipped_steps
        snapshots[index]["global_steps"] = engine.global_steps
        snapshots[index]["holds"] = flat_trainable(model).float()
    engine.destroy()
    return {"snapshots": snapshots, "log": records.messages}


@pytest.mark.slow
@pytest.mark.parametrize("kind, poisoned_index, dtype_name, before, launched, installed", [
    # ACCO: in B_1 the estimate is fine and the commit of update 2, launched after micro-batch 7
    # and installed after 9, is skipped; in A_1 the estimate is skipped too.
    ("ACCO", 6, "fp32", 5, 7, 9),
    ("ACCO", 4, "bf16", 5, 7, 9),
    # DPU: round 1 (micro-batches 4-7) is poisoned; its commit launches after 7, installs after 11.
    ("DPU", 5, "fp32", 3, 7, 11),
])
def test_non_finite_gradient_skips_the_update_on_every_rank(kind, poisoned_index, dtype_name, before, launched,
                                                           installed):
    results = run_distributed(_nan_worker, 2, kind, poisoned_index, dtype_name)
    for rank_result in results:
        snapshots = rank_result["snapshots"]
        last = snapshots[15]
        assert last["skipped"] == 1, "exactly one update skipped on every rank"
        assert last["applied"] == last["global_steps"] - 1
        for values in snapshots.values():
            assert torch.isfinite(values["master"]).all() and torch.isfinite(values["holds"]).all()
    snapshots = results[0]["snapshots"]
    # Snapshots are taken after draining the job launched at that micro-batch's boundary.
    before, launched, installed = snapshots[before], snapshots[launched], snapshots[installed]
    for key in ("master", "exp_avg", "exp_avg_sq"):
        assert torch.equal(before[key], launched[key]), f"the skipped job changed {key}"
    assert launched["skipped"] == 0 and installed["skipped"] == 1
    assert installed["applied"] == launched["applied"], "the AdamW step count must not advance"
    assert installed["lr"] == launched["lr"], "the LR schedule must not advance on a skipped update"
    assert torch.equal(installed["master"], before["master"])
    if kind == "ACCO":
        model_dtype = torch.bfloat16 if dtype_name == "bf16" else torch.float32
        shard = before["master"]  # rank 0's shard: the first elements of the flat parameters
        committed = shard.to(model_dtype).float()
        assert torch.equal(installed["holds"][:shard.numel()], committed), "the model must hold theta_t again"
    assert any("skipped" in message for message in results[0]["log"]), "the skip must be logged"


def _fp16_worker(rank, world_size, poisoned):
    import deepspeed_acco
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
    model = TinyNet(seed=0)
    config = _config("ACCO", fp16={"enabled": True, "initial_scale_power": 8, "loss_scale_window": 4,
                                   "hysteresis": 2, "min_loss_scale": 1})
    engine, *_ = deepspeed_acco.initialize(model=model, model_parameters=model.parameters(), config=config)
    assert next(model.parameters()).dtype == torch.float16
    # DeepSpeed's own scaler is the reference; it logs overflows through deepspeed.comm.
    import deepspeed.comm
    deepspeed.comm.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False,
                                    dist_init_required=False)
    reference = DynamicLossScaler(init_scale=2**8, scale_window=4, min_scale=1, delayed_shift=2,
                                  consecutive_hysteresis=False, raise_error_at_min_scale=False)
    scales, losses = [], []
    for index in range(64):
        x, y = batch(rank, index)
        loss = loss_fn(engine(x.half()).float(), y)
        if rank == 0 and index in poisoned:
            loss = loss * float("inf")
        engine.backward(loss)
        before = engine.global_steps
        engine.step()
        losses.append(loss.item())
        if engine.global_steps != before:
            reference.update_scale(engine.recent_commits[-1].skipped)
            scales.append((engine.schedule.loss_scale.scale, reference.cur_scale))
    result = {"scales": scales, "skipped": engine.skipped_steps, "losses": losses}
    engine.destroy()
    return result


@pytest.mark.slow
def test_fp16_follows_deepspeed_dynamic_loss_scaling():
    result = run_distributed(_fp16_worker, 2, (6, 14))[0]
    assert result["skipped"] == 2
    assert all(ours == reference for ours, reference in result["scales"])
    observed = [ours for ours, _ in result["scales"]]
    assert min(observed) < 2**8, "two overflows with hysteresis 2 must lower the scale"
    assert any(later > earlier for earlier, later in zip(observed, observed[1:])), \
        "overflow-free windows must raise the scale again"
    finite = [loss for loss in result["losses"] if loss == loss and loss != float("inf")]
    assert sum(finite[-6:]) < sum(finite[:6])


def _dead_peer_rank(rank, world_size, port, directory, result_path):
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.set_num_threads(1)
    import deepspeed_acco
    from deepspeed_acco.runtime.comm import CommunicationError
    model = TinyNet(seed=0)
    config = _config("ACCO", gradient_accumulation_steps=2)
    config["optimizer"]["params"]["communication_timeout_s"] = 20
    engine, *_ = deepspeed_acco.initialize(model=model, model_parameters=model.parameters(), config=config)
    for index in range(40):
        if index == 6:
            engine.save_checkpoint(directory, tag="before-the-crash")
        if rank == 1 and index == 9:
            os.kill(os.getpid(), 9)  # kill -9 in the middle of training
        x, y = batch(rank, index)
        engine.backward(loss_fn(engine(x), y))
        started = time.monotonic()
        try:
            engine.step()
        except CommunicationError as error:
            with open(result_path, "wb") as handle:
                pickle.dump({"error": str(error), "index": index, "waited_s": time.monotonic() - started}, handle)
            raise  # the training script dies with it: a non-zero exit code


def _train_acco(rank, start, stop, seed, load_dir=None):
    import deepspeed_acco
    model = TinyNet(seed=seed)
    engine, *_ = deepspeed_acco.initialize(model=model, model_parameters=model.parameters(),
                                           config=_config("ACCO", gradient_accumulation_steps=2))
    if load_dir is not None:
        engine.load_checkpoint(load_dir)
    for index in range(start, stop):
        x, y = batch(rank, index)
        engine.backward(loss_fn(engine(x), y))
        engine.step()
    with engine.committed_parameters():
        committed = flat_trainable(model)
    engine.destroy()
    return committed


def _resume_after_crash(rank, world_size, directory):
    return _train_acco(rank, 6, 14, seed=1, load_dir=directory)


def _uninterrupted(rank, world_size):
    return _train_acco(rank, 0, 14, seed=0)


@pytest.mark.slow
def test_a_killed_rank_makes_the_survivor_fail_fast_and_the_job_resumes_exactly(tmp_path):
    result_path = str(tmp_path / "survivor.pkl")
    started = time.monotonic()
    exit_codes = run_until_exit(_dead_peer_rank, 2, str(tmp_path), result_path)
    elapsed = time.monotonic() - started
    assert None not in exit_codes, "a process was left hanging"
    assert exit_codes[1] == -9
    assert exit_codes[0] != 0, "the survivor must exit non-zero"
    with open(result_path, "rb") as handle:
        survivor = pickle.load(handle)
    assert "collective" in survivor["error"] and "rank 0" in survivor["error"], survivor["error"]
    assert survivor["waited_s"] < 30 and elapsed < 100
    resumed = run_distributed(_resume_after_crash, 2, str(tmp_path))
    uninterrupted = run_distributed(_uninterrupted, 2)
    assert torch.equal(resumed[0], uninterrupted[0]) and torch.equal(resumed[1], uninterrupted[1])


HUNG_TIMEOUT_S = 5


def _hung_peer_rank(rank, world_size, port, result_path):
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.set_num_threads(1)
    import deepspeed_acco
    from deepspeed_acco.runtime.comm import CommunicationError, process_group_timeout_s
    model = TinyNet(seed=0)
    config = _config("DPU", gradient_accumulation_steps=2)
    config["optimizer"]["params"]["communication_timeout_s"] = HUNG_TIMEOUT_S
    engine, *_ = deepspeed_acco.initialize(model=model, model_parameters=model.parameters(), config=config)
    for index in range(40):
        if rank == 1 and index == 5:
            # Alive but stuck (a hung peer, not a dead one: its connections stay open), past our
            # timeout but not past the process groups' own.
            time.sleep(process_group_timeout_s(HUNG_TIMEOUT_S) - 10)
            os._exit(0)
        x, y = batch(rank, index)
        engine.backward(loss_fn(engine(x), y))
        started = time.monotonic()
        try:
            engine.step()
        except CommunicationError as error:
            with open(result_path, "wb") as handle:
                pickle.dump({"error": str(error), "index": index, "waited_s": time.monotonic() - started,
                             "group_timeout_s": process_group_timeout_s(HUNG_TIMEOUT_S)}, handle)
            os._exit(3)  # the job's worker is still inside gloo: leave without interpreter finalisation
    os._exit(0)


@pytest.mark.slow
def test_a_hung_peer_is_reported_by_the_hang_check_before_gloo_times_out(tmp_path):
    result_path = str(tmp_path / "survivor.pkl")
    exit_codes = run_until_exit(_hung_peer_rank, 2, result_path, timeout_s=120)
    assert exit_codes == [3, 0], exit_codes
    with open(result_path, "rb") as handle:
        survivor = pickle.load(handle)
    message = survivor["error"]
    assert "has not completed" in message and "collective" in message and "'acco-jobs'" in message, message
    # Rank 1 stopped before micro-batch 5; rank 0 launched commit 3 at the boundary after micro-batch 5
    # (its reduce-scatter hangs) and waits for it at the next one.
    assert survivor["index"] == 7
    assert HUNG_TIMEOUT_S - 1 <= survivor["waited_s"] < HUNG_TIMEOUT_S + 3 < survivor["group_timeout_s"]

