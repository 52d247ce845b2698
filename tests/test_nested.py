"""Tests of scatter / scatter_kwargs / gather of nested structures (cupy_parallel._src.nested)."""

from __future__ import annotations

import re
import warnings
from collections import OrderedDict, defaultdict, deque, namedtuple
from typing import Any

import numpy as np
import optree
import pytest
from hypothesis import given
from hypothesis import strategies as st

import cupy_parallel
from cupy_parallel import Device, device_of, is_array, to_device
from cupy_parallel._src import ops
from cupy_parallel._src.nested import gather, scatter, scatter_kwargs
from cupy_parallel._src.tape import Tape
from cupy_parallel.testing import arrays, assert_tree_equal, devices, nested_structures

NS = "cupy_parallel"
H = [Device("host", k) for k in range(8)]


def _numpy(x: Any) -> np.ndarray:
    """A plain NumPy copy of an array on any device (the oracle computes on the host)."""
    return x.get() if not isinstance(x, np.ndarray) else np.asarray(x).copy()


def _expected_replicas(tree: Any, devs: list[Device], dim: int) -> list[Any]:
    """The oracle: replica count by the rule, chunks by ``numpy.array_split`` (larger first)."""
    leaves = [x for x in optree.tree_leaves(tree, namespace=NS) if is_array(x)]
    counts = [1 if x.shape[dim] == 0 else min(len(devs), x.shape[dim]) for x in leaves]
    n = min(counts, default=len(devs))

    def replica(r: int) -> Any:
        def chunk(x: Any) -> Any:
            if not is_array(x):
                return x
            return to_device(np.array_split(_numpy(x), n, axis=dim)[r], devs[r])

        return optree.tree_map(chunk, tree, namespace=NS)

    return [replica(r) for r in range(n)]


# --------------------------------------------------------------------------------------------
# The round trip, bit-exact, over random structures, dtypes, layouts, dims and device lists


def _with_size(shape: list[int], dim: int, size: int) -> list[int]:
    shape[dim] = size
    return shape


@st.composite
def _cases(draw: st.DrawFn) -> tuple[Any, list[Device], int, Device]:
    dim = draw(st.sampled_from([0, 1, 2, -1, -2]))
    need = dim + 1 if dim >= 0 else -dim
    shapes = st.integers(need, max(need, 3)).flatmap(
        lambda ndim: st.lists(st.integers(0, 3), min_size=ndim, max_size=ndim)
    )
    if draw(st.booleans()):  # every array has the same size along dim, so replicas vary
        size = draw(st.integers(0, 10))
        shapes = shapes.map(lambda shape: _with_size(shape, dim, size))
    places = st.sampled_from([Device("cpu"), *cupy_parallel.devices()])
    leaves = arrays(shape=shapes, non_contiguous=True, device=places)
    structures = nested_structures(leaves, max_leaves=6)
    tree = draw(structures | st.tuples(leaves, structures))
    devs = draw(devices())
    target = draw(st.sampled_from([Device("cpu"), *cupy_parallel.devices()]))
    return tree, devs, dim, target


@pytest.mark.slow
@given(_cases())
def test_gather_of_scatter_is_the_identity(case):
    tree, devs, dim, target = case
    parts = scatter(tree, devs, dim)

    expected = _expected_replicas(tree, devs, dim)
    assert len(parts) == len(expected)
    for r, (part, want) in enumerate(zip(parts, expected, strict=True)):
        assert_tree_equal(part, want)  # chunk r holds the r-th array_split piece, on devs[r]
        for x in optree.tree_leaves(part, namespace=NS):
            assert not is_array(x) or device_of(x) == devs[r]

    back = gather(parts, target, dim)
    on_target = optree.tree_map(
        lambda x: to_device(x, target) if is_array(x) else x, tree, namespace=NS
    )
    assert_tree_equal(back, on_target)
    leaves = zip(*(optree.tree_leaves(t, namespace=NS) for t in (back, tree)), strict=True)
    assert all(is_array(a) or a is b for a, b in leaves)  # non-array leaves: the same objects


