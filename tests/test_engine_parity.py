"""Multi-process (gloo) parity tests of the engine (docs/design.md, section 4, layer 3).

- ShardedAdamW against DeepSpeed's own ZeRO-1 + AdamW (docs/design.md 3.1: fp32, 1e-6 after 20 updates).
- DPU and ACCO against the independent simulation of docs/design.md 3.2 / 3.3 (1e-6).
- ``overlap: true`` against ``overlap: false``: bitwise identical.
Two param groups (one without weight decay), a frozen layer and 122 trainable parameters, which
3 ranks do not divide.
"""
import pytest
import torch

from distributed_utils import run_distributed
from reference_sim import (TinyNet, batch, flat_trainable, loss_fn, param_groups, simulate_acco, simulate_dpu,
                           simulate_sharded)

LR, WEIGHT_DECAY, MICRO_BATCH, ACCUMULATION = 1e-2, 0.1, 4, 2
NUM_UPDATES = 20


def make_config(kind, world_size, clipping=0.0, **params):
    config = {
        "train_batch_size": MICRO_BATCH * ACCUMULATION * world_size,
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": ACCUMULATION,
        "gradient_clipping": clipping,
        "steps_per_print": 1000,
        "optimizer": {"type": kind, "params": dict(lr=LR, weight_decay=WEIGHT_DECAY, **params)},
    }
    if kind == "AdamW":
        config["zero_optimization"] = {"stage": 1}
    return config


def train(rank, config, num_micro_batches):
    """Train TinyNet on this rank's micro-batches; return what the model holds and the committed params."""
    import deepspeed_acco
    model = TinyNet(seed=0)
    engine, _, _, _ = deepspeed_acco.initialize(model=model, model_parameters=param_groups(model, True, WEIGHT_DECAY),
                                                config=config)
    for index in range(num_micro_batches):
        x, y = batch(rank, index, MICRO_BATCH)
        loss = loss_fn(engine(x), y)
        engine.backward(loss)
        engine.step()
    result = {"holds": flat_trainable(model), "global_steps": engine.global_steps}
    committed = getattr(engine, "committed_parameters", None)
    if committed is not None:
        with committed():
            result["committed"] = flat_trainable(model)
        engine.destroy()
    return result


def _deepspeed_vs_sharded(rank, world_size):
    runs = {}
    for clipping in (0.0, 1.0):
        for kind in ("AdamW", "ShardedAdamW"):
            runs[(kind, clipping)] = train(rank, make_config(kind, world_size, clipping), NUM_UPDATES * ACCUMULATION)
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_sharded_adamw_matches_deepspeed_zero1(world_size):
    results = run_distributed(_deepspeed_vs_sharded, world_size)
    for clipping in (0.0, 1.0):
        deepspeed_params = results[0][("AdamW", clipping)]["holds"]
        for rank_result in results:
            ours = rank_result[("ShardedAdamW", clipping)]
            assert ours["global_steps"] == NUM_UPDATES
            difference = (ours["holds"] - deepspeed_params).abs().max().item()
            assert difference <= 1e-6, f"clipping={clipping}: max |ShardedAdamW - DeepSpeed ZeRO-1| = {difference}"
    # Sanity: the runs trained (parameters moved) and clipping changed the trajectory.
    initial = flat_trainable(TinyNet(seed=0))
    assert (results[0][("ShardedAdamW", 0.0)]["holds"] - initial).abs().max() > 1e-2
    assert (results[0][("ShardedAdamW", 0.0)]["holds"] - results[0][("ShardedAdamW", 1.0)]["holds"]).abs().max() > 1e-5


def _overlap_variants(rank, world_size):
    runs = {}
    num_micro_batches = NUM_UPDATES * ACCUMULATION
    for kind in ("DPU", "ACCO"):
        for overlap in (True, False):
            runs[(kind, overlap)] = train(rank, make_config(kind, world_size, overlap=overlap), num_micro_batches)
    runs[("ACCO-clip", True)] = train(rank, make_config("ACCO", world_size, clipping=0.5), num_micro_batches)
    runs[("ShardedAdamW", True)] = train(rank, make_config("ShardedAdamW", world_size), num_micro_batches)
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_dpu_and_acco_match_simulation_and_overlap_is_bitwise(world_size):
    results = run_distributed(_overlap_variants, world_size)
    for kind in ("DPU", "ACCO"):
        for rank_result in results:
            assert torch.equal(rank_result[(kind, True)]["holds"], rank_result[(kind, False)]["holds"]), \
                f"{kind}: overlap on/off differ"
            assert torch.equal(rank_result[(kind, True)]["holds"], results[0][(kind, True)]["holds"]), \
                f"{kind}: ranks disagree"

    options = dict(lr=LR, weight_decay=WEIGHT_DECAY)
    sharded = simulate_sharded(world_size, ACCUMULATION, NUM_UPDATES, **options)
    assert (results[0][("ShardedAdamW", True)]["holds"] - sharded.flat()).abs().max() <= 1e-6

    dpu_holds, dpu_sim = simulate_dpu(world_size, ACCUMULATION, NUM_UPDATES, **options)
    dpu = results[0][("DPU", True)]
    assert dpu["global_steps"] == NUM_UPDATES - 1  # the last commit is still in flight
    assert (dpu["holds"] - torch.cat([p.reshape(-1) for p in dpu_holds])).abs().max() <= 1e-6
    assert (dpu["committed"] - dpu_sim.flat()).abs().max() <= 1e-6

    for name, clipping in (("ACCO", 0.0), ("ACCO-clip", 0.5)):
        estimate, committed, _ = simulate_acco(world_size, ACCUMULATION, NUM_UPDATES, clipping=clipping, **options)
        acco = results[0][(name, True)]
        assert acco["global_steps"] == NUM_UPDATES - 1
        difference = (acco["holds"] - torch.cat([p.reshape(-1) for p in estimate])).abs().max().item()
        assert difference <= 1e-6, f"{name}: estimate differs from the simulation by {difference}"
        difference = (acco["committed"] - torch.cat([p.reshape(-1) for p in committed])).abs().max().item()
        assert difference <= 1e-6, f"{name}: committed parameters differ from the simulation by {difference}"
    # The three methods really differ (the comparison above could not pass by accident).
    assert (results[0][("DPU", True)]["committed"] - results[0][("ACCO", True)]["committed"]).abs().max() > 1e-4
