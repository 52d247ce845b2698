"""Data parallelism: run one function on several devices, one slice of the batch each.

A *module* here is a pure function ``fn(params, *inputs, **kwargs)`` together with its parameter
pytree, the functional counterpart of a ``torch.nn.Module``. The four pieces follow
``torch.nn.parallel``:

- :func:`replicate` copies the parameters onto every device through the differentiable
  :class:`~cupy_parallel._src.moves.Broadcast`, so gradients of the replicas sum back into
  the originals;
- :func:`parallel_apply` calls several functions at once, one thread per replica, each inside its
  device's context and carrying the caller's active :class:`~cupy_parallel._src.tape.Tape`;
- :func:`data_parallel` scatters the inputs, replicates the parameters, applies the replicas and
  gathers the outputs; the gradient of a data-parallel step equals the one-device gradient;
- :class:`DataParallel` keeps a function, its parameters and the placement options together.

Arguments are read once, at the public entry. :func:`data_parallel` reads its own and then calls
the unchecked cores of the other steps (``_replicate``, ``_parallel_apply``,
:func:`~cupy_parallel._src.nested.scatter_kwargs_unchecked`,
:func:`~cupy_parallel._src.nested.gather_unchecked`), which read nothing again.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any, Concatenate, Generic

from cupy_parallel._src import comm
from cupy_parallel._src.arguments import (
    read_bool,
    read_callable,
    read_int,
    read_mapping,
    read_sequence,
)
from cupy_parallel._src.arrays import device_of, is_array
from cupy_parallel._src.arraytypes import Output, Params, Tree
from cupy_parallel._src.cuda.streams import StreamHandoff
from cupy_parallel._src.devices import Device, cupy_module, devices, read_device, read_devices
from cupy_parallel._src.moves import Broadcast, UncheckedBroadcast
from cupy_parallel._src.nested import gather_unchecked, scatter_kwargs_unchecked
from cupy_parallel._src.tree import flatten, key_path, leaves

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

    from optree import PyTreeSpec

    from cupy_parallel._src.devices import DeviceLike

__all__ = ["DataParallel", "data_parallel", "parallel_apply", "replicate"]

# --------------------------------------------------------------------------------------------
# Placement checks shared by replicate and data_parallel


def _params_on(params: Any, device: Device, where: str) -> tuple[list[Any], PyTreeSpec]:
    """The leaves and structure of ``params``, whose array leaves must all be on ``device``.

    Raises ``ValueError`` naming the key path of the first array leaf not on ``device``.
    """
    accessors, params_leaves, spec = flatten(params)
    for accessor, leaf in zip(accessors, params_leaves, strict=True):
        if is_array(leaf) and device_of(leaf) != device:
            raise ValueError(
                f"{where}: every parameter must live on {device}, but "
                f"{key_path(accessor, 'params')} is on {device_of(leaf)}. Move the parameters "
                f"first, e.g. optree.tree_map(lambda a: cupy_parallel.to_device(a, '{device}'), "
                "params, namespace='cupy_parallel')."
            )
    return params_leaves, spec


# --------------------------------------------------------------------------------------------
# replicate


def replicate(params: Tree, /, devices: Sequence[DeviceLike], detach: bool = False) -> list[Tree]:
    """Copy a parameter pytree onto each of ``devices``: one pytree per device.

    All array leaves are broadcast together, coalesced into a few buffers per dtype, through
    :class:`~cupy_parallel._src.moves.Broadcast`: on an active tape the replicas are recorded
    outputs, and the gradient of a source array is the sum of its replicas' gradients (the
    adjoint of a broadcast is a reduce-add). With ``detach=True`` the copy goes through
    :func:`~cupy_parallel._src.comm.broadcast_coalesced` and nothing is recorded. Leaves that
    are not arrays (ints, strings, ``None``) are shared by every replica, as torch shares a
    module's plain attributes.

    As in torch, every array must already live on ``devices[0]``, and the replica for
    ``devices[0]`` holds the broadcast's outputs for that device (the original arrays when
    ``detach=True``). An empty ``devices`` gives ``[]``.

    Args:
        params: A pytree (optree namespace ``"cupy_parallel"``) whose array leaves all live on
            ``devices[0]``.
        devices: The devices to copy to, in replica order.
        detach: Copy without recording on the tape.

    Returns:
        A list with one pytree per device, shaped like ``params``; every array of entry ``k``
        lives on ``devices[k]``.

    Raises:
        TypeError: ``devices`` is not a sequence of device specs.
        ValueError: A device does not exist, or an array leaf of ``params`` is not on
            ``devices[0]`` (the message names its key path).

    Example:
        >>> import numpy as np
        >>> import cupy_parallel
        >>> params = {"w": cupy_parallel.to_device(np.ones((2, 2)), "host:0"), "act": "tanh"}
        >>> copies = cupy_parallel.replicate(params, ["host:0", "host:1"])
        >>> [str(p["w"].device) for p in copies], copies[1]["act"]
        (['host:0', 'host:1'], 'tanh')
    """
    targets = read_devices(devices, "devices", accelerators_only=False, allow_empty=True)
    detach = read_bool(detach, "detach")
    if not targets:
        return []
    params_leaves, spec = _params_on(params, targets[0], "replicate")
    return _replicate(params_leaves, spec, targets, detach=detach, checked=True)


def _replicate(
    params_leaves: list[Any],
    spec: PyTreeSpec,
    targets: tuple[Device, ...],
    *,
    detach: bool,
    checked: bool,
) -> list[Tree]:
    """:func:`replicate` of flattened parameters on ``targets[0]`` and existing ``targets``.

    ``checked=False`` (data_parallel, whose devices are read and accelerators) broadcasts with
    :class:`UncheckedBroadcast`, which checks nothing again.
    """
    slots = [i for i, leaf in enumerate(params_leaves) if is_array(leaf)]
    arrays = [params_leaves[i] for i in slots]
    copies: Sequence[Sequence[Any]]
    if not arrays:
        copies = [() for _ in targets]
    elif detach:
        copies = comm.broadcast_coalesced(arrays, targets)
    else:
        flat = (Broadcast if checked else UncheckedBroadcast).apply(targets, *arrays)
        width = len(arrays)
        copies = [flat[k * width : (k + 1) * width] for k in range(len(targets))]
    replicas = []
    for copy in copies:
        replica_leaves = list(params_leaves)
        for slot, array in zip(slots, copy, strict=True):
            replica_leaves[slot] = array
        replicas.append(spec.unflatten(replica_leaves))
    return replicas  # type: ignore[return-value]  # optree: PyTree[Any]; params' structure


# --------------------------------------------------------------------------------------------
# parallel_apply


def _reraise(index: int, device: Device | None, error: BaseException) -> None:
    """Re-raise ``error`` in the caller, saying which replica on which device raised it.

    As torch's ``ExceptionWrapper.reraise``, the new exception keeps the original type when the
    type can be built from one message (else it is a ``RuntimeError``); the original is chained as
    ``__cause__``, so its traceback in the worker thread is shown too. ``KeyboardInterrupt`` and
    other non-``Exception`` errors are re-raised unchanged.
    """
    if not isinstance(error, Exception):
        raise error
    where = f"replica {index} on device {device}" if device is not None else f"replica {index}"
    message = f"Caught {type(error).__name__} in {where}: {error}"
    try:
        wrapped: Exception = type(error)(message)
    except Exception:  # noqa: BLE001 - any constructor that does not take one message
        wrapped = RuntimeError(message)
    raise wrapped from error


def _first_array_device(tree: Any) -> Device | None:
    for leaf in leaves(tree):
        if is_array(leaf):
            return device_of(leaf)
    return None


def _cuda_stream(device: Device | None) -> StreamHandoff | None:
    """The caller's current CuPy stream on a CUDA ``device``, handed to the worker thread."""
    if device is None or device.kind != "cuda" or cupy_module() is None:
        return None
    return StreamHandoff(device.index)