# --------------------------------------------------------------------------------------------
# The replica-count rule


def test_replicas_are_the_fewest_chunks_and_no_data_is_lost():
    tree = {"short": np.arange(3), "long": np.arange(8.0)}
    parts = scatter(tree, H[:4])
    assert len(parts) == 3  # "short" gives 3 chunks on 4 devices
    assert [p["long"].shape[0] for p in parts] == [3, 3, 2]  # torch would drop rows 6..7
    assert_tree_equal(gather(parts, "cpu"), tree)


def test_batch_smaller_than_device_count_uses_the_first_devices():
    parts = scatter(np.arange(5), H)
    assert [device_of(p) for p in parts] == H[:5]
    assert [p.tolist() for p in parts] == [[0], [1], [2], [3], [4]]


def test_structure_without_arrays_gives_one_replica_per_device():
    shared = object()
    tree = {"n": 3, "o": shared, "none": None, "s": ["a", 1.5]}
    parts = scatter(tree, H[:3])
    assert len(parts) == 3
    assert all(p["o"] is shared and p["s"][0] == "a" for p in parts)
    assert gather(parts, "host:0")["o"] is shared


def test_zero_size_dim_gives_one_replica():
    parts = scatter({"a": np.zeros((0, 3)), "b": np.arange(6)}, H[:4])
    assert len(parts) == 1
    assert parts[0]["a"].shape == (0, 3)
    assert parts[0]["b"].tolist() == list(range(6))


def test_chunks_follow_the_order_of_target_devices():
    order = [H[5], H[2], H[7]]
    parts = scatter((np.arange(6), [np.ones((6, 2))]), order)
    assert [device_of(p[0]) for p in parts] == order
    assert [device_of(p[1][0]) for p in parts] == order
    assert [p[0].tolist() for p in parts] == [[0, 1], [2, 3], [4, 5]]


def test_negative_dim_and_per_leaf_dims():
    x = np.arange(24).reshape(2, 3, 4)
    y = np.arange(6).reshape(2, 3)
    parts = scatter([x, y], H[:3], dim=-1)  # x splits its last axis (4), y its last axis (3)
    assert len(parts) == 3
    assert [p[0].shape for p in parts] == [(2, 3, 2), (2, 3, 1), (2, 3, 1)]
    assert_tree_equal(gather(parts, "cpu", dim=-1), [x, y])


def test_gather_to_cpu_gives_plain_numpy():
    parts = scatter(np.arange(4.0), H[:2])
    out = gather(parts, -1)
    assert type(out) is np.ndarray
    assert out.tolist() == [0.0, 1.0, 2.0, 3.0]


# --------------------------------------------------------------------------------------------
# Leaves and containers

Pair = namedtuple("Pair", ["x", "y"])


def test_none_passes_through():
    parts = scatter([None, np.arange(4), {"k": None}], H[:2])
    assert all(p[0] is None and p[2]["k"] is None for p in parts)
    back = gather(parts, "cpu")
    assert back[0] is None
    assert back[2] == {"k": None}


def test_non_array_leaves_are_shared_by_reference():
    config = {"lr": 0.1}
    tag = ("a", "b")  # a tuple is a container: its string leaves are shared one by one
    marker = object()
    parts = scatter({"x": np.arange(4), "config": config, "tag": tag, "m": marker}, H[:2])
    for p in parts:
        assert p["m"] is marker
        assert p["config"] is not config  # containers are rebuilt, their leaves shared
        assert p["config"]["lr"] is config["lr"]
    back = gather(parts, "cpu")
    assert back["m"] is marker
    assert back["tag"] == tag


