"""The NCCL backend through the public API: every collective against NumPy, streams, timeouts.

A world of one process runs on GPU 0; the ``*_multigpu`` forms use every GPU (at least two).
These tests run on the simulated CUDA with 1, 2 and 4 GPUs (its race checker fails a test on any
unordered access) and on the real GPUs (``gpu``-marked, skipped without NCCL and a GPU): the
``world`` fixture makes the module's ``cupy`` the one of its run. On the simulated GPU a
"spinning" producer kernel is a plain fill (it never finishes before the host waits anyway).
Timing, hung kernels, process tear-down and several processes need real GPUs (``real_gpu``).
"""

from __future__ import annotations

import contextlib
import gc
import re
import subprocess
import sys
import textwrap
import time
import weakref
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
from test_nccl import NCCL_OPS, _refusal
from test_nccl import _meaning as _reduce  # NumPy's reading of each ReduceOp
from test_nccl import _values as _sample  # values whose sums and products are exact

from cupy_parallel import distributed as dist
from cupy_parallel._src.cuda.nccl_tables import version_code
from cupy_parallel._src.devices import cuda_device_count, cupy_module
from cupy_parallel._src.distributed import groups
from cupy_parallel._src.enums import ReduceOp
from cupy_parallel.testing import simulated_cuda

if TYPE_CHECKING:
    from collections.abc import Iterator

REAL = dist.is_nccl_available()


def real_gpu(test: Any) -> Any:
    """Mark a test that needs real GPUs with NCCL (timing, hung kernels, several processes)."""
    marks = [pytest.mark.gpu, pytest.mark.skipif(not REAL, reason="needs CuPy's NCCL and a GPU")]
    for mark in marks:
        test = mark(test)
    return test


cupy: Any = cupy_module()  # the world fixture swaps in the module of its run
needs_two = pytest.mark.skipif(cuda_device_count() < 2, reason="needs two GPUs")

MOVED = [
    "bool",
    "int8",
    "int16",
    "uint16",
    "int64",
    "float16",
    "float32",
    "complex64",
    "complex128",
]
REDUCED = ["bool", "int8", "uint8", "int32", "uint64", "int64", "float16", "float32", "float64",
           "complex64", "complex128"]  # fmt: skip
OLD = version_code(2, 9, 9)  # before ncclAvg: AVG is a sum and a division


def _check(actual: np.ndarray, expected: np.ndarray) -> None:
    """Exact, except floating means (NCCL pre-multiplies by 1/n; NumPy divides the sum)."""
    assert actual.dtype == expected.dtype
    if expected.dtype.kind in "fc":
        np.testing.assert_allclose(actual, expected, rtol=1e-6)
    else:
        np.testing.assert_array_equal(actual, expected)


def _on(device: int, host: np.ndarray) -> Any:
    with cupy.cuda.Device(device):
        return cupy.asarray(host)


def _backend() -> Any:
    assert groups.state().world is not None
    return groups.state().world._backend


def _need(gpus: int) -> None:
    if cuda_device_count() < gpus:
        pytest.skip(f"needs {gpus} GPUs")


@pytest.fixture(
    params=[
        pytest.param(1, id="sim1"),
        pytest.param(2, id="sim2"),
        pytest.param(4, id="sim4"),
        pytest.param(
            0,
            id="gpu",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not REAL, reason="needs CuPy's NCCL and a GPU"),
            ],
        ),
    ]
)
def world(
    request: pytest.FixtureRequest, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Any]:
    """A one-process NCCL world on GPU 0 of the simulated CUDA (1, 2, 4 GPUs) or the real one."""
    with contextlib.ExitStack() as stack:
        if request.param:
            module = stack.enter_context(simulated_cuda(request.param))
            monkeypatch.setattr(sys.modules[__name__], "cupy", module)
        yield from _world(tmp_path)
        for device in range(cuda_device_count()):  # the simulated GPU finishes when waited for
            cupy.cuda.Device(device).synchronize()


