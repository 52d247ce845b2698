"""Random collective programs on thread ranks equal a NumPy model (issue 22's property).

A program is a sequence of collectives, each on a random group (a subset of the world made by
``new_group``), with a random root and reduction; every rank holds one row of values per step,
drawn by ``cupy_parallel.testing.rank_arrays``. ``assert_distributed_matches`` runs the program
on 1-4 thread ranks (``dist.spawn``) and compares, bit for bit, every output of every rank with
what the model computes from all the ranks' rows at once.

Values are small integers in every dtype, so sums and products are exact in any order (MPI may
reduce in any order) and the comparison can be bit-exact.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cupy_parallel.distributed as dist
from cupy_parallel.testing import assert_distributed_matches, rank_arrays

WIDTH = 12  # a row splits evenly among 1, 2, 3 or 4 members
KINDS = (
    "all_reduce", "broadcast", "reduce", "all_gather", "gather", "scatter", "reduce_scatter",
    "all_to_all",
)  # fmt: skip
REDUCTIONS = {
    "SUM": np.add,
    "MIN": np.minimum,
    "MAX": np.maximum,
    "PRODUCT": np.multiply,
}
DTYPES = (np.int32, np.int64, np.float32, np.float64)


@st.composite
def programs(draw: Any, world: int, dtype: Any) -> list[tuple[Any, ...]]:
    """Steps ``(kind, members, root, reduction)``: members sorted world ranks, root one of them."""
    steps = []
    for _ in range(draw(st.integers(1, 5))):
        members = tuple(sorted(draw(st.sets(st.integers(0, world - 1), min_size=1))))
        kind = draw(st.sampled_from(KINDS))
        root = draw(st.sampled_from(members))
        names = [n for n in REDUCTIONS if not (n == "PRODUCT" and dtype == np.float32)]
        steps.append((kind, members, root, draw(st.sampled_from(names))))
    return steps


def _small(rows: np.ndarray, dtype: Any) -> np.ndarray:
    """Small integers (-4..4) in ``dtype``: exact sums and products of up to 4 ranks."""
    return (rows.astype(np.int64) % 9 - 4).astype(dtype)


def run_program(program: list[tuple[Any, ...]], dtype: Any, rows: np.ndarray) -> list[Any]:
    """One rank's part: every step's outputs (``None`` where this rank takes no part)."""
    rank = dist.get_rank()
    values = _small(rows, dtype)
    groups = {}
    for _, members, _, _ in program:  # every rank makes the same groups in the same order
        if members not in groups:
            groups[members] = dist.new_group(list(members))
    outputs: list[Any] = []
    for step, (kind, members, root, reduction) in enumerate(program):
        if rank not in members:
            outputs.append(None)
            continue
        group, m, x = groups[members], len(members), values[step].copy()
        op = getattr(dist.ReduceOp, reduction)
        chunks = [c.copy() for c in np.split(x, m)]
        if kind == "all_reduce":
            dist.all_reduce(x, op=op, group=group)
            outputs.append(x)
        elif kind == "broadcast":
            dist.broadcast(x, src=root, group=group)
            outputs.append(x)
        elif kind == "reduce":
            dist.reduce(x, dst=root, op=op, group=group)
            outputs.append(x if rank == root else None)
        elif kind == "all_gather":
            out = [np.empty_like(x) for _ in members]
            dist.all_gather(out, x, group=group)
            outputs.append(out)
        elif kind == "gather":
            out = [np.empty_like(x) for _ in members] if rank == root else None
            dist.gather(x, out, dst=root, group=group)
            outputs.append(out)
        elif kind == "scatter":
            out = np.empty_like(chunks[0])
            dist.scatter(out, chunks if rank == root else None, src=root, group=group)
            outputs.append(out)
        elif kind == "reduce_scatter":
            out = np.empty_like(chunks[0])
            dist.reduce_scatter(out, chunks, op=op, group=group)
            outputs.append(out)
        else:  # all_to_all
            out = [np.empty_like(c) for c in chunks]
            dist.all_to_all(out, chunks, group=group)
            outputs.append(out)
    return outputs


def model(program: list[tuple[Any, ...]], dtype: Any, rows: list[np.ndarray]) -> list[list[Any]]:
    """The same program on all ranks' values at once, in NumPy."""
    values = [_small(r, dtype) for r in rows]
    expected: list[list[Any]] = [[] for _ in rows]
    for step, (kind, members, root, reduction) in enumerate(program):
        x = {r: values[r][step] for r in members}
        m, ufunc = len(members), REDUCTIONS[reduction]
        total = functools.reduce(ufunc, (x[r] for r in members))
        split = {r: np.split(x[r], m) for r in members}
        for rank in range(len(rows)):
            if rank not in members:
                expected[rank].append(None)
                continue
            me = members.index(rank)
            result = {
                "all_reduce": total,
                "broadcast": x[root],
                "reduce": total if rank == root else None,
                "all_gather": [x[r] for r in members],
                "gather": [x[r] for r in members] if rank == root else None,
                "scatter": split[root][me],
                "reduce_scatter": functools.reduce(ufunc, (split[r][me] for r in members)),
                "all_to_all": [split[r][me] for r in members],
            }[kind]
            expected[rank].append(result)
    return expected


@pytest.mark.slow
@settings(max_examples=40, deadline=None)
@given(data=st.data(), dtype=st.sampled_from(DTYPES))
def test_random_collective_programs_equal_the_numpy_model(data: Any, dtype: Any) -> None:
    rows = data.draw(rank_arrays(np.int8, (5, WIDTH), max_size=4), label="rows")
    program = data.draw(programs(len(rows), dtype), label="program")
    assert_distributed_matches(
        functools.partial(run_program, program, dtype),
        rows,
        functools.partial(model, program, dtype),
    )
