"""cupy_parallel.save / load: bit-exact round trips of pytrees, no pickle, atomic replacement.

Oracles: the saved objects themselves (bytes compared with ``tobytes``, so NaN payloads and
-0.0 count), safetensors' own NumPy reader for the files we write, and a child process killed
with SIGKILL in the middle of saves for atomicity.
"""

from __future__ import annotations

import collections
import os
import random
import subprocess
import sys
import textwrap
import time

import numpy as np
import optree
import pytest
from hypothesis import given, settings

import cupy_parallel as cp
from cupy_parallel import Device, HostArray, device_of
from cupy_parallel._src.tree import NAMESPACE
from cupy_parallel.testing import arrays, assert_tree_equal, nested_structures

Point = collections.namedtuple("Point", "x y")

DTYPES = [
    "?", "i1", "u1", "i2", "u2", "i4", "u4", "i8", "u8", "f2", "f4", "f8", "c8",
    "c16", "g", "G", ">f8", ">i4", ">c8", "M8[ns]", "m8[s]", "U3", "S2", "V3",
]  # fmt: skip


def same_bits(a, b):
    """Equal dtype, shape and bytes (NaN payloads and signed zeros included)."""
    a_host, b_host = (cp.to_device(x, "cpu") for x in (a, b))
    return (
        a_host.dtype == b_host.dtype
        and a_host.shape == b_host.shape
        and a_host.tobytes() == b_host.tobytes()
    )


def values(dtype, shape):
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=int(np.prod(shape)) * np.dtype(dtype).itemsize, dtype=np.uint8)
    x = raw.view(np.dtype(dtype)).reshape(shape).copy()
    if np.dtype(dtype).kind == "b":
        x = np.asarray(raw[: x.size].reshape(shape) % 2 == 1)
    return x


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(), (0,), (3, 0), (5,), (2, 3, 4)], ids=str)
def test_every_dtype_and_shape_round_trips_bit_exactly(tmp_path, dtype, shape):
    x = values(dtype, shape)
    path = tmp_path / "x.safetensors"
    cp.save({"x": x}, path)
    back = cp.load(path)["x"]
    assert type(back) is np.ndarray
    assert back.flags.writeable
    assert back.flags.c_contiguous
    assert same_bits(back, x)


def test_nan_payloads_and_signed_zeros_survive(tmp_path):
    x = np.array([0x7FF8_0000_0000_1234, 0x8000_0000_0000_0000], np.uint64).view(np.float64)
    cp.save([x, -0.0, float("nan"), float("-inf")], tmp_path / "f")
    arr, neg_zero, nan, neg_inf = cp.load(tmp_path / "f")
    assert arr.tobytes() == x.tobytes()
    assert str(neg_zero) == "-0.0"
    assert nan != nan
    assert neg_inf == float("-inf")


def test_non_contiguous_and_fortran_inputs_are_saved_as_values(tmp_path):
    base = np.arange(60.0).reshape(5, 12)
    tree = {"strided": base[::2, 1::3], "fortran": np.asfortranarray(base), "t": base.T}
    cp.save(tree, tmp_path / "v")
    back = cp.load(tmp_path / "v")
    for key, x in tree.items():
        assert back[key].flags.c_contiguous
        np.testing.assert_array_equal(back[key], x)


def test_structure_and_scalars_round_trip(tmp_path):
    tree = {
        "b": [True, False, None, 2**100, -7, 1.5, 1 - 2j, "naïve ✓", b"\x00\xff"],
        0: (),
        "a": collections.OrderedDict([("z", 1), ("y", {})]),
        3.5: Point(x=np.float32(1.25), y=np.int8(-3)),
        None: [[], ()],
    }
    cp.save(tree, tmp_path / "t")
    back = cp.load(tmp_path / "t")
    assert back == tree
    assert list(back) == list(tree)  # dicts keep their order (optree sorts keys when flattening)
    assert list(back["a"]) == ["z", "y"]
    assert type(back["a"]) is collections.OrderedDict
    point = back[3.5]
    assert type(point).__name__ == "Point"
    assert point._fields == ("x", "y")
    assert type(point.x) is np.float32
    assert type(point.y) is np.int8
    assert type(back["b"][3]) is int


