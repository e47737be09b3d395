"""Checkpoints in DeepSpeed's ZeRO-1 layout that continue the overlapped pipeline exactly (docs/design.md, 5).

Layout (``save_dir/tag/``), as DeepSpeed writes it, so its tools and loaders understand ours:
  mp_rank_00_model_states.pt                   rank 0: the committed module weights, counters and
                                               LR-scheduler state as of the committed update,
                                               config, param shapes
  [bf16_]zero_pp_rank_{r}_mp_rank_00_optim_states.pt
                                               rank r: DeepSpeed's partition r (in DeepSpeed's
                                               shard layout) of the fp32 masters (or what the
                                               schedule's checkpoint_state puts there instead)
                                               and of the rule's state, the committed step, and
                                               under the key "deepspeed_acco" the rank's own
                                               in-flight state

DeepSpeed's fields describe the *committed* state: when a commit has finished but is not installed
yet, its step count, LR-scheduler step and loss-scale update are already counted there, so that
another type, or DeepSpeed itself, continues from the committed update. The live counters, the
phase, the finished job's result, the schedule's further shards (an estimate, a kept partial
gradient, what the model holds when it is not the committed weights) and the rank's private
tensors (partial gradient sums of a round in progress) are under "deepspeed_acco"; each type's
``checkpoint_state`` says what it keeps. Whether a checkpoint can continue in a schedule is that
schedule's call (``Schedule.checkpoint_metadata`` and ``check_checkpoint_compatible``); this
module names no optimizer type. Shards are converted between this engine's layout (64-byte
aligned shards) and DeepSpeed's by point-to-point exchanges at save and load.

Loading at the same world size reads only the rank's own optimizer file; at another world size a
rank reads, memory-mapped, only the slices of the files that cover its new shard.

Saving is atomic: files go to a staging directory that replaces the tag's directory in one
``renameat2(RENAME_EXCHANGE)`` (where the filesystem lacks it: retire, rename, and a loader that
recovers a retired directory), and ``latest`` is replaced last.
"""
import collections
import ctypes
import ctypes.util
import errno
import logging
import os
import shutil
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from .flat import ShardGeometry, aligned_geometry, deepspeed_geometry
from .schedule import CheckpointState

MODEL_STATES_NAME = "mp_rank_00_model_states.pt"
LATEST_NAME = "latest"
OUR_KEY = "deepspeed_acco"
FORMAT_VERSION = 2
OPTIMIZER_STATE_KEY = "optimizer_state_dict"
logger = logging.getLogger("DeepSpeed").getChild("acco")


def optimizer_states_name(rank: int, bf16: bool) -> str:
    return f"{'bf16_' if bf16 else ''}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


# ---- files and directories ---------------------------------------------------------------------
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


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange_directories(first: str, second: str) -> bool:
    """Swap two directories atomically (Linux renameat2); False where the OS or filesystem cannot."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(code, f"renameat2({first!r}, {second!r}, RENAME_EXCHANGE) failed: {os.strerror(code)}")


def _retired_name(save_dir: str, tag: str) -> str:
    return os.path.join(save_dir, f".{tag}.retired")


def _replace_directory(staging: str, final: str, retired: str) -> None:
    """Make ``staging`` the tag's directory; the old one (if any) is removed afterwards."""
    if not os.path.exists(final):
        os.rename(staging, final)
        shutil.rmtree(retired, ignore_errors=True)  # left by an interrupted earlier save, if any
        return
    if _exchange_directories(staging, final):
        shutil.rmtree(staging, ignore_errors=True)  # now holds the old checkpoint
        return
    # No atomic exchange here: retire the old directory first. A crash between the two renames
    # leaves ``retired`` complete; _resolve_directory() loads it in that case.
    shutil.rmtree(retired, ignore_errors=True)
    os.rename(final, retired)
    os.rename(staging, final)
    shutil.rmtree(retired, ignore_errors=True)


