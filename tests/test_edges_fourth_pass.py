"""Issue 34: DDP, thread ranks and the in-place guard at their edges, and PyTorch parity.

Each test failed on the code before its fix (the commit that added it says how). The oracles:
NumPy (the averaged gradient computed on one process), a second thread rank, and torch's own
error types and messages (read from torch 2.13 with gloo on CPU where the test says so).
"""

from __future__ import annotations

import copy
import pickle
import subprocess
import sys
import threading
from typing import Any

import numpy as np
import pytest
from thread_ranks import WORKERS, worker

import cupy_parallel as cp
from cupy_parallel import distributed as dist
from cupy_parallel import ops
from cupy_parallel._src.hostarray import host_array, host_buffer


def _model(params: dict[str, Any], x: Any) -> Any:
    return ops.sum(ops.matmul(x, params["w"]))


def _shard(rank: int) -> np.ndarray:
    return np.arange(6.0).reshape(2, 3) * (rank + 1)


def _averaged(ranks: int) -> np.ndarray:
    """The gradient of _model averaged over the ranks' shards: sum over rows, per column."""
    grads = [_shard(r).sum(axis=0)[:, None] * np.ones((3, 2)) for r in range(ranks)]
    return np.mean(grads, axis=0)


# -- row 1: rebinding an entry of ddp.params -------------------------------------------------


def _rebinding_update(rank: int) -> list[Any]:
    ddp = cp.DistributedDataParallel(_model, {"w": np.ones((3, 2))})
    seen = []
    for _ in range(2):
        with cp.Tape() as tape:
            tape.watch(ddp.params)  # watched or not, the averaged gradient
            loss = ddp(_shard(rank))
        g = tape.gradient(loss, ddp.params)["w"]
        seen.append(g)
        ddp.params["w"] = ddp.params["w"] - 0.1 * g  # the natural hand-written update
    return seen


def test_rebinding_an_entry_of_params_still_averages() -> None:
    for grads in dist.spawn(_rebinding_update, 2):
        for g in grads:
            np.testing.assert_allclose(g, _averaged(2))


def _rebinding_a_bad_entry(rank: int) -> str:
    ddp = cp.DistributedDataParallel(_model, {"w": np.ones((3, 2))})
    ddp.params["w"] = np.ones((2, 2))
    try:
        ddp(_shard(rank))
    except ValueError as error:
        return str(error)
    return "no error"


def test_rebinding_an_entry_to_another_shape_is_refused_at_the_call() -> None:
    for message in dist.spawn(_rebinding_a_bad_entry, 2):
        assert "shape (2, 2)" in message
        assert "structure, shapes and dtypes" in message


# -- row 2: the construction broadcast notifies the tapes --------------------------------------


def _recorded_before_ddp(rank: int) -> str:
    w = np.full((3, 2), float(rank + 1))
    with cp.Tape() as tape:
        tape.watch(w)
        loss = ops.sum(ops.multiply(w, w))
    cp.DistributedDataParallel(_model, {"w": w})  # rank 1's w now holds rank 0's values
    try:
        tape.gradient(loss, w)
    except RuntimeError as error:
        return str(error)
    return "no error"


def test_the_construction_broadcast_is_seen_by_earlier_tapes() -> None:
    messages = dist.spawn(_recorded_before_ddp, 2)
    assert messages[0] == "no error"  # rank 0's values are its own: nothing was written
    assert "DistributedDataParallel" in messages[1]
    assert "modified in place" in messages[1]


# -- row 3: the guard sees through sliding_window_view / as_strided ----------------------------


def _window_then_all_reduce(rank: int) -> str:
    x = np.arange(6.0) + rank
    window = np.lib.stride_tricks.sliding_window_view(x, 2)
    with cp.Tape() as tape:
        tape.watch(window)
        loss = ops.sum(ops.multiply(window, window))
    dist.all_reduce(x)
    try:
        tape.gradient(loss, window)
    except RuntimeError as error:
        return str(error)
    return "no error"


def test_a_collective_into_the_base_of_a_recorded_window_is_refused() -> None:
    for message in dist.spawn(_window_then_all_reduce, 2):
        assert "modified in place" in message


