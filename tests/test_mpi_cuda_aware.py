"""The MPI backend's CUDA-aware branch, run under the simulated CUDA (no GPU, no CUDA-aware MPI).

With ``CUPY_PARALLEL_MPI_CUDA_AWARE=1`` inside ``simulated_cuda`` the simulator plays a CUDA-aware
MPI (``simcuda/sim_mpi.py``): device arrays go to MPI as the host memory behind them, and any
device work on a buffer not finished when it is handed to MPI, or queued on it before MPI's
completion, is a ``RaceError``. MPI runs here as a singleton (a world of one, in process);
``test_mpi_collectives.py`` runs the same branch with two and three processes.

Every collective (the ``*_multigpu`` forms on two simulated GPUs too) against NumPy, in float64,
float32 and float16, on the default and on non-blocking current streams; and the defects the
branch had (issue 24: the stream synchronised before the primitive queued its work, only the
current GPU's stream synchronised, work launched on the current GPU for another GPU's array),
each shown to be caught by the simulator.
"""

from __future__ import annotations

import contextlib
import warnings
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

from cupy_parallel import distributed as dist
from cupy_parallel._src.distributed import mpi_staging
from cupy_parallel._src.simcuda import SimulationError, sim_mpi
from cupy_parallel.distributed import ReduceOp
from cupy_parallel.testing import RaceError, simulated_cuda

if TYPE_CHECKING:
    from collections.abc import Iterator

DTYPES = [np.float64, np.float32, np.float16]
RTOL = {np.float64: 1e-12, np.float32: 1e-6, np.float16: 1e-3}


