"""The simulated CUDA against the installed CuPy: as strict as CuPy, and no stricter.

``cupy_parallel.testing.simulated_cuda`` stands in for CuPy on machines without a GPU, so every
name it offers must be CuPy's, at the same dotted path, of the same kind, with CuPy's parameters
and constants; and every CuPy name the library uses must exist in both. CuPy's Cython functions
refuse arguments of the wrong C type with ``TypeError`` before they reach CUDA, so argument
conversion is measured on the installed CuPy even without a GPU (a well-typed call fails later,
with a CUDA or NCCL error) and the simulator must refuse exactly the same arguments.

Where the simulator knowingly differs, an allow-list below says why.
"""

from __future__ import annotations

import ast
import contextlib
import enum
import importlib
import inspect
import itertools
import re
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cupy_parallel._src.simcuda import cuda as sim_cuda
from cupy_parallel._src.simcuda import memory as sim_memory
from cupy_parallel._src.simcuda import runtime as sim_runtime
from cupy_parallel._src.simcuda import sim_nccl
from cupy_parallel._src.simcuda import xp as sim_xp
from cupy_parallel._src.simcuda.cargs import as_c_int
from cupy_parallel.testing import simulated_cuda

cupy = pytest.importorskip("cupy", reason="needs CuPy (the test extra installs cupy-cuda12x)")
if int(cupy.__version__.split(".")[0]) < 14:
    pytest.skip("the simulated CUDA models CuPy >= 14", allow_module_level=True)


def _load_real_nccl() -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # CuPy warns when libnccl is missing
        try:
            from cupy.cuda import nccl
        except ImportError:
            return None
    return nccl if getattr(nccl, "available", False) else None


REAL_NCCL = _load_real_nccl()
NO_NCCL = "the real cupy.cuda.nccl does not load here (the test extra installs nvidia-nccl-cu12)"

# simulated namespace -> CuPy's dotted path
NAMESPACES: dict[str, Any] = {
    "cupy": sim_xp,
    "cupy.cuda": sim_cuda,
    "cupy.cuda.runtime": sim_runtime,
    "cupy.cuda.nccl": sim_nccl,
}
# simulated classes reached only through a function's result -> CuPy's class
RESULT_CLASSES: dict[str, Any] = {
    "cupy.cuda.MemoryPool": sim_memory.DevicePool,
    "cupy.cuda.PinnedMemoryPool": sim_memory.PinnedPool,
}

# Names the simulator offers that CuPy has not: test knobs and simulator hooks.
SIMULATOR_ONLY = {
    "cupy.simulation": "the running simulation (races, clocks), for tests",
    "cupy.cuda.nccl.set_deadlock_limit": "test knob: how long a call waits for its peers",
    "cupy.cuda.nccl.set_version": "test knob: the NCCL version the getters report",
    "cupy.cuda.nccl.NcclCommunicator.inject_async_error": "test knob: a peer's async error",
    "cupy.cuda.Stream.timeline": "the simulator's queue behind a stream (used by simulated NCCL)",
    "cupy.cuda.ExternalStream.timeline": "the simulator's queue behind a stream, as Stream's",
    "cupy.cuda.Event.op": "the recorded simulated operation (the race checker's clock)",
    "cupy.cuda.Event.device": "the device an event belongs to (CUDA's rule, checked at record)",
    "cupy.cuda.Memory.block": "the simulated memory block (the race checker's unit)",
    "cupy.cuda.Memory.chunk": "the piece of the block the simulated pool handed out (best fit)",
    "cupy.cuda.PinnedMemoryPointer.block": "the simulated memory block (the race checker's unit)",
    "cupy.cuda.MemoryPool.free": "takes back a block when its simulated Memory goes",
    "cupy.cuda.PinnedMemoryPool.free": "takes back a block when its simulated pinned pointer goes",
}
# Constants of the simulator that CuPy does not name: NCCL's ncclResult_t codes, checked
# against the name CuPy's NcclError gives each code instead.
NCCL_RESULT_PREFIX = "NCCL_ERROR_"

