"""``deepspeed_acco.initialize``: a drop-in for ``deepspeed.initialize`` (docs/design.md, section 2).

If the config selects one of our optimizer types the model is wrapped in :class:`AccoEngine`;
otherwise every argument is passed to ``deepspeed.initialize`` unchanged. Config mistakes raise
``ValueError`` before torch.distributed is initialised or any collective runs.
"""
import atexit
import datetime
import importlib
import os
import socket
import sys
import threading
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from .. import ops
from .builder import device_for_backend
from .comm import prepare_nccl_environment
from .config import load_config, optimizer_type, parse_config
from .engine import AccoEngine


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _world_size_before_init() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    value = os.environ.get("WORLD_SIZE", "1")
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable WORLD_SIZE={value!r} is not an integer") from None


def _uses_nccl() -> bool:
    """Whether this process's default group is, or will be (:func:`init_distributed`), an NCCL group."""
    if dist.is_available() and dist.is_initialized():
        return "nccl" in str(dist.get_backend())
    return torch.cuda.is_available()


def init_distributed(timeout_s: float) -> None:
    """Initialise torch.distributed from RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT if not done yet.

    gloo on CPU, nccl on CUDA, like DeepSpeed. Without any launcher variable this is a single
    process, which gets a private rendezvous on a free local port (the environment is not touched).
    """
    if dist.is_initialized():
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    timeout = datetime.timedelta(seconds=timeout_s)
    if not any(name in os.environ for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        dist.init_process_group(backend=backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0,
                                world_size=1, timeout=timeout)
    else:
        missing = [name for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
        if missing:
            raise ValueError(f"cannot initialise torch.distributed: environment variables {missing} are not set; "
                             f"start the job with the deepspeed launcher or torchrun")
        dist.init_process_group(backend=backend, timeout=timeout)
    # We created the default group, so we release it: torch 2.13's gloo groups left to
    # interpreter finalisation abort the process in about one exit in four (measured: 5 of 20
    # two-rank runs without destroy_process_group, 0 of 20 with it). Registered before any
    # engine's exit hook, so it runs after them.
    atexit.register(_destroy_default_group)


def _destroy_default_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _import_torch_dynamo_off_the_stack() -> None:
    """Import ``torch._dynamo`` on a thread of its own, unless something already has.

    ``torch.optim.Optimizer.__init__`` imports it on its first call, and that import leaves a frame
    of torch.fx's ``wrap`` in a reference cycle with itself, which keeps every frame then on the stack
    (and their locals) until the garbage collector runs. Imported while the engine is being built,
    those frames would hold the caller's model and the engine itself, so a process's first engine
    would outlive ``destroy()``; imported on a fresh thread, only that thread's frames are kept.
    Training scripts that import transformers have imported it already.
    """
    if "torch._dynamo" in sys.modules:
        return
    thread = threading.Thread(target=importlib.import_module, args=("torch._dynamo", ), name="acco-import-dynamo")
    thread.start()
    thread.join()


def _param_groups(model: torch.nn.Module, model_parameters) -> List[Dict]:
    if model_parameters is None:
        model_parameters = model.parameters()
    items = list(model_parameters)
    if not items:
        raise ValueError("model_parameters: empty; pass model.parameters() or a list of param-group dicts")
    if all(isinstance(item, dict) for item in items):
        groups = [dict(item, params=list(item["params"])) for item in items]
    elif all(isinstance(item, torch.Tensor) for item in items):
        groups = [{"params": items}]
    else:
        raise ValueError("model_parameters: mix of tensors and dicts; pass either parameters or param-group dicts")
    seen = set()
    model_param_ids = {id(p) for p in model.parameters()}
    for index, group in enumerate(groups):
        for p in group["params"]:
            if id(p) in seen:
                raise ValueError(f"model_parameters: a parameter appears twice (group {index}); each parameter may "
                                 f"belong to one group only")
            if id(p) not in model_param_ids:
                raise ValueError(f"model_parameters: group {index} holds a tensor that is not a parameter of the model")
            seen.add(id(p))
    if not any(p.requires_grad for group in groups for p in group["params"]):
        raise ValueError("model_parameters: no parameter requires a gradient; there is nothing to optimize")
    return groups


def _is_accelerate_placeholder(value: Any, class_name: str) -> bool:
    """Whether ``value`` is accelerate's ``DummyOptim``/``DummyScheduler`` (recognised without importing accelerate)."""
    kind = type(value)
    return kind.__name__ == class_name and kind.__module__.split(".")[0] == "accelerate"


def initialize(args: Any = None, model: Optional[torch.nn.Module] = None, optimizer: Any = None,
               model_parameters: Any = None, training_data: Any = None, lr_scheduler: Any = None,
               distributed_port: Optional[int] = None, mpu: Any = None, dist_init_required: Optional[bool] = None,
               collate_fn: Any = None, config: Any = None, config_params: Any = None, **kwargs):
    """Same signature and return as ``deepspeed.initialize``: ``(engine, optimizer, dataloader, lr_scheduler)``.

    Accelerate's ``DummyOptim`` (the HF Trainer passes one when the config names the optimizer) is
    not a client optimizer: its params become ``model_parameters``. A ``DummyScheduler`` stands for
    its ``lr_scheduler_callable``, or for the config's scheduler when it has none.
    """
    given = config if config is not None else config_params
    args_config = getattr(args, "deepspeed_config", None) if args is not None else None
    if args_config is not None and given is not None:
        raise ValueError("config: given both as args.deepspeed_config and as the config argument; pass only one")
    given = given if given is not None else args_config
    if given is None:
        raise ValueError("config: missing; pass config=<dict or JSON path> or args.deepspeed_config")
    config_dict = load_config(given)

    if optimizer_type(config_dict) is None:
        # Not ours: DeepSpeed gets the call exactly as it was made.
        import deepspeed
        forwarded = dict(args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
                         training_data=training_data, lr_scheduler=lr_scheduler, mpu=mpu,
                         dist_init_required=dist_init_required, collate_fn=collate_fn, config=config,
                         config_params=config_params, **kwargs)
        if distributed_port is not None:
            forwarded["distributed_port"] = distributed_port
        return deepspeed.initialize(**forwarded)

    if model is None:
        raise ValueError("model: deepspeed_acco.initialize requires a model")
    # The HF Trainer and Accelerate pass a DummyOptim for a config that names the optimizer (ours always do),
    # and they decide where each update ends (set_gradient_accumulation_boundary).
    caller_sets_boundaries = _is_accelerate_placeholder(optimizer, "DummyOptim")
    if caller_sets_boundaries:
        # The HF Trainer / Accelerate stand-in for "the optimizer is in the config": its params are ours.
        model_parameters = optimizer.params if model_parameters is None else model_parameters
        optimizer = None
    if optimizer is not None:
        raise ValueError("optimizer: a client optimizer was passed but the config selects optimizer type "
                         f"{config_dict['optimizer']['type']!r}; remove one of the two")
    if _is_accelerate_placeholder(lr_scheduler, "DummyScheduler"):
        # Its callable (if any) builds the scheduler on our optimizer; without one the config's section does.
        lr_scheduler = lr_scheduler.lr_scheduler_callable
    if mpu is not None:
        raise ValueError("mpu: model parallelism is not supported by deepspeed_acco's optimizers; remove mpu")
    unsupported = sorted(name for name, value in kwargs.items() if value is not None)
    if unsupported:
        raise ValueError(f"{', '.join(unsupported)}: not supported with deepspeed_acco's optimizer types; remove "
                         f"the argument (or pass None)")
    param_groups = _param_groups(model, model_parameters)
    # Before the parser, which builds the config's LR scheduler once on a stand-in optimizer (the first
    # torch optimizer of a process imports torch._dynamo).
    _import_torch_dynamo_off_the_stack()
    parse_options = dict(caller_sets_boundaries=caller_sets_boundaries, client_scheduler=lr_scheduler is not None,
                         param_group_count=len(param_groups))
    acco_config = parse_config(config_dict, _world_size_before_init(), **parse_options)
    if _uses_nccl():
        # Before our own groups exist; warns if an NCCL communicator of the script's predates it (docs/gpu.md).
        prepare_nccl_environment()
    if dist_init_required is not False:
        init_distributed(acco_config.params.communication_timeout_s)
    elif not dist.is_initialized():
        raise ValueError("dist_init_required=False but torch.distributed is not initialised; initialise it first")
    if dist.get_world_size() != acco_config.world_size:
        acco_config = parse_config(config_dict, dist.get_world_size(), **parse_options)
    device = device_for_backend()
    # Decides the update kernels before any group of ours exists: on CUDA a kernel that cannot be built
    # raises here with the build's error instead of training on the slower torch reference (ops/_backend.py).
    ops.backend(device)
    engine = AccoEngine(model=model, param_groups=param_groups, config=acco_config, lr_scheduler=lr_scheduler,
                        training_data=training_data, collate_fn=collate_fn, device=device)
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler
