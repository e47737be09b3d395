"""Checkpoints in DeepSpeed's ZeRO-1 layout, continuing the overlapped pipeline exactly (DESIGN 5).

Layout (``save_dir/tag/``), as DeepSpeed writes it, so its tools and loaders understand ours:
  mp_rank_00_model_states.pt                   rank 0: module (what the model holds), counters,
                                               LR scheduler, config, param shapes
  [bf16_]zero_pp_rank_{r}_mp_rank_00_optim_states.pt
                                               rank r: its fp32 master shard (CO2: anchor shard),
                                               AdamW moment shards and step, plus under the key
                                               "deepspeed_acco" the in-flight state of the schedule

The in-flight state is what a round boundary leaves behind: the phase, the finished-but-not-yet-
installed job result (its output is either the master weights or, for an ACCO estimate, a
stored shard), ACCO's kept first-half gradient shard, CO2's anchors and outer momentum. Every
piece is a shard, so a rank's file is O(params / W); only a save in the middle of a round adds
the rank's partial gradient sums (O(params)), and a CO2 save inside an outer round its replica. Loading reads every rank's file and rebuilds full
vectors, which also re-shards for a different world size.

Saving is atomic: files go to a staging directory that is renamed into place once every rank
has written, and ``latest`` is replaced last, so a crash mid-save leaves the previous checkpoint
and ``latest`` intact.
"""
import collections
import dataclasses
import logging
import os
import shutil
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..config import CO2
from .comm import CompletedWork
from .flat import FlatParamGroup, padded_numel
from .jobs import JobKind, JobResult
from .schedule import Phase

MODEL_STATES_NAME = "mp_rank_00_model_states.pt"
LATEST_NAME = "latest"
OUR_KEY = "deepspeed_acco"
FORMAT_VERSION = 1
OPTIMIZER_STATE_KEY = "optimizer_state_dict"
logger = logging.getLogger("deepspeed_acco")


def optimizer_states_name(rank: int, bf16: bool) -> str:
    return f"{'bf16_' if bf16 else ''}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def _atomic_save(obj: Any, path: str) -> None:
    temporary = f"{path}.tmp-{os.getpid()}"
    with open(temporary, "wb") as handle:
        torch.save(obj, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)


def _atomic_write_text(path: str, text: str) -> None:
    temporary = f"{path}.tmp-{os.getpid()}"
    with open(temporary, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)


def _fsync_directory(path: str) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _valid_prefix(shard: torch.Tensor, numel: int, rank: int) -> int:
    """How many leading elements of rank ``rank``'s shard are real parameters (not padding)."""
    return max(0, min(shard.numel(), numel - rank * shard.numel()))


def _param_names(module: torch.nn.Module) -> Tuple[Dict[int, str], Dict[str, str]]:
    names, shared = {}, {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in names:
            shared[name] = names[id(p)]
        else:
            names[id(p)] = name
    return names, shared


def _slice_mappings(flat: FlatParamGroup, names: Dict[int, str], shard_numel: int, rank: int):
    """Per parameter, the fragment of it that lies in this rank's shard (DeepSpeed's param_slice_mappings)."""
    from deepspeed.utils.tensor_fragment import fragment_address
    low, high = rank * shard_numel, (rank + 1) * shard_numel
    mappings = collections.OrderedDict()
    for p, offset in zip(flat.params, flat.offsets):
        start, end = max(offset, low), min(offset + p.numel(), high)
        if start < end:
            mappings[names[id(p)]] = fragment_address(numel=end - start, start=start - low)
    return mappings


def _result_to_dict(result) -> Dict:
    values = dataclasses.asdict(result)
    values.pop("timings_s", None)
    if isinstance(values.get("kind"), JobKind):
        values["kind"] = values["kind"].value
    return values


# ---- save ----------------------------------------------------------------------------------
def save_checkpoint(engine, save_dir: str, tag: Optional[str], client_state: Dict, save_latest: bool) -> bool:
    tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"
    if not tag or os.sep in tag or tag.startswith("."):
        raise ValueError(f"save_checkpoint: tag {tag!r} must be a non-empty name without path separators")
    engine.schedule.drain()  # the running job finishes; its result stays pending, and is saved
    rank = engine.global_rank
    final_directory = os.path.join(save_dir, tag)
    staging = os.path.join(save_dir, f".{tag}.staging")
    if rank == 0:
        os.makedirs(save_dir, exist_ok=True)
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)
    _barrier()
    bf16 = engine.config.precision == "bf16"
    _atomic_save(_optimizer_states(engine), os.path.join(staging, optimizer_states_name(rank, bf16)))
    if rank == 0:
        _atomic_save(_model_states(engine, client_state), os.path.join(staging, MODEL_STATES_NAME))
    _barrier()
    if rank == 0:
        retired = None
        if os.path.exists(final_directory):
            retired = os.path.join(save_dir, f".{tag}.retired-{os.getpid()}")
            os.rename(final_directory, retired)
        os.rename(staging, final_directory)
        if retired is not None:
            shutil.rmtree(retired, ignore_errors=True)
        if save_latest:
            _atomic_write_text(os.path.join(save_dir, LATEST_NAME), tag)
        _fsync_directory(save_dir)
    _barrier()
    return True


