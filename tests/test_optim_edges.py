"""Edge cases of the optimizers found by porting torch code, each one a former silent error.

The oracle is what torch does (or refuses) with the same input, stated in each test.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from cupy_parallel.optim import SGD, Adam


def test_a_read_only_parameter_is_refused_at_construction() -> None:
    # the step used to fail at the read-only parameter, after updating the ones before it and
    # leaving its own state half written (exp_avg filled, step still 0)
    first = np.ones(2)
    frozen = np.ones(3)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match=r"params\[1\] is read-only, but Adam\.step writes"):
        Adam([first, frozen])
    with pytest.raises(ValueError, match=r"params\['b'\] is read-only"):
        SGD({"a": first, "b": np.broadcast_to(np.ones(1), (3,))})


def test_a_self_overlapping_parameter_is_refused() -> None:
    # torch: "more than one element of the written-to tensor refers to a single memory
    # location"; the step kept the last element's update only ([0.7] * 3 for grads 1, 2, 3)
    one = np.lib.stride_tricks.as_strided(np.ones(1), (3,), (0,))
    with pytest.raises(ValueError, match=r"params\[0\] has strides \(0,\) for shape \(3,\)"):
        SGD([one], lr=0.1)


def test_parameters_sharing_memory_are_refused_in_and_across_groups() -> None:
    # each update read the other's result: buf[1:3] was moved twice per step
    buf = np.zeros(4)
    with pytest.raises(ValueError, match=r"params\[0\] and params\[1\] share memory"):
        SGD([buf[:3], buf[1:]], lr=1.0)
    opt = SGD([{"params": [buf[:2]]}], lr=1.0)
    with pytest.raises(
        ValueError,
        match=r"param_groups\[0\]\['params'\]\[0\] and param_groups\[1\]\['params'\]\['x'\] share",
    ):
        opt.add_param_group({"params": {"x": buf[1:]}})
    assert len(opt.param_groups) == 1
    SGD([buf[:2], buf[2:]], lr=1.0)  # disjoint views of one buffer are fine


def test_a_complex_parameter_is_refused_with_the_real_view_to_pass() -> None:
    # it rode along as a non-parameter: never updated, its gradient had to be None
    with pytest.raises(TypeError, match=r"params\['z'\] is a complex array \(complex128\)"):
        SGD({"w": np.ones(2), "z": np.ones(2, complex)}, lr=0.1)


def test_a_state_dict_taken_mid_run_stays_consistent_as_torch_s() -> None:
    # torch's state_dict holds each parameter's own state dict; ours copied it, so "step"
    # stayed 1.0 while exp_avg went on: loading it two steps later resumed with step 1 and the
    # moments of step 3, and two more steps gave [0.4548, 1.5452] where torch gives [0.5, 1.5]
    p = np.ones(2)
    opt = Adam([p], lr=0.1)
    g = np.array([1.0, -2.0])
    opt.step([g])
    sd = opt.state_dict()
    opt.step([g])
    opt.step([g])
    assert sd["state"][0]["step"] == 3.0
    opt.load_state_dict(sd)
    opt.step([g])
    opt.step([g])
    # the first five steps of Adam on a constant gradient move every entry by lr * sign
    np.testing.assert_allclose(p, [0.5, 1.5], rtol=1e-6)


def test_adamw_keeps_its_decay_decoupled_when_loading_an_adam_state_dict() -> None:
    # torch's AdamW sets decoupled_weight_decay=True on load; ours took Adam's False and went
    # on as Adam with L2 decay: after 3 steps from an Adam(weight_decay=0.1) dict, w differed
    # from AdamW's by 1.3e-2
    from cupy_parallel.optim import AdamW

    grads = [np.array([1.0, -0.5]), np.array([0.2, 0.3]), np.array([-1.0, 2.0])]
    want = np.array([1.0, -2.0])
    fresh = AdamW([want], lr=0.1, weight_decay=0.1)
    got = want.copy()
    loaded = AdamW([got], lr=0.1, weight_decay=0.1)
    adam = Adam([np.ones(2)], lr=0.1, weight_decay=0.1)
    adam.step([np.ones(2)])
    sd = adam.state_dict()
    sd["state"] = {}  # only the groups matter here
    loaded.load_state_dict(sd)
    assert loaded.param_groups[0]["decoupled_weight_decay"] is True
    for g in grads:
        fresh.step([g])
        loaded.step([g])
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("count", [2, 9], ids=["few", "many"])  # every pair / the sorted sweep
def test_a_gradient_sharing_memory_with_another_parameter_is_refused(count: int) -> None:
    # grads {"a": b, "b": a} (the gradient of sum(a * b), written by hand): a was updated
    # first and b's step read the new a: with a = 1, b = 2, lr = 0.5, b became 2.0 where
    # torch (whose .grad is a tensor of its own) gives 2 - 0.5 * 1 = 1.5
    params = {f"p{i}": np.full(2, float(i + 1)) for i in range(count)}
    a, b = params["p0"], params[f"p{count - 1}"]
    grads: dict[str, np.ndarray | None] = dict.fromkeys(params)
    grads["p0"], grads[f"p{count - 1}"] = b, a
    opt = SGD(params, lr=0.5)
    with pytest.raises(
        ValueError,
        match=rf"grads\['p{count - 1}'\] shares memory with another parameter \(the one "
        r"grads\['p0'\] is for\)",
    ):
        opt.step(grads)
    np.testing.assert_array_equal(a, [1.0, 1.0])
    grads["p0"], grads[f"p{count - 1}"] = b.copy(), a.copy()
    opt.step(grads)
    np.testing.assert_array_equal(a, [1.0 - 0.5 * count] * 2)
    np.testing.assert_array_equal(b, [count - 0.5] * 2)


def test_an_iterator_or_dict_view_of_arrays_is_refused() -> None:
    # torch converts params to a list; here a group {"params": d.values()} was an empty group
    # (the view is a leaf, no array): no parameter, no error until a confusing step
    d = {"a": np.ones(2), "b": np.ones(3)}
    with pytest.raises(TypeError, match=r"params is a dict_values, which is no pytree"):
        SGD([{"params": d.values()}], lr=0.1)
    with pytest.raises(TypeError, match=r"params is a generator"):
        SGD((x for x in d.values()), lr=0.1)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda p: Adam(p, lr=float("nan")), "Invalid learning rate: nan"),
        (lambda p: Adam(p, eps=float("nan")), "Invalid epsilon value: nan"),
        (lambda p: Adam(p, weight_decay=float("nan")), "Invalid weight_decay value: nan"),
        (lambda p: SGD(p, lr=float("nan")), "Invalid learning rate: nan"),
        (lambda p: SGD(p, lr=0.1, momentum=float("nan")), "Invalid momentum value: nan"),
        (lambda p: SGD(p, lr=0.1, dampening=float("nan")), "Invalid dampening value: nan"),
    ],
)
def test_a_nan_hyper_parameter_is_refused(make: Any, match: str) -> None:
    # torch's Adam refuses a NaN lr, eps or weight_decay; ours took them and made every
    # parameter NaN at the first step (torch's SGD does too: refused here as well)
    with pytest.raises(ValueError, match=match):
        make([np.ones(2)])


def test_a_nan_lr_set_mid_run_is_refused_before_any_update() -> None:
    p = np.ones(2)
    opt = Adam([p], lr=0.1)
    opt.param_groups[0]["lr"] = float("nan")  # a LambdaLR returning NaN, say
    with pytest.raises(ValueError, match="Invalid learning rate: nan"):
        opt.step([np.ones(2)])
    np.testing.assert_array_equal(p, np.ones(2))


def test_torch_param_names_place_the_state_when_sorted_keys_reorder_the_params() -> None:
    # torch.optim.Adam(model.named_parameters()) saves param_names in the model's order
    # ["2.weight", "10.weight"]; the dict {"2.weight": .., "10.weight": ..} flattens sorted
    # ("10.weight" first), and the state of equal shapes went to each other's parameter
    params = {"2.weight": np.ones(2), "10.weight": np.ones(2)}
    opt = Adam(params, lr=0.1)
    saved = {
        "state": {
            0: {"step": 1.0, "exp_avg": np.full(2, 2.0), "exp_avg_sq": np.full(2, 4.0)},
            1: {"step": 1.0, "exp_avg": np.full(2, 10.0), "exp_avg_sq": np.full(2, 100.0)},
        },
        "param_groups": [
            {**opt.state_dict()["param_groups"][0], "param_names": ["2.weight", "10.weight"]}
        ],
    }
    opt.load_state_dict(saved)
    ten, two = opt.state[0], opt.state[1]  # flatten order: "10.weight", "2.weight"
    np.testing.assert_array_equal(ten["exp_avg"], [10.0, 10.0])
    np.testing.assert_array_equal(two["exp_avg"], [2.0, 2.0])
    again = opt.state_dict()  # its names now in the order of its indices: reloads unchanged
    assert again["param_groups"][0]["param_names"] == ["10.weight", "2.weight"]
    opt.load_state_dict(again)
    np.testing.assert_array_equal(opt.state[0]["exp_avg"], [10.0, 10.0])
    nested = {"2": {"weight": np.ones(2)}, "10": {"weight": np.ones(2)}}  # torch's dotted names
    opt = Adam(nested, lr=0.1)
    opt.load_state_dict(saved)
    np.testing.assert_array_equal(opt.state[0]["exp_avg_sq"], [100.0, 100.0])
    del saved["param_groups"][0]["param_names"]  # without names, the position (torch's rule)
    opt.load_state_dict(saved)
    np.testing.assert_array_equal(opt.state[0]["exp_avg_sq"], [4.0, 4.0])
