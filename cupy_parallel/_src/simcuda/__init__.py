"""A simulated CUDA for tests: the part of CuPy this library uses, with a race checker.

``simulated_cuda(n)`` (public as :func:`cupy_parallel.testing.simulated_cuda`) makes the library
see CUDA with ``n`` GPUs: ``cupy_module()`` returns :mod:`.xp` (a stand-in for ``cupy``),
``platform()`` is ``"cuda"``. Device memory is host memory, arithmetic is NumPy's, and every
device operation is stamped with a vector clock (:mod:`.clock`); every access to device or
pinned memory is checked to happen after the conflicting accesses before it (:mod:`.memory`),
and a race raises :class:`RaceError` naming both operations and their streams.

Modules, bottom up: :mod:`.cargs` (C integer arguments, converted as CuPy's Cython converts
them), :mod:`.clock` (timelines, vector clocks, host synchronisation),
:mod:`.memory` (blocks, regions, the race checker, the pools), :mod:`.streams` (``Device``,
``Stream``, ``Event``, current device and streams per thread), :mod:`.pointers` (``Memory``,
``MemoryPointer``, pinned memory, every copy), :mod:`.ndarray` (the array and kernels),
:mod:`.runtime`, :mod:`.cuda` and :mod:`.xp` (the ``cupy.cuda.runtime``, ``cupy.cuda`` and
``cupy`` namespaces), :mod:`.session` (``simulated_cuda``). An NCCL add-on lives in
``sim_nccl.py`` (``cupy.cuda.nccl``); it can keep per-simulation state in ``state().extensions``.
A CUDA-aware MPI lives in ``sim_mpi.py`` (the MPI backend uses it when
``CUPY_PARALLEL_MPI_CUDA_AWARE=1``).
"""

from __future__ import annotations

from cupy_parallel._src.simcuda.clock import RaceError, SimulationError
from cupy_parallel._src.simcuda.session import simulated_cuda

__all__ = ["RaceError", "SimulationError", "simulated_cuda"]