def _run_replica(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    device: Device | None,
    stream: StreamHandoff | None,
) -> Any:
    if device is None:
        return fn(*args, **kwargs)
    with device:
        if stream is None:
            return fn(*args, **kwargs)
        with stream:
            return fn(*args, **kwargs)


def _run_all(calls: Sequence[Callable[[], Any]]) -> list[Future[Any]]:
    """Run every call; once all have ended, one future per call with its result or exception.

    A single call runs in this thread (as in torch); several run at once, each in a worker thread
    of its own and in a copy of this thread's ``contextvars`` context, so an active tape
    records what the workers do. A future holds any exception, ``KeyboardInterrupt`` too, for
    the caller to re-raise.
    """
    if len(calls) == 1:
        future: Future[Any] = Future()
        try:
            future.set_result(calls[0]())
        except BaseException as error:  # noqa: BLE001 - re-raised by the caller, as from a worker
            future.set_exception(error)
        return [future]
    if not calls:
        return []
    # No call starts before all are submitted, so no worker is idle when one is submitted and
    # each call gets a thread of its own (thread-local state, CUDA per-thread default streams).
    start = threading.Event()

    def gated(call: Callable[[], Any]) -> Any:
        start.wait()
        return call()

    pool = ThreadPoolExecutor(max_workers=len(calls), thread_name_prefix="cupy_parallel-replica")
    futures = [pool.submit(contextvars.copy_context().run, gated, call) for call in calls]
    start.set()
    try:
        wait(futures)
    except BaseException:
        pool.shutdown(wait=False)  # interrupted (Ctrl-C): the workers end their calls unwaited
        raise
    pool.shutdown()  # every call has ended: join the idle workers
    return futures


