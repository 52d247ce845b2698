"""FullyShardedDataParallel: against DDP and one process on 2-4 ranks, its edges on one rank.

``mpi_workers/fsdp_worker.py`` holds the multi-rank checks (FSDP in both reshard modes gives
DDP's parameters step for step with the same optimizer, float64 to 1e-12, and the one-process
run's; gradient shards are DDP's rows; the order of events; the memory resharding frees; a unit
``fn`` keeps stays gathered; ``full_params``/``sharded_params``; errors on every rank), run on
thread ranks (MPI backend, NumPy and host arrays), on NCCL thread ranks under ``simulated_cuda``
(CuPy arrays, race checker on) and in one ``mpiexec`` world. The tests below need one rank: a
world of one (``init_process_group("mpi")`` outside mpiexec), where the oracle is a plain tape.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from thread_ranks import MPIEXEC, printed, run_mpiexec, run_threads, worker

import cupy_parallel as cp
from cupy_parallel import distributed as dist
from cupy_parallel import ops
from cupy_parallel._src.recording import swap_out


def passed(ranks: int, count: int) -> list[str]:
    return [f"rank {r}: {count} checks passed" for r in range(ranks)]


@pytest.mark.parametrize("ranks", [2, 3, 4], ids=lambda n: f"{n}ranks")
def test_fsdp_on_thread_ranks(ranks: int) -> None:
    """NumPy and host arrays, float64 (and float32): the MPI backend on thread ranks."""
    ran = run_threads("fsdp_worker", ranks, "all", timeout=120)
    assert ran.returncode == 0, ran.stdout[-6000:] + ran.stderr[-3000:]
    assert printed(ran.stdout) == passed(ranks, len(worker("fsdp_worker").CHECKS))


@pytest.mark.parametrize("ranks", [2, 4], ids=lambda n: f"{n}ranks")
def test_fsdp_on_nccl_thread_ranks_with_cupy_arrays(ranks: int) -> None:
    """CuPy arrays over NCCL, rank r on simulated GPU r (race checker on)."""
    from cupy_parallel.testing import simulated_cuda

    with simulated_cuda(ranks):
        ran = run_threads("fsdp_worker", ranks, "cupy", timeout=120, backend="nccl")
    assert ran.returncode == 0, ran.stdout[-6000:] + ran.stderr[-3000:]
    assert printed(ran.stdout) == passed(ranks, len(worker("fsdp_worker").CUPY_CHECKS))


@pytest.mark.mpi
@pytest.mark.skipif(MPIEXEC is None, reason="needs mpiexec (pip install mpich)")
def test_fsdp_under_mpiexec() -> None:
    done = run_mpiexec("fsdp_worker", 3, timeout=240)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert printed(done.stdout) == passed(3, len(worker("fsdp_worker").CHECKS))


# -- a world of one ------------------------------------------------------------------------------


@pytest.fixture
def world() -> Any:
    dist.init_process_group("mpi", world_size=1)
    yield
    dist.destroy_process_group()


def _mlp(units: Any, x: Any) -> Any:
    h = ops.tanh(ops.add(ops.matmul(x, units["a"]["w"]), units["a"]["b"]))
    return ops.sum(ops.multiply(ops.matmul(h, units["b"]["w"]), units["b"]["s"]))


def _params() -> dict[str, Any]:
    rng = np.random.default_rng(0)
    return {
        "a": {"w": rng.normal(size=(3, 4)), "b": rng.normal(size=4)},
        "b": {"w": rng.normal(size=(4, 2)), "s": np.array(0.5)},
        "unused": [rng.normal(size=(2, 2)), np.zeros((0, 3))],
    }


X = np.linspace(-1.0, 1.0, 6).reshape(2, 3)


def _plain_gradient(params: dict[str, Any]) -> Any:
    with cp.Tape() as tape:
        tape.watch(params)
        loss = _mlp(params, X)
    return tape.gradient(loss, params)


@pytest.mark.usefixtures("world")
@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"fn": 3}, TypeError, "fn must be callable"),
        ({"params": np.ones(3)}, TypeError, "params must be a dict, list or tuple of units"),
        ({"reshard_after_forward": 1}, TypeError, "reshard_after_forward must be a bool"),
        ({"process_group": "world"}, TypeError, "group must be None"),
        (
            {"process_group": dist.GroupMember.NON_GROUP_MEMBER},
            ValueError,
            "process_group must be a group this rank is a member of",
        ),
        ({"params": {"u": {"w": np.arange(3)}}}, TypeError, r"params\['u'\]\['w'\] has dtype"),
    ],
    ids=["fn", "params", "reshard", "group", "non-member", "int"],
)
def test_bad_arguments_raise(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    arguments: dict[str, Any] = {"fn": _mlp, "params": _params(), **kwargs}
    with pytest.raises(error, match=match):
        cp.FullyShardedDataParallel(arguments.pop("fn"), arguments.pop("params"), **arguments)


@pytest.mark.usefixtures("world")
def test_tied_weights_are_refused() -> None:
    w = np.ones((2, 2))
    with pytest.raises(ValueError, match=r"params\['a'\] and params\['b'\] share memory \(tied"):
        cp.FullyShardedDataParallel(_mlp, {"a": w, "b": w})
    with pytest.raises(ValueError, match=r"params\[0\]\['x'\] and params\[1\] share memory"):
        cp.FullyShardedDataParallel(_mlp, [{"x": w}, w[1:]])


@pytest.mark.usefixtures("world")
@pytest.mark.parametrize("reshard", [True, False])
def test_gradient_is_the_plain_tapes_in_a_world_of_one(reshard: bool) -> None:
    """Every shard's gradient; zeros for the unit fn never reads (also with "none")."""
    fsdp = cp.FullyShardedDataParallel(_mlp, _params(), reshard_after_forward=reshard)
    want = _plain_gradient(_params())
    with cp.Tape() as tape:
        loss = fsdp(X)
    got = tape.gradient(loss, fsdp.params, unconnected_gradients="none")
    np.testing.assert_allclose(got["a"]["w"], want["a"]["w"], rtol=1e-14)
    np.testing.assert_allclose(got["a"]["b"], want["a"]["b"], rtol=1e-14)
    np.testing.assert_allclose(got["b"]["w"], want["b"]["w"], rtol=1e-14)
    assert got["b"]["s"].shape == (1,)  # a 0-d parameter is one row
    np.testing.assert_allclose(got["b"]["s"], [want["b"]["s"]], rtol=1e-14)
    np.testing.assert_array_equal(got["unused"][0], np.zeros((2, 2)))
    assert got["unused"][1].shape == (0, 3)


