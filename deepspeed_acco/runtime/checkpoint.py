"""Checkpoints in DeepSpeed's ZeRO-1 layout that continue the overlapped pipeline exactly (docs/checkpoints.md).

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
rank reads, memory-mapped, only the slices of the files that cover its new shard. Files are data:
``torch.load(weights_only=True)`` with DeepSpeed's checkpoint classes allowed and nothing else
unless the caller names it (:func:`load_file`). A load reads and checks everything it needs, the
ranks agree on one verdict, and only then is anything changed: a refused load leaves the engine as
it was.

Saving is atomic: files go to a staging directory that replaces the tag's directory in one
``renameat2(RENAME_EXCHANGE)`` (where the filesystem lacks it: retire, rename, and a loader that
recovers a retired directory), and ``latest`` is replaced last. The ranks agree after each step of
the file-system work, so one rank's failure reaches every rank at once and the save removes what it
wrote.
"""
import collections
import contextlib
import dataclasses
import logging
import os
import re
import shutil
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from . import checkpoint_files
from .checkpoint_files import (LATEST_NAME, MODEL_STATES_NAME, check_tag, checkpoint_classes,  # noqa: F401
                               first_line, load_file, read_latest)
from .flat import ShardGeometry, aligned_geometry, deepspeed_geometry
from .progress import Progress
from .schedule import CheckpointState

OUR_KEY = "deepspeed_acco"
FORMAT_VERSION = 2
OPTIMIZER_STATE_KEY = "optimizer_state_dict"
logger = logging.getLogger("DeepSpeed").getChild("acco")


def optimizer_states_name(rank: int, bf16: bool) -> str:
    return f"{'bf16_' if bf16 else ''}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


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
    """``shard`` (or its first ``numel`` elements) in a zero-padded tensor of ``size`` elements: one
    rank's shard moved between two layouts of the same vector (a partition read from a file has been
    brought to its exact padded size by :func:`_partition` first)."""
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
    tag = check_tag(tag if tag is not None else f"global_step{engine.global_steps}", "save_checkpoint")
    schedule = engine.schedule
    schedule.synchronize()  # every rank at the same job, which has finished; its result stays pending
    state = schedule.checkpoint_state()
    mid_round = engine.control.max(int(state.meta["round_micro_batches"] > 0)) > 0
    progress, loss_scale, scheduler_state, lrs = schedule.committed_view()
    numels = [flat.numel for flat in engine.optimizer.flats]
    rank = engine.global_rank

    names = _names_in_order(state)
    flat_list = [t for name in names for t in _tensors_of(state, name)]
    converted = _to_layout(engine, flat_list, numels * len(names), to_deepspeed=True)
    by_name = {name: converted[i * len(numels):(i + 1) * len(numels)] for i, name in enumerate(names)}
    committed_module = _committed_module_state(engine)

    # The file system work, in three steps that every rank agrees on before the next starts: a rank
    # that fails tells every other at once (instead of leaving them at a barrier until the timeout),
    # and a failed save removes what it wrote, leaving the previous checkpoint and latest as they were.
    final_directory = os.path.join(save_dir, tag)
    staging = os.path.join(save_dir, f".{tag}.staging")

    def prepare():
        if rank == 0:
            os.makedirs(save_dir, exist_ok=True)
            shutil.rmtree(staging, ignore_errors=True)
            os.makedirs(staging)

    def write():
        bf16 = engine.engine_config.precision == "bf16"
        optimizer_file = _optimizer_states(engine, state, by_name, progress, loss_scale, lrs)
        checkpoint_files.atomic_save(optimizer_file, os.path.join(staging, optimizer_states_name(rank, bf16)))
        if rank == 0:
            model_file = _model_states(engine, committed_module, client_state, progress, scheduler_state, mid_round)
            checkpoint_files.atomic_save(model_file, os.path.join(staging, MODEL_STATES_NAME))

    def publish():
        if rank == 0:
            checkpoint_files.fsync_directory(staging)
            checkpoint_files.replace_directory(staging, final_directory, checkpoint_files.retired_name(save_dir, tag))
            if save_latest:
                checkpoint_files.atomic_write_text(os.path.join(save_dir, LATEST_NAME), tag)
            checkpoint_files.fsync_directory(save_dir)

    for step, action in (("preparing the staging directory", prepare), ("writing the files", write),
                         ("publishing the checkpoint", publish)):
        _save_step(engine, step, action, staging)
    return True


