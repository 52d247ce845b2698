"""The simulated CUDA itself: CUDA's ordering rules, CuPy's pool rule, and the race reports.

Each ordering rule is tested both ways: a program that relies on it runs clean, and the same
program without the ordering raises ``RaceError`` naming both operations and their streams.
"""

from __future__ import annotations

import ctypes
import threading
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

import cupy_parallel
from cupy_parallel._src.devices import cupy_module
from cupy_parallel._src.simcuda import SimulationError, sim_nccl
from cupy_parallel.testing import RaceError, simulated_cuda

if TYPE_CHECKING:
    from types import ModuleType


@pytest.fixture
def cupy() -> Any:
    with simulated_cuda(2) as module:
        yield module


def ready(cupy: ModuleType, x: Any) -> Any:
    """``x`` after the host waited for every stream (a clean start for ordering tests)."""
    cupy.cuda.Device(x.device.id).synchronize()
    return x


# -- streams and events ------------------------------------------------------------------------


def test_unordered_streams_race_and_the_error_names_both(cupy: ModuleType) -> None:
    x = ready(cupy, cupy.arange(4.0))
    writer, reader = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    with writer:
        x += 1
    with (
        reader,
        pytest.raises(
            RaceError,
            match=r"read by `kernel operator mul on stream .*non-blocking.*"
            r"write by `kernel operator add on stream",
        ),
    ):
        x * 2


# Every way a kernel writes into an existing array: (name, the write on `x` reading `y`).
WRITERS = {
    "copyto": lambda cp, x, y: cp.copyto(x, y),
    "ufunc out= keyword": lambda cp, x, y: cp.add(y, 1, out=x),
    "ufunc out positional": lambda cp, x, y: cp.add(y, 1, x),
    "numpy ufunc out=": lambda cp, x, y: np.multiply(y, 2, out=x),
    "ufunc.at": lambda cp, x, y: cp.add.at(x, cp.asarray([0, 0, 1]), y[:3]),
    "put": lambda cp, x, y: cp.put(x, cp.asarray([1, 2]), y[:2]),
    "putmask": lambda cp, x, y: cp.putmask(x, y > 1, y),
    "fill_diagonal": lambda cp, x, y: cp.fill_diagonal(x.reshape(2, 2), y[0]),
    "ndarray.put": lambda cp, x, y: x.put(cp.asarray([0]), y[:1]),
    "setitem": lambda cp, x, y: x.__setitem__(slice(None), y),
    "clip out positional": lambda cp, x, y: cp.clip(y, 1, 2, x),
    "cumsum out positional": lambda cp, x, y: cp.cumsum(y, 0, None, x),
    "ndarray.clip out positional": lambda cp, x, y: y.clip(1, 2, x),
}


@pytest.mark.parametrize("write", list(WRITERS.values()), ids=list(WRITERS))
def test_every_kind_of_write_races_with_an_unordered_read(cupy: ModuleType, write: Any) -> None:
    x, y = ready(cupy, cupy.arange(4.0)), ready(cupy, cupy.arange(4.0))
    writer, reader = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    with writer:
        write(cupy, x, y)
    with reader, pytest.raises(RaceError, match=r"read by `kernel .* write by `kernel"):
        x * 2  # read after write


@pytest.mark.parametrize("write", list(WRITERS.values()), ids=list(WRITERS))
def test_every_kind_of_write_races_with_an_unordered_earlier_read(
    cupy: ModuleType, write: Any
) -> None:
    x, y = ready(cupy, cupy.arange(4.0)), ready(cupy, cupy.arange(4.0))
    writer, reader = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    with reader:
        x * 2
    with writer, pytest.raises(RaceError, match=r"write by `kernel .* read by `kernel"):
        write(cupy, x, y)  # write after read


@pytest.mark.parametrize("write", list(WRITERS.values()), ids=list(WRITERS))
def test_every_kind_of_write_computes_numpys_answer(cupy: ModuleType, write: Any) -> None:
    x, y = cupy.arange(4.0), cupy.arange(4.0) + 1
    a, b = np.arange(4.0), np.arange(4.0) + 1
    write(cupy, x, y)
    write(np, a, b)
    np.testing.assert_array_equal(x.get(), a)