def _world(tmp_path: Any) -> Iterator[Any]:
    cupy.cuda.Device(0).use()
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group(
        "nccl", store=store, rank=0, world_size=1, timeout=timedelta(seconds=60)
    )
    # Make GPU 0's communicator now (0.1-1 s on a real GPU, and blocking: barrier waits on the
    # host), so no test times communicator creation as if it were the collective.
    dist.barrier()
    yield _backend()
    dist.destroy_process_group()
    store.close()


_SPIN = r"""
extern "C" __global__ void spin_then_fill(long long cycles, int* out, int value, int n) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
    for (int i = threadIdx.x; i < n; i += blockDim.x) out[i] = value;
}
"""


def _spin_then_fill(x: Any, value: int, seconds: float) -> None:
    """Queue on the current stream: busy-wait ``seconds``, then fill the int32 ``x``."""
    if not hasattr(cupy, "RawKernel"):  # the simulated GPU: a fill, never done before a wait
        x.fill(value)
        return
    kernel = cupy.RawKernel(_SPIN, "spin_then_fill")
    cycles = int(seconds * cupy.cuda.Device().attributes["ClockRate"] * 1000)
    kernel((1,), (128,), (np.int64(cycles), x, np.int32(value), np.int32(x.size)))


# ---------------------------------------------------------------------------------------------
# A world of one GPU: every collective moves or reduces exactly what NumPy says


@pytest.mark.parametrize("dtype", MOVED)
def test_data_movement_is_bit_exact(world: Any, dtype: str) -> None:
    host = _sample(dtype, (3, 5), 0)
    x = cupy.asarray(host)
    dist.broadcast(x, src=0)
    np.testing.assert_array_equal(x.get(), host)

    gathered = [cupy.empty_like(x)]
    dist.all_gather(gathered, x)
    np.testing.assert_array_equal(gathered[0].get(), host)

    out = [cupy.empty_like(x)]
    dist.gather(x, out, dst=0)
    np.testing.assert_array_equal(out[0].get(), host)

    scattered = cupy.empty_like(x)
    dist.scatter(scattered, [x], src=0)
    np.testing.assert_array_equal(scattered.get(), host)

    exchanged = [cupy.empty_like(x)]
    dist.all_to_all(exchanged, [x])
    np.testing.assert_array_equal(exchanged[0].get(), host)


@pytest.mark.parametrize("op", NCCL_OPS, ids=lambda op: op.name)
@pytest.mark.parametrize("dtype", REDUCED)
def test_reductions_of_one_participant(world: Any, dtype: str, op: ReduceOp) -> None:
    if _refusal(dtype, op) is not None:
        # MIN/MAX (no order) and PRODUCT (torch's refusal) of complex numbers are refused for
        # every backend first (torch's ValueError, also a TypeError), other NCCL refusals by the
        # backend's dtype tables.
        if dtype.startswith("complex") and op in (ReduceOp.MIN, ReduceOp.MAX):
            message = rf"ReduceOp\.{op.name} is not defined for complex dtype {dtype}"
        elif dtype.startswith("complex") and op is ReduceOp.PRODUCT:  # torch refuses it too
            message = rf"ReduceOp\.PRODUCT is not supported on complex dtype {dtype}"
        else:
            message = rf"NCCL cannot reduce {dtype} arrays with"
        with pytest.raises(TypeError, match=message):
            dist.all_reduce(cupy.zeros(2, dtype), op=op)
        return
    host = _sample(dtype, (4, 3), 1)
    expected = _reduce(op, [host])
    x = cupy.asarray(host)
    dist.all_reduce(x, op=op)
    np.testing.assert_array_equal(x.get(), expected)
    y = cupy.asarray(host)
    dist.reduce(y, dst=0, op=op)
    np.testing.assert_array_equal(y.get(), expected)
    # reduce_scatter goes out of place: a wrong element count (complex lanes) would show here.
    out = cupy.full(host.shape, 1, dtype)
    dist.reduce_scatter(out, [cupy.asarray(host)], op=op)
    np.testing.assert_array_equal(out.get(), expected)


