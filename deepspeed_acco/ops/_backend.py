"""Backend selection for :mod:`deepspeed_acco.ops`: which op module updates tensors of which device.

Decided once per device type and cached, so a dispatch costs one dict lookup:

* CPU tensors use the ``acco_cpu_ops`` kernels, CUDA tensors the ``acco_cuda_ops`` kernels, each
  built with ninja on first use (see :mod:`deepspeed_acco.op_builder`). If one cannot be built
  (no compiler, no nvcc, a build error), tensors of that device fall back to the torch reference
  and a single warning says why.
* ``DEEPSPEED_ACCO_KERNELS=torch`` uses the reference everywhere; ``=cpu`` or ``=cuda`` requires
  that kernel: a build failure raises instead of falling back, and tensors of the other device
  are refused with a ``ValueError``. ``auto`` (or unset) is the default described above.
"""
import logging
import os
import threading
from typing import Dict, Optional

ENV_VAR = "DEEPSPEED_ACCO_KERNELS"
CHOICES = ("auto", "torch", "cpu", "cuda")
KERNEL_DEVICE_TYPES = ("cpu", "cuda")

logger = logging.getLogger("deepspeed_acco.ops")

_lock = threading.Lock()
_modules: Dict[str, Optional[object]] = {}  # device type -> op module, or None for the torch reference
_forced: Optional[str] = None

# Longest build error quoted in the fallback warning; forcing the backend raises the whole text.
_MAX_REASON_CHARS = 400


def forced() -> str:
    """The value of DEEPSPEED_ACCO_KERNELS ("auto" when unset), read once."""
    global _forced
    if _forced is None:
        value = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
        if value not in CHOICES:
            raise ValueError(f"{ENV_VAR}={os.environ.get(ENV_VAR)!r} is not one of {', '.join(CHOICES)}; "
                             f"unset it to use the fused kernels wherever they build")
        _forced = value
    return _forced


def kernel_module(device_type: str):
    """Op module serving ``device_type`` tensors, or None when the torch reference does."""
    try:
        return _modules[device_type]
    except KeyError:
        pass
    with _lock:
        if device_type not in _modules:
            _modules[device_type] = _resolve(device_type)
        return _modules[device_type]


def _resolve(device_type: str):
    choice = forced()
    if choice == "torch":
        return None
    if choice != "auto" and choice != device_type:
        raise ValueError(f"{ENV_VAR}={choice} runs the {choice} kernels, which cannot update {device_type} tensors; "
                         f"unset {ENV_VAR}, or set it to torch" +
                         (f" or {device_type}" if device_type in KERNEL_DEVICE_TYPES else ""))
    if device_type not in KERNEL_DEVICE_TYPES:
        return None
    try:
        return _load(device_type)
    except Exception as err:  # any build or load failure means: no kernel for this device
        if choice == device_type:
            raise RuntimeError(f"{ENV_VAR}={choice} but the fused {device_type} kernels are unavailable: {err}") from err
        reason = " ".join(str(err).split())
        if len(reason) > _MAX_REASON_CHARS:
            reason = reason[:_MAX_REASON_CHARS] + f"... (set {ENV_VAR}={device_type} to see the full error)"
        logger.warning("deepspeed_acco.ops: fused %s kernels unavailable, using the torch reference for %s tensors: %s",
                       device_type, device_type, reason)
        return None


def _load(device_type: str):
    # Imported here: it imports DeepSpeed, and nothing should be built or imported before first use.
    from ..op_builder import AccoCPUOpsBuilder, AccoCUDAOpsBuilder

    builder = AccoCPUOpsBuilder() if device_type == "cpu" else AccoCUDAOpsBuilder()
    # load() prefers an ahead-of-time build; the JIT path checks is_compatible() and raises its reason.
    return builder.load(verbose=False)


def reset() -> None:
    """Forget every decision (tests use it after changing DEEPSPEED_ACCO_KERNELS)."""
    global _forced
    with _lock:
        _modules.clear()
        _forced = None
