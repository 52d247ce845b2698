"""Sample sets and bit-exact checks shared by the test modules (``from helpers import ...``).

``tests/`` has no ``__init__.py``, so pytest's default ``prepend`` import mode puts it on
``sys.path`` and this module imports as ``helpers``.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

from cupy_parallel import is_array, to_device
from cupy_parallel._src.testing import DTYPES

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

__all__ = [
    "DTYPES",
    "assert_bits_equal",
    "on_each_kind_of_stream",
    "random_bits",
    "stream_environment",
    "to_numpy",
]


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


@contextlib.contextmanager
def stream_environment(kind: str) -> Iterator[str]:
    """The environment under which ``simulated_cuda`` gives threads ``kind`` current streams.

    ``legacy``: the legacy null stream, which every thread shares (CuPy's default);
    ``non-blocking``: every thread starts with a non-blocking stream of its own
    (``CUPY_PARALLEL_SIMULATED_STREAMS``); ``per-thread``:
    ``CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=1``. Ordering that only the legacy stream's sharing
    provided raises ``RaceError`` in the other two (issue 37).
    """
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("CUPY_PARALLEL_SIMULATED_STREAMS", raising=False)
        patch.delenv("CUPY_CUDA_PER_THREAD_DEFAULT_STREAM", raising=False)
        if kind == "non-blocking":
            patch.setenv("CUPY_PARALLEL_SIMULATED_STREAMS", "non-blocking")
        elif kind == "per-thread":
            patch.setenv("CUPY_CUDA_PER_THREAD_DEFAULT_STREAM", "1")
        yield kind


def on_each_kind_of_stream(test: Callable[..., Any]) -> Callable[..., Any]:
    """Run a ``test(ranks)`` of NCCL thread ranks on each kind of current stream.

    3 ranks on the legacy stream, 2 on a non-blocking stream per thread and 2 on CuPy's
    per-thread default stream (conftest's ``simulated_streams`` fixture sets the environment).
    """
    test = pytest.mark.usefixtures("simulated_streams")(test)
    return pytest.mark.parametrize(
        ("ranks", "simulated_streams"),
        [(3, "legacy"), (2, "non-blocking"), (2, "per-thread")],
        ids=["3ranks", "2ranks-non-blocking", "2ranks-per-thread"],
        indirect=["simulated_streams"],
    )(test)
