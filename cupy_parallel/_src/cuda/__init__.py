"""CUDA plumbing behind :mod:`cupy_parallel._src.comm`: streams, pinned staging, NCCL, copies.

Every module here imports CuPy lazily, only when a CUDA array reaches it, so the package imports
without CuPy. The modules are small and layered: :mod:`.streams` (background copy streams and
event ordering) and :mod:`.pinned` (page-locked staging buffers) underlie :mod:`.transfer`
(host/device/peer copies) and :mod:`.nccl` (communicators and collectives).
"""

from __future__ import annotations
