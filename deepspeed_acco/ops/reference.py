"""Pure-torch reference implementations of the fused update rules (DESIGN section 4).

These functions *define* the semantics that the fused C++/CUDA kernels must reproduce. They
follow ``torch.optim.AdamW``'s single-tensor code path operation by operation, so that
``adamw_step`` here is bitwise equal to ``torch.optim.AdamW(foreach=False)`` on the same data.

All tensors are 1-D, contiguous and fp32 (``out`` may be fp32 or bf16). Validation happens in
the public dispatchers of :mod:`deepspeed_acco.ops`; these functions assume valid input.

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
                   out: Optional[torch.Tensor] = None, control: Optional[torch.Tensor] = None) -> None:
    """CO2's outer update on one shard (DESIGN 3.5), in place.

    d = prev_anchor - mean_params; momentum = outer_momentum * momentum + d / penalty, clipped
    coordinate-wise to [-clip_threshold, clip_threshold] when given; prev_anchor <- anchor;
    anchor <- anchor - outer_lr * momentum (also written to ``out`` when given).

    With ``control`` the penalty is ``control[CONTROL_VALUE]`` (``penalty`` is None), and if
    ``control[CONTROL_SKIP] != 0`` the round is skipped: prev_anchor <- anchor, anchor and momentum
    unchanged (x_{k+2} = x_{k+1}).
    """
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
