"""Generic checks of config values: the error every config mistake raises, and finite numbers,
integers and booleans.

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
