"""Tests of cupy_parallel._src.parallel: replicate, parallel_apply, data_parallel, DataParallel.

The oracle for data parallelism is the same computation on one device with a plain tape: losses
and gradients of an MLP trained data-parallel must equal the one-device run to 1e-10.
"""

from __future__ import annotations

import threading

import numpy as np
import optree
import pytest
from helpers import to_numpy

from cupy_parallel._src import ops
from cupy_parallel._src.arrays import device_of, is_array, to_device
from cupy_parallel._src.devices import Device, as_device, devices
from cupy_parallel._src.nested import gather
from cupy_parallel._src.parallel import DataParallel, data_parallel, parallel_apply, replicate
from cupy_parallel._src.tape import Tape

NS = "cupy_parallel"
HOST0 = Device("host", 0)


def host(k: int) -> Device:
    return Device("host", k)


def tree_to(tree, device):
    return optree.tree_map(lambda a: to_device(a, device) if is_array(a) else a, tree, namespace=NS)


def numpy(a):
    """A plain NumPy copy of an array on any device (CuPy refuses implicit conversion)."""
    return np.asarray(to_device(a, "cpu"))


@pytest.fixture(autouse=True)
def _host_platform(request, monkeypatch):
    """Int device ids and the default device_ids mean host devices here, even beside a GPU."""
    if request.node.get_closest_marker("gpu") is None:
        monkeypatch.setenv("CUPY_PARALLEL_PLATFORM", "host")


def assert_trees_close(actual, expected, atol=1e-10):
    actual_leaves, actual_spec = optree.tree_flatten(actual, namespace=NS)
    expected_leaves, expected_spec = optree.tree_flatten(expected, namespace=NS)
    assert actual_spec == expected_spec
    for a, e in zip(actual_leaves, expected_leaves, strict=True):
        assert device_of(a) == device_of(e)
        np.testing.assert_allclose(numpy(a), numpy(e), rtol=0, atol=atol)


# --------------------------------------------------------------------------------------------
# The model: a two-layer tanh MLP with a mean squared error, float64


def init_mlp(seed: int = 0, sizes=(5, 16, 3), device=HOST0):
    rng = np.random.default_rng(seed)
    params = {
        "w1": rng.standard_normal(sizes[:2]) / np.sqrt(sizes[0]),
        "b1": rng.standard_normal(sizes[1]) * 0.1,
        "w2": rng.standard_normal(sizes[1:]) / np.sqrt(sizes[1]),
        "b2": rng.standard_normal(sizes[2]) * 0.1,
        "activation": "tanh",  # a non-array leaf, shared by the replicas
    }
    return tree_to(params, device)


def mlp(params, x):
    hidden = ops.tanh(ops.add(ops.matmul(x, params["w1"]), params["b1"]))
    return ops.add(ops.matmul(hidden, params["w2"]), params["b2"])


def mse(prediction, target):
    return ops.mean(ops.square(ops.subtract(prediction, target)))


def batch(rows: int, seed: int = 1):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((rows, 5)), rng.standard_normal((rows, 3))


def arrays_of(params):
    return {k: v for k, v in params.items() if k != "activation"}


def sgd(params, grads, lr=0.1):
    return {k: v - lr * grads[k] if k in grads else v for k, v in params.items()}


def train(step, params, x, y, steps=3):
    """Run ``steps`` SGD steps with ``step(params, x) -> prediction``; losses and gradients."""
    losses, grads_seen = [], []
    for _ in range(steps):
        with Tape() as tape:
            watched = arrays_of(params)
            tape.watch(watched)
            loss = mse(step({**params, **watched}, x), y)
        grads = tape.gradient(loss, watched)
        losses.append(loss)
        grads_seen.append(grads)
        params = sgd(params, grads)
    return losses, grads_seen


def one_device(params, x):
    return mlp(params, to_device(x, device_of(params["w1"])))


def check_training(ids):
    """Three SGD steps data-parallel over ``ids`` equal three steps on ``ids[0]`` alone."""
    first = as_device(ids[0])
    params = init_mlp(device=first)
    x, y = batch(37)  # uneven: 37 rows over 2, 3 and 8 devices; x stays on the cpu
    y = to_device(y, first)
    expected_losses, expected_grads = train(one_device, params, x, y)
    losses, grads = train(lambda p, xb: data_parallel(mlp, p, (xb,), ids), params, x, y)
    for loss, expected in zip(losses, expected_losses, strict=True):
        assert device_of(loss) == first
        np.testing.assert_allclose(numpy(loss), numpy(expected), rtol=0, atol=1e-10)
    assert_trees_close(grads, expected_grads)
    assert numpy(expected_losses[-1]) < numpy(expected_losses[0])  # the steps do train


