"""Pure-torch reference implementations of the fused update rules (docs/kernels.md).

These functions *define* the semantics that the fused C++/CUDA kernels must reproduce. They
follow ``torch.optim.AdamW``'s single-tensor code path operation by operation, so that
``adamw_step`` here is bitwise equal to ``torch.optim.AdamW(foreach=False)`` on the same data.

All tensors are 1-D, contiguous and fp32 (``out`` may be fp32 or bf16). Validation happens in
the public dispatchers of :mod:`deepspeed_acco.ops`; these functions assume valid input.

The second half defines the block quantisation of compressed communication (docs/wire.md, "Compressed communication"):
the packed format, the rounding and the four operations the kernels of
:mod:`deepspeed_acco.ops.quantization` reproduce bitwise (there ``packed`` is a 2-D uint8 tensor
and held copies may be bf16 or fp16).

``control`` (optional) is the device-side input of the engine's jobs: a 2-element fp32 tensor on
the tensors' device whose values the host never reads. Element ``CONTROL_VALUE`` is the gradient
multiplier (AdamW) or the gap penalty (CO2); element ``CONTROL_SKIP`` is a skip flag, non-zero
meaning "no update": state untouched, ``out`` receives the current parameters. The skip is a
``torch.where`` select, not a host branch, so it costs no synchronisation on any device.
"""
import math
from typing import Optional

import torch

CONTROL_VALUE = 0
"""Index in ``control`` of the gradient multiplier (AdamW) or the gap penalty (CO2)."""
CONTROL_SKIP = 1
"""Index in ``control`` of the skip flag (non-zero: no update)."""
CONTROL_NUMEL = 2


def adamw_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
               step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
               out: Optional[torch.Tensor] = None, control: Optional[torch.Tensor] = None) -> None:
    """One AdamW step in place on (param, exp_avg, exp_avg_sq); new params also written to ``out``.

    With ``control``, the step uses ``grad * control[CONTROL_VALUE]`` and is skipped if
    ``control[CONTROL_SKIP] != 0``.
    """
    if control is not None:
        new_param, new_exp_avg, new_exp_avg_sq = _adamw_new_values(
            param, grad * control[CONTROL_VALUE], exp_avg, exp_avg_sq, step=step, lr=lr, beta1=beta1, beta2=beta2,
            eps=eps, weight_decay=weight_decay)
        skip = control[CONTROL_SKIP] != 0
        exp_avg.copy_(torch.where(skip, exp_avg, new_exp_avg))
        exp_avg_sq.copy_(torch.where(skip, exp_avg_sq, new_exp_avg_sq))
        param.copy_(torch.where(skip, param, new_param))
        if out is not None:
            out.copy_(param)
        return
    param.mul_(1.0 - lr * weight_decay)
    exp_avg.lerp_(grad, 1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
    bias_correction1 = 1.0 - beta1**step
    bias_correction2_sqrt = math.sqrt(1.0 - beta2**step)
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-(lr / bias_correction1))
    if out is not None:
        out.copy_(param)


def adamw_peek(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
               step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
               out: torch.Tensor, control: Optional[torch.Tensor] = None) -> None:
    """Write to ``out`` the parameters :func:`adamw_step` would produce; inputs are left unchanged.

    Uses the same operations as :func:`adamw_step` on temporaries, so the result is bitwise equal
    to the parameters of a real step. With ``control`` as in :func:`adamw_step` (a skip writes
    ``param`` to ``out``).
    """
    if control is not None:
        new_param, _, _ = _adamw_new_values(param, grad * control[CONTROL_VALUE], exp_avg, exp_avg_sq, step=step,
                                            lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)
        out.copy_(torch.where(control[CONTROL_SKIP] != 0, param, new_param))
        return
    new_param, _, _ = _adamw_new_values(param, grad, exp_avg, exp_avg_sq, step=step, lr=lr, beta1=beta1,
                                        beta2=beta2, eps=eps, weight_decay=weight_decay)
    out.copy_(new_param)


