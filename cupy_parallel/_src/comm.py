"""Array-level multi-device primitives: torch's ``comm`` on NumPy, host devices and CuPy.

Every public function validates its arguments here, at the edge, before any memory is allocated
or copied; a bad argument raises ``TypeError`` (wrong type) or ``ValueError`` (wrong value) naming
it. The work is then done by device-generic helpers: host memory (``"cpu"`` and ``"host:k"``) is
copied with ``numpy.copyto`` into pooled buffers from :func:`~cupy_parallel.empty`; anything that
touches a GPU goes through :mod:`cupy_parallel._src.cuda` (pinned staging on background streams,
peer copies, NCCL). :func:`scatter_unchecked`, :func:`gather_unchecked` and
:func:`broadcast_coalesced_unchecked` are the public functions after their checks, for the
library's callers that read their arguments already (the recorded moves of ``data_parallel``).

Conventions shared by all six functions, carried over from ``torch.cuda.comm``:

* Target devices are accelerators (``"host:k"`` or ``"cuda:k"``); only :func:`gather` may deliver
  to ``"cpu"``, where it returns a plain ``numpy.ndarray``.
* ``destination=None`` means the *current device*: CuPy's current GPU on the CUDA platform and
  ``host:0`` on the host platform (torch uses the current CUDA device).
* dtypes are never converted: every dtype round-trips bit for bit, and arrays combined by one call
  must share a dtype. Dtypes CuPy lacks (object, strings, datetime/timedelta, structured,
  ``StringDType``, ``longdouble``) are refused with ``TypeError`` at the entry, at every size,
  as CuPy cannot hold them.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

import numpy as np

from cupy_parallel._src import comm_transfer as _transfer
from cupy_parallel._src.arguments import read_axis, read_int, read_sequence
from cupy_parallel._src.arrays import check_outs, copy_into, device_of, empty, is_array, move
from cupy_parallel._src.cuda import nccl_comm as _nccl
from cupy_parallel._src.cuda import streams as _streams
from cupy_parallel._src.devices import Device, cupy_module, platform, read_device, read_devices
from cupy_parallel._src.dtypes import check_device_dtype
from cupy_parallel._src.hostarray import HostArray, host_array, host_buffer, plain_buffer
from cupy_parallel._src.versions import announce_write, own_counter

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

    from cupy_parallel._src.arrays import Array
    from cupy_parallel._src.devices import DeviceLike

__all__ = [
    "DEFAULT_BUFFER_SIZE",
    "broadcast",
    "broadcast_coalesced",
    "gather",
    "reduce_add",
    "reduce_add_coalesced",
    "scatter",
]

DEFAULT_BUFFER_SIZE = 10485760
"""Bytes per coalescing bucket in the ``*_coalesced`` functions (10 MiB, torch's default)."""

_HOST_MEMORY = frozenset({"cpu", "host"})


# --------------------------------------------------------------------------------------------
# Argument checks (all raise before anything is allocated or copied)


def _check_array(x: Any, name: str) -> None:
    """Refuse a non-array, and an array of a dtype CuPy lacks (whatever its size or device).

    Only bool, integer, float16/32/64 and complex64/128 arrays pass, so no function here ever
    moves an object or string array, and :func:`reduce_add` only adds numbers (NumPy's ``add`` on
    fixed-width strings would concatenate and truncate into the output).
    """
    if not is_array(x):
        raise TypeError(
            f"{name} must be an array (numpy.ndarray, HostArray or cupy.ndarray), "
            f"got {type(x).__name__}."
        )
    check_device_dtype(x.dtype, f"{name}'s dtype")


def _read_arrays(seq: Any, name: str, *, allow_empty: bool = False) -> tuple[Any, ...]:
    """A sequence of arrays as a tuple; refuses a bare array, a string or a mapping."""
    items = read_sequence(
        seq,
        name,
        expected="a sequence (list or tuple) of arrays",
        hint="wrap a single array as [array]",
    )
    if not items and not allow_empty:
        raise ValueError(f"{name} must contain at least one array, got an empty sequence.")
    for i, x in enumerate(items):
        _check_array(x, f"{name}[{i}]")
    return items


def _on_accelerator(x: Any, name: str, operation: str) -> Device:
    device = device_of(x)
    if device.kind == "cpu":
        raise ValueError(
            f"{operation} expects {name} on an accelerator device ('host:k' or 'cuda:k'), "
            f"but it is a plain numpy.ndarray on 'cpu'; move it first with "
            "cupy_parallel.to_device(array, device)."
        )
    return device


def _read_dim(dim: Any, ndim: int, what: str) -> int:
    """``dim`` as an axis in ``[0, ndim)``; a negative ``dim`` counts from the end."""
    dim = read_int(dim, "dim")
    if ndim == 0:
        raise ValueError(
            f"{what} is 0-d, so it has no dimension {dim} to split or join along; "
            "reshape it to at least one dimension (e.g. array.reshape(1))."
        )
    return read_axis(dim, ndim, "dim", of=what)


def _read_buffer_size(buffer_size: Any) -> int:
    size = read_int(buffer_size, "buffer_size")
    if size < 1:
        raise ValueError(f"buffer_size must be a positive number of bytes, got {size}.")
    return size


def _read_chunk_sizes(chunk_sizes: Any, count: int, total: int, dim: int) -> tuple[int, ...]:
    entries = read_sequence(chunk_sizes, "chunk_sizes", expected="a sequence of ints")
    sizes = tuple(read_int(s, f"chunk_sizes[{i}]", minimum=0) for i, s in enumerate(entries))
    if len(sizes) != count:
        raise ValueError(
            f"chunk_sizes must have one entry per device: len(devices) = {count}, "
            f"but len(chunk_sizes) = {len(sizes)}."
        )
    if sum(sizes) != total:
        raise ValueError(
            f"chunk_sizes must sum to the array's size along dim {dim}, {total}, "
            f"but sum(chunk_sizes) = {sum(sizes)}."
        )
    return sizes


def _read_streams(streams: Any, targets: Sequence[Device]) -> tuple[Any, ...]:
    if streams is None:
        return (None,) * len(targets)
    entries = read_sequence(
        streams, "streams", expected="a sequence of cupy.cuda.Stream or None, one per device"
    )
    if len(entries) != len(targets):
        raise ValueError(
            f"streams must have one entry (a cupy.cuda.Stream or None) per device: "
            f"{len(targets)} devices, but {len(entries)} streams."
        )
    for i, (stream, device) in enumerate(zip(entries, targets, strict=True)):
        if stream is None:
            continue
        if not _streams.is_stream(stream):
            raise TypeError(
                f"streams[{i}] must be a cupy.cuda.Stream or None, got {type(stream).__name__}."
            )
        if device.kind != "cuda":
            raise ValueError(
                f"streams[{i}] is a CUDA stream, but device {i} is {device}, which has no "
                "streams; pass None for host devices."
            )
        stream_device = _streams.stream_device(stream)
        if stream_device not in (-1, device.index):
            raise ValueError(
                f"streams[{i}] belongs to cuda:{stream_device}, but device {i} is {device}; "
                f"create it under cupy.cuda.Device({device.index})."
            )
    return entries


def _exactly_one(first: str, first_value: Any, second: str, second_value: Any) -> None:
    if (first_value is None) == (second_value is None):
        raise ValueError(
            f"Exactly one of '{first}' and '{second}' must be given, got "
            f"{first}={_brief(first_value)} and {second}={_brief(second_value)}."
        )


def _not_with(name: str, value: Any, other: str) -> None:
    if value is not None:
        raise ValueError(
            f"'{name}' must not be given together with '{other}' (it is inferred from "
            f"'{other}'), got {name}={_brief(value)}."
        )


def _named(name: str, arrays: Sequence[Any]) -> list[tuple[str, Any]]:
    return [(f"{name}[{i}]", x) for i, x in enumerate(arrays)]


def _brief(value: Any) -> str:
    if value is None:
        return "None"
    if is_array(value):
        return f"<array of shape {value.shape}>"
    if isinstance(value, list | tuple):
        return f"<{type(value).__name__} of {len(value)}>"
    return repr(value)


def _check_same_dtype(x: Any, dtype: np.dtype[Any], name: str, reference: str) -> None:
    if x.dtype != dtype:
        raise ValueError(
            f"{name} has dtype {x.dtype}, but {reference} has dtype {dtype}; dtypes are never "
            "converted here, cast with .astype() first."
        )


def _current_device() -> Device:
    """The current device, as torch means it: the current GPU on CUDA, else ``host:0``."""
    cupy = cupy_module()
    if platform() == "cuda" and cupy is not None:
        return Device("cuda", int(cupy.cuda.Device().id))
    return Device("host", 0)


# --------------------------------------------------------------------------------------------
# Device-generic moves


def _index(dim: int, start: int, stop: int) -> tuple[slice, ...]:
    return (slice(None),) * dim + (slice(start, stop),)


def _offsets(sizes: Iterable[int]) -> list[tuple[int, int]]:
    """``(start, stop)`` of each size, laid back to back from 0."""
    return list(itertools.pairwise(itertools.accumulate(sizes, initial=0)))


def chunk_count(size: int, devices: int) -> int:
    """How many chunks a size along the split dim gives on ``devices``: one when it is 0."""
    return 1 if size == 0 else min(size, devices)


def even_chunks(size: int, parts: int) -> tuple[int, ...]:
    """``parts`` sizes summing to ``size``, differing by at most one, larger first."""
    base, extra = divmod(size, parts)
    return (base + 1,) * extra + (base,) * (parts - extra)


def _buckets(arrays: Sequence[Any], limit: int) -> list[list[int]]:
    """Indices of ``arrays`` grouped per dtype into buckets of at most ``limit`` bytes.

    A bucket is closed when the next array of its dtype would overflow it, so an array larger
    than ``limit`` gets a bucket of its own (torch's ``_take_tensors`` rule).
    """
    members: dict[np.dtype[Any], list[int]] = {}
    filled: dict[np.dtype[Any], int] = {}
    closed: list[list[int]] = []
    for i, x in enumerate(arrays):
        nbytes = int(x.size) * x.dtype.itemsize
        bucket = members.setdefault(x.dtype, [])
        if bucket and filled[x.dtype] + nbytes > limit:
            closed.append(bucket)
            bucket = members[x.dtype] = []
            filled[x.dtype] = 0
        bucket.append(i)
        filled[x.dtype] = filled.get(x.dtype, 0) + nbytes
    return closed + [bucket for bucket in members.values() if bucket]


# --------------------------------------------------------------------------------------------
# scatter / gather


def scatter(
    array: Array,
    /,
    devices: Sequence[DeviceLike] | None = None,
    chunk_sizes: Sequence[int] | None = None,
    dim: int = 0,
    streams: Sequence[Any] | None = None,
    *,
    out: Sequence[Array] | None = None,
) -> tuple[Array, ...]:
    """Split ``array`` along ``dim`` and place the pieces on ``devices`` (or into ``out``).

    Without ``chunk_sizes`` the array is cut into ``min(len(devices), array.shape[dim])``
    nearly equal chunks (sizes differ by at most one, larger first) that go to the first devices,
    so a batch of 5 on 4 devices uses all 4 (torch's ``chunk`` would use 3); a 0-size dimension
    gives one empty chunk on ``devices[0]``. Explicit ``chunk_sizes`` give one chunk per device and
    may contain zeros. A chunk whose device is the array's own device is a view of ``array``
    (as torch); every other chunk is a copy. ``"cpu"`` (NumPy) and accelerator sources are accepted.
    A copy keeps the chunk's memory layout (NumPy's ``order="K"``: its axes lie in memory in the
    order of the chunk's strides), so the chunks of a channels-last array are channels-last, as
    torch's are, and those of a Fortran-ordered array are Fortran-ordered (torch would make those
    C-contiguous, having no Fortran memory format).

    On CUDA, copies from host memory go through pinned staging buffers on a background stream of
    each target (or on ``streams[i]`` when given), and each target's current stream waits for its
    copy, so the results are ready to use on the current streams.

    Args:
        array: the array to split; any device.
        devices: the target accelerator devices. Exactly one of ``devices`` and ``out``.
        chunk_sizes: optional sizes along ``dim``, one per device, non-negative, summing to
            ``array.shape[dim]``. Not allowed with ``out``.
        dim: the dimension to split; negative counts from the end.
        streams: optional ``cupy.cuda.Stream`` (or ``None``) per device to copy on.
        out: arrays on accelerator devices to fill; their sizes along ``dim`` give the chunk sizes
            and their other dimensions must match ``array``'s.

    Returns:
        The chunks, one per used device, in device order (``tuple(out)`` when ``out`` is given).

    Raises:
        TypeError: an argument has the wrong type, or an array has a dtype CuPy lacks.
        ValueError: devices/out both or neither given, bad ``dim``, ``chunk_sizes`` or shapes,
            or an ``out`` that is read-only or overlaps another ``out`` or ``array``.

    Example:
        >>> import numpy as np
        >>> from cupy_parallel import comm
        >>> x = np.arange(10).reshape(5, 2)
        >>> parts = comm.scatter(x, ["host:0", "host:1"])
        >>> [p.shape for p in parts], [str(p.device) for p in parts]
        ([(3, 2), (2, 2)], ['host:0', 'host:1'])
        >>> comm.scatter(x, ["host:0", "host:1"], chunk_sizes=[0, 2], dim=-1)[1]
        HostArray([[0, 1],
                   [2, 3],
                   [4, 5],
                   [6, 7],
                   [8, 9]], device='host:1')
    """
    _check_array(array, "array")
    _exactly_one("devices", devices, "out", out)
    if out is None:
        targets = read_devices(devices, "devices", accelerators_only=True)
        axis = _read_dim(dim, array.ndim, "array")
        total = array.shape[axis]
        if chunk_sizes is None:
            sizes = even_chunks(total, chunk_count(total, len(targets)))
        else:
            sizes = _read_chunk_sizes(chunk_sizes, len(targets), total, axis)
        copy_streams = _read_streams(streams, targets)[: len(sizes)]
        targets = targets[: len(sizes)]
        outs: tuple[Any, ...] | None = None
    else:
        _not_with("chunk_sizes", chunk_sizes, "out")
        outs = _read_arrays(out, "out")
        axis = _read_dim(dim, array.ndim, "array")
        targets = tuple(_on_accelerator(o, f"out[{i}]", "scatter") for i, o in enumerate(outs))
        for i, o in enumerate(outs):
            _check_scatter_out(o, i, array, axis)
        sizes = tuple(o.shape[axis] for o in outs)
        if sum(sizes) != array.shape[axis]:
            raise ValueError(
                f"The sizes of out along dim {axis} must sum to the array's size there, "
                f"{array.shape[axis]}, but they sum to {sum(sizes)} ({list(sizes)})."
            )
        copy_streams = _read_streams(streams, targets)
        check_outs(_named("out", outs), [("array", array)], "scatter")
        announce_write(outs, "comm.scatter(out=...)")
    return scatter_unchecked(array, targets, sizes, axis, copy_streams, out=outs)


def scatter_unchecked(
    array: Any,
    targets: Sequence[Device],
    sizes: Sequence[int],
    axis: int,
    streams: Sequence[Any] | None = None,
    *,
    out: Sequence[Any] | None = None,
) -> tuple[Any, ...]:
    """:func:`scatter` of arguments already read, checking nothing: the library's callers.

    ``targets`` are existing accelerator devices, ``sizes`` one per target summing to
    ``array.shape[axis]``, ``axis`` in ``[0, array.ndim)``, ``streams`` one (or ``None``) per
    target, ``out`` (instead of fresh arrays) one writable array per target.
    """
    source = device_of(array)
    copy_streams = (None,) * len(targets) if streams is None else streams
    chunks = []
    for i, (device, (start, stop)) in enumerate(zip(targets, _offsets(sizes), strict=True)):
        piece = array[_index(axis, start, stop)]
        if out is None and device == source:
            chunks.append(piece)
            continue
        dst = _empty_like_layout(piece, piece.shape, device) if out is None else out[i]
        copy_into(dst, piece, stream=copy_streams[i])
        chunks.append(dst)
    return tuple(chunks)


def _empty_like_layout(like: Any, shape: tuple[int, ...], device: Device) -> Any:
    """An uninitialised array of ``like``'s dtype whose axes lie in memory in ``like``'s order.

    NumPy's ``order="K"``: the axes are ordered by ``like``'s strides, largest first (ties in
    axis order), so a channels-last ``like`` gives a channels-last array and a Fortran-ordered
    one a Fortran-ordered array; a C-contiguous (or 0-size, or 1-d) ``like`` gives a
    C-contiguous array.
    """
    if like.ndim < 2 or like.size == 0 or like.flags.c_contiguous:
        return empty(shape, like.dtype, device)
    strides = like.strides
    order = sorted(range(like.ndim), key=lambda axis: -abs(strides[axis]))
    memory = empty(tuple(shape[axis] for axis in order), like.dtype, device)
    return memory.transpose(tuple(order.index(axis) for axis in range(like.ndim)))


def _check_scatter_out(o: Any, i: int, array: Any, axis: int) -> None:
    expected = list(array.shape)
    expected[axis] = o.shape[axis] if o.ndim == array.ndim else -1
    if o.ndim != array.ndim or list(o.shape) != expected:
        raise ValueError(
            f"out[{i}] has shape {o.shape}, but it must match the array's shape {array.shape} "
            f"in every dimension except the scatter dim {axis}."
        )
    _check_same_dtype(o, array.dtype, f"out[{i}]", "array")


def gather(
    arrays: Sequence[Array],
    /,
    dim: int = 0,
    destination: DeviceLike | None = None,
    *,
    out: Array | None = None,
) -> Array:
    """Concatenate ``arrays`` (from accelerator devices) along ``dim`` on one device.

    ``destination`` may be any device; ``"cpu"`` or ``-1`` gives a plain ``numpy.ndarray`` (``-1``
    without torch's deprecation warning, since this library spells cpu that way on purpose).
    ``None`` means the current device (CuPy's current GPU on CUDA, ``host:0`` on the host
    platform), as torch uses the current CUDA device. The result is always a new array, laid out
    in memory as ``arrays[0]`` (NumPy's ``order="K"``: channels-last stays channels-last, as in
    torch, which follows the first input's memory format; Fortran order stays Fortran order).

    Args:
        arrays: the pieces, each on an accelerator device, all of one dtype and the same shape
            except along ``dim``.
        dim: the dimension to join along; negative counts from the end.
        destination: the device of the result. Not allowed with ``out``.
        out: an array (any device) to write the result into, of the gathered shape and dtype.

    Returns:
        The gathered array (``out`` itself when given).

    Raises:
        TypeError: an argument has the wrong type, or an array has a dtype CuPy lacks.
        ValueError: no arrays, arrays on ``"cpu"``, mismatched shapes or dtypes, a bad ``dim``
            or ``out`` (of the wrong shape or dtype, read-only, or overlapping an input).

    Example:
        >>> import numpy as np
        >>> import cupy_parallel
        >>> from cupy_parallel import comm
        >>> a = cupy_parallel.to_device(np.arange(4).reshape(2, 2), "host:0")
        >>> b = cupy_parallel.to_device(np.arange(2).reshape(2, 1), "host:1")
        >>> comm.gather([a, b], dim=1, destination="cpu")
        array([[0, 1, 0],
               [2, 3, 1]])
    """
    items = _read_arrays(arrays, "arrays")
    for i, x in enumerate(items):
        _on_accelerator(x, f"arrays[{i}]", "gather")
    first = items[0]
    axis = _read_dim(dim, first.ndim, "arrays[0]")
    expected = list(first.shape)
    for i, x in enumerate(items):
        if x.ndim != first.ndim:
            raise ValueError(
                f"arrays[{i}] has {x.ndim} dimensions, but arrays[0] has {first.ndim}; "
                "gather needs arrays of the same number of dimensions."
            )
        expected[axis] = x.shape[axis]
        if list(x.shape) != expected:
            raise ValueError(
                f"arrays[{i}] has shape {x.shape}, but gather along dim {axis} expects "
                f"{tuple(expected)} (the shape of arrays[0] except along dim)."
            )
        _check_same_dtype(x, first.dtype, f"arrays[{i}]", "arrays[0]")
    if out is None:
        target = (
            _current_device() if destination is None else read_device(destination, "destination")
        )
        return gather_unchecked(items, axis, target)
    _not_with("destination", destination, "out")
    _check_array(out, "out")
    shape = _gathered_shape(items, axis)
    if out.shape != shape:
        raise ValueError(f"out must have the gathered shape {shape}, got {out.shape}.")
    _check_same_dtype(out, first.dtype, "out", "arrays[0]")
    check_outs([("out", out)], _named("arrays", items), "gather")
    announce_write([out], "comm.gather(out=...)")
    return _join_into(out, items, axis)


def _gathered_shape(arrays: Sequence[Any], axis: int) -> tuple[int, ...]:
    shape = list(arrays[0].shape)
    shape[axis] = sum(x.shape[axis] for x in arrays)
    return tuple(shape)


def gather_unchecked(arrays: Sequence[Any], axis: int, destination: Device) -> Any:
    """:func:`gather` of arguments already read, checking nothing: the library's callers.

    ``arrays`` are one or more arrays on accelerator devices, of one dtype and ndim, equal in
    shape off ``axis`` (in ``[0, ndim)``); the result is a new array on the existing
    ``destination``.
    """
    out = _empty_like_layout(arrays[0], _gathered_shape(arrays, axis), destination)
    return _join_into(out, arrays, axis)


def _join_into(out: Any, arrays: Sequence[Any], axis: int) -> Any:
    spans = _offsets(x.shape[axis] for x in arrays)
    for x, (start, stop) in zip(arrays, spans, strict=True):
        copy_into(out[_index(axis, start, stop)], x)
    return out


# --------------------------------------------------------------------------------------------
# broadcast


def broadcast(
    array: Array,
    /,
    devices: Sequence[DeviceLike] | None = None,
    *,
    out: Sequence[Array] | None = None,
) -> tuple[Array, ...]:
    """Copy ``array`` to every device in ``devices`` (or into every array in ``out``).

    With ``devices``, the entry for the array's own device is ``array`` itself (torch does the
    same); the others are fresh copies. With ``out``, every ``out`` array receives a copy. On
    CUDA, a GPU source reaches the other GPUs with one NCCL broadcast when NCCL is available and
    the devices are distinct, otherwise with peer copies; a host source is staged once through
    pinned memory.

    Args:
        array: the array to copy; any device.
        devices: accelerator devices to copy to. Exactly one of ``devices`` and ``out``.
        out: arrays on accelerator devices, each of ``array``'s shape and dtype.

    Returns:
        One array per device (``tuple(out)`` when ``out`` is given).

    Raises:
        TypeError: an argument has the wrong type, or an array has a dtype CuPy lacks.
        ValueError: devices/out both or neither given, or an ``out`` of the wrong shape/dtype,
            read-only, or overlapping another ``out`` or ``array`` (``array`` itself is allowed:
            copying onto itself changes nothing).

    Example:
        >>> import numpy as np
        >>> from cupy_parallel import comm
        >>> copies = comm.broadcast(np.arange(3), ["host:0", "host:2"])
        >>> [str(c.device) for c in copies], copies[1]
        (['host:0', 'host:2'], HostArray([0, 1, 2], device='host:2'))
    """
    _check_array(array, "array")
    _exactly_one("devices", devices, "out", out)
    if out is None:
        targets = read_devices(devices, "devices", accelerators_only=True)
        return _broadcast(array, targets)
    outs = _read_arrays(out, "out")
    for i, o in enumerate(outs):
        _on_accelerator(o, f"out[{i}]", "broadcast")
        if o.shape != array.shape:
            raise ValueError(
                f"out[{i}] has shape {o.shape}, but broadcast needs the source's shape "
                f"{array.shape}."
            )
        _check_same_dtype(o, array.dtype, f"out[{i}]", "array")
    check_outs(_named("out", outs), [("array", array)], "broadcast", self_copy=True)
    announce_write([o for o in outs if o is not array], "comm.broadcast(out=...)")
    if not _nccl.broadcast_into(array, outs):
        for o in outs:
            copy_into(o, array)
    return outs


def _broadcast(array: Any, targets: Sequence[Device]) -> tuple[Any, ...]:
    source = device_of(array)
    others = [d for d in targets if d != source]
    outs = [empty(array.shape, array.dtype, d) for d in others]
    if not _nccl.broadcast_into(array, outs):
        _broadcast_copies(array, outs)
    fresh = iter(outs)
    return tuple(array if d == source else next(fresh) for d in targets)


def _broadcast_copies(array: Any, outs: Sequence[Any]) -> None:
    if device_of(array).kind in _HOST_MEMORY and any(device_of(o).kind == "cuda" for o in outs):
        _transfer.broadcast_from_host(array, outs)
    else:
        for o in outs:
            copy_into(o, array)


def broadcast_coalesced(
    arrays: Sequence[Array],
    /,
    devices: Sequence[DeviceLike],
    buffer_size: int = DEFAULT_BUFFER_SIZE,
) -> tuple[tuple[Array, ...], ...]:
    """Broadcast many arrays at once, packing them into buckets of up to ``buffer_size`` bytes.

    Every array must live on ``devices[0]``. Arrays of one dtype are packed into flat buckets of
    at most ``buffer_size`` bytes (an array larger than that gets its own bucket); each bucket is
    sent to each other device once and unpacked there into views. Results are in input order.

    Args:
        arrays: the arrays to broadcast, all on ``devices[0]`` (any dtypes, shapes, layouts).
        devices: accelerator devices; ``devices[0]`` holds the arrays.
        buffer_size: bytes per bucket (positive).

    Returns:
        One tuple per device. ``result[0]`` holds the input arrays themselves (as torch); the
        others hold copies that are views into the bucket buffers on their device, each with a
        version counter of its own, as torch (a write into one is no write into the others).

    Raises:
        TypeError: an argument has the wrong type, or an array has a dtype CuPy lacks.
        ValueError: an array not on ``devices[0]``, no devices, or a non-positive buffer_size.

    Example:
        >>> import numpy as np
        >>> import cupy_parallel
        >>> from cupy_parallel import comm
        >>> params = [cupy_parallel.to_device(np.ones((2, 2), np.float32), "host:0"),
        ...           cupy_parallel.to_device(np.arange(3), "host:0")]
        >>> replicas = comm.broadcast_coalesced(params, ["host:0", "host:1"])
        >>> replicas[0][1] is params[1], replicas[1][1]
        (True, HostArray([0, 1, 2], device='host:1'))
    """
    items = _read_arrays(arrays, "arrays", allow_empty=True)
    targets = read_devices(devices, "devices", accelerators_only=True)
    limit = _read_buffer_size(buffer_size)
    for i, x in enumerate(items):
        if device_of(x) != targets[0]:
            raise ValueError(
                f"arrays[{i}] is on {device_of(x)}, but broadcast_coalesced needs every array "
                f"on devices[0] ({targets[0]}); move it there with cupy_parallel.to_device."
            )
    return broadcast_coalesced_unchecked(items, targets, limit)


def broadcast_coalesced_unchecked(
    items: Sequence[Any], targets: Sequence[Device], limit: int = DEFAULT_BUFFER_SIZE
) -> tuple[tuple[Any, ...], ...]:
    """:func:`broadcast_coalesced` of arguments already read, checking nothing.

    ``items`` are arrays of dtypes CuPy has, all on ``targets[0]``; ``targets`` are existing
    accelerator devices; ``limit`` is a positive number of bytes per bucket.
    """
    results: list[list[Any]] = [list(items)] + [[None] * len(items) for _ in targets[1:]]
    for bucket in _buckets(items, limit):
        members = [items[i] for i in bucket]
        per_device = _broadcast_bucket(members, targets)
        for k, unpacked in enumerate(per_device, start=1):
            for i, x in zip(bucket, unpacked, strict=True):
                results[k][i] = x
    return tuple(tuple(r) for r in results)


def _broadcast_bucket(members: Sequence[Any], targets: Sequence[Device]) -> list[list[Any]]:
    """Copies of ``members`` on ``targets[1:]``, each device's copies views of one flat buffer."""
    if all(d.kind == "cuda" for d in targets):
        flats = _transfer.broadcast_flat(members, targets)
        return [_unflatten(flat, members) for flat in flats]
    total = sum(int(x.size) for x in members)
    dtype = members[0].dtype
    outputs = []
    for device in targets[1:]:
        flat = empty((total,), dtype, device)
        views = _unflatten(flat, members)
        for view, x in zip(views, members, strict=True):
            copy_into(view, x)
        outputs.append(views)
    return outputs


def _unflatten(flat: Any, like: Sequence[Any]) -> list[Any]:
    """Views of the 1-d ``flat`` with the shapes of ``like``, packed back to back.

    On a host device each view heads a version counter of its own, as torch gives each output
    of a coalesced call a new counter: an in-place write into one output is no write into the
    others (the tape would refuse a gradient that reads them). CuPy arrays have no counters.
    """
    spans = _offsets(int(x.size) for x in like)
    views = [
        flat[start:stop].reshape(x.shape) for x, (start, stop) in zip(like, spans, strict=True)
    ]
    if type(flat) is not HostArray:
        return views
    device = device_of(flat)
    return [host_array(own_counter(host_buffer(view)), device) for view in views]


# --------------------------------------------------------------------------------------------
# reduce_add


def reduce_add(inputs: Sequence[Array], /, destination: DeviceLike | None = None) -> Array:
    """Sum arrays of one shape and dtype living on (usually) different devices.

    The sum lands on ``destination``, which must be the device of one of the inputs (as torch
    requires); ``None`` means the current device (CuPy's current GPU, ``host:0`` on the host
    platform). Inputs may share a device. A single input is returned as it is (as torch).
    Outside NCCL the sum is taken in input order, ``((inputs[0] + inputs[1]) + inputs[2]) ...``,
    so it equals that NumPy expression bit for bit; NCCL (all inputs on distinct GPUs) sums in
    its own order. ``bool`` inputs are combined with logical or, as NumPy adds booleans.

    Args:
        inputs: arrays on accelerator devices, all of one shape and dtype.
        destination: the device of the result; must hold one of the inputs.

    Returns:
        The elementwise sum on ``destination``.

    Raises:
        TypeError: an argument has the wrong type, or an array has a dtype CuPy lacks.
        ValueError: no inputs, inputs on ``"cpu"``, mismatched shapes/dtypes, or a destination
            that holds none of the inputs.

    Example:
        >>> import numpy as np
        >>> import cupy_parallel
        >>> from cupy_parallel import comm
        >>> parts = [cupy_parallel.to_device(np.full(3, k), f"host:{k}") for k in range(3)]
        >>> comm.reduce_add(parts, destination="host:1")
        HostArray([3, 3, 3], device='host:1')
    """
    items = _read_arrays(inputs, "inputs")
    places = _check_reduce_inputs(items, "inputs")
    target = _read_reduce_destination(destination, places, "inputs")
    if len(items) == 1:
        return items[0]
    if _nccl.can_reduce(items, target):
        return _nccl.reduce(items, target)
    out = empty(items[0].shape, items[0].dtype, target)
    _sum_into(out, items)
    return out


def _check_reduce_inputs(items: Sequence[Any], name: str) -> list[Device]:
    first = items[0]
    places = []
    for i, x in enumerate(items):
        places.append(_on_accelerator(x, f"{name}[{i}]", "reduce_add"))
        if x.shape != first.shape:
            raise ValueError(
                f"{name}[{i}] has shape {x.shape}, but {name}[0] has shape {first.shape}; "
                "reduce_add sums arrays of one shape."
            )
        _check_same_dtype(x, first.dtype, f"{name}[{i}]", f"{name}[0]")
    return places


def _read_reduce_destination(destination: Any, places: Sequence[Device], name: str) -> Device:
    if destination is None:
        target = _current_device()
        spelled = f"destination=None (the current device, {target})"
    else:
        target = read_device(destination, "destination")
        spelled = f"destination {target}"
    if target not in places:
        on = sorted({str(d) for d in places})
        raise ValueError(
            f"reduce_add puts the sum on the device of one of its {name}, but {spelled} holds "
            f"none of them (they are on {on}); pass destination=<one of those devices>."
        )
    return target


def _sum_into(out: Any, terms: Sequence[Any]) -> None:
    """``out[...] = ((terms[0] + terms[1]) + ...)``, computed on ``out``'s device."""
    device = device_of(out)
    if device.kind == "cuda":
        _transfer.sum_into(out, [move(t, device) for t in terms])
        return
    dst = plain_buffer(out)
    # Host devices share the machine's memory: reading another host device's array directly is
    # its transfer, fused into the addition instead of a separate copy.
    values = [
        plain_buffer(t if device_of(t).kind in _HOST_MEMORY else move(t, device)) for t in terms
    ]
    if len(values) == 1:
        np.copyto(dst, values[0], casting="no")
        return
    np.add(values[0], values[1], out=dst)
    for v in values[2:]:
        np.add(dst, v, out=dst)


def reduce_add_coalesced(
    inputs: Sequence[Sequence[Array]],
    /,
    destination: DeviceLike | None = None,
    buffer_size: int = DEFAULT_BUFFER_SIZE,
) -> tuple[Array, ...]:
    """Sum lists of arrays across devices, packing them into buckets of ``buffer_size`` bytes.

    ``inputs[k]`` is device ``k``'s list; all lists have the same length and the arrays at one
    position share shape and dtype. Each list must live on one device. The sums land on
    ``destination`` (the device of one list; ``None`` is the current device), packed per dtype
    into buffers of at most ``buffer_size`` bytes and returned as views, in input order, each
    with a version counter of its own (as torch: a write into one is no write into the others).
    Sums are taken in list order (see :func:`reduce_add`); a single list gives fresh copies.

    Args:
        inputs: one sequence of arrays per device.
        destination: the device of the results; must hold one of the lists.
        buffer_size: bytes per bucket (positive).

    Returns:
        The sums, one per position.

    Raises:
        TypeError: an argument has the wrong type, or an array has a dtype CuPy lacks.
        ValueError: empty inputs, lists of different lengths, a list spread over devices,
            mismatched shapes/dtypes, a bad destination or buffer_size.

    Example:
        >>> import numpy as np
        >>> import cupy_parallel
        >>> from cupy_parallel import comm
        >>> grads = [[cupy_parallel.to_device(np.full(2, k + 1.0), f"host:{k}"),
        ...           cupy_parallel.to_device(np.arange(3) * k, f"host:{k}")] for k in range(2)]
        >>> comm.reduce_add_coalesced(grads, destination="host:0")
        (HostArray([3., 3.], device='host:0'), HostArray([0, 1, 2], device='host:0'))
    """
    lists = tuple(
        _read_arrays(per_device, f"inputs[{k}]", allow_empty=True)
        for k, per_device in enumerate(
            read_sequence(
                inputs, "inputs", expected="a sequence with one list of arrays per device"
            )
        )
    )
    if not lists:
        raise ValueError("inputs must hold at least one list of arrays, got an empty sequence.")
    count = len(lists[0])
    places = []
    for k, group in enumerate(lists):
        if len(group) != count:
            raise ValueError(
                f"inputs[{k}] has {len(group)} arrays, but inputs[0] has {count}; every device "
                "must contribute one array per position."
            )
        place = device_of(group[0]) if group else None
        for j, x in enumerate(group):
            _on_accelerator(x, f"inputs[{k}][{j}]", "reduce_add_coalesced")
            if device_of(x) != place:
                raise ValueError(
                    f"inputs[{k}][{j}] is on {device_of(x)}, but inputs[{k}][0] is on {place}; "
                    f"each list in inputs must live on one device."
                )
            reference = lists[0][j]
            if x.shape != reference.shape:
                raise ValueError(
                    f"inputs[{k}][{j}] has shape {x.shape}, but inputs[0][{j}] has shape "
                    f"{reference.shape}; arrays at one position must match."
                )
            _check_same_dtype(x, reference.dtype, f"inputs[{k}][{j}]", f"inputs[0][{j}]")
        if place is not None:
            places.append(place)
    limit = _read_buffer_size(buffer_size)
    if count == 0:  # nothing to sum, but a destination that names no device is still an error
        if destination is not None:
            read_device(destination, "destination")
        return ()
    target = _read_reduce_destination(destination, places, "inputs lists")
    results: list[Any] = [None] * count
    for bucket in _buckets(lists[0], limit):
        groups = [[group[j] for j in bucket] for group in lists]
        for j, total in zip(bucket, _reduce_bucket(groups, target), strict=True):
            results[j] = total
    return tuple(results)


def _reduce_bucket(groups: Sequence[Sequence[Any]], target: Device) -> list[Any]:
    """Sums of the aligned ``groups`` (one per device) on ``target``, as views of one buffer."""
    like = groups[0]
    if target.kind == "cuda" and all(device_of(g[0]).kind == "cuda" for g in groups):
        return _unflatten(_transfer.reduce_flat(groups, target), like)
    flat = empty((sum(int(x.size) for x in like),), like[0].dtype, target)
    views = _unflatten(flat, like)
    for j, view in enumerate(views):
        _sum_into(view, [g[j] for g in groups])
    return views
