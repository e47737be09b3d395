"""deepspeed-acco: communication-overlapped ZeRO-1 optimizers (ACCO, DPU, CO2) for DeepSpeed.

Switch a DeepSpeed job to our optimizers by changing the config's optimizer type. Importing the
package registers the types in DeepSpeed: from then on ``deepspeed.initialize`` (and so the Hugging
Face Trainer and Accelerate, which call it) builds our engine for our types and leaves every other
call to DeepSpeed (:mod:`deepspeed_acco.registration`). :func:`deepspeed_acco.initialize` does the
same without the registration. Importing the package is light (no torch, no deepspeed): the
registration waits for deepspeed's own import, and everything heavy loads on first use.
"""
from . import registration as _registration

__version__ = "0.1.0"


def initialize(*args, **kwargs):
    """Drop-in for ``deepspeed.initialize``; see :func:`deepspeed_acco.runtime.initialize.initialize`."""
    from .runtime.initialize import initialize as _initialize
    return _initialize(*args, **kwargs)


def register_optimizer_type(schedule_class):
    """Make a :class:`~deepspeed_acco.runtime.schedule.Schedule` subclass selectable by its ``type_name``
    (in ``deepspeed_acco.initialize`` and, once registered, in ``deepspeed.initialize``)."""
    from .runtime.optimizers import register
    return register(schedule_class)


def type_names():
    """The optimizer types our engine runs (as written in the DeepSpeed config)."""
    from .runtime.optimizers import type_names as _type_names
    return _type_names()


# The one import-time action, and the point of importing the package in an unmodified training
# script: deepspeed.initialize learns our optimizer types (now, or when deepspeed is imported).
_registration.install()

__all__ = ["initialize", "register_optimizer_type", "type_names", "__version__"]
