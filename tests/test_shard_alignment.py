"""Every rank's shard starts on a 64-byte boundary, in every dtype the pipeline uses (flat.py).

The CUDA kernels take their vectorised (16-byte) path only when every buffer they touch is
aligned; a shard that starts 8 bytes off on odd ranks would drop those ranks to the scalar path
for the whole update. Buffers are allocated 64-byte aligned (CPU) or 512-byte aligned (CUDA's
caching allocator), so aligned offsets make aligned pointers. Covers odd parameter counts,
W = 2..8, ZeRO-1 shards, and CO2's inner (per group) and outer (over all ranks) shards.
"""
import pytest
import torch

from deepspeed_acco.runtime.flat import FlatParamGroup
from deepspeed_acco.runtime.jobs import ADAMW, ShardState
from deepspeed_acco.runtime.optimizers.co2 import OuterState

ALIGNMENT_BYTES = 64
ODD_NUMELS = [1, 7, 33, 1001, 4097, 20_001]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _params(numel, dtype):
    # Two tensors of odd sizes that add up to numel (or one), like a layer's weight and bias.
    sizes = [numel] if numel < 3 else [numel - 2 - numel // 3, numel // 3 + 2]
    return [torch.nn.Parameter(torch.randn(size).to(dtype)) for size in sizes]


def _assert_shard_aligned(buffer, offset, numel, what):
    start = buffer[offset:offset + numel]
    assert (offset * buffer.element_size()) % ALIGNMENT_BYTES == 0, f"{what}: offset {offset} x {buffer.dtype}"
    assert start.data_ptr() % ALIGNMENT_BYTES == 0, f"{what}: shard pointer {start.data_ptr():#x}"


@pytest.mark.parametrize("model_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("world_size", range(2, 9))
def test_zero1_shards_are_64_byte_aligned_for_odd_parameter_counts(world_size, model_dtype):
    communication_dtype = torch.float32 if model_dtype == torch.float32 else model_dtype
    for numel in ODD_NUMELS:
        for rank in range(world_size):
            flat = FlatParamGroup(_params(numel, model_dtype), {}, world_size, rank, communication_dtype,
                                  synchronous=False)
            assert flat.padded_numel == flat.shard_numel * world_size and flat.padded_numel >= numel
            for name in ("model_flat", "grad_accum", "job_grad", "gather"):
                _assert_shard_aligned(getattr(flat, name), flat.shard_offset, flat.shard_numel,
                                      f"W={world_size} rank {rank} numel {numel} {name}")
            shard = ShardState(flat, communication_dtype, ADAMW)
            for name, tensor in [("master", shard.master), ("reduced", shard.reduced), ("grad", shard.grad),
                                 *shard.state.items()]:
                assert tensor.data_ptr() % ALIGNMENT_BYTES == 0, name


@pytest.mark.parametrize("model_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("world_size", range(2, 9))
def test_co2_inner_and_outer_shards_are_64_byte_aligned(world_size, model_dtype):
    communication_dtype = torch.float32 if model_dtype == torch.float32 else model_dtype
    group_sizes = [g for g in range(1, world_size + 1) if world_size % g == 0]
    for numel in ODD_NUMELS:
        for group_size in group_sizes:
            for rank in range(world_size):
                # As CO2.build makes them: ZeRO-1 inside the group, padded for all ranks.
                flat = FlatParamGroup(_params(numel, model_dtype), {}, group_size, rank % group_size,
                                      communication_dtype, synchronous=True, padding_world_size=world_size)
                where = f"W={world_size} g={group_size} rank {rank} numel {numel}"
                for name in ("model_flat", "grad_accum", "job_grad"):
                    _assert_shard_aligned(getattr(flat, name), flat.shard_offset, flat.shard_numel, f"{where} {name}")
                outer = OuterState(flat, world_size, rank, communication_dtype)
                assert outer.shard_numel * world_size == flat.padded_numel
                for name in ("round_start", "gather", "displacement"):
                    _assert_shard_aligned(getattr(outer, name), outer.shard_offset, outer.shard_numel,
                                          f"{where} outer {name}")
                for name in ("anchor", "prev_anchor", "momentum", "mean_displacement"):
                    assert getattr(outer, name).data_ptr() % ALIGNMENT_BYTES == 0, f"{where} {name}"