def _save_step(engine, step: str, action: Callable[[], None], staging: str) -> None:
    """Run one step of a save on every rank, then agree (one small collective on the control plane);
    if any rank failed, rank 0 removes the staging directory and every rank raises."""
    problem = None
    try:
        action()
    except Exception as error:
        problem = error
    verdicts = engine.control.texts("" if problem is None else f"{type(problem).__name__}: {problem}")
    failures = [(rank, verdict) for rank, verdict in enumerate(verdicts) if verdict]
    if not failures:
        return
    if engine.global_rank == 0:  # every rank has stopped writing into it
        shutil.rmtree(staging, ignore_errors=True)
    outcome = (f"save_checkpoint failed while {step}; its staging files are removed, and latest still names a "
               f"complete checkpoint (the previous one unless the failure came after the new one was in place)")
    if problem is not None:
        problem.add_note(outcome)
        raise problem
    reasons = "; ".join(f"rank {rank}: {verdict}" for rank, verdict in failures)
    raise RuntimeError(f"{outcome}: {reasons}")


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


# ---- load: read and check everything, then change anything ---------------------------------------
def _optimizer_file_path(directory: str, rank: int) -> str:
    for bf16 in (False, True):
        path = os.path.join(directory, optimizer_states_name(rank, bf16))
        if os.path.isfile(path):
            return path
    raise ValueError(f"load_checkpoint: optimizer states of rank {rank} are missing in {directory}; pass "
                     "load_optimizer_states=False to load the weights only")


_OPTIMIZER_FILE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")


class _SavedFiles:
    """The optimizer files of a checkpoint, opened on demand (each at most once)."""

    def __init__(self, directory: str, world_size: int, trusted_classes: Sequence = ()):
        self.directory = directory
        self.world_size = world_size
        self.trusted_classes = trusted_classes
        self._opened: Dict[int, Dict] = {}
        self._paths: Dict[int, str] = {}

    def path(self, rank: int) -> str:
        if rank not in self._paths:
            self._paths[rank] = _optimizer_file_path(self.directory, rank)
        return self._paths[rank]

    def __getitem__(self, rank: int) -> Dict:
        if rank not in self._opened:
            path = self.path(rank)
            content = load_file(path, self.trusted_classes)
            if not isinstance(content, dict) or not isinstance(content.get(OPTIMIZER_STATE_KEY), dict):
                raise ValueError(f"load_checkpoint: {path} has no {OPTIMIZER_STATE_KEY!r} entry; it is not a ZeRO-1 "
                                 f"optimizer file: load a checkpoint written by save_checkpoint")
            self._opened[rank] = content[OPTIMIZER_STATE_KEY]
        return self._opened[rank]

    def opened_ranks(self) -> List[int]:
        return sorted(self._opened)


@dataclass
class _LoadPlan:
    """Everything a load changes the engine with, read and checked (nothing applied yet)."""

    tag: str
    model_path: str
    model_states: Dict
    saved_world_size: int
    same_type: bool
    files: Optional[_SavedFiles]
    scheduler_state: Optional[Dict]

    def fingerprint(self) -> str:
        """What every rank must agree on: the same checkpoint, and optimizer files of one save."""
        step = None
        if self.files is not None:
            step = [_saved_step(self.files[rank]) for rank in sorted(self.files.opened_ranks())]
        return f"{self.tag}|{self.model_states.get('global_steps')}|{sorted(set(step)) if step else None}"