@pytest.mark.usefixtures("world")
def test_shards_full_params_and_sharded_params_of_a_0d_and_a_zero_size_parameter() -> None:
    fsdp = cp.FullyShardedDataParallel(_mlp, _params())
    assert fsdp.params["b"]["s"].shape == (1,)
    full = fsdp.full_params()
    assert full["b"]["s"].shape == ()
    assert float(full["b"]["s"]) == 0.5
    assert full["unused"][1].shape == (0, 3)
    assert full["unused"][0] is not fsdp.params["unused"][0]
    np.testing.assert_array_equal(fsdp.full_params(to=0)["a"]["w"], _params()["a"]["w"])
    sharded = fsdp.sharded_params()
    assert sharded["b"]["s"].global_shape == (1,)
    assert sharded["a"]["w"].rows == range(3)
    sharded["a"]["w"].local[0, 0] = 7.0  # a view: loading a checkpoint writes the parameters
    assert fsdp.params["a"]["w"][0, 0] == 7.0


@pytest.mark.usefixtures("world")
def test_a_persistent_tape_gathers_again_in_each_pass_and_two_calls_add_up() -> None:
    fsdp = cp.FullyShardedDataParallel(_mlp, _params())
    fsdp._trace = []
    with cp.Tape(persistent=True) as tape:
        loss = ops.add(fsdp(X), fsdp(X))
    first = tape.gradient(loss, fsdp.params)
    second = tape.gradient(loss, fsdp.params)
    want = _plain_gradient(_params())
    for got in (first, second):
        np.testing.assert_allclose(got["a"]["w"], 2 * want["a"]["w"], rtol=1e-14)
    regathers = [e for e in fsdp._trace if e[0] == "regather issued"]
    assert len(regathers) == 8, fsdp._trace  # 2 units x 2 calls x 2 passes


