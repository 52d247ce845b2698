"""The tape: recording, reverse accumulation, pytrees, errors, Functions, threads."""

from __future__ import annotations

import collections
import contextvars
import re
import threading
from typing import Any, ClassVar

import numpy as np
import pytest
from helpers import to_numpy

import cupy_parallel
from cupy_parallel import Function, Tape, gradcheck, ops, to_device


def rand(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-1.0, 1.0, shape)


# --------------------------------------------------------------------------------------------
# Gradients


def test_gradient_matches_the_closed_form() -> None:
    x, w = rand(4, 3), rand(3, seed=1)
    with Tape() as tape:
        tape.watch((x, w))
        loss = ops.sum(ops.square(ops.matmul(x, w)))
    gx, gw = tape.gradient(loss, (x, w))
    r = x @ w
    np.testing.assert_allclose(gx, 2 * np.outer(r, w), rtol=1e-13)
    np.testing.assert_allclose(gw, 2 * x.T @ r, rtol=1e-13)


def test_gradients_accumulate_when_an_array_is_used_twice() -> None:
    x = np.array([1.0, -2.0, 3.0])
    with Tape() as tape:
        tape.watch(x)
        y = ops.add(ops.multiply(x, x), ops.multiply(3.0, x))  # x^2 + 3x, x used three times
        loss = ops.sum(ops.add(y, y))
    np.testing.assert_array_equal(tape.gradient(loss, x), 2 * (2 * x + 3))


def test_sources_keep_their_pytree_structure() -> None:
    Pair = collections.namedtuple("Pair", "w b")
    params = {"layer": Pair(w=rand(2, 2), b=rand(2, seed=1)), "scale": [np.array(2.0)], "x": None}
    with Tape() as tape:
        tape.watch(params)
        layer = params["layer"]
        out = ops.add(ops.matmul(np.ones(2), layer.w), layer.b)
        loss = ops.sum(ops.multiply(out, params["scale"][0]))
    grads = tape.gradient(loss, params)
    assert isinstance(grads["layer"], Pair)
    assert grads["x"] is None
    np.testing.assert_array_equal(grads["layer"].w, np.full((2, 2), 2.0))
    np.testing.assert_array_equal(grads["layer"].b, np.full(2, 2.0))
    np.testing.assert_allclose(grads["scale"][0], (np.ones(2) @ layer.w + layer.b).sum())


def test_unconnected_source_gets_zeros_on_its_device() -> None:
    x = to_device(np.ones(3), "host:2")
    unused = to_device(np.ones((2, 2), np.float32), "host:4")
    with Tape() as tape:
        tape.watch((x, unused))
        loss = ops.sum(x)
    gx, gu = tape.gradient(loss, (x, unused))
    np.testing.assert_array_equal(to_numpy(gx), np.ones(3))
    assert gu.device == unused.device
    assert gu.dtype == np.float32
    np.testing.assert_array_equal(to_numpy(gu), np.zeros((2, 2)))


def test_gradient_with_respect_to_an_intermediate_result() -> None:
    x = rand(3)
    with Tape() as tape:
        tape.watch(x)
        h = ops.tanh(x)
        loss = ops.sum(ops.square(h))
    gh, gx = tape.gradient(loss, (h, x))
    np.testing.assert_allclose(gh, 2 * np.tanh(x), rtol=1e-14)
    np.testing.assert_allclose(gx, 2 * np.tanh(x) * (1 - np.tanh(x) ** 2), rtol=1e-14)


def test_output_gradients_and_pytree_targets() -> None:
    x = rand(2, 3)
    g1, g2 = rand(2, 3, seed=1), rand(3, seed=2)
    with Tape(persistent=True) as tape:
        tape.watch(x)
        y1 = ops.exp(x)
        y2 = ops.sum(x, 0)
    np.testing.assert_allclose(tape.gradient(y1, x, output_gradients=g1), g1 * np.exp(x))
    combined = tape.gradient({"a": y1, "b": y2}, x, output_gradients={"a": g1, "b": g2})
    np.testing.assert_allclose(combined, g1 * np.exp(x) + g2, rtol=1e-14)


def test_gradient_never_returns_an_array_the_caller_passed_in() -> None:
    x, y = rand(3), rand(3, seed=1)
    g = rand(3, seed=2)
    with Tape() as tape:
        tape.watch((x, y))
        z = ops.add(x, y)
    gx, gy = tape.gradient(z, (x, y), output_gradients=g)
    assert gx is not g
    assert gy is not g
    assert gx is not gy
    np.testing.assert_array_equal(gx, g)
    np.testing.assert_array_equal(gy, g)


def test_persistent_tape_answers_repeatedly() -> None:
    x = rand(3)
    with Tape(persistent=True) as tape:
        tape.watch(x)
        a = ops.sum(ops.exp(x))
        b = ops.sum(ops.square(x))
    np.testing.assert_allclose(tape.gradient(a, x), np.exp(x))
    np.testing.assert_allclose(tape.gradient(b, x), 2 * x)
    np.testing.assert_allclose(tape.gradient(a, x), np.exp(x))


def test_operations_outside_the_block_or_on_untracked_arrays_are_not_recorded() -> None:
    x = rand(3)
    with Tape() as tape:
        tape.watch(x)
        constant = ops.exp(rand(3, seed=1))
        y = ops.multiply(x, constant)
    after = ops.exp(y)
    assert tape.tracks(y)
    assert not tape.tracks(constant)
    assert not tape.tracks(after)
    assert not cupy_parallel._src.recording.is_recording()


# --------------------------------------------------------------------------------------------
# Nested tapes and higher order


def test_every_active_tape_records() -> None:
    x = rand(2)
    with Tape() as outer:
        outer.watch(x)
        with Tape() as inner:
            inner.watch(x)
            y = ops.sum(ops.square(x))
        z = ops.add(y, ops.sum(ops.exp(x)))
    assert outer.tracks(y)
    assert not inner.tracks(z)
    np.testing.assert_allclose(inner.gradient(y, x), 2 * x)
    np.testing.assert_allclose(outer.gradient(z, x), 2 * x + np.exp(x), rtol=1e-14)


def test_an_inner_tape_does_not_hide_operations_from_the_outer_one() -> None:
    """Table row 1: the outer tape used to see only ``x`` in ``y + x`` (gradient 1.0)."""
    x = np.array(3.0)
    with Tape() as outer:
        outer.watch(x)
        with Tape():
            y = ops.square(x)
        z = ops.add(y, x)
    assert outer.gradient(z, x) == 7.0  # 2x + 1


def cube(x: Any) -> Any:
    return ops.sum(ops.multiply(ops.multiply(x, x), x))


def test_second_derivative_through_nested_tapes() -> None:
    x = rand(3)
    with Tape() as outer:
        outer.watch(x)
        with Tape() as inner:
            inner.watch(x)
            y = cube(x)
        g = inner.gradient(y, x)  # 3 x^2, recorded on the outer tape
        assert outer.tracks(g)
        s = ops.sum(g)
    np.testing.assert_allclose(g, 3 * x * x, rtol=1e-14)
    np.testing.assert_allclose(outer.gradient(s, x), 6 * x, rtol=1e-14)


def gradient_of(f: Any) -> Any:
    def df(x: Any) -> Any:
        with Tape() as tape:
            tape.watch(x)
            y = f(x)
        return tape.gradient(y, x)

    return df