def test_ufunc_at_accumulates_repeated_indices_as_cupy(cupy: ModuleType) -> None:
    x = cupy.zeros(3)
    cupy.add.at(x, cupy.asarray([0, 0, 2]), 1.0)
    np.testing.assert_array_equal(x.get(), [2.0, 0.0, 1.0])
    assert cupy.add.reduce(cupy.arange(4.0)).get() == 6.0
    np.testing.assert_array_equal(
        cupy.multiply.outer(cupy.arange(2), cupy.arange(3)).get(),
        np.multiply.outer(np.arange(2), np.arange(3)),
    )


def test_numpy_index_arrays_are_accepted_as_cupy_uploads_them(cupy: ModuleType) -> None:
    a = np.arange(10.0) * 3
    x = cupy.asarray(a)
    idx, mask = np.array([4, 1, 1]), a > 10
    np.testing.assert_array_equal(x[idx].get(), a[idx])
    np.testing.assert_array_equal(x[mask].get(), a[mask])
    x[idx] = -1.0
    a[idx] = -1.0
    np.testing.assert_array_equal(x.get(), a)
    with pytest.raises(TypeError, match="Unsupported type"):
        x + np.ones(10)  # a host operand (not an index) is still refused


def test_device_arrays_pickle_onto_the_current_device(cupy: ModuleType) -> None:
    import pickle

    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    x = cupy.asarray(a)
    with cupy.cuda.Device(1):
        y = pickle.loads(pickle.dumps(x))
    assert y.device.id == 1
    assert y.dtype == np.float32
    np.testing.assert_array_equal(y.get(), a)


def test_an_event_orders_two_streams(cupy: ModuleType) -> None:
    x = ready(cupy, cupy.arange(4.0))
    writer, reader = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    with writer:
        x += 1
    reader.wait_event(writer.record())
    with reader:
        y = x * 2
    np.testing.assert_array_equal(y.get(stream=reader), (np.arange(4.0) + 1) * 2)


def test_waiting_on_an_event_recorded_before_the_write_does_not_order_it(cupy: ModuleType) -> None:
    x = ready(cupy, cupy.arange(4.0))
    writer, reader = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    early = writer.record()
    with writer:
        x += 1
    reader.wait_event(early)
    with reader, pytest.raises(RaceError):
        x * 2


def test_legacy_null_stream_synchronises_with_blocking_streams_only(cupy: ModuleType) -> None:
    x = ready(cupy, cupy.arange(4.0))
    with cupy.cuda.Stream():  # blocking: the null stream waits for it
        x += 1
    assert (x * 2).get()[1] == 4.0
    y = ready(cupy, cupy.arange(4.0))
    with cupy.cuda.Stream(non_blocking=True):
        y += 1
    with pytest.raises(RaceError, match="legacy null stream of cuda:0"):
        y * 2


def test_blocking_stream_waits_for_earlier_null_stream_work(cupy: ModuleType) -> None:
    x = cupy.arange(4.0)  # on the legacy null stream
    with cupy.cuda.Stream():
        x += 1
    with cupy.cuda.Stream(non_blocking=True), pytest.raises(RaceError):
        x += 1


def test_host_synchronisation_orders_and_event_done_reports_it(cupy: ModuleType) -> None:
    x = ready(cupy, cupy.arange(4.0))
    writer = cupy.cuda.Stream(non_blocking=True)
    with writer:
        x += 1
    event = writer.record()
    assert not event.done  # the simulated GPU finishes only when the host waits
    assert not writer.done
    event.synchronize()
    assert event.done
    assert writer.done
    assert x.get(stream=cupy.cuda.Stream(non_blocking=True))[0] == 1.0


def test_host_functions_run_when_the_host_waits_for_them(cupy: ModuleType) -> None:
    stream = cupy.cuda.Stream(non_blocking=True)
    calls: list[int] = []
    stream.launch_host_func(calls.append, 7)
    assert calls == []
    stream.synchronize()
    assert calls == [7]


