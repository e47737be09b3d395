"""Checkpoints (docs/checkpoints.md): exact continuation, DeepSpeed interop, re-sharding, atomicity, consolidation."""
import os
import subprocess
import sys

import pytest
import torch

from distributed_utils import run_distributed, run_until_exit
from reference_sim import Simulator, TinyNet, batch, flat_trainable, loss_fn, param_groups

MICRO_BATCH = 4


def make_config(kind, accumulation, **params):
    if kind in ("DPU", "ACCO"):
        params.setdefault("warmup_sync_updates", 0)  # the rule from update 0 ("auto": test_defaults.py)
    config = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": accumulation,
              "gradient_clipping": 1.0, "steps_per_print": 1000,
              "optimizer": {"type": kind, "params": dict(lr=1e-2, weight_decay=0.1, **params)},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                                           "warmup_num_steps": 3, "warmup_type": "linear"}}}
    if kind == "AdamW":
        config["zero_optimization"] = {"stage": 1}
    return config


def new_engine(config, seed=0):
    import deepspeed_acco
    model = TinyNet(seed=seed)
    engine, *_ = deepspeed_acco.initialize(model=model, model_parameters=param_groups(model, True, 0.1), config=config)
    return engine, model


def feed(engine, rank, start, stop):
    for index in range(start, stop):
        x, y = batch(rank, index, MICRO_BATCH)
        engine.backward(loss_fn(engine(x), y))
        engine.step()


def snapshot(engine, model):
    result = {"holds": flat_trainable(model), "global_steps": engine.global_steps,
              "global_samples": engine.global_samples, "lr": engine.get_lr()}
    committed = getattr(engine, "committed_parameters", None)
    if committed is not None:
        with committed():
            result["committed"] = flat_trainable(model)
    return result


def _resume_worker(rank, world_size, directory, cases):
    results = {}
    for name, config, save_at, total in cases:
        engine, model = new_engine(config)
        feed(engine, rank, 0, total)
        results[(name, "continuous")] = snapshot(engine, model)
        engine.destroy()

        engine, model = new_engine(config)
        feed(engine, rank, 0, save_at)
        results[(name, "at-save")] = snapshot(engine, model)
        engine.save_checkpoint(directory, tag=name, client_state={"cursor": save_at})
        module = torch.load(os.path.join(directory, name, "mp_rank_00_model_states.pt"), weights_only=False)["module"]
        results[(name, "module-file")] = torch.cat([module[key].reshape(-1).float()
                                                    for key, p in model.named_parameters() if p.requires_grad])
        engine.destroy()

        engine, model = new_engine(config, seed=123)  # different initial weights: all must come from the file
        path, client_state = engine.load_checkpoint(directory, tag=name)
        assert client_state["cursor"] == save_at
        feed(engine, rank, client_state["cursor"], total)
        results[(name, "resumed")] = snapshot(engine, model)
        engine.destroy()
    return results


