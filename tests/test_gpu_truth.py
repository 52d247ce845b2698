"""GPU truth, third pass: what real CUDA would show, caught by the simulator (issue 37).

Each test places work where only a real GPU would go wrong (parameters off the current GPU, a
caller's stream that is not the legacy null stream, device buffers handed to an MPI library, a
batch of sends and receives that must progress together) and runs under ``simulated_cuda`` with
its race checker on, so the unordered, wrongly placed or deadlocking schedule raises there.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from typing import Any

import numpy as np
import pytest

from cupy_parallel import distributed as dist
from cupy_parallel.testing import simulated_cuda

# ---------------------------------------------------------------------------------------------
# batch_isend_irecv over NCCL: one group for the whole list


def _exchange(cupy: Any, rank: int, peers: list[tuple[str, int]]) -> list[np.ndarray]:
    """Rank ``rank`` sends ``10 * rank + peer`` to each send peer and receives from the others."""
    ops, received = [], []
    for kind, peer in peers:
        if kind == "send":
            payload = cupy.full(3 + peer, 10 * rank + peer, np.int32)
            ops.append(dist.P2POp(dist.isend, payload, peer))
        else:
            buffer = cupy.zeros(3 + rank, np.int32)
            received.append((peer, buffer))
            ops.append(dist.P2POp(dist.irecv, buffer, peer))
    works = dist.batch_isend_irecv(ops)
    assert len(works) == len(ops)
    for work in works:
        work.wait()
    return [cupy.asnumpy(buffer) for _, buffer in received]


def _expected(rank: int, peers: list[tuple[str, int]]) -> list[np.ndarray]:
    return [np.full(3 + rank, 10 * p + rank, np.int32) for kind, p in peers if kind == "recv"]


def _pairwise(rank: int, size: int) -> list[tuple[str, int]]:
    peer = 1 - rank
    return [("send", peer), ("recv", peer)]


def _ring(rank: int, size: int) -> list[tuple[str, int]]:
    return [("send", (rank + 1) % size), ("recv", (rank - 1) % size)]


def _mixed(rank: int, size: int) -> list[tuple[str, int]]:
    # every rank receives from all others first, then sends to all others (reverse order)
    others = [r for r in range(size) if r != rank]
    return [("recv", r) for r in others] + [("send", r) for r in reversed(others)]


@pytest.mark.parametrize(
    ("pattern", "size"),
    [(_pairwise, 2), (_ring, 2), (_ring, 3), (_ring, 4), (_mixed, 3)],
    ids=["pairwise-2", "ring-2", "ring-3", "ring-4", "mixed-3"],
)
def test_sim_batch_isend_irecv_over_nccl_launches_one_group(pattern: Any, size: int) -> None:
    with simulated_cuda(size) as cupy:

        def program(rank: int) -> list[np.ndarray]:
            return _exchange(cupy, rank, pattern(rank, size))

        results = dist.spawn(program, size, backend="nccl", timeout=5)
    for rank, got in enumerate(results):
        want = _expected(rank, pattern(rank, size))
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(g, w)


def test_sim_nccl_groups_are_no_stricter_than_nccl() -> None:
    """Separate sends and receives posted in matching order complete, as NCCL's do."""
    with simulated_cuda(2) as cupy:

        def program(rank: int) -> np.ndarray:
            mine = cupy.full(4, rank + 1, np.float32)
            theirs = cupy.zeros(4, np.float32)
            if rank == 0:  # send first, then receive; rank 1 the reverse: each call matches
                dist.isend(mine, 1).wait()
                dist.irecv(theirs, 1).wait()
            else:
                dist.irecv(theirs, 0).wait()
                dist.isend(mine, 0).wait()
            return cupy.asnumpy(theirs)

        results = dist.spawn(program, 2, backend="nccl", timeout=5)
    np.testing.assert_array_equal(results[0], np.full(4, 2, np.float32))
    np.testing.assert_array_equal(results[1], np.full(4, 1, np.float32))


