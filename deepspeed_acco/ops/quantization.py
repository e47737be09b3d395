"""Block-quantised communication kernels (docs/kernels.md, "Compressed communication"): quantise
with error feedback, quantise a parameter delta, dequantise-and-sum, apply a dequantised delta.

The building blocks of :mod:`deepspeed_acco.runtime.compression`. Each public function validates
its arguments and dispatches, like the update rules in :mod:`deepspeed_acco.ops`, to the fused
kernel for the tensors' device or to the torch reference (:mod:`.reference`), which defines the
results; the CPU and CUDA kernels reproduce it bitwise.

Format (docs/kernels.md has the full description): a chunk of n fp32 values is cut into blocks
of ``block_size`` values (a power of two in [32, 512]); each block stores one fp32 scale
``absmax / max_code`` and one symmetric code per value, ``round_half_to_even(v * inv)`` with
``inv = max_code / absmax`` rounded to fp32, in [-127, 127] (``bits=8``) or [-7, 7] (``bits=4``,
two codes per byte). A packed chunk
is ``packed_bytes(n, bits=..., block_size=...)`` bytes; several chunks of equal length are the
rows of one 2-D uint8 tensor, so one call handles the chunks for every peer of a collective.
"""
from typing import Optional

import torch

from . import _backend, reference
from .reference import PACKED_ALIGN_BYTES, QUANT_MAX_CODE, packed_bytes

BITS = (8, 4)
MIN_BLOCK_SIZE = 32
MAX_BLOCK_SIZE = 512
DEFAULT_BLOCK_SIZE = 128
HELD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_format(bits: int, block_size: int) -> None:
    """Raise ``ValueError`` unless (bits, block_size) is a supported quantisation format."""
    if bits not in BITS:
        raise ValueError(f"bits must be 8 (int8 codes) or 4 (int4 codes), got {bits!r}")
    if (isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < MIN_BLOCK_SIZE
            or block_size > MAX_BLOCK_SIZE or block_size & (block_size - 1)):
        raise ValueError(f"block_size must be a power of two in [{MIN_BLOCK_SIZE}, {MAX_BLOCK_SIZE}] "
                         f"(values per fp32 scale), got {block_size!r}")


def _check_flat(name: str, tensor, dtypes, device: Optional[torch.device] = None, numel: Optional[int] = None):
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() != 1 or not tensor.is_contiguous():
        raise ValueError(f"{name} must be a 1-D contiguous tensor, got shape {tuple(tensor.shape)}")
    if tensor.dtype not in dtypes:
        raise ValueError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {tensor.dtype}")
    if device is not None and tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device}, expected {device}")
    if numel is not None and tensor.numel() != numel:
        raise ValueError(f"{name} has {tensor.numel()} elements, expected {numel}")


def _check_packed(packed, chunk_numel: int, device: torch.device, bits: int, block_size: int) -> None:
    if not isinstance(packed, torch.Tensor):
        raise TypeError(f"packed must be a torch.Tensor, got {type(packed).__name__}")
    if packed.dtype != torch.uint8 or packed.dim() != 2 or not packed.is_contiguous():
        raise ValueError(f"packed must be a contiguous 2-D uint8 tensor (one row per chunk), got {packed.dtype} of "
                         f"shape {tuple(packed.shape)}")
    if packed.device != device:
        raise ValueError(f"packed is on {packed.device}, expected {device}")
    expected = packed_bytes(chunk_numel, bits=bits, block_size=block_size)
    if packed.shape[1] != expected:
        raise ValueError(f"packed rows have {packed.shape[1]} bytes, expected packed_bytes({chunk_numel}, bits={bits}, "
                         f"block_size={block_size}) = {expected}")


def _chunk_numel(name: str, numel: int, packed) -> int:
    rows = packed.shape[0] if isinstance(packed, torch.Tensor) and packed.dim() == 2 else None
    if rows is None:
        return 0  # _check_packed reports the shape
    if rows == 0:
        if numel:
            raise ValueError(f"packed has no rows, but {name} has {numel} values to hold")
        return 0
    if numel % rows:
        raise ValueError(f"{name} has {numel} values, which do not split into {rows} equal chunks (rows of packed)")
    return numel // rows


def _byte_range(tensor: torch.Tensor):
    start = tensor.data_ptr()
    return start, start + tensor.numel() * tensor.element_size()


def _check_no_overlap(name_a: str, a: torch.Tensor, name_b: str, b: torch.Tensor, may_be_same: bool = False) -> None:
    (a0, a1), (b0, b1) = _byte_range(a), _byte_range(b)
    if a0 == b0 and a1 == b1 and may_be_same:
        return
    if a0 < b1 and b0 < a1:
        allowed = f" (it may be {name_b} itself)" if may_be_same else ""
        raise ValueError(f"{name_a} overlaps {name_b} in memory; pass separate buffers{allowed}")