def _adamw_new_values(param, grad, exp_avg, exp_avg_sq, *, step, lr, beta1, beta2, eps, weight_decay):
    """(theta', m', v') of one AdamW step, out of place, with the operations of :func:`adamw_step`."""
    new_param = param.mul(1.0 - lr * weight_decay)
    new_exp_avg = exp_avg.lerp(grad, 1.0 - beta1)
    new_exp_avg_sq = exp_avg_sq.mul(beta2).addcmul_(grad, grad, value=1.0 - beta2)
    bias_correction1 = 1.0 - beta1**step
    bias_correction2_sqrt = math.sqrt(1.0 - beta2**step)
    denom = (new_exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    new_param.addcdiv_(new_exp_avg, denom, value=-(lr / bias_correction1))
    return new_param, new_exp_avg, new_exp_avg_sq


def co2_outer_step(prev_anchor: torch.Tensor, anchor: torch.Tensor, momentum: torch.Tensor,
                   mean_params: torch.Tensor, *, outer_lr: float, outer_momentum: float,
                   penalty: Optional[float] = None, clip_threshold: Optional[float] = None,
                   out: Optional[torch.Tensor] = None, control: Optional[torch.Tensor] = None,
                   nesterov: bool = False, lr_scale: float = 1.0) -> None:
    """CO2's outer update on one shard (docs/design.md, 3.5), in place.

    d = prev_anchor - mean_params; momentum = outer_momentum * momentum + d / penalty, clipped
    coordinate-wise to [-clip_threshold, clip_threshold] when given; prev_anchor <- anchor;
    anchor <- anchor - outer_lr * momentum (also written to ``out`` when given).

    With ``control`` the penalty is ``control[CONTROL_VALUE]`` (``penalty`` is None), and if
    ``control[CONTROL_SKIP] != 0`` the round is skipped: prev_anchor <- anchor, anchor and momentum
    unchanged (x_{k+2} = x_{k+1}).

    Options from the local-SGD literature (docs/design.md, 3.5), off by default: ``nesterov``
    steps along d / penalty + outer_momentum * momentum instead of momentum (DiLoCo's outer
    Nesterov); ``lr_scale`` gamma normalises the pseudo-gradient by the inner learning rate
    (SlowMo): d / (penalty * gamma) enters the momentum and the step is multiplied by gamma.
    """
    if nesterov or lr_scale != 1.0:
        _co2_outer_step_variant(prev_anchor, anchor, momentum, mean_params, outer_lr=outer_lr,
                                outer_momentum=outer_momentum, penalty=penalty, clip_threshold=clip_threshold,
                                out=out, control=control, nesterov=nesterov, lr_scale=lr_scale)
        return
    if control is not None:
        pseudo_grad = prev_anchor.sub(mean_params).div_(control[CONTROL_VALUE])
        new_momentum = momentum.mul(outer_momentum).add_(pseudo_grad)
        if clip_threshold is not None:
            new_momentum.clamp_(-clip_threshold, clip_threshold)
        skip = control[CONTROL_SKIP] != 0
        momentum.copy_(torch.where(skip, momentum, new_momentum))
        prev_anchor.copy_(anchor)
        anchor.copy_(torch.where(skip, anchor, anchor.sub(momentum.mul(outer_lr))))
        if out is not None:
            out.copy_(anchor)
        return
    pseudo_grad = prev_anchor.sub(mean_params)
    momentum.mul_(outer_momentum).add_(pseudo_grad.div_(penalty))
    if clip_threshold is not None:
        # In place: an out-of-place clamp here would silently do nothing (the CO2 reference's bug).
        momentum.clamp_(-clip_threshold, clip_threshold)
    prev_anchor.copy_(anchor)
    anchor.sub_(momentum.mul(outer_lr))
    if out is not None:
        out.copy_(anchor)


def _co2_outer_step_variant(prev_anchor, anchor, momentum, mean_params, *, outer_lr, outer_momentum, penalty,
                            clip_threshold, out, control, nesterov, lr_scale) -> None:
    """:func:`co2_outer_step` with Nesterov and/or SlowMo's normalisation (any skip via ``control``)."""
    divisor = control[CONTROL_VALUE] if control is not None else penalty
    pseudo_grad = prev_anchor.sub(mean_params).div_(divisor).div_(lr_scale)
    new_momentum = momentum.mul(outer_momentum).add_(pseudo_grad)
    if clip_threshold is not None:
        new_momentum.clamp_(-clip_threshold, clip_threshold)
    direction = pseudo_grad.add_(new_momentum, alpha=outer_momentum) if nesterov else new_momentum
    new_anchor = anchor.sub(direction.mul(outer_lr * lr_scale))
    skip = (control[CONTROL_SKIP] != 0) if control is not None else torch.zeros((), dtype=torch.bool,
                                                                                 device=anchor.device)
    momentum.copy_(torch.where(skip, momentum, new_momentum))
    prev_anchor.copy_(anchor)
    anchor.copy_(torch.where(skip, anchor, new_anchor))
    if out is not None:
        out.copy_(anchor)


# ---------------------------------------------------------------------------------------------
# Block quantisation for compressed communication (docs/wire.md, "Compressed communication"; format in docs/kernels.md)
# ---------------------------------------------------------------------------------------------
#
# A chunk of n fp32 values is cut into blocks of `block_size` values (the last one may be
# shorter). Per block: scale = absmax / max_code and inv = max_code / absmax, both IEEE fp32
# divisions (max_code = 127 for int8, 7 for int4); code = round_half_to_even(v * inv), never
# beyond +-max_code since |v * inv| <= max_code (1 + 2^-24) (csrc/includes/acco_quant.h); the
# value a code stands for is code * scale. Special blocks:
# * absmax == 0, or so small that inv overflows to inf: scale 0 and codes 0 (the values stay in
#   the error-feedback residual);
# * any inf or NaN in the block, or a magnitude >= 2^127 (above it code * scale could round past
#   FLT_MAX and turn a finite value into inf): scale NaN and codes 0, so the block dequantises to
#   NaN and the non-finite check of whoever sums it fires; the residual of such a block is left
#   unchanged, so later steps are not poisoned.
# Packed chunk: [num_blocks fp32 scales][codes: n int8, or ceil(n / 2) bytes of two int4 with
# element 2j in the low nibble][zero padding to a multiple of PACKED_ALIGN_BYTES]. Several chunks
# of equal length are the rows of one 2-D uint8 tensor.

QUANT_MAX_CODE = {8: 127, 4: 7}
PACKED_ALIGN_BYTES = 16
QUANT_OVERFLOW_MAGNITUDE = 2.0**127


def quant_num_blocks(numel: int, block_size: int) -> int:
    return -(-numel // block_size)


def quant_code_bytes(numel: int, bits: int) -> int:
    return numel if bits == 8 else (numel + 1) // 2


def packed_bytes(numel: int, *, bits: int, block_size: int) -> int:
    """Bytes of one packed chunk of ``numel`` values, padding included."""
    raw = 4 * quant_num_blocks(numel, block_size) + quant_code_bytes(numel, bits)
    return -(-raw // PACKED_ALIGN_BYTES) * PACKED_ALIGN_BYTES


def _per_element(per_block: torch.Tensor, numel: int, block_size: int) -> torch.Tensor:
    """[rows, num_blocks] -> [rows, numel]: each block's value repeated over its elements."""
    return per_block.repeat_interleave(block_size, dim=1)[:, :numel]


def quantize_values(values: torch.Tensor, *, bits: int, block_size: int):
    """Quantises each row of ``values`` ([rows, n] fp32) as one chunk.

    Returns (codes [rows, n] as float, scales [rows, num_blocks], dequantised [rows, n],
    nonfinite [rows, n] bool: the element's block held an inf, a NaN or a magnitude >= 2^127).
    """
    rows, numel = values.shape
    num_blocks = quant_num_blocks(numel, block_size)
    blocks = values.new_zeros(rows, num_blocks * block_size)
    blocks[:, :numel] = values
    blocks = blocks.view(rows, num_blocks, block_size)
    magnitudes = blocks.abs()
    nonfinite = ~(magnitudes < QUANT_OVERFLOW_MAGNITUDE).all(dim=2)  # NaN compares false
    absmax = magnitudes.amax(dim=2)
    max_code = torch.full_like(absmax, QUANT_MAX_CODE[bits])
    # Tensor / tensor is an IEEE division on every device (a Python scalar divisor would be
    # turned into a multiplication by its reciprocal on CUDA).
    inv = max_code / absmax
    tiny = inv == math.inf
    scales = torch.where(tiny, 0.0, absmax / max_code)
    inv = torch.where(tiny | nonfinite, 0.0, inv)
    scales = torch.where(nonfinite, math.nan, scales)
    codes = torch.round(blocks * inv.unsqueeze(2))
    codes = torch.where(nonfinite.unsqueeze(2), 0.0, codes).view(rows, -1)[:, :numel]
    dequantised = codes * _per_element(scales, numel, block_size)
    return codes, scales, dequantised, _per_element(nonfinite, numel, block_size)


def write_packed(packed: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, *, bits: int) -> None:
    """Lays out codes ([rows, n], integral values) and scales ([rows, num_blocks]) in ``packed``."""
    rows, numel = codes.shape
    scale_bytes = 4 * scales.shape[1]
    packed.zero_()
    packed[:, :scale_bytes] = scales.contiguous().view(torch.uint8).view(rows, scale_bytes)
    codes = codes.to(torch.int16)
    if bits == 8:
        code_bytes = codes & 0xFF
    else:
        if numel % 2:
            codes = torch.nn.functional.pad(codes, (0, 1))
        code_bytes = (codes[:, 0::2] & 0x0F) | ((codes[:, 1::2] & 0x0F) << 4)
    packed[:, scale_bytes:scale_bytes + code_bytes.shape[1]] = code_bytes.to(torch.uint8)


def read_packed(packed: torch.Tensor, numel: int, *, bits: int, block_size: int):
    """Inverse of :func:`write_packed`: (codes [rows, n] int8, scales [rows, num_blocks] fp32)."""
    rows = packed.shape[0]
    scale_bytes = 4 * quant_num_blocks(numel, block_size)
    scales = packed[:, :scale_bytes].contiguous().view(torch.float32)
    code_bytes = packed[:, scale_bytes:scale_bytes + quant_code_bytes(numel, bits)]
    if bits == 8:
        return code_bytes.contiguous().view(torch.int8), scales
    nibbles = code_bytes.to(torch.int16)
    low = ((nibbles & 0x0F) ^ 8) - 8  # sign-extends the 4-bit two's complement value
    high = ((nibbles >> 4) ^ 8) - 8
    codes = torch.stack([low, high], dim=2).view(rows, -1)[:, :numel]
    return codes.to(torch.int8), scales


def dequantize_rows(packed: torch.Tensor, numel: int, *, bits: int, block_size: int) -> torch.Tensor:
    """[rows, numel] fp32: each row of ``packed`` dequantised (code * scale, one rounding)."""
    codes, scales = read_packed(packed, numel, bits=bits, block_size=block_size)
    return codes.to(torch.float32) * _per_element(scales, numel, block_size)


def quantize(input: torch.Tensor, packed: torch.Tensor, *, bits: int, block_size: int,
             residual: Optional[torch.Tensor] = None) -> None:
    """Quantise v = input (+ residual) into the rows of ``packed`` (one chunk per row).

    With ``residual`` (error feedback), also residual <- v - dequantised(v), except in blocks with
    an inf or NaN, whose residual is left unchanged.
    """
    rows = packed.shape[0]
    values = input if residual is None else input + residual
    values = values.view(rows, -1)
    codes, scales, dequantised, nonfinite = quantize_values(values, bits=bits, block_size=block_size)
    write_packed(packed, codes, scales, bits=bits)
    if residual is not None:
        kept = residual.view(rows, -1)
        kept.copy_(torch.where(nonfinite, kept, values - dequantised))


def quantize_delta(target: torch.Tensor, held: torch.Tensor, packed: torch.Tensor, *, bits: int,
                   block_size: int) -> None:
    """Quantise v = target - held (held in fp32, bf16 or fp16, widened exactly) into ``packed``."""
    rows = packed.shape[0]
    values = (target - held.to(torch.float32)).view(rows, -1)
    codes, scales, _, _ = quantize_values(values, bits=bits, block_size=block_size)
    write_packed(packed, codes, scales, bits=bits)


def dequantize_sum(packed: torch.Tensor, out: torch.Tensor, *, bits: int, block_size: int,
                   base: Optional[torch.Tensor] = None) -> None:
    """out = ((base + d_0) + d_1) + ..., d_k the dequantised row k of ``packed`` (each as long as
    ``out``); without ``base`` the sum starts at d_0. Each addition is one fp32 rounding."""
    dequantised = dequantize_rows(packed, out.numel(), bits=bits, block_size=block_size)
    total = base.clone() if base is not None else dequantised[0].clone()
    for row in range(0 if base is not None else 1, packed.shape[0]):
        total.add_(dequantised[row])
    out.copy_(total)


def apply_delta(packed: torch.Tensor, held: torch.Tensor, *, bits: int, block_size: int,
                out: Optional[torch.Tensor] = None) -> None:
    """out (default: held itself) = held + dequantised(packed), in fp32, rounded to held's dtype."""
    rows = packed.shape[0]
    chunk_numel = held.numel() // rows if rows else 0
    delta = dequantize_rows(packed, chunk_numel, bits=bits, block_size=block_size).view(-1)
    result = (held.to(torch.float32) + delta).to(held.dtype)
    (held if out is None else out).copy_(result)
