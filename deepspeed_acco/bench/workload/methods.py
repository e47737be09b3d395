"""The methods the bench compares and the DeepSpeed config each one runs with.

Every method gets the same batch sizes, learning-rate schedule, AdamW hyper-parameters and
gradient clipping; only the optimizer type (and ZeRO stage for DeepSpeed's own) differs.
``train_batch_size`` is the number of samples per committed update (CO2: per inner step), so
equal update counts mean equal samples.

A method can carry modifiers, ``METHOD+MODIFIER[+MODIFIER...]`` (``acco+bf16comm``): each is one
entry of :data:`MODIFIERS`, a piece of DeepSpeed config merged into the method's (plus the bytes per
value it makes the communication move, for the bound). Adding a modifier is adding one entry.
"""
import copy
import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Dict, List, Optional, Tuple, Union


@dataclass(frozen=True)
class Method:
    name: str                 # CLI name
    label: str                # table / plot label
    optimizer: Optional[str]  # DeepSpeed optimizer type; None for the compute-only baseline
    zero_stage: Optional[int] = None
    ours: bool = False        # runs on deepspeed_acco's engine (else DeepSpeed's own)
    comm_jobs: float = 1.0    # k in the bound max(T_compute, k * T_comm): communication rounds per update
                              # that must fit under compute (CO2: 1 / local_steps, set at run time)
    overlapped: bool = False  # whether the method can hide communication behind compute at all
    # How one round reduces the gradients (:func:`gradient_passes`): "reduce_scatter" (our engine),
    # "all_reduce" (DeepSpeed's stage 0, and stage 1 by default), "reduce" (DeepSpeed's stage 1 reducing
    # each partition to its owner); and whether it then all-gathers the parameters (one pass).
    gradient_collective: str = "reduce_scatter"
    gathers_parameters: bool = True
    zero_options: Tuple[Tuple[str, object], ...] = ()  # DeepSpeed zero_optimization keys besides the stage


# DeepSpeed's stage 1 at its best on gloo (docs/bench.md, "DeepSpeed's ZeRO-1: default and best"): each
# partition's gradients are reduced to its owner (dist.reduce) instead of all-reduced, the fewest bytes
# any of its stage-1 settings sends, in buckets of 1e6 values: gloo's reduce sends more than a
# reduce-scatter once a tensor passes 2 W MiB (4 MiB at two ranks, 1,048,576 fp32 values), and a bucket
# bounds every reduce DeepSpeed issues (but a single parameter larger than the bucket). Every other
# setting keeps DeepSpeed's default.
ZERO1_BEST_OPTIONS = (("use_multi_rank_bucket_allreduce", False), ("reduce_bucket_size", 1_000_000))

METHODS: Dict[str, Method] = {m.name: m for m in (
    Method("compute", "compute-only (no comm)", None),
    Method("zero1", "DeepSpeed ZeRO-1", "AdamW", zero_stage=1, gradient_collective="all_reduce"),
    Method("zero1best", "DeepSpeed ZeRO-1 (best)", "AdamW", zero_stage=1, gradient_collective="reduce",
           zero_options=ZERO1_BEST_OPTIONS),
    Method("zero0", "DeepSpeed DP (stage 0)", "AdamW", zero_stage=0, gradient_collective="all_reduce",
           gathers_parameters=False),
    Method("sharded", "ShardedAdamW", "ShardedAdamW", ours=True),
    Method("dpu", "DPU", "DPU", ours=True, overlapped=True),
    Method("acco", "ACCO", "ACCO", ours=True, comm_jobs=2.0, overlapped=True),
    Method("co2", "CO2", "CO2", ours=True, overlapped=True),
)}
# The demo: DeepSpeed's ZeRO-1 against the overlapped methods at their engine defaults, ACCO also with
# int8 communication (zero0 and sharded stay one flag away, --methods).
DEFAULT_METHODS = ("zero1", "zero1best", "sharded", "acco", "co2", "dpu")
BASELINE = "zero1"
MIN_LR_FRACTION = 0.1  # warm up from, and decay to, lr / 10 (DeepSpeed's first two updates run at the minimum)


