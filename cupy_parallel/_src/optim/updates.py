"""Running one parameter's update in place on its device: NumPy ``out=`` loops or one CUDA kernel.

An optimizer states its update twice, in the same order of operations (torch's):

* a **NumPy kernel** ``kernel(p, g, states, t1, t2, **scalars)``: in-place ufuncs with ``out=``
  on arrays of equal shape, with two scratch arrays ``t1``, ``t2``. :func:`apply` runs it over
  blocks of :data:`BLOCK` elements when every array is C-contiguous (so a dozen passes stay in
  the cache and memory is read and written once), else on the whole arrays. NumPy and
  HostArray parameters take this path (a HostArray's buffer, its write counted).
* a **CUDA kernel** ``(p, g, states, **scalars)``: one ``cupy.ElementwiseKernel`` call that
  reads and writes the parameter and its state (no temporaries), on the parameter's device.

The scratch arrays come from a :class:`Workspace` the optimizer keeps: one pair per dtype, as
large as the largest block, reused by every parameter and every step.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import numpy as np

from cupy_parallel._src.arrays import device_of
from cupy_parallel._src.devices import is_cupy_array, require_cupy
from cupy_parallel._src.hostarray import HostArray, host_buffer
from cupy_parallel._src.versions import count_write

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

__all__ = ["BLOCK", "Workspace", "apply", "elementwise_kernel", "opmath"]

BLOCK = 1 << 15
"""Elements per block of the NumPy path: a block's six arrays (parameter, gradient, two states,
two scratch; 128 KiB each in float32) stay in a core's L2 cache across the update's dozen passes.
Measured on an Adam step of 4 M float32 parameters: 8192 16.1 ms, 16384 14.9 ms, 32768 11.9 ms,
65536 13.2 ms, unblocked 17.4 ms (medians of 9)."""


class Workspace:
    """Two scratch arrays per dtype, grown to the largest size asked for, reused.

    Example:
        >>> ws = Workspace()
        >>> t1, t2 = ws.take(np.dtype(np.float32), (2, 3))
        >>> t1.shape, t2.dtype
        ((2, 3), dtype('float32'))
    """

    def __init__(self) -> None:
        self._buffers: dict[np.dtype[Any], np.ndarray] = {}

    def take(self, dtype: np.dtype[Any], shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
        """Two scratch arrays of ``shape`` and ``dtype`` (views of the kept buffer)."""
        size = int(np.prod(shape))
        buffer = self._buffers.get(dtype)
        if buffer is None or buffer.shape[1] < size:
            buffer = np.empty((2, size), dtype)
            self._buffers[dtype] = buffer
        return buffer[0, :size].reshape(shape), buffer[1, :size].reshape(shape)


def apply(
    numpy_kernel: Callable[..., None],
    cuda_kernel: Callable[..., None],
    param: Any,
    grad: Any,
    *,
    states: Sequence[Any],
    workspace: Workspace,
    **scalars: Any,
) -> None:
    """Update ``param`` and its ``states`` (arrays or ``None``) in place from ``grad``.

    Example:
        >>> def nk(p, g, states, t1, t2, *, lr):
        ...     np.multiply(g, -lr, out=t1)
        ...     p += t1
        >>> p = np.ones(3)
        >>> apply(nk, None, p, np.full(3, 2.0), states=[], workspace=Workspace(), lr=0.25)
        >>> p
        array([0.5, 0.5, 0.5])
    """
    if is_cupy_array(param):
        with device_of(param):
            cuda_kernel(param, grad, states, **scalars)
        return
    if type(param) is HostArray:
        buffers: list[Any] = [host_buffer(param), host_buffer(grad)]
        buffers += [None if s is None else host_buffer(s) for s in states]
        _run_numpy(numpy_kernel, buffers, workspace, scalars)
        for written in [buffers[0], *buffers[2:]]:
            if written is not None:
                count_write(written)
        return
    _run_numpy(numpy_kernel, [param, grad, *states], workspace, scalars)


def _run_numpy(
    kernel: Callable[..., None],
    arrays: list[Any],
    workspace: Workspace,
    scalars: dict[str, Any],
) -> None:
    with np.errstate(invalid="ignore", over="ignore"):  # NaN and inf propagate, as in torch
        wide = opmath(arrays[0].dtype)
        if wide != arrays[0].dtype:
            _run_widened(kernel, arrays, wide, workspace, scalars)
        else:
            _run_blocks(kernel, arrays, workspace, scalars)


def _run_widened(
    kernel: Callable[..., None],
    arrays: list[Any],
    wide: np.dtype[Any],
    workspace: Workspace,
    scalars: dict[str, Any],
) -> None:
    """The kernel on ``wide`` copies of narrow arrays, the results rounded back (torch's opmath)."""
    copies: list[Any] = [None if a is None else a.astype(wide) for a in arrays]
    _run_blocks(kernel, copies, workspace, scalars)
    for i, (narrow, result) in enumerate(zip(arrays, copies, strict=True)):
        if narrow is not None and i != 1:  # arrays[1], the gradient, is only read
            np.copyto(narrow, result, casting="same_kind")


def _run_blocks(
    kernel: Callable[..., None],
    arrays: list[Any],
    workspace: Workspace,
    scalars: dict[str, Any],
) -> None:
    param = arrays[0]
    present = [a for a in arrays if a is not None]
    if param.size > BLOCK and all(a.flags.c_contiguous for a in present):
        flat = [None if a is None else a.reshape(-1) for a in arrays]
        t1, t2 = workspace.take(param.dtype, (BLOCK,))
        size = param.size
        for start in range(0, size, BLOCK):
            stop = min(start + BLOCK, size)
            n = stop - start
            blocks = [None if a is None else a[start:stop] for a in flat]
            kernel(blocks[0], blocks[1], blocks[2:], t1[:n], t2[:n], **scalars)
        return
    t1, t2 = workspace.take(param.dtype, param.shape)
    kernel(arrays[0], arrays[1], arrays[2:], t1, t2, **scalars)


def opmath(dtype: np.dtype[Any], /) -> np.dtype[Any]:
    """The type an update computes in: float32 for float16 arrays (torch's opmath), else theirs.

    Only the states and the parameter are rounded to float16 (once per step each), as torch
    rounds a float16 tensor at the end of each of its ops; NumPy and CUDA's float16 arithmetic
    would round every intermediate (and ``eps=1e-8`` to 0).

    Example:
        >>> opmath(np.dtype(np.float16)), opmath(np.dtype(np.float64))
        (dtype('float32'), dtype('float64'))
    """
    return np.dtype(np.float32) if dtype == np.float16 else dtype


def elementwise_kernel(in_params: str, out_params: str, body: str, name: str) -> Any:
    """The ``cupy.ElementwiseKernel`` of that source (made once per source and CuPy module)."""
    return _kernel(require_cupy(), in_params, out_params, body, name)


@functools.cache
def _kernel(cupy: Any, in_params: str, out_params: str, body: str, name: str) -> Any:
    return cupy.ElementwiseKernel(in_params, out_params, body, name)
