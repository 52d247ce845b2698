"""A parameter replaced after the optimizer was built is refused at the next step.

The optimizers update the arrays they were given in place. A leaf of the params tree replaced
by another array (``params["w"] = w - lr * g``, ``ddp.params["w"] = new``) used to leave the
step moving the old, orphaned array while the tree the model reads kept its value, with no
error (torch has the same trap with a re-assigned ``Parameter``). Each test here failed before
(``DID NOT RAISE``: on 2 DDP ranks ``ddp.params["w"]`` stayed at [2, 2] while the optimizer
moved its old array). The oracles: NumPy's arithmetic for SGD, a one-process run of the same
optimizer on a plain dict for the ranks, and the values from before the refused step.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import cupy_parallel as cp
from cupy_parallel import distributed as dist
from cupy_parallel import ops
from cupy_parallel.distributed.optim import ZeroRedundancyOptimizer
from cupy_parallel.optim import SGD, Adam

REPLACED = r"is no longer the array this {} updates.*still holds the old array.*in place"


def test_a_replaced_leaf_of_ddp_params_is_refused_on_every_rank() -> None:
    def program(rank: int) -> Any:
        ddp = cp.DistributedDataParallel(
            lambda p, x: ops.sum(ops.multiply(p["w"], x)), {"w": np.array([2.0, 2.0])}
        )
        opt = Adam(ddp.params, lr=0.1)

        def step() -> None:
            with cp.Tape() as tape:
                tape.watch(ddp.params)  # the rebound array too, on any DDP
                loss = ddp(np.array([1.0, 2.0 + rank]))  # averaged gradient: [1, 2.5]
            opt.step(tape.gradient(loss, ddp.params))

        step()
        held = opt.param_groups[0]["params"][0]
        after_one = held.copy()
        ddp.params["w"] = ddp.params["w"] - 0.0  # a functional update: a new array
        with pytest.raises(ValueError, match=REPLACED.format("Adam")) as raised:
            step()
        assert "params['w']" in str(raised.value)
        np.testing.assert_array_equal(held, after_one)  # nothing written
        assert opt.state[0]["step"] == 1.0
        ddp.params["w"] = held  # put back, then updated in place: fine
        ddp.params["w"][...] = ddp.params["w"] * 1.0
        step()
        return ddp.params["w"], held

    plain = {"w": np.array([2.0, 2.0])}
    oracle = Adam(plain, lr=0.1)
    for _ in range(2):
        oracle.step({"w": np.array([1.0, 2.5])})
    for w, held in dist.spawn(program, 2, timeout=60):
        assert w is held
        np.testing.assert_allclose(w, plain["w"], rtol=0, atol=1e-15)


def test_a_replaced_leaf_of_a_dict_is_refused_before_any_update() -> None:
    params = {"b": np.zeros(2), "w": np.ones(2)}
    opt = Adam(params, lr=0.1)
    old_w = params["w"]
    params["b"] = np.zeros(2)  # equal values, another array
    grads = {"b": np.ones(2), "w": np.ones(2)}
    with pytest.raises(ValueError, match=r"params\['b'\] " + REPLACED.format("Adam")):
        opt.step(grads)
    np.testing.assert_array_equal(old_w, [1.0, 1.0])  # "w" comes after "b": not moved either
    assert opt.state == {}


def test_a_replaced_leaf_of_a_nested_list_is_named_by_its_path() -> None:
    params = [np.ones(2), [np.ones(3), np.ones(1)]]
    opt = SGD(params, lr=0.5)
    params[1][0] = params[1][0] * 1.0
    with pytest.raises(ValueError, match=r"params\[1\]\[0\] " + REPLACED.format("SGD")):
        opt.step([np.ones(2), [np.ones(3), np.ones(1)]])
    np.testing.assert_array_equal(params[0], [1.0, 1.0])


def test_a_replaced_leaf_in_a_later_param_group_stops_every_group() -> None:
    first, second = {"a": np.ones(2)}, [np.ones(1), np.ones(3)]
    opt = SGD([{"params": first}, {"params": second, "lr": 0.01}], lr=0.5)
    second[1] = np.ones(3)
    with pytest.raises(ValueError, match=r"param_groups\[1\]\['params'\]\[1\] is no longer"):
        opt.step([{"a": np.ones(2)}, [np.ones(1), np.ones(3)]])
    np.testing.assert_array_equal(first["a"], [1.0, 1.0])
    added = {"c": np.ones(2)}  # a group added later is checked as well
    second[1] = opt.param_groups[1]["params"][1]
    opt.add_param_group({"params": added})
    added["c"] = np.ones(2)
    with pytest.raises(ValueError, match=r"param_groups\[2\]\['params'\]\['c'\] is no longer"):
        opt.step([{"a": None}, [None, None], {"c": np.ones(2)}])


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda p: p.update(new=np.ones(2)), r"params changed structure.*add_param_group"),
        (lambda p: p.pop("b"), r"params changed structure"),
        (lambda p: p.update(count=np.ones(3)), r"params\['count'\] is a floating-point array now"),
    ],
)
def test_a_changed_structure_or_a_new_float_leaf_is_refused(change: Any, match: str) -> None:
    params = {"b": np.zeros(2), "count": np.arange(3), "name": "mlp", "w": np.ones(2)}
    opt = SGD(params, lr=0.5)
    change(params)
    with pytest.raises(ValueError, match=match):
        opt.step({"b": None, "count": None, "name": None, "w": np.ones(2)})
    np.testing.assert_array_equal(opt.param_groups[0]["params"][1], [1.0, 1.0])


def test_updates_in_place_and_replaced_non_parameters_pass() -> None:
    params = {"count": np.arange(3), "name": "mlp", "w": np.ones(2)}
    opt = SGD(params, lr=0.5)
    w = params["w"]
    params["w"][...] = [3.0, 5.0]
    params["w"] -= 1.0  # NumPy's in-place subtraction: the same array
    params["w"] = params["w"]
    params["count"] = np.arange(4)  # not parameters: ride along, replaceable
    params["name"] = "mlp2"
    opt.step({"count": None, "name": None, "w": np.array([2.0, 4.0])})
    assert params["w"] is w
    np.testing.assert_array_equal(w, np.array([2.0, 4.0]) - 0.5 * np.array([2.0, 4.0]))


def test_a_new_optimizer_takes_over_the_replaced_arrays_and_the_state() -> None:
    params = {"w": np.ones(2)}
    old = Adam(params, lr=0.1)
    old.step({"w": np.ones(2)})
    params["w"] = params["w"].copy()  # e.g. moved to another device
    with pytest.raises(ValueError, match=r"build a new Adam over the new arrays"):
        old.step({"w": np.ones(2)})
    new = Adam(params, lr=0.1)
    new.load_state_dict(old.state_dict())  # state_dict does not check: the way out
    new.step({"w": np.ones(2)})
    plain = {"w": np.ones(2)}
    oracle = Adam(plain, lr=0.1)
    for _ in range(2):
        oracle.step({"w": np.ones(2)})
    np.testing.assert_allclose(params["w"], plain["w"], rtol=0, atol=1e-15)


def test_zero_refuses_a_replaced_leaf_on_every_rank_before_its_collectives() -> None:
    def program(rank: int) -> Any:
        params = {"b": np.zeros(3), "w": np.ones((2, 2))}
        zero = ZeroRedundancyOptimizer(params, SGD, lr=0.5)
        grads = {"b": np.ones(3), "w": np.ones((2, 2))}
        zero.step(grads)
        old = dict(params)
        params["w"] = params["w"] + 0.0
        replaced = r"params\['w'\] " + REPLACED.format("ZeroRedundancyOptimizer")
        with pytest.raises(ValueError, match=replaced):
            zero.step(grads)
        params["w"] = old["w"]
        zero.step(grads)  # every rank still pairs its collectives
        return params

    for params in dist.spawn(program, 2, timeout=60):
        np.testing.assert_array_equal(params["b"], np.zeros(3) - 2 * 0.5)
        np.testing.assert_array_equal(params["w"], np.ones((2, 2)) - 2 * 0.5)


def test_an_optimizer_over_fsdp_params_refuses_a_replaced_shard() -> None:
    def program(rank: int) -> Any:
        fsdp = cp.FullyShardedDataParallel(
            lambda p, x: ops.sum(ops.multiply(p["a"]["w"], x)), {"a": {"w": np.ones(4)}}
        )
        opt = SGD(fsdp.params, lr=0.5)
        shard = fsdp.params["a"]["w"]
        fsdp.params["a"]["w"] = shard * 1.0
        with pytest.raises(ValueError, match=r"params\['a'\]\['w'\] " + REPLACED.format("SGD")):
            opt.step({"a": {"w": np.ones(2)}})
        return shard

    for shard in dist.spawn(program, 2, timeout=60):
        np.testing.assert_array_equal(shard, [1.0, 1.0])


# -- a whole new tree bound to ddp.params --------------------------------------------------------
#
# Before: the first two tests failed (DID NOT RAISE): the optimizer moved the old arrays while
# ddp.params, the new tree, kept its values. The third passed and pins that a new tree holding
# the optimizer's own arrays is no rebinding.

LET_GO = r"params\['w'\] is an array ddp\.params no longer holds.*Build the {0} over the new"


def _ddp() -> Any:
    return cp.DistributedDataParallel(
        lambda p, x: ops.sum(ops.multiply(p["w"], x)), {"w": np.array([2.0, 2.0])}
    )


def _step(ddp: Any, opt: Any, rank: int) -> None:
    with cp.Tape() as tape:
        loss = ddp(np.array([1.0, 2.0 + rank]))  # averaged gradient: [1, 2.5]
    opt.step(tape.gradient(loss, ddp.params))


def test_a_new_tree_bound_to_ddp_params_is_refused_at_the_step_on_every_rank() -> None:
    def program(rank: int) -> Any:
        ddp = _ddp()
        opt = Adam(ddp.params, lr=0.1)
        _step(ddp, opt, rank)
        old = opt.param_groups[0]["params"][0]
        after_one = old.copy()
        ddp.params = {"w": ddp.params["w"] - 0.0}  # a functional update of the whole tree
        with pytest.raises(ValueError, match=LET_GO.format("Adam")):
            _step(ddp, opt, rank)
        np.testing.assert_array_equal(old, after_one)  # nothing written
        assert opt.state[0]["step"] == 1.0
        fresh = Adam(ddp.params, lr=0.1)  # the way out the message names
        fresh.load_state_dict(opt.state_dict())
        _step(ddp, fresh, rank)
        return ddp.params["w"]

    want = _two_adam_steps_in_one_process()
    for w in dist.spawn(program, 2, timeout=60):
        np.testing.assert_allclose(w, want, rtol=0, atol=1e-15)


def test_an_optimizer_built_before_the_ddp_or_over_a_subtree_is_refused_too() -> None:
    def program(rank: int) -> Any:
        params = {"w": np.array([2.0, 2.0])}
        before = SGD(params, lr=0.5)  # built over the tree the DDP then takes
        ddp = cp.DistributedDataParallel(lambda p, x: ops.sum(ops.multiply(p["w"], x)), params)
        subtree = SGD([ddp.params["w"]], lr=0.5)
        ddp.params = {"w": np.zeros(2)}
        with pytest.raises(ValueError, match=LET_GO.format("SGD")):
            before.step({"w": np.ones(2)})
        with pytest.raises(ValueError, match=r"params\[0\] is an array ddp\.params no longer"):
            subtree.step([np.ones(2)])
        ddp.params = params  # bound back: its arrays are read again, the steps are fine
        before.step({"w": np.ones(2)})
        subtree.step([np.ones(2)])
        return ddp.params["w"]

    for w in dist.spawn(program, 2, timeout=60):
        np.testing.assert_array_equal(w, [1.0, 1.0])  # two SGD steps of 0.5


def test_a_new_tree_holding_the_same_arrays_is_no_rebinding() -> None:
    def program(rank: int) -> Any:
        ddp = _ddp()
        opt = Adam(ddp.params, lr=0.1)
        _step(ddp, opt, rank)
        ddp.params = dict(ddp.params)  # a new dict, the optimizer's arrays: still read
        _step(ddp, opt, rank)
        return ddp.params["w"]

    want = _two_adam_steps_in_one_process()
    for w in dist.spawn(program, 2, timeout=60):
        np.testing.assert_allclose(w, want, rtol=0, atol=1e-15)


def _two_adam_steps_in_one_process() -> Any:
    """The oracle: the parameter after two of ``_step``'s Adam steps, taken in one process."""
    plain = {"w": np.array([2.0, 2.0])}
    oracle = Adam(plain, lr=0.1)
    for _ in range(2):
        oracle.step({"w": np.array([1.0, 2.5])})
    return plain["w"]