def test_per_thread_default_streams_are_distinct_per_thread() -> None:
    with simulated_cuda(1, per_thread_default_stream=True) as cupy:
        assert cupy.cuda.get_current_stream() == cupy.cuda.Stream.ptds
        x = ready(cupy, cupy.arange(4.0))
        x += 1  # on the main thread's per-thread stream
        errors: list[BaseException] = []

        def reader() -> None:
            try:
                x * 2  # the worker's own per-thread stream: unordered
            except RaceError as error:
                errors.append(error)

        thread = threading.Thread(target=reader, name="worker")
        thread.start()
        thread.join()
        assert len(errors) == 1
        assert "per-thread default stream of thread 'worker'" in str(errors[0])
        assert "per-thread default stream of thread 'MainThread'" in str(errors[0])


def test_legacy_default_stream_is_shared_by_threads(cupy: ModuleType) -> None:
    x = cupy.arange(4.0)
    results = []
    thread = threading.Thread(target=lambda: results.append((x * 2).get()))
    thread.start()
    thread.join()
    np.testing.assert_array_equal(results[0], np.arange(4.0) * 2)


def test_events_belong_to_their_device_and_streams_to_theirs(cupy: ModuleType) -> None:
    with cupy.cuda.Device(1):
        other = cupy.cuda.Stream()
    event = cupy.cuda.Event()
    with pytest.raises(RuntimeError, match=r"created on cuda:0 cannot be recorded"):
        event.record(other)
    with (
        pytest.raises(
            RuntimeError, match=r"created on \(1\) does not match .* current device \(0\)"
        ),
        other,
    ):
        pass


# -- kernels and copies --------------------------------------------------------------------


def test_kernels_refuse_arrays_of_another_device_and_host_arrays(cupy: ModuleType) -> None:
    with cupy.cuda.Device(1):
        x = cupy.ones(3)
    with pytest.raises(
        ValueError, match=r"resides \(1\) is different from the current device \(0\)"
    ):
        x + 1
    with cupy.cuda.Device(1), pytest.raises(TypeError, match="Unsupported type"):
        x + np.ones(3)
    with pytest.raises(TypeError, match="Implicit conversion to a NumPy array is not allowed"):
        np.asarray(x)


@pytest.mark.parametrize("dtype", [object, "U3", ">f8", "M8[s]"], ids=str)
def test_arrays_refuse_dtypes_cupy_lacks(cupy: ModuleType, dtype: Any) -> None:
    with pytest.raises(ValueError, match="Unsupported dtype"):
        cupy.empty(3, dtype)


def test_set_checks_the_shape_like_cupy(cupy: ModuleType) -> None:
    x = cupy.empty((), np.float64)
    with pytest.raises(ValueError, match=r"Shape mismatch. Old shape: \(\), new shape: \(1,\)"):
        x.set(np.ascontiguousarray(np.array(2.0)))
    x.set(np.array(2.0))
    assert x.get()[()] == 2.0


def test_arithmetic_and_views_match_numpy(cupy: ModuleType) -> None:
    a = np.arange(24, dtype=np.float32).reshape(4, 6)
    x = cupy.asarray(a)
    np.testing.assert_array_equal((x.T[::2] * 3 - 1).get(), a.T[::2] * 3 - 1)
    np.testing.assert_array_equal(cupy.concatenate([x, x[:1]]).get(), np.concatenate([a, a[:1]]))
    assert float(x.sum()) == a.sum()
    view = x[1:3, ::2]
    assert view.base is x
    assert not view.flags.c_contiguous
    view[...] = 0
    a[1:3, ::2] = 0
    np.testing.assert_array_equal(x.get(), a)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int64, np.complex64, np.bool_])
def test_view_without_a_dtype_keeps_the_dtype_as_cupy(cupy: ModuleType, dtype: Any) -> None:
    a = np.arange(6).astype(dtype)
    x = cupy.asarray(a)
    v = x.view()
    assert v.dtype == a.dtype  # real CuPy: view() is the same dtype, not float64
    assert v.base is x
    np.testing.assert_array_equal(v.get(), a)
    assert x.view(np.uint8).shape == (a.nbytes,)


def test_peer_copies_are_ordered_by_the_copy_stream(cupy: ModuleType) -> None:
    source = ready(cupy, cupy.arange(4.0))
    with cupy.cuda.Device(1):
        target = ready(cupy, cupy.zeros(4))
        copier = cupy.cuda.Stream(non_blocking=True)
    with cupy.cuda.Device(0):
        source += 1  # legacy null stream of cuda:0
    with pytest.raises(
        RaceError, match=r"memcpyPeerAsync .* on stream .* of cuda:1.*legacy null stream of cuda:0"
    ):
        cupy.cuda.runtime.memcpyPeerAsync(target.data.ptr, 1, source.data.ptr, 0, 32, copier.ptr)


