"""DistributedDataParallel: against one process under mpiexec, and its edges in a world of one.

``mpi_workers/ddp_worker.py`` holds the multi-rank checks (the one-process oracle of the whole
batch's gradient to 1e-12 in float64 with uneven layers, several buckets, unused parameters,
``no_sync`` accumulation, the order of events, comm hooks, errors raised on every rank), in
float64, float32 and float16 against a float64 oracle, and the average to the bit against a
model of its reduction; one ``mpiexec`` launch per world size runs them all. The same checks
run on thread ranks (``spawn``: one run per world size): the MPI backend with NumPy and host
arrays, printing what the processes print, and NCCL ranks under ``simulated_cuda`` (race
checker on) with CuPy arrays. The other tests need no mpiexec: a world of one
(``init_process_group("mpi")`` outside mpiexec), where the average is the rank's own gradient,
so the oracle is a plain tape.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import subprocess
import sys
import threading
import warnings
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
from helpers import on_each_kind_of_stream
from thread_ranks import MPIEXEC, ROOT, printed, run_mpiexec, run_threads, worker

import cupy_parallel as cp
from cupy_parallel import distributed as dist
from cupy_parallel import ops
from cupy_parallel._src.ddp import FIRST_BUCKET_BYTES, _assign_buckets
from cupy_parallel.distributed.algorithms.ddp_comm_hooks import GradBucket, default_hooks

if TYPE_CHECKING:
    from collections.abc import Iterator


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.skipif(MPIEXEC is None, reason="needs mpiexec (pip install mpich)")
def test_ddp_equals_one_process_under_mpiexec() -> None:
    """Processes at one world size print what thread ranks print (which run 2 and 3, below)."""
    ranks = 3
    done = run_mpiexec("ddp_worker", ranks, timeout=240)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert done.stdout.count("checks passed") == ranks, done.stdout
    threads = run_threads("ddp_worker", ranks, "all", timeout=60)
    assert printed(threads.stdout) == printed(done.stdout)


def passed(ranks: int, count: int) -> list[str]:
    return [f"rank {r}: {count} checks passed" for r in range(ranks)]


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [2, 3], ids=lambda n: f"{n}ranks")
def test_ddp_on_thread_ranks(ranks: int) -> None:
    """NumPy and host arrays, float64/32/16: the MPI backend on thread ranks."""
    ran = run_threads("ddp_worker", ranks, "all", timeout=60)
    assert ran.returncode == 0, ran.stdout[-6000:] + ran.stderr[-3000:]
    assert printed(ran.stdout) == passed(ranks, len(worker("ddp_worker").CHECKS))


@pytest.mark.slow
@on_each_kind_of_stream
def test_ddp_on_nccl_thread_ranks_with_cupy_arrays(ranks: int) -> None:
    """CuPy arrays over NCCL, rank r on simulated GPU r (race checker on), float64/32/16; on 3
    ranks on the legacy stream (the MPI thread ranks above run 2 and 3 through the same worker; a
    simulated GPU per rank makes each world seconds long), on 2 off it."""
    from cupy_parallel.testing import simulated_cuda

    with simulated_cuda(ranks):
        ran = run_threads("ddp_worker", ranks, "cupy", timeout=60, backend="nccl")
    assert ran.returncode == 0, ran.stdout[-6000:] + ran.stderr[-3000:]
    assert printed(ran.stdout) == passed(ranks, len(worker("ddp_worker").cupy_checks()))


@pytest.fixture
def world() -> Any:
    dist.init_process_group("mpi", world_size=1)
    yield
    dist.destroy_process_group()


def _model(params: dict[str, Any], x: Any) -> Any:
    h = ops.tanh(ops.matmul(x, params["w1"]))
    return ops.sum(ops.matmul(h, params["w2"]))


def _params() -> dict[str, Any]:
    rng = np.random.default_rng(0)
    return {"w1": rng.normal(size=(3, 4)), "w2": rng.normal(size=(4, 2)), "name": "mlp"}


X = np.linspace(-1.0, 1.0, 6).reshape(2, 3)


def _plain_gradient(params: dict[str, Any]) -> Any:
    with cp.Tape() as tape:
        tape.watch(params)
        loss = _model(params, X)
    return tape.gradient(loss, params)


# -- arguments ---------------------------------------------------------------------------------


@pytest.mark.usefixtures("world")
@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"fn": 3}, TypeError, "fn must be callable"),
        ({"bucket_cap_mb": "25"}, TypeError, "bucket_cap_mb must be a real number, got str"),
        ({"bucket_cap_mb": 0.0}, ValueError, "bucket_cap_mb must be > 0, got 0.0"),
        ({"bucket_cap_mb": True}, TypeError, "bucket_cap_mb"),
        ({"broadcast_params": 1}, TypeError, "broadcast_params must be a bool, got int 1"),
        ({"process_group": "world"}, TypeError, "group must be None"),
        (
            {"process_group": dist.GroupMember.NON_GROUP_MEMBER},
            ValueError,
            "process_group must be a group this rank is a member of",
        ),
        ({"params": {"w": np.arange(3)}}, TypeError, r"params\['w'\] has dtype int64"),
    ],
    ids=["fn", "cap-type", "cap-zero", "cap-bool", "broadcast", "group", "non-member", "int"],
)
def test_bad_arguments_raise_before_anything_changes(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    params = _params()
    before = {k: v.copy() for k, v in params.items() if isinstance(v, np.ndarray)}
    arguments = {"fn": _model, "params": params, **kwargs}
    fn, p = arguments.pop("fn"), arguments.pop("params")
    with pytest.raises(error, match=match):
        cp.DistributedDataParallel(fn, p, **arguments)
    for k, v in before.items():
        np.testing.assert_array_equal(params[k], v)


def test_without_a_process_group_it_says_so() -> None:
    with pytest.raises(RuntimeError, match="not initialized"):
        cp.DistributedDataParallel(_model, _params())


# -- buckets -----------------------------------------------------------------------------------


def test_buckets_in_reverse_order_per_dtype_with_caps() -> None:
    arrays = [
        np.zeros(100, np.float64),  # 800 B
        np.zeros(100, np.float32),  # 400 B
        np.zeros(50, np.float64),  # 400 B
        np.zeros(200, np.float64),  # 1600 B
        np.zeros(10, np.float32),  # 40 B
    ]
    buckets = _assign_buckets(arrays, 500, 1000)
    # float64: [3] reaches the first cap (500 B), [2, 0] the cap; float32: [4, 1] stays open;
    # the bucket holding the last parameter is reduced first
    assert [b.members for b in buckets] == [[4, 1], [3], [2, 0]]
    assert [str(b.dtype) for b in buckets] == ["float32", "float64", "float64"]
    assert [b.size for b in buckets] == [110, 200, 150]
    assert buckets[0].slices == [(0, 10), (10, 110)]
    one = _assign_buckets(arrays, 10**9, 10**9)  # everything fits: one bucket per dtype
    assert [b.members for b in one] == [[4, 1], [3, 2, 0]]


@pytest.mark.usefixtures("world")
def test_default_cap_has_a_small_first_bucket() -> None:
    count = FIRST_BUCKET_BYTES // 8
    params = [np.zeros(count // 2), np.zeros(count // 2), np.zeros(count), np.zeros(count)]
    ddp = cp.DistributedDataParallel(lambda p, x: x, params)
    assert [b.members for b in ddp._buckets] == [[3], [2, 1, 0]]
    ddp = cp.DistributedDataParallel(lambda p, x: x, params, bucket_cap_mb=50.0)
    assert [b.members for b in ddp._buckets] == [[3, 2, 1, 0]]


# -- gradients in a world of one ---------------------------------------------------------------


@pytest.mark.usefixtures("world")
@pytest.mark.parametrize("cap", [25.0, 1e-5], ids=["one-bucket", "bucket-per-array"])
def test_gradient_is_the_plain_tapes_in_a_world_of_one(cap: float) -> None:
    params = _params()
    ddp = cp.DistributedDataParallel(_model, params, bucket_cap_mb=cap)
    assert ddp.params is params
    with cp.Tape() as tape:
        loss = ddp(X)
    grads = tape.gradient(loss, ddp.params)
    expected = _plain_gradient(_params())
    assert grads["name"] is None
    for k in ("w1", "w2"):
        np.testing.assert_allclose(grads[k], expected[k], rtol=1e-14, atol=0)


def _counting_hook(calls: list[int]) -> Any:
    """The allreduce hook, appending each bucket's index to ``calls``."""

    def counting(state: Any, bucket: Any) -> Any:
        calls.append(bucket.index())
        return default_hooks.allreduce_hook(state, bucket)

    return counting