@pytest.mark.usefixtures("world")
def test_a_check_writes_tape_keeps_the_units_gathered() -> None:
    fsdp = cp.FullyShardedDataParallel(_mlp, _params())
    fsdp._trace = []
    with cp.Tape(check_writes=True) as tape:
        loss = fsdp(X)
    got = tape.gradient(loss, fsdp.params)
    np.testing.assert_allclose(got["a"]["w"], _plain_gradient(_params())["a"]["w"], rtol=1e-14)
    assert not [e for e in fsdp._trace if e[0] == "resharded"], fsdp._trace


@pytest.mark.usefixtures("world")
def test_the_units_mapping_is_for_the_forward_call_only() -> None:
    kept: list[Any] = []
    fsdp = cp.FullyShardedDataParallel(lambda u, x: kept.append(u) or x, _params())
    fsdp(X)
    assert repr(kept[0]) == "<FSDP units ['a', 'b', 'unused'], gathered when read>"
    with pytest.raises(RuntimeError, match="gathered during the forward call only"):
        kept[0]["a"]


@pytest.mark.usefixtures("world")
def test_a_step_after_the_forward_pass_makes_the_gradient_raise() -> None:
    """Updating the shards between forward and backward: no silently wrong gradient."""
    from cupy_parallel.optim import SGD

    fsdp = cp.FullyShardedDataParallel(_mlp, _params())
    opt = SGD(fsdp.params, lr=0.1)
    with cp.Tape() as tape:
        loss = fsdp(X)
    opt.step(cp._src.tree.tree_map(lambda a: np.ones_like(a) if cp.is_array(a) else a, fsdp.params))
    with pytest.raises(RuntimeError, match="modified in place"):
        tape.gradient(loss, fsdp.params)


def test_swap_out_rebuilds_views_and_undo_puts_the_originals_back() -> None:
    """The tape's swap on its own: a gathered array and a view of it, against a plain pass."""
    w = np.arange(6.0).reshape(2, 3)
    x = np.ones((3, 2))
    for undo in (False, True):
        source = w.copy()
        with cp.Tape() as tape:
            tape.watch(source)
            full = ops.multiply(source, 1.0)  # the "gathered" array: owns its memory
            loss = ops.sum(ops.matmul(ops.transpose(full), ops.transpose(x)))
        from cupy_parallel._src.recording import node_count

        assert node_count(tape) == 4
        restored: list[Any] = []

        def restore(full: Any = full, restored: list[Any] = restored) -> list[Any]:
            restored.append(1)
            return [full.copy()]

        swap = swap_out(tape, 0, [full], restore)  # from the node making it
        assert swap is not None
        assert len(swap.rebuilds) == 2  # full and its transpose
        if undo:
            swap.undo([full])
        else:
            swap.commit()
        grad = tape.gradient(loss, source)
        np.testing.assert_array_equal(grad, np.full((2, 3), 3.0))
        assert restored == ([] if undo else [1, 1, 1])  # once a node: the caller caches, not here


