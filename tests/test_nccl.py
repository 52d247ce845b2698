"""The NCCL backend without a GPU: import, dtype/op tables, the unique id through real stores."""

from __future__ import annotations

import ctypes
import enum
import os
import re
import subprocess
import sys
import threading
import time
import types
import warnings
from datetime import timedelta
from typing import Any, ClassVar

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from cupy_parallel import distributed as dist
from cupy_parallel._src.devices import _cuda_device_count, cupy_module
from cupy_parallel._src.distributed import groups
from cupy_parallel._src.distributed import nccl as nccl_backend
from cupy_parallel._src.distributed.enums import Backend, ReduceOp
from cupy_parallel._src.distributed.nccl_tables import (
    AVG_VERSION,
    P2P_VERSION,
    NcclDataType,
    NcclRedOp,
    Reduction,
    reduction,
    transfer,
    version_code,
    version_string,
)
from cupy_parallel._src.distributed.store import FileStore, TCPStore

# The reductions NCCL has (ReduceOp.BAND/BOR/BXOR are refused before the tables are asked).
NCCL_OPS = [op for op in ReduceOp if op in nccl_backend.NCCLBackend.reduce_ops]

NEW = version_code(2, 18, 5)  # has ncclAvg and bfloat16
OLD = version_code(2, 9, 9)  # has neither

REDUCIBLE = [
    "bool", "int8", "uint8", "int32", "uint32", "int64", "uint64",
    "float16", "float32", "float64", "complex64", "complex128",
]  # fmt: skip
NOT_REDUCIBLE = ["int16", "uint16", "datetime64[s]", "S4"]

# NcclDataType -> the NumPy dtype of its values (the test's own reading of NCCL's names).
WIRE_NUMPY = {
    NcclDataType.INT8: np.int8,
    NcclDataType.UINT8: np.uint8,
    NcclDataType.INT32: np.int32,
    NcclDataType.UINT32: np.uint32,
    NcclDataType.INT64: np.int64,
    NcclDataType.UINT64: np.uint64,
    NcclDataType.FLOAT16: np.float16,
    NcclDataType.FLOAT32: np.float32,
    NcclDataType.FLOAT64: np.float64,
}


def _real_nccl() -> types.ModuleType | None:
    if cupy_module() is None:
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from cupy.cuda import nccl
    return nccl if nccl.available else None


# ---------------------------------------------------------------------------------------------
# Import and availability


