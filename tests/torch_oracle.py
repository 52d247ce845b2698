"""PyTorch as the oracle of the ops' derivatives: op cases, random op graphs, both evaluations.

Shared by ``tests/test_ops_torch.py`` and ``tests/make_torch_oracle.py`` (which stores PyTorch's
answers in ``tests/data/torch_oracle.npz`` for machines without PyTorch). Importing this module
never imports PyTorch: the evaluations take the ``torch`` module as an argument.

A *case* is a function ``f(*xs) -> y`` given twice, with our ops and with PyTorch, and its
inputs. Both sides compute, for a cotangent ``g`` and directions ``u``:

- ``value``: ``y``;
- ``first``: the vjp ``d<y, g>/dx`` for every input ``x``;
- ``second``: ``d s/dx`` with ``s = sum_k <first_k, u_k>`` (a Hessian-vector product), and
  ``second_g``: ``d s/dg`` (a Jacobian-vector product, by double vjp).

A random *graph* is a program of op steps over a pool of values (fan-out and reuse: every step
may read any earlier value, and every value enters the loss), drawn through a ``choose(n)``
callback, so hypothesis (live PyTorch) and a seeded ``random.Random`` (stored oracle) drive the
same generator.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

import cupy_parallel
from cupy_parallel import Tape, ops

if TYPE_CHECKING:
    from collections.abc import Callable

# --------------------------------------------------------------------------------------------
# Op cases: id -> (ours, theirs(torch, *xs), inputs(rng))


def _u(rng: np.random.Generator, *shape: int, low: float = -1.0, high: float = 1.0) -> np.ndarray:
    return rng.uniform(low, high, shape)


def _ties(rng: np.random.Generator) -> list[np.ndarray]:
    a = _u(rng, 3, 4)
    b = np.where(rng.uniform(size=(3, 4)) < 0.4, a, _u(rng, 3, 4))  # equal entries: ties
    return [a, b]


def _with_zeros(rng: np.random.Generator) -> list[np.ndarray]:
    x = _u(rng, 3, 4)
    x[0, :2] = 0.0
    return [x]


_MASK = np.array(
    [[True, False, True, True], [False, False, True, False], [True, True, False, True]]
)
_LABELS = np.array([2, 0, 3])
_IDX = np.array([0, 2, 0, 0])


def _beside(x: Any, constant: np.ndarray) -> Any:
    """``constant`` on ``x``'s device (a mask or labels must live with the data, as in CuPy)."""
    return cupy_parallel.to_device(constant, cupy_parallel.device_of(x))


@dataclass(frozen=True)
class Case:
    """One op under test."""

    ours: Callable[..., Any]
    theirs: Callable[..., Any]
    inputs: Callable[[np.random.Generator], list[np.ndarray]]


def _shapes(*shapes: tuple[int, ...], positive: bool = False) -> Callable[..., list[np.ndarray]]:
    low, high = (0.5, 2.0) if positive else (-1.0, 1.0)
    return lambda rng: [_u(rng, *s, low=low, high=high) for s in shapes]


def _positive_second(*shapes: tuple[int, ...]) -> Callable[..., list[np.ndarray]]:
    return lambda rng: [_u(rng, *shapes[0]), _u(rng, *shapes[1], low=0.5, high=2.0)]