def test_hessian_vector_product_matches_finite_differences() -> None:
    def f(x: Any) -> Any:  # sum(exp(x) * x^2 * (x + 1)): fan-out and reuse
        return ops.sum(ops.multiply(ops.multiply(ops.exp(x), ops.square(x)), ops.add(x, 1.0)))

    x, v = rand(4), rand(4, seed=1)
    with Tape() as outer:
        outer.watch(x)
        g = gradient_of(f)(x)
        gv = ops.sum(ops.multiply(g, v))
    hvp = outer.gradient(gv, x)
    eps = 1e-6
    numeric = (gradient_of(f)(x + eps * v) - gradient_of(f)(x - eps * v)) / (2 * eps)
    np.testing.assert_allclose(hvp, numeric, rtol=1e-7, atol=1e-9)
    assert gradcheck(gradient_of(f), [x])  # the whole Hessian, column by column


def test_gradient_that_does_not_depend_on_the_source_has_a_zero_derivative() -> None:
    x = rand(3)
    with Tape() as outer:
        outer.watch(x)
        g = gradient_of(lambda x: ops.sum(ops.multiply(x, 2.0)))(x)  # constant 2
        s = ops.sum(g)
    np.testing.assert_array_equal(g, np.full(3, 2.0))
    np.testing.assert_array_equal(outer.gradient(s, x), np.zeros(3))


class CubeOps(Function):
    """A Function whose backward is written with recorded ops: twice differentiable."""

    differentiable_backward = True

    @staticmethod
    def forward(ctx: Any, x: Any) -> Any:
        ctx.save_for_backward(x)
        return x * x * x

    @staticmethod
    def backward(ctx: Any, g: Any) -> Any:
        (x,) = ctx.saved_tensors
        return ops.multiply(g, ops.multiply(3.0, ops.square(x)))


def test_function_with_a_differentiable_backward_gives_second_derivatives() -> None:
    x = rand(3)
    with Tape() as outer:
        outer.watch(x)
        g = gradient_of(lambda x: ops.sum(CubeOps.apply(x)))(x)
        s = ops.sum(g)
    np.testing.assert_allclose(g, 3 * x * x, rtol=1e-14)
    np.testing.assert_allclose(outer.gradient(s, x), 6 * x, rtol=1e-14)


def test_function_with_a_raw_backward_refuses_second_derivatives() -> None:
    x = rand(3)
    with Tape() as outer:
        outer.watch(x)
        g = gradient_of(lambda x: ops.sum(Cube.apply(x, "cube")))(x)  # first order works
        s = ops.sum(g)
    np.testing.assert_allclose(g, 3 * x * x, rtol=1e-14)
    with pytest.raises(RuntimeError, match=r"Cube.backward is not differentiable.*differentiable_"):
        outer.gradient(s, x)


def test_stop_recording_pauses_only_this_tape() -> None:
    x = rand(2)
    with Tape() as outer:
        outer.watch(x)
        with Tape() as inner:
            inner.watch(x)
            with inner.stop_recording():
                y = ops.exp(x)
    assert outer.tracks(y)
    assert not inner.tracks(y)
    with pytest.raises(RuntimeError, match="not recording here"), inner.stop_recording():
        pass


def test_stop_gradient_makes_a_constant() -> None:
    x = rand(3)
    with Tape() as tape:
        tape.watch(x)
        c = cupy_parallel.stop_gradient({"c": x, "name": "kept"})
        y = ops.sum(ops.multiply(x, c["c"]))
    assert c["name"] == "kept"
    assert not tape.tracks(c["c"])
    np.testing.assert_array_equal(tape.gradient(y, x), x)  # not 2x


# --------------------------------------------------------------------------------------------
# Errors (raised before the tape changes: a failed call leaves it usable)


def recorded() -> tuple[Tape, np.ndarray, Any]:
    x = rand(3)
    tape = Tape()
    with tape:
        tape.watch(x)
        y = ops.exp(x)
    return tape, x, y


def test_unrecorded_target_names_the_likely_cause() -> None:
    x, w = rand(2, 3), rand(3)
    with Tape() as tape:
        tape.watch((x, w))
        raw = x @ w
        loss = ops.sum(raw)
    with pytest.raises(ValueError, match=r"target was not recorded on this tape.*`x @ w`"):
        tape.gradient(loss, (x, w))


def test_target_that_depends_on_no_source() -> None:
    x, y = rand(3), rand(3, seed=1)
    with Tape() as tape:
        tape.watch((x, y))
        loss = ops.sum(ops.exp(x))
    with pytest.raises(ValueError, match="does not depend on any of the sources"):
        tape.gradient(loss, y)
    np.testing.assert_allclose(tape.gradient(loss, x), np.exp(x))  # still usable


def test_non_persistent_tape_used_twice() -> None:
    tape, x, y = recorded()
    tape.gradient(y, x, output_gradients=np.ones(3))
    with pytest.raises(
        RuntimeError, match=r"non-persistent tape already computed.*persistent=True"
    ):
        tape.gradient(y, x, output_gradients=np.ones(3))
    with pytest.raises(RuntimeError, match="Cannot record"), tape:
        pass


def test_non_scalar_target_needs_output_gradients() -> None:
    tape, x, y = recorded()
    with pytest.raises(ValueError, match=r"target has shape \(3,\).*output_gradients"):
        tape.gradient(y, x)


@pytest.mark.parametrize(
    ("output_gradients", "error", "match"),
    [
        (lambda: np.ones(2), ValueError, r"must match its target: shape \(3,\) on cpu"),
        (lambda: to_device(np.ones(3), "host:1"), ValueError, r"got shape \(3,\) on host:1"),
        (lambda: [np.ones(3)], ValueError, "output_gradients must have the target's structure"),
        (lambda: 3.0, TypeError, "output_gradients must be an array, got float"),
    ],
    ids=["shape", "device", "structure", "type"],
)
def test_bad_output_gradients(output_gradients: Any, error: type, match: str) -> None:
    tape, x, y = recorded()
    with pytest.raises(error, match=match):
        tape.gradient(y, x, output_gradients=output_gradients())


def test_bad_sources_and_targets() -> None:
    tape, x, y = recorded()
    seed = np.ones(3)
    with pytest.raises(ValueError, match=r"sources\['b'\] was never watched"):
        tape.gradient(y, {"a": x, "b": rand(2)}, output_gradients=seed)
    with pytest.raises(TypeError, match="target to be an array, got float"):
        tape.gradient(1.0, x)
    with pytest.raises(ValueError, match="empty structure"):
        tape.gradient([], x)
    tape.gradient(y, x, output_gradients=seed)  # none of the above consumed the tape