@dataclass(frozen=True)
class Modifier:
    """A change to a method's DeepSpeed config, written ``METHOD+NAME`` in ``--methods`` (e.g.
    ``acco+bf16comm``). ``config`` is merged into the method's config (nested sections merged key by
    key); ``gradient_bytes`` / ``parameter_bytes``, where set, are the bytes per value the gradient
    reduce-scatter / parameter all-gather then move (for the bound)."""
    name: str
    label: str
    config: dict
    gradient_bytes: Optional[float] = None
    parameter_bytes: Optional[float] = None
    help: str = ""
    not_for_deepspeed: str = ""  # why DeepSpeed's own methods cannot take it (empty: they can)
    only_for: str = ""  # the one method it applies to (empty: any)


_ZERO_PLUS_PLUS_ONLY_STAGE_3 = ("DeepSpeed honours zero_quantized_gradients/_weights only with ZeRO stage 3, so its "
                                "ZeRO-1/stage 0 would run uncompressed")
MODIFIERS: Dict[str, Modifier] = {m.name: m for m in (
    Modifier("bf16comm", "bf16 comm", {"communication_data_type": "bf16"}, gradient_bytes=2,
             help="reduce(-scatter) the gradients in bf16 (communication_data_type)"),
    Modifier("fp32comm", "fp32 comm", {"communication_data_type": "fp32"}, gradient_bytes=4,
             help="reduce(-scatter) the gradients in fp32 (DeepSpeed's default under bf16 is bf16)"),
    # ZeRO++'s key names: block-quantised gradients and parameter deltas (docs/kernels.md). Bytes per
    # value: the codes plus one fp32 scale per block of 128 (runtime.compression.QuantizationFormat,
    # not imported here to keep the bench's command line free of torch).
    Modifier("q8", "int8 comm", {"zero_optimization": {"zero_quantized_gradients": True,
                                                       "zero_quantized_weights": True}},
             gradient_bytes=1 + 4 / 128, parameter_bytes=1 + 4 / 128,
             help="int8 gradient reduce-scatter and parameter-delta all-gather (zero_quantized_gradients/_weights)",
             not_for_deepspeed=_ZERO_PLUS_PLUS_ONLY_STAGE_3),
    # CO2's eager mode (docs/design.md 3.5): the anchor is merged one inner step into the next
    # round, so the averaging must fit under one inner step rather than a whole round.
    Modifier("eager", "eager (H=1)", {"optimizer": {"params": {"anchor_merge_steps": 1}}},
             help="CO2 only: anchor_merge_steps 1 (replicas keep their progress; the average is merged one "
                  "inner step into the next round)", only_for="co2"),
    # The CO2 paper's rule: every replica restarts from the anchor, which arrives one round late.
    Modifier("paper", "paper's restart rule", {"optimizer": {"params": {"anchor_merge_steps": 0}}},
             help="CO2 only: anchor_merge_steps 0, the CO2 paper's rule (replicas restart from the anchor, one "
                  "round late)", only_for="co2"),
    Modifier("q4", "int4 comm", {"zero_optimization": {"zero_quantized_gradients": True,
                                                       "zero_quantized_weights": True},
                                 "optimizer": {"params": {"quantization_bits": 4}}},
             gradient_bytes=0.5 + 4 / 128, parameter_bytes=0.5 + 4 / 128,
             help="int4 gradient reduce-scatter and parameter-delta all-gather (quantization_bits 4)",
             not_for_deepspeed=_ZERO_PLUS_PLUS_ONLY_STAGE_3),
)}


