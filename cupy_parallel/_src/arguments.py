"""Reading arguments at public entries: one reader per kind of value, for the whole package.

Every public function checks its arguments once, at the edge, before any state changes, and says
which argument was wrong, what was expected and what it got (JAX's ``api_util`` is the model).
These readers are the only place such checks are written:

- :func:`read_int`: a Python or NumPy integer (never ``bool``), optionally bounded below;
- :func:`read_bool`: a Python or NumPy bool;
- :func:`read_timeout`: seconds as ``datetime.timedelta``, ``int`` or ``float`` (finite, >= 0, or
  > 0 with ``positive=True``), returned as float seconds, the one timeout convention.

This module is the bottom layer: it imports nothing from the package.
"""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any

import numpy as np

__all__ = ["read_bool", "read_int", "read_timeout"]


def read_int(value: Any, name: str, /, *, minimum: int | None = None) -> int:
    """``value`` as an ``int``: Python and NumPy integers are accepted, ``bool`` is refused.

    Example:
        >>> import numpy as np
        >>> read_int(np.int64(3), "rank"), read_int(-1, "src")
        (3, -1)
        >>> read_int(True, "rank")
        Traceback (most recent call last):
        ...
        TypeError: rank must be an int, got bool True.
        >>> read_int(-2, "world_size", minimum=1)
        Traceback (most recent call last):
        ...
        ValueError: world_size must be >= 1, got -2.
    """
    if isinstance(value, bool | np.bool_) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}.")
    number = int(value)
    if minimum is not None and number < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {number}.")
    return number


def read_bool(value: Any, name: str, /) -> bool:
    """``value`` as a ``bool``: Python and NumPy booleans only (``0``/``1`` are refused).

    Example:
        >>> import numpy as np
        >>> read_bool(np.True_, "async_op")
        True
        >>> read_bool(1, "async_op")
        Traceback (most recent call last):
        ...
        TypeError: async_op must be a bool, got int 1.
    """
    if not isinstance(value, bool | np.bool_):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}.")
    return bool(value)


def read_timeout(value: Any, name: str = "timeout", /, *, positive: bool = True) -> float:
    """A timeout as float seconds, from a ``datetime.timedelta`` or a number of seconds.

    ``positive=True`` (the default) requires more than 0 seconds; ``positive=False`` admits 0
    (a non-blocking poll). Infinite, NaN, negative and boolean values are refused.

    Example:
        >>> read_timeout(timedelta(minutes=1)), read_timeout(2), read_timeout(0.5)
        (60.0, 2.0, 0.5)
        >>> read_timeout(0, "wait timeout")
        Traceback (most recent call last):
        ...
        ValueError: wait timeout must be more than 0 seconds, got 0.
    """
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, bool | np.bool_) or not isinstance(
        value, int | float | np.integer | np.floating
    ):
        raise TypeError(
            f"{name} must be a datetime.timedelta or a number of seconds, "
            f"got {type(value).__name__} {value!r}."
        )
    else:
        seconds = float(value)
    if not math.isfinite(seconds) or seconds < 0 or (positive and seconds == 0):
        bound = "more than 0" if positive else "at least 0"
        raise ValueError(f"{name} must be {bound} seconds, got {value!r}.")
    return seconds
