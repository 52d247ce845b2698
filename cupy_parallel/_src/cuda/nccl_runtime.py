"""The one NCCL runtime: the loader, "is NCCL available", grouped launches and communicator sets.

One vocabulary for every NCCL user of the library (``comm``'s collectives in :mod:`.nccl_comm`,
the ``"nccl"`` process-group backend, ``is_nccl_available`` and ``cupy-parallel info``):
:func:`nccl_module` is the only place that loads ``cupy.cuda.nccl`` (CuPy warns when libnccl is
missing, so the import is silenced here and the reason is reported by :func:`unavailable_reason`
instead), :func:`is_available` is the one meaning of "NCCL is available" (CuPy, its libnccl, and
a visible GPU), :func:`nccl_version` the version features are gated on, and dtypes and
reductions go through :mod:`.nccl_tables`. Under ``cupy_parallel.testing.simulated_cuda`` the
simulated CuPy brings its own ``cuda.nccl``, which the loader returns.

:class:`Communicators` is the one communicator cache and the one grouped-launch lock:

- NCCL requires every member of a communicator to issue its calls in the same order, so two
  threads must never interleave their ``groupStart`` ... ``groupEnd`` blocks on the same
  communicators (interleaved groups deadlock or mix data). :meth:`Communicators.group` holds the
  set's *launch lock* from ``groupStart`` to ``groupEnd`` (torch's ``AutoNcclGroup``).
- :meth:`Communicators.get_or_make` makes a set once per tuple of devices, under the set's
  *setup lock* (two threads' first calls make one set, not two), and
  :meth:`Communicators.take_all` hands every set back for ``destroy()`` or ``abort()``.

Its users keep their own instances, since their communicators differ: ``comm`` has one
process-wide instance keyed by the GPUs of a call (``initAll`` communicators, whose ranks are
the positions of those GPUs), and one re-entrant lock is both its launch and its setup lock
(so ``initAll`` inside a group is fine). Each process group has its own instance, keyed by the
local GPUs of a call (members of a communicator spanning the processes of the group), with
separate plain locks: a group's set-up waits for its peers up to the group's timeout and must
not hold up launches on communicators already made, and a launch of one group must not wait for
another group's (in the tests ranks are threads of one process: a process-wide launch lock held
by rank 0 in a ``groupEnd`` waiting for rank 1 would keep rank 1 from ever issuing its call).

Lock order: a setup lock, then the cache's own lock; a launch lock, then nothing of the runtime;
the cache's own lock is a leaf (held only to store or swap the dictionary), so a caller may take
it (through :meth:`~Communicators.take_all`) under its own locks. An abort must never need a
launch lock: it is what makes a ``groupEnd`` blocked under one return.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import warnings
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from cupy_parallel._src.devices import cuda_device_count, cupy_module

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from types import ModuleType

__all__ = [
    "Communicators",
    "device_ids",
    "is_available",
    "nccl_module",
    "nccl_version",
    "require_nccl",
    "unavailable_reason",
]

_loaded: dict[str, ModuleType | None] = {}  # the import of the real cupy.cuda.nccl, once


def nccl_module() -> ModuleType | None:
    """``cupy.cuda.nccl`` when CuPy is installed and its libnccl loads, else ``None``.

    Under the simulated CUDA this is the simulated NCCL.

    Example:
        >>> m = nccl_module()
        >>> m is None or bool(m.available)
        True
    """
    cupy = cupy_module()
    if cupy is None:
        return None
    if sys.modules.get("cupy") is not cupy:  # a stand-in CuPy carries its own NCCL
        own = getattr(cupy.cuda, "nccl", None)
        return own if own is not None and getattr(own, "available", False) else None
    if "nccl" not in _loaded:
        _loaded["nccl"] = _import_nccl()
    return _loaded["nccl"]


def _import_nccl() -> ModuleType | None:
    with warnings.catch_warnings():
        # CuPy warns when libnccl is missing; unavailable_reason() reports it instead.
        warnings.simplefilter("ignore")
        try:
            from cupy.cuda import nccl
        except ImportError:
            return None
    return nccl if getattr(nccl, "available", False) else None


def _nccl_package(cupy: Any) -> str:
    """The pip package that brings libnccl for the CUDA major version CuPy was built for."""
    try:
        major = int(cupy.cuda.runtime.runtimeGetVersion()) // 1000
    except Exception:  # noqa: BLE001 - no runtime library at all: name the common case
        major = 12
    return f"nvidia-nccl-cu{major}"


def unavailable_reason() -> str | None:
    """Why NCCL cannot be used here, or ``None`` when it can (see :func:`is_available`).

    Example:
        >>> reason = unavailable_reason()
        >>> reason is None or "NCCL" in reason or "CuPy" in reason
        True
    """
    cupy = cupy_module()
    if cupy is None:
        return "CuPy is not installed; install it with `pip install cupy-parallel[cuda12]`."
    if nccl_module() is None:
        return (
            "CuPy is installed, but its NCCL library (libnccl) cannot be loaded; install NCCL "
            f"for CuPy's CUDA version (`pip install {_nccl_package(cupy)}`)."
        )
    if cuda_device_count() == 0:
        return (
            "CuPy and NCCL load, but CuPy sees no GPU (no CUDA device is visible: check the "
            "driver with `nvidia-smi` and CUDA_VISIBLE_DEVICES, or use the 'mpi' backend)."
        )
    return None


def is_available() -> bool:
    """Whether NCCL can be used: CuPy is installed, its libnccl loads, and a GPU is visible.

    The one meaning of "NCCL is available" in the library (``comm``, the ``"nccl"`` backend,
    ``is_nccl_available``, ``cupy-parallel info``).

    Example:
        >>> is_available() in (True, False)
        True
    """
    return unavailable_reason() is None


def nccl_version(nccl: Any, /) -> int:
    """The NCCL version code features are gated on: the older of the built and loaded ones.

    Example:
        >>> import types
        >>> nccl_version(types.SimpleNamespace(get_version=lambda: 21805,
        ...                                    get_build_version=lambda: 2708))
        2708
    """
    return min(int(nccl.get_version()), int(nccl.get_build_version()))


def require_nccl() -> tuple[ModuleType, ModuleType]:
    """``(cupy.cuda.nccl, cupy)``, or ``RuntimeError`` saying why NCCL is not available."""
    nccl, cupy = nccl_module(), cupy_module()
    if nccl is None or cupy is None:
        raise RuntimeError(f"NCCL is not available: {unavailable_reason()}")
    return nccl, cupy


def device_ids(arrays: Sequence[Any], /) -> tuple[int, ...]:
    """The GPU of each CuPy array, in order: the key of a set of :class:`Communicators`."""
    return tuple(int(x.device.id) for x in arrays)


class Communicators(Mapping[tuple[int, ...], list[Any]]):
    """NCCL communicators by the tuple of devices they serve, and the lock their launches hold.

    ``launch_lock`` is held from ``groupStart`` to ``groupEnd`` (:meth:`group`), ``setup_lock``
    while a set is made (:meth:`get_or_make`); they may be one re-entrant lock. See the module's
    docstring for why ``comm`` and each process group keep their own instance. Read as a
    mapping, it holds the sets made so far.

    Example:
        >>> import threading, types
        >>> lock = threading.RLock()
        >>> sets = Communicators(launch_lock=lock, setup_lock=lock)
        >>> sets.get_or_make((0, 1), lambda devices: [f"GPU {d}" for d in devices])
        ['GPU 0', 'GPU 1']
        >>> sets.get_or_make((0, 1), lambda devices: [])  # made once
        ['GPU 0', 'GPU 1']
        >>> calls = []
        >>> nccl = types.SimpleNamespace(groupStart=lambda: calls.append("start"),
        ...                              groupEnd=lambda: calls.append("end"))
        >>> with sets.group(nccl):
        ...     calls.append("issue")
        >>> calls, list(sets), sets.take_all(), sets == {}
        (['start', 'issue', 'end'], [(0, 1)], ['GPU 0', 'GPU 1'], True)
    """

    def __init__(
        self,
        *,
        launch_lock: contextlib.AbstractContextManager[Any],
        setup_lock: contextlib.AbstractContextManager[Any],
    ) -> None:
        self._launch_lock = launch_lock
        self._setup_lock = setup_lock
        self._lock = threading.Lock()  # a leaf: guards storing into and swapping _made
        self._made: dict[tuple[int, ...], list[Any]] = {}

    def __getitem__(self, devices: tuple[int, ...], /) -> list[Any]:
        return self._made[devices]

    def __iter__(self) -> Iterator[tuple[int, ...]]:
        return iter(list(self._made))

    def __len__(self) -> int:
        return len(self._made)

    def get_or_make(
        self, devices: tuple[int, ...], make: Callable[[tuple[int, ...]], list[Any]], /
    ) -> list[Any]:
        """The set for ``devices``, made by ``make(devices)`` on first use, once for all threads.

        An error of ``make`` propagates and nothing is stored.
        """
        comms = self._made.get(devices)
        if comms is not None:
            return comms
        with self._setup_lock:  # two threads make one set, not two
            comms = self._made.get(devices)
            if comms is None:
                comms = make(devices)
                with self._lock:
                    self._made[devices] = comms
        return comms

    @contextlib.contextmanager
    def group(self, nccl: Any, /) -> Iterator[None]:
        """``groupStart`` ... ``groupEnd`` under the launch lock (torch's ``AutoNcclGroup``).

        Decided (issue 37, on the second pass's defect 4): an abort does *not* take this lock.
        ``ncclCommAbort`` from another thread (the watchdog, a blocking ``wait(timeout=...)``)
        while a thread holds the lock inside a stuck ``groupEnd`` is what abort exists for: it
        makes that ``groupEnd`` return, and torch's watchdog aborts the same way. Waiting for
        the lock first would wait for the very call the abort must end.
        """
        with self._launch_lock:  # until groupEnd
            nccl.groupStart()
            try:
                yield
            finally:
                nccl.groupEnd()

    def take_all(self) -> list[Any]:
        """Forget every set; their communicators, for ``destroy()`` or ``abort()``."""
        with self._lock:
            made, self._made = self._made, {}
        return [comm for comms in made.values() for comm in comms]