@dataclass(frozen=True)
class Variant:
    """A method with zero or more modifiers: what one bench run trains with."""
    method: Method
    modifiers: Tuple[Modifier, ...] = ()

    @property
    def name(self) -> str:
        return "+".join([self.method.name] + [m.name for m in self.modifiers])

    @property
    def label(self) -> str:
        return " + ".join([self.method.label] + [m.label for m in self.modifiers])

    def comm_bytes(self, precision: str) -> Tuple[float, float]:
        """Bytes per value of (gradient reduce-scatter, parameter all-gather) in one round.

        Both DeepSpeed and deepspeed_acco reduce gradients in the model's dtype unless
        ``communication_data_type`` says otherwise (docs/precision.md, "Precision"); CO2's round averages
        parameters, in fp32 unless that key is given, and gathers the new anchor in fp32
        (``OuterState.gather``) unless weights are compressed. Other methods gather parameters in the
        model's dtype."""
        model = 2.0 if precision == "bf16" else 4.0
        grad, param = (4.0, 4.0) if self.method.name == "co2" else (model, model)
        for m in self.modifiers:
            grad = m.gradient_bytes if m.gradient_bytes is not None else grad
            param = m.parameter_bytes if m.parameter_bytes is not None else param
        return grad, param

    def comm_passes(self, world_size: int, backend: str = "gloo") -> Tuple[float, float]:
        """Passes over the model one round makes per rank, (gradients, parameters): the bytes each rank
        sends in units of (W - 1) / W of the model (:func:`gradient_passes`); DeepSpeed's ZeRO-1 at its
        default config all-reduces (2, 1), our engine reduce-scatters (1, 1), stage 0 (2, 0)."""
        spec = self.method
        return (gradient_passes(spec.gradient_collective, world_size, backend),
                1.0 if spec.gathers_parameters else 0.0)


GRADIENT_COLLECTIVES = ("reduce_scatter", "all_reduce", "reduce")


def gradient_passes(collective: str, world_size: int, backend: str = "gloo") -> float:
    """Bytes each rank sends to reduce the gradients, in passes: one pass is (W - 1) / W of the
    gradients, what a ring reduce-scatter sends.

    * ``reduce_scatter``: 1;
    * ``all_reduce``: 2 (a ring all-reduce is a reduce-scatter then an all-gather);
    * ``reduce``: DeepSpeed's stage 1 with ``use_multi_rank_bucket_allreduce`` false calls ``dist.reduce``
      for each partition's share of a bucket, rooted at the partition's owner. gloo's reduce runs a
      ring reduce-scatter over the whole tensor and then sends each non-root rank's reduced chunk to
      the root, so over the W partitions a rank sends (W - 1) / W + (W - 1) / W^2 of the gradients:
      (W + 1) / W passes (1.5 at two ranks, 4/3 at three), while each reduce is at most 2 W MiB (a
      larger one sends more: ``ZERO1_BEST_OPTIONS`` bounds it with the bucket size). NCCL's reduce
      pipelines the tensor along a chain to the root, each non-root rank sending it once: 1 pass."""
    if collective not in GRADIENT_COLLECTIVES:
        raise ValueError(f"unknown gradient collective {collective!r}; expected one of {GRADIENT_COLLECTIVES}")
    if collective == "reduce_scatter" or world_size <= 1:
        return 1.0
    if collective == "all_reduce":
        return 2.0
    return 1.0 if backend == "nccl" else (world_size + 1) / world_size


def comm_description(method: str) -> str:
    """What ``method`` (a variant) communicates per round, for reports: for DeepSpeed's own methods, the
    ``zero_optimization`` section it runs with, e.g. ``DeepSpeed ZeRO-1 (zero_optimization {"stage": 1}:
    gradients all-reduced, then parameters all-gathered)``."""
    variant = parse_variant(method)
    spec = variant.method
    how = {"reduce_scatter": "gradients reduce-scattered", "all_reduce": "gradients all-reduced",
           "reduce": "each partition's gradients reduced to its owner"}[spec.gradient_collective]
    if spec.gathers_parameters:
        how += ", then parameters all-gathered"
    if spec.ours or spec.zero_stage is None:
        return f"{variant.label} ({how})"
    zero = json.dumps({"stage": spec.zero_stage, **dict(spec.zero_options)})
    return f"{variant.label} (zero_optimization {zero}: {how})"


