"""The host array: an array on a simulated accelerator ``"host:k"`` that behaves like a GPU array.

A :class:`HostArray` holds a NumPy buffer the way a ``cupy.ndarray`` holds device memory, and
enforces CuPy's rules at every boundary, so that code which keeps its placement right on host
devices keeps it right on GPUs:

* no implicit conversion: ``numpy.asarray(h)``, ``memoryview(h)``, ``numpy_array[...] = h`` raise
  ``TypeError``; ``h.get()`` and ``to_device(h, "cpu")`` are the exits;
* operands: arrays of the same host device and Python/NumPy scalars; a plain NumPy array, a
  list or a CuPy array is refused with ``TypeError``, an array of another device with
  ``ValueError`` (CuPy's peer-access error);
* results stay on the device: ``h[0]`` is a 0-d array, reductions, ``nonzero``, ``divmod`` give
  device arrays;
* dtypes CuPy lacks (object, strings, datetime, structured, ``longdouble``) are refused.

Each rule names the place in CuPy's sources it comes from (``cupy/_core/core.pyx`` and friends);
the conformance table in ``tests/test_hostarray_conformance.py`` checks them one by one.

Library internals reach the buffer with :func:`host_buffer` and wrap one with :func:`host_array`
(no copy, no checks); :func:`version` counts in-place writes; :func:`set_dispatch_guard` lets the
tape refuse raw NumPy on arrays it tracks.

This module holds the class, its attributes and its hot paths (operators, one- and two-operand
ufunc calls, the computing methods, indexing). The rest of NumPy's dispatch (ufunc methods and
keywords, NumPy functions) is :mod:`cupy_parallel._src.hostdispatch`, the error messages are
:mod:`cupy_parallel._src.hosterrors`, the dtypes CuPy has :mod:`cupy_parallel._src.dtypes`, the
write counters :mod:`cupy_parallel._src.versions`, and ``HostArray.to_device`` is
:func:`cupy_parallel._src.arrays.to_device`; ``arrays``, the layer above, installs those two
here (:func:`set_numpy_dispatch`, :func:`set_mover`) when the package is imported.
"""

from __future__ import annotations

import functools
import gc
import pickle
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import optree

from cupy_parallel._src.devices import (
    Device,
    as_device,
    check_exists,
    is_cupy_array,
    set_host_array_census,
)
from cupy_parallel._src.dtypes import DEVICE_DTYPE_CHARS, SCALAR_TYPES, check_device_dtype
from cupy_parallel._src.hosterrors import (
    EXITS,
    cross_device,
    foreign,
    implicit_conversion,
    out_error,
)
from cupy_parallel._src.tree import add_array_type
from cupy_parallel._src.versions import count_write, writes

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator, Mapping
    from types import ModuleType

    from numpy.typing import NDArray

    from cupy_parallel._src.arraytypes import CupyArray
    from cupy_parallel._src.devices import DeviceLike

__all__ = [
    "UFUNCS_CUPY_LACKS",
    "HostArray",
    "check_guard",
    "host_array",
    "host_buffer",
    "host_ufunc",
    "host_unary",
    "plain_buffer",
    "read_method_argument",
    "read_out",
    "set_dispatch_guard",
    "set_mover",
    "set_numpy_dispatch",
    "version",
    "wrap_result",
]

# --------------------------------------------------------------------------------------------
# The dispatch guard and the version counter

_guard: Callable[[str, tuple[Any, ...]], None] | None = None


def set_dispatch_guard(guard: Callable[[str, tuple[Any, ...]], None] | None, /) -> None:
    """Install ``guard(operation, operands)``, called before every raw NumPy computation.

    ``operation`` names the entry (``"numpy.add"``, ``"operator +"``, ``"HostArray.sum"``,
    ``"operator []="``); ``operands`` are the call's operands (for NumPy functions, the arguments
    flattened, so ``np.concatenate([a, b])`` passes ``a`` and ``b``). If the guard raises, nothing
    is computed or written.
    Indexing reads, views and metadata (shape, dtype, device) do not call it, nor do
    :func:`host_buffer` and :func:`host_array`. ``None`` removes the guard. There is one
    guard per process (the tape installs it).

    Example:
        >>> import cupy_parallel
        >>> import numpy as np
        >>> from cupy_parallel._src.arrays import to_device
        >>> seen = []
        >>> set_dispatch_guard(lambda operation, operands: seen.append(operation))
        >>> _ = to_device(np.ones(2), "host:0") + 1
        >>> set_dispatch_guard(None)
        >>> seen
        ['operator +']
    """
    global _guard
    if guard is not None and not callable(guard):
        raise TypeError(f"guard must be callable or None, got {type(guard).__name__}.")
    _guard = guard


def check_guard(operation: str, operands: tuple[Any, ...], /) -> None:
    """Call the dispatch guard, if one is installed (for the dispatch outside this module).

    Example:
        >>> check_guard("numpy.add", ())  # no guard installed: nothing happens
    """
    if _guard is not None:
        _guard(operation, operands)


def version(x: Any, /) -> int | None:
    """How many in-place writes have hit ``x``'s memory; ``None`` if ``x`` is no HostArray.

    Views of one buffer share one counter (torch's version counter): a write through any of
    them counts for all. Every in-place write through the HostArray API counts:
    ``__setitem__``, ``out=``, in-place operators, ``fill``, ``set``, ``sort``, ``put``,
    ``numpy.copyto`` and the other NumPy functions that write into an argument.

    Example:
        >>> import cupy_parallel
        >>> import numpy as np
        >>> from cupy_parallel._src.arrays import to_device
        >>> h = to_device(np.zeros(3), "host:0")
        >>> view = h[1:]
        >>> view += 1
        >>> version(h), version(view), version(np.zeros(1))
        (1, 1, None)
    """
    if type(x) is not HostArray:
        return None
    return writes(x._data)


