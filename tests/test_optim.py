"""The optimizers against a NumPy re-statement of torch's documented formulas and against torch.

Oracles: ``_reference`` below restates each documented update (plain NumPy expressions, out of
place, ``exp_avg`` as ``beta1 * m + (1 - beta1) * g`` rather than torch's ``lerp``) and always
runs; torch.optim (CPU, ``foreach=False``) runs where torch is installed. 25 steps of random
gradients with ``None`` gradients on some steps: float64 to 1e-12, float32 to 1e-5. The same
kernels run on NumPy and host arrays (compared to the bit), a state dict round trip mid-run
continues to the bit, and ranks of ``DistributedDataParallel`` + Adam stay bit-equal.
"""

from __future__ import annotations

import copy
import sys
from typing import Any

import numpy as np
import pytest

import cupy_parallel as cp
from cupy_parallel import ops
from cupy_parallel._src.optim.updates import BLOCK
from cupy_parallel.optim import SGD, Adam, AdamW, Optimizer
from cupy_parallel.testing import simulated_cuda

STEPS = 25

CASES: list[tuple[str, dict[str, Any]]] = [
    ("SGD", {"lr": 0.1}),
    ("SGD", {"lr": 0.1, "weight_decay": 0.05}),
    ("SGD", {"lr": 0.05, "momentum": 0.9}),
    ("SGD", {"lr": 0.05, "momentum": 0.9, "dampening": 0.3, "weight_decay": 0.01}),
    ("SGD", {"lr": 0.05, "momentum": 0.9, "nesterov": True}),
    ("SGD", {"lr": 0.05, "momentum": 0.8, "nesterov": True, "weight_decay": 0.1, "maximize": True}),
    ("SGD", {"lr": 0.1, "maximize": True}),
    ("Adam", {}),
    ("Adam", {"lr": 0.01, "weight_decay": 0.1}),
    ("Adam", {"lr": 0.01, "amsgrad": True}),
    ("Adam", {"lr": 0.02, "betas": (0.3, 0.9), "eps": 1e-6, "maximize": True}),
    ("Adam", {"lr": 0.01, "amsgrad": True, "weight_decay": 0.1, "maximize": True}),
    ("AdamW", {"lr": 0.01}),
    ("AdamW", {"lr": 0.01, "weight_decay": 0.3, "amsgrad": True}),
    ("AdamW", {"lr": 0.01, "betas": (0.4, 0.99), "maximize": True}),
]
CLASSES = {"SGD": SGD, "Adam": Adam, "AdamW": AdamW}
TOLERANCE = {np.float64: 1e-12, np.float32: 1e-5, np.float16: 2e-3}


def _case_id(case: tuple[str, dict[str, Any]]) -> str:
    name, kwargs = case
    return name + "".join(f"-{k}={v}" for k, v in kwargs.items())


def _shapes() -> dict[str, tuple[int, ...]]:
    # "big" is longer than a block: the blocked path; "w" is transposed: the whole-array path
    # in sorted key order: the flatten order, so .values() lines up with torch's list
    return {"b": (3,), "big": (BLOCK + 7,), "w": (4, 3)}


def _start(dtype: Any) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    params = {k: rng.normal(size=s).astype(dtype) for k, s in _shapes().items()}
    params["w"] = np.asfortranarray(params["w"])  # not C-contiguous
    return params


def _grads(step: int, dtype: Any) -> dict[str, np.ndarray | None]:
    rng = np.random.default_rng(100 + step)
    grads: dict[str, Any] = {k: rng.normal(size=s).astype(dtype) for k, s in _shapes().items()}
    if step % 5 == 3:
        grads["b"] = None  # skipped: its parameter and state stay as they are
    if step == 0:
        grads["w"] = None  # no state until its first gradient
    return grads


# -- the NumPy re-statement of the documented formulas ---------------------------------------