def test_a_new_tree_holding_the_same_arrays_at_swapped_leaves_is_refused() -> None:
    # Before: no error, and the step moved the wrong arrays: the optimizer, built over
    # {"a": a, "b": b}, applied the gradient of the model's leaf "a" (now the array b) to a,
    # so a moved by b's gradient and b by a's (here a=[-1, -1], b=[1, 1], both wrong).
    def model(p: Any, x: Any) -> Any:
        return ops.add(ops.sum(ops.multiply(p["a"], x)), ops.sum(ops.multiply(p["b"], 0.0 * x)))

    def program(rank: int) -> Any:
        ddp = cp.DistributedDataParallel(model, {"a": np.ones(2), "b": np.ones(2)})
        opt = SGD(ddp.params, lr=1.0)
        a, b = ddp.params["a"], ddp.params["b"]
        ddp.params = {"a": b, "b": a}  # the same arrays, each at the other's leaf
        with cp.Tape() as tape:
            loss = ddp(np.array([2.0, 2.0]))
        grads = tape.gradient(loss, ddp.params)  # "a" (the array b): [2, 2]; "b": zeros
        with pytest.raises(ValueError, match=LET_GO.format("SGD").replace("'w'", "'a'")):
            opt.step(grads)
        np.testing.assert_array_equal(a, [1.0, 1.0])  # nothing written
        ddp.params = {"a": a, "b": b}  # bound back, each at its own leaf: held again
        opt.step({"a": np.array([2.0, 2.0]), "b": np.zeros(2)})
        return a, b

    for a, b in dist.spawn(program, 2, timeout=60):  # the oracle: SGD's arithmetic, lr 1
        np.testing.assert_array_equal(a, [-1.0, -1.0])
        np.testing.assert_array_equal(b, [1.0, 1.0])