def test_containers_round_trip_with_their_metadata():
    tree = {
        "nt": Pair(np.arange(4), "label"),
        "dd": defaultdict(list, {"w": np.ones((4, 2))}),
        "dq": deque([np.arange(4.0), 7], maxlen=5),
        "od": OrderedDict([("z", np.arange(4)), ("a", np.zeros(4, bool))]),
    }
    parts = scatter(tree, H[:2])
    for p in parts:
        assert type(p["nt"]) is Pair
        assert p["dd"].default_factory is list
        assert p["dq"].maxlen == 5
        assert list(p["od"]) == ["z", "a"]
    back = gather(parts, "cpu")
    assert type(back["nt"]) is Pair
    assert back["dd"].default_factory is list
    assert back["dq"].maxlen == 5
    assert list(back["od"]) == ["z", "a"]
    assert_tree_equal(back, tree)


class Batch:
    """A user container registered with optree under the library's namespace."""

    def __init__(self, features: Any, labels: Any, name: str) -> None:
        self.features, self.labels, self.name = features, labels, name


optree.register_pytree_node(
    Batch,
    lambda b: ((b.features, b.labels), b.name, ("features", "labels")),
    lambda name, children: Batch(*children, name),
    namespace=NS,
)


class Opaque:
    """Not registered: a leaf, shared by reference even though it holds an array."""

    def __init__(self, data: Any) -> None:
        self.data = data


def test_registered_custom_node_is_split_and_rebuilt():
    batch = Batch(np.arange(12.0).reshape(6, 2), np.arange(6), "train")
    parts = scatter({"batch": batch, "opaque": Opaque(np.arange(6))}, H[:3])
    assert [type(p["batch"]) for p in parts] == [Batch] * 3
    assert [p["batch"].labels.tolist() for p in parts] == [[0, 1], [2, 3], [4, 5]]
    assert all(p["batch"].name == "train" for p in parts)
    assert all(p["opaque"] is parts[0]["opaque"] for p in parts)
    back = gather(parts, "cpu")
    assert isinstance(back["batch"], Batch)
    assert back["batch"].name == "train"
    assert_tree_equal(back["batch"].features, batch.features)
    assert_tree_equal(back["batch"].labels, batch.labels)


# --------------------------------------------------------------------------------------------
# 0-d arrays


def test_gathering_0d_arrays_stacks_them_and_warns_once():
    outputs = [
        {"loss": to_device(np.array(r, np.float32), H[r]), "acc": to_device(np.array(r / 2), H[r])}
        for r in range(3)
    ]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = gather(outputs, "cpu")
    assert len(caught) == 1
    assert caught[0].category is UserWarning
    assert "0-d arrays at key path ['acc'], ['loss']" in str(caught[0].message)
    assert_tree_equal(
        out, {"loss": np.array([0, 1, 2], np.float32), "acc": np.array([0.0, 0.5, 1.0])}
    )


def test_gathering_0d_arrays_along_another_dim_raises():
    outputs = [to_device(np.array(1.0), d) for d in H[:2]]
    with pytest.raises(ValueError, match=r"0-d arrays, which gather can only stack along dim=0"):
        gather(outputs, "cpu", dim=1)


def test_scattering_a_0d_array_raises_naming_its_path():
    with pytest.raises(ValueError, match=r"inputs\['s'\]\[1\] is a 0-d array, which cannot be"):
        scatter({"s": [np.arange(2), np.array(3.0)]}, H[:2])


# --------------------------------------------------------------------------------------------
# Mismatches between replicas name the key path


def _on(r: int, x: Any) -> Any:
    return to_device(np.asarray(x), H[r])


