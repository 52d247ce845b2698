"""The library's CUDA paths on the simulated CUDA (1, 2 and 4 GPUs), with every race reported.

``to_device`` (0-d, GPU to GPU after a producer on another stream, ``stream=``, GPU to CPU on
the array's own stream), ``parallel_apply``/``data_parallel`` with legacy and per-thread default
streams, the differentiable Functions' backward passes, and pinned staging buffers going back to
the pool. Values are checked against NumPy; the simulator checks the ordering.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
from helpers import DTYPES, assert_bits_equal, random_bits, stream_environment, to_numpy

from cupy_parallel import Device, Tape, comm, data_parallel, device_of, ops
from cupy_parallel._src.arrays import to_device
from cupy_parallel._src.cuda import pinned, streams
from cupy_parallel._src.parallel import parallel_apply
from cupy_parallel.functions import Broadcast, Gather, ReduceAddCoalesced, Scatter
from cupy_parallel.testing import simulated_cuda

if TYPE_CHECKING:
    from collections.abc import Iterator
    from types import ModuleType

GPU_COUNTS = [pytest.param((n, "legacy"), id=f"{n}gpu") for n in (1, 2, 4)] + [
    pytest.param((2, kind), id=f"2gpu-{kind}") for kind in ("non-blocking", "per-thread")
]


@pytest.fixture(params=GPU_COUNTS)
def cupy(request: pytest.FixtureRequest) -> Iterator[ModuleType]:
    """The simulated CUDA on 1, 2, 4 GPUs; two also off the legacy stream (issue 37)."""
    count, streams = request.param
    with stream_environment(streams), simulated_cuda(count) as module:
        yield module


@pytest.fixture(
    params=[(n, ptds) for n in (1, 2, 4) for ptds in (False, True)],
    ids=[f"{n}gpu-{'per-thread' if ptds else 'legacy'}" for n in (1, 2, 4) for ptds in (0, 1)],
)
def per_thread_cupy(request: pytest.FixtureRequest) -> Iterator[ModuleType]:
    """The simulated CUDA with legacy or per-thread default streams, on 1, 2 and 4 GPUs."""
    count, per_thread = request.param
    with simulated_cuda(count, per_thread_default_stream=per_thread) as module:
        yield module


def gpus(cupy: ModuleType, at_least: int = 1) -> list[Device]:
    """Every GPU, cycled so that there are at least ``at_least``."""
    count = cupy.cuda.runtime.getDeviceCount()
    return [Device("cuda", k % count) for k in range(max(at_least, count))]


def last_gpu(cupy: ModuleType) -> int:
    return cupy.cuda.runtime.getDeviceCount() - 1


# -- to_device -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_to_device_moves_0d_arrays_both_ways(cupy: ModuleType, dtype: Any) -> None:
    value = np.asarray(random_bits((), dtype))
    on_gpu = to_device(value, "cuda:0")
    assert on_gpu.shape == ()
    moved = to_device(on_gpu, f"cuda:{last_gpu(cupy)}")
    assert_bits_equal(to_device(moved, "cpu"), value)


def test_to_device_gpu_to_gpu_waits_for_the_producer_stream(cupy: ModuleType) -> None:
    target = last_gpu(cupy)
    expected = np.arange(12.0).reshape(3, 4)[:, ::2] * 3
    with cupy.cuda.Device(0):
        producer = cupy.cuda.Stream(non_blocking=True)
        producer.wait_event(cupy.cuda.Stream.null.record())
    with cupy.cuda.Device(0), producer:
        x = (cupy.arange(12.0).reshape(3, 4) * 3)[:, ::2]  # non-contiguous, on producer
        y = to_device(x, f"cuda:{target}")
        del x
        reused = cupy.zeros(12)  # the source's block, reused on the producer stream at once
        assert device_of(y) == Device("cuda", target)
        assert_bits_equal(to_device(y, "cpu"), expected)  # on cuda:target's current stream
        del reused


def test_to_device_on_a_given_stream_is_ordered_both_ways(cupy: ModuleType) -> None:
    device = last_gpu(cupy)
    with cupy.cuda.Device(device):
        copier = cupy.cuda.Stream(non_blocking=True)
        busy = cupy.arange(6.0)
        assert float(busy.sum()) == 15.0
        del busy  # its block goes to the next allocation on the current stream
        y = to_device(np.arange(6.0), f"cuda:{device}", stream=copier)
        doubled = y * 2  # on the current stream
    assert_bits_equal(to_device(doubled, "cpu"), np.arange(6.0) * 2)


def test_to_device_gpu_to_cpu_reads_on_the_arrays_device_stream(cupy: ModuleType) -> None:
    device = last_gpu(cupy)
    with cupy.cuda.Device(device):
        producer = cupy.cuda.Stream(non_blocking=True)
        producer.wait_event(cupy.cuda.Stream.null.record())
    with cupy.cuda.Device(device), producer:
        x = cupy.arange(5.0) + 1
        with cupy.cuda.Device(0):  # another current device; cuda:k's stream is still producer
            host = to_device(x, "cpu")
            assert isinstance(host, np.ndarray)
    assert_bits_equal(host, np.arange(5.0) + 1)


def test_to_device_to_cpu_on_a_given_stream_waits_for_the_current_stream(cupy: ModuleType) -> None:
    device = last_gpu(cupy)
    with cupy.cuda.Device(device):
        reader = cupy.cuda.Stream(non_blocking=True)
        x = cupy.arange(7.0) * 2  # on the current stream
        host = to_device(x, "cpu", stream=reader)
    assert_bits_equal(host, np.arange(7.0) * 2)


def test_to_device_checks_its_stream_before_copying() -> None:
    with simulated_cuda(2) as cupy:
        with cupy.cuda.Device(1):
            other = cupy.cuda.Stream()
        pool = cupy.get_default_pinned_memory_pool()
        with pytest.raises(
            TypeError, match=r"stream must be a cupy\.cuda\.Stream or None, got str"
        ):
            to_device(np.ones(2), "cuda:0", stream="s")
        with pytest.raises(
            ValueError, match=r"stream belongs to cuda:1, but this copy runs on cuda:0"
        ):
            to_device(np.ones(2), "cuda:0", stream=other)
        assert pool.n_free_blocks() == 0  # nothing was staged
        x = to_device(np.arange(3.0), "cuda:1", stream=other)
        assert_bits_equal(to_device(x, "cpu", stream=other), np.arange(3.0))


def test_scatter_from_a_gpu_on_explicit_streams_is_ordered_both_ways(cupy: ModuleType) -> None:
    targets = gpus(cupy, 2)  # one GPU: two copies on it; more: peer copies
    copy_streams = []
    for target in targets:
        with cupy.cuda.Device(target.index):
            copy_streams.append(cupy.cuda.Stream(non_blocking=True))
            busy = cupy.ones(6)
            busy.sum()  # a read still queued on the current stream (the host does not wait)
            del busy  # this block goes to the next allocation on the current stream
    with cupy.cuda.Device(0):
        x = cupy.arange(len(targets) * 6.0).reshape(-1, 2) + 1  # on the current stream
    parts = comm.scatter(x, targets, streams=copy_streams)
    for part, target in zip(parts, targets, strict=True):
        with cupy.cuda.Device(target.index):
            doubled = part * 2  # on the current stream: must see the copy
        assert device_of(doubled) == target
    expected = np.split((np.arange(len(targets) * 6.0).reshape(-1, 2) + 1), len(targets))
    for part, want in zip(parts, expected, strict=True):
        assert_bits_equal(to_device(part, "cpu"), want)


def test_scatter_into_outs_on_the_source_gpu_on_explicit_streams(cupy: ModuleType) -> None:
    device = last_gpu(cupy)
    with cupy.cuda.Device(device):
        x = cupy.arange(12.0).reshape(6, 2) + 1  # written on the current stream
        outs = [cupy.zeros((3, 2)) for _ in range(2)]  # written on the current stream
        copy_streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(2)]
    result = comm.scatter(x, streams=copy_streams, out=outs)  # same-GPU copies on the streams
    with cupy.cuda.Device(device):
        doubled = [o * 2 for o in result]  # on the current stream: must see the copies
    expected = np.arange(12.0).reshape(6, 2) + 1
    for got, want in zip(doubled, np.split(expected, 2), strict=True):
        assert_bits_equal(to_device(got, "cpu"), want * 2)


def test_comm_writes_into_noncontiguous_outs_on_gpus(cupy: ModuleType) -> None:
    targets = gpus(cupy, 2)
    x = random_bits((3, 4), np.int32)
    outs = []
    for target in targets:
        with cupy.cuda.Device(target.index):
            outs.append(cupy.zeros((4, 6), np.int32).T[::2])  # (3, 4), strided
    comm.broadcast(x, out=outs)  # one pinned staging buffer, uploads into strided outs
    for out in outs:
        assert_bits_equal(out, x)
    with cupy.cuda.Device(targets[-1].index):
        source = (cupy.arange(24, dtype=np.int32).reshape(4, 6) * 3).T[::2]
    comm.broadcast(source, out=outs)  # GPU to GPU (or same GPU) into strided outs
    for out in outs:
        assert_bits_equal(out, (np.arange(24, dtype=np.int32).reshape(4, 6) * 3).T[::2])
    with cupy.cuda.Device(0):
        joined = cupy.zeros((6, 2 * len(targets)), np.int32)[::2]  # (3, 2n), strided
    comm.gather([o[:, :2] for o in outs], 1, out=joined)
    expected = (np.arange(24, dtype=np.int32).reshape(4, 6) * 3).T[::2][:, :2]
    assert_bits_equal(joined, np.concatenate([expected] * len(targets), axis=1))
    host = np.zeros((6, 2 * len(targets)), np.int32)[::2]
    comm.gather([o[:, :2] for o in outs], 1, out=host)  # downloads into a strided host array
    assert_bits_equal(host, np.concatenate([expected] * len(targets), axis=1))


# -- parallel_apply and data_parallel ---------------------------------------------------------


def test_parallel_apply_orders_workers_after_scatter_and_before_gather(
    per_thread_cupy: ModuleType,
) -> None:
    targets = gpus(per_thread_cupy, 3)  # two replicas share a GPU: threads either way
    x = np.arange(36.0).reshape(9, 4)
    parts = comm.scatter(x, targets)

    def replica(a: Any) -> Any:
        return a * 2 + 1

    outs = parallel_apply([replica] * len(parts), parts, None, targets)
    assert_bits_equal(comm.gather(outs, 0, "cpu"), x * 2 + 1)
    assert_bits_equal(comm.gather(outs, 0, "cuda:0"), x * 2 + 1)


def test_parallel_apply_runs_on_the_callers_created_streams(cupy: ModuleType) -> None:
    targets = gpus(cupy, 2)
    created = {}
    for d in sorted({t.index for t in targets}):
        with cupy.cuda.Device(d):
            created[d] = cupy.cuda.Stream(non_blocking=True)
            created[d].use()

    def probe() -> int:
        return int(cupy.cuda.get_current_stream().ptr)

    seen = parallel_apply([probe] * len(targets), [()] * len(targets), None, targets)
    assert seen == [created[t.index].ptr for t in targets]


@pytest.mark.parametrize(
    ("dtype", "rtol"),
    [(np.float64, 1e-10), (np.float32, 1e-5), (np.float16, 2e-2)],
    ids=["float64", "float32", "float16"],
)
def test_data_parallel_gradients_match_numpy(
    per_thread_cupy: ModuleType, dtype: Any, rtol: float
) -> None:
    """float32 and float16 too: replicate's view() of the source replica kept float64 only."""
    rng = np.random.default_rng(0)
    w_host = rng.standard_normal((4, 3)).astype(dtype)
    x = rng.standard_normal((10, 4)).astype(dtype)
    w = to_device(w_host, "cuda:0")

    def model(params: Any, xb: Any) -> Any:
        return ops.tanh(ops.matmul(xb, params))

    with Tape() as tape:
        tape.watch(w)
        out = data_parallel(model, w, (x,), output_device="cpu")
        loss = ops.sum(ops.square(out))
    grad = tape.gradient(loss, w)
    assert out.dtype == dtype
    assert grad.dtype == dtype
    w64, x64 = w_host.astype(np.float64), x.astype(np.float64)  # the oracle in float64
    z = np.tanh(x64 @ w64)
    np.testing.assert_allclose(to_numpy(out), z, rtol=rtol, atol=rtol)
    expected = x64.T @ (2 * z * (1 - z**2))
    np.testing.assert_allclose(to_numpy(grad), expected, rtol=rtol, atol=rtol * abs(expected).max())