# -- pools ---------------------------------------------------------------------------------


def test_a_freed_block_goes_to_the_next_allocation_on_its_stream_without_a_sync(
    cupy: ModuleType,
) -> None:
    other = cupy.cuda.Stream(non_blocking=True)
    x = cupy.empty(64, np.float64)  # allocated for the legacy null stream
    address = x.data.ptr
    other.wait_event(cupy.cuda.Stream.null.record())
    with other:
        x[...] = 1.0  # written on another stream...
    del x  # ...and freed with nothing ordering that write
    y = cupy.empty(64, np.float64)
    assert y.data.ptr == address  # CuPy's rule: same stream, same size, reused at once
    with pytest.raises(
        RaceError,
        match=r"write by `kernel ndarray.fill on legacy null stream.*"
        r"write by `kernel setitem on stream",
    ):
        y.fill(2.0)


def test_part_of_a_larger_freed_block_is_reused_and_races(cupy: ModuleType) -> None:
    """CuPy's best fit: a 4 KiB free chunk serves a 1 KiB request (split), without a sync."""
    other = cupy.cuda.Stream(non_blocking=True)
    x = cupy.empty(512, np.float64)  # 4 KiB, for the legacy null stream
    address = x.data.ptr
    other.wait_event(cupy.cuda.Stream.null.record())
    with other:
        x[-8:] = 1.0  # the last 64 bytes, written on another stream
        x[:8] = 1.0  # and the first 64
    del x
    y = cupy.empty(128, np.float64)  # 1 KiB: the front of the freed chunk
    assert y.data.ptr == address
    with pytest.raises(
        RaceError, match=r"write by `kernel ndarray.fill .* write by `kernel setitem"
    ):
        y.fill(2.0)


def test_the_split_off_rest_is_reused_too_and_freed_neighbours_merge(cupy: ModuleType) -> None:
    pool = cupy.get_default_memory_pool()
    x = cupy.empty(512, np.float64)  # one 4 KiB block
    base, total = x.data.ptr, pool.total_bytes()
    del x
    y = cupy.empty(128, np.float64)  # the first KiB
    z = cupy.empty(384, np.float64)  # the 3 KiB rest, not a new block
    assert (y.data.ptr, z.data.ptr) == (base, base + 1024)
    assert pool.total_bytes() == total
    del y, z  # both parts free: merged back into one 4 KiB chunk
    assert pool.n_free_blocks() == 1
    w = cupy.empty(512, np.float64)
    assert w.data.ptr == base
    assert pool.total_bytes() == total
    del w
    pool.free_all_blocks()
    assert pool.total_bytes() == total - 4096


def test_a_split_block_is_not_released_until_merged(cupy: ModuleType) -> None:
    pool = cupy.get_default_memory_pool()
    x = cupy.empty(512, np.float64)
    total = pool.total_bytes()
    del x
    y = cupy.empty(128, np.float64)  # holds part of the block
    pool.free_all_blocks()  # the free 3 KiB part is not a whole block: kept (as CuPy)
    assert pool.total_bytes() == total
    assert pool.n_free_blocks() == 1
    del y


def test_a_block_freed_on_one_stream_is_not_reused_by_another(cupy: ModuleType) -> None:
    x = cupy.empty(64, np.float64)
    address = x.data.ptr
    del x
    with cupy.cuda.Stream(non_blocking=True):
        y = cupy.empty(64, np.float64)
    assert y.data.ptr != address


def free_pinned_memory_under_a_copy(*, reuse: bool, size: int = 8, again: int = 8) -> None:
    """Free a pinned buffer while a copy may still read it (and reuse it at once if asked)."""
    with simulated_cuda(1) as cupy:
        target = cupy.empty(size, np.uint8)
        memory = cupy.cuda.alloc_pinned_memory(size)
        target.data.copy_from_host_async(ctypes.addressof(memory), size)
        del memory  # back to the pool while the copy may still read it
        if reuse:
            with pytest.raises(
                RaceError, match=r"host writing pinned memory .*read by `copy_from_host_async"
            ):
                cupy.cuda.alloc_pinned_memory(again)


