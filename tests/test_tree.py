"""The one flattener: every pytree entry of the library sees unregistered container subclasses.

``class L(list)`` that nobody registered with optree is a list to ``scatter``/``gather``; it must
be one to ``Tape.watch``/``gradient``, ``stop_gradient``, ``replicate`` and ``data_parallel`` as
well (optree alone sees it as a single leaf, so each of them used to track or copy nothing).
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import to_numpy

import cupy_parallel as cp
from cupy_parallel import ops
from cupy_parallel._src import tree


class L(list):
    """A list subclass registered with nobody."""


class D(dict):
    """A dict subclass registered with nobody."""


@pytest.fixture(autouse=True)
def _two_devices() -> None:
    cp.set_host_device_count(2)


def test_flatten_sees_through_an_unregistered_subclass() -> None:
    names, leaves, spec = tree.flatten_with_names(D(a=L([1, 2]), b=3), "p")
    assert names == ["p['a'][0]", "p['a'][1]", "p['b']"]
    assert leaves == [1, 2, 3]
    rebuilt = spec.unflatten([10, 20, 30])
    assert type(rebuilt) is D
    assert type(rebuilt["a"]) is L
    assert rebuilt == {"a": [10, 20], "b": 30}


def test_tape_watch_and_gradient_through_a_list_subclass() -> None:
    x, y = np.array([1.0, 2.0]), np.array([3.0, -1.0])
    with cp.Tape() as tape:
        tape.watch(L([x, y]))
        loss = ops.sum(ops.multiply(x, y))
    grads = tape.gradient(loss, L([x, y]))
    assert type(grads) is L
    np.testing.assert_array_equal(grads[0], y)  # oracle: d(x.y)/dx = y
    np.testing.assert_array_equal(grads[1], x)


def test_stop_gradient_reaches_into_a_list_subclass() -> None:
    x = np.array([1.0, 2.0])
    with cp.Tape() as tape:
        tape.watch(x)
        fixed = cp.stop_gradient(L([x]))
        assert type(fixed) is L
        assert fixed[0] is not x
        y = ops.multiply(x, fixed[0])
    np.testing.assert_array_equal(tape.gradient(y, x, output_gradients=np.ones(2)), x)


def test_replicate_copies_the_arrays_inside_a_list_subclass() -> None:
    w = cp.to_device(np.arange(3.0), "host:0")
    replicas = cp.replicate(L([w, "tanh"]), ["host:0", "host:1"])
    assert [type(r) for r in replicas] == [L, L]
    assert [str(cp.device_of(r[0])) for r in replicas] == ["host:0", "host:1"]
    np.testing.assert_array_equal(to_numpy(replicas[1][0]), np.arange(3.0))
    assert replicas[1][1] == "tanh"


def test_data_parallel_with_list_subclass_params_matches_one_device() -> None:
    rng = np.random.default_rng(0)
    w0, b0 = rng.normal(size=(3, 2)), rng.normal(size=2)
    x = rng.normal(size=(5, 3))
    params = L([cp.to_device(w0, "host:0"), cp.to_device(b0, "host:0")])

    def model(p: L, batch: object) -> object:
        return ops.add(ops.matmul(batch, p[0]), p[1])

    with cp.Tape() as tape:
        tape.watch(params)
        loss = ops.sum(ops.square(cp.data_parallel(model, params, x, ["host:0", "host:1"])))
    gw, gb = tape.gradient(loss, params)
    out = x @ w0 + b0  # oracle: the same model in NumPy on one device
    np.testing.assert_allclose(to_numpy(gw), 2 * x.T @ out, rtol=1e-12)
    np.testing.assert_allclose(to_numpy(gb), 2 * out.sum(axis=0), rtol=1e-12)
