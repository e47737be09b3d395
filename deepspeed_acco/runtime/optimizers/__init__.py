"""The optimizer types, one module each, and the registry that maps config names to them.

A type is a :class:`~deepspeed_acco.runtime.schedule.Schedule` subclass with ``type_name``,
``Params`` (its kw_only params dataclass), ``Phase`` and ``boundary()``. Adding one is a file
here plus a :func:`register` line below (or a call from user code before ``initialize``).
"""
from typing import Dict, List, Optional, Type

from ..schedule import Schedule
from .acco import ACCO
from .co2 import CO2
from .dpu import DPU
from .sharded_adamw import ShardedAdamW

REGISTRY: Dict[str, Type[Schedule]] = {}


def register(schedule_class: Type[Schedule]) -> Type[Schedule]:
    """Make ``schedule_class`` selectable as ``"optimizer": {"type": schedule_class.type_name}``."""
    for attribute in ("type_name", "Params", "Phase"):
        if not hasattr(schedule_class, attribute):
            raise TypeError(f"{schedule_class.__name__} cannot be registered: it has no {attribute}")
    key = schedule_class.type_name.lower()
    existing = REGISTRY.get(key)
    if existing is not None and existing is not schedule_class:
        raise ValueError(f"optimizer type {schedule_class.type_name!r} is already registered by {existing.__name__}")
    REGISTRY[key] = schedule_class
    return schedule_class


def lookup(type_name) -> Optional[Type[Schedule]]:
    """The schedule class registered under ``type_name`` (case-insensitive), or None."""
    if not isinstance(type_name, str):
        return None
    return REGISTRY.get(type_name.lower())


def type_names() -> List[str]:
    return [cls.type_name for cls in REGISTRY.values()]


register(ShardedAdamW)
register(DPU)
register(ACCO)
register(CO2)
