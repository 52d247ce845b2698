"""The ops that move and add up elements: shapes, indexing, joining, sums, and ``fit``.

``reshape``, ``transpose``, ``getitem``, ``concatenate``, ``stack``, ``split`` and ``sum`` are
linear, and so are their vjps: each is written with the ops of this module (``sum``'s is a
broadcast, a broadcast's a sum). Every vjp of every op ends with :func:`fit`, which reduces a
broadcast gradient to its input's shape and dtype with ``sum``, ``reshape`` and the tape's
recorded cast: the other op modules build on this one.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any, TypeAlias

import numpy as np
from numpy.lib.array_utils import normalize_axis_index, normalize_axis_tuple

from cupy_parallel._src.arguments import read_axis, read_int
from cupy_parallel._src.arrays import device_of, is_array
from cupy_parallel._src.compute import host_operand, run_kernel, run_on, zeros_like
from cupy_parallel._src.hostarray import HostArray
from cupy_parallel._src.recording import active_tapes, cast, record, record_unary

if TYPE_CHECKING:
    from collections.abc import Sequence

    from cupy_parallel._src.arrays import Array

__all__ = [
    "Args",
    "Grads",
    "Needs",
    "concatenate",
    "fit",
    "getitem",
    "read_axes",
    "refuse_complex",
    "require_array",
    "reshape",
    "split",
    "spread",
    "stack",
    "sum",
    "transpose",
]


Args: TypeAlias = tuple[Any, ...]
Needs: TypeAlias = tuple[bool, ...]
Grads: TypeAlias = tuple[Any, ...]


def require_array(x: Any, op: str) -> None:
    """Refuse an ``x`` that is no array: ``ops.<op>`` takes one."""
    if not is_array(x):
        raise TypeError(f"ops.{op} takes an array, got {type(x).__name__}.")


def refuse_complex(op: str, z: Any, inputs: Args) -> None:
    """Refuse to record ``z = ops.<op>(*inputs)`` when ``z`` is complex: a real-only gradient.

    Called by the ops whose vjp holds for real numbers only (an order, a real formula), when a
    tape records them; an op no tape records computes as NumPy does.
    """
    if z.dtype.kind == "c" and any(t.tracks(x) for t in active_tapes() for x in inputs):
        raise TypeError(
            f"ops.{op} has no gradient for complex arrays (its result is {z.dtype}): its "
            "gradient is defined for real numbers only. Record it on real arrays (ops.real, "
            "ops.imag, ops.abs), or compute it outside the tape (cupy_parallel.stop_gradient)."
        )


# --------------------------------------------------------------------------------------------
# Gradient plumbing, written with ops so that it is recorded under an outer tape


def fit(g: Any, x: Any) -> Any:
    """Reduce a broadcast gradient ``g`` to the shape and dtype of the input ``x``.

    A complex ``g`` for a real ``x`` becomes its real part (the recorded cast): a real input of
    complex arithmetic gets ``dL/dx``, as PyTorch's derivative formulas give it. Every vjp
    calls this once per input gradient, mostly with ``g`` already fitting: the reduction lives
    in :func:`_unbroadcast` so that this common case creates no closure cells (its generator
    expression would, on every call).
    """
    if g.shape != x.shape:
        g = _unbroadcast(g, x)
    return g if g.dtype == x.dtype else cast(g, x.dtype)


def _unbroadcast(g: Any, x: Any) -> Any:
    """Sum the broadcast gradient ``g`` over the axes broadcasting added to ``x``'s shape."""
    lead = g.ndim - x.ndim
    axes = (
        *range(lead),
        *(lead + i for i, n in enumerate(x.shape) if n == 1 and g.shape[lead + i] != 1),
    )
    return reshape(sum(g, axes, keepdims=True), x.shape)


def _broadcast_to_kernel(xp: Any, x: Any, shape: tuple[int, ...]) -> Any:
    z = xp.empty(shape, x.dtype)  # a writable array, never a stride-0 view
    xp.copyto(z, x)  # (``broadcast_to(x, shape).copy()`` costs 4 times as much in NumPy)
    return z


