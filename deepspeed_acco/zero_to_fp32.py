"""Consolidate a ZeRO-1 checkpoint (ours or DeepSpeed's) into plain fp32 weights.

    python -m deepspeed_acco.zero_to_fp32 CHECKPOINT_DIR OUTPUT_FILE [--tag TAG] [--trusted-class MODULE.NAME ...]

Trainable parameters come from the fp32 master shards of every rank: the committed weights
(for CO2 the averaged anchor), not whatever the model held at save time (an ACCO estimate, a
CO2 local replica). Frozen parameters and buffers come from the module states. The output is
a state dict that ``model.load_state_dict`` accepts.

Every file is read with ``torch.load(weights_only=True)`` and the allowlist of
:func:`deepspeed_acco.runtime.checkpoint_files.checkpoint_classes`: a file that holds anything else (for
example the objects of a ``client_state``) is refused unless those are named trusted
(``trusted_classes=`` or ``--trusted-class``); nothing in a refused file runs.
"""
import argparse
import collections
import importlib
import os
import sys
from typing import Any, Dict, Optional, Sequence

import torch

from .runtime.checkpoint import (LATEST_NAME, MODEL_STATES_NAME, OPTIMIZER_STATE_KEY, check_tag, load_file,
                                 optimizer_states_name, read_latest)

CALLER = "zero_to_fp32"
TRUST_HINT = "pass consolidate(..., trusted_classes=[...]) or --trusted-class MODULE.NAME for each of them"


def _resolve_tag(checkpoint_dir: str, tag: Optional[str]) -> str:
    if tag is not None:
        return check_tag(tag, CALLER)
    found = read_latest(checkpoint_dir, CALLER)
    if found is None:
        raise ValueError(f"{CALLER}: no {LATEST_NAME} file in {checkpoint_dir!r}; pass --tag")
    return found


def _load(path: str, trusted_classes: Sequence) -> Any:
    return load_file(path, trusted_classes, caller=CALLER, trust_hint=TRUST_HINT)


def consolidate(checkpoint_dir: str, tag: Optional[str] = None,
                trusted_classes: Sequence = ()) -> Dict[str, torch.Tensor]:
    """Return the full fp32 state dict of the checkpoint ``checkpoint_dir/tag``.

    ``trusted_classes``: classes (or functions) besides tensors, plain data and DeepSpeed's
    checkpoint classes that you trust the files to hold (what ``torch.serialization.safe_globals``
    accepts)."""
    directory = os.path.join(checkpoint_dir, _resolve_tag(checkpoint_dir, tag))
    model_states = _load(os.path.join(directory, MODEL_STATES_NAME), trusted_classes)
    world_size = int(model_states["dp_world_size"])
    partitions = []
    for rank in range(world_size):
        for bf16 in (False, True):
            path = os.path.join(directory, optimizer_states_name(rank, bf16))
            if os.path.isfile(path):
                state = _load(path, trusted_classes)[OPTIMIZER_STATE_KEY]
                partitions.append(state["single_partition_of_fp32_groups"])
                break
        else:
            raise ValueError(f"{CALLER}: optimizer states of rank {rank} are missing in {directory}; the checkpoint "
                             f"is incomplete: consolidate a complete one")
    weights = collections.OrderedDict()
    for group_index, shapes in enumerate(model_states["param_shapes"]):
        # Padding sits only at the end of each group, so the ranks' unpadded partitions
        # concatenate to the group's flat parameters.
        flat = torch.cat([rank_partitions[group_index].float().reshape(-1) for rank_partitions in partitions])
        expected = sum(shape.numel() for shape in shapes.values())
        if flat.numel() != expected:
            raise ValueError(f"{CALLER}: {directory}: parameter group {group_index} has {flat.numel()} values in the "
                             f"optimizer files and {expected} in param_shapes; the files come from different saves")
        offset = 0
        for name, shape in shapes.items():
            weights[name] = flat[offset:offset + shape.numel()].view(shape).clone()
            offset += shape.numel()
    for name, value in model_states["module"].items():
        if name not in weights and torch.is_tensor(value):
            weights[name] = value.float() if value.is_floating_point() else value.clone()
    for name, original in (model_states.get("shared_params") or {}).items():
        if original in weights:
            weights[name] = weights[original]
    return weights


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint_dir", help="the directory save_checkpoint wrote (holds 'latest')")
    parser.add_argument("output_file", help="where to write the fp32 state dict (torch.save)")
    parser.add_argument("--tag", default=None, help="checkpoint tag (default: the one in 'latest')")
    parser.add_argument("--trusted-class", action="append", default=[], metavar="MODULE.NAME",
                        help="a class or function the files may hold besides tensors, plain data and DeepSpeed's "
                             "checkpoint classes (e.g. one your client_state holds); imported from MODULE; repeatable")
    args = parser.parse_args(argv)
    try:
        trusted = [_import(name) for name in args.trusted_class]
        weights = consolidate(args.checkpoint_dir, args.tag, trusted)
    except ValueError as error:
        sys.exit(f"error: {error}")
    torch.save(weights, args.output_file)
    total = sum(value.numel() for value in weights.values())
    print(f"wrote {len(weights)} tensors ({total:,} values) to {args.output_file}")


def _import(dotted: str) -> Any:
    """``module.path.Name`` (or ``module.path.Outer.Name``) as an object."""
    parts = dotted.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            value = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        try:
            for part in parts[split:]:
                value = getattr(value, part)
        except AttributeError:
            break
        return value
    raise ValueError(f"{CALLER}: --trusted-class {dotted!r}: no such importable class or function; give it as "
                     f"MODULE.NAME, with MODULE importable here")


if __name__ == "__main__":
    main()