@pytest.mark.parametrize("device", ["cpu", "host:0"])
def test_flat_tuples_and_single_arrays_give_what_pytrees_give(device: str) -> None:
    """A single array and a flat tuple of arrays (taken without flattening) are pytrees too.

    Oracle: the same sources as a dict (the flattening path) and the closed form
    d(sum(x * y))/dx = y.
    """
    x, y = to_device(rand(3), device), to_device(rand(3), device)
    with Tape(persistent=True) as tape:
        tape.watch((x, y))
        z = ops.multiply(x, y)
        loss = ops.sum(z)
    as_tuple = tape.gradient(loss, (x, y))
    as_list = tape.gradient(loss, [x, y])
    as_dict = tape.gradient(loss, {"x": x, "y": y})
    alone = tape.gradient(loss, x)
    assert type(as_tuple) is tuple
    assert type(as_list) is list
    assert len(as_tuple) == 2
    for got, want in ((as_tuple[0], y), (as_tuple[1], x), (as_list[0], y), (alone, y)):
        np.testing.assert_array_equal(to_device(got, "cpu"), to_device(want, "cpu"))
    np.testing.assert_array_equal(to_device(as_dict["y"], "cpu"), to_device(as_tuple[1], "cpu"))
    assert tape.gradient(loss, ()) == ()
    mixed = tape.gradient(loss, (x, "not an array", z))  # an intermediate result, and a string
    assert mixed[1] is None
    np.testing.assert_array_equal(to_device(mixed[2], "cpu"), np.ones(3))
    one = to_device(np.ones(3), device)
    twice = tape.gradient(z, (x, x), output_gradients=one)  # one array twice: two arrays
    assert twice[0] is not twice[1]
    assert twice[0] is not one
    with pytest.raises(ValueError, match=r"sources\[1\] was never watched"):
        tape.gradient(loss, (x, to_device(rand(3), device)))
    with pytest.raises(ValueError, match=r"target has shape \(3,\).*output_gradients"):
        tape.gradient(z, (x, y))
    with pytest.raises(ValueError, match=r"output_gradients must have the target's structure"):
        tape.gradient(z, x, output_gradients=[1.0, 1.0, 1.0])
    with pytest.raises(TypeError, match=r"output_gradients must be an array, got float"):
        tape.gradient(z, x, output_gradients=1.0)
    with pytest.raises(
        ValueError, match=r"must match its target: shape \(3,\) on .* got shape \(2,\)"
    ):
        tape.gradient(z, x, output_gradients=to_device(np.ones(2), device))
    with pytest.raises(ValueError, match=r"must match its target: .* got shape \(3,\) on host:1"):
        tape.gradient(z, x, output_gradients=to_device(np.ones(3), "host:1"))
    with pytest.raises(
        TypeError, match=r"output_gradients is complex \(complex128\) but its target"
    ):
        tape.gradient(z, x, output_gradients=to_device(np.ones(3, complex), device))
    with pytest.raises(TypeError, match=r"params\[1\] has dtype int64"):
        Tape().watch((x, to_device(np.arange(3), device)))
    with pytest.raises(TypeError, match=r"params has dtype int64"):
        Tape().watch(to_device(np.arange(3), device))


def test_non_array_leaves_of_params_are_skipped_like_replicate_skips_them() -> None:
    params = {"w": to_device(rand(2), "host:0"), "n": 3, "act": "tanh", "none": None}
    with Tape() as tape:
        tape.watch(params)
        loss = ops.sum(ops.multiply(params["w"], float(params["n"])))
    grads = tape.gradient(loss, params)
    assert grads == {"w": grads["w"], "n": None, "act": None, "none": None}
    np.testing.assert_array_equal(grads["w"].get(), np.full(2, 3.0))
    replicated = cupy_parallel.replicate(params, ["host:0"])[0]
    assert (replicated["n"], replicated["act"]) == (3, "tanh")


def test_watch_errors() -> None:
    tape = Tape()
    with pytest.raises(TypeError, match=r"params\['i'\] has dtype int64.*astype"):
        tape.watch({"w": np.ones(2), "i": np.arange(3)})
    with pytest.raises(TypeError, match="persistent must be a bool"):
        Tape(persistent=1)  # type: ignore[arg-type]
    assert not tape.tracks(np.ones(2))


def test_entering_a_recording_tape_again() -> None:
    with Tape() as tape, pytest.raises(RuntimeError, match="already recording"), tape:
        pass


# --------------------------------------------------------------------------------------------
# Function


class Cube(Function):
    @staticmethod
    def forward(ctx: Any, x: Any, label: str) -> Any:
        ctx.save_for_backward(x)
        ctx.label = label
        ctx.seen_needs = ctx.needs_input_grad
        return ops.multiply(ops.multiply(x, x), x)  # forward runs unrecorded: no double count

    @staticmethod
    def backward(ctx: Any, g: Any) -> Any:
        (x,) = ctx.saved_arrays
        assert ctx.label == "cube"
        return 3 * x * x * g, None


class SplitHalves(Function):
    """Two outputs and a non-differentiable third (an argmax)."""

    @staticmethod
    def forward(ctx: Any, x: Any) -> Any:
        ctx.n = x.shape[0] // 2
        index = np.argmax(x).reshape(1)
        ctx.mark_non_differentiable(index)
        return x[: ctx.n] * 1.0, x[ctx.n :] * 2.0, index

    @staticmethod
    def backward(ctx: Any, first: Any, second: Any, index: Any) -> Any:
        assert index.shape == (1,)
        assert not index.any()  # non-differentiable outputs get zeros
        return np.concatenate([first, 2.0 * second])


class Identity(Function):
    @staticmethod
    def forward(ctx: Any, x: Any) -> Any:
        return x

    @staticmethod
    def backward(ctx: Any, g: Any) -> Any:
        return g


def test_function_records_and_differentiates() -> None:
    x = rand(3)
    with Tape() as tape:
        tape.watch(x)
        y = Cube.apply(x, "cube")
        loss = ops.sum(y)
    np.testing.assert_allclose(tape.gradient(loss, x), 3 * x * x, rtol=1e-14)
    assert gradcheck(lambda x: Cube.apply(x, "cube"), [x])


def test_function_needs_input_grad_and_untracked_inputs() -> None:
    x, c = rand(2), rand(2, seed=1)
    seen: list[tuple[bool, ...]] = []

    class Mul(Function):
        @staticmethod
        def forward(ctx: Any, a: Any, b: Any) -> Any:
            ctx.save_for_backward(a, b)
            seen.append(ctx.needs_input_grad)
            return a * b

        @staticmethod
        def backward(ctx: Any, g: Any) -> Any:
            a, b = ctx.saved_arrays
            return g * b if ctx.needs_input_grad[0] else None, g * a

    with Tape() as tape:
        tape.watch(x)
        y = Mul.apply(x, c)
        untracked = Mul.apply(c, c)
        loss = ops.sum(y)
    assert seen == [(True, False), (False, False)]
    assert tape.tracks(y)
    assert not tape.tracks(untracked)
    np.testing.assert_array_equal(tape.gradient(loss, x), c)


def test_unreached_outputs_get_zeros_and_non_differentiable_outputs_are_untracked() -> None:
    x = rand(4)
    with Tape() as tape:
        tape.watch(x)
        first, second, index = SplitHalves.apply(x)
        loss = ops.sum(first)  # no gradient reaches `second`
    assert not tape.tracks(index)
    assert tape.tracks(second)
    np.testing.assert_array_equal(tape.gradient(loss, x), [1.0, 1.0, 0.0, 0.0])
    assert gradcheck(lambda x: SplitHalves.apply(x)[:2], [x])


def test_function_returning_its_input_keeps_the_graph_acyclic() -> None:
    x = rand(3)
    with Tape() as tape:
        tape.watch(x)
        y = Identity.apply(x)
        loss = ops.sum(ops.multiply(y, x))
    assert y is not x
    np.testing.assert_array_equal(y, x)
    np.testing.assert_allclose(tape.gradient(loss, x), 2 * x)


def test_function_zero_dim_numpy_scalar_gradients_are_accepted() -> None:
    x = np.array(2.0)
    with Tape() as tape:
        tape.watch(x)
        y = Cube.apply(x, "cube")
    g = tape.gradient(y, x)
    assert type(g) is np.ndarray
    assert g == 12.0