CASES: dict[str, Case] = {
    # elementwise binary, with broadcasting
    "add": Case(ops.add, lambda t, a, b: a + b, _shapes((2, 3), (3,))),
    "subtract": Case(ops.subtract, lambda t, a, b: a - b, _shapes((2, 1), (1, 3))),
    "multiply": Case(ops.multiply, lambda t, a, b: a * b, _shapes((4, 1, 3), (2, 1))),
    "divide": Case(ops.divide, lambda t, a, b: a / b, _positive_second((2, 3), (3,))),
    "power": Case(ops.power, lambda t, a, b: a**b, _shapes((2, 3), (2, 3), positive=True)),
    "power-scalar": Case(lambda x: ops.power(x, 3.0), lambda t, x: x**3.0, _shapes((2, 3))),
    "power-scalar-base": Case(lambda x: ops.power(2.0, x), lambda t, x: 2.0**x, _shapes((3,))),
    "maximum-ties": Case(ops.maximum, lambda t, a, b: t.maximum(a, b), _ties),
    "minimum-ties": Case(ops.minimum, lambda t, a, b: t.minimum(a, b), _ties),
    "maximum-broadcast": Case(ops.maximum, lambda t, a, b: t.maximum(a, b), _shapes((2, 3), (3,))),
    "minimum-scalar": Case(
        lambda x: ops.minimum(x, 0.25), lambda t, x: t.clamp(x, max=0.25), _shapes((3, 4))
    ),
    # elementwise unary
    "negative": Case(ops.negative, lambda t, x: -x, _shapes((2, 3))),
    "square": Case(ops.square, lambda t, x: x * x, _shapes((2, 3))),
    "exp": Case(ops.exp, lambda t, x: t.exp(x), _shapes((2, 3))),
    "log": Case(ops.log, lambda t, x: t.log(x), _shapes((2, 3), positive=True)),
    "tanh": Case(ops.tanh, lambda t, x: t.tanh(x), _shapes((2, 3))),
    "relu": Case(ops.relu, lambda t, x: t.relu(x), _with_zeros),
    "abs": Case(ops.abs, lambda t, x: t.abs(x), _with_zeros),
    "sqrt": Case(ops.sqrt, lambda t, x: t.sqrt(x), _shapes((2, 3), positive=True)),
    "clip": Case(
        lambda x: ops.clip(x, -0.5, 0.5), lambda t, x: t.clamp(x, -0.5, 0.5), _shapes((3, 4))
    ),
    "clip-lower": Case(lambda x: ops.clip(x, 0.0), lambda t, x: t.clamp(x, min=0.0), _with_zeros),
    "clip-arrays": Case(
        ops.clip,
        lambda t, x, lo, hi: t.clamp(x, lo, hi),
        lambda rng: [_u(rng, 3, 4), _u(rng, 4) * 0.5 - 0.3, _u(rng, 3, 1) * 0.3 + 0.4],
    ),
    "where": Case(
        lambda a, b: ops.where(_beside(a, _MASK), a, b),
        lambda t, a, b: t.where(t.as_tensor(_MASK), a, b),
        _shapes((3, 4), (4,)),
    ),
    # linear algebra, reductions
    "matmul": Case(ops.matmul, lambda t, a, b: a @ b, _shapes((2, 3), (3, 4))),
    "matmul-vector-matrix": Case(ops.matmul, lambda t, a, b: a @ b, _shapes((3,), (2, 3, 4))),
    "matmul-batch-vector": Case(ops.matmul, lambda t, a, b: a @ b, _shapes((2, 2, 3), (3,))),
    "matmul-vectors": Case(ops.matmul, lambda t, a, b: a @ b, _shapes((3,), (3,))),
    "sum": Case(lambda x: ops.sum(x, (0, 2)), lambda t, x: x.sum((0, 2)), _shapes((2, 3, 4))),
    "sum-keepdims": Case(
        lambda x: ops.sum(x, 1, keepdims=True), lambda t, x: x.sum(1, keepdim=True), _shapes((2, 3))
    ),
    "mean": Case(lambda x: ops.mean(x, -1), lambda t, x: x.mean(-1), _shapes((2, 3))),
    "var": Case(lambda x: ops.var(x, 0), lambda t, x: t.var(x, 0, correction=0), _shapes((4, 3))),
    "var-ddof1-all": Case(
        lambda x: ops.var(x, ddof=1), lambda t, x: t.var(x, correction=1), _shapes((2, 3))
    ),
    "logsumexp": Case(
        lambda x: ops.logsumexp(x, 1), lambda t, x: t.logsumexp(x, 1), _shapes((3, 4))
    ),
    "logsumexp-all-keepdims": Case(
        lambda x: ops.logsumexp(x, keepdims=True),
        lambda t, x: t.logsumexp(x, (0, 1), keepdim=True),
        _shapes((3, 4)),
    ),
    "softmax": Case(lambda x: ops.softmax(x, 0), lambda t, x: t.softmax(x, 0), _shapes((3, 4))),
    "log_softmax": Case(ops.log_softmax, lambda t, x: t.log_softmax(x, -1), _shapes((3, 4))),
    "softmax_cross_entropy": Case(
        lambda x: ops.softmax_cross_entropy(x, _beside(x, _LABELS)),
        lambda t, x: t.nn.functional.cross_entropy(x, t.as_tensor(_LABELS)),
        _shapes((3, 4)),
    ),
    "softmax_cross_entropy-sum": Case(
        lambda x: ops.softmax_cross_entropy(x, _beside(x, _LABELS), reduction="sum"),
        lambda t, x: t.nn.functional.cross_entropy(x, t.as_tensor(_LABELS), reduction="sum"),
        _shapes((3, 4)),
    ),
    "softmax_cross_entropy-none": Case(
        lambda x: ops.softmax_cross_entropy(x, _beside(x, _LABELS), reduction="none"),
        lambda t, x: t.nn.functional.cross_entropy(x, t.as_tensor(_LABELS), reduction="none"),
        _shapes((3, 4)),
    ),
    # shapes, indexing, joining
    "reshape": Case(
        lambda x: ops.reshape(x, (3, -1)), lambda t, x: x.reshape(3, -1), _shapes((2, 3))
    ),
    "transpose": Case(
        lambda x: ops.transpose(x, (2, 0, 1)), lambda t, x: x.permute(2, 0, 1), _shapes((2, 3, 4))
    ),
    "getitem-int": Case(lambda x: ops.getitem(x, 1), lambda t, x: x[1], _shapes((3, 4))),
    "getitem-slices": Case(
        lambda x: ops.getitem(x, (slice(None), slice(1, None, 2))),
        lambda t, x: x[:, 1::2],
        _shapes((3, 4)),
    ),
    "getitem-repeated-array": Case(
        lambda x: ops.getitem(x, _IDX), lambda t, x: x[t.as_tensor(_IDX)], _shapes((3, 4))
    ),
    "getitem-mask": Case(
        lambda x: ops.getitem(x, _MASK), lambda t, x: x[t.as_tensor(_MASK)], _shapes((3, 4))
    ),
    "getitem-array-and-slice": Case(
        lambda x: ops.getitem(x, (slice(0, 2), _IDX)),
        lambda t, x: x[0:2, t.as_tensor(_IDX)],
        _shapes((3, 4)),
    ),
    "getitem-newaxis-ellipsis": Case(
        lambda x: ops.getitem(x, (None, ..., -1)), lambda t, x: x[None, ..., -1], _shapes((3, 4))
    ),
    "concatenate-reuse": Case(
        lambda a, b: ops.concatenate([a, b, a], 1),
        lambda t, a, b: t.cat([a, b, a], 1),
        _shapes((2, 3), (2, 1)),
    ),
    "stack": Case(
        lambda a, b: ops.stack([a, b], -1),
        lambda t, a, b: t.stack([a, b], -1),
        _shapes((2, 3), (2, 3)),
    ),
    "split-middle": Case(
        lambda x: ops.split(x, [1, 3], 1)[1],
        lambda t, x: t.tensor_split(x, [1, 3], 1)[1],
        _shapes((2, 4)),
    ),
    "split-sections": Case(
        lambda x: ops.multiply(*ops.split(x, 2)),
        lambda t, x: t.tensor_split(x, 2)[0] * t.tensor_split(x, 2)[1],
        _shapes((4, 3)),
    ),
}


