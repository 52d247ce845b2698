"""Gradient clipping by total norm: torch.nn.utils.clip_grad_norm_'s math, functional.

torch's order: each gradient's ``p``-norm on its own device, the norm of those norms on the
first gradient's device (the total), then every gradient times
``min(max_norm / (total + 1e-6), 1)``. Gradients are values here (the tape returns them), so
the clipped gradients are new arrays and the given ones are left as they are.
"""

from __future__ import annotations

import math
import weakref
from typing import TYPE_CHECKING, Any

import numpy as np

from cupy_parallel._src import tree
from cupy_parallel._src.arguments import read_bool, read_real
from cupy_parallel._src.arrays import device_of, is_array, to_device
from cupy_parallel._src.hostarray import host_array, host_buffer

if TYPE_CHECKING:
    from cupy_parallel._src.devices import Device

__all__ = ["clip_grad_norm", "mark_sharded_gradients"]

_SHARDED: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
"""Live gradient arrays that are one rank's shard of a larger gradient, by id."""


def mark_sharded_gradients(arrays: list[Any]) -> None:
    """Note ``arrays`` as gradient shards (FSDP's): clipping them needs ``process_group``."""
    for a in arrays:
        _SHARDED[id(a)] = a


def _on(device: Device, compute: Any, *arrays: Any) -> Any:
    """``compute(xp, *arrays)`` on ``device``: CuPy there, NumPy on the cpu and host buffers."""
    if device.kind == "cuda":
        with device:
            return compute(device.xp, *arrays)
    with np.errstate(invalid="ignore", over="ignore"):  # torch's silent NaN and inf
        if device.kind == "host":
            result = compute(np, *[host_buffer(a) for a in arrays])
            return host_array(np.asarray(result), device)
        return np.asarray(compute(np, *arrays))


def _vector_norm(xp: Any, x: Any, p: float) -> Any:
    flat = x.reshape(-1)
    if xp is np:
        return np.linalg.vector_norm(flat, ord=p)
    return xp.linalg.norm(flat, ord=p)


