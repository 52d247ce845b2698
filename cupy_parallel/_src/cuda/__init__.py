"""CUDA plumbing behind :mod:`cupy_parallel._src.comm`: streams, pinned staging, NCCL, copies.

Every module here imports CuPy lazily, only when a CUDA array reaches it, so the package imports
without CuPy. The modules are small and layered: :mod:`.streams` (background copy streams, the
one "stream A waits for stream B" helper, the per-thread stream hand-off) and :mod:`.pinned`
(page-locked staging buffers) underlie :mod:`.copies` (the four CUDA copies, each ordered
against the current streams); these three use only :mod:`cupy_parallel._src.devices`, and
:func:`cupy_parallel._src.arrays.copy_into`, the one raw move, moves CUDA data through them.
:mod:`.nccl_runtime` (the loader, availability, the grouped-launch lock and the communicator
cache) is the one NCCL runtime, under :mod:`.nccl_comm` (``comm``'s NCCL broadcast and reduce)
and the process-group backend; ``comm``'s broadcast and reduce buffers are
:mod:`cupy_parallel._src.comm_transfer`. Every CUDA path runs in the tests on the simulated CUDA
(:mod:`cupy_parallel._src.simcuda`), whose race checker fails a test on any unordered access.
"""

from __future__ import annotations