# --------------------------------------------------------------------------------------------
# Reading operands


def read_out(x: Any, device: Device, operation: str) -> np.ndarray:
    """The buffer of ``out=`` argument ``x``: a host array on ``device``, else the error."""
    if type(x) is not HostArray:
        raise out_error(operation, device, x)
    if x._device != device:
        raise cross_device(operation, device, x._device)
    return x._data


_new = object.__new__
_NDARRAY = np.ndarray


def host_array(data: np.ndarray, device: Device, /) -> HostArray:
    """Wrap the NumPy buffer ``data`` as an array on ``device``: no copy, no checks.

    For library internals that made ``data`` themselves (copies, pool memory); users create
    host arrays with ``to_device`` or ``empty``.

    Example:
        >>> import numpy as np
        >>> host_array(np.arange(2), Device("host", 0))
        HostArray([0, 1], device='host:0')
    """
    h = _new(HostArray)
    h._data = data
    h._device = device
    return h


def host_buffer(x: HostArray, /) -> np.ndarray:
    """The NumPy buffer ``x`` holds: no copy, no checks (for library internals, never users).

    Example:
        >>> import numpy as np
        >>> buffer = np.arange(2)
        >>> host_buffer(host_array(buffer, Device("host", 0))) is buffer
        True
    """
    return x._data


def host_ufunc(ufunc: np.ufunc, a: Any, b: Any, /) -> HostArray | None:
    """``ufunc(a, b)`` on the buffers, on their device: no dispatch guard, no version counted.

    For library internals (the ops' hot path): one operand is a host array and the other a host
    array holding the same device object or a scalar CuPy takes. Anything else returns ``None``:
    the caller's own checks then say what is wrong (or take the slower path a device equal but
    not identical needs).

    Example:
        >>> import numpy as np
        >>> h = host_array(np.arange(2.0), Device("host", 0))
        >>> host_ufunc(np.add, h, 1.0), host_ufunc(np.add, h, np.ones(2))
        (HostArray([1., 2.], device='host:0'), None)
    """
    if type(a) is HostArray:
        device = a._device
        ra = a._data
        if type(b) is HostArray:
            if b._device is not device:
                return None
            rb = b._data
        elif type(b) in SCALAR_TYPES:
            rb = b
        else:
            return None
    elif type(b) is HostArray and type(a) in SCALAR_TYPES:
        device, ra, rb = b._device, a, b._data
    else:
        return None
    r = ufunc(ra, rb)
    h = _new(HostArray)
    h._data = r if type(r) is np.ndarray else np.asarray(r)
    h._device = device
    return h


def host_unary(ufunc: np.ufunc, x: HostArray, /) -> HostArray:
    """``ufunc(x)`` on the host array ``x``'s buffer, on its device (as :func:`host_ufunc`).

    Example:
        >>> import numpy as np
        >>> host_unary(np.negative, host_array(np.arange(2.0), Device("host", 0)))
        HostArray([-0., -1.], device='host:0')
    """
    r = ufunc(x._data)
    h = _new(HostArray)
    h._data = r if type(r) is np.ndarray else np.asarray(r)
    h._device = x._device
    return h


def plain_buffer(x: Any, /) -> Any:
    """``host_buffer(x)`` for a HostArray, anything else as it is (for library internals).

    Example:
        >>> import numpy as np
        >>> plain_buffer(host_array(np.arange(2), Device("host", 0)))
        array([0, 1])
    """
    return x._data if type(x) is HostArray else x


def wrap_result(result: Any, device: Device) -> Any:
    """A NumPy result as device arrays: arrays and NumPy scalars become arrays on ``device``."""
    if type(result) is np.ndarray:
        if result.dtype.char not in DEVICE_DTYPE_CHARS:
            check_device_dtype(result.dtype, "the result's dtype")
        return host_array(result, device)
    if isinstance(result, np.generic):
        return wrap_result(np.asarray(result), device)
    if isinstance(result, np.ndarray):  # a subclass (np.matrix, masked arrays): its data
        return wrap_result(result.view(np.ndarray), device)
    if isinstance(result, tuple | list):
        return optree.tree_map(functools.partial(wrap_result, device=device), cast("Any", result))
    return result


def _zero_d(value: Any) -> np.ndarray:
    return value if type(value) is np.ndarray else np.asarray(value)


# --------------------------------------------------------------------------------------------
# Python operators, implemented directly on the buffers (the hot path)

_PRIORITY = 100  # CuPy's ``__array_priority__``


def _other_operand(self: HostArray, other: Any, operation: str) -> Any:
    """CuPy's rule for a non-array, non-scalar right operand (``core.pyx``, ``_should_use_rop``)."""
    ufunc = getattr(type(other), "__array_ufunc__", _PRIORITY)
    if ufunc is None or (
        ufunc is _PRIORITY and getattr(other, "__array_priority__", 0) > _PRIORITY
    ):
        return NotImplemented
    raise foreign(operation, self._device, other)


def _binary(ufunc: np.ufunc, symbol: str) -> Callable[[HostArray, Any], HostArray]:
    operation = f"operator {symbol}"

    def method(self: HostArray, other: Any) -> Any:
        t = type(other)
        if t is HostArray:
            if other._device is not self._device and other._device != self._device:
                raise cross_device(operation, self._device, other._device)
            b = other._data
        elif t in SCALAR_TYPES:
            b = other
        else:
            return _other_operand(self, other, operation)
        if _guard is not None:
            _guard(operation, (self, other))
        r = ufunc(self._data, b)
        h = _new(HostArray)
        h._data = r if type(r) is np.ndarray else np.asarray(r)
        h._device = self._device
        return h

    method.__name__ = f"__{ufunc.__name__}__"
    return method