@pytest.mark.usefixtures("world")
def test_no_sync_forward_runs_no_hook_and_reduce_gradients_does() -> None:
    calls: list[int] = []
    counting = _counting_hook(calls)
    ddp = cp.DistributedDataParallel(_model, _params(), bucket_cap_mb=1e-5)
    ddp.register_comm_hook(None, counting)
    with ddp.no_sync():
        with cp.Tape() as tape:
            loss = ddp(X)
        grads = tape.gradient(loss, ddp.params)
    assert calls == []
    reduced = ddp.reduce_gradients(grads)
    assert calls == [0, 1]
    np.testing.assert_array_equal(reduced["w1"], grads["w1"])
    assert reduced["w1"] is not grads["w1"]
    assert reduced["name"] is None


def _recorded_step(ddp: Any) -> Any:
    with cp.Tape() as tape:
        loss = ddp(X)
    return tape.gradient(loss, ddp.params)


@pytest.mark.usefixtures("world")
def test_torch_style_accumulation_warns_once() -> None:
    """torch's pattern, ported word for word: the micro-batches inside no_sync, the last one
    outside. torch's last backward averages the accumulated .grad; ours averages that pass's
    gradients only, and the sum the user makes mixes local and averaged ones: a warning."""
    ddp = cp.DistributedDataParallel(_model, _params())
    with ddp.no_sync():
        _recorded_step(ddp)
        _recorded_step(ddp)
    with pytest.warns(UserWarning, match=r"2 forward call\(s\) recorded inside no_sync\(\)"):
        _recorded_step(ddp)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _recorded_step(ddp)  # the local passes were warned of once


@pytest.mark.usefixtures("world")
def test_torch_style_accumulation_on_one_tape_is_one_averaged_pass_and_does_not_warn() -> None:
    """torch's pattern with every micro-batch recorded on one tape: the pass that the last
    (synchronising) forward hooks averages every micro-batch's gradient, which is torch's
    answer (checked against torch's DDP on 2 and 3 gloo ranks: 3.7e-16). It once warned that
    the local gradients were left unaveraged; a micro-batch on a tape of its own still warns."""
    ddp = cp.DistributedDataParallel(_model, _params(), bucket_cap_mb=1e-5)
    expected = _plain_gradient_of_sum(ddp.params, [X, 2.0 * X, -X])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with cp.Tape() as tape:
            with ddp.no_sync():
                loss = ops.add(ddp(X), ddp(2.0 * X))
            loss = ops.add(loss, ddp(-X))
        grads = tape.gradient(loss, ddp.params)
    for name in ("w1", "w2"):
        np.testing.assert_allclose(grads[name], expected[name], rtol=1e-14, atol=0)
    with ddp.no_sync(), cp.Tape() as alone:
        ddp(X)  # on a tape of its own: left unreduced
    with cp.Tape() as tape:
        with ddp.no_sync(), cp.Tape() as inner:
            ddp(X)  # recorded on both tapes: the pass of the outer one reduces it
        with pytest.warns(UserWarning, match=r"1 forward call\(s\) recorded inside no_sync"):
            ddp(X)
    del alone, inner


