"""Devices and where arrays live: ``"cpu"``, ``"cuda:k"`` GPUs, ``"host:k"`` simulated accelerators.

The *platform* is the kind of accelerator the process spreads work over: CUDA when CuPy sees a
GPU, otherwise *host*, a set of simulated accelerators in host memory (as JAX's
``--xla_force_host_platform_device_count``). ``CUPY_PARALLEL_PLATFORM=host|cuda`` forces the choice;
``CUPY_PARALLEL_HOST_DEVICES`` or :func:`set_host_device_count` sets how many host devices exist.

Host devices are as strict as GPUs, so that code which keeps its placement right here keeps it
right on CUDA: a :class:`HostArray` refuses to meet an array of another host device (CuPy refuses
arrays of another GPU) or a plain NumPy array (CuPy refuses NumPy arrays). Python and NumPy
scalars are accepted, as CuPy accepts them. Computations, slices and views stay on their device.
``numpy.asarray(host_array)`` is the explicit exit to plain NumPy, the analogue of
``cupy.asnumpy``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypeAlias

import numpy as np
import optree

from cupy_parallel._src.memory import get_host_memory_pool

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from types import ModuleType

__all__ = [
    "Device",
    "DeviceLike",
    "HostArray",
    "array_namespace",
    "as_device",
    "cupy_module",
    "device_of",
    "devices",
    "empty",
    "is_array",
    "platform",
    "set_host_device_count",
    "to_device",
]

Kind: TypeAlias = Literal["cpu", "cuda", "host"]
_KINDS: tuple[Kind, ...] = ("cpu", "cuda", "host")
_PLATFORMS: tuple[Kind, ...] = ("cuda", "host")


# --------------------------------------------------------------------------------------------
# CuPy, optional


_substitutes: list[ModuleType] = []  # stand-ins for CuPy (the simulated CUDA), innermost last


def cupy_module() -> ModuleType | None:
    """CuPy if it can be imported, else ``None``. CuPy is never needed to import this package.

    Inside :func:`substitute_cupy` (``cupy_parallel.testing.simulated_cuda``), the stand-in.

    Example:
        >>> cupy_module() is None or cupy_module().__name__ == "cupy"
        True
    """
    if _substitutes:
        return _substitutes[-1]
    return _import_cupy()


@functools.cache
def _import_cupy() -> ModuleType | None:
    try:
        import cupy
    except ImportError:
        return None
    return cupy


@contextlib.contextmanager
def substitute_cupy(module: ModuleType) -> Iterator[None]:
    """Make :func:`cupy_module` return ``module`` (a stand-in for CuPy) inside the block.

    The device count and platform follow the stand-in (its ``cuda.runtime.getDeviceCount()``).

    Example:
        >>> import types
        >>> with substitute_cupy(types.ModuleType("stand_in")):
        ...     cupy_module().__name__
        'stand_in'
    """
    _substitutes.append(module)
    _cuda_device_count.cache_clear()
    try:
        yield
    finally:
        _substitutes.remove(module)
        _cuda_device_count.cache_clear()


@functools.cache
def _cuda_device_count() -> int:
    cupy = cupy_module()
    if cupy is None:
        return 0
    try:
        return int(cupy.cuda.runtime.getDeviceCount()) if cupy.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - a missing driver surfaces as several CUDA error types
        return 0


def _is_cupy_array(x: object) -> bool:
    cupy = cupy_module() if "cupy" in type(x).__module__ else None
    return cupy is not None and isinstance(x, cupy.ndarray)


# --------------------------------------------------------------------------------------------
# Device


@dataclass(frozen=True, slots=True)
class Device:
    """A place arrays live: ``Device("cpu")``, ``Device("cuda", 1)`` or ``Device("host", 2)``.

    Immutable and hashable. ``str(device)`` gives the spelling :func:`as_device` accepts. Used as a
    context manager, a CUDA device becomes CuPy's current device for the block (host and cpu
    devices need no context and do nothing).

    Example:
        >>> d = Device("host", 1)
        >>> str(d), d.kind, d.index
        ('host:1', 'host', 1)
        >>> Device("cpu")
        Device('cpu')
    """

    kind: Kind
    index: int = -1

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"Device kind must be one of {_KINDS}, got {self.kind!r}.")
        if isinstance(self.index, bool) or not isinstance(self.index, int | np.integer):
            raise TypeError(f"Device index must be an int, got {type(self.index).__name__}.")
        object.__setattr__(self, "index", int(self.index))
        if self.kind == "cpu" and self.index != -1:
            raise ValueError(f"The cpu device has index -1, got {self.index}.")
        if self.kind != "cpu" and self.index < 0:
            raise ValueError(f"A {self.kind} device index must be >= 0, got {self.index}.")

    def __str__(self) -> str:
        return "cpu" if self.kind == "cpu" else f"{self.kind}:{self.index}"

    def __repr__(self) -> str:
        return f"Device({str(self)!r})"

    @property
    def xp(self) -> ModuleType:
        """The array namespace computing on this device: ``cupy`` for CUDA, else ``numpy``."""
        if self.kind == "cuda":
            return _require_cupy(self)
        return np

    def __enter__(self) -> Device:
        if self.kind == "cuda":
            ctx = _require_cupy(self).cuda.Device(self.index)
            ctx.__enter__()
            _context_stack().append(ctx)
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.kind == "cuda":
            _context_stack().pop().__exit__(*exc_info)


_contexts = threading.local()


def _context_stack() -> list[Any]:
    stack: list[Any] | None = getattr(_contexts, "stack", None)
    if stack is None:
        stack = _contexts.stack = []
    return stack


def _require_cupy(device: Device) -> ModuleType:
    cupy = cupy_module()
    if cupy is None or _cuda_device_count() == 0:
        raise ValueError(
            f"Device {device} needs CUDA, which is not available here "
            f"({'CuPy is not installed' if cupy is None else 'CuPy sees no GPU'}). "
            "Use 'host:k' devices to run multi-device code on the CPU."
        )
    return cupy


CPU = Device("cpu")

DeviceLike: TypeAlias = "Device | str | int"


def as_device(spec: Any, /) -> Device:
    """Read a device spelling: ``"cpu"``, ``-1``, ``"cuda:k"``, ``"host:k"``, an int, a ``Device``.

    A non-negative int means device ``k`` of the current platform (CUDA or host), as torch reads an
    int as a GPU ordinal. ``"host"`` means ``"host:0"`` and ``"cuda"`` CuPy's current GPU. A
    ``cupy.cuda.Device`` is accepted as its GPU.

    Example:
        >>> as_device("host:3")
        Device('host:3')
        >>> as_device(-1)
        Device('cpu')
    """
    if isinstance(spec, Device):
        return spec
    if isinstance(spec, str):
        return _parse_device(spec)
    if isinstance(spec, bool):
        raise TypeError(f"device must be a str, int or Device, got bool {spec!r}.")
    if isinstance(spec, int | np.integer):
        return CPU if spec == -1 else Device(platform(), int(spec))
    if type(spec).__name__ == "Device" and "cupy" in type(spec).__module__:
        return Device("cuda", int(spec.id))
    raise TypeError(
        f"device must be a str ('cpu', 'cuda:0', 'host:1'), an int or a Device, "
        f"got {type(spec).__name__} {spec!r}."
    )


def _parse_device(text: str) -> Device:
    kind, sep, index = text.strip().partition(":")
    if kind not in _KINDS:
        raise ValueError(f"device string must be 'cpu', 'cuda:k' or 'host:k', got {text!r}.")
    if not sep:
        if kind == "cuda":
            return Device("cuda", int(_require_cupy(Device("cuda", 0)).cuda.Device().id))
        return CPU if kind == "cpu" else Device("host", 0)
    if kind == "cpu" or not index.isdigit():
        raise ValueError(f"device string must be 'cpu', 'cuda:k' or 'host:k', got {text!r}.")
    return Device(kind, int(index))


# --------------------------------------------------------------------------------------------
# Platform


_host_device_count: int | None = None


def platform() -> Kind:
    """``"cuda"`` when CuPy sees a GPU, else ``"host"``; ``CUPY_PARALLEL_PLATFORM`` overrides.

    Example:
        >>> platform() in ("cuda", "host")
        True
    """
    forced = os.environ.get("CUPY_PARALLEL_PLATFORM", "").strip().lower()
    if forced:
        if forced not in _PLATFORMS:
            raise ValueError(f"CUPY_PARALLEL_PLATFORM must be 'host' or 'cuda', got {forced!r}.")
        return "cuda" if forced == "cuda" else "host"
    return "cuda" if _cuda_device_count() > 0 else "host"


def set_host_device_count(count: int, /) -> None:
    """Set how many ``"host:k"`` devices exist (overrides ``CUPY_PARALLEL_HOST_DEVICES``).

    Example:
        >>> set_host_device_count(4)
        >>> [str(d) for d in devices()] if platform() == "host" else "not the host platform"
        ['host:0', 'host:1', 'host:2', 'host:3']
    """
    global _host_device_count
    if isinstance(count, bool) or not isinstance(count, int | np.integer):
        raise TypeError(f"count must be an int, got {type(count).__name__}.")
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}.")
    _host_device_count = int(count)


def _host_devices() -> int:
    if _host_device_count is not None:
        return _host_device_count
    text = os.environ.get("CUPY_PARALLEL_HOST_DEVICES", "1")
    if not text.strip().isdigit() or int(text) < 1:
        raise ValueError(f"CUPY_PARALLEL_HOST_DEVICES must be an integer >= 1, got {text!r}.")
    return int(text)


def devices() -> list[Device]:
    """The accelerator devices of the platform: every GPU, or every host device.

    Example:
        >>> set_host_device_count(2)
        >>> len(devices()) >= 1
        True
    """
    if platform() == "cuda":
        return [Device("cuda", k) for k in range(_cuda_device_count())]
    return [Device("host", k) for k in range(_host_devices())]


def _check_exists(device: Device) -> None:
    if device.kind == "host":
        count = _host_devices()
        if device.index >= count:
            raise ValueError(
                f"device {device} does not exist: there are {count} host devices "
                "(set CUPY_PARALLEL_HOST_DEVICES or call set_host_device_count)."
            )
    elif device.kind == "cuda":
        _require_cupy(device)
        if device.index >= _cuda_device_count():
            raise ValueError(
                f"device {device} does not exist: CuPy sees {_cuda_device_count()} GPUs."
            )


def _read_device(spec: Any, name: str, /) -> Device:
    """``as_device(spec)`` for a device that exists; errors name the argument ``name``."""
    try:
        device = as_device(spec)
        _check_exists(device)
    except (TypeError, ValueError) as error:
        raise type(error)(f"{name} is not a usable device: {error}") from None
    return device


def _read_devices(
    specs: Any, name: str, /, *, accelerators_only: bool, allow_empty: bool = False
) -> tuple[Device, ...]:
    """A sequence of existing devices, read at a public entry; errors name ``name[i]``.

    ``accelerators_only`` refuses ``"cpu"`` (arrays there are plain NumPy, placed nowhere);
    ``allow_empty`` accepts an empty sequence.
    """
    if (
        isinstance(specs, str | bytes | Mapping)
        or is_array(specs)
        or not isinstance(specs, Iterable)
    ):
        raise TypeError(
            f"{name} must be a sequence of devices, got {type(specs).__name__} {specs!r}; pass "
            "a list such as ['host:0', 'host:1'] or cupy_parallel.devices() (wrap a single "
            "device as [device])."
        )
    read = []
    for i, spec in enumerate(specs):
        device = _read_device(spec, f"{name}[{i}]")
        if accelerators_only and device.kind == "cpu":
            raise ValueError(
                f"{name}[{i}] must be an accelerator device ('host:k' or 'cuda:k'), got 'cpu' "
                "(plain NumPy memory); use cupy_parallel.devices() for the targets."
            )
        read.append(device)
    if not read and not allow_empty:
        raise ValueError(
            f"{name} must name at least one device, got an empty sequence; pass e.g. "
            "cupy_parallel.devices()."
        )
    return tuple(read)


# --------------------------------------------------------------------------------------------
# HostArray


class HostArray(np.ndarray):
    """A NumPy array that lives on a simulated accelerator ``"host:k"``.

    Create one with :func:`to_device` or :func:`empty`. Arithmetic, NumPy functions, slices and
    views stay on the array's device. Mixing it with an array of another host device raises
    ``ValueError``; mixing it with a plain ``numpy.ndarray`` raises ``TypeError``, as CuPy does.

    Example:
        >>> set_host_device_count(2)
        >>> a = to_device(np.arange(3.0), "host:1")
        >>> a * 2
        HostArray([0., 2., 4.], device='host:1')
        >>> a[1:].device
        Device('host:1')
    """

    _device: Device | None

    def __array_finalize__(self, obj: object) -> None:
        self._device = getattr(obj, "_device", None)

    @property
    def device(self) -> Device:  # type: ignore[override]
        """The host device this array lives on."""
        if self._device is None:
            raise ValueError(
                "This HostArray has no device; create host arrays with "
                "cupy_parallel.to_device(array, 'host:k')."
            )
        return self._device

    def __repr__(self) -> str:
        body = repr(self.view(np.ndarray))
        return f"HostArray{body[5:-1]}, device='{self._device}')"

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_host_array, (np.asarray(self).copy(), str(self._device)))

    def __array_ufunc__(self, ufunc: np.ufunc, method: str, *inputs: Any, **kwargs: Any) -> Any:
        out = kwargs.get("out")
        device = _common_device((*inputs, *(out or ())), f"numpy.{ufunc.__name__}")
        if out is not None:
            kwargs["out"] = tuple(_plain(o) for o in out)
        result = getattr(ufunc, method)(*(_plain(x) for x in inputs), **kwargs)
        if out is not None:
            return out[0] if len(out) == 1 else out
        return _on_device(result, device)

    def __array_function__(
        self,
        func: Callable[..., Any],
        types: Iterable[Any],
        args: Iterable[Any],
        kwargs: Mapping[str, Any],
    ) -> Any:
        operands: Any = (args, kwargs)
        leaves, spec = optree.tree_flatten(operands)
        device = _common_device(leaves, f"numpy.{func.__name__}")
        plain_args, plain_kwargs = optree.tree_unflatten(spec, [_plain(x) for x in leaves])
        return optree.tree_map(lambda r: _on_device(r, device), func(*plain_args, **plain_kwargs))

    def __setitem__(self, key: Any, value: Any) -> None:
        if isinstance(value, HostArray) and value._device != self._device:
            raise ValueError(
                f"Cannot assign an array on {value._device} into an array on {self._device}; "
                f"move it first with cupy_parallel.to_device(value, '{self._device}')."
            )
        super().__setitem__(key, value)

    def dot(self, b: Any, out: Any = None) -> Any:
        """``numpy.dot(self, b)``, checked for placement like every NumPy function."""
        return np.dot(self, b, out=out)


def _rebuild_host_array(data: np.ndarray, device: str) -> HostArray:
    return _wrap(data, as_device(device))


def _plain(x: Any) -> Any:
    return x.view(np.ndarray) if isinstance(x, HostArray) else x


def _wrap(array: np.ndarray, device: Device) -> HostArray:
    host = array.view(HostArray)
    host._device = device
    return host


def _on_device(result: Any, device: Device) -> Any:
    if isinstance(result, np.ndarray):
        return _wrap(result, device)
    if isinstance(result, np.generic):
        return _wrap(np.asarray(result), device)
    return result


def _common_device(operands: Iterable[Any], operation: str) -> Device:
    """The one host device all array operands share; raise if they disagree or include NumPy."""
    device: Device | None = None
    for x in operands:
        if isinstance(x, HostArray):
            if device is None:
                device = x.device
            elif x.device != device:
                raise ValueError(
                    f"{operation} got arrays on different devices, {device} and {x.device}. "
                    "Move them to one device with cupy_parallel.to_device(array, device)."
                )
    if device is None:
        raise TypeError(f"{operation} was dispatched to HostArray but found no HostArray operand.")
    for x in operands:
        if isinstance(x, np.ndarray) and not isinstance(x, HostArray):
            raise TypeError(
                f"{operation} mixes an array on {device} with a plain numpy.ndarray (on cpu), "
                "which CuPy would refuse too. Move it with "
                f"cupy_parallel.to_device(array, '{device}')."
            )
        if _is_cupy_array(x):
            raise TypeError(
                f"{operation} mixes an array on {device} with a cupy.ndarray on "
                f"{device_of(x)}. Move it with cupy_parallel.to_device(array, '{device}')."
            )
    return device


# --------------------------------------------------------------------------------------------
# Arrays on devices


def is_array(x: object, /) -> bool:
    """Whether ``x`` is an array this library places: ``numpy.ndarray`` (HostArray too) or CuPy.

    Example:
        >>> is_array(np.zeros(2)), is_array(3.0)
        (True, False)
    """
    return isinstance(x, np.ndarray) or _is_cupy_array(x)


def device_of(array: Any, /) -> Device:
    """The device an array lives on: ``cpu`` for NumPy, ``host:k`` for HostArray, ``cuda:k``.

    Example:
        >>> device_of(np.zeros(2))
        Device('cpu')
    """
    if isinstance(array, HostArray):
        return array.device
    if isinstance(array, np.ndarray):
        return CPU
    if _is_cupy_array(array):
        return Device("cuda", int(array.device.id))
    raise TypeError(
        f"array must be a numpy.ndarray, HostArray or cupy.ndarray, got {type(array).__name__}."
    )


def array_namespace(array: Any, /) -> ModuleType:
    """``numpy`` or ``cupy``: the module that computes on ``array``'s device.

    Example:
        >>> array_namespace(np.zeros(1)) is np
        True
    """
    return device_of(array).xp


def empty(shape: tuple[int, ...] | int, dtype: Any, device: Any, /) -> Any:
    """An uninitialised C-contiguous array on ``device``.

    Host and cpu arrays of 128 KiB or more come from the host memory pool (see
    :mod:`cupy_parallel._src.memory`), CUDA arrays from CuPy's pool.

    Example:
        >>> set_host_device_count(2)
        >>> empty((2, 3), np.float32, "host:1").device
        Device('host:1')
    """
    device = as_device(device)
    shape = (shape,) if isinstance(shape, int | np.integer) else tuple(shape)
    _check_exists(device)
    if device.kind == "cuda":
        cupy = device.xp
        with device:
            return cupy.empty(shape, dtype)
    array = get_host_memory_pool().empty(shape, dtype)
    return array if device.kind == "cpu" else _wrap(array, device)


def to_device(array: Any, device: Any, /, *, stream: Any = None) -> Any:
    """Copy ``array`` to ``device``; one already there is returned as it is (as torch's ``.to``).

    The copy is C-contiguous with the same dtype and bits. ``stream`` (a ``cupy.cuda.Stream``)
    orders CUDA copies; host copies are synchronous and ignore it.

    Example:
        >>> set_host_device_count(2)
        >>> h = to_device(np.arange(4), "host:1")
        >>> h
        HostArray([0, 1, 2, 3], device='host:1')
        >>> to_device(h, "cpu")
        array([0, 1, 2, 3])
    """
    source = device_of(array)
    target = as_device(device)
    if source == target:
        return array
    _check_exists(target)
    if target.kind == "cuda":
        cupy = target.xp
        with target:
            out = cupy.empty(array.shape, array.dtype)
            if source.kind == "cuda":
                src = cupy.ascontiguousarray(array)
                out.data.copy_from_device_async(src.data, src.nbytes, stream=stream)
            else:
                out.set(np.ascontiguousarray(_plain(array)), stream=stream)
        return out
    out = empty(array.shape, array.dtype, target)
    if source.kind == "cuda":
        _plain(out)[...] = array.get(stream=stream)
    else:
        np.copyto(_plain(out), _plain(array), casting="no")
    return out
