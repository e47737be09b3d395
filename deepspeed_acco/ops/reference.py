"""Pure-torch reference implementations of the fused update rules (DESIGN section 4).

These functions *define* the semantics that the fused C++/CUDA kernels must reproduce. They
follow ``torch.optim.AdamW``'s single-tensor code path operation by operation, so that
``adamw_step`` here is bitwise equal to ``torch.optim.AdamW(foreach=False)`` on the same data.

All tensors are 1-D, contiguous and fp32 (``out`` may be fp32 or bf16). Validation happens in
the public dispatchers of :mod:`deepspeed_acco.ops`; these functions assume valid input.
"""
import math
from typing import Optional

import torch


def adamw_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
               step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
               out: Optional[torch.Tensor] = None) -> None:
    """One AdamW step in place on (param, exp_avg, exp_avg_sq); new params also written to ``out``."""
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
               out: torch.Tensor) -> None:
    """Write to ``out`` the parameters :func:`adamw_step` would produce; inputs are left unchanged.

    Uses the same operations as :func:`adamw_step` on temporaries, so the result is bitwise equal
    to the parameters of a real step.
    """
    new_param = param.mul(1.0 - lr * weight_decay)
    new_exp_avg = exp_avg.lerp(grad, 1.0 - beta1)
    new_exp_avg_sq = exp_avg_sq.mul(beta2).addcmul_(grad, grad, value=1.0 - beta2)
    bias_correction1 = 1.0 - beta1**step
    bias_correction2_sqrt = math.sqrt(1.0 - beta2**step)
    denom = (new_exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    new_param.addcdiv_(new_exp_avg, denom, value=-(lr / bias_correction1))
    out.copy_(new_param)


def co2_outer_step(prev_anchor: torch.Tensor, anchor: torch.Tensor, momentum: torch.Tensor,
                   mean_params: torch.Tensor, *, outer_lr: float, outer_momentum: float, penalty: float,
                   clip_threshold: Optional[float] = None, out: Optional[torch.Tensor] = None) -> None:
    """CO2's outer update on one shard (DESIGN 3.5), in place.

    d = prev_anchor - mean_params; momentum = outer_momentum * momentum + d / penalty, clipped
    coordinate-wise to [-clip_threshold, clip_threshold] when given; prev_anchor <- anchor;
    anchor <- anchor - outer_lr * momentum (also written to ``out`` when given).
    """
    pseudo_grad = prev_anchor.sub(mean_params)
    momentum.mul_(outer_momentum).add_(pseudo_grad.div_(penalty))
    if clip_threshold is not None:
        # In place: an out-of-place clamp here would silently do nothing (the CO2 reference's bug).
        momentum.clamp_(-clip_threshold, clip_threshold)
    prev_anchor.copy_(anchor)
    anchor.sub_(momentum.mul(outer_lr))
    if out is not None:
        out.copy_(anchor)
