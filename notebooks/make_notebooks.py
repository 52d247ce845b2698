"""Write the tutorial notebooks of this directory from the cell sources below.

The notebooks are kept without outputs (``execution_count`` null), so that diffs show only what
a person wrote; tests/test_notebooks.py executes them. After editing a cell here, regenerate with

    python notebooks/make_notebooks.py

Every notebook runs unchanged on the host platform (it then creates 4 simulated devices) and on
CUDA (it uses every GPU, one or more).
"""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent

SETUP = """\
import numpy as np

import cupy_parallel

if cupy_parallel.platform() == "host":  # no GPU: simulate 4 accelerators in host memory
    cupy_parallel.set_host_device_count(4)
devices = cupy_parallel.devices()
print(cupy_parallel.platform(), [str(d) for d in devices])"""


def md(text: str) -> nbformat.NotebookNode:
    """A markdown cell."""
    return new_markdown_cell(text.strip())


def code(text: str) -> nbformat.NotebookNode:
    """A code cell, without outputs."""
    return new_code_cell(text.strip())


TOUR = [
    md("""
# A tour of cupy_parallel

`cupy_parallel` brings PyTorch's multi-device layer (`torch.cuda.comm`, `torch.nn.parallel`,
`torch.distributed`) to CuPy and NumPy arrays. This notebook shows devices and placement, the
array-level primitives of `cupy_parallel.comm`, and scatter/gather of nested batches.

It runs unchanged with or without GPUs: on a machine without one, the *host platform* gives us
simulated accelerators `host:0`, `host:1`, ... that live in host memory but enforce placement as
strictly as GPUs do.
"""),
    code(SETUP),
    md("""
## Devices and arrays

A device is `"cpu"` (plain NumPy), `"cuda:k"` (CuPy) or `"host:k"` (a `HostArray`, a device
array holding NumPy memory). `to_device` moves an array, `device_of` tells where it is.
"""),
    code("""
x = cupy_parallel.to_device(np.arange(6.0), devices[0])
print(type(x).__name__, cupy_parallel.device_of(x))
print(cupy_parallel.device_of(x * 2 + 1))  # results stay on the device
back = cupy_parallel.to_device(x, "cpu")
print(type(back).__name__, back)"""),
    md("""
## Placement errors

Code that mixes devices by accident fails loudly, with a message that says how to fix it. On
GPUs CuPy refuses NumPy arrays; host devices refuse them too, so placement bugs show up before
you rent a GPU.
"""),
    code("""
try:
    x + np.ones(6)  # a device array meets a plain NumPy array
except TypeError as error:
    print("TypeError:", error)"""),
    code("""
missing = f"{devices[0].kind}:{len(devices)}"  # one past the last device
try:
    cupy_parallel.to_device(np.ones(2), missing)
except ValueError as error:
    print("ValueError:", error)"""),
    code("""
if len(devices) > 1:
    y = cupy_parallel.to_device(np.ones(6), devices[1])
    try:
        z = x + y  # arrays on two different devices
        # CuPy allows this between GPUs with peer-to-peer access; host devices never do.
        print("allowed (peer access), result on", cupy_parallel.device_of(z))
    except ValueError as error:
        print("ValueError:", error)"""),
    md("""
## Scatter and gather of nested batches

`cupy_parallel.scatter` splits every array of a nested structure (dicts, lists, tuples,
namedtuples, ...) along a dimension, one slice per device, and passes other leaves through.
`cupy_parallel.gather` joins them again. Slices differ in size by at most one row.
"""),
    code("""
batch = {
    "image": np.arange(7 * 3, dtype=np.float32).reshape(7, 3),
    "label": np.arange(7),
    "meta": ("train", None),
}
parts = cupy_parallel.scatter(batch, devices)
for part in parts:
    image = part["image"]
    print(cupy_parallel.device_of(image), image.shape, part["label"], part["meta"])"""),
    code("""
joined = cupy_parallel.gather(parts, "cpu")
same = all(np.array_equal(joined[k], batch[k]) for k in ("image", "label"))
print("round trip equal:", same and joined["meta"] == batch["meta"])"""),
    md("""
## Coalesced broadcast and reduce

`comm.broadcast_coalesced` copies many small arrays to every device by packing them into a few
large buffers per dtype (one transfer instead of many), the way `replicate` copies a model's
parameters. `comm.reduce_add` sums one array per device onto one device, the step that adds up
gradients.
"""),
    code("""
from cupy_parallel import comm

params = [
    cupy_parallel.to_device(np.full((2, 2), 1.5), devices[0]),
    cupy_parallel.to_device(np.arange(3), devices[0]),
]
copies = comm.broadcast_coalesced(params, devices, buffer_size=1024)
for device, copy in zip(devices, copies):
    print(device, [(str(cupy_parallel.device_of(a)), a.dtype.name) for a in copy])"""),
    code("""
total = comm.reduce_add([copy[0] for copy in copies], devices[0])
print(cupy_parallel.device_of(total))
value = float(cupy_parallel.to_device(total, "cpu")[0, 0])
print("sum over devices:", value, "=", 1.5 * len(devices))"""),
]

