"""Conformance table: every row is one operation and what a CuPy array on a GPU does with it.

A host array must accept what a ``cupy.ndarray`` accepts and refuse what it refuses (issue 9).
Each row names the place in CuPy's sources (github.com/cupy/cupy, main of 2026-08) where the rule
comes from; the test id carries it. Outcomes:

* ``DEVICE``: accepted; every array in the result (and every operand written in place) is on
  the operand's device, and the values equal the same operation on plain NumPy, bit for bit;
* ``HOST``: accepted and leaves the device explicitly (``get``, ``float``, ``tolist``, ...);
  the value equals NumPy's;
* an exception type: refused with it, and nothing was written.
"""

from __future__ import annotations

import collections
import copy
import io
import operator
import pickle
from typing import Any, NamedTuple

import numpy as np
import optree
import pytest

import cupy_parallel as cp
from cupy_parallel import HostArray, to_device

DEVICE = "device"
HOST = "host"

KERNEL = "cupy/_core/_kernel.pyx"
CORE = "cupy/_core/core.pyx"
INDEXING = "cupy/_core/_routines_indexing.pyx"


class Row(NamedTuple):
    name: str
    source: str
    op: Any  # op(x, y, i, z, n): x, y on host:1, i int indices on host:1, z on host:2, n NumPy
    outcome: Any


class _List(list):  # a list subclass, as users pass them
    pass