@contextlib.contextmanager
def _reading(path: str):
    """A file whose entries are missing or of the wrong kind is refused naming the file."""
    try:
        yield
    except ValueError:
        raise
    except (KeyError, IndexError, TypeError, AttributeError) as error:
        raise ValueError(f"load_checkpoint: {path}: a missing or malformed entry ({type(error).__name__}: "
                         f"{first_line(error)}); the file was not written by DeepSpeed's ZeRO-1 or by "
                         f"save_checkpoint, or it is damaged: load another checkpoint") from error


def load_checkpoint(engine, load_dir: str, tag: Optional[str], load_module_strict: bool, load_optimizer_states: bool,
                    load_lr_scheduler_states: bool, trusted_classes: Optional[Sequence] = None):
    plan, problem = None, None
    try:  # local reads only: no collective before every rank has its verdict
        plan = _plan_load(engine, load_dir, tag, load_module_strict, load_optimizer_states, load_lr_scheduler_states,
                          trusted_classes or ())
    except Exception as error:
        problem = error
    _agree_on_load(engine, plan, problem)
    if plan is None:
        # DeepSpeed's behaviour: warn and load nothing, so a first run can always call load.
        logger.warning("load_checkpoint: no %s file in %r; nothing loaded (pass tag= to load a specific "
                       "checkpoint)", LATEST_NAME, load_dir)
        return None, None
    _apply_load(engine, plan, load_module_strict, load_lr_scheduler_states)
    known = {"module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
             "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
             "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config",
             "ds_version", "checkpoint_parallel_dimensions", OUR_KEY}
    client_state = {key: value for key, value in plan.model_states.items() if key not in known}
    return plan.model_path, client_state


_REFUSED, _NOTHING, _READY = "refused:", "nothing", "ready:"


def _agree_on_load(engine, plan: Optional[_LoadPlan], problem: Optional[BaseException]) -> None:
    """Every rank learns every rank's verdict (one small collective on the control plane); if any
    rank refused, or the ranks read different checkpoints, every rank raises before changing anything."""
    if problem is not None:
        text = _REFUSED + (str(problem) if isinstance(problem, ValueError) else f"{type(problem).__name__}: {problem}")
    else:
        text = _NOTHING if plan is None else _READY + plan.fingerprint()
    verdicts = engine.control.texts(text)
    refusals = [(rank, verdict[len(_REFUSED):]) for rank, verdict in enumerate(verdicts)
                if verdict.startswith(_REFUSED)]
    if refusals:
        if len(verdicts) == 1:
            if isinstance(problem, ValueError):
                raise problem
            raise ValueError(f"load_checkpoint: refused ({type(problem).__name__}: {problem}); nothing was "
                             f"loaded") from problem
        reasons = "; ".join(f"rank {rank}: {reason.removeprefix('load_checkpoint: ')}" for rank, reason in refusals)
        raise ValueError(f"load_checkpoint: refused on {len(refusals)} of {len(verdicts)} ranks, so no rank loaded "
                         f"anything: {reasons}") from problem
    if len(set(verdicts)) > 1:
        seen = "; ".join(f"rank {rank}: {verdict.replace(_READY, '', 1)}" for rank, verdict in enumerate(verdicts))
        raise ValueError(f"load_checkpoint: the ranks found different checkpoints ({seen}; as tag|global_steps|"
                         f"optimizer steps); every rank must load the same directory and tag, from storage every rank "
                         f"sees, and the optimizer files must come from one save")


