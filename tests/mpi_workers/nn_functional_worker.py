"""The differentiable collectives against one-process oracles: ``mpiexec -n N python <this> MODE``.

Every ``check_*`` function is a plain function of the running ranks: it reads
``dist.get_rank()``/``dist.get_world_size()`` only, builds every rank's data from seeds, and so
computes the one-process oracle itself (the sum over ranks of the ranks' losses, with
``cupy_parallel.ops`` and ``Tape`` on NumPy arrays). A mismatch raises ``AssertionError``. The
checks take ``kind``: ``"cpu"`` (NumPy arrays), ``"host"`` (``host:0`` arrays) or ``"cupy"``
(CuPy arrays; under ``simulated_cuda`` in mode ``simulated-cupy``). ``main()`` runs them after
``init_process_group``; other launchers (thread ranks) may call them the same way.

Modes: ``all`` (every check), ``zero-cotangent`` (that check alone, with a short timeout: code
whose collective vjps do not run on every pass hangs, then times out), ``simulated-cupy``, and
``cupy`` (CuPy arrays in the running world: NCCL thread ranks). ``rank_main(rank, [mode])``
runs a mode on a thread rank of ``spawn`` (tests/thread_ranks.py).
"""

from __future__ import annotations

import sys
import traceback
import warnings
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import numpy as np

import cupy_parallel
from cupy_parallel import Tape, ops
from cupy_parallel import distributed as dist
from cupy_parallel.distributed import ReduceOp
from cupy_parallel.distributed.nn import functional as nnf

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

RTOL, ATOL = 1e-10, 1e-12
SMOOTH_OPS = [ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MAX, ReduceOp.MIN]


# ---------------------------------------------------------------------------------------------
# Data, placement and the harness


def data(tag: str, rank: int, shape: tuple[int, ...]) -> np.ndarray:
    """Rank ``rank``'s array ``tag``: the same on every rank that asks (seeded)."""
    seed = [sum(map(ord, tag)), len(tag), rank]
    return np.random.default_rng(seed).standard_normal(shape)


def put(x: Any, kind: str) -> Any:
    """``x`` (NumPy) as an array of ``kind``."""
    if kind == "cpu":
        return np.array(x)
    if kind == "host":
        return cupy_parallel.to_device(np.array(x), "host:0")
    from cupy_parallel._src.devices import cupy_module

    # the current GPU: GPU 0 of an MPI rank's own process, GPU r of NCCL thread rank r
    return cupy_parallel.to_device(np.array(x), f"cuda:{cupy_module().cuda.Device().id}")


def host(x: Any) -> np.ndarray:
    """Any array (or None, read as 0) as NumPy, for comparisons."""
    if x is None:
        return np.zeros(())
    return np.asarray(cupy_parallel.to_device(x, "cpu"))


def close(name: str, got: Any, expected: Any) -> None:
    got_h, expected_h = host(got), host(expected)
    if got_h.shape != expected_h.shape and got_h.shape != () and expected_h.shape != ():
        raise AssertionError(f"{name}: shape {got_h.shape}, expected {expected_h.shape}")
    np.testing.assert_allclose(
        got_h, expected_h, rtol=RTOL, atol=ATOL, err_msg=f"{name} on rank {dist.get_rank()}"
    )


def weighted(cs: Sequence[Any], ys: Sequence[Any]) -> Any:
    """``sum_i sum(cs[i] * tanh(ys[i]))``, recorded: a loss with curvature."""
    total = None
    for c, y in zip(cs, ys, strict=True):
        term = ops.sum(ops.multiply(c, ops.tanh(y)))
        total = term if total is None else ops.add(total, term)
    return total


def add_all(terms: Sequence[Any]) -> Any:
    total = terms[0]
    for term in terms[1:]:
        total = ops.add(total, term)
    return total


def derivatives(
    loss_fn: Callable[[list[Any]], Any], xs: list[Any], vs: list[Any]
) -> tuple[Any, list[Any], list[Any]]:
    """The loss, its gradient for ``xs`` and the gradient of ``sum_i <vs[i], gradient[i]>``.

    Nested tapes: the second derivatives are Hessian-vector products.
    """
    with Tape() as outer:
        outer.watch(xs)
        with Tape() as inner:
            inner.watch(xs)
            loss = loss_fn(xs)
        gs = inner.gradient(loss, xs)
        h = add_all([ops.sum(ops.multiply(v, g)) for v, g in zip(vs, gs, strict=True)])
    hs = outer.gradient(h, xs, unconnected_gradients="none")
    return loss, gs, hs


