"""NumPy's dispatch for the host array: ``__array_ufunc__`` and ``__array_function__`` in general.

The host array's hot paths (operators, a ufunc called on one or two operands, the computing
methods) live with :class:`~cupy_parallel._src.hostarray.HostArray`; every other ufunc call
(methods such as ``reduce`` and ``at``, keywords, ``out=``) comes to :func:`apply_ufunc`, and
every NumPy function to :func:`apply_function`. Each follows CuPy's rules, table by table: which
ufuncs, ufunc methods, functions and keywords CuPy has (CuPy 14.2, NumPy 2.4), which parameters
of CuPy's functions upload host data, which functions write into an argument (their version
counters count it). :mod:`cupy_parallel._src.arrays` installs both into the host array
(:func:`~cupy_parallel._src.hostarray.set_numpy_dispatch`) when the package is imported.

Example:
    >>> import numpy as np
    >>> from cupy_parallel._src.arrays import to_device
    >>> np.add.reduce(to_device(np.arange(4.0), "host:0"))
    HostArray(6., device='host:0')
"""

from __future__ import annotations

import functools
import inspect
from collections import UserList
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import optree

from cupy_parallel._src.devices import is_cupy_array
from cupy_parallel._src.dtypes import SCALAR_TYPES, check_device_dtype
from cupy_parallel._src.hostarray import (
    UFUNCS_CUPY_LACKS,
    HostArray,
    check_guard,
    host_array,
    host_buffer,
    read_method_argument,
    read_out,
    wrap_result,
)
from cupy_parallel._src.hosterrors import cross_device, foreign
from cupy_parallel._src.versions import count_write

if TYPE_CHECKING:
    from collections.abc import Mapping

    from cupy_parallel._src.devices import Device

__all__ = ["apply_function", "apply_ufunc"]

# --------------------------------------------------------------------------------------------
# ufuncs (CuPy: ``core.pyx`` ``__array_ufunc__`` and ``_kernel.pyx`` ``ufunc.__call__``)

_UFUNC_KEYWORDS = {
    "__call__": frozenset({"out", "dtype", "casting"}),
    "outer": frozenset({"out", "dtype", "casting"}),
    "reduce": frozenset({"axis", "dtype", "out", "keepdims"}),
    "accumulate": frozenset({"axis", "dtype", "out"}),
    "reduceat": frozenset({"axis", "dtype", "out"}),
    "at": frozenset(),
}
_UFUNC_METHODS_CUPY_HAS: dict[str, frozenset[str] | None] = {
    "__call__": None,  # every ufunc CuPy has
    "outer": None,
    "reduce": frozenset({"add", "multiply"}),
    "accumulate": frozenset({"add", "multiply"}),
    "reduceat": frozenset({"add"}),
    "at": frozenset(
        {"add", "subtract", "maximum", "minimum", "bitwise_and", "bitwise_or", "bitwise_xor"}
    ),
}
_COMPARISONS = frozenset(
    {np.equal, np.not_equal, np.less, np.less_equal, np.greater, np.greater_equal}
)


def _operand(x: Any, device: Device, operation: str) -> Any:
    """The NumPy value computing for operand ``x`` of an elementwise operation on ``device``."""
    if type(x) is HostArray:
        if x.device is not device and x.device != device:
            raise cross_device(operation, device, x.device)
        return host_buffer(x)
    if type(x) in SCALAR_TYPES:
        return x
    raise foreign(operation, device, x)


