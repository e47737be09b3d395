"""The methods the bench compares and the DeepSpeed config each one runs with.

Every method gets the same batch sizes, learning-rate schedule, AdamW hyper-parameters and
gradient clipping; only the optimizer type (and ZeRO stage for DeepSpeed's own) differs.
``train_batch_size`` is the number of samples per committed update (CO2: per inner step), so
equal update counts mean equal samples.
"""
from dataclasses import dataclass
from typing import Dict, List, Optional


@dataclass(frozen=True)
class Method:
    name: str                 # CLI name
    label: str                # table / plot label
    optimizer: Optional[str]  # DeepSpeed optimizer type; None for the compute-only baseline
    zero_stage: Optional[int] = None
    ours: bool = False        # needs deepspeed_acco's engine
    comm_jobs: float = 1.0    # k in the bound max(T_compute, k * T_comm): communication rounds per update
                              # that must fit under compute (CO2: 1 / local_steps, set at run time)
    overlapped: bool = False  # whether the method can hide communication behind compute at all


METHODS: Dict[str, Method] = {m.name: m for m in (
    Method("compute", "compute-only (no comm)", None),
    Method("zero1", "DeepSpeed ZeRO-1", "AdamW", zero_stage=1),
    Method("zero0", "DeepSpeed DP (stage 0)", "AdamW", zero_stage=0),
    Method("sharded", "ShardedAdamW", "ShardedAdamW", ours=True),
    Method("dpu", "DPU", "DPU", ours=True, overlapped=True),
    Method("acco", "ACCO", "ACCO", ours=True, comm_jobs=2.0, overlapped=True),
    Method("co2", "CO2", "CO2", ours=True, overlapped=True),
)}
DEFAULT_METHODS = ("zero1", "zero0", "sharded", "dpu", "acco", "co2")
BASELINE = "zero1"
MIN_LR_FRACTION = 0.1  # warm up from, and decay to, lr / 10 (DeepSpeed's first two updates run at the minimum)


def ds_config(method: str, *, world_size: int, micro_batch: int, grad_accum: int, lr: float, total_updates: int,
              warmup: int, betas=(0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.1, clip: float = 1.0,
              local_steps: int = 12, dynamic_accumulation: bool = False, bf16: bool = False,
              torch_adam: bool = True, co2_options: Optional[dict] = None) -> dict:
    """The DeepSpeed JSON config (as a dict) for ``method``; ``co2_options``: further CO2 params
    (``outer_lr``, ``outer_momentum``, ``gap_penalty``), the engine's defaults where absent."""
    spec = METHODS[method]
    if spec.optimizer is None:
        raise ValueError(f"{method!r} runs without DeepSpeed (the compute-only baseline) and has no config")
    params = dict(lr=lr, betas=list(betas), eps=eps, weight_decay=weight_decay)
    if spec.ours:
        params["overlap"] = True
    elif torch_adam:
        params["torch_adam"] = True  # torch.optim.AdamW: no op build needed on CPU
    if spec.name == "acco":
        params["dynamic_accumulation"] = bool(dynamic_accumulation)
    if spec.name == "co2":
        params["local_steps"] = int(local_steps)
        params.update(co2_options or {})
    cfg = {
        "train_batch_size": micro_batch * grad_accum * world_size,
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": grad_accum,
        "gradient_clipping": clip,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        "optimizer": {"type": spec.optimizer, "params": params},
        "scheduler": {"type": "WarmupDecayLR", "params": {
            "warmup_min_lr": lr * MIN_LR_FRACTION, "warmup_max_lr": lr, "warmup_num_steps": max(2, int(warmup)),
            "total_num_steps": max(int(total_updates), int(warmup) + 1), "warmup_type": "linear"}},
    }
    if spec.zero_stage is not None:
        cfg["zero_optimization"] = {"stage": spec.zero_stage}
    if bf16:
        cfg["bf16"] = {"enabled": True}
    return cfg


def warmup_decay_lr(step: int, lr: float, warmup: int, total_updates: int) -> float:
    """The learning rate DeepSpeed's ``WarmupDecayLR`` (linear warm-up, the config above) sets after
    ``step`` scheduler steps, i.e. the lr of update ``step + 1``; for the compute-only baseline, which
    runs without DeepSpeed."""
    min_lr = lr * MIN_LR_FRACTION
    if step <= 0:
        return min_lr
    it = step - 1  # DeepSpeed's last_batch_iteration
    warmup = max(2, int(warmup))
    total = max(int(total_updates), int(warmup) + 1)
    if it < warmup:
        gamma = it / warmup
    else:
        gamma = max(0.0, (total - it) / max(1.0, total - warmup))
    return min_lr + (lr - min_lr) * gamma


def resolve_methods(text: str) -> List[str]:
    names = [m.strip().lower() for m in text.split(",") if m.strip()]
    aliases = {"zero-1": "zero1", "zero": "zero1", "ddp": "zero0", "stage0": "zero0", "shardedadamw": "sharded"}
    names = [aliases.get(m, m) for m in names]
    bad = [m for m in names if m not in METHODS or m == "compute"]
    if bad:
        raise SystemExit(f"unknown method(s) {bad}; choose from {[m for m in METHODS if m != 'compute']}")
    return list(dict.fromkeys(names))