TRAINING = [
    md("""
# Data-parallel training

A *module* is a pure function `fn(params, *inputs)` and its parameter pytree. We train a small MLP
with `cupy_parallel.DataParallel`, which splits every batch over the devices, runs a replica per
device in its own thread and gathers the outputs, all recorded on a `cupy_parallel.Tape` so that
gradients flow back to the parameters. Finally we check that the data-parallel gradients equal
those of the same step on one device.
"""),
    code(SETUP),
    md("""
## The tape

`Tape` records the operations of `cupy_parallel.ops` on arrays it watches; `tape.gradient` runs
reverse-mode differentiation. `gradcheck` compares it against finite differences.
"""),
    code("""
from cupy_parallel import ops

w = cupy_parallel.to_device(np.array([1.0, -2.0, 3.0]), devices[0])
with cupy_parallel.Tape() as tape:
    tape.watch(w)
    loss = ops.sum(ops.square(w))
print("gradient of sum(w**2):", cupy_parallel.to_device(tape.gradient(loss, w), "cpu"))
ok = cupy_parallel.gradcheck(lambda v: ops.sum(ops.tanh(v)), (w,), eps=1e-6, atol=1e-6, rtol=1e-4)
print("gradcheck:", ok)"""),
    md("""
## The model and its data
"""),
    code("""
rng = np.random.default_rng(0)
x_all = rng.standard_normal((2048, 8))
y_all = np.tanh(x_all @ rng.standard_normal((8, 1)))
first = devices[0]
x_all, y_all = cupy_parallel.to_device(x_all, first), cupy_parallel.to_device(y_all, first)

def init(rng):
    return {
        "w1": rng.standard_normal((8, 32)) / np.sqrt(8), "b1": np.zeros(32),
        "w2": rng.standard_normal((32, 1)) / np.sqrt(32), "b2": np.zeros(1),
    }

params = {k: cupy_parallel.to_device(v, first) for k, v in init(np.random.default_rng(1)).items()}

def mlp(p, x):
    hidden = ops.tanh(ops.add(ops.matmul(x, p["w1"]), p["b1"]))
    return ops.add(ops.matmul(hidden, p["w2"]), p["b2"])

def mse(prediction, target):
    return ops.mean(ops.square(ops.subtract(prediction, target)))"""),
    md("""
## Replicas

`replicate` copies the parameters to every device through a differentiable broadcast: the
gradient of each original is the sum of its replicas' gradients.
"""),
    code("""
replicas = cupy_parallel.replicate(params, devices)
print([str(cupy_parallel.device_of(r["w1"])) for r in replicas])"""),
    md("""
## Training with `DataParallel`
"""),
    code("""
model = cupy_parallel.DataParallel(mlp, params, device_ids=devices)
print(model)

def step(params, x, y, forward):
    with cupy_parallel.Tape() as tape:
        tape.watch(params)
        loss = mse(forward(x), y)
    return float(loss), tape.gradient(loss, params)

losses = []
for i in range(150):
    rows = slice(256 * (i % 8), 256 * (i % 8 + 1))
    loss, grads = step(model.params, x_all[rows], y_all[rows], model)
    model.params = {k: model.params[k] - 0.2 * grads[k] for k in model.params}
    losses.append(loss)
print(f"loss: first {losses[0]:.4f}, last {losses[-1]:.4f}")"""),
    code("""
import matplotlib.pyplot as plt

plt.figure(figsize=(6, 3.5))
plt.semilogy(losses)
plt.xlabel("SGD step")
plt.ylabel("mean squared error")
plt.title(f"DataParallel on {len(devices)} device(s)")
plt.show()"""),
    md("""
## Gradient check against one device

The same batch, the same parameters: once through `DataParallel`, once through `mlp` on a single
device with no data parallelism. The gradients agree to rounding.
"""),
    code("""
x, y = x_all[:512], y_all[:512]
_, parallel = step(model.params, x, y, model)
_, single = step(model.params, x, y, lambda batch: mlp(model.params, batch))
def on_host(a):
    return cupy_parallel.to_device(a, "cpu")

difference = max(float(np.max(np.abs(on_host(parallel[k]) - on_host(single[k])))) for k in params)
print(f"max |DataParallel - one device| = {difference:.3e}")"""),
]