def _reflected(ufunc: np.ufunc, symbol: str) -> Callable[[HostArray, Any], HostArray]:
    operation = f"operator {symbol}"

    def method(self: HostArray, other: Any) -> Any:
        if type(other) not in SCALAR_TYPES:
            return _other_operand(self, other, operation)
        if _guard is not None:
            _guard(operation, (other, self))
        r = ufunc(other, self._data)
        h = _new(HostArray)
        h._data = r if type(r) is np.ndarray else np.asarray(r)
        h._device = self._device
        return h

    return method


def _inplace(ufunc: np.ufunc, symbol: str) -> Callable[[HostArray, Any], HostArray]:
    operation = f"operator {symbol}="

    def method(self: HostArray, other: Any) -> Any:
        if type(other) is HostArray:
            if other._device is not self._device and other._device != self._device:
                raise cross_device(operation, self._device, other._device)
            b = other._data
        elif type(other) in SCALAR_TYPES:
            b = other
        else:
            return _other_operand(self, other, operation)
        if _guard is not None:
            _guard(operation, (self, other))
        ufunc(self._data, b, out=self._data)
        count_write(self._data)
        return self

    return method


def _comparison(ufunc: np.ufunc, symbol: str) -> Callable[[HostArray, Any], HostArray]:
    """CuPy's ``__richcmp__``: a 0-d NumPy array compares as its item.

    ``==`` with an object that has no ``__eq__`` of its own (``None``, ...) is all False, ``!=``
    all True.
    """
    operation = f"operator {symbol}"
    fast = _binary(ufunc, symbol)

    def method(self: HostArray, other: Any) -> Any:
        if type(other) is HostArray or type(other) in SCALAR_TYPES:
            return fast(self, other)
        if isinstance(other, np.ndarray) and other.ndim == 0:
            return fast(self, other.item())
        if ufunc in (np.equal, np.not_equal) and (
            other is None or type(other).__eq__ is object.__eq__  # type: ignore[comparison-overlap]
        ):
            if _guard is not None:
                _guard(operation, (self, other))
            filler = np.zeros if ufunc is np.equal else np.ones
            return host_array(filler(self._data.shape, bool), self._device)
        return _other_operand(self, other, operation)

    return method


def _unary(ufunc: np.ufunc, symbol: str) -> Callable[[HostArray], HostArray]:
    operation = f"operator {symbol}"

    def method(self: HostArray) -> HostArray:
        if _guard is not None:
            _guard(operation, (self,))
        return host_array(_zero_d(ufunc(self._data)), self._device)

    return method


# --------------------------------------------------------------------------------------------
# Methods computing on the buffer

_VIEW_METHODS = frozenset(
    {"diagonal", "flatten", "ravel", "reshape", "squeeze", "swapaxes", "transpose"}
)
"""Shape methods: no dispatch guard (as indexing)."""

_HOST_DATA_ARGUMENTS = {"take": 0, "compress": 0, "repeat": 0}
"""Arguments CuPy converts from host data (``core.array(...)``): lists and NumPy arrays pass."""

_METHOD_KEYWORDS_CUPY_LACKS = frozenset({"where", "initial", "correction", "mean"})
"""Reduction keywords NumPy's ndarray methods take and ``cupy.ndarray``'s do not."""


def _computing_method(name: str, out_position: int | None) -> Callable[..., HostArray]:
    operation = f"HostArray.{name}"
    guarded = name not in _VIEW_METHODS
    host_data = _HOST_DATA_ARGUMENTS.get(name)

    def method(self: HostArray, *args: Any, **kwargs: Any) -> Any:
        device = self._device
        if not args and not kwargs:  # the hot path: x.sum(), x.copy(), x.ravel()
            if guarded and _guard is not None:
                _guard(operation, (self,))
            return wrap_result(getattr(self._data, name)(), device)
        out = kwargs.pop("out", None)
        if out_position is not None and len(args) > out_position:
            out, args = args[out_position], args[:out_position] + args[out_position + 1 :]
        read = [
            read_method_argument(a, device, operation, host_data=i == host_data or not guarded)
            for i, a in enumerate(args)
        ]
        given = kwargs
        if kwargs.keys() & _METHOD_KEYWORDS_CUPY_LACKS:
            raise TypeError(
                f"{operation}() got keyword arguments cupy.ndarray.{name} does not take: "
                f"{sorted(kwargs.keys() & _METHOD_KEYWORDS_CUPY_LACKS)}."
            )
        if kwargs:
            kwargs = {
                k: read_method_argument(v, device, operation, host_data=False)
                for k, v in kwargs.items()
            }
        if out is not None:
            kwargs["out"] = read_out(out, device, operation)
        if guarded and _guard is not None:
            _guard(operation, (self, *args, *given.values(), *(() if out is None else (out,))))
        result = getattr(self._data, name)(*read, **kwargs)
        if out is not None:
            count_write(kwargs["out"])
            return out
        return wrap_result(result, device)

    method.__name__ = name
    method.__doc__ = f"``numpy.ndarray.{name}`` on the device; results stay on it."
    return method


def read_method_argument(x: Any, device: Device, operation: str, *, host_data: bool) -> Any:
    """A method argument: arrays must be on ``device``; host data only where CuPy converts it."""
    if type(x) is HostArray:
        if x._device is not device and x._device != device:
            raise cross_device(operation, device, x._device)
        return x._data
    if isinstance(x, np.ndarray | list | tuple) and not host_data:
        if isinstance(x, tuple) and all(isinstance(v, int | np.integer) for v in x):
            return x  # an axis tuple or a shape
        raise foreign(operation, device, x)
    if is_cupy_array(x):
        raise foreign(operation, device, x)
    return x