def test_arrays_come_back_on_their_devices_or_on_device(tmp_path):
    cp.set_host_device_count(2)
    tree = {
        "h1": cp.to_device(np.arange(4.0), "host:1"),
        "h0": cp.to_device(np.ones((2, 2), np.int32), "host:0"),
        "c": np.zeros(3),
    }
    cp.save(tree, tmp_path / "d")
    back = cp.load(tmp_path / "d")
    assert [str(device_of(back[k])) for k in ("h1", "h0", "c")] == ["host:1", "host:0", "cpu"]
    assert type(back["h1"]) is HostArray
    assert all(same_bits(back[k], tree[k]) for k in tree)
    moved = cp.load(tmp_path / "d", device="host:1")
    assert {str(device_of(v)) for v in moved.values()} == {"host:1"}
    assert all(same_bits(moved[k], tree[k]) for k in tree)
    on_cpu = cp.load(tmp_path / "d", device="cpu")
    assert all(type(v) is np.ndarray for v in on_cpu.values())


def test_cupy_arrays_round_trip_on_simulated_gpus(tmp_path):
    from cupy_parallel.testing import simulated_cuda

    with simulated_cuda(2):
        x = cp.to_device(values("f4", (3, 5)), "cuda:1")
        z = cp.to_device(values("c16", (4,)), "cuda:0")
        cp.save({"x": x[:, ::2], "z": z}, tmp_path / "g")
        back = cp.load(tmp_path / "g")
        assert device_of(back["x"]) == Device("cuda", 1)
        assert device_of(back["z"]) == Device("cuda", 0)
        assert same_bits(back["x"], x[:, ::2])
        assert same_bits(back["z"], z)
        on_host = cp.load(tmp_path / "g", device="cpu")
        assert same_bits(on_host["z"], z)
    cpu_only = cp.load(tmp_path / "g", device="cpu")  # no GPU now: still readable on the cpu
    assert cpu_only["z"].dtype == np.complex128
    with pytest.raises(ValueError, match=r"saved on cuda:\d.*device="):
        cp.load(tmp_path / "g")


def test_other_tools_read_the_arrays_by_key_path(tmp_path):
    from safetensors.numpy import load_file

    cp.save({"layer": [{"w": np.arange(3.0)}], "step": 4}, tmp_path / "m")
    assert list(load_file(tmp_path / "m")) == ["layer.0.w"]
    np.testing.assert_array_equal(load_file(tmp_path / "m")["layer.0.w"], np.arange(3.0))
    # every dtype safetensors has, 0-d and empty arrays: safetensors' own reader agrees
    arrays = {c: values(c, (3, 2)) for c in ("?", "i1", "u1", "i2", "u2", "i4", "u4", "i8")}
    arrays |= {c: values(c, (5,)) for c in ("u8", "f2", "f4", "f8", "c8")}
    arrays |= {"zero_d": np.array(7, np.int16), "empty": np.zeros((0, 4), np.float32)}
    cp.save(arrays, tmp_path / "all")
    theirs = load_file(tmp_path / "all")
    assert sorted(theirs) == sorted(arrays)
    assert all(same_bits(theirs[k], arrays[k]) for k in arrays)