def check_oracle(
    name: str,
    inputs_of: Callable[[int], list[np.ndarray]],
    local: Callable[[list[Any], Callable[[Any], Any]], Any],
    oracle: Callable[[list[list[Any]], Callable[[Any], Any]], list[Any]],
    kind: str,
    members: Sequence[int] | None = None,
) -> None:
    """This rank's loss, gradient and Hessian-vector product against the one-process oracle.

    ``inputs_of(s)``: rank ``s``'s inputs (NumPy). ``local(xs, put)``: this rank's loss, with the
    differentiable collectives. ``oracle(xss, put)``: every rank's loss in one process, from
    every rank's inputs ``xss[s]``, without communication. ``members``: the world ranks of the
    group the collectives run on, in group-rank order (default: the world); ``xss`` and the
    losses are then in group-rank order, and the other ranks check nothing.
    """
    world_rank = dist.get_rank()
    members = list(range(dist.get_world_size())) if members is None else list(members)
    if world_rank not in members:
        return
    rank, size = members.index(world_rank), len(members)
    everyone = [inputs_of(s) for s in members]
    directions = [
        [data(f"v{name}{i}", s, x.shape) for i, x in enumerate(xs)]
        for s, xs in zip(members, everyone, strict=True)
    ]
    on = [put(x, kind) for x in everyone[rank]]
    loss, gs, hs = derivatives(
        lambda xs: local(xs, lambda a: put(a, kind)), on, [put(v, kind) for v in directions[rank]]
    )

    flat = [x for xs in everyone for x in xs]
    counts = [len(xs) for xs in everyone]

    def summed(xs: list[Any]) -> Any:
        xss, start = [], 0
        for n in counts:
            xss.append(xs[start : start + n])
            start += n
        losses.extend(oracle(xss, np.asarray))
        return add_all(losses[-size:])

    losses: list[Any] = []
    _, oracle_gs, oracle_hs = derivatives(summed, flat, [v for vs in directions for v in vs])
    first = sum(counts[:rank])
    close(f"{name}: loss", loss, losses[rank])
    for i in range(counts[rank]):
        close(f"{name}: gradient of input {i}", gs[i], oracle_gs[first + i])
        close(f"{name}: second derivative of input {i}", hs[i], oracle_hs[first + i])


def check_adjoint(
    name: str,
    inputs_of: Callable[[int], list[np.ndarray]],
    apply: Callable[[list[Any]], Any],
    kind: str = "cpu",
) -> None:
    """The dot-product test: sum over ranks of <A x, y> equals that of <x, A^T y>.

    ``A`` is ``apply`` (a linear collective), ``A^T y`` the tape's gradient with output
    gradients ``y`` (random, this rank's); the sums over ranks are taken with a raw all_reduce.
    """
    rank = dist.get_rank()
    xs_np = inputs_of(rank)
    xs = [put(x, kind) for x in xs_np]
    with Tape() as tape:
        tape.watch(xs)
        out = apply(xs)
    outs = out if isinstance(out, tuple) else (out,)
    ys = tuple(data(f"y{name}{i}", rank, o.shape) for i, o in enumerate(outs))
    grads = tape.gradient(outs, xs, output_gradients=tuple(put(y, kind) for y in ys))
    sums = put(
        [
            sum(float(np.vdot(host(o), y)) for o, y in zip(outs, ys, strict=True)),
            sum(float(np.vdot(x, host(g))) for x, g in zip(xs_np, grads, strict=True)),
        ],
        kind,
    )
    dist.all_reduce(sums)
    local = host(sums)
    if not np.isclose(local[0], local[1], rtol=1e-12, atol=1e-12):
        raise AssertionError(
            f"{name}: sum <Ax, y> = {local[0]!r} but sum <x, A^T y> = {local[1]!r}"
        )


# ---------------------------------------------------------------------------------------------
# Oracles of the reductions, one process


def combine(values: Sequence[Any], op: ReduceOp) -> Any:
    """The reduction ``op`` of ``values`` with ops (no ties in the data: max/min are exact)."""
    if op is ReduceOp.SUM:
        return add_all(values)
    if op is ReduceOp.AVG:
        return ops.multiply(add_all(values), 1.0 / len(values))
    pick = ops.maximum if op is ReduceOp.MAX else ops.minimum
    total = values[0]
    for v in values[1:]:
        total = pick(total, v)
    return total


# ---------------------------------------------------------------------------------------------
# The checks against the oracle (first and second derivatives)


