"""The differentiable multi-device moves of ``torch.nn.parallel._functions`` on our tape.

Two adjoint pairs: :class:`Scatter` and :class:`Gather` (split along a dimension / join along it),
:class:`Broadcast` and :class:`ReduceAddCoalesced` (copy everywhere / sum back). The backward of
each is the other, applied through ``.apply`` so that the moves stay the library's primitives in
:mod:`cupy_parallel._src.comm`. Arguments are checked by ``comm`` before anything is copied.
:class:`ToDevice` (the public :func:`cupy_parallel.to_device`) is its own adjoint: its backward
moves the gradient back, as PyTorch's ``.to()`` does.

:class:`UncheckedScatter`, :class:`UncheckedGather` and :class:`UncheckedBroadcast` are the same
moves for the library's own callers (``nested``, ``parallel``), whose arguments are already read
at their public entry: their forward checks nothing again; their backward is the public class's.

Every backward here is written with recorded operations (``differentiable_backward = True``),
so gradients through the moves are themselves differentiable (Hessian-vector products through
:func:`~cupy_parallel.data_parallel`).

On CUDA, :class:`Scatter` copies host (``"cpu"``) input on a background stream per target GPU and
the consumer's current stream waits for it, as torch's ``_get_stream`` pattern does
(:func:`cupy_parallel._src.cuda.streams.background_stream`). Without CUDA there is nothing to do.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Literal, overload

from cupy_parallel._src import comm, ops
from cupy_parallel._src.arguments import read_int
from cupy_parallel._src.arrays import device_of, is_array
from cupy_parallel._src.arrays import to_device as move
from cupy_parallel._src.cuda.streams import background_stream
from cupy_parallel._src.devices import Device, read_devices
from cupy_parallel._src.function import Function, FunctionContext
from cupy_parallel._src.recording import is_recording

if TYPE_CHECKING:
    from numpy.typing import NDArray

    from cupy_parallel._src.arrays import Array
    from cupy_parallel._src.devices import DeviceLike

__all__ = [
    "Broadcast",
    "Gather",
    "ReduceAddCoalesced",
    "Scatter",
    "ToDevice",
    "UncheckedBroadcast",
    "UncheckedGather",
    "UncheckedScatter",
    "to_device",
]


def _copy_streams(source: Device, targets: tuple[Device, ...]) -> list[Any] | None:
    """Background copy streams for host-to-GPU scatter (``None`` when no GPU is involved)."""
    if source.kind != "cpu" or any(t.kind != "cuda" for t in targets):
        return None
    return [background_stream(t.index) for t in targets]


class Scatter(Function):
    """Split an array along ``dim`` over devices; the backward gathers the gradients back.

    ``Scatter.apply(target_devices, chunk_sizes, dim, array)`` returns one chunk per used
    device (see :func:`cupy_parallel.comm.scatter`: ``chunk_sizes=None`` splits evenly).
    The gradient of ``array`` is the chunks' gradients gathered onto ``array``'s device.

    Example:
        >>> import numpy as np
        >>> import cupy_parallel
        >>> x = np.arange(4.0)
        >>> with cupy_parallel.Tape() as tape:
        ...     tape.watch(x)
        ...     a, b = Scatter.apply(["host:0", "host:1"], None, 0, x)
        >>> b
        HostArray([2., 3.], device='host:1')
        >>> ones = [cupy_parallel.to_device(np.full(2, k + 1.0), f"host:{k}") for k in (0, 1)]
        >>> tape.gradient((a, b), x, output_gradients=tuple(ones))
        array([1., 1., 2., 2.])
    """

    differentiable_backward = True

    @staticmethod
    def forward(
        ctx: FunctionContext, target_devices: Any, chunk_sizes: Any, dim: int, array: Any
    ) -> tuple[Any, ...]:
        """Split ``array`` and place the chunks."""
        targets = read_devices(
            target_devices, "target_devices", accelerators_only=False, allow_empty=True
        )
        if not is_array(array):
            raise TypeError(f"Scatter.apply needs an array to split, got {type(array).__name__}.")
        ctx.dim = dim
        ctx.input_device = device_of(array)
        streams = _copy_streams(ctx.input_device, targets)
        return comm.scatter(array, targets, chunk_sizes, dim, streams)

    @staticmethod
    def backward(ctx: FunctionContext, *grads: Any) -> tuple[Any, ...]:
        """Gather the chunks' gradients onto the input's device."""
        return (None, None, None, Gather.apply(ctx.input_device, ctx.dim, *grads))


class UncheckedScatter(Scatter):
    """:class:`Scatter` of arguments already read; nothing is checked again.

    ``UncheckedScatter.apply(targets, chunk_sizes, axis, array)``: ``targets`` a tuple of existing
    accelerator devices, ``chunk_sizes`` one size per target summing to the array's size along
    ``axis`` (in ``[0, array.ndim)``), ``array`` an array of this library.
    """

    @staticmethod
    def forward(
        ctx: FunctionContext,
        target_devices: tuple[Device, ...],
        chunk_sizes: tuple[int, ...],
        dim: int,
        array: Any,
    ) -> tuple[Any, ...]:
        """Split ``array`` and place the chunks."""
        ctx.dim = dim
        ctx.input_device = device_of(array)
        streams = _copy_streams(ctx.input_device, target_devices)
        return comm.scatter_unchecked(array, target_devices, chunk_sizes, dim, streams)


SCALARS_WARNING = (
    "Gather was asked to join 0-d arrays along dim 0; they are joined as 1-element vectors "
    "and the result is a vector (as torch does)."
)
"""Gather's warning for 0-d inputs (``nested.gather`` warns once per call instead)."""


