"""cupy_parallel.comm on host devices, against NumPy oracles (np.split, np.concatenate, +)."""

from __future__ import annotations

import contextlib
import functools
import gc
import itertools
from typing import Any

import numpy as np
import pytest
from helpers import DTYPES, assert_bits_equal, random_bits
from hypothesis import given
from hypothesis import strategies as st

import cupy_parallel as cp
from cupy_parallel import Device, comm, device_of, to_device
from cupy_parallel._src.hostarray import host_array, plain_buffer, version
from cupy_parallel._src.memory import POOL_THRESHOLD, get_host_memory_pool
from cupy_parallel.testing import simulated_cuda


def shares(a: Any, b: Any) -> bool:
    return bool(np.shares_memory(plain_buffer(a), plain_buffer(b)))


def host(k: int) -> Device:
    return Device("host", k)


def hosts(n: int) -> list[str]:
    return [f"host:{k}" for k in range(n)]


def split_oracle(x: np.ndarray, sizes: list[int], dim: int) -> list[np.ndarray]:
    return np.split(x, np.cumsum(sizes)[:-1], axis=dim)


# --------------------------------------------------------------------------------------------
# scatter / gather


@pytest.mark.parametrize("count", [1, 3, 8])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_scatter_gather_round_trip_every_dtype(dtype: Any, count: int) -> None:
    x = random_bits((7, 3), dtype, seed=count)
    parts = comm.scatter(x, hosts(count))
    sizes = [p.shape[0] for p in parts]
    assert sizes == [len(c) for c in np.array_split(np.arange(7), min(count, 7))]
    for k, (part, want) in enumerate(zip(parts, split_oracle(x, sizes, 0), strict=True)):
        assert device_of(part) == host(k)
        assert_bits_equal(part, want)
    back = comm.gather(parts, 0, "cpu")
    assert type(back) is np.ndarray
    assert_bits_equal(back, x)


@pytest.mark.parametrize(
    ("size", "count", "sizes"),
    [
        (5, 4, [2, 1, 1, 1]),
        (8, 4, [2, 2, 2, 2]),
        (3, 8, [1, 1, 1]),
        (9, 2, [5, 4]),
        (1, 1, [1]),
        (0, 4, [0]),
    ],
)
def test_scatter_splits_into_nearly_equal_chunks_larger_first(
    size: int, count: int, sizes: list[int]
) -> None:
    parts = comm.scatter(np.arange(size * 2).reshape(size, 2), hosts(count))
    assert [p.shape[0] for p in parts] == sizes
    assert [device_of(p) for p in parts] == [host(k) for k in range(len(sizes))]


shapes = st.lists(st.integers(0, 5), min_size=1, max_size=3).map(tuple)


@st.composite
def scatter_cases(draw: st.DrawFn) -> tuple[np.ndarray, int, int, list[int] | None, str]:
    shape = draw(shapes)
    ndim = len(shape)
    dim = draw(st.integers(-ndim, ndim - 1))
    count = draw(st.integers(1, 8))
    dtype = draw(st.sampled_from(DTYPES))
    x = random_bits(shape, dtype, seed=draw(st.integers(0, 99)))
    layout = draw(st.sampled_from(["contiguous", "transposed", "strided"]))
    if layout == "transposed" and ndim > 1:
        x = np.ascontiguousarray(x.T).T  # same values, Fortran order
    elif layout == "strided":
        x = np.repeat(x, 2, axis=0)[::2]
    chunk_sizes = None
    if draw(st.booleans()):
        total = x.shape[dim]
        cuts = sorted(draw(st.lists(st.integers(0, total), min_size=count - 1, max_size=count - 1)))
        bounds = [0, *cuts, total]
        chunk_sizes = [b - a for a, b in itertools.pairwise(bounds)]
    source = draw(st.sampled_from(["cpu", "host:0", "host:5"]))
    return x, dim, count, chunk_sizes, source


@given(scatter_cases())
def test_scatter_gather_match_numpy_split_and_concatenate(case: Any) -> None:
    x, dim, count, chunk_sizes, source = case
    source_array = to_device(x, source)
    parts = comm.scatter(source_array, hosts(count), chunk_sizes, dim)
    if chunk_sizes is None:
        total = x.shape[dim]
        sizes = [len(c) for c in np.array_split(np.arange(total), max(1, min(count, total)))]
    else:
        sizes = chunk_sizes
    assert [p.shape[dim] for p in parts] == sizes
    for k, (part, want) in enumerate(zip(parts, split_oracle(x, sizes, dim), strict=True)):
        assert device_of(part) == host(k)
        assert_bits_equal(part, want)
    destination = ["cpu", "host:7", "host:0"][count % 3]
    back = comm.gather(parts, dim, destination)
    assert device_of(back) == cp.as_device(destination)
    assert_bits_equal(back, x)


def test_scatter_gives_a_view_for_the_source_device_and_copies_elsewhere() -> None:
    x = to_device(np.arange(8.0), "host:1")
    parts = comm.scatter(x, ["host:1", "host:2"])
    assert shares(parts[0], x)
    assert not shares(parts[1], x)
    assert not shares(comm.scatter(np.arange(4.0), ["host:0"])[0], x)


def channels_last(shape: tuple[int, ...]) -> np.ndarray:
    """An NCHW array laid out NHWC in memory (torch's channels_last), values 0, 1, 2, ..."""
    n, c, h, w = shape
    return np.arange(float(n * c * h * w)).reshape(n, h, w, c).transpose(0, 3, 1, 2)