def check_all_reduce(kind: str = "cpu") -> None:
    size = dist.get_world_size()
    for op in SMOOTH_OPS:

        def local(xs: list[Any], to: Any, op: ReduceOp = op) -> Any:
            c = to(data("c", dist.get_rank(), (4,)))
            return weighted([c], [nnf.all_reduce(ops.tanh(xs[0]), op)])

        def oracle(xss: list[list[Any]], to: Any, op: ReduceOp = op) -> list[Any]:
            y = combine([ops.tanh(xs[0]) for xs in xss], op)
            return [weighted([to(data("c", s, (4,)))], [y]) for s in range(size)]

        check_oracle(f"all_reduce {op.name}", lambda s: [data("x", s, (4,))], local, oracle, kind)


def check_broadcast(kind: str = "cpu") -> None:
    size = dist.get_world_size()
    for src in sorted({0, size - 1}):

        def local(xs: list[Any], to: Any, src: int = src) -> Any:
            c = to(data("c", dist.get_rank(), (2, 3)))
            return weighted([c], [nnf.broadcast(ops.tanh(xs[0]), src)])

        def oracle(xss: list[list[Any]], to: Any, src: int = src) -> list[Any]:
            y = ops.tanh(xss[src][0])
            return [weighted([to(data("c", s, (2, 3)))], [y]) for s in range(size)]

        check_oracle(f"broadcast src={src}", lambda s: [data("x", s, (2, 3))], local, oracle, kind)


def check_reduce(kind: str = "cpu") -> None:
    size = dist.get_world_size()
    cases = [(size - 1, op) for op in SMOOTH_OPS] + ([(0, ReduceOp.SUM)] if size > 1 else [])
    for dst, op in cases:

        def local(xs: list[Any], to: Any, dst: int = dst, op: ReduceOp = op) -> Any:
            c = to(data("c", dist.get_rank(), (5,)))
            return weighted([c], [nnf.reduce(ops.tanh(xs[0]), dst, op)])

        def oracle(xss: list[list[Any]], to: Any, dst: int = dst, op: ReduceOp = op) -> list[Any]:
            y = combine([ops.tanh(xs[0]) for xs in xss], op)
            zero = to(np.zeros(5))  # the other ranks' result: zeros, tanh(0) = 0
            return [
                weighted([to(data("c", s, (5,)))], [y if s == dst else zero]) for s in range(size)
            ]

        check_oracle(
            f"reduce dst={dst} {op.name}", lambda s: [data("x", s, (5,))], local, oracle, kind
        )


def check_all_gather(kind: str = "cpu") -> None:
    size = dist.get_world_size()

    def local(xs: list[Any], to: Any) -> Any:
        ys = nnf.all_gather(ops.tanh(xs[0]))
        assert isinstance(ys, tuple)
        assert len(ys) == size
        return weighted([to(data(f"c{j}", dist.get_rank(), (3,))) for j in range(size)], ys)

    def oracle(xss: list[list[Any]], to: Any) -> list[Any]:
        ys = [ops.tanh(xs[0]) for xs in xss]
        return [
            weighted([to(data(f"c{j}", s, (3,))) for j in range(size)], ys) for s in range(size)
        ]

    check_oracle("all_gather", lambda s: [data("x", s, (3,))], local, oracle, kind)


def check_reduce_scatter(kind: str = "cpu") -> None:
    size = dist.get_world_size()
    for op in SMOOTH_OPS:

        def inputs(s: int) -> list[np.ndarray]:
            return [data(f"x{q}", s, (2, 2)) for q in range(size)]

        def local(xs: list[Any], to: Any, op: ReduceOp = op) -> Any:
            c = to(data("c", dist.get_rank(), (2, 2)))
            return weighted([c], [nnf.reduce_scatter([ops.tanh(x) for x in xs], op)])

        def oracle(xss: list[list[Any]], to: Any, op: ReduceOp = op) -> list[Any]:
            return [
                weighted([to(data("c", q, (2, 2)))], [combine([ops.tanh(xs[q]) for xs in xss], op)])
                for q in range(size)
            ]

        check_oracle(f"reduce_scatter {op.name}", inputs, local, oracle, kind)


def _a2a_shape(sender: int, receiver: int) -> tuple[int, ...]:
    return (1 + sender + 2 * receiver, 2)


