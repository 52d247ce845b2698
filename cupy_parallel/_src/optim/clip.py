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
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):  # torch's silent NaN, inf
        if device.kind == "host":
            result = compute(np, *[host_buffer(a) for a in arrays])
            return host_array(np.asarray(result), device)
        return np.asarray(compute(np, *arrays))


def _vector_norm(xp: Any, x: Any, p: float) -> Any:
    """The ``p``-norm of ``x``, in ``x``'s dtype; float16 is summed in float32 (torch's opmath).

    NumPy and CuPy would sum float16 in float16 (and cast ``p`` to float16), so a norm past
    65504 would be inf and one of small gradients 0, where torch's is finite.
    """
    flat = x.reshape(-1)
    if flat.size == 0 and p == -math.inf:  # min over nothing: its identity (an empty shard)
        return xp.full((), math.inf, dtype=np.finfo(x.dtype).dtype)  # real for complex
    if x.dtype == np.float16:
        flat = flat.astype(np.float32)
    norm = np.linalg.vector_norm(flat, ord=p) if xp is np else xp.linalg.norm(flat, ord=p)
    return norm.astype(np.float16) if x.dtype == np.float16 else norm


def _coefficient(xp: Any, total: Any, max_norm: float) -> Any:
    """The coefficient ``clamp(max_norm / (total + 1e-6), max=1)`` op by op as torch does.

    torch's ``number / tensor`` is ``tensor.reciprocal() * number``, and a Python number
    enters an op in the opmath type (float32 for float16): ``max_norm = 1e9`` times the
    reciprocal 0 of an infinite float16 total is 0 there, where NumPy's float16 ``1e9`` (inf)
    would make it NaN.
    """
    wide = np.float32 if total.dtype == np.float16 else total.dtype
    shifted = (total.astype(wide) + 1e-6).astype(total.dtype)
    reciprocal = xp.reciprocal(shifted)
    return xp.minimum((reciprocal.astype(wide) * max_norm).astype(total.dtype), 1.0)


