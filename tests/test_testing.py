"""Tests of cupy_parallel.testing: the strategies draw what they promise, the assertion is exact."""

from __future__ import annotations

import copy
import math
import subprocess
import sys
from collections import OrderedDict, defaultdict, deque, namedtuple
from typing import Any

import numpy as np
import optree
import pytest
from hypothesis import find, given, settings
from hypothesis import strategies as st

import cupy_parallel
from cupy_parallel.testing import (
    arrays,
    assert_distributed_matches,
    assert_tree_equal,
    devices,
    nested_structures,
    rank_arrays,
)

ALL_DTYPES = {
    np.dtype(t)
    for t in (
        "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
        "float16", "float32", "float64", "complex64", "complex128",
    )
}  # fmt: skip


def _node_types(tree: Any) -> set[type]:
    """Every container type in a tree (optree calls is_leaf on each node before expanding it)."""
    seen: set[type] = set()

    def record(node: Any) -> bool:
        seen.add(type(node))
        return False

    optree.tree_flatten(tree, is_leaf=record, namespace="cupy_parallel")
    return seen


# --------------------------------------------------------------------------------------------
# arrays


@pytest.mark.slow
def test_arrays_draw_every_dtype():
    drawn: set[np.dtype[Any]] = set()

    @settings(max_examples=300, database=None)
    @given(arrays(max_dims=1))
    def collect(x):
        drawn.add(x.dtype)

    collect()
    assert drawn == ALL_DTYPES


@given(arrays(min_dims=1, max_dims=3, min_side=1, max_side=3, non_contiguous=True))
def test_arrays_respect_shape_bounds(x):
    assert 1 <= x.ndim <= 3
    assert all(1 <= n <= 3 for n in x.shape)
    assert type(x) is np.ndarray


@given(arrays(np.bool_, (4, 5)))
def test_bool_arrays_hold_only_0_and_1(x):
    assert x.view(np.uint8).max(initial=0) <= 1


@pytest.mark.slow
def test_arrays_find_bit_patterns_and_layouts():
    nan_payload = find(
        arrays(np.float32, (3,)),
        lambda x: bool(np.isnan(x).any()) and 0x7FC00000 not in x.view(np.uint32)[np.isnan(x)],
    )
    assert np.isnan(nan_payload).any()
    negative_zero = find(arrays(np.float64, (2,)), lambda x: bool(np.signbit(x[x == 0]).any()))
    assert np.signbit(negative_zero[negative_zero == 0]).any()
    empty = find(arrays(min_dims=2), lambda x: x.size == 0)
    assert 0 in empty.shape
    strided = find(arrays(min_dims=2, min_side=2, non_contiguous=True), _not_contiguous)
    assert not strided.flags.c_contiguous
    negative = find(arrays(min_dims=1, min_side=2, non_contiguous=True), _negative_stride)
    assert min(negative.strides) < 0


def _not_contiguous(x: Any) -> bool:
    return not x.flags.c_contiguous


def _negative_stride(x: Any) -> bool:
    return min(x.strides) < 0


@given(arrays(np.float64, (3, 4), non_contiguous=True))
def test_non_contiguous_views_read_their_base(x):
    # The view and a contiguous copy hold the same bits, whatever the strides.
    assert x.tobytes() == np.ascontiguousarray(x).tobytes()


@given(arrays(st.sampled_from([np.float16, np.complex64]), (6,), finite=True))
def test_finite_arrays_are_finite(x):
    assert np.isfinite(x).all()


@pytest.mark.slow
@given(st.data())
def test_arrays_on_a_device(data):
    device = data.draw(st.sampled_from(cupy_parallel.devices()))
    x = data.draw(arrays(min_dims=1, non_contiguous=True, device=device))
    assert cupy_parallel.device_of(x) == device
    y = data.draw(arrays(device=st.sampled_from(["host:2", "host:3"])))
    assert str(cupy_parallel.device_of(y)) in {"host:2", "host:3"}


def test_arrays_fixed_dtype_and_int_shape():
    x = find(arrays("uint16", 5), lambda a: True)
    assert x.shape == (5,)
    assert x.dtype == np.uint16


# --------------------------------------------------------------------------------------------
# devices


@pytest.fixture
def host_platform(monkeypatch: pytest.MonkeyPatch) -> None:
    """Device-count tests read the host platform's 8 devices, also on a machine with GPUs."""
    monkeypatch.setenv("CUPY_PARALLEL_PLATFORM", "host")


