"""Fused flat-shard update rules (docs/kernels.md): AdamW step, AdamW peek, CO2 outer step.

Each public function validates its arguments and dispatches to one backend with the same
signature: the pure-torch reference (:mod:`.reference`, which defines the semantics) or a fused
kernel for the tensors' device (C++/OpenMP for CPU tensors, CUDA for CUDA tensors), built on
first use. ``backend()`` names the backend in use; ``DEEPSPEED_ACCO_KERNELS=torch|cpu|cuda``
forces one (see :mod:`._backend`, and docs/kernels.md).

The block-quantisation kernels of compressed communication (``quantize``, ``quantize_delta``,
``dequantize_sum``, ``apply_delta``, ``packed_bytes``) live in :mod:`.quantization` and are
re-exported here.

Every function takes an optional ``control``: a 2-element fp32 tensor on the tensors' device that
the host never reads, so the engine's jobs decide on the device (no host synchronisation) how to
scale the gradient or the pseudo-gradient and whether to skip the update. Element
:data:`CONTROL_VALUE` is the gradient multiplier (AdamW) or the gap penalty lambda (CO2); element
:data:`CONTROL_SKIP` non-zero skips the update: state untouched, ``out`` gets the current
parameters (CO2: prev_anchor <- anchor, the anchor stays). See :func:`make_control`.
"""
from typing import Optional, Union

import torch

from . import _backend, reference
from .quantization import apply_delta, dequantize_sum, packed_bytes, quantize, quantize_delta
from .reference import CONTROL_NUMEL, CONTROL_SKIP, CONTROL_VALUE

_STATE_DTYPE = torch.float32
# ``out`` may have any of these dtypes; the kernels write the first two directly, fp16 through an
# fp32 staging copy (so callers never special-case the model dtype).
_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_KERNEL_OUT_DTYPES = (torch.float32, torch.bfloat16)


def make_control(value: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
    """The ``control`` tensor from two 0-dim device tensors (any float dtype; ``skip`` may be bool).

    ``value`` is rounded to fp32 once, as the kernels would round a Python float.
    """
    return torch.stack([value.to(torch.float32), skip.to(torch.float32)])


def _staged(out: Optional[torch.Tensor], like: torch.Tensor) -> Optional[torch.Tensor]:
    """Where the kernel writes ``out``: itself, or an fp32 staging tensor for other dtypes."""
    if out is None or out.dtype in _KERNEL_OUT_DTYPES:
        return out
    return torch.empty_like(like)


def _unstage(out: Optional[torch.Tensor], written: Optional[torch.Tensor]) -> None:
    if written is not out:
        out.copy_(written)


def backend(device: Union[str, torch.device, None] = None) -> str:
    """Name of the backend the update functions dispatch to: ``"cpu"``, ``"cuda"`` or ``"torch"``.

    Answers for tensors on ``device``; by default for the device training would use (the forced
    backend's, else CUDA when available, else CPU). May build the kernels (first use).
    """
    if device is None:
        choice = _backend.forced()
        if choice in _backend.KERNEL_DEVICE_TYPES:
            device_type = choice
        else:
            device_type = "cuda" if torch.cuda.is_available() else "cpu"
    else:
        device_type = torch.device(device).type
    return device_type if _backend.kernel_module(device_type) is not None else "torch"


def _check_flat(name: str, tensor: torch.Tensor, numel: int, device: torch.device, dtypes=(_STATE_DTYPE, )) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() != 1 or not tensor.is_contiguous():
        raise ValueError(f"{name} must be a 1-D contiguous tensor, got shape {tuple(tensor.shape)}")
    if tensor.numel() != numel:
        raise ValueError(f"{name} has {tensor.numel()} elements, expected {numel} (same as param)")
    if tensor.dtype not in dtypes:
        raise ValueError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {tensor.dtype}")
    if tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device}, expected {device} (same as param)")


def _check_control(control: Optional[torch.Tensor], device: torch.device) -> None:
    if control is not None:
        _check_flat("control", control, CONTROL_NUMEL, device)


