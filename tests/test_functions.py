"""Scatter/Gather and Broadcast/ReduceAddCoalesced: adjoint (dot-product) tests and gradchecks."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from helpers import to_numpy
from hypothesis import given
from hypothesis import strategies as st

from cupy_parallel import Device, Tape, device_of, gradcheck, ops, to_device
from cupy_parallel._src.devices import cupy_module
from cupy_parallel.functions import Broadcast, Gather, ReduceAddCoalesced, Scatter

HOST = [f"host:{k}" for k in range(8)]


def rand(shape: tuple[int, ...], seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape)


def inner(a: Any, b: Any) -> float:
    """<a, b> computed on the host, whatever device each lives on."""
    return float(np.vdot(np.asarray(to_device(a, "cpu")), np.asarray(to_device(b, "cpu"))))


def close(a: float, b: float) -> bool:
    return bool(np.isclose(a, b, rtol=1e-12, atol=1e-12))


@st.composite
def scatter_cases(draw: st.DrawFn) -> tuple[Any, ...]:
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(0, 5), min_size=ndim, max_size=ndim)))
    dim = draw(st.integers(-ndim, ndim - 1))
    count = draw(st.integers(1, 8))
    devices = draw(st.permutations(HOST))[:count]
    chunk_sizes = None
    if draw(st.booleans()):  # an explicit split, zeros allowed
        cuts = sorted(
            draw(st.lists(st.integers(0, shape[dim]), min_size=count - 1, max_size=count - 1))
        )
        chunk_sizes = [b - a for a, b in zip([0, *cuts], [*cuts, shape[dim]], strict=True)]
    source = draw(st.sampled_from(["cpu", *HOST[:3]]))
    return shape, dim, devices, chunk_sizes, source, draw(st.integers(0, 2**16))


# --------------------------------------------------------------------------------------------
# Scatter <-> Gather


@given(case=scatter_cases())
def test_scatter_adjoint_is_gather(case: tuple[Any, ...]) -> None:
    shape, dim, devices, chunk_sizes, source, seed = case
    x = to_device(rand(shape, seed), source)
    with Tape() as tape:
        tape.watch(x)
        chunks = Scatter.apply(devices, chunk_sizes, dim, x)
    ys = tuple(to_device(rand(c.shape, seed + 1 + i), c.device) for i, c in enumerate(chunks))
    adjoint = tape.gradient(chunks, x, output_gradients=ys)
    # <A x, y> == <x, A^T y>, and A^T y is the gradients joined along dim on x's device
    assert close(sum(inner(c, y) for c, y in zip(chunks, ys, strict=True)), inner(x, adjoint))
    assert device_of(adjoint) == device_of(x)
    axis = dim % len(shape)
    np.testing.assert_array_equal(
        np.asarray(to_device(adjoint, "cpu")),
        np.concatenate([np.asarray(to_device(y, "cpu")) for y in ys], axis=axis),
    )
    for c, d in zip(chunks, devices, strict=False):
        assert device_of(c) == Device("host", int(d[5:]))


@given(case=scatter_cases(), target=st.sampled_from(["cpu", "host:0", "host:6"]))
def test_gather_adjoint_is_scatter(case: tuple[Any, ...], target: str) -> None:
    shape, dim, devices, chunk_sizes, _, seed = case
    pieces = Scatter.apply(devices, chunk_sizes, dim, rand(shape, seed))  # inputs on many devices
    with Tape() as tape:
        tape.watch(pieces)
        joined = Gather.apply(target, dim, *pieces)
    y = to_device(rand(joined.shape, seed + 1), target)
    adjoints = tape.gradient(joined, list(pieces), output_gradients=y)
    assert close(inner(joined, y), sum(inner(p, a) for p, a in zip(pieces, adjoints, strict=True)))
    assert (
        device_of(joined) == Device("cpu") if target == "cpu" else Device("host", int(target[5:]))
    )
    for p, a in zip(pieces, adjoints, strict=True):
        assert device_of(a) == device_of(p)
        assert a.shape == p.shape


def test_gather_of_scalars_unsqueezes_with_a_warning_and_squeezes_gradients_back() -> None:
    scalars = [to_device(np.array(float(k + 1)), f"host:{k}") for k in range(3)]
    with Tape() as tape:
        tape.watch(scalars)
        with pytest.warns(UserWarning, match="0-d arrays along dim 0"):
            vector = Gather.apply("host:0", 0, *scalars)
        loss = ops.sum(ops.multiply(vector, to_device(np.array([10.0, 20.0, 30.0]), "host:0")))
    np.testing.assert_array_equal(to_numpy(vector), [1.0, 2.0, 3.0])
    grads = tape.gradient(loss, scalars)
    assert [g.shape for g in grads] == [(), (), ()]
    assert [str(g.device) for g in grads] == ["host:0", "host:1", "host:2"]
    assert [float(g) for g in grads] == [10.0, 20.0, 30.0]


def test_data_parallel_pattern_gradients_match_one_device() -> None:
    x, w = rand((7, 3), 0), to_device(rand((3, 2), 1), "host:0")

    with Tape() as tape:
        tape.watch((x, w))
        chunks = Scatter.apply(HOST[:3], None, 0, x)
        replicas = Broadcast.apply(HOST[: len(chunks)], w)
        outs = [ops.tanh(ops.matmul(c, r)) for c, r in zip(chunks, replicas, strict=True)]
        parallel = ops.sum(ops.square(Gather.apply("cpu", 0, *outs)))
    gx, gw = tape.gradient(parallel, (x, w))
    assert device_of(gw) == Device("host", 0)
    wp = to_numpy(w)
    with Tape() as tape:
        tape.watch((x, wp))
        single = ops.sum(ops.square(ops.tanh(ops.matmul(x, wp))))
    rx, rw = tape.gradient(single, (x, wp))
    np.testing.assert_allclose(parallel, single, rtol=1e-14)
    np.testing.assert_allclose(gx, rx, rtol=1e-13)
    np.testing.assert_allclose(to_numpy(gw), rw, rtol=1e-13)


def test_gradcheck_scatter_and_gather() -> None:
    x = rand((5, 2), 3)
    assert gradcheck(lambda x: Scatter.apply(HOST[:3], [2, 0, 3], 0, x), [x])
    assert gradcheck(lambda x: Scatter.apply(HOST[:2], None, 1, ops.square(x)), [x])
    parts = [to_device(rand((2, 3), k), f"host:{k}") for k in range(3)]
    assert gradcheck(lambda *ps: Gather.apply("cpu", -1, *ps), parts)


# --------------------------------------------------------------------------------------------
# Broadcast <-> ReduceAddCoalesced


@st.composite
def broadcast_cases(draw: st.DrawFn) -> tuple[Any, ...]:
    shapes = draw(
        st.lists(st.lists(st.integers(0, 4), max_size=3).map(tuple), min_size=1, max_size=4)
    )
    devices = draw(st.permutations(HOST))[: draw(st.integers(1, 8))]
    return shapes, devices, draw(st.integers(0, 2**16))


@given(case=broadcast_cases())
def test_broadcast_adjoint_is_reduce_add(case: tuple[Any, ...]) -> None:
    shapes, devices, seed = case
    xs = [to_device(rand(s, seed + i), devices[0]) for i, s in enumerate(shapes)]
    with Tape() as tape:
        tape.watch(xs)
        copies = Broadcast.apply(devices, *xs)
    assert len(copies) == len(devices) * len(xs)
    ys = tuple(to_device(rand(c.shape, seed + 100 + i), c.device) for i, c in enumerate(copies))
    adjoints = tape.gradient(copies, xs, output_gradients=ys)
    lhs = sum(inner(c, y) for c, y in zip(copies, ys, strict=True))
    assert close(lhs, sum(inner(x, a) for x, a in zip(xs, adjoints, strict=True)))
    n = len(xs)
    for j, (x, a) in enumerate(zip(xs, adjoints, strict=True)):  # A^T y: the copies' sum
        oracle = sum(np.asarray(to_device(ys[k * n + j], "cpu")) for k in range(len(devices)))
        np.testing.assert_allclose(np.asarray(to_device(a, "cpu")), oracle, rtol=1e-13)
        assert device_of(a) == device_of(x)
    for k, d in enumerate(devices):  # grouped per device
        assert {str(device_of(c)) for c in copies[k * n : (k + 1) * n]} == {d}


@given(case=broadcast_cases())
def test_reduce_add_adjoint_is_broadcast(case: tuple[Any, ...]) -> None:
    shapes, devices, seed = case
    grads = [
        to_device(rand(s, seed + 10 * k + i), d)
        for k, d in enumerate(devices)
        for i, s in enumerate(shapes)
    ]
    with Tape() as tape:
        tape.watch(grads)
        sums = ReduceAddCoalesced.apply(devices[0], len(shapes), *grads)
    ys = tuple(to_device(rand(s.shape, seed + 500 + i), devices[0]) for i, s in enumerate(sums))
    adjoints = tape.gradient(sums, grads, output_gradients=ys)
    lhs = sum(inner(s, y) for s, y in zip(sums, ys, strict=True))
    assert close(lhs, sum(inner(g, a) for g, a in zip(grads, adjoints, strict=True)))
    for g, a in zip(grads, adjoints, strict=True):
        assert device_of(a) == device_of(g)


def test_broadcast_copies_of_untracked_inputs_are_non_differentiable() -> None:
    w, b = to_device(rand((2, 2), 0), "host:0"), to_device(rand((2,), 1), "host:0")
    with Tape() as tape:
        tape.watch(w)
        w0, b0, w1, b1 = Broadcast.apply(["host:0", "host:1"], w, b)
        both = Gather.apply("host:0", 0, ops.add(w0, b0), ops.add(w1, b1))
        loss = ops.sum(both)
    assert w0 is not w  # the device-0 copy is a new object (a view) for the tape
    assert tape.tracks(w0)
    assert tape.tracks(w1)
    assert not tape.tracks(b0)
    assert not tape.tracks(b1)
    np.testing.assert_array_equal(to_numpy(tape.gradient(loss, w)), np.full((2, 2), 2.0))


def test_gradcheck_broadcast_and_reduce_add() -> None:
    w, b = to_device(rand((2, 3), 0), "host:1"), to_device(rand((3,), 1), "host:1")
    assert gradcheck(lambda w, b: Broadcast.apply(["host:1", "host:3", "host:0"], w, b), [w, b])
    parts = [to_device(rand((2,), k), f"host:{k // 2}") for k in range(4)]
    assert gradcheck(lambda *ps: ReduceAddCoalesced.apply("host:1", 2, *ps), parts)


# --------------------------------------------------------------------------------------------
# Errors


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: Scatter.apply("host:0", None, 0, np.ones(2)), TypeError, "sequence of devices"),
        (lambda: Scatter.apply(["host:0"], None, 0, [1.0]), TypeError, "array to split, got list"),
        (lambda: Gather.apply("cpu", 0, np.ones(1), 2.0), TypeError, "argument 3 is a float"),
        (
            lambda: ReduceAddCoalesced.apply("host:0", 2, *[to_device(np.ones(1), "host:0")] * 3),
            ValueError,
            "positive divisor of the number of arrays",
        ),
        (lambda: ReduceAddCoalesced.apply("host:0", 1.0, np.ones(1)), TypeError, "num_inputs"),
        (lambda: Broadcast.apply(3, np.ones(1)), TypeError, "wrap a single device"),
    ],
    ids=["scatter-devices", "scatter-array", "gather-leaf", "reduce-count", "reduce-type", "bcast"],
)
def test_errors(call: Any, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        call()


# --------------------------------------------------------------------------------------------
# CUDA


@pytest.mark.gpu
def test_cuda_scatter_gather_broadcast_reduce_gradients() -> None:
    cupy = cupy_module()
    assert cupy is not None
    gpus = [f"cuda:{k}" for k in range(cupy.cuda.runtime.getDeviceCount())]
    x = rand((9, 3), 0)  # host input: copied on background streams
    w = to_device(rand((3, 2), 1), gpus[0])
    with Tape() as tape:
        tape.watch((x, w))
        chunks = Scatter.apply(gpus, None, 0, x)
        replicas = Broadcast.apply(gpus[: len(chunks)], w)
        outs = [ops.matmul(c, r) for c, r in zip(chunks, replicas, strict=True)]
        loss = ops.sum(ops.square(Gather.apply("cpu", 0, *outs)))
    gx, gw = tape.gradient(loss, (x, w))
    assert device_of(gw) == Device("cuda", 0)
    r = x @ np.asarray(to_device(w, "cpu"))
    np.testing.assert_allclose(gx, 2 * r @ np.asarray(to_device(w, "cpu")).T, rtol=1e-12)
    np.testing.assert_allclose(cupy.asnumpy(gw), 2 * x.T @ r, rtol=1e-12)
    assert gradcheck(lambda w: ReduceAddCoalesced.apply(gpus[0], 1, *Broadcast.apply(gpus, w)), [w])


# --------------------------------------------------------------------------------------------
# to_device: differentiable, as torch's .to()


def test_to_device_round_trip_keeps_the_path() -> None:
    """Table row 2: the hop to host:1 and back used to drop the exp path (gradient 2w)."""
    w = to_device(rand((3,), 0), "host:0")
    with Tape() as tape:
        tape.watch(w)
        w1 = to_device(w, "host:1")
        back = to_device(ops.exp(w1), "host:0")
        loss = ops.sum(ops.add(ops.square(w), back))
    grad = tape.gradient(loss, w)
    assert device_of(grad) == Device("host", 0)
    expected = 2 * np.asarray(to_device(w, "cpu")) + np.exp(np.asarray(to_device(w, "cpu")))
    np.testing.assert_allclose(np.asarray(to_device(grad, "cpu")), expected, rtol=1e-14)


@pytest.mark.parametrize("source", ["cpu", "host:0", "host:3"])
def test_to_device_gradcheck_over_hops(source: str) -> None:
    x = to_device(rand((2, 3), 1), source)

    def hops(x: Any) -> Any:
        far = ops.exp(to_device(x, "host:2"))
        return ops.multiply(to_device(far, source), x)

    assert gradcheck(hops, [x])


def test_to_device_to_its_own_device_is_recorded_as_a_new_view() -> None:
    x = rand((3,), 2)
    assert to_device(x, "cpu") is x  # outside a tape: returned as it is
    with Tape() as tape:
        tape.watch(x)
        y = to_device(x, "cpu")
        loss = ops.sum(ops.multiply(y, x))
    assert y is not x
    np.testing.assert_array_equal(tape.gradient(loss, x), 2 * x)


def test_to_device_second_derivative() -> None:
    x = to_device(rand((3,), 3), "host:1")
    with Tape() as outer:
        outer.watch(x)
        with Tape() as inner:
            inner.watch(x)
            y = ops.sum(ops.exp(to_device(x, "host:4")))
        g = inner.gradient(y, x)
        s = ops.sum(g)
    assert device_of(g) == Device("host", 1)
    np.testing.assert_allclose(
        np.asarray(to_device(outer.gradient(s, x), "cpu")),
        np.exp(np.asarray(to_device(x, "cpu"))),
        rtol=1e-14,
    )


def test_to_device_refuses_non_arrays_under_a_tape() -> None:
    with Tape() as tape:
        tape.watch(rand((1,), 0))
        with pytest.raises(TypeError, match=r"array must be .*got list"):
            to_device([1.0], "host:1")


# --------------------------------------------------------------------------------------------
# On simulated GPUs, in every floating dtype

SIM_TOLERANCE = {np.float64: 1e-12, np.float32: 1e-5, np.float16: 1e-2}


@pytest.mark.parametrize("dtype", list(SIM_TOLERANCE), ids=lambda t: np.dtype(t).name)
def test_data_parallel_pattern_on_simulated_gpus_in_each_float_dtype(dtype: Any) -> None:
    """Scatter, Broadcast, Gather and ReduceAddCoalesced with their gradients, against NumPy.

    Forward and backward stay in the inputs' dtype; the oracle computes in float64.
    """
    from cupy_parallel.testing import simulated_cuda

    tolerance = SIM_TOLERANCE[dtype]
    x_host, w_host = rand((7, 3), 0).astype(dtype), rand((3, 2), 1).astype(dtype)
    gpus = ["cuda:0", "cuda:1", "cuda:2"]
    with simulated_cuda(3):
        w = to_device(w_host, "cuda:0")
        with Tape() as tape:
            tape.watch((x_host, w))
            chunks = Scatter.apply(gpus, None, 0, x_host)
            replicas = Broadcast.apply(gpus, w)
            outs = [ops.tanh(ops.matmul(c, r)) for c, r in zip(chunks, replicas, strict=True)]
            gathered = Gather.apply("cpu", 0, *outs)
            summed = ReduceAddCoalesced.apply("cuda:0", 1, *replicas)[0]
            loss = ops.add(ops.sum(ops.square(gathered)), ops.sum(to_device(summed, "cpu")))
        gx, gw = tape.gradient(loss, (x_host, w))
        assert gathered.dtype == dtype
        assert summed.dtype == dtype
        assert gx.dtype == dtype
        assert gw.dtype == dtype
        assert device_of(gw) == Device("cuda", 0)
        gw_host, summed_host = to_numpy(gw), to_numpy(summed)
    x64, w64 = x_host.astype(np.float64), w_host.astype(np.float64)
    z = np.tanh(x64 @ w64)
    dz = 2 * z * (1 - z**2)
    np.testing.assert_allclose(gathered, z, rtol=tolerance, atol=tolerance)
    np.testing.assert_allclose(summed_host, 3 * w64, rtol=tolerance, atol=tolerance)
    np.testing.assert_allclose(gx, dz @ w64.T, rtol=tolerance, atol=tolerance * 10)
    np.testing.assert_allclose(gw_host, x64.T @ dz + 3, rtol=tolerance, atol=tolerance * 10)