PROPERTIES = [
    md("""
# Property testing your own nested-structure code

Code that walks nested batches breaks on the containers nobody thought of: a namedtuple, an
`OrderedDict`, a `defaultdict`, a `deque`, a `None` in the middle. `cupy_parallel.testing` gives
[hypothesis](https://hypothesis.readthedocs.io) strategies that generate such structures with
arrays of every dtype on every device, and `assert_tree_equal`, which compares structures
bit-exactly and names the key path of the first difference.

Here we test a small helper one might write: move every array of a batch to a device.
"""),
    code(SETUP),
    code("""
from hypothesis import given, settings
from hypothesis import strategies as st

from cupy_parallel.testing import arrays, assert_tree_equal, nested_structures
from cupy_parallel.testing import devices as device_lists

# Few examples keep the notebook quick; derandomize makes every run find the same examples.
fast = settings(max_examples=30, deadline=None, derandomize=True, database=None)
batches = nested_structures(arrays(max_dims=2, max_side=3), max_leaves=6)"""),
    md("""
## A first attempt

A hand-written recursion over the containers we expect:
"""),
    code("""
def move_batch_naive(batch, device):
    if isinstance(batch, dict):
        return {k: move_batch_naive(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(move_batch_naive(v, device) for v in batch)
    if cupy_parallel.is_array(batch):
        return cupy_parallel.to_device(batch, device)
    return batch"""),
    md("""
The property: moving a batch to a device and back to the host gives the batch we started with,
and every array was on the device in between.
"""),
    code("""
import optree

def check_round_trip(move_batch):
    @fast
    @given(batch=batches, device=st.sampled_from(devices))
    def round_trip(batch, device):
        moved = move_batch(batch, device)
        for leaf in optree.tree_leaves(moved, namespace="cupy_parallel"):
            if cupy_parallel.is_array(leaf):
                assert cupy_parallel.device_of(leaf) == device
        assert_tree_equal(move_batch(moved, "cpu"), batch)
    round_trip()

try:
    check_round_trip(move_batch_naive)
    print("no counterexample found")
except Exception as error:  # hypothesis re-raises what failed on the smallest examples it found
    failures = getattr(error, "exceptions", [error])  # several distinct bugs come as a group
    print(f"the naive version fails in {len(failures)} distinct way(s):")
    for failure in failures:
        first_line = (str(failure).splitlines() or ["(no message)"])[0]
        print(f"- {type(failure).__name__}: {first_line}")
        for note in getattr(failure, "__notes__", []):
            if note.startswith(("Falsifying example", "Failing test case")):  # old, new hypothesis
                print(note)"""),
    md("""
Hypothesis shrinks the failure to a small structure: a namedtuple cannot be rebuilt from a
generator, and a `defaultdict` or `deque` loses its type (or its `maxlen`). Rather than adding a
branch per container, flatten with optree, act on the leaves, and unflatten, which keeps every
container and its metadata:
"""),
    code("""
def move_batch(batch, device):
    return optree.tree_map(
        lambda x: cupy_parallel.to_device(x, device) if cupy_parallel.is_array(x) else x,
        batch,
        namespace="cupy_parallel",
    )

check_round_trip(move_batch)
print("move_batch: the round-trip property holds on", fast.max_examples, "examples")"""),
    md("""
## Properties of the library, the same way

The same tools test code built on `cupy_parallel`. Scattering a batch over any list of devices and
gathering it back gives the batch, whatever its structure and dtypes:
"""),
    code("""
@fast
@given(
    batch=nested_structures(arrays(min_dims=1, max_dims=2, min_side=1, max_side=5), max_leaves=5),
    targets=device_lists(min_size=1, max_size=len(devices)),
)
def scatter_gather_round_trip(batch, targets):
    parts = cupy_parallel.scatter(batch, targets)
    assert len(parts) <= len(targets)
    assert_tree_equal(cupy_parallel.gather(parts, "cpu"), batch)

scatter_gather_round_trip()
print("scatter/gather: the round-trip property holds on", fast.max_examples, "examples")"""),
    md("""
In a test suite these are plain `pytest` tests: drop the call at the end, keep the decorators, and
raise `max_examples` (or use a hypothesis profile) for a thorough nightly run.
"""),
]

NOTEBOOKS = {
    "01_tour.ipynb": TOUR,
    "02_data_parallel_training.ipynb": TRAINING,
    "03_property_testing.ipynb": PROPERTIES,
}


def build(cells: list[nbformat.NotebookNode]) -> nbformat.NotebookNode:
    """A python3 notebook of ``cells`` with stable cell ids."""
    notebook = new_notebook(cells=cells)
    notebook.metadata["kernelspec"] = {
        "display_name": "Python 3",
        "language": "python",
        "name": "python3",
    }
    notebook.metadata["language_info"] = {"name": "python"}
    for index, cell in enumerate(notebook.cells):
        cell["id"] = f"cell-{index:02d}"  # stable ids: regenerating gives the same files
    return notebook


def main() -> None:
    """Validate and write every notebook."""
    for name, cells in NOTEBOOKS.items():
        notebook = build(cells)
        nbformat.validate(notebook)
        nbformat.write(notebook, HERE / name)
        print("wrote", HERE / name)


if __name__ == "__main__":
    main()