def test_sim_batch_over_nccl_refuses_tensors_on_two_gpus() -> None:
    with simulated_cuda(2) as cupy:

        def program(rank: int) -> str:
            with cupy.cuda.Device(1 - rank):
                other = cupy.zeros(2, np.float32)
            ops = [
                dist.P2POp(dist.isend, cupy.zeros(2, np.float32), 1 - rank),
                dist.P2POp(dist.irecv, other, 1 - rank),
            ]
            with pytest.raises(ValueError, match="one NCCL group on one GPU") as refused:
                dist.batch_isend_irecv(ops)
            return str(refused.value)

        messages = dist.spawn(program, 2, backend="nccl", timeout=5)
    assert messages[0] == (
        "batch_isend_irecv over NCCL issues its operations in one NCCL group on one GPU: "
        "p2p_op_list[1].tensor is on GPU 1, p2p_op_list[0].tensor on GPU 0."
    )


# ---------------------------------------------------------------------------------------------
# DDP: hooks and bucket copies on the bucket's GPU, not the thread's current one

HOOKS = [None, "fp16", "bf16"]
# where rank r's two parameters live (its current GPU is r): off the current GPU, or on two GPUs
LAYOUTS = {"off-current": lambda r: (r + 2, r + 2), "two-gpus": lambda r: (r + 2, r)}


def _ddp_grads(rank: int) -> list[np.ndarray]:
    rng = np.random.default_rng(rank)
    return [rng.normal(size=(4, 3)).astype(np.float32), rng.normal(size=5).astype(np.float32)]


def _ddp_oracle(hook: str | None, size: int = 2) -> list[np.ndarray]:
    grads = [_ddp_grads(r) for r in range(size)]
    out = []
    for k in range(2):
        values = [g[k] for g in grads]
        if hook is None:  # divided as copied, then summed (two addends: exact in any order)
            out.append(sum(v / np.float32(size) for v in values).astype(np.float32))
        else:  # torch's compress hooks: cast, divide in the narrow type, sum, cast back
            narrow = np.float16 if hook == "fp16" else _bfloat16()
            parts = [v.astype(narrow) / np.array(size, narrow) for v in values]
            out.append(sum(parts).astype(narrow).astype(np.float32))
    return out


def _bfloat16() -> Any:
    return np.dtype(pytest.importorskip("ml_dtypes").bfloat16)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("hook", HOOKS, ids=lambda h: h or "default")
def test_sim_ddp_reduces_buckets_on_their_own_gpu(layout: str, hook: str | None) -> None:
    import cupy_parallel as cp
    from cupy_parallel.distributed.algorithms.ddp_comm_hooks import default_hooks

    expected = _ddp_oracle(hook)
    hooks = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}
    with simulated_cuda(4) as cupy:

        def program(rank: int) -> list[np.ndarray]:
            assert cupy.cuda.Device().id == rank
            devices = LAYOUTS[layout](rank)
            params = []
            for device, g in zip(devices, _ddp_grads(rank), strict=True):
                with cupy.cuda.Device(device):
                    params.append(cupy.zeros(g.shape, np.float32))
            ddp = cp.DistributedDataParallel(lambda p, x: x, params)
            if hook is not None:
                ddp.register_comm_hook(None, hooks[hook])
            grads = []
            for device, g in zip(devices, _ddp_grads(rank), strict=True):
                with cupy.cuda.Device(device):  # strided views: a transpose, every other one
                    grads.append(
                        cupy.asarray(g.T.copy()).T
                        if g.ndim == 2
                        else cupy.asarray(g.repeat(2))[::2]
                    )
            assert not any(g.flags.c_contiguous for g in grads)
            reduced = ddp.reduce_gradients(grads)
            out = []
            for device, r in zip(devices, reduced, strict=True):
                assert r.device.id == device
                with r.device:
                    out.append(cupy.asnumpy(r))
            return out

        results = dist.spawn(program, 2, backend="nccl", timeout=10)
    for got in results:
        for g, w in zip(got, expected, strict=True):
            np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("hook", [None, "fp16"], ids=lambda h: h or "default")