def parallel_apply(
    fns: Sequence[Callable[..., Output]],
    inputs: Sequence[Any],
    /,
    kwargs_tup: Sequence[Mapping[str, Any]] | None = None,
    devices: Sequence[DeviceLike | None] | None = None,
) -> list[Output]:
    """Call ``fns[i](*inputs[i], **kwargs_tup[i])`` for every ``i`` at once, one thread each.

    Each call runs in a thread of its own (a single call runs in the caller's thread, as in torch)
    inside its device's context: on CUDA the device is made current and the caller's current
    CuPy stream on that device is used, so the work is ordered as if the caller had launched it.
    Under per-thread default streams (``CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=1``) the caller's
    stream cannot be named in another thread, so each worker's own stream first waits for the
    caller's and the caller's waits for the worker's when ``parallel_apply`` returns.
    Each thread runs in a copy of the caller's ``contextvars`` context, so operations in the
    workers are recorded on the caller's active tape and can be differentiated afterwards.

    ``inputs[i]`` that is not a tuple or list is passed as the single positional argument. When
    ``devices`` is ``None`` (or an entry is ``None``) the device of replica ``i`` is that of the
    first array in ``inputs[i]``/``kwargs_tup[i]``; with no array there the call runs in no
    device context.

    An exception in a worker is re-raised in the caller once all threads have finished, for the
    lowest failing replica. As torch does, it keeps the original type when that type can be built
    from a single message (else ``RuntimeError``); the message starts with
    ``"Caught <Type> in replica <i> on device <device>: "`` and the original exception is chained
    as ``__cause__``.

    Args:
        fns: The callables, one per replica.
        inputs: Positional arguments per replica: a tuple/list of arguments, or one argument.
        kwargs_tup: Keyword arguments per replica, or ``None`` for none.
        devices: The device of each replica, or ``None`` to infer them from the inputs.

    Returns:
        The results, in replica order.

    Raises:
        TypeError: An entry of ``fns`` is not callable, or an entry of ``kwargs_tup`` is not a
            mapping.
        ValueError: ``inputs``, ``kwargs_tup`` or ``devices`` has a different length than
            ``fns``.

    Example:
        >>> import numpy as np
        >>> import cupy_parallel
        >>> xs = [cupy_parallel.to_device(np.arange(3.0), f"host:{k}") for k in range(2)]
        >>> cupy_parallel.parallel_apply([np.sum, np.max], xs, devices=["host:0", "host:1"])
        [HostArray(3., device='host:0'), HostArray(2., device='host:1')]
    """
    fns = _per_replica(fns, "fns")
    inputs = _per_replica(inputs, "inputs")
    for i, fn in enumerate(fns):
        read_callable(fn, f"fns[{i}]")
    count = len(fns)
    if len(inputs) != count:
        raise ValueError(
            f"parallel_apply needs one entry of inputs per function: got {count} fns and "
            f"{len(inputs)} inputs."
        )
    if kwargs_tup is None:
        kwargs_tup = [{}] * count
    kwargs_tup = _per_replica(kwargs_tup, "kwargs_tup")
    if len(kwargs_tup) != count:
        raise ValueError(
            f"kwargs_tup must have one mapping per function: got {count} fns and "
            f"{len(kwargs_tup)} kwargs (pass None for no keyword arguments)."
        )
    for i, kwargs in enumerate(kwargs_tup):
        read_mapping(kwargs, f"kwargs_tup[{i}]")
    if devices is None:
        devices = [None] * count
    devices = _per_replica(devices, "devices")
    if len(devices) != count:
        raise ValueError(
            f"devices must have one entry per function: got {count} fns and "
            f"{len(devices)} devices (pass None to use each replica's input device)."
        )
    places = [
        read_device(spec, f"devices[{i}]")
        if spec is not None
        else _first_array_device((args, kwargs))
        for i, (spec, args, kwargs) in enumerate(zip(devices, inputs, kwargs_tup, strict=True))
    ]
    positional = [tuple(args) if isinstance(args, tuple | list) else (args,) for args in inputs]
    return _parallel_apply(fns, positional, kwargs_tup, places)