def test_function_without_backward_is_refused() -> None:
    with pytest.raises(TypeError, match="must define @staticmethod backward"):

        class NoBackward(Function):
            @staticmethod
            def forward(ctx: Any, x: Any) -> Any:
                return x


@pytest.mark.parametrize(
    ("name", "forward", "backward", "arity", "match"),
    [
        (
            "TooFew",
            lambda ctx, x, y: x + y,
            lambda ctx, g: g,
            2,
            "TooFew.backward returned 1 gradients, expected 2",
        ),
        (
            "WrongShape",
            lambda ctx, x: x.sum(),
            lambda ctx, g: g,
            1,
            r"WrongShape.backward returned an invalid gradient for argument 0 \('x'\).*got",
        ),
        (
            "WrongDevice",
            lambda ctx, x: x * 1.0,
            lambda ctx, g: to_device(g, "host:1"),
            1,
            r"expected shape \(2,\) on cpu, got shape \(2,\) on host:1",
        ),
    ],
    ids=["too-few", "wrong-shape", "wrong-device"],
)
def test_bad_backward_is_named(
    name: str, forward: Any, backward: Any, arity: int, match: str
) -> None:
    function = type(
        name, (Function,), {"forward": staticmethod(forward), "backward": staticmethod(backward)}
    )
    x = rand(2)
    with Tape() as tape:
        tape.watch(x)
        y = function.apply(*[x] * arity)
    with pytest.raises(ValueError, match=match):
        tape.gradient(y, x, output_gradients=np.ones_like(y))


class Float32Backward(Function):
    @staticmethod
    def forward(ctx: Any, x: Any) -> Any:
        return x * 0.1

    @staticmethod
    def backward(ctx: Any, g: Any) -> Any:
        return (g * 0.1).astype(np.float32)


def test_function_gradient_gets_its_input_dtype() -> None:
    """Table row 6: a float32 backward result for a float64 input used to come back float32."""
    x = rand(3)
    with Tape() as tape:
        tape.watch(x)
        y = ops.sum(Float32Backward.apply(x))
    g = tape.gradient(y, x)
    assert g.dtype == np.float64  # cast, as torch does
    np.testing.assert_array_equal(g, np.full(3, np.float32(0.1), dtype=np.float64))


def test_function_complex_gradient_for_a_real_input_is_refused() -> None:
    function = type(
        "ComplexBackward",
        (Function,),
        {
            "forward": staticmethod(lambda ctx, x: x * 1.0),
            "backward": staticmethod(lambda ctx, g: g * (1 + 1j)),
        },
    )
    x = rand(2)
    with Tape() as tape:
        tape.watch(x)
        y = function.apply(x)
    with pytest.raises(
        TypeError,
        match=r"ComplexBackward.backward returned a complex gradient \(complex128\) for argument "
        r"0 \('x'\), which is real \(float64\)",
    ):
        tape.gradient(y, x, output_gradients=np.ones(2))


def test_function_integer_outputs_are_not_differentiable() -> None:
    class ValueAndArgmax(Function):
        @staticmethod
        def forward(ctx: Any, x: Any) -> Any:
            return x * 2.0, np.argmax(x).reshape(1)

        @staticmethod
        def backward(ctx: Any, g: Any, g_index: Any) -> Any:
            assert g_index.dtype.kind == "i"
            assert not g_index.any()
            return g * 2.0

    x = rand(3)
    with Tape() as tape:
        tape.watch(x)
        y, index = ValueAndArgmax.apply(x)
    assert tape.tracks(y)
    assert not tape.tracks(index)
    np.testing.assert_array_equal(tape.gradient(y, x, output_gradients=np.ones(3)), np.full(3, 2.0))


def test_apply_takes_keyword_arguments() -> None:
    class Affine(Function):
        @staticmethod
        def forward(ctx: Any, x: Any, scale: Any = 2.0, *, offset: float = 0.0) -> Any:
            ctx.save_for_backward(x)
            ctx.scale = scale
            return x * scale + offset

        @staticmethod
        def backward(ctx: Any, g: Any) -> Any:
            (x,) = ctx.saved_tensors
            return g * ctx.scale, g * x if ctx.needs_input_grad[1] else None

    x, scale = rand(3), rand(3, seed=1)
    with Tape() as tape:
        tape.watch((x, scale))
        y = Affine.apply(x, scale=scale, offset=1.0)
        z = Affine.apply(x=x)  # the default scale
    np.testing.assert_array_equal(y, x * scale + 1.0)
    gx, gs = tape.gradient({"y": y, "z": z}, (x, scale), {"y": np.ones(3), "z": np.ones(3)})
    np.testing.assert_array_equal(gx, scale + 2.0)
    np.testing.assert_array_equal(gs, x)
    with pytest.raises(TypeError, match=r"Affine.apply: got an unexpected keyword argument 'w'"):
        Affine.apply(x, w=1.0)
    with Tape() as tape:
        tape.watch(x)
        with pytest.raises(
            ValueError,
            match=r"Affine.apply: keyword-only argument 'offset' is an array a tape tracks",
        ):
            Affine.apply(scale, offset=x)


def test_unconnected_gradients() -> None:
    x, unused = rand(3), rand(2, seed=1)
    with Tape(persistent=True) as tape:
        tape.watch((x, unused))
        y = ops.sum(ops.exp(x))
    gx, gu = tape.gradient(y, (x, unused), unconnected_gradients="none")
    assert gu is None
    np.testing.assert_allclose(gx, np.exp(x))
    assert tape.gradient(y, [unused], unconnected_gradients="none") == [None]  # no error
    np.testing.assert_array_equal(tape.gradient(y, (x, unused))[1], np.zeros(2))  # the default
    with pytest.raises(ValueError, match="does not depend on any of the sources"):
        tape.gradient(y, unused)  # "zero" refuses a target that depends on no source
    with pytest.raises(ValueError, match=r'unconnected_gradients must be "zero" or "none", got 0'):
        tape.gradient(y, x, unconnected_gradients=0)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [["zero"], {"zero": True}, {"none"}], ids=["list", "dict", "set"])
def test_an_unhashable_unconnected_gradients_is_named(value: object) -> None:
    """A list (or dict, set) for unconnected_gradients was looked up in a dict and raised
    Python's bare "unhashable type: 'list'", naming no argument; the tape stays usable."""
    x = rand(3)
    with Tape() as tape:
        tape.watch(x)
        y = ops.sum(ops.exp(x))
    with pytest.raises(
        ValueError,
        match=r'unconnected_gradients must be "zero" or "none", got ' + re.escape(repr(value)),
    ):
        tape.gradient(y, x, unconnected_gradients=value)  # type: ignore[arg-type]
    np.testing.assert_allclose(tape.gradient(y, x), np.exp(x))  # a non-persistent tape's one


def test_ctx_argument_errors() -> None:
    ctx = cupy_parallel._src.function.FunctionContext((True,))
    with pytest.raises(TypeError, match="save_for_backward takes arrays or None, got int"):
        ctx.save_for_backward(np.ones(1), 3)
    with pytest.raises(TypeError, match="mark_non_differentiable takes output arrays"):
        ctx.mark_non_differentiable("y")


# --------------------------------------------------------------------------------------------
# Threads and contexts