@pytest.mark.parametrize(
    ("outputs", "message"),
    [
        (
            lambda: [{"a": [_on(0, [1])]}, {"a": (_on(1, [1]),)}],
            (
                r"outputs\[1\] differs in structure from outputs\[0\] at key path \['a'\]: "
                r"outputs\[0\] has \[\*\] but outputs\[1\] has \(\*,\)"
            ),
        ),
        (
            lambda: [{"a": _on(0, [1])}, {"b": _on(1, [1])}],
            r"at key path \(the root\): outputs\[0\] has \{'a': \*\} but outputs\[1\] has \{'b'",
        ),
        (
            lambda: [[defaultdict(list, k=_on(0, [1]))], [defaultdict(int, k=_on(1, [1]))]],
            r"at key path \[0\]: outputs\[0\] has defaultdict\(<class 'list'>",
        ),
        (
            lambda: [{"x": _on(0, [1]), "tag": "a"}, {"x": _on(1, [1]), "tag": "b"}],
            r"outputs\[1\]\['tag'\] is 'b' but outputs\[0\]\['tag'\] is 'a'",
        ),
        (
            lambda: [[_on(0, [1])], [_on(1, [1]), None]],
            r"outputs\[1\] differs in structure .* has \[\*\] but outputs\[1\] has \[\*, \*\]",
        ),
        (
            lambda: [{"x": _on(0, [1])}, {"x": 1.0}],
            r"outputs\[1\]\['x'\] is a float but outputs\[0\]\['x'\] is a HostArray",
        ),
        (
            lambda: [{"x": _on(0, [1])}, {"x": _on(1, [1.0])}],
            r"outputs\[1\]\['x'\] is a 1-d float64 array but outputs\[0\]\['x'\] is a 1-d int64",
        ),
        (
            lambda: [(_on(0, np.zeros((2, 3))),), (_on(1, np.zeros((2, 4))),)],
            r"outputs\[1\]\[0\] has shape \(2, 4\) but outputs\[0\]\[0\] has \(2, 3\)",
        ),
        (
            lambda: [[np.zeros(2)], [_on(1, [1.0, 2.0])]],
            r"outputs\[0\]\[0\] is a plain numpy.ndarray on 'cpu'",
        ),
    ],
    ids=[
        "list-vs-tuple", "dict-keys", "default_factory", "non-array-leaf", "extra-leaf",
        "array-vs-float", "dtype", "shape", "cpu-array",
    ],
)  # fmt: skip
def test_gather_mismatches_name_the_key_path(outputs, message):
    replicas = outputs()
    with pytest.raises(ValueError, match=message):
        gather(replicas, "cpu")


def test_equal_non_array_leaves_are_returned_once():
    nan = float("nan")
    outputs = [{"x": _on(r, [r]), "lr": 0.1, "nan": nan, "name": "m"} for r in range(2)]
    outputs[1]["nan"] = float("nan")  # a different NaN object: still the same value
    for r, out in enumerate(outputs):
        out["nan32"] = np.float32(np.nan) + np.float32(r)  # NumPy NaN scalars, distinct objects
    back = gather(outputs, "cpu")
    assert np.isnan(back["nan32"])
    assert back["lr"] == 0.1
    assert back["nan"] is nan
    assert back["name"] == "m"


# --------------------------------------------------------------------------------------------
# scatter_kwargs


@pytest.mark.parametrize(
    ("inputs", "kwargs", "short", "long", "missing"),
    [
        ((np.arange(2),), {"y": np.arange(4)}, r"inputs\[0\] has batch size 2", "kwargs", "2-3"),
        ((np.arange(4), "f"), {"y": np.arange(2)}, r"kwargs\['y'\] has batch size 2", "in", "2-3"),
        ((np.arange(4),), {"m": np.ones((1, 2))}, r"kwargs\['m'\] has batch size 1", "in", "1-3"),
        (
            (np.arange(4),),
            {"a": np.arange(4), "b": np.arange(3)},
            r"kwargs\['b'\] has batch size 3",
            "in",
            "3",
        ),
    ],
    ids=["inputs-short", "kwargs-short", "kwargs-batch-1", "one-kwarg-short"],
)
def test_scatter_kwargs_refuses_sides_of_different_replica_counts(
    inputs, kwargs, short, long, missing
):
    # torch pads the shorter side with () / {}, and so did this library: replicas 2-3 ran
    # without an argument replicas 0-1 got, with no error.
    replicas = "replica" if "-" not in missing else "replicas"
    match = rf"{short} along dim 0.* but {long}.*: {replicas} {missing} would run without"
    with pytest.raises(ValueError, match=match):
        scatter_kwargs(inputs, kwargs, H[:4])