@pytest.mark.parametrize(
    ("size", "again"),
    [(8, 8), (1024, 600), (600, 1024), (1536, 2048)],
    ids=["same size", "smaller, same power of two", "larger, same power of two", "1.5 KiB in 2"],
)
def test_pinned_memory_reused_before_the_copy_read_it_is_a_race(size: int, again: int) -> None:
    """CuPy's pinned pool rounds sizes up to a power of two of 512-byte units, so any request
    that rounds alike gets the freed block."""
    with pytest.raises(RaceError, match=r"freed .* while `copy_from_host_async"):  # at the end
        free_pinned_memory_under_a_copy(reuse=True, size=size, again=again)


def test_pinned_memory_kept_until_the_copy_is_done_is_clean(cupy: ModuleType) -> None:
    target = cupy.empty(8, np.uint8)
    memory = cupy.cuda.alloc_pinned_memory(8)
    np.frombuffer(memory, np.uint8, 8)[:] = np.arange(8)
    target.data.copy_from_host_async(ctypes.addressof(memory), 8)
    done = cupy.cuda.Stream.null.record()
    done.synchronize()
    del memory
    again = cupy.cuda.alloc_pinned_memory(8)
    assert cupy.get_default_pinned_memory_pool().n_free_blocks() == 0
    np.testing.assert_array_equal(target.get(), np.arange(8))
    del again


def test_freeing_pinned_memory_in_use_is_reported_when_the_simulation_ends() -> None:
    with pytest.raises(
        RaceError, match=r"pinned host memory .* was freed .* while `copy_from_host_async"
    ):
        free_pinned_memory_under_a_copy(reuse=False)


# -- the session ---------------------------------------------------------------------------


def test_simulated_cuda_makes_the_library_see_cuda_and_restores_everything() -> None:
    before = cupy_module()
    with simulated_cuda(4) as cupy:
        assert cupy_module() is cupy
        assert cupy_parallel.platform() == "cuda"
        assert cupy_parallel.devices() == [cupy_parallel.Device("cuda", k) for k in range(4)]
        assert cupy.cuda.runtime.getDeviceCount() == 4
    assert cupy_module() is before
    assert cupy_parallel.platform() == "host"
    assert not cupy.cuda.is_available()
    with pytest.raises(RuntimeError, match="outside its simulation"):
        cupy.empty(3)


@pytest.mark.parametrize(
    ("count", "error", "match"),
    [
        (0, ValueError, "n_devices must be >= 1, got 0"),
        (True, TypeError, "n_devices must be an int"),
        ("2", TypeError, "n_devices must be an int"),
    ],
)
def test_simulated_cuda_reads_its_arguments(count: Any, error: type, match: str) -> None:
    with pytest.raises(error, match=match), simulated_cuda(count):
        pass


def test_simulations_do_not_nest() -> None:
    with simulated_cuda(1), pytest.raises(RuntimeError, match="do not nest"), simulated_cuda(1):
        pass


def test_a_group_operation_orders_every_stream_after_all_participants(cupy: ModuleType) -> None:
    simulation = cupy.simulation()
    with cupy.cuda.Device(0):
        a = cupy.cuda.Stream(non_blocking=True)
        x = ready(cupy, cupy.zeros(4))
        with a:
            x += 1  # written on a
    with cupy.cuda.Device(1):
        b = cupy.cuda.Stream(non_blocking=True)
    with simulation.lock:
        _, on_b = simulation.enqueue_group([a.timeline(), b.timeline()], "group")
    with cupy.cuda.Device(1):
        after = b.record()
    with cupy.cuda.Device(0):
        c = cupy.cuda.Stream(non_blocking=True)
        c.wait_event(after)  # ordered after the group on b, hence after the write on a
        with c:
            assert float((x * 2).sum()) == 8.0
    assert on_b.clock[a.timeline().id] >= 1


def test_strided_regions_race_only_where_they_overlap(cupy: ModuleType) -> None:
    x = ready(cupy, cupy.zeros((4, 6)))
    first, second = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    with first:
        x[:, ::2] = 1.0  # even columns
    with second:
        x[:, 1::2] = 2.0  # odd columns: interleaved bytes, none shared
    with second, pytest.raises(RaceError, match="bytes"):
        x[:, ::3] = 3.0  # columns 0 and 3: column 0 was written on the other stream


