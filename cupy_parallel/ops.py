"""Differentiable array operations recorded by :class:`cupy_parallel.Tape`."""

from cupy_parallel._src.ops import (
    add,
    divide,
    exp,
    log,
    matmul,
    mean,
    multiply,
    negative,
    relu,
    reshape,
    square,
    subtract,
    sum,
    tanh,
    transpose,
)

__all__ = [
    "add",
    "divide",
    "exp",
    "log",
    "matmul",
    "mean",
    "multiply",
    "negative",
    "relu",
    "reshape",
    "square",
    "subtract",
    "sum",
    "tanh",
    "transpose",
]
