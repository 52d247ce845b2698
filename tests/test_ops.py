"""Differentiable ops: values against NumPy, gradients against finite differences (gradcheck)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
from helpers import to_numpy
from hypothesis import given
from hypothesis import strategies as st

import cupy_parallel
from cupy_parallel import GradcheckError, Tape, gradcheck, ops, to_device
from cupy_parallel._src.devices import cupy_module

if TYPE_CHECKING:
    from collections.abc import Callable


def rand(*shape: int, seed: int = 0, low: float = -1.0, high: float = 1.0) -> np.ndarray:
    return np.random.default_rng(seed).uniform(low, high, shape)


def positive(*shape: int, seed: int = 0) -> np.ndarray:
    return rand(*shape, seed=seed, low=0.5, high=2.0)


# --------------------------------------------------------------------------------------------
# One sample set: (id, op, numpy oracle, inputs). Broadcasting, scalars and 0-d cases included.

BINARY = [
    ("add", ops.add, np.add),
    ("subtract", ops.subtract, np.subtract),
    ("multiply", ops.multiply, np.multiply),
    ("divide", ops.divide, np.divide),
]
BINARY_SHAPES = [
    ((3,), (3,)),
    ((2, 3), (3,)),  # leading broadcast
    ((2, 1), (1, 3)),  # both broadcast along size-1 axes
    ((4, 1, 3), (2, 1)),
    ((), (2, 2)),  # 0-d against a matrix
    ((), ()),
]
UNARY = [
    ("negative", ops.negative, np.negative, rand),
    ("square", ops.square, np.square, rand),
    ("exp", ops.exp, np.exp, rand),
    ("log", ops.log, np.log, positive),
    ("tanh", ops.tanh, np.tanh, rand),
    ("relu", ops.relu, lambda x: np.maximum(x, 0), rand),
]
UNARY_SHAPES = [(), (4,), (2, 3)]
MATMUL_SHAPES = [
    ((2, 3), (3, 4)),
    ((3,), (3, 4)),
    ((2, 3), (3,)),
    ((3,), (3,)),
    ((2, 2, 3), (3, 4)),
    ((3, 4), (2, 4, 5)),
    ((1, 2, 3), (2, 3, 2)),
    ((3,), (2, 3, 4)),
    ((2, 2, 3), (3,)),
]
REDUCTION_AXES = [None, 0, 1, -1, (0, 2), ()]


@pytest.mark.parametrize(("name", "op", "oracle"), BINARY, ids=[b[0] for b in BINARY])
@pytest.mark.parametrize(("sa", "sb"), BINARY_SHAPES, ids=str)
def test_binary_values_and_gradients(
    name: str, op: Callable[..., Any], oracle: Callable[..., Any], sa: tuple, sb: tuple
) -> None:
    a = rand(*sa, seed=1)
    b = positive(*sb, seed=2) if name == "divide" else rand(*sb, seed=2)
    np.testing.assert_array_equal(op(a, b), oracle(a, b))
    assert gradcheck(op, [a, b])
    if name != "divide":
        assert gradcheck(op, [b, a])


@pytest.mark.parametrize(("name", "op", "oracle"), BINARY, ids=[b[0] for b in BINARY])
def test_binary_python_scalar_constants(
    name: str, op: Callable[..., Any], oracle: Callable[..., Any]
) -> None:
    x = positive(2, 3)
    np.testing.assert_array_equal(op(x, 2.5), oracle(x, 2.5))
    np.testing.assert_array_equal(op(1.5, x), oracle(1.5, x))
    assert gradcheck(lambda x: op(x, 2.5), [x])
    assert gradcheck(lambda x: op(1.5, x), [x])
    assert gradcheck(lambda x: op(x, np.float64(0.75)), [x])


@pytest.mark.parametrize(("name", "op", "oracle", "make"), UNARY, ids=[u[0] for u in UNARY])
@pytest.mark.parametrize("shape", UNARY_SHAPES, ids=str)
def test_unary_values_and_gradients(
    name: str, op: Callable[..., Any], oracle: Callable[..., Any], make: Any, shape: tuple
) -> None:
    x = make(*shape, seed=3)
    if name == "relu":
        x = np.where(np.abs(x) < 0.05, 0.3, x)  # keep finite differences away from the kink
    np.testing.assert_array_equal(op(x), oracle(x))
    assert gradcheck(op, [x])


@pytest.mark.parametrize(("sa", "sb"), MATMUL_SHAPES, ids=str)
def test_matmul_values_and_gradients(sa: tuple, sb: tuple) -> None:
    a, b = rand(*sa, seed=4), rand(*sb, seed=5)
    np.testing.assert_allclose(ops.matmul(a, b), np.matmul(a, b), rtol=1e-14)
    assert gradcheck(ops.matmul, [a, b])


@pytest.mark.parametrize("op", [ops.sum, ops.mean], ids=["sum", "mean"])
@pytest.mark.parametrize("axis", REDUCTION_AXES, ids=str)
@pytest.mark.parametrize("keepdims", [False, True], ids=["drop", "keepdims"])
def test_reductions(op: Callable[..., Any], axis: Any, keepdims: bool) -> None:
    x = rand(2, 3, 4, seed=6)
    oracle = np.sum if op is ops.sum else np.mean
    np.testing.assert_allclose(
        op(x, axis, keepdims=keepdims), oracle(x, axis=axis, keepdims=keepdims), rtol=1e-14
    )
    assert gradcheck(lambda x: op(x, axis, keepdims=keepdims), [x])


@pytest.mark.parametrize(
    ("shape", "new"), [((2, 3), (3, 2)), ((2, 3), -1), ((6,), (1, 2, 3)), ((), (1,))], ids=str
)
def test_reshape(shape: tuple, new: Any) -> None:
    x = rand(*shape, seed=7)
    np.testing.assert_array_equal(ops.reshape(x, new), np.reshape(x, new))
    assert gradcheck(lambda x: ops.reshape(x, new), [x])


@pytest.mark.parametrize("axes", [None, (1, 0, 2), (2, 0, 1), (-1, 0, 1)], ids=str)
def test_transpose(axes: Any) -> None:
    x = rand(2, 3, 4, seed=8)
    np.testing.assert_array_equal(ops.transpose(x, axes), np.transpose(x, axes))
    assert gradcheck(lambda x: ops.transpose(x, axes), [x])


def test_mlp_composite_gradcheck() -> None:
    x, w1, b1, w2 = rand(5, 3, seed=9), rand(3, 4, seed=10), rand(4, seed=11), rand(4, 1, seed=12)

    def loss(x: Any, w1: Any, b1: Any, w2: Any) -> Any:
        hidden = ops.tanh(ops.add(ops.matmul(x, w1), b1))
        return ops.mean(ops.square(ops.subtract(ops.matmul(hidden, w2), 0.5)))

    assert gradcheck(loss, [x, w1, b1, w2])


@given(
    shapes=st.sampled_from([*BINARY_SHAPES, ((5, 1, 1), (1, 4)), ((1,), (3, 2))]),
    swap=st.booleans(),
    op=st.sampled_from([ops.add, ops.multiply, ops.subtract]),
)
def test_broadcast_gradients_sum_over_broadcast_axes(shapes: tuple, swap: bool, op: Any) -> None:
    """The oracle: a broadcast input's gradient is the full gradient summed to its shape."""
    sa, sb = shapes[::-1] if swap else shapes
    a, b = rand(*sa, seed=13), rand(*sb, seed=14)
    with Tape() as tape:
        tape.watch((a, b))
        z = op(a, b)
    g = rand(*np.broadcast_shapes(sa, sb), seed=15)
    ga, gb = tape.gradient(z, (a, b), output_gradients=g)
    full_a = g * (b if op is ops.multiply else 1.0)
    full_b = g * (a if op is ops.multiply else (-1.0 if op is ops.subtract else 1.0))
    np.testing.assert_allclose(ga, _reduce_to(full_a, sa), rtol=1e-13)
    np.testing.assert_allclose(gb, _reduce_to(full_b, sb), rtol=1e-13)
    assert ga.shape == sa
    assert gb.shape == sb


