"""The one place where tests read or poke the engine's internal state.

The public engine API (``deepspeed_acco.initialize``, ``engine(...)``, ``backward``, ``step``,
``global_steps``, ``global_samples``, ``get_lr()``, ``committed_parameters()``, checkpoints,
``communication_wait_s``) covers most checks. A few facts have no public accessor: the fp32
masters behind a low-precision model, the AdamW step count, the loss scale, where an ACCO rank
stands between boundaries, the micro-batch counts of each job. Each is one function here, so that
when the runtime is restructured only this module has to follow. Nothing here is collective.
"""
from typing import Dict, List, Optional, Tuple

import torch


def drain(engine) -> None:
    """Wait for the job in flight without consuming its result (what ``save_checkpoint`` does first)."""
    engine.schedule.drain()


def committed_fp32_fragments(engine) -> Dict[str, List[Tuple[int, torch.Tensor]]]:
    """This rank's piece of the committed fp32 state, by parameter name: {name: [(start, values)]}.

    "Committed" after draining the job in flight: the fp32 master shard for ShardedAdamW, DPU and
    ACCO (it includes a finished commit that is not installed yet), the fp32 anchor shard x_{k+1}
    (x_{k+2} once J_k finished) for CO2. ``start`` is the offset inside the flattened parameter.
    Fragments of every rank together cover every trainable parameter exactly once
    (see :func:`assemble`).
    """
    drain(engine)
    names = {id(p): name for name, p in engine.module.named_parameters()}
    optimizer = engine.optimizer
    if engine.engine_config.optimizer_type == "CO2":
        pieces = [(outer.shard_offset, outer.anchor) for outer in engine.schedule.outers]
    else:
        pieces = [(flat.shard_offset, shard.master) for flat, shard in zip(optimizer.flats, optimizer.shards)]
    fragments: Dict[str, List[Tuple[int, torch.Tensor]]] = {}
    for flat, (low, values) in zip(optimizer.flats, pieces):
        high = low + values.numel()
        for p, offset in zip(flat.params, flat.offsets):
            start, end = max(offset, low), min(offset + p.numel(), high)
            if start < end:
                fragments.setdefault(names[id(p)], []).append((start - offset, values[start - low:end - low].clone()))
    return fragments


def assemble(fragments_by_rank, model: torch.nn.Module) -> torch.Tensor:
    """Join every rank's :func:`committed_fp32_fragments` into one flat fp32 vector in the order of
    ``model``'s trainable parameters (the order of ``reference_sim.flat_trainable``)."""
    pieces = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        full = torch.zeros(p.numel(), dtype=torch.float32)
        covered = torch.zeros(p.numel(), dtype=torch.int32)
        for fragments in fragments_by_rank:
            for start, values in fragments.get(name, []):
                full[start:start + values.numel()] = values.float()
                covered[start:start + values.numel()] += 1
        assert bool((covered == 1).all()), f"{name}: the ranks' fragments do not cover it exactly once"
        pieces.append(full)
    return torch.cat(pieces)


def adamw_step_count(engine) -> int:
    """The AdamW step count of the next update minus one (bias correction), our engine or DeepSpeed's."""
    if hasattr(engine, "schedule"):  # ours
        return int(engine.schedule.progress.applied_steps)
    # DeepSpeed ZeRO-1: the wrapped torch optimizer's per-parameter state.
    base = engine.optimizer.optimizer
    steps = {int(state["step"].item() if torch.is_tensor(state["step"]) else state["step"])
             for state in base.state.values() if "step" in state}
    assert len(steps) == 1, f"DeepSpeed's parameter groups disagree on the step count: {steps}"
    return steps.pop()


def loss_scale(engine) -> float:
    """The fp16 loss scale the next backward uses."""
    return float(engine.schedule.loss_scale.scale)


def acco_half(engine) -> str:
    """ACCO: "A" while the rank accumulates a first half (at the estimate), "B" in a second half."""
    return "A" if engine.schedule.phase.value == "first_half" else "B"


def commit_micro_batches(engine) -> List[Tuple[int, int, bool]]:
    """Per installed commit (oldest first): (this rank's micro-batches in the job's last round,
    global micro-batches the update averaged, skipped)."""
    return [(result.local_micro_batches, result.global_micro_batches, result.skipped)
            for result in engine.recent_commits]


