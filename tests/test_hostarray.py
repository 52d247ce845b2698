"""The host array's contract beyond single operations: exits, version counters, the dispatch
guard, pickling, DLPack, dtypes and a random-program property against plain NumPy."""

from __future__ import annotations

import pickle
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
from helpers import DTYPES
from hypothesis import given
from hypothesis import strategies as st

import cupy_parallel as cp
from cupy_parallel import HostArray, empty, to_device
from cupy_parallel._src.hostarray import (
    check_device_dtype,
    host_array,
    host_buffer,
    set_dispatch_guard,
    version,
)
from cupy_parallel._src.memory import POOL_THRESHOLD


@pytest.fixture(autouse=True)
def _three_devices() -> None:
    cp.set_host_device_count(3)


def h(values: Any, device: str = "host:1") -> HostArray:
    return to_device(np.asarray(values), device)


# --------------------------------------------------------------------------------------------
# no implicit conversion (item 1)


@pytest.mark.parametrize(
    "convert",
    [np.asarray, np.array, np.ascontiguousarray, lambda x: np.zeros(3).__setitem__(..., x)],
    ids=["asarray", "array", "ascontiguousarray", "numpy[...]=h"],
)
def test_implicit_conversion_names_the_explicit_exits(convert: Any) -> None:
    with pytest.raises(
        TypeError,
        match=r"Implicit conversion of a device array to a NumPy array is not allowed.*"
        r"`\.get\(\)` or cupy_parallel\.to_device\(array, 'cpu'\)",
    ):
        convert(h([1.0, 2.0, 3.0]))


def test_get_and_set_follow_cupys_signatures() -> None:
    x = h(np.arange(6.0).reshape(2, 3))
    assert type(x.get()) is np.ndarray
    assert x.get(stream=None, order="F", out=None, blocking=True).flags.f_contiguous
    out = np.empty((2, 3))
    assert x.get(out=out) is out
    np.testing.assert_array_equal(out, np.arange(6.0).reshape(2, 3))
    with pytest.raises(TypeError, match=r"out has dtype float32; this array has float64"):
        x.get(out=np.empty((2, 3), np.float32))
    with pytest.raises(ValueError, match=r"out has shape \(3,\); this array has \(2, 3\)"):
        x.get(out=np.empty(3))
    x.set(np.ones((2, 3)), stream=None)
    assert x.get().tolist() == [[1.0] * 3] * 2
    with pytest.raises(TypeError, match=r"arr must be a numpy.ndarray, got list"):
        x.set([[0.0] * 3] * 2)
    with pytest.raises(ValueError, match=r"Cannot set to non-contiguous array"):
        x[:, ::2].set(np.zeros((2, 2)))


def test_host_array_is_not_an_ndarray_and_cannot_be_built_directly() -> None:
    x = h([1.0])
    assert not isinstance(x, np.ndarray)
    with pytest.raises(TypeError, match=r"cannot be constructed directly; use"):
        HostArray(np.zeros(1))


# --------------------------------------------------------------------------------------------
# what stays on the device (item 3)


def test_scalar_indexing_gives_a_0d_view_on_the_device() -> None:
    x = h([1.0, 2.0, 3.0])
    first = x[0]
    assert isinstance(first, HostArray)
    assert first.shape == ()
    assert first.device == cp.Device("host", 1)
    first[...] = 9.0  # a view, as in CuPy: writing it writes x
    assert x.get().tolist() == [9.0, 2.0, 3.0]
    assert [float(v) for v in x] == [9.0, 2.0, 3.0]
    assert all(isinstance(v, HostArray) for v in x)


def test_array_api_device_and_to_device() -> None:
    x = h([1, 2])
    assert x.device == cp.Device("host", 1)
    moved = x.to_device("host:2")
    assert moved.device == cp.Device("host", 2)
    assert moved.get().tolist() == [1, 2]
    assert x.to_device("host:1") is x
    assert type(x.to_device("cpu")) is np.ndarray
    assert x.__array_namespace__() is np