def _parallel_apply(
    fns: Sequence[Callable[..., Output]],
    inputs: Sequence[tuple[Any, ...]],
    kwargs_tup: Sequence[Mapping[str, Any]],
    places: Sequence[Device | None],
) -> list[Output]:
    """:func:`parallel_apply` of arguments already read, checking nothing.

    As many callables, argument tuples, keyword mappings and existing devices (or ``None``: no
    device context).
    """
    streams = [_cuda_stream(device) for device in places]
    calls = [
        functools.partial(_run_replica, fn, args, kwargs, device, stream)
        for fn, args, kwargs, device, stream in zip(
            fns, inputs, kwargs_tup, places, streams, strict=True
        )
    ]
    futures = _run_all(calls)  # every replica ends before any error is re-raised
    for handoff in streams:
        if handoff is not None:
            handoff.finish()
    for i, (future, device) in enumerate(zip(futures, places, strict=True)):
        error = future.exception()
        if error is not None:
            _reraise(i, device, error)
    return [future.result() for future in futures]


def _per_replica(value: Any, name: str) -> tuple[Any, ...]:
    return read_sequence(value, name, expected="a list or tuple with one entry per replica")


# --------------------------------------------------------------------------------------------
# data_parallel, DataParallel


def _pick_devices(device_ids: Any, output_device: Any) -> tuple[tuple[Device, ...], Device]:
    """The devices ``device_ids`` names (every device for ``None``) and the output device."""
    if device_ids is None:
        ids = tuple(devices())
    else:
        ids = read_devices(device_ids, "device_ids", accelerators_only=False, allow_empty=True)
    if not ids:
        raise ValueError(
            "device_ids must name at least one device, got an empty sequence "
            "(pass None to use every device of the platform)."
        )
    output = ids[0] if output_device is None else read_device(output_device, "output_device")
    return ids, output