def check_all_to_all(kind: str = "cpu") -> None:
    size = dist.get_world_size()

    def inputs(s: int) -> list[np.ndarray]:
        return [data(f"x{q}", s, _a2a_shape(s, q)) for q in range(size)]

    def local(xs: list[Any], to: Any) -> Any:
        rank = dist.get_rank()
        ys = nnf.all_to_all([ops.tanh(x) for x in xs])
        assert [y.shape for y in ys] == [_a2a_shape(j, rank) for j in range(size)]
        return weighted([to(data(f"c{j}", rank, _a2a_shape(j, rank))) for j in range(size)], ys)

    def oracle(xss: list[list[Any]], to: Any) -> list[Any]:
        return [
            weighted(
                [to(data(f"c{j}", q, _a2a_shape(j, q))) for j in range(size)],
                [ops.tanh(xss[j][q]) for j in range(size)],
            )
            for q in range(size)
        ]

    check_oracle("all_to_all", inputs, local, oracle, kind)


def _split(sender: int, receiver: int) -> int:
    return (sender + 2 * receiver) % 3  # some exchanges send no row


def check_all_to_all_single(kind: str = "cpu") -> None:
    size = dist.get_world_size()

    def inputs(s: int) -> list[np.ndarray]:
        return [data("x", s, (sum(_split(s, q) for q in range(size)), 3))]

    def local(xs: list[Any], to: Any) -> Any:
        rank = dist.get_rank()
        outs = [_split(j, rank) for j in range(size)]
        ins = [_split(rank, q) for q in range(size)]
        y = nnf.all_to_all_single(ops.tanh(xs[0]), outs, ins)
        return weighted([to(data("c", rank, (sum(outs), 3)))], [y])

    def oracle(xss: list[list[Any]], to: Any) -> list[Any]:
        losses = []
        for q in range(size):
            parts = []
            for j in range(size):
                start = sum(_split(j, p) for p in range(q))
                parts.append(ops.getitem(ops.tanh(xss[j][0]), slice(start, start + _split(j, q))))
            rows = sum(_split(j, q) for j in range(size))
            losses.append(weighted([to(data("c", q, (rows, 3)))], [ops.concatenate(parts)]))
        return losses

    check_oracle("all_to_all_single", inputs, local, oracle, kind)


def check_gather(kind: str = "cpu") -> None:
    size = dist.get_world_size()
    for dst in sorted({0, size - 1}):

        def local(xs: list[Any], to: Any, dst: int = dst) -> Any:
            rank = dist.get_rank()
            ys = nnf.gather(ops.tanh(xs[0]), dst)
            return weighted([to(data(f"c{j}", rank, (3,))) for j in range(size)], ys)

        def oracle(xss: list[list[Any]], to: Any, dst: int = dst) -> list[Any]:
            ys = [ops.tanh(xs[0]) for xs in xss]
            zeros = [to(np.zeros(3))] * size
            return [
                weighted(
                    [to(data(f"c{j}", s, (3,))) for j in range(size)], ys if s == dst else zeros
                )
                for s in range(size)
            ]

        check_oracle(f"gather dst={dst}", lambda s: [data("x", s, (3,))], local, oracle, kind)


def check_scatter(kind: str = "cpu") -> None:
    size = dist.get_world_size()
    for src in sorted({0, size - 1}):

        def inputs(s: int) -> list[np.ndarray]:
            return [data(f"x{q}", s, (2, 3)) for q in range(size)]

        def local(xs: list[Any], to: Any, src: int = src) -> Any:
            c = to(data("c", dist.get_rank(), (2, 3)))
            return weighted([c], [nnf.scatter([ops.tanh(x) for x in xs], src)])

        def oracle(xss: list[list[Any]], to: Any, src: int = src) -> list[Any]:
            return [
                weighted([to(data("c", q, (2, 3)))], [ops.tanh(xss[src][q])]) for q in range(size)
            ]

        check_oracle(f"scatter src={src}", inputs, local, oracle, kind)