# --------------------------------------------------------------------------------------------
# data_parallel: equal to the one-device run


@pytest.mark.parametrize("n_devices", [1, 2, 3, 8], ids=lambda n: f"{n}dev")
def test_training_matches_one_device(n_devices):
    check_training(list(range(n_devices)))


@pytest.mark.gpu
def test_training_matches_one_device_on_gpus():
    check_training(devices())  # every GPU, CuPy arrays; x is scattered from the cpu


def test_batch_smaller_than_device_count_uses_fewer_replicas():
    params = init_mlp()
    x, _ = batch(3)
    seen = []
    lock = threading.Lock()

    def recording_mlp(p, xb):
        with lock:
            seen.append((device_of(xb), device_of(p["w1"]), xb.shape[0]))
        return mlp(p, xb)

    out = data_parallel(recording_mlp, params, (x,))  # 8 devices, 3 rows
    assert sorted(seen, key=lambda s: s[0].index) == [(host(k), host(k), 1) for k in range(3)]
    expected = one_device(params, x)
    np.testing.assert_allclose(to_numpy(out), to_numpy(expected), rtol=0, atol=1e-12)
    assert device_of(out) == HOST0


def test_kwargs_are_scattered_and_non_array_kwargs_shared():
    params = init_mlp()
    x, _ = batch(10)
    scale = np.arange(10.0).reshape(10, 1)
    shapes = []
    lock = threading.Lock()

    def scaled(p, xb, *, scale, label):
        with lock:
            shapes.append((device_of(scale), scale.shape, label))
        return ops.multiply(mlp(p, xb), scale)

    out = data_parallel(scaled, params, x, [0, 1, 2], module_kwargs={"scale": scale, "label": "s"})
    assert sorted(shapes, key=lambda s: s[0].index) == [
        (host(0), (4, 1), "s"),
        (host(1), (3, 1), "s"),
        (host(2), (3, 1), "s"),
    ]
    expected = to_numpy(one_device(params, x)) * scale
    np.testing.assert_allclose(to_numpy(out), expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("use_class", [False, True], ids=["data_parallel", "DataParallel"])
def test_keyword_of_another_batch_size_is_refused(use_class):
    # Row 4 of issue 23: replicas 1-3 ran without the keyword (mask=None here, so the module
    # silently returned x unmasked for rows 1-3); torch pads the same way. Now: a ValueError.
    def masked(p, x, mask=None):
        return x if mask is None else ops.multiply(x, mask)

    x, mask = np.ones((4, 2)), np.zeros((1, 2))
    match = (
        r"module_kwargs\['mask'\] has batch size 1 along dim 0, so it splits into 1 replica, "
        r"but inputs\[0\] has batch size 4 and splits into 4 on the 4 devices: replicas 1-3 "
        r"would run without module_kwargs\['mask'\]"
    )
    if use_class:
        with pytest.raises(ValueError, match=match):
            DataParallel(masked, {}, [0, 1, 2, 3])(x, mask=mask)
    else:
        with pytest.raises(ValueError, match=match):
            data_parallel(masked, {}, (x,), [0, 1, 2, 3], module_kwargs={"mask": mask})
    # a keyword of the batch's size, or one without arrays, reaches every replica
    out = data_parallel(masked, {}, (x,), [0, 1, 2, 3], module_kwargs={"mask": np.zeros((4, 2))})
    np.testing.assert_array_equal(to_numpy(out), np.zeros((4, 2)))
    out = data_parallel(masked, {}, (x[:2],), [0, 1, 2, 3], module_kwargs={"mask": 0.0})
    np.testing.assert_array_equal(to_numpy(out), np.zeros((2, 2)))


def test_output_device_and_dim():
    w = to_device(np.array([[1.0], [2.0], [3.0]]), HOST0)
    x = np.arange(30.0).reshape(3, 10)

    def scale_rows(p, xb):
        return ops.multiply(xb, p)

    out = data_parallel(scale_rows, w, (x,), ["host:0", "host:1", "host:2"], "cpu", dim=1)
    assert type(out) is np.ndarray
    np.testing.assert_array_equal(out, x * np.array([[1.0], [2.0], [3.0]]))
    moved = data_parallel(scale_rows, w, (x,), [0], output_device="host:5", dim=1)
    assert device_of(moved) == host(5)
    np.testing.assert_array_equal(to_numpy(moved), out)


def test_no_inputs_runs_once_on_the_first_device():
    params = {"w": to_device(np.arange(3.0), host(2))}
    calls = []

    def fn(p):
        calls.append(device_of(p["w"]))
        return ops.multiply(p["w"], 2.0)

    out = data_parallel(fn, params, None, [2, 4, 6])
    assert calls == [host(2)]
    assert device_of(out) == host(2)
    np.testing.assert_array_equal(to_numpy(out), [0.0, 2.0, 4.0])


def test_data_parallel_class_equals_function():
    params = init_mlp()
    x, y = batch(11)
    y = to_device(y, HOST0)
    dp = DataParallel(mlp, params, device_ids=[0, 1, 2, 3])
    assert dp.params is params
    assert dp.device_ids == [host(k) for k in range(4)]
    assert dp.output_device == HOST0
    assert repr(dp) == (
        "DataParallel(mlp, device_ids=[host:0, host:1, host:2, host:3], output_device=host:0, "
        "dim=0)"
    )
    losses, grads = train(lambda p, xb: DataParallel(mlp, p, [0, 1, 2, 3])(xb), params, x, y)
    expected_losses, expected_grads = train(
        lambda p, xb: data_parallel(mlp, p, (xb,), [0, 1, 2, 3]), params, x, y
    )
    assert [float(v) for v in losses] == [float(v) for v in expected_losses]
    assert_trees_close(grads, expected_grads, atol=0)
    assert DataParallel(mlp, params).device_ids == [host(k) for k in range(8)]


def test_data_parallel_class_forwards_kwargs():
    w = to_device(np.ones(2), HOST0)
    dp = DataParallel(lambda p, x, *, shift: ops.add(ops.multiply(x, p), shift), w, [0, 1])
    out = dp(np.ones((4, 2)), shift=np.arange(8.0).reshape(4, 2))
    np.testing.assert_array_equal(to_numpy(out), 1.0 + np.arange(8.0).reshape(4, 2))


# --------------------------------------------------------------------------------------------
# data_parallel: bad input


def test_params_on_the_wrong_device():
    params = init_mlp()
    params["w2"] = to_device(params["w2"], host(1))
    x, _ = batch(4)
    match = r"data_parallel: every parameter must live on host:0, but params\['w2'\] is on host:1"
    with pytest.raises(ValueError, match=match):
        data_parallel(mlp, params, (x,))
    with pytest.raises(ValueError, match=r"params\['w2'\] is on host:1"):
        DataParallel(mlp, params)
    with pytest.raises(ValueError, match=r"replicate: .* params\['w2'\] is on host:1"):
        replicate(params, [0, 1])
    with pytest.raises(ValueError, match=r"must live on host:1, but params\['b1'\] is on host:0"):
        DataParallel(mlp, init_mlp(), [1, 2])
    dp = DataParallel(mlp, init_mlp(), [0, 1])
    dp.params = params  # a training loop replaced the parameters: checked again on every call
    with pytest.raises(ValueError, match=r"params\['w2'\] is on host:1"):
        dp(x)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"device_ids": []}, ValueError, "device_ids must name at least one device"),
        ({"device_ids": "host:0"}, TypeError, "device_ids must be a sequence of devices"),
        ({"device_ids": [0, 9]}, ValueError, r"device_ids\[1\] is not a usable device: .*host:9"),
        ({"device_ids": [0, 1.5]}, TypeError, r"device_ids\[1\] is not a usable device"),
        ({"output_device": "host:12"}, ValueError, "output_device is not a usable device"),
        ({"dim": 0.0}, TypeError, "dim must be an int"),
        ({"module_kwargs": [1]}, TypeError, "module_kwargs must be a mapping or None"),
    ],
    ids=[
        "empty-ids",
        "str-ids",
        "missing-id",
        "float-id",
        "missing-output",
        "float-dim",
        "list-kwargs",
    ],
)
def test_data_parallel_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        data_parallel(mlp, init_mlp(), (batch(4)[0],), **kwargs)


