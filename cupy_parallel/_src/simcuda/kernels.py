"""The simulated ``cupy.ElementwiseKernel``: straight-line CUDA C bodies run by NumPy, one kernel.

CuPy compiles an elementwise kernel's C body and runs it once per element. The simulation runs
the same body on whole arrays with NumPy (exact, since an elementwise body reads and writes only
its own element), as one kernel on the current stream of the current device (:func:`.launch`):
its array operands must live there, the race checker sees the inputs read and the outputs
written.

What a body may hold, which is what optimizers and pointwise updates need: statements
``TYPE name = expr;``, ``name = expr;`` and ``name op= expr;`` (no ``if``/``for``/braces), and
expressions of names, number literals, ``+ - * /``, unary ``- + !``, comparisons, ``&& ||``,
``c ? a : b``, parentheses and the calls in :data:`FUNCTIONS`. Anything else is a
``NotImplementedError`` naming it, never a different computation. C's arithmetic is kept: a
declared variable or an output takes its type; an integer literal adapts to the other operand
(``2 * x`` stays float32), a double literal promotes (``0.5 * x`` is double, ``0.5f * x``
float); scalars passed for a type placeholder are cast to it. Params: ``"T x, float64 y"``
(``raw`` params, ``_ind``/``i`` and the ``size`` argument are refused).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import numpy as np

from cupy_parallel._src.simcuda.ndarray import launch, ndarray

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["FUNCTIONS", "ElementwiseKernel"]

FUNCTIONS: dict[str, Callable[..., Any]] = {
    "sqrt": np.sqrt,
    "exp": np.exp,
    "log": np.log,
    "abs": np.abs,
    "fabs": np.abs,
    "isnan": np.isnan,
    "isinf": np.isinf,
    "isfinite": np.isfinite,
    "max": np.fmax,  # CUDA's max/fmax return the other operand for a NaN
    "min": np.fmin,
    "fmax": np.fmax,
    "fmin": np.fmin,
    "pow": np.power,
}
"""The math functions a simulated body may call (CUDA's, computed in the operands' type)."""

_TYPES = {
    "bool": np.bool_,
    "int8": np.int8,
    "int16": np.int16,
    "int32": np.int32,
    "int64": np.int64,
    "uint8": np.uint8,
    "uint16": np.uint16,
    "uint32": np.uint32,
    "uint64": np.uint64,
    "float16": np.float16,
    "float32": np.float32,
    "float64": np.float64,
    "float": np.float32,
    "double": np.float64,
    "int": np.int32,
}

_TOKEN = re.compile(
    r"\s*(?:(?P<number>(?:\d+\.\d*|\.\d+|\d+)(?:[eE][+-]?\d+)?[fF]?)"
    r"|(?P<name>[A-Za-z_]\w*)"
    r"|(?P<op>\|\||&&|==|!=|<=|>=|\+=|-=|\*=|/=|[-+*/<>=!?:(),;]))"
)

_BINARY: dict[str, tuple[int, Callable[[Any, Any], Any]]] = {
    "||": (1, np.logical_or),
    "&&": (2, np.logical_and),
    "==": (3, np.equal),
    "!=": (3, np.not_equal),
    "<": (4, np.less),
    ">": (4, np.greater),
    "<=": (4, np.less_equal),
    ">=": (4, np.greater_equal),
    "+": (5, np.add),
    "-": (5, np.subtract),
    "*": (6, np.multiply),
    "/": (6, np.divide),
}


def _tokens(text: str, name: str) -> list[str]:
    out: list[str] = []
    position = 0
    text = text.rstrip()
    while position < len(text):
        match = _TOKEN.match(text, position)
        if match is None or match.end() == position:
            raise NotImplementedError(
                f"ElementwiseKernel {name!r} (simulated): cannot read {text[position:][:30]!r}; "
                "the simulation runs straight-line bodies of names, literals, arithmetic, "
                "comparisons, ?:, && || ! and calls of " + ", ".join(sorted(FUNCTIONS)) + "."
            )
        out.append(match.group(match.lastgroup or "op"))
        position = match.end()
    return out


class _Parser:
    """A precedence-climbing parser of one expression, into a function of the variables."""

    def __init__(self, tokens: list[str], kernel: str) -> None:
        self.tokens, self.at, self.kernel = tokens, 0, kernel

    def _peek(self) -> str | None:
        return self.tokens[self.at] if self.at < len(self.tokens) else None

    def _take(self, expected: str | None = None) -> str:
        token = self._peek()
        if token is None or (expected is not None and token != expected):
            raise NotImplementedError(
                f"ElementwiseKernel {self.kernel!r} (simulated): expected "
                f"{expected or 'more'} in {' '.join(self.tokens)!r}, got {token!r}."
            )
        self.at += 1
        return token

    def expression(self) -> Callable[[dict[str, Any]], Any]:
        condition = self._binary(1)
        if self._peek() != "?":
            return condition
        self._take("?")
        if_true = self.expression()
        self._take(":")
        if_false = self.expression()
        return lambda v: np.where(condition(v), if_true(v), if_false(v))

    def _binary(self, lowest: int) -> Callable[[dict[str, Any]], Any]:
        left = self._unary()
        while (token := self._peek()) in _BINARY and _BINARY[token][0] >= lowest:
            precedence, ufunc = _BINARY[self._take()]
            right = self._binary(precedence + 1)
            left = _binary_node(ufunc, left, right)
        return left

    def _unary(self) -> Callable[[dict[str, Any]], Any]:
        token = self._peek()
        if token in ("-", "+", "!"):
            self._take()
            operand = self._unary()
            ufunc = {"-": np.negative, "+": np.positive, "!": np.logical_not}[token]
            return lambda v: ufunc(operand(v))
        return self._primary()

    def _primary(self) -> Callable[[dict[str, Any]], Any]:
        token = self._take()
        if token == "(":  # noqa: S105 - a token, not a password
            inner = self.expression()
            self._take(")")
            return inner
        if token[0].isdigit() or token[0] == ".":
            value = _literal(token)
            return lambda v: value
        if not (token[0].isalpha() or token[0] == "_"):
            self.at -= 1
            self._take("an operand")
        if self._peek() == "(":
            if token not in FUNCTIONS:
                raise NotImplementedError(
                    f"ElementwiseKernel {self.kernel!r} (simulated): no function {token!r}; "
                    f"the simulation has {sorted(FUNCTIONS)}."
                )
            self._take("(")
            args = [self.expression()]
            while self._peek() == ",":
                self._take(",")
                args.append(self.expression())
            self._take(")")
            fn = FUNCTIONS[token]
            return lambda v: fn(*[a(v) for a in args])
        name = token

        def read(v: dict[str, Any]) -> Any:
            if name not in v:
                raise NotImplementedError(
                    f"ElementwiseKernel {self.kernel!r} (simulated): {name!r} is neither a "
                    "param nor a variable declared before it is read."
                )
            return v[name]

        return read


def _binary_node(
    ufunc: Callable[[Any, Any], Any],
    left: Callable[[dict[str, Any]], Any],
    right: Callable[[dict[str, Any]], Any],
) -> Callable[[dict[str, Any]], Any]:
    return lambda v: ufunc(left(v), right(v))


def _literal(token: str) -> Any:
    if token[-1] in "fF":
        return np.float32(token[:-1])
    if any(c in token for c in ".eE"):
        return np.float64(token)  # a double: it promotes float operands, as in C
    return int(token)  # an int adapts to the other operand's type, as in C


def _params(text: str, kernel: str) -> list[tuple[str, str]]:
    params = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        words = part.split()
        if len(words) != 2 or words[0] == "raw":
            raise NotImplementedError(
                f"ElementwiseKernel {kernel!r} (simulated): the param {part!r} is not "
                "'TYPE name' (raw params are not simulated)."
            )
        params.append((words[0], words[1]))
    return params


class ElementwiseKernel:
    """A simulated ``cupy.ElementwiseKernel`` (see the module docstring for the body it runs).

    Example:
        >>> import numpy as np
        >>> from cupy_parallel.testing import simulated_cuda
        >>> import cupy_parallel as cp
        >>> with simulated_cuda(1):
        ...     cupy = cp.Device("cuda", 0).xp
        ...     axpy = cupy.ElementwiseKernel("T x, T a", "T y", "y = y + a * x;", "axpy")
        ...     y = cupy.ones(3, np.float32)
        ...     _ = axpy(cupy.arange(3, dtype=np.float32), 2.0, y)
        ...     y.get()
        array([1., 3., 5.], dtype=float32)
    """

    def __init__(  # noqa: PLR0917 - CuPy's signature
        self,
        in_params: str,
        out_params: str,
        operation: str,
        name: str = "kernel",
        reduce_dims: bool = True,
        preamble: str = "",
        no_return: bool = False,
        return_tuple: bool = False,
        **kwargs: Any,
    ) -> None:
        if preamble or kwargs.get("loop_prep") or kwargs.get("after_loop"):
            raise NotImplementedError(
                f"ElementwiseKernel {name!r} (simulated): preamble, loop_prep and after_loop "
                "code is not simulated."
            )
        self.name = name
        self.reduce_dims, self.no_return, self.return_tuple = reduce_dims, no_return, return_tuple
        self.in_params = _params(in_params, name)
        self.out_params = _params(out_params, name)
        if any(c in operation for c in "{}#") or re.search(r"\b(if|for|while)\b", operation):
            raise NotImplementedError(
                f"ElementwiseKernel {name!r} (simulated): control flow (if/for/while, braces, "
                "#directives) is not simulated; write the body as straight-line statements."
            )
        placeholders = {t for t, _ in self.in_params + self.out_params if t not in _TYPES}
        kinds = {n: t for t, n in self.in_params + self.out_params}
        inputs = {n for _, n in self.in_params}
        self._statements: list[tuple[str, str, str, Callable[[dict[str, Any]], Any]]] = []
        for statement in filter(None, (s.strip() for s in operation.split(";"))):
            tokens = _tokens(statement, name)
            if tokens[0] == "const":
                tokens = tokens[1:]
            if tokens[0] in _TYPES or tokens[0] in placeholders:
                kinds[tokens[1]] = tokens[0]
                tokens = tokens[1:]
            elif tokens[0] in inputs:
                raise NotImplementedError(
                    f"ElementwiseKernel {name!r}: {tokens[0]!r} is an input param (const in "
                    "CuPy's kernel); write to an output param."
                )
            if len(tokens) < 3 or tokens[1] not in ("=", "+=", "-=", "*=", "/="):
                raise NotImplementedError(
                    f"ElementwiseKernel {name!r} (simulated): {statement!r} is not "
                    "'TYPE name = expr', 'name = expr' or 'name op= expr'."
                )
            if tokens[0] not in kinds:
                raise NotImplementedError(
                    f"ElementwiseKernel {name!r} (simulated): {tokens[0]!r} is assigned but "
                    "neither a param nor declared ('TYPE name = ...')."
                )
            parser = _Parser(tokens[2:], name)
            expression = parser.expression()
            if parser.at != len(parser.tokens):
                parser._take("the end of the statement")
            self._statements.append((kinds[tokens[0]], tokens[0], tokens[1], expression))

    def __call__(self, *args: Any, size: Any = None, **kwargs: Any) -> Any:
        params = self.in_params + self.out_params
        if size is not None or kwargs or len(args) != len(params):
            raise NotImplementedError(
                f"ElementwiseKernel {self.name!r} (simulated): pass every in and out param "
                f"by position ({len(params)}: {[n for _, n in params]}), got {len(args)} "
                "(and no size or keywords)."
            )
        types: dict[str, np.dtype[Any]] = {}
        for (kind, pname), arg in zip(params, args, strict=True):
            if isinstance(arg, np.ndarray):
                raise TypeError(f"Unsupported type {type(arg)} for param {pname!r} (a NumPy array)")
            if (
                isinstance(arg, ndarray)
                and kind not in _TYPES
                and types.setdefault(kind, arg.dtype) != arg.dtype
            ):
                raise TypeError(
                    f"Type is mismatched: {pname!r} has {arg.dtype}, {kind} is {types[kind]}."
                )
        for (kind, _), arg in zip(params, args, strict=True):
            if not isinstance(arg, ndarray) and kind not in _TYPES and kind not in types:
                types[kind] = np.asarray(arg).dtype

        def dtype_of(kind: str) -> np.dtype[Any]:
            return np.dtype(_TYPES[kind]) if kind in _TYPES else types[kind]

        arrays = [a for a in args if isinstance(a, ndarray)]
        shape = np.broadcast_shapes(*[a.shape for a in arrays])
        outs = args[len(self.in_params) :]
        for (_, pname), out in zip(self.out_params, outs, strict=True):
            if not isinstance(out, ndarray) or out.shape != shape:
                raise ValueError(
                    f"ElementwiseKernel {self.name!r}: the output {pname!r} must be an array of "
                    f"the broadcast shape {shape}."
                )

        def compute() -> None:
            values: dict[str, Any] = {}
            for (kind, pname), arg in zip(params, args, strict=True):
                host = arg._layout_probe() if isinstance(arg, ndarray) else arg
                values[pname] = np.array(host, dtype=dtype_of(kind))  # a copy, read first
            for kind, target, operator, expression in self._statements:
                value = expression(values)
                if operator != "=":
                    value = _BINARY[operator[0]][1](values[target], value)
                values[target] = np.asarray(value).astype(dtype_of(kind))
            for (kind, pname), out in zip(self.out_params, outs, strict=True):
                out._layout_probe()[...] = np.broadcast_to(values[pname], shape).astype(
                    dtype_of(kind)
                )

        with np.errstate(all="ignore"):  # a GPU computes NaN and inf silently
            launch(f"ElementwiseKernel {self.name}", arrays, list(outs), compute)
        if self.no_return:
            return None
        return outs[0] if len(outs) == 1 and not self.return_tuple else tuple(outs)
