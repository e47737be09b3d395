"""What the two studies of benchmarks/gpu_study.sh share (docs/gpu_study.md): one process of world
size 1 on the GPU (or the CPU, for the dry run), the bench's model and DeepSpeed configs (so that the
studies train what ``make demo`` trains), and output written as it is produced."""
import json
import os
import time
from pathlib import Path

from ..workload.methods import ds_config, parse_variant

_PROCESS_START = time.perf_counter()  # before torch's import: a study's budget counts its imports

COMMUNICATION_TIMEOUT_S = 300.0


def add_common_arguments(parser) -> None:
    parser.add_argument("--model", default=None, help="bench model preset (default: 125m on CUDA, tiny on the CPU)")
    parser.add_argument("--ctx", type=int, default=256, help="tokens (bytes) per sequence")
    parser.add_argument("--micro-batch", type=int, default=None,
                        help="sequences per micro-batch (default: 16 on CUDA, 2 on the CPU)")
    parser.add_argument("--precision", default="auto", choices=("auto", "bf16", "fp32"),
                        help="auto: bf16 where the device computes it natively "
                             "(deepspeed_acco.bench.workload.precision)")
    parser.add_argument("--json", type=Path, default=None, help="write the results here (rewritten as they come)")


def setup(args):
    """Pick the device, model and precision; start torch.distributed as one rank. Returns the device."""
    import torch

    from ..network.jobs import free_port
    from ..workload.precision import choose_precision
    from deepspeed_acco.runtime.comm import prepare_nccl_environment
    from deepspeed_acco.runtime.initialize import init_distributed

    cuda = torch.cuda.is_available()
    args.model = args.model or ("125m" if cuda else "tiny")
    args.micro_batch = args.micro_batch or (16 if cuda else 2)
    args.precision, args.precision_why = choose_precision(args.precision)
    # DeepSpeed's initialize looks for a launcher's variables even when torch.distributed is up.
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1"),
                        ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(free_port()))):
        os.environ.setdefault(name, value)
    if cuda:
        torch.cuda.set_device(0)
        prepare_nccl_environment()  # before the first NCCL communicator (docs/gpu.md)
    init_distributed(COMMUNICATION_TIMEOUT_S)
    return torch.device("cuda", 0) if cuda else torch.device("cpu")


def describe_device(device) -> str:
    import torch
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (torch {torch.__version__}, CUDA {torch.version.cuda})"
    return f"CPU (torch {torch.__version__})"


def synchronize(device) -> None:
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def kernel_backend(device) -> str:
    """Which update kernels our engine dispatches to (docs/kernels.md)."""
    from deepspeed_acco import ops
    return ops.backend(device)


def method_label(method: str) -> str:
    return parse_variant(method).label


def build_engine(method: str, args, device, *, grad_accum: int, lr: float, total_updates: int, warmup: int,
                 lr_schedule: str = "decay", scheduler: dict = None, warmup_sync_updates=None, local_steps=None):
    """The bench's model (seed 0) under ``method``'s bench config (deepspeed_acco.bench.workload.methods.ds_config).

    DeepSpeed's ZeRO-1 runs torch's AdamW (``torch_adam``): its FusedAdam would be one more CUDA
    build on the GPU machine, and at 125M its optimizer step is a small part of an update."""
    import deepspeed_acco
    from ..workload.models import build_model

    config = ds_config(method, world_size=1, micro_batch=args.micro_batch, grad_accum=grad_accum, lr=lr,
                       total_updates=total_updates, warmup=warmup, bf16=args.precision == "bf16", torch_adam=True,
                       warmup_sync_updates=warmup_sync_updates, local_steps=local_steps, lr_schedule=lr_schedule)
    if scheduler is not None:
        config["scheduler"] = scheduler
    model = build_model(args.model, args.ctx, seed=0)
    engine, *_ = deepspeed_acco.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine, config


def release(engine, device) -> None:
    import gc

    import torch
    engine.destroy()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def write_json(path, payload: dict) -> None:
    """Atomically (a step killed at its limit leaves the last complete version)."""
    if path is None:
        return
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1))
    os.replace(tmp, path)


class Clock:
    """Seconds since the study's process started (its imports included), for its log and its budget."""

    def __init__(self):
        self.start = _PROCESS_START

    def __call__(self) -> float:
        return time.perf_counter() - self.start