def test_worker_threads_record_through_a_copied_context() -> None:
    x = rand(3)
    results: dict[str, Any] = {}
    with Tape() as tape:
        tape.watch(x)
        ctx = contextvars.copy_context()
        copied = threading.Thread(target=lambda: results.update(a=ctx.run(ops.exp, x)))
        bare = threading.Thread(target=lambda: results.update(b=ops.exp(x)))
        copied.start()
        bare.start()
        copied.join()
        bare.join()
        loss = ops.sum(results["a"])
    assert tape.tracks(results["a"])
    assert not tape.tracks(results["b"])  # a thread started without the context sees no tape
    np.testing.assert_allclose(tape.gradient(loss, x), np.exp(x))


def per_thread_loss(x: Any, w: Any, k: int) -> Any:
    h = ops.tanh(ops.add(ops.matmul(x, w), float(k)))
    for _ in range(20):  # long enough for the threads to interleave their records
        h = ops.multiply(ops.add(h, 0.1), 0.9)
    return ops.sum(ops.square(h))


def test_eight_threads_record_concurrently_like_a_sequential_run() -> None:
    x, w = rand(5, 3), rand(3, 2, seed=1)
    losses: list[Any] = [None] * 8
    barrier = threading.Barrier(8)

    def work(k: int) -> None:
        barrier.wait()
        losses[k] = per_thread_loss(x, w, k)

    with Tape() as tape:
        tape.watch((x, w))
        threads = [
            threading.Thread(target=contextvars.copy_context().run, args=(work, k))
            for k in range(8)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        total = losses[0]
        for loss in losses[1:]:
            total = ops.add(total, loss)
    concurrent_nodes = len(tape._nodes)
    gx, gw = tape.gradient(total, (x, w))

    with Tape() as oracle:  # the same sums, recorded one thread after another
        oracle.watch((x, w))
        total = per_thread_loss(x, w, 0)
        for k in range(1, 8):
            total = ops.add(total, per_thread_loss(x, w, k))
    assert len(oracle._nodes) == concurrent_nodes
    rx, rw = oracle.gradient(total, (x, w))
    np.testing.assert_allclose(gx, rx, rtol=1e-13)
    np.testing.assert_allclose(gw, rw, rtol=1e-13)


# --------------------------------------------------------------------------------------------
# Host arrays: in-place writes and raw NumPy are caught


def on_host(x: np.ndarray, k: int = 0) -> Any:
    return to_device(x, f"host:{k}")


def test_writing_into_a_recorded_output_inside_the_tape_is_refused() -> None:
    """Table row 3 (inside the block): ``y += 1`` used to give exp(x) + 1."""
    x = on_host(rand(3))
    with Tape() as tape:
        tape.watch(x)
        y = ops.exp(x)
        with pytest.raises(TypeError, match=r"operator \+= writes in place into an array a tape"):
            y += 1
    np.testing.assert_allclose(tape.gradient(y, x, on_host(np.ones(3))).get(), np.exp(x.get()))


def test_writing_into_a_recorded_output_before_gradient_raises() -> None:
    """Table row 3 (after the block): the version counter names the op, as torch does."""
    x = on_host(rand(3))
    with Tape() as tape:
        tape.watch(x)
        y = ops.exp(x)
    y += 1
    with pytest.raises(
        RuntimeError,
        match=r"gradient of ops.exp needs was modified in place.*output 0 \(shape \(3,\), on "
        r"host:0\) is at version 1, expected 0",
    ):
        tape.gradient(y, x, on_host(np.ones(3)))


@pytest.mark.parametrize("inside", [True, False], ids=["inside", "after"])
def test_refilling_a_saved_input_buffer_raises(inside: bool) -> None:
    """Table row 4: a data buffer refilled before gradient used to give the new data's gradient."""
    w, batch = on_host(rand(3)), on_host(rand(3, seed=1))  # the batch is a constant: not watched
    with Tape() as tape:
        tape.watch(w)
        loss = ops.sum(ops.multiply(batch, w))
        if inside:
            batch[...] = 0  # untracked, so not refused here; its version moves on
    if not inside:
        batch[...] = 0
    with pytest.raises(RuntimeError, match=r"ops.multiply.*input 0 .* at version 1, expected 0"):
        tape.gradient(loss, w)


def test_versions_read_late_still_see_every_write_after_recording() -> None:
    """The tape reads a host array's version at the first write counted after recording.

    Oracle: torch's rule, a write after recording raises naming the version it expected (the one
    the array had when recorded, written before or not), and no write leaves the gradient as
    NumPy computes it.
    """
    seed = on_host(np.ones(3))
    written_before = on_host(rand(3))
    written_before += 1  # at version 1 when recorded
    cases = {
        "nothing written": (lambda x, y, other: None, None),
        "another array written first": (lambda x, y, other: other.fill(0.0), None),
        "x after another array": (lambda x, y, other: (other.fill(0.0), x.fill(1.0)), (0, 0)),
        "x twice": (lambda x, y, other: (x.fill(1.0), x.fill(2.0)), (0, 0)),
        "y by a view": (lambda x, y, other: y[1:].fill(0.0), (0, 0)),
        "x written before recording": (lambda x, y, other: None, None),
    }
    for name, (write, expected) in cases.items():
        x = written_before if name == "x written before recording" else on_host(rand(3, seed=2))
        before = x.get()
        other = on_host(rand(3, seed=3))
        for persistent in (False, True):
            tape = Tape(persistent=persistent)
            with tape:
                tape.watch(x)
                y = ops.exp(x)
            if persistent:  # a first gradient reads nothing, the write after it still counts
                np.testing.assert_allclose(tape.gradient(y, x, seed).get(), np.exp(before))
            write(x, y, other)
            if expected is None:
                np.testing.assert_allclose(tape.gradient(y, x, seed).get(), np.exp(before))
            else:
                with pytest.raises(RuntimeError, match=r"ops.exp needs was modified in place"):
                    tape.gradient(y, x, seed)
            x = on_host(before) if expected is not None else x
    x = written_before
    with Tape() as tape:
        tape.watch(x)
        y = ops.exp(x)
    x.fill(0.5)  # from version 1 (when recorded) to 2
    with pytest.raises(
        RuntimeError,
        match=r"input 0 \(shape \(3,\), on host:0\) is at version 2, "
        r"expected 1",
    ):
        tape.gradient(y, x, seed)


def test_a_write_in_another_thread_after_recording_is_seen() -> None:
    """The thread that writes reads the recording thread's unread versions first (its lock)."""
    x = on_host(rand(3))
    with Tape() as tape:
        tape.watch(x)
        y = ops.multiply(ops.exp(x), x)
    writer = threading.Thread(target=lambda: x.fill(0.0))
    writer.start()
    writer.join()
    with pytest.raises(RuntimeError, match=r"ops.multiply needs was modified in place.*input 1"):
        tape.gradient(y, x, on_host(np.ones(3)))


def test_raw_numpy_on_a_recorded_host_array_is_refused() -> None:
    """Table row 5: ``np.sin(w)`` inside the tape used to drop the sin path (2w, not 2w + cos w)."""
    w = on_host(rand(3))
    with Tape() as tape:
        tape.watch(w)
        with pytest.raises(
            TypeError,
            match=r"numpy.sin is raw NumPy on an array a tape is recording.*silently miss this "
            r"path.*a cupy_parallel.ops function.*cupy_parallel.stop_gradient\(x\)",
        ):
            ops.add(ops.square(w), np.sin(w))


@pytest.mark.parametrize(
    ("compute", "name", "suggestion"),
    [
        (lambda w: w * 2.0, r"operator \*", r"cupy_parallel\.ops\.multiply"),
        (lambda w: 1.0 - w, "operator -", r"cupy_parallel\.ops\.subtract"),
        (lambda w: -w, "operator -", r"cupy_parallel\.ops\.negative"),
        (lambda w: w @ w, "operator @", r"cupy_parallel\.ops\.matmul"),
        (lambda w: w.sum(), "HostArray.sum", r"cupy_parallel\.ops\.sum"),
        (np.exp, "numpy.exp", r"cupy_parallel\.ops\.exp"),
        (
            lambda w: np.concatenate([w, w]),
            "numpy.concatenate",
            r"(cupy_parallel\.ops\.|a cupy_parallel\.ops f)",
        ),
        (lambda w: w.copy(), "HostArray.copy", r"a cupy_parallel\.ops function"),
    ],
    ids=["mul", "rsub", "neg", "matmul", "sum-method", "exp", "concatenate", "copy"],
)
def test_raw_numpy_error_names_the_ops_equivalent(compute: Any, name: str, suggestion: str) -> None:
    w = on_host(rand(3))
    with Tape() as tape:
        tape.watch(w)
        y = ops.tanh(w)  # recorded results are guarded like watched arrays
        with pytest.raises(TypeError, match=rf"^{name} is raw NumPy.*Use {suggestion}"):
            compute(w)
        with pytest.raises(TypeError, match=rf"^{name} is raw NumPy"):
            compute(y)


def test_raw_numpy_that_cannot_drop_a_gradient_is_allowed() -> None:
    w, data = on_host(rand(4)), on_host(rand(4, seed=1))
    with Tape() as tape:
        tape.watch(w)
        y = ops.multiply(w, data)
        mask = (w > 0).get()  # comparisons and argmax carry no gradient
        index = int(np.argmax(y))
        scaled = data * 2.0  # untracked arrays are constants
        constant = np.exp(cupy_parallel.stop_gradient(w))
        with tape.stop_recording():
            paused = np.sin(w)
        loss = ops.sum(ops.add(y, ops.multiply(scaled, constant)))
    after = w * 3.0  # outside the block nothing records: raw NumPy is fine
    np.testing.assert_array_equal(mask, w.get() > 0)
    assert index == int(np.argmax(w.get() * data.get()))
    np.testing.assert_allclose(paused.get(), np.sin(w.get()))
    np.testing.assert_allclose(after.get(), 3 * w.get())
    np.testing.assert_allclose(tape.gradient(loss, w).get(), data.get())


def test_raw_numpy_inside_function_forward_and_backward_is_allowed() -> None:
    class HostCube(Function):
        @staticmethod
        def forward(ctx: Any, x: Any) -> Any:
            ctx.save_for_backward(x)
            return x * x * x  # raw NumPy on a watched host array: recording is paused here

        @staticmethod
        def backward(ctx: Any, g: Any) -> Any:
            (x,) = ctx.saved_tensors
            return 3.0 * x * x * g

    x = on_host(rand(3))
    with Tape() as tape:
        tape.watch(x)
        y = ops.sum(HostCube.apply(x))
    np.testing.assert_allclose(tape.gradient(y, x).get(), 3 * x.get() ** 2, rtol=1e-14)
    with Tape() as tape:
        tape.watch(x)
        y = ops.sum(HostCube.apply(x))
    x[0] = 5.0  # a saved array written before backward: named by the Function
    with pytest.raises(RuntimeError, match=r"gradient of HostCube needs.*saved array 0"):
        tape.gradient(y, x)


def test_the_guard_follows_the_tapes_in_this_context() -> None:
    w = on_host(rand(2))
    with Tape() as tape:
        tape.watch(w)
        with pytest.raises(TypeError, match="raw NumPy"):
            np.exp(w)
        # a thread that did not copy the context has no active tape: nothing to refuse there
        result: list[Any] = []
        worker = threading.Thread(target=lambda: result.append(np.exp(w)))
        worker.start()
        worker.join()
    np.testing.assert_allclose(result[0].get(), np.exp(w.get()))
    np.testing.assert_allclose(np.exp(w).get(), np.exp(w.get()))  # the tape has exited


# --------------------------------------------------------------------------------------------
# NumPy arrays: in-place writes caught by the opt-in fingerprints


def test_check_writes_catches_a_write_into_a_numpy_output() -> None:
    x = rand(3)
    with Tape(check_writes=True) as tape:
        tape.watch(x)
        y = ops.exp(x)
    y += 1
    with pytest.raises(
        RuntimeError,
        match=r"check_writes=True\): an array ops.exp recorded was modified in place: its output 0 "
        r"\(shape \(3,\), on cpu\)",
    ):
        tape.gradient(y, x, np.ones(3))


def test_check_writes_catches_a_refilled_numpy_batch() -> None:
    w, batch = rand(3), rand(3, seed=1)
    with Tape(check_writes=True) as tape:
        tape.watch(w)
        loss = ops.sum(ops.multiply(batch, w))
    batch[1] = 0.0
    with pytest.raises(RuntimeError, match=r"ops.multiply recorded was modified.*input 0"):
        tape.gradient(loss, w)


def test_check_writes_leaves_an_untouched_graph_alone() -> None:
    x, w = rand(4, 3), rand(3, seed=1)
    with Tape(check_writes=True, persistent=True) as tape:
        tape.watch((x, w))
        loss = ops.sum(ops.square(ops.matmul(x, w)))
        after = ops.multiply(loss, 2.0)
    gx, gw = tape.gradient(loss, (x, w))
    r = x @ w
    np.testing.assert_allclose(gx, 2 * np.outer(r, w), rtol=1e-13)
    np.testing.assert_allclose(gw, 2 * x.T @ r, rtol=1e-13)
    np.testing.assert_allclose(tape.gradient(after, w), 2 * gw, rtol=1e-13)
    with pytest.raises(TypeError, match="check_writes must be a bool, got str"):
        Tape(check_writes="yes")  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# The recording interface ops are built on (record, record_unary, record_binary, is_recording)


def _split_vjp(gs: list[Any], xs: Any, needs: Any, zs: Any, aux: Any) -> Any:
    first, second = (np.zeros_like(z) if g is None else g for g, z in zip(gs, zs, strict=True))
    return (np.concatenate([first, second]) if needs[0] else None, None)


def halves(x: Any, scale: Any) -> tuple[Any, Any]:
    """An op with two outputs and a second input that gets no gradient, via ``record``."""
    first, second = x[:2] * 1.0, x[2:] * 1.0
    tape_module.record(_split_vjp, (x, scale), (first, second), None)
    return first, second


tape_module = cupy_parallel._src.recording


def test_record_is_a_no_op_without_a_tape_and_records_on_each_tape_that_tracks_an_input() -> None:
    x, y = rand(4), rand(4, seed=1)
    assert not tape_module.is_recording()
    halves(x, y)  # nothing to record on
    with Tape() as outer:
        outer.watch(x)
        with Tape() as inner:
            inner.watch(rand(1))
            assert tape_module.is_recording()
            assert tape_module.active_tapes() == (outer, inner)
            first, second = halves(x, y)  # recorded on outer only: inner tracks neither input
            with tape_module.pause_recording():
                assert not tape_module.is_recording()
    assert outer.tracks(first)
    assert outer.tracks(second)
    assert not inner.tracks(first)
    g = outer.gradient(first, x, output_gradients=np.ones(2))  # second's gradient: zeros
    np.testing.assert_array_equal(g, [1.0, 1.0, 0.0, 0.0])


def test_record_binary_needs_follow_each_tape() -> None:
    seen: list[tuple[bool, ...]] = []

    def vjp(gs: list[Any], xs: Any, needs: Any, zs: Any, aux: Any) -> Any:
        seen.append(needs)
        return tuple(gs[0] if n else None for n in needs)

    a, b = rand(2), rand(2, seed=1)
    with Tape() as ta, Tape() as tb:
        ta.watch(a)
        tb.watch(b)
        z = a + b
        tape_module.record_binary(vjp, a, b, z, None)
    np.testing.assert_array_equal(ta.gradient(z, a, np.ones(2)), np.ones(2))
    np.testing.assert_array_equal(tb.gradient(z, b, np.ones(2)), np.ones(2))
    assert seen == [(True, False), (False, True)]


def test_a_wrongly_shaped_gradient_is_named_not_returned() -> None:
    def bad_vjp(gs: list[Any], xs: Any, needs: Any, zs: Any, aux: Any) -> Any:
        return (gs[0].sum(),)  # a scalar for a (2,) input

    x = rand(2)
    with Tape() as tape:
        tape.watch(x)
        z = x * 2.0
        tape_module.record_unary(bad_vjp, x, z, None)
    with pytest.raises(ValueError, match=r"gradient of sources has shape \(\), its source \(2,\)"):
        tape.gradient(z, x, np.ones(2))


def test_a_raw_backward_declared_differentiable_is_named_under_an_outer_tape() -> None:
    class RawButDeclared(Function):
        differentiable_backward = True  # wrongly: backward uses raw NumPy

        @staticmethod
        def forward(ctx: Any, x: Any) -> Any:
            ctx.save_for_backward(x)
            return x * x

        @staticmethod
        def backward(ctx: Any, g: Any) -> Any:
            (x,) = ctx.saved_tensors
            return 2.0 * x * g

    x = on_host(rand(3))
    with Tape() as outer:
        outer.watch(x)
        with Tape() as inner:
            inner.watch(x)
            y = ops.sum(RawButDeclared.apply(x))
        with pytest.raises(TypeError, match=r"inside a gradient computation.*higher order"):
            inner.gradient(y, x)
    with Tape() as tape:  # first order alone is fine: no other tape records
        tape.watch(x)
        y = ops.sum(RawButDeclared.apply(x))
    np.testing.assert_allclose(tape.gradient(y, x).get(), 2 * x.get(), rtol=1e-14)


@pytest.mark.parametrize(
    ("gradient_dtype", "outcome"),
    [(np.float32, "cast"), (np.complex128, "refused")],
    ids=["float32-cast", "complex-refused"],
)
def test_gradient_takes_the_source_dtype_or_refuses_complex(
    gradient_dtype: Any, outcome: str
) -> None:
    def vjp(gs: list[Any], xs: Any, needs: Any, zs: Any, aux: Any) -> Any:
        return ((gs[0] * 0.1).astype(gradient_dtype),)

    x = rand(3)
    with Tape() as tape:
        tape.watch(x)
        z = x * 1.0
        tape_module.record_unary(vjp, x, z, None)
    if outcome == "refused":
        with pytest.raises(TypeError, match=r"gradient of sources is complex \(complex128\) but"):
            tape.gradient(z, x, np.ones(3))
        return
    g = tape.gradient(z, x, np.ones(3))
    assert g.dtype == np.float64
    np.testing.assert_array_equal(g, np.full(3, np.float32(0.1), dtype=np.float64))


def _one_gradient_vjp(gs: list[Any], xs: Any, needs: Any, zs: Any, aux: Any) -> Any:
    return (gs[0],)  # one gradient, but the op has two inputs


def test_a_vjp_returning_the_wrong_number_of_gradients_is_named() -> None:
    x, y = rand(3), rand(3, seed=1)
    with Tape() as tape:
        tape.watch(x)
        z = np.multiply(x, y)
        tape_module.record_binary(_one_gradient_vjp, x, y, z, None)
    with pytest.raises(
        ValueError, match=r"The vjp of ops\.one_gradient returned 1 gradients for 2 inputs"
    ):
        tape.gradient(z, x, output_gradients=np.ones(3))


# --------------------------------------------------------------------------------------------
# Gradient-ready hooks (Tape.register_gradient_ready_hook) and collective nodes


def _three_layer_loss(tape: Tape, params: dict[str, np.ndarray], events: list[str]) -> Any:
    """loss = sum(tanh(tanh(x w1) w2) w3), with a recorded probe after each layer's matmul."""
    x = np.linspace(-1.0, 1.0, 6).reshape(2, 3)
    tape.watch(params)
    h = ops.tanh(ops.matmul(x, params["w1"]))
    h = _Probe.apply(h, "w1 consumed", events)
    h = ops.tanh(ops.matmul(h, params["w2"]))
    h = _Probe.apply(h, "w2 consumed", events)
    return ops.sum(ops.matmul(h, params["w3"]))


class _Probe(Function):
    """The identity; its backward notes ``label`` in ``events`` (an event of the reverse pass)."""

    @staticmethod
    def forward(ctx: Any, x: Any, label: str, events: list[str]) -> Any:
        ctx.label, ctx.events = label, events
        return x.copy()

    @staticmethod
    def backward(ctx: Any, g: Any) -> Any:
        ctx.events.append(f"backward past {ctx.label}")
        return g, None, None


def _layer_params() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "w1": rng.standard_normal((3, 4)),
        "w2": rng.standard_normal((4, 5)),
        "w3": rng.standard_normal((5, 1)),
    }