# --------------------------------------------------------------------------------------------
# Indexing


def _is_advanced(key: tuple[Any, ...]) -> bool:
    """Whether an index holds arrays, sequences or booleans (CuPy's ``_prepare_slice_list``)."""
    return any(isinstance(k, list | tuple | np.ndarray | HostArray | bool | np.bool_) for k in key)


def _index(key: Any, device: Device) -> tuple[Any, ...]:
    """A NumPy index tuple: device arrays unwrapped (same device only), host data as is."""
    items = key if type(key) is tuple else (key,)
    if any(type(k) is HostArray for k in items) or any(is_cupy_array(k) for k in items):
        items = tuple(_index_item(k, device) for k in items)
    return items


def _index_item(k: Any, device: Device) -> Any:
    if type(k) is HostArray:
        if k._device is not device and k._device != device:
            raise cross_device("indexing", device, k._device)
        return k._data
    if is_cupy_array(k):
        raise foreign("indexing", device, k)
    return k


# --------------------------------------------------------------------------------------------
# What the modules above install: NumPy's general dispatch and the move between devices

UFUNCS_CUPY_LACKS = frozenset({"isnat", "matvec", "spacing", "vecdot", "vecmat"})
"""NumPy ufuncs with no CuPy counterpart (CuPy 14.2): ``__array_ufunc__`` returns NotImplemented."""
_UFUNC_OBJECTS_CUPY_LACKS = frozenset(
    getattr(np, name) for name in UFUNCS_CUPY_LACKS if hasattr(np, name)
)

_apply_ufunc: Callable[[Device, np.ufunc, str, tuple[Any, ...], dict[str, Any]], Any]
_apply_function: Callable[[Device, Any, tuple[Any, ...], Mapping[str, Any]], Any]
_mover: Callable[..., Any]


def set_numpy_dispatch(
    apply_ufunc: Callable[[Device, np.ufunc, str, tuple[Any, ...], dict[str, Any]], Any],
    apply_function: Callable[[Device, Any, tuple[Any, ...], Mapping[str, Any]], Any],
    /,
) -> None:
    """Install the general paths of ``__array_ufunc__`` and ``__array_function__``.

    :mod:`cupy_parallel._src.arrays` installs :mod:`cupy_parallel._src.hostdispatch`'s
    ``apply_ufunc(device, ufunc, method, inputs, kwargs)`` and ``apply_function(device, func,
    args, kwargs)`` when the package is imported; the operators and the one- and two-operand
    ufunc calls stay here, on the hot path.

    Example:
        >>> from cupy_parallel._src import hostdispatch
        >>> set_numpy_dispatch(hostdispatch.apply_ufunc, hostdispatch.apply_function)
    """
    global _apply_ufunc, _apply_function
    _apply_ufunc, _apply_function = apply_ufunc, apply_function


def set_mover(move: Callable[..., Any], /) -> None:
    """Install ``move(array, device, /, *, stream=None)`` behind ``HostArray.to_device``.

    :mod:`cupy_parallel._src.arrays` installs its ``to_device`` when the package is imported:
    placing arrays is the layer above this one.

    Example:
        >>> from cupy_parallel._src import arrays
        >>> set_mover(arrays.to_device)
    """
    global _mover
    _mover = move


def _divmod(self: HostArray, other: Any) -> Any:
    return _apply_ufunc(self._device, np.divmod, "__call__", (self, other), {})


def _rdivmod(self: HostArray, other: Any) -> Any:
    if type(other) not in SCALAR_TYPES:
        return _other_operand(self, other, "operator divmod")
    return _apply_ufunc(self._device, np.divmod, "__call__", (other, self), {})


# --------------------------------------------------------------------------------------------
# The array


