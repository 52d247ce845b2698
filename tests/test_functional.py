"""grad and value_and_grad: against closed forms, finite differences and the tape itself."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import cupy_parallel as cp
from cupy_parallel import Tape, gradcheck, ops, to_device


def rand(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-1.0, 1.0, shape)


def loss(params: dict[str, Any], x: Any) -> Any:
    """``sum((w x)^2) + sum(exp(b))``."""
    scaled = ops.multiply(params["w"], x)
    return ops.add(ops.sum(ops.square(scaled)), ops.sum(ops.exp(params["b"])))


def params_and_input() -> tuple[dict[str, Any], np.ndarray]:
    return {"w": rand(3), "b": rand(3, seed=1), "activation": "tanh"}, rand(3, seed=2)


def test_grad_over_a_params_pytree_matches_the_closed_form() -> None:
    params, x = params_and_input()
    grads = cp.grad(loss)(params, x)
    assert grads["activation"] is None  # non-array leaves are skipped, as replicate skips them
    np.testing.assert_allclose(grads["w"], 2 * params["w"] * x * x, rtol=1e-14)
    np.testing.assert_allclose(grads["b"], np.exp(params["b"]), rtol=1e-14)


def test_value_and_grad_returns_the_value_and_the_tape_gradient() -> None:
    params, x = params_and_input()
    value, grads = cp.value_and_grad(loss)(params, x)
    np.testing.assert_allclose(value, np.sum((params["w"] * x) ** 2) + np.exp(params["b"]).sum())
    with Tape() as tape:
        watched = {"w": params["w"], "b": params["b"]}
        tape.watch(watched)
        expected = tape.gradient(loss({**params, **watched}, x), watched)
    np.testing.assert_array_equal(grads["w"], expected["w"])
    np.testing.assert_array_equal(grads["b"], expected["b"])


def test_argnums_tuple_and_negative_positions() -> None:
    params, x = params_and_input()
    grads = cp.grad(loss, argnums=(0, -1))(params, x)
    assert isinstance(grads, tuple)
    assert len(grads) == 2
    np.testing.assert_allclose(grads[1], 2 * params["w"] ** 2 * x, rtol=1e-14)
    np.testing.assert_allclose(grads[0]["w"], 2 * params["w"] * x * x, rtol=1e-14)


def test_has_aux_passes_aux_through() -> None:
    params, x = params_and_input()

    def with_aux(p: Any, x: Any) -> Any:
        value = loss(p, x)
        return value, {"value": value}

    (value, aux), grads = cp.value_and_grad(with_aux, has_aux=True)(params, x)
    assert aux["value"] is value
    grads_only, aux_only = cp.grad(with_aux, has_aux=True)(params, x)
    np.testing.assert_array_equal(grads_only["w"], grads["w"])
    np.testing.assert_array_equal(aux_only["value"], value)


def cube(x: Any) -> Any:
    return ops.sum(ops.multiply(ops.multiply(x, x), x))


def test_grad_of_grad_is_the_second_derivative() -> None:
    x = rand(4)
    second = cp.grad(lambda x: ops.sum(cp.grad(cube)(x)))(x)
    np.testing.assert_allclose(second, 6 * x, rtol=1e-14)
    assert gradcheck(cp.grad(cube), [x])  # the Hessian of cube against finite differences


def test_grad_on_host_devices_keeps_the_devices() -> None:
    x = to_device(rand(3), "host:2")
    g = cp.grad(lambda x: ops.sum(ops.exp(to_device(x, "host:0"))))(x)
    assert g.device == x.device
    np.testing.assert_allclose(np.asarray(to_device(g, "cpu")), np.exp(rand(3)), rtol=1e-14)


def test_grad_under_an_outer_tape_is_recorded() -> None:
    x, v = rand(3), rand(3, seed=1)
    with Tape() as outer:
        outer.watch(x)
        g = cp.grad(cube)(x)
        gv = ops.sum(ops.multiply(g, v))
    np.testing.assert_allclose(outer.gradient(gv, x), 6 * x * v, rtol=1e-14)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"argnums": 1.0}, TypeError, r"argnums must be an int or a tuple of ints, got 1.0"),
        ({"argnums": True}, TypeError, "argnums must be an int or a tuple of ints, got True"),
        ({"argnums": [0]}, TypeError, r"argnums must be an int or a tuple of ints, got \[0\]"),
        ({"argnums": ()}, ValueError, "argnums must name at least one argument"),
        ({"argnums": (0, 0)}, ValueError, r"must not repeat an argument, got \(0, 0\)"),
        ({"has_aux": 1}, TypeError, "has_aux"),
    ],
    ids=["float", "bool", "list", "empty", "repeated", "has-aux"],
)
def test_bad_arguments_are_refused_at_once(kwargs: Any, error: type, match: str) -> None:
    for transform in (cp.grad, cp.value_and_grad):
        with pytest.raises(error, match=match):
            transform(cube, **kwargs)


def test_errors_when_called() -> None:
    x = rand(3)
    with pytest.raises(TypeError, match="fn must be callable, got int"):
        cp.grad(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="argnums names argument 2, but the function was called"):
        cp.grad(lambda a, b: cube(a), argnums=2)(x, x)
    with pytest.raises(TypeError, match="has_aux=True needs fn to return a pair"):
        cp.grad(cube, has_aux=True)(x)
    # named in grad's words (fn's value, its arguments), not the tape's (target, params[0])
    with pytest.raises(ValueError, match=r"fn's value has shape \(3,\): an implicit output"):
        cp.grad(ops.exp)(x)
    with pytest.raises(ValueError, match=r"value_and_grad\(\) needs fn's value to be computed"):
        cp.value_and_grad(lambda a, b: cube(b))(x, x.copy())  # independent of argnums: refused
    with pytest.raises(TypeError, match=r"grad\(\) needs fn's value to be an array .* float"):
        cp.grad(lambda a: 1.0)(x)
    with pytest.raises(TypeError, match=r"fn's value \(the first item of its pair\) is complex"):
        cp.grad(lambda a: (ops.sum(ops.multiply(a, 1j)), None), has_aux=True)(x)
    with pytest.raises(TypeError, match=r"grad\(\) differentiates .* argument 1\['w'\] has"):
        cp.grad(mixed, argnums=(0, 1))(x, {"w": np.arange(3)})


def _partial_by_differences(fn: Any, args: list[np.ndarray], i: int, eps: float = 1e-6) -> Any:
    """The partial derivative of the scalar ``fn(*args)`` in argument ``i``, by differences."""
    result = np.zeros_like(args[i])
    for index in np.ndindex(args[i].shape):
        values = []
        for step in (eps, -eps):
            moved = [a.copy() for a in args]
            moved[i][index] += step
            values.append(float(fn(*moved)))
        result[index] = (values[0] - values[1]) / (2 * eps)
    return result


def mixed(a: Any, b: Any) -> Any:
    """``sum(a * b**2 + exp(a))``: its two partials differ, so they cannot be confused."""
    return ops.sum(ops.add(ops.multiply(a, ops.square(b)), ops.exp(a)))


def test_one_array_passed_twice_gets_the_partial_derivatives() -> None:
    """Each argument is its own variable, as in jax.grad: not the total derivative twice."""
    x = rand(3)
    ga, gb = cp.grad(mixed, argnums=(0, 1))(x, x)
    for i, g in enumerate((ga, gb)):
        np.testing.assert_allclose(g, _partial_by_differences(mixed, [x, x], i), rtol=1e-7)
    np.testing.assert_allclose(ga, x**2 + np.exp(x), rtol=1e-14)
    np.testing.assert_allclose(gb, 2 * x * x, rtol=1e-14)
    value, (vb, va) = cp.value_and_grad(mixed, argnums=(1, 0))(x, x)  # in argnums order
    np.testing.assert_allclose(value, np.sum(x**3 + np.exp(x)), rtol=1e-14)
    np.testing.assert_array_equal(va, ga)
    np.testing.assert_array_equal(vb, gb)


def test_one_array_at_two_leaves_of_a_params_tree_gets_the_partials() -> None:
    x = rand(3)
    grads = cp.grad(lambda p: mixed(p["a"], p["pair"][1]))({"a": x, "pair": (1.0, x)})
    assert grads["pair"][0] is None
    np.testing.assert_allclose(grads["a"], _partial_by_differences(mixed, [x, x], 0), rtol=1e-7)
    np.testing.assert_allclose(grads["pair"][1], 2 * x * x, rtol=1e-14)


def test_other_references_to_the_argument_are_constants() -> None:
    """A closure over the array, or the array as an argument not in argnums: constants (JAX)."""
    x = rand(3)
    np.testing.assert_allclose(cp.grad(lambda a: mixed(a, x))(x), x**2 + np.exp(x), rtol=1e-14)
    np.testing.assert_allclose(cp.grad(mixed, argnums=1)(x, x), 2 * x * x, rtol=1e-14)


def test_partials_of_one_array_nest_and_record_on_an_outer_tape() -> None:
    x = rand(3)
    # d/da and d/db of sum(d mixed / da) = sum(b**2 + exp(a)): exp(a) and 2 b
    first_in_a = cp.grad(mixed)
    ga, gb = cp.grad(lambda a, b: ops.sum(first_in_a(a, b)), argnums=(0, 1))(x, x)
    np.testing.assert_allclose(ga, np.exp(x), rtol=1e-14)
    np.testing.assert_allclose(gb, 2 * x, rtol=1e-14)
    with Tape() as outer:  # the partials are functions of x: x**2 + exp(x) and 2 x**2
        outer.watch(x)
        pa, pb = cp.grad(mixed, argnums=(0, 1))(x, x)
        total = ops.sum(ops.add(pa, pb))
    np.testing.assert_allclose(outer.gradient(total, x), 6 * x + np.exp(x), rtol=1e-14)


def test_a_tape_gives_one_watched_array_its_total_derivative_at_every_entry() -> None:
    """Tape.gradient knows arrays by identity, as torch.autograd.grad(y, (x, x)) (both 2 x)."""
    x = rand(3)
    with Tape() as tape:
        tape.watch(x)
        y = ops.sum(ops.multiply(x, x))
    first, second = tape.gradient(y, (x, x))
    np.testing.assert_allclose(first, 2 * x, rtol=1e-14)
    np.testing.assert_allclose(second, 2 * x, rtol=1e-14)


def test_argnums_naming_one_argument_twice_is_refused() -> None:
    x = rand(3)
    with pytest.raises(ValueError, match=r"argnums \(1, -1\) names one argument twice"):
        cp.grad(mixed, argnums=(1, -1))(x, x)