@pytest.mark.parametrize("dtype", ["int8", "int32", "int64", "uint32", "float16", "complex128"])
def test_average_without_ncclavg_divides_toward_zero(world: Any, dtype: str) -> None:
    host = _sample(dtype, (50,), 2) * np.dtype(dtype).type(7)
    x = cupy.asarray(host)
    world._divide([x], 3)
    if np.dtype(dtype).kind in "iu":
        expected = (np.sign(host) * (np.abs(host) // 3)).astype(dtype)
        np.testing.assert_array_equal(x.get(), expected)
    else:
        np.testing.assert_allclose(x.get(), host / 3, rtol=1e-3)


def test_old_nccl_average_is_sum_then_divide(world: Any) -> None:
    world._version = OLD
    host = _sample("int32", (6,), 3)
    x = cupy.asarray(host)
    dist.all_reduce(x, op=ReduceOp.AVG)
    np.testing.assert_array_equal(x.get(), host)  # one participant: the mean is the value


def test_coalesced_forms_pack_mixed_dtypes_and_shapes(world: Any) -> None:
    hosts = [_sample("float32", (3, 2), 4), _sample("int8", (5,), 5), _sample("complex64", (0,), 6),
             _sample("float64", (), 7)]  # fmt: skip
    arrays = [cupy.asarray(h) for h in hosts]
    dist.all_reduce_coalesced(arrays, op=ReduceOp.SUM)
    for a, h in zip(arrays, hosts, strict=True):
        np.testing.assert_array_equal(a.get(), h)
    outputs = [[cupy.empty_like(a) for a in arrays]]
    dist.all_gather_coalesced(outputs, arrays)
    for a, h in zip(outputs[0], hosts, strict=True):
        np.testing.assert_array_equal(a.get(), h)


def test_empty_arrays_complete(world: Any) -> None:
    x = cupy.zeros((0, 3), cupy.float32)
    dist.all_reduce(x)
    dist.broadcast(x, src=0)
    out = [cupy.ones((0, 3), cupy.float32)]
    dist.all_gather(out, x)
    assert out[0].shape == (0, 3)
    assert dist.barrier(async_op=True).wait() is True


def test_recv_from_any_source_is_refused(world: Any) -> None:
    with pytest.raises(NotImplementedError, match=r"recv\(src=None\) receives from any rank"):
        dist.recv(cupy.zeros(2), src=None)


# ---------------------------------------------------------------------------------------------
# Streams, asynchronous work, lifetimes


def test_collective_sees_work_queued_before_it_and_orders_the_stream(world: Any) -> None:
    side = cupy.cuda.Stream(non_blocking=True)
    x = cupy.zeros(4096, cupy.int32)
    outputs = [cupy.full(4096, -1, cupy.int32)]
    cupy.cuda.Device().synchronize()
    with side:
        _spin_then_fill(x, 7, seconds=0.5)
        work = dist.all_gather(outputs, x, async_op=True)
        assert not work.is_completed()  # still behind the spinning kernel
        start = time.perf_counter()
        work.wait_stream()  # the side stream waits; the host does not
        assert time.perf_counter() - start < 0.2
        assert not work.is_completed()
        doubled = outputs[0] * 2
    side.synchronize()
    assert work.is_completed()
    np.testing.assert_array_equal(doubled.get(), np.full(4096, 14, np.int32))
    assert work.wait() is True
    assert work.exception() is None


def test_async_work_keeps_its_arrays_alive_until_done(world: Any) -> None:
    side = cupy.cuda.Stream(non_blocking=True)
    with side:
        x = cupy.zeros(1024, cupy.int32)
        _spin_then_fill(x, 5, seconds=0.3)
        outputs = [cupy.empty_like(x)]
        work = dist.all_gather(outputs, x, async_op=True)
    alive = weakref.ref(x)
    del x
    gc.collect()
    assert alive() is not None  # NCCL may still read it
    assert work.wait(timeout=60) is True  # an explicit timeout blocks the host
    gc.collect()
    assert alive() is None
    np.testing.assert_array_equal(outputs[0].get(), np.full(1024, 5, np.int32))


def test_synchronous_collective_is_stream_ordered(world: Any) -> None:
    # torch's semantics: a synchronous call orders the caller's stream and returns at once.
    # (The world fixture made the communicator: only the calls are timed, not its creation.)
    assert world._comms
    side = cupy.cuda.Stream(non_blocking=True)
    x = cupy.zeros(4096, cupy.int32)
    cupy.cuda.Device().synchronize()
    with side:
        _spin_then_fill(x, 7, seconds=0.5)
        start = time.perf_counter()
        dist.all_reduce(x)  # behind the spinning kernel on the device, not on the host
        work = dist.broadcast(x, src=0, async_op=True)
        assert work.wait() is True
        assert time.perf_counter() - start < 0.2
        assert not work.is_completed()
        doubled = x * 2  # queued after the collectives on the same stream: sees their result
    side.synchronize()
    np.testing.assert_array_equal(doubled.get(), np.full(4096, 14, np.int32))
    assert work.is_completed()


_HUNG_SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    from datetime import timedelta
    import cupy, numpy as np
    from cupy_parallel import distributed as dist
    from cupy_parallel._src.distributed import groups

    mode, path = sys.argv[1], sys.argv[2]
    if mode == "watchdog":  # keep running after the abort, to look at the group
        os.environ["CUPY_PARALLEL_NCCL_ASYNC_ERROR_HANDLING"] = "2"
    spin = cupy.RawKernel(r'''
    extern "C" __global__ void spin(long long cycles) {
        long long start = clock64();
        while (clock64() - start < cycles) { }
    }''', "spin")
    store = dist.FileStore(path, 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1,
                            timeout=timedelta(seconds=2))
    x = cupy.ones(4, cupy.float32)
    dist.all_reduce(x)  # makes the communicator; completes well within the timeout
    cupy.cuda.Device().synchronize()
    cycles = int(6.0 * cupy.cuda.Device().attributes["ClockRate"] * 1000)
    spin((1,), (1,), (np.int64(cycles),))  # the collective below cannot finish for 6 s
    start = time.monotonic()
    if mode == "blocking":
        try:
            dist.all_reduce(x, async_op=True).wait(timeout=1)
        except TimeoutError as error:
            print("TIMEOUT", error, flush=True)
    else:
        work = dist.all_reduce(x, async_op=True)
        assert work.wait() is True and time.monotonic() - start < 1.0  # no host blocking
        backend = groups.state().world._backend
        while backend.failure is None:
            time.sleep(0.01)
        print("ABORTED", 2 <= time.monotonic() - start < 4, flush=True)
        print("WORK", type(work.exception()).__name__, work.exception(), flush=True)
    try:
        dist.all_reduce(x)
    except RuntimeError as error:
        print("UNUSABLE", error, flush=True)
    os._exit(0)
    """
)


def _run(script: str, *args: str, returncode: int = 0) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == returncode, done.stderr
    return done


@real_gpu
def test_watchdog_aborts_a_hung_collective(tmp_path: Any) -> None:
    # A separate process: the aborted communicator must not affect the other tests.
    lines = _run(_HUNG_SCRIPT, "watchdog", str(tmp_path / "store")).stdout.splitlines()
    assert lines[0] == "ABORTED True"  # within the group's 2 s timeout, plus polling
    reason = "all_reduce timed out after 2 s on process group '0' (rank 0 of 1); the watchdog"
    assert lines[1].startswith(f"WORK DistTimeoutError {reason}")
    assert lines[2].startswith(f"UNUSABLE process group '0' is unusable: {reason}")


@real_gpu
def test_blocking_wait_times_out_and_aborts(tmp_path: Any) -> None:
    lines = _run(_HUNG_SCRIPT, "blocking", str(tmp_path / "store")).stdout.splitlines()
    assert lines[0].startswith(
        "TIMEOUT all_reduce on process group '0' did not complete within 1 s"
    )
    assert lines[1].startswith(
        "UNUSABLE process group '0' is unusable: all_reduce was abandoned by a blocking wait()"
    )


@real_gpu
def test_watchdog_abort_ends_the_process_when_a_stream_waits(tmp_path: Any) -> None:
    # The default: the stream that waits on the aborted collective would run on with partial
    # data, so the process ends (SIGABRT) saying why, as torch's default does.
    done = _run(_HUNG_SCRIPT, "teardown", str(tmp_path / "store"), returncode=-6)
    assert re.search(
        r"cupy_parallel: process group '0' \(rank 0 of 1\) was aborted: all_reduce timed out "
        r"after 2 s .* CUDA streams already wait on all_reduce, whose results are partial",
        done.stderr,
    )


_ABSENT_PEER_SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    from datetime import timedelta
    import cupy
    from cupy_parallel import distributed as dist

    rank, path = int(sys.argv[1]), sys.argv[2]
    store = dist.FileStore(path, 2)
    dist.init_process_group("nccl", store=store, rank=rank, world_size=2,
                            timeout=timedelta(seconds=3))
    if rank == 1:  # joins the group, never the collective
        store.wait(["rank 0 done"], timedelta(seconds=120))
        os._exit(0)
    start = time.monotonic()
    try:
        dist.all_reduce(cupy.ones(2))
    except TimeoutError as error:
        print("TIMEOUT", 3 <= time.monotonic() - start < 5, error, flush=True)
    store.set("rank 0 done", b"1")
    os._exit(0)
    """
)


def _run_two_ranks(script: str, store_path: str) -> list[str]:
    """Run ``script`` as ranks 0 and 1 (argv: rank, FileStore path); each must exit 0."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(rank), store_path],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    outs = [p.communicate(timeout=240) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
    return [out for out, _ in outs]


@real_gpu
def test_a_peer_that_never_joins_ends_the_collective_within_the_timeout(tmp_path: Any) -> None:
    outs = _run_two_ranks(_ABSENT_PEER_SCRIPT, str(tmp_path / "store"))
    assert outs[0].startswith(
        "TIMEOUT True NCCL set-up on process group '0' (rank 0 of 2): not every rank joined"
    )


_STALLED_PEER_SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    from datetime import timedelta
    import cupy
    from cupy_parallel import distributed as dist

    os.environ["CUPY_PARALLEL_NCCL_ASYNC_ERROR_HANDLING"] = "2"
    rank, path = int(sys.argv[1]), sys.argv[2]
    cupy.cuda.Device(rank).use()
    store = dist.FileStore(path, 2)
    dist.init_process_group("nccl", store=store, rank=rank, world_size=2,
                            timeout=timedelta(seconds=3))
    x = cupy.ones(1024)
    dist.all_reduce(x)  # both join the communicator
    cupy.cuda.Device().synchronize()
    if rank == 1:  # alive, but never posts the receive
        store.wait(["rank 0 done"], timedelta(seconds=120))
        os._exit(0)
    start = time.monotonic()
    try:
        # NCCL connects send/recv peers lazily, inside this call's groupEnd: without the
        # watchdog covering it, it could block forever.
        dist.send(x, dst=1, async_op=True).wait(timeout=60)
    except TimeoutError as error:
        print("TIMEOUT", 3 <= time.monotonic() - start < 8, error, flush=True)
    store.set("rank 0 done", b"1")
    os._exit(0)
    """
)


