"""The schedulers against torch.optim.lr_scheduler (to the bit) and against their closed forms.

torch's schedulers compute each lr from the previous one (``get_lr``'s recursive forms); ours
use the same formulas, so the sequences are equal to the bit where torch is installed. The
torch-free oracle is each schedule's documented closed form (1e-12).
"""

from __future__ import annotations

import copy
import math
from bisect import bisect_right
from typing import Any

import numpy as np
import pytest

from cupy_parallel.optim import SGD, Adam, lr_scheduler

EPOCHS = 40
LRS = (0.1, 0.02)  # two param groups


class Halving:
    """A callable object: its ``__dict__`` is saved (a plain function is not)."""

    def __init__(self) -> None:
        self.rate = 0.5

    def __call__(self, epoch: int) -> float:
        return self.rate ** (epoch // 4)


def _warmup(epoch: int) -> float:
    return min(1.0, (epoch + 1) / 5)


SIMPLE: dict[str, tuple[str, dict[str, Any]]] = {
    "step": ("StepLR", {"step_size": 7, "gamma": 0.5}),
    "multistep": ("MultiStepLR", {"milestones": [3, 9, 9, 20], "gamma": 0.3}),
    "linear": ("LinearLR", {"start_factor": 0.25, "end_factor": 0.9, "total_iters": 11}),
    "linear-default": ("LinearLR", {}),
    "cosine": ("CosineAnnealingLR", {"T_max": 10, "eta_min": 1e-4}),
    "cosine-zero": ("CosineAnnealingLR", {"T_max": 7}),
    "lambda": ("LambdaLR", {"lr_lambda": _warmup}),
}


def _closed(name: str, kw: dict[str, Any], base: float, t: int) -> float:
    if name == "StepLR":
        return base * kw["gamma"] ** (t // kw["step_size"])
    if name == "MultiStepLR":
        return base * kw["gamma"] ** bisect_right(sorted(kw["milestones"]), t)
    if name == "LinearLR":
        s, e, n = kw.get("start_factor", 1 / 3), kw.get("end_factor", 1.0), kw.get("total_iters", 5)
        return base * (s + (e - s) * min(n, t) / n)
    if name == "CosineAnnealingLR":
        eta = kw.get("eta_min", 0.0)
        return eta + (base - eta) * (1 + math.cos(math.pi * t / kw["T_max"])) / 2
    return base * kw["lr_lambda"](t)


def _ours(lrs: tuple[float, ...] = LRS) -> Any:
    return SGD([{"params": [np.zeros(1)], "lr": lr} for lr in lrs], lr=1.0)


def _sequence(scheduler: Any, epochs: int = EPOCHS) -> list[list[float]]:
    out = [list(scheduler.get_last_lr())]
    for _ in range(epochs):
        scheduler.step()
        out.append(list(scheduler.get_last_lr()))
        assert out[-1] == [g["lr"] for g in scheduler.optimizer.param_groups]
    return out


@pytest.mark.parametrize("key", SIMPLE)
def test_against_the_closed_forms(key: str) -> None:
    name, kw = SIMPLE[key]
    got = _sequence(getattr(lr_scheduler, name)(_ours(), **kw))
    for t, lrs in enumerate(got):
        for base, lr in zip(LRS, lrs, strict=True):
            assert lr == pytest.approx(_closed(name, kw, base, t), rel=1e-12, abs=1e-15)


def _torch_sequence(name: str, make: Any, epochs: int = EPOCHS) -> list[list[float]]:
    torch = pytest.importorskip("torch")
    params = [torch.zeros(1, requires_grad=True) for _ in LRS]
    opt = torch.optim.SGD(
        [{"params": [p], "lr": lr} for p, lr in zip(params, LRS, strict=True)], lr=1.0
    )
    scheduler = make(torch.optim.lr_scheduler, opt)
    out = [list(scheduler.get_last_lr())]
    for _ in range(epochs):
        opt.step()
        scheduler.step()
        out.append(list(scheduler.get_last_lr()))
    del name
    return out


@pytest.mark.parametrize("key", SIMPLE)
def test_against_torch_to_the_bit(key: str) -> None:
    name, kw = SIMPLE[key]
    theirs = _torch_sequence(name, lambda mod, opt: getattr(mod, name)(opt, **kw))
    assert _sequence(getattr(lr_scheduler, name)(_ours(), **kw)) == theirs


def _sequential(mod: Any, opt: Any) -> Any:
    warmup = mod.LinearLR(opt, start_factor=0.1, total_iters=5)
    cosine = mod.CosineAnnealingLR(opt, T_max=12, eta_min=1e-3)
    step = mod.StepLR(opt, step_size=4, gamma=0.5)
    return mod.SequentialLR(opt, [warmup, cosine, step], milestones=[5, 17])


def test_sequential_against_torch_to_the_bit_and_its_parts() -> None:
    ours = _sequence(_sequential(lr_scheduler, _ours()))
    # without torch: each phase restarts its closed form at its milestone
    for t, lrs in enumerate(ours):
        for base, lr in zip(LRS, lrs, strict=True):
            if t < 5:
                want = _closed("LinearLR", {"start_factor": 0.1, "total_iters": 5}, base, t)
            elif t < 17:
                want = _closed("CosineAnnealingLR", {"T_max": 12, "eta_min": 1e-3}, base, t - 5)
            else:
                want = _closed("StepLR", {"step_size": 4, "gamma": 0.5}, base, t - 17)
            assert lr == pytest.approx(want, rel=1e-12, abs=1e-15), t
    assert ours == _torch_sequence("SequentialLR", _sequential)


def test_a_changed_lr_is_followed_as_torch_follows_it() -> None:
    """The recursive forms read the group's current lr: a hand-set lr carries on, as in torch."""

    def run(mod: Any, opt: Any, steps: int) -> list[float]:
        scheduler = mod.CosineAnnealingLR(opt, T_max=6)
        out = []
        for i in range(steps):
            if i == 3:
                for g in opt.param_groups:
                    g["lr"] = g["lr"] * 0.5
            if hasattr(opt, "zero_grad"):
                opt.step()
            scheduler.step()
            out.append(scheduler.get_last_lr()[0])
        return out

    torch = pytest.importorskip("torch")
    topt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    assert run(lr_scheduler, _ours((0.1,)), 15) == run(torch.optim.lr_scheduler, topt, 15)


@pytest.mark.parametrize("key", [*SIMPLE, "sequential", "lambda-object"])
def test_state_dict_round_trip_mid_run_continues_identically(key: str) -> None:
    def make(opt: Any) -> Any:
        if key == "sequential":
            return _sequential(lr_scheduler, opt)
        if key == "lambda-object":
            return lr_scheduler.LambdaLR(opt, Halving())
        name, kw = SIMPLE[key]
        return getattr(lr_scheduler, name)(opt, **kw)

    opt = _ours()
    scheduler = make(opt)
    for _ in range(13):
        scheduler.step()
    saved_opt = copy.deepcopy(opt.state_dict())
    saved = copy.deepcopy(scheduler.state_dict())
    if key == "lambda-object":
        assert saved["lr_lambdas"] == [{"rate": 0.5}] * 2  # one object for both groups
    if key == "lambda":
        assert saved["lr_lambdas"] == [None, None]  # functions are not saved (torch)
    rest = _sequence(scheduler, 20)[1:]
    # torch's order to resume: build both, then load the optimizer's and the scheduler's states
    resumed_opt = _ours((5.0, 5.0))
    resumed = make(resumed_opt)
    if key == "lambda-object":
        resumed.lr_lambdas[0].rate = 0.25  # restored by load_state_dict
    resumed_opt.load_state_dict(saved_opt)
    resumed.load_state_dict(saved)
    if key == "lambda-object":
        assert resumed.lr_lambdas[0].rate == 0.5
    assert _sequence(resumed, 20)[1:] == rest


def test_torch_state_dict_loads_into_ours() -> None:
    torch = pytest.importorskip("torch")
    topt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    tsched = torch.optim.lr_scheduler.StepLR(topt, step_size=3, gamma=0.5)
    for _ in range(4):
        topt.step()
        tsched.step()
    opt = _ours((0.1,))
    sched = lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    sched.load_state_dict(tsched.state_dict())
    opt.param_groups[0]["lr"] = topt.param_groups[0]["lr"]
    for _ in range(5):
        topt.step()
        tsched.step()
        sched.step()
        assert sched.get_last_lr() == tsched.get_last_lr()


def test_schedules_adam_and_resumes_with_last_epoch() -> None:
    opt = Adam([np.zeros(2)], lr=0.1)
    scheduler = lr_scheduler.StepLR(opt, step_size=2)
    for _ in range(3):
        opt.step([np.ones(2)])
        scheduler.step()
    assert opt.param_groups[0]["initial_lr"] == 0.1
    assert opt.param_groups[0]["lr"] == pytest.approx(0.01)
    again = lr_scheduler.StepLR(opt, step_size=2, last_epoch=3)  # initial_lr is there
    assert again.base_lrs == [0.1]


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda o: lr_scheduler.StepLR(object(), 2), TypeError, "object is not an Optimizer"),
        (lambda o: lr_scheduler.StepLR(o, 0), ValueError, "step_size must be >= 1, got 0"),
        (lambda o: lr_scheduler.StepLR(o, 2.5), TypeError, "step_size must be an int"),
        (lambda o: lr_scheduler.StepLR(o, 2, last_epoch=3), KeyError, "initial_lr"),
        (
            lambda o: lr_scheduler.MultiStepLR(o, [2, "x"]),
            TypeError,
            r"milestones\[i\] must be an int",
        ),
        (
            lambda o: lr_scheduler.LinearLR(o, start_factor=0),
            ValueError,
            "Starting multiplicative factor",
        ),
        (
            lambda o: lr_scheduler.LinearLR(o, end_factor=2),
            ValueError,
            "Ending multiplicative factor",
        ),
        (lambda o: lr_scheduler.CosineAnnealingLR(o, T_max=0), ValueError, "T_max must be > 0"),
        (
            lambda o: lr_scheduler.LambdaLR(o, [_warmup]),
            ValueError,
            "Expected 2 lr_lambdas, but got 1",
        ),
        (lambda o: lr_scheduler.LambdaLR(o, 3), TypeError, "lr_lambda must be callable"),
        (lambda o: lr_scheduler.SequentialLR(o, [], []), ValueError, "at least one scheduler"),
        (
            lambda o: lr_scheduler.SequentialLR(o, [lr_scheduler.StepLR(o, 2)], [3]),
            ValueError,
            "one more than the number of milestone points",
        ),
        (
            lambda o: lr_scheduler.SequentialLR(o, [lr_scheduler.StepLR(_ours(), 2)], []),
            ValueError,
            "belong to the same optimizer",
        ),
        (
            lambda o: lr_scheduler.StepLR(o, 2).load_state_dict({"T_max": 3}),
            ValueError,
            r"entries \['T_max'\] that a StepLR does not have",
        ),
    ],
)
def test_bad_arguments(make: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        make(_ours())