def _broadcast_to(x: Any, shape: tuple[int, ...], /) -> Any:
    z = run_on(_broadcast_to_kernel, x, shape)  # shape: a tuple of ints (spread's)
    if active_tapes():
        record_unary(_broadcast_to_vjp, x, z, None)
    return z


def _broadcast_to_vjp(gs: list[Any], xs: Args, needs: Needs, zs: Args, aux: None) -> Grads:
    return (fit(gs[0], xs[0]),)


def spread(g: Any, x: Any, axes: tuple[int, ...], keepdims: bool) -> Any:
    """The gradient of a reduction over ``axes``: ``g`` copied along them to ``x``'s shape."""
    if not keepdims and axes != tuple(range(len(axes))):  # leading axes broadcast back as they are
        g = reshape(g, tuple([1 if i in axes else n for i, n in enumerate(x.shape)]))
    return g if g.shape == x.shape else _broadcast_to(g, x.shape)


# --------------------------------------------------------------------------------------------
# Sums


def read_axes(x: Any, axis: int | tuple[int, ...] | None) -> tuple[int, ...]:
    """``axis`` of ``x`` as a tuple of non-negative axes (``None``: all of them)."""
    if axis is None:
        return tuple(range(x.ndim))
    if type(axis) is int:  # one axis: NumPy's C check, with the same error (1.8 -> 0.2 us)
        return (normalize_axis_index(axis, x.ndim, "axis"),)
    return tuple(normalize_axis_tuple(axis, x.ndim, "axis"))


def _sum_kernel(xp: Any, x: Any, axis: Any, keepdims: bool) -> Any:
    return x.sum(axis, keepdims=keepdims)  # the method: numpy.sum is a Python wrapper


_sum_kernel.__name__ = "sum"


def sum(x: Array, /, axis: int | tuple[int, ...] | None = None, *, keepdims: bool = False) -> Array:
    """Sum over ``axis`` (all axes by default), differentiable.

    Example:
        >>> import numpy as np
        >>> from cupy_parallel import ops
        >>> ops.sum(np.ones((2, 3)), axis=0)
        array([2., 2., 2.])
    """
    require_array(x, "sum")
    axes = read_axes(x, axis)
    if type(x) is np.ndarray:  # what run_kernel does, without its checks (0.6 us of 1.9)
        z = _sum_kernel(np, x, axes, keepdims)
        z = z if type(z) is np.ndarray else np.asarray(z)  # NumPy's 0-d result
    elif type(keepdims) is bool:  # axes: read_axes' tuple of ints
        z = run_on(_sum_kernel, x, axes, keepdims)
    else:
        z = run_kernel(_sum_kernel, x, x, axes, keepdims)
    if active_tapes():
        record_unary(_sum_vjp, x, z, (axes, keepdims))
    return z


def _sum_vjp(gs: list[Any], xs: Args, needs: Needs, zs: Args, aux: tuple[Any, bool]) -> Grads:
    return (spread(gs[0], xs[0], *aux),)


# --------------------------------------------------------------------------------------------
# Shapes, indexing, joining


def _reshape_kernel(xp: Any, x: Any, shape: Any) -> Any:
    return x.reshape(shape)  # the method: numpy.reshape is a Python wrapper around it


def _transpose_kernel(xp: Any, x: Any, axes: Any) -> Any:
    return x.transpose(axes)


_reshape_kernel.__name__, _transpose_kernel.__name__ = "reshape", "transpose"  # for messages