def _plain_gradient_of_sum(params: dict[str, Any], xs: list[Any]) -> Any:
    with cp.Tape() as tape:
        tape.watch(params)
        loss = _model(params, xs[0])
        for x in xs[1:]:
            loss = ops.add(loss, _model(params, x))
    return tape.gradient(loss, params)


@pytest.mark.usefixtures("world")
def test_the_documented_accumulation_and_unrecorded_calls_do_not_warn() -> None:
    ddp = cp.DistributedDataParallel(_model, _params())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with ddp.no_sync():
            total = _recorded_step(ddp)
            ddp(X)  # no tape records it (an evaluation): no gradient, nothing left unreduced
        ddp.reduce_gradients(total)
        _recorded_step(ddp)
        with ddp.no_sync():
            ddp(X)
        _recorded_step(ddp)


@pytest.mark.usefixtures("world")
def test_a_tape_hooks_once_and_non_persistent_tapes_drop_their_hooks() -> None:
    calls: list[int] = []
    counting = _counting_hook(calls)
    ddp = cp.DistributedDataParallel(_model, _params())
    ddp.register_comm_hook(None, counting)
    with cp.Tape(persistent=True) as tape:
        loss = ops.add(ddp(X), ddp(2.0 * X))
    first = tape.gradient(loss, ddp.params)
    second = tape.gradient(loss, ddp.params)
    assert calls == [0, 0]  # one reduction per pass, however many forward calls
    np.testing.assert_array_equal(first["w1"], second["w1"])
    assert not np.shares_memory(first["w1"], second["w1"])  # fresh buffers each pass


@pytest.mark.usefixtures("world")
def test_one_array_at_two_leaves_gets_its_total_gradient() -> None:
    w = np.array([[1.0, 2.0], [3.0, -1.0]])
    ddp = cp.DistributedDataParallel(
        lambda p, x: ops.sum(ops.matmul(ops.matmul(x, p["a"]), p["b"])), {"a": w, "b": w}
    )
    x = np.array([[0.5, -2.0]])
    with cp.Tape() as tape:
        loss = ddp(x)
    grads = tape.gradient(loss, ddp.params)
    with cp.Tape() as tape:
        tape.watch(w)
        loss = ops.sum(ops.matmul(ops.matmul(x, w), w))
    expected = tape.gradient(loss, w)  # by identity: the total derivative, as Tape gives
    np.testing.assert_allclose(grads["a"], expected, rtol=1e-15)
    np.testing.assert_allclose(grads["b"], expected, rtol=1e-15)


@pytest.mark.usefixtures("world")
def test_value_and_grad_differentiates_its_own_arguments_not_ddp_params() -> None:
    ddp = cp.DistributedDataParallel(_model, _params())
    with pytest.raises(ValueError, match="does not depend on any of the sources"):
        cp.value_and_grad(lambda p: ddp(X))(ddp.params)


@pytest.mark.usefixtures("world")
def test_replacing_params_checks_their_structure() -> None:
    ddp = cp.DistributedDataParallel(_model, _params())
    new = _params()
    ddp.params = new
    assert ddp.params is new
    with pytest.raises(ValueError, match=r"params\['w2'\]: shape \(4, 2\) .* shape \(4, 3\)"):
        ddp.params = {**_params(), "w2": np.zeros((4, 3))}
    with pytest.raises(TypeError, match="floating-point"):
        ddp.params = {**_params(), "w2": np.zeros((4, 2), np.int32)}
    assert ddp.params is new


@pytest.mark.usefixtures("world")
def test_reduce_gradients_refuses_a_tree_unlike_params() -> None:
    ddp = cp.DistributedDataParallel(_model, _params())
    with pytest.raises(ValueError, match="On rank 0: grads must have the structure"):
        ddp.reduce_gradients({"w1": np.zeros((3, 4))})
    with pytest.raises(ValueError, match=r"grads\['w2'\] must be None or an array of .* \(4, 2\)"):
        ddp.reduce_gradients({"w1": np.zeros((3, 4)), "w2": np.zeros(8), "name": None})
    reduced = ddp.reduce_gradients({"w1": None, "w2": np.ones((4, 2)), "name": "x"})
    np.testing.assert_array_equal(reduced["w1"], np.zeros((3, 4)))  # None counts as zeros


@pytest.mark.usefixtures("world")
def test_a_refused_reduce_gradients_still_leaves_the_local_passes_to_warn_of() -> None:
    """reduce_gradients(bad tree) raises and averages nothing, so the no_sync passes before it
    are still unreduced and the next synchronising forward must warn of them. The count was
    reset before the tree was checked: the refused call silenced the warning."""
    ddp = cp.DistributedDataParallel(_model, _params())
    with ddp.no_sync():
        total = _recorded_step(ddp)
    with pytest.raises(ValueError, match=r"grads\['w2'\] must be None or an array"):
        ddp.reduce_gradients({**total, "w2": np.zeros(8)})
    with pytest.warns(UserWarning, match=r"1 forward call\(s\) recorded inside no_sync\(\)"):
        _recorded_step(ddp)
    with ddp.no_sync():
        total = _recorded_step(ddp)
    ddp.reduce_gradients(total)  # accepted: the local pass is averaged, nothing to warn of
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _recorded_step(ddp)


