"""Reading arguments at public entries: one reader per kind of value, for the whole package.

Every public function checks its arguments once, at the edge, before any state changes, and says
which argument was wrong, what was expected and what it got (JAX's ``api_util`` is the model).
These readers are the only place such checks are written:

- :func:`read_int`: a Python or NumPy integer (never ``bool``), optionally bounded below;
- :func:`read_bool`: a Python or NumPy bool;
- :func:`read_real`: a Python or NumPy real number (never ``bool``), as a float;
- :func:`read_timeout`: seconds as ``datetime.timedelta``, ``int`` or ``float`` (finite, >= 0, or
  > 0 with ``positive=True``), returned as float seconds, the one timeout convention;
- :func:`read_sequence`: a sequence of devices, arrays, sizes or per-replica entries, read once
  into a tuple. The one rule for what counts as a sequence: any iterable except a string
  (``str``, ``bytes``, ``bytearray``), a mapping and an array (anything with an array protocol),
  each of which would otherwise be iterated into characters, keys or rows by mistake. A generator
  is read once, so the caller may iterate the result as often as it needs;
- :func:`read_mapping`: keyword arguments (any ``Mapping``);
- :func:`read_callable`: a callable;
- :func:`read_axis`: an axis of an ``ndim``-d array in ``[0, ndim)``, negative counting from
  the end (NumPy's ``normalize_axis_index``; out of range is NumPy's ``AxisError``, which is a
  ``ValueError`` and an ``IndexError``).

:class:`ArgumentError` is the one exception for the few places where our convention
(``TypeError`` for a wrong type) and torch's (``ValueError``) disagree: it is both, so that code
ported from torch catches it as torch's and ours alike.

This module is the bottom layer: it imports nothing from the package (NumPy only).
"""

from __future__ import annotations

import math
import reprlib
from collections.abc import Callable, Iterable, Mapping
from datetime import timedelta
from typing import Any

import numpy as np
from numpy.exceptions import AxisError
from numpy.lib.array_utils import normalize_axis_index

__all__ = [
    "ArgumentError",
    "CheckedArgumentError",
    "CheckedValueError",
    "read_axis",
    "read_bool",
    "read_callable",
    "read_int",
    "read_mapping",
    "read_real",
    "read_sequence",
    "read_timeout",
]

_ARRAY_PROTOCOLS = (
    "__array_namespace__",
    "__array__",
    "__array_interface__",
    "__cuda_array_interface__",
    "__dlpack__",
)


class ArgumentError(TypeError, ValueError):
    """A wrong argument where torch raises ``ValueError`` and our convention says ``TypeError``.

    Raised for a wrong type (a ``TypeError``, as everywhere in this library) where torch raises
    ``ValueError``: ``Backend(None)``, ``PrefixStore(prefix, None)``, an entry of
    ``batch_isend_irecv``'s list that is not a ``P2POp``, arrays of different dtypes in one
    collective, ``ReduceOp.MIN``/``MAX`` on complex arrays. ``except ValueError`` (torch's
    tests) and ``except TypeError`` both catch it.

    Example:
        >>> issubclass(ArgumentError, TypeError), issubclass(ArgumentError, ValueError)
        (True, True)
    """


class CheckedValueError(ValueError, RuntimeError):
    """A wrong value that torch's process-group backends refuse in C++, with ``RuntimeError``.

    torch checks a collective's root rank, list lengths, array sizes, split sizes, tags and
    contiguity in its backends (``ProcessGroupGloo::allgather: invalid tensor size``, ``invalid
    root rank``, ``Tag must be nonnegative``), whose checks raise ``RuntimeError``; ours are
    ``ValueError``, as everywhere in this library. This error is both, so that ``except
    RuntimeError`` in ported torch code and ``except ValueError`` catch it.

    Example:
        >>> issubclass(CheckedValueError, ValueError), issubclass(CheckedValueError, RuntimeError)
        (True, True)
    """


class CheckedArgumentError(ArgumentError, RuntimeError):
    """Different dtypes in one collective: a ``TypeError``, ``ValueError`` and ``RuntimeError``.

    Ours is a ``TypeError``; torch raises ``ValueError`` from its Python checks (``all_gather``)
    and ``RuntimeError`` from its backends (``all_gather_into_tensor``,
    ``reduce_scatter_tensor``): each of the three catches it.

    Example:
        >>> [issubclass(CheckedArgumentError, t) for t in (TypeError, ValueError, RuntimeError)]
        [True, True, True]
    """


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


def read_real(value: Any, name: str, /, *, expected: str = "a real number") -> float:
    """``value`` as a ``float``: Python and NumPy integers and floats; ``bool`` is refused.

    ``expected`` completes "``name`` must be ..." (say the range the caller then checks).

    Example:
        >>> read_real(np.float32(0.5), "fraction"), read_real(2, "atol")
        (0.5, 2.0)
        >>> read_real("half", "fraction", expected="a number in [0, 1]")
        Traceback (most recent call last):
        ...
        TypeError: fraction must be a number in [0, 1], got str 'half'.
    """
    if isinstance(value, bool | np.bool_) or not isinstance(
        value, int | float | np.integer | np.floating
    ):
        raise TypeError(f"{name} must be {expected}, got {type(value).__name__} {value!r}.")
    return float(value)


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