def test_devices_are_comparable_but_unhashable_and_no_index_as_in_cupy(cupy: ModuleType) -> None:
    """Real CuPy 14: ``hash(Device(0))`` and ``operator.index(Device(0))`` raise TypeError."""
    import operator

    d = cupy.cuda.Device(1)
    assert d == cupy.cuda.Device(1)
    assert int(d) == 1
    with pytest.raises(TypeError):
        hash(d)
    with pytest.raises(TypeError):
        operator.index(d)


# -- the synchronous copies wait as CUDA documents, no more --------------------------------


def _read_on_a_non_blocking_stream(cupy: ModuleType, x: Any) -> np.ndarray:
    """``2 * x`` computed on a new non-blocking stream, copied to the host on that stream."""
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        return (x * 2).get(stream=stream)


def test_device_to_device_memcpy_does_not_make_the_host_wait(cupy: ModuleType) -> None:
    """cudaMemcpy device to device: "no host-side synchronization is performed"."""
    rt = cupy.cuda.runtime
    src, dst = ready(cupy, cupy.arange(4.0)), ready(cupy, cupy.zeros(4))
    rt.memcpy(dst.data.ptr, src.data.ptr, dst.nbytes, rt.memcpyDeviceToDevice)
    with pytest.raises(RaceError, match=r"read by `kernel .*non-blocking.* write by `memcpy"):
        _read_on_a_non_blocking_stream(cupy, dst)


def test_pageable_host_to_device_memcpy_returns_before_the_device_is_written(
    cupy: ModuleType,
) -> None:
    """cudaMemcpy from pageable memory returns once the data is staged, not written."""
    rt = cupy.cuda.runtime
    host = np.arange(4.0)
    dst = ready(cupy, cupy.zeros(4))
    rt.memcpy(dst.data.ptr, host.ctypes.data, dst.nbytes, rt.memcpyHostToDevice)
    with pytest.raises(RaceError, match=r"write by `memcpy"):
        _read_on_a_non_blocking_stream(cupy, dst)


def test_pageable_host_to_device_memcpy_waits_for_the_streams_earlier_work(
    cupy: ModuleType,
) -> None:
    rt = cupy.cuda.runtime
    x = ready(cupy, cupy.arange(4.0))
    x += 1  # on the legacy null stream, which cudaMemcpy synchronises before copying
    host = np.zeros(4)
    dst = ready(cupy, cupy.zeros(4))
    rt.memcpy(dst.data.ptr, host.ctypes.data, dst.nbytes, rt.memcpyHostToDevice)
    np.testing.assert_array_equal(_read_on_a_non_blocking_stream(cupy, x), (np.arange(4) + 1) * 2)


def test_pinned_host_to_device_memcpy_is_synchronous(cupy: ModuleType) -> None:
    rt = cupy.cuda.runtime
    pinned = cupy.cuda.alloc_pinned_memory(32)
    host = np.frombuffer(pinned, np.float64, 4)
    host[...] = np.arange(4.0)
    dst = ready(cupy, cupy.zeros(4))
    rt.memcpy(dst.data.ptr, host.ctypes.data, dst.nbytes, rt.memcpyHostToDevice)
    np.testing.assert_array_equal(_read_on_a_non_blocking_stream(cupy, dst), np.arange(4) * 2)


def test_device_to_host_memcpy_returns_when_the_copy_is_done(cupy: ModuleType) -> None:
    rt = cupy.cuda.runtime
    src = ready(cupy, cupy.arange(4.0))
    host = np.zeros(4)
    rt.memcpy(host.ctypes.data, src.data.ptr, src.nbytes, rt.memcpyDeviceToHost)
    np.testing.assert_array_equal(host, np.arange(4.0))
    writer = cupy.cuda.Stream(non_blocking=True)
    with writer:
        src += 1  # the copy already read src: no race
    np.testing.assert_array_equal(src.get(stream=writer), np.arange(4.0) + 1)