def case_inputs(name: str) -> list[np.ndarray]:
    """The inputs of case ``name`` (seeded by its name, so stable across runs)."""
    seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "little")
    return CASES[name].inputs(np.random.default_rng(seed))


# --------------------------------------------------------------------------------------------
# Evaluations: value, first order, second order


@dataclass
class Result:
    """What one side computes for a function, a cotangent and directions."""

    value: np.ndarray
    first: list[np.ndarray]
    second: list[np.ndarray]
    second_g: np.ndarray

    def arrays(self) -> dict[str, np.ndarray]:
        """Flat name -> array (the oracle file's layout)."""
        out = {"value": self.value, "second_g": self.second_g}
        out.update({f"first{i}": a for i, a in enumerate(self.first)})
        out.update({f"second{i}": a for i, a in enumerate(self.second)})
        return out


def directions(xs: list[np.ndarray], y_shape: tuple[int, ...], seed: int) -> tuple[Any, list[Any]]:
    """The cotangent ``g`` of ``y`` and one direction ``u`` per input."""
    rng = np.random.default_rng(seed)
    return rng.uniform(-1, 1, y_shape), [rng.uniform(-1, 1, x.shape) for x in xs]


def _host(x: Any) -> np.ndarray:
    return np.array(cupy_parallel.to_device(x, "cpu"))


