"""Devices: ``"cpu"``, ``"cuda:k"`` GPUs and ``"host:k"`` simulated accelerators.

The *platform* is the kind of accelerator the process spreads work over: CUDA when CuPy sees a
GPU, otherwise *host*, a set of simulated accelerators in host memory (as JAX's
``--xla_force_host_platform_device_count``). ``CUPY_PARALLEL_PLATFORM=host|cuda`` forces the choice;
``CUPY_PARALLEL_HOST_DEVICES`` or :func:`set_host_device_count` sets how many host devices exist.

This module knows devices only: discovery, the :class:`Device` type, reading device spellings and
the one way to reach CuPy (:func:`cupy_module`, :func:`require_cupy`). Arrays on host devices live
in :mod:`cupy_parallel._src.hostarray`; placing and moving arrays in
:mod:`cupy_parallel._src.arrays`.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import sys
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypeAlias, TypeGuard

import numpy as np

from cupy_parallel._src.arguments import read_int

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from types import ModuleType

    from cupy_parallel._src.arraytypes import CupyArray

__all__ = [
    "CPU",
    "Device",
    "DeviceLike",
    "as_device",
    "check_exists",
    "cuda_device_count",
    "cupy_arrays_may_exist",
    "cupy_module",
    "devices",
    "host_device_count",
    "platform",
    "read_device",
    "read_devices",
    "require_cupy",
    "set_host_array_census",
    "set_host_device_count",
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
    cuda_device_count.cache_clear()
    try:
        yield
    finally:
        _substitutes.remove(module)
        cuda_device_count.cache_clear()


def require_cupy() -> ModuleType:
    """CuPy, or ``ImportError`` naming the extra that installs it (the one "get CuPy or raise").

    Only code holding a CUDA array or naming a CUDA device calls this, so the error means the
    environment lost CuPy, not that the user asked for something wrong.

    Example:
        >>> try:
        ...     require_cupy().__name__
        ... except ImportError as error:
        ...     "cupy-parallel[cuda12]" in str(error)
        ...
        'cupy'
    """
    cupy = cupy_module()
    if cupy is None:
        raise ImportError(
            "CuPy is required for CUDA arrays and devices; install it with "
            "pip install 'cupy-parallel[cuda12]' (or [cuda13])."
        )
    return cupy


@functools.cache
def cuda_device_count() -> int:
    cupy = cupy_module()
    if cupy is None:
        return 0
    try:
        return int(cupy.cuda.runtime.getDeviceCount()) if cupy.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - a missing driver surfaces as several CUDA error types
        return 0


def is_cupy_array(x: object, /) -> TypeGuard[CupyArray]:
    """Whether ``x`` is a ``cupy.ndarray`` (cheap when it is not: CuPy is never imported for it)."""
    cupy = cupy_module() if "cupy" in type(x).__module__ else None
    return cupy is not None and isinstance(x, cupy.ndarray)


def cupy_arrays_may_exist() -> bool:
    """Whether :func:`is_cupy_array` can be true of anything; hot paths skip their arguments if not.

    True once CuPy was imported (its arrays need their module) and while a stand-in for it is in
    use (:func:`substitute_cupy`).

    Example:
        >>> import types
        >>> with substitute_cupy(types.ModuleType("stand_in")):
        ...     cupy_arrays_may_exist()
        True
    """
    return bool(_substitutes) or "cupy" in sys.modules


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
        """The array namespace computing on this device (``cupy`` for CUDA, else ``numpy``)."""
        if self.kind == "cuda":
            return _require_cuda(self)
        return np

    def __enter__(self) -> Device:
        if self.kind == "cuda":
            ctx = _require_cuda(self).cuda.Device(self.index)
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


def _require_cuda(device: Device) -> ModuleType:
    """CuPy when it sees a GPU, else ``ValueError`` saying that ``device`` cannot be used here."""
    cupy = cupy_module()
    if cupy is None or cuda_device_count() == 0:
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
        return CPU if spec == -1 else _interned(platform(), int(spec))
    if type(spec).__name__ == "Device" and "cupy" in type(spec).__module__:
        return _interned("cuda", int(spec.id))
    raise TypeError(
        f"device must be a str ('cpu', 'cuda:0', 'host:1'), an int or a Device, "
        f"got {type(spec).__name__} {spec!r}."
    )


_INTERNED: dict[tuple[str, int], Device] = {}


def _interned(kind: Kind, index: int) -> Device:
    """One ``Device`` object per device, so that comparing devices is mostly an ``is`` test."""
    device = _INTERNED.get((kind, index))
    if device is None:
        device = _INTERNED.setdefault((kind, index), Device(kind, index))
    return device


def _parse_device(text: str) -> Device:
    """Read ``"cpu"``, ``"cpu:0"``, ``"cuda"``, ``"cuda:k"``, ``"host"`` or ``"host:k"``.

    The index is ASCII digits only: ``str.isdigit`` also accepts other scripts' digits
    (``"host:١"``) and superscripts, which no other library reads as a device index.
    ``"cpu:0"`` is the cpu, as torch reads it; the cpu has no other index.
    """
    kind, sep, index = text.strip().partition(":")
    if kind not in _KINDS or (sep and not (index.isascii() and index.isdigit())):
        raise ValueError(
            f"device string must be 'cpu', 'cuda:k' or 'host:k', got {text!r} "
            "(k is written in ASCII digits)."
        )
    if not sep:
        if kind == "cuda":
            return Device("cuda", int(_require_cuda(Device("cuda", 0)).cuda.Device().id))
        return CPU if kind == "cpu" else Device("host", 0)
    if kind == "cpu":
        if int(index) != 0:
            raise ValueError(f"the cpu device has only index 0 ('cpu' or 'cpu:0'), got {text!r}.")
        return CPU
    return _interned(kind, int(index))


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
    return "cuda" if cuda_device_count() > 0 else "host"


_host_array_census: Callable[[int], Mapping[Device, int]] | None = None


def set_host_array_census(census: Callable[[int], Mapping[Device, int]] | None, /) -> None:
    """Install ``census(first)``: how many arrays live on each ``host:k`` with ``k >= first``.

    :mod:`cupy_parallel._src.hostarray`, a layer above, installs it at import, so that
    :func:`set_host_device_count` can refuse to remove a device arrays still live on.

    Example:
        >>> set_host_array_census(_host_array_census)  # reinstall the one in place
    """
    global _host_array_census
    _host_array_census = census


def set_host_device_count(count: int, /) -> None:
    """Set how many ``"host:k"`` devices exist (overrides ``CUPY_PARALLEL_HOST_DEVICES``).

    Removing devices that host arrays still live on is refused: those arrays would be on a
    device that does not exist (torch cannot remove a GPU under its tensors). Fewer devices
    than now are checked by a scan of the objects Python's garbage collector tracks (after a
    collection when the first scan finds arrays, so that unreachable ones do not count), which
    costs each array nothing and takes milliseconds; a count that keeps every device is not
    checked. Changing ``CUPY_PARALLEL_HOST_DEVICES`` instead is not checked.

    Raises:
        TypeError: ``count`` is not an int.
        ValueError: ``count`` is below 1, or arrays live on a device ``count`` would remove (the
            message names the devices and how many arrays live on each).

    Example:
        >>> set_host_device_count(4)
        >>> [str(d) for d in devices()] if platform() == "host" else "not the host platform"
        ['host:0', 'host:1', 'host:2', 'host:3']
    """
    global _host_device_count
    count = read_int(count, "count", minimum=1)
    try:
        removes = count < host_device_count()
    except ValueError:  # CUPY_PARALLEL_HOST_DEVICES is unreadable: check every device
        removes = True
    if removes and _host_array_census is not None:
        live = _host_array_census(count)
        if live:
            gc.collect()  # arrays in unreachable cycles are garbage, not live
            live = _host_array_census(count)
        if live:
            where = ", ".join(
                f"{n} array{'s' if n > 1 else ''} on {device}"
                for device, n in sorted(live.items(), key=lambda item: item[0].index)
            )
            raise ValueError(
                f"set_host_device_count({count}) would remove host devices that arrays still "
                f"live on ({where}); delete those arrays or move them with "
                f"cupy_parallel.to_device(x, 'host:k') for k < {count} first."
            )
    _host_device_count = count


def host_device_count() -> int:
    """How many ``"host:k"`` devices exist (:func:`set_host_device_count`, else the environment).

    Example:
        >>> set_host_device_count(3)
        >>> host_device_count()
        3
    """
    if _host_device_count is not None:
        return _host_device_count
    text = os.environ.get("CUPY_PARALLEL_HOST_DEVICES", "1")
    digits = text.strip()
    if not (digits.isascii() and digits.isdigit()) or int(digits) < 1:
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
        return [Device("cuda", k) for k in range(cuda_device_count())]
    return [Device("host", k) for k in range(host_device_count())]


def check_exists(device: Device, /) -> None:
    """Raise ``ValueError`` unless ``device`` exists in this process (the cpu always does)."""
    if device.kind == "host":
        count = host_device_count()
        if device.index >= count:
            raise ValueError(
                f"device {device} does not exist: there are {count} host devices "
                "(set CUPY_PARALLEL_HOST_DEVICES or call set_host_device_count)."
            )
    elif device.kind == "cuda":
        _require_cuda(device)
        if device.index >= cuda_device_count():
            raise ValueError(
                f"device {device} does not exist: CuPy sees {cuda_device_count()} GPUs."
            )


def read_device(spec: Any, name: str, /) -> Device:
    """``as_device(spec)`` for a device that exists; errors name the argument ``name``."""
    try:
        device = as_device(spec)
        check_exists(device)
    except (TypeError, ValueError) as error:
        raise type(error)(f"{name} is not a usable device: {error}") from None
    return device


def read_devices(
    specs: Any, name: str, /, *, accelerators_only: bool, allow_empty: bool = False
) -> tuple[Device, ...]:
    """A sequence of existing devices, read at a public entry; errors name ``name[i]``.

    ``accelerators_only`` refuses ``"cpu"`` (arrays there are plain NumPy, placed nowhere);
    ``allow_empty`` accepts an empty sequence.
    """
    if (
        isinstance(specs, str | bytes | Mapping)
        or hasattr(specs, "__array_namespace__")  # an array, whatever its library
        or isinstance(specs, np.ndarray)
        or not isinstance(specs, Iterable)
    ):
        raise TypeError(
            f"{name} must be a sequence of devices, got {type(specs).__name__} {specs!r}; pass "
            "a list such as ['host:0', 'host:1'] or cupy_parallel.devices() (wrap a single "
            "device as [device])."
        )
    read = []
    for i, spec in enumerate(specs):
        device = read_device(spec, f"{name}[{i}]")
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