# Parameters the simulator knowingly models differently: path -> (simulated, reason).
SIGNATURE_DIFFERENCES = {
    "cupy.cuda.Memory": (
        ["chunk", "device", "simulation"],
        "made by the simulated pool from a chunk of a block; CuPy's Memory(size) calls cudaMalloc",
    ),
    "cupy.cuda.MemoryPool.malloc": (
        ["device", "size", "stream_key"],
        "the simulated pool is called by alloc() with the device and stream it allocates for",
    ),
}


# ---------------------------------------------------------------------------------------------
# Helpers: the real side


def real_object(path: str) -> Any:
    """CuPy's object at ``path`` (``ImportError`` when it has none)."""
    if path == "cupy.cuda.nccl" or path.startswith("cupy.cuda.nccl."):
        if REAL_NCCL is None:
            pytest.skip(NO_NCCL)
        obj: Any = REAL_NCCL
        rest = path.removeprefix("cupy.cuda.nccl").lstrip(".")
    else:
        obj, rest = cupy, path.removeprefix("cupy").lstrip(".")
    missing = object()
    for name in filter(None, rest.split(".")):
        found = getattr(obj, name, missing)
        if found is missing:  # a submodule not yet loaded, else ModuleNotFoundError
            found = importlib.import_module(f"{obj.__name__}.{name}")
        obj = found
    return obj


_DOC_LINE = re.compile(r"^\s*[\w.]+\((?P<params>.*)\)\s*(->.*)?$")


def doc_parameters(doc_line: str) -> list[tuple[str, str | None]]:
    """(name, C type or ``None``) of each parameter in a Cython signature line, self left out.

    A keyword-only parameter's name is written ``*name``; ``*args`` and ``**kwargs`` are left out.

    Example:
        >>> doc_parameters("memcpy(intptr_t dst, intptr_t src, size_t size, int kind)")[2]
        ('size', 'size_t')
        >>> doc_parameters("get(self, stream=None, *, bint blocking=True)")
        [('stream', None), ('*blocking', 'bint')]
    """
    match = _DOC_LINE.match(doc_line)
    if match is None:
        raise ValueError(f"not a Cython signature line: {doc_line!r}")
    out = []
    keyword_only = False
    for part in filter(None, (p.strip() for p in match["params"].split(","))):
        words = part.split("=")[0].split()
        name = words[-1]
        if name.startswith("*"):  # a bare *, *args or **kwargs: keyword-only from here
            keyword_only = True
            continue
        if name in ("self", "cls"):
            continue
        out.append(("*" * keyword_only + name, words[0] if len(words) > 1 else None))
    return out


def _named(doc_line: str) -> str:
    return doc_line.strip().split("(")[0].split(".")[-1]


def _signature_names(obj: Any) -> list[str]:
    """Parameter names from ``inspect.signature``, keyword-only ones written ``*name``."""
    return [
        f"*{p.name}" if p.kind == p.KEYWORD_ONLY else p.name
        for p in inspect.signature(obj).parameters.values()
        if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.name not in ("self", "cls")
    ]


def real_parameters(obj: Any) -> list[tuple[str, str | None]]:
    """CuPy's parameters of ``obj`` (a function, method or class): its Cython signature line,
    else its Python signature."""
    doc = (obj.__doc__ or "").strip().splitlines()
    if doc and _DOC_LINE.match(doc[0]) and _named(doc[0]) in (obj.__name__, "__init__"):
        return doc_parameters(doc[0])
    return [(name, None) for name in _signature_names(obj)]


def sim_parameters(obj: Any) -> list[str]:
    return _signature_names(obj)


def kind_of(obj: Any) -> str:
    if inspect.ismodule(obj):
        return "module"
    if isinstance(obj, type):
        return "class"
    if callable(obj):
        return "function"
    return "value"


def is_property(cls: type, name: str) -> bool:
    return any(
        inspect.isdatadescriptor(vars(klass).get(name))
        for klass in cls.__mro__
        if klass is not object
    )


# ---------------------------------------------------------------------------------------------
# The simulator's public names


def _module_names() -> list[str]:
    return sorted(
        f"{path}.{name}" for path, module in NAMESPACES.items() for name in module.__all__
    )


def _constants() -> list[str]:
    return sorted(
        f"{path}.{name}"
        for path, module in NAMESPACES.items()
        for name, value in vars(module).items()
        if not name.startswith("_") and type(value) is int
    )


