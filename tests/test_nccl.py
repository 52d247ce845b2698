"""The NCCL backend without a GPU: tables, the unique id, and every call on simulated GPUs."""

from __future__ import annotations

import contextlib
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
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from cupy_parallel import Device
from cupy_parallel import distributed as dist
from cupy_parallel._src.averages import decode_average, encode_average
from cupy_parallel._src.cuda import nccl_comm
from cupy_parallel._src.cuda import nccl_runtime as cuda_nccl
from cupy_parallel._src.cuda.nccl_tables import (
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
from cupy_parallel._src.devices import cuda_device_count, cupy_module
from cupy_parallel._src.distributed import groups, nccl_backend
from cupy_parallel._src.distributed.store import FileStore, TCPStore
from cupy_parallel._src.enums import Backend, ReduceOp
from cupy_parallel._src.simcuda import SimulationError, sim_nccl
from cupy_parallel._src.simcuda import streams as sim_streams
from cupy_parallel.testing import RaceError, simulated_cuda

if TYPE_CHECKING:
    from collections.abc import Iterator

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
        "import cupy_parallel._src.distributed.nccl_backend as m; "
        "from cupy_parallel import distributed as d; "
        "print(m.nccl_module() is not None, d.is_nccl_available())"
    )
    out = subprocess.run(
        [sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, check=True
    )
    assert out.stderr == ""
    loads, available = out.stdout.split()
    assert loads == str(_real_nccl() is not None)
    assert available == str(_real_nccl() is not None and cuda_device_count() > 0)


def test_is_nccl_available_tells_the_truth() -> None:
    truth = _real_nccl() is not None and cuda_device_count() > 0
    assert dist.is_nccl_available() is truth
    assert nccl_backend.NCCLBackend.is_available() is truth
    assert cuda_nccl.is_available() is truth  # comm's NCCL: one meaning of "available"


@pytest.mark.parametrize(("runtime", "package"), [(12090, "cu12"), (13000, "cu13")])
def test_missing_libnccl_names_the_package_for_cupys_cuda(
    monkeypatch: pytest.MonkeyPatch, runtime: int, package: str
) -> None:
    versions = types.SimpleNamespace(runtimeGetVersion=lambda: runtime)
    fake_cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=versions))
    monkeypatch.setattr(cuda_nccl, "cupy_module", lambda: fake_cupy)
    monkeypatch.setattr(cuda_nccl, "nccl_module", lambda: None)
    assert cuda_nccl.unavailable_reason() == (
        "CuPy is installed, but its NCCL library (libnccl) cannot be loaded; install NCCL for "
        f"CuPy's CUDA version (`pip install nvidia-nccl-{package}`)."
    )


@pytest.mark.parametrize(
    ("cupy", "nccl", "gpus", "why"),
    [
        (
            False,
            False,
            0,
            r"CuPy is not installed; install it with `pip install cupy-parallel\[cuda12\]`",
        ),
        (
            True,
            False,
            0,
            (
                r"CuPy is installed, but its NCCL library \(libnccl\) cannot be loaded; install "
                r"NCCL for CuPy's CUDA version \(`pip install nvidia-nccl-cu12`\)"
            ),
        ),
        (True, True, 0, r"CuPy and NCCL load, but CuPy sees no GPU \(no CUDA device is visible"),
    ],
)
def test_unavailable_backend_says_what_is_missing(
    monkeypatch: pytest.MonkeyPatch, cupy: bool, nccl: bool, gpus: int, why: str
) -> None:
    runtime = types.SimpleNamespace(runtimeGetVersion=lambda: 12090)
    fake_cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=runtime))
    monkeypatch.setattr(cuda_nccl, "cupy_module", lambda: fake_cupy if cupy else None)
    monkeypatch.setattr(cuda_nccl, "nccl_module", lambda: _fake_nccl(NEW) if nccl else None)
    monkeypatch.setattr(cuda_nccl, "cuda_device_count", lambda: gpus)
    assert not nccl_backend.NCCLBackend.is_available()
    assert not cuda_nccl.is_available()
    with pytest.raises(RuntimeError, match=rf"^The 'nccl' backend is not available here: {why}"):
        groups._backend_class(Backend.NCCL)
    monkeypatch.setattr(cuda_nccl, "cuda_device_count", lambda: 1)
    assert nccl_backend.NCCLBackend.is_available() is (cupy and nccl)
    assert cuda_nccl.is_available() is (cupy and nccl)


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
        if op is ReduceOp.AVG and np.dtype(dtype).kind in "iu":  # exact: summed in a buffer
            assert plan.encoded
            assert plan.op is NcclRedOp.SUM
            assert not plan.divide
            if np.dtype(dtype).itemsize < 8:
                assert (wire, plan.lanes) == (np.dtype(np.int64), 1)
            else:  # quotient and remainder
                assert (wire, plan.lanes) == (np.dtype(dtype), 2)
            continue
        assert not plan.encoded
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
    """What NCCL computes: the op over the wire values, viewed back as ``dtype``.

    Encoded plans (``AVG`` of integers): the backend's encoding summed, then decoded.
    """
    if plan.encoded:
        n = len(arrays)
        total = np.zeros((plan.lanes, *arrays[0].shape), WIRE_NUMPY[plan.datatype])
        for a in arrays:
            part = np.zeros_like(total)
            encode_average(a, n, part, np)
            total += part
        return decode_average(total, n, np).astype(dtype)
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
    fake_backend.check_dtype(np.dtype(np.float32), ReduceOp.AVG)
    assert fake_backend._plan(np.dtype(np.float32), ReduceOp.AVG).divide  # 2.6 has no ncclAvg
    fake_backend.check_dtype(np.dtype(np.int32), ReduceOp.AVG)
    assert fake_backend._plan(np.dtype(np.int32), ReduceOp.AVG).encoded  # exact, any version
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
# The whole backend on the simulated CUDA and NCCL (cupy_parallel._src.simcuda)
#
# Ranks are threads; each NCCL call is a kernel on the backend's internal stream of the simulated
# GPU, stamped with the simulation's vector clock, and every access of device memory (the
# caller's kernels, the backend's copies, NCCL's reads and writes) is checked against the race
# rules. So these tests check the results against NumPy AND that every result is ordered after
# its producers and before its consumers by CUDA's rules, on 1, 2 and 4 simulated GPUs.

# gpus -> (world size, GPUs per rank)
LAYOUTS = [
    pytest.param(gpus, size, local, id=f"{gpus}gpu-{size}x{local}")
    for gpus, shapes in ((1, [(1, 1)]), (2, [(2, 1), (1, 2)]), (4, [(4, 1), (2, 2), (1, 4)]))
    for size, local in shapes
]
WORLDS = [pytest.param(gpus, id=f"{gpus}gpu") for gpus in (1, 2, 4)]