@pytest.mark.parametrize(
    "view",
    [
        lambda x: np.lib.stride_tricks.sliding_window_view(x, 2),
        lambda x: np.lib.stride_tricks.as_strided(x, (3, 2), (x.strides[0], x.strides[0])),
    ],
    ids=["sliding_window_view", "as_strided"],
)
def test_a_write_into_the_base_of_a_host_window_is_refused(view: Any) -> None:
    x = cp.to_device(np.arange(6.0), "host:0")
    window = host_array(view(host_buffer(x)), x.device)
    with cp.Tape() as tape:
        tape.watch(window)
        loss = ops.sum(ops.multiply(window, window))
    x[...] = 7.0
    with pytest.raises(RuntimeError, match="modified"):
        tape.gradient(loss, window)


# -- row 4: comm's out= forms notify the tapes --------------------------------------------------


def test_comm_gather_into_a_recorded_out_is_refused() -> None:
    parts = [cp.to_device(np.ones(2), "host:0"), cp.to_device(np.ones(2), "host:1")]
    out = np.arange(4.0)
    with cp.Tape() as tape:
        tape.watch(out)
        loss = ops.sum(ops.multiply(out, out))
    cp.comm.gather(parts, out=out)
    with pytest.raises(RuntimeError, match=r"comm\.gather"):
        tape.gradient(loss, out)


def test_comm_scatter_and_broadcast_into_recorded_outs_are_refused() -> None:
    outs = [cp.to_device(np.zeros(2), "host:0"), cp.to_device(np.zeros(2), "host:1")]
    for operation, call in [
        ("comm.scatter", lambda: cp.comm.scatter(np.ones(4), out=outs)),
        ("comm.broadcast", lambda: cp.comm.broadcast(np.ones(2), out=outs)),
    ]:
        with cp.Tape() as tape:
            tape.watch(outs[1])
            loss = ops.sum(ops.multiply(outs[1], outs[1]))
        call()
        with pytest.raises(RuntimeError, match=operation.replace(".", r"\.")):
            tape.gradient(loss, outs[1])


# -- row 5: spawn gives each rank its own copy of args -----------------------------------------


def _add_rank_and_reduce(rank: int, x: np.ndarray, params: dict[str, Any]) -> Any:
    x += rank
    dist.all_reduce(x)
    params["w"] -= 1.0  # an update in place, as a training step's
    return x, params["w"]


def test_spawn_gives_each_rank_its_own_copy_of_args() -> None:
    x = np.zeros(3)
    params = {"w": np.ones(2), "name": "kept"}
    results = dist.spawn(_add_rank_and_reduce, 3, args=(x, params))
    for reduced, w in results:
        np.testing.assert_array_equal(reduced, np.full(3, 0.0 + 1.0 + 2.0))
        np.testing.assert_array_equal(w, np.zeros(2))
    np.testing.assert_array_equal(x, np.zeros(3))  # the caller's arrays are untouched
    np.testing.assert_array_equal(params["w"], np.ones(2))


# -- row 9 and parity: comm hooks ----------------------------------------------------------------


class _WaitOnly:
    def __init__(self, value: Any) -> None:
        self.value = value

    def wait(self) -> Any:
        return self.value


def _hook_with_wait_only(rank: int) -> Any:
    ddp = cp.DistributedDataParallel(_model, {"w": np.ones((3, 2))})

    def hook(state, bucket):  # type: ignore[no-untyped-def]  # no annotations: unchecked
        buffer = bucket.buffer()
        dist.all_reduce(buffer)
        buffer /= dist.get_world_size()
        return _WaitOnly(buffer)

    ddp.register_comm_hook(None, hook)
    with cp.Tape() as tape:
        loss = ddp(_shard(rank))
    return tape.gradient(loss, ddp.params)["w"]


def test_a_comm_hook_returning_an_object_with_wait_works() -> None:
    for g in dist.spawn(_hook_with_wait_only, 2):
        np.testing.assert_allclose(g, _averaged(2))


# -- PyTorch parity -------------------------------------------------------------------------------


@pytest.fixture
def world() -> Any:
    dist.init_process_group("mpi", world_size=1, rank=0)
    yield
    dist.destroy_process_group()