def _scale(xp: Any, g: Any, c: Any) -> Any:
    """``g * c`` in ``g``'s dtype; float16 multiplied in float32, rounded once (torch's opmath)."""
    if g.dtype == np.float16:
        return xp.multiply(g.astype(np.float32), c.astype(np.float32)).astype(np.float16)
    return xp.multiply(g, c.astype(g.dtype))


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
        norm_type: ``p`` of the norms (a float; ``math.inf`` or torch's ``'inf'`` for the
            max-norm).
        error_if_nonfinite: raise ``RuntimeError`` (torch's) when the total norm is NaN or
            infinite; otherwise the gradients are scaled by it anyway, as in torch.
        process_group: a process group over which ``grads`` are *shards* of the whole
            gradients (ZeRO, FSDP): the total is the norm of all the shards, from one
            ``all_reduce`` (the sum of ``p``-th powers; ``MAX`` for ``inf``; ``MIN`` for
            ``-inf``; a rank without gradients adds nothing). ``p = 0`` is refused with a group:
            torch's 0-"norm" counts the *tensors* with a nonzero entry, which no rank can tell
            from its shards (summing each rank's count gave 7 for 3 tensors on 4 ranks); like
            torch's FSDP, which cannot take it either. ``None``: the gradients are whole
            (replicated ranks, as under DDP, need no reduction). Every rank of the group must
            call it. ``p < 0`` and ``-inf`` are refused for FSDP's gradient shards, whose zero
            padding rows they would count.

    Returns:
        ``(clipped_grads, total_norm)``; with no gradient at all, ``total_norm`` is a 0-d
        float32 zero on the cpu (torch's ``tensor(0.0)``) and nothing is scaled.

    Raises:
        TypeError: a leaf that is neither an array nor ``None``, or not floating-point or
            complex; a non-number ``max_norm`` or ``norm_type``.
        ValueError: ``max_norm`` below 0 or NaN (torch scales by it: a negative one flips the
            gradients' signs); ``norm_type=0`` with a ``process_group``; ``norm_type < 0``
            for FSDP's gradient shards; gradient shards of a
            :class:`~cupy_parallel.FullyShardedDataParallel` (on more than one rank) without
            ``process_group``.
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
    if not max_norm >= 0:  # torch multiplies by it anyway: a negative one flips every gradient
        raise ValueError(f"max_norm must be >= 0 (a norm), got {max_norm}.")
    if isinstance(norm_type, str) and norm_type.strip().lower() in ("inf", "-inf"):
        norm_type = float(norm_type)  # torch documents the string 'inf'
    p = read_real(norm_type, "norm_type")
    error_if_nonfinite = read_bool(error_if_nonfinite, "error_if_nonfinite")
    if process_group is not None and p == 0:
        raise ValueError(
            "norm_type=0 cannot be computed from gradient shards (process_group): torch's "
            "0-norm counts the whole gradients with a nonzero entry, which a rank cannot tell "
            "from its shard; use norm_type=2.0, 1.0 or inf."
        )
    names, leaves, spec = tree.flatten_with_names(grads, "grads")
    for name, leaf in zip(names, leaves, strict=True):
        if not is_array(leaf):
            raise TypeError(
                f"{name} must be an array or None, got {type(leaf).__name__}; clip_grad_norm "
                "takes the gradients (a tree of arrays), not the parameters."
            )
        if leaf.dtype.kind not in "fc":  # an integer gradient would be scaled to 0
            raise TypeError(
                f"{name} must be a floating-point or complex array (a gradient), got dtype "
                f"{leaf.dtype}."
            )
    fsdp_shards = any(_SHARDED.get(id(leaf)) is leaf for leaf in leaves)
    if process_group is None and fsdp_shards:
        raise ValueError(
            "grads holds gradient shards of a FullyShardedDataParallel (each rank holds some "
            "rows of each gradient), whose norm is not the whole gradients': pass "
            "process_group=fsdp.process_group (dist.group.WORLD for the default group), as "
            "torch's clip_grad_norm_ reduces FSDP's sharded gradients."
        )
    if fsdp_shards and p < 0:
        raise ValueError(
            f"norm_type must be positive (or math.inf) for FullyShardedDataParallel's gradient "
            f"shards, got {p}: -inf and negative norms would see the zero rows that pad the "
            "shards as gradient zeros. Gather the gradients to clip with those norms."
        )
    total = _total_norm(leaves, p)
    if process_group is not None:
        total = _reduce_total(total, p, process_group, has_gradients=bool(leaves))
    if error_if_nonfinite and not bool(math.isfinite(float(to_device(total, "cpu")))):
        raise RuntimeError(
            f"The total norm of order {p} for gradients from `parameters` is non-finite, so it "
            "cannot be clipped. To disable this error and scale the gradients by the non-finite "
            "norm anyway, set `error_if_nonfinite=False`"
        )
    if not leaves:
        return spec.unflatten(leaves), total
    first = device_of(total)
    coefficient = _on(first, lambda xp, t: _coefficient(xp, t, max_norm), total)
    clipped = []
    for leaf in leaves:
        here = to_device(coefficient, device_of(leaf))
        clipped.append(_on(device_of(leaf), _scale, leaf, here))
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


def _reduce_total(total: Any, p: float, group: Any, *, has_gradients: bool) -> Any:
    """The norm over the group's shards from this rank's ``total``: one all_reduce, in float64.

    Every rank reduces a float64 value whatever its gradients' dtype (a rank without gradients
    has a float32 zero, torch's), so the ranks always agree on the buffer; the result comes
    back in ``total``'s dtype, on its device.
    """
    from cupy_parallel._src.distributed.reductions import all_reduce
    from cupy_parallel._src.enums import ReduceOp

    device = device_of(total)
    if math.isinf(p):
        op, power = (ReduceOp.MAX if p > 0 else ReduceOp.MIN), 1.0
    else:
        op, power = ReduceOp.SUM, p  # p != 0: clip_grad_norm refuses 0 with a group
    part = _on(device, lambda xp, t: (t.astype(np.float64) ** power).reshape(1), total)
    if not has_gradients:  # the reduction's identity (torch's zero would be 0**p = inf for p < 0)
        part[...] = math.inf if op == ReduceOp.MIN else 0.0
    all_reduce(part, op=op, group=group)
    return _on(device, lambda xp, s: (s ** (1.0 / power)).reshape(()).astype(total.dtype), part)