def test_ready_hooks_fire_mid_pass_as_each_gradient_becomes_final() -> None:
    params, events = _layer_params(), []
    with Tape(persistent=True) as tape:
        loss = _three_layer_loss(tape, params, events)
    expected = tape.gradient(loss, params)
    events.clear()
    seen: dict[str, np.ndarray] = {}
    for name, w in params.items():
        tape.register_gradient_ready_hook(
            w, lambda g, n=name: (events.append(f"{n} ready"), seen.__setitem__(n, g.copy()))[1]
        )
    grads = tape.gradient(loss, params)
    # w3 is final before the pass goes past layer 2's probe, w2 before layer 1's: mid-pass
    assert events == [
        "w3 ready",
        "backward past w2 consumed",
        "w2 ready",
        "backward past w1 consumed",
        "w1 ready",
    ]
    for name in params:  # the hook saw the final (complete) gradient, and it is returned as is
        np.testing.assert_array_equal(seen[name], expected[name])
        np.testing.assert_array_equal(grads[name], expected[name])


def test_a_hook_sees_the_sum_of_every_use_of_its_leaf() -> None:
    w, calls = np.array([0.5, -1.0]), []
    with Tape() as tape:
        tape.watch(w)
        loss = ops.sum(ops.add(ops.square(w), ops.multiply(w, w)))  # w used three times
    tape.register_gradient_ready_hook(w, lambda g: calls.append(g.copy()))
    grad = tape.gradient(loss, w)
    np.testing.assert_allclose(calls[0], 4 * w)  # d/dw (w^2 + w*w) = 4w, one call
    assert len(calls) == 1
    np.testing.assert_allclose(grad, 4 * w)


