"""Sample sets and bit-exact checks shared by the test modules (``from helpers import ...``).

``tests/`` has no ``__init__.py``, so pytest's default ``prepend`` import mode puts it on
``sys.path`` and this module imports as ``helpers``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from cupy_parallel import is_array, to_device
from cupy_parallel._src.testing import DTYPES

__all__ = ["DTYPES", "assert_bits_equal", "random_bits", "to_numpy"]


def random_bits(shape: tuple[int, ...], dtype: Any, seed: int = 0) -> np.ndarray:
    """An array of any dtype filled with random bytes (NaN payloads and -0.0 included)."""
    dtype = np.dtype(dtype)
    raw = np.random.default_rng(seed).integers(0, 256, (*shape, dtype.itemsize), dtype=np.uint8)
    if dtype == np.bool_:
        return (raw[..., 0] & 1).astype(np.bool_)
    return raw.view(dtype).reshape(shape)


def to_numpy(x: Any) -> np.ndarray:
    """A plain ``numpy.ndarray`` with the contents of an array on any device (or of host data)."""
    return np.asarray(to_device(x, "cpu") if is_array(x) else x)


def assert_bits_equal(actual: Any, expected: Any) -> None:
    """Same shape, dtype and bytes (NaNs compare by payload, -0.0 differs from 0.0)."""
    actual, expected = to_numpy(actual), to_numpy(expected)
    assert actual.shape == expected.shape
    assert actual.dtype == expected.dtype
    assert actual.tobytes() == expected.tobytes()