def _classes() -> dict[str, type]:
    classes = {
        f"{path}.{name}": getattr(module, name)
        for path, module in NAMESPACES.items()
        for name in module.__all__
        if isinstance(getattr(module, name), type)
    }
    return {**classes, **RESULT_CLASSES}


def real_has(class_path: str, name: str) -> bool:
    """Whether CuPy's class at ``class_path``, or an instance made without a GPU, has ``name``."""
    cls = real_object(class_path)
    if hasattr(cls, name):
        return True
    instances = {
        "cupy.cuda.Stream": lambda: cls.null,
        "cupy.cuda.ExternalStream": lambda: _external_stream(cupy),
        "cupy.cuda.Device": lambda: cls(0),
    }
    make = instances.get(class_path)
    return make is not None and hasattr(make(), name)


def _external_stream(cupy_module: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # CuPy 14 deprecates it
        return cupy_module.cuda.ExternalStream(0)


def _instances(cp: Any) -> dict[str, Any]:
    """One simulated object of each class, for attributes set at construction."""
    pointer = cp.cuda.alloc(8)
    return {
        "cupy.cuda.Device": cp.cuda.Device(0),
        "cupy.cuda.Stream": cp.cuda.Stream(),
        "cupy.cuda.ExternalStream": _external_stream(cp),
        "cupy.cuda.Event": cp.cuda.Event(),
        "cupy.ndarray": cp.zeros(1),
        "cupy.cuda.nccl.NcclCommunicator": cp.cuda.nccl.NcclCommunicator.initAll(1)[0],
        "cupy.cuda.MemoryPointer": pointer,
        "cupy.cuda.Memory": pointer.mem,
        "cupy.cuda.PinnedMemoryPointer": cp.cuda.alloc_pinned_memory(8),
    }


def _members() -> list[str]:
    out = []
    for path, cls in _classes().items():
        if issubclass(cls, BaseException):
            continue  # CuPy's exceptions carry nothing public but the status
        for klass in cls.__mro__:
            if klass is object or klass.__module__.split(".")[0] == "ctypes":
                continue
            out.extend(f"{path}.{name}" for name in vars(klass) if not name.startswith("_"))
    return sorted(set(out))


@pytest.mark.parametrize("path", _module_names())
def test_public_name_is_cupys(path: str) -> None:
    """Every name a simulated namespace exports is CuPy's, and of the same kind."""
    if path in SIMULATOR_ONLY:
        pytest.skip(f"simulator only: {SIMULATOR_ONLY[path]}")
    module_path, name = path.rsplit(".", 1)
    sim = getattr(NAMESPACES[module_path], name)
    real = real_object(path)
    assert kind_of(sim) == kind_of(real), (
        f"{path}: simulated {kind_of(sim)}, CuPy's {kind_of(real)}"
    )


@pytest.mark.parametrize("path", _constants())
def test_constant_is_cupys(path: str) -> None:
    """``runtime.memcpyDeviceToDevice``, ``nccl.NCCL_FLOAT32``, ``NCCL_SUM``... equal CuPy's."""
    module_path, name = path.rsplit(".", 1)
    value = getattr(NAMESPACES[module_path], name)
    if name.startswith(NCCL_RESULT_PREFIX):
        if REAL_NCCL is None:
            pytest.skip(NO_NCCL)
        assert str(REAL_NCCL.NcclError(value)).startswith(f"{name}:")
        return
    assert value == real_object(path), path


def test_class_relations_are_cupys() -> None:
    """One simulated class derives from another exactly where CuPy's do (``ExternalStream`` is
    not a ``Stream``), so ``isinstance`` answers as on a GPU."""
    classes = {
        path: cls
        for path, cls in _classes().items()
        if not (path.startswith("cupy.cuda.nccl.") and REAL_NCCL is None)
    }
    wrong = [
        f"{a} {'is' if issubclass(ca, cb) else 'is not'} a subclass of {b} in the simulator"
        for (a, ca), (b, cb) in itertools.permutations(classes.items(), 2)
        if issubclass(ca, cb) != issubclass(real_object(a), real_object(b))
    ]
    assert not wrong


@pytest.mark.parametrize("path", sorted(_classes()))
def test_constructor_parameters_are_cupys(path: str) -> None:
    """Each simulated class is built with CuPy's parameters, in CuPy's order."""
    cls = _classes()[path]
    if issubclass(cls, BaseException):
        return  # NcclError(status), CUDARuntimeError(status): only raised, never built by callers
    if path in ("cupy.ufunc", "cupy.cuda.PinnedMemoryPointer") or path in RESULT_CLASSES:
        pytest.skip("built by the simulator (ufuncs, pinned allocations, pools), not by callers")
    _check_parameters(path, real_object(path), cls)


@pytest.mark.parametrize("path", _members())
def test_member_is_cupys(path: str) -> None:
    """Each public method and property of a simulated class is CuPy's, with CuPy's parameters."""
    if path in SIMULATOR_ONLY:
        pytest.skip(f"simulator only: {SIMULATOR_ONLY[path]}")
    class_path, name = path.rsplit(".", 1)
    cls = _classes()[class_path]
    real_class = real_object(class_path)
    assert real_has(class_path, name), f"CuPy's {class_path} has no {name}"
    sim, real = inspect.getattr_static(cls, name), getattr(real_class, name)
    if is_property(cls, name):
        assert not callable(real) or is_property(real_class, name), f"{path} is a method in CuPy"
        return
    if isinstance(sim, type(cls)) or not callable(getattr(cls, name)):  # Stream.null, ...
        assert kind_of(getattr(cls, name)) == kind_of(real), path
        return
    _check_parameters(path, real, getattr(cls, name))


def test_external_stream_is_deprecated_as_in_cupy() -> None:
    """CuPy 14 warns when an ``ExternalStream`` is made (errors under pytest): so does the
    simulator, with CuPy's words; its own handle lookups (NCCL's stream handles) do not warn."""
    with pytest.warns(DeprecationWarning, match="^ExternalStream is deprecated") as real:
        cupy.cuda.ExternalStream(0)
    with simulated_cuda(1) as cp:
        with pytest.warns(DeprecationWarning, match="^ExternalStream is deprecated") as sim:
            cp.cuda.ExternalStream(0)
        assert [str(w.message) for w in sim] == [str(w.message) for w in real]
        (comm,) = cp.cuda.nccl.NcclCommunicator.initAll(1)
        x = cp.zeros(1)
        stream = cp.cuda.Stream()
        comm.allReduce(x.data.ptr, x.data.ptr, 1, 8, 0, stream.ptr)  # no warning: an error here


def test_instance_attributes_are_cupys() -> None:
    """Attributes the simulated objects set in ``__init__`` (``ptr``, ``device_id``) are CuPy's."""
    missing = []
    with simulated_cuda(1) as cp:
        for path, instance in _instances(cp).items():
            if path.startswith("cupy.cuda.nccl.") and REAL_NCCL is None:
                continue
            for name in vars(instance):
                if name.startswith("_") or f"{path}.{name}" in SIMULATOR_ONLY:
                    continue
                if not real_has(path, name):
                    missing.append(f"{path}.{name}")
    assert not missing, f"CuPy has no {missing}"


def _functions() -> list[str]:
    return [
        path
        for path in _module_names()
        if path not in SIMULATOR_ONLY
        and kind_of(getattr(NAMESPACES[path.rsplit(".", 1)[0]], path.rsplit(".", 1)[1]))
        == "function"
    ]


@pytest.mark.parametrize("path", _functions())
def test_function_parameters_are_cupys(path: str) -> None:
    """Each simulated function takes CuPy's parameters, in CuPy's order, under CuPy's names."""
    module_path, name = path.rsplit(".", 1)
    _check_parameters(path, real_object(path), getattr(NAMESPACES[module_path], name))


def _check_parameters(path: str, real: Any, sim: Any) -> None:
    real_names = [name for name, _ in real_parameters(real)]
    sim_names = sim_parameters(sim)
    if path in SIGNATURE_DIFFERENCES:
        expected, reason = SIGNATURE_DIFFERENCES[path]
        assert sim_names == expected, f"{path}: the allow-list ({reason}) is out of date"
        assert sim_names != real_names, f"{path} now matches CuPy: drop its allow-list entry"
        return
    assert sim_names == real_names, f"{path}: simulated {sim_names}, CuPy's {real_names}"


# ---------------------------------------------------------------------------------------------
# The CuPy names the library uses

LIBRARY = Path(__file__).resolve().parents[1] / "cupy_parallel" / "_src"
# a name bound to CuPy (or its submodule) in the library's code -> its dotted path in CuPy
ROOTS = {
    "cupy": "cupy",
    "_cupy": "cupy",
    "xp": "cupy",  # the array module of the arrays at hand: CuPy's on a GPU
    "nccl": "cupy.cuda.nccl",
    "runtime": "cupy.cuda.runtime",
}
# CuPy members the library reaches through objects, which the scan cannot follow
MEMBER_USES = [
    "cupy.cuda.Device.id",
    "cupy.cuda.Event.record",
    "cupy.cuda.Event.synchronize",
    "cupy.cuda.Event.done",
    "cupy.cuda.MemoryPointer.copy_from_device_async",
    "cupy.cuda.MemoryPointer.copy_from_host_async",
    "cupy.cuda.MemoryPointer.ptr",
    "cupy.cuda.Stream.launch_host_func",
    "cupy.cuda.Stream.ptr",
    "cupy.cuda.Stream.wait_event",
    "cupy.cuda.Stream.synchronize",
    "cupy.cuda.Stream.record",
    "cupy.cuda.Stream.use",
    "cupy.cuda.nccl.NcclCommunicator.abort",
    "cupy.cuda.nccl.NcclCommunicator.allGather",
    "cupy.cuda.nccl.NcclCommunicator.allReduce",
    "cupy.cuda.nccl.NcclCommunicator.bcast",
    "cupy.cuda.nccl.NcclCommunicator.broadcast",
    "cupy.cuda.nccl.NcclCommunicator.check_async_error",
    "cupy.cuda.nccl.NcclCommunicator.destroy",
    "cupy.cuda.nccl.NcclCommunicator.recv",
    "cupy.cuda.nccl.NcclCommunicator.reduce",
    "cupy.cuda.nccl.NcclCommunicator.reduceScatter",
    "cupy.cuda.nccl.NcclCommunicator.send",
    "cupy.ndarray.data",
    "cupy.ndarray.device",
    "cupy.ndarray.flags",
    "cupy.ndarray.get",
    "cupy.ndarray.nbytes",
    "cupy.ndarray.set",
]


def _chain(node: ast.AST) -> list[str] | None:
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id, *reversed(names)]
    return None