def data_parallel(  # noqa: PLR0917 - torch's data_parallel takes its options positionally
    fn: Callable[Concatenate[Params, ...], Output],
    params: Params,
    inputs: Any,
    /,
    device_ids: Sequence[DeviceLike] | None = None,
    output_device: DeviceLike | None = None,
    dim: int = 0,
    module_kwargs: Mapping[str, Any] | None = None,
) -> Output:
    """Evaluate ``fn(params, *inputs, **module_kwargs)`` with the batch split over devices.

    The functional form of ``torch.nn.parallel.data_parallel``. The arrays in ``inputs`` and
    ``module_kwargs`` are scattered along ``dim`` over ``device_ids`` (nested structures are
    walked, see :func:`~cupy_parallel._src.nested.scatter_kwargs`); ``params`` is replicated onto
    the devices that received a slice (a batch smaller than the number of devices uses fewer
    replicas); the replicas run in parallel (:func:`parallel_apply`); their outputs are gathered
    along ``dim`` on ``output_device``. Every step is recorded on an active tape, so the gradient
    of a loss computed from the gathered output equals the gradient of the same loss computed on
    one device.

    When only one replica runs (one device in ``device_ids``, a batch of one row, or no inputs)
    nothing is replicated: the inputs are moved to ``device_ids[0]``, ``fn`` is called there with
    the original ``params`` and its output is returned as it is. Unlike torch, which then leaves
    the output on ``device_ids[0]``, it is gathered to ``output_device`` when that is another
    device (with :func:`~cupy_parallel._src.nested.gather`'s rules, so a 0-d output becomes a
    vector of one, as with several replicas).

    Args:
        fn: The module function, called as ``fn(params, *inputs, **kwargs)``.
        params: Its parameter pytree; every array leaf must live on ``device_ids[0]``.
        inputs: A tuple of positional inputs, or one input (``None`` for no input).
        device_ids: The devices to use; ``None`` means every device of the platform.
        output_device: Where the output is gathered; defaults to ``device_ids[0]``. May be
            ``"cpu"``.
        dim: The batch dimension the inputs are split along and the outputs joined along.
        module_kwargs: Keyword arguments for ``fn``, scattered like ``inputs``.

    Returns:
        The gathered output, shaped as one call of ``fn`` on the whole batch would give.

    Raises:
        TypeError: ``fn`` is not callable, ``dim`` is not an int, or a device is misspelt; or
            ``fn`` cannot be called as ``fn(params, *inputs, **kwargs)`` (the error a replica
            raises then says that a module must be ``fn(params, *inputs)``).
        ValueError: ``device_ids`` is empty or names a missing device, a parameter is not on
            ``device_ids[0]`` (the message names its key path), or the arrays of ``inputs`` and
            ``module_kwargs`` split into different numbers of replicas, so that some replica
            would run without an argument the others get (torch runs it so; see
            :func:`~cupy_parallel._src.nested.scatter_kwargs`).

    Example:
        >>> import numpy as np
        >>> import cupy_parallel
        >>> params = {"w": cupy_parallel.to_device(np.array([[2.0]]), "host:0")}
        >>> def fn(p, x):
        ...     return x @ p["w"]
        >>> cupy_parallel.data_parallel(fn, params, np.arange(5.0).reshape(5, 1))
        HostArray([[0.], [2.], [4.], [6.], [8.]], device='host:0')
    """
    read_callable(fn, "fn", call="fn(params, *inputs)")
    ids, output = _pick_devices(device_ids, output_device)
    dim = read_int(dim, "dim")
    if module_kwargs is not None:
        read_mapping(module_kwargs, "module_kwargs", expected="a mapping or None")
    params_leaves, spec = _params_on(params, ids[0], "data_parallel")
    if not isinstance(inputs, tuple):
        inputs = () if inputs is None else (inputs,)
    kwargs = dict(module_kwargs or {})
    # Every argument is read above, once; the steps below are the unchecked cores.
    if inputs or kwargs:
        _accelerators(ids)
        args, kwargs_per = scatter_kwargs_unchecked(
            inputs, kwargs, ids, dim, names=("inputs", "module_kwargs")
        )
    else:  # nothing to split: one call on device_ids[0], as torch
        args, kwargs_per = ((),), ({},)
    used = ids[: len(args)]
    replicas = (
        [params]
        if len(used) == 1
        else _replicate(params_leaves, spec, used, detach=False, checked=False)
    )
    try:
        outputs = _parallel_apply(
            [functools.partial(fn, replica) for replica in replicas], args, kwargs_per, used
        )
    except TypeError as error:
        _refuse_signature(fn, error, replicas[0], args[0], kwargs_per[0])
        raise
    if len(used) == 1 and output == used[0]:
        return outputs[0]
    return gather_unchecked(outputs, output, dim)