def test_sim_ddp_tape_hooks_reduce_on_the_parameters_gpu(hook: str | None) -> None:
    """The tape's gradient-ready hooks run outside the node's device: DDP enters the bucket's."""
    import cupy_parallel as cp
    from cupy_parallel import ops
    from cupy_parallel.distributed.algorithms.ddp_comm_hooks import default_hooks

    coefficients = [np.arange(1.0, 7.0, dtype=np.float32) * (r + 1) for r in range(2)]
    with simulated_cuda(4) as cupy:

        def program(rank: int) -> np.ndarray:
            with cupy.cuda.Device(rank + 2):
                w = cupy.zeros(6, np.float32)
                c = cupy.asarray(coefficients[rank])
            ddp = cp.DistributedDataParallel(lambda p, x: ops.sum(ops.multiply(p, x)), w)
            if hook is not None:
                ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
            with cp.Tape() as tape, w.device:  # the forward on the parameter's GPU
                loss = ddp(c)
            grad = tape.gradient(loss, ddp.params)  # the backward (and its hooks) from GPU r
            assert grad.device.id == rank + 2
            with grad.device:
                return cupy.asnumpy(grad)

        results = dist.spawn(program, 2, backend="nccl", timeout=10)
    if hook is None:
        expected = (coefficients[0] + coefficients[1]) / np.float32(2)
    else:
        half = [c.astype(np.float16) / np.float16(2) for c in coefficients]
        expected = (half[0] + half[1]).astype(np.float32)
    for got in results:
        np.testing.assert_array_equal(got, expected)


# ---------------------------------------------------------------------------------------------
# Work.get_future(): the caller's current stream waits, as on torch's CUDA futures

STREAMS = ["nonblocking", "ptds"]


def _caller_stream(cupy: Any, kind: str) -> Any:
    """The caller's current stream for a test: a non-blocking one, or the per-thread default."""
    return (
        cupy.cuda.Stream(non_blocking=True) if kind == "nonblocking" else contextlib.nullcontext()
    )


def _values(rank: int, dtype: Any = np.float32) -> np.ndarray:
    return (np.arange(6, dtype=np.float64) * 0.25 + rank + 1).astype(dtype)


@pytest.mark.parametrize("streams", STREAMS)
def test_sim_nccl_future_orders_the_callers_stream(streams: str) -> None:
    total = _values(0) + _values(1)
    with simulated_cuda(2, per_thread_default_stream=streams == "ptds") as cupy:

        def program(rank: int) -> tuple[np.ndarray, ...]:
            with _caller_stream(cupy, streams):
                x = cupy.asarray(_values(rank))
                future = dist.all_reduce(x, async_op=True).get_future()
                box: list[Any] = []  # the callback's array, read later without value()
                doubled = future.then(lambda f: box.append(f.value()[0] * 2) or box[0])
                while not (future.done() and doubled.done()):
                    time.sleep(0.001)
                # done: a callback given now runs at once, in this thread (its stream waits)
                quadrupled = doubled.then(lambda _: box[0] * 2).wait()
                # done: a callback given now runs at once, in this thread, reading x directly
                with cupy.cuda.Stream(non_blocking=True):  # and on another stream
                    tripled = cupy.asnumpy(future.then(lambda _: x * 3).wait())
                waited = future.wait()[0] + 0  # a kernel on the caller's stream reads it
                value = doubled.wait() + 0
                result = future.result()[0] + 0
                return (
                    cupy.asnumpy(waited),
                    cupy.asnumpy(value),
                    cupy.asnumpy(result),
                    tripled,
                    cupy.asnumpy(quadrupled),
                )

        results = dist.spawn(program, 2, backend="nccl", timeout=10)
    for waited, value, result, tripled, quadrupled in results:
        np.testing.assert_array_equal(quadrupled, 4 * total)
        np.testing.assert_array_equal(tripled, 3 * total)
        np.testing.assert_array_equal(waited, total)
        np.testing.assert_array_equal(value, 2 * total)
        np.testing.assert_array_equal(result, total)


@pytest.mark.parametrize("streams", STREAMS)
def test_sim_ddp_hook_returning_get_future_then(streams: str) -> None:
    """DDP's documented hook pattern: ``work.get_future().then(...)``."""
    import cupy_parallel as cp

    grads = [_values(r) for r in range(2)]

    def hook(state: Any, bucket: Any) -> Any:
        work = dist.all_reduce(bucket.buffer(), async_op=True)
        return work.get_future().then(lambda f: f.value()[0] / 2)

    with simulated_cuda(2, per_thread_default_stream=streams == "ptds") as cupy:

        def program(rank: int) -> np.ndarray:
            with _caller_stream(cupy, streams):
                ddp = cp.DistributedDataParallel(lambda p, x: x, cupy.zeros(6, np.float32))
                ddp.register_comm_hook(None, hook)
                reduced = ddp.reduce_gradients(cupy.asarray(grads[rank]))
                return cupy.asnumpy(reduced + 0)

        results = dist.spawn(program, 2, backend="nccl", timeout=10)
    for got in results:
        np.testing.assert_array_equal(got, (grads[0] + grads[1]) / np.float32(2))