def test_non_callable_module():
    with pytest.raises(TypeError, match="fn must be callable as fn"):
        data_parallel("mlp", init_mlp(), (batch(4)[0],))
    with pytest.raises(TypeError, match="fn must be callable as fn"):
        DataParallel(None, init_mlp())


@pytest.mark.parametrize("device_ids", [[0, 1], [0]], ids=["two-replicas", "one-replica"])
def test_module_of_the_wrong_signature_gets_a_hint(device_ids):
    # Issue 23: DataParallel(lambda x: ..., params) failed with only Python's "takes 1
    # positional argument but 2 were given"; the error now says how a module is called.
    w = to_device(np.ones(2), HOST0)
    match = (
        r"Caught TypeError in replica 0 on device host:0: .*takes 1 positional argument but 2 "
        r"were given; the module <lambda>\(x\) cannot be called as data_parallel calls it, "
        r"fn\(params, \*inputs, \*\*kwargs\), here with params and 1 input: a module function "
        r"must be fn\(params, \*inputs\)"
    )
    with pytest.raises(TypeError, match=match):
        DataParallel(lambda x: x, w, device_ids)(np.ones((4, 2)))

    def needs_y(p, x, *, y):
        return x

    with pytest.raises(TypeError, match=r"needs_y\(p, x, \*, y\) cannot be called"):
        data_parallel(needs_y, w, (np.ones((4, 2)),), device_ids)

    def inner_error(p, x):
        return len(5)  # a TypeError from inside the module: no hint

    with pytest.raises(TypeError, match=r"has no len\(\)$"):
        data_parallel(inner_error, w, (np.ones((4, 2)),), device_ids)