def ours_first(
    fn: Callable[..., Any], xs: list[np.ndarray], seed: int, device: str = "cpu"
) -> tuple[Any, list[Any]]:
    """Value and vjp of ``fn`` on one tape, with the inputs on ``device``."""
    g, _ = directions(xs, fn(*xs).shape, seed)
    xs, g = _on(xs, device), _on([g], device)[0]
    with Tape() as tape:
        tape.watch(xs)
        y = fn(*xs)
    first = tape.gradient(y, xs, output_gradients=g)
    return _host(y), [_host(f) for f in first]


def _on(arrays: list[np.ndarray], device: str) -> list[Any]:
    return [cupy_parallel.to_device(a.copy(), device) for a in arrays]


def ours(fn: Callable[..., Any], xs: list[np.ndarray], seed: int, device: str = "cpu") -> Result:
    """Value, vjp and double vjp of ``fn`` with nested tapes, with the inputs on ``device``."""
    g, us = directions(xs, fn(*xs).shape, seed)
    xs, us = _on(xs, device), _on(us, device)
    g = _on([g], device)[0]
    with Tape() as outer:
        outer.watch([*xs, g])
        with Tape() as inner:
            inner.watch(xs)
            y = fn(*xs)
        first = inner.gradient(y, xs, output_gradients=g)
        s = ops.sum(ops.multiply(first[0], us[0]))
        for f, u in zip(first[1:], us[1:], strict=True):
            s = ops.add(s, ops.sum(ops.multiply(f, u)))
    *second, second_g = outer.gradient(s, [*xs, g])
    return Result(_host(y), [_host(f) for f in first], [_host(h) for h in second], _host(second_g))


def theirs(torch: Any, fn: Callable[..., Any], xs: list[np.ndarray], seed: int) -> Result:
    """The same quantities with PyTorch autograd (``create_graph=True``)."""
    ts = [torch.tensor(x, requires_grad=True) for x in xs]
    y = fn(torch, *ts)
    g0, us = directions(xs, tuple(y.shape), seed)
    g = torch.tensor(g0, requires_grad=True)
    first = torch.autograd.grad(y, ts, g, create_graph=True, allow_unused=True)
    first = [torch.zeros_like(t) if f is None else f for t, f in zip(ts, first, strict=True)]
    s = sum((f * torch.as_tensor(u)).sum() for f, u in zip(first, us, strict=True))
    wrt = [*ts, g]
    second = (
        torch.autograd.grad(s, wrt, allow_unused=True) if s.requires_grad else [None] * len(wrt)
    )
    second = [torch.zeros_like(t) if h is None else h for t, h in zip(wrt, second, strict=True)]
    as_np = lambda t: t.detach().numpy(force=True).copy()  # noqa: E731
    return Result(
        as_np(y), [as_np(f) for f in first], [as_np(h) for h in second[:-1]], as_np(second[-1])
    )


# --------------------------------------------------------------------------------------------
# Random op graphs


@dataclass
class Graph:
    """A random program: input shapes and steps ``(op, argument indices, parameters)``."""

    shapes: list[tuple[int, ...]]
    steps: list[tuple[str, tuple[int, ...], tuple[Any, ...]]] = field(default_factory=list)

    def key(self) -> str:
        """A digest of the program (the oracle file checks it was made by this generator)."""
        return hashlib.sha256(repr((self.shapes, self.steps)).encode()).hexdigest()[:16]


_SHAPES = [(2, 3), (3,), (1, 3), (2, 1), (3, 2), ()]
_UNARY = ["negative", "square", "exp", "log", "tanh", "relu", "abs", "sqrt", "clip"]
_BINARY = ["add", "subtract", "multiply", "divide", "power", "maximum", "minimum", "where"]


def _broadcast(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...] | None:
    try:
        return tuple(np.broadcast_shapes(a, b))
    except ValueError:
        return None


