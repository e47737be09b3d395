"""deepspeed-acco: communication-overlapped ZeRO-1 optimizers (ACCO, DPU, CO2) for DeepSpeed.

Switch a DeepSpeed job to our optimizers by changing the config's optimizer type and calling
:func:`deepspeed_acco.initialize` instead of ``deepspeed.initialize``. Importing the package is
light (no torch): everything heavy loads on first use.
"""
__version__ = "0.1.0"


def initialize(*args, **kwargs):
    """Drop-in for ``deepspeed.initialize``; see :func:`deepspeed_acco.runtime.initialize.initialize`."""
    from .runtime.initialize import initialize as _initialize
    return _initialize(*args, **kwargs)


def register_optimizer_type(schedule_class):
    """Make a :class:`~deepspeed_acco.runtime.schedule.Schedule` subclass selectable by its ``type_name``."""
    from .runtime.optimizers import register
    return register(schedule_class)


def type_names():
    """The optimizer types our engine runs (as written in the DeepSpeed config)."""
    from .runtime.optimizers import type_names as _type_names
    return _type_names()


__all__ = ["initialize", "register_optimizer_type", "type_names", "__version__"]