def reshape(x: Array, /, shape: int | tuple[int, ...]) -> Array:
    """``x`` with a new shape (one entry may be -1), differentiable.

    Example:
        >>> import numpy as np
        >>> from cupy_parallel import ops
        >>> ops.reshape(np.arange(4.0), (2, 2))
        array([[0., 1.],
               [2., 3.]])
    """
    require_array(x, "reshape")
    kind = type(shape)
    if kind is tuple or kind is int:  # no array in it (NumPy reads the items)
        z = run_on(_reshape_kernel, x, shape)
    else:
        z = run_kernel(_reshape_kernel, x, x, shape)
    if active_tapes():
        record_unary(_reshape_vjp, x, z, None)
    return z


def _reshape_vjp(gs: list[Any], xs: Args, needs: Needs, zs: Args, aux: None) -> Grads:
    return (reshape(gs[0], xs[0].shape),)


def transpose(x: Array, /, axes: tuple[int, ...] | None = None) -> Array:
    """``x`` with its axes permuted (reversed by default), differentiable.

    Example:
        >>> import numpy as np
        >>> from cupy_parallel import ops
        >>> ops.transpose(np.zeros((2, 3, 4)), (2, 0, 1)).shape
        (4, 2, 3)
    """
    require_array(x, "transpose")
    # a NumPy array directly, as sum does (every matmul's vjp transposes twice)
    if type(x) is np.ndarray:
        z = x.transpose(axes)
    elif axes is None or type(axes) is tuple:
        z = run_on(_transpose_kernel, x, axes)
    else:
        z = run_kernel(_transpose_kernel, x, x, axes)
    if active_tapes():
        record_unary(_transpose_vjp, x, z, None if axes is None else _inverse(axes, z.ndim))
    return z


def _inverse(axes: tuple[int, ...], ndim: int) -> tuple[int, ...]:
    """The permutation undoing ``axes`` (a valid permutation of ``ndim`` axes, some negative)."""
    inverse = [0] * ndim
    for i, axis in enumerate(axes):
        inverse[axis % ndim] = i
    return tuple(inverse)


def _transpose_vjp(gs: list[Any], xs: Args, needs: Needs, zs: Args, inverse: Any) -> Grads:
    return (transpose(gs[0], inverse),)


def _read_key(x: Any, index: Any) -> tuple[tuple[Any, ...], bool]:
    """``index`` as a tuple of raw components, and whether it repeats elements (int arrays)."""
    key = index if isinstance(index, tuple) else (index,)
    raw = []
    repeats = False
    for c in key:
        if isinstance(c, HostArray):
            if not isinstance(x, HostArray):
                raise TypeError(
                    f"ops.getitem indexes an array on {device_of(x)} with an index array on "
                    f"{c.device}. Move the index with cupy_parallel.to_device(index, "
                    f"'{device_of(x)}')."
                )
            c = host_operand(c, x.device, "getitem")  # noqa: PLW2901 - an index is a constant
        elif isinstance(c, list | tuple):
            c = np.asarray(c)  # noqa: PLW2901
        elif is_array(c) and c.dtype.kind == "f":
            raise IndexError(
                f"ops.getitem indexes with ints, slices, None, ..., integer or boolean arrays, "
                f"got a {c.dtype} array."
            )
        if is_array(c) and c.dtype.kind in "iu":
            repeats = True
        raw.append(c)
    return tuple(raw), repeats


def _getitem_kernel(xp: Any, x: Any, key: tuple[Any, ...]) -> Any:
    if xp is not np:
        key = tuple(xp.asarray(c) if isinstance(c, np.ndarray) else c for c in key)
    return x[key]


def getitem(x: Array, index: Any, /) -> Array:
    """``x[index]`` with NumPy's rules, differentiable.

    ``index`` may hold ints, slices, ``None``, ``...``, integer arrays (repeated elements get
    their gradients summed) and boolean masks. The result is a new array (a view of ``x`` for
    basic indexing, as in NumPy).

    Example:
        >>> import numpy as np
        >>> from cupy_parallel import ops
        >>> x = np.arange(6.0).reshape(2, 3)
        >>> ops.getitem(x, (1, slice(0, 2))), ops.getitem(x, x > 3.5)
        (array([3., 4.]), array([4., 5.]))
    """
    require_array(x, "getitem")
    key, repeats = _read_key(x, index)
    z = run_kernel(_getitem_kernel, x, x, key)
    if active_tapes():
        record_unary(_getitem_vjp, x, z, (key, repeats))
    return z