def test_scatter_kwargs_shares_a_side_without_arrays_with_every_replica():
    # A side without arrays follows the other side's replica count, so every replica gets it
    # (it was scattered to all 4 devices and the array side padded: replicas 2-3 ran without x).
    args, kwargs = scatter_kwargs((np.arange(2),), {"flag": True}, H[:4])
    assert [[_numpy(x).tolist() for x in a] for a in args] == [[[0]], [[1]]]
    assert kwargs == ({"flag": True}, {"flag": True})
    args, kwargs = scatter_kwargs(("label",), {"y": np.arange(3)}, H[:4])
    assert args == (("label",),) * 3
    assert [_numpy(k["y"]).tolist() for k in kwargs] == [[0], [1], [2]]


def test_scatter_kwargs_with_one_side_empty():
    args, kwargs = scatter_kwargs((np.arange(3),), None, H[:2])
    assert [a[0].tolist() for a in args] == [[0, 1], [2]]
    assert kwargs == ({}, {})
    args, kwargs = scatter_kwargs(None, {"y": np.arange(3)}, H[:2])
    assert args == ((), ())
    assert [k["y"].tolist() for k in kwargs] == [[0, 1], [2]]
    assert scatter_kwargs((), {}, H[:2]) == ((), ())  # torch's result when both are empty


def test_scatter_kwargs_matches_scatter_and_gives_tuples_and_dicts():
    inputs = [np.arange(6.0), None]
    kwargs = OrderedDict(w=np.ones((6, 2)), k=3)
    args, kws = scatter_kwargs(inputs, kwargs, H[:3], 0)
    assert all(type(a) is tuple for a in args)
    assert all(type(k) is dict for k in kws)
    for a, want in zip(args, scatter(inputs, H[:3]), strict=True):
        assert_tree_equal(list(a), want)
    for k, want in zip(kws, scatter(kwargs, H[:3]), strict=True):
        assert_tree_equal(k, dict(want))


# --------------------------------------------------------------------------------------------
# Argument validation at the entry


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (
            lambda: scatter([np.arange(2)], "host:0"),
            TypeError,
            r"target_devices must be a sequence of devices",
        ),
        (
            lambda: scatter([np.arange(2)], 3),
            TypeError,
            r"target_devices must be a sequence of devices",
        ),
        (
            lambda: scatter([np.arange(2)], []),
            ValueError,
            r"target_devices must name at least one device",
        ),
        (lambda: scatter([np.arange(2)], ["host:9"]), ValueError, r"target_devices\[0\].*host:9"),
        (lambda: scatter([np.arange(2)], [H[0], 2.5]), TypeError, r"target_devices\[1\]"),
        (
            lambda: scatter([np.arange(2)], [H[0], "cpu"]),
            ValueError,
            r"target_devices\[1\] must be an accelerator",
        ),
        (lambda: scatter([np.arange(2)], H[:2], dim=True), TypeError, r"dim must be an int"),
        (lambda: scatter([np.arange(2)], H[:2], dim=1.0), TypeError, r"dim must be an int"),
        (
            lambda: scatter({"a": np.zeros((2, 2)), "b": [np.zeros(2)]}, H[:2], dim=1),
            ValueError,
            r"dim must be in \[-1, 0\] for the 1-d array inputs\['b'\]\[0\], got 1",
        ),
        (lambda: gather([], "cpu"), ValueError, r"outputs is empty"),
        (lambda: gather(np.arange(2), "cpu"), TypeError, r"outputs must be a list or tuple"),
        (lambda: gather({"a": 1}, "cpu"), TypeError, r"outputs must be a list or tuple"),
        (lambda: gather([_on(0, [1])], "host:12"), ValueError, r"target_device is not a usable"),
        (lambda: gather([_on(0, [1])], "cpu", dim="0"), TypeError, r"dim must be an int"),
        (
            lambda: gather([[_on(0, [1])], [_on(1, [2])]], "cpu", dim=1),
            ValueError,
            r"dim must be in \[-1, 0\] for the 1-d array outputs\[0\]\[0\], got 1",
        ),
        (lambda: scatter_kwargs(np.arange(2), None, H[:2]), TypeError, r"inputs must be a tuple"),
        (lambda: scatter_kwargs((), [1], H[:2]), TypeError, r"kwargs must be a mapping"),
        (
            lambda: scatter_kwargs((), None, []),
            ValueError,
            r"target_devices must name at least one device",
        ),
    ],
    ids=[
        "devices-str", "devices-int", "devices-empty", "devices-missing", "devices-bad-type",
        "devices-cpu", "dim-bool", "dim-float", "scatter-dim-range", "outputs-empty",
        "outputs-array", "outputs-dict", "target-missing", "gather-dim-str", "gather-dim-range",
        "kwargs-inputs-type", "kwargs-kwargs-type", "kwargs-devices",
    ],
)  # fmt: skip
def test_bad_arguments_raise_before_any_copy(call, error, message):
    with pytest.raises(error, match=message):
        call()