def layout_of(x: np.ndarray) -> tuple[int, ...]:
    """The strides NumPy gives a new array laid out as ``x`` (``order="K"``): the oracle."""
    return np.empty_like(x, order="K").strides


@pytest.mark.parametrize(
    ("source", "dim"),
    [
        (channels_last((5, 3, 4, 2)), 0),
        (channels_last((4, 3, 5, 2)), 2),
        (np.asfortranarray(np.arange(15.0).reshape(5, 3)), 0),
        (np.asfortranarray(np.arange(15.0).reshape(3, 5)), 1),
        (np.arange(24.0).reshape(2, 3, 4).transpose(2, 0, 1), 0),
    ],
    ids=["channels-last-dim0", "channels-last-dim2", "fortran-dim0", "fortran-dim1", "permuted"],
)
@pytest.mark.parametrize("on", ["cpu", "host:0"])
def test_scatter_and_gather_keep_the_memory_layout(source: np.ndarray, dim: int, on: str) -> None:
    # Issue 23: the copied chunks and the gathered array were always C-contiguous; torch's are
    # channels-last for a channels-last input (test_memory_format_scatter_gather). Here every
    # layout is kept as NumPy's order="K" keeps it, Fortran order too.
    array = source if on == "cpu" else host_array(source.copy(order="K"), host(0))
    parts = comm.scatter(array, hosts(3), dim=dim)
    expected = split_oracle(source, [p.shape[dim] for p in parts], dim)
    for part, want in zip(parts, expected, strict=True):
        assert_bits_equal(part, want)
        if device_of(part) == device_of(array):  # a view of the source, as torch
            assert shares(part, array)
            assert part.strides == source.strides
        else:
            assert part.strides == layout_of(want)
    for destination in ["cpu", "host:2"]:
        gathered = comm.gather(parts, dim, destination)
        assert_bits_equal(gathered, source)
        assert gathered.strides == layout_of(source)
    plain = comm.scatter(np.arange(12.0).reshape(4, 3), hosts(2))
    assert all(p.flags.c_contiguous for p in plain)  # C order stays C order
    assert comm.gather(plain, 0, "host:1").flags.c_contiguous


def test_scatter_and_gather_keep_the_memory_layout_on_simulated_gpus() -> None:
    # The CUDA paths (staged uploads, peer copies, downloads into strided arrays) under the
    # simulated CUDA, which also checks every copy's stream ordering.
    source = channels_last((5, 3, 4, 2))
    with simulated_cuda(2):
        parts = comm.scatter(source, ["cuda:0", "cuda:1"])
        assert [p.strides for p in parts] == [layout_of(source[:3]), layout_of(source[3:])]
        for destination in ["cpu", "cuda:0", "cuda:1"]:
            gathered = comm.gather(parts, 0, destination)
            assert gathered.strides == layout_of(source)
            assert_bits_equal(to_device(gathered, "cpu"), source)


def test_scatter_into_out_infers_chunk_sizes() -> None:
    x = random_bits((3, 5), np.int16)
    out = [cp.empty((3, 0), np.int16, "host:2"), cp.empty((3, 5), np.int16, "host:3")]
    result = comm.scatter(x, dim=-1, out=out)
    assert result[0] is out[0]
    assert result[1] is out[1]
    assert_bits_equal(out[1], x)


def test_gather_into_out_and_noncontiguous_pieces() -> None:
    x = random_bits((4, 6), np.complex64)
    pieces = [to_device(x[:, :2], "host:0")[:, ::-1], to_device(x[:, 2:], "host:1")[::1]]
    out = np.zeros((4, 6), np.complex64)
    assert comm.gather(pieces, 1, out=out) is out
    assert_bits_equal(out, np.concatenate([x[:, 1::-1], x[:, 2:]], axis=1))