def test_a_leaf_replaced_in_place_is_refused_before_the_next_forward_call() -> None:
    # Before: the step right after ddp.params["w"] = new (no forward call between, which is
    # where the DDP read its tree again) moved the old array, no error: the model read [1, 1]
    # while the optimizer's array went to [0.5, 0]; only the step after raised.
    def program(rank: int) -> Any:
        ddp = cp.DistributedDataParallel(
            lambda p, x: ops.sum(ops.multiply(p["w"], x)), {"w": np.ones(2)}
        )
        opt = SGD([ddp.params["w"]], lr=0.5)  # over the arrays, not the tree
        old = ddp.params["w"]
        with cp.Tape() as tape:
            loss = ddp(np.array([1.0, 2.0]))
        grads = tape.gradient(loss, ddp.params)
        ddp.params["w"] = ddp.params["w"].copy()  # the model reads another array now
        with pytest.raises(ValueError, match=r"params\[0\] is an array ddp\.params no longer"):
            opt.step([grads["w"]])
        np.testing.assert_array_equal(old, [1.0, 1.0])  # nothing written
        fresh = SGD([ddp.params["w"]], lr=0.5)
        fresh.step([grads["w"]])
        return ddp.params["w"]

    for w in dist.spawn(program, 2, timeout=60):  # the oracle: SGD's arithmetic
        np.testing.assert_array_equal(w, np.ones(2) - 0.5 * np.array([1.0, 2.0]))