def library_uses() -> set[str]:
    """Every ``cupy.…``, ``xp.…``, ``nccl.…``, ``runtime.…`` chain of the library but ``simcuda/``.

    A name a module imports from ``cupy_parallel`` (``transfer.py``'s ``nccl`` is the library's
    own) is not CuPy's; ``self._cupy`` is.
    """
    found = set()
    for file in sorted(LIBRARY.rglob("*.py")):
        if "simcuda" in file.parts:
            continue
        tree = ast.parse(file.read_text(), str(file))
        own = {
            alias.asname or alias.name
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("cupy_parallel")
            for alias in node.names
        }
        inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or id(node) in inner:
                continue
            chain = _chain(node)
            if chain is None:
                continue
            if chain[0] == "self" and len(chain) > 2 and chain[1] == "_cupy":
                chain = chain[1:]
            root = ROOTS.get(chain[0])
            if root is None or chain[0] in own:
                continue
            found.add(".".join([root, *chain[1:]]))
    return found


def _sim_object(cp: Any, path: str) -> Any:
    obj = cp
    for name in path.split(".")[1:]:
        obj = getattr(obj, name)
    return obj


@pytest.mark.slow
def test_library_scan_finds_the_known_uses() -> None:
    """The scan is the source of truth: it must at least see what the library is known to use."""
    known = {
        "cupy.cuda.Device",
        "cupy.cuda.Stream",
        "cupy.cuda.runtime.getDeviceCount",
        "cupy.cuda.runtime.memcpyAsync",
        "cupy.cuda.runtime.memcpyDeviceToDevice",
        "cupy.cuda.nccl.NcclCommunicator.initAll",
        "cupy.cuda.nccl.groupStart",
        "cupy.cuda.alloc_pinned_memory",
    }
    assert known <= library_uses()