@real_gpu
@needs_two
def test_a_peer_that_joined_but_stalls_ends_the_call_within_the_timeout(tmp_path: Any) -> None:
    outs = _run_two_ranks(_STALLED_PEER_SCRIPT, str(tmp_path / "store"))
    assert outs[0].startswith(
        "TIMEOUT True send to group rank 1 timed out after 3 s on process group '0' (rank 0 of 2)"
    )


# ---------------------------------------------------------------------------------------------
# Sizes and streams: the internal stream is ordered against whichever stream the caller uses

STREAMS = ["null", "blocking", "non_blocking", "per_thread"]


def _stream(kind: str) -> Any:
    if kind == "null":
        return cupy.cuda.Stream.null
    if kind == "per_thread":
        return cupy.cuda.Stream.ptds
    return cupy.cuda.Stream(non_blocking=kind == "non_blocking")


@pytest.mark.slow
@pytest.mark.parametrize("kind", STREAMS)
@pytest.mark.parametrize("size", [1, 1000, 1 << 22])  # int32: 4 B to 16 MiB
def test_collectives_follow_the_callers_stream_at_every_size(
    world: Any, kind: str, size: int
) -> None:
    stream = _stream(kind)
    with stream:
        x = cupy.zeros(size, cupy.int32)
        _spin_then_fill(x, 3, seconds=0.05)  # the producer still runs when the call is issued
        dist.all_reduce(x)  # synchronous: stream-ordered, the host does not wait
        outs = [cupy.full(size, -1, cupy.int32)]
        dist.all_gather(outs, x * 2)
        z = outs[0] + 1
        dist.broadcast(z, src=0)
        pieces = [cupy.empty_like(z)]
        dist.all_to_all(pieces, [z])
        total = pieces[0].astype(cupy.int64).sum()
    stream.synchronize()
    assert int(total) == 7 * size