def check_subgroup(kind: str = "cpu") -> None:
    """The collectives on a group that is not the world: roots are world ranks, as in torch.

    The group is ranks 1.. of the world (the whole world at 2 ranks); its outsiders get
    ``ValueError`` from every collective and take no part.
    """
    world = dist.get_world_size()
    members = list(range(1, world)) if world > 2 else list(range(world))
    group = dist.new_group(members)
    if dist.get_rank() not in members:
        try:
            nnf.all_reduce(put(np.ones(2), kind), group=group)
        except ValueError as error:
            if "not a member of group" not in str(error):
                raise
        else:
            raise AssertionError("a rank outside the group called all_reduce without error")
        return
    size = len(members)
    me = members.index(dist.get_rank())
    first, last = members[0], members[-1]

    def one(s: int) -> list[np.ndarray]:
        return [data("sx", s, (3,))]

    def many(s: int) -> list[np.ndarray]:
        return [data(f"sx{q}", s, (3,)) for q in range(size)]

    def c(s: int, j: int = 0) -> np.ndarray:
        return data(f"sc{j}", s, (3,))

    cases: list[tuple[str, Any, Any, Any]] = [
        (
            "all_reduce MAX",
            one,
            lambda xs, to: weighted(
                [to(c(members[me]))], [nnf.all_reduce(ops.tanh(xs[0]), ReduceOp.MAX, group)]
            ),
            lambda xss, to: [
                weighted([to(c(s))], [combine([ops.tanh(xs[0]) for xs in xss], ReduceOp.MAX)])
                for s in members
            ],
        ),
        (
            f"broadcast src={last}",
            one,
            lambda xs, to: weighted(
                [to(c(members[me]))], [nnf.broadcast(ops.tanh(xs[0]), last, group)]
            ),
            lambda xss, to: [weighted([to(c(s))], [ops.tanh(xss[-1][0])]) for s in members],
        ),
        (
            f"reduce dst={last} AVG",
            one,
            lambda xs, to: weighted(
                [to(c(members[me]))], [nnf.reduce(ops.tanh(xs[0]), last, ReduceOp.AVG, group)]
            ),
            lambda xss, to: [
                weighted(
                    [to(c(s))],
                    [
                        combine([ops.tanh(xs[0]) for xs in xss], ReduceOp.AVG)
                        if s == last
                        else to(np.zeros(3))
                    ],
                )
                for s in members
            ],
        ),
        (
            "all_gather",
            one,
            lambda xs, to: weighted(
                [to(c(members[me], j)) for j in range(size)],
                nnf.all_gather(ops.tanh(xs[0]), group),
            ),
            lambda xss, to: [
                weighted([to(c(s, j)) for j in range(size)], [ops.tanh(xs[0]) for xs in xss])
                for s in members
            ],
        ),
        (
            "reduce_scatter SUM",
            many,
            lambda xs, to: weighted(
                [to(c(members[me]))], [nnf.reduce_scatter([ops.tanh(x) for x in xs], group=group)]
            ),
            lambda xss, to: [
                weighted([to(c(s))], [add_all([ops.tanh(xs[q]) for xs in xss])])
                for q, s in enumerate(members)
            ],
        ),
        (
            "all_to_all",
            many,
            lambda xs, to: weighted(
                [to(c(members[me], j)) for j in range(size)],
                nnf.all_to_all([ops.tanh(x) for x in xs], group),
            ),
            lambda xss, to: [
                weighted([to(c(s, j)) for j in range(size)], [ops.tanh(xs[q]) for xs in xss])
                for q, s in enumerate(members)
            ],
        ),
        (
            f"gather dst={first}",
            one,
            lambda xs, to: weighted(
                [to(c(members[me], j)) for j in range(size)],
                nnf.gather(ops.tanh(xs[0]), first, group),
            ),
            lambda xss, to: [
                weighted(
                    [to(c(s, j)) for j in range(size)],
                    [ops.tanh(xs[0]) if s == first else to(np.zeros(3)) for xs in xss],
                )
                for s in members
            ],
        ),
        (
            f"scatter src={last}",
            many,
            lambda xs, to: weighted(
                [to(c(members[me]))], [nnf.scatter([ops.tanh(x) for x in xs], last, group)]
            ),
            lambda xss, to: [
                weighted([to(c(s))], [ops.tanh(xss[-1][q])]) for q, s in enumerate(members)
            ],
        ),
    ]
    for name, inputs, local, oracle in cases:
        check_oracle(f"subgroup {name}", inputs, local, oracle, kind, members)


# ---------------------------------------------------------------------------------------------
# Dot-product (adjoint) tests of the linear collectives


