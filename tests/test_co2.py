"""CO2 on the engine (docs/design.md, 3.5), multi-process gloo with 2, 3 and 4 ranks: against the
independent simulation, overlap on/off, clipping, the Local-SGD identity, and outer-state size."""
import pytest
import torch

from distributed_utils import run_distributed
from reference_sim import TinyNet, batch, flat_trainable, loss_fn, param_groups, simulate_co2

LR, WEIGHT_DECAY, ACCUMULATION, LOCAL_STEPS, ROUNDS = 1e-2, 0.1, 2, 3, 4

PAPER = dict(anchor_merge_steps=0)  # the paper's restart rule (docs/design.md 3.5), no longer the default
VARIANTS = {
    # "adaptive" without anchor_merge_steps: the paper's rule, the only one the adaptive penalty is defined for
    "adaptive": dict(gap_penalty="adaptive", outer_lr=1.0, outer_momentum=0.5),
    "constant": dict(gap_penalty=2.0, outer_lr=0.8, outer_momentum=0.3, **PAPER),
    "adaptive-clip": dict(gap_penalty="adaptive", outer_lr=1.0, outer_momentum=0.5, clip_threshold=2e-3),
    "constant-clip": dict(gap_penalty=1.0, outer_lr=1.0, outer_momentum=0.9, clip_threshold=2e-3, **PAPER),
    "loose-clip": dict(gap_penalty=1.0, outer_lr=1.0, outer_momentum=0.9, clip_threshold=1e3, **PAPER),
    "no-clip": dict(gap_penalty=1.0, outer_lr=1.0, outer_momentum=0.9, **PAPER),
    "local-sgd": dict(gap_penalty=1.0, outer_lr=1.0, outer_momentum=0.0, **PAPER),
    # anchor_merge_steps H: eager merging of the anchor H inner steps into the next round
    "eager-h1": dict(gap_penalty=1.0, outer_lr=1.0, outer_momentum=0.0, anchor_merge_steps=1),
    "eager-tau": dict(gap_penalty=1.5, outer_lr=0.8, outer_momentum=0.5, anchor_merge_steps=LOCAL_STEPS),
    "nesterov": dict(gap_penalty=1.0, outer_lr=0.7, outer_momentum=0.9, outer_nesterov=True, **PAPER),
    "normalize": dict(gap_penalty=1.0, outer_lr=0.5, outer_momentum=0.5, normalize_by_inner_lr=True, **PAPER),
    "warmup": dict(gap_penalty=1.0, outer_lr=0.5, outer_momentum=0.0, warmup_sync_updates=LOCAL_STEPS, **PAPER),
    "defaults": dict(),  # eager merge one inner step into each round (local_steps is set by the test)
}
# The engine's keys -> the simulation's (and a scheduler where the variant needs the LR to change).
_SIM_NAMES = {"outer_nesterov": "nesterov", "normalize_by_inner_lr": "normalize", "warmup_sync_updates": "warmup"}
_SCHEDULED = {"normalize"}
_ENGINE_DEFAULTS = dict(gap_penalty=1.0, outer_lr=0.5, outer_momentum=0.0, anchor_merge_steps=1)  # CO2Params'


def _eager(name):
    """Whether the variant merges eagerly (an adaptive penalty without anchor_merge_steps: the paper's rule)."""
    options = VARIANTS[name]
    return options.get("anchor_merge_steps", 0 if options.get("gap_penalty") == "adaptive" else 1) != 0


def _scheduler_section():
    return {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": LR, "warmup_num_steps": 5,
                                           "warmup_type": "linear"}}


def _sim_options(name):
    options = {_SIM_NAMES.get(key, key): value for key, value in VARIANTS[name].items()}
    for key, value in _ENGINE_DEFAULTS.items():
        options.setdefault(key, value)
    if not _eager(name):
        options["anchor_merge_steps"] = None  # the simulation's name for the paper's rule
    if name in _SCHEDULED:
        from deepspeed.runtime.lr_schedules import WarmupLR
        params = _scheduler_section()["params"]
        options["lr_scheduler"] = lambda optimizer: WarmupLR(optimizer, **params)
    return options