def _plan_load(engine, load_dir: str, tag: Optional[str], strict: bool, load_optimizer_states: bool,
               load_lr_scheduler_states: bool, trusted_classes: Sequence) -> Optional[_LoadPlan]:
    """Read and check every file the load needs, changing nothing (None: no ``latest``, nothing to load)."""
    if tag is None:
        tag = read_latest(load_dir, "load_checkpoint")
        if tag is None:
            return None
    else:
        tag = check_tag(tag, "load_checkpoint")
    directory = checkpoint_files.resolve_directory(load_dir, tag)
    model_path = os.path.join(directory, MODEL_STATES_NAME)
    if not os.path.isfile(model_path):
        raise ValueError(f"load_checkpoint: {model_path} does not exist (tag {tag!r} in {load_dir!r}); pass the tag "
                         f"of a checkpoint in that directory")
    model_states = load_file(model_path, trusted_classes)
    with _reading(model_path):
        if not isinstance(model_states, dict):
            raise ValueError(f"load_checkpoint: {model_path} holds {type(model_states).__name__}, not a model states "
                             f"dict; load a checkpoint written by save_checkpoint")
        _check_module(engine, model_states, model_path, strict)
        saved_world_size = model_states.get("dp_world_size", engine.world_size)
        if isinstance(saved_world_size, bool) or not isinstance(saved_world_size, int) or saved_world_size < 1:
            raise ValueError(f"load_checkpoint: {model_path}: dp_world_size is {saved_world_size!r}, not a positive "
                             f"integer; load a checkpoint written by save_checkpoint")
        ours = model_states.get(OUR_KEY)
        if ours is not None and not isinstance(ours, dict):
            raise ValueError(f"load_checkpoint: {model_path}: the {OUR_KEY!r} entry is not a dict; load a checkpoint "
                             f"written by save_checkpoint")
        same_type = ours is not None and ours.get("optimizer_type") == engine.engine_config.optimizer_type
    files = None
    if load_optimizer_states:
        with _reading(model_path):
            _check_compatible(engine, model_states, model_path, saved_world_size, same_type)
        _check_file_set(directory, saved_world_size)
        files = _SavedFiles(directory, saved_world_size, trusted_classes)
        ranks = _ranks_to_read(engine, saved_world_size)
        for rank in ranks:
            with _reading(files.path(rank)):
                _check_optimizer_file(engine, files[rank], files.path(rank), rank, saved_world_size, same_type)
        steps = {_saved_step(files[rank]) for rank in ranks}
        sharded_keys = {tuple(sorted(files[rank][OUR_KEY]["sharded"])) for rank in ranks} if same_type else set()
        if len(steps) > 1 or len(sharded_keys) > 1:
            raise ValueError(f"load_checkpoint: the optimizer files of ranks {ranks} in {directory} come from "
                             f"different saves (optimizer steps {sorted(steps)}); load a complete checkpoint")
        if same_type:
            own_path = files.path(_own_rank(engine, saved_world_size))
            with _reading(own_path):
                _check_round_state(engine, _own(files, engine, saved_world_size)[OUR_KEY], own_path, saved_world_size)
    scheduler_state = None
    if load_lr_scheduler_states and engine.lr_scheduler is not None:
        in_optimizer_file = files is not None and same_type  # the live state, as the schedule left it
        source = files.path(_own_rank(engine, saved_world_size)) if in_optimizer_file else model_path
        with _reading(source):
            scheduler_state = _own(files, engine, saved_world_size)[OUR_KEY]["lr_scheduler"] if in_optimizer_file \
                else model_states.get("lr_scheduler")
            _check_scheduler_state(engine, scheduler_state, source)
    return _LoadPlan(tag=tag, model_path=model_path, model_states=model_states, saved_world_size=saved_world_size,
                     same_type=same_type, files=files, scheduler_state=scheduler_state)