def check_adjoints(kind: str = "cpu") -> None:
    size = dist.get_world_size()
    last = size - 1

    def adjoint(name: str, inputs: Callable[[int], list[np.ndarray]], apply: Any) -> None:
        check_adjoint(name, inputs, apply, kind)

    def one(tag: str) -> Callable[[int], list[np.ndarray]]:
        return lambda s: [data(tag, s, (3, 2))]

    def listed(tag: str) -> Callable[[int], list[np.ndarray]]:
        return lambda s: [data(f"{tag}{q}", s, (3, 2)) for q in range(size)]

    for op in (ReduceOp.SUM, ReduceOp.AVG):
        adjoint(f"all_reduce {op.name}", one("a"), lambda xs, op=op: nnf.all_reduce(xs[0], op))
        adjoint(f"reduce {op.name}", one("b"), lambda xs, op=op: nnf.reduce(xs[0], last, op))
        adjoint(
            f"reduce_scatter {op.name}", listed("c"), lambda xs, op=op: nnf.reduce_scatter(xs, op)
        )
    adjoint("broadcast", one("d"), lambda xs: nnf.broadcast(xs[0], last))
    adjoint("all_gather", one("e"), lambda xs: nnf.all_gather(xs[0]))
    adjoint("gather", one("f"), lambda xs: nnf.gather(xs[0], last))
    adjoint("scatter", listed("g"), lambda xs: nnf.scatter(xs, last))
    adjoint(
        "all_to_all",
        lambda s: [data(f"h{q}", s, _a2a_shape(s, q)) for q in range(size)],
        nnf.all_to_all,
    )
    rank = dist.get_rank()
    adjoint(
        "all_to_all_single",
        lambda s: [data("i", s, (sum(_split(s, q) for q in range(size)), 2))],
        lambda xs: nnf.all_to_all_single(
            xs[0], [_split(j, rank) for j in range(size)], [_split(rank, q) for q in range(size)]
        ),
    )
    # equal input splits (None) of a rank-dependent number of rows, uneven output splits: the
    # gradient has x's rows, not y's (it came out with y's and the exchange failed)
    adjoint(
        "all_to_all_single, output splits only",
        lambda s: [data("j", s, (size * (1 + s), 2))],
        lambda xs: nnf.all_to_all_single(xs[0], [1 + j for j in range(size)]),
    )
    # 0-d arrays (all_gather's gradient is a reduce_scatter of 0-d arrays: it raised)
    adjoint("all_gather 0-d", lambda s: [data("k", s, ())], lambda xs: nnf.all_gather(xs[0]))
    adjoint(
        "reduce_scatter 0-d",
        lambda s: [data(f"l{q}", s, ()) for q in range(size)],
        nnf.reduce_scatter,
    )


# ---------------------------------------------------------------------------------------------
# MIN/MAX with ties, refusals, integers, the zero cotangent


def tied(tag: str, rank: int, shape: tuple[int, ...]) -> np.ndarray:
    """Values in {0, 1, 2}: ties between 2, 3 and 4 ranks are common."""
    seed = [sum(map(ord, tag)), rank, 7]
    return np.random.default_rng(seed).integers(0, 3, shape).astype(np.float64)


def check_extremum_ties(kind: str = "cpu") -> None:
    """The gradient goes to the ranks holding the extremum, 1/k each when k ranks tie (NumPy)."""
    rank, size = dist.get_rank(), dist.get_world_size()
    xs = [tied("t", s, (16,)) for s in range(size)]
    cs = [data("ct", s, (16,)) for s in range(size)]
    for op, pick in ((ReduceOp.MAX, np.max), (ReduceOp.MIN, np.min)):
        extremum = pick(np.stack(xs), axis=0)
        masks = [(x == extremum).astype(float) for x in xs]
        share = masks[rank] / np.sum(masks, axis=0)
        # all_reduce: every rank's loss sum(c_s * y) reaches y
        x = put(xs[rank], kind)
        with Tape() as tape:
            tape.watch(x)
            y = nnf.all_reduce(x, op)
            loss = ops.sum(ops.multiply(put(cs[rank], kind), y))
        close(f"all_reduce {op.name} value", y, extremum)
        close(f"all_reduce {op.name} tie gradient", tape.gradient(loss, x), share * sum(cs))
        # reduce: only the destination's loss reaches the result
        dst = size - 1
        with Tape() as tape:
            tape.watch(x)
            y = nnf.reduce(x, dst, op)
            loss = ops.sum(ops.multiply(put(cs[rank], kind), y))
        close(f"reduce {op.name} value", y, extremum if rank == dst else np.zeros(16))
        close(f"reduce {op.name} tie gradient", tape.gradient(loss, x), share * cs[dst])
        # reduce_scatter: chunk q's extremum goes to rank q
        chunks = [[tied(f"t{q}", s, (4,)) for q in range(size)] for s in range(size)]
        mine = [put(c, kind) for c in chunks[rank]]
        with Tape() as tape:
            tape.watch(mine)
            y = nnf.reduce_scatter(mine, op)
            loss = ops.sum(ops.multiply(put(cs[rank][:4], kind), y))
        grads = tape.gradient(loss, mine)
        for q in range(size):
            column = np.stack([chunks[s][q] for s in range(size)])
            ext = pick(column, axis=0)
            hits = (column == ext).astype(float)
            if q == rank:
                close(f"reduce_scatter {op.name} value", y, ext)
            expected = hits[rank] / hits.sum(axis=0) * cs[q][:4]
            close(f"reduce_scatter {op.name} tie gradient {q}", grads[q], expected)