def _model_states(engine, client_state: Dict) -> Dict:
    import deepspeed
    names, shared = _param_names(engine.module)
    state = {
        "module": engine.module.state_dict(),
        "buffer_names": [name for name, _ in engine.module.named_buffers()],
        "optimizer": None,
        "param_shapes": [collections.OrderedDict((names[id(p)], p.shape) for p in flat.params)
                         for flat in engine.optimizer.flats],
        "frozen_param_shapes": None,
        "shared_params": shared,
        "frozen_param_fragments": None,
        "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
        "data_sampler": None,
        "random_ltd": None,
        "sparse_tensor_module_names": set(),
        "skipped_steps": engine.skipped_steps,
        "global_steps": engine.global_steps,
        "global_samples": engine.global_samples,
        "dp_world_size": engine.world_size,
        "mp_world_size": 1,
        "ds_config": engine.config.raw,
        "ds_version": deepspeed.__version__,
    }
    state.update(client_state)
    state[OUR_KEY] = {"format": FORMAT_VERSION, "optimizer_type": engine.config.optimizer_type,
                      "micro_steps": engine.micro_steps, "scheduler_steps": engine._scheduler_steps,
                      "applied_steps": engine.optimizer.applied_steps}
    return state


def _optimizer_states(engine) -> Dict:
    import deepspeed
    from deepspeed.runtime.zero.config import ZeroStageEnum
    optimizer, schedule = engine.optimizer, engine.schedule
    rank, world_size = engine.global_rank, engine.world_size
    names, _ = _param_names(engine.module)
    co2 = engine.config.optimizer_type == CO2
    # DeepSpeed's fp32 partitions: the committed weights. For CO2 that is the anchor (sharded
    # over all ranks), so DeepSpeed's zero_to_fp32 and ours consolidate the averaged model.
    committed = [state.anchor for state in schedule.outers] if co2 else [shard.master for shard in optimizer.shards]
    single_partitions, paddings, mappings = [], [], []
    for flat, shard in zip(optimizer.flats, committed):
        valid = _valid_prefix(shard, flat.numel, rank)
        single_partitions.append(shard[:valid].clone())
        paddings.append(shard.numel() - valid)
        mappings.append(_slice_mappings(flat, names, shard.numel(), rank))
    base_state = {"state": {}, "param_groups": []}
    for index, (flat, shard) in enumerate(zip(optimizer.flats, optimizer.shards)):
        base_state["state"][index] = {"step": optimizer.applied_steps, "exp_avg": shard.exp_avg.clone(),
                                      "exp_avg_sq": shard.exp_avg_sq.clone()}
        group = {key: value for key, value in flat.param_group.items() if key != "params"}
        group.update(bias_correction=True, params=[index])
        base_state["param_groups"].append(group)
    state = {
        "loss_scaler": engine.loss_scaler,
        "dynamic_loss_scale": bool(getattr(engine.loss_scaler, "dynamic", False)),
        "overflow": False,
        "clip_grad": engine.config.gradient_clipping,
        "base_optimizer_state": base_state,
        "single_partition_of_fp32_groups": single_partitions,
        "zero_stage": ZeroStageEnum.optimizer_states,
        "group_paddings": paddings,
        "param_alignment_paddings": [[0] * len(flat.params) for flat in optimizer.flats],
        "partition_count": [world_size] * len(optimizer.flats),
        "ds_version": deepspeed.__version__,
        "param_slice_mappings": mappings,
        OUR_KEY: _in_flight_state(engine),
    }
    return {OPTIMIZER_STATE_KEY: state, "ds_config": engine.config.raw, "ds_version": deepspeed.__version__}


