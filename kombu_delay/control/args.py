"""The checks of :class:`~kombu_delay.DelayControl`'s arguments: a wrong type is a
``TypeError`` and a value out of range a ``ValueError``, each naming the argument, before
anything reaches Redis (where it failed on an attribute, or was taken for something else)."""

from __future__ import annotations

import math
import numbers
from decimal import Decimal
from typing import Any

from kombu_delay.message import is_text
from kombu_delay.store import keys
from kombu_delay.store.listing import Cursor


def whole(name: str, value: Any, least: int = 1) -> int:
    """``value``, a whole number (no bool) of at least ``least``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} is a whole number, not {type(value).__name__}")
    if value < least:
        raise ValueError(f"{name} must be at least {least}, got {value}")
    return value


def queue_name(value: Any) -> str:
    """``value``, a queue's name."""
    if not isinstance(value, str):
        raise TypeError(f"a queue is named by a str, not {type(value).__name__}")
    if not is_text(value):  # a lone surrogate: kombu could not have published to it
        raise ValueError(f"the queue name {value!r} is not UTF-8 text")
    return value


def cursor(value: Any) -> Cursor | None:
    """The position ``value`` names: a ``cursor`` a page of ``scheduled()`` returned, or None."""
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise TypeError(f"a cursor is a str, not {type(value).__name__}")
    try:
        return Cursor.parse(value)
    except ValueError:
        raise ValueError(f"not a cursor of scheduled(): {value!r}") from None


def countdown_seconds(value: Any) -> float:
    """``value``, a finite number of seconds (no bool, no text), kept within
    ``±MAX_DUE_MS`` s: bounded before ``* 1000``, which overflows a float near 1e305 s, and that
    far either way is past the ceiling or before the epoch, so no outcome changes."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real | Decimal):
        raise TypeError(f"countdown is a number of seconds, not {type(value).__name__}")
    # Judged on the value itself: a finite one past any float (10**400, Decimal("1e400"), a
    # numpy longdouble) is as far past the clamp as its sign says; NaN and ±inf of any kind
    # (numpy's float32 too) are refused.
    if (
        (value.is_nan() or value.is_infinite())
        if isinstance(value, Decimal)
        else (value != value or value in (math.inf, -math.inf))
    ):
        raise ValueError(f"countdown {value} is not a finite number of seconds")
    try:
        seconds = float(value)  # (float() took True, "5", b"5" and `or 0` took [])
    except OverflowError:
        seconds = math.inf if value > 0 else -math.inf  # type: ignore[operator]
    return min(max(seconds, -keys.MAX_DUE_MS), keys.MAX_DUE_MS)