def test_module_imports_without_nccl_and_warns_nothing() -> None:
    # A fresh interpreter with warnings as errors: importing and probing must stay silent.
    code = (
        "import cupy_parallel._src.distributed.nccl as m; "
        "from cupy_parallel import distributed as d; "
        "print(m.nccl_module() is not None, d.is_nccl_available())"
    )
    out = subprocess.run(
        [sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, check=True
    )
    assert out.stderr == ""
    loads, available = out.stdout.split()
    assert loads == str(_real_nccl() is not None)
    assert available == str(_real_nccl() is not None and _cuda_device_count() > 0)


def test_is_nccl_available_tells_the_truth() -> None:
    truth = _real_nccl() is not None and _cuda_device_count() > 0
    assert dist.is_nccl_available() is truth
    assert nccl_backend.NCCLBackend.is_available() is truth


@pytest.mark.parametrize(
    ("cupy", "nccl", "gpus", "why"),
    [
        (
            False,
            False,
            0,
            r"CuPy is not installed; install it with `pip install cupy-parallel\[cuda12\]`",
        ),
        (True, False, 0, r"CuPy is installed, but its NCCL library \(libnccl\) cannot be loaded"),
        (True, True, 0, r"CuPy and NCCL load, but CuPy sees no GPU \(no CUDA device is visible"),
    ],
)
def test_unavailable_backend_says_what_is_missing(
    monkeypatch: pytest.MonkeyPatch, cupy: bool, nccl: bool, gpus: int, why: str
) -> None:
    monkeypatch.setattr(
        nccl_backend, "cupy_module", lambda: types.SimpleNamespace() if cupy else None
    )
    monkeypatch.setattr(nccl_backend, "nccl_module", lambda: _fake_nccl(NEW) if nccl else None)
    monkeypatch.setattr(nccl_backend, "_cuda_device_count", lambda: gpus)
    assert not nccl_backend.NCCLBackend.is_available()
    with pytest.raises(RuntimeError, match=rf"^The 'nccl' backend is not available here: {why}"):
        groups._backend_class(Backend.NCCL)
    monkeypatch.setattr(nccl_backend, "_cuda_device_count", lambda: 1)
    assert nccl_backend.NCCLBackend.is_available() is (cupy and nccl)


@pytest.mark.skipif(_real_nccl() is not None, reason="NCCL loads here")
def test_backend_refuses_to_start_without_nccl() -> None:
    with pytest.raises(
        RuntimeError, match=r"cannot start: CuPy is installed, but its NCCL library"
    ):
        nccl_backend.NCCLBackend(0, 1, store=None, timeout=1.0, group_name="0")


# ---------------------------------------------------------------------------------------------
# Constants and versions


@pytest.mark.skipif(_real_nccl() is None, reason="cupy.cuda.nccl does not load here")
@pytest.mark.parametrize("enum", [NcclDataType, NcclRedOp])
def test_constants_match_cupy_by_name(enum: type[NcclDataType] | type[NcclRedOp]) -> None:
    nccl = _real_nccl()
    for member in enum:
        assert getattr(nccl, f"NCCL_{member.name}") == member.value, member


@pytest.mark.parametrize("enum", [NcclDataType, NcclRedOp])
def test_constants_are_distinct_and_dense(enum: type[NcclDataType] | type[NcclRedOp]) -> None:
    # ncclDataType_t and ncclRedOp_t number their members 0, 1, 2, ...
    assert sorted(m.value for m in enum) == list(range(len(enum)))


@pytest.mark.parametrize(
    ("version", "text"),
    [((2, 4, 8), "2.4.8"), ((2, 8, 4), "2.8.4"), ((2, 9, 6), "2.9.6"), ((2, 21, 5), "2.21.5")],
)
def test_version_code_matches_nccl_macro(version: tuple[int, int, int], text: str) -> None:
    major, minor, patch = version
    # NCCL_VERSION(X, Y, Z): X*1000+Y*100+Z up to 2.8, X*10000+Y*100+Z from 2.9.
    expected = major * (1000 if minor <= 8 else 10000) + minor * 100 + patch
    assert version_code(*version) == expected
    assert version_string(expected) == text


def test_version_gates() -> None:
    assert version_code(2, 9, 99) < AVG_VERSION <= version_code(2, 10, 0) < version_code(2, 10, 3)
    assert version_code(2, 6, 4) < P2P_VERSION == version_code(2, 7, 0)


# ---------------------------------------------------------------------------------------------
# The reduction table: every (dtype, ReduceOp) either maps or raises a pinned error


def _refusal(dtype: str, op: ReduceOp) -> str | None:
    """The test's statement of what NCCL refuses (None: it reduces)."""
    if dtype in NOT_REDUCIBLE:
        shown = re.escape(str(np.dtype(dtype)))
        return rf"NCCL cannot reduce {shown} arrays \(ReduceOp\.{op.name}\): it reduces bool,"
    if dtype == "bool" and op is ReduceOp.AVG:
        return r"cannot reduce bool arrays with ReduceOp\.AVG: the mean of booleans"
    if dtype.startswith("complex") and op is ReduceOp.PRODUCT:
        return rf"cannot reduce {dtype} arrays with ReduceOp\.PRODUCT: NCCL reduces complex"
    if dtype.startswith("complex") and op in (ReduceOp.MIN, ReduceOp.MAX):
        return rf"cannot reduce {dtype} arrays with ReduceOp\.{op.name}: complex numbers have no"
    return None


@pytest.mark.parametrize("op", NCCL_OPS, ids=lambda op: op.name)
@pytest.mark.parametrize("dtype", REDUCIBLE + NOT_REDUCIBLE)
def test_every_dtype_and_op_maps_or_is_refused(dtype: str, op: ReduceOp) -> None:
    refusal = _refusal(dtype, op)
    for version in (OLD, NEW):
        if refusal is not None:
            with pytest.raises(TypeError, match=refusal):
                reduction(np.dtype(dtype), op, version)
            continue
        plan = reduction(np.dtype(dtype), op, version)
        wire = np.dtype(WIRE_NUMPY[plan.datatype])
        assert plan.lanes * wire.itemsize == np.dtype(dtype).itemsize
        assert plan.divide == (op is ReduceOp.AVG and version < AVG_VERSION)
        if op is ReduceOp.AVG:
            assert plan.op is (NcclRedOp.SUM if version < AVG_VERSION else NcclRedOp.AVG)


@pytest.mark.parametrize("name", REDUCIBLE)
def test_wire_type_is_the_dtype_itself(name: str) -> None:
    dtype = np.dtype(name)
    plan = reduction(dtype, ReduceOp.SUM, NEW)
    wire = np.dtype(WIRE_NUMPY[plan.datatype])
    if dtype.kind == "c":
        assert wire == np.dtype(f"float{dtype.itemsize * 4}")
        assert plan.lanes == 2
    elif dtype.kind == "b":
        assert wire == np.uint8
    else:
        assert wire == dtype
        assert plan.lanes == 1


class _Bfloat16:
    """Stands in for ``ml_dtypes.bfloat16``'s dtype (the table only reads its name)."""

    name = "bfloat16"
    itemsize = 2

    def __str__(self) -> str:
        return "bfloat16"


def test_bfloat16_needs_nccl_2_10() -> None:
    plan = reduction(_Bfloat16(), ReduceOp.AVG, NEW)  # type: ignore[arg-type]
    assert plan == Reduction(NcclDataType.BFLOAT16, 1, NcclRedOp.AVG, divide=False)
    with pytest.raises(NotImplementedError, match=r"NCCL 2\.9\.9 cannot reduce bfloat16 arrays"):
        reduction(_Bfloat16(), ReduceOp.SUM, OLD)  # type: ignore[arg-type]


def test_unknown_reduce_op_is_not_implemented() -> None:
    fake = enum.Enum("Future", {"BXOR": "bxor"}).BXOR  # a member ReduceOp may grow
    with pytest.raises(NotImplementedError, match=r"ReduceOp\.BXOR has no NCCL counterpart"):
        reduction(np.dtype(np.int32), fake, NEW)  # type: ignore[arg-type]


def _emulate(plan: Reduction, arrays: list[np.ndarray], dtype: np.dtype) -> np.ndarray:
    """What NCCL computes: the op over the wire values, viewed back as ``dtype``."""
    wire = [np.ascontiguousarray(a).view(WIRE_NUMPY[plan.datatype]) for a in arrays]
    stack = np.stack(wire)
    if plan.op is NcclRedOp.SUM:
        out = stack.sum(axis=0, dtype=stack.dtype)
    elif plan.op is NcclRedOp.PROD:
        out = stack.prod(axis=0, dtype=stack.dtype)
    elif plan.op is NcclRedOp.MAX:
        out = stack.max(axis=0)
    elif plan.op is NcclRedOp.MIN:
        out = stack.min(axis=0)
    else:  # ncclAvg: the sum divided, integers toward zero
        out = _average(stack.sum(axis=0, dtype=stack.dtype), len(arrays))
    if plan.divide:
        out = _average(out.view(dtype), len(arrays)).view(out.dtype)
    return out.view(dtype)


def _average(total: np.ndarray, n: int) -> np.ndarray:
    if total.dtype.kind in "fc":
        return (total / total.dtype.type(n)).astype(total.dtype)
    return (np.sign(total) * (np.abs(total) // n)).astype(total.dtype)  # toward zero


def _meaning(op: ReduceOp, arrays: list[np.ndarray]) -> np.ndarray:
    """What ``op`` means on the values (NumPy's reading, independent of NCCL)."""
    stack = np.stack(arrays)
    if stack.dtype == bool:
        ufunc = {ReduceOp.SUM: np.logical_or, ReduceOp.MAX: np.logical_or}.get(op, np.logical_and)
        return ufunc.reduce(stack, axis=0)
    if op is ReduceOp.SUM:
        return stack.sum(axis=0, dtype=stack.dtype)
    if op is ReduceOp.PRODUCT:
        return stack.prod(axis=0, dtype=stack.dtype)
    if op is ReduceOp.MIN:
        return stack.min(axis=0)
    if op is ReduceOp.MAX:
        return stack.max(axis=0)
    if stack.dtype.kind in "iu":
        return _average(stack.sum(axis=0, dtype=np.int64), len(arrays)).astype(stack.dtype)
    return (stack.sum(axis=0, dtype=stack.dtype) / stack.dtype.type(len(arrays))).astype(
        stack.dtype
    )


@given(
    dtype=st.sampled_from(REDUCIBLE),
    op=st.sampled_from(NCCL_OPS),
    version=st.sampled_from([OLD, NEW]),
    participants=st.sampled_from([1, 2, 4]),  # 1/n exact: ncclAvg's pre-multiplied sum is too
    seed=st.integers(0, 2**32 - 1),
)
def test_nccl_arithmetic_on_the_wire_means_the_reduce_op(
    dtype: str, op: ReduceOp, version: int, participants: int, seed: int
) -> None:
    if _refusal(dtype, op) is not None:
        return
    rng = np.random.default_rng(seed)
    dt = np.dtype(dtype)
    if dt.kind == "b":
        arrays = [rng.integers(0, 2, 5).astype(bool) for _ in range(participants)]
    elif dt.kind in "iu":
        info = np.iinfo(dt)
        low, high = max(info.min, -(info.max // 4)), min(info.max // 4, 50)  # sums fit
        arrays = [rng.integers(low, high, 5, endpoint=True).astype(dt) for _ in range(participants)]
    elif dt.kind == "c":
        arrays = [
            (rng.integers(-8, 8, 5) + 1j * rng.integers(-8, 8, 5)).astype(dt)
            for _ in range(participants)
        ]
    else:
        arrays = [rng.integers(-8, 8, 5).astype(dt) for _ in range(participants)]
    plan = reduction(dt, op, version)
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(_emulate(plan, arrays, dt), _meaning(op, arrays))


@pytest.mark.parametrize(
    "dtype", [*REDUCIBLE, "int16", "uint16", "datetime64[s]", "S4", "U3", "V5", "float128"]
)
def test_transfer_moves_bytes_of_every_fixed_size_dtype(dtype: str) -> None:
    assert transfer(np.dtype(dtype)) == np.dtype(dtype).itemsize


@pytest.mark.parametrize("dtype", ["O", [("a", "O"), ("b", "i4")]])
def test_transfer_refuses_objects(dtype: object) -> None:
    with pytest.raises(TypeError, match=r"NCCL moves arrays as bytes, and .* have no fixed-size"):
        transfer(np.dtype(dtype))


# ---------------------------------------------------------------------------------------------
# The backend's own checks, on a stand-in NCCL module (no GPU needed to reach them)


def _fake_nccl(version: int) -> types.SimpleNamespace:
    return types.SimpleNamespace(get_version=lambda: version, get_build_version=lambda: version)


@pytest.fixture
def fake_backend(monkeypatch: pytest.MonkeyPatch) -> nccl_backend.NCCLBackend:
    monkeypatch.setattr(nccl_backend, "nccl_module", lambda: _fake_nccl(version_code(2, 6, 4)))
    return nccl_backend.NCCLBackend(0, 2, store=None, timeout=1.0, group_name="g")


def test_backend_checks_dtypes_through_the_tables(fake_backend: nccl_backend.NCCLBackend) -> None:
    fake_backend.check_dtype(np.dtype(np.int16), None)
    fake_backend.check_dtype(np.dtype(np.int32), ReduceOp.AVG)
    assert fake_backend._plan(np.dtype(np.int32), ReduceOp.AVG).divide  # NCCL 2.6 has no ncclAvg
    with pytest.raises(TypeError, match=r"NCCL cannot reduce int16 arrays \(ReduceOp\.SUM\)"):
        fake_backend.check_dtype(np.dtype(np.int16), ReduceOp.SUM)
    with pytest.raises(TypeError, match=r"have no fixed-size bytes"):
        fake_backend.check_dtype(np.dtype(object), None)


def test_recv_from_any_source_points_to_mpi(fake_backend: nccl_backend.NCCLBackend) -> None:
    with pytest.raises(NotImplementedError, match=r"recv\(src=None\) .* use the 'mpi' backend"):
        fake_backend.recv(np.zeros(1), None, 0)


@pytest.mark.parametrize("name", ["send", "recv", "gather", "scatter", "all_to_all"])
def test_point_to_point_needs_nccl_2_7(fake_backend: nccl_backend.NCCLBackend, name: str) -> None:
    x = np.zeros(1)
    calls = {
        "send": lambda: fake_backend.send(x, 1, 0),
        "recv": lambda: fake_backend.recv(x, 1, 0),
        "gather": lambda: fake_backend.gather(None, x, 1),
        "scatter": lambda: fake_backend.scatter(x, None, 1),
        "all_to_all": lambda: fake_backend.all_to_all([x, x], [x, x]),
    }
    with pytest.raises(NotImplementedError, match=rf"{name} needs NCCL >= 2\.7 .* NCCL 2\.6\.4"):
        calls[name]()


def test_subgroups_number_their_members(fake_backend: nccl_backend.NCCLBackend) -> None:
    member = fake_backend.new_subgroup([0, 1], timeout=2.0, group_name="1")
    assert member is not None
    assert (member.rank, member.size, member.timeout, member.group_name) == (0, 2, 2.0, "1")
    assert fake_backend.new_subgroup([1], timeout=2.0, group_name="2") is None


# ---------------------------------------------------------------------------------------------
# The unique id: bytes in the store, CuPy's spelling at the communicator


def _uid(seed: int) -> bytes:
    uid = np.random.default_rng(seed).integers(0, 256, 128, dtype=np.uint8).tobytes()
    return uid[:-2] + b"\x00\xff"  # both extremes, whatever the seed


def test_unique_id_bytes_from_every_cupy_spelling() -> None:
    uid = _uid(0)
    signed = tuple(int(v) for v in np.frombuffer(uid, np.int8))  # CuPy < 14, signed char
    unsigned = tuple(uid)  # CuPy < 14 where char is unsigned
    for spelling in (uid, signed, unsigned):
        assert nccl_backend._unique_id_bytes(spelling) == uid


class _Communicator:
    """``NcclCommunicator`` stand-ins that accept one spelling of the id, as CuPy's do."""

    seen: ClassVar[list[bytes]] = []

    def __init__(self, nranks: int, uid: object, rank: int) -> None:
        self.check(uid)
        self.seen.append(nccl_backend._unique_id_bytes(uid))  # type: ignore[arg-type]
        self.nranks, self.rank = nranks, rank

    def check(self, uid: object) -> None:
        raise NotImplementedError


class _Bytes(_Communicator):  # CuPy >= 14
    def check(self, uid: object) -> None:
        if not isinstance(uid, bytes):
            raise TypeError("Argument 'commId' has incorrect type (expected bytes, got tuple)")


class _SignedChars(_Communicator):  # CuPy < 14 on x86
    def check(self, uid: object) -> None:
        if not isinstance(uid, tuple):
            raise TypeError("Argument 'commId' has incorrect type (expected tuple, got bytes)")
        if any(not -128 <= v <= 127 for v in uid):
            raise OverflowError("value too large to convert to char")


class _UnsignedChars(_Communicator):  # CuPy < 14 on ARM
    def check(self, uid: object) -> None:
        if not isinstance(uid, tuple):
            raise TypeError("Argument 'commId' has incorrect type (expected tuple, got bytes)")
        if any(not 0 <= v <= 255 for v in uid):
            raise OverflowError("can't convert negative value to char")


@pytest.mark.parametrize("cls", [_Bytes, _SignedChars, _UnsignedChars])
def test_communicator_gets_the_id_in_cupys_spelling(cls: type[_Communicator]) -> None:
    uid = _uid(1)
    cls.seen = []
    comm = nccl_backend._new_communicator(types.SimpleNamespace(NcclCommunicator=cls), 4, uid, 3)
    assert cls.seen == [uid]
    assert (comm.nranks, comm.rank) == (4, 3)


@pytest.mark.skipif(_real_nccl() is None, reason="cupy.cuda.nccl does not load here")
def test_real_communicator_refuses_the_other_spelling_before_nccl_runs() -> None:
    # _new_communicator relies on this: the wrong id spelling is a TypeError from argument
    # conversion (CuPy >= 14 takes bytes), raised before any NCCL call or GPU is needed.
    nccl = _real_nccl()
    uid = nccl.get_unique_id()
    other = tuple(uid) if isinstance(uid, bytes) else nccl_backend._unique_id_bytes(uid)
    with pytest.raises(TypeError, match="commId"):
        nccl.NcclCommunicator(1, other, 0)


def _stores(kind: str, path: str, n: int) -> list:
    if kind == "file":
        return [FileStore(path, n) for _ in range(n)]
    master = TCPStore("127.0.0.1", 0, world_size=n, is_master=True, wait_for_workers=False)
    return [master] + [TCPStore("127.0.0.1", master.port, world_size=n) for _ in range(n - 1)]


@pytest.mark.parametrize("source", ["cupy", "old-cupy-tuple"])
@pytest.mark.parametrize("kind", ["file", "tcp"])
def test_unique_id_round_trips_through_a_store(
    kind: str, source: str, tmp_path: os.PathLike
) -> None:
    if source == "cupy":
        nccl = _real_nccl()
        if nccl is None:
            pytest.skip("cupy.cuda.nccl does not load here")
        uid = nccl_backend._unique_id_bytes(nccl.get_unique_id())
    else:
        uid = _uid(2)
    n = 3
    stores = _stores(kind, os.path.join(tmp_path, "store"), n)
    got: dict[int, bytes] = {}

    def leader() -> tuple[int, ...] | bytes:
        # CuPy >= 14 hands out bytes; older CuPy a tuple of (signed) chars.
        return uid if source == "cupy" else tuple(int(v) for v in np.frombuffer(uid, np.int8))

    def rank(r: int) -> None:
        got[r] = nccl_backend._share_unique_id(
            stores[r], "nccl/g/0", create=leader if r == 0 else None, readers=n, timeout=30.0
        )

    threads = [threading.Thread(target=rank, args=(r,)) for r in reversed(range(n))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert got == dict.fromkeys(range(n), uid)
        assert stores[0].num_keys() == 0  # the last reader removed the id and its counter
    finally:
        for s in stores:
            s.close()


def test_unique_id_wait_times_out_naming_the_key(tmp_path: os.PathLike) -> None:
    path = os.path.join(tmp_path, "store")
    with (
        FileStore(path, 1, timeout=timedelta(seconds=5)) as store,
        pytest.raises(TimeoutError, match=r"did not publish the unique id 'k/0' within 0\.1 s"),
    ):
        nccl_backend._share_unique_id(store, "k/0", create=None, readers=2, timeout=0.1)


# ---------------------------------------------------------------------------------------------
# The whole backend on a simulated GPU and NCCL
#
# Device arrays are NumPy buffers addressed by raw pointer, as CuPy's are; the simulated NCCL
# performs each call at ``groupEnd`` once every member has issued it (members are threads, or
# the devices of one thread), reading and writing memory through the pointers it was given. So
# the backend's pointer arithmetic, packing, member numbering, element counts and in-group
# ordering are checked against NumPy without a GPU.


def _memory(ptr: int, nbytes: int) -> np.ndarray:
    return np.frombuffer((ctypes.c_char * nbytes).from_address(ptr), np.uint8)


class _SimArray:
    """A "device array": ``.data.ptr``, ``.device``, ``.nbytes``... over a NumPy buffer."""

    def __init__(self, host: np.ndarray, device: int) -> None:
        self.host = np.ascontiguousarray(host).copy()
        self.device = _SimDevice(device)
        self.data = types.SimpleNamespace(ptr=self.host.ctypes.data)
        self.dtype, self.size, self.nbytes = self.host.dtype, self.host.size, self.host.nbytes


class _SimDevice:
    current = threading.local()

    def __init__(self, device_id: int) -> None:
        self.id = device_id

    def __enter__(self) -> _SimDevice:
        self.previous = getattr(_SimDevice.current, "id", 0)
        _SimDevice.current.id = self.id
        return self

    def __exit__(self, *exc: object) -> None:
        _SimDevice.current.id = self.previous


class _SimStream:
    """A stream that records the events it was told to wait on."""

    ptr = 0
    current = threading.local()  # each thread's current stream, as CUDA's per-thread default

    def __init__(self) -> None:
        self.waited: list[_SimEvent] = []

    def wait_event(self, event: _SimEvent) -> None:
        self.waited.append(event)

    def __enter__(self) -> _SimStream:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def _current_stream() -> _SimStream:
    stream = getattr(_SimStream.current, "stream", None)
    if stream is None:
        stream = _SimStream.current.stream = _SimStream()
    return stream


class _SimEvent:
    """A CUDA event; the simulated NCCL performs calls at ``groupEnd``, so recorded events have
    fired unless the simulation holds them (a hung peer: a kernel that never returns), until a
    communicator is aborted (``ncclCommAbort`` makes stuck kernels exit)."""

    def __init__(self, sim: _SimNccl) -> None:
        self.sim = sim
        self.held = False

    def record(self, stream: object = None) -> None:
        self.held = self.sim.hold

    @property
    def done(self) -> bool:
        return not self.held or bool(self.sim.aborted)


def _sim_cupy(sim: _SimNccl) -> types.SimpleNamespace:
    def empty(n: int, dtype: object) -> _SimArray:
        return _SimArray(np.zeros(n, dtype), getattr(_SimDevice.current, "id", 0))

    def divide(n: object, x: _SimArray) -> None:  # the kernel "x = x / n" (C division)
        h = x.host
        h[...] = h / n if h.dtype.kind in "fc" else np.sign(h) * (np.abs(h) // n)

    def memcpy(dst: int, src: int, nbytes: int, kind: int, stream: int) -> None:
        ctypes.memmove(dst, src, nbytes)

    runtime = types.SimpleNamespace(
        memcpyAsync=memcpy,
        memcpyDeviceToDevice=3,
        getDevice=lambda: getattr(_SimDevice.current, "id", 0),
    )
    cuda = types.SimpleNamespace(
        Device=_SimDevice,
        Stream=lambda non_blocking=False: _SimStream(),
        Event=lambda disable_timing=False: _SimEvent(sim),
        get_current_stream=_current_stream,
        runtime=runtime,
    )
    return types.SimpleNamespace(
        cuda=cuda,
        uint8=np.uint8,
        empty=empty,
        zeros=empty,
        ElementwiseKernel=lambda *args: divide,
    )


class _SimNccl:
    """NCCL's semantics on shared memory; calls rendezvous by (communicator, kind, sequence)."""

    NcclError = type("NcclError", (RuntimeError,), {})

    def __init__(self, version: int) -> None:
        self.version = version
        self.lock = threading.Condition()
        self.slots: dict[tuple, dict[int, tuple]] = {}
        self.counters: dict[tuple, int] = {}
        self.local = threading.local()
        self.hold = False  # events recorded now never fire on their own (a hung peer)
        self.aborted: list[Any] = []  # communicators aborted (ncclCommAbort), in order
        self.destroyed: list[Any] = []
        sim = self

        class Communicator:
            def __init__(self, nranks: int, uid: bytes, rank: int) -> None:
                assert isinstance(uid, bytes)
                assert len(uid) == 128
                self.uid, self.nranks, self.rank = uid, nranks, rank

            def abort(self) -> None:
                sim.aborted.append(self)

            def destroy(self) -> None:
                sim.destroyed.append(self)

            def check_async_error(self) -> None:
                pass

            def __getattr__(self, kind: str) -> object:
                return lambda *args: sim.local.pending.append((self, kind, args))

        self.NcclCommunicator = Communicator

    def get_version(self) -> int:
        return self.version

    get_build_version = get_version

    def get_unique_id(self) -> bytes:
        return os.urandom(128)

    def groupStart(self) -> None:
        self.local.pending = []

    def groupEnd(self) -> None:
        pending, self.local.pending = self.local.pending, []
        keys = [self._deposit(comm, kind, args) for comm, kind, args in pending]
        with self.lock:
            for key, expected in keys:
                while len(self.slots[key]) < expected:
                    assert self.lock.wait(30), f"simulated NCCL: {key} never matched"

    def _deposit(self, comm: Any, kind: str, args: tuple) -> tuple[tuple, int]:
        if kind in ("send", "recv"):
            peer = args[3]
            src, dst = (comm.rank, peer) if kind == "send" else (peer, comm.rank)
            channel = (comm.uid, src, dst, kind)
            key, expected, member = (comm.uid, src, dst), 2, kind
        else:
            channel = (comm.uid, comm.rank)
            key, expected, member = (comm.uid, kind), comm.nranks, comm.rank
        with self.lock:
            n = self.counters.get(channel, 0)
            self.counters[channel] = n + 1
            key = (*key, n)
            slot = self.slots.setdefault(key, {})
            slot[member] = args
            if len(slot) == expected:
                self._run(key, slot)
                self.lock.notify_all()
        return key, expected

    def _run(self, key: tuple, slot: dict) -> None:
        if "send" in slot:  # send(ptr, count, type, peer, stream) meets recv(ptr, ...)
            s, r = slot["send"], slot["recv"]
            _memory(r[0], r[1])[...] = _memory(s[0], s[1])
            return
        kind, n = key[1], len(slot)
        wire = WIRE_NUMPY[NcclDataType(slot[0][3])]
        size = np.dtype(wire).itemsize

        def view(ptr: int, count: int) -> np.ndarray:
            return _memory(ptr, count * size).view(wire)

        if kind == "broadcast":  # (send, recv, count, type, root, stream)
            root = slot[0][4]
            for args in slot.values():
                view(args[1], args[2])[...] = view(slot[root][0], args[2])
        elif kind == "allGather":  # (send, recv, count, type, stream)
            for args in slot.values():
                for r in range(n):
                    chunk = view(args[1], n * args[2])[r * args[2] : (r + 1) * args[2]]
                    chunk[...] = view(slot[r][0], args[2])
        elif kind in ("allReduce", "reduce"):  # (send, recv, count, type, op[, root], stream)
            reduced = _nccl_reduce([view(slot[r][0], slot[r][2]) for r in range(n)], slot[0][4])
            targets = range(n) if kind == "allReduce" else [slot[0][5]]
            for r in targets:
                view(slot[r][1], slot[r][2])[...] = reduced
        else:  # reduceScatter (send, recv, recvcount, type, op, stream)
            count = slot[0][2]
            sends = [view(slot[r][0], n * count) for r in range(n)]
            for r in range(n):
                chunk = [s[r * count : (r + 1) * count] for s in sends]
                view(slot[r][1], count)[...] = _nccl_reduce(chunk, slot[0][4])


def _nccl_reduce(parts: list[np.ndarray], op: int) -> np.ndarray:
    stack = np.stack(parts)
    with np.errstate(over="ignore"):
        if op == NcclRedOp.AVG:
            return _average(stack.sum(axis=0, dtype=stack.dtype), len(parts))
        ufunc = {NcclRedOp.SUM: np.add, NcclRedOp.PROD: np.multiply, NcclRedOp.MAX: np.maximum}
        return ufunc.get(NcclRedOp(op), np.minimum).reduce(stack, axis=0, dtype=stack.dtype)


@pytest.fixture(params=[OLD, NEW], ids=["nccl-2.9", "nccl-2.18"])
def sim(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> _SimNccl:
    nccl = _SimNccl(request.param)
    cupy = _sim_cupy(nccl)
    monkeypatch.setattr(nccl_backend, "nccl_module", lambda: nccl)
    monkeypatch.setattr(nccl_backend, "cupy_module", lambda: cupy)
    nccl_backend._divide_kernel.cache_clear()
    yield nccl
    nccl_backend._divide_kernel.cache_clear()


def _world(store: Any, size: int, name: str = "0") -> list[nccl_backend.NCCLBackend]:
    return [
        nccl_backend.NCCLBackend(r, size, store=store, timeout=30.0, group_name=name)
        for r in range(size)
    ]


def _on_ranks(backends: list, body: Any) -> list:
    """Run ``body(rank, backend)`` on every rank at once (threads stand in for processes)."""
    results: dict[int, Any] = {}
    errors: list[BaseException] = []

    def run(r: int) -> None:
        try:
            results[r] = body(r, backends[r])
        except BaseException as error:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(error)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(backends))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return [results[r] for r in range(len(backends))]


def _values(dtype: str, shape: tuple[int, ...], seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    dt = np.dtype(dtype)
    if dt.kind == "b":
        return rng.integers(0, 2, shape).astype(bool)
    values = rng.integers(0 if dt.kind == "u" else -6, 7, shape)
    if dt.kind == "c":
        values = values + 1j * rng.integers(-6, 7, shape)
    return values.astype(dt)


@pytest.fixture
def store(tmp_path: os.PathLike) -> Any:
    with FileStore(os.path.join(tmp_path, "store"), -1) as s:
        yield s


@pytest.mark.parametrize("op", NCCL_OPS, ids=lambda op: op.name)
@pytest.mark.parametrize("dtype", ["bool", "int8", "uint32", "int64", "float32", "complex128"])
def test_sim_reductions_over_ranks_and_devices(
    sim: _SimNccl, store: Any, dtype: str, op: ReduceOp
) -> None:
    if _refusal(dtype, op) is not None:
        return
    size, local = 2, 2  # 2 ranks x 2 devices = 4 NCCL members
    hosts = [[_values(dtype, (3, 2), 4 * r + j) for j in range(local)] for r in range(size)]
    flat = [h for row in hosts for h in row]
    expected = _meaning(op, flat)
    chunks = [[_values(dtype, (2,), 50 + 8 * r + k) for k in range(size * local)] for r in range(2)]

    def body(r: int, b: nccl_backend.NCCLBackend) -> tuple:
        b.check_dtype(np.dtype(dtype), op)
        xs = [_SimArray(h, j) for j, h in enumerate(hosts[r])]
        b.all_reduce(xs, op).wait()
        ys = [_SimArray(h, j) for j, h in enumerate(hosts[r])]
        b.reduce(ys, 1, 0, op).wait()
        outs = [_SimArray(np.zeros(2, dtype), j) for j in range(local)]
        ins = [[_SimArray(c, j) for c in chunks[r]] for j in range(local)]
        b.reduce_scatter(outs, ins, op).wait()
        return [x.host for x in xs], [y.host for y in ys], [o.host for o in outs]

    results = _on_ranks(_world(store, size), body)
    for r, (xs, ys, outs) in enumerate(results):
        for x in xs:
            np.testing.assert_array_equal(x, expected)
        np.testing.assert_array_equal(ys[0], expected if r == 1 else hosts[r][0])
        np.testing.assert_array_equal(ys[1], hosts[r][1])  # only the root array changes
        for j, out in enumerate(outs):
            # member r * L + j gets the reduction of chunk r * L + j of every member's list
            member = r * local + j
            parts = [chunks[q][member] for q in range(size) for _ in range(local)]
            np.testing.assert_array_equal(out, _meaning(op, parts))


@pytest.mark.parametrize("dtype", ["bool", "int16", "float16", "complex64"])
def test_sim_data_movement_over_ranks_and_devices(sim: _SimNccl, store: Any, dtype: str) -> None:
    size, local = 2, 2
    hosts = [[_values(dtype, (2, 3), 10 * r + j) for j in range(local)] for r in range(size)]
    flat = [h for row in hosts for h in row]

    def body(r: int, b: nccl_backend.NCCLBackend) -> tuple:
        xs = [_SimArray(h, j) for j, h in enumerate(hosts[r])]
        b.broadcast(xs, 1, 1).wait()  # from rank 1's second device
        outs = [[_SimArray(np.zeros((2, 3), dtype), i) for _ in flat] for i in range(local)]
        ins = [_SimArray(h, j) for j, h in enumerate(hosts[r])]
        b.all_gather(outs, ins).wait()
        return [x.host for x in xs], [[o.host for o in row] for row in outs]

    for xs, outs in _on_ranks(_world(store, size), body):
        for x in xs:
            np.testing.assert_array_equal(x, hosts[1][1])
        for row in outs:
            for got, want in zip(row, flat, strict=True):
                np.testing.assert_array_equal(got, want)


def test_sim_point_to_point_and_rooted_calls(sim: _SimNccl, store: Any) -> None:
    if sim.version < P2P_VERSION:
        return
    size = 3
    data = [_values("complex64", (4,), r) for r in range(size)]

    def body(r: int, b: nccl_backend.NCCLBackend) -> dict:
        out: dict[str, Any] = {}
        mine = _SimArray(data[r], 0)
        gathered = [_SimArray(np.zeros(4, np.complex64), 0) for _ in range(size)]
        b.gather(gathered if r == 1 else None, mine, 1).wait()
        out["gather"] = [g.host for g in gathered] if r == 1 else None
        piece = _SimArray(np.zeros(4, np.complex64), 0)
        parts = [_SimArray(d, 0) for d in data] if r == 2 else None
        b.scatter(piece, parts, 2).wait()
        out["scatter"] = piece.host
        # rank r sends r + s + 1 int8 values, all 10 * r + s, to rank s
        ins = [_SimArray(np.full(r + s + 1, 10 * r + s, np.int8), 0) for s in range(size)]
        outs = [_SimArray(np.zeros(s + r + 1, np.int8), 0) for s in range(size)]
        b.all_to_all(outs, ins).wait()
        out["all_to_all"] = [o.host for o in outs]
        message = _SimArray(np.arange(5.0) * (r + 1), 0)
        if r == 0:
            b.send(message, 2, 0).wait()
        elif r == 2:
            work = b.recv(message, 0, 0)
            work.wait()
            out["recv"] = (message.host, work.source_rank())
        b.barrier().wait()
        return out

    results = _on_ranks(_world(store, size), body)
    for got, want in zip(results[1]["gather"], data, strict=True):
        np.testing.assert_array_equal(got, want)
    for r in range(size):
        np.testing.assert_array_equal(results[r]["scatter"], data[r])
        for s, got in enumerate(results[r]["all_to_all"]):
            np.testing.assert_array_equal(got, np.full(s + r + 1, 10 * s + r, np.int8))
    received, source = results[2]["recv"]
    np.testing.assert_array_equal(received, np.arange(5.0))
    assert source == 0


def test_sim_coalesced_calls_mix_dtypes_and_shapes(sim: _SimNccl, store: Any) -> None:
    size = 2
    shapes = [("float64", (2, 2)), ("int32", (3,)), ("complex64", (0,)), ("uint8", ())]
    hosts = [[_values(d, s, 7 * r + k) for k, (d, s) in enumerate(shapes)] for r in range(size)]

    def body(r: int, b: nccl_backend.NCCLBackend) -> tuple:
        arrays = [_SimArray(h, 0) for h in hosts[r]]
        b.all_reduce_coalesced(arrays, ReduceOp.AVG).wait()
        outs = [[_SimArray(np.zeros_like(h), 0) for h in hosts[r]] for _ in range(size)]
        b.all_gather_coalesced(outs, [_SimArray(h, 0) for h in hosts[r]]).wait()
        return [a.host for a in arrays], [[o.host for o in row] for row in outs]

    for averaged, gathered in _on_ranks(_world(store, size), body):
        for k, got in enumerate(averaged):
            np.testing.assert_array_equal(got, _meaning(ReduceOp.AVG, [h[k] for h in hosts]))
        for r, row in enumerate(gathered):
            for got, want in zip(row, hosts[r], strict=True):
                np.testing.assert_array_equal(got, want)


def test_sim_subgroups_and_shutdown(sim: _SimNccl, store: Any) -> None:
    def body(r: int, b: nccl_backend.NCCLBackend) -> Any:
        sub = b.new_subgroup([0, 2], timeout=30.0, group_name="1")
        x = _SimArray(np.array([r + 1.0]), 0)
        if sub is not None:
            sub.all_reduce([x], ReduceOp.PRODUCT).wait()
            sub.shutdown()
        b.all_reduce([_SimArray(np.ones(1), 0)], ReduceOp.SUM).wait()
        b.shutdown()
        return x.host[0], b._comms

    results = _on_ranks(_world(store, 3), body)
    assert [x for x, _ in results] == [3.0, 2.0, 3.0]  # ranks 0 and 2: 1 * 3
    assert all(comms == {} for _, comms in results)
    assert store.num_keys() == 0  # every unique id was read by all and removed


# ---------------------------------------------------------------------------------------------
# Waiting (torch's ProcessGroupNCCL semantics), timeouts and the watchdog, on the simulation


def _held_backend(sim: _SimNccl, store: Any, timeout: float) -> nccl_backend.NCCLBackend:
    """A world of one whose next calls never finish on the device (a hung peer's kernel)."""
    backend = nccl_backend.NCCLBackend(0, 1, store=store, timeout=timeout, group_name="g")
    backend.all_reduce([_SimArray(np.ones(1), 0)], ReduceOp.SUM).wait()  # makes the communicator
    sim.hold = True
    return backend


def _until(condition: Any, limit: float = 10.0) -> float:
    """Seconds until ``condition()`` held (fails the test after ``limit``)."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < limit, "condition never held"
        time.sleep(0.005)
    return time.monotonic() - start


def test_sim_wait_orders_the_callers_stream_and_does_not_block(sim: _SimNccl, store: Any) -> None:
    backend = _held_backend(sim, store, timeout=30.0)
    pg = groups.ProcessGroup(backend, (0,), "g")
    try:
        stream = _current_stream()
        stream.waited.clear()
        work = backend.all_reduce([_SimArray(np.ones(3), 0)], ReduceOp.SUM)
        start = time.monotonic()
        assert work.wait() is True  # stream-ordered: returns while the device is still busy
        assert time.monotonic() - start < 1.0
        (done,) = work._events
        assert not done.event.done
        assert not work.is_completed()
        # the caller's stream: once before the call (ready event, on the internal stream) no;
        # after wait() it waits on exactly this work's completion event.
        assert stream.waited == [done.event]
        # A synchronous call through the public layer returns the same way.
        assert dist.barrier(group=pg) is None
        assert len(stream.waited) == 2
        assert not stream.waited[1].done
        for event in stream.waited:
            event.held = False  # the device catches up
        assert work.is_completed()
        assert work.is_success()
    finally:
        sim.hold = False
        for event in _current_stream().waited:
            event.held = False
        backend.shutdown()


def test_sim_wait_with_timeout_blocks_aborts_and_raises(sim: _SimNccl, store: Any) -> None:
    backend = _held_backend(sim, store, timeout=30.0)
    comms = [c for group in backend._comms.values() for c in group]
    other = backend.broadcast([_SimArray(np.ones(2), 0)], 0, 0)
    work = backend.all_reduce([_SimArray(np.ones(3), 0)], ReduceOp.SUM)
    start = time.monotonic()
    with pytest.raises(
        TimeoutError, match=r"^all_reduce on process group 'g' did not complete within 0\.2 s"
    ):
        work.wait(timeout=0.2)
    assert 0.2 <= time.monotonic() - start < 5.0  # the host blocked until the deadline
    assert sim.aborted == comms
    assert backend._comms == {}
    pinned = r"all_reduce was abandoned by a blocking wait\(\) on process group 'g' \(rank 0 of 1\)"
    assert re.match(pinned, backend.failure or "")
    with pytest.raises(TimeoutError, match=pinned):
        work.wait()  # the work keeps its error
    with pytest.raises(RuntimeError, match=r"^broadcast cannot complete: all_reduce was abandoned"):
        other.wait()
    backend.shutdown()
    assert sim.destroyed == []  # aborted communicators are not destroyed again


def test_sim_watchdog_aborts_a_hung_collective(sim: _SimNccl, store: Any) -> None:
    backend = _held_backend(sim, store, timeout=0.3)
    pg = groups.ProcessGroup(backend, (0,), "g")
    watchdog = backend._watchdog
    assert watchdog is not None
    assert watchdog.thread.daemon
    assert watchdog.thread.is_alive()
    comms = [c for group in backend._comms.values() for c in group]
    work = backend.all_reduce([_SimArray(np.ones(3), 0)], ReduceOp.SUM)
    start = time.monotonic()
    assert work.wait() is True  # nobody blocks: only the watchdog can notice
    elapsed = _until(lambda: backend.failure is not None)
    assert time.monotonic() - start >= 0.3
    assert elapsed < 3.0
    assert sim.aborted == comms
    pinned = (
        r"all_reduce timed out after 0\.3 s on process group 'g' \(rank 0 of 1\); the watchdog "
        r"aborted its NCCL communicators\."
    )
    assert isinstance(work.exception(), TimeoutError)
    assert re.fullmatch(pinned, str(work.exception()))
    with pytest.raises(TimeoutError, match=pinned):
        work.wait()
    with pytest.raises(RuntimeError, match=rf"^process group 'g' is unusable: {pinned}"):
        dist.barrier(group=pg)
    _until(lambda: not watchdog.thread.is_alive())  # its group failed: nothing left to watch
    backend.shutdown()


def test_sim_watchdog_releases_finished_work_and_stops_on_shutdown(
    sim: _SimNccl, store: Any
) -> None:
    backend = nccl_backend.NCCLBackend(0, 1, store=store, timeout=0.2, group_name="g")
    assert backend._watchdog is None  # started lazily
    x = _SimArray(np.arange(4.0), 0)
    work = backend.all_reduce([x], ReduceOp.SUM)
    watchdog = backend._watchdog
    assert watchdog is not None
    assert watchdog.thread.daemon
    # The watchdog retires the finished work (releasing its arrays) without anybody waiting.
    _until(lambda: work._done)
    assert work._keep is None
    assert backend._in_flight == []
    time.sleep(0.3)  # longer than the timeout: a finished work never trips the watchdog
    assert backend.failure is None
    assert sim.aborted == []
    backend.shutdown()
    assert not watchdog.thread.is_alive()
    assert backend._watchdog is None
    assert len(sim.destroyed) == 1
    with pytest.raises(RuntimeError, match=r"process group 'g' was shut down"):
        backend.all_reduce([x], ReduceOp.SUM)


def test_sim_set_up_times_out_when_a_peer_never_joins(sim: _SimNccl, store: Any) -> None:
    # Rank 0 of two: its peer never calls, so the communicator cannot form.
    backend = nccl_backend.NCCLBackend(0, 2, store=store, timeout=0.3, group_name="g")
    blocked = threading.Event()
    sim.NcclCommunicator = lambda *args: blocked.wait(30)  # ncclCommInitRank waits for peers
    start = time.monotonic()
    with pytest.raises(
        TimeoutError,
        match=r"^NCCL set-up on process group 'g' \(rank 0 of 2\): not every rank joined the "
        r"communicator within 0\.3 s",
    ):
        backend.all_reduce([_SimArray(np.ones(1), 0)], ReduceOp.SUM)
    assert 0.3 <= time.monotonic() - start < 5.0
    assert (backend.failure or "").startswith("NCCL set-up on process group 'g'")
    blocked.set()