def _getitem_vjp(gs: list[Any], xs: Args, needs: Needs, zs: Args, aux: Any) -> Grads:
    key, repeats = aux
    return (_index_add(fit(gs[0], zs[0]), key, xs[0].shape, repeats),)


def _index_add_kernel(
    xp: Any, g: Any, key: tuple[Any, ...], shape: tuple[int, ...], repeats: bool
) -> Any:
    out = xp.zeros(shape, g.dtype)
    if xp is not np:
        key = tuple(xp.asarray(c) if isinstance(c, np.ndarray) else c for c in key)
    if repeats:
        xp.add.at(out, key, g)
    else:
        out[key] = g
    return out


def _index_add(g: Any, key: tuple[Any, ...], shape: tuple[int, ...], repeats: bool) -> Any:
    """Zeros of ``shape`` with ``g`` added at ``key`` (the adjoint of ``getitem``)."""
    z = run_kernel(_index_add_kernel, g, g, key, shape, repeats)
    if active_tapes():
        record_unary(_index_add_vjp, g, z, key)
    return z


def _index_add_vjp(gs: list[Any], xs: Args, needs: Needs, zs: Args, key: Any) -> Grads:
    return (getitem(gs[0], key),)


def _arrays(arrays: Any, op: str) -> tuple[Any, ...]:
    if is_array(arrays) or not isinstance(arrays, list | tuple):
        raise TypeError(f"ops.{op} takes a list or tuple of arrays, got {type(arrays).__name__}.")
    if not arrays:
        raise ValueError(f"ops.{op} needs at least one array, got an empty sequence.")
    for i, a in enumerate(arrays):
        if not is_array(a):
            raise TypeError(f"ops.{op} takes arrays, but item {i} is a {type(a).__name__}.")
    return tuple(arrays)


def _concatenate_kernel(xp: Any, arrays: Sequence[Any], axis: int) -> Any:
    return xp.concatenate(arrays, axis=axis)


def concatenate(arrays: Sequence[Array], /, axis: int = 0) -> Array:
    """Join ``arrays`` along an existing ``axis``, differentiable.

    Example:
        >>> import numpy as np
        >>> from cupy_parallel import ops
        >>> ops.concatenate([np.zeros(2), np.ones(1)])
        array([0., 0., 1.])
    """
    xs = _arrays(arrays, "concatenate")
    z = run_kernel(_concatenate_kernel, xs[0], list(xs), read_int(axis, "axis"))
    if active_tapes():
        axis = int(normalize_axis_index(axis, z.ndim))
        offsets = np.cumsum([x.shape[axis] for x in xs[:-1]]).tolist()
        record(_concatenate_vjp, xs, (z,), (axis, offsets))
    return z


def _concatenate_vjp(gs: list[Any], xs: Args, needs: Needs, zs: Args, aux: Any) -> Grads:
    axis, offsets = aux
    parts = split(gs[0], offsets, axis)
    return tuple(fit(p, x) if need else None for p, x, need in zip(parts, xs, needs, strict=True))


def _stack_kernel(xp: Any, arrays: Sequence[Any], axis: int) -> Any:
    return xp.stack(arrays, axis=axis)


def stack(arrays: Sequence[Array], /, axis: int = 0) -> Array:
    """Join ``arrays`` of one shape along a new ``axis``, differentiable.

    Example:
        >>> import numpy as np
        >>> from cupy_parallel import ops
        >>> ops.stack([np.zeros(2), np.ones(2)], axis=1)
        array([[0., 1.],
               [0., 1.]])
    """
    xs = _arrays(arrays, "stack")
    z = run_kernel(_stack_kernel, xs[0], list(xs), read_int(axis, "axis"))
    if active_tapes():
        record(_stack_vjp, xs, (z,), int(normalize_axis_index(axis, z.ndim)))
    return z