@pytest.mark.usefixtures("world")
def test_ddp_without_parameters_raises_runtime_error() -> None:
    # torch: "DistributedDataParallel is not needed when a module doesn't have any parameter
    # that requires a gradient."
    with pytest.raises(RuntimeError, match="not needed when params holds no parameter"):
        cp.DistributedDataParallel(lambda p, x: x, {"name": "none"})
    with pytest.raises(RuntimeError, match="not needed when params holds no parameter"):
        cp.DistributedDataParallel(lambda p, x: x, {})


@pytest.mark.usefixtures("world")
def test_pickle_and_deepcopy_of_a_ddp_point_to_its_params() -> None:
    ddp = cp.DistributedDataParallel(_model, {"w": np.ones((3, 2))})
    with pytest.raises(TypeError, match=r"save ddp\.params"):
        pickle.dumps(ddp)
    with pytest.raises(TypeError, match=r"save ddp\.params"):
        copy.deepcopy(ddp)
    with pytest.raises(TypeError, match=r"save ddp\.params"):
        copy.copy(ddp)


@pytest.mark.usefixtures("world")
@pytest.mark.parametrize(
    ("hook_source", "match"),
    [
        (
            "def hook(state, bucket: int): ...",
            "Communication hook: bucket annotation should be GradBucket",
        ),
        (
            "def hook(state, bucket) -> int: ...",
            r"Communication hook: return annotation should be Future",
        ),
    ],
    ids=["bucket", "return"],
)
def test_register_comm_hook_checks_annotations(hook_source: str, match: str) -> None:
    # torch's messages: "Communication hook: bucket annotation should be dist.GradBucket." and
    # "... return annotation should be torch.futures.Future[torch.Tensor]." (ValueError)
    namespace: dict[str, Any] = {}
    exec(hook_source, namespace)
    ddp = cp.DistributedDataParallel(_model, {"w": np.ones((3, 2))})
    with pytest.raises(ValueError, match=match):
        ddp.register_comm_hook(None, namespace["hook"])


@pytest.mark.usefixtures("world")
def test_register_comm_hook_accepts_the_right_annotations() -> None:
    from cupy_parallel._src.distributed.work import Future
    from cupy_parallel.distributed.algorithms.ddp_comm_hooks import GradBucket, default_hooks

    def hook(state, bucket):  # type: ignore[no-untyped-def]
        return default_hooks.allreduce_hook(state, bucket)

    def hook_text(state: Any, bucket: GradBucket) -> Future[np.ndarray]:  # text: postponed
        return default_hooks.allreduce_hook(state, bucket)

    hook.__annotations__ = {"bucket": GradBucket, "return": Future[Any]}  # the objects
    for h in (hook, hook_text):
        ddp = cp.DistributedDataParallel(_model, {"w": np.ones((3, 2))})
        ddp.register_comm_hook(None, h)
        with cp.Tape() as tape:
            loss = ddp(_shard(0))
        np.testing.assert_allclose(tape.gradient(loss, ddp.params)["w"], _averaged(1))


@pytest.mark.usefixtures("world")
def test_a_hook_returning_no_future_raises_runtime_error_at_backward() -> None:
    ddp = cp.DistributedDataParallel(_model, {"w": np.ones((3, 2))})
    ddp.register_comm_hook(None, lambda state, bucket: "nope")
    with cp.Tape() as tape:
        loss = ddp(_shard(0))
    with pytest.raises(RuntimeError, match="must return a future"):
        tape.gradient(loss, ddp.params)


def _refusals(rank: int) -> list[str]:
    found = []
    for op in (dist.ReduceOp.PRODUCT, dist.ReduceOp.BAND, dist.ReduceOp.BOR, dist.ReduceOp.BXOR):
        x = np.ones(2, np.complex64)
        try:
            dist.all_reduce(x, op=op)
        except ValueError as error:  # torch's type (ours is also a TypeError)
            found.append(f"{isinstance(error, TypeError)} {error}")
    x = np.full(2, 1.0 + 2.0j)
    dist.all_reduce(x)  # the sum still works: (1 + 2j) * 2
    np.testing.assert_array_equal(x, np.full(2, 2.0 + 4.0j))
    try:
        dist.all_gather([np.zeros(2), np.zeros(2)], np.ones(2, np.float32))
    except ValueError as error:
        found.append(str(error))
    return found


