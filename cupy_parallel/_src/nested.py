"""Scatter and gather of nested structures (pytrees) of arrays over devices.

The counterpart of ``torch.nn.parallel.scatter_gather``. A structure is flattened with optree
(namespace ``"cupy_parallel"``), its array leaves are split or joined one by one, and the
structure is rebuilt. Every container optree knows round-trips with its metadata: tuple, list,
dict, namedtuple, ``OrderedDict`` (order kept), ``defaultdict`` (``default_factory`` kept),
``deque`` (``maxlen`` kept) and any class registered with
``optree.register_pytree_node(..., namespace="cupy_parallel")``.

Structures are flattened by :func:`cupy_parallel._src.tree.flatten`, the library's one
flattener: subclasses of tuple, list, dict, ``OrderedDict``, ``defaultdict`` and ``deque`` that
are not registered with optree are split like their base, as torch's ``isinstance`` tests treat
them, and come back as the subclass when it can be rebuilt (the rule is in that module).

Arrays move through the differentiable :class:`~cupy_parallel.functions.Scatter` and
:class:`~cupy_parallel.functions.Gather`, so both directions are recorded on an active
:class:`~cupy_parallel.Tape`.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from cupy_parallel._src.arguments import read_axis, read_int, read_mapping, read_sequence
from cupy_parallel._src.arrays import device_of, is_array
from cupy_parallel._src.comm import chunk_count, even_chunks
from cupy_parallel._src.devices import Device, read_device, read_devices
from cupy_parallel._src.moves import UncheckedGather, UncheckedScatter
from cupy_parallel._src.tree import flatten, key_path, leaves_equal, structure_difference

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from cupy_parallel._src.arraytypes import Tree
    from cupy_parallel._src.devices import DeviceLike

__all__ = [
    "gather",
    "gather_unchecked",
    "scatter",
    "scatter_kwargs",
    "scatter_kwargs_unchecked",
    "scatter_unchecked",
]

# --------------------------------------------------------------------------------------------
# Leaves: the one place arrays are split and joined


def _scatter_leaf(
    array: Any, devices: tuple[Device, ...], chunk_sizes: tuple[int, ...], dim: int
) -> tuple[Any, ...]:
    return tuple(UncheckedScatter.apply(devices, chunk_sizes, dim, array))


def _gather_leaves(arrays: Sequence[Any], target: Device, dim: int) -> Any:
    return UncheckedGather.apply(target, dim, *arrays)


def _foreign_array_type(leaf: object) -> str | None:
    """The qualified type name of ``leaf`` if it is another library's array, else ``None``.

    Another library's array is anything with ``__dlpack__``, ``__array__``,
    ``__array_interface__`` or ``__cuda_array_interface__`` that :func:`is_array` does not
    accept (torch tensors, JAX arrays, ...); NumPy scalars are values, not arrays.
    """
    if is_array(leaf) or isinstance(leaf, np.generic):
        return None
    cls = type(leaf)
    if any(hasattr(cls, name) for name in _ARRAY_PROTOCOLS):
        return f"{cls.__module__}.{cls.__qualname__}"
    return None


_ARRAY_PROTOCOLS = ("__dlpack__", "__array__", "__array_interface__", "__cuda_array_interface__")
_VALUE_TYPES = (type(None), bool, int, float, complex, str, bytes, np.generic)


# --------------------------------------------------------------------------------------------
# Public functions


def scatter(inputs: Tree, /, target_devices: Sequence[DeviceLike], dim: int = 0) -> list[Tree]:
    """Split every array in a nested structure along ``dim`` and spread the pieces over devices.

    Returns one structure per replica: replica ``i`` holds chunk ``i`` of every array, placed on
    ``target_devices[i]``. ``None`` passes through, and other leaves (numbers, strings, objects)
    are shared by reference between the replicas; containers are rebuilt for each replica.
    Subclasses of tuple, list, dict, ``OrderedDict``, ``defaultdict`` and ``deque`` are split like
    their base and come back as the subclass when ``cls(contents)`` rebuilds exactly those
    contents, else as the base (see the module notes). Any other object of a class not
    registered with optree is a leaf, shared whole even if it holds arrays; arrays of other
    libraries (torch, JAX) are refused. A chunk that stays on its array's device may be a view
    of it, as in torch.

    The number of replicas is the fewest chunks any array produces. An array of size ``s`` along
    ``dim`` gives ``min(len(target_devices), s)`` chunks (one if ``s == 0``), so a batch smaller
    than the device count leaves devices unused, as in torch. A structure without arrays gives
    ``len(target_devices)`` replicas. Where torch would then drop the trailing chunks of longer
    arrays, here every array is split into exactly that many nearly equal chunks (sizes differ
    by at most one, larger first), so no data is lost and ``gather(scatter(x), d)`` equals
    ``x`` for every structure.

    Arrays go through :class:`~cupy_parallel.functions.Scatter`, so the split is recorded on an
    active :class:`~cupy_parallel.Tape` and gradients flow back to the inputs.

    Args:
        inputs: A structure of arrays (NumPy, HostArray or CuPy, on any device) and other leaves.
        target_devices: The devices to scatter to, e.g. ``cupy_parallel.devices()``.
        dim: The dimension to split every array along; negative counts from the end. Every
            array leaf needs that dimension (a 0-d array cannot be split).

    Returns:
        A list of structures like ``inputs``, one per replica.

    Raises:
        TypeError: ``target_devices`` is not a sequence of devices, ``dim`` is not an int, or a
            leaf is an array of another library (a torch tensor, a JAX array, anything with
            ``__dlpack__`` or ``__array__`` that is not a NumPy, HostArray or CuPy array):
            scatter cannot place it, and sharing it whole would give every replica all of it.
        ValueError: ``target_devices`` is empty or names a missing device, or an array leaf has
            no dimension ``dim`` (the message names its key path).

    Example:
        >>> import numpy as np
        >>> x = {"a": np.arange(5), "b": [np.ones((5, 2)), None], "tag": "batch"}
        >>> parts = scatter(x, ["host:0", "host:1"])
        >>> len(parts), parts[0]["a"], parts[1]["a"].device
        (2, HostArray([0, 1, 2], device='host:0'), Device('host:1'))
        >>> parts[1]["b"][1] is None, parts[1]["tag"]
        (True, 'batch')
    """
    devices = read_devices(target_devices, "target_devices", accelerators_only=True)
    return scatter_unchecked(inputs, devices, read_int(dim, "dim"))


def scatter_unchecked(inputs: Tree, devices: tuple[Device, ...], dim: int) -> list[Tree]:
    """:func:`scatter` with ``devices`` (existing accelerators) and the int ``dim`` already read.

    The leaves are checked here (arrays of other libraries, 0-d arrays, ``dim`` out of range).
    """
    plan = _Plan(inputs, devices, dim, "inputs")
    # optree types an unflattened tree as PyTree[Any]; each has the structure (type) of inputs
    return plan.split(len(devices) if plan.shortest is None else plan.shortest[0])


class _Plan:
    """One structure read for scatter, ready to split into any number of replicas.

    It holds the leaves, the split dim of each array leaf, and the array that gives the fewest
    chunks (``shortest``: its chunk count, key path and size along its dim; ``None`` when the
    structure holds no array).
    """

    def __init__(self, inputs: Any, devices: tuple[Device, ...], dim: int, root: str) -> None:
        accessors, self.leaves, self.spec = flatten(inputs)
        self.devices = devices
        self.dims: dict[int, int] = {}
        self.shortest: tuple[int, str, int] | None = None
        for k, (accessor, leaf) in enumerate(zip(accessors, self.leaves, strict=True)):
            if not is_array(leaf):
                foreign = _foreign_array_type(leaf)
                if foreign is not None:
                    raise TypeError(
                        f"{key_path(accessor, root)} is a {foreign}, an array of another "
                        "library, which scatter cannot split or place (it would be shared whole "
                        "by every replica); convert it first with "
                        "cupy_parallel.to_device(x, device)."
                    )
                continue
            where = key_path(accessor, root)
            if leaf.ndim == 0:
                raise ValueError(
                    f"{where} is a 0-d array, which cannot be split along dim={dim}; "
                    "give it a dimension (x.reshape(1)) or pass it as a Python scalar to share "
                    "it."
                )
            axis = self.dims[k] = read_axis(dim, leaf.ndim, "dim", of=f"array {where}")
            count = chunk_count(leaf.shape[axis], len(devices))
            if self.shortest is None or count < self.shortest[0]:
                self.shortest = (count, where, leaf.shape[axis])

    def split(self, replicas: int) -> list[Any]:
        """The structure split into ``replicas`` (at most the chunk count of every array)."""
        columns: list[Any] = []
        for k, leaf in enumerate(self.leaves):
            if k in self.dims:
                sizes = even_chunks(leaf.shape[self.dims[k]], replicas)
                columns.append(_scatter_leaf(leaf, self.devices[:replicas], sizes, self.dims[k]))
            else:
                columns.append((leaf,) * replicas)
        return [self.spec.unflatten([column[r] for column in columns]) for r in range(replicas)]


def scatter_kwargs(
    inputs: Sequence[Any] | None,
    kwargs: Mapping[str, Any] | None,
    /,
    target_devices: Sequence[DeviceLike],
    dim: int = 0,
) -> tuple[tuple[tuple[Any, ...], ...], tuple[dict[str, Any], ...]]:
    """:func:`scatter` positional arguments and keyword arguments together, one pair per replica.

    Each side is scattered as :func:`scatter` does, and every replica gets both sides: a side
    without arrays (or an empty side, as ``()`` / ``{}``) is given to as many replicas as the
    other side makes. When both sides hold arrays that split into different replica counts (a
    batch of 4 positional rows and a keyword array of 1 row on 4 devices), some replica would
    run without an argument the others get, so this raises ``ValueError`` naming the two arrays
    and their sizes; torch pads the shorter side with empty arguments and runs the extra
    replicas without them. As in torch, when both sides are empty the result is ``((), ())``.

    Args:
        inputs: The positional arguments, a tuple or list (or ``None`` for none).
        kwargs: The keyword arguments, a mapping (or ``None`` for none).
        target_devices: The devices to scatter to.
        dim: The dimension to split every array along.

    Returns:
        ``(inputs_per_replica, kwargs_per_replica)``: a tuple of argument tuples and a tuple of
        keyword dictionaries, of the same length.

    Raises:
        TypeError: ``inputs`` is not a tuple or list, or ``kwargs`` is not a mapping; and the
            errors of :func:`scatter`.
        ValueError: The two sides split into different replica counts (see above); and the
            errors of :func:`scatter`.

    Example:
        >>> import numpy as np
        >>> args, kwargs = scatter_kwargs(
        ...     (np.arange(4),), {"scale": 2.0}, ["host:0", "host:1"]
        ... )
        >>> args[1], kwargs[1]
        ((HostArray([2, 3], device='host:1'),), {'scale': 2.0})
    """
    if inputs is None:
        inputs = ()
    positional = read_sequence(
        inputs,
        "inputs",
        expected="a tuple or list of positional arguments",
        hint="wrap a single argument as (x,)",
    )
    if not isinstance(inputs, tuple | list):  # a namedtuple keeps its field names in key paths
        inputs = positional
    kwargs = read_mapping({} if kwargs is None else kwargs, "kwargs")
    devices = read_devices(target_devices, "target_devices", accelerators_only=True)
    return scatter_kwargs_unchecked(inputs, kwargs, devices, read_int(dim, "dim"))


def scatter_kwargs_unchecked(
    inputs: Sequence[Any],
    kwargs: Mapping[str, Any],
    devices: tuple[Device, ...],
    dim: int,
    *,
    names: tuple[str, str] = ("inputs", "kwargs"),
) -> tuple[tuple[tuple[Any, ...], ...], tuple[dict[str, Any], ...]]:
    """:func:`scatter_kwargs` of arguments already read: a tuple or list, a mapping, devices.

    ``names`` are the two sides' names in the caller's words, for the error messages.
    """
    plans = [
        None if not side else _Plan(side, devices, dim, name)
        for side, name in zip((inputs, kwargs), names, strict=True)
    ]
    if plans[0] is None and plans[1] is None:
        return (), ()
    shortest = [plan.shortest for plan in plans if plan is not None and plan.shortest]
    if len(shortest) == 2 and shortest[0][0] != shortest[1][0]:
        _refuse_unequal_sides(shortest[0], shortest[1], len(devices), dim)
    count = shortest[0][0] if shortest else len(devices)  # a side without arrays is shared
    first, second = plans
    scattered_inputs: list[tuple[Any, ...]] = (
        [tuple(r) for r in first.split(count)] if first else [() for _ in range(count)]
    )
    scattered_kwargs: list[dict[str, Any]] = (
        [dict(r) for r in second.split(count)] if second else [{} for _ in range(count)]
    )
    return tuple(scattered_inputs), tuple(scattered_kwargs)


def _refuse_unequal_sides(
    first: tuple[int, str, int], second: tuple[int, str, int], devices: int, dim: int
) -> None:
    """The positional and keyword sides split into different replica counts: refuse.

    torch pads the shorter side with empty arguments, so the extra replicas run without the
    arguments that the others get; splitting both sides into the smaller count would instead
    give one replica a whole batch the caller meant to spread. Neither is what was asked for.
    """
    (few, short, short_size), (many, long, long_size) = sorted((first, second))
    missing = f"replica {few}" if many - few == 1 else f"replicas {few}-{many - 1}"
    raise ValueError(
        f"{short} has batch size {short_size} along dim {dim}, so it splits into {few} "
        f"replica{'s' if few > 1 else ''}, but {long} has batch size {long_size} and splits into "
        f"{many} on the {devices} devices: {missing} would run without {short}. Give the "
        f"scattered arrays of the positional and keyword arguments one size along dim {dim}, "
        "or pass an array every replica needs whole another way (a Python value, a closure or "
        "the parameters)."
    )


def gather(outputs: Sequence[Tree], /, target_device: DeviceLike, dim: int = 0) -> Tree:
    """Join per-replica structures into one: arrays are concatenated along ``dim`` on a device.

    ``outputs`` holds one structure per replica, all of the same structure. Array leaves are
    concatenated in replica order and land on ``target_device`` (``"cpu"`` or ``-1`` gives
    NumPy arrays). ``None`` passes through. A non-array leaf must be equal in every replica and
    is returned once (replica 0's object), so ``gather(scatter(x, devices), d)`` equals ``x``
    for every structure; leaves that differ raise, as do structures that differ.

    When every replica returns a 0-d array at some key path and ``dim`` is 0, they are stacked
    into a vector of length ``len(outputs)`` and a ``UserWarning`` is issued once per call, as
    torch does for scalars (e.g. per-replica losses).

    Arrays go through :class:`~cupy_parallel.functions.Gather`, so the join is recorded on an
    active :class:`~cupy_parallel.Tape` and gradients flow back to every replica.

    Args:
        outputs: A list or tuple with one structure per replica.
        target_device: Where the gathered arrays go, e.g. ``"host:0"``, ``"cuda:0"`` or ``"cpu"``.
        dim: The dimension to concatenate along; negative counts from the end.

    Returns:
        One structure like each of ``outputs``.

    Raises:
        TypeError: ``outputs`` is not a list or tuple, ``dim`` is not an int, or a leaf is an
            array of another library (see :func:`scatter`).
        ValueError: ``outputs`` is empty, ``target_device`` is unusable, or the replicas differ
            in structure, in a non-array leaf, in an array's ndim, dtype or shape off ``dim``, or
            an array has no dimension ``dim``. The message names the key path.

    Example:
        >>> import numpy as np
        >>> parts = scatter({"y": np.arange(6.0), "n": 3}, ["host:0", "host:1"])
        >>> gather(parts, "cpu")
        {'y': array([0., 1., 2., 3., 4., 5.]), 'n': 3}
    """
    outputs = read_sequence(
        outputs,
        "outputs",
        expected="a list or tuple with one structure per replica",
        hint="wrap a single replica's output as [output]",
    )
    if len(outputs) == 0:
        raise ValueError("outputs is empty; gather needs at least one replica's output.")
    target = read_device(target_device, "target_device")
    return gather_unchecked(outputs, target, read_int(dim, "dim"), stacklevel=3)


def gather_unchecked(
    outputs: Sequence[Tree], target: Device, dim: int, *, stacklevel: int = 2
) -> Tree:
    """:func:`gather` of arguments already read: one or more outputs, a device, an int ``dim``.

    The replicas' structures and leaves are checked here. ``stacklevel`` is the 0-d warning's,
    counted from this function (2: its caller).
    """
    accessors, first, spec = flatten(outputs[0])
    columns: list[list[Any]] = [[leaf] for leaf in first]
    for r, replica in enumerate(outputs[1:], start=1):
        _, leaves, replica_spec = flatten(replica)
        difference = structure_difference(spec, replica_spec)
        if difference is not None:
            where, expected, actual = difference
            raise ValueError(
                f"outputs[{r}] differs in structure from outputs[0] at key path "
                f"{where}: outputs[0] has {expected} but "
                f"outputs[{r}] has {actual}. Every replica must return the same structure."
            )
        for column, leaf in zip(columns, leaves, strict=True):
            column.append(leaf)

    plans: list[int | None] = []
    scalars: list[str] = []
    for accessor, column in zip(accessors, columns, strict=True):
        path = accessor.codify("")
        plan = _check_column(column, dim, path)
        plans.append(plan)
        if plan is not None and column[0].ndim == 0:
            scalars.append(key_path(accessor))
    if scalars:
        warnings.warn(
            f"gather along dim 0 got 0-d arrays at key path {', '.join(scalars)}; they are "
            f"stacked into vectors of length {len(outputs)} (one element per replica). Return "
            "arrays with a leading dimension to gather without this warning.",
            UserWarning,
            stacklevel=stacklevel,
        )
    gathered = [
        column[0] if plan is None else _gather_leaves(column, target, plan)
        for plan, column in zip(plans, columns, strict=True)
    ]
    return cast("Tree", spec.unflatten(gathered))  # the structure of every replica


def _check_column(column: list[Any], dim: int, path: str) -> int | None:
    """Check one leaf position across replicas; the dim to gather it along, or None to share it.

    ``path`` is the leaf's key path in a replica, so ``outputs[r]{path}`` names the leaf.
    """
    for r, leaf in enumerate(column):
        foreign = _foreign_array_type(leaf)
        if foreign is not None:
            raise TypeError(
                f"outputs[{r}]{path} is a {foreign}, an array of another library, which gather "
                "cannot join; return arrays of this library from every replica (convert with "
                "cupy_parallel.to_device(x, device))."
            )
    arrays = [is_array(leaf) for leaf in column]
    if not any(arrays):
        for r, leaf in enumerate(column[1:], start=1):
            if not leaves_equal(column[0], leaf):
                raise ValueError(
                    f"outputs[{r}]{path} is {leaf!r} but outputs[0]{path} is {column[0]!r}. "
                    "Only arrays are gathered; other leaves must be equal in every replica."
                    + _unregistered_hint(leaf)
                )
        return None
    if not all(arrays):
        r = arrays.index(not arrays[0])
        raise ValueError(
            f"outputs[{r}]{path} is a {type(column[r]).__name__} but outputs[0]{path} is a "
            f"{type(column[0]).__name__}; every replica must return arrays at the same places."
        )
    for r, array in enumerate(column):
        if device_of(array).kind == "cpu":
            raise ValueError(
                f"outputs[{r}]{path} is a plain numpy.ndarray on 'cpu', but gather collects "
                "arrays from accelerator devices ('host:k' or 'cuda:k'); move it with "
                "cupy_parallel.to_device(array, device) or return it from a replica's device."
            )
    first = column[0]
    for r, array in enumerate(column[1:], start=1):
        if array.ndim != first.ndim or array.dtype != first.dtype:
            raise ValueError(
                f"outputs[{r}]{path} is a {array.ndim}-d {array.dtype} array but "
                f"outputs[0]{path} is a {first.ndim}-d {first.dtype} array; arrays gathered "
                "together need one ndim and dtype."
            )
    if first.ndim == 0:
        if dim != 0:
            raise ValueError(
                f"outputs[0]{path} and the other replicas' are 0-d arrays, which gather can only "
                f"stack along dim=0, not dim={dim}; give them a dimension (x.reshape(1))."
            )
        return 0
    axis = read_axis(dim, first.ndim, "dim", of=f"array outputs[0]{path}")
    for r, array in enumerate(column[1:], start=1):
        if _shape_off(array.shape, axis) != _shape_off(first.shape, axis):
            raise ValueError(
                f"outputs[{r}]{path} has shape {array.shape} but outputs[0]{path} has "
                f"{first.shape}; gather along dim {axis} needs them equal in every other dim."
            )
    return axis


def _unregistered_hint(leaf: object) -> str:
    """For an object that may be a container optree does not know: how to register it."""
    if isinstance(leaf, _VALUE_TYPES):
        return ""
    name = type(leaf).__qualname__
    return (
        f" {name} is not a container type registered with optree, so gather treats each "
        f"{name} as one value; if it holds arrays to gather, register it with "
        f"optree.register_pytree_node({name}, flatten, unflatten, namespace='cupy_parallel')."
    )


def _shape_off(shape: tuple[int, ...], axis: int) -> tuple[int, ...]:
    return shape[:axis] + shape[axis + 1 :]