def test_memcpy_peer_is_serialised_with_both_devices_work_without_a_host_wait(
    cupy: ModuleType,
) -> None:
    rt = cupy.cuda.runtime
    src = ready(cupy, cupy.arange(4.0))
    with cupy.cuda.Device(1):
        dst = ready(cupy, cupy.zeros(4))
        late = cupy.cuda.Stream(non_blocking=True)  # made after: its work is ordered after too
    rt.memcpyPeer(dst.data.ptr, 1, src.data.ptr, 0, src.nbytes)
    with cupy.cuda.Device(1), late:
        doubled = dst * 2
    writer = cupy.cuda.Stream(non_blocking=True)
    with writer:
        src += 1  # later work on the source device is ordered after the copy as well
    np.testing.assert_array_equal(doubled.get(stream=late), np.arange(4.0) * 2)


def test_shares_memory_runs_on_the_current_device_as_cupy(cupy: ModuleType) -> None:
    """CuPy computes shares_memory with kernels on the current device that read both arrays."""
    x = cupy.arange(8.0)
    assert cupy.shares_memory(x[:4], x[2:6])
    assert not cupy.shares_memory(x[:4], x[4:])
    assert cupy.shares_memory(x[:4], x[4:], max_work="MAY_SHARE_BOUNDS") is False
    with cupy.cuda.Device(1), pytest.raises(ValueError, match="different from the current device"):
        cupy.shares_memory(x[:4], x[2:6])  # another GPU's arrays, no peer access
    writer = cupy.cuda.Stream(non_blocking=True)
    with writer:
        x[:2] = 1.0
    with pytest.raises(RaceError, match=r"read by `kernel shares_memory"):
        cupy.shares_memory(x[:4], x[4:])  # reads x, unordered after the write


# -- the simulated NCCL is as strict as NCCL ---------------------------------------------------