@pytest.mark.parametrize("commit", [False, True], ids=["undone", "committed_then_undone"])
def test_an_undone_swap_leaves_the_tape_watching_the_memory_its_nodes_hold(commit: bool) -> None:
    """Seen before: another thread rank's collective scanned the tape between a swap and its
    undo. The arrays put back were not watched for in-place writes (a write into them left the
    gradient silently wrong), and the freed stand-ins' memory was (a new buffer reusing it was
    refused as "modified in place", a false error on some ranks). The oracles: the nodes'
    memory recomputed from scratch, and the gradient with and without a write."""
    from cupy_parallel._src.recording import _memory_key, note_overwritten

    w = np.arange(6.0).reshape(2, 3)
    with cp.Tape(persistent=True) as tape:
        tape.watch(w)
        full = ops.multiply(w, 1.0)
        loss = ops.sum(ops.matmul(ops.transpose(full), np.ones((2, 2))))
    swap = swap_out(tape, 0, [full], lambda: [full.copy()])
    assert swap is not None
    note_overwritten([np.zeros(1)], "another rank's write")  # scans the nodes (stand-ins)
    if commit:
        swap.commit()
    again = full.copy() if commit else full  # committed: the memory gathered once more
    swap.undo([again])
    note_overwritten([np.zeros(1)], "another rank's write")
    held = {_memory_key(a) for node in tape._nodes for a in (*node[1], *node[3]) if cp.is_array(a)}
    assert tape._held == held
    np.testing.assert_array_equal(tape.gradient(loss, w), np.full((2, 3), 2.0))
    note_overwritten([again], "dist.all_reduce")
    with pytest.raises(RuntimeError, match=r"modified in place after ops\.matmul was rec"):
        tape.gradient(loss, w)


# -- against torch's FSDP2 ------------------------------------------------------------------------


def _ours_on_a_rank(rank: int) -> list[Any]:
    """Our FSDP + optim.Adam on the oracle's model, weights, data and shards."""
    from cupy_parallel.optim import Adam

    oracle = worker("torch_fsdp_oracle")
    layers = [{"w": w, "b": b} for w, b in oracle.weights()]

    def mlp(units: Any, x: Any) -> Any:
        h = x
        for k in range(len(layers)):
            h = ops.add(ops.matmul(h, units[k]["w"]), units[k]["b"])
            if k < len(layers) - 1:
                h = ops.tanh(h)
        return h

    fsdp = cp.FullyShardedDataParallel(mlp, layers)
    optimizer = Adam(fsdp.params, lr=oracle.LR)
    x, y = oracle.data()
    world = dist.get_world_size()
    rows = slice(rank * oracle.N // world, (rank + 1) * oracle.N // world)
    history = []
    for _ in range(oracle.STEPS):
        with cp.Tape() as tape:
            loss = ops.mean(ops.square(ops.subtract(fsdp(x[rows]), y[rows])))
        optimizer.step(tape.gradient(loss, fsdp.params))
        full = fsdp.full_params()
        history.append([a for unit in full for a in (unit["w"].T, unit["b"])])
    return history


@pytest.mark.slow
def test_fsdp_matches_torch_fsdp2_over_gloo() -> None:
    """torch's ``fully_shard`` + Adam on 2 gloo processes: the same parameters, step by step."""
    pytest.importorskip("torch")
    import json
    import subprocess
    import sys

    from thread_ranks import WORKERS

    done = subprocess.run(
        [sys.executable, str(WORKERS / "torch_fsdp_oracle.py")],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    theirs = json.loads(line[len("RESULT ") :])
    ours = dist.spawn(_ours_on_a_rank, 2)[0]
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        for mine, torch_param in zip(a, b, strict=True):
            np.testing.assert_allclose(mine, torch_param, rtol=1e-12, atol=1e-14, err_msg=f"{step}")


@pytest.mark.usefixtures("world")
def test_replacing_the_shards_is_refused_not_silently_ignored() -> None:
    fsdp = cp.FullyShardedDataParallel(_mlp, _params())
    with pytest.raises(AttributeError, match="params cannot be replaced: its leaves are views"):
        fsdp.params = _params()
    fsdp.params["a"]["w"] = fsdp.params["a"]["w"] - 1.0  # the functional update
    with pytest.raises(ValueError, match=r"fsdp.params\['a'\]\['w'\] is no longer this"):
        fsdp(X)
    seen: list[bool] = []
    fsdp = cp.FullyShardedDataParallel(lambda u, x: seen.append("a" in u) or x, _params())
    fsdp._trace = []
    fsdp(X)
    assert seen == [True]
    assert fsdp._trace == []  # `in` gathers nothing