def test_safetensors_reads_every_dtype_we_write_bit_exactly(tmp_path):
    """safetensors' own readers (load_file, safe_open) are the oracle of the layout we write:
    each dtype it has comes back as itself, each other one as its bytes (uint8, last axis the
    item size), 0-d, empty and non-contiguous arrays included."""
    from safetensors import safe_open
    from safetensors.numpy import load_file

    arrays = {f"{c}{shape}": values(c, shape) for c in DTYPES for shape in [(), (0, 2), (3, 4)]}
    arrays["strided"] = values("f8", (6, 4))[::2, ::-1]
    arrays["fortran"] = np.asfortranarray(values("c16", (3, 5)))
    cp.save(arrays, tmp_path / "all")
    theirs = load_file(tmp_path / "all")
    with safe_open(tmp_path / "all", framework="np") as handle:
        mapped = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
    assert sorted(theirs) == sorted(mapped) == sorted(arrays)
    native = {np.dtype(c) for c in ("?", "i1", "u1", "i2", "u2", "i4", "u4", "i8", "u8")}
    native |= {np.dtype(c) for c in ("f2", "f4", "f8", "c8")}
    for name, array in arrays.items():
        for got in (theirs[name], mapped[name]):
            if array.dtype in native:
                assert same_bits(got, array), name
            else:
                assert got.dtype == np.uint8, name
                assert got.shape == (*array.shape, array.dtype.itemsize), name
                assert got.tobytes() == np.ascontiguousarray(array).tobytes(), name


def test_key_paths_that_read_alike_get_tensors_of_their_own(tmp_path):
    tree = {"a.b#1": np.zeros(1), "a.b": np.ones(1), "a": {"b": np.full(1, 2.0)}, "__x": np.ones(2)}
    cp.save(tree, tmp_path / "names")
    assert_tree_equal(cp.load(tmp_path / "names"), tree)


def test_a_plain_safetensors_file_loads_as_a_dict(tmp_path):
    from safetensors.numpy import save_file

    save_file({"a": np.arange(3, dtype=np.int16), "b": np.ones((2, 2))}, tmp_path / "p")
    back = cp.load(tmp_path / "p")
    assert sorted(back) == ["a", "b"]
    assert same_bits(back["a"], np.arange(3, dtype=np.int16))


class Opaque:
    pass


@pytest.mark.parametrize(
    ("tree", "match"),
    [
        ({"a": [1, Opaque()]}, r"tree\['a'\]\[1\] is a test_serialization\.Opaque.*no pickle"),
        ({"o": np.array([None, 1], dtype=object)}, r"tree\['o'\] .*dtype object"),
        ({"s": np.zeros(2, dtype="i4,f8")}, r"tree\['s'\] .*structured"),
        ([{1, 2}], r"tree\[0\] is a builtins\.set"),
        ({(1, 2): 3}, r"dict key is a tuple"),
        ({"f": lambda: 0}, r"tree\['f'\] is a builtins\.function"),
    ],
)
def test_objects_are_refused_before_anything_is_written(tmp_path, tree, match):
    with pytest.raises(TypeError, match=match):
        cp.save(tree, tmp_path / "refused")
    assert os.listdir(tmp_path) == []