def test_worker_exception_names_replica_and_device():
    params = init_mlp()

    def fails_on_host2(p, xb):
        if device_of(xb) == host(2):
            raise ValueError("boom")
        return mlp(p, xb)

    with pytest.raises(
        ValueError, match=r"^Caught ValueError in replica 2 on device host:2: boom$"
    ) as info:
        data_parallel(fails_on_host2, params, (batch(8)[0],), [0, 1, 2, 3])
    assert isinstance(info.value.__cause__, ValueError)
    assert str(info.value.__cause__) == "boom"


# --------------------------------------------------------------------------------------------
# parallel_apply


def test_parallel_apply_runs_one_thread_per_replica_at_once():
    barrier = threading.Barrier(4, timeout=10)  # breaks unless all four calls overlap
    names = []

    def meet(x):
        names.append(threading.current_thread().name)
        barrier.wait()
        return x * 2

    xs = [to_device(np.full(2, float(k)), host(k)) for k in range(4)]
    results = parallel_apply([meet] * 4, [(x,) for x in xs], None, [0, 1, 2, 3])
    for k, r in enumerate(results):
        assert device_of(r) == host(k)
        np.testing.assert_array_equal(to_numpy(r), [2.0 * k, 2.0 * k])
    assert len(set(names)) == 4
    assert threading.current_thread().name not in names


def test_parallel_apply_single_replica_runs_in_the_caller():
    names = []
    (result,) = parallel_apply([lambda: names.append(threading.current_thread().name) or 7], [()])
    assert result == 7
    assert names == [threading.current_thread().name]


def test_parallel_apply_kwargs_and_bare_inputs():
    xs = [to_device(np.arange(3.0), host(k)) for k in range(3)]
    results = parallel_apply(
        [lambda x, power: x**power] * 3, xs, [{"power": k} for k in range(3)]
    )  # a bare array input is the one positional argument
    for k, r in enumerate(results):
        np.testing.assert_array_equal(to_numpy(r), np.arange(3.0) ** k)
        assert device_of(r) == host(k)
    assert parallel_apply([], []) == []


def test_parallel_apply_carries_the_tape_into_threads():
    rng = np.random.default_rng(3)
    ws = [to_device(rng.standard_normal((4, 2)), host(k)) for k in range(3)]
    xs = [to_device(rng.standard_normal((5, 4)), host(k)) for k in range(3)]

    def f(w, x):
        return ops.sum(ops.square(ops.tanh(ops.matmul(x, w))))

    with Tape(persistent=True) as tape:
        tape.watch(ws)
        threaded = parallel_apply([f] * 3, list(zip(ws, xs, strict=True)))
    threaded_grads = [tape.gradient(loss, w) for loss, w in zip(threaded, ws, strict=True)]
    for w, x, loss, grad in zip(ws, xs, threaded, threaded_grads, strict=True):
        with Tape() as sequential:
            sequential.watch(w)
            expected = f(w, x)
        np.testing.assert_array_equal(to_numpy(loss), to_numpy(expected))
        assert device_of(grad) == device_of(w)
        np.testing.assert_array_equal(to_numpy(grad), to_numpy(sequential.gradient(expected, w)))