class HostArray:
    """An array on a simulated accelerator ``"host:k"``, strict as a ``cupy.ndarray`` on a GPU.

    Create one with ``cupy_parallel.to_device`` or ``cupy_parallel.empty``. Arithmetic,
    NumPy functions, slices and views stay on the array's device. Mixing it with an array of
    another device raises ``ValueError``; with a plain ``numpy.ndarray``, a list or a CuPy
    array, ``TypeError``, as CuPy does. ``numpy.asarray(h)`` raises ``TypeError``: ``h.get()``
    and ``to_device(h, "cpu")`` are the exits, as ``.get()`` and ``cupy.asnumpy`` are in CuPy.

    Why a duck array and not a ``numpy.ndarray`` subclass: NumPy converts a subclass to a plain
    array without asking it (``np.asarray``, ``memoryview``, the buffer protocol, ``np.save``
    and every C routine read its memory directly), so a subclass cannot refuse implicit
    conversion; CuPy's arrays are not ndarrays either. The array holds its NumPy buffer and
    implements ``__array_ufunc__``, ``__array_function__``, the operators and the methods
    itself.

    Other decisions:

    * ``__dlpack__`` exports only when the consumer asks for the cpu explicitly
      (``np.from_dlpack(h, device="cpu")``, which copies, as CuPy copies a GPU array to the
      cpu); a plain ``np.from_dlpack(h)`` raises ``BufferError``, since it would be an
      implicit conversion.
    * Pickling keeps the device; unpickling in a process without that device raises
      ``ValueError`` naming how many host devices it has (CuPy unpickles onto the current
      device instead; silently moving data is what host devices exist to catch).
    * ``__array_namespace__`` is ``numpy``, which computes on host arrays through the
      dispatch protocols (as ``cupy_parallel.array_namespace`` says).
    * Values are NumPy's, bit for bit: where CuPy's defaults differ (``put``'s ``mode`` is
      ``'wrap'`` in CuPy, ``'raise'`` in NumPy) or CuPy is silently different (it wraps
      out-of-bounds indices), the host array does what NumPy does, so errors are raised.
    * Known places where it is stricter or looser than CuPy: structured and void dtypes are
      refused (CuPy's main branch holds their bytes); a refused dtype is a ``TypeError``
      (CuPy: ``ValueError``); Python numbers nested in a NumPy function's list arguments
      (``np.concatenate([h, [1, 2]])``) are passed to NumPy, where some CuPy functions refuse
      them; which NumPy functions, keywords and ufunc methods exist follows CuPy 14.2.

    Example:
        >>> import cupy_parallel
        >>> import numpy as np
        >>> from cupy_parallel._src.arrays import to_device
        >>> from cupy_parallel._src.devices import set_host_device_count
        >>> set_host_device_count(2)
        >>> a = to_device(np.arange(3.0), "host:1")
        >>> a * 2
        HostArray([0., 2., 4.], device='host:1')
        >>> a[1:].device
        Device('host:1')
        >>> a.get()
        array([0., 1., 2.])
    """

    __slots__ = ("__weakref__", "_data", "_device")
    __array_priority__ = _PRIORITY
    __hash__ = None  # type: ignore[assignment]  # mutable, as numpy.ndarray

    _data: Any  # the numpy.ndarray (Any: NumPy's stubs are narrower than what we forward)
    _device: Device

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError(
            "HostArray cannot be constructed directly; use cupy_parallel.to_device(array, "
            "'host:k') or cupy_parallel.empty(shape, dtype, 'host:k')."
        )

    # -- metadata ------------------------------------------------------------------------------

    @property
    def device(self) -> Device:
        """The host device this array lives on (array API standard)."""
        return self._device

    @property
    def shape(self) -> tuple[int, ...]:
        """The array's shape; assigning reshapes in place, as for NumPy and CuPy arrays."""
        return self._data.shape

    @shape.setter
    def shape(self, value: Any) -> None:
        self._data.shape = value

    @property
    def dtype(self) -> np.dtype[Any]:
        """The element type."""
        return self._data.dtype

    @property
    def ndim(self) -> int:
        """The number of dimensions."""
        return self._data.ndim

    @property
    def size(self) -> int:
        """The number of elements."""
        return self._data.size

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return self._data.itemsize

    @property
    def nbytes(self) -> int:
        """Bytes of all elements."""
        return self._data.nbytes

    @property
    def strides(self) -> tuple[int, ...]:
        """Bytes to step in each dimension."""
        return self._data.strides

    @property
    def flags(self) -> Any:
        """The buffer's flags (contiguity, writeability)."""
        return self._data.flags

    @property
    def T(self) -> HostArray:  # noqa: N802 - NumPy's name
        """The transposed view."""
        return host_array(self._data.T, self._device)

    @property
    def mT(self) -> HostArray:  # noqa: N802 - NumPy's name
        """The view with the last two axes swapped."""
        return host_array(self._data.mT, self._device)

    @property
    def real(self) -> HostArray:
        """The real part (a view for complex arrays)."""
        return host_array(_zero_d(self._data.real), self._device)

    @real.setter
    def real(self, value: Any) -> None:
        self.real[...] = value

    @property
    def imag(self) -> HostArray:
        """The imaginary part (a view for complex arrays)."""
        return host_array(_zero_d(self._data.imag), self._device)

    @imag.setter
    def imag(self, value: Any) -> None:
        self.imag[...] = value

    def __len__(self) -> int:
        if not self._data.ndim:
            raise TypeError("len() of unsized object")
        return len(self._data)

    def __iter__(self) -> Iterator[HostArray]:
        if not self._data.ndim:
            raise TypeError("iteration over a 0-d array")
        return (self[i] for i in range(len(self._data)))

    def __repr__(self) -> str:
        body = repr(self._data)
        return f"HostArray{body[5:-1]}, device='{self._device}')"

    def __str__(self) -> str:
        return str(self._data)

    def __format__(self, format_spec: str) -> str:
        return format(self._data, format_spec)

    # -- exits to the host ---------------------------------------------------------------------

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        raise implicit_conversion()

    def __buffer__(self, flags: int) -> memoryview:
        raise implicit_conversion("a buffer (memoryview)")

    def get(
        self,
        stream: Any = None,
        order: str = "C",
        out: np.ndarray | None = None,
        blocking: bool = True,
    ) -> np.ndarray:
        """A NumPy copy of the array on the cpu (``cupy.ndarray.get``'s signature).

        ``stream`` and ``blocking`` are accepted for CuPy compatibility; host copies are
        synchronous. ``out`` must be a NumPy array of the same shape and dtype.

        Example:
            >>> import cupy_parallel
            >>> import numpy as np
            >>> from cupy_parallel._src.arrays import to_device
            >>> to_device(np.arange(3), "host:0").get()
            array([0, 1, 2])
        """
        if out is not None:
            if not isinstance(out, np.ndarray):
                raise TypeError(f"out must be a numpy.ndarray, got {type(out).__name__}.")
            if out.dtype != self._data.dtype:
                raise TypeError(f"out has dtype {out.dtype}; this array has {self._data.dtype}.")
            if out.shape != self._data.shape:
                raise ValueError(f"out has shape {out.shape}; this array has {self._data.shape}.")
            np.copyto(out, self._data)
            return out
        if order not in ("C", "F", "A", "c", "f", "a"):
            raise ValueError(f"order must be 'C', 'F' or 'A', got {order!r}.")
        if order.upper() == "A":
            order = (
                "F" if self._data.flags.f_contiguous and not self._data.flags.c_contiguous else "C"
            )
        layout: Any = order.upper()
        return np.array(self._data, order=layout, copy=True)

    def set(self, arr: np.ndarray, stream: Any = None) -> None:
        """Copy the NumPy array ``arr`` into this array (``cupy.ndarray.set``'s rules).

        ``arr`` must be a ``numpy.ndarray`` of the same dtype and shape.

        Example:
            >>> import cupy_parallel
            >>> import numpy as np
            >>> from cupy_parallel._src.arrays import to_device
            >>> h = to_device(np.zeros(2), "host:0")
            >>> h.set(np.array([1.0, 2.0]))
            >>> h
            HostArray([1., 2.], device='host:0')
        """
        if not isinstance(arr, np.ndarray):
            raise TypeError(f"arr must be a numpy.ndarray, got {type(arr).__name__}.")
        if arr.dtype != self._data.dtype:
            raise TypeError(f"{arr.dtype} array cannot be set to {self._data.dtype} array.")
        if arr.shape != self._data.shape:
            raise ValueError(
                f"Shape mismatch. Old shape: {self._data.shape}, new shape: {arr.shape}."
            )
        if not (self._data.flags.c_contiguous or self._data.flags.f_contiguous):
            raise ValueError("Cannot set to non-contiguous array (as in CuPy).")
        if _guard is not None:
            _guard("HostArray.set", (self, arr))
        np.copyto(self._data, arr)
        count_write(self._data)

    def item(self, *args: Any) -> Any:
        """The one element as a Python scalar."""
        return self._data.item(*args)

    def tolist(self) -> Any:
        """The elements as nested Python lists (a copy to the host)."""
        return self._data.tolist()

    def tobytes(self, order: str = "C") -> bytes:
        """The raw bytes (a copy to the host)."""
        return self._data.tobytes(order)

    def tofile(self, fid: Any, sep: str = "", format: str = "%s") -> None:
        """Write the elements to a file, as ``numpy.ndarray.tofile``."""
        self._data.tofile(fid, sep, format)

    def dump(self, file: Any) -> None:
        """Pickle the array to ``file``."""
        if isinstance(file, str):
            with open(file, "wb") as f:
                pickle.dump(self, f, -1)
        else:
            pickle.dump(self, file, -1)

    def dumps(self) -> bytes:
        """The array pickled."""
        return pickle.dumps(self, -1)

    def __bool__(self) -> bool:
        return bool(self._data)

    def __int__(self) -> int:
        return int(self._data)

    def __float__(self) -> float:
        return float(self._data)

    def __complex__(self) -> complex:
        return complex(self._data)

    def to_device(
        self, device: DeviceLike, /, *, stream: Any = None
    ) -> NDArray[Any] | HostArray | CupyArray:  # cupy_parallel.Array, spelled out: see arrays
        """This array on ``device`` (array API standard); the same array if it is there.

        Example:
            >>> import cupy_parallel
            >>> import numpy as np
            >>> from cupy_parallel._src.arrays import to_device
            >>> from cupy_parallel._src.devices import set_host_device_count
            >>> set_host_device_count(2)
            >>> to_device(np.arange(2), "host:0").to_device("host:1")
            HostArray([0, 1], device='host:1')
        """
        return _mover(self, device, stream=stream)

    def __array_namespace__(self, /, *, api_version: str | None = None) -> ModuleType:
        return np

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)  # kDLCPU: the bytes are in host memory

    def __dlpack__(
        self,
        *,
        stream: Any = None,
        max_version: tuple[int, int] | None = None,
        dl_device: tuple[int, int] | None = None,
        copy: bool | None = None,
    ) -> Any:
        if dl_device is None or tuple(dl_device) != (1, 0):
            raise BufferError(
                f"An array on {self._device} is device memory: DLPack exports it only to a "
                "consumer asking for the cpu explicitly (np.from_dlpack(array, device='cpu')), "
                f"which copies; {EXITS}."
            )
        if copy is False:
            raise ValueError("Device memory cannot be exported to the cpu without a copy.")
        return self._data.copy().__dlpack__(max_version=max_version)

    # -- pickling and copies -------------------------------------------------------------------

    def __reduce__(self) -> tuple[Any, ...]:
        return (_unpickle, (self._data, str(self._device)))

    def __copy__(self) -> HostArray:
        return self.copy()

    def __deepcopy__(self, memo: Any) -> HostArray:
        return self.copy()

    def copy(self, order: str = "C") -> HostArray:
        """A copy on the same device."""
        if _guard is not None:
            _guard("HostArray.copy", (self,))
        return host_array(self._data.copy(order), self._device)

    def astype(
        self,
        dtype: Any,
        order: str = "K",
        casting: Any = None,
        subok: Any = None,
        copy: bool = True,
    ) -> HostArray:
        """The elements converted to ``dtype`` (a dtype CuPy has), on the same device."""
        dtype = check_device_dtype(dtype, "HostArray.astype's dtype")
        if _guard is not None:
            _guard("HostArray.astype", (self,))
        kwargs = {} if casting is None else {"casting": casting}
        return host_array(self._data.astype(dtype, order, copy=copy, **kwargs), self._device)

    def view(self, dtype: Any = None, array_class: Any = None) -> HostArray:
        """The same memory seen as ``dtype`` (a dtype CuPy has); never a NumPy array."""
        if (isinstance(dtype, type) and issubclass(dtype, np.ndarray)) or array_class is not None:
            raise TypeError(
                f"HostArray.view returns device arrays only (CuPy: 'Type must be a sub-type of "
                f"ndarray type'); {EXITS}."
            )
        if dtype is None:
            return host_array(self._data.view(), self._device)
        dtype = check_device_dtype(dtype, "HostArray.view's dtype")
        return host_array(self._data.view(dtype), self._device)

    # -- in-place methods ----------------------------------------------------------------------

    def fill(self, value: Any) -> None:
        """Set every element to the scalar ``value`` (a 0-d array of this device counts)."""
        if type(value) is HostArray:
            if value._device != self._device:
                raise cross_device("HostArray.fill", self._device, value._device)
            if value._data.ndim:
                raise ValueError("non-scalar array cannot be used for fill (as in CuPy).")
            scalar: Any = value._data[()]
        elif type(value) in SCALAR_TYPES:
            scalar = value
        elif is_cupy_array(value):
            raise foreign("HostArray.fill", self._device, value)
        else:  # CuPy reads host data as numpy.asarray(value, dtype) and wants a scalar
            host = np.asarray(value, dtype=self._data.dtype)
            if host.shape:
                raise ValueError(
                    f"non-scalar {type(value).__name__} cannot be used for fill (as in CuPy)."
                )
            scalar = host[()]
        if _guard is not None:
            _guard("HostArray.fill", (self, value))
        self._data.fill(scalar)
        count_write(self._data)

    def sort(self, axis: int = -1, kind: Any = None, order: Any = None) -> None:
        """Sort in place along ``axis``."""
        if _guard is not None:
            _guard("HostArray.sort", (self,))
        self._data.sort(axis, kind, order)
        count_write(self._data)

    def partition(
        self, kth: Any, axis: int = -1, kind: str = "introselect", order: Any = None
    ) -> None:
        """Partition in place around ``kth``."""
        kth = read_method_argument(kth, self._device, "HostArray.partition", host_data=True)
        if _guard is not None:
            _guard("HostArray.partition", (self,))
        self._data.partition(kth, axis, kind, order)
        count_write(self._data)

    def put(self, indices: Any, values: Any, mode: str = "raise") -> None:
        """Set the flat elements at ``indices`` to ``values`` (host data converted, as CuPy)."""
        operation = "HostArray.put"
        read_indices = read_method_argument(indices, self._device, operation, host_data=True)
        read_values = read_method_argument(values, self._device, operation, host_data=True)
        if _guard is not None:
            _guard(operation, (self, indices, values))
        self._data.put(read_indices, read_values, mode)
        count_write(self._data)

    # -- indexing ------------------------------------------------------------------------------

    def __getitem__(self, key: Any) -> HostArray:
        t = type(key)
        if t is int:  # a 0-d view, not a NumPy scalar
            h = _new(HostArray)
            h._data = self._data[key, ...]
            h._device = self._device
            return h
        if t is not slice:
            key = _index(key, self._device)
        r = self._data[key]
        if type(r) is not np.ndarray:  # all dims indexed by integers: view the element
            element = (*key, ...) if type(key) is tuple else (key, ...)
            r = self._data[element]
        return host_array(r, self._device)

    def __setitem__(self, key: Any, value: Any) -> None:
        device = self._device
        if type(key) is not int and type(key) is not slice:
            key = _index(key, device)
        if type(value) is HostArray:
            if value._device != device:
                raise ValueError(
                    f"Cannot assign an array on {value._device} into an array on {device}; "
                    f"move it first with cupy_parallel.to_device(value, '{device}')."
                )
            source: Any = value._data
        elif type(value) in SCALAR_TYPES:
            source = value
        elif is_cupy_array(value):
            raise foreign("assignment", device, value)
        elif type(key) is tuple and _is_advanced(key):
            source = np.asarray(value, dtype=self._data.dtype)  # CuPy uploads it here
        else:  # CuPy's basic-index assignment is fill(): host data must be one scalar
            source = np.asarray(value, dtype=self._data.dtype)
            if source.shape:
                raise ValueError(
                    f"Cannot assign a {type(value).__name__} of shape {source.shape} into an "
                    f"array on {device}: CuPy refuses host data here ('non-scalar "
                    "numpy.ndarray cannot be used for fill'); move it first with "
                    f"cupy_parallel.to_device(value, '{device}')."
                )
        if _guard is not None:
            _guard("operator []=", (self, value))
        self._data[key] = source
        count_write(self._data)

    # -- NumPy's dispatch protocols ------------------------------------------------------------

    def __array_ufunc__(self, ufunc: np.ufunc, method: str, *inputs: Any, **kwargs: Any) -> Any:
        device = self._device
        if kwargs or method != "__call__" or ufunc in _UFUNC_OBJECTS_CUPY_LACKS or len(inputs) > 2:
            return _apply_ufunc(device, ufunc, method, inputs, kwargs)
        if len(inputs) == 2:  # the hot path: two operands, each an array here or a scalar
            a, b = inputs
            if a is self:  # NumPy asks the first array operand, so mostly this one
                a = self._data
            elif type(a) is HostArray and (a._device is device or a._device == device):
                a = a._data
            elif type(a) not in SCALAR_TYPES:
                return _apply_ufunc(device, ufunc, method, inputs, kwargs)
            if b is self:
                b = self._data
            elif type(b) is HostArray and (b._device is device or b._device == device):
                b = b._data
            elif type(b) not in SCALAR_TYPES:
                return _apply_ufunc(device, ufunc, method, inputs, kwargs)
            if _guard is not None:
                _guard(f"numpy.{ufunc.__name__}", inputs)
            r = ufunc(a, b)
        else:  # one operand, which is this array
            if _guard is not None:
                _guard(f"numpy.{ufunc.__name__}", inputs)
            r = ufunc(self._data)
        if type(r) is _NDARRAY:
            h = _new(HostArray)
            h._data = r
            h._device = device
            return h
        if ufunc.nout == 1:
            return host_array(np.asarray(r), device)
        return tuple(host_array(_zero_d(y), device) for y in r)

    def __array_function__(
        self,
        func: Callable[..., Any],
        types: Iterable[type],
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
    ) -> Any:
        for t in types:
            if not issubclass(t, HostArray | np.ndarray) and "cupy" not in t.__module__:
                return NotImplemented
        return _apply_function(self._device, func, args, kwargs)

    # -- operators (CuPy's ``core.pyx``) -------------------------------------------------------

    __add__ = _binary(np.add, "+")
    __radd__ = _reflected(np.add, "+")
    __iadd__ = _inplace(np.add, "+")
    __sub__ = _binary(np.subtract, "-")
    __rsub__ = _reflected(np.subtract, "-")
    __isub__ = _inplace(np.subtract, "-")
    __mul__ = _binary(np.multiply, "*")
    __rmul__ = _reflected(np.multiply, "*")
    __imul__ = _inplace(np.multiply, "*")
    __truediv__ = _binary(np.true_divide, "/")
    __rtruediv__ = _reflected(np.true_divide, "/")
    __itruediv__ = _inplace(np.true_divide, "/")
    __floordiv__ = _binary(np.floor_divide, "//")
    __rfloordiv__ = _reflected(np.floor_divide, "//")
    __ifloordiv__ = _inplace(np.floor_divide, "//")
    __mod__ = _binary(np.remainder, "%")
    __rmod__ = _reflected(np.remainder, "%")
    __imod__ = _inplace(np.remainder, "%")
    __pow__ = _binary(np.power, "**")
    __rpow__ = _reflected(np.power, "**")
    __ipow__ = _inplace(np.power, "**")
    __matmul__ = _binary(np.matmul, "@")
    __rmatmul__ = _reflected(np.matmul, "@")
    __imatmul__ = _inplace(np.matmul, "@")
    __and__ = _binary(np.bitwise_and, "&")
    __rand__ = _reflected(np.bitwise_and, "&")
    __iand__ = _inplace(np.bitwise_and, "&")
    __or__ = _binary(np.bitwise_or, "|")
    __ror__ = _reflected(np.bitwise_or, "|")
    __ior__ = _inplace(np.bitwise_or, "|")
    __xor__ = _binary(np.bitwise_xor, "^")
    __rxor__ = _reflected(np.bitwise_xor, "^")
    __ixor__ = _inplace(np.bitwise_xor, "^")
    __lshift__ = _binary(np.left_shift, "<<")
    __rlshift__ = _reflected(np.left_shift, "<<")
    __ilshift__ = _inplace(np.left_shift, "<<")
    __rshift__ = _binary(np.right_shift, ">>")
    __rrshift__ = _reflected(np.right_shift, ">>")
    __irshift__ = _inplace(np.right_shift, ">>")
    __divmod__ = _divmod
    __rdivmod__ = _rdivmod
    __eq__ = _comparison(np.equal, "==")  # type: ignore[assignment]  # an array, as NumPy's
    __ne__ = _comparison(np.not_equal, "!=")  # type: ignore[assignment]
    __lt__ = _comparison(np.less, "<")
    __le__ = _comparison(np.less_equal, "<=")
    __gt__ = _comparison(np.greater, ">")
    __ge__ = _comparison(np.greater_equal, ">=")
    __neg__ = _unary(np.negative, "-")
    __pos__ = _unary(np.positive, "+")
    __abs__ = _unary(np.absolute, "abs")
    __invert__ = _unary(np.invert, "~")

    # -- methods computing on the buffer: name, position of ``out`` among positional arguments --

    all = _computing_method("all", 1)
    any = _computing_method("any", 1)
    argmax = _computing_method("argmax", 1)
    argmin = _computing_method("argmin", 1)
    argpartition = _computing_method("argpartition", None)
    argsort = _computing_method("argsort", None)
    choose = _computing_method("choose", 1)
    clip = _computing_method("clip", 2)
    compress = _computing_method("compress", 2)
    conj = _computing_method("conj", None)
    conjugate = _computing_method("conjugate", None)
    cumprod = _computing_method("cumprod", 2)
    cumsum = _computing_method("cumsum", 2)
    diagonal = _computing_method("diagonal", None)
    dot = _computing_method("dot", 1)
    flatten = _computing_method("flatten", None)
    max = _computing_method("max", 1)
    mean = _computing_method("mean", 2)
    min = _computing_method("min", 1)
    nonzero = cast("Callable[..., tuple[HostArray, ...]]", _computing_method("nonzero", None))
    prod = _computing_method("prod", 2)
    ravel = _computing_method("ravel", None)
    repeat = _computing_method("repeat", None)
    reshape = _computing_method("reshape", None)
    round = _computing_method("round", 1)
    searchsorted = _computing_method("searchsorted", None)
    squeeze = _computing_method("squeeze", None)
    std = _computing_method("std", 2)
    sum = _computing_method("sum", 2)
    swapaxes = _computing_method("swapaxes", None)
    take = _computing_method("take", 2)
    trace = _computing_method("trace", 4)
    transpose = _computing_method("transpose", None)
    var = _computing_method("var", 2)


def _unpickle(data: np.ndarray, device: str) -> HostArray:
    target = as_device(device)
    try:
        check_exists(target)
    except ValueError as error:
        raise ValueError(f"Cannot unpickle an array of {device}: {error}") from None
    return host_array(data, target)


def _host_array_census(first: int, /) -> dict[Device, int]:
    """How many host arrays live on each ``host:k`` with ``k >= first``.

    A scan of the objects the garbage collector tracks (every HostArray is one), so that
    creating an array costs nothing for it; ``set_host_device_count`` runs it only when it
    removes devices.
    """
    counts: dict[Device, int] = {}
    for obj in gc.get_objects():
        if type(obj) is HostArray:
            device = getattr(obj, "_device", None)  # None: being built in another thread
            if device is not None and device.index >= first:
                counts[device] = counts.get(device, 0) + 1
    return counts


set_host_array_census(_host_array_census)
add_array_type(HostArray)