def check_refusals(kind: str = "cpu") -> None:
    """PRODUCT computes but refuses its gradient (every rank, no hang); integers: no record."""
    rank, size = dist.get_rank(), dist.get_world_size()
    xs = [data("p", s, (3,)) for s in range(size)]
    for name, apply in (
        ("all_reduce", lambda x: nnf.all_reduce(x, ReduceOp.PRODUCT)),
        ("reduce", lambda x: nnf.reduce(x, 0, ReduceOp.PRODUCT)),
        ("reduce_scatter", lambda x: nnf.reduce_scatter([x] * size, ReduceOp.PRODUCT)),
    ):
        x = put(xs[rank], kind)
        with Tape() as tape:
            tape.watch(x)
            y = apply(x)
            loss = ops.sum(y)
        if name != "reduce" or rank == 0:
            close(f"{name} PRODUCT value", y, np.prod(np.stack(xs), axis=0))
        try:
            tape.gradient(loss, x)
        except RuntimeError as error:
            message = str(error)
            if f"nn.functional.{name} with ReduceOp.PRODUCT has no gradient" not in message:
                raise AssertionError(f"{name}: unexpected message {message!r}") from error
        else:
            raise AssertionError(f"{name} PRODUCT: gradient did not raise")
    # integer arrays: communicated, not recorded (the bitwise reductions are for them; NCCL
    # has none)
    ints = put(np.arange(4) + rank, kind)
    bitwise = [] if dist.get_backend() == "nccl" else [ReduceOp.BOR, ReduceOp.BAND, ReduceOp.BXOR]
    with Tape() as tape:
        tape.watch(put(np.ones(4), kind))
        for op in [ReduceOp.SUM, ReduceOp.MAX, *bitwise]:
            y = nnf.all_reduce(ints, op)
            if tape.tracks(y):
                raise AssertionError(f"all_reduce {op.name} of integers was recorded")
        everyone = np.stack([np.arange(4) + s for s in range(size)])
        close("all_reduce SUM of integers", nnf.all_reduce(ints), everyone.sum(axis=0))
        if bitwise:
            expected = np.bitwise_or.reduce(everyone)
            close("all_reduce BOR of integers", nnf.all_reduce(ints, ReduceOp.BOR), expected)
    # the caller's arrays are never written
    x = put(xs[rank], kind)
    nnf.all_reduce(x)
    nnf.broadcast(x, size - 1)
    nnf.scatter([x] * size, 0)
    close("the input after the collectives", x, xs[rank])


def check_list_arguments(kind: str = "cpu") -> None:
    """A list of one array per member, of one dtype (and shape): refused before communicating."""
    size = dist.get_world_size()
    if size < 2:
        return
    cases = [
        (
            lambda: nnf.scatter([put(np.ones(2 + q), kind) for q in range(size)], 0),
            ValueError,
            "inputs[1] has shape (3,) but inputs[0] has (2,)",
        ),
        (
            lambda: nnf.reduce_scatter([put(np.ones(2 + q), kind) for q in range(size)]),
            ValueError,
            "inputs[1] has shape (3,) but inputs[0] has (2,)",
        ),
        (
            lambda: nnf.all_to_all(
                [put(np.ones(2, [float, int][q % 2]), kind) for q in range(size)]
            ),
            TypeError,
            "inputs[1] has dtype int64 but inputs[0] has float64",
        ),
    ]
    for call, error, message in cases:
        expect_error(call, error, message)


def expect_error(call: Callable[[], Any], error: type[Exception], message: str) -> None:
    """``call()`` raises ``error`` with ``message`` in its text."""
    try:
        call()
    except error as caught:
        if message not in str(caught):
            raise AssertionError(f"unexpected message {caught}") from caught
    else:
        raise AssertionError(f"no {error.__name__}: {message}")