def test_gather_default_destination_is_host_0_on_the_host_platform(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CUPY_PARALLEL_PLATFORM", "host")
    parts = comm.scatter(np.arange(6), hosts(3))
    assert device_of(comm.gather(parts)) == host(0)


def test_streams_of_none_are_accepted_on_host_devices() -> None:
    parts = comm.scatter(np.arange(5), hosts(4), streams=[None] * 4)
    assert_bits_equal(comm.gather(parts, destination=-1), np.arange(5))


# --------------------------------------------------------------------------------------------
# broadcast


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_broadcast_copies_bits_to_every_device(dtype: Any) -> None:
    x = random_bits((3, 4), dtype)[:, ::2]
    copies = comm.broadcast(x, hosts(4))
    for k, c in enumerate(copies):
        assert device_of(c) == host(k)
        assert_bits_equal(c, x)
        assert not shares(c, x)


def test_broadcast_returns_the_source_for_its_own_device_and_fills_out() -> None:
    x = to_device(np.arange(3.0), "host:2")
    copies = comm.broadcast(x, ["host:1", "host:2"])
    assert copies[1] is x
    out = [cp.empty((3,), np.float64, "host:2"), cp.empty((3,), np.float64, "host:5")]
    assert comm.broadcast(x, out=out) == tuple(out)
    for o in out:
        assert_bits_equal(o, np.arange(3.0))


@st.composite
def array_lists(draw: st.DrawFn) -> list[np.ndarray]:
    count = draw(st.integers(0, 8))
    arrays = []
    for i in range(count):
        dtype = draw(st.sampled_from([np.float32, np.float64, np.int8, np.bool_, np.complex64]))
        x = random_bits(draw(shapes), dtype, seed=i)
        if draw(st.booleans()) and x.ndim > 1:
            x = x.T
        arrays.append(x)
    return arrays


buffer_sizes = st.sampled_from([1, 7, 16, 64, 10485760])


@given(array_lists(), st.integers(1, 8), buffer_sizes)
def test_broadcast_coalesced_matches_per_array_copies(
    arrays: list[np.ndarray], count: int, buffer_size: int
) -> None:
    sources = [to_device(x, "host:0") for x in arrays]
    result = comm.broadcast_coalesced(sources, hosts(count), buffer_size)
    assert len(result) == count
    assert all(a is b for a, b in zip(result[0], sources, strict=True))
    for k, replica in enumerate(result[1:], start=1):
        assert len(replica) == len(arrays)
        for got, want in zip(replica, arrays, strict=True):
            assert device_of(got) == host(k)
            assert_bits_equal(got, want)


def address(x: Any) -> int:
    return int(plain_buffer(x).ctypes.data)


def test_broadcast_coalesced_packs_buckets_per_dtype_and_buffer_size() -> None:
    f32 = [to_device(np.full(4, i, np.float32), "host:0") for i in range(3)]  # 16 bytes each
    i64 = to_device(np.arange(2), "host:0")
    arrays = [f32[0], i64, f32[1], f32[2]]
    packed = comm.broadcast_coalesced(arrays, ["host:0", "host:1"], buffer_size=32)[1]
    # first float32 bucket: arrays 0 and 2, back to back in one buffer
    assert address(packed[2]) == address(packed[0]) + 16
    assert address(packed[3]) != address(packed[2]) + 16  # array 3 overflows into a new bucket
    assert not shares(packed[0], packed[1])  # int64 has its own bucket
    separate = comm.broadcast_coalesced(arrays, ["host:0", "host:1"], buffer_size=1)[1]
    assert address(separate[2]) != address(separate[0]) + 16


@pytest.mark.parametrize("call", ["broadcast_coalesced", "reduce_add_coalesced"])
def test_coalesced_outputs_have_a_version_counter_each(call: str) -> None:
    # Issue 23, row 10: the outputs of one bucket (views of one flat buffer) shared one version
    # counter, so a write into one output counted as a write into all; torch gives each output
    # a counter of its own.
    sources = [np.arange(3.0), np.ones((2, 2)), np.full(1, 5.0)]
    arrays = [to_device(x, "host:0") for x in sources]
    if call == "broadcast_coalesced":
        outs = comm.broadcast_coalesced(arrays, hosts(2))[1]
        expected = sources
    else:
        others = [to_device(x, "host:1") for x in sources]
        outs = comm.reduce_add_coalesced([arrays, others], "host:1")
        expected = [2 * x for x in sources]
    assert address(outs[1]) == address(outs[0]) + 24  # still one bucket
    assert [version(o) for o in outs] == [0, 0, 0]
    outs[1][...] = 7.0
    view = outs[2][:1]
    view += 1.0
    assert [version(o) for o in outs] == [0, 1, 1]
    assert version(view) == 1  # a view of an output shares the output's counter
    assert_bits_equal(outs[0], expected[0])
    assert_bits_equal(outs[1], np.full((2, 2), 7.0))
    assert_bits_equal(outs[2], expected[2] + 1.0)


# --------------------------------------------------------------------------------------------
# reduce_add


def numpy_sum(arrays: list[np.ndarray]) -> np.ndarray:
    return functools.reduce(np.add, arrays)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_reduce_add_equals_numpy_sum_in_input_order(dtype: Any) -> None:
    terms = [random_bits((2, 3), dtype, seed=k) for k in range(4)]
    if np.dtype(dtype).kind in "fc":
        terms = [np.nan_to_num(t, nan=1.0, posinf=2.0, neginf=-2.0) for t in terms]
    inputs = [to_device(t, f"host:{k}") for k, t in enumerate(terms)]
    with np.errstate(over="ignore", invalid="ignore"):
        result = comm.reduce_add(inputs, destination="host:2")
        want = numpy_sum(terms)
    assert device_of(result) == host(2)
    assert_bits_equal(result, want)


def test_reduce_add_allows_shared_devices_and_returns_a_single_input() -> None:
    a = to_device(np.arange(3), "host:1")
    b = to_device(np.ones(3, np.int64), "host:1")
    assert_bits_equal(comm.reduce_add([a, b, a], destination="host:1"), np.arange(3) * 2 + 1)
    assert comm.reduce_add([a], destination="host:1") is a


def test_reduce_add_default_destination_is_host_0_on_the_host_platform(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CUPY_PARALLEL_PLATFORM", "host")
    inputs = [to_device(np.ones(2), "host:1"), to_device(np.ones(2), "host:0")]
    assert device_of(comm.reduce_add(inputs)) == host(0)
    with pytest.raises(ValueError, match=r"destination=None \(the current device, host:0\)"):
        comm.reduce_add(inputs[:1] * 2)


@st.composite
def replica_lists(draw: st.DrawFn) -> tuple[list[list[np.ndarray]], list[np.ndarray]]:
    templates = draw(array_lists())
    replicas = draw(st.integers(1, 4))
    lists = []
    for r in range(replicas):
        values = []
        for i, t in enumerate(templates):
            values.append(random_bits(t.shape, t.dtype, seed=100 * r + i))
        lists.append(values)
    return lists, templates


@given(replica_lists(), buffer_sizes, st.integers(0, 3))
def test_reduce_add_coalesced_matches_numpy_sums(
    case: tuple[list[list[np.ndarray]], list[np.ndarray]], buffer_size: int, root: int
) -> None:
    lists, templates = case
    root %= len(lists)
    inputs = [[to_device(x, f"host:{k}") for x in xs] for k, xs in enumerate(lists)]
    with np.errstate(over="ignore", invalid="ignore"):
        result = comm.reduce_add_coalesced(inputs, f"host:{root}", buffer_size)
        wants = [numpy_sum([xs[j] for xs in lists]) for j in range(len(templates))]
    assert len(result) == len(templates)
    for got, want in zip(result, wants, strict=True):
        assert device_of(got) == host(root)
        assert_bits_equal(got, want)
    for k, xs in enumerate(lists):  # inputs are untouched
        for x, original in zip(inputs[k], xs, strict=True):
            assert_bits_equal(x, original)


def test_reduce_add_coalesced_of_one_list_copies() -> None:
    x = to_device(np.arange(4.0), "host:3")
    (total,) = comm.reduce_add_coalesced([[x]], "host:3")
    assert_bits_equal(total, np.arange(4.0))
    assert not shares(total, x)
    assert comm.reduce_add_coalesced([[], []], "host:0") == ()


# --------------------------------------------------------------------------------------------
# bad input: every error named, raised before anything is written

X = np.arange(12.0).reshape(4, 3)


class h:  # noqa: N801 - reads as a function in the table below
    """An array to place on host:k when the test runs (host devices exist only inside tests)."""

    def __init__(self, x: Any, k: int) -> None:
        self.x, self.k = np.asarray(x), k


def _resolve(obj: Any) -> Any:
    if isinstance(obj, h):
        return to_device(obj.x, f"host:{obj.k}")
    if isinstance(obj, list):
        return [_resolve(o) for o in obj]
    return obj


def _call(fn: Any, *args: Any, **kwargs: Any) -> Any:
    return lambda: fn(*map(_resolve, args), **{k: _resolve(v) for k, v in kwargs.items()})


def _scatter(*args: Any, **kwargs: Any) -> Any:
    return _call(comm.scatter, *args, **kwargs)


BAD_INPUTS = [
    # scatter
    ("scatter-list", _scatter([1, 2], hosts(2)), TypeError, "array must be an array"),
    ("scatter-neither", _scatter(X), ValueError, "Exactly one of 'devices' and 'out'"),
    ("scatter-both", _scatter(X, hosts(2), out=[h(X, 0)]), ValueError, "Exactly one of"),
    ("scatter-str-devices", _scatter(X, "host:0"), TypeError, "devices must be a sequence"),
    ("scatter-no-devices", _scatter(X, []), ValueError, "devices must name at least one"),
    (
        "scatter-missing",
        _scatter(X, ["host:9"]),
        ValueError,
        r"devices\[0\] is not a usable device: device host:9",
    ),
    ("scatter-cpu", _scatter(X, ["host:0", "cpu"]), ValueError, r"devices\[1\] must be an acc"),
    (
        "scatter-spelling",
        _scatter(X, ["gpu:0"]),
        ValueError,
        r"devices\[0\] is not a usable device: device string",
    ),
    (
        "scatter-float-dev",
        _scatter(X, [1.5]),
        TypeError,
        r"devices\[0\] is not a usable device: device must be",
    ),
    ("scatter-dim", _scatter(X, hosts(2), dim=2), ValueError, r"dim must be in \[-2, 1\]"),
    ("scatter-dim-type", _scatter(X, hosts(2), dim=1.0), TypeError, "dim must be an int"),
    ("scatter-0d", _scatter(np.array(1.0), hosts(2)), ValueError, "array is 0-d"),
    ("chunk-len", _scatter(X, hosts(2), [4]), ValueError, r"len\(devices\) = 2, but len\(chu"),
    ("chunk-neg", _scatter(X, hosts(2), [5, -1]), ValueError, r"chunk_sizes\[1\] must be >= 0"),
    ("chunk-sum", _scatter(X, hosts(2), [1, 2]), ValueError, r"sum\(chunk_sizes\) = 3"),
    ("chunk-float", _scatter(X, hosts(2), [1.0, 3]), TypeError, r"chunk_sizes\[0\] must be an"),
    ("chunk-scalar", _scatter(X, hosts(2), 4), TypeError, "chunk_sizes must be a sequence"),
    (
        "out-chunks",
        _scatter(X, None, [4], out=[h(X, 1)]),
        ValueError,
        "'chunk_sizes' must not be given together with 'out'",
    ),
    ("out-empty", _scatter(X, out=[]), ValueError, "out must contain at least one array"),
    ("out-shape", _scatter(X, out=[h(X, 1), h(X[:, :1], 2)]), ValueError, r"out\[1\] has shape"),
    ("out-sum", _scatter(X, out=[h(X[:3], 1)]), ValueError, "along dim 0 must sum to .* 4"),
    ("out-cpu", _scatter(X, out=[X.copy()]), ValueError, r"scatter expects out\[0\] on an acc"),
    (
        "out-dtype",
        _scatter(X, out=[h(X.astype(np.float32), 1)]),
        ValueError,
        r"out\[0\] has dtype float32, but array has dtype float64",
    ),
    ("streams-type", _scatter(X, hosts(2), streams=3), TypeError, "streams must be a sequence"),
    ("streams-len", _scatter(X, hosts(2), streams=[None]), ValueError, "2 devices, but 1 str"),
    ("streams-item", _scatter(X, hosts(2), streams=["s", None]), TypeError, r"streams\[0\] mus"),
    # gather
    ("gather-bare", _call(comm.gather, h(X, 0)), TypeError, "arrays must be a sequence"),
    ("gather-empty", _call(comm.gather, []), ValueError, "arrays must contain at least one"),
    ("gather-item", _call(comm.gather, [h(X, 0), 3]), TypeError, r"arrays\[1\] must be an arr"),
    ("gather-cpu", _call(comm.gather, [X]), ValueError, r"gather expects arrays\[0\] on an acc"),
    (
        "gather-shape",
        _call(comm.gather, [h(X, 0), h(X[:, :2], 1)]),
        ValueError,
        r"arrays\[1\] has shape \(4, 2\), but gather along dim 0 expects \(4, 3\)",
    ),
    ("gather-ndim", _call(comm.gather, [h(X, 0), h(X[0], 1)]), ValueError, "has 1 dimensions"),
    (
        "gather-dtype",
        _call(comm.gather, [h(X, 0), h(X.astype(np.int64), 1)]),
        ValueError,
        r"arrays\[1\] has dtype int64",
    ),
    ("gather-0d", _call(comm.gather, [h(1.0, 0), h(2.0, 1)]), ValueError, r"arrays\[0\] is 0-d"),
    ("gather-dim", _call(comm.gather, [h(X, 0)], -3), ValueError, r"dim must be in \[-2, 1\]"),
    (
        "gather-out-dest",
        _call(comm.gather, [h(X, 0)], 0, "cpu", out=X.copy()),
        ValueError,
        "'destination' must not be given together with 'out'",
    ),
    (
        "gather-out-shape",
        _call(comm.gather, [h(X, 0), h(X, 1)], out=X.copy()),
        ValueError,
        r"out must have the gathered shape \(8, 3\)",
    ),
    (
        "gather-dest",
        _call(comm.gather, [h(X, 0)], 0, "tpu:0"),
        ValueError,
        "destination is not a usable device: device string",
    ),
    # broadcast
    ("bcast-list", _call(comm.broadcast, [1.0], hosts(2)), TypeError, "array must be an array"),
    ("bcast-neither", _call(comm.broadcast, X), ValueError, "Exactly one of 'devices' and 'out'"),
    (
        "bcast-out-shape",
        _call(comm.broadcast, X, out=[h(X, 0), h(X.T, 1)]),
        ValueError,
        r"out\[1\] has shape \(3, 4\), but broadcast needs the source's shape \(4, 3\)",
    ),
    (
        "bcast-out-cpu",
        _call(comm.broadcast, X, out=[X.copy()]),
        ValueError,
        r"broadcast expects out\[0\] on an accelerator",
    ),
    ("bcast-cpu-target", _call(comm.broadcast, X, ["cpu"]), ValueError, "must be an accelerator"),
    # broadcast_coalesced
    (
        "bc-placement",
        _call(comm.broadcast_coalesced, [h(X, 0), h(X, 1)], hosts(2)),
        ValueError,
        r"arrays\[1\] is on host:1, but broadcast_coalesced needs every array on devices\[0\]",
    ),
    (
        "bc-buffer",
        _call(comm.broadcast_coalesced, [h(X, 0)], hosts(2), 0),
        ValueError,
        "buffer_size must be a positive number of bytes, got 0",
    ),
    (
        "bc-buffer-type",
        _call(comm.broadcast_coalesced, [h(X, 0)], hosts(2), "10MB"),
        TypeError,
        "buffer_size must be an int",
    ),
    (
        "bc-bare",
        _call(comm.broadcast_coalesced, h(X, 0), hosts(2)),
        TypeError,
        "arrays must be a sequence",
    ),
    ("bc-no-devices", _call(comm.broadcast_coalesced, [], []), ValueError, "at least one device"),
    # reduce_add
    ("ra-empty", _call(comm.reduce_add, []), ValueError, "inputs must contain at least one"),
    (
        "ra-shape",
        _call(comm.reduce_add, [h(X, 0), h(X.T, 1)], "host:0"),
        ValueError,
        r"inputs\[1\] has shape \(3, 4\), but inputs\[0\] has shape \(4, 3\)",
    ),
    (
        "ra-dtype",
        _call(comm.reduce_add, [h(X, 0), h(X.astype(np.float32), 1)], "host:0"),
        ValueError,
        r"inputs\[1\] has dtype float32, but inputs\[0\] has dtype float64",
    ),
    (
        "ra-cpu",
        _call(comm.reduce_add, [X, h(X, 1)], "host:1"),
        ValueError,
        r"reduce_add expects inputs\[0\] on an accelerator",
    ),
    (
        "ra-destination",
        _call(comm.reduce_add, [h(X, 0), h(X, 1)], "host:2"),
        ValueError,
        r"destination host:2 holds none of them \(they are on \['host:0', 'host:1'\]\)",
    ),
    # reduce_add_coalesced
    ("rac-bare", _call(comm.reduce_add_coalesced, h(X, 0)), TypeError, "one list of arrays per"),
    ("rac-empty", _call(comm.reduce_add_coalesced, []), ValueError, "at least one list"),
    (
        "rac-inner",
        _call(comm.reduce_add_coalesced, [h(X, 0)]),
        TypeError,
        r"inputs\[0\] must be a sequence",
    ),
    (
        "rac-lengths",
        _call(comm.reduce_add_coalesced, [[h(X, 0), h(X, 0)], [h(X, 1)]], "host:0"),
        ValueError,
        r"inputs\[1\] has 1 arrays, but inputs\[0\] has 2",
    ),
    (
        "rac-spread",
        _call(comm.reduce_add_coalesced, [[h(X, 0), h(X, 1)], [h(X, 1), h(X, 1)]], "host:1"),
        ValueError,
        r"inputs\[0\]\[1\] is on host:1, but inputs\[0\]\[0\] is on host:0",
    ),
    (
        "rac-shape",
        _call(comm.reduce_add_coalesced, [[h(X, 0)], [h(X[:2], 1)]], "host:0"),
        ValueError,
        r"inputs\[1\]\[0\] has shape \(2, 3\), but inputs\[0\]\[0\] has shape \(4, 3\)",
    ),
    (
        "rac-buffer",
        _call(comm.reduce_add_coalesced, [[h(X, 0)]], "host:0", -5),
        ValueError,
        "buffer_size must be a positive number of bytes, got -5",
    ),
    (
        "rac-destination",
        _call(comm.reduce_add_coalesced, [[h(X, 0)], [h(X, 1)]], "cpu"),
        ValueError,
        "destination cpu holds none of them",
    ),
]


@pytest.mark.parametrize(
    ("call", "error", "pattern"),
    [case[1:] for case in BAD_INPUTS],
    ids=[case[0] for case in BAD_INPUTS],
)
def test_bad_input_is_refused_with_a_named_message(call: Any, error: type, pattern: str) -> None:
    with pytest.raises(error, match=pattern):
        call()


def test_errors_are_raised_before_anything_is_written() -> None:
    x = np.arange(6.0)
    first = cp.empty((6,), np.float64, "host:1")
    first[...] = -1.0
    bad = cp.empty((5,), np.float64, "host:2")
    with pytest.raises(ValueError, match=r"out\[1\] has shape"):
        comm.broadcast(x, out=[first, bad])
    with pytest.raises(ValueError, match=r"out\[1\] has shape"):
        comm.scatter(x, out=[first[:3], cp.empty((3, 1), np.float64, "host:2")])
    assert_bits_equal(first, np.full(6, -1.0))


# --------------------------------------------------------------------------------------------
# out= arrays that cannot take the result: refused before the first copy


def _filled(shape: Any, k: int, value: float = -1.0) -> Any:
    array = cp.empty(shape, np.float64, f"host:{k}")
    array[...] = value
    return array


def _read_only(shape: Any, k: int) -> Any:
    array = _filled(shape, k)
    array.flags.writeable = False
    return array


def test_a_read_only_out_is_refused_before_the_first_copy() -> None:
    x = np.arange(6.0)
    first = _filled((3,), 1)
    with pytest.raises(ValueError, match=r"out\[1\] is read-only, but scatter writes"):
        comm.scatter(x, out=[first, _read_only((3,), 2)])
    with pytest.raises(ValueError, match=r"out\[1\] is read-only, but broadcast writes"):
        comm.broadcast(x[:3], out=[first, _read_only((3,), 2)])
    assert_bits_equal(first, np.full(3, -1.0))
    parts = comm.scatter(x, hosts(2))
    frozen = np.zeros(6)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match=r"out is read-only, but gather writes its result"):
        comm.gather(parts, out=frozen)


def test_scatter_refuses_out_arrays_that_overlap_each_other_or_the_source() -> None:
    # Old code wrote chunk 1 over the end of chunk 0 (a silently wrong out[0]).
    x = np.arange(6.0)
    buffer = _filled((5,), 1)
    with pytest.raises(ValueError, match=r"out\[0\] and out\[1\] share memory, but scatter"):
        comm.scatter(x, out=[buffer[:3], buffer[2:]])
    assert_bits_equal(buffer, np.full(5, -1.0))
    source = to_device(x, "host:1")
    with pytest.raises(ValueError, match=r"out\[0\] shares memory with array, which scatter"):
        comm.scatter(source, out=[source[1:4], _filled((3,), 2)])
    assert_bits_equal(source, x)
    # interleaved views of one buffer do not overlap, and are accepted
    parts = comm.scatter(x[:5], out=[buffer[0::2], buffer[1::2]])
    assert_bits_equal(buffer, np.array([0.0, 3.0, 1.0, 4.0, 2.0]))
    assert [p.shape for p in parts] == [(3,), (2,)]


def test_gather_refuses_an_out_that_overlaps_an_input_or_itself() -> None:
    # gather([x[3:], x[:3]], out=x) used to read x[:3] after overwriting it.
    x = to_device(np.arange(6.0), "host:0")
    with pytest.raises(ValueError, match=r"out shares memory with arrays\[0\], which gather"):
        comm.gather([x[3:], x[:3]], out=x)
    assert_bits_equal(x, np.arange(6.0))
    repeated = np.lib.stride_tricks.as_strided(np.zeros(1), shape=(6,), strides=(0,))
    with pytest.raises(ValueError, match=r"out has strides \(0,\) for shape \(6,\): several"):
        comm.gather([x[3:], x[:3]], out=repeated)


def test_broadcast_refuses_overlapping_outs_but_accepts_the_source_as_its_own_out() -> None:
    x = to_device(np.arange(4.0), "host:1")
    buffer = _filled((6,), 2)
    with pytest.raises(ValueError, match=r"out\[0\] and out\[1\] share memory, but broadcast"):
        comm.broadcast(x, out=[buffer[:4], buffer[2:]])
    longer = to_device(np.arange(5.0), "host:1")
    with pytest.raises(ValueError, match=r"out\[0\] shares memory with array, which broadcast"):
        comm.broadcast(longer[:4], out=[longer[1:], buffer[:4]])
    assert_bits_equal(longer, np.arange(5.0))
    assert_bits_equal(buffer, np.full(6, -1.0))
    copies = comm.broadcast(x, out=[x, buffer[2:]])  # copying x onto itself is a no-op
    assert copies[0] is x
    assert_bits_equal(x, np.arange(4.0))
    assert_bits_equal(buffer, np.array([-1.0, -1.0, 0.0, 1.0, 2.0, 3.0]))


def test_reduce_add_coalesced_of_empty_lists_still_reads_the_destination() -> None:
    with pytest.raises(ValueError, match="destination is not a usable device: device string"):
        comm.reduce_add_coalesced([[], []], "bogus")
    with pytest.raises(TypeError, match="destination is not a usable device: device must be"):
        comm.reduce_add_coalesced([[], []], 1.5)
    assert comm.reduce_add_coalesced([[], []]) == ()


# --------------------------------------------------------------------------------------------
# dtypes CuPy lacks: one TypeError at the entry, whatever the size (the pool used to decide)

LACKING = [
    np.dtype(object),
    np.dtype("U3"),
    np.dtype("S3"),
    np.dtype("datetime64[s]"),
    np.dtype("timedelta64[ms]"),
    np.dtype([("a", np.int32), ("b", np.float32)]),
    np.dtype("V4"),
    np.dtypes.StringDType(),
]


def _on_host(x: np.ndarray, k: int) -> Any:
    """A host array around ``x`` as it is (to_device refuses these dtypes; comm must too)."""
    return host_array(x, Device("host", k))


def _lacking_calls(dtype: np.dtype[Any], n: int) -> list[tuple[str, Any, str]]:
    x = np.zeros(n, dtype)
    h0, h1 = _on_host(np.zeros(n, dtype), 0), _on_host(np.zeros(n, dtype), 1)
    good = [to_device(np.zeros(n), f"host:{k}") for k in range(2)]
    return [
        ("scatter", lambda: comm.scatter(x, hosts(2)), "array"),
        ("broadcast", lambda: comm.broadcast(x, hosts(2)), "array"),
        ("broadcast_coalesced", lambda: comm.broadcast_coalesced([h0], hosts(2)), r"arrays\[0\]"),
        ("gather", lambda: comm.gather([h0, h1], destination="cpu"), r"arrays\[0\]"),
        ("gather-out", lambda: comm.gather(good, out=np.empty(2 * n, dtype)), "out"),
        ("reduce_add", lambda: comm.reduce_add([h0, h1], "host:0"), r"inputs\[0\]"),
        ("reduce_add-mixed", lambda: comm.reduce_add([good[0], h1], "host:0"), r"inputs\[1\]"),
        (
            "reduce_add_coalesced",
            lambda: comm.reduce_add_coalesced([[h0], [h1]], "host:0"),
            r"inputs\[0\]\[0\]",
        ),
    ]


@pytest.mark.parametrize("n", [4, POOL_THRESHOLD], ids=["small", "pooled"])
@pytest.mark.parametrize("dtype", LACKING, ids=lambda d: d.str if d.kind != "V" else d.name)
def test_dtypes_cupy_lacks_are_refused_by_every_function_at_every_size(
    dtype: np.dtype[Any], n: int
) -> None:
    # The old code moved small object/string arrays and failed with NumPy's "Cannot change
    # data-type" deep in the pool for big ones; reduce_add on strings truncated the sums.
    calls = _lacking_calls(dtype, n)
    gc.collect()  # so that no other test's garbage is freed while this one counts
    used = get_host_memory_pool().used_bytes()
    for name, call, argument in calls:
        with pytest.raises(
            TypeError,
            match=rf"^{argument}'s dtype is .*, a dtype device arrays cannot hold \(CuPy has "
            r"bool, integer, float16/32/64, complex64/128 and ml_dtypes' bfloat16 arrays only",
        ):
            call()
        assert get_host_memory_pool().used_bytes() <= used, f"{name} allocated before refusing"


@st.composite
def views_of_one_buffer(draw: st.DrawFn) -> tuple[int, list[tuple[int, int, int]]]:
    """A buffer length and 1-3 (start, step, count) views of it: overlapping or not."""
    length = draw(st.integers(4, 24))
    views = []
    for _ in range(draw(st.integers(1, 3))):
        start = draw(st.integers(0, length - 1))
        step = draw(st.integers(1, 3))
        count = draw(st.integers(0, (length - 1 - start) // step + 1))
        views.append((start, step, count))
    return length, views


@given(views_of_one_buffer(), st.sampled_from(["scatter", "broadcast"]))
def test_out_views_are_refused_exactly_when_they_overlap(
    case: tuple[int, list[tuple[int, int, int]]], operation: str
) -> None:
    # The oracle: the element indices each view covers, as Python sets.
    length, views = case
    if operation == "broadcast":  # every out has the source's shape
        fewest = min(count for _, _, count in views)
        views = [(start, step, fewest) for start, step, _ in views]
    buffer = cp.empty((length,), np.float64, "host:1")
    buffer[...] = -1.0
    outs = [buffer[start : start + step * count : step] for start, step, count in views]
    covered = [set(range(start, start + step * count, step)) for start, step, count in views]
    overlap = any(a & b for a, b in itertools.combinations(covered, 2))
    counts = [count for _, _, count in views]
    if operation == "scatter":
        source = np.arange(sum(counts), dtype=np.float64)
        expected = split_oracle(source, counts, 0)
    else:
        source = np.arange(counts[0], dtype=np.float64)
        expected = [source] * len(views)
    call = getattr(comm, operation)
    if overlap:
        with pytest.raises(
            ValueError, match=rf"out\[\d\] and out\[\d\] share memory, but {operation}"
        ):
            call(source, out=outs)
        assert_bits_equal(buffer, np.full(length, -1.0))  # nothing was written
    else:
        call(source, out=outs)
        for out, want in zip(outs, expected, strict=True):
            assert_bits_equal(out, want)


# --------------------------------------------------------------------------------------------
# Every comm function on simulated GPUs, in every floating dtype

SIM_DTYPES = {np.float64: 1e-12, np.float32: 1e-6, np.float16: 1e-3}


@pytest.mark.parametrize("dtype", list(SIM_DTYPES), ids=lambda t: np.dtype(t).name)
def test_every_function_on_simulated_gpus_in_each_float_dtype(dtype: Any) -> None:
    """scatter, gather, broadcast(_coalesced), reduce_add(_coalesced) against NumPy.

    NCCL (simulated) sums the distinct GPUs' arrays; a wrong dtype or layout anywhere on the
    CUDA paths shows as a dtype or value mismatch, and the simulator checks every ordering.
    """
    tolerance = SIM_DTYPES[dtype]
    rng = np.random.default_rng(7)
    source = rng.uniform(-2, 2, (7, 5)).astype(dtype)
    gpus = ["cuda:0", "cuda:1", "cuda:2"]

    def host_copy(x: Any) -> np.ndarray:
        result = np.asarray(to_device(x, "cpu"))
        assert result.dtype == np.dtype(dtype)
        return result

    with simulated_cuda(3):
        parts = comm.scatter(source, gpus)
        assert [str(device_of(p)) for p in parts] == gpus
        assert_bits_equal(host_copy(comm.gather(parts, 0, "cuda:1")), source)
        assert_bits_equal(host_copy(comm.gather(parts, 0, "cpu")), source)
        on_gpu = to_device(source, "cuda:0")
        for copy, gpu in zip(comm.broadcast(on_gpu, gpus), gpus, strict=True):
            assert str(device_of(copy)) == gpu
            assert_bits_equal(host_copy(copy), source)
        pieces = [to_device(source[k : k + 3], gpu) for k, gpu in enumerate(gpus)]
        expected = (source[0:3].astype(np.float64) + source[1:4] + source[2:5]).astype(dtype)
        total = comm.reduce_add(pieces, "cuda:2")
        assert str(device_of(total)) == "cuda:2"
        np.testing.assert_allclose(host_copy(total), expected, rtol=tolerance, atol=tolerance)
        lists = [[p, p[0]] for p in pieces]
        sums = comm.reduce_add_coalesced(lists, "cuda:1", buffer_size=32)
        np.testing.assert_allclose(host_copy(sums[0]), expected, rtol=tolerance, atol=tolerance)
        np.testing.assert_allclose(host_copy(sums[1]), expected[0], rtol=tolerance, atol=tolerance)
        small = [on_gpu, on_gpu[1:3, ::2]]
        for k, copies in enumerate(comm.broadcast_coalesced(small, gpus, buffer_size=64)):
            assert str(device_of(copies[0])) == gpus[k]
            assert_bits_equal(host_copy(copies[0]), source)
            assert_bits_equal(host_copy(copies[1]), source[1:3, ::2])


# --------------------------------------------------------------------------------------------
# bfloat16 (ml_dtypes, the optional extra cupy-parallel[bfloat16]; CuPy 14 and NCCL have it)


@pytest.mark.parametrize("where", ["host", "simulated-cuda"])
def test_bfloat16_through_every_function(where: str) -> None:
    """Issue 24 defect 7: comm refused bfloat16; each function against NumPy (bits or sums).

    reduce_add sums in bfloat16 (NCCL widens each step to float32 and rounds), so the sum of
    three inputs is checked against float32 sums within bfloat16's precision.
    """
    ml_dtypes = pytest.importorskip("ml_dtypes")
    bf16 = np.dtype(ml_dtypes.bfloat16)
    rng = np.random.default_rng(3)
    source = rng.uniform(-2, 2, (6, 4)).astype(bf16)
    simulated = where == "simulated-cuda"
    devices = ["cuda:0", "cuda:1", "cuda:2"] if simulated else ["host:0", "host:1", "host:2"]

    def host_copy(x: Any) -> np.ndarray:
        result = np.asarray(to_device(x, "cpu"))
        assert result.dtype == bf16
        return result

    def bits(x: np.ndarray) -> np.ndarray:
        return x.view(np.uint16)

    with simulated_cuda(3) if simulated else contextlib.nullcontext():
        parts = comm.scatter(source, devices)
        np.testing.assert_array_equal(
            bits(host_copy(comm.gather(parts, 0, devices[1]))), bits(source)
        )
        on_device = to_device(source, devices[0])
        for copy in comm.broadcast(on_device, devices):
            np.testing.assert_array_equal(bits(host_copy(copy)), bits(source))
        for copies in comm.broadcast_coalesced([on_device, on_device[1]], devices, buffer_size=16):
            np.testing.assert_array_equal(bits(host_copy(copies[1])), bits(source[1]))
        pieces = [to_device(source[k : k + 3], device) for k, device in enumerate(devices)]
        expected = source[0:3].astype(np.float32) + source[1:4] + source[2:5]
        total = host_copy(comm.reduce_add(pieces, devices[2]))
        np.testing.assert_allclose(total.astype(np.float32), expected, rtol=2e-2, atol=2e-2)
        sums = comm.reduce_add_coalesced([[p] for p in pieces], devices[1], buffer_size=8)
        np.testing.assert_allclose(
            host_copy(sums[0]).astype(np.float32), expected, rtol=2e-2, atol=2e-2
        )