def make_graph(choose: Callable[[int], int], *, steps: int, hops: bool) -> Graph:
    """A random graph drawn with ``choose(n) -> int in [0, n)``."""
    graph = Graph([_SHAPES[choose(len(_SHAPES) - 1)] for _ in range(1 + choose(3))])
    pool = list(graph.shapes)
    kinds = ["unary", "binary", "reduce", "softmax", "shape", "index", "join", "matmul"]
    kinds += ["hop"] if hops else []
    for _ in range(steps):
        kind = kinds[choose(len(kinds))]
        i = choose(len(pool))
        s = pool[i]
        if kind == "unary":
            graph.steps.append((_UNARY[choose(len(_UNARY))], (i,), ()))
            pool.append(s)
        elif kind == "binary":
            j = choose(len(pool))
            out = _broadcast(s, pool[j])
            if out is None or np.prod(out) > 24:
                continue
            graph.steps.append((_BINARY[choose(len(_BINARY))], (i, j), ()))
            pool.append(out)
        elif kind == "reduce" and s:
            axis = choose(len(s))
            op = ["sum", "mean", "logsumexp", "var"][choose(4)]
            if op == "var" and s[axis] < 2:
                op = "sum"
            graph.steps.append((op, (i,), (axis,)))
            pool.append(s[:axis] + s[axis + 1 :])
        elif kind == "softmax" and s:
            graph.steps.append((["softmax", "log_softmax"][choose(2)], (i,), (choose(len(s)),)))
            pool.append(s)
        elif kind == "shape" and len(s) >= 2:
            graph.steps.append(("transpose", (i,), ()))
            pool.append(s[::-1])
        elif kind == "shape":
            graph.steps.append(("reshape", (i,), ((1, *s),)))
            pool.append((1, *s))
        elif kind == "index" and s and s[0] >= 2:
            which = choose(4)
            n = s[0]
            index: Any = [
                choose(n),
                (slice(1, None),),
                tuple(choose(n) for _ in range(3)),
                (*tuple(bool(choose(2)) for _ in range(n - 1)), True),
            ][which]
            graph.steps.append(("getitem", (i,), (which, index)))
            count = [None, n - 1, 3, builtin_sum(index) if which == 3 else 0][which]
            pool.append(s[1:] if which == 0 else (count, *s[1:]))
        elif kind == "join" and s:
            j = choose(len(pool))
            if pool[j] != s:
                j = i  # reuse the same value twice
            op = ["concatenate", "stack", "split"][choose(3)]
            if op == "split":
                if s[0] < 2:
                    continue
                graph.steps.append(("split", (i,), (1,)))
                pool.extend([(1, *s[1:]), (s[0] - 1, *s[1:])])
            else:
                graph.steps.append((op, (i, j), ()))
                pool.append((2 * s[0], *s[1:]) if op == "concatenate" else (2, *s))
        elif kind == "matmul" and len(s) == 2:
            j = choose(len(pool))
            if len(pool[j]) != 2 or pool[j][0] != s[1]:
                continue
            graph.steps.append(("matmul", (i, j), ()))
            pool.append((s[0], pool[j][1]))
        elif kind == "hop":
            graph.steps.append(("hop", (i,), (1 + choose(3),)))
            pool.append(s)
    return graph


builtin_sum = sum


def _graph_ops_ours() -> dict[str, Callable[..., Any]]:
    def hop(x: Any, k: int) -> Any:
        """cpu -> host:k -> host:(k % 3 + 1) -> cpu, computing on each host device."""
        away = ops.tanh(cupy_parallel.to_device(x, f"host:{k}"))
        further = ops.exp(cupy_parallel.to_device(away, f"host:{k % 3 + 1}"))
        return cupy_parallel.to_device(further, "cpu")

    return {
        "negative": ops.negative,
        "square": ops.square,
        "exp": lambda x: ops.exp(ops.tanh(x)),
        "log": lambda x: ops.log(ops.add(ops.square(x), 0.5)),
        "tanh": ops.tanh,
        "relu": ops.relu,
        "abs": ops.abs,
        "sqrt": lambda x: ops.sqrt(ops.add(ops.square(x), 0.5)),
        "clip": lambda x: ops.clip(x, -0.5, 0.5),
        "add": ops.add,
        "subtract": ops.subtract,
        "multiply": ops.multiply,
        "divide": lambda a, b: ops.divide(a, ops.add(ops.square(b), 0.5)),
        "power": lambda a, b: ops.power(ops.add(ops.square(a), 0.5), ops.tanh(b)),
        "maximum": ops.maximum,
        "minimum": ops.minimum,
        "where": lambda a, b: ops.where(_greater(a, b), a, b),
        "sum": ops.sum,
        "mean": ops.mean,
        "logsumexp": ops.logsumexp,
        "var": ops.var,
        "softmax": ops.softmax,
        "log_softmax": ops.log_softmax,
        "transpose": ops.transpose,
        "reshape": ops.reshape,
        "getitem": lambda x, which, index: ops.getitem(x, _index(which, index, np)),
        "concatenate": lambda a, b: ops.concatenate([a, b]),
        "stack": lambda a, b: ops.stack([a, b]),
        "split": lambda x, at: ops.split(x, [at]),
        "matmul": ops.matmul,
        "hop": hop,
    }