@pytest.mark.parametrize("path", sorted(library_uses() | set(MEMBER_USES)))
def test_library_use_exists_in_both(path: str) -> None:
    """Every CuPy name the library uses exists in CuPy and in the simulated CUDA."""
    class_path, name = path.rsplit(".", 1)
    with simulated_cuda(1) as cp:
        instances = _instances(cp)
        if class_path in instances:  # a member, perhaps set in __init__
            assert real_has(class_path, name), f"CuPy's {class_path} has no {name}"
            assert hasattr(instances[class_path], name), f"the simulated {class_path} has no {name}"
            return
        real_object(path)  # AttributeError: CuPy has no such name
        _sim_object(cp, path)


# ---------------------------------------------------------------------------------------------
# Argument conversion: the simulator refuses exactly what CuPy's Cython refuses


class _Zero(enum.IntEnum):
    ZERO = 0


class _IndexOnly:
    def __index__(self) -> int:
        return 0


def _probes(pointer: Any) -> dict[str, Any]:
    """Values of many Python types, all zero (safe to pass anywhere), by name."""
    return {
        "int": 0,
        "bool": False,
        "IntEnum": _Zero.ZERO,
        "numpy.int64": np.int64(0),
        "numpy.uint64": np.uint64(0),
        "float": 0.0,
        "numpy.float32": np.float32(0),
        "MemoryPointer": pointer,
        "__index__ only": _IndexOnly(),
        "str": "0",
        "None": None,
    }


