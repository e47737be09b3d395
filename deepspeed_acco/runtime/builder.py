"""Builds everything an engine runs on: communicators, lane, schedule, LR scheduler, data, monitors.

Construction is collective (process groups are created in the same order on every rank) and has
no global side effects beyond the process groups it creates, which the engine releases in
``destroy()``.
"""
import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from .comm import Communicator, ControlPlane, Lane, new_communicator, new_control_plane, prepare_nccl_environment
from .config import EngineConfig
from .loss_scale import LossScale
from .optimizers import lookup
from .optimizers.params import AUTO
from .scheduler_config import DEEPSPEED_SCHEDULERS, scheduler_class
from .warmup import describe_warmup, resolve_auto_warmup
from .schedule import BuildContext, Schedule


@dataclass
class Parts:
    """What :func:`build` makes for an engine."""

    schedule: Schedule
    lane: Lane
    control: ControlPlane
    communicators: List[Communicator]
    lr_scheduler: Any
    dataloader: Any
    monitor: Any
    defaults_note: str = ""
    """One line for the start-up log: what the defaults resolved to where the config left them out
    (docs/design.md, 2 "Defaults"); empty when there is nothing to say."""


def broadcast_model(module: torch.nn.Module) -> None:
    """Start every rank from rank 0's parameters and buffers, as DeepSpeed does."""
    if dist.get_world_size() == 1:
        return
    with torch.no_grad():
        for tensor in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(tensor.data, src=0)


def build(*, module: torch.nn.Module, param_groups: List[Dict], config: EngineConfig, device: torch.device,
          client_lr_scheduler: Any = None, training_data: Any = None, collate_fn: Any = None) -> Parts:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    timeout_s = config.params.communication_timeout_s
    if dist.get_backend() == "nccl":
        prepare_nccl_environment()  # before this process's first NCCL launch (broadcast_model's)
    module.to(device=device, dtype=config.model_torch_dtype if config.precision != "fp32" else None)
    broadcast_model(module)

    communicators: List[Communicator] = []
    # A dedicated process group for the jobs, so the training loop's own collectives never
    # interleave with them (docs/failures.md).
    jobs = new_communicator(list(range(world_size)), timeout_s, name="acco-jobs")
    communicators.append(jobs)
    control = new_control_plane(timeout_s)
    lane = Lane(rank, device, timeout_s)

    def new_group_communicator(group_size: int, name: str) -> Communicator:
        """This rank's group of consecutive ranks; every rank creates every group, in order."""
        if group_size == 1:
            return Communicator(group=None, rank=0, world_size=1, name=f"{name}-local")
        mine = None
        for first in range(0, world_size, group_size):
            ranks = list(range(first, first + group_size))
            communicator = new_communicator(ranks, timeout_s, name=f"{name}-{first // group_size}")
            if rank in ranks:
                mine = communicator
        communicators.append(mine)
        return mine

    schedule_class = lookup(config.optimizer_type)
    auto_warmup = getattr(config.params, "warmup_sync_updates", None) == AUTO
    if auto_warmup:  # resolved from the LR scheduler, which needs the schedule's optimizer: 0 until then
        config.params = _with_warmup(config.params, 0)
    context = BuildContext(params=config.params, config=config, param_groups=param_groups, rank=rank,
                           world_size=world_size, device=device, lane=lane, jobs_communicator=jobs, control=control,
                           loss_scale=LossScale.from_config(config.fp16_loss_scale),
                           new_group_communicator=new_group_communicator)
    schedule = schedule_class.build(context)
    schedule.fix_wire_from_environment()
    schedule.optimizer.attach_loss_scale(schedule.loss_scale)
    lr_scheduler = make_lr_scheduler(schedule.optimizer, client_lr_scheduler, config.raw.get("scheduler"))
    schedule.lr_scheduler = lr_scheduler
    warmup_reason = None
    if auto_warmup:
        resolved = resolve_auto_warmup(lr_scheduler, getattr(config.params, "sync_after_updates", None))
        config.params = _with_warmup(config.params, resolved.updates)
        schedule.params = config.params
        schedule.warmup_sync_updates = resolved.updates
        warmup_reason = resolved.reason
    dataloader = None
    if training_data is not None:
        dataloader = make_dataloader(training_data, collate_fn, config, rank, world_size)
    return Parts(schedule=schedule, lane=lane, control=control, communicators=communicators,
                 lr_scheduler=lr_scheduler, dataloader=dataloader, monitor=make_monitor(config.raw),
                 defaults_note=defaults_note(config, warmup_reason))