def test_not_a_checkpoint_and_truncated_files_name_the_path(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("hello, not a checkpoint")
    with pytest.raises(ValueError, match=r"notes\.txt is not a checkpoint"):
        cp.load(text)
    path = tmp_path / "state"
    cp.save({"w": np.arange(1000.0)}, path)
    data = path.read_bytes()
    for cut in (4, 40, len(data) - 8):
        path.write_bytes(data[:cut])
        with pytest.raises(ValueError, match=rf"{path.name} is not a checkpoint.*truncated"):
            cp.load(path)
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        cp.load(tmp_path / "absent")


def test_template_gives_its_classes_and_checks_every_key(tmp_path):
    cp.set_host_device_count(2)
    path = tmp_path / "tpl"
    cp.save({"p": Point(np.arange(3.0), 2), "q": [np.ones(2, np.float32)]}, path)
    template = {
        "p": Point(np.zeros(3), 0),
        "q": [cp.to_device(np.zeros(2, np.float32), "host:1")],
    }
    back = cp.load(path, template=template)
    assert type(back["p"]) is Point
    assert back["p"].y == 2
    np.testing.assert_array_equal(back["p"].x, np.arange(3.0))
    assert device_of(back["q"][0]) == Device("host", 1)  # the template's array's device
    np.testing.assert_array_equal(template["p"].x, np.zeros(3))  # untouched
    with pytest.raises(KeyError, match=r"tpl has no tree\['r'\]"):
        cp.load(path, template={**template, "r": 1})
    with pytest.raises(KeyError, match=r"tpl holds tree\['q'\]\[0\], which the template"):
        cp.load(path, template={"p": template["p"]})
    with pytest.raises(ValueError, match=r"tree\['p'\]\.x was saved with shape \(3,\) and dtype"):
        cp.load(path, template={**template, "p": Point(np.zeros(4), 0)})
    with pytest.raises(ValueError, match=r"tree\['q'\]\[0\] was saved .* float32.*float64"):
        cp.load(path, template={**template, "q": [np.zeros(2)]})


def test_registered_nodes_need_a_template(tmp_path):
    class Pair:
        def __init__(self, a, b):
            self.a, self.b = a, b

    optree.register_pytree_node(
        Pair, lambda p: ((p.a, p.b), None, ("a", "b")), lambda _, c: Pair(*c), namespace=NAMESPACE
    )
    try:
        cp.save({"pair": Pair(np.arange(2), 3.0)}, tmp_path / "n")
        with pytest.raises(ValueError, match=r"tree\['pair'\] is a .*Pair.*template="):
            cp.load(tmp_path / "n")
        back = cp.load(tmp_path / "n", template={"pair": Pair(np.zeros(2, int), 0.0)})
        assert type(back["pair"]) is Pair
        assert back["pair"].b == 3.0
        np.testing.assert_array_equal(back["pair"].a, np.arange(2))
    finally:
        optree.unregister_pytree_node(Pair, namespace=NAMESPACE)


def test_bfloat16_round_trips_when_ml_dtypes_is_installed(tmp_path):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x = values("u2", (5,)).view(ml_dtypes.bfloat16)
    cp.save([x], tmp_path / "bf")
    assert same_bits(cp.load(tmp_path / "bf")[0], x)


def test_saving_over_a_file_replaces_it_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "ckpt"
    cp.save({"v": 1}, path)
    cp.save({"v": 2}, path)
    assert cp.load(path) == {"v": 2}
    assert os.listdir(tmp_path) == ["ckpt"]


def _resident_pages(fd, size):
    """How many of the file's pages are in the page cache (Linux ``mincore`` of a mapping)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int]
    libc.mmap.argtypes += [ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    assert address not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
    try:
        pages = (ctypes.c_ubyte * -(-size // mmap.PAGESIZE))()
        assert libc.mincore(address, size, pages) == 0, ctypes.get_errno()
        return sum(page & 1 for page in pages)
    finally:
        libc.munmap(address, size)


@pytest.mark.skipif(sys.platform != "linux", reason="mincore and posix_fadvise as on Linux")
def test_saving_over_a_file_first_drops_its_cached_pages(tmp_path):
    # so that the new file's pages reuse the old one's memory (benchmarks/bench_save.py)
    path = tmp_path / "ckpt"
    cp.save({"w": np.full(1 << 20, 1.0)}, path)
    fd = os.open(path, os.O_RDONLY)  # the previous version's inode, after the rename too
    try:
        size = os.fstat(fd).st_size
        before = _resident_pages(fd, size)
        if before == 0:
            pytest.skip("this file system keeps no written pages in the cache")
        cp.save({"w": np.full(1 << 20, 2.0)}, path)
        assert _resident_pages(fd, size) == 0
        assert os.pread(fd, 16, size - 16) == np.full(2, 1.0).tobytes()  # its bytes are intact
    finally:
        os.close(fd)
    assert cp.load(path)["w"][0] == 2.0


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs")
def test_saving_over_a_fifo_replaces_it_without_opening_it(tmp_path):
    os.mkfifo(tmp_path / "pipe")  # opening it to read would wait for a writer forever
    cp.save({"v": 1}, tmp_path / "pipe")
    assert cp.load(tmp_path / "pipe") == {"v": 1}


# ------------------------------------------------------------------------------------------
# Atomicity: a child process saves ~200 MB versions in a loop and is killed at random moments

# Forks each child from one process that has imported the library already, so that a trial costs
# its save and its kill, not an interpreter start. A line "N" starts a child that saves versions
# N+1, N+2, ... in a loop; the next line kills it (SIGKILL), reaps it and answers "gone".
# Single-threaded, so fork is safe here.
ZYGOTE = textwrap.dedent(
    """
    import os, signal, sys, numpy as np, cupy_parallel as cp
    path = sys.argv[1]
    print("ready", flush=True)
    for line in sys.stdin:
        child = os.fork()
        if child == 0:
            version = int(line)
            while True:
                version += 1
                cp.save({"version": version, "w": np.full(25_000_000, float(version))}, path)
        print("started", flush=True)
        sys.stdin.readline()
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
        print("gone", flush=True)
    """
)


@pytest.mark.slow  # ~20 s: 20 kills of a 200 MB save, each version loaded whole
def test_a_save_killed_at_any_moment_leaves_a_complete_version(tmp_path):
    path = tmp_path / "ckpt"
    start = time.perf_counter()
    cp.save({"version": 0, "w": np.full(25_000_000, 0.0)}, path)
    one_save = time.perf_counter() - start  # as slow as this machine is now (a loaded CI too)
    rng = random.Random(1234)
    seen = set()
    zygote = subprocess.Popen(
        [sys.executable, "-c", ZYGOTE, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)),
    )
    assert zygote.stdin is not None
    assert zygote.stdout is not None

    def say(line: str, answer: str) -> None:
        zygote.stdin.write(line + "\n")
        zygote.stdin.flush()
        assert zygote.stdout.readline() == answer + "\n"

    try:
        assert zygote.stdout.readline() == "ready\n"
        for trial in range(20):
            say(str(1000 * (trial + 1)), "started")
            time.sleep(rng.uniform(0.0, 2.0 * one_save))  # in its first save or its second
            say("kill", "gone")
            state = cp.load(path)
            version = state["version"]
            seen.add(version)
            w = state["w"]
            assert w.shape == (25_000_000,)
            assert w[0] == w[-1] == float(version)  # one whole version, never a mix
            assert np.all(w == float(version))
    finally:
        zygote.kill()
        zygote.communicate()
    assert len(seen) > 1  # the kills landed at different points


def test_a_crafted_file_naming_an_object_dtype_is_refused(tmp_path):
    """A file that says "view these bytes as object references" must not be obeyed."""
    import json

    from safetensors import safe_open

    path = tmp_path / "evil"
    cp.save({"x": np.zeros(2, np.complex128)}, path)  # stored as bytes, true dtype in metadata
    with safe_open(path, framework="np") as f:
        description = json.loads(f.metadata()["cupy_parallel"])
    description["leaves"][0]["dtype"] = "|O"
    description["leaves"][0]["shape"] = [4]
    from cupy_parallel._src.serialization import write_safetensors

    data = {"x": np.zeros((2, 16), np.uint8)}
    write_safetensors(str(path), data, {"cupy_parallel": json.dumps(description)})
    with pytest.raises(ValueError, match=r"evil is damaged: .*dtype '\|O', which does not hold"):
        cp.load(path)


@settings(max_examples=30, deadline=None)
@given(nested_structures(arrays(non_contiguous=True), max_leaves=6))
def test_random_structures_round_trip_into_a_template_of_themselves(tree):
    """Every container the library's pytrees have (defaultdict and deque too) and any array."""
    import tempfile

    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "tree")
        cp.save(tree, path)
        assert_tree_equal(cp.load(path, template=tree), tree)