def _check_module(engine, model_states: Dict, path: str, strict: bool) -> None:
    """What ``module.load_state_dict`` would refuse, refused before it copies anything (it raises only
    after copying the tensors that fit)."""
    module = model_states.get("module")
    if not isinstance(module, dict) or not all(isinstance(key, str) and torch.is_tensor(value)
                                               for key, value in module.items()):
        raise ValueError(f"load_checkpoint: {path}: 'module' is not a state dict of tensors; load a checkpoint "
                         f"written by save_checkpoint")
    expected = engine.module.state_dict(keep_vars=True)
    if strict:
        missing = [key for key in expected if key not in module]
        unexpected = [key for key in module if key not in expected]
        if missing or unexpected:
            raise ValueError(f"load_checkpoint: {path}: the module state does not match the model (missing "
                             f"{missing[:5]}{'...' if len(missing) > 5 else ''}, unexpected "
                             f"{unexpected[:5]}{'...' if len(unexpected) > 5 else ''}); load a checkpoint of this "
                             f"model, or pass load_module_strict=False to load the entries that match")
    for key, current in expected.items():
        saved = module.get(key)
        if saved is None:
            continue
        if tuple(saved.shape) != tuple(current.shape) or saved.is_floating_point() != current.is_floating_point():
            raise ValueError(f"load_checkpoint: {path}: {key} is {saved.dtype} of shape {tuple(saved.shape)} in the "
                             f"file and {current.dtype} of shape {tuple(current.shape)} in the model; load a "
                             f"checkpoint of this model")


def _check_compatible(engine, model_states: Dict, path: str, saved_world_size: int, same_type: bool) -> None:
    flats = engine.optimizer.flats
    shapes = model_states.get("param_shapes") or []
    if len(shapes) != len(flats):
        raise ValueError(f"load_checkpoint: the checkpoint has {len(shapes)} parameter groups, the engine "
                         f"{len(flats)}; build the optimizer param groups as when it was saved")
    for index, (flat, group_shapes) in enumerate(zip(flats, shapes)):
        saved = [tuple(shape) for shape in group_shapes.values()]
        current = [tuple(p.shape) for p in flat.params]
        if saved != current:
            numel = sum(int(torch.Size(shape).numel()) for shape in saved)
            raise ValueError(f"load_checkpoint: {path}: parameter group {index} has {len(current)} trainable "
                             f"parameters ({flat.numel} values) in the engine and {len(saved)} ({numel} values) in "
                             f"the checkpoint, or other shapes; load a checkpoint of the same model, with the same "
                             f"param groups")
    ours = model_states.get(OUR_KEY) or {}
    engine.schedule.check_checkpoint_compatible(ours, saved_world_size)
    if ours.get("mid_round") and (saved_world_size != engine.world_size or not same_type):
        raise ValueError("load_checkpoint: the checkpoint was saved in the middle of a round (partial gradient sums "
                         "are per rank); load it with the same world size and optimizer type, or save at a round "
                         "boundary (after the step() for which is_gradient_accumulation_boundary() was true)")


def _check_file_set(directory: str, saved_world_size: int) -> None:
    """The optimizer files present are exactly those of the world size the model states file claims."""
    ranks = sorted({int(match.group(1)) for match in map(_OPTIMIZER_FILE.match, os.listdir(directory)) if match})
    if ranks != list(range(saved_world_size)):
        missing = sorted(set(range(saved_world_size)) - set(ranks))
        extra = sorted(set(ranks) - set(range(saved_world_size)))
        problem = (f"optimizer states of rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} are "
                   f"missing" if missing else f"there are optimizer files of ranks {extra}")
        raise ValueError(f"load_checkpoint: {directory}: {problem}, but {MODEL_STATES_NAME} says the checkpoint was "
                         f"written by {saved_world_size} ranks; the files come from different saves: load a complete "
                         f"checkpoint, or pass load_optimizer_states=False to load the weights only")


def _ranks_to_read(engine, saved_world_size: int) -> List[int]:
    """The saved ranks whose optimizer files this rank reads: its own at the same world size, else
    those whose DeepSpeed partitions overlap its new shard of some group."""
    if saved_world_size == engine.world_size:
        return [engine.global_rank]
    ranks = {_own_rank(engine, saved_world_size)}
    rank = engine.global_rank
    for flat in engine.optimizer.flats:
        shard_numel = _our_shard_numel(engine, flat.numel)
        mine = (rank * shard_numel, (rank + 1) * shard_numel)
        saved = deepspeed_geometry(flat.numel, saved_world_size)
        ranks.update(saved_rank for saved_rank in range(saved_world_size)
                     if _overlap(mine, saved.shard_range(saved_rank), flat.numel)[1]
                     > _overlap(mine, saved.shard_range(saved_rank), flat.numel)[0])
    return sorted(ranks)


