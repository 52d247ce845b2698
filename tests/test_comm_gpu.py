"""cupy_parallel.comm's CUDA paths: pinned staging, stream ordering, peer copies, NCCL.

Every test runs on the simulated CUDA with 1, 2 and 4 GPUs (whose race checker fails a test on
any unordered access), and on the real GPUs (``gpu``-marked, skipped without one). With one GPU
the multi-device tests use it several times (``cuda:0`` twice), which still runs the staging,
local-copy and coalescing paths; the NCCL and peer-copy checks that need two distinct GPUs skip
below that.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
from helpers import assert_bits_equal, random_bits, stream_environment, to_numpy

from cupy_parallel import Device, comm, device_of, to_device
from cupy_parallel._src import comm_transfer as transfer
from cupy_parallel._src.cuda import copies, nccl_comm, nccl_runtime, pinned, streams
from cupy_parallel._src.devices import cuda_device_count
from cupy_parallel.testing import simulated_cuda

if TYPE_CHECKING:
    from collections.abc import Iterator
    from types import ModuleType


@pytest.fixture(
    params=[
        pytest.param((1, "legacy"), id="sim1"),
        pytest.param((2, "legacy"), id="sim2"),
        pytest.param((2, "non-blocking"), id="sim2-non-blocking"),
        pytest.param((2, "per-thread"), id="sim2-per-thread"),
        pytest.param((4, "legacy"), id="sim4"),
        pytest.param((0, "legacy"), id="gpu", marks=pytest.mark.gpu),
    ]
)
def cupy(request: pytest.FixtureRequest) -> Iterator[ModuleType]:
    """CuPy on the real GPUs (``gpu``), or the simulated CUDA with 1, 2 or 4 GPUs.

    Two GPUs also off the legacy stream: every thread on a non-blocking stream of its own, and
    per-thread default streams (conftest's ``stream_environment``).
    """
    count, streams = request.param
    if count == 0:
        yield pytest.importorskip("cupy")
        return
    with stream_environment(streams), simulated_cuda(count) as module:
        yield module


def targets(at_least: int = 2) -> list[Device]:
    """Every GPU, cycled so that there are at least ``at_least`` targets."""
    count = cuda_device_count()
    return [Device("cuda", k % count) for k in range(max(at_least, count))]


def distinct_gpus(n: int = 2) -> list[Device]:
    if cuda_device_count() < n:
        pytest.skip(f"needs {n} GPUs")
    return [Device("cuda", k) for k in range(n)]


def synchronize_all(cupy: ModuleType) -> None:
    for k in range(cuda_device_count()):
        with cupy.cuda.Device(k):
            cupy.cuda.get_current_stream().synchronize()
            streams.background_stream(k).synchronize()


def test_scatter_from_numpy_stages_through_pinned_memory_and_orders_streams(
    cupy: ModuleType,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    staged = []

    def spy(shape: tuple[int, ...], dtype: Any) -> Any:
        staged.append(shape)
        return pinned.staging_array(shape, dtype)

    monkeypatch.setattr(copies, "staging_array", spy)
    x = random_bits((1 << 18, 8), np.float32)  # 8 MiB: the copies take long enough to race
    devices = targets(4)
    parts = comm.scatter(x, devices)
    # No explicit synchronization: work queued on each current stream must see the copy.
    flipped = []
    for part, device in zip(parts, devices, strict=True):
        assert device_of(part) == device
        with cupy.cuda.Device(device.index):
            flipped.append(part.view(np.uint32) ^ np.uint32(0xFFFFFFFF))
    chunks = np.array_split(x, len(devices))
    assert staged == [c.shape for c in chunks]
    for got, want in zip(flipped, chunks, strict=True):
        assert to_numpy(got).tobytes() == (want.view(np.uint32) ^ np.uint32(0xFFFFFFFF)).tobytes()
    synchronize_all(cupy)
    assert pinned.in_flight() == 0


@pytest.mark.parametrize("dtype", [np.bool_, np.int16, np.uint64, np.float16, np.complex128])
def test_scatter_gather_round_trip_on_gpus(cupy: ModuleType, dtype: Any) -> None:
    x = random_bits((9, 5), dtype)[:, ::2]  # non-contiguous source
    parts = comm.scatter(x, targets(3)[:3], dim=1, chunk_sizes=[0, 2, 1])
    for part, want in zip(parts, np.split(x, [0, 2], axis=1), strict=True):
        assert_bits_equal(part, want)
    assert_bits_equal(comm.gather(parts, 1, "cpu"), x)
    on_gpu = comm.gather(parts, -1, "cuda:0")
    assert device_of(on_gpu) == Device("cuda", 0)
    assert_bits_equal(on_gpu, x)
    assert_bits_equal(comm.gather(parts, 1, "host:1"), x)


def test_scatter_on_explicit_streams_into_noncontiguous_out(cupy: ModuleType) -> None:
    devices = targets(2)[:2]
    copy_streams = []
    for device in devices:
        with cupy.cuda.Device(device.index):
            copy_streams.append(cupy.cuda.Stream(non_blocking=True))
    outs = []
    for device in devices:
        with cupy.cuda.Device(device.index):
            outs.append(cupy.zeros((4, 6), np.float64)[:, ::2])
    x = np.arange(24.0).reshape(8, 3)
    result = comm.scatter(x, dim=0, streams=copy_streams, out=outs)
    assert all(r is o for r, o in zip(result, outs, strict=True))
    assert_bits_equal(outs[0], x[:4])
    assert_bits_equal(outs[1], x[4:])


def test_scatter_refuses_a_stream_of_another_gpu(cupy: ModuleType) -> None:
    first, second = distinct_gpus(2)
    with cupy.cuda.Device(second.index):
        wrong = cupy.cuda.Stream()
    with pytest.raises(ValueError, match=r"streams\[0\] belongs to cuda:1, but device 0 is cuda:0"):
        comm.scatter(np.arange(4.0), [first, second], streams=[wrong, None])


def test_gather_uses_peer_copies_between_gpus(cupy: ModuleType) -> None:
    first, second = distinct_gpus(2)
    x = random_bits((6, 4), np.int32)
    with cupy.cuda.Device(second.index):
        piece = cupy.asarray(x[3:]).T.copy().T  # Fortran order on the second GPU
    with cupy.cuda.Device(first.index):
        head = cupy.asarray(x[:3])
    out = comm.gather([head, piece], 0, first)
    assert device_of(out) == first
    assert_bits_equal(out, x)
    assert_bits_equal(comm.gather([piece, head], 0, second), np.concatenate([x[3:], x[:3]]))


def test_broadcast_from_numpy_stages_once(
    cupy: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []
    monkeypatch.setattr(
        transfer,
        "staging_array",
        lambda shape, dtype: calls.append(shape) or pinned.staging_array(shape, dtype),
    )
    x = random_bits((1000,), np.complex64)
    copies = comm.broadcast(x, targets(3))
    assert calls == [x.shape]
    for c in copies:
        assert_bits_equal(c, x)


def test_broadcast_from_a_gpu_returns_the_source_and_copies_elsewhere(cupy: ModuleType) -> None:
    devices = sorted(set(targets(2)), key=lambda d: d.index)
    with cupy.cuda.Device(0):
        x = cupy.asarray(random_bits((5, 7), np.float16))
    copies = comm.broadcast(x, devices)
    assert copies[0] is x
    for copy, device in zip(copies, devices, strict=True):
        assert device_of(copy) == device
        assert to_numpy(copy).tobytes() == to_numpy(x).tobytes()


def test_nccl_broadcast_and_reduce_match_numpy(cupy: ModuleType) -> None:
    if not nccl_runtime.is_available():
        pytest.skip("NCCL is not available")
    gpus = distinct_gpus(2)
    values = [np.arange(12, dtype=np.float32).reshape(3, 4) * (k + 1) for k in range(len(gpus))]
    inputs = [to_device(v, d) for v, d in zip(values, gpus, strict=True)]
    outs = [to_device(np.zeros((3, 4), np.float32), d) for d in gpus[1:]]
    assert nccl_comm.broadcast_into(inputs[0], outs)
    for out in outs:
        assert_bits_equal(out, values[0])
    assert nccl_comm.can_reduce(inputs, gpus[1])
    total = comm.reduce_add(inputs, destination=gpus[1])
    assert device_of(total) == gpus[1]
    assert_bits_equal(total, functools.reduce(np.add, values))  # small integers: exact


def test_reduce_add_falls_back_to_copies_for_dtypes_nccl_lacks(cupy: ModuleType) -> None:
    values = [random_bits((4, 4), np.int16, seed=k) for k in range(3)]
    devices = targets(3)[:3]
    inputs = [to_device(v, d) for v, d in zip(values, devices, strict=True)]
    assert not nccl_comm.can_reduce(inputs, devices[0])
    total = comm.reduce_add(inputs, destination=devices[0])
    assert_bits_equal(total, functools.reduce(np.add, values))


def test_coalesced_broadcast_and_reduce_on_gpus(cupy: ModuleType) -> None:
    devices = targets(3)
    arrays = [
        random_bits((3, 5), np.float32, 1),
        random_bits((7,), np.int8, 2),
        random_bits((2, 2, 2), np.float32, 3).transpose(2, 0, 1),
        random_bits((0, 4), np.bool_, 4),
        random_bits((40,), np.float32, 5),
    ]
    sources = [to_device(np.ascontiguousarray(a), devices[0]) for a in arrays]
    result = comm.broadcast_coalesced(sources, devices, buffer_size=64)  # smaller than arrays
    assert all(a is b for a, b in zip(result[0], sources, strict=True))
    for replica, device in zip(result[1:], devices[1:], strict=True):
        for got, want in zip(replica, arrays, strict=True):
            assert device_of(got) == device
            assert_bits_equal(got, np.ascontiguousarray(want))

    rng = np.random.default_rng(0)
    lists = [
        [rng.integers(-50, 50, a.shape).astype(a.dtype) for a in arrays if a.dtype != np.bool_]
        for _ in devices
    ]
    inputs = [[to_device(x, d) for x in xs] for xs, d in zip(lists, devices, strict=True)]
    sums = comm.reduce_add_coalesced(inputs, devices[-1], buffer_size=64)
    for j, got in enumerate(sums):
        assert device_of(got) == devices[-1]
        assert_bits_equal(got, functools.reduce(np.add, [xs[j] for xs in lists]))


def test_comms_nccl_communicators_are_destroyed_with_the_simulation() -> None:
    """The cached initAll communicators are destroyed (at exit, and when a simulated CUDA ends):
    the next simulation makes its own instead of reusing the dead one's."""
    made = []
    for _ in range(2):
        with simulated_cuda(2) as cupy:
            x = to_device(np.arange(4.0), "cuda:0")
            outs = comm.broadcast(x, ["cuda:0", "cuda:1"])
            np.testing.assert_array_equal(outs[1].get(), np.arange(4.0))
            made.append(list(nccl_comm._communicators.values()))
            assert made[-1], "comm used NCCL"
            assert cupy.cuda.nccl is not None
        assert len(nccl_comm._communicators) == 0
    first, second = (sorted(id(c) for comms in m for c in comms) for m in made)
    assert not set(first) & set(second)
    assert all(c._destroyed for comms in made[0] for c in comms)


def test_overlapping_outs_on_another_gpu_are_refused_from_any_current_device() -> None:
    """The overlap test of outs runs CuPy's shares_memory kernels on the outs' GPU, not on the
    current one (where CuPy refuses another GPU's arrays without peer access)."""
    with simulated_cuda(2) as cupy:
        with cupy.cuda.Device(1):
            buffer = cupy.zeros(6)
        disjoint = [buffer[:3], buffer[3:]]
        overlapping = [buffer[:3], buffer[2:5]]  # sizes sum to 6, element 2 twice
        x = np.arange(6.0)
        with cupy.cuda.Device(0):  # the current device is not the outs'
            comm.scatter(x, out=disjoint)
            with pytest.raises(ValueError, match=r"share memory"):
                comm.scatter(x, out=overlapping)
        np.testing.assert_array_equal(buffer.get(), x)