@contextlib.contextmanager
def _world_of_one(cuda_aware: str) -> Iterator[None]:
    """A world of one with ``CUPY_PARALLEL_MPI_CUDA_AWARE=cuda_aware`` (the probe re-read)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CUPY_PARALLEL_MPI_CUDA_AWARE", cuda_aware)
        mpi_staging._process_mpi_is_cuda_aware.cache_clear()  # the probe, cached per process
        dist.init_process_group("mpi", world_size=1, timeout=timedelta(seconds=20))
        try:
            yield
        finally:
            dist.destroy_process_group()
            mpi_staging._process_mpi_is_cuda_aware.cache_clear()


@contextlib.contextmanager
def _emulating(library: str) -> Iterator[None]:
    previous = sim_mpi.emulate(library)
    try:
        yield
    finally:
        sim_mpi.emulate(previous)


@pytest.fixture
def aware() -> Iterator[None]:
    """A world of one whose MPI is (simulated) CUDA-aware: MPICH, which takes device memory in
    every non-blocking call the backend posts (reductions with predefined operations)."""
    with _world_of_one("1"), _emulating("mpich"), warnings.catch_warnings():
        warnings.simplefilter("error")  # the staging note would be an error: never staged
        yield


@pytest.fixture(params=sorted(sim_mpi.DEVICE_CALLS))
def library(request: pytest.FixtureRequest) -> Iterator[str]:
    """A world of one whose (simulated) CUDA-aware MPI is each documented library in turn."""
    with _world_of_one("1"), _emulating(request.param), warnings.catch_warnings():
        warnings.simplefilter("error")  # staging what the library cannot take says nothing
        yield request.param


@pytest.fixture
def staging() -> Iterator[None]:
    """A world of one whose MPI is not CUDA-aware (CuPy arrays are staged through the host)."""
    with _world_of_one("0"), warnings.catch_warnings():
        # the one-time staging note, said by the first test that stages
        warnings.filterwarnings("ignore", "cupy_parallel MPI backend: .* copied through host")
        yield


def values(seed: int, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.uniform(-4, 4, shape).astype(dtype)


def on(cp: Any, host: np.ndarray, device: int) -> Any:
    with cp.cuda.Device(device):
        return cp.asarray(host)


def same(cp: Any, got: Any, expected: np.ndarray, dtype: Any) -> None:
    with got.device:  # read on its GPU's current stream
        host = cp.asnumpy(got)
    assert host.dtype == np.dtype(dtype)
    np.testing.assert_allclose(host, expected, rtol=RTOL[dtype], atol=RTOL[dtype])


def use_streams(cp: Any, kind: str) -> None:
    """Make a fresh non-blocking stream current on every GPU (``kind == "non-blocking"``)."""
    if kind == "non-blocking":
        for device in range(2):
            with cp.cuda.Device(device):
                cp.cuda.Stream(non_blocking=True).use()


def single_device_collectives(cp: Any, dtype: Any) -> None:
    x = values(1, (5,), dtype)
    for op, expected in [(ReduceOp.SUM, x), (ReduceOp.AVG, x), (ReduceOp.MAX, x)]:
        got = cp.asarray(x)
        dist.all_reduce(got, op=op)
        same(cp, got, expected, dtype)
    got = cp.asarray(x)
    dist.broadcast(got, src=0)
    same(cp, got, x, dtype)
    got = cp.asarray(x)
    dist.reduce(got, dst=0, op=ReduceOp.SUM)
    same(cp, got, x, dtype)
    outs = [cp.zeros(5, dtype)]
    dist.all_gather(outs, cp.asarray(x), async_op=True).wait()
    same(cp, outs[0], x, dtype)
    outs = [cp.zeros(5, dtype)]
    dist.gather(cp.asarray(x), outs, dst=0)
    same(cp, outs[0], x, dtype)
    z = cp.zeros(5, dtype)
    dist.scatter(z, [cp.asarray(x)], src=0)
    same(cp, z, x, dtype)
    z = cp.zeros(5, dtype)
    dist.reduce_scatter(z, [cp.asarray(x)])
    same(cp, z, x, dtype)
    outs = [cp.zeros(5, dtype)]
    dist.all_to_all(outs, [cp.asarray(x)])
    same(cp, outs[0], x, dtype)
    pair = [cp.asarray(np.arange(3, dtype=np.int16)), cp.asarray(x)]
    dist.all_reduce_coalesced(pair, op=ReduceOp.AVG)
    same(cp, pair[1], x, dtype)
    np.testing.assert_array_equal(cp.asnumpy(pair[0]), np.arange(3, dtype=np.int16))
    lists = [[cp.zeros(5, dtype)]]
    dist.all_gather_coalesced(lists, [cp.asarray(x)])
    same(cp, lists[0][0], x, dtype)


def multigpu_collectives(cp: Any, dtype: Any) -> None:
    """The ``*_multigpu`` forms, one array on each of the two GPUs (participants = GPUs here)."""
    a, b = values(2, (2, 3), dtype), values(3, (2, 3), dtype)
    total = (a.astype(np.float64) + b.astype(np.float64)).astype(dtype)
    xs = [on(cp, a, 0), on(cp, b, 1)]
    dist.all_reduce_multigpu(xs)
    for x in xs:
        same(cp, x, total, dtype)
    xs = [on(cp, a, 0), on(cp, b, 1)]
    dist.all_reduce_multigpu(xs, op=ReduceOp.AVG)
    for x in xs:
        same(cp, x, (total.astype(np.float64) / 2).astype(dtype), dtype)
    xs = [on(cp, a, 0), on(cp, b, 1)]
    dist.reduce_multigpu(xs, dst=0, dst_tensor=0)
    same(cp, xs[0], total, dtype)
    same(cp, xs[1], b, dtype)
    xs = [on(cp, a, 0), on(cp, b, 1)]
    dist.reduce_multigpu(xs, dst=0, dst_tensor=1, op=ReduceOp.MAX)
    same(cp, xs[1], np.maximum(a, b), dtype)
    xs = [on(cp, a, 0), on(cp, b, 1)]
    dist.broadcast_multigpu(xs, src=0, src_tensor=1)
    for x in xs:
        same(cp, x, b, dtype)
    outs = [[on(cp, np.zeros((2, 3), dtype), i) for _ in range(2)] for i in range(2)]
    dist.all_gather_multigpu(outs, [on(cp, a, 0), on(cp, b, 1)])
    for i in range(2):
        same(cp, outs[i][0], a, dtype)
        same(cp, outs[i][1], b, dtype)
        assert outs[i][0].device.id == i
    c, d = values(4, (2, 3), dtype), values(5, (2, 3), dtype)
    ins = [[on(cp, a, 0), on(cp, b, 0)], [on(cp, c, 1), on(cp, d, 1)]]
    outs = [on(cp, np.zeros((2, 3), dtype), 0), on(cp, np.zeros((2, 3), dtype), 1)]
    dist.reduce_scatter_multigpu(outs, ins)
    same(cp, outs[0], (a.astype(np.float64) + c).astype(dtype), dtype)
    same(cp, outs[1], (b.astype(np.float64) + d).astype(dtype), dtype)


@pytest.mark.parametrize("streams", ["default", "non-blocking", "per-thread"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: np.dtype(t).name)
def test_every_collective_through_a_cuda_aware_mpi(aware: None, dtype: Any, streams: str) -> None:
    with simulated_cuda(2, per_thread_default_stream=streams == "per-thread") as cp:
        use_streams(cp, streams)
        single_device_collectives(cp, dtype)
        with cp.cuda.Device(1):  # the arrays on the GPU that is not the current one at entry
            single_device_collectives(cp, dtype)
        multigpu_collectives(cp, dtype)
        with cp.cuda.Device(1):
            multigpu_collectives(cp, dtype)


@pytest.mark.parametrize("streams", ["default", "non-blocking", "per-thread"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=lambda t: np.dtype(t).name)
def test_every_collective_staged_through_the_host(staging: None, dtype: Any, streams: str) -> None:
    """The staging branch with arrays on several GPUs: each copied on its own GPU's stream."""
    with simulated_cuda(2, per_thread_default_stream=streams == "per-thread") as cp:
        use_streams(cp, streams)
        single_device_collectives(cp, dtype)
        multigpu_collectives(cp, dtype)