def _with_warmup(params, updates: int):
    """``params`` with ``warmup_sync_updates`` = ``updates``, keeping which keys the config gave."""
    resolved = dataclasses.replace(params, warmup_sync_updates=updates)
    resolved.given = params.given
    return resolved


def defaults_note(config: EngineConfig, warmup_reason: Optional[str]) -> str:
    """The start-up log line that says what the defaults of docs/design.md (2, "Defaults") did for a config
    that leaves them out, and the key that restores the previous behaviour; "" when nothing was left out.

    ``warmup_reason``: why "auto" resolved as it did (None: the config gave an integer)."""
    kind, params = config.optimizer_type, config.params
    parts = []
    if not config.communication_dtype_given and config.communication_dtype != "fp32":
        parts.append(f"gradients are reduced in {config.communication_dtype} (the model's dtype, DeepSpeed's rule; "
                     f"set communication_data_type \"fp32\" for fp32 reductions, the previous default)")
    if warmup_reason is not None:
        parts.append(describe_warmup(params.warmup_sync_updates, warmup_reason)
                     + "; set warmup_sync_updates to 0 for none, the previous default, or to a number")
    elif getattr(params, "warmup_sync_updates", 0):
        parts.append(describe_warmup(params.warmup_sync_updates, None))
    if kind == "CO2":
        given = params.given
        if "anchor_merge_steps" not in given:
            if params.eager_merge:
                parts.append(f"the anchor is merged eagerly, {params.anchor_merge_steps} inner step into each round "
                             f"(anchor_merge_steps {params.anchor_merge_steps}, the default; 0 for the paper's rule, "
                             f"the previous default)")
            else:
                parts.append("replicas restart from an anchor one round old (the paper's rule, anchor_merge_steps 0: "
                             "the default with an \"adaptive\" gap_penalty)")
        if "local_steps" not in given:
            parts.append(f"local_steps is {params.local_steps} (the default; it was 12)")
    return f"{kind}: " + "; ".join(parts) if parts else ""


def make_lr_scheduler(optimizer, client_scheduler, section: Optional[Dict]):
    """The client's scheduler (an object, or a callable taking the optimizer), else the config's."""
    if client_scheduler is not None:
        if callable(client_scheduler) and not hasattr(client_scheduler, "step"):
            return client_scheduler(optimizer)
        return client_scheduler
    if not section:
        return None
    # The section was checked by the parser (runtime/scheduler_config.py), before any collective.
    name = section.get("type")
    params = section.get("params", {}) or {}
    cls = scheduler_class(name)
    if cls is None:
        raise ValueError(f"deepspeed_acco config: scheduler.type: unknown scheduler {name!r}; use one of "
                         f"DeepSpeed's ({', '.join(DEEPSPEED_SCHEDULERS)}) or a torch.optim.lr_scheduler class name")
    return cls(optimizer, **params)


def make_dataloader(dataset, collate_fn, config: EngineConfig, rank: int, world_size: int):
    """DeepSpeed's ``training_data`` loader: each rank its share, micro-batches of the configured size."""
    sampler = torch.utils.data.distributed.DistributedSampler(dataset, num_replicas=world_size, rank=rank)
    return torch.utils.data.DataLoader(dataset, batch_size=config.batch.micro_batch_size, sampler=sampler,
                                       collate_fn=collate_fn, drop_last=config.dataloader_drop_last)


def make_monitor(raw_config: Dict):
    from deepspeed.monitor.config import get_monitor_config
    monitor_config = get_monitor_config(raw_config)
    if not monitor_config.enabled:
        return None
    from deepspeed.monitor.monitor import MonitorMaster
    return MonitorMaster(monitor_config)


def device_for_backend() -> torch.device:
    """The rank's device: its CUDA device under NCCL, else the CPU."""
    if torch.cuda.is_available() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))