def co2_overlap_steps(method: str, local_steps: Optional[int] = None, gap_penalty=None) -> int:
    """Inner steps CO2's outer averaging must fit in (the bound): ``anchor_merge_steps`` H in eager
    mode, ``local_steps`` under the restart rule (H 0 or null), as the engine resolves them from
    ``method``'s modifiers, ``local_steps`` (--local-steps) and ``gap_penalty`` (--gap-penalty:
    "adaptive" without an explicit H selects the restart rule), with its defaults for the rest."""
    from deepspeed_acco.runtime.optimizers.co2 import CO2Params
    from deepspeed_acco.runtime.optimizers.params import parse_params
    given = {"local_steps": local_steps, "gap_penalty": gap_penalty}
    given = {key: value for key, value in given.items() if value is not None}
    for m in parse_variant(method).modifiers:
        given.update(m.config.get("optimizer", {}).get("params", {}))
    params = parse_params(CO2Params, given, "CO2")
    merge = params.anchor_merge_steps
    return params.local_steps if not merge else min(int(merge), params.local_steps)


def _merge(base: dict, extra: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


@lru_cache(maxsize=None)
def parse_variant(text: str) -> Variant:
    """``"acco+bf16comm"`` -> Variant; ValueError (naming ``--methods`` and the choices) otherwise."""
    aliases = {"zero-1": "zero1", "zero": "zero1", "zero1-best": "zero1best", "ddp": "zero0", "stage0": "zero0", "shardedadamw": "sharded"}
    parts = [x.strip().lower() for x in str(text).split("+")]
    base = aliases.get(parts[0], parts[0])
    if base not in METHODS:
        raise ValueError(f"--methods: unknown method {parts[0]!r} in {text!r}; choose from "
                         f"{', '.join(m for m in METHODS if m != 'compute')}")
    modifiers = []
    for name in parts[1:]:
        if name not in MODIFIERS:
            raise ValueError(f"--methods: unknown modifier {name!r} in {text!r}; modifiers are "
                             f"{', '.join(MODIFIERS)} (e.g. acco+bf16comm)")
        if MODIFIERS[name] in modifiers:
            raise ValueError(f"--methods: modifier {name!r} given twice in {text!r}")
        if MODIFIERS[name].only_for and base != MODIFIERS[name].only_for:
            raise ValueError(f"--methods: {text!r}: modifier {name!r} applies to {MODIFIERS[name].only_for} only")
        if MODIFIERS[name].not_for_deepspeed and base != "compute" and not METHODS[base].ours:
            raise ValueError(f"--methods: {text!r}: {MODIFIERS[name].not_for_deepspeed}; use it with "
                             f"deepspeed_acco's methods (sharded, dpu, acco, co2)")
        modifiers.append(MODIFIERS[name])
    if base == "compute" and modifiers:
        raise ValueError("--methods: the compute-only baseline has no communication to modify")
    return Variant(METHODS[base], tuple(modifiers))


# AdamW's beta2 for every method and the lone replica; beta1 is --beta1 (0.9 by default).
BETA2 = 0.95


def ds_config(method: str, *, world_size: int, micro_batch: int, grad_accum: int, lr: float, total_updates: int,
              warmup: int, betas=(0.9, BETA2), eps: float = 1e-8, weight_decay: float = 0.1, clip: float = 1.0,
              local_steps: Optional[int] = None, dynamic_accumulation: bool = False, bf16: bool = False,
              torch_adam: bool = True, co2_options: Optional[dict] = None,
              warmup_sync_updates: Union[int, str, None] = None,
              lr_schedule: str = "decay", sync_after_updates: Optional[int] = None) -> dict:
    """The DeepSpeed JSON config (as a dict) for ``method`` (a method name, with modifiers if any:
    ``acco+bf16comm``); ``co2_options``: further CO2 params (``outer_lr``, ``outer_momentum``,
    ``gap_penalty``, ``group_size``), the engine's defaults where absent. ``local_steps`` and
    ``warmup_sync_updates`` (an int or "auto") are written only when given: None keeps the engine's
    defaults."""
    variant = parse_variant(method)
    spec = variant.method
    if spec.optimizer is None:
        raise ValueError(f"{method!r} runs without DeepSpeed (the compute-only baseline) and has no config")
    params = dict(lr=lr, betas=list(betas), eps=eps, weight_decay=weight_decay)
    if spec.ours:
        params["overlap"] = True
    elif torch_adam:
        params["torch_adam"] = True  # torch.optim.AdamW: no op build needed on CPU
    if spec.name == "acco":
        params["dynamic_accumulation"] = bool(dynamic_accumulation)
    if warmup_sync_updates is not None and spec.name in ("dpu", "acco", "co2"):
        params["warmup_sync_updates"] = warmup_sync_updates if warmup_sync_updates == "auto" else int(warmup_sync_updates)
    if sync_after_updates is not None and spec.name in ("dpu", "acco"):
        params["sync_after_updates"] = int(sync_after_updates)
    if spec.name == "co2":
        if local_steps is not None:
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
        "scheduler": _scheduler(lr_schedule, lr, warmup, total_updates),
    }
    if spec.zero_stage is not None:
        cfg["zero_optimization"] = {"stage": spec.zero_stage, **dict(spec.zero_options)}
    if bf16:
        cfg["bf16"] = {"enabled": True}
    for modifier in variant.modifiers:
        cfg = _merge(cfg, modifier.config)
    return cfg