C_TYPES = ("int", "size_t", "intptr_t", "ptrdiff_t")

NCCL_METHODS = {
    "allReduce": 6,
    "reduce": 7,
    "broadcast": 6,
    "bcast": 5,
    "reduceScatter": 6,
    "allGather": 5,
    "send": 5,
    "recv": 5,
}


def _real_cases() -> dict[str, tuple[Any, list[Any]]]:
    """CuPy's callable and well-typed all-zero arguments, by path (no GPU is needed)."""
    pointer = cupy.cuda.MemoryPointer.__new__(cupy.cuda.MemoryPointer)  # ptr 0
    runtime = cupy.cuda.runtime
    cases: dict[str, tuple[Any, list[Any]]] = {
        "cupy.cuda.runtime.memcpyAsync": (runtime.memcpyAsync, [0, 0, 0, 0, 0]),
        "cupy.cuda.runtime.memcpy": (runtime.memcpy, [0, 0, 0, 0]),
        "cupy.cuda.runtime.memcpyPeerAsync": (runtime.memcpyPeerAsync, [0, 0, 0, 0, 0, 0]),
        "cupy.cuda.runtime.memcpyPeer": (runtime.memcpyPeer, [0, 0, 0, 0, 0]),
        "cupy.cuda.runtime.setDevice": (runtime.setDevice, [0]),
        "cupy.cuda.runtime.deviceCanAccessPeer": (runtime.deviceCanAccessPeer, [0, 0]),
        "cupy.cuda.runtime.getDeviceProperties": (runtime.getDeviceProperties, [0]),
        "cupy.cuda.runtime.streamSynchronize": (runtime.streamSynchronize, [0]),
        "cupy.cuda.get_current_stream": (cupy.cuda.get_current_stream, [0]),
        "cupy.cuda.alloc": (cupy.cuda.alloc, [0]),
        "cupy.cuda.alloc_pinned_memory": (cupy.cuda.alloc_pinned_memory, [0]),
        "cupy.cuda.MemoryPointer": (
            cupy.cuda.MemoryPointer,
            [cupy.cuda.memory.UnownedMemory(0, 0, None, 0), 0],
        ),
        "cupy.cuda.MemoryPointer.memset_async": (pointer.memset_async, [0, 0]),
        "cupy.cuda.MemoryPointer.copy_from_device_async": (
            pointer.copy_from_device_async,
            [pointer, 0],
        ),
        "cupy.cuda.MemoryPointer.copy_from_device": (pointer.copy_from_device, [pointer, 0]),
        "cupy.cuda.MemoryPointer.copy_from_host_async": (pointer.copy_from_host_async, [0, 0]),
        "cupy.cuda.MemoryPointer.copy_to_host_async": (pointer.copy_to_host_async, [0, 0]),
    }
    if REAL_NCCL is not None:
        comm = REAL_NCCL.NcclCommunicator.__new__(REAL_NCCL.NcclCommunicator)  # no NCCL comm
        # a real unique id: on a GPU, a one-rank communicator then forms at once
        uid = REAL_NCCL.get_unique_id()
        cases["cupy.cuda.nccl.NcclCommunicator"] = (REAL_NCCL.NcclCommunicator, [1, uid, 0])
        for name, n in NCCL_METHODS.items():
            cases[f"cupy.cuda.nccl.NcclCommunicator.{name}"] = (getattr(comm, name), [0] * n)
    return cases