# -- the Functions' backward passes ----------------------------------------------------------


def test_scatter_gather_broadcast_reduce_gradients(cupy: ModuleType) -> None:
    targets = [str(d) for d in gpus(cupy)]
    x = random_bits((9, 3), np.int8).astype(np.float64)  # host input: background streams
    w_host = random_bits((3, 2), np.int8, 1).astype(np.float64)
    w = to_device(w_host, targets[0])
    with Tape() as tape:
        tape.watch((x, w))
        chunks = Scatter.apply(targets, None, 0, x)
        replicas = Broadcast.apply(targets[: len(chunks)], w)
        outs = [ops.matmul(c, r) for c, r in zip(chunks, replicas, strict=True)]
        loss = ops.sum(ops.square(Gather.apply("cpu", 0, *outs)))
    gx, gw = tape.gradient(loss, (x, w))
    assert device_of(gw) == Device("cuda", 0)
    r = x @ w_host
    np.testing.assert_allclose(gx, 2 * r @ w_host.T, rtol=1e-12)
    np.testing.assert_allclose(to_numpy(gw), 2 * x.T @ r, rtol=1e-12)


def test_broadcast_and_reduce_add_coalesced_gradients(cupy: ModuleType) -> None:
    targets = [str(d) for d in gpus(cupy, 2)]
    w_host = np.linspace(-1.0, 1.0, 6).reshape(2, 3)
    w = to_device(w_host, targets[0])
    with Tape() as tape:
        tape.watch(w)
        copies = Broadcast.apply(targets, w)
        total = ReduceAddCoalesced.apply(targets[-1], 1, *copies)[0]  # backward: GPU to GPU
        loss = ops.sum(ops.multiply(total, total))
    assert device_of(total) == Device("cuda", int(targets[-1][5:]))
    grad = tape.gradient(loss, w)
    assert device_of(grad) == Device("cuda", 0)
    np.testing.assert_allclose(to_numpy(grad), 2 * len(targets) ** 2 * w_host, rtol=1e-12)


