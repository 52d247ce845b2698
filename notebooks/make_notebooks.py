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


def loss_plot(title: str) -> nbformat.NotebookNode:
    """The cell plotting ``losses`` per step; ``title``: the title's Python expression."""
    return code(f"""
import matplotlib.pyplot as plt

plt.figure(figsize=(6, 3.5))
plt.semilogy(losses)
plt.xlabel("SGD step")
plt.ylabel("cross-entropy")
plt.title({title})
plt.show()""")


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
classifier with `cupy_parallel.DataParallel`, which splits every batch over the devices, runs a
replica per device in its own thread and gathers the outputs, all recorded on a tape so that
gradients flow back to the parameters; `cupy_parallel.value_and_grad` gives the loss and its
gradients in one call. Finally we check that the data-parallel gradients equal those of the same
step on one device.
"""),
    code(SETUP),
    md("""
## Gradients

`Tape` records the operations of `cupy_parallel.ops` on arrays it watches; `tape.gradient` runs
reverse-mode differentiation. `cupy_parallel.grad(fn)` is the same as a function transformation
(jax's shape), and since gradients are themselves recorded, `grad` of a `grad` gives second
derivatives. `gradcheck` compares the tape against finite differences.
"""),
    code("""
from cupy_parallel import ops

def on_host(a):
    return cupy_parallel.to_device(a, "cpu")

w = cupy_parallel.to_device(np.array([1.0, -2.0, 3.0]), devices[0])
with cupy_parallel.Tape() as tape:
    tape.watch(w)
    loss = ops.sum(ops.square(w))
print("tape.gradient:", on_host(tape.gradient(loss, w)))

grad_of_square = cupy_parallel.grad(lambda v: ops.sum(ops.square(v)))
print("gradient of sum(w**2):", on_host(grad_of_square(w)))
# d/dw sum(grad(w) * w) = d/dw sum(2 w**2) = 4 w: a derivative of a derivative
second = cupy_parallel.grad(lambda v: ops.sum(ops.multiply(grad_of_square(v), v)))
print("second order:", on_host(second(w)))
ok = cupy_parallel.gradcheck(lambda v: ops.sum(ops.tanh(v)), (w,), eps=1e-6, atol=1e-6, rtol=1e-4)
print("gradcheck:", ok)"""),
    md("""
## The model and its data

Three classes, picked by a random teacher network; the loss is softmax cross-entropy against
the integer labels (`ops.softmax_cross_entropy`, classes on the last axis).
"""),
    code("""
rng = np.random.default_rng(0)
x_all = rng.standard_normal((2048, 8))
teacher = np.tanh(x_all @ rng.standard_normal((8, 8))) @ rng.standard_normal((8, 3))
labels_all = np.argmax(teacher, axis=1)
first = devices[0]
x_all = cupy_parallel.to_device(x_all, first)
labels_all = cupy_parallel.to_device(labels_all, first)

def init(rng):
    return {
        "w1": rng.standard_normal((8, 32)) / np.sqrt(8), "b1": np.zeros(32),
        "w2": rng.standard_normal((32, 3)) / np.sqrt(32), "b2": np.zeros(3),
    }

params = {k: cupy_parallel.to_device(v, first) for k, v in init(np.random.default_rng(1)).items()}

def mlp(p, x):
    hidden = ops.tanh(ops.add(ops.matmul(x, p["w1"]), p["b1"]))
    return ops.add(ops.matmul(hidden, p["w2"]), p["b2"])"""),
    md("""
## Replicas

`replicate` copies the parameters to every device through a differentiable broadcast: the
gradient of each original is the sum of its replicas' gradients.
"""),
    code("""
replicas = cupy_parallel.replicate(params, devices)
print([str(cupy_parallel.device_of(r["w1"])) for r in replicas])"""),
    md("""
## Training with `DataParallel` and `value_and_grad`
"""),
    code("""
model = cupy_parallel.DataParallel(mlp, params, device_ids=devices)
print(model)

def objective(p, x, labels):
    model.params = p  # the replicas are broadcast from these (differentiated) arrays
    return ops.softmax_cross_entropy(model(x), labels)

step = cupy_parallel.value_and_grad(objective)  # (params, x, labels) -> (loss, grads)

losses = []
for i in range(150):
    rows = slice(256 * (i % 8), 256 * (i % 8 + 1))
    loss, grads = step(model.params, x_all[rows], labels_all[rows])
    model.params = {k: model.params[k] - 0.5 * grads[k] for k in model.params}
    losses.append(float(on_host(loss)))
print(f"loss: first {losses[0]:.4f}, last {losses[-1]:.4f}")"""),
    loss_plot('f"DataParallel on {len(devices)} device(s)"'),
    md("""
## Gradient check against one device

The same batch, the same parameters: once through `DataParallel`, once through `mlp` on a single
device with no data parallelism. The gradients agree to rounding.
"""),
    code("""
x, labels = x_all[:512], labels_all[:512]
_, parallel = step(model.params, x, labels)
one_device = cupy_parallel.value_and_grad(lambda p: ops.softmax_cross_entropy(mlp(p, x), labels))
_, single = one_device(model.params)
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

import warnings

from hypothesis.errors import HypothesisWarning

# Few examples keep the notebook quick; derandomize makes every run find the same examples.
fast = settings(max_examples=30, deadline=None, derandomize=True, database=None)
# Newer hypothesis builds the repr of a whole recursive strategy internally and warns that it
# is long; there is nothing to act on, so that one warning is not shown.
warnings.filterwarnings("ignore", "Generating overly large repr", HypothesisWarning)
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
                where = cupy_parallel.device_of(leaf)
                assert where == device, f"an array stayed on {where}: its container was skipped"
        assert_tree_equal(move_batch(moved, "cpu"), batch)
    round_trip()

def diagnosis(failure):  # what a failure of the round trip means, in words
    text = str(failure)
    if isinstance(failure, TypeError) and "__new__" in text:
        return "a namedtuple was rebuilt from one generator argument"
    if "differ in structure" in text:
        return "a container came back as another type or lost its metadata"
    if "its container was skipped" in text:
        return "a container the recursion does not know (e.g. a deque) was passed through unmoved"
    return "another failure: read the example"

try:
    check_round_trip(move_batch_naive)
    print("no counterexample found")
except Exception as error:  # hypothesis re-raises what failed on the smallest examples it found
    failures = getattr(error, "exceptions", [error])  # several distinct bugs come as a group
    print(f"the naive version fails in {len(failures)} distinct way(s):")
    for failure in failures:
        first_line = (str(failure).splitlines() or ["(no message)"])[0]
        print(f"- {type(failure).__name__}: {first_line}")
        print(f"  meaning: {diagnosis(failure)}")
        for note in getattr(failure, "__notes__", []):
            if note.startswith(("Falsifying example", "Failing test case")):  # old, new hypothesis
                print(note)"""),
    md("""
Hypothesis shrinks each distinct failure to a small example, printed above with what it means.
Which containers the shrunk examples show can vary with the hypothesis version, but the bugs are
the same: `type(batch)(generator)` passes a namedtuple one argument instead of its fields;
rebuilding a mapping or sequence by hand turns an `OrderedDict` into a `dict` (a `defaultdict`
loses its `default_factory`); and a container the recursion does not list, such as a `deque`, is
passed through with its arrays left where they were. Rather than adding a branch
per container, flatten with optree, act on the leaves, and unflatten, which keeps every
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

DISTRIBUTED = [
    md("""
# Distributed training on thread ranks

`torch.distributed` code runs as one process per rank, started by a launcher. To try such code
here, `cupy_parallel.distributed.spawn(fn, nprocs)` runs `fn(rank)` on `nprocs` *thread ranks*:
threads of this notebook's process, each with its own initialised default process group, as if
each had called `init_process_group` in a process of its own. They run the MPI backend itself
over an in-process MPI, so every collective gives the same results and the same errors as under
`mpiexec`. It is a backend for experiments and tests; production runs on MPI and NCCL.

We all-reduce by hand, train a classifier with `DistributedDataParallel` on 4 ranks, check its
gradients against one process, differentiate through a collective, and finally run the same
training function, unchanged, under `cupy-parallel launch`.
"""),
    code("""
import numpy as np

import cupy_parallel
from cupy_parallel import distributed as dist
from cupy_parallel import ops"""),
    md("""
## All-reduce by hand

Each rank holds its own array; `dist.all_reduce` replaces it, in place, by the sum over the ranks.
`spawn` returns what each rank's function returned, in rank order.
"""),
    code("""
def all_reduce_by_hand(rank):
    x = np.arange(4.0) * (rank + 1)  # this rank's array
    mine = x.copy()
    dist.all_reduce(x)  # on every rank: the sum of the ranks' arrays
    return dist.get_rank(), dist.get_world_size(), mine, x

results = dist.spawn(all_reduce_by_hand, 4)
for rank, world_size, mine, total in results:
    print(f"rank {rank} of {world_size}: {mine} -> {total}")
expected = np.sum([mine for _, _, mine, _ in results], axis=0)
print("every rank holds the NumPy sum:", all(np.array_equal(t, expected) for *_, t in results))"""),
    md("""
## Training with `DistributedDataParallel`

The training code goes into a module file, so that the same function runs under a launcher at
the end. Every rank builds the same data set and takes its shard of each batch with
`dist.shard_indices` (torch's `DistributedSampler`); `DistributedDataParallel` broadcasts rank 0's
parameters to all ranks at construction, and `tape.gradient` returns the gradients averaged over
the ranks, all-reduced in buckets while the backward pass runs. Shards are equal, so the average
of the ranks' mean losses is the mean loss of the whole batch.
"""),
    code('''
%%writefile ddp_train.py
"""Train a small classifier with DistributedDataParallel, on thread ranks or under a launcher."""

import numpy as np

import cupy_parallel
from cupy_parallel import distributed as dist
from cupy_parallel import ops


def make_data(n=1024):
    """Three classes picked by a random teacher network (the same data set on every rank)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, 8))
    teacher = np.tanh(x @ rng.standard_normal((8, 8))) @ rng.standard_normal((8, 3))
    return x, np.argmax(teacher, axis=1)


def init_params(seed):
    rng = np.random.default_rng(seed)
    return {
        "w1": rng.standard_normal((8, 32)) / np.sqrt(8), "b1": np.zeros(32),
        "w2": rng.standard_normal((32, 3)) / np.sqrt(32), "b2": np.zeros(3),
    }


def mlp(p, x):
    hidden = ops.tanh(ops.add(ops.matmul(x, p["w1"]), p["b1"]))
    return ops.add(ops.matmul(hidden, p["w2"]), p["b2"])


def train(steps=160, batch=64, lr=0.5):
    """SGD, each rank on its shard of every batch: the parameters and the batch loss per step."""
    x, labels = make_data()
    world = dist.get_world_size()
    # each rank starts from parameters of its own: DDP broadcasts rank 0's to all
    ddp = cupy_parallel.DistributedDataParallel(mlp, init_params(seed=dist.get_rank()))
    per_rank = batch // world
    steps_per_epoch = len(x) // batch
    losses = []
    for step in range(steps):
        epoch, i = divmod(step, steps_per_epoch)
        mine = dist.shard_indices(len(x), epoch=epoch)  # this rank's shuffled shard
        rows = mine[i * per_rank : (i + 1) * per_rank]
        with cupy_parallel.Tape() as tape:
            loss = ops.softmax_cross_entropy(ddp(x[rows]), labels[rows])
        grads = tape.gradient(loss, ddp.params)  # averaged over the ranks
        ddp.params = {k: ddp.params[k] - lr * grads[k] for k in grads}
        total = np.array([float(loss)])
        dist.all_reduce(total)
        losses.append(float(total[0]) / world)  # the whole batch's mean loss
    return ddp.params, losses


def summary(losses):
    return f"{dist.get_world_size()} ranks: final loss {losses[-1]!r}"


if __name__ == "__main__":
    dist.init_process_group()  # backend, rank and world size from the launcher
    _, losses = train()
    if dist.get_rank() == 0:
        print(summary(losses))
    dist.destroy_process_group()'''),
    code("""
import importlib

importlib.invalidate_caches()  # ddp_train.py was just written: let the import system see it
import ddp_train

runs = dist.spawn(lambda rank: ddp_train.train(), 4)
params, losses = runs[0]
same = all(np.array_equal(p[k], params[k]) for p, _ in runs for k in params)
print("every rank ends with rank 0's parameters:", same)
print(f"loss: first {losses[0]:.4f}, last {losses[-1]:.4f}")"""),
    loss_plot('"DistributedDataParallel on 4 thread ranks"'),
    md("""
## Gradients checked against one process

One step from the trained parameters: each of the 4 ranks takes 16 rows of its shard, and DDP
averages the ranks' gradients. On one process, without any distribution, the gradient of the mean
loss over the union of the ranks' rows is the same, up to rounding. (Each rank gets its own copy
of the parameters, as a process would: DDP's broadcast writes into them.)
"""),
    code("""
x, labels = ddp_train.make_data()

def ddp_gradient(rank):
    ddp = cupy_parallel.DistributedDataParallel(
        ddp_train.mlp, {k: v.copy() for k, v in params.items()}
    )
    rows = dist.shard_indices(len(x))[:16]
    with cupy_parallel.Tape() as tape:
        loss = ops.softmax_cross_entropy(ddp(x[rows]), labels[rows])
    return rows, tape.gradient(loss, ddp.params)

shards = dist.spawn(ddp_gradient, 4)
union = np.concatenate([rows for rows, _ in shards])

def mean_loss(p):  # over all the ranks' rows, on one process
    return ops.softmax_cross_entropy(ddp_train.mlp(p, x[union]), labels[union])

one_process = cupy_parallel.grad(mean_loss)(params)
difference = max(float(np.max(np.abs(g[k] - one_process[k]))) for _, g in shards for k in params)
print(f"{len(union)} rows on 4 ranks: max |DDP - one process| = {difference:.1e}")"""),
    md("""
## Differentiating through a collective

`cupy_parallel.distributed.nn.functional` (torch's module path) has collectives that are recorded
on the tape. A rank's gradient is the gradient, with respect to its own inputs, of the **sum over
the ranks of the ranks' losses**. Here rank `r` all-gathers every rank's vector `x_s` and its loss
is `(r + 1) * sum_s |x_s|^2`; the sum of the losses is `(1 + 2 + ... + W) * sum_s |x_s|^2`, so each
rank's gradient is `W (W + 1) x_r`: `20 x_r` on 4 ranks, not the `2 (r + 1) x_r` of its own loss.
"""),
    code("""
from cupy_parallel.distributed.nn import functional as dnn

def through_all_gather(rank):
    x = np.arange(3.0) + 10 * rank  # this rank's vector
    with cupy_parallel.Tape() as tape:
        tape.watch(x)
        everyone = ops.stack(dnn.all_gather(x))  # (world size, 3), recorded
        loss = ops.multiply(rank + 1.0, ops.sum(ops.square(everyone)))
    return x, tape.gradient(loss, x)

world = 4
results = dist.spawn(through_all_gather, world)
for rank, (x_r, g) in enumerate(results):
    print(f"rank {rank}: x {x_r}, gradient {g}")
equal = all(np.array_equal(g, world * (world + 1) * x_r) for x_r, g in results)
print("closed form equal:", equal)"""),
    md("""
## The same function under a launcher

`ddp_train.py` ends with an `if __name__ == "__main__":` block: each process initialises its
process group from the launcher's environment (`dist.init_process_group()` with no arguments),
trains and prints. In a terminal, in this notebook's directory:

```bash
cupy-parallel launch --backend mpi --nproc-per-node 2 ddp_train.py
```

starts 2 processes under `mpiexec` (without `--backend`, the launcher picks `nccl` on a machine
with GPUs). Thread ranks have MPI's semantics, so the same function on 2 thread ranks prints the
same final loss, to the last digit (the launcher's run is left to a terminal: this notebook does
not need MPI installed):
"""),
    code("""
print(dist.spawn(lambda rank: ddp_train.summary(ddp_train.train()[1]), 2)[0])
print(f"(4 ranks above: final loss {losses[-1]!r})")"""),
    md("""
Every global batch is the same whatever the number of ranks (rank `r` takes every `W`-th row of
the epoch's permutation), so this run on 2 ranks follows the 4-rank run above up to rounding.
"""),
]

SHARDED = [
    md("""
# Sharded training: memory per rank 1/N

With `DistributedDataParallel` every rank holds the whole model, its gradients and (with Adam)
two more copies of optimizer state: 4x the parameters per rank, whatever the number of ranks.
Sharding cuts that. ZeRO-1 (`distributed.optim.ZeroRedundancyOptimizer`) keeps the optimizer
state of a 1/N partition of the parameters on each rank; `FullyShardedDataParallel` (FSDP,
ZeRO-3) keeps 1/N of the parameters, gradients and optimizer state, and gathers a *unit* of the
model (a top-level entry of its parameters) only while it computes.

We train one 8-unit MLP with Adam on 4 thread ranks, four ways, measure the bytes each rank holds
at the peak of a step, and check that the four runs take the same steps.
"""),
    code("""
import gc
import weakref

import numpy as np

import cupy_parallel
from cupy_parallel import distributed as dist
from cupy_parallel import ops
from cupy_parallel.optim import Adam

D, UNITS, BATCH, STEPS = 384, 8, 16, 5  # a unit: a 384 x 384 float32 weight (576 KiB), a bias

def init_params():  # the weights in pooled memory (cupy_parallel.empty), as a rank's arrays are
    rng = np.random.default_rng(0)
    params = {}
    for k in range(UNITS):
        w = cupy_parallel.empty((D, D), np.float32, "cpu")
        w[...] = rng.standard_normal((D, D)) / np.sqrt(D)
        params[f"layer{k}"] = {"w": w, "b": np.zeros(D, np.float32)}
    return params

def layer(p, h):
    return ops.tanh(ops.add(ops.matmul(h, p["w"]), p["b"]))

def mlp(units, x):  # FSDP gathers units[k] when it is read, and frees it once the next one is
    h = x
    for k in range(UNITS):
        h = layer(units[f"layer{k}"], h)
    return h

def batch(rank, step):
    rng = np.random.default_rng(1000 * step + rank)
    x = rng.standard_normal((BATCH, D)).astype(np.float32)
    return x, np.tanh(x[:, ::-1]).copy()"""),
    md("""
## Bytes per rank

Large arrays (128 KiB and more: the weights, gradient buffers, optimizer state, gathered units;
here even a quarter of a weight) come from the host memory pool. Thread ranks share one pool, so we attribute each block to the
rank that allocated it and follow it until it is freed: each rank's current and peak bytes.
"""),
    code("""
class BytesPerRank:
    \"\"\"Each thread rank's pooled bytes: now, and the peak since reset().\"\"\"

    def __init__(self):
        self.pool = cupy_parallel.get_host_memory_pool()
        self.now, self.peak = {}, {}
        allocate = self.pool.empty

        def empty(shape, dtype):
            array = allocate(shape, dtype)
            block = array
            while isinstance(block, np.ndarray):  # the pool's block, at the end of the bases
                block = block.base
            if block is not None:
                rank = dist.get_rank()
                self.now[rank] = self.now.get(rank, 0) + array.nbytes
                self.peak[rank] = max(self.peak.get(rank, 0), self.now[rank])
                weakref.finalize(block, self._free, rank, array.nbytes)
            return array

        self.pool.empty = empty

    def _free(self, rank, nbytes):
        self.now[rank] -= nbytes

    def reset(self):
        self.peak = dict(self.now)

probe = BytesPerRank()"""),
    md("""
## Four ways to train

`ddp`: DDP + Adam. `zero1`: DDP + `ZeroRedundancyOptimizer(Adam)`. `fsdp`: FSDP + Adam on its
shards (any optimizer works on them unchanged). `fsdp grad_op`: FSDP with
`reshard_after_forward=False`, which keeps the gathered units from the forward to the backward
pass (fewer all-gathers, more memory). Each run takes its parameters from the same seed and each
rank its own batches; every rank records the loss averaged over the ranks and its peak bytes
during the last step.
"""),
    code("""
def make(kind):
    if kind == "ddp":
        module = cupy_parallel.DistributedDataParallel(mlp, init_params())
        return module, Adam(module.params, lr=1e-3)
    if kind == "zero1":
        from cupy_parallel.distributed.optim import ZeroRedundancyOptimizer

        module = cupy_parallel.DistributedDataParallel(mlp, init_params())
        return module, ZeroRedundancyOptimizer(module.params, Adam, lr=1e-3)
    reshard = kind == "fsdp"
    module = cupy_parallel.FullyShardedDataParallel(
        mlp, init_params(), reshard_after_forward=reshard
    )
    return module, Adam(module.params, lr=1e-3)

def train(rank, kind):
    module, optimizer = make(kind)
    losses = []
    for step in range(STEPS):
        x, y = batch(rank, step)
        if step == STEPS - 1:
            gc.collect()  # what earlier steps left in reference cycles, for every run alike
            dist.barrier()
            probe.reset()
        with cupy_parallel.Tape() as tape:
            loss = ops.mean(ops.square(ops.subtract(module(x), y)))
        grads = tape.gradient(loss, module.params)
        optimizer.step(grads)
        del grads, tape
        mean = np.array([float(loss)])
        dist.all_reduce(mean)
        losses.append(float(mean[0]) / dist.get_world_size())
    dist.barrier()
    return losses, probe.peak.get(rank, 0)

kinds = ["ddp", "fsdp", "fsdp grad_op"]
try:
    from cupy_parallel.distributed.optim import ZeroRedundancyOptimizer  # noqa: F401

    kinds.insert(1, "zero1")
except ImportError:
    print("ZeroRedundancyOptimizer is not in this version: three runs")

runs = {kind: dist.spawn(train, 4, args=(kind,)) for kind in kinds}
losses = {kind: result[0][0] for kind, result in runs.items()}
peaks = {kind: max(peak for _, peak in result) for kind, result in runs.items()}
for kind in kinds:
    share = peaks[kind] / peaks["ddp"]
    print(f"{kind:13s} peak bytes per rank {peaks[kind]:>10,}  ({share:.2f} of DDP's)")
gap = max(abs(a - b) for kind in kinds for a, b in zip(losses[kind], losses["ddp"]))
print(f"loss curves equal: {gap < 1e-5} (largest difference {gap:.1e}, float32)")"""),
    md("""
The issue's targets, with DDP's 4 copies of the parameters `P` as the unit and `N = 4` ranks:
ZeRO-1 at most `(2 + 2/N) / 4` of DDP's (parameters and gradients whole, Adam's state 1/N),
FSDP at most `(4/N) / 4` plus two units (the one computing and the one prefetched).
"""),
    code("""
import matplotlib.pyplot as plt

P = UNITS * (D * D + D) * 4
targets = {"ddp": 4 * P, "zero1": (2 + 2 / 4) * P, "fsdp": P + 2 * (D * D + D) * 4}
fig, (bars, curves) = plt.subplots(1, 2, figsize=(11, 3.8))
names = list(peaks)
bars.bar(names, [peaks[k] / 2**20 for k in names], color="tab:blue", label="measured peak")
bars.scatter(
    [k for k in names if k in targets],
    [targets[k] / 2**20 for k in names if k in targets],
    color="tab:red", marker="_", s=900, label="target",
)
bars.set_ylabel("MiB per rank")
bars.set_title("memory per rank, Adam, 4 ranks")
bars.legend()
for kind in kinds:
    curves.plot(losses[kind], label=kind, linestyle="--" if kind != "ddp" else "-")
curves.set_xlabel("Adam step")
curves.set_ylabel("mean squared error")
curves.set_title("the same steps")
curves.legend()
plt.tight_layout()
plt.show()"""),
    md("""
FSDP's peak is its shards (parameters, gradients, Adam's two moments: `P` over 4 ranks) plus
the units in flight: the one computing, the next one's all-gather (prefetched while the current
one computes), and in the backward pass the unit gathered again with one reduce-scatter in
flight. `fsdp grad_op` keeps every gathered unit to the backward pass: more memory, no second
all-gather. `benchmarks/bench_sharded.py` measures the same on 4 MPI processes, with step times.
"""),
]


TRAINING_STATE = [
    md("""
# Training state: optimizer, schedule, clipping, and a checkpoint that survives a crash

`DistributedDataParallel` gives each rank the averaged gradient; what turns it into training is
the state around it. Here two thread ranks train a small MLP with torch's recipe, in our names:
`cupy_parallel.optim.Adam`, a warm-up then cosine schedule (`optim.lr_scheduler.SequentialLR`),
`cupy_parallel.clip_grad_norm`, and a checkpoint of the whole state (`cupy_parallel.save`:
parameters, optimizer, schedule, step) every 5 steps. Then rank 1 crashes at step 13, the job
is started again, resumes from the checkpoint of step 10, and ends with exactly the parameters
of a run that never crashed.
"""),
    code('''import os
import tempfile

import numpy as np

import cupy_parallel as cp
from cupy_parallel import distributed as dist
from cupy_parallel import ops
from cupy_parallel.optim import Adam
from cupy_parallel.optim.lr_scheduler import CosineAnnealingLR, LinearLR, SequentialLR

STEPS, EVERY, BATCH, FEATURES, HIDDEN, WORLD = 20, 5, 32, 8, 16, 2


def mlp(params, x):
    hidden = ops.tanh(ops.add(ops.matmul(x, params["w1"]), params["b1"]))
    return ops.add(ops.matmul(hidden, params["w2"]), params["b2"])


def initial_params():
    rng = np.random.default_rng(0)
    return {
        "w1": rng.standard_normal((FEATURES, HIDDEN)) / np.sqrt(FEATURES),
        "b1": np.zeros(HIDDEN),
        "w2": rng.standard_normal((HIDDEN, 1)) / np.sqrt(HIDDEN),
        "b2": np.zeros(1),
    }


def batch(step, rank):
    """This rank's rows of step `step`'s batch: a function of the step alone."""
    rng = np.random.default_rng(1000 + step)
    x = rng.standard_normal((BATCH, FEATURES))
    y = np.sin(x.sum(axis=1, keepdims=True))
    rows = slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD)
    return x[rows], y[rows]'''),
    md("""
One rank's training. The optimizer updates the parameter arrays in place (the arrays DDP holds),
so a resumed run loads the parameters first, builds DDP and the optimizer over them, and then
loads the optimizer's and the schedule's state. Rank 0 writes the checkpoint; `cupy_parallel.save`
writes a temporary file and renames it, so a crash in the middle of a save leaves the previous
checkpoint whole.
"""),
    code('''def train(rank, path=None, die_at=None):
    """One rank's run: resume from `path` if a checkpoint is there, save to it every EVERY steps."""
    state = cp.load(path) if path and os.path.exists(path) else None
    ddp = cp.DistributedDataParallel(mlp, state["params"] if state else initial_params())
    opt = Adam(ddp.params, lr=1e-2, weight_decay=1e-4)
    warmup = LinearLR(opt, start_factor=0.1, total_iters=5)
    schedule = SequentialLR(opt, [warmup, CosineAnnealingLR(opt, T_max=STEPS - 5)], [5])
    first = 0
    if state:  # the optimizer's and the schedule's state, then where we were
        opt.load_state_dict(state["optim"])
        schedule.load_state_dict(state["schedule"])
        first = state["step"]
    losses = {}
    for step in range(first, STEPS):
        if step == die_at and rank == 1:
            raise RuntimeError(f"rank 1 crashed at step {step}")
        x, y = batch(step, rank)
        with cp.Tape() as tape:
            loss = ops.mean(ops.square(ops.subtract(ddp(x), y)))
        grads, _ = cp.clip_grad_norm(tape.gradient(loss, ddp.params), max_norm=1.0)
        opt.step(grads)
        schedule.step()
        losses[step] = float(loss)
        if path and (step + 1) % EVERY == 0 and rank == 0:
            cp.save(
                {"params": ddp.params, "optim": opt.state_dict(),
                 "schedule": schedule.state_dict(), "step": step + 1},
                path,
            )
        dist.barrier()  # no rank runs ahead of a checkpoint being written
    return {k: v.copy() for k, v in ddp.params.items()}, losses, first'''),
    md("""
The uninterrupted run, then a run in which rank 1 crashes at step 13: `spawn` stops the other
rank and raises, as a launcher stops a job whose rank died. The checkpoint on disk is step 10's.
"""),
    code("""whole = dist.spawn(train, WORLD)
print(f"uninterrupted: loss {whole[0][1][0]:.4f} at step 0, {whole[0][1][STEPS - 1]:.4f} at step {STEPS - 1}")

path = os.path.join(tempfile.mkdtemp(), "state.safetensors")
try:
    dist.spawn(train, WORLD, args=(path, 13))
except RuntimeError as failure:
    print("the job died:", str(failure).splitlines()[0])
print("the checkpoint on disk is step", cp.load(path)["step"])"""),
    md("""
Start the job again: every rank loads step 10's state and goes on. Why it is exact: the batch
of a step is a function of the step alone (with a `DistributedSampler`, `shard_indices(...,
epoch=e)` gives each epoch's order from its number), and every piece of state the update reads
— the parameters, Adam's moments and step count, the schedule's position — is in the
checkpoint, bit for bit.
"""),
    code("""resumed = dist.spawn(train, WORLD, args=(path,))
print("resumed from step", resumed[0][2])
same = all(
    np.array_equal(resumed[r][0][k], whole[r][0][k]) for r in range(WORLD) for k in whole[r][0]
)
print("bit for bit the parameters of the uninterrupted run:", same)
print("same losses after the restart:", all(resumed[0][1][s] == whole[0][1][s] for s in resumed[0][1]))"""),
    md("""
With processes, the same loop runs under the launcher, which restarts a job whose rank died:
`cupy-parallel launch --nproc-per-node 2 --max-restarts 1 examples/train_resume.py OUT
--kill-at 13` (rank 1 kills itself with `SIGKILL`; the restarted job sees
`TORCHELASTIC_RESTART_COUNT=1`). `tests/test_examples.py` checks that it ends with the
uninterrupted run's parameters, bit for bit. For sharded state (FSDP, ZeRO) saved on one number
of ranks and loaded on another, see `cupy_parallel.distributed.checkpoint` and notebook 06.
"""),
]

NOTEBOOKS = {
    "01_tour.ipynb": TOUR,
    "02_data_parallel_training.ipynb": TRAINING,
    "03_property_testing.ipynb": PROPERTIES,
    "04_distributed_training.ipynb": DISTRIBUTED,
    "05_training_state.ipynb": TRAINING_STATE,
    "06_sharded_training.ipynb": SHARDED,
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
