"""Backend selection for :mod:`deepspeed_acco.ops`: which op module updates tensors of which device.

Decided once per device type and cached, so a dispatch costs one dict lookup:

* CPU tensors use the ``acco_cpu_ops`` kernels, CUDA tensors the ``acco_cuda_ops`` kernels, each
  built with ninja on first use (see :mod:`deepspeed_acco.op_builder`).
* CUDA is strict (docs/kernels.md): if the CUDA kernels cannot be built or loaded, the first
  dispatch (``deepspeed_acco.initialize`` makes it before building anything) raises with the
  build's error. A GPU job that silently ran on the reference would run at a fraction of the
  speed with nothing to say so (it happened on the first GPU run, docs/gpu_check.md).
* The CPU falls back: if its kernels cannot be built (no compiler, no OpenMP), CPU tensors use the
  torch reference and a single warning says why; the package keeps working everywhere.
* ``DEEPSPEED_ACCO_KERNELS=torch`` uses the reference everywhere, the explicit opt-in on CUDA;
  ``=cpu`` or ``=cuda`` requires that kernel (a build failure raises), and tensors of the other
  device are refused with a ``ValueError``. ``auto`` (or unset) is the default described above.

The backend chosen for a device is logged once, at INFO, when it is first decided.
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
        logger.info("deepspeed_acco.ops: %s tensors use the torch reference (%s=torch)", device_type, ENV_VAR)
        return None
    if choice != "auto" and choice != device_type:
        raise ValueError(f"{ENV_VAR}={choice} runs the {choice} kernels, which cannot update {device_type} tensors; "
                         f"unset {ENV_VAR}, or set it to torch" +
                         (f" or {device_type}" if device_type in KERNEL_DEVICE_TYPES else ""))
    if device_type not in KERNEL_DEVICE_TYPES:
        return None
    try:
        module = _load(device_type)
    except Exception as err:  # any build or load failure means: no kernel for this device
        if choice == device_type:
            raise RuntimeError(f"{ENV_VAR}={choice} but the fused {device_type} kernels are unavailable: {err}") from err
        if device_type == "cuda":
            raise RuntimeError(
                f"deepspeed_acco: the fused CUDA kernels could not be built or loaded, and the engine does not "
                f"fall back on its own to the torch reference (separate torch operations instead of one fused "
                f"pass). Fix the build (the error follows; docs/gpu.md, \"The fused CUDA kernels\"), or set "
                f"{ENV_VAR}=torch to run the torch reference on purpose.\n{err}") from err
        reason = " ".join(str(err).split())
        if len(reason) > _MAX_REASON_CHARS:
            reason = reason[:_MAX_REASON_CHARS] + f"... (set {ENV_VAR}={device_type} to see the full error)"
        logger.warning("deepspeed_acco.ops: fused %s kernels unavailable, using the torch reference for %s tensors: %s",
                       device_type, device_type, reason)
        return None
    logger.info("deepspeed_acco.ops: %s tensors use the fused %s kernels (%s)", device_type, device_type,
                getattr(module, "__file__", module))
    return module


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
