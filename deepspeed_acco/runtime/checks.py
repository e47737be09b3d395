"""Generic checks of config values: the error every config mistake raises, finite numbers,
integers, booleans, and the upper bounds of durations and counts.

The lowest module of the runtime: it imports only the standard library, so the config
(:mod:`.config`), the params of every optimizer type (:mod:`.optimizers.params`) and the types
themselves use the same checks without importing each other.
"""
import math
from typing import Any


def config_error(key: str, problem: str, fix: str) -> ValueError:
    return ValueError(f"deepspeed_acco config: {key}: {problem}; {fix}")


def number(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise config_error(key, f"expected a finite number, got {value!r}", "set it to a number")
    return float(value)


def integer(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise config_error(key, f"expected an integer, got {value!r}", "set it to an integer")
    return value


def boolean(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise config_error(key, f"expected true or false, got {value!r}", "set it to a JSON boolean")
    return value


MAX_COUNT = 2**31 - 1
"""The upper bound of every count key (micro-batches, updates, steps, ranks, a loss-scale window):
no run comes near it, so a larger value is a mistake (a unit or an exponent typed wrong)."""
MAX_DURATION_S = 365 * 24 * 3600.0
"""The upper bound of every duration key, in seconds (one year). A timeout only decides when a hang
is reported; larger values overflow ``datetime.timedelta`` (about 8.6e13 s) or the process
groups' millisecond timeouts on the way."""


def at_most(key: str, value, limit, fix: str, limit_text: str = ""):
    """``value`` if it is at most ``limit``; else the config error naming ``key`` and ``fix``."""
    if value > limit:
        raise config_error(key, f"must be at most {limit:,.0f}{limit_text}, got {value!r}", fix)
    return value


def count_at_most(key: str, value, limit: int = MAX_COUNT):
    """A count key up to :data:`MAX_COUNT` (or ``limit``)."""
    return at_most(key, value, limit, "use a smaller count; a run never comes near this one, so it is a mistake "
                                      "(check the unit)")
