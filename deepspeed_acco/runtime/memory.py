"""Memory accounting: the buffers an engine holds, by category, in bytes and bytes per parameter.

Three views of the same numbers (docs/precision.md, "Memory: bytes per parameter per rank"):

- :func:`engine_breakdown` (``engine.memory_breakdown()``): the tensors this rank's engine holds,
  each storage counted once (buffers that share a storage are caught and listed under
  ``shared``), by category; every further tensor reachable from the schedule (a buffer a type
  adds without naming it here) is counted under ``other``, so the total is what is allocated.
- :func:`predicted_breakdown`: the same categories from a formula in the padded flat lengths,
  the world size, the dtypes and the options.
- :func:`deepspeed_breakdown`: DeepSpeed's ZeRO-1 optimizer walked the same way (its flat bit16
  groups, fp32 partitions, optimizer state, gradient partitions and buckets, and the gradients the
  model's parameters hold), so that a table compares like with like.

The dict all three return is ``{"num_parameters", "world_size", "categories": {name: bytes},
"total_bytes", "bytes_per_parameter": {name: float, "total": float}}`` (plus ``shared`` for the
measured ones); :func:`format_breakdowns` prints several side by side.
"""
import collections
import dataclasses
import enum
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import torch

CATEGORIES = (
    "model",
    "master",
    "moments",
    "gradient_accumulator",
    "communication",
    "gathered",
    "acco_first_half",
    "co2_outer",
    "co2_replica",
    "compression",
    "other",
)
DESCRIPTIONS = {
    "model": "the trainable parameters the model computes with (model dtype, full length)",
    "master": "fp32 master weights of this rank's shard",
    "moments": "AdamW's exp_avg and exp_avg_sq of this rank's shard (fp32)",
    "gradient_accumulator": "the round's gradient sums (ours: fp32, full length; DeepSpeed: the params' .grad)",
    "communication": "the gradient snapshot a job reduces (comm dtype, full length), its reduced shard and "
                     "fp32 shard gradient, gloo's ring buffers; DeepSpeed: its gradient partitions and buckets",
    "gathered": "all-gather output of an overlapped job (DPU: the committed parameters, ACCO: the estimate "
                "or the committed parameters), installed at the next boundary (model dtype, full length); "
                "none of its own when the communication dtype is the model's: the job writes it into the "
                "gradient snapshot it has finished reducing",
    "acco_first_half": "ACCO: the reduced first-half gradient sum kept for the commit (fp32 shard)",
    "co2_outer": "CO2: anchors x_k, x_{k+1} and the outer momentum (fp32, sharded over all ranks)",
    "co2_replica": "CO2: the round's starting point and the gathered next anchor (fp32, full length), "
                   "and in eager mode the inner masters at the boundary (fp32 shard)",
    "compression": "quantised collectives: error-feedback residuals, packed send/receive buffers, the "
                   "fp32 new shard of a compressed all-gather",
    "other": "every further tensor reachable from the schedule (statistics, control tensors)",
}

DTYPE_BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}
Entry = Tuple[str, str, Optional[torch.Tensor]]
"""(category, name, tensor) of one buffer."""


def _dtype(value) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    names = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
             "fp16": torch.float16, "float16": torch.float16}
    if value not in names:
        raise ValueError(f"unknown dtype {value!r}; use one of {sorted(names)} or a torch dtype")
    return names[value]


def _storage_key(tensor: torch.Tensor):
    """(device, storage address), bytes; meta tensors (DeepSpeed's layout records) hold no memory."""
    if tensor.device.type == "meta":
        return ("meta", id(tensor)), 0
    storage = tensor.untyped_storage()
    return (str(tensor.device), storage.data_ptr()), storage.nbytes()


# ---- measured: the engine's own buffers ------------------------------------------------------------
def _compression_entries(compressions, name: str) -> Iterator[Entry]:
    for index, compression in enumerate(compressions or ()):
        gradients, weights = compression.gradients, compression.weights
        if gradients is not None:
            yield "compression", f"{name}[{index}].residual", gradients.residual
            yield "compression", f"{name}[{index}].gradient_send", gradients._send
            yield "compression", f"{name}[{index}].gradient_receive", gradients._receive
        if weights is not None:
            yield "compression", f"{name}[{index}].weight_send", weights._send
            yield "compression", f"{name}[{index}].weight_gathered", weights._gathered
        yield "compression", f"{name}[{index}].new_shard", compression.new_shard