def _check_adamw_args(param, grad, exp_avg, exp_avg_sq, out, step, lr, beta1, beta2, eps) -> None:
    if not isinstance(param, torch.Tensor):
        raise TypeError(f"param must be a torch.Tensor, got {type(param).__name__}")
    _check_flat("param", param, param.numel(), param.device)
    for name, tensor in (("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        _check_flat(name, tensor, param.numel(), param.device)
    if out is not None:
        _check_flat("out", out, param.numel(), param.device, _OUT_DTYPES)
    if int(step) != step or step < 1:
        raise ValueError(f"step is the 1-based AdamW step count, got {step}")
    if not 0.0 <= beta1 < 1.0 or not 0.0 <= beta2 < 1.0:
        raise ValueError(f"betas must lie in [0, 1), got ({beta1}, {beta2})")
    if lr < 0.0 or eps <= 0.0:
        raise ValueError(f"need lr >= 0 and eps > 0, got lr={lr}, eps={eps}")


def adamw_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
               step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
               out: Optional[torch.Tensor] = None, control: Optional[torch.Tensor] = None) -> None:
    """In-place AdamW step (``torch.optim.AdamW`` semantics) on flat fp32 tensors.

    ``step`` is the 1-based step count used for bias correction. If ``out`` (fp32 or bf16, same
    length) is given, the new parameters are also written there in its dtype. With ``control``
    the step uses ``grad * control[CONTROL_VALUE]`` (the buffer is not modified) and is skipped, on
    the device, when ``control[CONTROL_SKIP] != 0``.
    """
    _check_adamw_args(param, grad, exp_avg, exp_avg_sq, out, step, lr, beta1, beta2, eps)
    _check_control(control, param.device)
    written = _staged(out, param)
    kernels = _backend.kernel_module(param.device.type)
    if kernels is None:
        reference.adamw_step(param, grad, exp_avg, exp_avg_sq, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                             weight_decay=weight_decay, out=written, control=control)
    elif control is None:
        kernels.adamw_step(param, grad, exp_avg, exp_avg_sq, written, int(step), float(lr), float(beta1),
                           float(beta2), float(eps), float(weight_decay))
    else:
        kernels.adamw_step_controlled(param, grad, exp_avg, exp_avg_sq, written, control, int(step), float(lr),
                                      float(beta1), float(beta2), float(eps), float(weight_decay))
    _unstage(out, written)


def adamw_peek(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
               step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
               out: torch.Tensor, control: Optional[torch.Tensor] = None) -> None:
    """Write to ``out`` the parameters :func:`adamw_step` would produce, leaving all state unchanged.

    ``control`` as in :func:`adamw_step`; a skip writes ``param`` to ``out``.
    """
    if out is None:
        raise ValueError("adamw_peek needs an out tensor to write the estimated parameters to")
    _check_adamw_args(param, grad, exp_avg, exp_avg_sq, out, step, lr, beta1, beta2, eps)
    _check_control(control, param.device)
    written = _staged(out, param)
    kernels = _backend.kernel_module(param.device.type)
    if kernels is None:
        reference.adamw_peek(param, grad, exp_avg, exp_avg_sq, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                             weight_decay=weight_decay, out=written, control=control)
    elif control is None:
        kernels.adamw_peek(param, grad, exp_avg, exp_avg_sq, written, int(step), float(lr), float(beta1),
                           float(beta2), float(eps), float(weight_decay))
    else:
        kernels.adamw_peek_controlled(param, grad, exp_avg, exp_avg_sq, written, control, int(step), float(lr),
                                      float(beta1), float(beta2), float(eps), float(weight_decay))
    _unstage(out, written)


def co2_outer_step(prev_anchor: torch.Tensor, anchor: torch.Tensor, momentum: torch.Tensor,
                   mean_params: torch.Tensor, *, outer_lr: float, outer_momentum: float,
                   penalty: Optional[float] = None, clip_threshold: Optional[float] = None,
                   out: Optional[torch.Tensor] = None, control: Optional[torch.Tensor] = None,
                   nesterov: bool = False, lr_scale: float = 1.0) -> None:
    """CO2 outer update on a shard (docs/design.md, 3.5); see :func:`.reference.co2_outer_step`.

    The gap penalty is either ``penalty`` (a host number) or ``control[CONTROL_VALUE]`` (a device value, with
    the skip flag in ``control[CONTROL_SKIP]``): give exactly one of the two. ``nesterov`` and
    ``lr_scale`` (the options of docs/design.md 3.5) run on the torch reference: the outer step
    comes once per round of ``local_steps`` inner steps, so a fused kernel would gain nothing.
    """
    if not isinstance(anchor, torch.Tensor):
        raise TypeError(f"anchor must be a torch.Tensor, got {type(anchor).__name__}")
    for name, tensor in (("prev_anchor", prev_anchor), ("anchor", anchor), ("momentum", momentum),
                         ("mean_params", mean_params)):
        _check_flat(name, tensor, anchor.numel(), anchor.device)
    if out is not None:
        _check_flat("out", out, anchor.numel(), anchor.device, _OUT_DTYPES)
    if (penalty is None) == (control is None):
        raise ValueError("co2_outer_step needs exactly one of penalty (a number) and control (a device tensor "
                         f"holding the penalty and the skip flag); got penalty={penalty!r} and "
                         f"{'a' if control is not None else 'no'} control tensor")
    if penalty is not None and penalty <= 0.0:
        raise ValueError(f"penalty must be > 0, got {penalty}")
    _check_control(control, anchor.device)
    if clip_threshold is not None and clip_threshold <= 0.0:
        raise ValueError(f"clip_threshold must be > 0 or None, got {clip_threshold}")
    if not lr_scale > 0.0:
        raise ValueError(f"lr_scale must be > 0, got {lr_scale}")
    written = _staged(out, anchor)
    kernels = _backend.kernel_module(anchor.device.type)
    clip = None if clip_threshold is None else float(clip_threshold)
    if kernels is None or nesterov or lr_scale != 1.0:
        reference.co2_outer_step(prev_anchor, anchor, momentum, mean_params, outer_lr=outer_lr,
                                 outer_momentum=outer_momentum, penalty=penalty, clip_threshold=clip_threshold,
                                 out=written, control=control, nesterov=nesterov, lr_scale=lr_scale)
    elif control is None:
        kernels.co2_outer_step(prev_anchor, anchor, momentum, mean_params, written, float(outer_lr),
                               float(outer_momentum), float(penalty), clip)
    else:
        kernels.co2_outer_step_controlled(prev_anchor, anchor, momentum, mean_params, written, control,
                                          float(outer_lr), float(outer_momentum), clip)
    _unstage(out, written)


__all__ = [
    "adamw_step", "adamw_peek", "co2_outer_step", "make_control", "CONTROL_VALUE", "CONTROL_SKIP", "backend",
    "reference", "quantize", "quantize_delta", "dequantize_sum", "apply_delta", "packed_bytes"
]
