"""The tape: recording, reverse accumulation, pytrees, errors, Functions, threads."""

from __future__ import annotations

import collections
import contextvars
import threading
from typing import Any

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
    assert cupy_parallel._src.tape.active_tape() is None


def test_innermost_tape_records() -> None:
    x = rand(2)
    with Tape() as outer:
        outer.watch(x)
        with Tape() as inner:
            inner.watch(x)
            y = ops.sum(ops.square(x))
        z = ops.sum(ops.exp(x))
    np.testing.assert_allclose(inner.gradient(y, x), 2 * x)
    np.testing.assert_allclose(outer.gradient(z, x), np.exp(x))
    assert not outer.tracks(y)


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
    with pytest.raises(TypeError, match=r"sources\[1\] is a float"):
        tape.gradient(y, [x, 1.0], output_gradients=seed)
    with pytest.raises(TypeError, match="target to be an array, got float"):
        tape.gradient(1.0, x)
    with pytest.raises(ValueError, match="empty structure"):
        tape.gradient([], x)
    tape.gradient(y, x, output_gradients=seed)  # none of the above consumed the tape


def test_watch_errors() -> None:
    tape = Tape()
    with pytest.raises(TypeError, match=r"params\['n'\] is a int"):
        tape.watch({"w": np.ones(2), "n": 3})
    with pytest.raises(TypeError, match=r"params\[0\] has dtype int64.*astype"):
        tape.watch([np.arange(3)])
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
            r"invalid gradient for argument 0: expected shape \(2,\) on cpu, got",
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


def test_ctx_argument_errors() -> None:
    ctx = cupy_parallel._src.tape.FunctionContext((True,))
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
