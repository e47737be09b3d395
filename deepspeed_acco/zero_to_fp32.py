"""Consolidate a ZeRO-1 checkpoint (ours or DeepSpeed's) into plain fp32 weights.

    python -m deepspeed_acco.zero_to_fp32 CHECKPOINT_DIR OUTPUT_FILE [--tag TAG]

Trainable parameters come from the fp32 master shards of every rank: the committed weights
(for CO2 the averaged anchor), not whatever the model held at save time (an ACCO estimate, a
CO2 local replica). Frozen parameters and buffers come from the module states. The output is
a state dict that ``model.load_state_dict`` accepts.
"""
import argparse
import collections
import os
from typing import Dict, Optional

import torch

from .runtime.checkpoint import LATEST_NAME, MODEL_STATES_NAME, OPTIMIZER_STATE_KEY, optimizer_states_name


def _resolve_tag(checkpoint_dir: str, tag: Optional[str]) -> str:
    if tag is not None:
        return tag
    latest = os.path.join(checkpoint_dir, LATEST_NAME)
    if not os.path.isfile(latest):
        raise ValueError(f"no {LATEST_NAME} file in {checkpoint_dir!r}; pass --tag")
    with open(latest) as handle:
        return handle.read().strip()


def consolidate(checkpoint_dir: str, tag: Optional[str] = None) -> Dict[str, torch.Tensor]:
    """Return the full fp32 state dict of the checkpoint ``checkpoint_dir/tag``."""
    directory = os.path.join(checkpoint_dir, _resolve_tag(checkpoint_dir, tag))
    model_states = torch.load(os.path.join(directory, MODEL_STATES_NAME), map_location="cpu", weights_only=False)
    world_size = int(model_states["dp_world_size"])
    partitions = []
    for rank in range(world_size):
        for bf16 in (False, True):
            path = os.path.join(directory, optimizer_states_name(rank, bf16))
            if os.path.isfile(path):
                state = torch.load(path, map_location="cpu", weights_only=False)[OPTIMIZER_STATE_KEY]
                partitions.append(state["single_partition_of_fp32_groups"])
                break
        else:
            raise FileNotFoundError(f"optimizer states of rank {rank} are missing in {directory}")
    weights = collections.OrderedDict()
    for group_index, shapes in enumerate(model_states["param_shapes"]):
        # Padding sits only at the end of each group, so the ranks' unpadded partitions
        # concatenate to the group's flat parameters.
        flat = torch.cat([rank_partitions[group_index].float().reshape(-1) for rank_partitions in partitions])
        expected = sum(shape.numel() for shape in shapes.values())
        if flat.numel() != expected:
            raise ValueError(f"group {group_index}: {flat.numel()} values in the shards, {expected} in param_shapes")
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
    args = parser.parse_args(argv)
    weights = consolidate(args.checkpoint_dir, args.tag)
    torch.save(weights, args.output_file)
    total = sum(value.numel() for value in weights.values())
    print(f"wrote {len(weights)} tensors ({total:,} values) to {args.output_file}")


if __name__ == "__main__":
    main()