def _co2_worker(rank, world_size, runs):
    import deepspeed_acco
    results = {}
    for name, group_size, overlap in runs:
        model = TinyNet(seed=0)
        config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": ACCUMULATION,
                  "gradient_clipping": 0.0, "steps_per_print": 1000,
                  "optimizer": {"type": "CO2", "params": dict(lr=LR, weight_decay=WEIGHT_DECAY, local_steps=LOCAL_STEPS,
                                                              group_size=group_size, overlap=overlap,
                                                              **VARIANTS[name])}}
        if name in _SCHEDULED:
            config["scheduler"] = _scheduler_section()
        engine, *_ = deepspeed_acco.initialize(model=model, model_parameters=param_groups(model, True, WEIGHT_DECAY),
                                               config=config)
        schedule = engine.schedule
        boundaries = []
        start = [s.round_start.clone() for s in schedule.outers]  # x_0
        mid_replica = None
        for index in range(ROUNDS * LOCAL_STEPS * ACCUMULATION):
            x, y = batch(rank, index)
            engine.backward(loss_fn(engine(x), y))
            rounds_before, steps_before = schedule.outer_rounds, engine.global_steps
            engine.step()
            if schedule.outer_rounds != rounds_before:
                # y_k = x_k + displacement (this rank's inner shard; all of it without groups).
                boundaries.append({"y": [x_k + s.displacement.float() for x_k, s in zip(start, schedule.outers)],
                                   "x_next": [f.model_flat.clone() for f in engine.optimizer.flats]})
                start = [s.round_start.clone() for s in schedule.outers]
            elif engine.global_steps != steps_before and schedule.outer_rounds == ROUNDS - 1:
                mid_replica = [f.model_flat.clone() for f in engine.optimizer.flats]
        result = {"holds": flat_trainable(model), "global_steps": engine.global_steps, "boundaries": boundaries,
                  "mid_replica": mid_replica}
        with engine.committed_parameters():
            result["committed"] = flat_trainable(model)
        result["sizes"] = [(f.padded_numel, s.prev_anchor.numel(), s.anchor.numel(), s.momentum.numel(),
                            s.mean_displacement.numel()) for f, s in zip(engine.optimizer.flats, schedule.outers)]
        engine.destroy()
        results[(name, group_size, overlap)] = result
    return results


def _check_against_simulation(results, world_size, name, group_size):
    options = _sim_options(name)
    rounds = ROUNDS - options.get("warmup", 0) // LOCAL_STEPS
    holds, committed, _ = simulate_co2(world_size, ACCUMULATION, rounds, local_steps=LOCAL_STEPS,
                                       group_size=group_size, lr=LR, weight_decay=WEIGHT_DECAY, **options)
    ours = results[0][(name, group_size, True)]
    assert ours["global_steps"] == ROUNDS * LOCAL_STEPS
    difference = (ours["holds"] - torch.cat([t.reshape(-1) for t in holds])).abs().max().item()
    assert difference <= 1e-6, f"{name}, group_size={group_size}: what rank 0 holds differs by {difference}"
    difference = (ours["committed"] - torch.cat([t.reshape(-1) for t in committed])).abs().max().item()
    assert difference <= 1e-6, f"{name}, group_size={group_size}: the newest anchor differs by {difference}"
    if not _eager(name):
        for rank_result in results:  # every replica restarts from the same anchor
            assert torch.equal(rank_result[(name, group_size, True)]["holds"], ours["holds"])


@pytest.mark.slow
def test_co2_two_ranks_matches_simulation_overlap_clipping_and_local_sgd_identity():
    runs = [(name, 1, True) for name in VARIANTS] + [("adaptive", 1, False), ("constant-clip", 1, False)]
    results = run_distributed(_co2_worker, 2, runs)
    for name in ("adaptive", "constant", "adaptive-clip", "constant-clip"):
        _check_against_simulation(results, 2, name, 1)
    for name in ("adaptive", "constant-clip"):
        for rank_result in results:
            assert torch.equal(rank_result[(name, 1, True)]["holds"], rank_result[(name, 1, False)]["holds"])
            assert torch.equal(rank_result[(name, 1, True)]["committed"], rank_result[(name, 1, False)]["committed"])

    # Clipping that binds changes the trajectory; one that never binds changes nothing.
    clipped, loose, plain = (results[0][(name, 1, True)]["committed"] for name in ("constant-clip", "loose-clip",
                                                                                   "no-clip"))
    assert torch.equal(loose, plain)
    assert (clipped - plain).abs().max() > 1e-4

    # alpha_o = 1, beta_o = 0, lambda = 1: x_{k+2} = ybar_k + (x_{k+1} - x_k), checked on the engine.
    boundaries = [rank_result[("local-sgd", 1, True)]["boundaries"] for rank_result in results]
    initial = [flat.clone() for flat in boundaries[0][0]["x_next"]]  # x_1 = x_0
    anchors = [initial, initial] + [b["x_next"] for b in boundaries[0][1:]]  # x_0, x_1, x_2, ...
    assert len(anchors) == ROUNDS + 1
    for k in range(ROUNDS - 1):
        for group in range(len(initial)):
            ybar = sum(rank_boundaries[k]["y"][group] for rank_boundaries in boundaries) / len(boundaries)
            expected = ybar + (anchors[k + 1][group] - anchors[k][group])
            assert (anchors[k + 2][group] - expected).abs().max() <= 1e-6, k
    assert (anchors[3][0] - anchors[1][0]).abs().max() > 1e-3  # the anchor really moved