# --------------------------------------------------------------------------------------------
# Differentiable on the tape (through functions.Scatter / functions.Gather)


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_gather_of_scatter_has_the_identity_gradient(dim):
    rng = np.random.default_rng(0)
    x = {
        "w": to_device(rng.standard_normal((5, 3)), "host:2"),
        "v": [rng.standard_normal((4, 6)).astype(np.float32), "label"],
    }
    sources = [x["w"], x["v"][0]]
    with Tape() as tape:
        tape.watch(sources)
        y = gather(scatter(x, H[:4], dim), "host:1", dim)
    g = optree.tree_map(
        lambda a: (
            to_device(rng.standard_normal(a.shape).astype(a.dtype), "host:1") if is_array(a) else a
        ),
        y,
        namespace=NS,
    )
    grads = tape.gradient([y["w"], y["v"][0]], sources, output_gradients=[g["w"], g["v"][0]])
    # The adjoint of a copy-and-reassemble is the identity, moved back to each source's device.
    assert_tree_equal(grads, [to_device(g["w"], "host:2"), to_device(g["v"][0], "cpu")])


def test_per_replica_losses_gathered_as_a_vector_differentiate():
    x = np.arange(10.0).reshape(5, 2)
    with Tape() as tape:
        tape.watch(x)
        losses = [ops.sum(ops.square(part)) for part in scatter(x, H[:3])]
        with pytest.warns(UserWarning, match=r"0-d arrays at key path \(the root\)"):
            per_replica = gather(losses, "host:0")
        total = ops.sum(per_replica)
    assert per_replica.shape == (3,)
    np.testing.assert_array_equal(per_replica.get(), [1.0 + 4 + 9, 16.0 + 25 + 36 + 49, 64.0 + 81])
    np.testing.assert_array_equal(tape.gradient(total, x), 2 * x)  # d/dx sum(x^2), exact


@pytest.mark.gpu
def test_round_trip_over_gpus():
    cupy = pytest.importorskip("cupy")
    gpus = [Device("cuda", k) for k in range(cupy.cuda.runtime.getDeviceCount())]
    with cupy.cuda.Device(0):
        labels = cupy.arange(8)
    x = {"a": np.arange(24.0).reshape(8, 3), "b": [labels, "tag"], "c": None}
    parts = scatter(x, gpus)
    assert len(parts) == min(len(gpus), 8)
    for r, part in enumerate(parts):
        assert device_of(part["a"]) == gpus[r]
        assert device_of(part["b"][0]) == gpus[r]
    assert_tree_equal(gather(parts, "cpu"), {"a": x["a"], "b": [labels.get(), "tag"], "c": None})
    with cupy.cuda.Device(0):
        expected = {"a": cupy.asarray(x["a"]), "b": [labels, "tag"], "c": None}
    assert_tree_equal(gather(parts, gpus[0]), expected)


