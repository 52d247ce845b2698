"""get_state_dict / set_state_dict with distributed.checkpoint: saved on 4 ranks, resumed on 2.

The oracle is the uninterrupted run: 4 thread ranks train the MLP of ``mpi_workers/ddp_worker``
(DDP + AdamW with param groups, ZeRO over it, or FSDP + AdamW on its shards) for 3 steps, save
``{"model": ..., "optim": ...}`` with ``distributed.checkpoint``, and train 3 more steps. Then 2
thread ranks build the model from *other* initial values and a fresh optimizer, load the
checkpoint through ``get_state_dict`` (templates), ``load`` and ``set_state_dict``, and train the
same 3 steps on the same whole batch (2 shards instead of 4): their parameters and their
optimizer state must equal the uninterrupted run's (float64, 1e-12), whichever of ZeRO, the
plain optimizer and FSDP saved and loaded (FSDP's state, shards, is compared through the
parameters it moves); with CuPy arrays too, on NCCL thread ranks under ``simulated_cuda`` (race
checker on). The rest runs in a world of one.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from thread_ranks import worker

import cupy_parallel as cp
from cupy_parallel import distributed as dist
from cupy_parallel import ops
from cupy_parallel.distributed import checkpoint as dcp
from cupy_parallel.distributed.checkpoint import get_state_dict, set_state_dict
from cupy_parallel.distributed.optim import ZeroRedundancyOptimizer
from cupy_parallel.optim import SGD, Adam, AdamW

STEPS = 3


def _setting(arrays: str) -> Any:
    return worker("ddp_worker").Setting(arrays)


def _build(kind: str, seed: int, arrays: str = "cpu") -> tuple[Any, Any]:
    """The model and its optimizer: DDP + ZeRO(AdamW), DDP + AdamW, or FSDP + AdamW."""
    w = worker("ddp_worker")
    if kind == "fsdp":
        model = cp.FullyShardedDataParallel(w.mlp, w.make_params(seed, _setting(arrays)))
    else:
        model = cp.DistributedDataParallel(w.mlp, w.make_params(seed, _setting(arrays)))
    params = model.params
    groups = [
        {"params": params["layers"], "weight_decay": 0.1},
        {"params": {"extra": params["extra"], "unused": params["unused"]}, "weight_decay": 0.0},
    ]
    if kind == "zero":
        return model, ZeroRedundancyOptimizer(groups, AdamW, lr=0.01, amsgrad=True)
    return model, AdamW(groups, lr=0.01, amsgrad=True)


def _train(model: Any, optimizer: Any, steps: range, arrays: str = "cpu") -> None:
    w = worker("ddp_worker")
    x, y = w.data()
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in steps:
        put = _setting(arrays).put
        xs, ys = put(w.shard(x, rank, world)), put(w.shard(y, rank, world))
        with cp.Tape() as tape:
            loss = ops.mean(ops.square(ops.subtract(model(xs, extra=step % 2 == 1), ys)))
        grads = tape.gradient(loss, model.params)
        optimizer.step([grads["layers"], {"extra": grads["extra"], "unused": grads["unused"]}])


def _whole_params(model: Any) -> Any:
    return model.full_params() if isinstance(model, cp.FullyShardedDataParallel) else model.params


def _whole_state(optimizer: Any, kind: str) -> dict[str, Any] | None:
    """The unsharded state dict (a ZeRO's consolidated to rank 0); None for FSDP's shards."""
    if kind == "fsdp":
        return None
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        optimizer.consolidate_state_dict(to=0)
        return optimizer.state_dict() if dist.get_rank() == 0 else {}
    return optimizer.state_dict()


def _host(tree: Any) -> Any:
    return cp._src.tree.tree_map(
        lambda a: np.array(cp.to_device(a, "cpu")) if cp.is_array(a) else a, tree
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("saved_by", "loaded_by"),
    [
        ("zero", "zero"),
        ("zero", "plain"),
        ("plain", "zero"),
        ("zero", "fsdp"),
        ("fsdp", "zero"),
        ("fsdp", "fsdp"),
    ],
    ids=lambda kind: kind,
)
def test_saved_on_4_ranks_resumed_on_2_continues_as_the_uninterrupted_run(
    tmp_path: Any, saved_by: str, loaded_by: str
) -> None:
    """zero: DDP + ZeRO(AdamW); plain: DDP + AdamW; fsdp: FSDP + AdamW on its shards."""
    _resume_4_to_2(tmp_path / "ckpt", saved_by, loaded_by, "cpu", "threads")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("saved_by", "loaded_by"), [("zero", "fsdp"), ("fsdp", "zero")], ids=lambda kind: kind
)
def test_cupy_arrays_over_nccl_saved_on_4_resumed_on_2(
    tmp_path: Any, saved_by: str, loaded_by: str
) -> None:
    """CuPy arrays, rank r on simulated GPU r (race checker on), NCCL thread ranks."""
    _resume_4_to_2(tmp_path / "ckpt", saved_by, loaded_by, "cupy", "nccl")


def _resume_4_to_2(path: Any, saved_by: str, loaded_by: str, arrays: str, backend: str) -> None:
    from cupy_parallel.testing import simulated_cuda

    w = worker("ddp_worker")

    def uninterrupted(rank: int) -> Any:
        model, optimizer = _build(saved_by, 0, arrays)
        _train(model, optimizer, range(STEPS), arrays)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, path)
        _train(model, optimizer, range(STEPS, 2 * STEPS), arrays)
        return _host(_whole_params(model)), _host(_whole_state(optimizer, saved_by))

    def resumed(rank: int) -> Any:
        model, optimizer = _build(loaded_by, 5, arrays)  # other values: the load must set them
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, path)
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
        _train(model, optimizer, range(STEPS, 2 * STEPS), arrays)
        return _host(_whole_params(model)), _host(_whole_state(optimizer, loaded_by))

    def run(program: Any, ranks: int) -> list[Any]:
        if backend == "threads":
            return dist.spawn(program, ranks, timeout=60)
        with simulated_cuda(ranks):
            return dist.spawn(program, ranks, timeout=60, backend=backend)

    want_params, want_state = run(uninterrupted, 4)[0]
    results = run(resumed, 2)
    for rank, (params, _) in enumerate(results):
        w.close(params, want_params, f"rank {rank}'s parameters")
    got_state = results[0][1]
    if want_state is None or got_state is None:
        return  # FSDP's state is shards: its effect on the parameters is what is compared
    assert got_state["param_groups"] == want_state["param_groups"]
    assert sorted(got_state["state"]) == sorted(want_state["state"])
    for index, entry in want_state["state"].items():
        w.close(got_state["state"][index], entry, f"state of parameter {index}")


# -- a world of one ------------------------------------------------------------------------------


@pytest.fixture
def world() -> Any:
    dist.init_process_group("mpi", world_size=1)
    yield
    dist.destroy_process_group()


def _ddp(params: Any) -> Any:
    return cp.DistributedDataParallel(lambda p, x: x, params)


@pytest.mark.usefixtures("world")
def test_names_are_dotted_key_paths_and_values_the_live_arrays() -> None:
    params = {"layers": [{"w": np.ones((2, 2)), "b": np.zeros(2)}], "act": "tanh"}
    ddp = _ddp(params)
    opt = SGD(ddp.params, lr=0.1, momentum=0.9)
    opt.step({"layers": [{"w": np.ones((2, 2)), "b": np.ones(2)}], "act": None})
    model_sd, optim_sd = get_state_dict(ddp, opt)
    assert list(model_sd) == ["act", "layers.0.b", "layers.0.w"]
    assert model_sd["layers.0.w"] is params["layers"][0]["w"]
    assert model_sd["act"] == "tanh"
    assert optim_sd["param_groups"][0]["params"] == ["layers.0.b", "layers.0.w"]
    assert optim_sd["state"]["layers.0.b"]["momentum_buffer"] is opt.state[0]["momentum_buffer"]


@pytest.mark.usefixtures("world")
def test_a_fresh_optimizer_gets_a_zero_template_without_touching_the_parameters() -> None:
    params = {"w": np.array([-0.0, 1.0])}
    ddp = _ddp(params)
    opt = Adam(ddp.params, amsgrad=True)
    _, optim_sd = get_state_dict(ddp, opt)
    entry = optim_sd["state"]["w"]
    assert sorted(entry) == ["exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step"]
    assert entry["step"] == 0.0
    assert np.array_equal(entry["exp_avg"], np.zeros(2))
    assert np.signbit(params["w"][0])  # bit for bit: -0.0 stays


@pytest.mark.usefixtures("world")
def test_round_trip_through_a_checkpoint_in_a_world_of_one(tmp_path: Any) -> None:
    a = _ddp({"w": np.arange(3.0), "b": np.ones(2)})
    opt = ZeroRedundancyOptimizer(a.params, Adam, lr=0.1)
    opt.step({"w": np.ones(3), "b": np.full(2, 2.0)})
    model_sd, optim_sd = get_state_dict(a, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, tmp_path / "c")
    b = _ddp({"w": np.zeros(3), "b": np.zeros(2)})
    plain = Adam(b.params, lr=0.5)
    m2, o2 = get_state_dict(b, plain)
    state = {"model": m2, "optim": o2}
    dcp.load(state, tmp_path / "c")
    set_state_dict(b, plain, model_state_dict=state["model"], optim_state_dict=state["optim"])
    assert np.array_equal(b.params["w"], a.params["w"])
    assert plain.param_groups[0]["lr"] == 0.1
    opt.consolidate_state_dict()
    want, got = opt.state_dict(), plain.state_dict()
    for index, entry in want["state"].items():
        for key, value in entry.items():
            assert np.array_equal(np.asarray(got["state"][index][key]), np.asarray(value))


@pytest.mark.usefixtures("world")
@pytest.mark.parametrize(
    ("model_sd", "optim_sd", "error", "match"),
    [
        ({"w": np.ones(2)}, None, ValueError, r"missing \['b'\], unknown \[\]"),
        ({"w": np.ones(3), "b": np.ones(1)}, None, ValueError, r"\['w'\] has shape \(3,\)"),
        ({"w": "x", "b": np.ones(1)}, None, TypeError, r"\['w'\] must be an array"),
        (None, {"state": {"v": {}}, "param_groups": []}, ValueError, "'v', which is not"),
        (None, {"state": {}, "param_groups": [{"params": ["w"]}]}, ValueError, "must name"),
    ],
    ids=["missing", "shape", "type", "unknown-state", "groups"],
)
def test_set_state_dict_checks_before_writing(
    model_sd: Any, optim_sd: Any, error: type, match: str
) -> None:
    params = {"w": np.ones(2), "b": np.ones(1)}
    ddp = _ddp(params)
    opt = Adam(ddp.params)
    _, good_optim = get_state_dict(ddp, opt)
    with pytest.raises(error, match=match):
        set_state_dict(
            ddp,
            opt,
            model_state_dict=model_sd
            if model_sd is not None
            else {"w": np.zeros(2), "b": np.zeros(1)},
            optim_state_dict=optim_sd if optim_sd is not None else good_optim,
        )
    assert np.array_equal(params["w"], np.ones(2))


@pytest.mark.usefixtures("world")
def test_wrong_model_or_foreign_optimizer_is_refused() -> None:
    ddp = _ddp({"w": np.ones(2)})
    with pytest.raises(TypeError, match="model must be a DistributedDataParallel"):
        get_state_dict({"w": np.ones(2)}, Adam([np.ones(2)]))
    with pytest.raises(TypeError, match=r"optimizer must be a cupy_parallel\.optim optimizer"):
        get_state_dict(ddp, object())
    with pytest.raises(ValueError, match="is not one of the model's parameters"):
        get_state_dict(ddp, Adam([np.ones(2)]))


@pytest.mark.usefixtures("world")
def test_colliding_dotted_names_are_refused() -> None:
    ddp = _ddp({"a.b": np.ones(1), "a": {"b": np.ones(1)}})
    with pytest.raises(ValueError, match=r"have one dotted name 'a.b'"):
        get_state_dict(ddp, Adam(ddp.params))