def test_a_hook_may_replace_the_gradient() -> None:
    w, b = np.array([1.0, 2.0]), np.array(3.0)
    with Tape() as tape:
        tape.watch((w, b))
        loss = ops.add(ops.sum(ops.square(w)), b)
    replacement = np.array([10.0, 20.0])
    tape.register_gradient_ready_hook(w, lambda g: replacement)
    grads = tape.gradient(loss, {"w": w, "b": b})
    np.testing.assert_array_equal(grads["w"], replacement)
    np.testing.assert_array_equal(grads["b"], 1.0)


def test_an_unused_leaf_has_its_hook_called_with_none_at_the_start() -> None:
    used, unused, events = np.array([1.0, 2.0]), np.array([5.0]), []
    with Tape() as tape:
        tape.watch((used, unused))
        loss = _Probe.apply(ops.sum(used), "sum", events)
    tape.register_gradient_ready_hook(unused, lambda g: events.append(("unused", g)))
    tape.register_gradient_ready_hook(used, lambda g: events.append(("used", g is not None)))
    grads = tape.gradient(loss, (used, unused))
    # the unused leaf's gradient is final from the start: its hook is called first
    assert events == [("unused", None), "backward past sum", ("used", True)]
    np.testing.assert_array_equal(grads[1], [0.0])  # the unconnected zero, as without a hook
    calls = []
    with Tape() as tape:
        tape.watch((used, unused))
        loss = ops.sum(used)
    tape.register_gradient_ready_hook(unused, lambda g: np.array([7.0]))  # replaces None
    tape.register_gradient_ready_hook(used, calls.append)
    grads = tape.gradient(loss, (used, unused))
    np.testing.assert_array_equal(grads[1], [7.0])
    np.testing.assert_array_equal(calls[0], [1.0, 1.0])