def test_like_creates_on_the_device_of_like() -> None:
    x = h([1.0], "host:2")
    for made in (np.asarray([1, 2], like=x), np.zeros(2, like=x), np.arange(2, like=x)):
        assert isinstance(made, HostArray)
        assert made.device == cp.Device("host", 2)


# --------------------------------------------------------------------------------------------
# pickling (item 6), DLPack (items 1 and 8)


def test_pickle_keeps_the_device() -> None:
    x = h([[1.5, 2.5]], "host:2")
    back = pickle.loads(pickle.dumps(x))
    assert back.device == x.device
    assert back.get().tolist() == [[1.5, 2.5]]


def test_unpickling_for_a_device_this_process_lacks_names_the_count() -> None:
    data = pickle.dumps(h([1.0], "host:2"))
    code = (
        "import pickle, sys, cupy_parallel as cp\n"
        "cp.set_host_device_count(2)\n"
        "try:\n"
        "    pickle.loads(sys.stdin.buffer.read())\n"
        "except ValueError as error:\n"
        "    print(error)\n"
    )
    env = {"CUPY_PARALLEL_PLATFORM": "host", "PATH": ""}
    out = subprocess.run(
        [sys.executable, "-c", code],
        input=data,
        capture_output=True,
        check=True,
        env=env,
        timeout=60,
    )
    assert out.stdout.decode().strip() == (
        "Cannot unpickle an array of host:2: device host:2 does not exist: there are 2 host "
        "devices (set CUPY_PARALLEL_HOST_DEVICES or call set_host_device_count)."
    )


def test_dlpack_exports_only_an_explicit_copy_to_the_cpu() -> None:
    x = h([1.0, 2.0])
    with pytest.raises(BufferError, match=r"DLPack exports it only to a consumer asking for"):
        np.from_dlpack(x)
    copy = np.from_dlpack(x, device="cpu")
    copy[0] = 5.0
    assert x.get().tolist() == [1.0, 2.0]  # a copy, never a view of device memory
    assert x.__dlpack_device__() == (1, 0)


class _Producer:
    """A DLPack producer that is not ours (as a torch CPU tensor or a JAX array)."""

    def __init__(self, data: np.ndarray) -> None:
        self._data = data

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self._data.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self._data.__dlpack_device__()


@pytest.mark.parametrize("target", ["cpu", "host:2"])
def test_to_device_accepts_any_dlpack_producer_and_copies(target: str) -> None:
    data = np.arange(4.0)
    moved = to_device(_Producer(data), target)
    assert cp.device_of(moved) == cp.as_device(target)
    data[0] = 7.0  # the result does not alias the producer's memory
    assert to_device(moved, "cpu").tolist() == [0.0, 1.0, 2.0, 3.0]


def test_to_device_refuses_what_is_neither_array_nor_producer() -> None:
    with pytest.raises(
        TypeError,
        match=r"array must be a numpy.ndarray, HostArray, cupy.ndarray or a DLPack producer, got "
        r"list",
    ):
        to_device([1.0], "host:0")


# --------------------------------------------------------------------------------------------
# dtypes CuPy lacks (item 5): refused at every size


UNSUPPORTED = [
    np.dtype(object),
    np.dtype("U3"),
    np.dtype("S3"),
    np.dtype("datetime64[s]"),
    np.dtype("timedelta64[ms]"),
    np.dtype([("a", np.int32), ("b", np.float64)]),
    np.dtype("V8"),
    np.dtype(np.longdouble),
    np.dtypes.StringDType(),
    np.dtype(">f8" if np.little_endian else "<f8"),  # CuPy refuses non-native byte order
]