def _resolve_directory(load_dir: str, tag: str) -> str:
    final = os.path.join(load_dir, tag)
    if os.path.isdir(final):
        return final
    retired = _retired_name(load_dir, tag)
    if os.path.isfile(os.path.join(retired, MODEL_STATES_NAME)):
        logger.warning("load_checkpoint: %s is missing but its previous version %s is complete (a save was "
                       "interrupted while replacing it); loading that", final, retired)
        return retired
    return final


# ---- shard layouts ---------------------------------------------------------------------------
def _overlap(a: Tuple[int, int], b: Tuple[int, int], numel: int) -> Tuple[int, int]:
    start, stop = max(a[0], b[0]), min(a[1], b[1], numel)
    return start, max(start, stop)


def _repartition_job(communicator, pieces: List[Tuple[torch.Tensor, ShardGeometry, ShardGeometry]]):
    """A lane job that moves each shard from its source layout to its destination layout.

    ``pieces``: (this rank's shard in the source layout, source, destination); returns the rank's
    shards in the destination layouts (padding zero).
    """
    rank = communicator.rank

    def job():
        outputs, sends, receives = [], [], []
        for shard, source, destination in pieces:
            output = torch.zeros(destination.shard_numel, dtype=shard.dtype, device=shard.device)
            outputs.append(output)
            numel = source.numel
            mine_src, mine_dst = source.shard_range(rank), destination.shard_range(rank)
            for peer in range(source.world_size):
                start, stop = _overlap(mine_src, destination.shard_range(peer), numel)
                if stop > start:
                    piece = shard[start - mine_src[0]:stop - mine_src[0]]
                    if peer == rank:
                        output[start - mine_dst[0]:stop - mine_dst[0]].copy_(piece)
                    else:
                        sends.append((peer, piece.contiguous()))
                if peer == rank:
                    continue
                start, stop = _overlap(source.shard_range(peer), mine_dst, numel)
                if stop > start:
                    receives.append((peer, output[start - mine_dst[0]:stop - mine_dst[0]]))
        communicator.exchange(sends, receives)
        return outputs
    return job


def _run_on_lane(engine, job, label: str):
    return engine.lane.submit(job, engine.schedule.communicator_for_checkpoints(), label=label).wait()


def _to_layout(engine, tensors: List[torch.Tensor], numels: List[int], to_deepspeed: bool) -> List[torch.Tensor]:
    """Convert per-group shards between our layout and DeepSpeed's (collective)."""
    world_size = engine.world_size
    pieces = []
    for shard, numel in zip(tensors, numels):
        ours = ShardGeometry(numel=numel, world_size=world_size,
                             shard_numel=shard.numel() if to_deepspeed else _our_shard_numel(engine, numel))
        theirs = deepspeed_geometry(numel, world_size)
        pieces.append((shard, ours, theirs) if to_deepspeed else (shard, theirs, ours))
    if world_size == 1:
        return [_copy_into(shard, destination.shard_numel, source.numel) for shard, source, destination in pieces]
    return _run_on_lane(engine, _repartition_job(engine.schedule.communicator_for_checkpoints(), pieces),
                        "checkpoint shard layout")


def _copy_into(shard: torch.Tensor, size: int, numel: int) -> torch.Tensor:
    """``shard`` (or its first ``numel`` elements) in a zero-padded tensor of ``size`` elements."""
    output = torch.zeros(size, dtype=shard.dtype, device=shard.device)
    count = min(size, shard.numel(), numel)
    output[:count].copy_(shard[:count])
    return output


def _our_shard_numel(engine, numel: int) -> int:
    """Our shard size over all ranks for a vector of ``numel`` elements."""
    return aligned_geometry(numel, engine.world_size).shard_numel


def _gather_full_job(communicator, shards: List[torch.Tensor], dtypes: List[torch.dtype]):
    def job():
        outputs = []
        for shard, dtype in zip(shards, dtypes):
            full = torch.empty(shard.numel() * communicator.world_size, dtype=shard.dtype, device=shard.device)
            communicator.all_gather(full, shard)
            outputs.append(full.to(dtype))
        return outputs
    return job