def clip_grad_norm(
    grads: Any,
    max_norm: float,
    norm_type: float = 2.0,
    *,
    error_if_nonfinite: bool = False,
    process_group: Any = None,
) -> tuple[Any, Any]:
    """Scale ``grads`` so that their total ``norm_type``-norm is at most ``max_norm``.

    torch's ``clip_grad_norm_`` math: the total norm is the ``norm_type``-norm of the
    gradients' norms (``inf``: the largest absolute value, ``1``, ``2`` or any other ``p``),
    computed on the device of the first gradient (in flatten order), where it is returned as a
    0-d array; every gradient is multiplied by ``min(max_norm / (total + 1e-6), 1)`` on its own
    device, in its dtype.

    Decided here: the function is **out of place** (torch's ``clip_grad_norm_`` scales ``.grad``
    in place): it returns ``(clipped_grads, total_norm)``, the clipped gradients as a new tree
    shaped as ``grads`` with new arrays, and leaves ``grads`` untouched, which fits gradients
    that the tape returns as values. ``None`` leaves stay ``None``.

    Args:
        grads: a pytree of arrays (NumPy, HostArray, CuPy; any devices) and ``None``.
        max_norm: the largest total norm.
        norm_type: ``p`` of the norms (a float, ``math.inf`` for the max-norm).
        error_if_nonfinite: raise ``RuntimeError`` (torch's) when the total norm is NaN or
            infinite; otherwise the gradients are scaled by it anyway, as in torch.
        process_group: a process group over which ``grads`` are *shards* of the whole
            gradients (ZeRO, FSDP): the total is the norm of all the shards, from one
            ``all_reduce`` (the sum of ``p``-th powers; ``MAX`` for ``inf``); only ``p > 0``
            and ``inf`` (``ValueError`` otherwise: ``p = 0`` counts whole gradients, and
            ``-inf`` or ``p < 0`` would count FSDP's zero padding rows). ``None``: the
            gradients are whole (replicated ranks, as under DDP, need no reduction). Every
            rank of the group must call it.

    Returns:
        ``(clipped_grads, total_norm)``; with no gradient at all, ``total_norm`` is a 0-d
        float32 zero on the cpu (torch's ``tensor(0.0)``) and nothing is scaled.

    Raises:
        TypeError: a leaf that is neither an array nor ``None``; a non-number ``max_norm`` or
            ``norm_type``.
        ValueError: ``norm_type <= 0`` (``0``, negative, ``-inf``) with ``process_group``;
            gradient shards of a :class:`~cupy_parallel.FullyShardedDataParallel` (on more
            than one rank) without ``process_group``.
        RuntimeError: the total norm is not finite and ``error_if_nonfinite``.

    Example:
        >>> import numpy as np
        >>> import cupy_parallel as cp
        >>> grads = {"w": np.array([3.0, 0.0]), "b": np.array([4.0]), "frozen": None}
        >>> clipped, total = cp.clip_grad_norm(grads, max_norm=1.0)
        >>> float(total), clipped["frozen"]
        (5.0, None)
        >>> clipped["w"].round(6), grads["w"]          # the input is not changed
        (array([0.6, 0. ]), array([3., 0.]))
    """
    max_norm = read_real(max_norm, "max_norm")
    p = read_real(norm_type, "norm_type")
    error_if_nonfinite = read_bool(error_if_nonfinite, "error_if_nonfinite")
    names, leaves, spec = tree.flatten_with_names(grads, "grads")
    for name, leaf in zip(names, leaves, strict=True):
        if not is_array(leaf):
            raise TypeError(
                f"{name} must be an array or None, got {type(leaf).__name__}; clip_grad_norm "
                "takes the gradients (a tree of arrays), not the parameters."
            )
    if process_group is None and any(_SHARDED.get(id(leaf)) is leaf for leaf in leaves):
        raise ValueError(
            "grads holds gradient shards of a FullyShardedDataParallel (each rank holds some "
            "rows of each gradient), whose norm is not the whole gradients': pass "
            "process_group=fsdp.process_group (dist.group.WORLD for the default group), as "
            "torch's clip_grad_norm_ reduces FSDP's sharded gradients."
        )
    if process_group is not None and not p > 0:
        raise ValueError(
            f"norm_type must be positive (or math.inf) with process_group, got {p}: the "
            "total of norm_type <= 0 cannot be assembled from shards. p = 0 counts the "
            "gradients with a nonzero element (torch's math), which one reduction of per-rank "
            "counts cannot give, and -inf and negative norms would see the zero rows that "
            "pad FullyShardedDataParallel's shards (and a rank without gradients) as "
            "gradient zeros. Gather the gradients to clip with those norms."
        )
    total = _total_norm(leaves, p)
    if process_group is not None:
        total = _reduce_total(total, p, process_group)
    if error_if_nonfinite and not bool(math.isfinite(float(to_device(total, "cpu")))):
        raise RuntimeError(
            f"The total norm of order {p} for gradients from `parameters` is non-finite, so it "
            "cannot be clipped. To disable this error and scale the gradients by the non-finite "
            "norm anyway, set `error_if_nonfinite=False`"
        )
    if not leaves:
        return spec.unflatten(leaves), total
    first = device_of(total)
    coefficient = _on(first, lambda xp, t: xp.minimum(max_norm / (t + 1e-6), 1.0), total)
    clipped = []
    for leaf in leaves:
        here = to_device(coefficient, device_of(leaf))
        clipped.append(
            _on(device_of(leaf), lambda xp, g, c: xp.multiply(g, c.astype(g.dtype)), leaf, here)
        )
    return spec.unflatten(clipped), total


def _total_norm(leaves: list[Any], p: float) -> Any:
    """The ``p``-norm of the leaves' ``p``-norms, a 0-d array on the first leaf's device."""
    if not leaves:
        return np.zeros((), np.float32)
    first = device_of(leaves[0])
    norms = [
        to_device(_on(device_of(g), lambda xp, x: _vector_norm(xp, x, p), g), first) for g in leaves
    ]
    dtype = np.result_type(*[n.dtype for n in norms])
    return _on(
        first, lambda xp, *ns: _vector_norm(xp, xp.stack([n.astype(dtype) for n in ns]), p), *norms
    )


def _reduce_total(total: Any, p: float, group: Any) -> Any:
    """The norm over the group's shards from this rank's ``total``: one all_reduce, in float64.

    Every rank reduces a float64 value whatever its gradients' dtype (a rank without gradients
    has a float32 zero, torch's), so the ranks always agree on the buffer; the result comes
    back in ``total``'s dtype, on its device.
    """
    from cupy_parallel._src.distributed.reductions import all_reduce
    from cupy_parallel._src.enums import ReduceOp

    device = device_of(total)
    if math.isinf(p):  # p > 0 here (clip_grad_norm refuses the others)
        op, power = ReduceOp.MAX, 1.0
    else:
        op, power = ReduceOp.SUM, p
    part = _on(device, lambda xp, t: (t.astype(np.float64) ** power).reshape(1), total)
    all_reduce(part, op=op, group=group)
    return _on(device, lambda xp, s: (s ** (1.0 / power)).reshape(()).astype(total.dtype), part)
