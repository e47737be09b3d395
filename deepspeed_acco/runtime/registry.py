"""The registry of optimizer types: config name -> :class:`~deepspeed_acco.runtime.schedule.Schedule` subclass.

It imports nothing of the package, so that the schedule (which looks up a checkpoint's saved type)
and the types (which subclass the schedule) both import it and imports still go one way. The
built-in types are registered by :mod:`deepspeed_acco.runtime.optimizers`, which the config parser
and the builder import before any lookup; user code adds types with
``deepspeed_acco.register_optimizer_type``.
"""
from typing import Dict, List, Optional

REGISTRY: Dict[str, type] = {}
"""Lower-case type name -> Schedule subclass."""


def register(schedule_class: type) -> type:
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


def lookup(type_name) -> Optional[type]:
    """The schedule class registered under ``type_name`` (case-insensitive), or None."""
    if not isinstance(type_name, str):
        return None
    return REGISTRY.get(type_name.lower())


def type_names() -> List[str]:
    return [cls.type_name for cls in REGISTRY.values()]