# --------------------------------------------------------------------------------------------
# Subclasses of the built-in containers are split like their base (torch's isinstance tests)


class ListSub(list):
    pass


class TupleSub(tuple):
    __slots__ = ()


class DictSub(dict):
    pass


class OrderedSub(OrderedDict):
    pass


class DefaultSub(defaultdict):
    pass


class DequeSub(deque):
    pass


SUBCLASSED = [
    (lambda: ListSub([np.arange(6), "tag"]), list),
    (lambda: TupleSub((np.arange(6.0), 3)), tuple),
    (lambda: DictSub(b=np.arange(6), a="tag"), dict),
    (lambda: OrderedSub([("z", np.arange(6)), ("a", 1)]), OrderedDict),
    (lambda: DefaultSub(list, {"w": np.ones((6, 2))}), defaultdict),
    (lambda: DequeSub([np.arange(6), None], 4), deque),
]


def _as_base(container: Any, base: type) -> Any:
    """The same contents in the base type (the oracle scatters that)."""
    if base is defaultdict:
        return defaultdict(container.default_factory, container)
    if base is deque:
        return deque(container, container.maxlen)
    return base(container)


@pytest.mark.parametrize(
    ("make", "base"), SUBCLASSED, ids=[b.__name__ for _, b in SUBCLASSED]
)  # fmt: skip
def test_a_container_subclass_is_split_like_its_base_and_rebuilt(make: Any, base: type) -> None:
    # The old code saw an unregistered subclass as a leaf and gave every replica the whole of it.
    tree = {"s": make()}
    parts = scatter(tree, H[:3])
    expected = scatter({"s": _as_base(tree["s"], base)}, H[:3])
    assert len(parts) == 3
    for got, want in zip(parts, expected, strict=True):
        assert type(got["s"]) is type(tree["s"])
        assert_tree_equal(_as_base(got["s"], base), want["s"], check_device=True)
    back = gather(parts, "cpu")
    assert type(back["s"]) is type(tree["s"])
    assert_tree_equal(_as_base(back["s"], base), _as_base(tree["s"], base))


def test_subclasses_inside_subclasses_are_split_too() -> None:
    tree = ListSub([DictSub(x=TupleSub((np.arange(4),))), np.arange(4)])
    parts = scatter(tree, H[:2])
    assert type(parts[1][0]["x"]) is TupleSub
    assert parts[1][0]["x"][0].tolist() == [2, 3]
    back = gather(parts, "cpu")
    assert type(back) is ListSub
    assert type(back[0]) is DictSub
    assert type(back[0]["x"]) is TupleSub
    assert back[0]["x"][0].tolist() == [0, 1, 2, 3]


class NeedsName(dict):
    """Its constructor needs a second argument: cannot be rebuilt from its contents alone."""

    def __init__(self, data: Any, name: str) -> None:
        super().__init__(data)
        self.name = name


class Doubling(list):
    """Its constructor changes the contents: rebuilding it would not give the same contents."""

    def __init__(self, items: Any = ()) -> None:
        super().__init__([*items, *items])


def test_a_subclass_that_cannot_be_rebuilt_comes_back_as_its_base() -> None:
    doubled = Doubling()
    doubled.extend([np.arange(4), 1])
    tree = {"named": NeedsName({"x": np.arange(4)}, "train"), "doubled": doubled}
    parts = scatter(tree, H[:2])
    assert [type(p["named"]) for p in parts] == [dict, dict]
    assert [type(p["doubled"]) for p in parts] == [list, list]
    assert parts[1]["named"]["x"].tolist() == [2, 3]
    assert parts[1]["doubled"][0].tolist() == [2, 3]
    back = gather(parts, "cpu")
    assert type(back["named"]) is dict
    assert back["doubled"][0].tolist() == [0, 1, 2, 3]
    assert back["doubled"][1] == 1