def apply_ufunc(
    device: Device, ufunc: np.ufunc, method: str, inputs: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    name = ufunc.__name__
    operation = f"numpy.{name}" if method == "__call__" else f"numpy.{name}.{method}"
    if name in UFUNCS_CUPY_LACKS:
        raise TypeError(
            f"{operation} is not available for device arrays (CuPy has no cupy.{name})."
        )
    supported = _UFUNC_METHODS_CUPY_HAS.get(method, frozenset())
    if supported is not None and name not in supported:
        raise NotImplementedError(
            f"{operation} is not supported for device arrays (CuPy: '{name}.{method} is not "
            "supported yet')."
        )
    unknown = set(kwargs) - _UFUNC_KEYWORDS[method]
    if unknown:
        raise TypeError(
            f"{operation}: Wrong arguments {sorted(unknown)} (CuPy's ufuncs take "
            f"{sorted(_UFUNC_KEYWORDS[method])} only)."
        )
    out = kwargs.get("out")
    outs: tuple[Any, ...] = ()
    if out is not None:
        outs = out if isinstance(out, tuple) else (out,)
        if len(outs) != 1:
            raise ValueError(f"{operation}: The 'out' parameter must have exactly one array value.")
        kwargs["out"] = tuple(read_out(o, device, operation) for o in outs)
    if "dtype" in kwargs and kwargs["dtype"] is not None:
        check_device_dtype(kwargs["dtype"], f"{operation}'s dtype")
    if method == "at":
        a, indices, *rest = inputs
        read: list[Any] = [
            read_out(a, device, operation),
            read_method_argument(indices, device, operation, host_data=True),
            *(_operand(b, device, operation) for b in rest),
        ]
    elif ufunc in _COMPARISONS:
        read = [
            _operand(
                x.item() if isinstance(x, np.ndarray) and x.ndim == 0 else x, device, operation
            )
            for x in inputs
        ]
    else:
        read = [_operand(x, device, operation) for x in inputs]
    check_guard(operation, (*inputs, *outs))
    result = getattr(ufunc, method)(*read, **kwargs)
    if method == "at":
        count_write(read[0])
        return None
    if outs:
        count_write(kwargs["out"][0])
        return outs[0] if ufunc.nout == 1 or method != "__call__" else outs
    return wrap_result(result, device)


# --------------------------------------------------------------------------------------------
# NumPy functions (CuPy: ``core.pyx`` ``__array_function__`` calls the ``cupy`` function)

_CREATION_FUNCTIONS: frozenset[Any] = frozenset(
    {
        np.array,
        np.asarray,
        np.asanyarray,
        np.ascontiguousarray,
        np.asfortranarray,
        np.require,
        np.arange,
        np.empty,
        np.zeros,
        np.ones,
        np.full,
        np.eye,
        np.identity,
        np.tri,
        np.frombuffer,
        np.fromfile,
        np.fromfunction,
        np.fromiter,
        np.fromstring,
        np.loadtxt,
        np.genfromtxt,
    }
)
"""Functions that dispatch here only through ``like=`` (NEP 35): host data is uploaded."""

_WRITTEN_ARGUMENTS: dict[Any, str] = {
    np.copyto: "dst",
    np.put: "a",
    np.place: "arr",
    np.putmask: "a",
    np.fill_diagonal: "a",
    np.put_along_axis: "arr",
}
"""Functions writing into an argument other than ``out`` (their version counters count it)."""


@functools.cache
def _written_positions(func: Any) -> tuple[tuple[int | None, str], ...]:
    """(position, name) of the arguments ``func`` writes into: ``out`` and the table above.

    The position is ``None`` for a keyword-only parameter (``einsum(*operands, out=None)``).
    """
    names = {"out", _WRITTEN_ARGUMENTS.get(func, "out")}
    try:
        parameters = list(inspect.signature(func).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: out= by keyword only
        return ((None, "out"),)
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return tuple(
        (i if p.kind in positional else None, p.name)
        for i, p in enumerate(parameters)
        if p.name in names
    )


_FUNCTIONS_CUPY_LACKS = frozenset(
    {
        "numpy.block",
        "numpy.busday_count",
        "numpy.busday_offset",
        "numpy.datetime_as_string",
        "numpy.einsum_path",
        "numpy.geomspace",
        "numpy.histogram_bin_edges",
        "numpy.insert",
        "numpy.is_busday",
        "numpy.linalg.diagonal",
        "numpy.linalg.matrix_norm",
        "numpy.linalg.multi_dot",
        "numpy.linalg.outer",
        "numpy.linalg.svdvals",
        "numpy.linalg.tensordot",
        "numpy.linalg.trace",
        "numpy.linalg.vecdot",
        "numpy.linalg.vector_norm",
        "numpy.nanpercentile",
        "numpy.nanquantile",
        "numpy.polyder",
        "numpy.polydiv",
        "numpy.polyint",
        "numpy.unstack",
    }
)
"""NumPy functions with no CuPy counterpart (CuPy 14.2, NumPy 2.4): on a GPU array,
``cupy.ndarray.__array_function__`` returns ``NotImplemented`` and NumPy raises ``TypeError``."""


_KEYWORDS_CUPY_LACKS: dict[str, frozenset[str]] = {
    name: frozenset(keywords.split())
    for name, keywords in {
        "numpy.all": "where",
        "numpy.amax": "initial where",
        "numpy.amin": "initial where",
        "numpy.any": "where",
        "numpy.argpartition": "kind order",
        "numpy.argsort": "order stable",
        "numpy.astype": "device",
        "numpy.broadcast_arrays": "subok",
        "numpy.broadcast_to": "subok",
        "numpy.clip": "min max",
        "numpy.copy": "subok",
        "numpy.count_nonzero": "keepdims",
        "numpy.isin": "kind",
        "numpy.lexsort": "axis",
        "numpy.linalg.cholesky": "upper",
        "numpy.linalg.matrix_rank": "hermitian rtol",
        "numpy.linalg.pinv": "hermitian rtol",
        "numpy.linalg.svd": "hermitian",
        "numpy.max": "initial where",
        "numpy.mean": "where",
        "numpy.min": "initial where",
        "numpy.nanmax": "initial where",
        "numpy.nanmean": "where",
        "numpy.nanmin": "initial where",
        "numpy.nanprod": "initial where",
        "numpy.nanstd": "correction mean where",
        "numpy.nansum": "initial where",
        "numpy.nanvar": "correction mean where",
        "numpy.partition": "kind order",
        "numpy.percentile": "weights",
        "numpy.prod": "initial where",
        "numpy.quantile": "weights",
        "numpy.reshape": "shape",
        "numpy.sort": "order stable",
        "numpy.std": "correction mean where",
        "numpy.sum": "initial where",
        "numpy.take": "mode",
        "numpy.trim_zeros": "axis",
        "numpy.unique": "sorted",
        "numpy.unpackbits": "count",
        "numpy.var": "correction mean where",
        **{
            f"numpy.fft.{transform}": "out"
            for transform in ("fft", "fft2", "fftn", "hfft", "ifft", "ifft2", "ifftn", "ihfft")
        },
        **{
            f"numpy.fft.{transform}": "out"
            for transform in ("irfft", "irfft2", "irfftn", "rfft", "rfft2", "rfftn")
        },
    }.items()
}
"""Keywords NumPy's function takes and CuPy's counterpart does not (CuPy 14.2, NumPy 2.4): CuPy
raises ``TypeError`` (an unexpected keyword argument), so a host array does too."""

_HOST_DATA_PARAMETERS: dict[str, frozenset[str]] = {
    name: frozenset(parameters.split())
    for name, parameters in {
        "numpy.append": "arr values",
        "numpy.around": "a",
        "numpy.average": "a",
        "numpy.cov": "y",
        "numpy.cross": "a b",
        "numpy.diag": "v",
        "numpy.diff": "a prepend append",
        "numpy.einsum": "operands",
        "numpy.extract": "condition",
        "numpy.gradient": "f",
        "numpy.histogramdd": "weights",
        "numpy.imag": "val",
        "numpy.isclose": "a b",
        "numpy.linspace": "start stop",
        "numpy.place": "mask vals",
        "numpy.polyval": "x",
        "numpy.real": "val",
        "numpy.resize": "a",
        "numpy.tril": "m",
        "numpy.triu": "m",
        "numpy.unwrap": "p",
        "numpy.vander": "x",
        "numpy.linalg.cond": "x",
        "numpy.fft.fftshift": "x",
        "numpy.fft.ifftshift": "x",
    }.items()
}
"""Parameters whose CuPy implementation uploads host data (``x = cupy.asarray(x)``, CuPy 14.2):
NumPy arrays passed there are accepted and copied to the device, as CuPy copies them."""


@functools.cache
def _signature(func: Any) -> inspect.Signature:
    return inspect.signature(func)


def _upload_host_data(
    device: Device, name: str, func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments with NumPy arrays in host-data parameters copied to ``device``."""
    bound = _signature(func).bind(*args, **kwargs)
    for parameter in _HOST_DATA_PARAMETERS[name]:
        if parameter not in bound.arguments:
            continue
        value = bound.arguments[parameter]
        if _signature(func).parameters[parameter].kind is inspect.Parameter.VAR_POSITIONAL:
            bound.arguments[parameter] = tuple(
                host_array(v.copy(), device) if type(v) is np.ndarray else v for v in value
            )
        elif type(value) is np.ndarray:
            bound.arguments[parameter] = host_array(value.copy(), device)
    return bound.args, bound.kwargs


def _copyto_source(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[Any, ...]:
    """CuPy's ``copyto`` takes a NumPy source of one element as a scalar, refuses larger ones."""
    if len(args) >= 2 and type(args[1]) is np.ndarray:
        if args[1].size != 1:
            raise ValueError(
                "non-scalar numpy.ndarray cannot be used for copyto (as in CuPy); move it with "
                "cupy_parallel.to_device first."
            )
        return (args[0], args[1].reshape(())[()], *args[2:])
    return args


def apply_function(
    device: Device, func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> Any:
    operation = f"numpy.{func.__name__}"
    qualified = f"{func.__module__}.{func.__name__}"
    unknown = set(kwargs) & _KEYWORDS_CUPY_LACKS.get(qualified, frozenset())
    if unknown:
        raise TypeError(
            f"{qualified}() got keyword arguments CuPy's {qualified.replace('numpy', 'cupy', 1)} "
            f"does not take: {sorted(unknown)}."
        )
    if qualified in _HOST_DATA_PARAMETERS:
        args, kwargs = _upload_host_data(device, qualified, func, args, kwargs)
    elif func is np.copyto:
        args = _copyto_source(args, kwargs)
    if qualified in _FUNCTIONS_CUPY_LACKS:
        raise TypeError(
            f"no implementation found for '{func.__module__}.{func.__name__}' on device arrays "
            f"(CuPy has no {func.__module__.replace('numpy', 'cupy', 1)}.{func.__name__})."
        )
    creation = func in _CREATION_FUNCTIONS
    leaves: list[Any]
    leaves, spec = optree.tree_flatten(cast("Any", (args, dict(kwargs))), none_is_leaf=True)
    read = [_function_leaf(x, device, operation, creation) for x in leaves]
    read_args, read_kwargs = optree.tree_unflatten(spec, read)
    written = [
        read_kwargs[name] if name in read_kwargs else read_args[i]
        for i, name in _written_positions(func)
        if name in read_kwargs or (i is not None and i < len(read_args))
    ]
    if isinstance(read_kwargs.get("out"), tuple):
        written.extend(read_kwargs["out"])
    if func is np.nan_to_num and (read_args[1:2] or [read_kwargs.get("copy", True)])[0] is False:
        written.append(read_args[0])  # nan_to_num(x, copy=False) writes into x
    if not creation:
        check_guard(operation, tuple(leaves))  # the arguments flattened (a list of arrays opened)
    result = func(*read_args, **read_kwargs)
    for buffer in written:
        if isinstance(buffer, np.ndarray):
            count_write(buffer)
    if "out" in kwargs and kwargs["out"] is not None and result is read_kwargs["out"]:
        return kwargs["out"]
    return wrap_result(result, device)


def _function_leaf(x: Any, device: Device, operation: str, creation: bool) -> Any:
    if type(x) is HostArray:
        if x.device is not device and x.device != device:
            raise cross_device(operation, device, x.device)
        return host_buffer(x)
    if isinstance(x, np.ndarray):
        if creation:
            return x
        raise foreign(operation, device, x)
    if is_cupy_array(x):
        raise foreign(operation, device, x)
    if isinstance(x, list | tuple | UserList):  # a subclass or UserList: optree left it whole
        return [_function_leaf(v, device, operation, creation) for v in x]
    return x