def make_gather_full(engine):
    """``gather_full(shards, dtype=None)``: every rank's shard of each group, concatenated (collective)."""
    def gather_full(shards: List[torch.Tensor], dtype: Optional[torch.dtype] = None) -> List[torch.Tensor]:
        dtypes = [dtype or flat.model_dtype for flat in engine.optimizer.flats]
        communicator = engine.schedule.communicator_for_checkpoints()
        if communicator.world_size == 1:
            return [shard.to(d, copy=True) for shard, d in zip(shards, dtypes)]
        return _run_on_lane(engine, _gather_full_job(communicator, shards, dtypes), "checkpoint all-gather")
    return gather_full


# ---- save ------------------------------------------------------------------------------------
def _param_names(module: torch.nn.Module) -> Tuple[Dict[int, str], Dict[str, str]]:
    names, shared = {}, {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in names:
            shared[name] = names[id(p)]
        else:
            names[id(p)] = name
    return names, shared


def _slice_mappings(flat, names: Dict[int, str], geometry: ShardGeometry, rank: int):
    """Per parameter, the fragment of it that lies in DeepSpeed's partition ``rank`` (param_slice_mappings)."""
    from deepspeed.utils.tensor_fragment import fragment_address
    low, high = geometry.shard_range(rank)
    mappings = collections.OrderedDict()
    for p, offset in zip(flat.params, flat.offsets):
        start, end = max(offset, low), min(offset + p.numel(), high)
        if start < end:
            mappings[names[id(p)]] = fragment_address(numel=end - start, start=start - low)
    return mappings


def save_checkpoint(engine, save_dir: str, tag: Optional[str], client_state: Dict, save_latest: bool) -> bool:
    tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"
    if not tag or os.sep in tag or tag.startswith("."):
        raise ValueError(f"save_checkpoint: tag {tag!r} must be a non-empty name without path separators")
    schedule = engine.schedule
    schedule.synchronize()  # every rank at the same job, which has finished; its result stays pending
    state = schedule.checkpoint_state()
    mid_round = engine.control.max(int(state.meta["round_micro_batches"] > 0)) > 0
    progress, loss_scale, scheduler_state, lrs = schedule.committed_view()
    numels = [flat.numel for flat in engine.optimizer.flats]
    rank, world_size = engine.global_rank, engine.world_size

    names = _names_in_order(state)
    flat_list = [t for name in names for t in _tensors_of(state, name)]
    converted = _to_layout(engine, flat_list, numels * len(names), to_deepspeed=True)
    by_name = {name: converted[i * len(numels):(i + 1) * len(numels)] for i, name in enumerate(names)}

    final_directory = os.path.join(save_dir, tag)
    staging = os.path.join(save_dir, f".{tag}.staging")
    if rank == 0:
        os.makedirs(save_dir, exist_ok=True)
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)
    engine.control.barrier()
    bf16 = engine.engine_config.precision == "bf16"
    optimizer_file = _optimizer_states(engine, state, by_name, progress, loss_scale, lrs)
    _atomic_save(optimizer_file, os.path.join(staging, optimizer_states_name(rank, bf16)))
    committed_module = _committed_module_state(engine)
    if rank == 0:
        model_file = _model_states(engine, committed_module, client_state, progress, scheduler_state, mid_round)
        _atomic_save(model_file, os.path.join(staging, MODEL_STATES_NAME))
    engine.control.barrier()
    if rank == 0:
        _fsync_directory(staging)
        _replace_directory(staging, final_directory, _retired_name(save_dir, tag))
        if save_latest:
            _atomic_write_text(os.path.join(save_dir, LATEST_NAME), tag)
        _fsync_directory(save_dir)
    engine.control.barrier()
    return True


# Names of the re-shardable vectors in a CheckpointState: masters, each rule-state tensor, then
# the schedule's further shards.
def _names_in_order(state: CheckpointState) -> List[str]:
    names = ["fp32"]
    if state.rule_state is not None:
        names += [f"rule:{key}" for key in state.rule_state[0]]
    names += [f"sharded:{key}" for key in sorted(state.sharded)]
    return names


