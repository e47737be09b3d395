"""The optimizer types, one module each, registered under their config names.

A type is a :class:`~deepspeed_acco.runtime.schedule.Schedule` subclass with ``type_name``,
``Params`` (its kw_only params dataclass), ``Phase`` and ``boundary()``. Adding one is a file
here plus a :func:`register` line below (or a call from user code before ``initialize``). The
registry itself is :mod:`deepspeed_acco.runtime.registry`.
"""
from ..registry import lookup, register, type_names
from .acco import ACCO
from .co2 import CO2
from .dpu import DPU
from .sharded_adamw import ShardedAdamW

register(ShardedAdamW)
register(DPU)
register(ACCO)
register(CO2)

__all__ = ["lookup", "register", "type_names", "ACCO", "CO2", "DPU", "ShardedAdamW"]
