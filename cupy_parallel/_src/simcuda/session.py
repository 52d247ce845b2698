"""``simulated_cuda(n_devices)``: run the library on a simulated CUDA machine.

Public as :func:`cupy_parallel.testing.simulated_cuda`.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import TYPE_CHECKING

from cupy_parallel._src.arguments import read_bool, read_int
from cupy_parallel._src.cuda import nccl_comm, pinned, streams
from cupy_parallel._src.devices import substitute_cupy
from cupy_parallel._src.simcuda import clock, xp

if TYPE_CHECKING:
    from collections.abc import Iterator
    from types import ModuleType

__all__ = ["simulated_cuda"]


@contextlib.contextmanager
def simulated_cuda(
    n_devices: int, /, *, per_thread_default_stream: bool | None = None
) -> Iterator[ModuleType]:
    """Make the library see CUDA with ``n_devices`` simulated GPUs inside the block.

    ``cupy_parallel``'s CuPy becomes a stand-in (yielded, use it as ``cupy``) whose device memory
    is host memory and whose arithmetic is NumPy's; ``platform()`` is ``"cuda"`` and
    ``devices()`` lists ``cuda:0`` … ``cuda:{n-1}``. Streams, events, the legacy null stream's
    implicit synchronisation, per-thread default streams, pinned memory and CuPy's pool reuse
    rule (a freed block goes to the next allocation on the same stream, without a sync) follow
    CUDA, and every access to device or pinned memory is checked against the accesses before it:
    an access not ordered after a conflicting one raises ``RaceError`` naming both operations and
    their streams. Work completes only when the host waits for it (``Event.done`` is ``False``
    until then), the most adversarial schedule. Races found where nothing can raise (memory
    freed while in use) are raised when the block ends. Everything is restored on exit.

    The MPI backend stages the stand-in's arrays through host memory, as for an MPI that is not
    CUDA-aware; with ``CUPY_PARALLEL_MPI_CUDA_AWARE=1`` it hands them to a simulated CUDA-aware
    MPI instead, which reads and writes their memory itself and reports device work on it that
    is not finished when MPI gets it, or is queued before MPI completes, as ``RaceError``.

    Args:
        n_devices: How many GPUs to simulate (at least 1).
        per_thread_default_stream: Whether the default stream is each thread's per-thread
            default stream (``Stream.ptds``) rather than the legacy null stream; ``None`` reads
            ``CUPY_CUDA_PER_THREAD_DEFAULT_STREAM`` (``"1"`` means yes), as CuPy does.
            ``CUPY_PARALLEL_SIMULATED_STREAMS=non-blocking`` (for test suites run off the legacy
            stream) instead starts every thread with a non-blocking stream of its own current
            on each GPU, as a program that makes one current in each of its threads.

    Raises:
        TypeError, ValueError: for a bad argument; ``RuntimeError`` when simulations nest.

    Example:
        >>> import numpy as np
        >>> import cupy_parallel
        >>> from cupy_parallel.testing import simulated_cuda
        >>> with simulated_cuda(2) as cupy:
        ...     x = cupy_parallel.to_device(np.arange(3.0), "cuda:1")
        ...     with cupy.cuda.Device(1):
        ...         y = x * 2
        ...     cupy_parallel.devices(), cupy_parallel.to_device(y, "cpu")
        ([Device('cuda:0'), Device('cuda:1')], array([0., 2., 4.]))
        >>> cupy_parallel.platform()
        'host'
    """
    count = read_int(n_devices, "n_devices", minimum=1)
    if per_thread_default_stream is None:
        ptds = os.environ.get("CUPY_CUDA_PER_THREAD_DEFAULT_STREAM", "0").strip() == "1"
    else:
        ptds = read_bool(per_thread_default_stream, "per_thread_default_stream")
    simulation = clock.Simulation(count, per_thread_default_stream=ptds)
    if os.environ.get("CUPY_PARALLEL_SIMULATED_STREAMS", "").strip() == "non-blocking":
        simulation.extensions["threads_start_non_blocking"] = True
    clock.activate(simulation)
    streams.forget_background_streams()
    module = sys.modules[xp.__name__]
    try:
        with substitute_cupy(module):
            yield module
    finally:
        with simulation.lock:
            simulation.finish()
        nccl_comm.destroy_communicators()  # comm's NCCL communicators live in this simulation
        clock.deactivate(simulation)  # first: what is dropped below is not freed into it
        pinned.forget_in_flight()
        streams.forget_background_streams()
    if simulation.deferred:
        raise simulation.deferred[0]