def _tensors_of(state: CheckpointState, name: str) -> List[torch.Tensor]:
    if name == "fp32":
        return state.fp32_partitions
    kind, key = name.split(":", 1)
    if kind == "rule":
        return [group[key] for group in state.rule_state]
    return state.sharded[key]


def _committed_module_state(engine) -> Dict[str, torch.Tensor]:
    """The module's state dict with the committed parameters in it (what DeepSpeed's tools expect)."""
    with engine.schedule.committed_parameters():
        return {key: value.detach().to("cpu", copy=True) for key, value in engine.module.state_dict().items()}


def _model_states(engine, module_state, client_state: Dict, progress, scheduler_state, mid_round: bool) -> Dict:
    import deepspeed
    names, shared = _param_names(engine.module)
    state = {
        "module": module_state,
        "buffer_names": [name for name, _ in engine.module.named_buffers()],
        "optimizer": None,
        "param_shapes": [collections.OrderedDict((names[id(p)], p.shape) for p in flat.params)
                         for flat in engine.optimizer.flats],
        "frozen_param_shapes": None,
        "shared_params": shared,
        "frozen_param_fragments": None,
        "lr_scheduler": scheduler_state,
        "data_sampler": None,
        "random_ltd": None,
        "sparse_tensor_module_names": set(),
        "skipped_steps": progress.skipped_steps,
        "global_steps": progress.global_steps,
        "global_samples": progress.global_samples,
        "dp_world_size": engine.world_size,
        "mp_world_size": 1,
        "ds_config": engine.config,
        "ds_version": deepspeed.__version__,
    }
    state.update(client_state)
    state[OUR_KEY] = dict(engine.schedule.checkpoint_metadata(), format=FORMAT_VERSION,
                          optimizer_type=engine.engine_config.optimizer_type, mid_round=mid_round)
    return state


def _optimizer_states(engine, state: CheckpointState, by_name, progress, loss_scale, lrs) -> Dict:
    import deepspeed
    from deepspeed.runtime.zero.config import ZeroStageEnum
    optimizer, schedule = engine.optimizer, engine.schedule
    rank, world_size = engine.global_rank, engine.world_size
    names, _ = _param_names(engine.module)
    single_partitions, paddings, mappings = [], [], []
    for flat, partition in zip(optimizer.flats, by_name["fp32"]):
        geometry = deepspeed_geometry(flat.numel, world_size)
        valid = geometry.valid_numel(rank)
        single_partitions.append(partition[:valid].cpu())
        paddings.append(geometry.shard_numel - valid)
        mappings.append(_slice_mappings(flat, names, geometry, rank))
    base_state = {"state": {}, "param_groups": []}
    for index, (flat, lr) in enumerate(zip(optimizer.flats, lrs)):
        entry = {"step": progress.applied_steps}
        if state.rule_state is not None:
            for key in state.rule_state[index]:
                entry[key] = by_name[f"rule:{key}"][index].cpu()
        base_state["state"][index] = entry
        group = {key: value for key, value in flat.param_group.items() if key != "params"}
        group.update(lr=lr, bias_correction=True, params=[index])
        base_state["param_groups"].append(group)
    ours = {
        "format": FORMAT_VERSION,
        "optimizer_type": engine.engine_config.optimizer_type,
        "world_size": world_size,
        "meta": state.meta,
        "progress": schedule.progress.state_dict(),
        "lr_scheduler": schedule.lr_scheduler.state_dict() if schedule.lr_scheduler is not None else None,
        "param_group_lrs": [group["lr"] for group in optimizer.param_groups],
        "loss_scale": vars(schedule.loss_scale).copy(),
        "sharded": {key: [t.cpu() for t in by_name[f"sharded:{key}"]] for key in state.sharded},
        "local": _to_cpu(state.local),
    }
    file_state = {
        "loss_scaler": loss_scale.to_deepspeed(),
        "dynamic_loss_scale": loss_scale.dynamic,
        "overflow": False,
        "clip_grad": engine.engine_config.gradient_clipping,
        "base_optimizer_state": base_state,
        "single_partition_of_fp32_groups": single_partitions,
        "zero_stage": ZeroStageEnum.optimizer_states,
        "group_paddings": paddings,
        "param_alignment_paddings": [[0] * len(flat.params) for flat in optimizer.flats],
        "partition_count": [world_size] * len(optimizer.flats),
        "ds_version": deepspeed.__version__,
        "param_slice_mappings": mappings,
        OUR_KEY: ours,
    }
    return {OPTIMIZER_STATE_KEY: file_state, "ds_config": engine.config, "ds_version": deepspeed.__version__}