def _refuse_signature(
    fn: Callable[..., Any],
    error: TypeError,
    params: Any,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
) -> None:
    """If ``fn`` cannot be called with a replica's arguments, say how a module is called.

    Called when a replica raised ``TypeError``: if ``fn``'s signature cannot bind
    ``(params, *args, **kwargs)``, the error came from the call itself, not from inside ``fn``,
    and the ``TypeError`` raised instead says that a module is ``fn(params, *inputs)``.
    """
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a callable without a signature Python can read
        return
    try:
        signature.bind(params, *args, **kwargs)
    except TypeError:
        pass
    else:
        return
    name = getattr(fn, "__name__", type(fn).__name__)
    keywords = f" and keywords {sorted(kwargs)}" if kwargs else ""
    raise TypeError(
        f"{error}; the module {name}{signature} cannot be called as data_parallel calls it, "
        f"fn(params, *inputs, **kwargs), here with params and {len(args)} input"
        f"{'s' if len(args) != 1 else ''}{keywords}: a module function must be "
        "fn(params, *inputs), taking its parameter pytree first (e.g. lambda params, x: ...)."
    ) from error.__cause__ or error


def _accelerators(ids: tuple[Device, ...]) -> None:
    """Refuse ``"cpu"`` among the devices a batch is scattered over (arrays there are NumPy)."""
    for i, device in enumerate(ids):
        if device.kind == "cpu":
            raise ValueError(
                f"device_ids[{i}] must be an accelerator device ('host:k' or 'cuda:k') to take a "
                "slice of the batch, got 'cpu' (plain NumPy memory); use cupy_parallel.devices()."
            )


class DataParallel(Generic[Params, Output]):
    """A module function and its parameters, evaluated data-parallel when called.

    The counterpart of ``torch.nn.DataParallel`` for pure functions: ``dp(*inputs, **kwargs)`` is
    ``data_parallel(fn, dp.params, inputs, dp.device_ids, dp.output_device, dp.dim, kwargs)``.
    ``params`` is an attribute the training loop may replace after each step (the new arrays must
    also live on ``device_ids[0]``). Unlike torch, which moves a module to ``device_ids[0]`` when
    only one device is given, the parameters are never moved: placement is checked here and on
    every call.

    Args:
        fn: The module function, called as ``fn(params, *inputs, **kwargs)``.
        params: Its parameter pytree, on ``device_ids[0]``.
        device_ids: The devices to use; ``None`` means every device of the platform.
        output_device: Where outputs are gathered; defaults to ``device_ids[0]``.
        dim: The batch dimension.

    Raises:
        TypeError: ``fn`` is not callable or ``dim`` is not an int.
        ValueError: As :func:`data_parallel`.

    Example:
        >>> import numpy as np
        >>> import cupy_parallel
        >>> params = cupy_parallel.to_device(np.array([1.0, -1.0]), "host:0")
        >>> dp = cupy_parallel.DataParallel(lambda p, x: x * p, params, device_ids=[0, 1])
        >>> dp(np.ones((3, 2))), dp.output_device
        (HostArray([[ 1., -1.], [ 1., -1.], [ 1., -1.]], device='host:0'), Device('host:0'))
    """

    def __init__(
        self,
        fn: Callable[Concatenate[Params, ...], Output],
        params: Params,
        device_ids: Sequence[DeviceLike] | None = None,
        output_device: DeviceLike | None = None,
        dim: int = 0,
    ) -> None:
        read_callable(fn, "fn", call="fn(params, *inputs)")
        self.fn = fn
        ids, self.output_device = _pick_devices(device_ids, output_device)
        self.device_ids = list(ids)
        self.dim = read_int(dim, "dim")
        _params_on(params, ids[0], "DataParallel")
        self.params = params

    def __call__(self, /, *inputs: Any, **kwargs: Any) -> Output:
        """``data_parallel`` of the stored function and parameters on ``inputs``."""
        return data_parallel(
            self.fn,
            self.params,
            inputs,
            self.device_ids,
            self.output_device,
            self.dim,
            kwargs,
        )

    def __repr__(self) -> str:
        name = getattr(self.fn, "__name__", type(self.fn).__name__)
        ids = ", ".join(str(d) for d in self.device_ids)
        return (
            f"DataParallel({name}, device_ids=[{ids}], output_device={self.output_device}, "
            f"dim={self.dim})"
        )
