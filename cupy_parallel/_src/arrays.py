"""Arrays on devices: which arrays this library places, where they live, and the raw move.

Three kinds of arrays are placed: ``numpy.ndarray`` on the ``"cpu"``, :class:`HostArray` on a
simulated ``"host:k"`` device, ``cupy.ndarray`` on ``"cuda:k"``; their static type is
:data:`Array`. :func:`copy_into` is the one raw copy between devices (whatever devices the two
arrays live on), :func:`move` puts an array the library holds on a device through it, and
:func:`to_device` is the same move for any input, checked; the public
``cupy_parallel.to_device`` is that move recorded on the tape.

``Array`` is ``numpy.ndarray | HostArray | cupy.ndarray``. At run time it is a class that
cannot be instantiated and whose ``isinstance`` is :func:`is_array`; for type checkers
``cupy.ndarray`` is the stand-in :class:`~cupy_parallel._src.arraytypes.CupyArray` (see there
why).

Example:
    >>> import numpy as np, cupy_parallel as cp
    >>> def double(x: cp.Array) -> cp.Array:
    ...     return cp.ops.multiply(x, 2.0)
    >>> double(np.arange(3))
    array([0., 2., 4.])
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any, TypeAlias

import numpy as np

from cupy_parallel._src.cuda import copies, streams
from cupy_parallel._src.devices import (
    CPU,
    Device,
    as_device,
    check_exists,
    is_cupy_array,
    require_cupy,
)
from cupy_parallel._src.dtypes import check_device_dtype
from cupy_parallel._src.hostarray import (
    HostArray,
    host_array,
    plain_buffer,
    set_mover,
    set_numpy_dispatch,
)
from cupy_parallel._src.hostdispatch import apply_function, apply_ufunc
from cupy_parallel._src.memory import get_host_memory_pool

if TYPE_CHECKING:
    from collections.abc import Sequence
    from types import ModuleType

    from numpy.typing import DTypeLike, NDArray

    from cupy_parallel._src.arraytypes import CupyArray, Scalar
    from cupy_parallel._src.devices import DeviceLike

__all__ = [
    "Array",
    "Operand",
    "array_namespace",
    "check_outs",
    "copy_into",
    "device_of",
    "empty",
    "is_array",
    "move",
    "shares_memory",
    "to_device",
]

_KDL_CPU, _KDL_CUDA, _KDL_CUDA_HOST, _KDL_CUDA_MANAGED = 1, 2, 3, 13


if TYPE_CHECKING:
    Array: TypeAlias = "NDArray[Any] | HostArray | CupyArray"
else:

    class _ArrayMeta(type):
        def __instancecheck__(cls, instance: object) -> bool:
            return is_array(instance)

    class Array(metaclass=_ArrayMeta):
        """An array the library places: ``numpy.ndarray``, ``HostArray`` or ``cupy.ndarray``.

        For type checkers this is the union ``numpy.typing.NDArray[Any] | HostArray |
        cupy.ndarray`` (``cupy.ndarray`` through a stand-in, as CuPy has no type information);
        use it to annotate your own functions. At run time it cannot be instantiated, and
        ``isinstance(x, Array)`` is :func:`cupy_parallel.is_array`.

        Example:
            >>> import numpy as np, cupy_parallel as cp
            >>> def double(x: cp.Array) -> cp.Array:
            ...     return cp.ops.multiply(x, 2.0)
            >>> double(np.arange(3.0)), isinstance(np.ones(2), cp.Array), isinstance([1], cp.Array)
            (array([0., 2., 4.]), True, False)
        """

        __slots__ = ()

        def __new__(cls, *args: object, **kwargs: object) -> Array:
            raise TypeError(
                "cupy_parallel.Array is a type for annotations and isinstance checks; make "
                "arrays with numpy, cupy_parallel.to_device or cupy_parallel.empty."
            )


Operand: TypeAlias = "Array | Scalar"
"""An operand of the element-wise :mod:`cupy_parallel.ops`: an array or a scalar."""


def is_array(x: object, /) -> bool:
    """Whether ``x`` is an array this library places: ``numpy.ndarray``, HostArray or CuPy.

    Example:
        >>> import numpy as np
        >>> is_array(np.zeros(2)), is_array(3.0)
        (True, False)
    """
    return type(x) is HostArray or isinstance(x, np.ndarray) or is_cupy_array(x)


def device_of(array: Array, /) -> Device:
    """The device an array lives on: ``cpu`` for NumPy, ``host:k`` for HostArray, ``cuda:k``.

    Example:
        >>> import numpy as np
        >>> device_of(np.zeros(2))
        Device('cpu')
    """
    if type(array) is HostArray:
        return array.device
    if isinstance(array, np.ndarray):
        return CPU
    if is_cupy_array(array):
        return Device("cuda", int(array.device.id))
    raise TypeError(
        f"array must be a numpy.ndarray, HostArray or cupy.ndarray, got {type(array).__name__}."
    )


def array_namespace(array: Array, /) -> ModuleType:
    """``numpy`` or ``cupy``: the module that computes on ``array``'s device.

    NumPy computes on host arrays through its dispatch protocols (the result stays on the
    array's device), so it is their namespace as it is the cpu's: the one way to pick NumPy or
    CuPy is ``device.xp``.

    Example:
        >>> import numpy as np
        >>> array_namespace(np.zeros(1)) is np
        True
    """
    return device_of(array).xp


def empty(shape: tuple[int, ...] | int, /, dtype: DTypeLike, device: DeviceLike) -> Array:
    """An uninitialised C-contiguous array on ``device``.

    ``dtype`` and ``device`` may be passed by position or by keyword (``empty(shape, dtype,
    device=d)``, as torch's ``empty(..., device=d)``).

    Host and cpu arrays of 128 KiB or more come from the host memory pool (see
    :mod:`cupy_parallel._src.memory`), CUDA arrays from CuPy's pool. On an accelerator the
    dtype must be one CuPy has (``TypeError`` otherwise, at every size); on the cpu any NumPy
    dtype is accepted (arrays of references, object or ``StringDType``, are never pooled).

    Example:
        >>> import numpy as np
        >>> from cupy_parallel import set_host_device_count
        >>> set_host_device_count(2)
        >>> empty((2, 3), np.float32, "host:1").device
        Device('host:1')
        >>> empty(4, np.int64, device="host:1").shape
        (4,)
    """
    device = as_device(device)
    shape = (shape,) if isinstance(shape, int | np.integer) else tuple(shape)
    check_exists(device)
    dtype = np.dtype(dtype) if device.kind == "cpu" else check_device_dtype(dtype, "dtype")
    if device.kind == "cuda":
        cupy = device.xp
        with device:
            return cupy.empty(shape, dtype)
    if dtype.hasobject or dtype.kind == "T":  # references (object, StringDType): never pooled
        return np.empty(shape, dtype)
    array = get_host_memory_pool().empty(shape, dtype)
    return array if device.kind == "cpu" else host_array(array, device)


def _from_dlpack(array: Any) -> Any:
    """A producer of another library as a NumPy (cpu) or CuPy (GPU) array; ``None`` if none."""
    if not (hasattr(array, "__dlpack__") and hasattr(array, "__dlpack_device__")):
        return None
    kind, _ = array.__dlpack_device__()
    if kind in (_KDL_CPU, _KDL_CUDA_HOST):
        return np.from_dlpack(array)
    if kind in (_KDL_CUDA, _KDL_CUDA_MANAGED):
        return require_cupy().from_dlpack(array)
    raise TypeError(
        f"array is a {type(array).__name__} in DLPack device type {kind}, which is neither "
        "cpu nor CUDA memory; move it to the cpu in its own library first."
    )


def to_device(array: Any, device: Any, /, *, stream: Any = None) -> Any:
    """Copy ``array`` to ``device``; one already there is returned as it is (as torch's ``.to``).

    The copy is C-contiguous with the same dtype and bits. CUDA copies are ordered against the
    current streams of the devices involved (see :mod:`cupy_parallel._src.cuda.copies`): the
    result is ready for work queued next on the target's current stream, a GPU source is read
    after the work queued on its device's current stream and is not reused before it was read,
    and a copy to the host returns when the data is there. ``stream`` (a ``cupy.cuda.Stream`` of
    the GPU side: the target's for uploads and GPU-to-GPU copies, the source's for downloads)
    carries the copy instead, ordered the same way; host copies are synchronous and ignore it.
    Any DLPack producer (a torch tensor, a JAX array) is accepted and copied: a producer is
    never "already there", since the result is ours. Dtypes CuPy lacks (object, strings,
    datetime, structured) cannot go to an accelerator (``TypeError``, at every size).

    Example:
        >>> import numpy as np
        >>> from cupy_parallel import set_host_device_count
        >>> set_host_device_count(2)
        >>> h = to_device(np.arange(4), "host:1")
        >>> h
        HostArray([0, 1, 2, 3], device='host:1')
        >>> to_device(h, "cpu")
        array([0, 1, 2, 3])
    """
    foreign = None if is_array(array) else _from_dlpack(array)
    if foreign is not None:
        source_array = foreign
    elif is_array(array):
        source_array = array
    else:
        raise TypeError(
            f"array must be a numpy.ndarray, HostArray, cupy.ndarray or a DLPack producer, got "
            f"{type(array).__name__}."
        )
    source = device_of(source_array)
    target = as_device(device)
    if source == target and foreign is None:
        return array
    check_exists(target)
    if target.kind != "cpu":
        check_device_dtype(source_array.dtype, "array's dtype")
    if stream is not None:
        _check_stream(stream, target if target.kind == "cuda" else source)
    out = empty(source_array.shape, source_array.dtype, target)
    copy_into(out, source_array, stream=stream)
    return out


# The host array's behaviours that live above it: NumPy's general dispatch and this move
set_numpy_dispatch(apply_ufunc, apply_function)
set_mover(to_device)


def copy_into(dst: Any, src: Any, *, stream: Any = None) -> None:
    """Copy ``src`` into ``dst`` (same shape and dtype), whatever devices they live on.

    The one raw copy of the library, unchecked (for arrays the library holds): host memories
    (``"cpu"``, ``"host:k"``) copy with one ``numpy.copyto``; copies that touch a GPU go through
    :mod:`cupy_parallel._src.cuda.copies`, ordered against the current streams of the devices
    involved. ``stream`` (on ``dst``'s GPU for uploads and peer copies, on ``src``'s GPU for
    downloads) carries the copy instead of the default: a background stream for uploads, the
    current stream otherwise. Either way the current streams wait for the copy before returning.

    Example:
        >>> import numpy as np
        >>> out = empty(3, np.int64, "host:0")
        >>> copy_into(out, np.arange(3))
        >>> out
        HostArray([0, 1, 2], device='host:0')
    """
    source, target = device_of(src), device_of(dst)
    if source.kind != "cuda" and target.kind != "cuda":
        np.copyto(plain_buffer(dst), plain_buffer(src), casting="no")
    elif src.size == 0:
        return
    elif target.kind == "cuda" and source.kind != "cuda":
        copies.upload(dst, target.index, plain_buffer(src), stream)
    elif source.kind == "cuda" and target.kind != "cuda":
        copies.download(plain_buffer(dst), src, source.index, stream)
    elif source == target:
        copies.local(dst, src, target.index, stream)
    else:
        copies.peer(dst, target.index, src, source.index, stream)


def move(x: Any, device: Device, /) -> Any:
    """``x`` on ``device``: itself when already there, else a copy ordered as :func:`copy_into`.

    For arrays the library holds (no checks); :func:`to_device` is the checked move.

    Example:
        >>> import numpy as np
        >>> x = np.arange(2)
        >>> move(x, CPU) is x, move(x, Device("host", 0))
        (True, HostArray([0, 1], device='host:0'))
    """
    if device_of(x) == device:
        return x
    out = empty(x.shape, x.dtype, device)
    copy_into(out, x)
    return out


def _check_stream(stream: Any, gpu: Device) -> None:
    """``stream`` must be a CuPy stream, of ``gpu`` (the GPU side of the copy) when it is one."""
    if not streams.is_stream(stream):
        raise TypeError(f"stream must be a cupy.cuda.Stream or None, got {type(stream).__name__}.")
    if gpu.kind != "cuda":
        return  # a host copy: synchronous, the stream is not used
    owner = streams.stream_device(stream)
    if owner not in (-1, gpu.index):
        raise ValueError(
            f"stream belongs to cuda:{owner}, but this copy runs on {gpu} (the target for "
            f"uploads and GPU-to-GPU copies, the source for downloads); create it under "
            f"cupy.cuda.Device({gpu.index})."
        )


def check_outs(
    outs: Sequence[tuple[str, Any]],
    inputs: Sequence[tuple[str, Any]],
    operation: str,
    *,
    self_copy: bool = False,
) -> None:
    """Refuse an ``out`` that cannot take the result, before anything is copied or sent.

    The one overlap test of the library: ``comm``'s functions and the collectives of
    ``distributed`` that fill a list of arrays call it. An ``out`` is refused when it is
    read-only, when it overlaps itself (a zero stride over more than one element, as
    ``numpy.broadcast_to`` makes: torch's ``assert_no_internal_overlap``), when it shares
    memory with another ``out`` (``[buf] * n``: every entry would end up holding the last
    result), or when it shares memory with an input that the call reads (the copy would read
    what it already overwrote; torch's ``cat`` refuses that as well). With ``self_copy=True``
    an ``out`` occupying exactly the input's memory is accepted: copying an array onto itself
    is a no-op (torch's ``copy_`` returns early). ``outs`` and ``inputs`` are ``(name, array)``
    pairs; the names appear in the messages.
    """
    for name, o in outs:
        if not getattr(o.flags, "writeable", True):  # CuPy arrays have no read-only flag
            raise ValueError(
                f"{name} is read-only, but {operation} writes its result into it; pass a "
                "writable array (for example a copy)."
            )
        if o.size > 1 and any(
            stride == 0 and extent > 1 for stride, extent in zip(o.strides, o.shape, strict=True)
        ):
            raise ValueError(
                f"{name} has strides {o.strides} for shape {o.shape}: several of its elements "
                f"are one memory location, so {operation} cannot write a result into it; pass "
                "an array whose elements do not overlap (for example a copy)."
            )
    for i, j in _bounds_meet(outs):
        (name, o), (other, p) = outs[i], outs[j]
        if shares_memory(o, p):
            same = (
                "; they are one array (a list made as [buf] * n repeats buf): make one array "
                "per entry, e.g. [numpy.empty_like(buf) for _ in range(n)]"
                if o is p
                else ""
            )
            raise ValueError(
                f"{name} and {other} share memory, but {operation} writes into each of them, "
                f"so all but the last result would be lost; pass out arrays that do not "
                f"overlap{same}."
            )
    for name, o in outs:
        for source, x in inputs:
            if shares_memory(o, x) and not (self_copy and _layout(o) == _layout(x)):
                raise ValueError(
                    f"{name} shares memory with {source}, which {operation} reads, so writing "
                    f"the result would overwrite its own input; pass an out that does not "
                    f"overlap {source}."
                )


def _bounds_meet(named: Sequence[tuple[str, Any]]) -> list[tuple[int, int]]:
    """The pairs ``(i, j)``, ``i < j`` in order, of arrays whose memory bounds intersect.

    Only these can share memory: sorting by where each array's memory starts and sweeping
    finds them in ``O(n log n)`` for disjoint arrays, where testing every pair (``O(n^2)``
    exact tests) cost 1.6 ms for the 64 outputs of an ``all_gather`` on 64 ranks (0.3 ms
    now). Up to ``_FEW`` arrays every pair is tested: reading an address costs more than that.
    """
    if len(named) <= _FEW:
        return list(itertools.combinations(range(len(named)), 2))
    spans = []
    for index, (_, x) in enumerate(named):
        if x.size == 0:
            continue  # no memory
        device = device_of(x)
        start, shape, strides = _layout(x)
        low = start + sum(s * (n - 1) for s, n in zip(strides, shape, strict=True) if s < 0)
        high = start + sum(s * (n - 1) for s, n in zip(strides, shape, strict=True) if s > 0)
        # host memory (cpu and host:k) is one address space; each GPU is its own
        space = device.index if device.kind == "cuda" else -1
        spans.append((space, low, high + x.itemsize, index))
    spans.sort()
    pairs: list[tuple[int, int]] = []
    active: list[tuple[int, int, int, int]] = []
    for span in spans:
        space, low, _, index = span
        active = [a for a in active if a[0] == space and a[2] > low]
        pairs.extend((min(a[3], index), max(a[3], index)) for a in active)
        active.append(span)
    return sorted(pairs)


_FEW = 8  # where testing every pair stops being faster than sorting (28 pairs: ~30 us)


def shares_memory(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` have an element in common (unknown counts as yes)."""
    first, second = device_of(a), device_of(b)
    if first.kind == "cuda" or second.kind == "cuda":
        # CuPy's exact test builds a pointer per element on the GPU: only when the bounds meet.
        # The exact test runs kernels on the current device: make it the arrays' own device.
        cupy = first.xp
        if first != second or not cupy.may_share_memory(a, b):
            return False
        with first:
            return bool(cupy.shares_memory(a, b))
    buffers = plain_buffer(a), plain_buffer(b)
    try:  # a bounded search: exact answers for ordinary layouts, "yes" for pathological ones
        return bool(np.shares_memory(*buffers, max_work=_SHARES_MEMORY_WORK))
    except np.exceptions.TooHardError:
        return True


_SHARES_MEMORY_WORK: Any = 1 << 16  # numpy's stubs admit only -1 and 0, the runtime any bound


def _layout(x: Any) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    """Where ``x``'s memory starts, its shape and strides: equal for the same memory."""
    pointer = x.data.ptr if device_of(x).kind == "cuda" else plain_buffer(x).ctypes.data
    return int(pointer), tuple(x.shape), tuple(x.strides)
