"""What a PyTorch user porting a DDP script runs into first: torch's keywords and habits.

``mp.spawn`` code that calls ``init_process_group`` in the spawned function, ``cp.grad`` over a
DDP model, and torch's keywords of ``DistributedDataParallel`` and ``spawn``: each either does
what torch's does (checked against our own default behaviour, the oracle) or is refused with a
message saying why and what to do. The launcher's torchrun options are in ``test_launch.py``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import cupy_parallel as cp
from cupy_parallel import distributed as dist
from cupy_parallel import ops

# --------------------------------------------------------------------------------------------
# init_process_group inside a spawn function (torch.multiprocessing.spawn's habit)


@pytest.mark.parametrize("backend", ["mpi", "gloo", "nccl"])
def test_init_process_group_in_a_spawned_function_says_spawn_did_it(backend: str) -> None:
    def ported(rank: int) -> None:  # as under mp.spawn: the function initialises its group
        dist.init_process_group(backend, rank=rank, world_size=2)

    with pytest.raises(RuntimeError, match=r"spawn: rank \d failed") as caught:
        dist.spawn(ported, 2)
    cause = caught.value.__cause__
    assert isinstance(cause, RuntimeError)
    message = str(cause)
    assert "run by cupy_parallel.distributed.spawn, which already initialised this rank's" in (
        message
    )
    assert "remove the call" in message
    assert "called twice" not in message


def test_a_spawned_rank_may_still_start_over_after_destroying_its_group() -> None:
    def restart(rank: int) -> list[float]:
        dist.destroy_process_group()
        dist.init_process_group("mpi")  # thread ranks: the in-process MPI world again
        x = np.full(2, rank + 1.0)
        dist.all_reduce(x)
        return x.tolist()

    assert dist.spawn(restart, 2) == [[3.0, 3.0], [3.0, 3.0]]


def test_init_process_group_twice_outside_spawn_keeps_its_message() -> None:
    dist.init_process_group("mpi", world_size=1)
    try:
        with pytest.raises(RuntimeError, match=r"init_process_group was called twice"):
            dist.init_process_group("mpi", world_size=1)
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------------
# spawn's torch keywords


def _sum_over_ranks(rank: int) -> list[float]:
    x = np.full(3, rank + 1.0)
    dist.all_reduce(x)
    return x.tolist()


@pytest.mark.parametrize(
    "options",
    [{"join": True}, {"daemon": True}, {"daemon": False}, {"join": True, "daemon": True}],
    ids=str,
)
def test_spawn_takes_torchs_keywords_that_mean_what_it_does(options: dict[str, Any]) -> None:
    assert dist.spawn(_sum_over_ranks, 3, **options) == dist.spawn(_sum_over_ranks, 3)


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"join": False}, ValueError, r"spawn\(join=False\) is not supported: spawn always waits"),
        ({"start_method": "spawn"}, ValueError, r"start_method='spawn'\) has no meaning here"),
        ({"start_method": "fork"}, ValueError, r"the ranks are threads of this process"),
        ({"join": 1}, TypeError, r"join must be a bool, got int 1"),
        ({"daemon": "no"}, TypeError, r"daemon must be a bool, got str 'no'"),
        ({"joined": True}, TypeError, r"unexpected keyword argument 'joined'"),
    ],
    ids=str,
)
def test_spawn_refuses_torchs_keywords_that_mean_nothing_here(
    options: dict[str, Any], error: type[Exception], message: str
) -> None:
    started: list[int] = []
    with pytest.raises(error, match=message):
        dist.spawn(started.append, 2, **options)
    assert started == []  # refused before any rank ran


# --------------------------------------------------------------------------------------------
# DistributedDataParallel: cp.grad over a DDP model, and torch's keywords

X = np.arange(12.0).reshape(6, 2) / 10


def _model(p: dict[str, Any], x: Any) -> Any:
    return ops.matmul(ops.tanh(ops.matmul(x, p["w1"])), p["w2"])


def _params() -> dict[str, Any]:
    rng = np.random.default_rng(0)
    return {"w1": rng.normal(size=(2, 3)), "w2": rng.normal(size=(3, 1)), "unused": np.ones(2)}


def _ddp_gradient(rank: int, options: dict[str, Any]) -> dict[str, Any]:
    ddp = cp.DistributedDataParallel(_model, _params(), **options)
    with cp.Tape() as tape:
        loss = ops.mean(ops.square(ddp(X[rank::2])))
    return tape.gradient(loss, ddp.params)


def test_grad_over_a_ddp_model_points_to_the_tape() -> None:
    def ported(rank: int) -> Any:
        ddp = cp.DistributedDataParallel(_model, _params())
        return cp.grad(lambda p: ops.mean(ops.square(ddp(X[rank::2]))))(ddp.params)

    with pytest.raises(RuntimeError, match=r"spawn: rank \d failed") as caught:
        dist.spawn(ported, 2)
    cause = caught.value.__cause__
    assert isinstance(cause, ValueError)
    assert "does not depend on any of the sources" in str(cause)
    assert "For DDP gradients use a Tape" in str(cause)
    assert "tape.gradient(loss, ddp.params)" in str(cause)
    # ... and the Tape it points to gives the whole batch's gradient (the one-process oracle)
    grads = dist.spawn(_ddp_gradient, 2, ({},))
    with cp.Tape() as tape:
        params = _params()
        tape.watch(params)
        loss = ops.mean(ops.square(_model(params, X)))
    whole = tape.gradient(loss, params)
    for rank_grads in grads:
        for name in whole:
            np.testing.assert_allclose(rank_grads[name], whole[name], rtol=1e-12, atol=1e-15)


def test_a_tape_asked_for_unrelated_sources_keeps_its_message() -> None:
    a, b = np.ones(2), np.ones(2)
    with cp.Tape() as tape:
        tape.watch((a, b))
        loss = ops.sum(ops.square(a))
    with pytest.raises(ValueError, match=r"does not depend on any of the sources") as caught:
        tape.gradient(loss, b)
    assert "DistributedDataParallel" not in str(caught.value)


ACCEPTED = [
    {"find_unused_parameters": True},
    {"find_unused_parameters": False},
    {"device_ids": None, "output_device": None},
    {"device_ids": ["cpu"], "output_device": "cpu"},
    {"gradient_as_bucket_view": True, "static_graph": True, "check_reduction": False},
    {"broadcast_buffers": False, "init_sync": True, "dim": 0},
    {"mixed_precision": None, "device_mesh": None, "skip_all_reduce_unused_params": False},
    {"delay_all_reduce_named_params": None, "param_to_hook_all_reduce": None},
]


@pytest.mark.parametrize("options", ACCEPTED, ids=str)
def test_ddp_takes_torchs_keywords_where_it_behaves_so_anyway(options: dict[str, Any]) -> None:
    # the oracle: the same DDP without them (the "unused" parameter gets zeros either way)
    got = dist.spawn(_ddp_gradient, 2, (options,))
    expected = dist.spawn(_ddp_gradient, 2, ({},))
    for mine, theirs in zip(got, expected, strict=True):
        assert mine.keys() == theirs.keys()
        for name in mine:
            np.testing.assert_array_equal(mine[name], theirs[name])
        np.testing.assert_array_equal(mine["unused"], np.zeros(2))


def test_device_ids_naming_the_parameters_host_device_is_accepted() -> None:
    cp.set_host_device_count(2)

    def on_host(rank: int, device_ids: list[Any]) -> Any:
        params = {"w": cp.to_device(np.ones((2, 1)), "host:1")}
        ddp = cp.DistributedDataParallel(
            lambda p, x: ops.matmul(x, p["w"]), params, device_ids=device_ids
        )
        with cp.Tape() as tape:
            loss = ops.sum(ddp(cp.to_device(np.full((1, 2), rank + 1.0), "host:1")))
        return cp.to_device(tape.gradient(loss, ddp.params)["w"], "cpu")

    for ids in ([1], ["host:1"], (cp.as_device("host:1"),)):
        for g in dist.spawn(on_host, 2, (ids,)):
            np.testing.assert_array_equal(g, [[1.5], [1.5]])  # mean of 1 and 2


REFUSED = [
    ({"device_ids": [0]}, ValueError, r"device_ids=\[0\] names (host|cuda):0, but the param"),
    ({"device_ids": 0}, TypeError, r"device_ids must be None or a list of one device, got 0"),
    ({"device_ids": ["cpu", "cpu"]}, ValueError, r"device_ids must name one device"),
    ({"output_device": "host:0"}, ValueError, r"output_device='host:0' names host:0, but the"),
    ({"find_unused_parameters": 1}, TypeError, r"find_unused_parameters must be a bool"),
    ({"static_graph": "yes"}, TypeError, r"static_graph must be a bool"),
    ({"init_sync": False}, ValueError, r"init_sync=False is broadcast_params=False here"),
    ({"dim": 1}, ValueError, r"dim=1\) is not supported: inputs are never split here"),
    ({"mixed_precision": "bf16"}, ValueError, r"register fp16_compress_hook or bf16_compr"),
    ({"device_mesh": object()}, ValueError, r"pass the process group as process_group"),
    ({"skip_all_reduce_unused_params": True}, ValueError, r"so that no rank waits for an"),
    ({"bucket_cap_md": 4}, TypeError, r"unexpected keyword argument 'bucket_cap_md' \(torch's"),
]


@pytest.mark.parametrize(("options", "error", "message"), REFUSED, ids=[m for _, _, m in REFUSED])
def test_ddp_refuses_torchs_keywords_that_mean_otherwise_here(
    options: dict[str, Any], error: type[Exception], message: str
) -> None:
    cp.set_host_device_count(2)
    dist.init_process_group("mpi", world_size=1)  # a world of one
    try:
        params = _params()
        before = {k: v.copy() for k, v in params.items()}
        with pytest.raises(error, match=message):
            cp.DistributedDataParallel(_model, params, **options)
        for name in params:  # refused before anything was broadcast or written
            np.testing.assert_array_equal(params[name], before[name])
    finally:
        dist.destroy_process_group()