def _to_cpu(value):
    if torch.is_tensor(value):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {key: _to_cpu(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_to_cpu(item) for item in value]
    return value


# ---- load ------------------------------------------------------------------------------------
def _load(path: str):
    """Memory-mapped: only the bytes that are used get read."""
    return torch.load(path, map_location="cpu", weights_only=False, mmap=True)


def _optimizer_file_path(directory: str, rank: int) -> str:
    for bf16 in (False, True):
        path = os.path.join(directory, optimizer_states_name(rank, bf16))
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(f"load_checkpoint: optimizer states of rank {rank} are missing in {directory}; pass "
                            "load_optimizer_states=False to load the weights only")


class _SavedFiles:
    """The optimizer files of a checkpoint, opened on demand (each at most once)."""

    def __init__(self, directory: str, world_size: int):
        self.directory = directory
        self.world_size = world_size
        self._opened: Dict[int, Dict] = {}

    def __getitem__(self, rank: int) -> Dict:
        if rank not in self._opened:
            self._opened[rank] = _load(_optimizer_file_path(self.directory, rank))[OPTIMIZER_STATE_KEY]
        return self._opened[rank]


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
    directory = _resolve_directory(load_dir, str(tag))
    model_path = os.path.join(directory, MODEL_STATES_NAME)
    if not os.path.isfile(model_path):
        raise FileNotFoundError(f"load_checkpoint: {model_path} does not exist (tag {tag!r} in {load_dir!r})")
    schedule = engine.schedule
    schedule.synchronize()
    model_states = _load(model_path)
    saved_world_size = int(model_states.get("dp_world_size", engine.world_size))
    files = _SavedFiles(directory, saved_world_size) if load_optimizer_states else None
    ours = model_states.get(OUR_KEY)
    same_type = ours is not None and ours.get("optimizer_type") == engine.engine_config.optimizer_type
    if files is not None:
        _check_compatible(engine, model_states, files, saved_world_size, same_type)

    engine.module.load_state_dict(model_states["module"], strict=load_module_strict)
    if files is None:  # weights only: the optimizer keeps its state; every copy of the weights follows the module
        for shard, flat in zip(engine.optimizer.shards, engine.optimizer.flats):
            shard.master.copy_(flat.shard_of(flat.model_flat))
        schedule.reset()
    elif same_type:
        _load_same_type(engine, files, saved_world_size)
        schedule.continue_warmup(ours)
    else:
        _load_committed_state(engine, files, saved_world_size, model_states)
    if load_lr_scheduler_states and engine.lr_scheduler is not None:
        saved_scheduler = _own(files, engine, saved_world_size)[OUR_KEY]["lr_scheduler"] \
            if files is not None and same_type else model_states.get("lr_scheduler")
        if saved_scheduler:
            engine.lr_scheduler.load_state_dict(saved_scheduler)
    known = {"module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
             "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
             "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config",
             "ds_version", "checkpoint_parallel_dimensions", OUR_KEY}
    client_state = {key: value for key, value in model_states.items() if key not in known}
    return model_path, client_state


def _own(files: _SavedFiles, engine, saved_world_size: int) -> Dict:
    """This rank's file at the same world size; after a re-shard, a file this rank reads for its shard
    anyway (the plain data in it, param groups and counters, is the same in every rank's file)."""
    if saved_world_size == engine.world_size:
        return files[engine.global_rank]
    numel = engine.optimizer.flats[0].numel
    start = min(engine.global_rank * _our_shard_numel(engine, numel), numel - 1)
    return files[min(start // deepspeed_geometry(numel, saved_world_size).shard_numel, saved_world_size - 1)]


def _check_compatible(engine, model_states: Dict, files: _SavedFiles, saved_world_size: int, same_type: bool) -> None:
    flats = engine.optimizer.flats
    shapes = model_states.get("param_shapes") or []
    if len(shapes) != len(flats):
        raise ValueError(f"load_checkpoint: the checkpoint has {len(shapes)} parameter groups, the engine "
                         f"{len(flats)}; build the optimizer param groups as when it was saved")
    for index, (flat, group_shapes) in enumerate(zip(flats, shapes)):
        saved = sum(int(torch.Size(shape).numel()) for shape in group_shapes.values())
        if saved != flat.numel:
            raise ValueError(f"load_checkpoint: parameter group {index} has {flat.numel} trainable parameters, the "
                             f"checkpoint {saved}; load a checkpoint of the same model")
    ours = model_states.get(OUR_KEY) or {}
    engine.schedule.check_checkpoint_compatible(ours, saved_world_size)
    if ours.get("mid_round") and (saved_world_size != engine.world_size or not same_type):
        raise ValueError("load_checkpoint: the checkpoint was saved in the middle of a round (partial gradient sums "
                         "are per rank); load it with the same world size and optimizer type, or save at a round "
                         "boundary (after the step() for which is_gradient_accumulation_boundary() was true)")


def _read_resharded(engine, files: _SavedFiles, saved_world_size: int, getter, numels: List[int],
                    our_numels: List[int]) -> List[torch.Tensor]:
    """This rank's shards in our layout of one saved vector per group.

    ``getter(file, group)`` returns the saved rank's DeepSpeed partition (a valid prefix is enough).
    Same world size: the own file, moved between layouts by the peers. Otherwise: memory-mapped
    slices of the files that cover this rank's new shard.
    """
    if saved_world_size == engine.world_size:
        own = files[engine.global_rank]
        partitions = [_copy_into(getter(own, index), deepspeed_geometry(numel, saved_world_size).shard_numel, numel)
                      for index, numel in enumerate(numels)]
        return _to_layout(engine, partitions, numels, to_deepspeed=False)
    outputs = []
    rank = engine.global_rank
    for index, (numel, shard_numel) in enumerate(zip(numels, our_numels)):
        mine = (rank * shard_numel, (rank + 1) * shard_numel)
        saved = deepspeed_geometry(numel, saved_world_size)
        output = None
        for saved_rank in range(saved_world_size):
            start, stop = _overlap(mine, saved.shard_range(saved_rank), numel)
            if stop <= start:
                continue
            piece = getter(files[saved_rank], index)
            offset = saved.shard_range(saved_rank)[0]
            if output is None:
                output = torch.zeros(shard_numel, dtype=piece.dtype)
            output[start - mine[0]:stop - mine[0]].copy_(piece[start - offset:stop - offset])
        outputs.append(output if output is not None else torch.zeros(shard_numel))
    return [t.to(engine.device) for t in outputs]


def _load_vectors(engine, files, saved_world_size, getter) -> List[torch.Tensor]:
    numels = [flat.numel for flat in engine.optimizer.flats]
    return _read_resharded(engine, files, saved_world_size, getter, numels,
                           [_our_shard_numel(engine, n) for n in numels])


def _saved_step(file: Dict) -> int:
    step = file["base_optimizer_state"]["state"][0]["step"]
    return int(step.item() if torch.is_tensor(step) else step)


def _load_masters_and_rule_state(engine, files, saved_world_size) -> None:
    """DeepSpeed's fields: fp32 partitions and the rule's state (the committed state)."""
    schedule = engine.schedule
    masters = _load_vectors(engine, files, saved_world_size, lambda f, i: f["single_partition_of_fp32_groups"][i])
    for shard, values in zip(engine.optimizer.shards, masters):
        shard.master.copy_(values)
    saved_state = _own(files, engine, saved_world_size)["base_optimizer_state"]["state"][0]
    for key in schedule.rule.state_names:
        if key not in saved_state:
            raise ValueError(f"load_checkpoint: the checkpoint's optimizer state has no {key!r} (saved by another "
                             f"optimizer); pass load_optimizer_states=False to load the weights only")
        values = _load_vectors(engine, files, saved_world_size, lambda f, i, key=key: f["base_optimizer_state"]["state"][i][key])
        for shard, value in zip(engine.optimizer.shards, values):
            shard.state[key].copy_(value)


def _load_committed_state(engine, files, saved_world_size, model_states) -> None:
    """Another type's (or DeepSpeed's) checkpoint: continue from its committed update with a fresh schedule."""
    schedule, optimizer = engine.schedule, engine.optimizer
    own = _own(files, engine, saved_world_size)
    _load_masters_and_rule_state(engine, files, saved_world_size)
    schedule.reset()
    for flat, full in zip(optimizer.flats, make_gather_full(engine)([s.master for s in optimizer.shards])):
        flat.install(full)
    for flat, group in zip(optimizer.flats, own["base_optimizer_state"]["param_groups"]):
        for key in ("lr", "betas", "eps", "weight_decay"):
            if key in group:
                flat.param_group[key] = tuple(group[key]) if key == "betas" else group[key]
    progress = schedule.progress
    progress.applied_steps = _saved_step(own)
    progress.global_steps = int(model_states.get("global_steps", 0))
    progress.global_samples = int(model_states.get("global_samples", 0))
    progress.skipped_steps = int(model_states.get("skipped_steps", 0))
    progress.micro_steps = progress.global_steps * engine.gradient_accumulation_steps()
    progress.scheduler_steps = progress.applied_steps
    if engine.engine_config.precision == "fp16" and own.get("loss_scaler") is not None:
        schedule.loss_scale.load_deepspeed(own["loss_scaler"])


def _load_same_type(engine, files, saved_world_size) -> None:
    """Our own type: the live counters and the in-flight state, exactly where the save left them."""
    schedule, optimizer = engine.schedule, engine.optimizer
    own = _own(files, engine, saved_world_size)
    ours = own[OUR_KEY]
    if schedule.rule_state_is_sharded():
        _load_masters_and_rule_state(engine, files, saved_world_size)
    sharded = {}
    for key in ours["sharded"]:
        sharded[key] = _load_vectors(engine, files, saved_world_size, lambda f, i, key=key: f[OUR_KEY]["sharded"][key][i])
    fp32 = [shard.master for shard in optimizer.shards]
    if not schedule.rule_state_is_sharded():  # the DeepSpeed partitions hold the schedule's own vectors
        fp32 = _load_vectors(engine, files, saved_world_size, lambda f, i: f["single_partition_of_fp32_groups"][i])
    local = _to_device(ours["local"], engine.device) if saved_world_size == engine.world_size else {}
    if saved_world_size != engine.world_size and "compression" in ours["local"] and engine.global_rank == 0:
        # A residual is what one rank has not yet sent to each other rank's shard; with other shards
        # and peers it has no owner. Dropping it loses at most half a quantisation step per value once.
        logger.warning("load_checkpoint: re-sharding from %d to %d ranks drops the error-feedback residuals of "
                       "compressed gradients (per rank and per shard layout); they restart from zero",
                       saved_world_size, engine.world_size)
    state = CheckpointState(fp32_partitions=fp32, rule_state=None, sharded=sharded, local=local, meta=ours["meta"])
    # The model already holds the module file's committed weights; the schedule installs what it
    # held instead where that differs (e.g. "held").
    schedule.load_checkpoint_state(state, make_gather_full(engine))
    schedule.progress.load_state_dict(ours["progress"])
    for group, lr in zip(optimizer.param_groups, ours["param_group_lrs"]):
        group["lr"] = lr
    for key, value in ours["loss_scale"].items():
        setattr(schedule.loss_scale, key, value)


def _to_device(value, device):
    if torch.is_tensor(value):
        return value.to(device)
    if isinstance(value, dict):
        return {key: _to_device(item, device) for key, item in value.items()}
    if isinstance(value, list):
        return [_to_device(item, device) for item in value]
    return value