def in_flight_micro_batches(engine) -> int:
    """Global micro-batches held by the finished-but-not-installed job, not in any installed commit.

    A pending commit counts both halves; a pending ACCO estimate counts its first half.
    """
    drain(engine)
    running = engine.schedule.running
    if running is None:
        return 0
    return int(running.wait().global_micro_batches)


def partial_round_micro_batches(engine) -> int:
    """Micro-batches this rank has accumulated in the current round (not handed to any job yet)."""
    return int(engine.schedule.round_micro_batches)


def poison_outer_reduce_scatter(engine, call_index: int) -> None:
    """CO2: make this rank's ``call_index``-th (0-based) outer reduce-scatter return NaN, so that
    the outer round's mean parameters are non-finite on every rank."""
    communicator = engine.schedule.outer_communicator
    original = communicator.reduce_scatter
    calls = {"n": 0}

    def poisoned(output, input):
        original(output, input)
        if calls["n"] == call_index:
            output.fill_(float("nan"))
        calls["n"] += 1

    communicator.reduce_scatter = poisoned


def outer_skips(engine) -> Optional[int]:
    """CO2: outer rounds skipped for non-finite values, as counted by the engine."""
    return getattr(engine.schedule, "outer_skips", None)


def engine_state(engine) -> Dict[str, object]:
    """Everything a checkpoint load may change, copied: the module's tensors, every flat buffer
    (model, gathered output, partial sums), masters and the rule's state, counters, LR scheduler,
    param-group hyperparameters, loss scale, phase and round, the job in flight (the same object, its
    kind) and each type's own state (ACCO's kept first half, CO2's outer state). Waits for nothing
    and changes nothing; compare two with :func:`state_differences`."""
    schedule = engine.schedule

    def copy(value):
        if torch.is_tensor(value):
            return value.detach().clone()
        if isinstance(value, dict):
            return {key: copy(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return [copy(item) for item in value]
        return value

    state = {
        "module": {key: value.detach().clone() for key, value in
                   list(engine.module.named_parameters()) + list(engine.module.named_buffers())},
        "flats": [{"model": flat.model_flat, "grad_accum": flat.grad_accum, "gather": flat.gather,
                   "job_grad": flat.job_grad} for flat in engine.optimizer.flats],
        "shards": [{"master": shard.master, **shard.state} for shard in engine.optimizer.shards],
        "param_groups": [{key: value for key, value in group.items() if key != "params"}
                         for group in engine.optimizer.param_groups],
        "progress": schedule.progress.state_dict(),
        "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
        "loss_scale": vars(schedule.loss_scale),
        "phase": schedule.phase, "round_micro_batches": schedule.round_micro_batches,
        "round_loss_scale": schedule.round_loss_scale, "jobs_launched": schedule.jobs_launched,
        "running": id(schedule.running) if schedule.running is not None else None,
        "running_kind": schedule.running_kind, "warmup_sync_updates": schedule.warmup_sync_updates,
    }
    for name in ("first_half_sum", "boundary_masters", "inner_steps_in_round", "outer_rounds", "outer_skips",
                 "round_lr_sums"):
        if hasattr(schedule, name):
            state[name] = getattr(schedule, name)
    if hasattr(schedule, "outers"):
        state["outers"] = [{"anchor": outer.anchor, "prev_anchor": outer.prev_anchor, "momentum": outer.momentum,
                            "round_start": outer.round_start, "gather": outer.gather} for outer in schedule.outers]
    return copy(state)


def state_differences(before: Dict[str, object], after: Dict[str, object], path: str = "") -> List[str]:
    """The paths at which two :func:`engine_state` copies differ (bitwise for tensors)."""
    if torch.is_tensor(before) or torch.is_tensor(after):
        same = torch.is_tensor(before) and torch.is_tensor(after) and before.dtype == after.dtype \
            and torch.equal(before, after)
        return [] if same else [path]
    if isinstance(before, dict) and isinstance(after, dict):
        if set(before) != set(after):
            return [f"{path} keys"]
        return [item for key in before for item in state_differences(before[key], after[key], f"{path}.{key}")]
    if isinstance(before, list) and isinstance(after, list):
        if len(before) != len(after):
            return [f"{path} length"]
        return [item for index, (a, b) in enumerate(zip(before, after))
                for item in state_differences(a, b, f"{path}[{index}]")]
    return [] if before == after else [path]