def read_sequence(
    value: Any, name: str, /, *, expected: str, hint: str = "", lists_only: bool = False
) -> tuple[Any, ...]:
    """``value`` as a tuple: any iterable except a string, a mapping or an array.

    ``expected`` completes "``name`` must be ..." in the message, ``hint`` (optional) says how to
    fix the call. Entries are not checked: the caller reads each one with its own reader.
    ``lists_only=True`` is the second rule, torch's for the lists a collective fills or reads in
    place, ``gradcheck``'s inputs and a store's keys: a ``list`` or ``tuple`` only.

    Example:
        >>> read_sequence(["host:0", "host:1"], "devices", expected="a sequence of devices")
        ('host:0', 'host:1')
        >>> read_sequence((k for k in range(3)), "sizes", expected="a sequence of ints")
        (0, 1, 2)
        >>> read_sequence("host:0", "devices", expected="a sequence of devices",
        ...               hint="wrap a single device as [device]")
        Traceback (most recent call last):
        ...
        TypeError: devices must be a sequence of devices, got str 'host:0'; wrap a single device as [device].
        >>> read_sequence({"k"}, "keys", expected="a list of str", lists_only=True)
        Traceback (most recent call last):
        ...
        TypeError: keys must be a list of str, got set {'k'}.
    """  # noqa: E501 - a doctest's expected output is one line
    if (
        isinstance(value, str | bytes | bytearray | Mapping)
        or any(hasattr(type(value), protocol) for protocol in _ARRAY_PROTOCOLS)
        or not isinstance(value, list | tuple if lists_only else Iterable)
    ):
        fix = f"; {hint}" if hint else ""
        raise TypeError(
            f"{name} must be {expected}, got {type(value).__name__} {reprlib.repr(value)}{fix}."
        )
    return tuple(value)


def read_mapping(
    value: Any, name: str, /, *, expected: str = "a mapping of keyword arguments"
) -> Mapping[str, Any]:
    """``value`` if it is a ``Mapping``; ``expected`` completes "``name`` must be ...".

    Example:
        >>> read_mapping({"scale": 2.0}, "kwargs")
        {'scale': 2.0}
        >>> read_mapping([1], "module_kwargs", expected="a mapping or None")
        Traceback (most recent call last):
        ...
        TypeError: module_kwargs must be a mapping or None, got list [1].
    """
    if not isinstance(value, Mapping):
        raise TypeError(
            f"{name} must be {expected}, got {type(value).__name__} {reprlib.repr(value)}."
        )
    return value


def read_callable(value: Any, name: str, /, *, call: str = "") -> Callable[..., Any]:
    """``value`` if it is callable; ``call`` (optional) shows how it will be called.

    Example:
        >>> read_callable(len, "fn") is len
        True
        >>> read_callable("mlp", "fn", call="fn(params, *inputs)")
        Traceback (most recent call last):
        ...
        TypeError: fn must be callable as fn(params, *inputs), got str 'mlp'.
    """
    if not callable(value):
        how = f" as {call}" if call else ""
        raise TypeError(
            f"{name} must be callable{how}, got {type(value).__name__} {reprlib.repr(value)}."
        )
    return value


def read_axis(value: Any, ndim: int, name: str = "axis", /, *, of: str = "array") -> int:
    """``value`` as an axis of the ``ndim``-d ``of``, in ``[0, ndim)``; negative counts from the end.

    An int is read with :func:`read_int`; one out of range raises NumPy's ``AxisError`` (a
    ``ValueError`` and an ``IndexError``) with a message naming ``name``, the range and ``of``.

    Example:
        >>> read_axis(-1, 3, "dim"), read_axis(1, 3, "dim")
        (2, 1)
        >>> read_axis(2, 2, "dim", of="array x")
        Traceback (most recent call last):
        ...
        numpy.exceptions.AxisError: dim must be in [-2, 1] for the 2-d array x, got 2; pass a dim in that range or reshape the array.
    """  # noqa: E501 - a doctest's expected output is one line
    axis = read_int(value, name)
    try:
        return int(normalize_axis_index(axis, ndim))
    except AxisError:
        if ndim == 0:
            raise AxisError(
                f"{name} must be an axis of the {of}, but it is 0-d and has none, got {axis}; "
                "reshape it to at least one dimension (e.g. x.reshape(1))."
            ) from None
        raise AxisError(
            f"{name} must be in [{-ndim}, {ndim - 1}] for the {ndim}-d {of}, got {axis}; pass a "
            f"{name} in that range or reshape the array."
        ) from None