@real_gpu
def test_barrier_blocks_the_host_while_the_gpu_is_busy(world: Any) -> None:
    # torch's barrier blocks the host until the barrier's kernel ran, which waits for the work
    # queued before it on the current stream.
    x = cupy.zeros(1, cupy.int32)
    _spin_then_fill(x, 1, seconds=0.5)
    start = time.perf_counter()
    dist.barrier()
    assert time.perf_counter() - start >= 0.4
    assert int(x[0]) == 1


# ---------------------------------------------------------------------------------------------
# Several GPUs in one process: the *_multigpu forms


@pytest.mark.parametrize("version", ["native", "old"])
@pytest.mark.parametrize("op", NCCL_OPS, ids=lambda op: op.name)
@pytest.mark.parametrize("dtype", ["bool", "int32", "int64", "float32", "float64", "complex64"])
def test_all_reduce_and_reduce_multigpu(world: Any, dtype: str, op: ReduceOp, version: str) -> None:
    _need(2)
    GPUS = cuda_device_count()
    if _refusal(dtype, op) is not None:
        return
    if version == "old":
        world._version = OLD
    hosts = [_sample(dtype, (7,), 10 + k) for k in range(GPUS)]
    expected = _reduce(op, hosts)
    xs = [_on(k, h) for k, h in enumerate(hosts)]
    dist.all_reduce_multigpu(xs, op=op)
    for x in xs:
        _check(x.get(), expected)
    ys = [_on(k, h) for k, h in enumerate(hosts)]
    dist.reduce_multigpu(ys, dst=0, op=op, dst_tensor=GPUS - 1)
    _check(ys[-1].get(), expected)
    for y, h in zip(ys[:-1], hosts[:-1], strict=True):
        np.testing.assert_array_equal(y.get(), h)  # the other arrays keep their values