class TwoArgumentError(Exception):
    def __init__(self, code, detail):
        super().__init__(f"{code}: {detail}")


def test_parallel_apply_reraises_lowest_failing_replica():
    def fail(k):
        if k == 1:
            raise KeyError("k1")
        if k == 2:
            raise TwoArgumentError(2, "bad")
        return k

    with pytest.raises(KeyError, match="Caught KeyError in replica 1 on device host:5") as info:
        parallel_apply([fail] * 3, [(0,), (1,), (2,)], None, [4, 5, 6])
    assert isinstance(info.value.__cause__, KeyError)
    with pytest.raises(RuntimeError, match="Caught TwoArgumentError in replica 0: 2: bad") as info:
        parallel_apply([fail], [(2,)])
    assert isinstance(info.value.__cause__, TwoArgumentError)


def test_parallel_apply_infers_the_device_from_the_inputs():
    def fail(x, *, y):
        raise ArithmeticError("inferred")

    x = to_device(np.ones(1), host(3))
    with pytest.raises(
        ArithmeticError, match=r"^Caught ArithmeticError in replica 1 on device host:6: inferred$"
    ):
        parallel_apply(
            [lambda x, *, y: x, fail],
            [(x,), (None,)],
            [{"y": 1}, {"y": to_device(np.ones(1), host(6))}],
        )
    with pytest.raises(ArithmeticError, match=r"^Caught ArithmeticError in replica 1: inferred$"):
        parallel_apply([lambda x, *, y: x, fail], [(x,), (None,)], [{"y": 1}, {"y": 2}])


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        (([len, 3], [(), ()]), TypeError, r"fns\[1\] must be callable, got int 3"),
        (([len], [(), ()]), ValueError, "got 1 fns and 2 inputs"),
        (([len], [()], [{}, {}]), ValueError, "kwargs_tup must have one mapping per function"),
        (([len], [()], [[]]), TypeError, r"kwargs_tup\[0\] must be a mapping"),
        (([len], [()], None, [0, 1]), ValueError, "devices must have one entry per function"),
        (([len], [()], None, ["host:8"]), ValueError, r"devices\[0\] is not a usable device"),
        ((len, [()]), TypeError, "fns must be a list or tuple"),
        (([len], "x"), TypeError, "inputs must be a list or tuple"),
    ],
    ids=[
        "not-callable",
        "inputs-length",
        "kwargs-length",
        "kwargs-type",
        "devices-length",
        "missing-device",
        "fns-type",
        "inputs-str",
    ],
)
def test_parallel_apply_bad_arguments(args, error, match):
    with pytest.raises(error, match=match):
        parallel_apply(*args)


# --------------------------------------------------------------------------------------------
# replicate


def nested_params():
    rng = np.random.default_rng(5)
    return tree_to(
        {
            "layers": [
                {"w": rng.standard_normal((3, 4)), "b": rng.standard_normal(4).astype(np.float32)},
                {"w": rng.standard_normal((4, 2)), "scale": np.array(2.0)},
            ],
            "steps": np.arange(3),
            "name": "net",
            "dropout": None,
        },
        HOST0,
    )


@pytest.mark.parametrize("detach", [False, True], ids=["recorded", "detached"])
def test_replicate_placement(detach):
    params = nested_params()
    targets = [host(0), host(3), host(5)]
    replicas = replicate(params, targets, detach=detach)
    assert len(replicas) == 3
    leaves, spec = optree.tree_flatten(params, namespace=NS)
    for device, replica in zip(targets, replicas, strict=True):
        replica_leaves, replica_spec = optree.tree_flatten(replica, namespace=NS)
        assert replica_spec == spec
        for leaf, copy in zip(leaves, replica_leaves, strict=True):
            if is_array(leaf):
                assert device_of(copy) == device
                assert copy.dtype == leaf.dtype
                np.testing.assert_array_equal(to_numpy(copy), to_numpy(leaf))
            else:
                assert copy is leaf
    if detach:  # as torch's broadcast_coalesced, the first device keeps the originals
        assert replicas[0]["layers"][0]["w"] is params["layers"][0]["w"]
    assert replicate(params, []) == []
    assert replicate({"lr": 0.1}, [0, 1]) == [{"lr": 0.1}, {"lr": 0.1}]