def _in_flight_state(engine) -> Dict:
    schedule, optimizer = engine.schedule, engine.optimizer
    state = {
        "format": FORMAT_VERSION,
        "optimizer_type": engine.config.optimizer_type,
        "world_size": engine.world_size,
        "phase": schedule.phase.value,
        "round_micro_batches": schedule.round_micro_batches,
        "grad_accum": ([flat.unpadded(flat.grad_accum).clone() for flat in optimizer.flats]
                       if schedule.round_micro_batches else None),
        "pending": None,
    }
    if schedule.running is not None:
        result = schedule.running.wait()
        state["pending"] = {"kind": schedule.running_kind.value if schedule.running_kind else "outer",
                            "result": _result_to_dict(result)}
        if schedule.running_kind is JobKind.ESTIMATE:
            state["estimate_shards"] = [flat.shard_of(flat.gather).clone() for flat in optimizer.flats]
    if schedule.phase is Phase.SECOND_HALF:
        state["first_half_sum"] = [shard.first_half_sum.clone() for shard in optimizer.shards]
    if engine.config.optimizer_type == CO2:
        mid_round = schedule.inner_steps_in_round > 0 or schedule.round_micro_batches > 0
        state["co2"] = {
            "group_size": engine.config.optimizer.group_size,
            # Mid-round, each group's replica has drifted from the others and from the module
            # states rank 0 saved, so every rank keeps its own (O(params); at an outer boundary all
            # replicas equal the anchor and nothing extra is stored).
            "replica": [flat.unpadded(flat.model_flat).clone() for flat in optimizer.flats] if mid_round else None,
            "inner_master": [shard.master.clone() for shard in optimizer.shards],
            "prev_anchor": [outer.prev_anchor.clone() for outer in schedule.outers],
            "momentum": [outer.momentum.clone() for outer in schedule.outers],
            "inner_steps_in_round": schedule.inner_steps_in_round,
            "outer_rounds": schedule.outer_rounds,
            "outer_skips": schedule.outer_skips,
        }
    return state


