"""The MPI backend's always-on argument comparisons, and their messages when the ranks disagree.

Rooted operations and ``all_to_all`` compare their arguments, always: ``broadcast``,
``reduce``, ``gather`` and ``scatter`` (and what is built on them) exchange the root each rank
named and the dtype and shape of its array alongside the operation, ``all_to_all`` (and
``all_to_all_single``) the byte counts each rank sends and expects; they finish only once
these agree. Ranks that disagree get ``ValueError`` naming them, on every rank, and the group
is unusable (MPI's result is undefined: one rank's array silently overwrites the root's; a
receiver expecting more than is sent keeps zeros; a reduction reads one dtype's bytes as
another's). The price is that rooted operations synchronise the group, as MPI allows any
collective to: ``benchmarks/bench_collectives.py`` reports a 4 KiB ``broadcast`` at 16–24 µs
against mpi4py's 2.3–3.1 (whose root returns at once) on 2 ranks, 75–95 µs against 7–9 on 4
ranks sharing 2 cores; the comparison itself costs about 8 µs and 56 µs of that. The other
collectives (``all_reduce``, ``all_gather``, ``reduce_scatter`` and their ``_tensor`` forms)
compare shapes and dtypes only in the debug mode (``DETAIL``): an exchange beside each would
double the 4-rank ``all_reduce`` latency.

The backend's work runs the exchange (an ``Iallgather`` on the group's control communicator,
overlapping the operation); this module says what each rank sends (a few ``int64``) and what the
rows of every rank mean.
"""

from __future__ import annotations

import zlib
from typing import TYPE_CHECKING, Any

import numpy as np

from cupy_parallel._src.distributed.backend import disagreeing, per_rank

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    # What a rank sends, and what says how every rank's rows disagree (None: they agree).
    Comparison = tuple[np.ndarray, Callable[[np.ndarray], str | None]]

__all__ = ["compare_counts", "compare_root_and_array", "dtype_row", "dtype_said"]


def dtype_row(dtype: np.dtype[Any]) -> list[int]:
    """A dtype as the ranks compare it: number, item size and a checksum of its spelling.

    The number and item size name it (:func:`dtype_said`); the spelling holds the byte order
    and the unit.
    """
    return [dtype.num, dtype.itemsize, zlib.crc32(dtype.str.encode())]


def dtype_said(number: int, itemsize: int) -> str:
    """The name of a dtype the ranks compared by ``dtype.num`` and ``dtype.itemsize``."""
    dtype = _DTYPES_BY_NUMBER.get(number)
    name = dtype.name if dtype is not None else f"dtype number {number}"
    if dtype is None or dtype.kind in "SUVMm":  # flexible, or with a unit: say the item size
        name = f"{name} ({itemsize}-byte items)"
    return name


_DTYPES_BY_NUMBER: dict[int, np.dtype[Any]] = {
    np.dtype(code).num: np.dtype(code) for code in np.typecodes["All"]
}


def compare_root_and_array(root: int, array: Any, world: Sequence[int], /) -> Comparison:
    """What the ranks exchange to compare the root (group rank) each named and their arrays.

    ``world`` holds the group's ranks as global ranks, for the messages. Both travel in the one
    exchange, so comparing the arrays costs no more than comparing the roots: their dtypes,
    shapes (and so sizes) must agree, as the debug mode requires of every collective. Otherwise
    MPI gives the root a reduction over garbage, or leaves part of an array as it was, or reads
    one dtype's bytes as another's.
    """
    shape = zlib.crc32(repr(array.shape).encode())
    mine = np.array([root, *dtype_row(array.dtype), array.size, array.ndim, shape], np.int64)

    def verify(every: np.ndarray) -> str | None:
        roots = every[:, 0].tolist()
        if roots.count(roots[0]) != len(roots):
            named = per_rank([world[r] for r in roots], world)
            return (
                f"{disagreeing(roots, world)} in the root they named (src/dst, as global "
                f"ranks: {named}). Every rank must pass the same root."
            )
        arrays = [tuple(row) for row in every[:, 1:].tolist()]
        if arrays.count(arrays[0]) == len(arrays):
            return None
        said = [
            f"{dtype_said(number, itemsize)}, {size} elements, {ndim}-d"
            for number, itemsize, _, size, ndim, _ in arrays
        ]
        layout = (
            " (the same dtype and size: their shapes or byte orders differ; the debug mode "
            "CUPY_PARALLEL_DISTRIBUTED_DEBUG=DETAIL names the shapes)"
            if len(set(said)) == 1
            else ""
        )
        passed = per_rank(said, world)
        return (
            f"{disagreeing(arrays, world)} in the array they passed{layout} ({passed}). Every "
            "rank must pass an array of the same dtype and shape."
        )

    return mine, verify


def compare_counts(
    sends: Sequence[int], receives: Sequence[int], dtype: np.dtype[Any], world: Sequence[int], /
) -> Comparison:
    """What the ranks exchange to compare the bytes each sends to and expects from each other.

    And the dtype (each rank's inputs and outputs share one): bytes of another dtype, even
    of the same size, would be read as garbage.
    """
    size = len(sends)

    def verify(every: np.ndarray) -> str | None:
        sent, expected = every[:, :size], every[:, size : 2 * size]  # [r, j]: r sends j
        pairs = [
            f"rank {world[r]} sends {sent[r, j]} bytes to rank {world[j]}, which expects "
            f"{expected[j, r]}"
            for r in range(size)
            for j in range(size)
            if sent[r, j] != expected[j, r]
        ]
        if pairs:
            return (
                f"the ranks disagree on the sizes they exchange (global ranks): "
                f"{'; '.join(pairs)}. What rank r sends to rank j must be the size rank j "
                "expects from rank r."
            )
        dtypes = [tuple(row) for row in every[:, 2 * size :].tolist()]
        if dtypes.count(dtypes[0]) == len(dtypes):
            return None
        said = [dtype_said(number, itemsize) for number, itemsize, _ in dtypes]
        order = "; their byte orders differ" if len(set(said)) == 1 else ""
        passed = per_rank(said, world)
        return (
            f"{disagreeing(dtypes, world)} in the dtype they exchange ({passed}{order}). "
            "Every rank must pass arrays of one dtype."
        )

    mine = [*sends, *receives, *dtype_row(dtype)]
    return np.array(mine, np.int64), verify