def schedule_buffers(schedule) -> List[Entry]:
    """Every buffer the schedule's types are known to hold, with its category and a name."""
    entries: List[Entry] = []
    for index, flat in enumerate(schedule.flats):
        entries += [("model", f"flats[{index}].model_flat", flat.model_flat),
                    ("gradient_accumulator", f"flats[{index}].grad_accum", flat.grad_accum),
                    ("communication", f"flats[{index}].job_grad", flat.job_grad)]
        if not flat.gather_shares_job_grad:  # else the snapshot above is also the all-gather output
            entries.append(("gathered", f"flats[{index}].gather", flat.gather))
    for index, shard in enumerate(schedule.shards):
        entries.append(("master", f"shards[{index}].master", shard.master))
        entries += [("moments", f"shards[{index}].{key}", value) for key, value in shard.state.items()]
        entries += [("communication", f"shards[{index}].reduced", shard.reduced),
                    ("communication", f"shards[{index}].grad", shard.grad)]
    for index, values in enumerate(getattr(schedule, "first_half_sum", None) or ()):
        entries.append(("acco_first_half", f"first_half_sum[{index}]", values))
    for index, outer in enumerate(getattr(schedule, "outers", None) or ()):
        entries += [("co2_outer", f"outers[{index}].{key}", getattr(outer, key))
                    for key in ("prev_anchor", "anchor", "momentum")]
        entries += [("co2_replica", f"outers[{index}].round_start", outer.round_start),
                    ("co2_replica", f"outers[{index}].gather", outer.gather),
                    ("communication", f"outers[{index}].displacement", outer.displacement),
                    ("communication", f"outers[{index}].mean_displacement", outer.mean_displacement)]
    for index, values in enumerate(getattr(schedule, "boundary_masters", None) or ()):
        entries.append(("co2_replica", f"boundary_masters[{index}]", values))
    entries += _compression_entries(schedule.compression, "compression")
    entries += _compression_entries(getattr(schedule, "outer_compression", None), "outer_compression")
    communicators = {id(c): c for c in (schedule.communicator, getattr(schedule, "outer_communicator", None))
                     if c is not None}
    for communicator in communicators.values():
        for key, buffers in getattr(communicator, "_ring_buffers", {}).items():
            for position, values in enumerate(buffers):
                entries.append(("communication", f"{communicator.name}.ring_buffer{list(key[:2])}[{position}]", values))
    return entries


def reachable_tensors(root, *, package: str = "deepspeed_acco") -> Dict[Any, Tuple[int, str]]:
    """Every tensor storage reachable from ``root`` through objects of ``package``'s classes,
    dataclasses and containers: {storage key: (bytes, the path it was first reached by)}.

    Objects of other libraries (the model, LR schedulers, process groups, threads) are not entered.
    """
    found: Dict[Any, Tuple[int, str]] = {}
    seen = set()
    stack: List[Tuple[Any, str]] = [(root, "schedule")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, torch.Tensor):
            key, nbytes = _storage_key(value)
            if nbytes and key not in found:
                found[key] = (nbytes, path)
            continue
        if id(value) in seen or isinstance(value, (str, bytes, int, float, bool, type, enum.Enum)) or value is None:
            continue
        seen.add(id(value))
        if isinstance(value, Mapping):
            stack += [(item, f"{path}[{key!r}]") for key, item in value.items()]
        elif isinstance(value, (list, tuple, set, frozenset, collections.deque)):
            stack += [(item, f"{path}[{index}]") for index, item in enumerate(value)]
        elif type(value).__module__.startswith(package) or dataclasses.is_dataclass(value):
            attributes = getattr(value, "__dict__", None)
            if attributes is None and hasattr(type(value), "__slots__"):
                attributes = {name: getattr(value, name, None) for name in type(value).__slots__}
            stack += [(item, f"{path}.{name}") for name, item in (attributes or {}).items()]
    return found