def check_zero_cotangent(kind: str = "cpu") -> None:
    """Rank 0's loss ignores the collectives' outputs; every rank still gets its gradient.

    Rank 0 computes its gradient without any gradient reaching the nodes: their vjps must run
    anyway (with zero cotangents), or the other ranks wait forever in the backward collectives.
    Second order too: the vjps' own collectives are recorded on the outer tape on every rank.
    """
    rank, size = dist.get_rank(), dist.get_world_size()
    xs = [data("z", s, (3,)) for s in range(size)]
    cs = [data("cz", s, (3,)) for s in range(size)]
    x = put(xs[rank], kind)
    with Tape() as outer:
        outer.watch(x)
        with Tape() as tape:
            tape.watch(x)
            gathered = nnf.all_gather(x)
            y = nnf.all_reduce(ops.tanh(x))  # the first collective of the backward pass
            own = ops.sum(ops.square(x))
            loss = (
                own
                if rank == 0
                else ops.add(
                    own, ops.add(weighted([put(cs[rank], kind)], [y]), ops.sum(gathered[0]))
                )
            )
        g = tape.gradient(loss, x)
        h = ops.sum(g)
    hg = outer.gradient(h, x)
    # oracle, in NumPy: d/dx_r of sum_s |x_s|^2 + sum_{s>0} <c_s, tanh(sum_q tanh(x_q))> + x_0
    u = sum(np.tanh(v) for v in xs)
    c = sum(cs[1:], np.zeros(3))
    dt = 1 - np.tanh(xs[rank]) ** 2
    du = 1 - np.tanh(u) ** 2
    expected = 2 * xs[rank] + c * du * dt + (size - 1.0 if rank == 0 else 0.0)
    close("zero cotangent: gradient", g, expected)
    # second: d/dx_r of sum_s sum(g_s), g_s = 2 x_s + c du dt_s (+1): the Hessian's row sums
    t = np.tanh(xs[rank])
    d2t = -2 * t * dt
    sum_dt = sum(1 - np.tanh(v) ** 2 for v in xs)
    d2u = -2 * np.tanh(u) * du
    expected2 = 2 + c * du * d2t + c * d2u * dt * sum_dt
    close("zero cotangent: second derivative", hg, expected2)


CHECKS: list[Callable[..., None]] = [
    check_all_reduce,
    check_broadcast,
    check_reduce,
    check_all_gather,
    check_reduce_scatter,
    check_all_to_all,
    check_all_to_all_single,
    check_gather,
    check_scatter,
    check_subgroup,
    check_extremum_ties,
    check_refusals,
    check_list_arguments,
    check_zero_cotangent,
    check_adjoints,
]


def attempt(name: str, check: Callable[..., None], *args: Any) -> list[str]:
    """Run one check: ``[]``, or its failure's traceback (every failing check is reported)."""
    try:
        check(*args)
    except Exception:  # noqa: BLE001 - report any error, go on with the next check
        return [f"{name}: {traceback.format_exc()}"]
    return []


def run(kinds: Sequence[str]) -> list[str]:
    """Every check for each kind of array; the failures' tracebacks."""
    failures = []
    for kind in kinds:
        for check in CHECKS:
            failures += attempt(f"{check.__name__}({kind!r})", check, kind)
    return failures


def main() -> int:
    return rank_main(0, sys.argv[1:])


def rank_main(rank: int, argv: list[str]) -> int:
    """One rank's program (``rank`` is unused: the world says which); see the module.

    Under ``spawn`` the world exists already: ``backend="threads"`` (MPI) for ``all`` and
    ``zero-cotangent``, ``backend="nccl"`` under ``simulated_cuda`` for ``cupy``.
    """
    mode = argv[0] if argv else "all"
    seconds = 8 if mode == "zero-cotangent" else 120
    if not dist.is_initialized():  # spawn made the world already
        dist.init_process_group("mpi", timeout=timedelta(seconds=seconds))
    rank = dist.get_rank()
    if mode == "zero-cotangent":
        check_zero_cotangent()
        failures: list[str] = []
    elif mode == "simulated-cupy":
        from cupy_parallel.testing import simulated_cuda

        warnings.filterwarnings("ignore", "cupy_parallel MPI backend: CUDA is simulated")
        with simulated_cuda(1):
            failures = run(["cupy"])
    elif mode == "cupy":  # CuPy arrays on the running world's GPUs (NCCL thread ranks)
        failures = run(["cupy"])
    else:
        failures = run(["cpu", "host"])
    dist.destroy_process_group()
    if failures:
        print(f"rank {rank}: {len(failures)} checks failed:", file=sys.stderr)
        for failure in failures:
            print(failure, file=sys.stderr)
        return 1
    print(f"rank {rank}: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