@pytest.mark.parametrize("dtype", UNSUPPORTED, ids=str)
@pytest.mark.parametrize("count", [1, 1 + POOL_THRESHOLD // 4], ids=["small", "pooled"])
def test_dtypes_cupy_lacks_are_refused_by_to_device_and_empty(dtype: Any, count: int) -> None:
    match = r"a dtype device arrays cannot hold \(CuPy has bool, integer, float16/32/64"
    with pytest.raises(TypeError, match=rf"array's dtype is .*, {match}"):
        to_device(np.zeros(count, dtype), "host:0")
    with pytest.raises(TypeError, match=rf"dtype is .*, {match}"):
        empty((count,), dtype, "host:0")
    assert empty((count,), dtype, "cpu").dtype == dtype  # the cpu holds any NumPy dtype


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_every_dtype_cupy_has_is_accepted(dtype: Any) -> None:
    assert check_device_dtype(dtype, "dtype") == np.dtype(dtype)
    assert empty((2,), dtype, "host:0").dtype == dtype


# --------------------------------------------------------------------------------------------
# version counters and the dispatch guard (CONTRACTS.md 2)


IN_PLACE = {
    "setitem": lambda x: x.__setitem__(0, 1.0),
    "iadd": lambda x: x.__iadd__(1.0),
    "out=": lambda x: np.add(x, 1.0, out=x),
    "fill": lambda x: x.fill(2.0),
    "set": lambda x: x.set(np.zeros(4)),
    "copyto": lambda x: np.copyto(x, 3.0),
    "sort": lambda x: x.sort(),
    "put": lambda x: x.put([0], [5.0]),
    "np.put": lambda x: np.put(x, [0], [5.0]),
    "ufunc.at": lambda x: np.add.at(x, [0], 1.0),
    "method out=": lambda x: x[:2].cumsum(out=x[2:]),
    "function out=": lambda x: np.einsum("i,i->i", x, x, out=x),
    "positional out": lambda x: np.dot(x[:1], x[:1], x[0]),
    "nan_to_num(copy=False)": lambda x: np.nan_to_num(x, copy=False),
}


@pytest.mark.parametrize("write", IN_PLACE.values(), ids=IN_PLACE.keys())
def test_every_in_place_write_counts_for_every_view(write: Any) -> None:
    x = h(np.arange(4.0))
    view = x[1:]
    other = h(np.arange(4.0))
    assert version(x) == version(view) == 0
    write(x)
    assert version(x) == version(view) == 1
    assert version(other) == 0
    _ = x + 1, x.sum(), x[0], np.exp(x), np.einsum("i,i->", x, x)  # reads do not count
    assert version(x) == 1
    assert version(np.zeros(2)) is None


def test_the_guard_sees_every_computation_and_can_refuse_it() -> None:
    x = h([1.0, 2.0])
    seen: list[str] = []

    def guard(operation: str, operands: tuple[Any, ...]) -> None:
        seen.append(operation)
        if operation in ("operator +=", "numpy.multiply"):
            raise TypeError(f"refused {operation}")

    set_dispatch_guard(guard)
    try:
        _ = x + 1
        _ = np.exp(x)
        _ = np.concatenate([x, x])
        _ = x.sum()
        _ = x[0], x.T, x.shape  # indexing and metadata are not computations
        with pytest.raises(TypeError, match=r"refused operator \+="):
            x += 1
        with pytest.raises(TypeError, match=r"refused numpy.multiply"):
            np.multiply(x, 2.0, out=x)
    finally:
        set_dispatch_guard(None)
    assert seen == [
        "operator +",
        "numpy.exp",
        "numpy.concatenate",
        "HostArray.sum",
        "operator +=",
        "numpy.multiply",
    ]
    assert x.get().tolist() == [1.0, 2.0]  # refused before writing
    assert version(x) == 0


def test_internal_wrapping_shares_the_buffer() -> None:
    buffer = np.arange(3)
    x = host_array(buffer, cp.Device("host", 0))
    assert host_buffer(x) is buffer
    with pytest.raises(TypeError, match=r"guard must be callable or None, got int"):
        set_dispatch_guard(3)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# the property: random NumPy programs on host arrays equal plain NumPy, bit for bit

_UNARY = [np.negative, np.absolute, np.exp, np.tanh, np.sin, np.floor, np.square, np.sign]
_BINARY = [np.add, np.subtract, np.multiply, np.maximum, np.minimum, np.hypot, np.arctan2]
_SCALARS = [0.5, -2, 3.0, np.float32(1.5), True]


def _step(xp_arrays: list[Any], choice: tuple[Any, ...]) -> None:
    """Apply one program step to ``xp_arrays`` (host arrays or NumPy arrays), appending results."""
    kind, a, b, extra = choice
    x = xp_arrays[a % len(xp_arrays)]
    y = xp_arrays[b % len(xp_arrays)]
    same = x.shape == y.shape
    if kind == "unary":
        xp_arrays.append(_UNARY[extra % len(_UNARY)](x))
    elif kind == "binary" and same:
        xp_arrays.append(_BINARY[extra % len(_BINARY)](x, y))
    elif kind == "scalar":
        xp_arrays.append(x * _SCALARS[extra % len(_SCALARS)] + 1)
    elif kind == "operator" and same:
        xp_arrays.append([x + y, x - y, x * y, x / (abs(y) + 1), x**2][extra % 5])
    elif kind == "matmul" and same and x.ndim in (1, 2):
        xp_arrays.append(x @ y.T)
    elif kind == "reduce" and x.ndim:
        axis = extra % x.ndim
        xp_arrays.append([x.sum, x.mean, x.max, x.cumsum][extra % 4](axis=axis))
    elif kind == "shape" and x.ndim:
        xp_arrays.append([x.T, x.reshape(-1), x[::-1], x[..., None], x.copy()][extra % 5])
    elif kind == "index" and x.ndim:
        element = x[extra % x.shape[0]]
        if isinstance(element, np.generic):  # NumPy copies; CuPy's x[k] is a 0-d view, as x[k, ...]
            element = x[extra % x.shape[0], ...]
        xp_arrays.append(element)
    elif kind == "where" and same:
        xp_arrays.append(np.where(x > y, x, y))
    elif kind == "concatenate" and x.ndim and same:
        xp_arrays.append(np.concatenate([x, y]))
    elif kind == "inplace" and x.ndim and same and x.dtype == y.dtype:
        x += y
    elif kind == "setitem" and x.ndim:
        x[extra % x.shape[0]] = _SCALARS[extra % len(_SCALARS)]
    elif kind == "astype":
        xp_arrays.append(x.astype([np.float32, np.float64, np.int64][extra % 3]))


_STEP = st.tuples(
    st.sampled_from(
        [
            "unary",
            "binary",
            "scalar",
            "operator",
            "matmul",
            "reduce",
            "shape",
            "index",
            "where",
            "concatenate",
            "inplace",
            "setitem",
            "astype",
        ]
    ),
    st.integers(0, 50),
    st.integers(0, 50),
    st.integers(0, 50),
)


@given(
    start=st.lists(st.floats(-4, 4, width=64), min_size=6, max_size=6),
    program=st.lists(_STEP, min_size=1, max_size=20),
)
def test_random_programs_equal_numpy_bit_for_bit_and_stay_on_the_device(
    start: list[float], program: list[tuple[Any, ...]]
) -> None:
    base = np.array(start).reshape(2, 3)
    plain: list[Any] = [base.copy(), base[::-1].copy()]
    placed: list[Any] = [to_device(a, "host:2") for a in plain]
    with np.errstate(all="ignore"):
        for choice in program:
            _step(plain, choice)
            _step(placed, choice)
            plain[-1] = np.asarray(plain[-1])  # NumPy's scalar results as the 0-d arrays they are
    assert len(placed) == len(plain)
    for got, want in zip(placed, plain, strict=True):
        assert isinstance(got, HostArray)
        assert got.device == cp.Device("host", 2)
        expected = np.asarray(want)  # NumPy gives scalars where device arrays stay 0-d
        assert (got.dtype, got.shape) == (expected.dtype, expected.shape)
        assert got.get().tobytes() == expected.tobytes()
