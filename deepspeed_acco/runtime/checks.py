"""Generic checks of config values: the error every config mistake raises, finite numbers,
integers, booleans and the upper bounds of durations and counts; and the collection of every
problem of one config into one error.

The lowest module of the runtime: it imports only the standard library, so the config
(:mod:`.config`), the params of every optimizer type (:mod:`.optimizers.params`) and the types
themselves use the same checks without importing each other.

One pass over the config (docs/design.md, 2, "One pass"): the parser runs every check inside
:func:`collecting`; a check that finds a problem either raises (the rest of that check is skipped)
or calls :func:`report` (the check goes on), and :func:`attempt` lets the parser go on with the next
check after one that raised. At the end, one ``ValueError`` names every problem, one line each with
its key path and fix; a config with a single problem gets that problem's own message.
"""
import contextlib
import contextvars
import math
from typing import Any, Iterator, List, Optional

_PREFIX = "deepspeed_acco config: "
AUTO_WORD = "auto"


def config_error(key: str, problem: str, fix: str) -> ValueError:
    return ValueError(f"{_PREFIX}{key}: {problem}; {fix}")


def unfilled_auto_error(key: str) -> ValueError:
    """The error for an ``"auto"`` that reached the engine: only the HF Trainer and Accelerate fill them in."""
    return config_error(key, "\"auto\" was not filled in", "the HF Trainer and Accelerate replace \"auto\" with "
                        "their own values when they start the engine; outside them, write the value")


def number(key: str, value: Any) -> float:
    if value == AUTO_WORD:
        raise unfilled_auto_error(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise config_error(key, f"expected a finite number, got {value!r}", "set it to a number")
    return float(value)


def integer(key: str, value: Any) -> int:
    if value == AUTO_WORD:
        raise unfilled_auto_error(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise config_error(key, f"expected an integer, got {value!r}", "set it to an integer")
    return value


def boolean(key: str, value: Any) -> bool:
    if value == AUTO_WORD:
        raise unfilled_auto_error(key)
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


# ---- every problem of a config at once -----------------------------------------------------------
class ConfigProblems(ValueError):
    """Several problems of one config: the message has a header and then one line per problem."""

    def __init__(self, errors: List[ValueError]):
        self.errors = list(errors)
        lines = [_line(error) for error in self.errors]
        super().__init__(f"{_PREFIX}{len(lines)} problems; fix them all, then start again:\n"
                         + "\n".join(f"  {line}" for line in lines))


def _line(error: ValueError) -> str:
    text = str(error)
    return text[len(_PREFIX):] if text.startswith(_PREFIX) else text


def _key(error: ValueError) -> str:
    """The key path a message names (``"optimizer.params.lr"``), or the whole line."""
    line = _line(error)
    key, separator, _ = line.partition(": ")
    return key if separator and " " not in key else line


class _Collector:
    def __init__(self):
        self.errors: List[ValueError] = []

    def add(self, error: ValueError) -> None:
        for one in error.errors if isinstance(error, ConfigProblems) else [error]:
            # One line per key: a key whose value is wrong in one way is not reported again by a
            # later check that reads it.
            if _key(one) not in {_key(known) for known in self.errors}:
                self.errors.append(one)

    def raise_if_any(self) -> None:
        if len(self.errors) == 1:
            raise self.errors[0]
        if self.errors:
            raise ConfigProblems(self.errors)


_ACTIVE: contextvars.ContextVar[Optional[_Collector]] = contextvars.ContextVar("deepspeed_acco_config_problems",
                                                                              default=None)


@contextlib.contextmanager
def collecting() -> Iterator[_Collector]:
    """Collect the problems of every check inside; at the end raise one ``ValueError`` naming them all.

    Nested inside another ``collecting()`` it adds to the outer one, which raises."""
    outer = _ACTIVE.get()
    if outer is not None:
        yield outer
        return
    collector = _Collector()
    token = _ACTIVE.set(collector)
    try:
        yield collector
    except ValueError as error:
        collector.add(error)
    finally:
        _ACTIVE.reset(token)
    collector.raise_if_any()


def report(error: ValueError) -> None:
    """A problem found by a check that goes on: collected inside :func:`collecting`, else raised."""
    collector = _ACTIVE.get()
    if collector is None:
        raise error
    collector.add(error)


@contextlib.contextmanager
def attempt() -> Iterator[None]:
    """Run one check; inside :func:`collecting` a ``ValueError`` it raises is collected and the caller goes
    on with its next check. Outside, the error propagates as usual."""
    collector = _ACTIVE.get()
    if collector is None:
        yield
        return
    try:
        yield
    except ValueError as error:
        collector.add(error)


def problems_so_far() -> int:
    """How many problems the active :func:`collecting` holds (0 outside one)."""
    collector = _ACTIVE.get()
    return len(collector.errors) if collector is not None else 0
