"""Synchronous warm-up (``warmup_sync_updates``, issue 16): the first N committed updates of DPU and
ACCO are ShardedAdamW updates, then the type's rule takes over from the committed parameters with
the optimizer state, step count and LR schedule carried on; checkpoints inside the warm-up and
across the switch resume exactly (2 ranks, against the single-process simulation)."""
import pytest
import torch

from distributed_utils import run_distributed
from reference_sim import TinyNet, batch, flat_trainable, loss_fn, param_groups, simulate_acco, simulate_dpu

LR, WEIGHT_DECAY, ACCUMULATION, WARMUP = 1e-2, 0.1, 2, 3
AFTER = 4  # updates (DPU: rounds) of the type's own rule after the warm-up
CASES = {"DPU": WARMUP + AFTER, "ACCO": WARMUP + 2 * AFTER}  # rounds fed: DPU one per update, ACCO two
SAVE_POINTS = (2, WARMUP + 1)  # inside the warm-up, and just after the switch (in rounds of the rule)


def _config(kind):
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": ACCUMULATION,
            "gradient_clipping": 0.0, "steps_per_print": 1000,
            "optimizer": {"type": kind, "params": {"lr": LR, "weight_decay": WEIGHT_DECAY,
                                                    "warmup_sync_updates": WARMUP}}}


def _micro_batches(kind):
    """Micro-batches per rank: the warm-up's full batches, then the rule's rounds (ACCO: halves)."""
    rounds_after = CASES[kind] - WARMUP
    per_round = ACCUMULATION if kind == "DPU" else ACCUMULATION // 2
    return WARMUP * ACCUMULATION + rounds_after * per_round


def _run(rank, kind, directory=None, save_at=None, load=False):
    import deepspeed_acco
    model = TinyNet(seed=0)
    engine, *_ = deepspeed_acco.initialize(model=model, model_parameters=param_groups(model, True, WEIGHT_DECAY),
                                           config=_config(kind))
    phases, start = [], 0
    if load:
        _, client = engine.load_checkpoint(directory, tag=f"{kind}-{save_at}")
        start = client["cursor"]
    for index in range(start, _micro_batches(kind)):
        if save_at is not None and not load and index == save_at:
            engine.save_checkpoint(directory, tag=f"{kind}-{save_at}", client_state={"cursor": index})
        x, y = batch(rank, index)
        engine.backward(loss_fn(engine(x), y))
        engine.step()
        phases.append((engine.global_steps, engine.schedule.in_sync_warmup))
    holds = flat_trainable(model)
    with engine.committed_parameters():
        committed = flat_trainable(model)
    result = {"holds": holds, "committed": committed, "global_steps": engine.global_steps, "phases": phases}
    engine.destroy()
    return result


def _worker(rank, world_size, directory):
    results = {}
    for kind in CASES:
        results[(kind, "straight")] = _run(rank, kind)
        for save_at in (SAVE_POINTS[0] * ACCUMULATION, SAVE_POINTS[1] * ACCUMULATION):
            _run(rank, kind, directory, save_at=save_at)
            results[(kind, save_at)] = _run(rank, kind, directory, save_at=save_at, load=True)
    return results


@pytest.mark.slow
def test_warmup_is_synchronous_then_the_rule_takes_over_and_checkpoints_resume_exactly(tmp_path):
    results = run_distributed(_worker, 2, str(tmp_path))
    flat = lambda tensors: torch.cat([t.reshape(-1) for t in tensors])  # noqa: E731
    options = dict(lr=LR, weight_decay=WEIGHT_DECAY)
    dpu_holds, dpu_sim = simulate_dpu(2, ACCUMULATION, CASES["DPU"] - WARMUP, warmup=WARMUP, **options)
    acco_estimate, acco_committed, _ = simulate_acco(2, ACCUMULATION, (CASES["ACCO"] - WARMUP) // 2,
                                                     warmup=WARMUP, **options)
    references = {"DPU": (dpu_holds, dpu_sim.get()), "ACCO": (acco_estimate, acco_committed)}
    for kind, (holds, committed) in references.items():
        straight = results[0][(kind, "straight")]
        assert (straight["holds"] - flat(holds)).abs().max().item() <= 1e-6, f"{kind}: what the model holds"
        # The warm-up's updates are installed at once: after each of the first WARMUP boundaries the
        # model holds the update just committed, and the warm-up ends exactly after WARMUP of them.
        warmup_steps = [steps for steps, warming in straight["phases"] if warming]
        assert max(warmup_steps) == WARMUP - 1 and straight["phases"][WARMUP * ACCUMULATION - 1] == (WARMUP, False)
        for rank in (0, 1):
            for save_at in (SAVE_POINTS[0] * ACCUMULATION, SAVE_POINTS[1] * ACCUMULATION):
                resumed = results[rank][(kind, save_at)]
                assert torch.equal(resumed["holds"], results[rank][(kind, "straight")]["holds"]), (kind, save_at)
                assert torch.equal(resumed["committed"], results[rank][(kind, "straight")]["committed"])
                assert resumed["global_steps"] == results[rank][(kind, "straight")]["global_steps"]
    # ACCO's committed parameters too: the commit in flight at the end equals the simulation's.
    committed = results[0][("ACCO", "straight")]["committed"]
    assert (committed - flat(acco_committed)).abs().max().item() <= 1e-6
