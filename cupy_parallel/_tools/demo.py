"""The ``cupy-parallel demo`` model: a small MLP classifier trained with :class:`DataParallel`.

Everything the command does is importable here, so that the pieces can be reused and tested:
:func:`make_dataset` draws a synthetic classification problem, :func:`init_params` and :func:`mlp`
define the model as a pure function of a parameter pytree (the library's notion of a "module"),
:func:`cross_entropy` is its loss (softmax cross-entropy with integer labels),
:func:`single_device_step` and :func:`data_parallel_step` compute the loss and its gradients with
:func:`cupy_parallel.value_and_grad`, and :func:`train` runs SGD while checking, on the first step,
that the data-parallel gradients equal the single-device ones. :func:`plot_losses` draws the loss
curve.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import optree

from cupy_parallel._src import ops
from cupy_parallel._src.arrays import to_device
from cupy_parallel._src.devices import Device, as_device
from cupy_parallel._src.functional import value_and_grad
from cupy_parallel._src.parallel import DataParallel
from cupy_parallel._src.tree import NAMESPACE

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from pathlib import Path

__all__ = [
    "TOLERANCES",
    "DemoConfig",
    "DemoResult",
    "cross_entropy",
    "data_parallel_step",
    "init_params",
    "make_dataset",
    "max_abs_difference",
    "mlp",
    "plot_losses",
    "single_device_step",
    "train",
]

#: Largest absolute difference allowed between the data-parallel and the single-device gradients
#: of the first step, per dtype. Both compute the same sums in a different order, so the
#: difference is a few units in the last place; the bound leaves room for that and nothing more.
TOLERANCES: dict[str, float] = {"float64": 1e-10, "float32": 1e-4}

Params = dict[str, Any]


@dataclass(frozen=True)
class DemoConfig:
    """What :func:`train` trains, and where.

    Attributes:
        devices: the devices to spread each batch over; parameters live on the first.
        steps: SGD steps.
        seed: seeds the data and the initial parameters.
        dtype: ``"float64"`` (the check's tolerance is 1e-10) or ``"float32"`` (1e-4).
        features: input features.
        hidden: hidden units.
        classes: output classes.
        batch_size: samples per step (the whole batch, before it is split over devices).
        batches: how many distinct batches the dataset holds; steps cycle through them.
        learning_rate: the SGD step size.

    Example:
        >>> DemoConfig(devices=("host:0", "host:1"), steps=3).devices
        (Device('host:0'), Device('host:1'))
    """

    devices: tuple[Device, ...]
    steps: int = 200
    seed: int = 0
    dtype: str = "float64"
    features: int = 16
    hidden: int = 64
    classes: int = 4
    batch_size: int = 512
    batches: int = 8
    learning_rate: float = 0.5

    def __post_init__(self) -> None:
        devices = tuple(as_device(d) for d in self.devices)
        if not devices:
            raise ValueError("devices must name at least one device, got an empty sequence.")
        object.__setattr__(self, "devices", devices)
        if self.dtype not in TOLERANCES:
            raise ValueError(f"dtype must be one of {sorted(TOLERANCES)}, got {self.dtype!r}.")
        for name in ("steps", "features", "hidden", "classes", "batch_size", "batches"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}.")


@dataclass
class DemoResult:
    """What :func:`train` measured.

    Attributes:
        losses: the loss before each SGD step (``losses[0]`` is the initial loss).
        max_abs_difference: largest absolute difference between the first step's data-parallel
            gradients and those of the same step on one device without data parallelism.
        tolerance: the bound the difference is checked against.
        seconds: wall time of the training loop.
        samples: samples processed by the training loop.

    Example:
        >>> r = DemoResult(losses=[2.0, 1.0], max_abs_difference=0.0, tolerance=1e-10,
        ...                seconds=0.5, samples=100)
        >>> r.passed, r.samples_per_second
        (True, 200.0)
    """

    losses: list[float] = field(default_factory=list)
    max_abs_difference: float = math.nan
    tolerance: float = 0.0
    seconds: float = 0.0
    samples: int = 0

    @property
    def passed(self) -> bool:
        """Whether the gradient check held (a NaN difference fails it)."""
        return self.max_abs_difference <= self.tolerance

    @property
    def samples_per_second(self) -> float:
        """Training throughput."""
        return self.samples / self.seconds if self.seconds > 0 else math.inf


def make_dataset(
    n_samples: int, n_features: int, /, *, seed: int, dtype: str = "float64", classes: int = 4
) -> tuple[np.ndarray, np.ndarray]:
    """A synthetic classification problem: the classes a random two-layer ``tanh`` teacher picks.

    Args:
        n_samples: rows.
        n_features: input columns.
        seed: seeds :func:`numpy.random.default_rng`; equal seeds give equal data.
        dtype: dtype of the inputs.
        classes: the number of classes.

    Returns:
        ``(x, labels)``: NumPy arrays of shapes ``(n_samples, n_features)`` (``dtype``) and
        ``(n_samples,)`` (int64 class indices in ``[0, classes)``).

    Example:
        >>> x, labels = make_dataset(5, 3, seed=0)
        >>> x.shape, labels.shape, x.dtype, labels.dtype
        ((5, 3), (5,), dtype('float64'), dtype('int64'))
    """
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n_samples, n_features))
    teacher_hidden = rng.standard_normal((n_features, 8)) / math.sqrt(n_features)
    teacher_out = rng.standard_normal((8, classes))
    labels = np.argmax(np.tanh(x @ teacher_hidden) @ teacher_out, axis=1)
    return x.astype(dtype), labels.astype(np.int64)


def init_params(
    n_features: int,
    hidden: int,
    /,
    *,
    seed: int,
    dtype: str = "float64",
    device: Any = "cpu",
    classes: int = 4,
) -> Params:
    """Parameters of a ``n_features → hidden → classes`` MLP on ``device`` (scaled normal weights).

    Example:
        >>> p = init_params(3, 4, seed=0)
        >>> {k: v.shape for k, v in p.items()}
        {'w1': (3, 4), 'b1': (4,), 'w2': (4, 4), 'b2': (4,)}
    """
    rng = np.random.default_rng(seed + 1)
    host = {
        "w1": rng.standard_normal((n_features, hidden)) / math.sqrt(n_features),
        "b1": np.zeros(hidden),
        "w2": rng.standard_normal((hidden, classes)) / math.sqrt(hidden),
        "b2": np.zeros(classes),
    }
    return {k: to_device(v.astype(dtype), device) for k, v in host.items()}


def mlp(params: Params, x: Any, /) -> Any:
    """The model: class scores (logits) ``tanh(x @ w1 + b1) @ w2 + b2``.

    Example:
        >>> import numpy as np
        >>> p = init_params(3, 4, seed=0)
        >>> mlp(p, np.ones((2, 3))).shape
        (2, 4)
    """
    hidden = ops.tanh(ops.add(ops.matmul(x, params["w1"]), params["b1"]))
    return ops.add(ops.matmul(hidden, params["w2"]), params["b2"])


def cross_entropy(logits: Any, labels: Any, /) -> Any:
    """The loss: mean softmax cross-entropy of ``logits`` against integer ``labels``.

    Example:
        >>> import numpy as np
        >>> float(cross_entropy(np.zeros((2, 4)), np.array([0, 3])))  # uniform: log(4)
        1.3862943611198906
    """
    return ops.softmax_cross_entropy(logits, labels)


def single_device_step(params: Params, x: Any, labels: Any, /) -> tuple[float, Params]:
    """Loss and gradients of one batch on the parameters' device, without data parallelism.

    ``x`` and ``labels`` must live on the parameters' device. This is the oracle the
    data-parallel step is checked against.

    Example:
        >>> p = init_params(3, 4, seed=0, device="host:0")
        >>> x, y = (to_device(a, "host:0") for a in make_dataset(6, 3, seed=0))
        >>> loss, grads = single_device_step(p, x, y)
        >>> sorted(grads) == sorted(p), grads["w1"].shape, grads["w1"].device
        (True, (3, 4), Device('host:0'))
    """
    loss, grads = value_and_grad(lambda p: cross_entropy(mlp(p, x), labels))(params)
    return float(to_device(loss, "cpu")), grads


def data_parallel_step(model: Any, params: Params, x: Any, labels: Any, /) -> tuple[float, Params]:
    """Loss and gradients of one batch with ``model``, a :class:`cupy_parallel.DataParallel`.

    ``params`` become the model's parameters. The batch is split over the model's devices, each
    replica runs :func:`mlp`, the logits are gathered on the output device, where ``labels``
    must live, and the gradients flow back to ``params`` on the first device.

    Example:
        >>> import cupy_parallel
        >>> cupy_parallel.set_host_device_count(2)
        >>> p = init_params(3, 4, seed=0, device="host:0")
        >>> model = DataParallel(mlp, p, device_ids=["host:0", "host:1"])
        >>> x, y = (to_device(a, "host:0") for a in make_dataset(6, 3, seed=0))
        >>> loss, grads = data_parallel_step(model, p, x, y)
        >>> grads["w1"].device
        Device('host:0')
    """

    def objective(params: Params) -> Any:
        model.params = params  # the replicas are broadcast from these very (watched) arrays
        return cross_entropy(model(x), labels)

    loss, grads = value_and_grad(objective)(params)
    return float(to_device(loss, "cpu")), grads


def max_abs_difference(a: Any, b: Any, /) -> float:
    """Largest absolute difference between the leaves of two equal-shaped pytrees of arrays.

    Leaves may live on any devices; they are compared on the host.

    Example:
        >>> import numpy as np
        >>> max_abs_difference({"a": np.zeros(2)}, {"a": np.array([0.0, -0.5])})
        0.5
    """
    leaves_a, spec_a = optree.tree_flatten(a, namespace=NAMESPACE)
    leaves_b, spec_b = optree.tree_flatten(b, namespace=NAMESPACE)
    if spec_a != spec_b:
        raise ValueError(f"The two trees differ in structure: {spec_a} and {spec_b}.")
    worst = 0.0
    for u, v in zip(leaves_a, leaves_b, strict=True):
        diff = np.abs(np.asarray(to_device(u, "cpu")) - np.asarray(to_device(v, "cpu")))
        worst = max(worst, float(diff.max(initial=0.0)))
        if math.isnan(float(diff.sum())):
            return math.nan
    return worst


def train(
    config: DemoConfig, /, *, progress: Callable[[Sequence[float]], None] | None = None
) -> DemoResult:
    """Train the MLP with SGD over ``config.devices`` and check the first step against one device.

    Args:
        config: model size, devices, steps and seed.
        progress: called after every step with the losses so far (the CLI drives its progress
            bar with it).

    Returns:
        The losses, the gradient check's largest difference and tolerance, and the timing.

    Example:
        >>> import cupy_parallel
        >>> cupy_parallel.set_host_device_count(2)
        >>> result = train(DemoConfig(devices=("host:0", "host:1"), steps=3, batch_size=8))
        >>> result.passed, len(result.losses)
        (True, 3)
    """
    first = config.devices[0]
    x_all, y_all = (
        to_device(a, first)
        for a in make_dataset(
            config.batch_size * config.batches,
            config.features,
            seed=config.seed,
            dtype=config.dtype,
            classes=config.classes,
        )
    )
    params = init_params(
        config.features,
        config.hidden,
        seed=config.seed,
        dtype=config.dtype,
        device=first,
        classes=config.classes,
    )
    model = DataParallel(mlp, params, device_ids=list(config.devices))
    result = DemoResult(tolerance=TOLERANCES[config.dtype])

    def batch(step: int) -> tuple[Any, Any]:
        begin = (step % config.batches) * config.batch_size
        rows = slice(begin, begin + config.batch_size)
        return x_all[rows], y_all[rows]

    _, reference = single_device_step(params, *batch(0))
    start = time.perf_counter()
    for step in range(config.steps):
        loss, grads = data_parallel_step(model, params, *batch(step))
        if step == 0:
            result.max_abs_difference = max_abs_difference(grads, reference)
        params = {name: params[name] - config.learning_rate * grads[name] for name in params}
        result.losses.append(loss)
        if progress is not None:
            progress(result.losses)
    result.seconds = time.perf_counter() - start
    result.samples = config.steps * config.batch_size
    return result


def plot_losses(losses: Sequence[float], path: Path, /, *, title: str) -> Path:
    r"""Write the loss curve to ``path`` as a PNG (matplotlib, Agg backend) and return the path.

    Example:
        >>> import pathlib, tempfile
        >>> out = pathlib.Path(tempfile.mkdtemp()) / "loss.png"
        >>> plot_losses([1.0, 0.5, 0.25], out, title="demo").read_bytes()[:4]
        b'\x89PNG'
    """
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6.4, 4.0), dpi=100)
    axes = figure.add_subplot()
    axes.plot(np.arange(len(losses)), np.asarray(losses, dtype=float))
    axes.set_yscale("log")
    axes.set_xlabel("SGD step")
    axes.set_ylabel("cross-entropy")
    axes.set_title(title)
    axes.grid(visible=True, which="both", alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, format="png")
    return path
