"""ZeroRedundancyOptimizer: against DDP + the optimizer, one process, and torch's (gloo).

``mpi_workers/zero_worker.py`` holds the multi-rank checks (ZeRO-1 equals DDP + the same
optimizer step for step and the one-process whole-batch run, float64 to 1e-12, with param
groups, None gradients, both syncs; the consolidated state dict equals the unsharded one; a
state dict of another world size loads and training continues alike; schedulers; errors on
every rank): on 2, 3 and 4 thread ranks, NCCL thread ranks under ``simulated_cuda`` (race
checker on) and one ``mpiexec`` world. torch's ZeroRedundancyOptimizer on gloo processes is the
oracle of the partition, the parameters and the consolidated state (skipped without torch).
The rest runs in a world of one.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from thread_ranks import MPIEXEC, WORKERS, printed, run_mpiexec, run_threads, worker

import cupy_parallel as cp
from cupy_parallel import distributed as dist
from cupy_parallel import ops
from cupy_parallel._src.sharded import zero as zero_module
from cupy_parallel._src.sharded.zero import partition_sizes
from cupy_parallel.distributed.optim import ZeroRedundancyOptimizer
from cupy_parallel.optim import SGD, Adam, AdamW


def passed(ranks: int, count: int) -> list[str]:
    return [f"rank {r}: {count} checks passed" for r in range(ranks)]


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [2, 3, 4], ids=lambda n: f"{n}ranks")
def test_zero_on_thread_ranks(ranks: int) -> None:
    ran = run_threads("zero_worker", ranks, "all", timeout=60)
    assert ran.returncode == 0, ran.stdout[-6000:] + ran.stderr[-3000:]
    assert printed(ran.stdout) == passed(ranks, len(worker("zero_worker").checks()))


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [2, 3, 4], ids=lambda n: f"{n}ranks")
def test_zero_on_nccl_thread_ranks_with_cupy_arrays(ranks: int) -> None:
    from cupy_parallel.testing import simulated_cuda

    with simulated_cuda(ranks):
        ran = run_threads("zero_worker", ranks, "cupy", timeout=60, backend="nccl")
    assert ran.returncode == 0, ran.stdout[-6000:] + ran.stderr[-3000:]
    assert printed(ran.stdout) == passed(ranks, len(worker("zero_worker").cupy_checks()))


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.skipif(MPIEXEC is None, reason="needs mpiexec (pip install mpich)")
def test_zero_under_mpiexec() -> None:
    done = run_mpiexec("zero_worker", 4, timeout=240)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert printed(done.stdout) == passed(4, len(worker("zero_worker").checks()))


# -- the partition -------------------------------------------------------------------------------


def _greedy(group_sizes: list[list[int]], world: int) -> list[list[list[int]]]:
    """The rule restated: for each parameter, largest first, the least-loaded rank."""
    load = [0] * world
    out = []
    for sizes in group_sizes:
        owned: list[list[int]] = [[] for _ in range(world)]
        order = sorted(range(len(sizes)), key=lambda k: (-sizes[k], k))
        for k in order:
            rank = min(range(world), key=lambda r: (load[r], r))
            owned[rank].append(k)
            load[rank] += sizes[k]
        out.append(owned)
    return out


@given(
    st.lists(st.lists(st.integers(0, 50), max_size=8), min_size=1, max_size=3),
    st.integers(1, 5),
)
def test_partition_is_the_greedy_rule_and_covers_every_parameter(
    groups: list[list[int]], world: int
) -> None:
    got = partition_sizes(groups, world)
    assert got == _greedy(groups, world)
    for sizes, owned in zip(groups, got, strict=True):
        assert sorted(itertools.chain(*owned)) == list(range(len(sizes)))
    # LPT's bound: the largest load is within the largest item of the mean load
    loads = [sum(groups[g][k] for g in range(len(groups)) for k in got[g][r]) for r in range(world)]
    biggest = max((s for sizes in groups for s in sizes), default=0)
    assert max(loads) <= sum(loads) / world + biggest


@pytest.mark.slow
def test_partition_matches_torchs() -> None:
    torch = pytest.importorskip("torch")
    zro = pytest.importorskip("torch.distributed.optim.zero_redundancy_optimizer")
    sizes = [[7, 3, 12, 12, 1, 40], [5, 5, 9]]
    for world in (2, 3, 4):
        fake = zro.ZeroRedundancyOptimizer.__new__(zro.ZeroRedundancyOptimizer)
        tensors = [[torch.zeros(n) for n in group] for group in sizes]
        fake.param_groups = [{"params": group} for group in tensors]
        fake.world_size = world
        fake._partition_parameters_cache = []
        theirs = fake._partition_parameters()
        want = [
            [
                [next(i for i, t in enumerate(group) if t is p) for p in theirs[r][g]["params"]]
                for r in range(world)
            ]
            for g, group in enumerate(tensors)
        ]
        assert partition_sizes(sizes, world) == want


# -- against torch's ZeroRedundancyOptimizer (gloo processes) -------------------------------------


@pytest.mark.slow
def test_against_torchs_zero_redundancy_optimizer_on_gloo(tmp_path: Any) -> None:
    pytest.importorskip("torch")
    world, steps = 3, 5
    rng = np.random.default_rng(7)
    shapes = [(6, 4), (4,), (9,), (3, 3), (), (12,), (2, 5)]
    group = np.array([0, 1, 1, 0, 1, 0, 0])
    case: dict[str, Any] = {
        "world": world,
        "steps": steps,
        "count": len(shapes),
        "group": group,
        "scale": rng.uniform(0.5, 2.0, size=len(shapes)),
    }
    for i, shape in enumerate(shapes):
        case[f"p{i}"] = rng.normal(size=shape)
        for step in range(steps):
            case[f"noise_{step}_{i}"] = rng.normal(size=shape)
    np.savez(tmp_path / "case.npz", **case)
    done = subprocess.run(
        [
            sys.executable,
            str(WORKERS / "torch_zero_oracle.py"),
            str(tmp_path / "case.npz"),
            str(tmp_path / "out.npz"),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    torch_out = dict(np.load(tmp_path / "out.npz"))

    def program(rank: int) -> Any:
        params = [case[f"p{i}"].copy() for i in range(len(shapes))]
        groups = [
            {
                "params": [p for p, g in zip(params, group, strict=True) if g == 0],
                "weight_decay": 0.1,
            },
            {
                "params": [p for p, g in zip(params, group, strict=True) if g == 1],
                "weight_decay": 0.0,
            },
        ]
        zero = ZeroRedundancyOptimizer(groups, AdamW, lr=0.01, amsgrad=True)
        for step in range(steps):
            grads = [
                np.asarray(p * case["scale"][i] + case[f"noise_{step}_{i}"])
                for i, p in enumerate(params)
            ]
            zero.step([[grads[i] for i in range(len(shapes)) if group[i] == g] for g in (0, 1)])
        local = [
            [next(i for i, q in enumerate(params) if q is p) for p in g["params"]]
            for g in zero.optim.param_groups
        ]
        zero.consolidate_state_dict(to=0)
        return params, local, zero.state_dict() if rank == 0 else None

    results = dist.spawn(program, world, timeout=60)
    order = [i for g in (0, 1) for i in range(len(shapes)) if group[i] == g]
    for rank, (params, local, _) in enumerate(results):
        for i, p in enumerate(params):
            np.testing.assert_allclose(p, torch_out[f"final{i}"], rtol=0, atol=1e-12)
        for g, indices in enumerate(local):
            assert indices == torch_out[f"owned_{rank}_{g}"].tolist(), (rank, g)
    state = results[0][2]["state"]
    assert len(state) == len(shapes)
    for index, entry in state.items():
        for key, value in entry.items():
            np.testing.assert_allclose(
                np.asarray(value), torch_out[f"state_{order[index]}_{key}"], rtol=0, atol=1e-12
            )


# -- a world of one ------------------------------------------------------------------------------


@pytest.fixture
def world() -> Any:
    dist.init_process_group("mpi", world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.usefixtures("world")
@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        ((ZeroRedundancyOptimizer,), {}, TypeError, "cannot be ZeroRedundancyOptimizer"),
        ((Adam,), {"param_sync": "gather"}, ValueError, "param_sync must be one of"),
        ((Adam,), {"lr": -1.0}, ValueError, "Invalid learning rate: -1.0"),
        ((Adam,), {"betas": 3}, TypeError, "betas"),
        (
            (Adam,),
            {"process_group": dist.GroupMember.NON_GROUP_MEMBER},
            ValueError,
            "process_group must be a group this rank is a member of",
        ),
    ],
    ids=["itself", "sync", "lr", "betas", "non-member"],
)
def test_bad_arguments(
    args: tuple[Any, ...], kwargs: dict[str, Any], error: type, match: str
) -> None:
    with pytest.raises(error, match=match):
        ZeroRedundancyOptimizer({"w": np.ones(3)}, *args, **kwargs)


@pytest.mark.usefixtures("world")
def test_an_instance_for_a_class_is_refused() -> None:
    with pytest.raises(
        TypeError,
        match=r"optimizer_class must be an optimizer class.*an instance of SGD \(pass the class",
    ):
        ZeroRedundancyOptimizer({"w": np.ones(3)}, SGD([np.ones(1)], lr=0.1))  # type: ignore[arg-type]


@pytest.mark.usefixtures("world")
def test_a_non_contiguous_parameter_is_refused() -> None:
    with pytest.raises(
        ValueError, match=r"parameter 1 of param group 0 \(shape \(2,\)\) is not C-contiguous"
    ):
        ZeroRedundancyOptimizer([np.ones(2), np.ones(4)[::2]], Adam)


@pytest.mark.usefixtures("world")
def test_state_dict_before_consolidating_is_torchs_runtime_error() -> None:
    zero = ZeroRedundancyOptimizer([np.ones(2)], Adam)
    with pytest.raises(RuntimeError, match=r"consolidate_state_dict\(to=0\)"):
        zero.state_dict()
    with pytest.raises(ValueError, match=r"to must be a rank of the group, in \[0, 1\), got 1"):
        zero.consolidate_state_dict(to=1)


@pytest.mark.usefixtures("world")
def test_a_bad_gradient_changes_nothing() -> None:
    params = {"w": np.ones(3), "b": np.zeros(2)}
    zero = ZeroRedundancyOptimizer(params, Adam, lr=0.1)
    with pytest.raises(ValueError, match=r"grads\['w'\] must have its parameter's shape"):
        zero.step({"w": np.ones(4), "b": np.ones(2)})
    assert not zero.optim.state
    assert np.array_equal(params["b"], np.zeros(2))


@pytest.mark.usefixtures("world")
@pytest.mark.parametrize(
    ("state_dict", "match"),
    [
        ({"state": {}}, "must be a dict with 'state' and 'param_groups'"),
        ({"state": {}, "param_groups": [{"params": [0]}]}, r"it has 1 groups of \[2\] parameters"),
        ({"state": {5: {}}, "param_groups": [{"params": [0, 1]}]}, "parameter 5, which no"),
        (
            {"state": {1: {"exp_avg": np.ones(3)}}, "param_groups": [{"params": [0, 1]}]},
            r"\[1\]\['exp_avg'\] has shape \(3,\), its parameter \(2,\)",
        ),
    ],
    ids=["keys", "counts", "index", "shape"],
)
def test_a_bad_state_dict_is_named_and_changes_nothing(state_dict: Any, match: str) -> None:
    params = [np.ones(3), np.ones(2)]
    zero = ZeroRedundancyOptimizer(params, Adam, lr=0.1)
    zero.step([np.ones(3), np.ones(2)])
    before = {k: dict(v) for k, v in zero.optim.state.items()}
    with pytest.raises(ValueError, match=match):
        zero.load_state_dict(state_dict)
    assert zero.optim.state.keys() == before.keys()


@pytest.mark.usefixtures("world")
def test_param_groups_carry_every_hyper_parameter_like_torchs() -> None:
    zero = ZeroRedundancyOptimizer(
        [{"params": [np.ones(2)]}, {"params": [np.ones(1)], "lr": 0.5}], SGD, lr=0.1, momentum=0.9
    )
    plain = SGD(
        [{"params": [np.ones(2)]}, {"params": [np.ones(1)], "lr": 0.5}], lr=0.1, momentum=0.9
    )
    strip = [{k: v for k, v in g.items() if k != "params"} for g in zero.param_groups]
    assert strip == [{k: v for k, v in g.items() if k != "params"} for g in plain.param_groups]
    zero.add_param_group({"params": [np.ones(3)], "lr": 0.01})
    assert [g["lr"] for g in zero.optim.param_groups] == [0.1, 0.5, 0.01]
    zero.param_groups[0]["lr"] = 0.2  # a scheduler's write reaches the local optimizer at step
    zero.step([[np.ones(2)], [np.ones(1)], [None]])
    assert zero.optim.param_groups[0]["lr"] == 0.2


@pytest.mark.usefixtures("world")
def test_a_step_overwrites_parameters_a_tape_still_needs() -> None:
    params = {"w": np.array([1.0, 2.0])}
    zero = ZeroRedundancyOptimizer(params, SGD, lr=0.1)
    with cp.Tape() as tape:
        tape.watch(params)
        loss = ops.sum(ops.square(params["w"]))
    zero.step({"w": np.ones(2)})
    with pytest.raises(Exception, match="modified in place after"):
        tape.gradient(loss, params)


@pytest.mark.usefixtures("world")
def test_a_world_of_one_is_the_plain_optimizer() -> None:
    rng = np.random.default_rng(0)
    a = {"w": rng.normal(size=(3, 2)), "b": rng.normal(size=2), "name": "m"}
    b = {k: v.copy() if isinstance(v, np.ndarray) else v for k, v in a.items()}
    zero, plain = ZeroRedundancyOptimizer(a, Adam, lr=0.1), Adam(b, lr=0.1)
    for _ in range(3):
        g = {"w": a["w"] * 2, "b": a["b"] * 3, "name": None}
        zero.step(g)
        plain.step({"w": b["w"] * 2, "b": b["b"] * 3, "name": None})
    assert np.array_equal(a["w"], b["w"])
    assert np.array_equal(a["b"], b["b"])
    zero.consolidate_state_dict()
    got, want = zero.state_dict(), plain.state_dict()
    assert got["param_groups"] == want["param_groups"]
    for index in want["state"]:
        for key, value in want["state"][index].items():
            assert np.array_equal(got["state"][index][key], value)


def _edge_params() -> dict[str, Any]:
    rng = np.random.default_rng(3)
    return {
        "scale": np.array(1.5),  # 0-d
        "empty": np.zeros((0, 3)),  # zero-size
        "half": rng.normal(size=5).astype(np.float32),  # another dtype: its own buffer
        "w": rng.normal(size=(4, 2)),
        "v": rng.normal(size=7),
        "big": rng.normal(size=(180, 200)),  # >= IN_PLACE_BYTES
        "name": "edge",
    }


def _edge_grads(params: dict[str, Any], step: int) -> dict[str, Any]:
    return {
        k: (np.asarray(v * (step + 1.0) + 0.5) if k != "name" else None) for k, v in params.items()
    }


@pytest.mark.parametrize(
    ("sync", "buffered"),
    [
        ("broadcast", {}),  # every parameter in place: nothing beyond the parameters
        # every owner's small parameters, in one buffer per owner and dtype, on every rank:
        # the float32 vector; the float64 0-d, 4 x 2 and 7 ("big" in place, "empty" not sent)
        ("broadcast_packed", {"float32": 5 * 4, "float64": (1 + 8 + 7) * 8}),
    ],
)
def test_the_default_sync_allocates_nothing_the_packed_one_the_small_parameters(
    sync: str, buffered: dict[str, int], monkeypatch: Any
) -> None:
    """The memory claim of ``param_sync``, by the bytes its sync asks the pool for (2 ranks)."""
    allocated: dict[int, dict[str, int]] = {}
    allocate = zero_module.empty

    def counting(size: Any, dtype: Any, device: Any) -> Any:
        mine = allocated.setdefault(dist.get_rank(), {})
        mine[str(dtype)] = mine.get(str(dtype), 0) + int(size) * np.dtype(dtype).itemsize
        return allocate(size, dtype, device)

    monkeypatch.setattr(zero_module, "empty", counting)

    def train(rank: int) -> Any:
        params = _edge_params()
        zero = ZeroRedundancyOptimizer(params, Adam, lr=0.1, param_sync=sync)
        zero.step(_edge_grads(params, 0))
        return params

    ranks = dist.spawn(train, 2, timeout=60)
    assert allocated == ({0: buffered, 1: buffered} if buffered else {})
    for key, value in ranks[0].items():  # and the sync did sync
        assert np.array_equal(ranks[1][key], value) if key != "name" else value == "edge"


@pytest.mark.slow
@pytest.mark.parametrize("sync", ["broadcast", "broadcast_packed", "all_gather"])
def test_edges_0d_zero_size_mixed_dtypes_and_a_sharded_checkpoint_3_to_2(
    tmp_path: Any, sync: str
) -> None:  # broadcast_packed: "big" (288 KiB) is broadcast in place, the others packed
    """ZeRO == the plain optimizer bit for bit; its checkpoint from 3 ranks resumes on 2."""
    from cupy_parallel.distributed import checkpoint as dcp
    from cupy_parallel.distributed.checkpoint import get_state_dict, set_state_dict

    path = tmp_path / "ckpt"

    def saving(rank: int) -> Any:
        zp, pp = _edge_params(), _edge_params()
        zero = ZeroRedundancyOptimizer(zp, Adam, lr=0.1, param_sync=sync)
        plain = Adam(pp, lr=0.1)
        for step in range(3):
            zero.step(_edge_grads(zp, step))
            plain.step(_edge_grads(pp, step))
        for key in pp:
            if isinstance(pp[key], np.ndarray):
                assert zp[key].dtype == pp[key].dtype
                assert np.array_equal(zp[key], pp[key]), key
        ddp = cp.DistributedDataParallel(lambda p, x: x, zp)
        model_sd, optim_sd = get_state_dict(ddp, zero)
        dcp.save({"model": model_sd, "optim": optim_sd}, path)
        return plain.state_dict(), {k: v.copy() for k, v in pp.items() if isinstance(v, np.ndarray)}

    want_state, want_params = dist.spawn(saving, 3, timeout=60)[0]

    def loading(rank: int) -> Any:
        params = {
            k: (np.zeros_like(v) if isinstance(v, np.ndarray) else v)
            for k, v in _edge_params().items()
        }
        ddp = cp.DistributedDataParallel(lambda p, x: x, params)
        zero = ZeroRedundancyOptimizer(ddp.params, Adam, lr=0.3, param_sync=sync)
        model_sd, optim_sd = get_state_dict(ddp, zero)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, path)
        set_state_dict(ddp, zero, model_state_dict=state["model"], optim_state_dict=state["optim"])
        zero.consolidate_state_dict(to=0)
        return params, zero.state_dict() if rank == 0 else None

    results = dist.spawn(loading, 2, timeout=60)
    for params, _ in results:
        for key, value in want_params.items():
            assert np.array_equal(params[key], value), key
    got = results[0][1]
    assert got["param_groups"] == want_state["param_groups"]
    assert sorted(got["state"]) == sorted(want_state["state"])
    for index, entry in want_state["state"].items():
        for key, value in entry.items():
            assert np.array_equal(np.asarray(got["state"][index][key]), np.asarray(value)), (
                index,
                key,
            )


def test_ranks_passing_different_param_syncs_are_named_on_every_rank() -> None:
    """Three ranks, three syncs: every rank raises, naming the option and both values (the
    message said the *parameters* differed, and named no value)."""
    syncs = ["broadcast", "broadcast_packed", "all_gather"]

    def program(rank: int) -> str:
        try:
            ZeroRedundancyOptimizer({"w": np.ones(3)}, SGD, lr=0.1, param_sync=syncs[rank])
        except ValueError as error:
            return str(error)
        return "no error"

    for message in dist.spawn(program, 3, timeout=60):
        assert message == (
            "ZeroRedundancyOptimizer's param_sync differs across the ranks: rank 1 passed "
            "'broadcast_packed', rank 0 'broadcast'. Every rank must pass the same param_sync."
        )


def test_on_a_subgroup_group_ranks_are_not_world_ranks() -> None:
    """new_group([1, 2]) of 3 ranks: owners and consolidate's ``to`` are group ranks."""

    def program(rank: int) -> Any:
        group = dist.new_group([1, 2])
        if rank == 0:
            return None
        zp, pp = _edge_params(), _edge_params()
        zero = ZeroRedundancyOptimizer(zp, Adam, lr=0.1, process_group=group)
        plain = Adam(pp, lr=0.1)
        for step in range(2):
            zero.step(_edge_grads(zp, step))
            plain.step(_edge_grads(pp, step))
        zero.consolidate_state_dict(to=1)  # group rank 1: world rank 2
        same = all(np.array_equal(zp[k], pp[k]) for k in pp if isinstance(pp[k], np.ndarray))
        try:
            whole = zero.state_dict()
        except RuntimeError:  # not consolidated here: group rank 0 (world rank 1)
            whole = None
        return same, whole is not None, whole, plain.state_dict()

    results = dist.spawn(program, 3, timeout=60)
    assert results[0] is None
    assert [r[:2] for r in results[1:]] == [(True, False), (True, True)]
    whole, want = results[2][2], results[2][3]
    assert sorted(whole["state"]) == sorted(want["state"])
    for index, entry in want["state"].items():
        for key, value in entry.items():
            assert np.array_equal(np.asarray(whole["state"][index][key]), np.asarray(value))