def test_movement_multigpu(world: Any) -> None:
    _need(2)
    GPUS = cuda_device_count()
    hosts = [_sample("complex128", (3, 2), 20 + k) for k in range(GPUS)]
    xs = [_on(k, h) for k, h in enumerate(hosts)]
    dist.broadcast_multigpu(xs, src=0, src_tensor=1)
    for x in xs:
        np.testing.assert_array_equal(x.get(), hosts[1])
    xs = [_on(k, h) for k, h in enumerate(hosts)]
    outs = [[_on(i, np.zeros_like(hosts[0])) for _ in range(GPUS)] for i in range(GPUS)]
    dist.all_gather_multigpu(outs, xs)
    for row in outs:
        for out, h in zip(row, hosts, strict=True):
            np.testing.assert_array_equal(out.get(), h)


def test_reduce_scatter_multigpu(world: Any) -> None:
    _need(2)
    GPUS = cuda_device_count()
    # inputs[i][j] on GPU i; output j receives the sum over i of inputs[i][j].
    hosts = [[_sample("int64", (4,), 30 + GPUS * i + j) for j in range(GPUS)] for i in range(GPUS)]
    inputs = [[_on(i, h) for h in row] for i, row in enumerate(hosts)]
    outputs = [_on(j, np.zeros(4, np.int64)) for j in range(GPUS)]
    dist.reduce_scatter_multigpu(outputs, inputs)
    for j, out in enumerate(outputs):
        np.testing.assert_array_equal(out.get(), sum(hosts[i][j] for i in range(GPUS)))