# ---- load ----------------------------------------------------------------------------------
def load_checkpoint(engine, load_dir: str, tag: Optional[str], load_module_strict: bool, load_optimizer_states: bool,
                    load_lr_scheduler_states: bool):
    if tag is None:
        latest = os.path.join(load_dir, LATEST_NAME)
        if not os.path.isfile(latest):
            # DeepSpeed's behaviour: warn and load nothing, so a first run can always call load.
            logger.warning("load_checkpoint: no %s file in %r; nothing loaded (pass tag= to load a specific "
                           "checkpoint)", LATEST_NAME, load_dir)
            return None, None
        with open(latest) as handle:
            tag = handle.read().strip()
    directory = os.path.join(load_dir, str(tag))
    model_path = os.path.join(directory, MODEL_STATES_NAME)
    if not os.path.isfile(model_path):
        raise FileNotFoundError(f"load_checkpoint: {model_path} does not exist (tag {tag!r} in {load_dir!r})")
    engine.schedule.drain()
    model_states = torch.load(model_path, map_location="cpu", weights_only=False)
    saved_world_size = int(model_states.get("dp_world_size", engine.world_size))
    optimizer_files = _read_optimizer_files(directory, saved_world_size) if load_optimizer_states else None
    if optimizer_files is not None:
        _check_compatible(engine, model_states, optimizer_files, saved_world_size)

    engine.module.load_state_dict(model_states["module"], strict=load_module_strict)
    if optimizer_files is not None:
        _load_optimizer(engine, optimizer_files, saved_world_size)
    else:  # weights only: the optimizer keeps its state; every copy of the weights follows the module
        for shard, flat in zip(engine.optimizer.shards, engine.optimizer.flats):
            shard.master.copy_(flat.shard_of(flat.model_flat))
        engine.schedule.reset()
    if load_lr_scheduler_states and engine.lr_scheduler is not None and model_states.get("lr_scheduler"):
        engine.lr_scheduler.load_state_dict(model_states["lr_scheduler"])
    if load_optimizer_states:
        engine.global_steps = int(model_states.get("global_steps", 0))
        engine.global_samples = int(model_states.get("global_samples", 0))
        engine.skipped_steps = int(model_states.get("skipped_steps", 0))
        ours = model_states.get(OUR_KEY, {})
        engine.micro_steps = int(ours.get("micro_steps", engine.global_steps * engine.gradient_accumulation_steps()))
        engine._scheduler_steps = int(ours.get("scheduler_steps", engine.global_steps))
    known = {"module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
             "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
             "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config",
             "ds_version", "checkpoint_parallel_dimensions", OUR_KEY}
    client_state = {key: value for key, value in model_states.items() if key not in known}
    return model_path, client_state


def _read_optimizer_files(directory: str, saved_world_size: int) -> List[Dict]:
    files = []
    for rank in range(saved_world_size):
        for bf16 in (False, True):
            path = os.path.join(directory, optimizer_states_name(rank, bf16))
            if os.path.isfile(path):
                files.append(torch.load(path, map_location="cpu", weights_only=False)[OPTIMIZER_STATE_KEY])
                break
        else:
            raise FileNotFoundError(f"load_checkpoint: optimizer states of rank {rank} are missing in {directory} "
                                    f"(the checkpoint was written by {saved_world_size} ranks); pass "
                                    "load_optimizer_states=False to load the weights only")
    return files


def _check_compatible(engine, model_states: Dict, files: List[Dict], saved_world_size: int) -> None:
    flats = engine.optimizer.flats
    partitions = files[0]["single_partition_of_fp32_groups"]
    if len(partitions) != len(flats):
        raise ValueError(f"load_checkpoint: the checkpoint has {len(partitions)} parameter groups, the engine "
                         f"{len(flats)}; build the optimizer param groups as when it was saved")
    for index, flat in enumerate(flats):
        saved = sum(file["single_partition_of_fp32_groups"][index].numel() for file in files)
        if saved != flat.numel:
            raise ValueError(f"load_checkpoint: parameter group {index} has {flat.numel} trainable parameters, the "
                             f"checkpoint {saved}; load a checkpoint of the same model")
    in_flight = files[0].get(OUR_KEY)
    if in_flight is None:
        if engine.config.optimizer_type == CO2:
            raise ValueError("load_checkpoint: this checkpoint has no CO2 outer state (it was written by DeepSpeed "
                             "or another type); pass load_optimizer_states=False to start CO2 from its weights")
        return
    saved_type = in_flight["optimizer_type"]
    ours = engine.config.optimizer_type
    if (saved_type == CO2) != (ours == CO2):
        raise ValueError(f"load_checkpoint: a {saved_type} checkpoint cannot continue as {ours} (CO2 keeps a replica "
                         f"and outer state per rank); pass load_optimizer_states=False to start from its weights")
    if ours == CO2 and (saved_world_size != engine.world_size
                        or in_flight["co2"]["group_size"] != engine.config.optimizer.group_size):
        raise ValueError(f"load_checkpoint: CO2 checkpoints continue only with the same world size and group_size "
                         f"(saved: {saved_world_size} ranks, group_size {in_flight['co2']['group_size']}); pass "
                         f"load_optimizer_states=False to start from the weights")
    mid_round = any(file[OUR_KEY]["round_micro_batches"] for file in files)
    if mid_round and (saved_world_size != engine.world_size or saved_type != ours):
        raise ValueError("load_checkpoint: the checkpoint was saved in the middle of a round (partial gradient sums "
                         "are per rank); load it with the same world size and optimizer type, or save at a round "
                         "boundary (after the step() for which is_gradient_accumulation_boundary() was true)")