@pytest.mark.slow
def test_co2_three_ranks_matches_simulation():
    results = run_distributed(_co2_worker, 3, [("adaptive-clip", 1, True), ("constant", 1, True)])
    _check_against_simulation(results, 3, "adaptive-clip", 1)
    _check_against_simulation(results, 3, "constant", 1)


@pytest.mark.slow
def test_co2_four_ranks_groups_of_two_and_outer_state_scales_as_one_over_w():
    runs = [("adaptive", 2, True), ("constant-clip", 2, True), ("adaptive", 1, True), ("eager-h1", 2, True),
            ("warmup", 2, True)]
    results = run_distributed(_co2_worker, 4, runs, timeout_s=480)
    _check_against_simulation(results, 4, "eager-h1", 2)
    _check_against_simulation(results, 4, "warmup", 2)
    _check_against_simulation(results, 4, "adaptive", 2)
    _check_against_simulation(results, 4, "constant-clip", 2)
    _check_against_simulation(results, 4, "adaptive", 1)
    # Ranks of a group hold identical replicas mid-round; different groups do not.
    holds = [r[("adaptive", 2, True)]["mid_replica"][0] for r in results]
    assert torch.equal(holds[0], holds[1]) and torch.equal(holds[2], holds[3])
    assert not torch.equal(holds[0], holds[2])
    # Outer state per rank is one W-th of the padded model (memory O(params / W)).
    two_rank = run_distributed(_co2_worker, 2, [("adaptive", 1, True)])[0][("adaptive", 1, True)]["sizes"]
    for sizes_by_world, world_size in ((results[0][("adaptive", 2, True)]["sizes"], 4), (two_rank, 2)):
        for padded, *outer_shards in sizes_by_world:
            assert all(size == padded // world_size for size in outer_shards)
    # ... up to the padding that aligns every shard (at most SHARD_ALIGNMENT_ELEMENTS per rank and group).
    from deepspeed_acco.runtime.flat import SHARD_ALIGNMENT_ELEMENTS
    trainable = sum(p.numel() for p in TinyNet().parameters() if p.requires_grad)
    for sizes_by_world, world_size in ((results[0][("adaptive", 2, True)]["sizes"], 4), (two_rank, 2)):
        padding = sum(s[1] for s in sizes_by_world) * world_size - trainable
        assert 0 <= padding < SHARD_ALIGNMENT_ELEMENTS * world_size * len(sizes_by_world)


@pytest.mark.slow
def test_co2_options_and_defaults_match_simulation():
    """Eager merging (H = 1 and H = tau), outer Nesterov, SlowMo's lr normalisation, the synchronous
    warm-up and the defaults, on 2 ranks; eager mode with overlap off too (same numbers)."""
    names = ("eager-h1", "eager-tau", "nesterov", "normalize", "warmup", "defaults")
    runs = [(name, 1, True) for name in names] + [("eager-h1", 1, False)]
    results = run_distributed(_co2_worker, 2, runs)
    for name in names:
        _check_against_simulation(results, 2, name, 1)
    for rank_result in results:
        assert torch.equal(rank_result[("eager-h1", 1, True)]["holds"], rank_result[("eager-h1", 1, False)]["holds"])
    # Eager replicas keep their own progress: the two ranks hold different parameters mid-training.
    assert not torch.equal(results[0][("eager-h1", 1, True)]["holds"], results[1][("eager-h1", 1, True)]["holds"])


def test_outer_wait_monitor_warns_once_after_consecutive_unhidden_rounds():
    from deepspeed_acco.runtime.optimizers.co2 import OuterWaitMonitor
    now = [0.0]
    monitor = OuterWaitMonitor("local_steps", 4, clock=lambda: now[0])

    def round_of(seconds, waited):
        now[0] += seconds
        return monitor.record(waited)

    assert round_of(1.0, 0.5) is None  # the first boundary only starts the clock
    assert [round_of(1.0, 0.01) for _ in range(5)] == [None] * 5  # hidden: 1% of each round
    assert round_of(1.0, 0.5) is None and round_of(1.0, 0.5) is None
    assert round_of(1.0, 0.0) is None  # a hidden round resets the count
    assert round_of(1.0, 0.5) is None and round_of(1.0, 0.5) is None
    message = round_of(1.0, 0.5)
    assert message is not None and "optimizer.params.local_steps (now 4)" in message
    assert round_of(1.0, 0.9) is None  # once
    for local_steps, names_bound in ((4, False), (1, True)):
        eager = OuterWaitMonitor("anchor_merge_steps", 1, clock=lambda: now[0], bound=("local_steps", local_steps))
        assert eager.record(0.0) is None
        messages = []
        for _ in range(3):
            now[0] += 2.0
            messages.append(eager.record(1.0))
        assert messages[:2] == [None, None] and "optimizer.params.anchor_merge_steps (now 1)" in messages[2]
        # At its upper bound (H = local_steps) raising H alone is refused by the config check: name both.
        assert ("optimizer.params.local_steps (now 1)" in messages[2]) == names_bound, messages[2]