@pytest.mark.usefixtures("host_platform")
@given(devices(min_size=2, max_size=5))
def test_devices_are_distinct_platform_devices(ds):
    assert 2 <= len(ds) <= 5
    assert len(set(ds)) == len(ds)
    assert set(ds) <= set(cupy_parallel.devices())


@pytest.mark.usefixtures("host_platform")
def test_devices_come_in_any_order_and_up_to_eight():
    assert find(devices(), lambda ds: ds != sorted(ds, key=lambda d: d.index)) is not None
    assert len(find(devices(), lambda ds: len(ds) == 8)) == 8


@pytest.mark.usefixtures("host_platform")
def test_devices_may_repeat_when_not_unique():
    ds = find(devices(min_size=2, unique=False), lambda ds: len(set(ds)) < len(ds))
    assert len(set(ds)) < len(ds)


@pytest.mark.usefixtures("host_platform")
def test_devices_follow_the_host_device_count():
    cupy_parallel.set_host_device_count(3)
    ds = find(devices(), lambda ds: len(ds) == 3)
    assert sorted(d.index for d in ds) == [0, 1, 2]


@pytest.mark.usefixtures("host_platform")
def test_devices_errors():
    with pytest.raises(ValueError, match=r"1 <= min_size <= max_size, got min_size=3, max_size=2"):
        devices(min_size=3, max_size=2)
    cupy_parallel.set_host_device_count(2)

    @given(devices(min_size=3))
    def draw(ds):
        pass

    with pytest.raises(ValueError, match=r"needs 3 distinct devices but the platform has 2"):
        draw()


# --------------------------------------------------------------------------------------------
# nested_structures


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind",
    [tuple, list, dict, OrderedDict, defaultdict, deque, "namedtuple"],
    ids=lambda k: k if isinstance(k, str) else k.__name__,
)
def test_nested_structures_draw_every_container(kind):
    if kind == "namedtuple":
        tree = find(
            nested_structures(st.just(1)),
            lambda t: any(optree.is_namedtuple_class(k) for k in _node_types(t)),
        )
        assert any(optree.is_namedtuple_class(k) for k in _node_types(tree))
    else:
        tree = find(nested_structures(st.just(1)), lambda t: kind in _node_types(t))
        assert kind in _node_types(tree)


@pytest.mark.slow
def test_nested_structures_draw_none_nan_and_nesting():
    tree = find(
        nested_structures(st.just(1)), lambda t: None in optree.tree_leaves(t, none_is_leaf=True)
    )
    assert None in optree.tree_leaves(tree, none_is_leaf=True)
    deep = find(nested_structures(st.just(1)), lambda t: optree.tree_structure(t).num_nodes >= 6)
    assert optree.tree_structure(deep).num_nodes >= 6
    nan = find(
        nested_structures(st.just(1)),
        lambda t: any(isinstance(x, float) and math.isnan(x) for x in optree.tree_leaves(t)),
    )
    assert nan is not None
    ordered = find(
        nested_structures(st.just(1)),
        lambda t: isinstance(t, OrderedDict) and list(t) != sorted(t),
    )
    assert list(ordered) != sorted(ordered)
    bounded = find(
        nested_structures(st.just(1)), lambda t: isinstance(t, deque) and t.maxlen is not None
    )
    assert bounded.maxlen >= len(bounded)


@given(nested_structures(st.just("leaf"), none=False, other_leaves=False, max_leaves=5))
def test_nested_structures_only_hold_the_given_leaves(tree):
    assert set(optree.tree_leaves(tree, none_is_leaf=True)) <= {"leaf"}


# --------------------------------------------------------------------------------------------
# assert_tree_equal


@given(nested_structures(arrays(non_contiguous=True)))
def test_a_tree_equals_its_deep_copy(tree):
    assert_tree_equal(tree, copy.deepcopy(tree))
    fresh = optree.tree_map(_fresh_copy, tree, namespace="cupy_parallel")
    assert_tree_equal(tree, fresh)


def _fresh_copy(x: Any) -> Any:
    return np.array(x, order="C", copy=True) if cupy_parallel.is_array(x) else x


@given(st.data())
def test_arrays_compare_by_their_bits(data):
    # Oracle: the raw bytes of two C-contiguous arrays of one dtype and shape.
    dtype = data.draw(st.sampled_from(sorted(ALL_DTYPES, key=str)))
    a = data.draw(arrays(dtype, (3,)))
    b = data.draw(st.sampled_from([a.copy(), data.draw(arrays(dtype, (3,)))]))
    if a.tobytes() == b.tobytes():
        assert_tree_equal([a], [b])
    else:
        with pytest.raises(
            AssertionError, match=r"^Trees differ at \[0\]: \d of 3 elements differ"
        ):
            assert_tree_equal([a], [b])