ROWS = [
    # ---- ufuncs ------------------------------------------------------------------------------
    Row("np.add(x, y)", f"{CORE}:__array_ufunc__", lambda x, y, i, z, n: np.add(x, y), DEVICE),
    Row(
        "np.subtract(x, 2)",
        f"{KERNEL}:_preprocess_arg",
        lambda x, y, i, z, n: np.subtract(x, 2),
        DEVICE,
    ),
    Row(
        "np.multiply(2.5, x)",
        f"{KERNEL}:_preprocess_arg",
        lambda x, y, i, z, n: np.multiply(2.5, x),
        DEVICE,
    ),
    Row(
        "np.true_divide(x, y)",
        f"{CORE}:__array_ufunc__",
        lambda x, y, i, z, n: np.true_divide(x, y),
        DEVICE,
    ),
    Row(
        "np.floor_divide(x, 2)",
        f"{CORE}:__array_ufunc__",
        lambda x, y, i, z, n: np.floor_divide(x, 2),
        DEVICE,
    ),
    Row("np.power(x, 2)", f"{CORE}:__array_ufunc__", lambda x, y, i, z, n: np.power(x, 2), DEVICE),
    Row("np.exp(x)", f"{CORE}:__array_ufunc__", lambda x, y, i, z, n: np.exp(x), DEVICE),
    Row("np.log(x)", f"{CORE}:__array_ufunc__", lambda x, y, i, z, n: np.log(x), DEVICE),
    Row("np.sqrt(x)", f"{CORE}:__array_ufunc__", lambda x, y, i, z, n: np.sqrt(x), DEVICE),
    Row("np.sin(x)", f"{CORE}:__array_ufunc__", lambda x, y, i, z, n: np.sin(x), DEVICE),
    Row("np.tanh(x)", f"{CORE}:__array_ufunc__", lambda x, y, i, z, n: np.tanh(x), DEVICE),
    Row(
        "np.maximum(x, y)",
        f"{CORE}:__array_ufunc__",
        lambda x, y, i, z, n: np.maximum(x, y),
        DEVICE,
    ),
    Row(
        "np.minimum(x, 1.5)",
        f"{CORE}:__array_ufunc__",
        lambda x, y, i, z, n: np.minimum(x, 1.5),
        DEVICE,
    ),
    Row(
        "np.greater(x, y)",
        f"{CORE}:__array_ufunc__",
        lambda x, y, i, z, n: np.greater(x, y),
        DEVICE,
    ),
    Row(
        "np.equal(x, 2.0)",
        f"{CORE}:__array_ufunc__",
        lambda x, y, i, z, n: np.equal(x, 2.0),
        DEVICE,
    ),
    Row(
        "np.less(x, 0-d numpy)",
        f"{CORE}:__array_ufunc__ (comparisons take a 0-d array's item)",
        lambda x, y, i, z, n: np.less(x, np.array(2.5)),
        DEVICE,
    ),
    Row(
        "np.logical_and",
        f"{CORE}:__array_ufunc__",
        lambda x, y, i, z, n: np.logical_and(x > 1, y > 1),
        DEVICE,
    ),
    Row("np.isnan(x)", f"{CORE}:__array_ufunc__", lambda x, y, i, z, n: np.isnan(x), DEVICE),
    Row("np.isfinite(x)", f"{CORE}:__array_ufunc__", lambda x, y, i, z, n: np.isfinite(x), DEVICE),
    Row(
        "np.absolute(-x)", f"{CORE}:__array_ufunc__", lambda x, y, i, z, n: np.absolute(-x), DEVICE
    ),
    Row("np.sign(x)", f"{CORE}:__array_ufunc__", lambda x, y, i, z, n: np.sign(x), DEVICE),
    Row(
        "np.arctan2(x, y)",
        f"{CORE}:__array_ufunc__",
        lambda x, y, i, z, n: np.arctan2(x, y),
        DEVICE,
    ),
    Row("np.hypot(x, y)", f"{CORE}:__array_ufunc__", lambda x, y, i, z, n: np.hypot(x, y), DEVICE),
    Row(
        "np.divmod(x, 2)", f"{CORE}:__array_ufunc__", lambda x, y, i, z, n: np.divmod(x, 2), DEVICE
    ),
    Row("np.modf(x)", f"{CORE}:__array_ufunc__", lambda x, y, i, z, n: np.modf(x), DEVICE),
    Row("np.frexp(x)", f"{CORE}:__array_ufunc__", lambda x, y, i, z, n: np.frexp(x), DEVICE),
    Row(
        "np.add(x, y, out=y)",
        f"{KERNEL}:ufunc.__call__ (out)",
        lambda x, y, i, z, n: np.add(x, y, out=y),
        DEVICE,
    ),
    Row(
        "np.add(x, 1, dtype=float32)",
        f"{KERNEL}:ufunc.__call__ (dtype)",
        lambda x, y, i, z, n: np.add(x, 1, dtype=np.float32),
        DEVICE,
    ),
    Row(
        "np.add(x, np.float32)",
        "cupy/_core/_scalar.pyx:scalar_type_set",
        lambda x, y, i, z, n: np.add(x, np.float32(2)),
        DEVICE,
    ),
    Row(
        "np.add(x, True)",
        "cupy/_core/_scalar.pyx:scalar_type_set",
        lambda x, y, i, z, n: np.add(x, True),
        DEVICE,
    ),
    Row(
        "np.add(x, 1+2j)",
        "cupy/_core/_scalar.pyx:scalar_type_set",
        lambda x, y, i, z, n: np.add(x, 1 + 2j),
        DEVICE,
    ),
    Row(
        "np.add.reduce(x)",
        f"{KERNEL}:ufunc.reduce (add)",
        lambda x, y, i, z, n: np.add.reduce(x),
        DEVICE,
    ),
    Row(
        "np.multiply.accumulate(x)",
        f"{KERNEL}:ufunc.accumulate (multiply)",
        lambda x, y, i, z, n: np.multiply.accumulate(x),
        DEVICE,
    ),
    Row(
        "np.add.outer(x[0], y[0])",
        f"{KERNEL}:ufunc.outer",
        lambda x, y, i, z, n: np.add.outer(x[0], y[0]),
        DEVICE,
    ),
    Row(
        "np.add.at(x, i, 1)",
        f"{KERNEL}:ufunc.at (_scatter_op)",
        lambda x, y, i, z, n: np.add.at(x, i, 1),
        DEVICE,
    ),
    Row(
        "np.add(x, numpy)",
        f"{CORE}:__array_ufunc__ (numpy.ndarray refused)",
        lambda x, y, i, z, n: np.add(x, n),
        TypeError,
    ),
    Row(
        "np.add(x, list)",
        f"{CORE}:__array_ufunc__ (NotImplemented)",
        lambda x, y, i, z, n: np.add(x, [1.0, 2.0, 3.0]),
        TypeError,
    ),
    Row(
        "np.add(x, tuple)",
        f"{CORE}:__array_ufunc__ (NotImplemented)",
        lambda x, y, i, z, n: np.add(x, (1.0, 2.0, 3.0)),
        TypeError,
    ),
    Row(
        "np.add(x, str)",
        f"{CORE}:__array_ufunc__ (NotImplemented)",
        lambda x, y, i, z, n: np.add(x, "a"),
        TypeError,
    ),
    Row(
        "np.add(x, None)",
        f"{CORE}:__array_ufunc__ (NotImplemented)",
        lambda x, y, i, z, n: np.add(x, None),
        TypeError,
    ),
    Row(
        "np.add(x, 0-d numpy)",
        f"{KERNEL}:_preprocess_arg (CScalar refuses arrays)",
        lambda x, y, i, z, n: np.add(x, np.array(2.0)),
        TypeError,
    ),
    Row(
        "np.add(x, other device)",
        f"{KERNEL}:_check_peer_access",
        lambda x, y, i, z, n: np.add(x, z),
        ValueError,
    ),
    Row(
        "np.add(x, 1, out=numpy)",
        f"{KERNEL}:_decide_params_type_core",
        lambda x, y, i, z, n: np.add(x, 1, out=n),
        TypeError,
    ),
    Row(
        "np.add(x, 1, out=other device)",
        f"{KERNEL}:_check_peer_access",
        lambda x, y, i, z, n: np.add(x, 1, out=z),
        ValueError,
    ),
    Row(
        "np.add(x, 1, where=...)",
        f"{KERNEL}:ufunc.__call__ ('Wrong arguments')",
        lambda x, y, i, z, n: np.add(x, 1, where=x > 1),
        TypeError,
    ),
    Row(
        "np.add(x, 1, order='C')",
        f"{KERNEL}:ufunc.__call__ ('Wrong arguments')",
        lambda x, y, i, z, n: np.add(x, 1, order="C"),
        TypeError,
    ),
    Row(
        "np.divmod(x, 2, out=(y, y))",
        f"{CORE}:__array_ufunc__ (one out array)",
        lambda x, y, i, z, n: np.divmod(x, 2, out=(y, y.copy())),
        ValueError,
    ),
    Row(
        "np.maximum.reduce(x)",
        f"{KERNEL}:ufunc.reduce (add/multiply only)",
        lambda x, y, i, z, n: np.maximum.reduce(x),
        NotImplementedError,
    ),
    Row(
        "np.isnat(x)",
        f"{CORE}:__array_ufunc__ (no cupy.isnat)",
        lambda x, y, i, z, n: np.isnat(x),
        TypeError,
    ),
    # ---- Python operators ------------------------------------------------------------------
    Row("x + y", f"{CORE}:__add__", lambda x, y, i, z, n: x + y, DEVICE),
    Row("x - 1", f"{CORE}:__sub__", lambda x, y, i, z, n: x - 1, DEVICE),
    Row("2 * x", f"{CORE}:__mul__", lambda x, y, i, z, n: 2 * x, DEVICE),
    Row("x / y", f"{CORE}:__truediv__", lambda x, y, i, z, n: x / y, DEVICE),
    Row("x // 2", f"{CORE}:__floordiv__", lambda x, y, i, z, n: x // 2, DEVICE),
    Row("x % 2", f"{CORE}:__mod__", lambda x, y, i, z, n: x % 2, DEVICE),
    Row("x ** 2", f"{CORE}:__pow__", lambda x, y, i, z, n: x**2, DEVICE),
    Row("2.0 ** x", f"{CORE}:__pow__", lambda x, y, i, z, n: 2.0**x, DEVICE),
    Row("x @ y.T", f"{CORE}:__matmul__", lambda x, y, i, z, n: x @ y.T, DEVICE),
    Row("-x", f"{CORE}:__neg__", lambda x, y, i, z, n: -x, DEVICE),
    Row("abs(x)", f"{CORE}:__abs__", lambda x, y, i, z, n: abs(x), DEVICE),
    Row("~(x > 2)", f"{CORE}:__invert__", lambda x, y, i, z, n: ~(x > 2), DEVICE),
    Row("(x > 2) & (y > 2)", f"{CORE}:__and__", lambda x, y, i, z, n: (x > 2) & (y > 2), DEVICE),
    Row("x < y", f"{CORE}:__richcmp__", lambda x, y, i, z, n: x < y, DEVICE),
    Row(
        "x == None",
        f"{CORE}:__richcmp__ (object.__eq__: all False)",
        lambda x, y, i, z, n: x == None,  # noqa: E711 - the operator under test
        DEVICE,
    ),
    Row("x != None", f"{CORE}:__richcmp__ (all True)", lambda x, y, i, z, n: x != None, DEVICE),  # noqa: E711
    Row(
        "x > 0-d numpy",
        f"{CORE}:__richcmp__ (0-d numpy as its item)",
        lambda x, y, i, z, n: x > np.array(1.0),
        DEVICE,
    ),
    Row("x += 1", f"{CORE}:__iadd__", lambda x, y, i, z, n: operator.iadd(x, 1), DEVICE),
    Row("x *= y", f"{CORE}:__imul__", lambda x, y, i, z, n: operator.imul(x, y), DEVICE),
    Row("divmod(x, 2)", f"{CORE}:__divmod__", lambda x, y, i, z, n: divmod(x, 2), DEVICE),
    Row(
        "x + numpy",
        f"{CORE}:__add__ -> numpy.add -> __array_ufunc__",
        lambda x, y, i, z, n: x + n,
        TypeError,
    ),
    Row("numpy + x", f"{CORE}:__array_ufunc__", lambda x, y, i, z, n: n + x, TypeError),
    Row(
        "x + list",
        f"{CORE}:__array_ufunc__ (NotImplemented)",
        lambda x, y, i, z, n: x + [1.0, 2.0, 3.0],  # noqa: RUF005 - the operator under test
        TypeError,
    ),
    Row(
        "x * 0-d numpy",
        f"{KERNEL}:_preprocess_arg",
        lambda x, y, i, z, n: x * np.array(2.0),
        TypeError,
    ),
    Row(
        "x + other device", f"{KERNEL}:_check_peer_access", lambda x, y, i, z, n: x + z, ValueError
    ),
    Row("x += numpy", f"{CORE}:__iadd__", lambda x, y, i, z, n: operator.iadd(x, n), TypeError),
    Row(
        "x == 'a'", f"{CORE}:__richcmp__ -> numpy.equal", lambda x, y, i, z, n: x == "a", TypeError
    ),
    # ---- methods -----------------------------------------------------------------------------
    Row("x.sum()", f"{CORE}:sum", lambda x, y, i, z, n: x.sum(), DEVICE),
    Row("x.sum(axis=0)", f"{CORE}:sum", lambda x, y, i, z, n: x.sum(axis=0), DEVICE),
    Row("x.mean()", f"{CORE}:mean", lambda x, y, i, z, n: x.mean(), DEVICE),
    Row("x.std()", f"{CORE}:std", lambda x, y, i, z, n: x.std(), DEVICE),
    Row("x.var(axis=1)", f"{CORE}:var", lambda x, y, i, z, n: x.var(axis=1), DEVICE),
    Row("x.max()", f"{CORE}:max", lambda x, y, i, z, n: x.max(), DEVICE),
    Row("x.min(axis=0)", f"{CORE}:min", lambda x, y, i, z, n: x.min(axis=0), DEVICE),
    Row("x.argmax()", f"{CORE}:argmax", lambda x, y, i, z, n: x.argmax(), DEVICE),
    Row("x.argmin(axis=1)", f"{CORE}:argmin", lambda x, y, i, z, n: x.argmin(axis=1), DEVICE),
    Row("x.all()", f"{CORE}:all", lambda x, y, i, z, n: x.all(), DEVICE),
    Row("x.any()", f"{CORE}:any", lambda x, y, i, z, n: x.any(), DEVICE),
    Row("x.cumsum()", f"{CORE}:cumsum", lambda x, y, i, z, n: x.cumsum(), DEVICE),
    Row("x.prod()", f"{CORE}:prod", lambda x, y, i, z, n: x.prod(), DEVICE),
    Row("x.clip(1, 3)", f"{CORE}:clip", lambda x, y, i, z, n: x.clip(1, 3), DEVICE),
    Row("x.round()", f"{CORE}:round", lambda x, y, i, z, n: x.round(), DEVICE),
    Row("x.astype(float32)", f"{CORE}:astype", lambda x, y, i, z, n: x.astype(np.float32), DEVICE),
    Row("x.copy()", f"{CORE}:copy", lambda x, y, i, z, n: x.copy(), DEVICE),
    Row("x.reshape(3, 2)", f"{CORE}:reshape", lambda x, y, i, z, n: x.reshape(3, 2), DEVICE),
    Row("x.transpose()", f"{CORE}:transpose", lambda x, y, i, z, n: x.transpose(), DEVICE),
    Row(
        "x.transpose([1, 0])",
        f"{CORE}:transpose",
        lambda x, y, i, z, n: x.transpose([1, 0]),
        DEVICE,
    ),
    Row("x.T", f"{CORE}:T", lambda x, y, i, z, n: x.T, DEVICE),
    Row("x.ravel()", f"{CORE}:ravel", lambda x, y, i, z, n: x.ravel(), DEVICE),
    Row("x.flatten()", f"{CORE}:flatten", lambda x, y, i, z, n: x.flatten(), DEVICE),
    Row("x.swapaxes(0, 1)", f"{CORE}:swapaxes", lambda x, y, i, z, n: x.swapaxes(0, 1), DEVICE),
    Row("x.diagonal()", f"{CORE}:diagonal", lambda x, y, i, z, n: x.diagonal(), DEVICE),
    Row("x.trace()", f"{CORE}:trace", lambda x, y, i, z, n: x.trace(), DEVICE),
    Row("x.nonzero()", f"{INDEXING}:_ndarray_nonzero", lambda x, y, i, z, n: x.nonzero(), DEVICE),
    Row(
        "x.ravel().searchsorted(2.5)",
        f"{CORE}:searchsorted",
        lambda x, y, i, z, n: x.ravel().searchsorted(2.5),
        DEVICE,
    ),
    Row("x.take(i)", f"{INDEXING}:_take", lambda x, y, i, z, n: x.take(i), DEVICE),
    Row(
        "x.take(list)",
        f"{INDEXING}:_take (core.array converts host data)",
        lambda x, y, i, z, n: x.take([0, 1]),
        DEVICE,
    ),
    Row(
        "x.repeat(2)",
        "cupy/_core/_routines_manipulation.pyx:_repeat",
        lambda x, y, i, z, n: x.repeat(2),
        DEVICE,
    ),
    Row("x.conj()", f"{CORE}:conj", lambda x, y, i, z, n: x.conj(), DEVICE),
    Row("x.dot(y.T)", f"{CORE}:dot", lambda x, y, i, z, n: x.dot(y.T), DEVICE),
    Row("x.fill(0.5)", f"{CORE}:fill", lambda x, y, i, z, n: x.fill(0.5), DEVICE),
    Row(
        "x.fill(0-d numpy)",
        f"{CORE}:fill (numpy.asarray(value) of shape ())",
        lambda x, y, i, z, n: x.fill(np.array(0.5)),
        DEVICE,
    ),
    Row(
        "x.sort()",
        "cupy/_core/_routines_sorting.pyx:_ndarray_sort",
        lambda x, y, i, z, n: x.sort(),
        DEVICE,
    ),
    Row("x.put(i, 9.0)", f"{INDEXING}:_ndarray_put", lambda x, y, i, z, n: x.put(i, 9.0), DEVICE),
    Row(
        "x.put(list, list)",
        f"{INDEXING}:_ndarray_put (core.array converts)",
        lambda x, y, i, z, n: x.put([0], [9.0]),
        DEVICE,
    ),
    Row("x.view(int64)", f"{CORE}:view", lambda x, y, i, z, n: x.view(np.int64), DEVICE),
    Row(
        "x.sum(out=0-d device)",
        f"{CORE}:sum (out)",
        lambda x, y, i, z, n: x.sum(out=y[0, 0]),
        DEVICE,
    ),
    Row(
        "x.astype(object)",
        "cupy/_core/_dtype.pyx:get_dtype (no object arrays)",
        lambda x, y, i, z, n: x.astype(object),
        TypeError,
    ),
    Row(
        "x.view(np.ndarray)",
        f"{CORE}:view ('Type must be a sub-type of ndarray')",
        lambda x, y, i, z, n: x.view(np.ndarray),
        TypeError,
    ),
    Row(
        "x.dot(numpy)",
        f"{CORE}:dot (b is a cupy ndarray)",
        lambda x, y, i, z, n: x.dot(n),
        TypeError,
    ),
    Row(
        "x.take(other device)",
        f"{KERNEL}:_check_peer_access",
        lambda x, y, i, z, n: x.take(z.astype(np.intp)[0]),
        ValueError,
    ),
    Row(
        "x.fill(numpy vector)",
        f"{CORE}:fill ('non-scalar numpy.ndarray')",
        lambda x, y, i, z, n: x.fill(n),
        ValueError,
    ),
    Row(
        "x.fill(other device)",
        f"{KERNEL}:_check_peer_access",
        lambda x, y, i, z, n: x.fill(z[0, 0]),
        ValueError,
    ),
    Row(
        "x.sum(out=numpy)",
        f"{KERNEL}:_decide_params_type_core",
        lambda x, y, i, z, n: x.sum(out=np.zeros(())),
        TypeError,
    ),
    Row(
        "x.searchsorted(other device)",
        f"{KERNEL}:_check_peer_access",
        lambda x, y, i, z, n: x.ravel().searchsorted(z.ravel()),
        ValueError,
    ),
    Row(
        "x[0, 0].nonzero()",
        f"{INDEXING}:_ndarray_nonzero (0-d)",
        lambda x, y, i, z, n: x[0, 0].nonzero(),
        ValueError,
    ),
    # ---- NumPy functions ---------------------------------------------------------------------
    Row(
        "np.concatenate([x, y])",
        f"{CORE}:__array_function__",
        lambda x, y, i, z, n: np.concatenate([x, y]),
        DEVICE,
    ),
    Row(
        "np.stack((x, y))",
        f"{CORE}:__array_function__",
        lambda x, y, i, z, n: np.stack((x, y)),
        DEVICE,
    ),
    Row(
        "np.concatenate(list subclass)",
        "cupy/_manipulation/join.py:concatenate (any sequence)",
        lambda x, y, i, z, n: np.concatenate(_List([x, y])),
        DEVICE,
    ),
    Row(
        "np.concatenate(UserList)",
        "cupy/_manipulation/join.py:concatenate (any sequence)",
        lambda x, y, i, z, n: np.concatenate(collections.UserList([x, y])),
        DEVICE,
    ),
    Row(
        "np.where(c, x, y)",
        f"{CORE}:__array_function__",
        lambda x, y, i, z, n: np.where(x > 2, x, y),
        DEVICE,
    ),
    Row(
        "np.where(c, x, 0.0)",
        f"{CORE}:__array_function__",
        lambda x, y, i, z, n: np.where(x > 2, x, 0.0),
        DEVICE,
    ),
    Row("np.where(c)", f"{CORE}:__array_function__", lambda x, y, i, z, n: np.where(x > 2), DEVICE),
    Row(
        "np.dot(x, y.T)", f"{CORE}:__array_function__", lambda x, y, i, z, n: np.dot(x, y.T), DEVICE
    ),
    Row(
        "np.matmul(x, y.T)",
        f"{CORE}:__array_ufunc__",
        lambda x, y, i, z, n: np.matmul(x, y.T),
        DEVICE,
    ),
    Row(
        "np.einsum",
        f"{CORE}:__array_function__",
        lambda x, y, i, z, n: np.einsum("ij,ij->i", x, y),
        DEVICE,
    ),
    Row(
        "np.linalg.norm(x)",
        f"{CORE}:__array_function__ (cupy.linalg)",
        lambda x, y, i, z, n: np.linalg.norm(x),
        DEVICE,
    ),
    Row(
        "np.linalg.inv",
        f"{CORE}:__array_function__ (cupy.linalg)",
        lambda x, y, i, z, n: np.linalg.inv(x[:, :2] + np.eye(2, like=x)),
        DEVICE,
    ),
    Row(
        "np.split(x, 3, axis=1)",
        f"{CORE}:__array_function__",
        lambda x, y, i, z, n: np.split(x, 3, axis=1),
        DEVICE,
    ),
    Row(
        "np.sort(x, axis=None)",
        f"{CORE}:__array_function__",
        lambda x, y, i, z, n: np.sort(x, axis=None),
        DEVICE,
    ),
    Row("np.argsort(x)", f"{CORE}:__array_function__", lambda x, y, i, z, n: np.argsort(x), DEVICE),
    Row("np.unique(x)", f"{CORE}:__array_function__", lambda x, y, i, z, n: np.unique(x), DEVICE),
    Row("np.cumsum(x)", f"{CORE}:__array_function__", lambda x, y, i, z, n: np.cumsum(x), DEVICE),
    Row(
        "np.clip(x, 1, 2)",
        f"{CORE}:__array_function__",
        lambda x, y, i, z, n: np.clip(x, 1, 2),
        DEVICE,
    ),
    Row(
        "np.copyto(y, x)",
        f"{CORE}:__array_function__ (cupy.copyto)",
        lambda x, y, i, z, n: np.copyto(y, x),
        DEVICE,
    ),
    Row(
        "np.broadcast_to",
        f"{CORE}:__array_function__",
        lambda x, y, i, z, n: np.broadcast_to(x[0], (2, 3)),
        DEVICE,
    ),
    Row(
        "np.transpose(x)",
        f"{CORE}:__array_function__",
        lambda x, y, i, z, n: np.transpose(x),
        DEVICE,
    ),
    Row(
        "np.expand_dims(x, 0)",
        f"{CORE}:__array_function__",
        lambda x, y, i, z, n: np.expand_dims(x, 0),
        DEVICE,
    ),
    Row(
        "np.histogram(x, 3)",
        f"{CORE}:__array_function__",
        lambda x, y, i, z, n: np.histogram(x, bins=3),
        DEVICE,
    ),
    Row(
        "np.mean(x, axis=0)",
        f"{CORE}:__array_function__",
        lambda x, y, i, z, n: np.mean(x, axis=0),
        DEVICE,
    ),
    Row(
        "np.sum(x, axis=0, out=y[0])",
        f"{CORE}:__array_function__ (out)",
        lambda x, y, i, z, n: np.sum(x, axis=0, out=y[0]),
        DEVICE,
    ),
    Row(
        "np.concatenate([x, numpy])",
        f"{CORE}:__array_function__ -> cupy.concatenate",
        lambda x, y, i, z, n: np.concatenate([x, n[None]]),
        TypeError,
    ),
    Row(
        "np.concatenate([x, other device])",
        f"{KERNEL}:_check_peer_access",
        lambda x, y, i, z, n: np.concatenate([x, z]),
        ValueError,
    ),
    Row(
        "np.where(other device, x, y)",
        f"{KERNEL}:_check_peer_access",
        lambda x, y, i, z, n: np.where(z > 1, x, y),
        ValueError,
    ),
    Row(
        "np.copyto(numpy, x)",
        f"{CORE}:__array_function__ -> cupy.copyto",
        lambda x, y, i, z, n: np.copyto(n, x[0]),
        TypeError,
    ),
    Row(
        "np.dot(x, numpy)",
        f"{CORE}:__array_function__ -> cupy.dot",
        lambda x, y, i, z, n: np.dot(x, n),
        TypeError,
    ),
    Row(
        "np.einsum(x, numpy)",
        "cupy/linalg/_einsum.py:_parse_einsum_input (cupy.asarray uploads operands)",
        lambda x, y, i, z, n: np.einsum("ij,j->i", x, n),
        DEVICE,
    ),
    Row(
        "np.isclose(x, numpy)",
        "cupy/_logic/comparison.py:isclose (cupy.asanyarray uploads b)",
        lambda x, y, i, z, n: np.isclose(x, n),
        DEVICE,
    ),
    Row(
        "np.copyto(x, 1-element numpy)",
        "cupy/_manipulation/basic.py:copyto (a one-element numpy source is a scalar)",
        lambda x, y, i, z, n: np.copyto(x, n[:1]),
        DEVICE,
    ),
    Row(
        "np.copyto(x, numpy vector)",
        "cupy/_manipulation/basic.py:copyto ('non-scalar numpy.ndarray')",
        lambda x, y, i, z, n: np.copyto(x, n),
        ValueError,
    ),
    Row(
        "np.dot(x, y, numpy out)",
        f"{CORE}:dot (out is a cupy ndarray)",
        lambda x, y, i, z, n: np.dot(x[0], y[0], np.zeros(())),
        TypeError,
    ),
    Row(
        "np.block([x, y])",
        f"{CORE}:__array_function__ (no cupy.block)",
        lambda x, y, i, z, n: np.block([x, y]),
        TypeError,
    ),
    Row(
        "np.insert(x, 0, 1.0)",
        f"{CORE}:__array_function__ (no cupy.insert)",
        lambda x, y, i, z, n: np.insert(x, 0, 1.0),
        TypeError,
    ),
    Row(
        "np.linalg.multi_dot",
        f"{CORE}:__array_function__ (no cupy.linalg.multi_dot)",
        lambda x, y, i, z, n: np.linalg.multi_dot([x, y.T, x]),
        TypeError,
    ),
    Row(
        "np.sum(x, where=...)",
        "cupy/_math/sumprod.py:sum (no where parameter)",
        lambda x, y, i, z, n: np.sum(x, where=x > 2),
        TypeError,
    ),
    Row(
        "np.max(x, initial=0)",
        "cupy/_statistics/order.py:amax (no initial parameter)",
        lambda x, y, i, z, n: np.max(x, initial=0.0),
        TypeError,
    ),
    Row(
        "x.sum(where=...)",
        f"{CORE}:sum (axis, dtype, out, keepdims only)",
        lambda x, y, i, z, n: x.sum(where=x > 2),
        TypeError,
    ),
    Row(
        "np.sort(x, stable=True)",
        "cupy/_sorting/sort.py:sort (no stable parameter)",
        lambda x, y, i, z, n: np.sort(x, stable=True),
        TypeError,
    ),
    # ---- NEP 35 like= ------------------------------------------------------------------------
    Row(
        "np.asarray(list, like=x)",
        "cupy/_creation/from_data.py:asarray",
        lambda x, y, i, z, n: np.asarray([1.0, 2.0], like=x),
        DEVICE,
    ),
    Row(
        "np.array(numpy, like=x)",
        "cupy/_creation/from_data.py:array",
        lambda x, y, i, z, n: np.array(n, like=x),
        DEVICE,
    ),
    Row(
        "np.ones(3, like=x)",
        "cupy/_creation/basic.py:ones",
        lambda x, y, i, z, n: np.ones(3, like=x),
        DEVICE,
    ),
    Row(
        "np.arange(3, like=x)",
        "cupy/_creation/ranges.py:arange",
        lambda x, y, i, z, n: np.arange(3, like=x),
        DEVICE,
    ),
    Row(
        "np.full(2, 7.0, like=x)",
        "cupy/_creation/basic.py:full",
        lambda x, y, i, z, n: np.full((2,), 7.0, like=x),
        DEVICE,
    ),
    # ---- indexing ----------------------------------------------------------------------------
    Row("x[0]", f"{INDEXING}:_ndarray_getitem", lambda x, y, i, z, n: x[0], DEVICE),
    Row(
        "x[0, 1] (0-d, not a scalar)",
        f"{INDEXING}:_view_getitem",
        lambda x, y, i, z, n: x[0, 1],
        DEVICE,
    ),
    Row("x[:, 1:]", f"{INDEXING}:_view_getitem", lambda x, y, i, z, n: x[:, 1:], DEVICE),
    Row("x[..., None]", f"{INDEXING}:_view_getitem", lambda x, y, i, z, n: x[..., None], DEVICE),
    Row("x[i]", f"{INDEXING}:_ndarray_getitem (take)", lambda x, y, i, z, n: x[i], DEVICE),
    Row(
        "x[list]",
        f"{INDEXING}:_prepare_slice_list (converts lists)",
        lambda x, y, i, z, n: x[[1, 0]],
        DEVICE,
    ),
    Row(
        "x[numpy index]",
        f"{INDEXING}:_prepare_slice_list (converts numpy)",
        lambda x, y, i, z, n: x[np.array([1, 0])],
        DEVICE,
    ),
    Row("x[x > 2]", f"{INDEXING}:_getitem_mask_single", lambda x, y, i, z, n: x[x > 2], DEVICE),
    Row(
        "x[other device index]",
        f"{KERNEL}:_check_peer_access",
        lambda x, y, i, z, n: x[z.astype(np.intp)[0]],
        ValueError,
    ),
    Row("x[0.5]", f"{INDEXING}:_prepare_slice_list", lambda x, y, i, z, n: x[0.5], IndexError),
    # ---- assignment --------------------------------------------------------------------------
    Row(
        "x[0] = 5.0",
        f"{INDEXING}:_scatter_op (fill)",
        lambda x, y, i, z, n: x.__setitem__(0, 5.0),
        DEVICE,
    ),
    Row(
        "x[0] = y[1]",
        f"{INDEXING}:_scatter_op (elementwise_copy)",
        lambda x, y, i, z, n: x.__setitem__(0, y[1]),
        DEVICE,
    ),
    Row(
        "x[...] = 0-d numpy",
        f"{INDEXING}:_scatter_op (fill)",
        lambda x, y, i, z, n: x.__setitem__(Ellipsis, np.array(3.0)),
        DEVICE,
    ),
    Row(
        "x[[0]] = numpy",
        f"{INDEXING}:_scatter_op_single (core.array)",
        lambda x, y, i, z, n: x.__setitem__([0], np.ones((1, 3))),
        DEVICE,
    ),
    Row(
        "x[i] = 0.0",
        f"{INDEXING}:_scatter_op_single",
        lambda x, y, i, z, n: x.__setitem__(i, 0.0),
        DEVICE,
    ),
    Row(
        "x[0] = numpy vector",
        f"{INDEXING}:_scatter_op -> fill (non-scalar)",
        lambda x, y, i, z, n: x.__setitem__(0, n),
        ValueError,
    ),
    Row(
        "x[0] = list",
        f"{INDEXING}:_scatter_op -> fill (non-scalar)",
        lambda x, y, i, z, n: x.__setitem__(0, [1.0, 2.0, 3.0]),
        ValueError,
    ),
    Row(
        "x[0] = other device",
        f"{KERNEL}:_check_peer_access",
        lambda x, y, i, z, n: x.__setitem__(0, z[0]),
        ValueError,
    ),
    Row(
        "numpy[...] = x",
        f"{CORE}:__array__",
        lambda x, y, i, z, n: n.__setitem__(Ellipsis, x[0]),
        TypeError,
    ),
    # ---- conversion --------------------------------------------------------------------------
    Row("np.asarray(x)", f"{CORE}:__array__", lambda x, y, i, z, n: np.asarray(x), TypeError),
    Row("np.array(x)", f"{CORE}:__array__", lambda x, y, i, z, n: np.array(x), TypeError),
    Row("np.array([x, y])", f"{CORE}:__array__", lambda x, y, i, z, n: np.array([x, y]), TypeError),
    Row(
        "np.ascontiguousarray(x)",
        f"{CORE}:__array__",
        lambda x, y, i, z, n: np.ascontiguousarray(x),
        TypeError,
    ),
    Row("memoryview(x)", f"{CORE}:__getbuffer__", lambda x, y, i, z, n: memoryview(x), TypeError),
    Row(
        "np.from_dlpack(x)",
        f"{CORE}:__dlpack__ (device memory)",
        lambda x, y, i, z, n: np.from_dlpack(x),
        BufferError,
    ),
    Row(
        "np.from_dlpack(x, device='cpu')",
        f"{CORE}:__dlpack__ (dl_device=kDLCPU copies)",
        lambda x, y, i, z, n: np.from_dlpack(x, device="cpu"),
        HOST,
    ),
    Row("float(x[0, 0])", f"{CORE}:__float__", lambda x, y, i, z, n: float(x[0, 0]), HOST),
    Row("int(x[0, 0])", f"{CORE}:__int__", lambda x, y, i, z, n: int(x[0, 0]), HOST),
    Row("complex(x[0, 0])", f"{CORE}:__complex__", lambda x, y, i, z, n: complex(x[0, 0]), HOST),
    Row("bool(x[0, 0])", f"{CORE}:__nonzero__", lambda x, y, i, z, n: bool(x[0, 0]), HOST),
    Row("bool(x)", f"{CORE}:__nonzero__ (ambiguous)", lambda x, y, i, z, n: bool(x), ValueError),
    Row("x[0, 0].item()", f"{CORE}:item", lambda x, y, i, z, n: x[0, 0].item(), HOST),
    Row("x.item() of many", f"{CORE}:item (size != 1)", lambda x, y, i, z, n: x.item(), ValueError),
    Row("x.tolist()", f"{CORE}:tolist", lambda x, y, i, z, n: x.tolist(), HOST),
    Row("x.get()", f"{CORE}:get", lambda x, y, i, z, n: x.get(), HOST),
    Row("x.get(order='F')", f"{CORE}:get (order)", lambda x, y, i, z, n: x.get(order="F"), HOST),
    Row("x.tobytes()", f"{CORE}:tobytes", lambda x, y, i, z, n: x.tobytes(), HOST),
    Row("list(x)", f"{CORE}:__iter__ (device rows)", lambda x, y, i, z, n: list(x), DEVICE),
    Row("len(x)", f"{CORE}:__len__", lambda x, y, i, z, n: len(x), HOST),
    Row(
        "operator.index(x[0, 0])",
        f"{CORE} (no __index__)",
        lambda x, y, i, z, n: operator.index(x[0, 0].astype(np.int64)),
        TypeError,
    ),
    Row("x.set(numpy)", f"{CORE}:set", lambda x, y, i, z, n: x[0].set(n), DEVICE),
    Row(
        "x.set(list)",
        f"{CORE}:set (numpy.ndarray only)",
        lambda x, y, i, z, n: x[0].set([1.0, 2.0, 3.0]),
        TypeError,
    ),
    Row(
        "x.set(other dtype)",
        f"{CORE}:set (dtype)",
        lambda x, y, i, z, n: x[0].set(n.astype(np.float32)),
        TypeError,
    ),
    Row("x.set(other shape)", f"{CORE}:set (shape)", lambda x, y, i, z, n: x.set(n), ValueError),
    Row("copy.deepcopy(x)", f"{CORE}:__deepcopy__", lambda x, y, i, z, n: copy.deepcopy(x), DEVICE),
    Row("copy.copy(x)", f"{CORE}:__copy__", lambda x, y, i, z, n: copy.copy(x), DEVICE),
    Row("str(x)", f"{CORE}:__str__", lambda x, y, i, z, n: str(x), HOST),
    # ---- I/O ---------------------------------------------------------------------------------
    Row(
        "pickle round trip",
        f"{CORE}:__reduce__",
        lambda x, y, i, z, n: pickle.loads(pickle.dumps(x)),
        DEVICE,
    ),
    Row(
        "np.save(file, x)",
        "cupy/_io/npz.py:save (cupy.asnumpy inside)",
        lambda x, y, i, z, n: np.save(io.BytesIO(), x),
        HOST,
    ),
    Row(
        "np.savez(file, a=x)",
        "cupy/_io/npz.py:savez",
        lambda x, y, i, z, n: np.savez(io.BytesIO(), a=x),
        HOST,
    ),
    Row("x.dump(file)", f"{CORE}:dump", lambda x, y, i, z, n: x.dump(io.BytesIO()), HOST),
    Row("x.dumps()", f"{CORE}:dumps", lambda x, y, i, z, n: x.dumps(), HOST),
]


def _operands() -> tuple[Any, ...]:
    x = np.arange(1.0, 7.0).reshape(2, 3)
    y = np.array([[2.0, 0.5, 3.0], [1.0, 4.0, 0.25]])
    i = np.array([1, 0])
    z = np.ones((2, 3))
    n = np.array([7.0, 8.0, 9.0])
    return x, y, i, z, n


def _on_device(x: Any, y: Any, i: Any, z: Any, n: Any) -> tuple[Any, ...]:
    placed = to_device(x, "host:1"), to_device(y, "host:1"), to_device(i, "host:1")
    return (*placed, to_device(z, "host:2"), n)


def _value(value: Any) -> Any:
    """Arrays (either kind) and NumPy scalars by dtype, shape and bytes; others as they are."""
    if isinstance(value, HostArray):
        value = value.get()
    if isinstance(value, np.ndarray | np.generic):
        array = np.asarray(value)
        return (array.dtype.str, array.shape, np.ascontiguousarray(array).tobytes())
    return value


def _leaves(tree: Any) -> list[Any]:
    return optree.tree_leaves(tree, none_is_leaf=True)


_NUMPY_EQUIVALENT = {  # rows whose NumPy spelling differs
    "x.get()": lambda x, y, i, z, n: x.copy(),
    "x.get(order='F')": lambda x, y, i, z, n: np.asfortranarray(x),
    "x.set(numpy)": lambda x, y, i, z, n: x[0].__setitem__(Ellipsis, n),
    "x.sum(out=0-d device)": lambda x, y, i, z, n: x.sum(out=y[0, 0, ...]),  # NumPy: y[0, 0] copies
}
_RESULT_NOT_COMPARED = frozenset({"x.dumps()"})  # a HostArray pickles as one, not as an ndarray


def test_the_table_has_at_least_100_rows() -> None:
    assert len(ROWS) >= 100
    assert len({row.name for row in ROWS}) == len(ROWS)


@pytest.mark.parametrize("row", ROWS, ids=[f"{r.name} <{r.source}>" for r in ROWS])
def test_host_arrays_do_what_cupy_arrays_do(row: Row) -> None:
    cp.set_host_device_count(3)
    plain = _operands()
    on_device = _on_device(*plain)
    before = [_value(a) for a in on_device]
    if isinstance(row.outcome, type):
        with pytest.raises(row.outcome):
            row.op(*on_device)
        assert [_value(a) for a in on_device] == before  # refused before writing anything
        return
    result = row.op(*on_device)
    if row.outcome == DEVICE:
        for leaf in [*_leaves(result), *on_device[:3]]:
            if leaf is not None:
                assert isinstance(leaf, HostArray), f"{row.name} gave a {type(leaf).__name__}"
                assert leaf.device == cp.Device("host", 1)
    else:
        assert not any(isinstance(leaf, HostArray) for leaf in _leaves(result))
    expected = _NUMPY_EQUIVALENT.get(row.name, row.op)(*plain)  # the oracle: plain NumPy
    if row.name not in _RESULT_NOT_COMPARED:
        assert [_value(v) for v in _leaves(result)] == [_value(v) for v in _leaves(expected)]
    assert [_value(a) for a in on_device] == [_value(a) for a in plain]  # same writes