def _check_partitions(name: str, values: Any, engine, path: str, saved_rank: int, saved_world_size: int,
                      fp32: bool = True) -> None:
    """One saved vector per group: fp32 (``fp32=False``: any floating point, for vectors kept in the
    model's dtype such as ``held``), and exactly DeepSpeed partition ``saved_rank``'s length for the
    engine's group sizes (its valid prefix, or the whole padded partition). Never padded."""
    flats = engine.optimizer.flats
    if not isinstance(values, (list, tuple)) or len(values) != len(flats):
        count = len(values) if isinstance(values, (list, tuple, dict)) else type(values).__name__
        raise ValueError(f"load_checkpoint: {path}: {name} has {count} entries, the engine {len(flats)} parameter "
                         f"groups; load a checkpoint of this model with the same param groups")
    for index, (flat, value) in enumerate(zip(flats, values)):
        geometry = deepspeed_geometry(flat.numel, saved_world_size)
        allowed = (geometry.valid_numel(saved_rank), geometry.shard_numel)
        if not torch.is_tensor(value) or value.dim() != 1 or not value.is_floating_point() \
                or (fp32 and value.dtype != torch.float32):
            kind = f"{value.dtype} tensor of shape {tuple(value.shape)}" if torch.is_tensor(value) else \
                type(value).__name__
            raise ValueError(f"load_checkpoint: {path}: {name}[{index}] is a {kind}, not a 1-D "
                             f"{'fp32' if fp32 else 'floating-point'} partition; load a checkpoint written by "
                             f"save_checkpoint or DeepSpeed's ZeRO-1")
        if value.numel() not in allowed:
            raise ValueError(f"load_checkpoint: {path}: {name}[{index}] has {value.numel()} values, but partition "
                             f"{saved_rank} of parameter group {index} ({flat.numel} values over {saved_world_size} "
                             f"ranks) has {allowed[0]} ({allowed[1]} padded): the file belongs to another model or "
                             f"world size; load a checkpoint of this model")