RESUME_CASES = [
    # name, config, save after micro-batch, train until micro-batch
    ("sharded", make_config("ShardedAdamW", 2), 6, 14),
    ("dpu", make_config("DPU", 2), 6, 14),
    ("acco-estimate-pending", make_config("ACCO", 4), 6, 16),  # after A_1: between estimate and commit
    ("acco-commit-pending", make_config("ACCO", 4), 8, 16),  # after B_1
    ("acco-mid-round", make_config("ACCO", 4), 7, 16),  # inside B_1: partial gradient sums saved
    ("co2-mid-outer-round", make_config("CO2", 2, local_steps=3), 10, 22),
    # Inside the synchronous warm-up (3 of 4 warm-up updates done): the committed weights are the
    # warm-up's, not x_0 (the anchors only start at the switch).
    ("co2-mid-warmup", make_config("CO2", 2, local_steps=3, warmup_sync_updates=4), 6, 22),
    # Eager mode, saved between boundary 1 and the merge of its job (y_1 and the LR sums in flight).
    ("co2-eager-merge-pending", make_config("CO2", 2, local_steps=3, anchor_merge_steps=2, gap_penalty=1.0,
                                            normalize_by_inner_lr=True), 14, 22),
]


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_load_and_continue_is_bitwise_identical_to_never_stopping(world_size, tmp_path):
    results = run_distributed(_resume_worker, world_size, str(tmp_path), RESUME_CASES)
    for name, *_ in RESUME_CASES:
        for rank, rank_results in enumerate(results):
            continuous, resumed = rank_results[(name, "continuous")], rank_results[(name, "resumed")]
            for key in ("holds", "committed"):
                assert torch.equal(continuous[key], resumed[key]), f"{name}, rank {rank}: {key} differs"
            for key in ("global_steps", "global_samples", "lr"):
                assert continuous[key] == resumed[key], f"{name}, rank {rank}: {key}"
            # The module file holds the committed weights at the save, whatever the phase.
            assert torch.equal(rank_results[(name, "module-file")], rank_results[(name, "at-save")]["committed"]), name
    at_save = results[0][("co2-mid-warmup", "at-save")]
    assert torch.equal(at_save["committed"], at_save["holds"])  # warm-up updates are installed at once
    assert not torch.equal(at_save["committed"], flat_trainable(TinyNet(seed=0)))
    # Per-rank optimizer files are shards: O(params / W), the mid-round one carries gradient sums.
    sizes = {name: os.path.getsize(tmp_path / name / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
             for name, *_ in RESUME_CASES}
    assert sizes["acco-mid-round"] > sizes["acco-commit-pending"]


def _interop_worker(rank, world_size, directory):
    results = {}
    # DeepSpeed ZeRO-1 writes; DeepSpeed and each of our types continue from it.
    engine, model = new_engine(make_config("AdamW", 2))
    feed(engine, rank, 0, 8)
    engine.save_checkpoint(directory, tag="from-deepspeed")
    deepspeed_partitions = [t.clone() for t in engine.optimizer.single_partition_of_fp32_groups]
    for kind in ("AdamW", "ShardedAdamW", "ACCO", "DPU"):
        engine, model = new_engine(make_config(kind, 2), seed=7)
        engine.load_checkpoint(directory, tag="from-deepspeed")
        if kind != "AdamW":
            masters = [shard.master for shard in engine.optimizer.shards]
            results[(kind, "masters-equal")] = all(
                torch.equal(master[:partition.numel()], partition)
                for master, partition in zip(masters, deepspeed_partitions))
            results[(kind, "applied_steps")] = engine.schedule.progress.applied_steps
        feed(engine, rank, 8, 16)
        results[(kind, "after-deepspeed")] = snapshot(engine, model)
        if hasattr(engine, "destroy"):
            engine.destroy()
    # ShardedAdamW writes; DeepSpeed ZeRO-1 continues from it like ShardedAdamW does.
    engine, model = new_engine(make_config("ShardedAdamW", 2))
    feed(engine, rank, 0, 8)
    engine.save_checkpoint(directory, tag="from-sharded")
    engine.destroy()
    for kind in ("AdamW", "ShardedAdamW"):
        engine, model = new_engine(make_config(kind, 2), seed=7)
        engine.load_checkpoint(directory, tag="from-sharded")
        feed(engine, rank, 8, 16)
        results[(kind, "after-sharded")] = snapshot(engine, model)
        if hasattr(engine, "destroy"):
            engine.destroy()
    return results


@pytest.mark.slow
def test_deepspeed_zero1_checkpoints_load_both_ways(tmp_path):
    results = run_distributed(_interop_worker, 2, str(tmp_path))[0]
    for kind in ("ShardedAdamW", "ACCO", "DPU"):
        assert results[(kind, "masters-equal")], kind
        assert results[(kind, "applied_steps")] == 4
        assert results[(kind, "after-deepspeed")]["global_steps"] >= 4 + 3
    difference = (results[("ShardedAdamW", "after-deepspeed")]["holds"]
                  - results[("AdamW", "after-deepspeed")]["holds"]).abs().max().item()
    assert difference <= 1e-6, f"DeepSpeed checkpoint continued by ShardedAdamW vs by DeepSpeed: {difference}"
    difference = (results[("AdamW", "after-sharded")]["holds"]
                  - results[("ShardedAdamW", "after-sharded")]["holds"]).abs().max().item()
    assert difference <= 1e-6, f"ShardedAdamW checkpoint continued by DeepSpeed vs by ShardedAdamW: {difference}"
    assert results[("AdamW", "after-sharded")]["lr"] == results[("ShardedAdamW", "after-sharded")]["lr"]


def _elastic_worker(rank, world_size, directory, phase):
    config = make_config("ShardedAdamW", 2)
    if phase == "save":
        engine, model = new_engine(config)
        feed(engine, rank, 0, 8)
        engine.save_checkpoint(directory, tag="elastic")
        config = make_config("ACCO", 2)
        engine.destroy()
        engine, model = new_engine(config)
        feed(engine, rank, 0, 7)  # ACCO with its estimate in flight
        engine.save_checkpoint(directory, tag="elastic-acco")
        engine.destroy()
        return None
    engine, model = new_engine(config, seed=5)
    engine.load_checkpoint(directory, tag="elastic")
    feed(engine, rank, 8, 16)
    result = {"sharded": snapshot(engine, model)}
    engine.destroy()
    engine, model = new_engine(make_config("ACCO", 2), seed=5)
    engine.load_checkpoint(directory, tag="elastic-acco")
    feed(engine, rank, 7, 15)
    result["acco"] = snapshot(engine, model)
    engine.destroy()
    return result


@pytest.mark.slow
def test_elastic_load_reshards_to_another_world_size(tmp_path):
    run_distributed(_elastic_worker, 3, str(tmp_path), "save")
    results = run_distributed(_elastic_worker, 2, str(tmp_path), "load")
    # Reference: AdamW on 3 workers for 4 updates, then on 2 workers (same optimizer state).
    from deepspeed.runtime.lr_schedules import WarmupLR
    sim = Simulator(3, clipping=1.0)
    scheduler = WarmupLR(sim.optimizer, warmup_min_lr=0.0, warmup_max_lr=1e-2, warmup_num_steps=3,
                         warmup_type="linear")
    for update in range(8):
        if update == 4:
            sim.ranks = [0, 1]
        total, count = sim.gradient_sum(sim.get(), 2)
        sim.adamw([t / count for t in total])
        scheduler.step()
    difference = (results[0]["sharded"]["holds"] - sim.flat()).abs().max().item()
    assert difference <= 1e-6, difference
    assert torch.equal(results[0]["sharded"]["holds"], results[1]["sharded"]["holds"])
    acco = results[0]["acco"]
    assert torch.isfinite(acco["committed"]).all() and acco["global_steps"] >= 6
    assert torch.equal(acco["committed"], results[1]["acco"]["committed"])


def _save_then_die(rank, world_size, port, directory):
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.set_num_threads(1)
    from deepspeed_acco.runtime import checkpoint_files
    engine, model = new_engine(make_config("ACCO", 2))
    feed(engine, rank, 0, 6)
    engine.save_checkpoint(directory, tag="good")
    feed(engine, rank, 6, 12)
    original = checkpoint_files.atomic_save

    def crash_midway(obj, path):
        with open(path + ".partial", "wb") as handle:
            handle.write(b"half a checkpoint")
        if rank == 0:
            os.kill(os.getpid(), 9)  # killed while writing
        original(obj, path)

    checkpoint_files.atomic_save = crash_midway
    engine.save_checkpoint(directory, tag="interrupted")
    os._exit(0)


def _load_latest(rank, world_size, directory):
    engine, model = new_engine(make_config("ACCO", 2), seed=9)
    path, _ = engine.load_checkpoint(directory)
    result = {"path": path, "global_steps": engine.global_steps}
    feed(engine, rank, 6, 12)
    result.update(snapshot(engine, model))
    engine.destroy()
    return result


def _continuous(rank, world_size):
    engine, model = new_engine(make_config("ACCO", 2))
    feed(engine, rank, 0, 12)
    result = snapshot(engine, model)
    engine.destroy()
    return result


@pytest.mark.slow
def test_a_crash_during_save_leaves_the_previous_checkpoint_and_latest(tmp_path):
    exit_codes = run_until_exit(_save_then_die, 2, str(tmp_path))
    assert exit_codes[0] == -9
    assert (tmp_path / "latest").read_text() == "good"
    assert not (tmp_path / "interrupted").exists()
    resumed = run_distributed(_load_latest, 2, str(tmp_path))
    continuous = run_distributed(_continuous, 2)
    assert resumed[0]["path"].endswith(os.path.join("good", "mp_rank_00_model_states.pt"))
    assert torch.equal(resumed[0]["holds"], continuous[0]["holds"])
    assert torch.equal(resumed[0]["committed"], continuous[0]["committed"])


def _consolidation_worker(rank, world_size, directory):
    results = {}
    for kind, params in (("ACCO", {}), ("CO2", {"local_steps": 2})):
        engine, model = new_engine(make_config(kind, 2, **params))
        feed(engine, rank, 0, 9)
        engine.save_checkpoint(directory, tag=kind)
        with engine.committed_parameters():
            results[kind] = {name: p.detach().clone() for name, p in model.named_parameters()}
        engine.destroy()
    return results


@pytest.mark.slow
def test_consolidation_writes_plain_fp32_weights_also_readable_by_deepspeed_tool(tmp_path):
    committed = run_distributed(_consolidation_worker, 2, str(tmp_path))[0]
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    for kind in ("ACCO", "CO2"):
        output = tmp_path / f"{kind}.pt"
        completed = subprocess.run([sys.executable, "-m", "deepspeed_acco.zero_to_fp32", str(tmp_path),
                                    str(output), "--tag", kind], capture_output=True, text=True, timeout=300)
        assert completed.returncode == 0, completed.stderr
        weights = torch.load(output, weights_only=True)
        assert all(weights[name].dtype == torch.float32 for name in weights)
        for name, value in committed[kind].items():
            assert torch.equal(weights[name], value), (kind, name)
        assert "frozen.weight" in weights  # frozen parameters come from the module states
        model = TinyNet(seed=3)
        model.load_state_dict(weights)  # a plain state dict for the plain model
        # DeepSpeed's own tool reads our layout too (for ZeRO-1 it leaves frozen parameters out).
        deepspeed_view = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path), tag=kind)
        for name, value in committed[kind].items():
            if not name.startswith("frozen."):
                assert torch.equal(deepspeed_view[name].float(), value), (kind, name)