def test_nan_payloads_and_negative_zero_differ():
    quiet = np.array([np.nan], np.float32)
    payload = np.array([0x7FC00001], np.uint32).view(np.float32)
    assert_tree_equal(quiet, quiet.copy())
    with pytest.raises(AssertionError, match=r"first at index \(0,\): .*0x7fc00000.*0x7fc00001"):
        assert_tree_equal(quiet, payload)
    with pytest.raises(AssertionError, match=r"at \['x'\]: 1 of 2 elements.*index \(1,\)"):
        assert_tree_equal({"x": np.array([1.0, 0.0])}, {"x": np.array([1.0, -0.0])})


Point = namedtuple("Point", ["x", "y"])
Other = namedtuple("Other", ["x", "y"])


@pytest.mark.parametrize(
    ("actual", "expected", "message"),
    [
        ([np.zeros(2, np.float32)], [np.zeros(2)], r"at \[0\]: dtype float32 != float64"),
        ({"a": np.zeros((2, 1))}, {"a": np.zeros((1, 2))}, r"\['a'\]: shape \(2, 1\) != \(1, 2\)"),
        ([1, [2]], [1, (2,)], r"in structure at \[1\]: actual has \[\*\], expected has \(\*,\)"),
        ({"a": 1}, {"b": 1}, r"in structure at \(the root\): actual has \{'a': \*\}"),
        (Point(1, 2), Other(1, 2), r"in structure at \(the root\): actual has Point"),
        (
            {"d": defaultdict(list, a=1)},
            {"d": defaultdict(int, a=1)},
            r"at \['d'\]: actual has defaultdict\(<class 'list'>",
        ),
        ([deque([1], maxlen=2)], [deque([1], maxlen=3)], r"at \[0\]: .*maxlen=2.*maxlen=3"),
        (OrderedDict(a=1, b=2), OrderedDict(b=2, a=1), r"actual has OrderedDict\(\{'a'"),
        ([None], [0], r"at \[0\]: actual has None, expected has a leaf"),
        ({"t": (1, "x")}, {"t": (1, "y")}, r"at \['t'\]\[1\]: 'x' != 'y'"),
        ([1], [True], r"at \[0\]: 1 != True"),
        ([np.zeros(1)], [0.0], r"at \[0\]: actual is ndarray, expected float"),
    ],
    ids=[
        "dtype", "shape", "list-vs-tuple", "keys", "namedtuple-type", "default_factory",
        "maxlen", "ordereddict-order", "none-vs-leaf", "non-array-leaf", "int-vs-bool",
        "array-vs-float",
    ],
)  # fmt: skip
def test_differences_name_the_key_path(actual, expected, message):
    with pytest.raises(AssertionError, match=message):
        assert_tree_equal(actual, expected)


def test_device_is_compared_unless_told_otherwise():
    x = np.arange(3.0)
    on_host = cupy_parallel.to_device(x, "host:1")
    with pytest.raises(AssertionError, match=r"at \['w'\]: device host:1 != cpu"):
        assert_tree_equal({"w": on_host}, {"w": x})
    assert_tree_equal({"w": on_host}, {"w": x}, check_device=False)


def test_equal_trees_pass():
    tree = {
        "a": [np.float16(1), float("nan"), None, "s"],
        "b": defaultdict(list, k=np.arange(3)),
        "c": deque([np.zeros((0, 2))], maxlen=4),
        "d": OrderedDict(z=1, y=Point(np.ones(1, bool), 2 + 0j)),
    }
    assert_tree_equal(tree, copy.deepcopy(tree))
    assert_tree_equal({"a": 1, "b": 2}, {"b": 2, "a": 1})  # dict order does not matter, as with ==


# --------------------------------------------------------------------------------------------
# Packaging and CUDA


def test_import_cupy_parallel_does_not_need_hypothesis():
    code = "import sys, cupy_parallel; print('hypothesis' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False"


@pytest.mark.gpu
@given(st.data())
def test_cupy_arrays_are_drawn_and_compared(data):
    cupy = pytest.importorskip("cupy")
    x = data.draw(arrays(min_dims=1, non_contiguous=True, device="cuda:0"))
    assert isinstance(x, cupy.ndarray)
    assert cupy_parallel.device_of(x) == cupy_parallel.Device("cuda", 0)
    assert_tree_equal([x], [x.copy()])
    assert_tree_equal(x, cupy.asnumpy(x), check_device=False)
    with pytest.raises(AssertionError, match=r"device cuda:0 != cpu"):
        assert_tree_equal(x, cupy.asnumpy(x))
    if x.size and x.dtype.kind == "f":
        flipped = x.copy()
        flipped[(0,) * x.ndim] = -flipped[(0,) * x.ndim]  # flips the sign bit, even of 0 or NaN
        with pytest.raises(AssertionError, match=r"elements differ in their bits"):
            assert_tree_equal(x, flipped)