def _number(value: Any) -> bool:
    if torch.is_tensor(value):
        return value.numel() == 1
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_optimizer_file(engine, state: Dict, path: str, saved_rank: int, saved_world_size: int,
                          same_type: bool) -> None:
    """Everything the load reads from one optimizer file, checked against the engine."""
    counts = state.get("partition_count")
    if counts is not None and any(int(count) != saved_world_size for count in counts):
        raise ValueError(f"load_checkpoint: {path} was written for {list(counts)} ranks, but {MODEL_STATES_NAME} "
                         f"says {saved_world_size}; the files come from different saves: load a complete checkpoint")
    ours = state.get(OUR_KEY)
    if ours is not None and ours.get("world_size", saved_world_size) != saved_world_size:
        raise ValueError(f"load_checkpoint: {path} was written by {ours.get('world_size')} ranks, but "
                         f"{MODEL_STATES_NAME} says {saved_world_size}; the files come from different saves: load a "
                         f"complete checkpoint")
    schedule = engine.schedule
    _check_partitions("single_partition_of_fp32_groups", state["single_partition_of_fp32_groups"], engine, path,
                      saved_rank, saved_world_size)
    base = state["base_optimizer_state"]
    groups = base["state"]
    if not _number(groups[0]["step"]):
        raise ValueError(f"load_checkpoint: {path}: the optimizer step is {groups[0]['step']!r}, not a number; load a "
                         f"checkpoint written by save_checkpoint or DeepSpeed's ZeRO-1")
    if not same_type or schedule.rule_state_is_sharded():
        for key in schedule.rule.state_names:
            if not all(key in groups[index] for index in range(len(engine.optimizer.flats))):
                raise ValueError(f"load_checkpoint: the checkpoint's optimizer state has no {key!r} (saved by another "
                                 f"optimizer); pass load_optimizer_states=False to load the weights only")
            _check_partitions(f"base_optimizer_state[{key!r}]",
                              [groups[index][key] for index in range(len(engine.optimizer.flats))], engine, path,
                              saved_rank, saved_world_size)
    if not same_type:
        param_groups = base["param_groups"]
        if len(param_groups) != len(engine.optimizer.flats):
            raise ValueError(f"load_checkpoint: {path} has {len(param_groups)} param groups, the engine "
                             f"{len(engine.optimizer.flats)}; build the optimizer param groups as when it was saved")
        for index, group in enumerate(param_groups):
            for key in ("lr", "eps", "weight_decay"):
                if key in group and not _number(group[key]):
                    raise ValueError(f"load_checkpoint: {path}: param group {index}'s {key} is {group[key]!r}; load a "
                                     f"checkpoint written by save_checkpoint or DeepSpeed's ZeRO-1")
            if "betas" in group and not (len(group["betas"]) == 2 and all(map(_number, group["betas"]))):
                raise ValueError(f"load_checkpoint: {path}: param group {index}'s betas are {group['betas']!r}; load "
                                 f"a checkpoint written by save_checkpoint or DeepSpeed's ZeRO-1")
        scaler = state.get("loss_scaler")
        if engine.engine_config.precision == "fp16" and scaler is not None:
            names = ["cur_scale"] + (["cur_iter", "last_overflow_iter", "cur_hysteresis"]
                                     if getattr(scaler, "dynamic", False) else [])
            if not all(_number(getattr(scaler, name, None)) for name in names):
                raise ValueError(f"load_checkpoint: {path}: the loss scaler lacks {names}; load a checkpoint written "
                                 f"by save_checkpoint or DeepSpeed's ZeRO-1")
        return
    if not isinstance(ours, dict):
        raise ValueError(f"load_checkpoint: {path} has no {OUR_KEY!r} entry although its model states name "
                         f"{engine.engine_config.optimizer_type}; the files come from different saves: load a complete "
                         f"checkpoint")
    sharded = ours["sharded"]
    for key, values in sharded.items():
        _check_partitions(f"{OUR_KEY}.sharded[{key!r}]", values, engine, path, saved_rank, saved_world_size,
                          fp32=False)
    progress = ours["progress"]
    if not all(_number(progress.get(item.name, 0)) for item in dataclasses.fields(Progress)):
        raise ValueError(f"load_checkpoint: {path}: the counters {progress!r} are not numbers; load a checkpoint "
                         f"written by save_checkpoint")
    lrs = ours["param_group_lrs"]
    if len(lrs) != len(engine.optimizer.param_groups) or not all(map(_number, lrs)):
        raise ValueError(f"load_checkpoint: {path}: {len(lrs)} learning rates for {len(engine.optimizer.param_groups)} "
                         f"param groups; build the optimizer param groups as when it was saved")
    unknown = sorted(set(ours["loss_scale"]) - set(vars(engine.schedule.loss_scale)))
    if unknown:
        raise ValueError(f"load_checkpoint: {path}: the loss scale has unknown entries {unknown}; load a checkpoint "
                         f"written by save_checkpoint")


def _check_round_state(engine, ours: Dict, path: str, saved_world_size: int) -> None:
    """The schedule's in-flight state (phase, pending job, partial sums, its own entries)."""
    local = ours["local"] if saved_world_size == engine.world_size else {}
    state = CheckpointState(fp32_partitions=[], rule_state=None, sharded=ours["sharded"], local=local,
                            meta=ours["meta"])
    try:
        engine.schedule.check_checkpoint_state(state)
    except ValueError as error:
        raise ValueError(f"load_checkpoint: {path}: {error}; load a checkpoint written by save_checkpoint with this "
                         f"optimizer type") from None


