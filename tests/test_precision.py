"""Every optimizer type in every precision against the independent simulation (docs/precision.md, "Precision",
"Reduced precision": masters, anchors, CO2's y_k and every optimizer state are fp32, the model holds
the cast; with fp16 each round is unscaled by the loss scale its own backward used).

- The precision matrix: ShardedAdamW, DPU, ACCO, CO2 x {fp32, bf16, fp16} x overlap on/off on two
  ranks, against ``reference_sim`` run with fp32 master math and the model computing in the low
  precision (fp16 with a static power-of-two loss scale, which the simulation applies exactly).
- fp16 dynamic loss scaling: with power-of-two scales and no overflow, a run whose scale doubles at
  every update equals the static-scale run (docs/precision.md, "Precision": fp16 loss scaling).
- CO2 in bf16 at a small learning rate, where bf16 rounding bites: against the simulation, and its
  parameters move as far as in fp32 (docs/precision.md, "Precision": fp32 masters).
- ACCO with dynamic accumulation and a slow rank: the committed updates equal a simulation that
  replays each rank's micro-batch counts and averages by the global count (docs/design.md, 3.4).

Every engine run happens in one two-rank job (the module fixture), in the same processes, one
engine after the other; each test checks its part of the results.

Tolerances. The fp32 committed state (masters, CO2 anchors) must agree with the simulation to
1e-6 in every precision: the engine and the simulation do the same math in fp32 and differ only in
the last bits (fused kernels vs torch's AdamW, a multiply by 1/count vs a division; measured:
<= 1.2e-7 in every cell). What the model holds must be the cast of the simulated fp32 value or a
neighbour (one ulp of the model dtype), the only freedom last-bit fp32 differences leave. Every
precision defect this test guards against moves the fp32 state by far more (1e-3 to 1e-2: CO2
losing sub-ulp progress, a gradient unscaled by the wrong power of two), and a single one-ulp flip of
a bf16/fp16 model value would too (it changes the next gradient), so a looser bound would buy nothing.
"""
import time
import traceback

import pytest
import torch

import engine_probe as probe
from distributed_utils import run_distributed
from reference_sim import (TinyNet, batch, flat_trainable, loss_fn, param_groups, simulate_acco, simulate_co2,
                           simulate_dpu, simulate_sharded)

WORLD_SIZE = 2
MICRO_BATCH, ACCUMULATION = 4, 2
LR, WEIGHT_DECAY, CLIPPING = 1e-2, 0.1, 0.5
NUM_UPDATES = 8
"""Committed updates per matrix run (CO2: inner steps)."""
CO2_OPTIONS = dict(local_steps=2, outer_lr=1.0, outer_momentum=0.5, gap_penalty="adaptive")
TYPES = ("ShardedAdamW", "DPU", "ACCO", "CO2")
PRECISIONS = ("fp32", "bf16", "fp16")
MODEL_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
STATIC_LOSS_SCALE = 2.0**10
DYNAMIC_FP16 = {"enabled": True, "loss_scale": 0, "initial_scale_power": 6, "loss_scale_window": 1,
                "hysteresis": 2, "min_loss_scale": 1}
"""Dynamic scaling that doubles the scale after every overflow-free update: 2^6 up to 2^14 in eight
updates, always a power of two and (for this model) never overflowing."""
FP32_STATE_TOLERANCE = 1e-6

# CO2 in bf16 at a small learning rate (docs/precision.md, "Precision"): progress below one bf16 ulp per step
# must not be lost, measured at a small scale.
SLOW_LR, SLOW_UPDATES, SLOW_LOCAL_STEPS = 1e-4, 64, 4

# Dynamic accumulation: per micro-batch, rank 0 takes this long and rank 1 five times as long.
FAST_RANK_DELAY_S = 0.01
SLOW_RANK_DELAY_S = 0.05
DYNAMIC_UPDATES = 6


def precision_section(precision, fp16=None):
    if precision == "bf16":
        return {"bf16": {"enabled": True}}
    if precision == "fp16":
        return {"fp16": fp16 or {"enabled": True, "loss_scale": STATIC_LOSS_SCALE}}
    return {}


def make_config(kind, precision="fp32", lr=LR, overlap=True, fp16=None, **params):
    if kind == "CO2":
        params = {**CO2_OPTIONS, **params}
    # fp32 reductions: the matrix checks the fp32 master math against the simulation, which reduces in
    # fp32 (the default dtype, the model's, is tested in test_defaults.py)
    config = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": ACCUMULATION,
              "gradient_clipping": CLIPPING, "steps_per_print": 10_000, "communication_data_type": "fp32",
              "optimizer": {"type": kind, "params": dict(lr=lr, weight_decay=WEIGHT_DECAY, overlap=overlap, **params)}}
    config.update(precision_section(precision, fp16))
    return config