# -- comm hooks --------------------------------------------------------------------------------


@pytest.mark.usefixtures("world")
def test_comm_hook_contract() -> None:
    seen: list[Any] = []

    def hook(state: Any, bucket: GradBucket) -> Any:
        seen.append((state, bucket.index(), bucket.is_last(), len(bucket.parameters())))
        assert [g.shape for g in bucket.gradients()] == [p.shape for p in bucket.parameters()]
        return default_hooks.allreduce_hook(None, bucket)

    params = _params()
    ddp = cp.DistributedDataParallel(_model, params, bucket_cap_mb=1e-5)
    ddp.register_comm_hook("state", hook)
    with pytest.raises(RuntimeError, match="only be called once"):
        ddp.register_comm_hook("state", hook)
    with pytest.raises(TypeError, match="hook must be callable"):
        cp.DistributedDataParallel(_model, _params()).register_comm_hook(None, 3)
    fresh = cp.DistributedDataParallel(_model, _params())
    with pytest.raises(TypeError, match=r"state is the process group fp16_compress_hook reduces"):
        fresh.register_comm_hook("world", default_hooks.fp16_compress_hook)
    fresh.register_comm_hook(None, default_hooks.fp16_compress_hook)  # nothing was registered
    with cp.Tape() as tape:
        loss = ddp(X)
    tape.gradient(loss, ddp.params)
    assert seen == [("state", 0, False, 1), ("state", 1, True, 1)]


@pytest.mark.usefixtures("world")
@pytest.mark.parametrize(
    ("result", "match"),
    [
        (lambda bucket: "nope", "must return a future"),
        (lambda bucket: _done(np.zeros(3)), r"must hold the reduced flat buffer.*shape \(3,\)"),
    ],
    ids=["no-future", "wrong-shape"],
)
def test_a_bad_comm_hook_is_named(result: Any, match: str) -> None:
    ddp = cp.DistributedDataParallel(_model, _params())
    ddp.register_comm_hook(None, lambda state, bucket: result(bucket))
    with cp.Tape() as tape:
        loss = ddp(X)
    with pytest.raises((TypeError, ValueError), match=match):
        tape.gradient(loss, ddp.params)


def _done(value: Any) -> Any:
    from cupy_parallel._src.distributed.work import Future

    future: Future[Any] = Future()
    future.set_result(value)
    return future


@pytest.mark.usefixtures("world")
def test_fp16_hook_rounds_to_half_precision() -> None:
    ddp = cp.DistributedDataParallel(_model, _params())
    ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    with cp.Tape() as tape:
        loss = ddp(X)
    grads = tape.gradient(loss, ddp.params)
    expected = _plain_gradient(_params())
    for k in ("w1", "w2"):
        np.testing.assert_array_equal(grads[k], expected[k].astype(np.float16).astype(np.float64))


@pytest.mark.usefixtures("world")
def test_bf16_hook_needs_ml_dtypes() -> None:
    ddp = cp.DistributedDataParallel(_model, _params())
    try:
        import ml_dtypes
    except ImportError:
        with pytest.raises(RuntimeError, match="install ml_dtypes"):
            ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    else:  # pragma: no cover - ml_dtypes is not a dependency
        # the MPI backend sums bfloat16 (in float32): a world of one rounds to bfloat16 once
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
        grads = _plain_gradient(_params())
        reduced = ddp.reduce_gradients(grads)
        bf16 = np.dtype(ml_dtypes.bfloat16)
        np.testing.assert_array_equal(reduced["w1"], grads["w1"].astype(bf16).astype(float))


def test_bf16_hook_is_refused_at_registration_where_the_backend_has_no_bfloat16_sum() -> None:
    """NCCL before 2.10 has no bfloat16 (simulated NCCL 2.9 here): refused when registered.

    (The MPI backend sums bfloat16 in float32: see test_bf16_hook_averages_in_bfloat16...)
    """
    pytest.importorskip("ml_dtypes")  # without it the hook is refused for that (above)
    from cupy_parallel._src.cuda.nccl_tables import version_code
    from cupy_parallel._src.simcuda import sim_nccl
    from cupy_parallel.testing import simulated_cuda

    grads = [np.array([1.0, 2.0, 0.5, 3.0, -4.0, 8.0], np.float32) * (r + 1) for r in (0, 1)]
    with simulated_cuda(2) as cupy:
        sim_nccl.set_version(version_code(2, 9, 9))

        def refuses(rank: int) -> tuple[str, np.ndarray]:
            ddp = cp.DistributedDataParallel(lambda p, x: x, cupy.zeros(6, np.float32))
            with pytest.raises(NotImplementedError) as refused:  # NCCL's own refusal's type
                ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)  # nothing registered
            reduced = ddp.reduce_gradients(cupy.asarray(grads[rank]))
            return str(refused.value), cupy.asnumpy(reduced)

        results = dist.spawn(refuses, 2, backend="nccl")
    half = np.float16
    expected = sum(g.astype(half) / half(2) for g in grads).astype(np.float32)  # torch's fp16 hook
    for message, reduced in results:
        assert message.startswith(
            "bf16_compress_hook reduces each bucket in bfloat16, which the 'nccl' backend of "
            "process group '0' cannot reduce"
        ), message
        np.testing.assert_array_equal(reduced, expected)