# --------------------------------------------------------------------------------------------
# rank_arrays and assert_distributed_matches


@settings(max_examples=30, database=None)
@given(rank_arrays(np.float32, (2, 3), min_size=2, max_size=3, finite=True))
def test_rank_arrays_share_dtype_and_shape(xs):
    assert 2 <= len(xs) <= 3
    assert {(x.dtype, x.shape) for x in xs} == {(np.dtype(np.float32), (2, 3))}
    assert all(np.isfinite(x).all() for x in xs)


def test_rank_arrays_draw_one_dtype_per_world_and_fixed_sizes():
    worlds = []

    @settings(max_examples=60, database=None)
    @given(rank_arrays(world_size=3, max_dims=1))
    def collect(xs):
        worlds.append(xs)

    collect()
    assert {len(xs) for xs in worlds} == {3}
    assert all(len({(x.dtype, x.shape) for x in xs}) == 1 for xs in worlds)
    assert len({xs[0].dtype for xs in worlds}) > 3  # the dtype varies between worlds


def _all_reduced(x):
    import cupy_parallel.distributed as dist

    y = x.copy()
    dist.all_reduce(y)
    return y


def test_assert_distributed_matches_compares_every_rank_with_the_oracle():
    xs = [np.array([1.0, 2.0]), np.array([3.0, 5.0]), np.array([0.5, 0.25])]
    results = assert_distributed_matches(_all_reduced, xs, lambda xs: [sum(xs)] * len(xs))
    np.testing.assert_array_equal(results[2], [4.5, 7.25])
    wrong = [sum(xs), sum(xs), sum(xs) + 1]  # rank 2's oracle is off by one
    with pytest.raises(AssertionError, match=r"rank 2 of 3 differs from the oracle"):
        assert_distributed_matches(_all_reduced, xs, lambda _: wrong)
    near = [sum(xs) * (1 + 1e-9)] * 3
    with pytest.raises(AssertionError, match="differ in their bits"):  # bit-exact by default
        assert_distributed_matches(_all_reduced, xs, lambda _: near)
    assert_distributed_matches(_all_reduced, xs, lambda _: near, rtol=1e-8)
    with pytest.raises(AssertionError, match=r"(?s)rank 0 of 3.*Not equal to tolerance"):
        assert_distributed_matches(_all_reduced, xs, lambda _: near, rtol=1e-12)


def test_assert_distributed_matches_refuses_bad_arguments():
    xs = [np.zeros(1)]
    with pytest.raises(TypeError, match=r"fn must be callable as fn\(my_input\), got int"):
        assert_distributed_matches(3, xs, list)
    with pytest.raises(ValueError, match="inputs must hold one input per rank"):
        assert_distributed_matches(_all_reduced, [], list)
    with pytest.raises(ValueError, match="rtol and atol must be >= 0"):
        assert_distributed_matches(_all_reduced, xs, list, atol=-1)
    with pytest.raises(ValueError, match=r"oracle must return one result per rank \(1\), got 2"):
        assert_distributed_matches(_all_reduced, xs, lambda xs: [xs[0], xs[0]])


def _sum_and_rank(x):
    import cupy_parallel.distributed as dist

    return {"sum": _all_reduced(x), "rank": dist.get_rank(), "note": None}


def test_assert_distributed_matches_with_a_tolerance_compares_other_leaves_exactly():
    xs = [np.array([1.0]), np.array([2.0])]

    def oracle(xs, *, rank_of=lambda r: r, dtype=np.float64, scale=1 + 1e-12):
        total = (sum(xs) * scale).astype(dtype)
        return [{"sum": total, "rank": rank_of(r), "note": None} for r in range(len(xs))]

    assert_distributed_matches(_sum_and_rank, xs, oracle, rtol=1e-9)
    with pytest.raises(AssertionError, match=r"rank 1 of 2 differs.*\['rank'\]: 1 != 0"):
        assert_distributed_matches(
            _sum_and_rank, xs, lambda xs: oracle(xs, rank_of=lambda r: 0), rtol=1e-9
        )
    with pytest.raises(AssertionError, match="rank 0 of 2 differs"):  # dtypes must agree
        assert_distributed_matches(
            _sum_and_rank, xs, lambda xs: oracle(xs, dtype=np.float32), rtol=1e-3
        )