def _greater(a: Any, b: Any) -> Any:
    return np.greater(_host(a), _host(b))  # a constant mask, computed off the tape


def _index(which: int, index: Any, xp: Any) -> Any:
    return index if which < 2 else xp.asarray(list(index))


def _graph_ops_theirs(t: Any) -> dict[str, Callable[..., Any]]:
    def getitem(x: Any, which: int, index: Any) -> Any:
        return x[index] if which < 2 else x[t.as_tensor(list(index))]

    return {
        "negative": lambda x: -x,
        "square": lambda x: x * x,
        "exp": lambda x: t.exp(t.tanh(x)),
        "log": lambda x: t.log(x * x + 0.5),
        "tanh": t.tanh,
        "relu": t.relu,
        "abs": t.abs,
        "sqrt": lambda x: t.sqrt(x * x + 0.5),
        "clip": lambda x: t.clamp(x, -0.5, 0.5),
        "add": lambda a, b: a + b,
        "subtract": lambda a, b: a - b,
        "multiply": lambda a, b: a * b,
        "divide": lambda a, b: a / (b * b + 0.5),
        "power": lambda a, b: (a * a + 0.5) ** t.tanh(b),
        "maximum": t.maximum,
        "minimum": t.minimum,
        "where": lambda a, b: t.where(a.detach() > b.detach(), a, b),
        "sum": lambda x, axis: x.sum(axis),
        "mean": lambda x, axis: x.mean(axis),
        "logsumexp": t.logsumexp,
        "var": lambda x, axis: t.var(x, axis, correction=0),
        "softmax": t.softmax,
        "log_softmax": t.log_softmax,
        "transpose": lambda x: x.permute(*range(x.ndim - 1, -1, -1)),
        "reshape": lambda x, shape: x.reshape(shape),
        "getitem": getitem,
        "concatenate": lambda a, b: t.cat([a, b]),
        "stack": lambda a, b: t.stack([a, b]),
        "split": lambda x, at: t.tensor_split(x, [at]),
        "matmul": t.matmul,
        "hop": lambda x, k: t.exp(t.tanh(x)),
    }


def run_graph(graph: Graph, table: dict[str, Callable[..., Any]], xs: list[Any], side: str) -> Any:
    """The graph's scalar loss: every pool value weighted into it (maximal fan-out)."""
    pool = list(xs)
    for op, args, params in graph.steps:
        out = table[op](*(pool[a] for a in args), *params)
        pool.extend(out if isinstance(out, list | tuple) else [out])
    rng = np.random.default_rng(len(pool))
    weights = [rng.uniform(-1, 1, np.shape(v) if side == "ours" else tuple(v.shape)) for v in pool]
    if side == "ours":
        terms = [ops.sum(ops.multiply(v, w)) for v, w in zip(pool, weights, strict=True)]
        terms += [ops.multiply(ops.sum(ops.square(x)), 0.1) for x in xs]
        loss = terms[0]
        for term in terms[1:]:
            loss = ops.add(loss, term)
        return loss
    t = _torch_module(xs[0])
    terms = [(v * t.as_tensor(w)).sum() for v, w in zip(pool, weights, strict=True)]
    terms += [(x * x).sum() * 0.1 for x in xs]
    return builtin_sum(terms[1:], terms[0])


def _torch_module(x: Any) -> Any:
    import torch

    return torch


def graph_inputs(graph: Graph, seed: int) -> list[np.ndarray]:
    """The graph's inputs, drawn from ``seed``."""
    rng = np.random.default_rng(seed)
    return [rng.uniform(-1, 1, s) for s in graph.shapes]


def graph_functions(graph: Graph) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """``graph`` as a function of its inputs, with our ops and with PyTorch."""
    table = _graph_ops_ours()
    theirs_table: dict[str, Any] = {}

    def f_ours(*xs: Any) -> Any:
        return run_graph(graph, table, list(xs), "ours")

    def f_theirs(t: Any, *xs: Any) -> Any:
        if not theirs_table:
            theirs_table.update(_graph_ops_theirs(t))
        return run_graph(graph, theirs_table, list(xs), "theirs")

    return f_ours, f_theirs


def seeded_graph(seed: int, *, steps: int = 8, hops: bool = True) -> Graph:
    """The graph a ``random.Random(seed)`` draws (the stored oracle's graphs)."""
    rnd = random.Random(seed)
    return make_graph(rnd.randrange, steps=steps, hops=hops)