def _sim_call(cp: Any, path: str, args: list[Any]) -> None:
    """Call the simulated ``path`` with ``args`` (zero unless probed) in simulation ``cp``."""
    pointer = cp.cuda.alloc(0)  # ptr 0
    name = path.rsplit(".", 1)[1]
    if path.startswith("cupy.cuda.nccl.NcclCommunicator."):
        nccl = cp.cuda.nccl
        (comm,) = nccl.NcclCommunicator.initAll(1)
        partner = {"send": "recv", "recv": "send"}.get(name)
        nccl.groupStart()
        try:
            getattr(comm, name)(*args)
            if partner is not None:  # rank 0 sends to itself: the matching call, in one group
                getattr(comm, partner)(0, 0, nccl.NCCL_FLOAT32, 0, 0)
        finally:
            with contextlib.suppress(Exception):
                nccl.groupEnd()
        return
    if path == "cupy.cuda.nccl.NcclCommunicator":
        cp.cuda.nccl.NcclCommunicator(*args)
        return
    if path == "cupy.cuda.MemoryPointer":
        cp.cuda.MemoryPointer(pointer.mem, *args[1:])
        return
    if path.startswith("cupy.cuda.MemoryPointer."):
        if name.startswith("copy_from_device"):
            args = [pointer, *args[1:]]
        getattr(pointer, name)(*args)
        return
    _sim_object(cp, path)(*args)


def _refuses(call: Any) -> bool:
    """Whether ``call`` fails converting its arguments (TypeError); any other outcome accepts."""
    try:
        call()
    except TypeError:
        return True
    except Exception:  # noqa: BLE001 - CUDA/NCCL errors (no GPU), SimulationError: accepted
        return False
    return False


# Parameters whose C type CuPy's signature line does not show: path -> (name, C type)
UNTYPED_LINES = {
    "cupy.cuda.alloc": [("size", "size_t")],  # alloc(size) hands it to MemoryPool.malloc(size_t)
}


def _c_typed(path: str, real: Any) -> list[tuple[int, str, str]]:
    """(index, name, C type) of each C-integer parameter, from CuPy's signature line."""
    params = UNTYPED_LINES.get(path) or real_parameters(real)
    return [(i, name, ctype) for i, (name, ctype) in enumerate(params) if ctype in C_TYPES]


def _conversion_cases() -> list[str]:
    paths = sorted(_real_cases())
    if REAL_NCCL is None:
        paths += [f"cupy.cuda.nccl.NcclCommunicator.{name}" for name in NCCL_METHODS]
    return paths


@pytest.mark.parametrize("path", _conversion_cases())
def test_argument_conversion_is_cupys(path: str) -> None:
    """Each C-integer parameter refuses (TypeError) exactly the values CuPy refuses."""
    cases = _real_cases()
    if path not in cases:
        pytest.skip(NO_NCCL)
    real, defaults = cases[path]
    typed = _c_typed(path, real_object(path))
    assert typed, f"{path}: no C-integer parameters found in CuPy's signature"
    real_pointer = cupy.cuda.MemoryPointer.__new__(cupy.cuda.MemoryPointer)
    mismatches = []
    with warnings.catch_warnings(), simulated_cuda(1) as cp:
        warnings.simplefilter("ignore", DeprecationWarning)
        sim_pointer = cp.cuda.alloc(0)
        for index, name, ctype in typed:
            real_values, sim_values = _probes(real_pointer), _probes(sim_pointer)
            for label, value in real_values.items():
                real_args = list(defaults)
                real_args[index] = value
                sim_args = list(defaults)
                sim_args[index] = sim_values[label]
                cupy_refuses = _refuses(lambda args=real_args: real(*args))
                sim_refuses = _refuses(lambda args=sim_args: _sim_call(cp, path, args))
                if cupy_refuses != sim_refuses:
                    mismatches.append(
                        f"{name} ({ctype}) = {label}: CuPy "
                        f"{'refuses' if cupy_refuses else 'accepts'}, the simulator "
                        f"{'refuses' if sim_refuses else 'accepts'}"
                    )
    assert not mismatches, f"{path}:\n" + "\n".join(mismatches)