def _full(pieces: List[torch.Tensor], numel: int) -> torch.Tensor:
    """Concatenate every rank's shard of one vector (in rank order) and keep its first ``numel``."""
    return torch.cat([piece.reshape(-1).float() for piece in pieces])[:numel]


def _shard_from_full(flat: FlatParamGroup, full: torch.Tensor, shard_numel: int, rank: int) -> torch.Tensor:
    padded = torch.zeros(flat.padded_numel, dtype=torch.float32)
    padded[:full.numel()] = full
    return padded[rank * shard_numel:(rank + 1) * shard_numel]


def _padded_pieces(pieces: List[torch.Tensor], numel: int, world_size: int) -> List[torch.Tensor]:
    """Pad each rank's piece to the saved shard size (DeepSpeed strips the padding of the last shards)."""
    shard_numel = padded_numel(numel, world_size) // world_size
    return [torch.cat([piece.float(), torch.zeros(shard_numel - piece.numel())]) for piece in pieces]


def _load_optimizer(engine, files: List[Dict], saved_world_size: int) -> None:
    optimizer, schedule = engine.optimizer, engine.schedule
    rank, world_size = engine.global_rank, engine.world_size
    co2 = engine.config.optimizer_type == CO2
    in_flight = files[0].get(OUR_KEY)
    own = files[rank] if saved_world_size == world_size else None

    committed_full = []
    for index, flat in enumerate(optimizer.flats):
        committed_full.append(_full(_padded_pieces([f["single_partition_of_fp32_groups"][index] for f in files],
                                                          flat.numel, saved_world_size), flat.numel))
    step = files[0]["base_optimizer_state"]["state"][0]["step"]
    optimizer.applied_steps = int(step.item() if torch.is_tensor(step) else step)
    for index, (flat, shard) in enumerate(zip(optimizer.flats, optimizer.shards)):
        saved_group = files[0]["base_optimizer_state"]["param_groups"][index]
        for key in ("lr", "betas", "eps", "weight_decay"):
            if key in saved_group:
                flat.param_group[key] = tuple(saved_group[key]) if key == "betas" else saved_group[key]
        if co2:
            # Replica state of this rank's group, saved by this very rank (same world size enforced).
            co2_state = own[OUR_KEY]["co2"]
            shard.master.copy_(co2_state["inner_master"][index])
            shard.exp_avg.copy_(own["base_optimizer_state"]["state"][index]["exp_avg"])
            shard.exp_avg_sq.copy_(own["base_optimizer_state"]["state"][index]["exp_avg_sq"])
            continue
        for name, target in (("exp_avg", shard.exp_avg), ("exp_avg_sq", shard.exp_avg_sq)):
            full = _full([f["base_optimizer_state"]["state"][index][name] for f in files], flat.numel)
            target.copy_(_shard_from_full(flat, full, flat.shard_numel, rank))
        shard.master.copy_(_shard_from_full(flat, committed_full[index], flat.shard_numel, rank))
    if isinstance(files[0].get("loss_scaler"), type(engine.loss_scaler)) and engine.config.precision == "fp16":
        engine.loss_scaler = files[0]["loss_scaler"]

    if in_flight is None or (in_flight["optimizer_type"] != engine.config.optimizer_type
                             and not in_flight["round_micro_batches"]):
        # A DeepSpeed checkpoint, or another of our types saved at a boundary: continue from the
        # committed state with a fresh schedule (the model must hold the committed weights).
        schedule.reset()
        for flat, full in zip(optimizer.flats, committed_full):
            flat.model_flat[:flat.numel].copy_(full)
        return
    _restore_in_flight(engine, files, own, committed_full, saved_world_size)