def _stack_vjp(gs: list[Any], xs: Args, needs: Needs, zs: Args, axis: int) -> Grads:
    lead = (slice(None),) * axis
    return tuple(
        fit(getitem(gs[0], (*lead, i)), x) if need else None
        for i, (x, need) in enumerate(zip(xs, needs, strict=True))
    )


def _split_kernel(xp: Any, x: Any, sections: int | list[int], axis: int) -> list[Any]:
    if isinstance(sections, int):
        return list(xp.split(x, sections, axis=axis))
    lead = (slice(None),) * axis
    cuts = [0, *sections, x.shape[axis]]
    keys = [(*lead, slice(a, b)) for a, b in itertools.pairwise(cuts)]
    return [x[key] for key in keys]


def split(x: Array, indices_or_sections: int | Sequence[int], /, axis: int = 0) -> list[Array]:
    """Split ``x`` along ``axis`` into equal sections or at indices (``numpy.split``).

    With indices, piece ``i`` is ``x[cuts[i]:cuts[i + 1]]`` along ``axis``, where ``cuts`` is
    ``[0, *indices, length]`` and each slice has Python's rules (negative indices count from
    the end), as in NumPy (and ``torch.tensor_split``). Indices need not increase:
    ``split(x, [3, 1])`` gives ``x[:3]``, an empty ``x[3:1]`` and ``x[1:]``, which overlap;
    the gradient of ``x`` then adds up the gradients of every piece that holds an element.

    Example:
        >>> import numpy as np
        >>> from cupy_parallel import ops
        >>> ops.split(np.arange(5.0), [2])
        [array([0., 1.]), array([2., 3., 4.])]
    """
    require_array(x, "split")
    axis = read_axis(axis, x.ndim)
    sections: int | list[int]
    if isinstance(indices_or_sections, list | tuple) or (
        isinstance(indices_or_sections, np.ndarray) and indices_or_sections.ndim == 1
    ):  # a 1-d NumPy array of indices, as numpy.split takes
        sections = [
            read_int(i, f"indices_or_sections[{k}]") for k, i in enumerate(indices_or_sections)
        ]
    else:
        sections = read_int(indices_or_sections, "indices_or_sections", minimum=1)
        if x.shape[axis] % sections:
            raise ValueError(
                f"ops.split cannot cut axis {axis} of length {x.shape[axis]} into {sections} "
                "equal sections; pass the split indices instead."
            )
    zs = run_kernel(_split_kernel, x, x, sections, axis)
    if active_tapes():
        record(_split_vjp, (x,), tuple(zs), (axis, _split_positions(x.shape[axis], sections)))
    return zs


def _split_positions(length: int, sections: int | list[int]) -> Any:
    """``None`` when the pieces of ``split`` tile the axis in order, else where they lie.

    Equal sections and non-decreasing indices tile the axis, and the gradient is the pieces'
    gradients joined. Otherwise (decreasing indices: empty and overlapping pieces) it is the
    joined gradients added at the positions of the pieces' elements along the axis, in order.
    """
    if isinstance(sections, int):
        return None
    cuts = [0, *sections, length]
    pieces = [np.arange(*slice(a, b).indices(length)) for a, b in itertools.pairwise(cuts)]
    positions = np.concatenate(pieces)
    if positions.size == length and (positions == np.arange(length)).all():
        return None
    return positions


def _split_vjp(gs: list[Any], xs: Args, needs: Needs, zs: Args, aux: Any) -> Grads:
    axis, positions = aux
    parts = [zeros_like(z) if g is None else g for g, z in zip(gs, zs, strict=True)]
    joined = concatenate(parts, axis)
    if positions is None:
        return (fit(joined, xs[0]),)
    key = (*(slice(None),) * axis, positions)
    return (fit(_index_add(joined, key, xs[0].shape, repeats=True), xs[0]),)
