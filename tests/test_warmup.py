"""Synchronous warm-up and cool-down (``warmup_sync_updates``, ``sync_after_updates``; docs/design.md, 3.6): the
first N committed updates of DPU and ACCO are ShardedAdamW updates, then the type's rule takes over
from the committed parameters with the optimizer state, step count and LR schedule carried on; with
a cool-down, every update after the first M is ShardedAdamW's again. Checkpoints inside the warm-up,
across the switches and inside the cool-down resume exactly (2 ranks, against the single-process
simulation)."""
import pytest
import torch

from distributed_utils import run_distributed
from reference_sim import (TinyNet, batch, flat_trainable, loss_fn, param_groups, run_sharded, simulate_acco,
                           simulate_dpu)

LR, WEIGHT_DECAY, ACCUMULATION, WARMUP = 1e-2, 0.1, 2, 3
AFTER = 4  # updates of the type's own rule after the warm-up (warm-up cases)
RULE, COOL = 2, 2  # cool-down cases: updates of the rule after the warm-up, then synchronous updates
# name -> (type, extra params, updates of the rule, synchronous updates at the end)
CASES = {"DPU": ("DPU", {}, AFTER, 0), "ACCO": ("ACCO", {}, AFTER, 0),
         "DPU-cool": ("DPU", {"sync_after_updates": WARMUP + RULE}, RULE, COOL),
         "ACCO-cool": ("ACCO", {"sync_after_updates": WARMUP + RULE}, RULE, COOL)}


def _config(case):
    kind, extra, _, _ = CASES[case]
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": ACCUMULATION,
            "gradient_clipping": 0.0, "steps_per_print": 1000,
            "optimizer": {"type": kind, "params": {"lr": LR, "weight_decay": WEIGHT_DECAY,
                                                    "warmup_sync_updates": WARMUP, **extra}}}


def _micro_batches(case):
    """Micro-batches per rank: the warm-up's full batches, the rule's (DPU: full batches, ACCO: two
    halves per update), the cool-down's full batches."""
    _, _, rule, cool = CASES[case]
    return (WARMUP + rule + cool) * ACCUMULATION


def _save_points(case):
    """Micro-batch indices to save at: inside the warm-up and just after the switch to the rule; for
    the cool-down cases, inside the rule's last update and inside the first synchronous update."""
    if CASES[case][3]:
        return ((WARMUP + RULE) * ACCUMULATION - 1, (WARMUP + RULE) * ACCUMULATION + 1)
    return (2 * ACCUMULATION, (WARMUP + 1) * ACCUMULATION)


def _run(rank, case, directory=None, save_at=None, load=False):
    import deepspeed_acco
    model = TinyNet(seed=0)
    engine, *_ = deepspeed_acco.initialize(model=model, model_parameters=param_groups(model, True, WEIGHT_DECAY),
                                           config=_config(case))
    phases, start = [], 0
    if load:
        _, client = engine.load_checkpoint(directory, tag=f"{case}-{save_at}")
        start = client["cursor"]
    for index in range(start, _micro_batches(case)):
        if save_at is not None and not load and index == save_at:
            engine.save_checkpoint(directory, tag=f"{case}-{save_at}", client_state={"cursor": index})
        x, y = batch(rank, index)
        engine.backward(loss_fn(engine(x), y))
        engine.step()
        phases.append((engine.global_steps, engine.schedule.in_sync_warmup, engine.schedule.in_sync_update))
    holds = flat_trainable(model)
    with engine.committed_parameters():
        committed = flat_trainable(model)
    result = {"holds": holds, "committed": committed, "global_steps": engine.global_steps, "phases": phases}
    engine.destroy()
    return result


def _worker(rank, world_size, directory):
    results = {}
    for case in CASES:
        results[(case, "straight")] = _run(rank, case)
        for save_at in _save_points(case):
            _run(rank, case, directory, save_at=save_at)
            results[(case, save_at)] = _run(rank, case, directory, save_at=save_at, load=True)
    return results


@pytest.mark.slow
def test_warmup_and_cooldown_are_synchronous_around_the_rule_and_checkpoints_resume_exactly(tmp_path):
    results = run_distributed(_worker, 2, str(tmp_path))
    flat = lambda tensors: torch.cat([t.reshape(-1) for t in tensors])  # noqa: E731
    options = dict(lr=LR, weight_decay=WEIGHT_DECAY)
    dpu_holds, dpu_sim = simulate_dpu(2, ACCUMULATION, AFTER, warmup=WARMUP, **options)
    acco_estimate, acco_committed, _ = simulate_acco(2, ACCUMULATION, AFTER, warmup=WARMUP, **options)
    # Cool-down: the rule's RULE updates after the warm-up (the DPU commit of the last one installed
    # at once), then COOL synchronous updates from theta_{WARMUP + RULE}; the model then holds the
    # committed parameters.
    _, dpu_cool = simulate_dpu(2, ACCUMULATION, RULE, warmup=WARMUP, **options)
    _, _, acco_cool = simulate_acco(2, ACCUMULATION, RULE, warmup=WARMUP, **options)
    dpu_cool, acco_cool = (run_sharded(sim, ACCUMULATION, COOL).get() for sim in (dpu_cool, acco_cool))
    references = {"DPU": (dpu_holds, dpu_sim.get()), "ACCO": (acco_estimate, acco_committed),
                  "DPU-cool": (dpu_cool, dpu_cool), "ACCO-cool": (acco_cool, acco_cool)}
    for case, (holds, committed) in references.items():
        straight = results[0][(case, "straight")]
        assert (straight["holds"] - flat(holds)).abs().max().item() <= 1e-6, f"{case}: what the model holds"
        assert (straight["committed"] - flat(committed)).abs().max().item() <= 1e-6, f"{case}: committed"
        # The warm-up's updates are installed at once: after each of the first WARMUP boundaries the
        # model holds the update just committed, and the warm-up ends exactly after WARMUP of them.
        warmup_steps = [steps for steps, warming, _ in straight["phases"] if warming]
        assert max(warmup_steps) == WARMUP - 1
        assert straight["phases"][WARMUP * ACCUMULATION - 1] == (WARMUP, False, False)
        if CASES[case][3]:
            # The cool-down starts exactly after WARMUP + RULE committed updates and each of its
            # updates is committed at its own boundary.
            synchronous = [steps for steps, _, sync in straight["phases"] if sync and steps >= WARMUP]
            first = (WARMUP + RULE) * ACCUMULATION - 1
            assert straight["phases"][first] == (WARMUP + RULE, False, True)
            assert synchronous[0] == WARMUP + RULE and straight["global_steps"] == WARMUP + RULE + COOL
            assert not any(sync for steps, _, sync in straight["phases"][WARMUP * ACCUMULATION:first])
        for rank in (0, 1):
            for save_at in _save_points(case):
                resumed = results[rank][(case, save_at)]
                assert torch.equal(resumed["holds"], results[rank][(case, "straight")]["holds"]), (case, save_at)
                assert torch.equal(resumed["committed"], results[rank][(case, "straight")]["committed"])
                assert resumed["global_steps"] == results[rank][(case, "straight")]["global_steps"]