def _full(name: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    defaults = {
        "SGD": {"lr": 1e-3, "momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0},
        "Adam": {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0},
        "AdamW": {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2},
    }[name]
    return {"nesterov": False, "maximize": False, "amsgrad": False, **defaults, **kwargs}


def _reference(name: str, kwargs: dict[str, Any], p: Any, g: Any, s: dict[str, Any]) -> Any:
    """One documented update of ``p`` (float64 arithmetic), ``s`` the parameter's state."""
    h = _full(name, kwargs)
    p, g = p.astype(np.float64), g.astype(np.float64)
    if h["maximize"]:
        g = -g
    if name == "SGD":
        if h["weight_decay"]:
            g = g + h["weight_decay"] * p
        if h["momentum"]:
            buf = s.get("buf")
            buf = g.copy() if buf is None else h["momentum"] * buf + (1 - h["dampening"]) * g
            s["buf"] = buf
            g = g + h["momentum"] * buf if h["nesterov"] else buf
        return p - h["lr"] * g
    t = s.get("t", 0) + 1
    s["t"] = t
    beta1, beta2 = h["betas"]
    if name == "AdamW":
        p = p * (1 - h["lr"] * h["weight_decay"])
    elif h["weight_decay"]:
        g = g + h["weight_decay"] * p
    s["m"] = beta1 * s.get("m", 0.0) + (1 - beta1) * g
    s["v"] = beta2 * s.get("v", 0.0) + (1 - beta2) * g * g
    second = s["v"]
    if h["amsgrad"]:
        s["vmax"] = second = np.maximum(s.get("vmax", 0.0), s["v"])
    denom = np.sqrt(second) / np.sqrt(1 - beta2**t) + h["eps"]
    return p - h["lr"] / (1 - beta1**t) * s["m"] / denom


def _close(actual: Any, expected: Any, dtype: Any) -> None:
    tol = TOLERANCE[dtype]
    np.testing.assert_allclose(np.asarray(actual, np.float64), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_against_the_documented_formulas(case: tuple[str, dict[str, Any]], dtype: Any) -> None:
    name, kwargs = case
    params = _start(dtype)
    opt = CLASSES[name](params, **kwargs)
    expected = {k: v.astype(np.float64) for k, v in params.items()}
    states: dict[str, dict[str, Any]] = {k: {} for k in params}
    for step in range(STEPS):
        grads = _grads(step, dtype)
        opt.step(grads)
        for k, g in grads.items():
            if g is not None:
                # the reference steps from the float64 trajectory; float32 drifts within 1e-5
                expected[k] = _reference(name, kwargs, expected[k], g, states[k])
    for k in params:
        _close(params[k], expected[k], dtype)
        assert params[k].dtype == dtype


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_float16_computes_in_float32_and_rounds_once_per_step(
    case: tuple[str, dict[str, Any]],
) -> None:
    """torch's opmath for float16: the update in float32, the parameter and state stored float16.

    The reference keeps the parameter and its state in float16 between steps and computes each
    step in float64: ours is within two float16 ulps of it (2e-3). (torch rounds after each of its
    ops instead, and divides by an ``eps`` rounded to 0 where ``exp_avg_sq`` underflows: inf.)
    """
    name, kwargs = case
    params = _start(np.float16)
    opt = CLASSES[name](params, **kwargs)
    expected = {k: v.copy() for k, v in params.items()}
    states: dict[str, dict[str, Any]] = {k: {} for k in params}
    for step in range(STEPS):
        grads = _grads(step, np.float16)
        opt.step(grads)
        for k, g in grads.items():
            if g is not None:
                expected[k] = _reference(name, kwargs, expected[k], g, states[k]).astype(np.float16)
                for key, value in states[k].items():
                    if isinstance(value, np.ndarray):
                        states[k][key] = value.astype(np.float16).astype(np.float64)
    for k in params:
        assert params[k].dtype == np.float16
        assert np.isfinite(params[k]).all()
        np.testing.assert_allclose(
            params[k].astype(np.float64), expected[k].astype(np.float64), rtol=2e-3, atol=2e-3
        )


# -- torch ----------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Any:
    """torch on one thread while these tests run: its thread pool spins on a loaded machine."""
    torch = sys.modules.get("torch")
    if torch is None:
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _torch_run(name: str, kwargs: dict[str, Any], groups: Any, steps: range, grads_of: Any) -> Any:
    torch = pytest.importorskip("torch")
    opt = getattr(torch.optim, name)(groups, foreach=False, **kwargs)
    tensors = [p for g in opt.param_groups for p in g["params"]]
    for step in steps:
        for t, g in zip(tensors, grads_of(step), strict=True):
            t.grad = None if g is None else torch.from_numpy(np.ascontiguousarray(g))
        opt.step()
    return opt


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_against_torch(case: tuple[str, dict[str, Any]], dtype: Any) -> None:
    torch = pytest.importorskip("torch")
    name, kwargs = case
    params = _start(dtype)
    tensors = [torch.tensor(v) for v in params.values()]
    opt = CLASSES[name](params, **kwargs)
    for step in range(STEPS):
        opt.step(_grads(step, dtype))
    torch_opt = _torch_run(
        name, kwargs, tensors, range(STEPS), lambda s: list(_grads(s, dtype).values())
    )
    for ours, theirs in zip(params.values(), tensors, strict=True):
        _close(ours, theirs.numpy().astype(np.float64), dtype)
    # the same state, under torch's names
    ours_sd, theirs_sd = opt.state_dict(), torch_opt.state_dict()
    assert sorted(ours_sd["state"]) == sorted(theirs_sd["state"])
    for i, entry in theirs_sd["state"].items():
        assert sorted(ours_sd["state"][i]) == sorted(entry)
        for key, value in entry.items():
            if key == "step":
                assert ours_sd["state"][i][key] == float(value)
            else:
                _close(ours_sd["state"][i][key], value.numpy().astype(np.float64), dtype)


def test_param_groups_against_torch_and_the_formulas() -> None:
    """No weight decay on biases, a smaller lr for them: groups in torch's list layout."""
    torch = pytest.importorskip("torch")
    params = _start(np.float64)
    groups = [
        {"params": {"w": params["w"], "big": params["big"]}},
        {"params": [params["b"]], "weight_decay": 0.0, "lr": 0.003},
    ]
    opt = AdamW(groups, lr=0.01, weight_decay=0.2)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.2, 0.0]
    assert [g["lr"] for g in opt.param_groups] == [0.01, 0.003]
    tensors = {k: torch.tensor(v) for k, v in params.items()}
    torch_groups = [
        {"params": [tensors["big"], tensors["w"]]},  # flatten order: sorted keys
        {"params": [tensors["b"]], "weight_decay": 0.0, "lr": 0.003},
    ]

    def split(step: int) -> list[Any]:
        g = _grads(step, np.float64)
        return [{"w": g["w"], "big": g["big"]}, [g["b"]]]

    for step in range(STEPS):
        opt.step(split(step))
    _torch_run(
        "AdamW",
        {"lr": 0.01, "weight_decay": 0.2},
        torch_groups,
        range(STEPS),
        lambda s: [split(s)[0]["big"], split(s)[0]["w"], split(s)[1][0]],
    )
    for k in params:
        _close(params[k], tensors[k].numpy(), np.float64)
    sd = opt.state_dict()
    assert [g["params"] for g in sd["param_groups"]] == [[0, 1], [2]]


def test_param_groups_against_the_formulas_without_torch() -> None:
    params = _start(np.float64)
    expected = {k: v.copy() for k, v in params.items()}
    opt = SGD(
        [{"params": {"w": params["w"]}}, {"params": {"b": params["b"]}, "weight_decay": 0.0}],
        lr=0.1,
        momentum=0.9,
        weight_decay=0.1,
    )
    states: dict[str, dict[str, Any]] = {"w": {}, "b": {}}
    for step in range(STEPS):
        g = _grads(step, np.float64)
        opt.step([{"w": g["w"]}, {"b": g["b"]}])
        for k, kw in (("w", {"weight_decay": 0.1}), ("b", {})):
            if g[k] is not None:
                args = {"lr": 0.1, "momentum": 0.9, **kw}
                expected[k] = _reference("SGD", args, expected[k], g[k], states[k])
    for k in ("w", "b"):
        _close(params[k], expected[k], np.float64)


# -- state dicts ----------------------------------------------------------------------------


def _copy_state_dict(sd: dict[str, Any]) -> dict[str, Any]:
    return copy.deepcopy(sd)  # the state's arrays are the optimizer's own: copy to keep them


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_state_dict_round_trip_mid_run_continues_to_the_bit(
    case: tuple[str, dict[str, Any]],
) -> None:
    name, kwargs = case
    straight = _start(np.float64)
    opt = CLASSES[name](straight, **kwargs)
    for step in range(12):
        opt.step(_grads(step, np.float64))
    saved_params = {k: v.copy() for k, v in straight.items()}
    saved = _copy_state_dict(opt.state_dict())
    for step in range(12, STEPS):
        opt.step(_grads(step, np.float64))
    resumed = saved_params
    fresh = CLASSES[name](resumed, lr=0.5)  # hyper-parameters come from the state dict
    fresh.load_state_dict(saved)
    assert fresh.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    for step in range(12, STEPS):
        fresh.step(_grads(step, np.float64))
    for k in straight:
        np.testing.assert_array_equal(resumed[k], straight[k])


@pytest.mark.parametrize(
    "case", [c for c in CASES if c[0] != "SGD" or "momentum" in c[1]], ids=_case_id
)
def test_our_state_dict_loads_into_torch_and_back(case: tuple[str, dict[str, Any]]) -> None:
    torch = pytest.importorskip("torch")
    name, kwargs = case
    params = _start(np.float64)
    opt = CLASSES[name](params, **kwargs)
    for step in range(12):
        opt.step(_grads(step, np.float64))
    sd = opt.state_dict()
    as_torch = {
        "state": {
            # torch.tensor copies (as_tensor would share the arrays, and torch keeps them)
            i: {k: torch.tensor(v) if k != "step" else v for k, v in e.items()}
            for i, e in sd["state"].items()
        },
        "param_groups": copy.deepcopy(sd["param_groups"]),
    }
    tensors = [torch.tensor(v) for v in params.values()]
    torch_opt = getattr(torch.optim, name)(tensors, foreach=False, **kwargs)
    torch_opt.load_state_dict(as_torch)
    for step in range(12, STEPS):
        grads = _grads(step, np.float64)
        opt.step(grads)
        for t, g in zip(tensors, grads.values(), strict=True):
            t.grad = None if g is None else torch.from_numpy(np.ascontiguousarray(g))
        torch_opt.step()
    for ours, theirs in zip(params.values(), tensors, strict=True):
        _close(ours, theirs.numpy(), np.float64)
    # and torch's state dict (tensors, a tensor step) loads into ours
    back = CLASSES[name]({k: v.copy() for k, v in params.items()}, **kwargs)
    back.load_state_dict(torch_opt.state_dict())
    for i, entry in opt.state_dict()["state"].items():
        for key, value in entry.items():
            np.testing.assert_allclose(back.state[i][key], value, rtol=1e-12, atol=1e-12)
        assert isinstance(back.state[i].get("step", 0.0), float)


def test_state_dict_layout() -> None:
    params = {"a": np.ones(2), "b": {"c": np.ones(3)}, "name": "model"}
    opt = Adam(params, lr=0.1, amsgrad=True)
    opt.step({"a": None, "b": {"c": np.ones(3)}, "name": None})
    sd = opt.state_dict()
    assert sd["param_groups"] == [
        {
            "lr": 0.1,
            "betas": (0.9, 0.999),
            "eps": 1e-8,
            "weight_decay": 0.0,
            "amsgrad": True,
            "maximize": False,
            "decoupled_weight_decay": False,
            "params": [0, 1],
        }
    ]
    assert list(sd["state"]) == [1]
    assert sorted(sd["state"][1]) == ["exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step"]
    assert sd["state"][1]["step"] == 1.0
    assert sd["state"][1]["exp_avg"] is opt.state[1]["exp_avg"]  # torch's references
    assert params["name"] == "model"


# -- array kinds, the tape, DDP -------------------------------------------------------------


@pytest.mark.parametrize("case", CASES[::2], ids=_case_id)
def test_host_arrays_step_as_numpy_to_the_bit(case: tuple[str, dict[str, Any]]) -> None:
    name, kwargs = case
    cp.set_host_device_count(2)
    numpy_params = _start(np.float32)
    host_params = {k: cp.to_device(v, "host:1") for k, v in numpy_params.items()}
    numpy_opt = CLASSES[name](numpy_params, **kwargs)
    host_opt = CLASSES[name](host_params, **kwargs)
    for step in range(6):
        grads = _grads(step, np.float32)
        numpy_opt.step(grads)
        host_opt.step(
            {k: None if g is None else cp.to_device(g, "host:1") for k, g in grads.items()}
        )
    for k in numpy_params:
        assert str(cp.device_of(host_params[k])) == "host:1"
        np.testing.assert_array_equal(cp.to_device(host_params[k], "cpu"), numpy_params[k])
    for entry in host_opt.state.values():
        for key, value in entry.items():
            if key != "step":
                assert str(cp.device_of(value)) == "host:1"


def test_a_gradient_on_another_device_is_refused_before_any_update() -> None:
    cp.set_host_device_count(2)
    params = {"a": cp.to_device(np.ones(2), "host:0"), "b": cp.to_device(np.ones(2), "host:0")}
    opt = SGD(params, lr=0.1)
    with pytest.raises(ValueError, match=r"grads\['b'\] is on host:1, its parameter on host:0"):
        opt.step({"a": cp.to_device(np.ones(2), "host:0"), "b": cp.to_device(np.ones(2), "host:1")})
    np.testing.assert_array_equal(cp.to_device(params["a"], "cpu"), np.ones(2))


@pytest.mark.parametrize("cls", [SGD, Adam, AdamW])
def test_a_step_on_arrays_a_tape_needs_makes_its_gradient_raise(cls: type[Optimizer]) -> None:
    params = {"w": np.array([1.0, 2.0])}
    opt = cls(params, lr=0.1)
    with cp.Tape() as tape:
        tape.watch(params)
        loss = ops.sum(ops.multiply(params["w"], params["w"]))
    opt.step({"w": np.ones(2)})
    with pytest.raises(RuntimeError, match=f"{cls.__name__}.step"):
        tape.gradient(loss, params)


def test_a_tape_that_used_the_optimizer_state_raises_too() -> None:
    params = {"w": np.array([1.0, 2.0])}
    opt = Adam(params, lr=0.1)
    opt.step({"w": np.ones(2)})
    exp_avg = opt.state[0]["exp_avg"]
    with cp.Tape() as tape:
        tape.watch(exp_avg)
        loss = ops.sum(ops.multiply(exp_avg, exp_avg))
    opt.step({"w": np.ones(2)})
    with pytest.raises(RuntimeError, match=r"Adam\.step"):
        tape.gradient(loss, exp_avg)
    # a tape taken after the step is fine, and its gradient is the closed form
    with cp.Tape() as tape:
        tape.watch(params)
        loss = ops.sum(ops.multiply(params["w"], params["w"]))
    np.testing.assert_array_equal(tape.gradient(loss, params)["w"], 2 * params["w"])


def _mlp(params: dict[str, Any], x: Any) -> Any:
    h = ops.tanh(ops.matmul(x, params["w1"]))
    return ops.sum(ops.multiply(ops.matmul(h, params["w2"]), ops.matmul(h, params["w2"])))


def _mlp_params() -> dict[str, Any]:
    rng = np.random.default_rng(0)
    return {"w1": rng.normal(size=(3, 5)), "w2": rng.normal(size=(5, 2)), "name": "mlp"}


X_ALL = np.linspace(-1.0, 1.0, 36).reshape(12, 3)


def _ddp_rank(rank: int, world: int, steps: int) -> dict[str, Any]:
    from cupy_parallel import distributed as dist

    params = _mlp_params()
    ddp = cp.DistributedDataParallel(_mlp, params)
    opt = Adam(ddp.params, lr=0.01, weight_decay=0.01)
    rows = len(X_ALL) // world
    for _ in range(steps):
        with cp.Tape() as tape:
            loss = ddp(X_ALL[rank * rows : (rank + 1) * rows])
        opt.step(tape.gradient(loss, ddp.params))
    assert dist.get_world_size() == world
    return {k: v for k, v in ddp.params.items() if k != "name"}


@pytest.mark.parametrize("world", [2, 3], ids=lambda n: f"{n}ranks")
def test_ddp_ranks_stay_bit_equal_and_match_one_process(world: int) -> None:
    from cupy_parallel import distributed as dist

    steps = 8
    results = dist.spawn(_ddp_rank, world, (world, steps), timeout=60)
    for other in results[1:]:
        for k in results[0]:
            np.testing.assert_array_equal(other[k], results[0][k])
    # one process, whole batch: DDP averages the ranks' gradients of their shares
    params = _mlp_params()
    opt = Adam(params, lr=0.01, weight_decay=0.01)
    rows = len(X_ALL) // world
    for _ in range(steps):
        total: dict[str, Any] = {}
        for r in range(world):
            g = cp.grad(_mlp)(params, X_ALL[r * rows : (r + 1) * rows])
            for k in ("w1", "w2"):
                total[k] = total.get(k, 0.0) + g[k] / world
        opt.step({"w1": total["w1"], "w2": total["w2"], "name": None})
    for k in ("w1", "w2"):
        np.testing.assert_allclose(results[0][k], params[k], rtol=1e-12, atol=1e-12)


# -- errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda p: SGD(p, lr=-0.1), ValueError, "Invalid learning rate: -0.1"),
        (lambda p: SGD(p, lr=0.1, momentum=-1), ValueError, "Invalid momentum value: -1"),
        (lambda p: SGD(p, weight_decay=-1), ValueError, "Invalid weight_decay value: -1"),
        (lambda p: SGD(p, nesterov=True), ValueError, "Nesterov momentum requires a momentum"),
        (
            lambda p: SGD(p, momentum=0.9, dampening=0.1, nesterov=True),
            ValueError,
            "zero dampening",
        ),
        (lambda p: SGD(p, lr="0.1"), TypeError, "learning rate must be a real number, got str"),
        (lambda p: SGD(p, nesterov=1), TypeError, "nesterov must be a bool, got int 1"),
        (lambda p: Adam(p, lr=-1e-3), ValueError, "Invalid learning rate"),
        (lambda p: Adam(p, eps=-1.0), ValueError, "Invalid epsilon value: -1.0"),
        (lambda p: Adam(p, betas=(1.0, 0.9)), ValueError, "Invalid beta parameter at index 0: 1.0"),
        (lambda p: Adam(p, betas=(0.9, -0.1)), ValueError, "Invalid beta parameter at index 1"),
        (lambda p: Adam(p, betas=0.9), TypeError, "betas must be a pair of floats"),
        (lambda p: AdamW(p, weight_decay=-0.1), ValueError, "Invalid weight_decay value"),
        (lambda p: Adam(p, amsgrad=None), TypeError, "amsgrad must be a bool"),
        (lambda p: Adam([{"params": p, "lr": -1.0}]), ValueError, "Invalid learning rate: -1.0"),
        (lambda p: SGD({"a": "x"}), ValueError, "optimizer got an empty parameter list"),
        (lambda p: SGD([]), ValueError, "optimizer got an empty parameter list"),
        (lambda p: SGD([p["w"], p["w"]]), ValueError, "more than one parameter group"),
        (
            lambda p: SGD([{"params": [p["w"]]}, {"params": [p["w"]]}]),
            ValueError,
            "more than one parameter group",
        ),
        (lambda p: SGD([{"params": [p["w"]]}, {"lr": 1}]), TypeError, "mixes param groups"),
    ],
)
def test_bad_constructor_arguments(make: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        make({"w": np.ones(2)})


def test_bad_gradients_are_refused_before_any_update() -> None:
    params = {"a": np.ones(2), "b": np.ones(3)}
    opt = Adam(params, lr=0.1)
    cases = [
        ({"a": np.ones(2)}, ValueError, "grads must be shaped as the params"),
        (
            {"a": np.ones(2), "b": np.ones(4)},
            ValueError,
            r"grads\['b'\] must have its parameter's shape",
        ),
        ({"a": np.ones(2), "b": np.ones(3, np.float32)}, ValueError, "dtype"),
        (
            {"a": np.ones(2), "b": [1.0, 2.0, 3.0]},
            TypeError,
            r"grads\['b'\] must be an array or None, got list",
        ),
        (
            {"a": np.ones(2), "b": 3.0},
            TypeError,
            r"grads\['b'\] must be an array or None, got float",
        ),
    ]
    for grads, error, match in cases:
        with pytest.raises(error, match=match):
            opt.step(grads)
    np.testing.assert_array_equal(params["a"], np.ones(2))
    assert opt.state == {}
    grouped = SGD([{"params": [np.ones(1)]}, {"params": [np.ones(1)]}])
    with pytest.raises(
        ValueError,
        match="grads must be a list of 2 gradient trees, one per param group, got a list of 1",
    ):
        grouped.step([[np.ones(1)]])
    with pytest.raises(ValueError, match=r"grads\['a'\] shares memory with its parameter"):
        opt.step({"a": params["a"][::-1], "b": None})
    with pytest.raises(ValueError, match=r"grads\['name'\] must be None"):
        SGD({"w": np.ones(1), "name": "m"}).step({"w": np.ones(1), "name": np.ones(1)})


def test_bad_state_dicts_are_refused_before_anything_changes() -> None:
    params = [np.ones(2), np.ones(3)]
    opt = Adam(params, lr=0.1)
    opt.step([np.ones(2), np.ones(3)])
    good = copy.deepcopy(opt.state_dict())
    before = copy.deepcopy(opt.state)

    def changed(**edit: Any) -> dict[str, Any]:
        sd = copy.deepcopy(good)
        sd.update(edit)
        return sd

    one_group = changed(param_groups=[*good["param_groups"], good["param_groups"][0]])
    short = changed(param_groups=[{**good["param_groups"][0], "params": [0]}])
    state = copy.deepcopy(good["state"])
    state[1]["exp_avg"] = np.ones(4)
    bad_shape = changed(state=state)
    state = copy.deepcopy(good["state"])
    del state[0]["exp_avg_sq"]
    missing = changed(state=state)
    state = copy.deepcopy(good["state"])
    state[7] = state[0]
    unknown = changed(state=state)
    amsgrad = changed(param_groups=[{**good["param_groups"][0], "amsgrad": True}])
    cases = [
        ([1], ValueError, "state_dict must be a dict with 'state' and 'param_groups'"),
        (one_group, ValueError, "different number of parameter groups: 2 saved, 1 in this"),
        (short, ValueError, "doesn't match the size of optimizer's group"),
        (bad_shape, ValueError, r"\['exp_avg'\] has shape \(4,\), its parameter \(3,\)"),
        (missing, ValueError, r"lacks \['exp_avg_sq'\]"),
        (unknown, ValueError, "entry for parameter 7, which no param group lists"),
        (amsgrad, ValueError, r"lacks \['max_exp_avg_sq'\]"),
    ]
    for sd, error, match in cases:
        with pytest.raises(error, match=match):
            opt.load_state_dict(sd)
        assert opt.param_groups[0]["amsgrad"] is False
        for i, entry in before.items():
            for k, v in entry.items():
                np.testing.assert_array_equal(opt.state[i][k], v)


def test_an_empty_group_in_a_list_is_allowed_as_in_torch() -> None:
    """ZeRO gives a rank without parameters an empty group; an empty tree alone is refused."""
    w = np.ones(2)
    opt = Adam([{"params": []}, {"params": [w]}], lr=0.1)
    opt.step([[], [np.ones(2)]])
    assert opt.state_dict()["param_groups"][1]["params"] == [0]
    np.testing.assert_allclose(w, [0.9, 0.9], rtol=1e-8)  # a first step moves by lr
    empty = SGD([{"params": []}], lr=0.1)
    empty.step([[]])
    assert empty.state_dict() == {"state": {}, "param_groups": [{**empty.defaults, "params": []}]}


def test_switching_amsgrad_on_mid_run_is_refused() -> None:
    opt = Adam([np.ones(2)], lr=0.1)
    opt.step([np.ones(2)])
    opt.param_groups[0]["amsgrad"] = True
    with pytest.raises(ValueError, match="was a hyper-parameter such as amsgrad switched on"):
        opt.step([np.ones(2)])


def test_a_scheduler_style_lr_change_is_read_at_the_next_step() -> None:
    w = np.zeros(1)
    opt = SGD([w], lr=0.1)
    opt.step([np.ones(1)])
    opt.param_groups[0]["lr"] = 0.01
    opt.step([np.ones(1)])
    np.testing.assert_allclose(w, [-0.11], rtol=1e-15)
    opt.param_groups[0]["lr"] = -1.0
    with pytest.raises(ValueError, match=r"Invalid learning rate: -1\.0"):
        opt.step([np.ones(1)])
    np.testing.assert_allclose(w, [-0.11], rtol=1e-15)


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16], ids=["f64", "f32", "f16"])
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_cupy_kernels_under_simulated_cuda_match_numpy(
    case: tuple[str, dict[str, Any]], dtype: Any
) -> None:
    """The ElementwiseKernel sources themselves, run by the simulation on two GPUs.

    One kernel per parameter on its own device (the current device is another one), the state
    made there, the race checker on; the values equal the NumPy path's (the simulation computes
    the C body with NumPy, so only the order of operations could differ: 1e-12 / 1e-5).
    """
    name, kwargs = case
    numpy_params = _start(dtype)
    numpy_opt = CLASSES[name](numpy_params, **kwargs)
    with simulated_cuda(2):
        place = {"b": "cuda:0", "big": "cuda:1", "w": "cuda:1"}
        gpu_params = {k: cp.to_device(v, place[k]) for k, v in numpy_params.items()}
        gpu_opt = CLASSES[name](gpu_params, **kwargs)
        for step in range(6):
            grads = _grads(step, dtype)
            numpy_opt.step(grads)
            gpu_opt.step(
                {k: None if g is None else cp.to_device(g, place[k]) for k, g in grads.items()}
            )
        for k in numpy_params:
            assert str(cp.device_of(gpu_params[k])) == place[k]
            _close(cp.to_device(gpu_params[k], "cpu"), numpy_params[k].astype(np.float64), dtype)
        for i, entry in gpu_opt.state.items():
            key = sorted(numpy_params)[i]
            for state_key, value in entry.items():
                if state_key != "step":
                    assert str(cp.device_of(value)) == place[key]
        # a state dict loads onto the parameters' GPUs
        resumed = CLASSES[name]({k: v.copy() for k, v in gpu_params.items()}, **kwargs)
        resumed.load_state_dict(numpy_opt.state_dict())
        for i, entry in resumed.state.items():
            key = sorted(numpy_params)[i]
            for state_key, value in entry.items():
                if state_key != "step":
                    assert str(cp.device_of(value)) == place[key]
                    np.testing.assert_array_equal(
                        cp.to_device(value, "cpu"), numpy_opt.state[i][state_key]
                    )


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_cupy_fused_kernels_match_numpy(case: tuple[str, dict[str, Any]]) -> None:
    cupy = pytest.importorskip("cupy")
    if cp.platform() != "cuda":
        pytest.skip("needs a CUDA GPU")
    name, kwargs = case
    for dtype in (np.float64, np.float32):
        numpy_params = _start(dtype)
        gpu_params = {k: cupy.asarray(v) for k, v in numpy_params.items()}
        numpy_opt = CLASSES[name](numpy_params, **kwargs)
        gpu_opt = CLASSES[name](gpu_params, **kwargs)
        for step in range(STEPS):
            grads = _grads(step, dtype)
            numpy_opt.step(grads)
            gpu_opt.step({k: None if g is None else cupy.asarray(g) for k, g in grads.items()})
        for k in numpy_params:
            _close(cupy.asnumpy(gpu_params[k]), numpy_params[k].astype(np.float64), dtype)