class Gather(Function):
    """Join arrays from several devices along ``dim`` on one device; the backward scatters.

    ``Gather.apply(target_device, dim, *arrays)``. As in torch, 0-d arrays gathered along dim 0
    are treated as 1-element vectors (with a warning) and give a vector; their gradients are
    squeezed back to 0-d. The gradient of each input is its slice of the output gradient, moved
    to the input's device.

    Example:
        >>> import numpy as np
        >>> import cupy_parallel
        >>> a = cupy_parallel.to_device(np.ones(2), "host:0")
        >>> b = cupy_parallel.to_device(np.zeros(1), "host:1")
        >>> Gather.apply("cpu", 0, a, b)
        array([1., 1., 0.])
    """

    differentiable_backward = True

    @staticmethod
    def forward(ctx: FunctionContext, target_device: Any, dim: int, *arrays: Any) -> Any:
        """Concatenate ``arrays`` on ``target_device``."""
        for i, x in enumerate(arrays):
            if not is_array(x):
                raise TypeError(
                    f"Gather.apply joins arrays, but argument {i + 2} is a {type(x).__name__}."
                )
        arrays = _unsqueeze_scalars(ctx, dim, arrays)
        if ctx.unsqueezed_scalar:
            warnings.warn(SCALARS_WARNING, UserWarning, stacklevel=3)
        result = comm.gather(arrays, dim, target_device)
        ctx.dim = dim % result.ndim
        ctx.input_sizes = tuple(x.shape[ctx.dim] for x in arrays)
        return result

    @staticmethod
    def backward(ctx: FunctionContext, grad: Any) -> tuple[Any, ...]:
        """Scatter the output gradient back to the inputs' devices, in their sizes."""
        pieces = Scatter.apply(ctx.input_devices, ctx.input_sizes, ctx.dim, grad)
        if ctx.unsqueezed_scalar:
            pieces = tuple(ops.reshape(p, ()) for p in pieces)
        return (None, None, *pieces)


def _unsqueeze_scalars(ctx: FunctionContext, dim: int, arrays: tuple[Any, ...]) -> tuple[Any, ...]:
    """``arrays`` as 1-element vectors when all are 0-d and ``dim`` is 0 (noted on ``ctx``)."""
    ctx.input_devices = tuple(device_of(x) for x in arrays)
    ctx.unsqueezed_scalar = bool(arrays) and dim == 0 and all(x.ndim == 0 for x in arrays)
    return tuple(x.reshape(1) for x in arrays) if ctx.unsqueezed_scalar else arrays