def account(entries: Iterable[Entry], *, num_parameters: int, world_size: int,
            reachable: Optional[Dict[Any, Tuple[int, str]]] = None) -> Dict[str, Any]:
    """Sum the entries by category, each storage once; storages in ``reachable`` that no entry
    names go to ``other``. ``shared`` lists [name, name it shares a storage with]."""
    categories = {name: 0 for name in CATEGORIES}
    owners: Dict[Any, str] = {}
    shared: List[List[str]] = []
    for category, name, tensor in entries:
        if tensor is None:
            continue
        if category not in categories:
            raise ValueError(f"unknown memory category {category!r}; use one of {list(CATEGORIES)}")
        key, nbytes = _storage_key(tensor)
        if key in owners:
            shared.append([name, owners[key]])
            continue
        owners[key] = name
        categories[category] += nbytes
    for key, (nbytes, _) in (reachable or {}).items():
        if key not in owners:
            categories["other"] += nbytes
    result = _result(categories, num_parameters, world_size)
    result["shared"] = shared
    return result


def _result(categories: Dict[str, int], num_parameters: int, world_size: int) -> Dict[str, Any]:
    categories = {name: int(categories.get(name, 0)) for name in CATEGORIES}
    total = sum(categories.values())
    per_parameter = {name: value / num_parameters for name, value in categories.items()}
    per_parameter["total"] = total / num_parameters
    return {"num_parameters": int(num_parameters), "world_size": int(world_size), "categories": categories,
            "total_bytes": total, "bytes_per_parameter": per_parameter}


def engine_breakdown(engine) -> Dict[str, Any]:
    """``engine.memory_breakdown()``: what this rank's engine holds now (see the module docstring).

    Adds ``optimizer_type``, ``model_dtype``, ``communication_dtype`` and ``padded_numels`` (the flat
    groups' padded lengths, the formula's P).
    """
    schedule = engine.schedule
    flats = schedule.flats
    result = account(schedule_buffers(schedule), num_parameters=sum(flat.numel for flat in flats),
                     world_size=schedule.world_size, reachable=reachable_tensors(schedule))
    result.update(optimizer_type=type(schedule).type_name, model_dtype=str(flats[0].model_dtype).replace("torch.", ""),
                  communication_dtype=str(flats[0].job_grad.dtype).replace("torch.", ""),
                  accumulation_dtype=str(flats[0].grad_accum.dtype).replace("torch.", ""),
                  padded_numels=[flat.padded_numel for flat in flats])
    return result


def unaccounted(engine, min_bytes: int = 0) -> List[Tuple[str, int]]:
    """Reachable storages of at least ``min_bytes`` that :func:`schedule_buffers` does not name
    (path, bytes): a buffer a type holds that the categories miss."""
    named = {_storage_key(tensor)[0] for _, _, tensor in schedule_buffers(engine.schedule) if tensor is not None}
    return [(path, nbytes) for key, (nbytes, path) in reachable_tensors(engine.schedule).items()
            if key not in named and nbytes >= min_bytes]


# ---- the formula -----------------------------------------------------------------------------------
def _packed_bytes(numel: int, bits: int, block_size: int) -> int:
    from ..ops import packed_bytes
    return packed_bytes(numel, bits=bits, block_size=block_size)


def _compression_bytes(padded: int, members: int, compression: Mapping[str, Any]) -> int:
    """Buffers of one group's compressed collectives on a communicator of ``members`` ranks."""
    if members == 1 or not (compression.get("gradients") or compression.get("weights")):
        return 0
    chunk = padded // members
    bits, block_size = int(compression.get("bits", 8)), int(compression.get("block_size", 128))
    packed = _packed_bytes(chunk, bits, block_size)
    total = 0
    if compression.get("gradients"):
        total += 4 * (members - 1) * chunk + 2 * (members - 1) * packed  # residual, send, receive
    if compression.get("weights"):
        total += packed + members * packed + 4 * chunk  # send, gathered, new fp32 shard
    return total


def _ring_bytes(shard_numels: Iterable[int], members: int, dtype_bytes: int, backend: str) -> int:
    """gloo's ring reduce-scatter keeps two chunk buffers per distinct (chunk length, dtype)."""
    if backend != "gloo" or members == 1:
        return 0
    return sum(2 * numel * dtype_bytes for numel in set(shard_numels))