def _reduce_to(g: np.ndarray, shape: tuple) -> np.ndarray:
    while g.ndim > len(shape):
        g = g.sum(axis=0)
    for i, n in enumerate(shape):
        if n == 1:
            g = g.sum(axis=i, keepdims=True)
    return g


# --------------------------------------------------------------------------------------------
# Results are arrays, dtypes and devices are kept


def test_zero_dim_results_are_arrays_not_numpy_scalars() -> None:
    x = np.array(2.0)
    for result in (ops.multiply(x, x), ops.sum(np.ones(3)), ops.exp(x), ops.add(1.0, 2.0)):
        assert type(result) is np.ndarray
        assert result.shape == ()
    with Tape() as tape:
        tape.watch(x)
        y = ops.negative(ops.multiply(x, x))
    assert type(tape.gradient(y, x)) is np.ndarray


def test_gradient_dtype_follows_the_input() -> None:
    x = np.ones(3, np.float32)
    with Tape() as tape:
        tape.watch(x)
        y = ops.sum(ops.multiply(x, np.full(3, 2.0)))  # promotes to float64
    g = tape.gradient(y, x)
    assert y.dtype == np.float64
    assert g.dtype == np.float32
    np.testing.assert_array_equal(g, np.full(3, 2.0, np.float32))