def micro_batches_for(kind, num_updates, local_steps=CO2_OPTIONS["local_steps"]):
    """Micro-batches per rank for ``num_updates`` committed updates (CO2: whole outer rounds of inner steps)."""
    if kind == "CO2":
        assert num_updates % local_steps == 0
    return num_updates * ACCUMULATION


# ---- the engine side: one job runs every configuration ---------------------------------------
def _train(rank, run):
    import deepspeed_acco
    model = TinyNet(seed=0)
    engine, *_ = deepspeed_acco.initialize(model=model, model_parameters=param_groups(model, True, WEIGHT_DECAY),
                                           config=run["config"])
    dtype = next(model.parameters()).dtype
    initial = flat_trainable(model).float()
    scales, grad_norms, rounds = [], [], []
    index, in_round = 0, 0

    def more():
        if "num_micro_batches" in run:
            return index < run["num_micro_batches"]
        return engine.global_steps < run["until_global_steps"]

    while more():
        x, y = batch(rank, index, MICRO_BATCH)
        loss = loss_fn(engine(x.to(dtype)).float(), y)
        engine.backward(loss)
        if run.get("delays_s"):
            time.sleep(run["delays_s"][rank])  # compute time; rank 1 is a slower GPU, emulated
        half = probe.acco_half(engine) if run.get("record_rounds") else None
        before = engine.global_steps
        scale_used = probe.loss_scale(engine)
        engine.step()
        index += 1
        in_round += 1
        if run.get("record_rounds") and probe.acco_half(engine) != half:
            rounds.append((half, in_round))
            in_round = 0
        if engine.global_steps != before:
            scales.append(scale_used)
            grad_norms.append(engine.get_global_grad_norm())
    result = {"holds": flat_trainable(model).float(), "initial": initial, "global_steps": engine.global_steps,
              "skipped": engine.skipped_steps, "scales": scales, "grad_norms": grad_norms, "rounds": rounds,
              "micro_batches": index}
    with engine.committed_parameters():
        result["committed"] = flat_trainable(model).float()
    result["fp32"] = probe.committed_fp32_fragments(engine)
    if run.get("record_rounds"):
        result["commits"] = probe.commit_micro_batches(engine)
    engine.destroy()
    return result


def _worker(rank, world_size, runs):
    results = {}
    for name, run in runs.items():
        try:
            results[name] = _train(rank, run)
        except Exception:  # one broken configuration must not hide the results of the others
            results[name] = {"error": traceback.format_exc()}
    return results


def _runs():
    runs = {}
    for kind in TYPES:
        for precision in PRECISIONS:
            for overlap in (True, False):
                runs[("matrix", kind, precision, overlap)] = {
                    "config": make_config(kind, precision, overlap=overlap),
                    "num_micro_batches": micro_batches_for(kind, NUM_UPDATES)}
        runs[("fp16-dynamic", kind)] = {"config": make_config(kind, "fp16", fp16=DYNAMIC_FP16),
                                        "num_micro_batches": micro_batches_for(kind, NUM_UPDATES)}
    slow = micro_batches_for("CO2", SLOW_UPDATES, SLOW_LOCAL_STEPS)
    for kind, precision in (("CO2", "fp32"), ("CO2", "bf16"), ("ShardedAdamW", "bf16")):
        runs[("small-lr", kind, precision)] = {
            "config": make_config(kind, precision, lr=SLOW_LR, **({"local_steps": SLOW_LOCAL_STEPS} if kind == "CO2"
                                                                  else {})),
            "num_micro_batches": slow}
    runs[("dynamic-accumulation",)] = {"config": make_config("ACCO", dynamic_accumulation=True),
                                       "until_global_steps": DYNAMIC_UPDATES,
                                       "delays_s": (FAST_RANK_DELAY_S, SLOW_RANK_DELAY_S),
                                       "record_rounds": True}
    return runs


@pytest.fixture(scope="module")
def results():
    return run_distributed(_worker, WORLD_SIZE, _runs(), timeout_s=400)


def get(results, name, rank=0):
    result = results[rank][name]
    if "error" in result:
        pytest.fail(f"{name} failed on rank {rank}:\n{result['error']}")
    return result


def fp32_state(results, name):
    """The committed fp32 state of a run, joined from every rank's shard."""
    return probe.assemble([get(results, name, rank)["fp32"] for rank in range(WORLD_SIZE)], TinyNet(0))


