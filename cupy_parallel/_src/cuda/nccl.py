"""NCCL for the whole library: the loader, "is NCCL available", and ``comm``'s collectives.

One vocabulary: :func:`nccl_module` is the only place that loads ``cupy.cuda.nccl`` (CuPy warns
when libnccl is missing, so the import is silenced here and the reason is reported by
:func:`unavailable_reason` instead), :func:`is_available` is the one meaning of "NCCL is
available" (CuPy, its libnccl, and a visible GPU; used by ``comm``, the ``"nccl"`` process-group
backend and ``cupy-parallel info``), and dtypes and reductions go through
:mod:`.nccl_tables`. Under ``cupy_parallel.testing.simulated_cuda`` the simulated CuPy brings its
own ``cuda.nccl``, which the loader returns.

torch's ``comm`` uses NCCL for ``broadcast`` and ``reduce_add`` whenever every tensor is a dense,
contiguous CUDA tensor on a distinct GPU; otherwise it falls back to peer copies. This module
does the same: :func:`broadcast_into` and :func:`reduce` run one grouped collective
(``groupStart``/``groupEnd``) on each GPU's current stream and report through their eligibility
checks when the caller must fall back.

Decisions:

- Serialised like torch's ``AutoNcclGroup``: one process-wide lock is held from ``groupStart``
  to ``groupEnd`` (and while ``initAll`` makes communicators), so two threads never interleave
  their calls on the cached communicators (NCCL requires every member to issue its calls in the
  same order; interleaved groups deadlock or mix data).
- Reductions are NCCL's typed kernels on the array's own dtype (:func:`.nccl_tables.reduction`
  with ``SUM``): ``float16`` is summed *in float16* by NCCL, not widened; ``bool`` is a logical
  or; complex numbers are summed as pairs of reals. dtypes NCCL cannot sum (int16, uint16, ...)
  fall back to peer copies and a sum on the target GPU, which is exact the same way.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import warnings
from typing import TYPE_CHECKING, Any

from cupy_parallel._src.arrays import device_of, empty
from cupy_parallel._src.cuda.nccl_tables import reduction
from cupy_parallel._src.cuda.streams import current_stream
from cupy_parallel._src.devices import _cuda_device_count, cupy_module
from cupy_parallel._src.enums import ReduceOp

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence
    from types import ModuleType

    from cupy_parallel._src.cuda.nccl_tables import Reduction
    from cupy_parallel._src.devices import Device

__all__ = [
    "broadcast_into",
    "can_reduce",
    "communicators",
    "group",
    "is_available",
    "nccl_module",
    "nccl_version",
    "reduce",
    "unavailable_reason",
]

_group_lock = threading.RLock()  # held from groupStart to groupEnd (torch's AutoNcclGroup)
_communicators: dict[tuple[int, ...], list[Any]] = {}
_loaded: dict[str, ModuleType | None] = {}  # the import of the real cupy.cuda.nccl, once


def nccl_module() -> ModuleType | None:
    """``cupy.cuda.nccl`` when CuPy is installed and its libnccl loads, else ``None``.

    Under the simulated CUDA this is the simulated NCCL.

    Example:
        >>> m = nccl_module()
        >>> m is None or bool(m.available)
        True
    """
    cupy = cupy_module()
    if cupy is None:
        return None
    if sys.modules.get("cupy") is not cupy:  # a stand-in CuPy carries its own NCCL
        own = getattr(cupy.cuda, "nccl", None)
        return own if own is not None and getattr(own, "available", False) else None
    if "nccl" not in _loaded:
        _loaded["nccl"] = _import_nccl()
    return _loaded["nccl"]


def _import_nccl() -> ModuleType | None:
    with warnings.catch_warnings():
        # CuPy warns when libnccl is missing; unavailable_reason() reports it instead.
        warnings.simplefilter("ignore")
        try:
            from cupy.cuda import nccl
        except ImportError:
            return None
    return nccl if getattr(nccl, "available", False) else None


def _nccl_package(cupy: Any) -> str:
    """The pip package that brings libnccl for the CUDA major version CuPy was built for."""
    try:
        major = int(cupy.cuda.runtime.runtimeGetVersion()) // 1000
    except Exception:  # noqa: BLE001 - no runtime library at all: name the common case
        major = 12
    return f"nvidia-nccl-cu{major}"


def unavailable_reason() -> str | None:
    """Why NCCL cannot be used here, or ``None`` when it can (see :func:`is_available`).

    Example:
        >>> reason = unavailable_reason()
        >>> reason is None or "NCCL" in reason or "CuPy" in reason
        True
    """
    cupy = cupy_module()
    if cupy is None:
        return "CuPy is not installed; install it with `pip install cupy-parallel[cuda12]`."
    if nccl_module() is None:
        return (
            "CuPy is installed, but its NCCL library (libnccl) cannot be loaded; install NCCL "
            f"for CuPy's CUDA version (`pip install {_nccl_package(cupy)}`)."
        )
    if _cuda_device_count() == 0:
        return (
            "CuPy and NCCL load, but CuPy sees no GPU (no CUDA device is visible: check the "
            "driver with `nvidia-smi` and CUDA_VISIBLE_DEVICES, or use the 'mpi' backend)."
        )
    return None


def is_available() -> bool:
    """Whether NCCL can be used: CuPy is installed, its libnccl loads, and a GPU is visible.

    The one meaning of "NCCL is available" in the library (``comm``, the ``"nccl"`` backend,
    ``is_nccl_available``, ``cupy-parallel info``).

    Example:
        >>> is_available() in (True, False)
        True
    """
    return unavailable_reason() is None


def nccl_version(nccl: Any, /) -> int:
    """The NCCL version code features are gated on: the older of the built and loaded ones.

    Example:
        >>> import types
        >>> nccl_version(types.SimpleNamespace(get_version=lambda: 21805,
        ...                                    get_build_version=lambda: 2708))
        2708
    """
    return min(int(nccl.get_version()), int(nccl.get_build_version()))


def _modules() -> tuple[ModuleType, ModuleType]:
    nccl, cupy = nccl_module(), cupy_module()
    if nccl is None or cupy is None:
        raise RuntimeError(f"NCCL is not available: {unavailable_reason()}")
    return nccl, cupy


@contextlib.contextmanager
def group(nccl: Any, /) -> Iterator[None]:
    """``groupStart`` ... ``groupEnd`` under the process-wide NCCL lock (torch's AutoNcclGroup).

    Every grouped call of ``comm`` runs inside this, so threads never interleave their calls on
    the cached communicators. The lock is re-entrant (``initAll`` inside a group is fine).
    """
    with _group_lock:  # until groupEnd
        nccl.groupStart()
        try:
            yield
        finally:
            nccl.groupEnd()


def communicators(device_ids: tuple[int, ...]) -> list[Any]:
    """One ``NcclCommunicator`` per GPU of ``device_ids`` (rank = position), created once."""
    nccl, _ = _modules()
    with _group_lock:
        comms = _communicators.get(device_ids)
        if comms is None:
            comms = _communicators[device_ids] = nccl.NcclCommunicator.initAll(list(device_ids))
    return comms


def _eligible(arrays: Sequence[Any]) -> bool:
    """NCCL applies: at least two C-contiguous CUDA arrays on distinct GPUs, and NCCL loads."""
    if len(arrays) < 2:
        return False
    places = [device_of(x) for x in arrays]
    if any(p.kind != "cuda" for p in places) or len(set(places)) != len(places):
        return False
    return all(x.flags.c_contiguous for x in arrays) and nccl_module() is not None


def broadcast_into(source: Any, outs: Sequence[Any]) -> bool:
    """Broadcast ``source`` into ``outs`` with NCCL; ``False`` (nothing done) when NCCL can't.

    The bytes are broadcast as ``uint8``, so every dtype travels bit for bit.
    """
    buffers = [source, *outs]
    if not outs or device_of(source).kind != "cuda" or not _eligible(buffers):
        return False
    if source.nbytes == 0:
        return True
    nccl, cupy = _modules()
    ids = tuple(device_of(b).index for b in buffers)
    comms = communicators(ids)
    with group(nccl):
        for comm, buffer, device in zip(comms, buffers, ids, strict=True):
            with cupy.cuda.Device(device):
                stream = current_stream(device)
                comm.bcast(buffer.data.ptr, buffer.nbytes, nccl.NCCL_UINT8, 0, stream.ptr)
    return True


def _sum_plan(dtype: Any) -> Reduction | None:
    """How NCCL sums ``dtype`` (:mod:`.nccl_tables`), or ``None`` when it cannot."""
    nccl = nccl_module()
    if nccl is None:
        return None
    try:
        return reduction(dtype, ReduceOp.SUM, nccl_version(nccl))
    except (TypeError, NotImplementedError):  # int16, bfloat16 on an old NCCL: peer copies
        return None


def can_reduce(inputs: Sequence[Any], target: Device) -> bool:
    """Whether :func:`reduce` applies: NCCL-eligible inputs of an NCCL-summable dtype on target."""
    return (
        _eligible(inputs)
        and _sum_plan(inputs[0].dtype) is not None
        and any(device_of(x) == target for x in inputs)
    )


def reduce(inputs: Sequence[Any], target: Device) -> Any:
    """The elementwise sum of ``inputs`` on ``target`` (one of their GPUs), by one NCCL reduce."""
    nccl, cupy = _modules()
    first = inputs[0]
    out: Any = empty(first.shape, first.dtype, target)  # a cupy.ndarray (untyped)
    if first.size == 0:
        return out
    plan = _sum_plan(first.dtype)
    if plan is None:
        raise TypeError(f"NCCL cannot sum {first.dtype} arrays; check can_reduce() first.")
    count = first.size * plan.lanes
    ids = tuple(device_of(x).index for x in inputs)
    root = ids.index(target.index)
    comms = communicators(ids)
    with group(nccl):
        for rank, (comm, x, device) in enumerate(zip(comms, inputs, ids, strict=True)):
            with cupy.cuda.Device(device):
                stream = current_stream(device)
                receive = out.data.ptr if rank == root else x.data.ptr
                comm.reduce(
                    x.data.ptr, receive, count, int(plan.datatype), int(plan.op), root, stream.ptr
                )
    return out