def quantize(input: torch.Tensor, packed: torch.Tensor, *, bits: int, block_size: int,
             residual: Optional[torch.Tensor] = None) -> None:
    """Quantise v = input (+ residual) into ``packed``, one chunk per row.

    ``input`` (fp32, 1-D) holds ``packed.shape[0]`` chunks of equal length back to back; blocks
    restart at every chunk. With ``residual`` (fp32, same length: error feedback), v includes it
    and the residual becomes v - dequantised(v); blocks holding an inf or NaN are sent as NaN
    (scale NaN, codes 0) and keep their residual.
    """
    check_format(bits, block_size)
    _check_flat("input", input, (torch.float32, ))
    if residual is not None:
        _check_flat("residual", residual, (torch.float32, ), input.device, input.numel())
        _check_no_overlap("residual", residual, "input", input)
    _check_packed(packed, _chunk_numel("input", input.numel(), packed), input.device, bits, block_size)
    kernels = _backend.kernel_module(input.device.type)
    if kernels is None:
        reference.quantize(input, packed, bits=bits, block_size=block_size, residual=residual)
    else:
        kernels.quantize(input, residual, packed, bits, block_size)


def quantize_delta(target: torch.Tensor, held: torch.Tensor, packed: torch.Tensor, *, bits: int,
                   block_size: int) -> None:
    """Quantise v = target - held into ``packed``, one chunk per row.

    ``target`` is fp32 (e.g. new master weights), ``held`` the copy every replica holds (fp32, bf16
    or fp16, same length). Applying the result with :func:`apply_delta` moves ``held`` to within
    half a quantisation step (plus ``held``'s own rounding) of ``target``.
    """
    check_format(bits, block_size)
    _check_flat("target", target, (torch.float32, ))
    _check_flat("held", held, HELD_DTYPES, target.device, target.numel())
    _check_packed(packed, _chunk_numel("target", target.numel(), packed), target.device, bits, block_size)
    kernels = _backend.kernel_module(target.device.type)
    if kernels is None:
        reference.quantize_delta(target, held, packed, bits=bits, block_size=block_size)
    else:
        kernels.quantize_delta(target, held, packed, bits, block_size)


def dequantize_sum(packed: torch.Tensor, out: torch.Tensor, *, bits: int, block_size: int,
                   base: Optional[torch.Tensor] = None) -> None:
    """out = ((base + d_0) + d_1) + ... with d_k the dequantised row k of ``packed``.

    Every row is a chunk as long as ``out`` (fp32): the owner's side of a quantised
    reduce-scatter, rows being what each peer sent. Without ``base`` the sum starts at d_0.
    ``base`` (fp32) may be ``out`` itself (accumulate in place).
    """
    check_format(bits, block_size)
    _check_flat("out", out, (torch.float32, ))
    _check_packed(packed, out.numel(), out.device, bits, block_size)
    if base is not None:
        _check_flat("base", base, (torch.float32, ), out.device, out.numel())
        _check_no_overlap("base", base, "out", out, may_be_same=True)
    elif packed.shape[0] == 0:
        raise ValueError("dequantize_sum needs a base or at least one packed row to sum")
    kernels = _backend.kernel_module(out.device.type)
    if kernels is None:
        reference.dequantize_sum(packed, out, bits=bits, block_size=block_size, base=base)
    else:
        kernels.dequantize_sum(packed, out, base, bits, block_size)


def apply_delta(packed: torch.Tensor, held: torch.Tensor, *, bits: int, block_size: int,
                out: Optional[torch.Tensor] = None) -> None:
    """out = held + dequantised(packed), computed in fp32 and rounded to held's dtype.

    ``held`` (fp32, bf16 or fp16) holds ``packed.shape[0]`` chunks back to back; ``out`` (default:
    ``held``, updated in place) has held's dtype and length. Deterministic: every rank that
    applies the same packed delta to the same held copy gets the same bits.
    """
    check_format(bits, block_size)
    _check_flat("held", held, HELD_DTYPES)
    if out is None:
        out = held
    else:
        _check_flat("out", out, (held.dtype, ), held.device, held.numel())
        _check_no_overlap("out", out, "held", held, may_be_same=True)
    _check_packed(packed, _chunk_numel("held", held.numel(), packed), held.device, bits, block_size)
    kernels = _backend.kernel_module(held.device.type)
    if kernels is None:
        reference.apply_delta(packed, held, bits=bits, block_size=block_size, out=out)
    else:
        kernels.apply_delta(packed, held, out, bits, block_size)


__all__ = [
    "BITS", "DEFAULT_BLOCK_SIZE", "HELD_DTYPES", "MAX_BLOCK_SIZE", "MIN_BLOCK_SIZE", "PACKED_ALIGN_BYTES",
    "QUANT_MAX_CODE", "apply_delta", "check_format", "dequantize_sum", "packed_bytes", "quantize", "quantize_delta"
]