def _real_converter(ctype: str) -> Any:
    """A CuPy call taking one ``ctype`` value that fails before touching memory, even on a GPU.

    Out-of-range sizes must never reach a copy: with a GPU, NCCL calls on a communicator that
    was never made (``NULL``) fail at once; without NCCL, CUDA calls are used only where no GPU
    is visible (they fail at the driver).
    """
    if ctype == "ptrdiff_t":  # pointer arithmetic only
        memory = cupy.cuda.memory.UnownedMemory(0, 0, None, 0)
        return lambda v: cupy.cuda.MemoryPointer(memory, v)
    if REAL_NCCL is not None:
        comm = REAL_NCCL.NcclCommunicator.__new__(REAL_NCCL.NcclCommunicator)
        return {
            "int": lambda v: comm.allReduce(0, 0, 0, v, 0, 0),
            "size_t": lambda v: comm.allReduce(0, 0, v, 7, 0, 0),
            "intptr_t": lambda v: comm.allReduce(v, 0, 0, 7, 0, 0),
        }[ctype]
    if cupy.cuda.is_available():
        pytest.skip(NO_NCCL + "; CUDA calls with out-of-range values are unsafe on a GPU")
    runtime = cupy.cuda.runtime
    return {
        "int": runtime.setDevice,
        "size_t": lambda v: runtime.memcpy(0, 0, v, 0),
        "intptr_t": runtime.streamSynchronize,
    }[ctype]


@pytest.mark.parametrize("ctype", C_TYPES)
def test_as_c_int_is_cythons_rule(ctype: str) -> None:
    """``as_c_int`` against CuPy's own conversion of each value, on a function of that C type."""
    pointer = cupy.cuda.MemoryPointer.__new__(cupy.cuda.MemoryPointer)
    real = _real_converter(ctype)
    for label, value in _probes(pointer).items():
        refused = _refuses(lambda v=value: as_c_int(v, "x", ctype))  # type: ignore[arg-type]
        assert refused == _refuses(lambda v=value: real(v)), f"{ctype} = {label}"
    for big in (1 << 31, 1 << 63, 1 << 64, -1, -(1 << 63) - 1):
        error: type[BaseException] | None = None
        try:
            real(big)
        except OverflowError as caught:
            error = type(caught)
            message = str(caught)
        except Exception:  # noqa: BLE001 - accepted: a CUDA error follows
            pass
        if error is None:
            assert as_c_int(big, "x", ctype) == big  # type: ignore[arg-type]
        else:
            with pytest.raises(OverflowError, match=re.escape(message)):
                as_c_int(big, "x", ctype)  # type: ignore[arg-type]


def test_simulated_nccl_names_the_parameter_it_refuses() -> None:
    """A ``MemoryPointer`` where NCCL takes an ``intptr_t`` fails as on a GPU, naming it."""
    with simulated_cuda(1) as cp:
        nccl = cp.cuda.nccl
        (comm,) = nccl.NcclCommunicator.initAll(1)
        x = cp.zeros(2, np.float32)
        args = (x.data.ptr, 2, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, 0)
        refused = r"^an integer is required \(parameter 'sendbuf' is intptr_t, got MemoryPointer\)$"
        with pytest.raises(TypeError, match=refused):
            comm.allReduce(x.data, *args)
        with pytest.raises(TypeError, match=r"parameter 'stream' is intptr_t, got Stream\)$"):
            comm.allReduce(x.data.ptr, *args[:-1], cp.cuda.Stream.null)
        with pytest.raises(TypeError, match=r"parameter 'count' is size_t, got NoneType\)$"):
            comm.allReduce(x.data.ptr, x.data.ptr, None, *args[2:])
        comm.allReduce(x.data.ptr, x.data.ptr, np.uint64(2), *args[2:])  # size_t: NumPy is fine