LR_SCHEDULES = ("decay", "constant")


def _scheduler(lr_schedule: str, lr: float, warmup: int, total_updates: int) -> dict:
    """DeepSpeed's scheduler section: ``decay`` is ``WarmupDecayLR`` (linear warm-up from lr/10 to
    lr, then linear decay to lr/10 at ``total_updates``), ``constant`` is ``WarmupLR`` (the same
    warm-up, then lr to the end: a schedule with no decay, for telling effects of the decay from
    effects of the run's length)."""
    if lr_schedule not in LR_SCHEDULES:
        raise ValueError(f"--lr-schedule: expected one of {', '.join(LR_SCHEDULES)}, got {lr_schedule!r}")
    params = {"warmup_min_lr": lr * MIN_LR_FRACTION, "warmup_max_lr": lr, "warmup_num_steps": max(2, int(warmup)),
              "warmup_type": "linear"}
    if lr_schedule == "constant":
        return {"type": "WarmupLR", "params": params}
    params["total_num_steps"] = max(int(total_updates), int(warmup) + 1)
    return {"type": "WarmupDecayLR", "params": params}


def warmup_decay_lr(step: int, lr: float, warmup: int, total_updates: int, lr_schedule: str = "decay") -> float:
    """The learning rate DeepSpeed's ``WarmupDecayLR`` (linear warm-up, the config above; ``WarmupLR``
    with ``lr_schedule="constant"``) sets after ``step`` scheduler steps, i.e. the lr of update
    ``step + 1``; for the compute-only baseline, which runs without DeepSpeed."""
    min_lr = lr * MIN_LR_FRACTION
    if step <= 0:
        return min_lr
    it = step - 1  # DeepSpeed's last_batch_iteration
    warmup = max(2, int(warmup))
    total = max(int(total_updates), int(warmup) + 1)
    if it < warmup:
        gamma = it / warmup
    elif lr_schedule == "constant":
        gamma = 1.0
    else:
        gamma = max(0.0, (total - it) / max(1.0, total - warmup))
    return min_lr + (lr - min_lr) * gamma


def resolve_methods(text: str) -> List[str]:
    """``--methods`` -> the canonical variant names, in order, without repeats (SystemExit on a bad one)."""
    names = []
    for item in (m.strip() for m in text.split(",") if m.strip()):
        try:
            variant = parse_variant(item)
        except ValueError as exc:
            raise SystemExit(str(exc)) from None
        if variant.method.name == "compute":
            raise SystemExit("--methods: the compute-only baseline always runs (turn it off with --no-compute-only)")
        names.append(variant.name)
    return list(dict.fromkeys(names))