@pytest.mark.parametrize("device", ["host:0", "host:5"])
def test_ops_on_host_arrays_keep_their_device(device: str) -> None:
    x = to_device(positive(2, 3), device)
    w = to_device(rand(3, 2, seed=1), device)
    with Tape() as tape:
        tape.watch((x, w))
        y = ops.matmul(ops.log(ops.square(x)), w)
        outputs = [y, ops.relu(y), ops.transpose(y), ops.reshape(y, -1), ops.mean(y, 0)]
        loss = ops.sum(ops.divide(ops.exp(ops.tanh(ops.negative(y))), 2.0))
    for out in [*outputs, loss]:
        assert isinstance(out, cupy_parallel.HostArray)
        assert out.device == cupy_parallel.as_device(device)
    gx, gw = tape.gradient(loss, (x, w))
    assert gx.device == gw.device == cupy_parallel.as_device(device)
    with Tape() as tape:  # the same computation on plain NumPy is the oracle
        xp, wp = to_numpy(x), to_numpy(w)
        tape.watch((xp, wp))
        y = ops.matmul(ops.log(ops.square(xp)), wp)
        loss = ops.sum(ops.divide(ops.exp(ops.tanh(ops.negative(y))), 2.0))
    rx, rw = tape.gradient(loss, (xp, wp))
    np.testing.assert_array_equal(to_numpy(gx), rx)
    np.testing.assert_array_equal(to_numpy(gw), rw)


def test_gradcheck_on_host_devices() -> None:
    x = to_device(rand(3, 2), "host:2")
    assert gradcheck(lambda x: ops.sum(ops.tanh(x), 0), [x])


def test_ops_refuse_to_mix_devices() -> None:
    x = to_device(np.ones(2), "host:1")
    with pytest.raises(TypeError, match=r"plain numpy\.ndarray"):
        ops.add(x, np.ones(2))
    with pytest.raises(ValueError, match="different devices"):
        ops.multiply(x, to_device(np.ones(2), "host:2"))