def test_writing_one_replica_array_leaves_the_others_differentiable():
    # Issue 23, row 10: the replicas of one device are views of one coalesced buffer and shared
    # one version counter, so writing replica b made the tape refuse the gradient through
    # replica w ("modified in place"); torch gives each output its own counter.
    w = to_device(np.array([1.0, -2.0, 3.0]), HOST0)
    params = {"w": w, "b": to_device(np.zeros(2), HOST0)}
    with Tape() as tape:
        tape.watch(w)
        replicas = replicate(params, [0, 1])
        loss = ops.sum(ops.multiply(replicas[1]["w"], replicas[1]["w"]))
        replicas[1]["b"][...] = 3.0
    np.testing.assert_array_equal(to_numpy(tape.gradient(loss, w)), 2 * np.array([1.0, -2.0, 3.0]))


def test_replicate_gradient_is_the_sum_over_replicas():
    """Dot-product test of replicate's adjoint: <c, R(p)> = <R^T c, p> with R^T c = sum_k c_k."""
    rng = np.random.default_rng(7)
    params = {
        "a": to_device(rng.standard_normal((3, 2)), HOST0),
        "b": to_device(rng.standard_normal(5), HOST0),
    }
    targets = [host(0), host(2), host(7), host(1)]
    cotangents = [
        {name: to_device(rng.standard_normal(p.shape), d) for name, p in params.items()}
        for d in targets
    ]
    with Tape() as tape:
        tape.watch(params)
        replicas = replicate(params, targets)
        partials = [
            ops.reshape(
                ops.add(
                    ops.sum(ops.multiply(r["a"], c["a"])), ops.sum(ops.multiply(r["b"], c["b"]))
                ),
                (1,),
            )
            for r, c in zip(replicas, cotangents, strict=True)
        ]
        total = ops.sum(gather(partials, HOST0))
    grads = tape.gradient(total, params)
    for name in params:
        expected = sum(to_numpy(c[name]) for c in cotangents)
        assert device_of(grads[name]) == HOST0
        np.testing.assert_allclose(to_numpy(grads[name]), expected, rtol=0, atol=1e-12)
    adjoint = sum(float(np.vdot(to_numpy(grads[n]), to_numpy(params[n]))) for n in params)
    np.testing.assert_allclose(adjoint, float(to_numpy(total)), rtol=1e-12)


def test_replicate_detached_records_nothing():
    params = {"w": to_device(np.ones(3), HOST0)}
    with Tape() as tape:
        tape.watch(params)
        (_, copy) = replicate(params, [0, 1], detach=True)
        loss = ops.sum(copy["w"])
    with pytest.raises(ValueError, match="was not recorded on this tape"):
        tape.gradient(loss, params)


def test_replicate_bad_arguments():
    with pytest.raises(TypeError, match="devices must be a sequence of devices"):
        replicate({}, 3)
    with pytest.raises(TypeError, match="detach must be a bool"):
        replicate({}, [0], detach="yes")


@pytest.mark.gpu
def test_parallel_apply_enters_each_gpu_and_the_callers_stream():
    cupy = pytest.importorskip("cupy")
    gpus = devices()
    targets = [*gpus, gpus[0]]  # two replicas on one GPU: threads even on a one-GPU machine
    streams = {}
    try:
        for d in gpus:
            with cupy.cuda.Device(d.index):
                streams[d.index] = cupy.cuda.Stream(non_blocking=True)
                streams[d.index].use()

        def probe():
            return cupy.cuda.Device().id, cupy.cuda.get_current_stream().ptr

        seen = parallel_apply([probe] * len(targets), [()] * len(targets), None, targets)
    finally:
        for d in gpus:
            with cupy.cuda.Device(d.index):
                cupy.cuda.Stream.null.use()
    assert seen == [(d.index, streams[d.index].ptr) for d in targets]