def _restore_in_flight(engine, files: List[Dict], own: Optional[Dict], committed_full: List[torch.Tensor],
                       saved_world_size: int) -> None:
    optimizer, schedule = engine.optimizer, engine.schedule
    rank = engine.global_rank
    state = files[0][OUR_KEY]
    schedule.reset()
    schedule.phase = Phase(state["phase"])
    if state["round_micro_batches"]:
        schedule.round_micro_batches = own[OUR_KEY]["round_micro_batches"]
        for flat, values in zip(optimizer.flats, own[OUR_KEY]["grad_accum"]):
            flat.grad_accum[:flat.numel].copy_(values)
    pending = state["pending"]
    if engine.config.optimizer_type == CO2:
        _restore_co2(engine, files, own, committed_full, pending)
        return
    if pending is not None:
        kind = JobKind(pending["kind"])
        result = JobResult(**dict(pending["result"], kind=kind))
        for index, flat in enumerate(optimizer.flats):
            if kind is JobKind.ESTIMATE:
                full = _full([f[OUR_KEY]["estimate_shards"][index] for f in files], flat.numel)
            else:  # a commit's output is the master weights it left behind
                full = committed_full[index]
            flat.gather.zero_()
            flat.gather[:flat.numel].copy_(full)
        schedule.running = CompletedWork(f"{kind.value} restored from checkpoint", result)
        schedule.running_kind = kind
    if schedule.phase is Phase.SECOND_HALF:
        for index, (flat, shard) in enumerate(zip(optimizer.flats, optimizer.shards)):
            full = _full([f[OUR_KEY]["first_half_sum"][index] for f in files], flat.numel)
            shard.ensure_first_half_buffer().copy_(_shard_from_full(flat, full, flat.shard_numel, rank))


def _restore_co2(engine, files: List[Dict], own: Dict, committed_full: List[torch.Tensor], pending) -> None:
    from .co2 import OuterResult
    optimizer, schedule = engine.optimizer, engine.schedule
    co2_state = own[OUR_KEY]["co2"]
    schedule.inner_steps_in_round = co2_state["inner_steps_in_round"]
    schedule.outer_rounds = co2_state["outer_rounds"]
    schedule.outer_skips = co2_state["outer_skips"]
    if co2_state["replica"] is not None:
        for flat, replica in zip(optimizer.flats, co2_state["replica"]):
            flat.model_flat[:flat.numel].copy_(replica)
    for index, (flat, outer) in enumerate(zip(optimizer.flats, schedule.outers)):
        outer.anchor.copy_(outer.shard_of(_padded_to(flat, committed_full[index])))
        outer.prev_anchor.copy_(co2_state["prev_anchor"][index])
        outer.momentum.copy_(co2_state["momentum"][index])
        # gather = x_{k+2} (or x_{k+1} before the first job) and round_start = x_{k+1}, both
        # exactly the model-dtype casts of the anchors the job left behind.
        outer.gather.copy_(_padded_to(flat, committed_full[index]))
        if outer.round_start is not None:
            previous = _full([f[OUR_KEY]["co2"]["prev_anchor"][index] for f in files], flat.numel)
            outer.round_start.copy_(_padded_to(flat, previous))
    if pending is not None:
        result = OuterResult(**pending["result"])
        schedule.running = CompletedWork("CO2 outer averaging restored from checkpoint", result)
        schedule.running_kind = None


def _padded_to(flat: FlatParamGroup, full: torch.Tensor) -> torch.Tensor:
    padded = torch.zeros(flat.padded_numel, dtype=torch.float32)
    padded[:full.numel()] = full
    return padded
