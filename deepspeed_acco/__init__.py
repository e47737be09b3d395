"""deepspeed-acco: communication-overlapped ZeRO-1 optimizers (ACCO, DPU, CO2) for DeepSpeed.

Switch a DeepSpeed job to our optimizers by changing the config's optimizer type and calling
:func:`deepspeed_acco.initialize` instead of ``deepspeed.initialize``.
"""
from .config import OPTIMIZER_TYPES

__version__ = "0.1.0"


def initialize(*args, **kwargs):
    """Drop-in for ``deepspeed.initialize``; see :func:`deepspeed_acco.runtime.initialize.initialize`."""
    from .runtime.initialize import initialize as _initialize
    return _initialize(*args, **kwargs)


__all__ = ["initialize", "OPTIMIZER_TYPES", "__version__"]