# -- pinned staging buffers --------------------------------------------------------------------


def test_staging_buffers_return_to_the_pool_once_their_copies_finish(cupy: ModuleType) -> None:
    targets = gpus(cupy, 2)
    pool = cupy.get_default_pinned_memory_pool()
    comm.scatter(np.arange(64.0).reshape(8, 8), targets)
    for d in sorted({t.index for t in targets}):
        streams.background_stream(d).synchronize()
    # The copies are done: the next call into the staging code (here in_flight) drops the
    # buffers on this host thread, never inside a host function (a CUDA call when the pinned pool
    # is disabled).
    assert pinned.in_flight() == 0
    assert pool.n_free_blocks() == len(targets)


@pytest.mark.parametrize("pooled", [True, False], ids=["pinned pool", "pool disabled"])
def test_staging_never_frees_pinned_memory_inside_a_host_function(pooled: bool) -> None:
    """With set_pinned_memory_allocator(None), dropping pinned memory is cudaFreeHost, which
    CUDA forbids in host functions; the simulator reports it (the drop used to happen there)."""
    with simulated_cuda(2) as cupy:
        if not pooled:
            cupy.cuda.set_pinned_memory_allocator(None)
        for _ in range(3):  # the second and third scatters drop the first ones' buffers
            parts = comm.scatter(np.arange(8.0), ["cuda:0", "cuda:1"])
            for d in (0, 1):
                streams.background_stream(d).synchronize()
        np.testing.assert_array_equal(to_numpy(parts[1]), np.arange(4.0, 8.0))
        assert pinned.in_flight() == 0