# ---- the simulation side ---------------------------------------------------------------------
def simulate(kind, precision, num_updates=NUM_UPDATES, lr=LR, local_steps=CO2_OPTIONS["local_steps"]):
    """(what the model holds at the end, the committed fp32 state), both fp32, as the engine should have them."""
    options = dict(lr=lr, weight_decay=WEIGHT_DECAY, clipping=CLIPPING, model_dtype=MODEL_DTYPES[precision],
                   loss_scale=STATIC_LOSS_SCALE if precision == "fp16" else 1.0)
    flat = lambda tensors: torch.cat([t.reshape(-1) for t in tensors])  # noqa: E731
    if kind == "ShardedAdamW":
        sim = simulate_sharded(WORLD_SIZE, ACCUMULATION, num_updates, **options)
        return sim.flat(), sim.flat()
    if kind == "DPU":
        holds, sim = simulate_dpu(WORLD_SIZE, ACCUMULATION, num_updates, **options)
        return flat(holds), sim.flat()
    if kind == "ACCO":
        estimate, committed, _ = simulate_acco(WORLD_SIZE, ACCUMULATION, num_updates, **options)
        return flat(estimate), flat(committed)
    co2 = {**CO2_OPTIONS, "local_steps": local_steps}
    holds, committed, _ = simulate_co2(WORLD_SIZE, ACCUMULATION, num_updates // local_steps, **co2, **options)
    return flat(holds), flat(committed)


def ulp_excess(ours, reference, dtype):
    """How far ``ours`` (model-dtype values, as fp32) lies beyond one ulp of the cast of ``reference``
    (fp32); <= 0 everywhere means every value is the cast or one of its two neighbours."""
    cast = reference.to(dtype).float()
    if dtype == torch.float32:
        return ((ours - cast).abs() - 1e-6).max().item()
    info = torch.finfo(dtype)
    one_ulp = torch.clamp(cast.abs(), min=info.tiny) * info.eps
    return ((ours - cast).abs() - one_ulp).max().item()


def expected_global_steps(kind, num_updates):
    # DPU and ACCO: the last commit is still in flight (docs/design.md, 3.2, 3.3).
    return num_updates - 1 if kind in ("DPU", "ACCO") else num_updates


# ---- the tests -------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("kind", TYPES)
def test_precision_matrix_matches_fp32_master_simulation(results, kind, precision):
    dtype = MODEL_DTYPES[precision]
    sim_holds, sim_committed = simulate(kind, precision)
    for overlap in (True, False):
        name = ("matrix", kind, precision, overlap)
        ours = get(results, name)
        label = f"{kind} {precision} overlap={overlap}"
        assert ours["skipped"] == 0, f"{label}: {ours['skipped']} updates skipped"
        assert ours["global_steps"] == expected_global_steps(kind, NUM_UPDATES), label
        for rank in range(1, WORLD_SIZE):
            assert torch.equal(get(results, name, rank)["holds"], ours["holds"]), f"{label}: ranks disagree"
        excess = ulp_excess(ours["holds"], sim_holds, dtype)
        assert excess <= 0, \
            f"{label}: the model holds values beyond one {precision} ulp of the simulation's (+{excess})"
        excess = ulp_excess(ours["committed"], sim_committed, dtype)
        assert excess <= 0, f"{label}: committed parameters beyond one {precision} ulp of the simulation's (+{excess})"
        difference = (fp32_state(results, name) - sim_committed).abs().max().item()
        assert difference <= FP32_STATE_TOLERANCE, \
            f"{label}: fp32 committed state (masters/anchors) differs from the fp32-master simulation by {difference}"
    on, off = (get(results, ("matrix", kind, precision, overlap)) for overlap in (True, False))
    for key in ("holds", "committed"):
        assert torch.equal(on[key], off[key]), f"{kind} {precision}: overlap on/off differ ({key})"
    moved = (sim_committed - on["initial"]).abs().max().item()
    assert moved > 100 * FP32_STATE_TOLERANCE, f"{kind} {precision}: too little movement to compare"


@pytest.mark.slow
@pytest.mark.parametrize("kind", TYPES)
def test_fp16_dynamic_loss_scale_equals_static_scale(results, kind):
    static = get(results, ("matrix", kind, "fp16", True))
    dynamic = get(results, ("fp16-dynamic", kind))
    assert static["skipped"] == dynamic["skipped"] == 0, "the comparison needs overflow-free runs"
    assert len(set(static["scales"])) == 1
    assert len(set(dynamic["scales"])) >= 4, f"the dynamic scale did not change enough: {dynamic['scales']}"
    # Power-of-two scales commute with every fp16 rounding: the unscaled gradients, hence their norms
    # and the updates, must not depend on the scale.
    assert len(static["grad_norms"]) == len(dynamic["grad_norms"])
    ratios = [d / s for s, d in zip(static["grad_norms"], dynamic["grad_norms"])]
    assert all(abs(ratio - 1) <= 1e-5 for ratio in ratios), \
        f"{kind}: gradient norm of each update, dynamic / static scale: {[round(r, 4) for r in ratios]} " \
        f"(loss scales {dynamic['scales']})"
    difference = (fp32_state(results, ("fp16-dynamic", kind))
                  - fp32_state(results, ("matrix", kind, "fp16", True))).abs().max().item()
    assert difference <= 1e-6, f"{kind}: fp32 masters after dynamic vs static loss scaling differ by {difference}"
    assert torch.equal(dynamic["holds"], static["holds"])


@pytest.mark.slow
def test_co2_bf16_keeps_fp32_progress_at_small_learning_rate(results):
    name = ("small-lr", "CO2", "bf16")
    _, sim_committed = simulate("CO2", "bf16", SLOW_UPDATES, lr=SLOW_LR, local_steps=SLOW_LOCAL_STEPS)
    difference = (fp32_state(results, name) - sim_committed).abs().max().item()
    assert difference <= FP32_STATE_TOLERANCE, \
        f"CO2 bf16: fp32 anchor differs from the fp32-master simulation by {difference}"
    ours = get(results, name)
    assert ulp_excess(ours["committed"], sim_committed, torch.bfloat16) <= 0

    def movement(run_name):
        run = get(results, run_name)
        initial = run["initial"]
        moved = (run["committed"] - initial).abs()
        return moved.mean().item(), (moved == 0).float().mean().item()

    co2_fp32, _ = movement(("small-lr", "CO2", "fp32"))
    co2_bf16, co2_bf16_frozen = movement(name)
    sharded_bf16, sharded_bf16_frozen = movement(("small-lr", "ShardedAdamW", "bf16"))
    summary = (f"mean |theta_T - theta_0|: CO2 fp32 {co2_fp32:.3g}, CO2 bf16 {co2_bf16:.3g}, ShardedAdamW bf16 "
               f"{sharded_bf16:.3g}; never moved: CO2 bf16 {co2_bf16_frozen:.0%}, ShardedAdamW bf16 "
               f"{sharded_bf16_frozen:.0%}")
    assert co2_bf16 >= 0.8 * co2_fp32, summary
    assert co2_bf16_frozen <= sharded_bf16_frozen + 0.1, summary


@pytest.mark.slow
def test_dynamic_accumulation_averages_by_the_global_count(results):
    name = ("dynamic-accumulation",)
    per_rank = [get(results, name, rank) for rank in range(WORLD_SIZE)]
    rounds = [r["rounds"] for r in per_rank]
    assert len(rounds[0]) == len(rounds[1]), "the ranks passed different numbers of boundaries"
    assert [half for half, _ in rounds[0]] == [half for half, _ in rounds[1]]
    assert [half for half, _ in rounds[0]] == ["A", "B"] * DYNAMIC_UPDATES + ["A"]
    fast, slow = per_rank[0]["micro_batches"], per_rank[1]["micro_batches"]
    assert fast > slow + 2, f"the counts are not unequal enough to test anything: {fast} vs {slow}"
    counts = []
    for update in range(DYNAMIC_UPDATES):
        first = {rank: rounds[rank][2 * update][1] for rank in range(WORLD_SIZE)}
        second = {rank: rounds[rank][2 * update + 1][1] for rank in range(WORLD_SIZE)}
        counts.append((first, second))
    # The engine's own record: the global count of each commit is the sum over ranks of both halves.
    assert [commit[1] for commit in per_rank[0]["commits"]] == \
        [sum(first.values()) + sum(second.values()) for first, second in counts]
    _, committed, _ = simulate_acco(WORLD_SIZE, ACCUMULATION, counts=counts, lr=LR, weight_decay=WEIGHT_DECAY,
                                    clipping=CLIPPING)
    committed = torch.cat([t.reshape(-1) for t in committed])
    for rank, result in enumerate(per_rank):
        difference = (result["committed"] - committed).abs().max().item()
        assert difference <= 1e-6, f"rank {rank}: committed parameters differ from the replay by {difference} " \
                                   f"(per-update counts {counts})"
        assert (result["holds"] - committed).abs().max().item() <= 1e-6  # A_N: the model holds theta_N