CO2_DEFAULT_ANCHOR_MERGE_STEPS = 1
"""CO2's default ``anchor_merge_steps`` (the eager merge, docs/design.md 3.5), which the formula
assumes when ``options`` does not give it (tests/test_memory.py checks it against the engine's)."""


def predicted_breakdown(optimizer_type: str, padded_numels: Union[int, Sequence[int]], world_size: int,
                        model_dtype="fp32", communication_dtype=None,
                        options: Optional[Mapping[str, Any]] = None) -> Dict[str, Any]:
    """The formula of docs/precision.md ("Memory: bytes per parameter per rank") for one rank.

    ``padded_numels``: each flat group's padded length (one int: one group); ``world_size`` W;
    ``options["accumulation_dtype"]``: the gradient accumulator's (``data_types.grad_accum_dtype``;
    default fp32);
    dtypes as torch dtypes or "fp32"/"bf16"/"fp16" (the communication dtype defaults to the
    engine's rule: the model's, fp32 with compressed gradients). ``options``: ``num_parameters`` (the real count, for bytes per parameter; default the
    padded total), ``group_size``, ``anchor_merge_steps`` (default the engine's, 1) and ``outer_communication_dtype`` (CO2; the
    last fp32 unless the config gives ``communication_data_type``), ``compression``
    (``{"gradients", "weights", "bits", "block_size"}``), ``backend`` ("gloo" adds the ring
    reduce-scatter's buffers; default "nccl").
    """
    options = dict(options or {})
    kind = optimizer_type.lower()
    if kind not in ("shardedadamw", "dpu", "acco", "co2"):
        raise ValueError(f"optimizer type {optimizer_type!r} has no memory formula; use ShardedAdamW, DPU, ACCO or CO2")
    numels = [int(padded_numels)] if isinstance(padded_numels, int) else [int(n) for n in padded_numels]
    model_bytes = DTYPE_BYTES[_dtype(model_dtype)]
    if communication_dtype is None:  # the engine's rule: the model's dtype, fp32 under compressed gradients
        communication_dtype = "fp32" if (options.get("compression") or {}).get("gradients") else model_dtype
    comm_bytes = DTYPE_BYTES[_dtype(communication_dtype)]
    # The all-gather output shares the gradient snapshot's storage when the dtypes match (flat.py).
    gather_in_snapshot = _dtype(communication_dtype) == _dtype(model_dtype)
    # CO2's outer averaging moves parameters, not gradients: fp32 unless communication_data_type is given.
    outer_bytes = DTYPE_BYTES[_dtype(options.get("outer_communication_dtype", "fp32"))]
    compression = dict(options.get("compression") or {})
    backend = options.get("backend", "nccl")
    accumulation_bytes = DTYPE_BYTES[_dtype(options.get("accumulation_dtype", "fp32"))]
    group = int(options.get("group_size", 1)) if kind == "co2" else world_size
    if world_size % group:
        raise ValueError(f"group_size {group} does not divide the world size {world_size}")
    c = {name: 0 for name in CATEGORIES}
    for padded in numels:
        if padded % world_size:
            raise ValueError(f"padded length {padded} is not a multiple of the world size {world_size}")
        inner = padded // group  # this rank's shard of the update (all ranks; CO2: its group)
        c["model"] += model_bytes * padded
        c["master"] += 4 * inner
        c["moments"] += 8 * inner
        c["gradient_accumulator"] += accumulation_bytes * padded
        c["communication"] += comm_bytes * padded + comm_bytes * inner + 4 * inner  # job_grad, reduced, grad
        if kind in ("dpu", "acco") and not gather_in_snapshot:
            c["gathered"] += model_bytes * padded
        if kind == "acco":
            c["acco_first_half"] += 4 * inner
        if kind == "co2":
            outer = padded // world_size
            c["co2_outer"] += 12 * outer
            c["co2_replica"] += 8 * padded
            # 0 or None: the paper's rule keeps no boundary masters; not given: the engine's default.
            if options.get("anchor_merge_steps", CO2_DEFAULT_ANCHOR_MERGE_STEPS):
                c["co2_replica"] += 4 * inner  # the inner masters kept from the boundary to the merge
            c["communication"] += outer_bytes * padded + outer_bytes * outer  # displacement and its mean
            c["compression"] += _compression_bytes(padded, world_size, compression)
        c["compression"] += _compression_bytes(padded, group, compression)
    if not compression.get("gradients"):
        c["communication"] += _ring_bytes([n // group for n in numels], group, comm_bytes, backend)
        if kind == "co2":
            c["communication"] += _ring_bytes([n // world_size for n in numels], world_size, outer_bytes, backend)
    result = _result(c, int(options.get("num_parameters", sum(numels))), world_size)
    result.update(optimizer_type=optimizer_type, model_dtype=str(_dtype(model_dtype)).replace("torch.", ""),
                  communication_dtype=str(_dtype(communication_dtype if communication_dtype is not None
                                                 else model_dtype)).replace("torch.", ""),
                  padded_numels=numels)
    return result


def deepspeed_zero1_formula(padded_numels: Union[int, Sequence[int]], world_size: int, model_dtype="fp32", *,
                            num_parameters: Optional[int] = None) -> Dict[str, Any]:
    """DeepSpeed ZeRO-1's held buffers per rank in the same categories, as
    :func:`deepspeed_breakdown` measures them between two backward passes of an update: the bit16
    flat (P, model dtype), the params' gradients (P, model dtype: DeepSpeedZeroOptimizer
    accumulates in the model's dtype), the fp32 partition (S) and AdamW's moments (2S). At the
    update's last backward the gradients are released and their reduced partition (S) is kept
    until the step; its buckets exist only during the reduction."""
    numels = [int(padded_numels)] if isinstance(padded_numels, int) else [int(n) for n in padded_numels]
    model_bytes = DTYPE_BYTES[_dtype(model_dtype)]
    c = {name: 0 for name in CATEGORIES}
    for padded in numels:
        shard = padded // world_size
        c["model"] += model_bytes * padded
        c["master"] += 4 * shard
        c["moments"] += 8 * shard
        c["gradient_accumulator"] += model_bytes * padded
    result = _result(c, int(num_parameters or sum(numels)), world_size)
    result.update(optimizer_type="DeepSpeed ZeRO-1", model_dtype=str(_dtype(model_dtype)).replace("torch.", ""),
                  padded_numels=numels)
    return result


# ---- DeepSpeed ZeRO-1 measured the same way --------------------------------------------------------
def _deepspeed_entries(optimizer, module: Optional[torch.nn.Module]) -> List[Entry]:
    entries: List[Entry] = []
    for index, flat in enumerate(getattr(optimizer, "bit16_groups_flat", None) or ()):
        entries.append(("model", f"bit16_groups_flat[{index}]", flat))
    for index, flat in enumerate(getattr(optimizer, "bf16_groups_flat", None) or ()):  # BF16_Optimizer
        entries.append(("model", f"bf16_groups_flat[{index}]", flat))
    masters = list(getattr(optimizer, "single_partition_of_fp32_groups", None) or ()) \
        or list(getattr(optimizer, "fp32_groups_flat_partition", None) or ())
    for index, master in enumerate(masters):
        entries.append(("master", f"fp32_partition[{index}]", master))
        entries.append(("communication", f"fp32_partition[{index}].grad", master.grad))
    inner = getattr(optimizer, "optimizer", None)
    if inner is not None:
        for index, state in enumerate(inner.state.values()):
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    entries.append(("moments", f"optimizer.state[{index}].{key}", value))
    for index, flat in enumerate(getattr(optimizer, "fp32_groups_gradients_flat", None) or ()):  # BF16_Optimizer
        entries.append(("gradient_accumulator", f"fp32_groups_gradients_flat[{index}]", flat))
    if module is not None:
        for name, p in module.named_parameters():
            entries.append(("gradient_accumulator", f"{name}.grad", p.grad))
    for index, grads in sorted((getattr(optimizer, "averaged_gradients", None) or {}).items()):
        for position, grad in enumerate(grads or ()):
            entries.append(("communication", f"averaged_gradients[{index}][{position}]", grad))
    for index, grads in sorted((getattr(optimizer, "all_grad_tensors", None) or {}).items()):
        for position, grad in enumerate(grads or ()):
            entries.append(("gradient_accumulator", f"all_grad_tensors[{index}][{position}]", grad))
    for index, buffer in enumerate(getattr(optimizer, "ipg_buffer", None) or ()):
        entries.append(("communication", f"ipg_buffer[{index}]", buffer))
    entries.append(("communication", "grads_in_partition", getattr(optimizer, "grads_in_partition", None)))
    return entries


def _deepspeed_reachable(optimizer) -> Dict[Any, Tuple[int, str]]:
    """Tensors held directly by the ZeRO optimizer's attributes (lists and dicts entered; the torch
    optimizer inside through its state)."""
    found: Dict[Any, Tuple[int, str]] = {}

    def visit(value, path, depth):
        if isinstance(value, torch.Tensor):
            key, nbytes = _storage_key(value)
            if nbytes and key not in found:
                found[key] = (nbytes, path)
            grad = value.grad if isinstance(value, torch.nn.Parameter) or value.is_leaf else None
            if grad is not None:
                visit(grad, path + ".grad", depth)
        elif depth < 4 and isinstance(value, Mapping):
            for key, item in value.items():
                visit(item, f"{path}[{key!r}]", depth + 1)
        elif depth < 4 and isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                visit(item, f"{path}[{index}]", depth + 1)

    for name, value in vars(optimizer).items():
        visit(value, name, 0)
    inner = getattr(optimizer, "optimizer", None)
    if inner is not None:
        visit(dict(inner.state), "optimizer.state", 0)
    return found


def deepspeed_breakdown(engine) -> Dict[str, Any]:
    """DeepSpeed's engine (ZeRO stage 1, or the BF16_Optimizer that stage 1 uses with fp32 gradient
    accumulation) walked into the categories of :func:`engine_breakdown`.

    What DeepSpeed holds depends on when: the params' gradients exist between a backward and the
    step that ends the accumulation, so call this after a backward that does not end an update to
    see its steady-state peak. Further tensors held by the ZeRO optimizer's attributes (flattened
    views of the same storages aside) are counted under ``other``.
    """
    optimizer = engine.optimizer
    module = getattr(engine, "module", None)
    groups = getattr(optimizer, "bit16_groups_flat", None) or getattr(optimizer, "bf16_groups_flat", None)
    if groups is None:
        raise ValueError("deepspeed_breakdown: the engine's optimizer is not a ZeRO-1 optimizer (no bit16 groups); "
                         "configure zero_optimization.stage 1")
    num_parameters = sum(p.numel() for p in module.parameters() if p.requires_grad) if module is not None \
        else sum(flat.numel() for flat in groups)
    result = account(_deepspeed_entries(optimizer, module), num_parameters=num_parameters,
                     world_size=engine.dp_world_size, reachable=_deepspeed_reachable(optimizer))
    result.update(optimizer_type="DeepSpeed ZeRO-1", optimizer_class=type(optimizer).__name__,
                  model_dtype=str(groups[0].dtype).replace("torch.", ""),
                  padded_numels=[int(flat.numel()) for flat in groups])
    return result


# ---- printing ------------------------------------------------------------------------------------
def format_breakdowns(breakdowns: Mapping[str, Mapping[str, Any]], *, per_parameter: bool = True) -> str:
    """A text table: one column per breakdown, one row per category that any of them holds."""
    names = list(breakdowns)
    rows = [name for name in CATEGORIES if any(b["categories"].get(name) for b in breakdowns.values())]
    width = max([len(name) for name in names] + [10])

    def cell(breakdown, name):
        if per_parameter:
            return f"{breakdown['bytes_per_parameter'][name]:.2f}"
        return f"{breakdown['categories'][name] / 2 ** 20:.1f}" if name != "total" else \
            f"{breakdown['total_bytes'] / 2 ** 20:.1f}"

    unit = "bytes/param" if per_parameter else "MiB"
    lines = [f"{unit:<22}" + "".join(f"{name:>{width + 2}}" for name in names)]
    for row in rows + ["total"]:
        lines.append(f"{row:<22}" + "".join(f"{cell(breakdowns[name], row):>{width + 2}}" for name in names))
    return "\n".join(lines)


__all__ = ["CATEGORIES", "DESCRIPTIONS", "account", "deepspeed_breakdown", "deepspeed_zero1_formula",
           "engine_breakdown", "format_breakdowns", "predicted_breakdown", "reachable_tensors", "schedule_buffers",
           "unaccounted"]