def test_complex_product_and_bitwise_all_reduce_and_mixed_dtype_all_gather_are_refused() -> None:
    for found in dist.spawn(_refusals, 2):
        assert len(found) == 5, found
        for message, op in zip(found, ["PRODUCT", "BAND", "BOR", "BXOR"], strict=False):
            assert message.startswith(f"True ReduceOp.{op} is not supported on complex dtype")
        assert "tensors with different dtypes" in found[4]


def test_complex_refusals_match_torchs() -> None:
    torch = pytest.importorskip("torch")
    tdist = pytest.importorskip("torch.distributed")
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    store = tdist.TCPStore("127.0.0.1", port, 1, True)
    tdist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match=r"does not support RedOpType\.PRODUCT on complex"):
            tdist.all_reduce(torch.ones(2, dtype=torch.complex64), op=tdist.ReduceOp.PRODUCT)
        with pytest.raises(ValueError, match="different dtypes"):
            tdist.all_gather([torch.zeros(2, dtype=torch.float64)], torch.ones(2))
    finally:
        tdist.destroy_process_group()


_rank_0_left = threading.Event()


def _monitored_at_once(rank: int) -> str:
    import datetime

    if rank == 1:  # arrives only once rank 0 has left its barrier, however loaded the machine
        assert _rank_0_left.wait(timeout=60)
    try:
        dist.monitored_barrier(timeout=datetime.timedelta(0))
    except RuntimeError as error:
        return str(error)
    finally:
        if rank == 0:
            _rank_0_left.set()
    return "no error"


def test_monitored_barrier_with_a_zero_timeout_times_out_at_once() -> None:
    import datetime

    dist.init_process_group("mpi", world_size=1, rank=0)
    try:
        dist.monitored_barrier(timeout=datetime.timedelta(0))  # a world of one: nothing to wait
    finally:
        dist.destroy_process_group()
    _rank_0_left.clear()
    messages = dist.spawn(_monitored_at_once, 2)
    assert "rank 1 did not arrive within 0 s" in messages[0]


def test_a_timed_out_barrier_is_a_runtime_error_as_torchs_dist_backend_error() -> None:
    assert issubclass(dist.DistTimeoutError, dist.DistBackendError)
    assert issubclass(dist.DistBackendError, dist.DistError)
    caught: list[BaseException] = []

    def barrier_alone(rank: int) -> None:
        if rank == 0:
            try:
                dist.barrier()  # rank 1 never comes
            except RuntimeError as error:  # torch's catch: DistBackendError
                caught.append(error)

    with pytest.raises(RuntimeError, match="spawn: rank 0 failed"):
        dist.spawn(barrier_alone, 2, timeout=0.3)  # a started barrier cannot be taken back
    assert len(caught) == 1
    assert isinstance(caught[0], TimeoutError)  # this library's catch before
    assert type(caught[0]) is dist.DistTimeoutError


def _world_object(rank: int) -> Any:
    x = np.full(2, rank + 1.0)
    work = dist.group.WORLD.allreduce([x])  # torch's ProcessGroup method on group.WORLD
    work.wait()
    return x, dist.group.WORLD.rank(), dist.group.WORLD.size()


def test_group_world_is_usable_as_the_default_process_group() -> None:
    for rank, (x, r, size) in enumerate(dist.spawn(_world_object, 3)):
        np.testing.assert_array_equal(x, np.full(2, 6.0))
        assert (r, size) == (rank, 3)
    assert repr(dist.group.WORLD) == "group.WORLD"
    with pytest.raises(RuntimeError, match="not initialized"):
        dist.group.WORLD.rank()


# -- row 8: an unused PRODUCT output ---------------------------------------------------------------


def _product_kept_for_logging(rank: int) -> Any:
    from cupy_parallel.distributed.nn import functional as F  # noqa: N812 - torch's name

    x = np.array([1.0, 2.0]) + rank
    with cp.Tape() as tape:
        tape.watch(x)
        logged = F.all_reduce(x, op=dist.ReduceOp.PRODUCT)  # kept for logging only
        loss = ops.sum(ops.square(F.all_reduce(x)))
    g = tape.gradient(loss, x)
    with cp.Tape() as tape:
        tape.watch(x)
        used = F.all_reduce(x, op=dist.ReduceOp.PRODUCT)
        loss = ops.sum(used) if rank == 0 else ops.sum(x)  # used on rank 0 only
    try:
        tape.gradient(loss, x)
    except RuntimeError as error:
        return logged, g, str(error)
    return logged, g, "no error"