def test_a_registered_subclass_keeps_its_own_registration() -> None:
    class Registered(list):
        pass

    optree.register_pytree_node(
        Registered,
        lambda r: ((r[0],), len(r), None),  # only the first item is a child
        lambda n, children: Registered([children[0], *["rest"] * (n - 1)]),
        namespace=NS,
    )
    try:
        parts = scatter(Registered([np.arange(4), "x"]), H[:2])
        assert [type(p) for p in parts] == [Registered, Registered]
        assert parts[1][0].tolist() == [2, 3]
        assert parts[1][1] == "rest"
    finally:
        optree.unregister_pytree_node(Registered, namespace=NS)


def test_a_self_containing_subclass_is_refused() -> None:
    loop = ListSub([np.arange(2)])
    loop.append(loop)
    with pytest.raises(ValueError, match="the structure contains itself"):
        scatter(loop, H[:2])


def test_gather_mismatch_names_subclasses_and_unregistered_types() -> None:
    replicas = [DictSub(a=_on(0, [1])), {"a": _on(1, [1])}]
    with pytest.raises(
        ValueError,
        match=r"at key path \(the root\): outputs\[0\] has DictSub\(\{'a': \*\}\) but "
        r"outputs\[1\] has \{'a': \*\}",
    ):
        gather(replicas, "cpu")
    with pytest.raises(
        ValueError,
        match=r"outputs\[1\]\['o'\] is .* Only arrays are gathered; .* Opaque is not a "
        r"container type registered with optree, so gather treats each Opaque as one value; "
        r"if it holds arrays to gather, register it with optree.register_pytree_node\(Opaque, "
        r"flatten, unflatten, namespace='cupy_parallel'\)",
    ):
        gather([{"o": Opaque(_on(r, [r]))} for r in range(2)], "cpu")


# --------------------------------------------------------------------------------------------
# Arrays of other libraries are refused, not shared whole


class DLPackOnly:
    """Stands for a JAX/CuPy-like array of another library: it only speaks DLPack."""

    def __init__(self, data: np.ndarray) -> None:
        self.data = data

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self.data.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.data.__dlpack_device__()


class ArrayProtocolOnly:
    """Converts with numpy.asarray (``__array__``) but is no array of ours."""

    def __init__(self, data: np.ndarray) -> None:
        self.data = data

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return self.data


def _foreign_arrays() -> list[Any]:
    arrays = [DLPackOnly(np.arange(4)), ArrayProtocolOnly(np.arange(4))]
    try:
        import torch
    except ImportError:  # torch is an optional oracle
        return arrays
    return [*arrays, torch.arange(4)]


@pytest.mark.parametrize("foreign", _foreign_arrays(), ids=lambda x: type(x).__name__)
def test_scatter_and_gather_refuse_arrays_of_other_libraries(foreign: Any) -> None:
    # The old code shared such an array whole with every replica (no split, no placement).
    name = re.escape(f"{type(foreign).__module__}.{type(foreign).__qualname__}")
    with pytest.raises(
        TypeError,
        match=rf"inputs\['x'\]\[1\] is a {name}, an array of another library, which scatter "
        r"cannot split or place .* convert it first with cupy_parallel.to_device\(x, device\)",
    ):
        scatter({"x": [np.arange(4), foreign]}, H[:2])
    with pytest.raises(
        TypeError,
        match=rf"outputs\[1\]\['y'\] is a {name}, an array of another library, which gather "
        r"cannot join; .* cupy_parallel.to_device\(x, device\)",
    ):
        gather([{"y": _on(0, [1])}, {"y": foreign}], "cpu")


def test_numpy_scalars_are_values_and_still_shared() -> None:
    lr = np.float32(0.5)
    parts = scatter({"x": np.arange(4), "lr": lr}, H[:2])
    assert all(p["lr"] is lr for p in parts)
    assert gather(parts, "cpu")["lr"] is lr