@pytest.mark.parametrize("aware", ["staged", "cuda-aware"])
@pytest.mark.parametrize("streams", STREAMS)
def test_sim_mpi_future_of_cupy_arrays_orders_the_callers_stream(
    monkeypatch: pytest.MonkeyPatch, streams: str, aware: str
) -> None:
    """float16 over MPI: summed in float32, cast back by the finalizers (staged or on device).

    CUDA-aware: an MPICH, which takes the reduction on device memory (its temporaries too).
    """
    from cupy_parallel._src.simcuda import sim_mpi

    monkeypatch.setenv("CUPY_PARALLEL_MPI_CUDA_AWARE", "1" if aware == "cuda-aware" else "0")
    total = (_values(0, np.float16).astype(np.float32) + _values(1, np.float16)).astype(np.float16)
    previous = sim_mpi.emulate("mpich")
    with contextlib.ExitStack() as restore:
        restore.callback(sim_mpi.emulate, previous)
        results = _mpi_future_program(streams)
    for waited, chained in results:
        np.testing.assert_array_equal(waited, total)
        np.testing.assert_array_equal(chained, total + np.float16(1))


def _mpi_future_program(streams: str) -> list[Any]:
    total = (_values(0, np.float16).astype(np.float32) + _values(1, np.float16)).astype(np.float16)
    with simulated_cuda(2, per_thread_default_stream=streams == "ptds") as cupy:

        def program(rank: int) -> tuple[np.ndarray, np.ndarray]:
            cupy.cuda.Device(rank).use()
            with _caller_stream(cupy, streams):
                x = cupy.asarray(_values(rank, np.float16))
                future = dist.all_reduce(x, async_op=True).get_future()
                chained = future.then(lambda f: f.value()[0] + 1)
                while not future.done():  # the helper finished on the host ...
                    time.sleep(0.001)
                # ... and the temporaries it freed must not be reused under its pending copies
                scratch = [cupy.full(6, 7, dtype) for dtype in ("f2", "f4", "f8") for _ in "ab"]
                late = future.then(lambda _: x + 2).wait()  # runs here, reading x directly
                waited = future.wait()[0] + 0
                assert all(int(s[0]) == 7 for s in scratch)
                np.testing.assert_array_equal(cupy.asnumpy(late), total + np.float16(2))
                return cupy.asnumpy(waited), cupy.asnumpy(chained.wait() + 0)

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # the one-time staging warning
            return dist.spawn(program, 2, timeout=10)


# ---------------------------------------------------------------------------------------------
# The suites off the legacy stream: the fixture's streams are what it says


def test_sim_stream_kinds_of_the_fixture(simulated_streams: str) -> None:
    """Two threads' current streams: shared (legacy) or each its own, unordered (the others)."""
    import threading

    from cupy_parallel.testing import RaceError

    with simulated_cuda(1) as cupy:
        x = cupy.zeros(4, np.float32)
        x += 1  # queued on this thread's current stream, not waited for
        mine = cupy.cuda.get_current_stream()
        seen: list[Any] = []

        def other() -> None:
            seen.append(cupy.cuda.get_current_stream())
            try:
                seen.append(cupy.asnumpy(x * 2))
            except RaceError as error:
                seen.append(error)

        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
        theirs, outcome = seen
        if simulated_streams == "legacy":
            assert mine == theirs == cupy.cuda.Stream.null
            np.testing.assert_array_equal(outcome, np.full(4, 2, np.float32))
        else:
            if simulated_streams == "non-blocking":
                assert mine.is_non_blocking
                assert theirs.is_non_blocking
                assert mine != theirs
            else:
                assert mine == theirs == cupy.cuda.Stream.ptds  # one handle, a stream per thread
            assert isinstance(outcome, RaceError)
        cupy.cuda.Device().synchronize()