def test_an_unused_product_output_does_not_break_the_gradient() -> None:
    results = dist.spawn(_product_kept_for_logging, 2)
    total = np.array([1.0, 2.0]) + np.array([2.0, 3.0])
    for logged, g, message in results:
        np.testing.assert_array_equal(logged, np.array([2.0, 6.0]))
        np.testing.assert_array_equal(g, 2 * 2 * total)  # d/dx sum((x0 + x1)^2), summed
        assert "all_reduce with ReduceOp.PRODUCT has no gradient" in message  # every rank


# -- row 6: a plain thread started inside a thread rank -------------------------------------------


def _plain_thread_in_a_rank(rank: int) -> list[str]:
    import contextvars
    import threading

    seen: list[str] = []

    def body() -> None:
        try:
            seen.append(f"rank {dist.get_rank()} of {dist.get_world_size()}")
        except RuntimeError as error:
            seen.append(str(error))

    plain = threading.Thread(target=body, name=f"plain {rank}")
    plain.start()
    plain.join()
    carried = threading.Thread(target=contextvars.copy_context().run, args=(body,))
    carried.start()
    carried.join()
    return seen


def test_a_plain_thread_started_in_a_thread_rank_is_told_it_belongs_to_no_rank() -> None:
    dist.init_process_group("mpi", world_size=1, rank=0)  # the caller's own world
    try:
        results = dist.spawn(_plain_thread_in_a_rank, 2)
        assert dist.get_world_size() == 1  # the caller's world is still its own
    finally:
        dist.destroy_process_group()
    for rank, (plain, carried) in enumerate(results):
        assert f"Thread 'plain {rank}' belongs to no rank" in plain
        assert "contextvars.copy_context().run" in plain
        assert carried == f"rank {rank} of 2"


# -- row 10: DDP's buckets and nn.functional's backward collectives never cross ---------------


def _crossing(rank: int) -> Any:
    from cupy_parallel.distributed.nn import functional as F  # noqa: N812 - torch's name

    c = np.array([3.0, 4.0])

    def model(params: dict[str, Any], a: Any) -> Any:
        terms = []
        if rank == 0:  # the parameter is unused on rank 1: its bucket is complete at once there
            terms.append(ops.sum(ops.multiply(params["w"], c)))
        terms.append(ops.sum(F.all_reduce(a)))  # its backward is an all_reduce of 2 float64
        return terms[0] if len(terms) == 1 else ops.add(terms[0], terms[1])

    ddp = cp.DistributedDataParallel(model, {"w": np.ones(2)})
    a = np.array([1.0, 2.0]) * (rank + 1)
    with cp.Tape() as tape:
        tape.watch(a)
        loss = ddp(a)
    grads = tape.gradient(loss, {"params": ddp.params, "a": a})
    return grads["params"]["w"], grads["a"]


def test_ddp_buckets_and_functional_backward_collectives_never_cross() -> None:
    for w, a in dist.spawn(_crossing, 2):
        np.testing.assert_array_equal(w, np.array([3.0, 4.0]) / 2)  # rank 0's c, averaged
        np.testing.assert_array_equal(a, np.array([2.0, 2.0]))  # the ones of both ranks


# -- row 12: a forgotten launcher ----------------------------------------------------------------