def test_removed_hooks_are_not_called_and_bad_hooks_are_refused() -> None:
    w, calls = np.array([1.0]), []
    with Tape(persistent=True) as tape:
        tape.watch(w)
        y = ops.square(w)
        loss = ops.sum(y)
    handle = tape.register_gradient_ready_hook(w, calls.append)
    tape.gradient(loss, w)
    handle.remove()
    handle.remove()
    tape.gradient(loss, w)
    assert len(calls) == 1
    with pytest.raises(TypeError, match=r"hook must be callable as hook\(gradient\), got int"):
        tape.register_gradient_ready_hook(w, 3)
    with pytest.raises(ValueError, match=r"watched on this tape.*a recorded result"):
        tape.register_gradient_ready_hook(y, calls.append)
    with pytest.raises(ValueError, match="not watched on this tape"):
        tape.register_gradient_ready_hook(np.ones(1), calls.append)


def test_a_raising_hook_ends_gradient_with_its_error() -> None:
    w = np.array([1.0])
    with Tape() as tape:
        tape.watch(w)
        loss = ops.sum(ops.square(w))

    def refuse(g: Any) -> None:
        raise KeyError("from the hook")

    tape.register_gradient_ready_hook(w, refuse)
    with pytest.raises(KeyError, match="from the hook"):
        tape.gradient(loss, w)


def _counting_vjp(gs: list[Any], xs: Any, needs: Any, zs: Any, aux: list[Any]) -> Any:
    aux.append(gs[0].copy())
    return (gs[0],)


def test_a_collective_node_runs_with_a_zero_cotangent_when_no_gradient_reaches_it() -> None:
    """A rank whose loss ignores a collective's output must still run the collective's vjp."""
    from cupy_parallel._src import recording

    recording.mark_collective(_counting_vjp)
    w, cotangents = np.array([1.0, 2.0]), []
    with Tape() as tape:
        tape.watch(w)
        ignored = w.copy()
        recording.record(_counting_vjp, (w,), (ignored,), cotangents)
        loss = ops.sum(ops.square(w))  # does not use `ignored`
    grad = tape.gradient(loss, w)
    np.testing.assert_array_equal(grad, 2 * w)
    assert len(cotangents) == 1
    np.testing.assert_array_equal(cotangents[0], np.zeros(2))  # ran, with zeros
    # an unmarked vjp that no gradient reaches is skipped, as before
    skipped: list[Any] = []
    with Tape() as tape:
        tape.watch(w)
        recording.record(_probe_vjp, (w,), (w.copy(),), skipped)
        loss = ops.sum(w)
    tape.gradient(loss, w)
    assert skipped == []


def _probe_vjp(gs: list[Any], xs: Any, needs: Any, zs: Any, aux: list[Any]) -> Any:
    aux.append(gs[0])
    return (gs[0],)


class _LoggedProbe(Function):
    """The identity, logging when its backward runs."""

    events: ClassVar[list[str]] = []

    @staticmethod
    def forward(ctx: Any, x: Any) -> Any:
        return x.copy()

    @staticmethod
    def backward(ctx: Any, g: Any) -> Any:
        _LoggedProbe.events.append("probe backward")
        return g


def test_ready_hooks_run_mid_pass_in_the_order_gradients_become_final() -> None:
    w1, w2, unused, side = rand(3, 3), rand(3, 1, seed=1), rand(2, seed=2), rand(3, seed=3)
    events = _LoggedProbe.events = []
    with Tape() as tape:
        tape.watch((w1, w2, unused, side))
        h = _LoggedProbe.apply(ops.tanh(ops.matmul(rand(2, 3, seed=4), w1)))
        _ = ops.sum(side)  # consumed, but not on the target's path
        loss = ops.sum(ops.matmul(h, w2))
    for name, leaf in {"w1": w1, "w2": w2, "unused": unused, "side": side}.items():
        tape.register_gradient_ready_hook(
            leaf, lambda g, n=name: events.append(f"{n} {'None' if g is None else g.shape}")
        )
    grads = tape.gradient(loss, (w1, w2, unused, side))
    # unused: final from the start; w2 before the probe's backward, w1 after it; side (its
    # consumer recorded between them, no gradient reaches it) gets None once that node is passed
    assert events == ["unused None", "w2 (3, 1)", "side None", "probe backward", "w1 (3, 3)"]
    np.testing.assert_array_equal(grads[2], np.zeros(2))


@pytest.mark.parametrize(
    ("name", "op"),
    [
        ("reshape to a list", lambda x: ops.reshape(x, [3, 2])),
        ("transpose by a list", lambda x: ops.transpose(x, [1, 0])),
        ("a scalar first", lambda x: ops.multiply(2.0, x)),
        ("a power of 0", lambda x: ops.power(x, 0.0)),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_host_ops_off_the_fast_paths_match_numpy(name: str, op: Any) -> None:
    """The ops' general paths (a list where the fast path takes a tuple, a scalar operand
    first): host arrays give NumPy's values and gradients."""
    data = np.arange(1.0, 7.0).reshape(2, 3)
    results = []
    for x in (data.copy(), to_device(data.copy(), "host:0")):
        with Tape() as tape:
            tape.watch(x)
            y = op(x)
            loss = ops.sum(ops.multiply(y, y))
        results.append((to_numpy(y), to_numpy(tape.gradient(loss, x))))
    (want_y, want_g), (got_y, got_g) = results
    np.testing.assert_array_equal(got_y, want_y)
    np.testing.assert_array_equal(got_g, want_g)


def test_a_unary_op_of_a_python_scalar_gives_numpy_s_0d_array() -> None:
    got = ops.tanh(0.5)
    assert type(got) is np.ndarray
    assert got.shape == ()
    assert got == np.tanh(0.5)