def test_staging_copies_each_array_on_its_own_gpus_stream(staging: None) -> None:
    """Defect 2 (staging): ``arg.get()`` copied on the current GPU's stream, not the array's.

    An array of GPU 1 written on GPU 1's (non-blocking) stream, GPU 0 current: its copy to the
    host must wait for that stream.
    """
    with simulated_cuda(2) as cp:
        xs = []
        for device in range(2):
            with cp.cuda.Device(device):
                cp.cuda.Stream(non_blocking=True).use()
                x = cp.ones(3, np.float32)
                x *= device + 1  # pending on this GPU's stream
                xs.append(x)
        dist.all_reduce_multigpu(xs)
        for x in xs:
            same(cp, x, np.full(3, 3, np.float32), np.float32)


def old_ordering(monkeypatch: pytest.MonkeyPatch) -> None:
    """No synchronisation at posting (the caller synchronises before the call, as before)."""

    class Unsynchronized:
        def synchronize(self) -> None:
            pass

    monkeypatch.setattr(mpi_staging, "current_stream", lambda device: Unsynchronized())


CALLS = {  # (x on GPU 0, y on GPU 1)
    "float16 all_reduce": lambda cp, x, y: dist.all_reduce(x),  # accumulated in float32
    "all_gather": lambda cp, x, y: dist.all_gather([cp.zeros_like(x)], x),
    "gather": lambda cp, x, y: dist.gather(x, [cp.zeros_like(x)], dst=0),
    "all_to_all": lambda cp, x, y: dist.all_to_all([cp.zeros_like(x)], [x]),
    "all_reduce_multigpu": lambda cp, x, y: dist.all_reduce_multigpu([x, y]),
}