def test_a_world_of_one_nobody_asked_for_warns_once_naming_the_launchers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from cupy_parallel._src.distributed import groups

    monkeypatch.setattr(groups, "_warned_alone", False)
    for name in ("WORLD_SIZE", "PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    with pytest.warns(UserWarning, match=r"cupy-parallel launch.*mpiexec -n N") as caught:
        dist.init_process_group("mpi")
    dist.destroy_process_group()
    assert len(caught) == 1
    dist.init_process_group("mpi")  # once per process: no second warning (errors here)
    dist.destroy_process_group()
    monkeypatch.setattr(groups, "_warned_alone", False)
    dist.init_process_group("mpi", world_size=1)  # explicit: no warning
    dist.destroy_process_group()
    assert dist.spawn(lambda rank: dist.get_world_size(), 1) == [1]  # a thread rank: none


# -- row 7: a failed NCCL spawn leaves nothing pending -------------------------------------------


def _fails_on_rank_one(rank: int) -> None:
    from cupy_parallel._src.devices import cupy_module

    x = cupy_module().asarray(np.ones(3))
    if rank == 1:
        raise ValueError("rank 1 fails on purpose")
    dist.all_reduce(x)
    x.get()


def _sums(rank: int) -> float:
    from cupy_parallel._src.devices import cupy_module

    x = cupy_module().asarray(np.ones(3))
    dist.all_reduce(x)
    return float(x.get()[0])


def test_nccl_spawns_after_failed_ones_never_race() -> None:
    from cupy_parallel.testing import simulated_cuda

    # before: 49 of 300 runs after a failed one raised RaceError in spawn's set-up barrier
    with simulated_cuda(2):
        for _ in range(100):
            with pytest.raises(RuntimeError, match=r"spawn: rank 1 failed \(ValueError"):
                dist.spawn(_fails_on_rank_one, 2, backend="nccl")
            assert dist.spawn(_sums, 2, backend="nccl") == [2.0, 2.0]


# -- row 10: a parameter no rank used gets the tape's unconnected value (PyTorch parity) ---------
#
# Before the fix every such parameter got zeros, whatever unconnected_gradients said (the test
# with "none" failed: 'c' was array([0., 0., 0.]), not None); "zero" gave zeros already.

_uses = worker("torch_ddp_unused_oracle").uses  # the pattern torch's oracle runs too
_STEPS = worker("torch_ddp_unused_oracle").STEPS


def _unused_model(params: dict[str, Any], x: Any, rank: int, step: int) -> Any:
    loss = ops.sum(ops.multiply(params["a"], x))
    for power, name in ((2, "b"), (3, "c")):
        if _uses(name, rank, step):
            loss = ops.add(loss, ops.sum(ops.multiply(params[name], x**power)))
    return loss


def _unused_steps(rank: int, mode: str, find: bool = True) -> list[Any]:
    params = {name: np.ones(3) for name in "abc"}
    ddp = cp.DistributedDataParallel(_unused_model, params, find_unused_parameters=find)
    grads = []
    for step in range(_STEPS):
        with cp.Tape() as tape:
            loss = ddp(np.arange(3.0) + rank + step, rank, step)
        grads.append(tape.gradient(loss, ddp.params, unconnected_gradients=mode))
    return grads


def _whole_batch(world: int, step: int, mode: str) -> dict[str, Any]:
    """The oracle: one process, one tape, the mean of every rank's loss."""
    params = {name: np.ones(3) for name in "abc"}
    with cp.Tape() as tape:
        tape.watch(params)
        losses = [_unused_model(params, np.arange(3.0) + r + step, r, step) for r in range(world)]
        loss = ops.mean(ops.stack(losses))
    return tape.gradient(loss, params, unconnected_gradients=mode)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("mode", ["none", "zero"])
def test_a_parameter_no_rank_used_gets_the_unconnected_value(world: int, mode: str) -> None:
    results = dist.spawn(_unused_steps, world, (mode,))
    for step in range(_STEPS):
        want = _whole_batch(world, step, mode)
        assert (want["c"] is None) == (mode == "none" and step == 0)  # the oracle's own answer
        for grads in results:
            for name in "abc":
                got = grads[step][name]
                if want[name] is None:
                    assert got is None, (step, name)
                else:
                    np.testing.assert_allclose(got, want[name], rtol=1e-15, atol=0)
    # used on some ranks only: the average on every rank, those that did not use it included
    assert all(grads[0]["b"] is not None for grads in results)


@pytest.mark.slow
def test_unused_parameters_match_torchs_ddp_on_gloo(tmp_path: Any) -> None:
    """One world of torch processes (each imports torch: seconds); 3 ranks hold every pattern
    (used everywhere, on some ranks, nowhere, usage changing), the thread-rank oracle test
    above runs 2 and 3."""
    pytest.importorskip("torch")
    world = 3
    out = tmp_path / "out.npz"
    oracle = str(WORKERS / "torch_ddp_unused_oracle.py")
    done = subprocess.run(
        [sys.executable, oracle, str(world), str(out)],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    theirs = dict(np.load(out))
    assert "c_0_0" not in theirs  # torch: .grad is None where no rank used the parameter
    for rank, grads in enumerate(dist.spawn(_unused_steps, world, ("none",))):
        for step in range(_STEPS):
            for name in "abc":
                key, got = f"{name}_{step}_{rank}", grads[step][name]
                if key not in theirs:
                    assert got is None, key
                else:
                    np.testing.assert_allclose(got, theirs[key], rtol=1e-15, atol=0)


def _caught(rank: int, program: Any, *args: Any) -> Any:
    try:
        return program(rank, *args)
    except ValueError as error:
        return f"{type(error).__name__}: {error}"


def test_none_without_find_unused_parameters_raises_where_a_parameter_got_no_gradient() -> None:
    # nothing is exchanged, so a rank cannot tell "unused here" from "unused everywhere"
    messages = dist.spawn(_caught, 2, (_unused_steps, "none", False))
    for message, name in zip(messages, ["c", "b"], strict=True):  # rank 1 used no 'b' either
        assert isinstance(message, str)
        assert f"params['{name}'] got no gradient on this rank" in message
        assert "construct it with find_unused_parameters=True" in message
    # "zero" needs no exchange: the reduced value, zeros where no rank used it (the oracle's)
    for grads in dist.spawn(_unused_steps, 2, ("zero", False)):
        for step in range(_STEPS):
            want = _whole_batch(2, step, "zero")
            for name in "abc":
                np.testing.assert_allclose(grads[step][name], want[name], rtol=1e-15, atol=0)


def _asking(rank: int, modes: tuple[str, ...]) -> Any:
    return _unused_steps(rank, modes[rank])


def test_ranks_asking_different_unconnected_values_raise_on_every_rank() -> None:
    for message in dist.spawn(_caught, 2, (_asking, ("none", "zero"))):
        assert isinstance(message, str)
        assert 'The ranks\' gradient() calls differ: 1 of 2 take unconnected_gradients="none"' in (
            message
        )


def _find_on_rank_zero(rank: int) -> Any:
    return cp.DistributedDataParallel(
        _model, {"w": np.ones((3, 2))}, find_unused_parameters=rank == 0
    )


def test_find_unused_parameters_must_agree_across_ranks() -> None:
    for message in dist.spawn(_caught, 2, (_find_on_rank_zero,)):
        assert isinstance(message, str)
        assert "differ across the ranks" in message


def _only_unused_source(rank: int, mode: str) -> Any:
    ddp = cp.DistributedDataParallel(
        _unused_model, {name: np.ones(3) for name in "abc"}, find_unused_parameters=True
    )
    with cp.Tape() as tape:
        loss = ddp(np.arange(3.0) + rank, rank, 0)
    return tape.gradient(loss, ddp.params["c"], unconnected_gradients=mode)


def test_a_target_that_reaches_no_source_on_any_rank_is_the_tapes_error() -> None:
    params = {name: np.ones(3) for name in "abc"}
    with cp.Tape() as tape:  # the one-process oracle
        tape.watch(params)
        loss = _unused_model(params, np.arange(3.0), 0, 0)
    with pytest.raises(ValueError, match="does not depend on any of the sources") as caught:
        tape.gradient(loss, params["c"])
    for message in dist.spawn(_caught, 2, (_only_unused_source, "zero")):
        assert message == f"{type(caught.value).__name__}: {caught.value}"
    assert dist.spawn(_only_unused_source, 2, ("none",)) == [None, None]


def _unused_steps_on_gpus(rank: int) -> list[Any]:
    gpu = f"cuda:{rank}"
    params = {name: cp.to_device(np.ones(3), gpu) for name in "abc"}
    ddp = cp.DistributedDataParallel(_unused_model, params, find_unused_parameters=True)
    grads = []
    for step in range(_STEPS):
        with cp.Tape() as tape:
            loss = ddp(cp.to_device(np.arange(3.0) + rank + step, gpu), rank, step)
        g = tape.gradient(loss, ddp.params, unconnected_gradients="none")
        grads.append({k: None if v is None else cp.to_device(v, "cpu") for k, v in g.items()})
    return grads


def test_the_used_parameters_are_exchanged_on_the_buckets_gpus_over_nccl() -> None:
    from cupy_parallel.testing import simulated_cuda

    with simulated_cuda(2):
        results = dist.spawn(_unused_steps_on_gpus, 2, backend="nccl")
    for step in range(_STEPS):
        want = _whole_batch(2, step, "none")
        for grads in results:
            for name in "abc":
                if want[name] is None:
                    assert grads[step][name] is None, (step, name)
                else:
                    np.testing.assert_allclose(grads[step][name], want[name], rtol=1e-15, atol=0)


# The same question on a nested tree, as users build them: a dict of lists holding a
# zero-size parameter (used from step 1 on) and one read only through stop_gradient (never
# reached), each parameter a bucket of its own, with and without fp16_compress_hook, asked on
# a persistent tape twice, and for a subtree. torch's DDP (gloo, find_unused_parameters=True,
# checked by hand on the same pattern) gives the zero-size parameter None in step 0 and an
# empty gradient in step 1, and None to the detached one in every step: the oracle here is the
# one-process tape over the mean of the ranks' losses. (These passed when written: they pin
# the pattern.)


def _nested_model(p: dict[str, Any], x: Any, rank: int, step: int) -> Any:
    loss = ops.sum(ops.multiply(p["l"][0], x))
    loss = ops.add(loss, ops.sum(ops.multiply(cp.stop_gradient(p["d"]["s"]), x)))
    if rank % 2 == 0:
        loss = ops.add(loss, ops.sum(ops.multiply(p["l"][1], x**2)))
    if step == 1 and rank == 1:
        loss = ops.add(loss, ops.sum(ops.multiply(p["d"]["c"], x**3)))
    if step >= 1:
        loss = ops.add(loss, ops.sum(ops.multiply(p["d"]["z"], np.ones(0))))
    return loss


def _nested_params() -> dict[str, Any]:
    return {"l": [np.ones(3), np.ones(3)], "d": {"c": np.ones(3), "s": np.ones(3), "z": np.ones(0)}}


def _nested_steps(rank: int, mode: str, hook: bool) -> list[Any]:
    from cupy_parallel.distributed.algorithms.ddp_comm_hooks import default_hooks

    ddp = cp.DistributedDataParallel(
        _nested_model, _nested_params(), find_unused_parameters=True, bucket_cap_mb=1e-6
    )
    if hook:
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    found = []
    for step in range(2):
        with cp.Tape(persistent=True) as tape:
            loss = ddp(np.arange(3.0) + rank + step, rank, step)
        found.append(tape.gradient(loss, ddp.params, unconnected_gradients=mode))
        subtree = [ddp.params["l"][1], ddp.params["d"]]  # "d" alone reaches nothing in step 0
        found.append(tape.gradient(loss, subtree, unconnected_gradients=mode))
    return found


@pytest.mark.parametrize("hook", [False, True])
@pytest.mark.parametrize("mode", ["none", "zero"])
def test_unused_parameters_of_a_nested_tree_in_buckets_of_one(mode: str, hook: bool) -> None:
    world = 2
    results = dist.spawn(_nested_steps, world, (mode, hook))
    for step in range(2):
        params = _nested_params()
        with cp.Tape() as tape:
            tape.watch(params)
            losses = [
                _nested_model(params, np.arange(3.0) + r + step, r, step) for r in range(world)
            ]
            want = tape.gradient(ops.mean(ops.stack(losses)), params, unconnected_gradients=mode)
        assert (want["d"]["s"] is None) == (mode == "none")
        assert (want["d"]["z"] is None) == (mode == "none" and step == 0)
        for found in results:
            whole, subtree = found[2 * step], found[2 * step + 1]
            assert subtree[1].keys() == want["d"].keys()
            pairs = [(whole["l"][0], want["l"][0])]
            pairs += [(got, want["l"][1]) for got in (whole["l"][1], subtree[0])]
            pairs += [(got[k], want["d"][k]) for got in (whole["d"], subtree[1]) for k in "csz"]
            for got, expected in pairs:
                if expected is None:
                    assert got is None, (step, mode)
                else:
                    np.testing.assert_allclose(got, expected, rtol=1e-3 if hook else 1e-15)