# --------------------------------------------------------------------------------------------
# Second order: a Hessian-vector product through data_parallel


def exp_model(params, x):
    """``(exp(w * w) + b) * sum(x ** 2)``: per replica a vector shaped like ``w``."""
    scale = ops.sum(ops.square(x))
    return ops.multiply(
        ops.add(ops.exp(ops.multiply(params["w"], params["w"])), params["b"]), scale
    )


def hessian_vector_product(step, params, x, v):
    """``H v`` of ``sum(step(params, x))`` by differentiating ``<gradient, v>`` on an outer tape."""
    with Tape() as outer:
        watched = arrays_of(params)
        outer.watch(watched)
        with Tape() as inner:
            inner.watch(watched)
            loss = ops.sum(step({**params, **watched}, x))
        grads = inner.gradient(loss, watched)
        products = [ops.sum(ops.multiply(grads[k], v[k])) for k in sorted(watched)]
        total = products[0]
        for p in products[1:]:
            total = ops.add(total, p)
    return outer.gradient(total, watched)


@pytest.mark.parametrize("n_devices", [2, 3], ids=lambda n: f"{n}dev")
def test_hessian_vector_product_through_data_parallel_equals_one_device(n_devices):
    rng = np.random.default_rng(3)
    params = tree_to(
        {"w": rng.uniform(-1, 1, 4), "b": rng.uniform(-1, 1, 4), "activation": "exp"}, HOST0
    )
    v = tree_to({"w": rng.uniform(-1, 1, 4), "b": rng.uniform(-1, 1, 4)}, HOST0)
    x = rng.standard_normal((7, 2))
    ids = list(range(n_devices))
    parallel = hessian_vector_product(
        lambda p, xb: data_parallel(exp_model, p, (xb,), ids), params, x, v
    )
    single = hessian_vector_product(lambda p, xb: exp_model(p, to_device(xb, HOST0)), params, x, v)
    assert_trees_close(parallel, single)
    # the analytic oracle: H = diag(S exp(w^2) (2 + 4 w^2)) for w, zero for b; S = sum(x^2)
    w = numpy(params["w"])
    expected_w = (x**2).sum() * np.exp(w * w) * (2 + 4 * w * w) * numpy(v["w"])
    np.testing.assert_allclose(numpy(parallel["w"]), expected_w, rtol=1e-12)
    np.testing.assert_array_equal(numpy(parallel["b"]), np.zeros(4))


# --------------------------------------------------------------------------------------------
# data_parallel on simulated GPUs, in every floating dtype


SIM_TOLERANCE = {np.float64: 1e-10, np.float32: 1e-5, np.float16: 5e-3}


@pytest.mark.parametrize("n_devices", [2, 3], ids=lambda n: f"{n}gpu")
@pytest.mark.parametrize("dtype", list(SIM_TOLERANCE), ids=lambda t: np.dtype(t).name)
def test_training_on_simulated_gpus_matches_one_gpu(dtype, n_devices):
    """Three SGD steps data-parallel over simulated GPUs equal the same steps on cuda:0 alone.

    In the parameters' dtype throughout (issue 24: float32 parameters came back float64 from
    replicate, silently); the simulator checks every copy's and kernel's stream ordering.
    """
    from cupy_parallel.testing import simulated_cuda

    with simulated_cuda(n_devices):
        first = Device("cuda", 0)
        params = {
            k: to_device(numpy(v).astype(dtype), first) if is_array(v) else v
            for k, v in init_mlp().items()
        }
        x, y = (a.astype(dtype) for a in batch(37))
        y = to_device(y, first)
        ids = [Device("cuda", k) for k in range(n_devices)]
        expected_losses, expected_grads = train(one_device, params, x, y)
        losses, grads = train(lambda p, xb: data_parallel(mlp, p, (xb,), ids), params, x, y)
        atol = SIM_TOLERANCE[dtype]
        for loss, expected in zip(losses, expected_losses, strict=True):
            assert loss.dtype == dtype
            assert device_of(loss) == first
            np.testing.assert_allclose(numpy(loss), numpy(expected), rtol=atol, atol=atol)
        for step, expected in zip(grads, expected_grads, strict=True):
            assert {g.dtype for g in step.values()} == {np.dtype(dtype)}
            assert_trees_close(step, expected, atol=atol * 10)
        assert numpy(expected_losses[-1]) < numpy(expected_losses[0])