# ---------------------------------------------------------------------------------------------
# Two processes, one GPU each: point-to-point and real peers

_PEERS_SCRIPT = textwrap.dedent(
    """
    import sys
    from datetime import timedelta
    import cupy, numpy as np
    from cupy_parallel import distributed as dist
    from cupy_parallel._src.enums import ReduceOp

    rank, path = int(sys.argv[1]), sys.argv[2]
    cupy.cuda.Device(rank).use()
    store = dist.FileStore(path, 2)
    dist.init_process_group("nccl", store=store, rank=rank, world_size=2,
                            timeout=timedelta(seconds=120))
    base = np.arange(-5, 7, dtype=np.int64)
    x = cupy.asarray(base * (rank + 1))
    dist.all_reduce(x, op=ReduceOp.AVG)
    total = base * 3
    np.testing.assert_array_equal(x.get(), np.sign(total) * (np.abs(total) // 2))

    message = np.linspace(0, 1, 9, dtype=np.float32)
    if rank == 0:
        dist.send(cupy.asarray(message), dst=1)
    else:
        got = cupy.zeros(9, cupy.float32)
        assert dist.recv(got, src=0) == 0
        np.testing.assert_array_equal(got.get(), message)

    mine = cupy.full(3, rank + 10, cupy.int16)
    gathered = [cupy.zeros(3, cupy.int16) for _ in range(2)] if rank == 1 else None
    dist.gather(mine, gathered, dst=1)
    if rank == 1:
        assert [int(g[0]) for g in gathered] == [10, 11]

    piece = cupy.zeros(2, cupy.complex64)
    parts = [cupy.full(2, 1 + 2j * r, cupy.complex64) for r in range(2)] if rank == 0 else None
    dist.scatter(piece, parts, src=0)
    np.testing.assert_array_equal(piece.get(), np.full(2, 1 + 2j * rank, np.complex64))

    # all_to_all with sizes that differ per pair: rank r sends r + s + 1 values to rank s.
    inputs = [cupy.full(rank + s + 1, 10 * rank + s, cupy.float64) for s in range(2)]
    outputs = [cupy.zeros(s + rank + 1, cupy.float64) for s in range(2)]
    dist.all_to_all(outputs, inputs)
    for s in range(2):
        np.testing.assert_array_equal(outputs[s].get(), np.full(s + rank + 1, 10 * s + rank))

    solo = dist.new_group([1])
    pair = dist.new_group([0, 1])
    y = cupy.full(2, rank + 1.0)
    if rank == 1:
        dist.all_reduce(y, group=solo)
        assert float(y[0]) == 2.0
    z = cupy.full(2, rank + 1.0)
    dist.all_reduce(z, op=ReduceOp.PRODUCT, group=pair)
    assert float(z[0]) == 2.0
    dist.barrier()
    dist.destroy_process_group()
    print("OK", rank, flush=True)
    """
)


@real_gpu
@needs_two
def test_two_processes_point_to_point_and_subgroups(tmp_path: Any) -> None:
    outs = _run_two_ranks(_PEERS_SCRIPT, str(tmp_path / "store"))
    assert [out.strip() for out in outs] == ["OK 0", "OK 1"]