class UncheckedGather(Gather):
    """:class:`Gather` of arguments already read; nothing is checked again, nothing warns.

    ``UncheckedGather.apply(target, axis, *arrays)``: ``target`` an existing device, ``arrays``
    on accelerator devices of one dtype and ndim, equal in shape off ``axis`` (in
    ``[0, ndim)``), or all 0-d with ``axis`` 0 (stacked into a vector, as :class:`Gather` does,
    without its warning: the caller warns).
    """

    @staticmethod
    def forward(ctx: FunctionContext, target_device: Any, dim: int, *arrays: Any) -> Any:
        """Concatenate ``arrays`` on ``target_device``."""
        arrays = _unsqueeze_scalars(ctx, dim, arrays)
        ctx.dim = dim
        ctx.input_sizes = tuple(x.shape[dim] for x in arrays)
        return comm.gather_unchecked(arrays, dim, target_device)


class Broadcast(Function):
    """Copy arrays to several devices at once; the backward sums the copies' gradients.

    ``Broadcast.apply(target_devices, *arrays)`` returns a flat tuple grouped per device:
    ``len(target_devices) * len(arrays)`` arrays, device 0's copies first (coalesced, see
    :func:`cupy_parallel.comm.broadcast_coalesced`; every array must be on
    ``target_devices[0]``). Copies of arrays the tape does not track are non-differentiable.

    Example:
        >>> import numpy as np
        >>> import cupy_parallel
        >>> w = cupy_parallel.to_device(np.ones(2), "host:0")
        >>> b = cupy_parallel.to_device(np.zeros(1), "host:0")
        >>> [str(x.device) for x in Broadcast.apply(["host:0", "host:1"], w, b)]
        ['host:0', 'host:0', 'host:1', 'host:1']
    """

    differentiable_backward = True

    @staticmethod
    def forward(ctx: FunctionContext, target_devices: Any, *arrays: Any) -> tuple[Any, ...]:
        """Broadcast ``arrays`` to ``target_devices``."""
        ctx.target_devices = read_devices(
            target_devices, "target_devices", accelerators_only=False, allow_empty=True
        )
        ctx.num_inputs = len(arrays)
        if not arrays:
            return ()
        ctx.input_device = device_of(arrays[0]) if is_array(arrays[0]) else None
        return _flat_copies(ctx, comm.broadcast_coalesced(arrays, ctx.target_devices))

    @staticmethod
    def backward(ctx: FunctionContext, *grads: Any) -> tuple[Any, ...]:
        """Sum the gradients of the copies onto the input device."""
        return (None, *ReduceAddCoalesced.apply(ctx.input_device, ctx.num_inputs, *grads))


def _flat_copies(ctx: FunctionContext, per_device: tuple[tuple[Any, ...], ...]) -> tuple[Any, ...]:
    """The copies grouped per device, flat; copies of untracked arrays are non-differentiable."""
    for i, needs in enumerate(ctx.needs_input_grad[1:]):
        if not needs:
            ctx.mark_non_differentiable(*(copies[i] for copies in per_device))
    return tuple(x for copies in per_device for x in copies)


class UncheckedBroadcast(Broadcast):
    """:class:`Broadcast` of arguments already read; nothing is checked again.

    ``UncheckedBroadcast.apply(targets, *arrays)``: ``targets`` a tuple of existing accelerator
    devices, ``arrays`` (at least one) arrays of this library, all on ``targets[0]``.
    """

    @staticmethod
    def forward(
        ctx: FunctionContext, target_devices: tuple[Device, ...], *arrays: Any
    ) -> tuple[Any, ...]:
        """Broadcast ``arrays`` to ``target_devices``."""
        ctx.target_devices = target_devices
        ctx.num_inputs = len(arrays)
        ctx.input_device = target_devices[0]
        return _flat_copies(ctx, comm.broadcast_coalesced_unchecked(arrays, target_devices))


