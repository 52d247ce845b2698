"""Device model: spellings, platform selection, strict host arrays, copies and the memory pool."""

from __future__ import annotations

import pickle
import subprocess
import sys

import numpy as np
import pytest
from helpers import DTYPES, random_bits

import cupy_parallel as cp
from cupy_parallel import Device, HostArray, as_device, device_of, to_device
from cupy_parallel._src.devices import host_device_count
from cupy_parallel._src.memory import POOL_THRESHOLD, HostMemoryPool

# --------------------------------------------------------------------------------------------
# spellings


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("cpu", Device("cpu")),
        ("cpu:0", Device("cpu")),  # as torch.device("cpu:0")
        (-1, Device("cpu")),
        ("host:3", Device("host", 3)),
        ("host", Device("host", 0)),
        ("cuda:1", Device("cuda", 1)),
        (Device("host", 2), Device("host", 2)),
        (np.int64(-1), Device("cpu")),
    ],
    ids=str,
)
def test_as_device_spellings(spec: object, expected: Device) -> None:
    assert as_device(spec) == expected


def test_int_means_device_of_the_platform(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUPY_PARALLEL_PLATFORM", "host")
    assert as_device(2) == Device("host", 2)
    monkeypatch.setenv("CUPY_PARALLEL_PLATFORM", "cuda")
    assert as_device(2) == Device("cuda", 2)


def test_device_is_hashable_and_prints_its_spelling() -> None:
    assert len({Device("host", 1), as_device("host:1"), Device("cpu")}) == 2
    assert [str(d) for d in (Device("cpu"), Device("host", 4), Device("cuda", 0))] == [
        "cpu",
        "host:4",
        "cuda:0",
    ]
    assert as_device(str(Device("host", 4))) == Device("host", 4)


@pytest.mark.parametrize(
    ("spec", "error", "match"),
    [
        ("gpu:0", ValueError, r"device string must be 'cpu', 'cuda:k' or 'host:k', got 'gpu:0'"),
        ("host:x", ValueError, r"got 'host:x'"),
        ("host:-1", ValueError, r"got 'host:-1'"),
        ("cpu:1", ValueError, r"the cpu device has only index 0 \('cpu' or 'cpu:0'\), got 'cpu:1'"),
        ("host:\u0661", ValueError, r"got 'host:\u0661' \(k is written in ASCII digits\)"),
        ("cuda:\u00b2", ValueError, r"got 'cuda:\u00b2' \(k is written in ASCII digits\)"),
        (True, TypeError, r"device must be a str, int or Device, got bool True"),
        (1.5, TypeError, r"device must be a str .* got float 1.5"),
        (None, TypeError, r"got NoneType None"),
        (-2, ValueError, r"device index must be >= 0, got -2"),
    ],
    ids=repr,
)
def test_as_device_rejects(spec: object, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        as_device(spec)


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        (
            ("tpu", 0),
            ValueError,
            r"Device kind must be one of \('cpu', 'cuda', 'host'\), got 'tpu'",
        ),
        (("cpu", 0), ValueError, r"The cpu device has index -1, got 0"),
        (("host", 1.0), TypeError, r"Device index must be an int, got float"),
    ],
)
def test_device_constructor_rejects(args: tuple, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        Device(*args)


# --------------------------------------------------------------------------------------------
# platform


def test_devices_follow_host_count(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUPY_PARALLEL_PLATFORM", "host")
    cp.set_host_device_count(3)
    assert cp.devices() == [Device("host", k) for k in range(3)]
    assert cp.platform() == "host"


def test_host_count_from_environment() -> None:
    code = "import cupy_parallel as c; print(len(c.devices()), c.platform())"
    env = {"CUPY_PARALLEL_PLATFORM": "host", "CUPY_PARALLEL_HOST_DEVICES": "5", "PATH": ""}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["5", "host"]


@pytest.mark.parametrize(
    ("name", "value", "match"),
    [
        (
            "CUPY_PARALLEL_PLATFORM",
            "tpu",
            r"CUPY_PARALLEL_PLATFORM must be 'host' or 'cuda', got 'tpu'",
        ),
        ("CUPY_PARALLEL_HOST_DEVICES", "zero", r"must be an integer >= 1, got 'zero'"),
    ],
)
def test_bad_environment(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str, match: str
) -> None:
    monkeypatch.setenv("CUPY_PARALLEL_PLATFORM", "host")
    monkeypatch.setattr("cupy_parallel._src.devices._host_device_count", None)
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=match):
        cp.devices()


@pytest.mark.parametrize(
    ("count", "error", "match"),
    [
        (0, ValueError, r"count must be >= 1, got 0"),
        ("2", TypeError, r"count must be an int, got str"),
    ],
)
def test_set_host_device_count_rejects(count: object, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        cp.set_host_device_count(count)  # type: ignore[arg-type]


@pytest.mark.slow
def test_set_host_device_count_refuses_to_remove_a_device_arrays_live_on() -> None:
    # Issue 23: set_host_device_count(2) with arrays on host:5 left them on a device that no
    # longer existed (every later operation on them failed, far from the cause).
    cp.set_host_device_count(8)
    a = cp.to_device(np.arange(3.0), "host:5")
    view = a[1:]
    b = cp.to_device(np.ones(2), "host:3")
    match = (
        r"set_host_device_count\(2\) would remove host devices that arrays still live on "
        r"\(1 array on host:3, 2 arrays on host:5\); delete those arrays or move them"
    )
    with pytest.raises(ValueError, match=match):
        cp.set_host_device_count(2)
    assert host_device_count() == 8  # refused before anything changed
    cp.set_host_device_count(6)  # keeps host:3 and host:5
    with pytest.raises(ValueError, match=r"\(2 arrays on host:5\)"):
        cp.set_host_device_count(4)
    np.testing.assert_array_equal(to_device(view, "cpu"), [1.0, 2.0])
    del a, view, b
    cp.set_host_device_count(8)
    cycle: list[object] = [cp.to_device(np.ones(1), "host:7")]
    cycle.append(cycle)  # unreachable garbage in a reference cycle does not count
    del cycle
    cp.set_host_device_count(2)
    assert host_device_count() == 2


def test_import_without_cupy() -> None:
    code = (
        "import sys; sys.modules['cupy'] = None\n"
        "import cupy_parallel as c, numpy as np\n"
        "print(c.platform(), c.device_of(c.to_device(np.ones(2), 'host:0')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["host", "host:0"]


def test_cupy_arrays_may_exist_once_cupy_is_imported() -> None:
    """The MPI backend skips looking for CuPy arrays until CuPy (or a stand-in) is loaded."""
    code = (
        "import sys, types\n"
        "import cupy_parallel.distributed\n"
        "from cupy_parallel._src.devices import cupy_arrays_may_exist\n"
        "before = cupy_arrays_may_exist()\n"
        "sys.modules.setdefault('cupy', types.ModuleType('cupy'))\n"
        "print(before, cupy_arrays_may_exist())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True"]


def test_cuda_device_without_cuda_is_a_clear_error() -> None:
    if cp.platform() == "cuda":
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match=r"Device cuda:0 needs CUDA, which is not available here"):
        to_device(np.ones(2), "cuda:0")


# --------------------------------------------------------------------------------------------
# strict host arrays


@pytest.fixture
def pair() -> tuple[HostArray, HostArray]:
    return to_device(np.arange(6.0).reshape(2, 3), "host:1"), to_device(np.ones(3), "host:2")


MIXED_DEVICE_OPS = {
    "add": lambda a, b: a + b,
    "matmul": lambda a, b: a @ b,
    "ufunc": np.maximum,
    "concatenate": lambda a, b: np.concatenate([a, b[None]]),
    "dot-method": lambda a, b: a.dot(b),
    "where": lambda a, b: np.where(a > 0, a, b),
    "setitem": lambda a, b: a.__setitem__(0, b),
    "copyto": lambda a, b: np.copyto(a[0], b),
    "out=": lambda a, b: np.add(b, b, out=a[0]),
}


@pytest.mark.parametrize("op", MIXED_DEVICE_OPS.values(), ids=MIXED_DEVICE_OPS.keys())
def test_two_host_devices_never_mix(pair: tuple[HostArray, HostArray], op) -> None:
    a, b = pair
    before = a.get()
    with pytest.raises(
        ValueError, match=r"different devices, host:[12] and host:[12]|on host:2 into"
    ):
        op(a, b)
    np.testing.assert_array_equal(a.get(), before)  # nothing was written


MIXED_NUMPY_OPS = {
    "add": lambda a, n: a + n,
    "radd": lambda a, n: n + a,
    "zero-d": lambda a, n: a * np.asarray(2.0),
    "stack": lambda a, n: np.stack([a[0], n]),
    "copyto-into-numpy": lambda a, n: np.copyto(n, a[0]),
    "dot": np.dot,  # (CuPy's einsum uploads host operands; its dot does not)
}


@pytest.mark.parametrize("op", MIXED_NUMPY_OPS.values(), ids=MIXED_NUMPY_OPS.keys())
def test_host_array_refuses_plain_numpy(pair: tuple[HostArray, HostArray], op) -> None:
    a, _ = pair
    with pytest.raises(TypeError, match=r"mixes an array on host:1 with a plain numpy.ndarray"):
        op(a, np.ones(3))


RESULTS_STAY = {
    "scalar-arith": lambda a: a * 2 + 1,
    "numpy-scalar": lambda a: np.float32(3) * a,
    "ufunc": np.exp,
    "reduction": lambda a: a.sum(),
    "mean": lambda a: a.mean(axis=0),
    "argmax": np.argmax,
    "slice": lambda a: a[1:, ::2],
    "transpose": lambda a: a.T,
    "reshape": lambda a: a.reshape(-1),
    "astype": lambda a: a.astype(np.float16),
    "copy": lambda a: a.copy(),
    "matmul": lambda a: a @ a.T,
    "split": lambda a: np.split(a, 3, axis=1)[2],
    "linalg": np.linalg.norm,
    "same-device-mix": lambda a: np.concatenate([a, a]),
}


@pytest.mark.parametrize("op", RESULTS_STAY.values(), ids=RESULTS_STAY.keys())
def test_results_slices_and_views_stay_on_device(pair: tuple[HostArray, HostArray], op) -> None:
    a, _ = pair
    result = op(a)
    assert isinstance(result, HostArray)
    assert device_of(result) == Device("host", 1)
    expected = op(a.get())
    np.testing.assert_array_equal(result.get(), expected)


def test_views_share_memory_and_device(pair: tuple[HostArray, HostArray]) -> None:
    a, _ = pair
    view = a[0]
    view[...] = 7.0
    assert a.get()[0].tolist() == [7.0, 7.0, 7.0]
    assert view.device == a.device


def test_assigning_numpy_into_a_basic_index_is_refused_as_cupy_fill_does(
    pair: tuple[HostArray, HostArray],
) -> None:
    # cupy/_core/_routines_indexing.pyx _scatter_op: host data goes through fill(), scalars only
    a, _ = pair
    with pytest.raises(ValueError, match=r"Cannot assign a ndarray of shape \(3,\) into an array"):
        a[1] = np.array([9.0, 8.0, 7.0])
    a[1] = np.array(9.0)  # a 0-d array is a scalar to fill()
    a[[0], 0] = np.array([5.0])  # advanced indexing uploads host data (_scatter_op_single)
    assert a.get().tolist() == [[5.0, 1.0, 2.0], [9.0, 9.0, 9.0]]


def test_repr_pickle_and_exit_to_numpy(pair: tuple[HostArray, HostArray]) -> None:
    a, _ = pair
    assert repr(a).endswith("device='host:1')")
    back = pickle.loads(pickle.dumps(a))
    assert back.device == a.device
    np.testing.assert_array_equal(back.get(), a.get())
    assert type(a.get()) is np.ndarray
    assert type(to_device(a, "cpu")) is np.ndarray


def test_device_of_rejects_non_arrays() -> None:
    with pytest.raises(
        TypeError, match=r"array must be a numpy.ndarray, HostArray or cupy.ndarray, got list"
    ):
        device_of([1, 2])


def test_host_array_is_made_by_to_device_not_its_constructor() -> None:
    with pytest.raises(TypeError, match=r"HostArray cannot be constructed directly; use"):
        HostArray(np.zeros(2))


# --------------------------------------------------------------------------------------------
# copies


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize(
    "path",
    [("cpu", "host:0"), ("host:0", "host:7"), ("host:3", "cpu")],
    ids="->".join,
)
def test_to_device_round_trips_bits(dtype: type, path: tuple[str, str]) -> None:
    src, dst = path
    original = random_bits((5, 4), dtype)
    start = to_device(original, src)
    moved = to_device(start[:, ::2], dst)  # non-contiguous source
    assert device_of(moved) == as_device(dst)
    assert moved.dtype == original.dtype
    assert to_device(moved, "cpu").tobytes() == np.ascontiguousarray(original[:, ::2]).tobytes()


def test_to_device_same_device_returns_the_array() -> None:
    h = to_device(np.ones(3), "host:2")
    assert to_device(h, "host:2") is h


@pytest.mark.parametrize("shape", [(0,), (3, 0, 2), ()])
def test_to_device_zero_size_and_zero_d(shape: tuple[int, ...]) -> None:
    x = random_bits(shape, np.float32)
    h = to_device(x, "host:1")
    assert h.shape == shape
    assert to_device(h, "cpu").tobytes() == x.tobytes()


def test_to_device_missing_host_device() -> None:
    cp.set_host_device_count(2)
    with pytest.raises(ValueError, match=r"device host:5 does not exist: there are 2 host devices"):
        to_device(np.ones(2), "host:5")


def test_empty_places_and_shapes() -> None:
    big = cp.empty((POOL_THRESHOLD,), np.uint8, "host:3")
    small = cp.empty(3, np.int16, "cpu")
    assert (device_of(big), big.shape, big.dtype) == (
        Device("host", 3),
        (POOL_THRESHOLD,),
        np.uint8,
    )
    assert (type(small), small.shape, small.dtype) == (np.ndarray, (3,), np.int16)


def test_empty_takes_dtype_and_device_by_keyword() -> None:
    # Issue 23: empty(shape, dtype, device=...) raised TypeError (device was positional-only).
    cp.set_host_device_count(2)
    a = cp.empty((2, 3), np.float32, device="host:1")
    b = cp.empty(4, dtype=np.int16, device="cpu")
    assert (device_of(a), a.shape, a.dtype) == (Device("host", 1), (2, 3), np.float32)
    assert (type(b), b.shape, b.dtype) == (np.ndarray, (4,), np.int16)
    with pytest.raises(ValueError, match=r"device host:5 does not exist"):
        cp.empty(1, np.float32, device="host:5")


# --------------------------------------------------------------------------------------------
# memory pool


def test_pool_reuses_freed_blocks_and_tracks_bytes() -> None:
    pool = HostMemoryPool()
    a = pool.empty((POOL_THRESHOLD // 4,), np.float32)
    address = a.__array_interface__["data"][0]
    assert (pool.used_bytes(), pool.free_bytes()) == (POOL_THRESHOLD, 0)
    view = a[10:]
    del a
    assert pool.free_bytes() == 0  # a view keeps the block alive
    del view
    assert (pool.used_bytes(), pool.free_bytes()) == (0, POOL_THRESHOLD)
    b = pool.empty((POOL_THRESHOLD // 8,), np.float64)
    assert b.__array_interface__["data"][0] == address
    pool.free_all_blocks()
    assert pool.free_bytes() == 0


def test_pool_serves_small_arrays_from_numpy() -> None:
    pool = HostMemoryPool()
    a = pool.empty((4,), np.float64)
    assert a.base is None
    assert pool.used_bytes() == 0