@contextlib.contextmanager
def _gpus(
    n: int, monkeypatch: pytest.MonkeyPatch, *, version: int = NEW, ptds: bool = False
) -> Iterator[tuple[Any, list[str]]]:
    """``n`` simulated GPUs with a simulated NCCL of ``version``; yields (cupy, tear-downs).

    A tear-down (``os.abort()`` outside tests) is recorded instead of ending pytest.
    """
    torn: list[str] = []
    monkeypatch.setattr(nccl_backend, "_tear_down", torn.append)
    with simulated_cuda(n, per_thread_default_stream=ptds) as cupy:
        sim_nccl.set_version(version)
        yield cupy, torn


def _world(store: Any, size: int, name: str = "0", timeout: float = 30.0) -> list[Any]:
    return [
        nccl_backend.NCCLBackend(r, size, store=store, timeout=timeout, group_name=name)
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


def _shutdown(cupy: Any, backends: list) -> None:
    """The host waits for every GPU (the simulated GPU finishes only then), then shuts down."""
    for device in range(cupy.cuda.runtime.getDeviceCount()):
        cupy.cuda.Device(device).synchronize()
    for b in backends:
        b.shutdown()


def _values(dtype: str, shape: tuple[int, ...], seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    dt = np.dtype(dtype)
    if dt.kind == "b":
        return rng.integers(0, 2, shape).astype(bool)
    values = rng.integers(0 if dt.kind == "u" else -6, 7, shape)
    if dt.kind == "c":
        values = values + 1j * rng.integers(-6, 7, shape)
    return values.astype(dt)


def _on(cupy: Any, device: int, host: np.ndarray) -> Any:
    with cupy.cuda.Device(device):
        return cupy.asarray(host)


def _host(x: Any) -> np.ndarray:
    with x.device:
        return x.get()


@pytest.fixture
def store(tmp_path: os.PathLike) -> Any:
    with FileStore(os.path.join(tmp_path, "store"), -1) as s:
        yield s


@pytest.mark.parametrize("op", NCCL_OPS, ids=lambda op: op.name)
@pytest.mark.parametrize("dtype", ["bool", "int8", "uint32", "int64", "float16", "complex128"])
@pytest.mark.parametrize(("gpus", "size", "local"), LAYOUTS)
def test_sim_reductions_over_ranks_and_devices(
    monkeypatch: pytest.MonkeyPatch,
    store: Any,
    gpus: int,
    size: int,
    local: int,
    dtype: str,
    op: ReduceOp,
) -> None:
    if _refusal(dtype, op) is not None:
        return
    hosts = [[_values(dtype, (3, 2), 4 * r + j) for j in range(local)] for r in range(size)]
    expected = _meaning(op, [h for row in hosts for h in row])
    members = size * local
    chunks = [[_values(dtype, (2,), 50 + 8 * r + k) for k in range(members)] for r in range(size)]

    with _gpus(gpus, monkeypatch) as (cupy, torn):

        def body(r: int, b: Any) -> tuple:
            devices = [r * local + j for j in range(local)]
            b.check_dtype(np.dtype(dtype), op)
            xs = [_on(cupy, d, h) for d, h in zip(devices, hosts[r], strict=True)]
            b.all_reduce(xs, op).wait()  # synchronous: stream-ordered
            ys = [_on(cupy, d, h) for d, h in zip(devices, hosts[r], strict=True)]
            b.reduce(ys, size - 1, local - 1, op).wait()
            outs = [_on(cupy, d, np.zeros(2, dtype)) for d in devices]
            ins = [[_on(cupy, d, c) for c in chunks[r]] for d in devices]
            b.reduce_scatter(outs, ins, op).wait()
            return [_host(x) for x in xs], [_host(y) for y in ys], [_host(o) for o in outs]

        backends = _world(store, size)
        results = _on_ranks(backends, body)
        _shutdown(cupy, backends)
        assert torn == []
    for r, (xs, ys, outs) in enumerate(results):
        for x in xs:
            np.testing.assert_array_equal(x, expected)
        for j, y in enumerate(ys):  # only the root's array changes
            root = r == size - 1 and j == local - 1
            np.testing.assert_array_equal(y, expected if root else hosts[r][j])
        for j, out in enumerate(outs):
            # member r * L + j gets the reduction of entry r * L + j of every member's list
            parts = [chunks[q][r * local + j] for q in range(size) for _ in range(local)]
            np.testing.assert_array_equal(out, _meaning(op, parts))


@pytest.mark.parametrize("dtype", ["int32", "int8", "float32", "complex64"])
@pytest.mark.parametrize(("gpus", "size", "local"), LAYOUTS)
def test_sim_average_without_ncclavg_divides_after_the_sum(
    monkeypatch: pytest.MonkeyPatch, store: Any, gpus: int, size: int, local: int, dtype: str
) -> None:
    hosts = [[_values(dtype, (7,), 9 * r + j) for j in range(local)] for r in range(size)]
    expected = _meaning(ReduceOp.AVG, [h for row in hosts for h in row])
    with _gpus(gpus, monkeypatch, version=OLD) as (cupy, _):

        def body(r: int, b: Any) -> list:
            plan = b._plan(np.dtype(dtype), ReduceOp.AVG)
            assert plan.encoded if np.dtype(dtype).kind == "i" else plan.divide
            xs = [_on(cupy, r * local + j, h) for j, h in enumerate(hosts[r])]
            b.all_reduce(xs, ReduceOp.AVG).wait()
            return [_host(x) for x in xs]

        backends = _world(store, size)
        results = _on_ranks(backends, body)
        _shutdown(cupy, backends)
    for row in results:
        for x in row:
            np.testing.assert_array_equal(x, expected)


NCCL_INTEGERS = ["int8", "uint8", "int32", "uint32", "int64", "uint64"]


def _extremes(dtype: str, contributor: int, count: int) -> np.ndarray:
    """A contributor's values: the dtype's ends, mixed signs, then values over the whole range."""
    info = np.iinfo(dtype)
    lo, hi, c = int(info.min), int(info.max), contributor
    cases = [lo, hi, lo if c % 2 else hi, hi - c % 64, lo + c % 64, hi if c == count - 1 else lo]
    rng = np.random.default_rng([np.dtype(dtype).num, c])
    rest = rng.integers(lo, hi, size=4, dtype=dtype, endpoint=True)
    return np.array([*cases, *(int(v) for v in rest)], dtype=dtype).reshape(2, 5)


def _exact_mean(arrays: list[np.ndarray]) -> np.ndarray:
    """The mean rounded toward zero, in Python integers."""
    columns = zip(*(a.reshape(-1).tolist() for a in arrays), strict=True)
    means = [abs(sum(c)) // len(c) * (1 if sum(c) >= 0 else -1) for c in columns]
    return np.array(means, dtype=arrays[0].dtype).reshape(arrays[0].shape)


@pytest.mark.slow
@pytest.mark.parametrize("version", [OLD, NEW], ids=["nccl2.9", "nccl2.18"])
@pytest.mark.parametrize(("gpus", "size", "local"), LAYOUTS)
def test_sim_integer_average_is_exact_where_the_sum_overflows(
    monkeypatch: pytest.MonkeyPatch, store: Any, gpus: int, size: int, local: int, version: int
) -> None:
    # ncclAvg (and a sum then a division) wraps: int8 100 and 100 averaged to -28.
    members = size * local
    hosts = {d: [_extremes(d, c, members) for c in range(members)] for d in NCCL_INTEGERS}
    chunks = {  # chunk k of member c
        d: [[_extremes(d, 100 * c + k, members) for k in range(members)] for c in range(members)]
        for d in NCCL_INTEGERS
    }
    with _gpus(gpus, monkeypatch, version=version) as (cupy, torn):

        def body(r: int, b: Any) -> dict:
            devices = [r * local + j for j in range(local)]
            got: dict = {}
            for d in NCCL_INTEGERS:
                mine = hosts[d][r * local : (r + 1) * local]
                xs = [_on(cupy, dev, h) for dev, h in zip(devices, mine, strict=True)]
                b.all_reduce(xs, ReduceOp.AVG).wait()
                ys = [_on(cupy, dev, h) for dev, h in zip(devices, mine, strict=True)]
                b.reduce(ys, size - 1, local - 1, ReduceOp.AVG).wait()
                outs = [_on(cupy, dev, np.zeros((2, 5), d)) for dev in devices]
                ins = [
                    [_on(cupy, dev, c) for c in chunks[d][r * local + j]]
                    for j, dev in enumerate(devices)
                ]
                b.reduce_scatter(outs, ins, ReduceOp.AVG).wait()
                got[d] = ([_host(x) for x in xs], _host(ys[-1]), [_host(o) for o in outs])
            with cupy.cuda.Device(devices[0]):
                coalesced = [cupy.asarray(hosts[d][r]) for d in NCCL_INTEGERS]
            if local == 1:  # one array per member: every rank's own
                b.all_reduce_coalesced(coalesced, ReduceOp.AVG).wait()
                got["coalesced"] = [_host(x) for x in coalesced]
            return got

        backends = _world(store, size)
        results = _on_ranks(backends, body)
        _shutdown(cupy, backends)
        assert torn == []
    for r, got in enumerate(results):
        for d in NCCL_INTEGERS:
            xs, root, outs = got[d]
            for x in xs:
                np.testing.assert_array_equal(x, _exact_mean(hosts[d]), err_msg=d)
            if r == size - 1:
                np.testing.assert_array_equal(root, _exact_mean(hosts[d]), err_msg=d)
            for j, out in enumerate(outs):
                want = _exact_mean([chunks[d][c][r * local + j] for c in range(members)])
                np.testing.assert_array_equal(out, want, err_msg=d)
        if local == 1:
            for d, x in zip(NCCL_INTEGERS, got["coalesced"], strict=True):
                want = _exact_mean([hosts[d][q] for q in range(size)])
                np.testing.assert_array_equal(x, want, err_msg=d)


@pytest.mark.parametrize("dtype", ["bool", "int16", "float16", "complex64"])
@pytest.mark.parametrize(("gpus", "size", "local"), LAYOUTS)
def test_sim_data_movement_over_ranks_and_devices(
    monkeypatch: pytest.MonkeyPatch, store: Any, gpus: int, size: int, local: int, dtype: str
) -> None:
    hosts = [[_values(dtype, (2, 3), 10 * r + j) for j in range(local)] for r in range(size)]
    flat = [h for row in hosts for h in row]
    with _gpus(gpus, monkeypatch) as (cupy, _):

        def body(r: int, b: Any) -> tuple:
            devices = [r * local + j for j in range(local)]
            xs = [_on(cupy, d, h) for d, h in zip(devices, hosts[r], strict=True)]
            b.broadcast(xs, size - 1, local - 1).wait()  # from the last rank's last GPU
            outs = [[_on(cupy, d, np.zeros((2, 3), dtype)) for _ in flat] for d in devices]
            ins = [_on(cupy, d, h) for d, h in zip(devices, hosts[r], strict=True)]
            b.all_gather(outs, ins).wait()
            return [_host(x) for x in xs], [[_host(o) for o in row] for row in outs]

        backends = _world(store, size)
        results = _on_ranks(backends, body)
        _shutdown(cupy, backends)
    for xs, outs in results:
        for x in xs:
            np.testing.assert_array_equal(x, hosts[-1][-1])
        for row in outs:
            for got, want in zip(row, flat, strict=True):
                np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("size", [2, 3, 4])
def test_sim_point_to_point_and_rooted_calls(
    monkeypatch: pytest.MonkeyPatch, store: Any, size: int
) -> None:
    data = [_values("complex64", (4,), r) for r in range(size)]
    with _gpus(4, monkeypatch) as (cupy, _):

        def body(r: int, b: Any) -> dict:
            cupy.cuda.Device(r).use()
            out: dict[str, Any] = {}
            mine = cupy.asarray(data[r])
            gathered = [cupy.zeros(4, np.complex64) for _ in range(size)]
            b.gather(gathered if r == 1 else None, mine, 1).wait()
            out["gather"] = [g.get() for g in gathered] if r == 1 else None
            piece = cupy.zeros(4, np.complex64)
            parts = [cupy.asarray(d) for d in data] if r == size - 1 else None
            b.scatter(piece, parts, size - 1).wait()
            out["scatter"] = piece.get()
            # rank r sends r + s + 1 int8 values, all 10 * r + s, to rank s
            ins = [cupy.full(r + s + 1, 10 * r + s, np.int8) for s in range(size)]
            outs = [cupy.zeros(s + r + 1, np.int8) for s in range(size)]
            b.all_to_all(outs, ins).wait()
            out["all_to_all"] = [o.get() for o in outs]
            message = cupy.asarray(np.arange(5.0) * (r + 1))
            if r == 0:
                b.send(message, size - 1, 0).wait()
            elif r == size - 1:
                work = b.recv(message, 0, 0)
                work.wait()
                out["recv"] = (message.get(), work.source_rank())
            b.barrier().wait()
            return out

        backends = _world(store, size)
        results = _on_ranks(backends, body)
        _shutdown(cupy, backends)
    for got, want in zip(results[1]["gather"], data, strict=True):
        np.testing.assert_array_equal(got, want)
    for r in range(size):
        np.testing.assert_array_equal(results[r]["scatter"], data[r])
        for s, got in enumerate(results[r]["all_to_all"]):
            np.testing.assert_array_equal(got, np.full(s + r + 1, 10 * s + r, np.int8))
    received, source = results[size - 1]["recv"]
    np.testing.assert_array_equal(received, np.arange(5.0))
    assert source == 0


@pytest.mark.parametrize("gpus", WORLDS)
def test_sim_coalesced_calls_mix_dtypes_and_shapes(
    monkeypatch: pytest.MonkeyPatch, store: Any, gpus: int
) -> None:
    shapes = [("float64", (2, 2)), ("int32", (3,)), ("complex64", (0,)), ("uint8", ())]
    hosts = [[_values(d, s, 7 * r + k) for k, (d, s) in enumerate(shapes)] for r in range(gpus)]
    with _gpus(gpus, monkeypatch) as (cupy, _):

        def body(r: int, b: Any) -> tuple:
            cupy.cuda.Device(r).use()
            arrays = [cupy.asarray(h) for h in hosts[r]]
            b.all_reduce_coalesced(arrays, ReduceOp.AVG).wait()
            outs = [[cupy.zeros_like(a) for a in arrays] for _ in range(gpus)]
            b.all_gather_coalesced(outs, [cupy.asarray(h) for h in hosts[r]]).wait()
            # one input, sent as it is (no packed copy), written on this stream just before
            alone = cupy.zeros((2, 2))
            alone += cupy.asarray(hosts[r][0])
            single = [[cupy.zeros((2, 2))] for _ in range(gpus)]
            b.all_gather_coalesced(single, [alone]).wait()
            for q, row in enumerate(single):
                np.testing.assert_array_equal(row[0].get(), hosts[q][0])
            return [a.get() for a in arrays], [[o.get() for o in row] for row in outs]

        backends = _world(store, gpus)
        results = _on_ranks(backends, body)
        _shutdown(cupy, backends)
    for averaged, gathered in results:
        for k, got in enumerate(averaged):
            np.testing.assert_array_equal(got, _meaning(ReduceOp.AVG, [h[k] for h in hosts]))
        for r, row in enumerate(gathered):
            for got, want in zip(row, hosts[r], strict=True):
                np.testing.assert_array_equal(got, want)


def test_sim_subgroups_and_shutdown(monkeypatch: pytest.MonkeyPatch, store: Any) -> None:
    with _gpus(4, monkeypatch) as (cupy, _):

        def body(r: int, b: Any) -> Any:
            cupy.cuda.Device(r).use()
            sub = b.new_subgroup([0, 2], timeout=30.0, group_name="1")
            x = cupy.asarray(np.array([r + 1.0]))
            if sub is not None:
                sub.all_reduce([x], ReduceOp.PRODUCT).wait()
                value = float(x.get()[0])
                sub.shutdown()
            else:
                value = float(x.get()[0])
            y = cupy.ones(1)
            b.all_reduce([y], ReduceOp.SUM).wait()
            total = float(y.get()[0])
            b.shutdown()
            return value, total, b._comms

        results = _on_ranks(_world(store, 3), body)
    assert [(v, t) for v, t, _ in results] == [(3.0, 3.0), (2.0, 3.0), (3.0, 3.0)]
    assert all(comms == {} for _, _, comms in results)
    assert store.num_keys() == 0  # every unique id was read by all and removed


# ---------------------------------------------------------------------------------------------
# Streams: the internal stream is ordered after the caller's stream and before its consumers


STREAM_KINDS = ["legacy", "per-thread", "blocking", "non-blocking"]


def _user_stream(cupy: Any, kind: str) -> Any:
    if kind in ("legacy", "per-thread"):
        return cupy.cuda.get_current_stream()  # the default stream of this simulation
    return cupy.cuda.Stream(non_blocking=kind == "non-blocking")


@pytest.mark.parametrize("n", [1, 1000, 1 << 16])
@pytest.mark.parametrize("kind", STREAM_KINDS)
@pytest.mark.parametrize("gpus", WORLDS)
def test_sim_sync_and_async_calls_are_ordered_on_every_stream(
    monkeypatch: pytest.MonkeyPatch, store: Any, gpus: int, kind: str, n: int
) -> None:
    with _gpus(gpus, monkeypatch, ptds=kind == "per-thread") as (cupy, torn):

        def body(r: int, b: Any) -> tuple:
            cupy.cuda.Device(r).use()
            stream = _user_stream(cupy, kind)
            with stream:
                x = cupy.arange(n, dtype=np.int64) * (r + 1)  # produced on the stream
                b.all_reduce([x], ReduceOp.SUM).wait()  # synchronous
                y = x * 2  # consumed on the stream
                z = cupy.full(n, r, np.int64)
                work = b.broadcast([z], gpus - 1, 0)  # asynchronous
                work.wait_stream(stream)
                total = y + z
                work = b.all_reduce([total], ReduceOp.MAX)
            other = cupy.cuda.Stream(non_blocking=True)
            work.wait_stream(other)  # a stream given explicitly
            with other:
                return total.get(stream=other)

        backends = _world(store, gpus)
        results = _on_ranks(backends, body)
        _shutdown(cupy, backends)
        assert torn == []
    triangle = gpus * (gpus + 1) // 2
    expected = np.arange(n, dtype=np.int64) * 2 * triangle + (gpus - 1)
    for result in results:
        np.testing.assert_array_equal(result, expected)


def test_sim_a_consumer_not_ordered_after_an_async_call_is_a_race(
    monkeypatch: pytest.MonkeyPatch, store: Any
) -> None:
    # The checker sees the internal stream: reading the result of an async collective on a
    # stream that never waited for it is reported, naming NCCL's write and the stream.
    with _gpus(1, monkeypatch) as (cupy, _):
        (backend,) = _world(store, 1)
        x = cupy.ones(8)
        work = backend.all_reduce([x], ReduceOp.SUM)
        with (
            cupy.cuda.Stream(non_blocking=True),
            pytest.raises(RaceError, match=r"not ordered after the write by `nccl allReduce"),
        ):
            x * 2  # the read is the point
        work.wait()
        _shutdown(cupy, [backend])


# ---------------------------------------------------------------------------------------------
# Barrier, the watchdog and stalled peers


def test_sim_barrier_blocks_the_host_until_the_device_finished(
    monkeypatch: pytest.MonkeyPatch, store: Any
) -> None:
    # torch's barrier blocks the host; a stream-ordered barrier (the old one) leaves the work
    # queued before it unfinished, which the simulated GPU shows as not done.
    with _gpus(2, monkeypatch) as (cupy, _):

        def body(r: int, b: Any) -> tuple[bool, bool]:
            cupy.cuda.Device(r).use()
            stream = cupy.cuda.get_current_stream()
            x = cupy.ones(10) * 2  # a kernel before the barrier
            before = stream.done
            b.barrier().wait()
            return before, stream.done and float(x.get()[0]) == 2.0

        backends = _world(store, 2)
        results = _on_ranks(backends, body)
        _shutdown(cupy, backends)
    assert results == [(False, True), (False, True)]


def test_sim_first_barrier_uses_gpu_rank_mod_device_count(
    monkeypatch: pytest.MonkeyPatch, store: Any
) -> None:
    # Every rank of a node starts on GPU 0; before any collective a barrier must spread the
    # ranks over the GPUs (rank % device_count), as torch's does. NCCL refuses one GPU twice.
    with _gpus(4, monkeypatch) as (cupy, _):

        def body(r: int, b: Any) -> Any:
            b.barrier().wait()
            return list(b._comms)

        backends = _world(store, 4)
        assert _on_ranks(backends, body) == [[(0,)], [(1,)], [(2,)], [(3,)]]
        _shutdown(cupy, backends)


def test_sim_first_subgroup_barrier_uses_the_global_rank(
    monkeypatch: pytest.MonkeyPatch, store: Any
) -> None:
    # A subgroup of world ranks 1 and 3 on a 4-GPU node: torch picks the GPU by the global rank
    # (1 -> GPU 1, 3 -> GPU 3); the group rank (0, 1) would put world rank 1 on GPU 0, where
    # world rank 0 runs, and rank 3 on GPU 1.
    with _gpus(4, monkeypatch) as (cupy, _):

        def body(r: int, b: Any) -> Any:
            sub = b.new_subgroup([1, 3], timeout=30.0, group_name="odd")
            if sub is None:
                return None
            sub.barrier().wait()
            made = list(sub._comms)
            sub.shutdown()
            return made

        backends = _world(store, 4)
        assert _on_ranks(backends, body) == [None, [(1,)], None, [(3,)]]
        _shutdown(cupy, backends)


def _until(condition: Any, limit: float = 10.0) -> float:
    """Seconds until ``condition()`` held (fails the test after ``limit``)."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < limit, "condition never held"
        time.sleep(0.005)
    return time.monotonic() - start


def test_sim_watchdog_aborts_a_collective_that_does_not_finish(
    monkeypatch: pytest.MonkeyPatch, store: Any
) -> None:
    # The simulated GPU finishes work only when the host waits for it: a collective nobody
    # waits for looks hung to the watchdog, which aborts the group after its timeout.
    with _gpus(1, monkeypatch) as (cupy, torn):
        (backend,) = _world(store, 1, name="g", timeout=0.3)
        pg = groups.ProcessGroup(backend, (0,), "g")
        x = cupy.ones(3)
        start = time.monotonic()
        work = backend.all_reduce([x], ReduceOp.SUM)
        assert work.wait() is True  # stream-ordered: the host does not wait
        watchdog = backend._watchdog
        assert watchdog is not None
        assert watchdog.thread.daemon
        _until(lambda: backend.failure is not None)
        assert time.monotonic() - start >= 0.3
        comms = sim_nccl_comms(cupy)
        assert all(c._aborted for c in comms)
        pinned = (
            r"all_reduce timed out after 0\.3 s on process group 'g' \(rank 0 of 1\); the "
            r"watchdog aborted its NCCL communicators\."
        )
        assert isinstance(work.exception(), TimeoutError)
        assert re.fullmatch(pinned, str(work.exception()))
        with pytest.raises(TimeoutError, match=pinned):
            work.wait()
        with pytest.raises(RuntimeError, match=rf"^process group 'g' is unusable: {pinned}"):
            dist.barrier(group=pg)
        _until(lambda: not watchdog.thread.is_alive())
        # wait() had made the caller's stream wait on the collective: that stream runs on with
        # partial data, so the process is torn down (os.abort() outside this test).
        (message,) = torn
        assert re.match(
            rf"cupy_parallel: process group 'g' \(rank 0 of 1\) was aborted: {pinned}", message
        )
        assert message.endswith(
            "CUDA streams already wait on all_reduce, whose results are partial; the process "
            "is ended so that they are not used silently (set "
            "CUPY_PARALLEL_NCCL_ASYNC_ERROR_HANDLING=2 to keep running with the group unusable "
            "instead)."
        )
        backend.shutdown()


def sim_nccl_comms(cupy: Any) -> list[Any]:
    """Every communicator the simulated NCCL made in this simulation."""
    state = cupy.simulation().extensions["nccl"]
    return [c for clique in state.cliques.values() for c in clique.members.values()]


@pytest.mark.parametrize(("handling", "ordered"), [("2", True), ("1", False)])
def test_sim_abort_tears_down_only_when_a_stream_waits(
    monkeypatch: pytest.MonkeyPatch, store: Any, handling: str, ordered: bool
) -> None:
    monkeypatch.setenv("CUPY_PARALLEL_NCCL_ASYNC_ERROR_HANDLING", handling)
    with _gpus(1, monkeypatch) as (cupy, torn):
        (backend,) = _world(store, 1, timeout=0.2)
        work = backend.all_reduce([cupy.ones(3)], ReduceOp.SUM)
        if ordered:
            work.wait()  # a stream waits, but the user chose to keep running
        _until(lambda: backend.failure is not None)
        assert isinstance(work.exception(), TimeoutError)
        assert torn == []
        backend.shutdown()


def test_sim_watchdog_releases_finished_work_and_stops_on_shutdown(
    monkeypatch: pytest.MonkeyPatch, store: Any
) -> None:
    with _gpus(1, monkeypatch) as (cupy, _):
        (backend,) = _world(store, 1, name="g", timeout=0.2)
        assert backend._watchdog is None  # started lazily
        x = cupy.arange(4.0)
        work = backend.all_reduce([x], ReduceOp.SUM)
        watchdog = backend._watchdog
        assert watchdog is not None
        work.wait()
        np.testing.assert_array_equal(x.get(), np.arange(4.0))  # the host waits for the GPU
        _until(lambda: work.done)  # the watchdog retires it, releasing its arrays
        assert work._keep is None
        assert backend._in_flight == []
        time.sleep(0.3)  # longer than the timeout: a finished work never trips the watchdog
        assert backend.failure is None
        backend.shutdown()
        assert not watchdog.thread.is_alive()
        assert backend._watchdog is None
        assert all(c._destroyed and not c._aborted for c in sim_nccl_comms(cupy))
        with pytest.raises(RuntimeError, match=r"process group 'g' was shut down"):
            backend.all_reduce([x], ReduceOp.SUM)


def test_sim_blocking_wait_synchronises_and_releases(
    monkeypatch: pytest.MonkeyPatch, store: Any
) -> None:
    # wait(timeout=...) blocks the host until the collective finished: afterwards the result
    # is readable with no further ordering, and the work is complete.
    with _gpus(2, monkeypatch) as (cupy, _):

        def body(r: int, b: Any) -> np.ndarray:
            cupy.cuda.Device(r).use()
            x = cupy.full(5, r + 1.0)
            work = b.all_reduce([x], ReduceOp.SUM)
            assert work.wait(timeout=10) is True
            assert work.is_completed()
            with cupy.cuda.Stream(non_blocking=True):  # any stream: the host synchronised
                return (x * 1).get()

        backends = _world(store, 2)
        results = _on_ranks(backends, body)
        _shutdown(cupy, backends)
    for result in results:
        np.testing.assert_array_equal(result, np.full(5, 3.0))


def test_sim_a_peer_that_joined_but_stalls_times_out(
    monkeypatch: pytest.MonkeyPatch, store: Any
) -> None:
    # NCCL connects lazily inside the first groupEnd, which blocks until the peer issues the
    # same call. The work must be watched from before groupEnd, or this hangs forever.
    with _gpus(2, monkeypatch) as (cupy, torn):
        backends = _world(store, 2, timeout=0.3)

        def body(r: int, b: Any) -> Any:
            cupy.cuda.Device(r).use()
            x = cupy.ones(1)
            b.all_reduce([x], ReduceOp.SUM).wait()  # both join
            assert float(x.get()[0]) == 2.0
            if r == 1:
                return None  # alive, but never reaches the next collective
            start = time.monotonic()
            with pytest.raises(
                TimeoutError,
                match=r"^all_reduce timed out after 0\.3 s on process group '0' \(rank 0 of 2\); "
                r"the watchdog aborted its NCCL communicators\.",
            ):
                b.all_reduce([x], ReduceOp.SUM)
            return time.monotonic() - start

        elapsed = _on_ranks(backends, body)[0]
        assert 0.3 <= elapsed < 5.0
        assert torn == []  # nothing waited on it
        for b in backends:
            b.shutdown()


def test_sim_set_up_times_out_when_a_peer_never_joins(
    monkeypatch: pytest.MonkeyPatch, store: Any
) -> None:
    with _gpus(2, monkeypatch) as (cupy, _):
        sim_nccl.set_deadlock_limit(1.0)  # the set-up thread left behind gives up soon
        # Rank 0 of two: its peer never calls, so the communicator cannot form.
        backend = nccl_backend.NCCLBackend(0, 2, store=store, timeout=0.3, group_name="g")
        start = time.monotonic()
        with pytest.raises(
            TimeoutError,
            match=r"^NCCL set-up on process group 'g' \(rank 0 of 2\): not every rank joined the "
            r"communicator within 0\.3 s",
        ):
            backend.all_reduce([cupy.ones(1)], ReduceOp.SUM)
        assert 0.3 <= time.monotonic() - start < 5.0
        assert (backend.failure or "").startswith("NCCL set-up on process group 'g'")


# ---------------------------------------------------------------------------------------------
# Debug mode (CUPY_PARALLEL_DISTRIBUTED_DEBUG=DETAIL): the ranks compare through the store
#
# Each thread-rank calls the public functions on its own ProcessGroup object wrapping its
# backend, so the comparison runs exactly as in a process: collectives._run, then agree().


def _debug_groups(backends: list) -> list[Any]:
    ranks = tuple(range(len(backends)))
    for b in backends:
        b.detail = True
    return [groups.ProcessGroup(b, ranks, b.group_name) for b in backends]


# What rank 2 of three passes differently; the rest pass the first spelling.
MISMATCHES = {
    "shape": ("all_reduce", "'float64[4]'", "'float64[5]'"),
    "dtype": ("all_reduce", "'float64[4]'", "'float32[4]'"),
    "op": ("all_reduce", "'ReduceOp.SUM'", "'ReduceOp.MAX'"),
    "root": ("broadcast", "0", "1"),
    "operation": ("all_reduce", "'all_reduce'", "'broadcast'"),
}


def _debug_call(cupy: Any, pg: Any, r: int, what: str | None) -> Any:
    """The call rank ``r`` makes: the agreed one, or rank 2's variant ``what``."""
    odd = r == 2 and what is not None
    size = 5 if odd and what == "shape" else 4
    dtype = np.float32 if odd and what == "dtype" else np.float64
    x = cupy.asarray(np.arange(size, dtype=dtype) + 10 * r)
    if what == "root" or (odd and what == "operation"):
        dist.broadcast(x, src=1 if odd and what == "root" else 0, group=pg)
    else:
        op = dist.ReduceOp.MAX if odd and what == "op" else dist.ReduceOp.SUM
        dist.all_reduce(x, op=op, group=pg)
    return x


@pytest.mark.parametrize("what", sorted(MISMATCHES))
def test_sim_debug_mode_raises_on_every_rank_naming_the_differing_one(
    monkeypatch: pytest.MonkeyPatch, store: Any, what: str
) -> None:
    operation, agreed, odd = MISMATCHES[what]
    with _gpus(3, monkeypatch) as (cupy, _):
        backends = _world(store, 3)
        pgs = _debug_groups(backends)

        def body(r: int, b: Any) -> tuple[str, bool, np.ndarray]:
            cupy.cuda.Device(r).use()
            with pytest.raises(ValueError, match="differ from the rest of process group") as caught:
                _debug_call(cupy, pgs[r], r, what)
            untouched = b._comms == {}  # raised before NCCL was asked for anything
            x = cupy.asarray(np.arange(4.0) + 10 * r)
            dist.all_reduce(x, group=pgs[r])  # the group is still usable after a mismatch
            return str(caught.value), untouched, _host(x)

        results = _on_ranks(backends, body)
        _shutdown(cupy, backends)
    # Every rank raises, each under the name of the operation it called, with the same account.
    accounts = {message.split(": ", 1)[1] for message, _, _ in results}
    assert len(accounts) == 1
    message = results[0][0]
    assert message.startswith(f"{operation}: ranks [2] differ from the rest of process group")
    before, after = message.split("rank 2: (")
    assert f"rank 0: ('{operation}'" in before
    assert agreed in before
    assert odd in after
    summed = sum(np.arange(4.0) + 10 * r for r in range(3))
    for _, untouched, x in results:
        assert untouched
        np.testing.assert_array_equal(x, summed)  # the next call moved the right data
    assert store.num_keys() == 0  # every record was read by all and removed


def test_sim_debug_mode_agreeing_calls_give_numpy_results(
    monkeypatch: pytest.MonkeyPatch, store: Any
) -> None:
    with _gpus(2, monkeypatch) as (cupy, _):
        backends = _world(store, 2)
        pgs = _debug_groups(backends)

        def body(r: int, b: Any) -> list[np.ndarray]:
            del b
            cupy.cuda.Device(r).use()
            x = cupy.asarray(np.array([1.0, -2.0, 3.0]) * (r + 1))
            dist.all_reduce(x, op=dist.ReduceOp.MIN, group=pgs[r])
            y = cupy.asarray(np.full(2, 7 + r, np.int32))
            dist.broadcast(y, src=1, group=pgs[r])
            out = [cupy.zeros(3, np.int64) for _ in range(2)]
            dist.all_gather(out, cupy.asarray(np.arange(3) * (r + 1)), group=pgs[r])
            return [_host(x), _host(y), *[_host(o) for o in out]]

        results = _on_ranks(backends, body)
        _shutdown(cupy, backends)
    for x, y, first, second in results:
        np.testing.assert_array_equal(x, [1.0, -4.0, 3.0])
        np.testing.assert_array_equal(y, [8, 8])
        np.testing.assert_array_equal(first, [0, 1, 2])
        np.testing.assert_array_equal(second, [0, 2, 4])
    assert store.num_keys() == 0


def test_sim_debug_mode_names_a_rank_that_skipped_the_collective(
    monkeypatch: pytest.MonkeyPatch, store: Any
) -> None:
    with _gpus(3, monkeypatch) as (cupy, _):
        backends = _world(store, 3, timeout=0.3)
        pgs = _debug_groups(backends)

        def body(r: int, b: Any) -> tuple[str, str]:
            cupy.cuda.Device(r).use()
            if r == 1:
                return "", ""  # alive, but skips the collective
            x = cupy.ones(2)
            with pytest.raises(TimeoutError) as caught:
                dist.all_reduce(x, group=pgs[r])
            with pytest.raises(RuntimeError) as after:
                dist.all_reduce(x, group=pgs[r])
            assert b._comms == {}  # nothing reached NCCL
            return str(caught.value), str(after.value)

        results = _on_ranks(backends, body)
        _shutdown(cupy, backends)
    for r in (0, 2):
        timed_out, after = results[r]
        assert timed_out == (
            f"the debug mode's comparison of collective #0 on process group '0' (rank {r} of "
            "3): group ranks [1] did not reach it within 0.3 s (they skipped a collective, or "
            "died)."
        )
        assert f"is unusable: {timed_out}" in after


# ---------------------------------------------------------------------------------------------
# comm's NCCL: one thread's grouped calls never interleave with another's (defect 8)


def test_sim_comm_nccl_calls_of_two_threads_do_not_interleave(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with _gpus(2, monkeypatch) as (cupy, _):
        from cupy_parallel import comm

        def body(t: int, _: Any) -> list[bool]:
            ok = []
            for i in range(60):
                value = 100 * t + i
                with cupy.cuda.Device(0):
                    x = cupy.full(4 + t, value, np.int64)  # the threads' sizes differ
                copies = comm.broadcast(x, ["cuda:0", "cuda:1"])
                ok.append(bool((_host(copies[1]) == value).all()))
            return ok

        results = _on_ranks([None, None], body)
    assert results == [[True] * 60, [True] * 60]


# ---------------------------------------------------------------------------------------------
# The simulated NCCL itself


def test_sim_nccl_reports_mismatched_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    with _gpus(2, monkeypatch) as (cupy, _):
        uid = sim_nccl.get_unique_id()

        def body(r: int, _: Any) -> None:
            cupy.cuda.Device(r).use()
            comm = sim_nccl.NcclCommunicator(2, uid, r)
            x = cupy.zeros(4 + r, np.float32)
            stream = cupy.cuda.get_current_stream().ptr
            comm.allReduce(x.data.ptr, x.data.ptr, x.size, sim_nccl.NCCL_FLOAT32, 0, stream)

        with pytest.raises(
            SimulationError,
            match=r"mismatched calls on one communicator: allReduce\(count=\d, .*\) by rank \d "
            r"meets allReduce\(count=\d",
        ):
            _on_ranks([None, None], body)


def test_sim_nccl_refuses_one_gpu_twice_and_bad_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    with _gpus(2, monkeypatch):
        with pytest.raises(TypeError, match=r"Argument 'commId' has incorrect type"):
            sim_nccl.NcclCommunicator(1, tuple(range(128)), 0)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"commId length 3 != 128"):
            sim_nccl.NcclCommunicator(1, b"abc", 0)
        uid = sim_nccl.get_unique_id()
        sim_nccl.groupStart()
        sim_nccl.NcclCommunicator(2, uid, 0)
        sim_nccl.NcclCommunicator(2, uid, 1)  # the same (current) GPU
        with pytest.raises(sim_nccl.NcclError, match=r"Duplicate GPU detected: rank 0 and rank 1"):
            sim_nccl.groupEnd()


@pytest.mark.parametrize("value", ["0", "3", "yes"])
def test_error_handling_variable_is_checked(
    fake_backend: nccl_backend.NCCLBackend, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("CUPY_PARALLEL_NCCL_ASYNC_ERROR_HANDLING", value)
    with pytest.raises(
        ValueError,
        match=rf"^CUPY_PARALLEL_NCCL_ASYNC_ERROR_HANDLING must be 1 .* or 2 .*, got '{value}'\.",
    ):
        fake_backend.new_subgroup([0, 1], timeout=1.0, group_name="1")


@pytest.mark.parametrize(
    "dtype", ["bool", "int8", "uint8", "int16", "int32", "int64", "float16", "float64", "complex64"]
)
@pytest.mark.parametrize("gpus", [2, 4])
def test_sim_comm_reduce_add_and_broadcast_through_nccl(
    monkeypatch: pytest.MonkeyPatch, gpus: int, dtype: str
) -> None:
    # comm's NCCL reduce goes through nccl_tables (the one dtype table): bool sums as a logical
    # or, complex as pairs of reals, float16 in float16; int16 has no NCCL type and falls back.
    hosts = [_values(dtype, (3, 4), 60 + k) for k in range(gpus)]
    expected = hosts[0].copy()
    with np.errstate(over="ignore"):
        for h in hosts[1:]:
            expected = (expected | h) if expected.dtype == bool else (expected + h)
    with _gpus(gpus, monkeypatch) as (cupy, _):
        from cupy_parallel import comm

        inputs = [_on(cupy, k, h) for k, h in enumerate(hosts)]
        target = f"cuda:{gpus - 1}"
        uses_nccl = nccl_comm.can_reduce(inputs, Device("cuda", gpus - 1))
        total = comm.reduce_add(inputs, destination=target)
        copies = comm.broadcast(inputs[1], [f"cuda:{k}" for k in range(gpus)])
        np.testing.assert_array_equal(_host(total), expected)
        for copy in copies:
            assert _host(copy).tobytes() == hosts[1].tobytes()
    assert uses_nccl is (dtype != "int16")


class _StuckEvent:
    """A CUDA event behind a kernel that never ends (until ``release``)."""

    def __init__(self) -> None:
        self.released = threading.Event()

    @property
    def done(self) -> bool:
        return self.released.is_set()

    def synchronize(self) -> None:
        self.released.wait(30)


def test_blocking_wait_gives_up_at_its_deadline(
    fake_backend: nccl_backend.NCCLBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    # wait(timeout=t) synchronises in a helper thread; when the event does not fire within t
    # the caller gets TimeoutError at t (not when the helper returns) and the group is aborted.
    # (No GPU to make current here: the fake event needs none.)
    monkeypatch.setattr(nccl_backend._Done, "_current", lambda self: contextlib.nullcontext())
    event = _StuckEvent()
    work = nccl_backend._NCCLWork("all_reduce", fake_backend, [], keep=None)
    work._events = [nccl_backend._Done(event, 0)]
    start = time.monotonic()
    try:
        with pytest.raises(
            TimeoutError, match=r"^all_reduce on process group 'g' did not complete within 0\.2 s"
        ):
            work.wait(timeout=0.2)
        assert 0.2 <= time.monotonic() - start < 2.0
        assert re.match(
            r"all_reduce was abandoned by a blocking wait\(\)", fake_backend.failure or ""
        )
    finally:
        event.released.set()


def test_sim_watchdog_aborts_on_an_asynchronous_nccl_error(
    monkeypatch: pytest.MonkeyPatch, store: Any
) -> None:
    # ncclCommGetAsyncError reports a dead peer: the watchdog aborts at once, not at the timeout.
    monkeypatch.setenv("CUPY_PARALLEL_NCCL_ASYNC_ERROR_HANDLING", "2")
    with _gpus(1, monkeypatch) as (cupy, _):
        (backend,) = _world(store, 1, name="g", timeout=30.0)
        work = backend.all_reduce([cupy.ones(2)], ReduceOp.SUM)
        (comm,) = sim_nccl_comms(cupy)
        comm.inject_async_error()
        elapsed = _until(lambda: backend.failure is not None)
        assert elapsed < 5.0
        assert re.match(
            r"all_reduce failed in NCCL \(NCCL_ERROR_REMOTE_ERROR: asynchronous error on rank 0\) "
            r"on process group 'g'; its NCCL communicators were aborted\.",
            backend.failure or "",
        )
        with pytest.raises(RuntimeError, match=r"^all_reduce cannot complete: all_reduce failed"):
            work.wait()
        assert comm._aborted
        backend.shutdown()


def test_sim_nccl_abort_wakes_a_call_waiting_for_its_peer(monkeypatch: pytest.MonkeyPatch) -> None:
    with _gpus(2, monkeypatch) as (cupy, _):
        comms = sim_nccl.NcclCommunicator.initAll([0, 1])
        raised: list[BaseException] = []

        def lonely() -> None:  # rank 0 sends; rank 1 never receives
            x = cupy.ones(4)
            try:
                comms[0].send(x.data.ptr, 4, sim_nccl.NCCL_FLOAT64, 1, 0)
            except sim_nccl.NcclError as error:
                raised.append(error)

        thread = threading.Thread(target=lonely)
        thread.start()
        time.sleep(0.2)
        assert thread.is_alive()  # blocked until the peer calls
        comms[0].abort()
        thread.join(5)
        assert not thread.is_alive()
        (error,) = raised
        assert str(error) == (
            "NCCL_ERROR_REMOTE_ERROR: communicator of rank 0 was aborted while waiting for its "
            "peers"
        )
        with pytest.raises(sim_nccl.NcclError, match=r"rank 0's communicator was aborted"):
            comms[0].check_async_error()


def test_sim_two_threads_sharing_a_group_do_not_interleave_their_calls(
    monkeypatch: pytest.MonkeyPatch, store: Any
) -> None:
    # One rank driving two GPUs: each call is a group of two NCCL calls. Two threads calling at
    # once must not mix their groups on the shared communicators (torch's per-group mutex).
    with _gpus(2, monkeypatch) as (cupy, _):
        (backend,) = _world(store, 1)
        start = threading.Barrier(2)

        def body(t: int, _: Any) -> list[bool]:
            ok = []
            start.wait(10)  # both threads' first calls find no communicators
            for i in range(40):
                xs = [_on(cupy, d, np.full(3 + t, 10.0 * i + t + d)) for d in (0, 1)]
                backend.all_reduce(xs, ReduceOp.SUM).wait()
                want = 2 * (10.0 * i + t) + 1
                ok.append(all(bool((_host(x) == want).all()) for x in xs))
            return ok

        results = _on_ranks([None, None], body)
        _shutdown(cupy, [backend])
    assert results == [[True] * 40, [True] * 40]
    assert backend._made == 1  # the two threads' first calls made one set of communicators


def test_sim_helper_threads_use_only_their_ranks_gpu(
    monkeypatch: pytest.MonkeyPatch, store: Any
) -> None:
    """The watchdog and the wait helper set their device before touching events: a thread's first
    CUDA call binds its current device's context, GPU 0 if it never set one (about 0.5 GiB on
    GPU 0 per rank on a real machine)."""
    with _gpus(2, monkeypatch) as (cupy, torn):

        def body(r: int, b: Any) -> list[float]:
            cupy.cuda.Device(r).use()
            x = cupy.full(4, r + 1.0)
            work = b.all_reduce([x], ReduceOp.SUM)
            time.sleep(3 * b._watchdog.interval)  # the watchdog polls the pending events
            work.wait(timeout=20)  # blocks the host: the wait helper thread
            return list(x.get())

        backends = _world(store, 2, name="ctx", timeout=5.0)
        results = _on_ranks(backends, body)
        used = sim_streams.contexts()
        _shutdown(cupy, backends)
        assert torn == []
    assert results == [[3.0] * 4, [3.0] * 4]
    helpers = {name: devices for name, devices in used.items() if "NCCL" in name}
    assert any("watchdog" in name for name in helpers), used
    assert any("wait" in name for name in helpers)
    for name, devices in helpers.items():
        rank = int(re.search(r"rank (\d)", name).group(1))  # type: ignore[union-attr]
        assert devices == {rank}, f"{name} used the contexts of GPUs {sorted(devices)}"


def test_sim_communicators_made_during_an_abort_are_aborted_too(
    monkeypatch: pytest.MonkeyPatch, store: Any
) -> None:
    """An abort (a watchdog) takes the sets made by then; a thread still making one must not
    leave its communicators alive and unaborted in the cache of a failed group."""
    with _gpus(1, monkeypatch) as (cupy, torn):
        (backend,) = _world(store, 1, name="g", timeout=30.0)
        make = backend._make_communicators
        made: list[Any] = []

        def make_while_aborted(devices: tuple[int, ...]) -> list[Any]:
            comms = make(devices)
            made.extend(comms)
            backend._abort("the watchdog aborted the group meanwhile")
            return comms

        monkeypatch.setattr(backend, "_make_communicators", make_while_aborted)
        with pytest.raises(RuntimeError, match=r"'g' is unusable: the watchdog aborted"):
            backend.all_reduce([cupy.ones(2)], ReduceOp.SUM)
        assert made
        assert all(c._aborted for c in made)  # not left behind, alive
        assert len(backend._comms) == 0
        with pytest.raises(RuntimeError, match=r"'g' is unusable"):
            backend.all_reduce([cupy.ones(2)], ReduceOp.SUM)  # refused before anything is made
        backend.shutdown()
        assert torn == []