class ReduceAddCoalesced(Function):
    """Sum per-device groups of arrays onto one device; the backward broadcasts.

    ``ReduceAddCoalesced.apply(destination, num_inputs, *grads)``: ``grads`` is the flat
    per-device grouping :class:`Broadcast` produces, ``num_inputs`` arrays per device. Returns
    ``num_inputs`` sums on ``destination`` (see :func:`cupy_parallel.comm.reduce_add_coalesced`).

    Example:
        >>> import numpy as np
        >>> import cupy_parallel
        >>> parts = [cupy_parallel.to_device(np.full(2, k + 1.0), f"host:{k}") for k in range(3)]
        >>> ReduceAddCoalesced.apply("host:0", 1, *parts)
        (HostArray([6., 6.], device='host:0'),)
    """

    differentiable_backward = True

    @staticmethod
    def forward(
        ctx: FunctionContext, destination: Any, num_inputs: int, *grads: Any
    ) -> tuple[Any, ...]:
        """Sum the groups."""
        num_inputs = read_int(num_inputs, "num_inputs")
        if num_inputs < 1 or len(grads) % num_inputs:
            raise ValueError(
                f"num_inputs must be a positive divisor of the number of arrays ({len(grads)}), "
                f"one group of num_inputs arrays per device; got num_inputs={num_inputs}."
            )
        groups = [grads[i : i + num_inputs] for i in range(0, len(grads), num_inputs)]
        for k, group in enumerate(groups):
            for j, x in enumerate(group):
                if not is_array(x):
                    raise TypeError(
                        f"ReduceAddCoalesced.apply sums arrays, but array {j} of group {k} is "
                        f"a {type(x).__name__}."
                    )
        ctx.target_devices = tuple(device_of(group[0]) for group in groups)
        return comm.reduce_add_coalesced(groups, destination)

    @staticmethod
    def backward(ctx: FunctionContext, *grads: Any) -> tuple[Any, ...]:
        """Broadcast the sums' gradients back to every group's device."""
        source = ctx.target_devices[0]
        grads = tuple(ToDevice.apply(g, source, None) for g in grads)
        return (None, None, *Broadcast.apply(ctx.target_devices, *grads))


class ToDevice(Function):
    """Copy an array to a device; the backward moves the gradient back to the source device.

    ``ToDevice.apply(array, device, stream)``: see :func:`to_device`, which calls it while a tape
    records.

    Example:
        >>> import numpy as np
        >>> import cupy_parallel
        >>> x = np.array([1.0, 2.0])
        >>> with cupy_parallel.Tape() as tape:
        ...     tape.watch(x)
        ...     y = ToDevice.apply(x, "host:1", None)
        >>> tape.gradient(y, x, output_gradients=to_device(np.ones(2), "host:1"))
        array([1., 1.])
    """

    differentiable_backward = True

    @staticmethod
    def forward(ctx: FunctionContext, array: Any, device: Any, stream: Any) -> Any:
        """Copy ``array`` to ``device`` (returned as it is when it is there already)."""
        ctx.source = device_of(array)
        return move(array, device, stream=stream)

    @staticmethod
    def backward(ctx: FunctionContext, grad: Any) -> tuple[Any, ...]:
        """Move the gradient back to the source device."""
        return ToDevice.apply(grad, ctx.source, None), None, None


@overload
def to_device(
    array: Array, device: Literal["cpu", -1], /, *, stream: Any = None
) -> NDArray[Any]: ...
@overload
def to_device(array: Array, device: DeviceLike, /, *, stream: Any = None) -> Array: ...
def to_device(array: Any, device: Any, /, *, stream: Any = None) -> Any:
    """Copy ``array`` to ``device``, differentiably; one already there is returned as it is.

    Like PyTorch's ``.to()``: while a tape records, the move is recorded and the gradient is
    moved back to ``array``'s device (then an array already on ``device`` comes back as a new
    view, so that the graph stays acyclic). The copy is C-contiguous with the same dtype and
    bits. ``stream`` (a ``cupy.cuda.Stream``) orders CUDA copies; host copies are synchronous
    and ignore it.

    Args:
        array: a NumPy, HostArray or CuPy array.
        device: the target device (``"cpu"``, ``"host:k"``, ``"cuda:k"`` or a Device).
        stream: the CUDA stream of the copy (``None``: the current stream).

    Returns:
        The array on ``device``.

    Raises:
        TypeError: ``array`` is not an array or ``device`` not a device.
        ValueError: ``device`` does not exist.

    Example:
        >>> import numpy as np
        >>> import cupy_parallel
        >>> from cupy_parallel import Tape, ops
        >>> w = np.array([1.0, 2.0])
        >>> with Tape() as tape:
        ...     tape.watch(w)
        ...     far = cupy_parallel.to_device(w, "host:1")
        ...     loss = ops.sum(ops.square(far))
        >>> far
        HostArray([1., 2.], device='host:1')
        >>> tape.gradient(loss, w)  # moved back to w's device
        array([2., 4.])
    """
    if not is_recording():
        return move(array, device, stream=stream)
    return ToDevice.apply(array, device, stream)