def test_bf16_hook_over_nccl_rounds_to_bfloat16() -> None:
    ml_dtypes = pytest.importorskip("ml_dtypes")
    from cupy_parallel.testing import simulated_cuda

    bf16 = np.dtype(ml_dtypes.bfloat16)
    grads = [np.array([1.0, 1 / 3, 1e-3, 300.0, -2.5, 7.0], np.float32) * (r + 1) for r in (0, 1)]
    with simulated_cuda(2) as cupy:

        def reduce(rank: int) -> Any:
            ddp = cp.DistributedDataParallel(lambda p, x: x, cupy.zeros(6, np.float32))
            ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
            return cupy.asnumpy(ddp.reduce_gradients(cupy.asarray(grads[rank])))

        reduced = dist.spawn(reduce, 2, backend="nccl")
    # torch's hook in NumPy: cast to bfloat16, divide by the world size there, sum, cast back
    expected = sum(g.astype(bf16) / np.array(2, bf16) for g in grads).astype(np.float32)
    assert not np.array_equal(expected, sum(grads) / 2)  # bfloat16's rounding shows
    for got in reduced:
        np.testing.assert_array_equal(got, expected)


def _bf16_bits(values: np.ndarray) -> np.ndarray:
    """float32 values rounded to bfloat16 bit patterns, to nearest even (NumPy only)."""
    bits = np.ascontiguousarray(values, np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def _bf16_values(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


@pytest.mark.parametrize("ranks", [2, 3], ids=lambda n: f"{n}ranks")
def test_bf16_hook_averages_in_bfloat16_on_thread_ranks(ranks: int) -> None:
    """torch's bf16_compress_hook: cast to bfloat16, divide by the world size, sum, cast back.

    Through the hook itself and through DDP's buckets (``reduce_gradients``), on the MPI
    backend (thread ranks); the oracle rounds with NumPy bit arithmetic, to nearest even.
    """
    pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(5)
    params = {k: v for k, v in _params().items() if k != "name"}
    # float32 values (the first cast rounds), within 2**-3..2**3 so that the float32 sum of the
    # ranks' bfloat16 parts is exact in any order
    grads = [
        {
            k: (rng.choice([-1, 1], v.shape) * 2.0 ** rng.uniform(-3, 3, v.shape))
            .astype(np.float32)
            .astype(np.float64)
            for k, v in params.items()
        }
        for _ in range(ranks)
    ]

    def oracle(values: list[np.ndarray]) -> np.ndarray:
        parts = [_bf16_bits(_bf16_values(_bf16_bits(v)) / np.float32(ranks)) for v in values]
        total = sum(_bf16_values(p) for p in parts)
        return _bf16_values(_bf16_bits(total)).astype(np.float64)

    def program(rank: int) -> tuple[Any, Any]:
        flat = grads[rank]["w1"].reshape(-1)
        bucket = GradBucket(0, flat.copy(), [np.zeros(flat.size)], [(0, flat.size)])
        hooked = default_hooks.bf16_compress_hook(None, bucket).wait()
        ddp = cp.DistributedDataParallel(_model, params)
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
        return hooked, ddp.reduce_gradients(grads[rank])

    results = dist.spawn(program, ranks)
    for hooked, reduced in results:
        w1 = oracle([g["w1"].reshape(-1) for g in grads])
        np.testing.assert_array_equal(hooked, w1)
        for k in params:
            np.testing.assert_array_equal(reduced[k], oracle([g[k] for g in grads]), err_msg=k)


@pytest.mark.parametrize("device", ["cpu", "host:1"])
def test_fp16_compress_hook_sends_both_parts_of_a_complex_bucket(device: str) -> None:
    """Each part in float16, averaged as a real bucket of twice the length would be: the
    oracle is the MPI backend's float16 average (each part divided in float16, the ranks' parts
    summed in float32, rounded once). Casting the complex bucket, as torch does, keeps the real
    parts only."""
    ranks = 2
    rng = np.random.default_rng(8)
    flats = [rng.normal(size=5) + 1j * rng.normal(size=5) for _ in range(ranks)]

    def average(parts: list[np.ndarray]) -> np.ndarray:
        divided = [(p.astype(np.float16) / np.float16(ranks)).astype(np.float32) for p in parts]
        return sum(divided).astype(np.float16).astype(np.float64)  # type: ignore[no-any-return]

    expected = average([f.view(np.float64) for f in flats]).view(np.complex128)

    def program(rank: int) -> Any:
        flat = cp.to_device(flats[rank], device)
        bucket = GradBucket(0, flat, [cp.to_device(np.zeros(5, complex), device)], [(0, 5)])
        reduced = default_hooks.fp16_compress_hook(None, bucket).wait()
        assert reduced is flat  # written back into the bucket's buffer, as torch's hook
        return cp.to_device(reduced, "cpu")

    for reduced in dist.spawn(program, ranks):
        np.testing.assert_array_equal(reduced, expected)
    assert np.all(expected.imag != 0)


@pytest.mark.usefixtures("world")
def test_second_derivatives_through_the_average_are_refused() -> None:
    ddp = cp.DistributedDataParallel(_model, _params())
    with cp.Tape() as outer:
        with cp.Tape() as inner:
            loss = ddp(X)
        with pytest.raises(NotImplementedError, match="cannot be differentiated again"):
            inner.gradient(loss, ddp.params)
    del outer


def test_import_cupy_parallel_does_not_import_distributed() -> None:
    code = (
        "import sys, cupy_parallel\n"
        "assert 'cupy_parallel._src.distributed' not in sys.modules\n"
        "cupy_parallel.DistributedDataParallel\n"
        "assert 'mpi4py' not in sys.modules\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False
    )
    assert done.returncode == 0, done.stderr


# -- CuPy arrays and NCCL (simulated CUDA, a world of one; several ranks need thread ranks) ----


def test_cupy_parameters_over_nccl_in_a_world_of_one() -> None:
    from cupy_parallel.testing import simulated_cuda

    with simulated_cuda(1) as cupy:
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
        try:
            params = {k: cupy.asarray(v) for k, v in _params().items() if k != "name"}
            x = cupy.asarray(X)
            for cap, hook in [(25.0, None), (1e-5, default_hooks.fp16_compress_hook)]:
                ddp = cp.DistributedDataParallel(_model, params, bucket_cap_mb=cap)
                if hook is not None:
                    ddp.register_comm_hook(None, hook)
                with cp.Tape() as tape:
                    loss = ddp(x)
                grads = tape.gradient(loss, ddp.params)
                expected = _plain_gradient({k: cupy.asnumpy(v) for k, v in params.items()})
                for k in ("w1", "w2"):
                    assert type(grads[k]) is type(params[k])
                    want = expected[k]
                    if hook is not None:
                        want = want.astype(np.float16).astype(np.float64)
                    np.testing.assert_allclose(cupy.asnumpy(grads[k]), want, rtol=1e-14, atol=0)
                reduced = ddp.reduce_gradients(grads)
                np.testing.assert_array_equal(
                    cupy.asnumpy(reduced["w1"]), cupy.asnumpy(grads["w1"])
                )
        finally:
            dist.destroy_process_group()


def test_the_fused_division_scales_cupy_gradients_while_copying() -> None:
    from cupy_parallel._src.ddp import _write
    from cupy_parallel.testing import simulated_cuda

    with simulated_cuda(1) as cupy:
        buffer = cupy.zeros(6)
        _write(buffer, 1, 5, cupy.asarray([[3.0, 6.0], [9.0, 12.0]]), 3)
        np.testing.assert_array_equal(cupy.asnumpy(buffer), [0, 1, 2, 3, 4, 0])
    host = np.zeros(4)
    _write(host, 0, 4, np.arange(4.0), 2)
    np.testing.assert_array_equal(host, [0, 0.5, 1, 1.5])
    # a division, rounded once: not a product with 1/3 rounded to the dtype first
    for dtype in (np.float16, np.float32):
        grad = np.linspace(0.5, 900.0, 2001).astype(dtype)
        out = np.zeros(grad.size, dtype)
        _write(out, 0, grad.size, grad, 3)
        exact = (grad.astype(np.float64) / 3).astype(dtype)
        np.testing.assert_array_equal(out, exact)


# -- threads -----------------------------------------------------------------------------------


@contextlib.contextmanager
def _switching_often() -> Iterator[None]:
    """Threads switch every microsecond: a check-then-act race shows in a few trials."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(interval)


def _stacked(params: list[Any], x: Any) -> Any:
    return ops.sum(ops.multiply(ops.stack(params), x))  # d/dp_i = x


def _one_ddp_in_two_threads(rank: int) -> list[float]:
    """Each rank: one DDP called from two threads (parallel_apply) under one tape."""
    ddp = cp.DistributedDataParallel(_stacked, [np.array(1.0) for _ in range(200)])
    x = np.array(rank + 1.0)
    with cp.Tape() as tape:
        first, second = cp.parallel_apply([ddp, ddp], [(x,), (x,)])
        loss = ops.add(first, second)
    return [float(g) for g in tape.gradient(loss, ddp.params)]


@pytest.mark.slow
def test_one_ddp_called_from_two_threads_under_one_tape_reduces_once() -> None:
    # the oracle: on one process, d(sum over ranks of loss_r)/dp_i / 2 = (2 * 1 + 2 * 2) / 2
    expected = [3.0] * 200
    with _switching_often():
        for trial in range(30):
            for rank, grads in enumerate(dist.spawn(_one_ddp_in_two_threads, 2, timeout=20)):
                assert grads == expected, f"trial {trial}, rank {rank}"


@pytest.mark.usefixtures("world")
def test_no_sync_blocks_of_two_threads_interleaved_leave_it_synchronising() -> None:
    calls: list[int] = []
    ddp = cp.DistributedDataParallel(_model, _params())
    ddp.register_comm_hook(None, _counting_hook(calls))
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()

    def first() -> None:
        with ddp.no_sync():
            first_in.set()
            second_in.wait(5)
        first_out.set()

    def second() -> None:
        first_in.wait(5)
        with ddp.no_sync():
            second_in.set()
            first_out.wait(5)
            with cp.Tape() as tape:  # the first block closed, this one is open: no reduction
                loss = ddp(X)
            tape.gradient(loss, ddp.params)

    threads = [threading.Thread(target=f) for f in (first, second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert calls == []
    # both blocks closed (the first one first); the local pass inside is not reduced: a warning
    unreduced = r"1 forward call\(s\) recorded inside no_sync"
    with pytest.warns(UserWarning, match=unreduced), cp.Tape() as tape:
        loss = ddp(X)
    grads = tape.gradient(loss, ddp.params)
    assert calls == [0]
    np.testing.assert_allclose(grads["w1"], _plain_gradient(_params())["w1"], rtol=1e-14)


@pytest.mark.usefixtures("world")
def test_two_passes_of_one_tape_at_once_in_two_threads_are_refused() -> None:
    entered, release = threading.Event(), threading.Event()

    def slow(state: Any, bucket: Any) -> Any:
        entered.set()
        release.wait(5)
        return default_hooks.allreduce_hook(state, bucket)

    ddp = cp.DistributedDataParallel(_model, _params())
    ddp.register_comm_hook(None, slow)
    with cp.Tape(persistent=True) as tape:
        loss = ddp(X)
    first: list[Any] = []
    thread = threading.Thread(
        target=contextvars.copy_context().run,
        args=(lambda: first.append(tape.gradient(loss, ddp.params)),),
    )
    thread.start()
    try:
        assert entered.wait(5)  # the first pass is reducing
        with pytest.raises(RuntimeError, match="Two backward passes of one tape ran at once"):
            tape.gradient(loss, ddp.params)
    finally:
        release.set()
        thread.join()
    expected = _plain_gradient(_params())  # the first pass is untouched
    for k in ("w1", "w2"):
        np.testing.assert_allclose(first[0][k], expected[k], rtol=1e-14, atol=0)


# -- where gradients live ----------------------------------------------------------------------


@contextlib.contextmanager
def _two_device_world(kind: str) -> Iterator[Any]:
    """A world of one whose arrays are ``kind`` (host or CuPy), with a second device of it."""
    if kind == "cupy":
        from cupy_parallel.testing import simulated_cuda

        with simulated_cuda(2):
            dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
            try:
                yield lambda x, index=0: cp.to_device(x, f"cuda:{index}")
            finally:
                dist.destroy_process_group()
        return
    cp.set_host_device_count(2)
    dist.init_process_group("mpi", world_size=1)
    try:
        yield lambda x, index=0: cp.to_device(x, f"host:{index}")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("kind", ["host", "cupy"])
@pytest.mark.parametrize(
    ("gradient", "error", "match"),
    [
        (
            lambda on, x: x,
            TypeError,
            (
                r"On rank 0: grads\['b'\] is a numpy.ndarray on cpu, but its parameter "
                r"params\['b'\] is a (HostArray on host|cupy.ndarray on cuda):0"
            ),
        ),
        (
            lambda on, x: on(x, 1),
            ValueError,
            (
                r"On rank 0: grads\['b'\] is on (host|cuda):1, but its parameter "
                r"params\['b'\] is on (host|cuda):0"
            ),
        ),
    ],
    ids=["numpy", "other-device"],
)
def test_reduce_gradients_refuses_a_gradient_of_another_type_or_device_first(
    kind: str, gradient: Any, error: type[Exception], match: str
) -> None:
    calls: list[int] = []
    with _two_device_world(kind) as on:
        params = {"a": on(np.ones(3)), "b": on(np.ones(2))}
        ddp = cp.DistributedDataParallel(lambda p, x: x, params, bucket_cap_mb=1e-6)
        ddp.register_comm_hook(None, _counting_hook(calls))
        with pytest.raises(error, match=match):
            ddp.reduce_gradients({"a": on(np.arange(3.0)), "b": gradient(on, np.arange(2.0))})
        assert calls == []  # refused before any bucket started
        reduced = ddp.reduce_gradients({"a": on(np.arange(3.0)), "b": on(np.arange(2.0))})
        assert calls == [0, 1]
        for k, n in [("a", 3), ("b", 2)]:  # a world of one: the average is the rank's own
            assert cp.device_of(reduced[k]) == cp.device_of(params[k])
            np.testing.assert_array_equal(cp.to_device(reduced[k], "cpu"), np.arange(float(n)))


@pytest.mark.parametrize(
    ("replacement", "error", "match"),
    [
        (np.ones(2), TypeError, r"of params\['w'\] is a numpy.ndarray on cpu, but the param"),
        (None, ValueError, r"of params\['w'\] is on host:1, but the parameter is on host:0"),
    ],
    ids=["numpy", "other-device"],
)
def test_the_backward_pass_refuses_a_gradient_of_another_type_or_device(
    replacement: Any, error: type[Exception], match: str
) -> None:
    with _two_device_world("host") as on:
        w = on(np.ones(2))
        ddp = cp.DistributedDataParallel(lambda p, x: ops.sum(ops.multiply(p["w"], x)), {"w": w})
        wrong = on(np.ones(2), 1) if replacement is None else replacement
        with cp.Tape() as tape:
            tape.watch(w)  # a hook of the user's, called first, gives DDP's the wrong array
            tape.register_gradient_ready_hook(w, lambda g: wrong)
            loss = ddp(on(np.ones(2)))
        with pytest.raises(error, match=match):
            tape.gradient(loss, ddp.params)


def test_replaced_params_must_stay_on_their_devices() -> None:
    with _two_device_world("host") as on:
        ddp = cp.DistributedDataParallel(lambda p, x: x, {"w": on(np.ones(2))})
        old = ddp.params
        with pytest.raises(ValueError, match=r"params\['w'\] is on host:1, not host:0"):
            ddp.params = {"w": on(np.ones(2), 1)}
        assert ddp.params is old


# -- replacing the parameters ------------------------------------------------------------------


def _scaled(params: dict[str, Any], x: Any) -> Any:
    return ops.sum(ops.multiply(ops.multiply(x, params["s"]), params["w"]))


@pytest.mark.usefixtures("world")
def test_a_0d_parameter_updated_the_functional_way_stays_an_array() -> None:
    ddp = cp.DistributedDataParallel(_scaled, {"s": np.array(2.0), "w": np.array([1.0, -3.0])})
    x = np.array([0.5, 4.0])
    oracle = {"s": np.array(2.0), "w": np.array([1.0, -3.0])}  # a plain tape, NumPy's update
    for _ in range(3):
        with cp.Tape() as tape:
            loss = ddp(x)
        grads = tape.gradient(loss, ddp.params)
        new = {k: ddp.params[k] - 0.1 * grads[k] for k in grads}  # the README's update
        assert type(new["s"]) is np.float64  # NumPy's arithmetic on 0-d arrays
        ddp.params = new
        with cp.Tape() as tape:
            tape.watch(oracle)
            loss = _scaled(oracle, x)
        expected = tape.gradient(loss, oracle)
        oracle = {k: np.asarray(oracle[k] - 0.1 * expected[k]) for k in oracle}
        assert type(ddp.params["s"]) is np.ndarray
        assert ddp.params["s"].shape == ()
        assert ddp.params["w"] is new["w"]
        for k in oracle:
            np.testing.assert_allclose(ddp.params[k], oracle[k], rtol=1e-15)


@pytest.mark.usefixtures("world")
@pytest.mark.parametrize(
    ("value", "match"),
    [
        (
            np.float32(2.0),
            (
                r"params\['s'\] is a NumPy float32 scalar np.float32\(2.0\) where the old "
                r"params had an array of shape \(\) and dtype float64: NumPy .* wrap it with "
                r"numpy.asarray \(of dtype float64\)"
            ),
        ),
        (2.0, r"params\['s'\] is a float 2.0 where the old params had an array of shape \(\)"),
    ],
    ids=["scalar-of-another-dtype", "float"],
)
def test_a_non_array_where_a_parameter_was_is_named(value: Any, match: str) -> None:
    if np.lib.NumpyVersion(np.__version__) < "2.0.0":
        match = match.replace(r"np.float32\(2.0\)", "2.0")
    ddp = cp.DistributedDataParallel(_scaled, {"s": np.array(2.0), "w": np.array([1.0, -3.0])})
    old = ddp.params
    with pytest.raises(ValueError, match=match):
        ddp.params = {"s": value, "w": np.zeros(2)}
    assert ddp.params is old


def _with_a_float_on_rank_one(rank: int) -> str:
    s = np.array(2.0) if rank == 0 else 2.0
    with pytest.raises(ValueError) as refused:
        cp.DistributedDataParallel(_scaled, {"s": s, "w": np.array([1.0, -3.0])})
    return str(refused.value)


def test_ranks_parameters_are_compared_by_name() -> None:
    for message in dist.spawn(_with_a_float_on_rank_one, 2):
        assert "(params['s']: shape () float64 ndarray/cpu vs no array)" in message, message


def _tied(params: dict[str, Any], x: Any) -> Any:
    hidden = ops.tanh(ops.add(ops.matmul(x, params["a"]), params["b"]))
    return ops.mean(ops.square(ops.matmul(hidden, params["c"])))


_TIED_RNG = np.random.default_rng(7)
_TIED_W, _TIED_B = _TIED_RNG.normal(size=(4, 4)), _TIED_RNG.normal(size=4)
_TIED_SHARDS = [[_TIED_RNG.normal(size=(3, 4)) for _ in range(2)] for _ in range(3)]  # step, rank


def _train_tied(rank: int) -> tuple[Any, str]:
    """Three SGD steps with ``a`` and ``c`` tied, kept tied; then the untying update."""
    w = _TIED_W.copy()
    ddp = cp.DistributedDataParallel(_tied, {"a": w, "b": _TIED_B.copy(), "c": w})
    for shards in _TIED_SHARDS:
        with cp.Tape() as tape:
            loss = ddp(shards[rank])
        grads = tape.gradient(loss, ddp.params)
        p = ddp.params
        untied = {k: p[k] - 0.1 * grads[k] for k in grads}  # the README's update
        with pytest.raises(ValueError) as refused:
            ddp.params = untied
        assert ddp.params is p
        w = p["a"] - 0.1 * grads["a"]  # once, at both leaves
        ddp.params = {"a": w, "b": untied["b"], "c": w}
    return ddp.params, str(refused.value)


def test_tied_weights_stay_tied_and_train_as_one_process() -> None:
    # the oracle: one process, one array w at both places, the whole batch's mean loss
    w, b = _TIED_W.copy(), _TIED_B.copy()
    for shards in _TIED_SHARDS:
        with cp.Tape() as tape:
            tape.watch((w, b))
            loss = _tied({"a": w, "b": b, "c": w}, np.concatenate(shards))
        gw, gb = tape.gradient(loss, (w, b))
        w, b = w - 0.1 * gw, b - 0.1 * gb
    for params, message in dist.spawn(_train_tied, 2):
        assert params["a"] is params["c"]
        np.testing.assert_allclose(params["a"], w, rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(params["b"], b, rtol=1e-12, atol=1e-14)
        assert message.startswith(
            "params['a'] and params['c'] were one array (tied weights), but the new params hold "
            "two different arrays there"
        ), message


@pytest.mark.usefixtures("world")
def test_a_tied_0d_parameter_updated_once_stays_tied() -> None:
    s = np.array(2.0)
    ddp = cp.DistributedDataParallel(
        lambda p, x: ops.sum(ops.multiply(ops.multiply(x, p["u"]), p["v"])), {"u": s, "v": s}
    )
    x = np.array([1.0, 3.0])
    with cp.Tape() as tape:
        loss = ddp(x)
    grads = tape.gradient(loss, ddp.params)
    np.testing.assert_allclose(grads["u"], 2 * 2.0 * 4.0, rtol=1e-15)  # d(4 s^2)/ds at s = 2
    new = ddp.params["u"] - 0.1 * grads["u"]  # a NumPy scalar, once
    ddp.params = {"u": new, "v": new}
    assert ddp.params["u"] is ddp.params["v"]
    np.testing.assert_allclose(ddp.params["u"], 2.0 - 0.1 * 16.0, rtol=1e-15)
    with pytest.raises(ValueError, match=r"params\['u'\] and params\['v'\] were one array"):
        ddp.params = {"u": np.asarray(new), "v": np.asarray(new)}