# --------------------------------------------------------------------------------------------
# Errors


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: ops.matmul(np.ones(2), 2.0), TypeError, "ops.matmul takes an array, got float"),
        (lambda: ops.sum([1.0, 2.0]), TypeError, "ops.sum takes an array, got list"),
        (lambda: ops.exp("x"), TypeError, "ops.exp takes arrays .* got str"),
        (lambda: ops.add([1.0], np.ones(1)), TypeError, "ops.add takes arrays .* got list"),
        (lambda: ops.sum(np.ones((2, 2)), 2), ValueError, "axis 2 is out of bounds"),
        (lambda: ops.mean(np.ones((0, 2)), 0), ValueError, "averages no elements"),
    ],
    ids=["matmul-scalar", "sum-list", "exp-str", "add-list", "sum-axis", "mean-empty"],
)
def test_errors(call: Callable[[], Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        call()


def test_gradcheck_catches_a_wrong_gradient() -> None:
    class WrongSquare(cupy_parallel.Function):
        @staticmethod
        def forward(ctx: Any, x: Any) -> Any:
            ctx.save_for_backward(x)
            return x * x

        @staticmethod
        def backward(ctx: Any, g: Any) -> Any:
            (x,) = ctx.saved_arrays
            return g * x  # should be 2 * x * g

    x = np.array([1.0, 3.0])
    with pytest.raises(
        GradcheckError,
        match=r"output 0 at \(1,\) with respect to input 0 at \(1,\): numerical 6, analytical 3",
    ):
        gradcheck(WrongSquare.apply, [x])


def test_gradcheck_argument_errors() -> None:
    with pytest.raises(TypeError, match="inputs must be a list or tuple"):
        gradcheck(ops.exp, np.ones(2))
    with pytest.raises(ValueError, match="at least one floating-point or complex array"):
        gradcheck(lambda n: ops.exp(np.ones(n)), [2])
    with pytest.raises(ValueError, match=r"eps must be a finite positive number, got 0\.0"):
        gradcheck(ops.exp, [np.ones(2)], eps=0.0)
    with pytest.raises(TypeError, match="output 0 is a float"):
        gradcheck(lambda x: 1.0, [np.ones(2)])


# --------------------------------------------------------------------------------------------
# CUDA


@pytest.mark.gpu
def test_cupy_ops_values_and_gradients() -> None:
    cupy = cupy_module()
    assert cupy is not None
    x, w = cupy.asarray(rand(4, 3)), cupy.asarray(rand(3, 2, seed=1))
    assert gradcheck(
        lambda x, w: ops.mean(ops.tanh(ops.matmul(ops.relu(ops.add(x, 2.0)), w))), [x, w]
    )
    for name, op, oracle, make in UNARY:
        del name
        v = make(2, 3)
        np.testing.assert_allclose(cupy.asnumpy(op(cupy.asarray(v))), oracle(v), rtol=1e-12)
        assert gradcheck(op, [cupy.asarray(v)])


@pytest.mark.gpu
def test_cupy_ops_run_on_the_arrays_gpu() -> None:
    cupy = cupy_module()
    assert cupy is not None
    last = cupy.cuda.runtime.getDeviceCount() - 1
    with cupy.cuda.Device(last):
        x = cupy.asarray(rand(3, 3))
    with cupy.cuda.Device(0), Tape() as tape:  # current device differs from the data's
        tape.watch(x)
        y = ops.sum(ops.square(ops.matmul(x, x)), 0)
        loss = ops.sum(y)
    assert y.device.id == last
    g = tape.gradient(loss, x)
    assert g.device.id == last
    xs = cupy.asnumpy(x)
    with Tape() as tape:
        tape.watch(xs)
        ref = ops.sum(ops.square(ops.matmul(xs, xs)))
    np.testing.assert_allclose(cupy.asnumpy(g), tape.gradient(ref, xs), rtol=1e-12)


# --------------------------------------------------------------------------------------------
# The ops a real model needs (their derivatives against PyTorch: tests/test_ops_torch.py)

NEW_UNARY = [
    ("sqrt", ops.sqrt, np.sqrt),
    ("abs", ops.abs, np.abs),
    ("softmax", ops.softmax, lambda x: np.exp(x) / np.exp(x).sum(-1, keepdims=True)),
    ("log_softmax", ops.log_softmax, lambda x: x - np.log(np.exp(x).sum(-1, keepdims=True))),
    ("logsumexp", lambda x: ops.logsumexp(x, 0), lambda x: np.log(np.exp(x).sum(0))),
    ("var", lambda x: ops.var(x, 1, ddof=1), lambda x: np.var(x, 1, ddof=1)),
    ("clip", lambda x: ops.clip(x, 0.8, 1.5), lambda x: np.clip(x, 0.8, 1.5)),
    ("power", lambda x: ops.power(x, 2.5), lambda x: x**2.5),
    ("maximum", lambda x: ops.maximum(x, 1.0), lambda x: np.maximum(x, 1.0)),
    ("minimum", lambda x: ops.minimum(1.0, x), lambda x: np.minimum(1.0, x)),
    ("where", lambda x: ops.where(x > 1.0, x, 0.0), lambda x: np.where(x > 1.0, x, 0.0)),
    ("getitem", lambda x: ops.getitem(x, (slice(None), [2, 0, 2])), lambda x: x[:, [2, 0, 2]]),
    ("getitem-mask", lambda x: ops.getitem(x, x > 1.0), lambda x: x[x > 1.0]),
    ("concatenate", lambda x: ops.concatenate([x, x], 1), lambda x: np.concatenate([x, x], 1)),
    ("stack", lambda x: ops.stack([x, x], 0), lambda x: np.stack([x, x], 0)),
    ("split", lambda x: ops.split(x, [1], 1)[1], lambda x: np.split(x, [1], 1)[1]),
]


@pytest.mark.parametrize(("name", "op", "oracle"), NEW_UNARY, ids=[u[0] for u in NEW_UNARY])
def test_new_ops_values_and_gradients(name: str, op: Any, oracle: Any) -> None:
    x = positive(2, 3, seed=16)
    np.testing.assert_allclose(op(x), oracle(x), rtol=1e-14)
    assert gradcheck(op, [x])


@pytest.mark.parametrize(("name", "op", "oracle"), NEW_UNARY, ids=[u[0] for u in NEW_UNARY])
def test_new_ops_on_host_arrays_keep_their_device(name: str, op: Any, oracle: Any) -> None:
    """Host arrays compute like NumPy, stay on their device, and so do their gradients."""
    x = positive(2, 3, seed=16)
    h = to_device(x, "host:3")
    y = op(h)
    assert isinstance(y, cupy_parallel.HostArray)
    assert y.device == cupy_parallel.as_device("host:3")
    np.testing.assert_allclose(to_device(y, "cpu"), oracle(x), rtol=1e-14)
    g = rand(*y.shape, seed=17)
    grads = []
    for source in (x, h):
        with Tape() as tape:
            tape.watch(source)
            out = op(source)
        seed = g if source is x else to_device(g, "host:3")
        grads.append(tape.gradient(out, source, output_gradients=seed))
    assert grads[1].device == cupy_parallel.as_device("host:3")
    np.testing.assert_array_equal(to_device(grads[1], "cpu"), grads[0])


def test_softmax_cross_entropy_matches_its_definition() -> None:
    logits, labels = rand(4, 3, seed=18), np.array([2, 0, 1, 2])
    log_p = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    losses = -log_p[np.arange(4), labels]
    np.testing.assert_allclose(ops.softmax_cross_entropy(logits, labels), losses.mean(), rtol=1e-14)
    np.testing.assert_allclose(
        ops.softmax_cross_entropy(logits, labels, reduction="sum"), losses.sum(), rtol=1e-14
    )
    np.testing.assert_allclose(
        ops.softmax_cross_entropy(logits, labels, reduction="none"), losses, rtol=1e-14
    )
    assert gradcheck(lambda z: ops.softmax_cross_entropy(z, labels), [logits])


def test_getitem_repeated_indices_sum_their_gradients() -> None:
    x = rand(3, seed=19)
    with Tape() as tape:
        tape.watch(x)
        y = ops.sum(ops.getitem(x, np.array([0, 0, 2, 0])))
    np.testing.assert_array_equal(tape.gradient(y, x), [3.0, 0.0, 1.0])


def test_ties_split_the_gradient_like_pytorch() -> None:
    a = np.array([1.0, 2.0, 3.0])
    b = np.array([1.0, 5.0, 0.0])
    with Tape() as tape:
        tape.watch((a, b))
        y = ops.sum(ops.maximum(a, b))
    ga, gb = tape.gradient(y, (a, b))
    np.testing.assert_array_equal(ga, [0.5, 0.0, 1.0])
    np.testing.assert_array_equal(gb, [0.5, 1.0, 0.0])


def test_reduction_gradients_are_writable_arrays() -> None:
    x = rand(2, 3, seed=20)
    with Tape() as tape:
        tape.watch(x)
        y = ops.sum(x)
    g = tape.gradient(y, x)
    assert g.flags.writeable
    assert g.strides == np.ones((2, 3)).strides


def test_third_derivative_through_three_tapes() -> None:
    """Every vjp is written with ops, so derivatives nest to any order: (x**4)''' = 24 x."""
    x = np.array([0.5, -1.5])
    with Tape() as t3:
        t3.watch(x)
        with Tape() as t2:
            t2.watch(x)
            with Tape() as t1:
                t1.watch(x)
                y = ops.sum(ops.power(x, 4.0))
            d1 = t1.gradient(y, x)
            s1 = ops.sum(d1)
        d2 = t2.gradient(s1, x)
        s2 = ops.sum(d2)
    d3 = t3.gradient(s2, x)
    np.testing.assert_allclose(d1, 4 * x**3, rtol=1e-14)
    np.testing.assert_allclose(d2, 12 * x**2, rtol=1e-14)
    np.testing.assert_allclose(d3, 24 * x, rtol=1e-14)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: ops.getitem(np.ones(3), np.array([0.5])), IndexError, "got a float64 array"),
        (
            lambda: ops.getitem(
                to_device(np.ones(3), "host:1"), to_device(np.array([True, False, True]), "host:2")
            ),
            ValueError,
            "different devices, host:1 and host:2",
        ),
        (
            lambda: ops.getitem(np.ones(3), to_device(np.array([0, 2]), "host:2")),
            TypeError,
            "with an index array on host:2",
        ),
        (lambda: ops.clip(np.ones(2)), ValueError, "ops.clip needs lo or hi"),
        (lambda: ops.var(np.ones(2), ddof=2), ValueError, "no degrees of freedom with ddof=2"),
        (lambda: ops.var(np.ones(2), ddof=-1), ValueError, "ddof"),
        (lambda: ops.softmax(np.array(1.0)), ValueError, "at least one axis"),
        (lambda: ops.logsumexp(np.ones((2, 0)), 1), ValueError, "has no elements"),
        (lambda: ops.concatenate(np.ones(2)), TypeError, "takes a list or tuple of arrays"),
        (lambda: ops.concatenate([]), ValueError, "at least one array"),
        (lambda: ops.stack([np.ones(2), 1.0]), TypeError, "item 1 is a float"),
        (lambda: ops.split(np.ones(5), 2), ValueError, "cannot cut axis 0 of length 5"),
        (
            lambda: ops.softmax_cross_entropy(np.ones((2, 3)), np.array([0.0, 1.0])),
            TypeError,
            "integer class labels, got dtype float64",
        ),
        (
            lambda: ops.softmax_cross_entropy(np.ones((2, 3)), np.array([0, 1, 2])),
            ValueError,
            r"labels of shape \(2,\) .* got \(3,\)",
        ),
        (
            lambda: ops.softmax_cross_entropy(np.ones((2, 3)), np.array([0, 3])),
            ValueError,
            r"label 3 outside \[0, 3\)",
        ),
        (
            lambda: ops.softmax_cross_entropy(np.ones((2, 3)), np.array([0, 1]), reduction="avg"),
            ValueError,
            "reduction must be one of",
        ),
        (
            lambda: ops.concatenate(
                [to_device(np.ones(1), "host:1"), to_device(np.ones(1), "host:2")]
            ),
            ValueError,
            "different devices",
        ),
        (
            lambda: ops.where(np.ones(2) > 0, to_device(np.ones(2), "host:1"), np.ones(2)),
            TypeError,
            r"plain numpy\.ndarray",
        ),
    ],
    ids=[
        "getitem-float",
        "getitem-index-device",
        "getitem-index-on-host-device",
        "clip-no-bounds",
        "var-ddof",
        "var-negative-ddof",
        "softmax-0d",
        "logsumexp-empty",
        "concatenate-array",
        "concatenate-empty",
        "stack-scalar",
        "split-uneven",
        "xent-float-labels",
        "xent-shape",
        "xent-range",
        "xent-reduction",
        "concatenate-devices",
        "where-mixed",
    ],
)
def test_new_op_errors(call: Callable[[], Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        call()