def test_two_threads_calling_one_communicator_at_once_is_reported() -> None:
    """NCCL communicators are not thread-safe: a call while another thread is inside one is an
    error (real NCCL would corrupt or hang); one thread at a time, as with a lock, is fine."""
    with simulated_cuda(2) as cupy:
        nccl = cupy.cuda.nccl
        uid = nccl.get_unique_id()
        made: dict[int, Any] = {}

        def make(rank: int) -> None:
            with cupy.cuda.Device(rank):
                made[rank] = nccl.NcclCommunicator(2, uid, rank)

        threads = [threading.Thread(target=make, args=(r,)) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        with cupy.cuda.Device(0):
            x = cupy.ones(4)
        errors: list[BaseException] = []

        def all_reduce() -> None:  # rank 0's member, used by a second thread while the first waits
            try:
                with cupy.cuda.Device(0):
                    made[0].allReduce(
                        x.data.ptr, x.data.ptr, 4, nccl.NCCL_FLOAT64, nccl.NCCL_SUM, 0
                    )
            except BaseException as error:  # noqa: BLE001 - collected for the assertion
                errors.append(error)

        sim_nccl.set_deadlock_limit(5.0)
        first = threading.Thread(target=all_reduce)
        first.start()  # waits in the call: rank 1 never comes
        time.sleep(0.3)
        with (
            pytest.raises(SimulationError, match=r"while thread .* is inside nccl allReduce"),
            cupy.cuda.Device(0),
        ):
            made[0].allReduce(x.data.ptr, x.data.ptr, 4, nccl.NCCL_FLOAT64, nccl.NCCL_SUM, 0)
        made[0].abort()  # releases the waiting thread (as a watchdog would)
        first.join()
        assert len(errors) == 1
        assert "aborted" in str(errors[0])


def _two_gpu_communicators(cupy: ModuleType) -> list[Any]:
    return cupy.cuda.nccl.NcclCommunicator.initAll([0, 1])


@pytest.mark.parametrize("root", [0, 1])
def test_a_broadcast_root_may_finish_before_its_peers_start(root: int) -> None:
    """NCCL's buffered protocols let a root (a sender) finish first: the root's later work is not
    ordered after a peer's earlier work, while the peer's later work is ordered after the
    root's earlier work (it received the root's data)."""
    peer = 1 - root
    with simulated_cuda(2) as cupy:
        nccl = cupy.cuda.nccl
        comms = _two_gpu_communicators(cupy)
        streams, xs, scratch = {}, {}, {}
        for d in (0, 1):
            with cupy.cuda.Device(d):
                streams[d] = cupy.cuda.Stream(non_blocking=True)
                xs[d] = cupy.zeros(4)
                scratch[d] = cupy.zeros(4)
                cupy.cuda.Device(d).synchronize()
        for d in (0, 1):  # each GPU writes its scratch on its stream, unsynchronised
            with cupy.cuda.Device(d), streams[d]:
                scratch[d][...] = d + 1.0
        nccl.groupStart()
        for d in (0, 1):
            with cupy.cuda.Device(d):
                comms[d].bcast(xs[d].data.ptr, 4, nccl.NCCL_FLOAT64, root, streams[d].ptr)
        nccl.groupEnd()
        rt = cupy.cuda.runtime
        with cupy.cuda.Device(root), streams[root]:  # the root reads the peer's: not ordered
            late = cupy.zeros(4)
            with pytest.raises(RaceError, match=r"memcpyPeerAsync .* write by `kernel setitem"):
                rt.memcpyPeerAsync(
                    late.data.ptr, root, scratch[peer].data.ptr, peer, 32, streams[root].ptr
                )
        with cupy.cuda.Device(peer), streams[peer]:  # the receiver reads the root's: ordered
            out = cupy.zeros(4)
            rt.memcpyPeerAsync(
                out.data.ptr, peer, scratch[root].data.ptr, root, 32, streams[peer].ptr
            )
            np.testing.assert_array_equal(out.get(stream=streams[peer]), [root + 1.0] * 4)


# -- the host's accesses to pinned memory in flight --------------------------------------------


def _pinned(cupy: ModuleType, n: int) -> np.ndarray:
    return np.frombuffer(cupy.cuda.alloc_pinned_memory(8 * n), np.float64, n)


def test_a_pinned_download_is_there_only_after_the_host_waits(cupy: ModuleType) -> None:
    x = ready(cupy, cupy.arange(4.0))
    stream = cupy.cuda.Stream(non_blocking=True)
    out = _pinned(cupy, 4)
    x.get(stream=stream, out=out, blocking=False)
    assert np.isnan(out).all()  # read too early: undefined on a GPU, NaN here, never the data
    stream.synchronize()
    np.testing.assert_array_equal(out, np.arange(4.0))


def test_later_device_work_in_stream_order_sees_a_pinned_download(cupy: ModuleType) -> None:
    x = ready(cupy, cupy.arange(4.0))
    stream = cupy.cuda.Stream(non_blocking=True)
    staged = _pinned(cupy, 4)
    with stream:
        y = cupy.empty(4)
    x.get(stream=stream, out=staged, blocking=False)
    y.set(staged, stream=stream)  # ordered after the download on the same stream
    np.testing.assert_array_equal(y.get(stream=stream), np.arange(4.0))


def write_pinned_in_flight(direction: str) -> None:
    """The host writes pinned memory an asynchronous copy in ``direction`` may still use."""
    with simulated_cuda(1) as cupy:
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            x = cupy.arange(4.0)
        buffer = _pinned(cupy, 4)
        if direction == "download":
            x.get(stream=stream, out=buffer, blocking=False)
        else:
            buffer[...] = np.arange(4.0)
            x.set(buffer, stream=stream)
        buffer[0] = 7.0  # before synchronising with the copy
        stream.synchronize()


@pytest.mark.parametrize(
    ("direction", "copy"),
    [("download", "copy_to_host_async"), ("upload", "copy_from_host_async")],
)
def test_the_host_writing_pinned_memory_in_flight_is_a_race(direction: str, copy: str) -> None:
    """Refilling the pinned source of a pending upload, or writing the pinned target of a
    pending download, races with the copy on a GPU; reported when the simulation ends."""
    with pytest.raises(RaceError, match=rf"the host wrote it while `{copy}"):
        write_pinned_in_flight(direction)


def test_the_host_touching_pinned_memory_after_waiting_is_clean(cupy: ModuleType) -> None:
    x = ready(cupy, cupy.arange(4.0))
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        y = cupy.empty(4)
    buffer = _pinned(cupy, 4)
    buffer[...] = 5.0
    y.set(buffer, stream=stream)
    stream.synchronize()
    buffer[...] = -1.0  # the upload is done: free to refill
    x.get(stream=stream, out=buffer, blocking=False)
    stream.synchronize()
    buffer += 1.0
    np.testing.assert_array_equal(buffer, np.arange(4.0) + 1)
    np.testing.assert_array_equal(y.get(stream=stream), [5.0] * 4)