def test_back_to_back_scatters_reuse_pinned_buffers_safely(cupy: ModuleType) -> None:
    targets = gpus(cupy, 2)
    pool = cupy.get_default_pinned_memory_pool()
    for step in range(50):
        x = random_bits((16, 4), np.float32, seed=step)
        parts = comm.scatter(x, targets)
        assert_bits_equal(comm.gather(parts, 0, "cpu"), x)  # the host waits for the copies
    assert pool.n_free_blocks() <= 2 * len(targets)  # reused, not one buffer per scatter


def test_reduce_add_of_every_dtype_on_peer_copies(cupy: ModuleType) -> None:
    targets = gpus(cupy, 3)
    for dtype in (np.int16, np.float32, np.complex128, np.uint8):
        values = [random_bits((3, 2), np.int8, seed=k).astype(dtype) for k in range(len(targets))]
        inputs = [to_device(v, d) for v, d in zip(values, targets, strict=True)]
        total = comm.reduce_add(inputs, destination=targets[-1])
        assert_bits_equal(total, functools.reduce(np.add, values))


def test_getitem_gradient_with_repeated_indices_on_a_gpu(cupy: ModuleType) -> None:
    """The backward of indexing scatters with ``add.at`` (the simulator lacked ``ufunc.at``)."""
    x = to_device(np.arange(4.0), "cuda:0")
    index = np.array([0, 0, 3, 0])  # a NumPy index array, as CuPy accepts
    with Tape() as tape:
        tape.watch(x)
        y = ops.sum(ops.getitem(x, index))
    grad = tape.gradient(y, x)
    assert device_of(grad) == Device("cuda", 0)
    np.testing.assert_array_equal(to_numpy(grad), np.bincount(index, minlength=4))