@pytest.mark.parametrize("case", list(CALLS))
def test_work_queued_before_posting_is_a_race_without_the_synchronisation(
    aware: None, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    """Defect 1: the primitive's zero-fills, casts and packing must end before MPI gets them.

    With the synchronisation taken out of the posting (every GPU synchronised before the
    primitive queued its work, as before the fix) the simulated CUDA-aware MPI reports the race.
    """
    old_ordering(monkeypatch)
    dtype = np.float16 if case.startswith("float16") else np.float32
    with simulated_cuda(2) as cp:
        x, y = on(cp, np.arange(4, dtype=dtype), 0), on(cp, np.ones(4, dtype), 1)
        for device in range(2):
            cp.cuda.Device(device).synchronize()  # what the old code did before the primitive
        with pytest.raises(RaceError, match=r"by `MPI_I\w+ on a CUDA-aware MPI \(rank 0\)`"):
            CALLS[case](cp, x, y)


def test_the_synchronisation_covers_every_gpu(aware: None) -> None:
    """Defect 2 (CUDA-aware): every GPU holding a buffer is synchronised, not the current one.

    The array of GPU 1 is written on GPU 1's non-blocking stream while GPU 0 is current.
    """
    with simulated_cuda(2) as cp:
        with cp.cuda.Device(1):
            cp.cuda.Stream(non_blocking=True).use()
            x = cp.ones(4, np.float32)
            x += 1  # pending on GPU 1's stream
        dist.all_reduce(x, op=ReduceOp.AVG)
        same(cp, x, np.full(4, 2, np.float32), np.float32)


def test_only_the_current_gpus_stream_synchronised_is_a_race(
    aware: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Defect 2 shown: synchronising the current GPU's stream only leaves GPU 1's work pending."""

    class CurrentGpuOnly:
        def synchronize(self) -> None:
            from cupy_parallel._src.devices import cupy_module

            cupy = cupy_module()
            with cupy.cuda.Device(0):  # the GPU current at the call
                cupy.cuda.get_current_stream().synchronize()

    monkeypatch.setattr(mpi_staging, "current_stream", lambda device: CurrentGpuOnly())
    with simulated_cuda(2) as cp:
        with cp.cuda.Device(1):
            cp.cuda.Stream(non_blocking=True).use()
            x = cp.ones(4, np.float32)
            x += 1
        with pytest.raises(RaceError, match=r"cuda:1 .* `MPI_Iallreduce"):
            dist.all_reduce(x)


def test_device_work_before_completion_is_a_race(aware: None) -> None:
    """MPI may write the array until the request is found complete: a kernel before is a race."""
    with simulated_cuda(1) as cp:
        x = cp.ones(4, np.float32)
        work = dist.all_reduce(x, async_op=True)
        with pytest.raises(RaceError, match=r"`MPI_Iallreduce on a CUDA-aware MPI \(rank 0\)`"):
            x += 1
        work.wait()
        x += 1  # ordered after MPI's completion
        np.testing.assert_array_equal(cp.asnumpy(x), np.full(4, 3, np.float32))


def test_host_arrays_pass_through_after_device_ones(aware: None) -> None:
    """The wrapped communicator hands NumPy arrays to MPI as before, inside and outside."""
    with simulated_cuda(1) as cp:
        x = cp.ones(2)
        dist.all_reduce(x)
        y = np.ones(2)
        dist.all_reduce(y)
        np.testing.assert_array_equal(y, np.ones(2))
    z = np.arange(3.0)
    dist.all_reduce(z, op=ReduceOp.AVG)
    np.testing.assert_array_equal(z, np.arange(3.0))


# ---------------------------------------------------------------------------------------------
# Per MPI library: what its CUDA-aware MPI takes on device memory, the rest staged (issue 37)


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=lambda t: np.dtype(t).name)
def test_every_collective_per_mpi_library(library: str, dtype: Any) -> None:
    """The simulated MPI refuses device memory where its library does (DEVICE_CALLS)."""
    with simulated_cuda(2, per_thread_default_stream=True) as cp:
        use_streams(cp, "non-blocking")
        single_device_collectives(cp, dtype)
        multigpu_collectives(cp, dtype)
        x = cp.asarray(values(7, (6,), dtype))
        for op, want in [(ReduceOp.MIN, cp.asnumpy(x)), (ReduceOp.MAX, cp.asnumpy(x))]:
            got = x.copy()  # float MIN/MAX: the user operation, always staged
            dist.all_reduce(got, op=op)
            same(cp, got, want, dtype)


@pytest.mark.parametrize(
    ("name", "call"),
    [
        ("Iallreduce", dist.all_reduce),
        ("Ibcast", lambda x: dist.broadcast(x, src=0)),
        ("Iallgather", lambda x: dist.all_gather([x.copy()], x)),
    ],
)
def test_the_simulated_open_mpi_refuses_device_memory_in_nonblocking_collectives(
    name: str, call: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the per-library table (every primitive on device) Open MPI's refusal shows."""
    monkeypatch.setitem(mpi_staging.ON_DEVICE, "openmpi", frozenset(mpi_staging.ON_DEVICE["mpich"]))
    with _world_of_one("1"), _emulating("openmpi"), simulated_cuda(1) as cp:
        x = cp.ones(4, np.float32)
        with pytest.raises(SimulationError, match=rf"MPI_{name} was handed device memory.*openmpi"):
            call(x)


def test_the_simulated_mpi_refuses_a_user_operation_on_device_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """MPICH takes reductions on device memory, but not with our MIN/MAX host function."""
    monkeypatch.setattr(mpi_staging, "_on_device", lambda primitive, args: True)
    with _world_of_one("1"), _emulating("mpich"), simulated_cuda(1) as cp:
        x = cp.ones(4, np.float32)
        with pytest.raises(SimulationError, match="MPI_Iallreduce with a user-defined operation"):
            dist.all_reduce(x, op=ReduceOp.MAX)


@pytest.mark.parametrize("emulated", sorted(sim_mpi.DEVICE_CALLS))
def test_point_to_point_stays_on_device_for_every_library(
    emulated: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sends and receives still hand MPI the device array: a kernel before completion races."""
    monkeypatch.setenv("CUPY_PARALLEL_MPI_CUDA_AWARE", "1")
    with _emulating(emulated), simulated_cuda(2) as cp:

        def program(rank: int) -> np.ndarray:
            x = cp.full(4, rank + 1, np.float32)
            if rank == 0:
                work = dist.isend(x, dst=1)
                with pytest.raises(RaceError, match=r"`MPI_Isend on a CUDA-aware MPI"):
                    x += 1
                work.wait()
            else:
                dist.irecv(x, src=0).wait()
            return cp.asnumpy(x)

        results = dist.spawn(program, 2, timeout=10)
    np.testing.assert_array_equal(results[1], np.ones(4, np.float32))


def test_the_library_is_read_from_the_mpi_version_string(monkeypatch: pytest.MonkeyPatch) -> None:
    cases = {
        "Open MPI v4.1.5, package: Open MPI": "openmpi",
        "MPICH Version:      4.1.2": "mpich",
        "MVAPICH2 Version      :\t2.3.7 (MPICH 3.2.1)": "mvapich",
        "Intel(R) MPI Library 2021.10": "unknown",
    }
    for text, want in cases.items():
        mpi_staging._process_mpi_library.cache_clear()
        fake = type("FakeMPI", (), {"Get_library_version": staticmethod(lambda text=text: text)})
        monkeypatch.setattr(mpi_staging, "load_mpi", lambda fake=fake: fake)
        assert mpi_staging._process_mpi_library() == want
    mpi_staging._process_mpi_library.cache_clear()