def _check_scheduler_state(engine, saved: Any, path: str) -> None:
    if not saved:
        return
    if not isinstance(saved, dict):
        raise ValueError(f"load_checkpoint: {path}: the LR scheduler state is a {type(saved).__name__}, not a dict; "
                         f"pass load_lr_scheduler_states=False to keep this run's scheduler")
    missing = sorted(set(engine.lr_scheduler.state_dict()) - set(saved))
    if missing:
        raise ValueError(f"load_checkpoint: {path}: the LR scheduler state lacks {missing} (another scheduler "
                         f"saved it); configure the scheduler as when it was saved, or pass "
                         f"load_lr_scheduler_states=False to keep this run's scheduler")


# ---- load: apply what was checked -----------------------------------------------------------------
def _apply_load(engine, plan: _LoadPlan, strict: bool, load_lr_scheduler_states: bool) -> None:
    schedule, files, saved_world_size = engine.schedule, plan.files, plan.saved_world_size
    schedule.synchronize()
    engine.module.load_state_dict(plan.model_states["module"], strict=strict)
    if files is None:  # weights only: the optimizer keeps its state; every copy of the weights follows the module
        for shard, flat in zip(engine.optimizer.shards, engine.optimizer.flats):
            shard.master.copy_(flat.shard_of(flat.model_flat))
        schedule.reset()
    elif plan.same_type:
        _load_same_type(engine, files, saved_world_size)
        schedule.continue_warmup(plan.model_states[OUR_KEY])
    else:
        _load_committed_state(engine, files, saved_world_size, plan.model_states)
    if load_lr_scheduler_states and engine.lr_scheduler is not None and plan.scheduler_state:
        engine.lr_scheduler.load_state_dict(plan.scheduler_state)


def _own_rank(engine, saved_world_size: int) -> int:
    """The saved rank whose file holds this rank's plain data: its own at the same world size; after a
    re-shard, a file this rank reads for its shard anyway (the plain data in it, param groups and
    counters, is the same in every rank's file)."""
    if saved_world_size == engine.world_size:
        return engine.global_rank
    numel = engine.optimizer.flats[0].numel
    start = min(engine.global_rank * _our_shard_numel(engine, numel), numel - 1)
    return min(start // deepspeed_geometry(numel, saved_world_size).shard_numel, saved_world_size - 1)


def _own(files: _SavedFiles, engine, saved_world_size: int) -> Dict:
    return files[_own_rank(engine, saved_world_size)]


def _partition(values: torch.Tensor, numel: int, saved_world_size: int, saved_rank: int) -> torch.Tensor:
    """A saved DeepSpeed partition as the whole padded partition (padding zero). Its length was
    checked before the load changed anything; any other length is an error, never padded."""
    geometry = deepspeed_geometry(numel, saved_world_size)
    if values.numel() not in (geometry.valid_numel(saved_rank), geometry.shard_numel):
        raise ValueError(f"load_checkpoint: a partition of {values.numel()} values where partition {saved_rank} of "
                         f"{numel} values over {saved_world_size} ranks has {geometry.valid_numel(saved_rank)}")
    output = torch.zeros(geometry.shard_numel, dtype=values.dtype, device=values.device)
    output[:values.numel()].copy_(values)
    return output


def _read_resharded(engine, files: _SavedFiles, saved_world_size: int, getter, numels: List[int],
                    our_numels: List[int]) -> List[torch.Tensor]:
    """This rank's shards in our layout of one saved vector per group.

    ``getter(file, group)`` returns the saved rank's DeepSpeed partition (a valid prefix is enough).
    Same world size: the own file, moved between layouts by the peers. Otherwise: memory-mapped
    slices of the files that cover this rank's new shard.
    """
    if saved_world_size == engine.world_size:
        own = files[engine.global_rank]
        partitions = [_partition(getter(own, index), numel, saved_world_size, engine.global_rank)
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
    for key in schedule.rule.state_names:
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

