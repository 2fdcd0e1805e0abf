"""Checks of settings' fields, shared by the frozen dataclasses that take settings
(`SamplingParams`, `EngineConfig`, `SchedulerConfig`, `Qwen3Config`): each field's conversion,
its test and what it allows in words, with one error message for all (pure Python and numpy)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import fields
from typing import Any

import numpy as np

Check = tuple[Callable[[Any], Any], Callable[[Any], bool] | None, str]


def check_fields(
    instance: object, checks: dict[str, Check], prefix: str = "", optional: set[str] = frozenset()
) -> None:
    """Replaces each field of a frozen dataclass `instance` named in `checks` by its converted
    value, in the order of `checks`; fields whose default is None, and the `optional` ones, may
    also be None.

    Args:
        checks: field name -> (its conversion, None where the value is refused; a test of the
            converted value, or None; what is allowed, in words).

    Raises:
        ValueError: "{prefix}{name} must be {allowed}, got {value}" for the first field refused.
    """
    optional = optional | {f.name for f in fields(instance) if f.default is None}
    for name, (convert, ok, allowed) in checks.items():
        value = getattr(instance, name)
        if value is None and name in optional:
            continue
        converted = convert(value)
        if converted is None or (ok is not None and not ok(converted)):
            raise ValueError(f"{prefix}{name} must be {allowed}, got {shown(value)}")
        object.__setattr__(instance, name, converted)


def as_int(value: object) -> int | None:
    """`value` as a Python int if it is an integer (numpy's included, bools not), else None."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        return None
    return int(value)


def as_real(value: object) -> float | None:
    """`value` as a Python float if it is a real number other than NaN (integers and numpy
    scalars included, bools not), else None; integers too large for a float give inf."""
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        return None
    try:
        real = float(value)
    except OverflowError:
        real = math.inf if value > 0 else -math.inf
    return None if math.isnan(real) else real


def as_bool(value: object) -> bool | None:
    """`value` as a Python bool if it is one (numpy's included), else None."""
    return bool(value) if isinstance(value, bool | np.bool_) else None


def check_flag(name: str, value: object) -> None:
    """Raises TypeError unless `value`, an argument `name`, is True or False: a truthy string
    ("false") must not turn a flag on."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {shown(value)}")


def as_str(value: object) -> str | None:
    """`value` as a Python str if it is one, else None."""
    return str(value) if isinstance(value, str) else None


def shown(value: object, limit: int = 80) -> str:
    """`value`'s repr for an error message, cut to about `limit` characters."""
    try:
        text = repr(value)
    except ValueError:  # an int past Python's digit limit of str()
        text = f"<an int of {value.bit_length()} bits>"
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def as_tuple(value: object, convert: Callable[[Any], Any]) -> tuple | None:
    """A string as a tuple of itself; a list, tuple, set or 1-d array as the tuple of `convert`
    of each item. None where the value or an item (`convert` gives None) is not allowed."""
    items = (value,) if isinstance(value, str) else value
    if isinstance(items, np.ndarray) and items.ndim != 1:
        return None
    if not isinstance(items, list | tuple | set | frozenset | np.ndarray):
        return None
    converted = tuple(convert(item) for item in items)
    return None if None in converted else converted


FLAG: Check = (as_bool, None, "True or False")