def test_a_co2_checkpoint_from_before_its_entry_said_so_is_refused_by_its_registered_class():
    """Checkpoints written before ``continues_only_as_itself`` was recorded (the same FORMAT_VERSION):
    the saved type's registered class says CO2's state is its own, so the refusal comes from the check
    ``load_checkpoint`` runs before it reads or overwrites anything, in the words a new checkpoint gets
    (tests/test_new_type.py)."""
    from deepspeed_acco.runtime.optimizers import ACCO, CO2, DPU, ShardedAdamW
    old_co2 = {"format": 2, "optimizer_type": "CO2", "mid_round": False, "group_size": 1}
    for target in (ShardedAdamW, DPU, ACCO):
        schedule = target.__new__(target)  # the check reads only the class
        with pytest.raises(ValueError, match=rf"a CO2 checkpoint cannot continue as {target.type_name} \(CO2 keeps a "
                                             rf"replica and outer state per rank\); pass load_optimizer_states=False"):
            schedule.check_checkpoint_compatible(old_co2, 2)
    # The types whose committed state any type continues from still load into each other, old or new.
    for saved in ({"format": 2, "optimizer_type": "ACCO", "mid_round": False},
                  {"format": 2, "optimizer_type": "ACCO", "mid_round": False, "warmup_sync_updates": 0}, {}):
        DPU.__new__(DPU).check_checkpoint_compatible(saved, 2)
    assert CO2.continues_only_as_itself_reason and ACCO.continues_only_as_itself_reason is None
