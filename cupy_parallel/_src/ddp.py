"""``DistributedDataParallel``: one replica per rank, gradients averaged over the group.

The counterpart of ``torch.nn.parallel.DistributedDataParallel`` for a module that is a pure
function ``fn(params, *inputs, **kwargs)`` (as for :class:`~cupy_parallel.DataParallel`). Each
rank of a process group holds the same parameters and its own shard of the batch; a gradient
computed on a :class:`~cupy_parallel.Tape` that recorded ``ddp(inputs)`` is the average over
the group of the ranks' gradients, which for a mean loss over equal shards is the gradient of
the whole batch's loss on one process.

How (torch's ``Reducer``): the parameters are cut into *buckets* at construction, in reverse
parameter order (the order gradients become final in a backward pass), one dtype and device
per bucket, at most ``bucket_cap_mb`` each (a bucket closes once it reaches its cap, so one
parameter larger than the cap is a bucket of its own). With the default cap (25 MiB) the first
bucket closes at 1 MiB (torch's ``_DEFAULT_FIRST_BUCKET_BYTES``, which torch applies when
``bucket_cap_mb`` is not given), so that the first all-reduce starts early. Each
forward call watches the parameters on the active tapes and registers, once per tape, a
gradient-ready hook on each parameter (:meth:`Tape.register_gradient_ready_hook`). In a backward
pass the hook copies the final gradient into its bucket's flat buffer; when a bucket is
complete, and every bucket before it has started, its communication hook starts an
asynchronous all-reduce, while the rest of the backward pass runs. Once the pass has run its
last node (torch's ``queue_callback``), every bucket is waited for, and the gradients the tape
returns are views of the reduced buffers. The buckets reduce on a communicator of their own
(a group of the same ranks, made at construction), so that they never pair with another
collective of the pass (``nn.functional``'s backward collectives), whatever order each rank's
gradients become final in.

The buckets start in the same order on every rank (bucket ``k`` only after bucket ``k - 1``),
whatever order each rank's gradients become final in: collectives must pair up across ranks.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
import warnings
import weakref
from typing import TYPE_CHECKING, Any, Concatenate, Generic

import numpy as np

from cupy_parallel._src.arguments import read_bool, read_callable, read_real
from cupy_parallel._src.arrays import array_namespace, device_of, empty, is_array, move
from cupy_parallel._src.arraytypes import Output, Params
from cupy_parallel._src.bindings import hold, rebind
from cupy_parallel._src.compute import cuda_device, on_device_of
from cupy_parallel._src.devices import CPU, as_device
from cupy_parallel._src.distributed.comm_hooks import (
    GradBucket,
    PolledFuture,
    allreduce_hook,
    bf16_compress_hook,
    bfloat16,
    fp16_compress_hook,
)
from cupy_parallel._src.distributed.groups import (
    get_global_rank,
    get_rank,
    get_world_size,
    new_group,
    resolve_group,
)
from cupy_parallel._src.distributed.objects import all_gather_object
from cupy_parallel._src.distributed.reductions import all_reduce
from cupy_parallel._src.distributed.rooted import broadcast
from cupy_parallel._src.enums import ReduceOp
from cupy_parallel._src.hostarray import HostArray, host_array, host_buffer, plain_buffer
from cupy_parallel._src.recording import (
    active_tapes,
    at_pass_end,
    note_overwritten,
    pause_recording,
    unconnected_as_none,
    unreach,
)
from cupy_parallel._src.tape import Tape
from cupy_parallel._src.tree import flatten, flatten_with_names

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Sequence

    from optree import PyTreeSpec

    from cupy_parallel._src.arraytypes import Tree
    from cupy_parallel._src.distributed.work import Future

__all__ = ["DistributedDataParallel"]

_MIB = 1024 * 1024
FIRST_BUCKET_BYTES = 1 * _MIB
"""The cap of the first bucket reduced (torch's ``dist._DEFAULT_FIRST_BUCKET_BYTES``)."""
_DEFAULT_CAP_MB = 25.0
POLLS = range(8)
"""How many more times a gradient-ready hook asks the oldest bucket in flight (see the class)."""
_SHIPPED = frozenset({allreduce_hook, fp16_compress_hook, bf16_compress_hook})
"""The hooks whose state is the process group: given the group, they reduce on DDP's own."""
_COMPRESSED: dict[Callable[..., Any], Callable[[], Any]] = {
    fp16_compress_hook: lambda: np.dtype(np.float16),
    bf16_compress_hook: bfloat16,  # raises RuntimeError without ml_dtypes
}
"""The shipped hooks that reduce in another dtype: that dtype (its backend must reduce it)."""


class CommHookError(RuntimeError, TypeError):
    """A communication hook returned no future: torch raises ``RuntimeError`` at backward.

    Also a ``TypeError`` (the wrong type of result), which this library raised before.
    """


# --------------------------------------------------------------------------------------------
# Buckets


class _Bucket:
    """Where bucket ``index`` lives: its parameters (indices), their slices of a flat buffer."""

    __slots__ = ("device", "dtype", "index", "members", "size", "slices")

    def __init__(self, index: int, members: list[int], arrays: list[Any]) -> None:
        self.index = index
        self.members = members
        self.slices: list[tuple[int, int]] = []
        start = 0
        for i in members:
            self.slices.append((start, start + arrays[i].size))
            start += arrays[i].size
        self.size = start
        self.dtype = arrays[members[0]].dtype
        self.device = device_of(arrays[members[0]])


def _check_placement(device_ids: Any, output_device: Any, arrays: list[Any]) -> None:
    """Check torch's ``device_ids``/``output_device``: only the parameters' device is taken."""
    where = sorted({str(device_of(a)) for a in arrays})
    if device_ids is not None:
        if isinstance(device_ids, str) or not isinstance(device_ids, list | tuple):
            raise TypeError(f"device_ids must be None or a list of one device, got {device_ids!r}.")
        if len(device_ids) != 1:
            raise ValueError(
                "device_ids must name one device (each rank's DistributedDataParallel runs on "
                f"one, as torch's with one device per process), got {list(device_ids)!r}."
            )
    for option, given in (("device_ids", device_ids), ("output_device", output_device)):
        if given is None:
            continue
        spec = given[0] if option == "device_ids" else given
        device = str(as_device(spec))
        if where != [device]:
            shown = f"[{spec!r}]" if option == "device_ids" else repr(spec)
            raise ValueError(
                f"{option}={shown} names {device}, but the parameters are on "
                f"{', '.join(where) or 'no device (no arrays)'}: DistributedDataParallel runs fn "
                "where its parameters are. Move them there (cupy_parallel.to_device) or leave "
                f"{option} out."
            )


# torch's keywords whose default (or any value, for the flags) is what this class does anyway,
# and why another value is refused
_TORCH_FLAGS = {
    "gradient_as_bucket_view": "the gradients are always views of the bucket buffers",
    "static_graph": "every backward pass reduces every bucket, whatever the graph",
    "check_reduction": "every backward pass reduces every bucket",
    "broadcast_buffers": "there are no buffers: params is the whole state",
}
_TORCH_DEFAULTS: dict[str, tuple[Any, str]] = {
    "init_sync": (True, "init_sync=False is broadcast_params=False here"),
    "dim": (0, "inputs are never split here: each rank passes its own shard"),
    "skip_all_reduce_unused_params": (
        False,
        (
            "every parameter's gradient is reduced in every pass (unused ones as zeros), so "
            "that no rank waits for another"
        ),
    ),
    "mixed_precision": (
        None,
        (
            "the gradients are reduced in the parameters' dtype; for float16/bfloat16 on the "
            "wire register fp16_compress_hook or bf16_compress_hook"
        ),
    ),
    "device_mesh": (None, "pass the process group as process_group"),
    "delay_all_reduce_named_params": (None, "every parameter's gradient is reduced in buckets"),
    "param_to_hook_all_reduce": (None, "every parameter's gradient is reduced in buckets"),
}


def _read_torch_options(options: dict[str, Any]) -> None:
    """Accept torch's keywords where the behaviour is ours anyway; refuse the rest, saying why."""
    for name, value in options.items():
        if name in _TORCH_FLAGS:
            if value is not None:
                read_bool(value, name)  # either way: it is what happens (see _TORCH_FLAGS)
        elif name in _TORCH_DEFAULTS:
            default, why = _TORCH_DEFAULTS[name]
            if value is not default and not (
                default is not None and isinstance(value, type(default)) and value == default
            ):
                raise ValueError(
                    f"DistributedDataParallel({name}={value!r}) is not supported: {why}."
                )
        else:
            raise TypeError(
                f"DistributedDataParallel got an unexpected keyword argument {name!r} (torch's "
                f"keywords it takes: device_ids, output_device, find_unused_parameters, "
                f"{', '.join(sorted([*_TORCH_FLAGS, *_TORCH_DEFAULTS]))})."
            )


def _assign_buckets(arrays: list[Any], first_bytes: int, cap_bytes: int) -> list[_Bucket]:
    """Cut the parameters into buckets, in reverse parameter order (see the module).

    Per dtype and device, the first bucket closes at ``first_bytes``, the others at
    ``cap_bytes``.
    """
    open_: dict[Any, tuple[list[int], int, int]] = {}  # key -> (members, bytes, buckets closed)
    done: list[list[int]] = []
    for i in reversed(range(len(arrays))):
        a = arrays[i]
        key = (a.dtype, device_of(a))
        members, size, closed = open_.get(key, ([], 0, 0))
        members.append(i)
        size += a.nbytes
        if size >= (first_bytes if closed == 0 else cap_bytes):
            done.append(members)
            members, size, closed = [], 0, closed + 1
        open_[key] = (members, size, closed)
    done.extend(members for members, _, _ in open_.values() if members)
    done.sort(key=lambda members: -members[0])  # the bucket of the last parameter first
    return [_Bucket(k, members, arrays) for k, members in enumerate(done)]


def _write(buffer: Any, start: int, stop: int, grad: Any, divisor: int | None = None) -> None:
    """``buffer[start:stop] = grad.ravel() / divisor`` (zeros for ``None``), on its device.

    A division in the buffer's dtype, rounded once, as ``allreduce_hook``'s (torch's
    ``div_``): not a multiplication by ``1 / divisor``, which the dtype rounds first (float16's
    ``1 / 3`` is 0.33325: every averaged gradient would be 2.4e-4 too small).
    """
    raw = plain_buffer(buffer)
    if grad is None or divisor is None:
        on_device_of(raw, _copy, raw, start, stop, None if grad is None else plain_buffer(grad))
    else:  # one pass: divided while copied
        xp = np if isinstance(raw, np.ndarray) else array_namespace(raw)
        on_device_of(raw, _divide, xp, plain_buffer(grad), divisor, raw[start:stop])


# Both run on the buffer's device: flattening a strided gradient allocates and launches there,
# not on the thread's current GPU (which a tape hook or a rank over two GPUs need not be on).
def _copy(raw: Any, start: int, stop: int, grad: Any) -> None:
    raw[start:stop] = 0 if grad is None else grad.reshape(-1)


def _divide(xp: Any, x: Any, divisor: int, out: Any) -> None:
    xp.divide(x.reshape(-1), divisor, out=out)


_ARRAY_TYPES = {"cpu": "numpy.ndarray", "host": "HostArray", "cuda": "cupy.ndarray"}
"""The array type of each device kind (one type per kind)."""


def _placement_problem(what: str, param: str, bucket: _Bucket, grad: Any) -> tuple[str, str] | None:
    """What is wrong with where the gradient ``grad`` lives, for a parameter of ``bucket``.

    ``(error type, message)``, or ``None``: the gradient must be an array of the parameter's
    array type (``TypeError``), on its device (``ValueError``), which is its bucket's, as a
    GPU's kernels insist (a host device must catch what a GPU would). A NumPy scalar counts
    as a NumPy array (0-d gradients computed with NumPy).
    """
    device = CPU if isinstance(grad, np.generic) else device_of(grad)
    want = bucket.device
    whose = f"its parameter {param}" if param else "the parameter"
    if device.kind != want.kind:
        return (
            "TypeError",
            (
                f"{what} is a {_ARRAY_TYPES[device.kind]} on {device}, but {whose} is a "
                f"{_ARRAY_TYPES[want.kind]} on {want}: a gradient must be an array of its "
                f"parameter's type, on its device (cupy_parallel.to_device(grad, '{want}'))."
            ),
        )
    if device != want:
        return (
            "ValueError",
            (
                f"{what} is on {device}, but {whose} is on {want}: a gradient must be on its "
                f"parameter's device (cupy_parallel.to_device(grad, '{want}'))."
            ),
        )
    return None


def _view(buffer: Any, start: int, stop: int, shape: tuple[int, ...]) -> Any:
    """``buffer[start:stop]`` shaped ``shape``, of the buffer's own array type (a view)."""
    if type(buffer) is HostArray:
        return host_array(host_buffer(buffer)[start:stop].reshape(shape), buffer.device)
    return buffer[start:stop].reshape(shape)


def _on_gpu_of(buffer: Any) -> Any:
    """The bucket buffer's GPU as a context (CuPy's current device), or no context on the host."""
    device = cuda_device(plain_buffer(buffer))
    return contextlib.nullcontext() if device is None else device


class _Reduction:
    """One reduction of every bucket: buffers filled, communication started in order, waited.

    Filled by :meth:`check_and_put` or, for gradients checked already, :meth:`put` (one
    parameter's gradient at a time, in any order); bucket ``k`` starts once it is complete and
    buckets ``0..k-1`` have started. :meth:`finish` starts what is left and waits for everything.
    """

    __slots__ = (
        "_ddp",
        "buffers",
        "divisor",
        "futures",
        "hook",
        "next",
        "pending",
        "state",
        "used",
    )

    def __init__(self, ddp: DistributedDataParallel[Any, Any]) -> None:
        self._ddp = ddp
        buckets = ddp._buckets
        self.buffers: list[Any] = [None] * len(buckets)
        self.pending = [len(b.members) for b in buckets]
        self.futures: list[tuple[Future[Any], Any, Any]] = []  # future, hook's buffer, bucket
        self.next = 0
        self.used = [False] * len(ddp._arrays)  # which parameters a gradient reached (the tape's)
        with ddp._lock:  # one hook for the whole reduction, even if one is registered meanwhile
            ddp._backward_ran = True
            self.hook, self.state = ddp._comm_hook, ddp._comm_state
        if self.hook in _SHIPPED and (self.state is None or self.state is ddp.process_group):
            self.state = ddp._bucket_group  # the shipped hooks reduce on DDP's own communicator
        # the default hook, fused: each gradient divided by the group's size as it is copied
        self.divisor = ddp._world if self.hook is None and ddp._world > 1 else None

    def check_and_put(self, i: int, grad: Any) -> Any:
        """:meth:`put`, once the gradient is checked against its parameter (the tape's path)."""
        ddp = self._ddp
        if grad is not None:
            param = ddp._arrays[i]
            if tuple(grad.shape) != tuple(param.shape):
                raise ValueError(
                    f"The gradient of {ddp._names[i]} has shape {tuple(grad.shape)}, the "
                    f"parameter {tuple(param.shape)}."
                )
            bucket, _ = ddp._where[i]
            problem = _placement_problem(f"The gradient of {ddp._names[i]}", "", bucket, grad)
            if problem is not None:
                raise _ERRORS[problem[0]](problem[1])
            self.used[i] = True
        return self.put(i, grad)

    def put(self, i: int, grad: Any) -> Any:
        """Copy parameter ``i``'s gradient (checked) into its bucket; return its view there."""
        ddp = self._ddp
        bucket, slot = ddp._where[i]
        param = ddp._arrays[i]
        buffer = self.buffers[bucket.index]
        if buffer is None:
            buffer = self.buffers[bucket.index] = empty(bucket.size, bucket.dtype, bucket.device)
        start, stop = bucket.slices[slot]
        _write(buffer, start, stop, grad, self.divisor)
        self.pending[bucket.index] -= 1
        self._start_ready()
        return _view(buffer, start, stop, param.shape)

    def _start_ready(self) -> None:
        buckets = self._ddp._buckets
        while self.next < len(buckets) and self.pending[self.next] == 0:
            self._start(self.next)
            self.next += 1
        # MPI moves nonblocking collectives on only while asked; one test moves them all
        for future, _, on in self.futures:
            done = getattr(future, "done", None)  # a hook's future may have wait() only
            if done is None:
                continue
            with _on_gpu_of(on):  # a poll that completes it runs the hook's then() there
                if done():
                    continue
                for _ in POLLS:
                    if done():
                        break
            break

    def _start(self, k: int) -> None:
        ddp = self._ddp
        if self.hook is None:  # allreduce_hook, its division done by put
            work = all_reduce(self.buffers[k], group=ddp._bucket_group, async_op=True)
            self.futures.append((PolledFuture.of_work(work), None, self.buffers[k]))
            return
        bucket = ddp._buckets[k]
        params = [ddp._arrays[i] for i in bucket.members]
        grad_bucket = GradBucket(
            k, self.buffers[k], params, bucket.slices, last=k == len(ddp._buckets) - 1
        )
        with pause_recording(), _on_gpu_of(self.buffers[k]):  # the hook's casts and divisions
            future = self.hook(self.state, grad_bucket)
        if not callable(getattr(future, "wait", None)):
            raise CommHookError(
                "A DDP communication hook must return a future of the reduced bucket (with a "
                f"wait() method, e.g. work.get_future()), got {type(future).__name__}."
            )
        self.futures.append((future, self.buffers[k], self.buffers[k]))

    def _start_rest(self) -> None:
        """Start the buckets left (all complete by now)."""
        for k in range(self.next, len(self.buffers)):
            if self.buffers[k] is None:  # a bucket no gradient reached (reduce_gradients)
                b = self._ddp._buckets[k]
                self.buffers[k] = empty(b.size, b.dtype, b.device)
                _write(self.buffers[k], 0, b.size, None)
            self._start(k)
        self.next = len(self.buffers)

    def end_pass(self) -> None:
        """:meth:`finish` a backward pass; parameters no rank's gradient reached get none.

        With ``find_unused_parameters``, the ranks sum which parameters a gradient reached on
        each (and how many ranks' callers take ``None`` for no gradient) in one all-reduce of
        ``len(params) + 1`` int32 on the buckets' communicator, started after the last bucket
        and waited for with them: a parameter no rank used is then :func:`unreach`-ed on every
        rank (its caller's ``unconnected_gradients`` value), and callers that differ raise on
        every rank. Without it nothing is exchanged: every parameter keeps its reduced
        gradient (zeros where no rank used it), which a caller asking ``None`` for no gradient
        cannot take where this rank used not every parameter (``ValueError``, after the
        buckets, so that no peer waits).
        """
        ddp = self._ddp
        none = unconnected_as_none()
        self._start_rest()
        counts = None
        if ddp.find_unused_parameters:
            local = np.array([*self.used, none], dtype=np.int32)
            counts = move(local, ddp._buckets[0].device)
            work = all_reduce(counts, group=ddp._bucket_group, async_op=True)
            self.futures.append((PolledFuture.of_work(work), None, counts))
        self.finish()
        if counts is None:
            if none and not all(self.used):
                name = ddp._names[self.used.index(False)]
                raise ValueError(
                    'unconnected_gradients="none" gives None to a parameter no rank used, but '
                    f"{name} got no gradient on this rank, and this DistributedDataParallel "
                    "does not learn whether another rank's did: construct it with "
                    "find_unused_parameters=True (one small all-reduce per backward pass, as "
                    'torch\'s), or take unconnected_gradients="zero" (zeros for a parameter no '
                    "rank used)."
                )
            return
        total = plain_buffer(move(counts, CPU)).tolist()
        asking = total.pop()
        if 0 < asking < ddp._world:
            raise ValueError(
                f"The ranks' gradient() calls differ: {asking} of {ddp._world} take "
                'unconnected_gradients="none", the others "zero", so a parameter no rank used '
                "would get None on some ranks and zeros on others. Pass the same "
                "unconnected_gradients on every rank."
            )
        for array, count in zip(ddp._arrays, total, strict=True):
            if count == 0:
                unreach(array)

    def finish(self) -> list[Any]:
        """Start the buckets left (all complete by now), wait for all; the reduced buffers."""
        self._start_rest()
        for k, (future, buffer, on) in enumerate(self.futures):
            with pause_recording(), _on_gpu_of(on):  # then() callbacks run in this wait
                result = future.wait()
            if buffer is not None and result is not buffer:
                if not is_array(result) or tuple(result.shape) != (buffer.size,):
                    shape = getattr(result, "shape", None)
                    raise ValueError(
                        f"The communication hook's future for bucket {k} must hold the reduced "
                        f"flat buffer, an array of shape ({buffer.size},), got "
                        f"{type(result).__name__} of shape {shape}."
                    )
                _write(buffer, 0, buffer.size, result)
        return self.buffers


class _TapeReduction:
    """A tape's gradient-ready hooks for the parameters: one reduction per backward pass.

    Every hooked parameter's hook runs once per pass (with ``None`` when no gradient reached
    it), so a pass is over when all have run; a hook that sees a parameter twice knows the
    previous pass ended early (an error) and starts afresh. One array at two leaves of params
    is hooked twice: its second hook gets the replacement the first returned, so the gradient
    the first received is kept for it.

    A pass runs its hooks in the thread that called ``gradient()``; two passes of one tape at
    once, in two threads, would mix their gradients in one reduction (and issue their
    collectives in an order the ranks need not share), so a hook of a second thread's pass
    while a live thread's pass is under way raises ``RuntimeError``.
    """

    __slots__ = ("_ddp", "_lock", "_owner", "_received", "_reduction", "_seen", "_shared", "ids")

    def __init__(self, ddp: DistributedDataParallel[Any, Any], arrays: list[Any]) -> None:
        self._ddp = ddp
        self.ids = [id(a) for a in arrays]  # one array at two leaves: hooked twice
        self._seen: set[int] = set()
        self._received: dict[int, Any] = {}  # id(array) -> the gradient its first hook got
        self._reduction: _Reduction | None = None
        self._owner: threading.Thread | None = None  # the thread whose pass is under way
        self._lock = threading.Lock()
        self._shared = len(set(self.ids)) < len(self.ids)

    def ready(self, i: int, grad: Any) -> Any:
        me = threading.current_thread()
        with self._lock:  # only the pass's own thread goes past this block
            owner = self._owner
            if self._reduction is not None and owner is not me:
                if owner is not None and owner.is_alive():
                    raise RuntimeError(
                        "Two backward passes of one tape ran at once, in threads "
                        f"{owner.name!r} and {me.name!r}: DistributedDataParallel reduces one "
                        "pass of a tape at a time (the ranks must issue its collectives in one "
                        "order). Compute the tape's gradients in one thread at a time. (A pass "
                        "that failed in a live thread also leaves its reduction unfinished.)"
                    )
                self._reduction = None  # the pass of a thread that has ended: it failed
            reduction = self._reduction
            if reduction is None or i in self._seen:
                reduction = self._begin()
                self._owner = me
            self._seen.add(i)
        if self._shared:
            grad = self._received.setdefault(self.ids[i], grad)
        view = reduction.check_and_put(i, grad)
        if len(self._seen) == len(self.ids):
            with self._lock:
                self._reduction, self._seen, self._received = None, set(), {}
            # wait once the pass has issued all its collectives (torch's queue_callback): a
            # peer may wait for this rank in a backward collective still to come
            if not at_pass_end(reduction.end_pass):
                reduction.end_pass()
        return view

    def _begin(self) -> _Reduction:
        arrays = self._ddp._arrays
        for tape in active_tapes():  # the tapes recording this pass (the computing one paused)
            if any(tape.tracks(a) for a in arrays):
                raise NotImplementedError(
                    "DistributedDataParallel's averaged gradients cannot be differentiated "
                    "again: a gradient() is computed while an outer tape tracks the "
                    "parameters. (torch's DDP runs create_graph=True with a warning, but its "
                    "higher-order gradients are not synchronised: it does not differentiate "
                    "through the all-reduce, so each rank's second derivative misses the other "
                    "ranks' terms.) For higher derivatives run the forward under "
                    "ddp.no_sync() and average with "
                    "cupy_parallel.distributed.nn.functional.all_reduce, which is "
                    "differentiable."
                )
        self._reduction, self._seen, self._received = _Reduction(self._ddp), set(), {}
        return self._reduction


# --------------------------------------------------------------------------------------------
# Agreement of the ranks


def _describe(
    names: list[str], leaves: list[Any], spec: PyTreeSpec
) -> tuple[str, list[tuple[str, tuple[int, ...], str, str]], list[tuple[str, str]]]:
    """What must agree across ranks: the structure, and each array leaf's shape/dtype/kind.

    Also the local problems (``(error type, message)``): array leaves neither floating-point nor
    complex.
    """
    entries, problems = [], []
    for name, leaf in zip(names, leaves, strict=True):
        if not is_array(leaf):
            continue
        kind = device_of(leaf).kind
        entries.append((name, tuple(leaf.shape), str(leaf.dtype), f"{type(leaf).__name__}/{kind}"))
        if leaf.dtype.kind not in "fc":
            problems.append(
                (
                    "TypeError",
                    (
                        f"DistributedDataParallel trains floating-point and complex arrays, but "
                        f"{name} has dtype {leaf.dtype}. Cast it first "
                        "(array.astype(numpy.float32)) or keep it out of params."
                    ),
                )
            )
    return str(spec), entries, problems


_ERRORS: dict[str, type[Exception]] = {"TypeError": TypeError, "ValueError": ValueError}


def _agree(what: str, description: Any, problems: list[tuple[str, str]], group: Any) -> None:
    """Have every rank compare ``description`` and raise alike if any rank differs or failed.

    One object all-gather: every rank sees every rank's description and local problems, so
    every rank raises (the same error), none waits for a collective its peers skip.
    """
    gathered: list[Any] = [None] * get_world_size(group)
    all_gather_object(gathered, (description, problems), group=group)
    for rank, (_, found) in enumerate(gathered):
        if found:
            kind, message = found[0]
            raise _ERRORS.get(kind, ValueError)(f"On rank {rank}: {message}")
    first = gathered[0][0]
    for rank, (other, _) in enumerate(gathered):
        if other != first:
            raise ValueError(
                f"{what} differ across the ranks: rank {rank}'s differ from rank 0's "
                f"({_first_difference(first, other)}). Every rank must pass the same structure, "
                "shapes and dtypes."
            )


def _first_difference(a: Any, b: Any) -> str:
    if not isinstance(a, tuple) or not isinstance(b, tuple):
        return f"{a} vs {b}"
    spec_a, entries_a, *extra_a = a
    spec_b, entries_b, *extra_b = b
    if spec_a != spec_b:
        return f"structure {spec_a} vs {spec_b}"
    # entries by name: a leaf that is no array has none, so positions would not line up
    named_a, named_b = {x[0]: x for x in entries_a}, {y[0]: y for y in entries_b}
    for name in [*named_a, *(name for name in named_b if name not in named_a)]:
        x, y = named_a.get(name), named_b.get(name)
        if x != y:
            return f"{name}: {_entry(x)} vs {_entry(y)}"
    return f"options {extra_a} vs {extra_b}"


def _entry(entry: tuple[str, tuple[int, ...], str, str] | None) -> str:
    return "no array" if entry is None else f"shape {entry[1]} {entry[2]} {entry[3]}"


_UNREDUCED = (
    "DistributedDataParallel: this forward call reduces the gradients of its own pass only, "
    "but {} forward call(s) recorded inside no_sync() since the last reduce_gradients(), on "
    "other tapes, left rank-local gradients that nothing has averaged. torch's pattern "
    "(micro-batches inside no_sync(), the last one outside) averages the accumulated .grad "
    "there (as here when all are recorded on one tape); across tapes a gradient "
    "has no .grad to accumulate into, so adding this pass's averaged gradients to the earlier "
    "local ones mixes averaged and local values. Sum every micro-batch's gradients inside "
    "no_sync() and average the sum once with ddp.reduce_gradients(total) (see no_sync)."
)


# --------------------------------------------------------------------------------------------
# DistributedDataParallel


class DistributedDataParallel(Generic[Params, Output]):
    """A module function whose gradients are averaged over a process group, as torch's DDP.

    Every rank of the group builds one, with parameters of the same structure, shapes and
    dtypes, and calls it on its own shard of the batch (see
    :func:`cupy_parallel.distributed.shard_indices`). ``ddp(*inputs, **kwargs)`` is
    ``fn(ddp.params, *inputs, **kwargs)``, recorded so that ``tape.gradient(loss, ddp.params)``
    returns the gradients averaged over the group: for a mean loss over equal shards, the
    gradient of the whole batch's mean loss. The reduction runs in buckets during the backward
    pass (see the module :mod:`cupy_parallel._src.ddp`).

    Decisions:

    - Construction broadcasts the parameters from the group's first rank **in place** (as torch
      overwrites a module's parameters): ``ddp.params`` is the pytree passed, its arrays now
      holding rank 0's values. First the ranks compare the structure, shapes, dtypes and array
      types of their parameters (and the options): a difference, or a parameter neither
      floating-point nor complex on any rank, raises the same error on every rank.
    - A forward call watches the parameters on **every active tape** and hooks them once per
      tape: any tape that recorded a forward outside :meth:`no_sync` averages the parameters'
      gradients in each of its ``gradient()`` passes (a persistent tape in each), whatever
      else the pass asks for. Several forward calls on one tape make one reduction per pass.
      The reduced gradients cannot be differentiated again: a pass computed while another
      active tape tracks the parameters raises ``NotImplementedError``. torch's DDP runs
      ``create_graph=True`` with a warning, but does not differentiate through its
      all-reduce: the higher-order gradients it returns are each rank's own, silently
      missing the other ranks' terms; here that would be a wrong answer without an error, so
      it is refused. For higher derivatives, run the forward under :meth:`no_sync` and
      average with ``cupy_parallel.distributed.nn.functional.all_reduce`` (differentiable).
    - Like torch, the flag of :meth:`no_sync` is read at the forward call: a tape on which
      every forward ran inside ``no_sync`` keeps its gradients rank-local. torch's way of
      accumulating (the last micro-batch outside ``no_sync``, whose backward averages the
      accumulated ``.grad``) has no counterpart here, since a tape's gradients are new arrays:
      a recorded forward call outside ``no_sync`` that follows recorded calls inside it, with
      no :meth:`reduce_gradients` between, warns (``UserWarning``), because adding its averaged
      gradients to the earlier local ones gives neither torch's answer nor the local one.
      Calls inside and outside ``no_sync`` recorded on **one** tape are one backward pass,
      which averages all of their gradients (torch's answer for the same pattern): no warning.
    - Threads may share one DDP (each rank calling ``cupy_parallel.parallel_apply([ddp, ddp],
      ...)`` under one tape): its bookkeeping is locked, so a tape is hooked once whichever
      thread's forward call comes first, and each pass reduces once. The :meth:`no_sync` flag
      is the object's (as torch's), seen by every thread. One tape's ``gradient()`` passes
      must run one at a time: a pass started in a second thread while another thread's runs
      raises ``RuntimeError``.
    - The ranks reduce every bucket in every pass, whatever each used (a parameter no gradient
      reached counts as zeros, so no rank waits for another): a parameter used on some ranks
      gets the average on every rank, the ranks that did not use it included (torch's
      answer). A parameter no rank used gets the tape's ``unconnected_gradients`` value, as
      torch's DDP with ``find_unused_parameters=True`` leaves its ``.grad`` ``None``: with
      ``find_unused_parameters=True`` the ranks learn which parameters any rank used (one
      all-reduce of ``len(params) + 1`` int32 per backward pass, after the buckets, as
      torch's ``local_used_map``), and ``gradient(..., unconnected_gradients="none")`` gives
      ``None`` there on every rank (``"zero"``, the default: zeros, and the tape's
      ``ValueError`` when the target reaches no source on any rank). Ranks whose calls ask
      differently raise ``ValueError`` on every rank. Decision: without it (the default, at
      no cost) nothing is exchanged and such a parameter gets zeros, the reduced value; a
      pass asking ``"none"`` raises ``ValueError`` at its end on a rank where a parameter got
      no gradient (torch without ``find_unused_parameters`` raises for an unused parameter
      too). A parameter no recorded operation consumed is final at the start of the pass (torch's
      ``find_unused_parameters`` marks it ready at once); one consumed only off the loss's
      path holds its bucket back until the pass reaches that operation. Every rank must run
      the same backward passes (a rank whose tape does not reduce makes its peers wait, as in
      torch). One array at two leaves of ``params`` (tied weights) gets its total gradient at
      both.
    - Tied weights stay tied: assigning :attr:`params` refuses (``ValueError`` naming both
      leaves) new params holding two different arrays where the old ones held one, which the
      functional update ``{k: p[k] - lr * g[k]}`` makes (from the next step on, each leaf
      would get only its own part of the gradient and training would drift from the tied
      model's). Update the tied array once and put the result at both leaves.
    - The gradients returned are views of fresh flat buffers, one per bucket and pass (never a
      buffer reused across steps, so a gradient kept from one step does not change later).
    - Progress: the MPI backend moves a nonblocking all-reduce on only while its rank calls
      into MPI, so each gradient-ready hook tests the oldest bucket in flight up to 9 times
      (one test moves every pending collective on; a test costs microseconds); between two
      hooks the communication waits. Measured on the benchmark's MLP (2 ranks on 2 shared
      cores): one test per hook left 6-18 ms of waiting at the end of the pass, nine left
      0.1-7.5 ms (32: no better). A helper thread testing every 0.1 ms was starved by the
      backward pass (5 tests in 40 ms on a busy core) and MPICH's own progress thread
      (``MPICH_ASYNC_PROGRESS=1``) slowed the computation it should hide behind.
    - The default reduction is torch's ``allreduce_hook`` fused with the copy into the
      buckets: each gradient is divided by the group's size as it is copied (one pass over
      the gradients less); a registered hook gets the undivided bucket, as in torch.
    - Low precision: a bucket has its parameters' dtype, so float16 (and float32) gradients
      are averaged in that dtype on the wire, as torch does: each rank's gradient is divided
      by the group's size (one rounding), then summed by the backend. The ``"mpi"`` backend
      sums float16 in float32 and rounds once (the average is then within one float16
      rounding of the exact mean of the divided gradients, whatever the number of ranks);
      NCCL sums in float16 rank after rank, as torch's float16 buckets over NCCL. Dividing
      first (torch's order) keeps the sum from overflowing float16's 65504; tiny gradients
      may round to float16's subnormals. For a float32 reduction of float16 gradients, keep
      float32 parameters (master weights) or reduce under :meth:`no_sync` yourself.
    - ``cupy_parallel.grad``/``value_and_grad`` differentiate the arguments they pass (views),
      not ``ddp.params``: take gradients with respect to ``ddp.params`` on a :class:`Tape`.
    - The parameters may be replaced between steps (``ddp.params = new``, a functional update)
      by a pytree of the same structure, shapes, dtypes and devices; nothing is broadcast
      then. A NumPy scalar where a 0-d NumPy array of its dtype was (NumPy's arithmetic on
      0-d arrays returns scalars) is taken as ``numpy.asarray`` of it (see :attr:`params`).
    - Complex parameters (torch's DDP takes them too) get gradients in PyTorch's convention
      (``dL/dRe + i dL/dIm``), averaged as they are: a complex bucket is summed element-wise
      (the real and imaginary parts separately, exactly as pairs of reals; NCCL reduces it so).
      The compression hooks send a complex bucket as its real and imaginary parts in
      float16/bfloat16 (torch casts a complex bucket to ``float16``, dropping the imaginary
      part with a warning).
    - A gradient must live where its parameter does, as a GPU's kernels insist: an array of
      the parameter's type on its device (a NumPy gradient for a ``host:0`` parameter raises
      ``TypeError``, a ``host:1`` one ``ValueError``), in a backward pass and in
      :meth:`reduce_gradients`, which checks every gradient before any bucket starts.

    Args:
        fn: The module function, called as ``fn(params, *inputs, **kwargs)``.
        params: Its parameter pytree; array leaves must be floating-point or complex (other
            leaves are passed through).
        process_group: The group to average over (``None``: the default group).
        bucket_cap_mb: The size cap of a bucket in MiB (with the default, 25, the first
            bucket's is 1 MiB, as torch's without ``bucket_cap_mb``).
        broadcast_params: Broadcast the parameters from the group's first rank (torch's
            ``init_sync``).
        device_ids: torch's ``device_ids``: ``None``, or one device (an int, a name, a
            :class:`~cupy_parallel.Device`) naming where every parameter already is. ``fn``
            runs where its parameters are, so this only checks (``ValueError`` otherwise, as
            torch refuses a CPU module given device ids).
        output_device: torch's ``output_device``: ``None`` or the parameters' device, checked
            the same way (the output is wherever ``fn`` computes it).
        find_unused_parameters: Whether each backward pass exchanges which parameters the
            ranks used, so that one no rank used gets the tape's ``unconnected_gradients``
            value (``None`` for ``"none"``) rather than zeros. Unused parameters are reduced
            with the others either way, so no rank waits (see the decisions above).
        **torch_options: torch's other keywords. Accepted where the behaviour here is theirs
            anyway: ``gradient_as_bucket_view`` (the gradients are always views of the
            buckets), ``static_graph`` and ``check_reduction`` (every pass reduces every
            bucket), ``broadcast_buffers`` (there are no buffers: ``params`` is the whole
            state), ``init_sync=True``, ``dim=0``, ``skip_all_reduce_unused_params=False`` and
            ``None`` for ``mixed_precision``, ``device_mesh``,
            ``delay_all_reduce_named_params`` and ``param_to_hook_all_reduce``. Any other
            value of these is refused with a ``ValueError`` saying why and what to do; an
            unknown keyword is a ``TypeError``.

    Raises:
        TypeError: ``fn`` or ``process_group`` has a wrong type, ``bucket_cap_mb`` is not a
            number, ``broadcast_params`` not a bool, or a parameter is neither floating-point
            nor complex (on every rank).
        ValueError: ``bucket_cap_mb`` is not positive, or the ranks' parameters differ (on
            every rank).
        RuntimeError: No process group is initialised.

    Example:
        >>> import numpy as np
        >>> import cupy_parallel
        >>> from cupy_parallel import distributed as dist, ops
        >>> dist.init_process_group("mpi")  # under `mpiexec -n N` every rank runs this
        >>> ddp = cupy_parallel.DistributedDataParallel(
        ...     lambda p, x: ops.matmul(x, p["w"]), {"w": np.ones((2, 1))}
        ... )
        >>> x = np.full((3, 2), dist.get_rank() + 1.0)  # this rank's shard of the batch
        >>> with cupy_parallel.Tape() as tape:
        ...     loss = ops.mean(ddp(x))
        >>> tape.gradient(loss, ddp.params)  # averaged over the ranks
        {'w': array([[1.], [1.]])}
        >>> dist.destroy_process_group()
    """

    def __init__(
        self,
        fn: Callable[Concatenate[Params, ...], Output],
        params: Params,
        *,
        process_group: Any = None,
        bucket_cap_mb: float = _DEFAULT_CAP_MB,
        broadcast_params: bool = True,
        device_ids: Sequence[Any] | None = None,
        output_device: Any = None,
        find_unused_parameters: bool = False,
        **torch_options: Any,
    ) -> None:
        read_callable(fn, "fn", call="fn(params, *inputs)")
        find_unused_parameters = read_bool(find_unused_parameters, "find_unused_parameters")
        _read_torch_options(torch_options)
        cap = read_real(bucket_cap_mb, "bucket_cap_mb")
        if not cap > 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb!r}.")
        broadcast_params = read_bool(broadcast_params, "broadcast_params")
        if resolve_group(process_group) is None:
            raise ValueError(
                "process_group must be a group this rank is a member of, got "
                "GroupMember.NON_GROUP_MEMBER (a rank outside the group builds no DDP)."
            )
        names, leaves, spec = flatten_with_names(params, "params")
        _check_placement(device_ids, output_device, [leaf for leaf in leaves if is_array(leaf)])
        spec_text, entries, problems = _describe(names, leaves, spec)
        description = (spec_text, entries, cap, broadcast_params, find_unused_parameters)
        _agree("The parameters of DistributedDataParallel", description, problems, process_group)
        self.fn = fn
        self.find_unused_parameters = find_unused_parameters
        self.process_group = process_group
        self.bucket_cap_mb = cap
        self._spec = spec
        self._entries = entries
        self._slots = [k for k, leaf in enumerate(leaves) if is_array(leaf)]
        if not self._slots:  # the same on every rank (they agreed on the structure)
            raise RuntimeError(
                "DistributedDataParallel is not needed when params holds no parameter (no "
                f"array leaf in {spec}): there is no gradient to average (torch raises here "
                "too)."
            )
        self._names = [names[k] for k in self._slots]
        self._arrays = [leaves[k] for k in self._slots]
        cap_bytes = max(1, int(cap * _MIB))
        first = FIRST_BUCKET_BYTES if cap == _DEFAULT_CAP_MB else cap_bytes  # torch's rule
        self._buckets = _assign_buckets(self._arrays, first, cap_bytes)
        self._where: list[tuple[_Bucket, int]] = [None] * len(self._arrays)  # type: ignore[list-item]
        for bucket in self._buckets:
            for slot, i in enumerate(bucket.members):
                self._where[i] = (bucket, slot)
        self._params = params
        self._world = get_world_size(process_group)
        # The buckets' all-reduces run on a communicator of their own (the same ranks): a
        # bucket completes at a point of the backward pass that differs between ranks (a
        # parameter unused on one rank is ready at once there), so on the group's own
        # communicator it would pair with another collective of the pass (nn.functional's
        # backward all-reduce of equal size: each took the other's values, no error).
        pg = resolve_group(process_group)
        assert pg is not None  # a member (checked above)
        self._bucket_group = new_group(
            list(pg.ranks), timeout=pg.live_backend().timeout, use_local_synchronization=True
        )
        # the bookkeeping below is read and written under this lock: threads may share a DDP
        self._lock = threading.Lock()
        self._unsynced = 0  # how many no_sync() blocks are open, in any thread
        # forward calls recorded inside no_sync() since the last reduce_gradients (see
        # __call__): for each, the tapes that recorded it (a tape that ends drops out)
        self._local_forwards: list[weakref.WeakSet[Tape]] = []
        # None: allreduce_hook's reduction, fused with the copy into the buckets
        self._comm_hook: Callable[[Any, GradBucket], Future[Any]] | None = None
        self._comm_state: Any = process_group
        self._backward_ran = False
        self._tapes: weakref.WeakKeyDictionary[Tape, _TapeReduction] = weakref.WeakKeyDictionary()
        if broadcast_params:
            self._broadcast()
        hold(self)  # an optimizer over the arrays has ddp.params read again before its steps

    # -- parameters ----------------------------------------------------------------------

    @property
    def params(self) -> Params:
        """The parameter pytree (the same on every rank once constructed).

        Assigning replaces it (see the class): a pytree of the old one's structure, shapes,
        dtypes and devices. Decision: a NumPy scalar where the old pytree had a 0-d NumPy array
        of its dtype is taken, as ``numpy.asarray(scalar)`` (lossless), because NumPy returns
        scalars from arithmetic on 0-d arrays, so the functional update ``{k: p[k] - lr * g[k]}``
        makes one; ``ddp.params`` is then a copy of the pytree assigned holding that array.
        An optimizer built over arrays the new pytree no longer holds, or holds at another
        leaf (the same arrays swapped), raises ``ValueError`` at its next step (it would move
        arrays this DDP no longer reads there): build it over the new ``ddp.params``, or
        update the parameters in place.
        """
        return self._params

    @params.setter
    def params(self, params: Params) -> None:
        names, leaves, spec = flatten_with_names(params, "params")
        old_spec = str(self._spec)
        same_structure = str(spec) == old_spec  # the leaves line up with the old ones
        if same_structure and self._scalars_as_arrays(leaves):
            params = spec.unflatten(leaves)  # type: ignore[assignment]  # params' structure
        spec_text, entries, problems = _describe(names, leaves, spec)
        if problems:
            raise TypeError(problems[0][1])
        if (spec_text, entries) != (old_spec, self._entries):
            if same_structure:
                self._refuse_non_arrays(names, leaves)
            raise ValueError(
                "New DistributedDataParallel params must have the structure, shapes and dtypes "
                "of the old ones (the buckets are cut for them): "
                f"{_first_difference((old_spec, self._entries), (spec_text, entries))}."
            )
        arrays = [leaves[k] for k in self._slots]
        self._check_ties(arrays)
        for name, array, (bucket, _) in zip(self._names, arrays, self._where, strict=True):
            if device_of(array) != bucket.device:
                raise ValueError(
                    f"New DistributedDataParallel params must stay on the devices of the old "
                    f"ones (the buckets live there), but {name} is on {device_of(array)}, not "
                    f"{bucket.device}; move it back with cupy_parallel.to_device."
                )
        with self._lock:  # a forward in another thread sees the old pair or the new one
            old, self._params, self._arrays = self._arrays, params, arrays
        rebind(old, arrays, "ddp.params")  # an optimizer over the old arrays raises at its step

    def _scalars_as_arrays(self, leaves: list[Any]) -> bool:
        """Turn NumPy scalars at the old 0-d NumPy arrays' places, of their dtype, into arrays.

        ``leaves`` has the old params' structure; returns whether one was turned.
        """
        turned: dict[int, Any] = {}  # id(scalar) -> its array: one scalar at two leaves, one
        for k, old in zip(self._slots, self._arrays, strict=True):
            leaf = leaves[k]
            if (
                isinstance(leaf, np.generic)
                and isinstance(old, np.ndarray)
                and old.ndim == 0
                and leaf.dtype == old.dtype
            ):
                leaves[k] = turned.setdefault(id(leaf), np.asarray(leaf))
        return bool(turned)

    def _check_ties(self, arrays: list[Any]) -> None:
        """Refuse new arrays that untie leaves the old params tied (one array at both)."""
        first: dict[int, int] = {}  # id(old array) -> the first parameter holding it
        for i, old in enumerate(self._arrays):
            j = first.setdefault(id(old), i)
            if j != i and arrays[i] is not arrays[j]:
                a, b = self._names[j], self._names[i]
                raise ValueError(
                    f"{a} and {b} were one array (tied weights), but the new params hold two "
                    "different arrays there: updating each leaf on its own unties them, and "
                    "training drifts from the tied model's. Keep them tied: compute the "
                    "updated array once and put that same array at both leaves, or build a new "
                    "DistributedDataParallel to untie them."
                )

    def _refuse_non_arrays(self, names: list[str], leaves: list[Any]) -> None:
        """Refuse a leaf that is no array where the old params had one, naming it.

        ``leaves`` has the old params' structure.
        """
        for k, old in zip(self._slots, self._arrays, strict=True):
            leaf = leaves[k]
            if is_array(leaf):
                continue
            what = f"{type(leaf).__name__} {leaf!r}"
            hint = "; pass an array there"
            if isinstance(leaf, np.generic):
                what = f"NumPy {leaf.dtype} scalar {leaf!r}"
                hint = (
                    ": NumPy returns scalars from arithmetic on 0-d arrays; wrap it with "
                    f"numpy.asarray (of dtype {old.dtype}) or cupy_parallel.to_device"
                )
            raise ValueError(
                f"New DistributedDataParallel params must have arrays where the old ones had, "
                f"but {names[k]} is a {what} where the old params had an array of shape "
                f"{tuple(old.shape)} and dtype {old.dtype}{hint}."
            )

    def _broadcast(self) -> None:
        """Overwrite the parameters with the group's first rank's, one broadcast per bucket."""
        group = self.process_group
        src = 0 if group is None else get_global_rank(group, 0)
        first = get_rank(group) == 0
        for bucket in self._buckets:
            buffer = empty(bucket.size, bucket.dtype, bucket.device)
            members = [self._arrays[i] for i in bucket.members]
            if first:
                for p, (start, stop) in zip(members, bucket.slices, strict=True):
                    _write(buffer, start, stop, p)
            broadcast(buffer, src, group=group)
            if not first:
                # a tape that recorded on them before construction must not use rank 0's values
                note_overwritten(
                    members, "DistributedDataParallel's broadcast of rank 0's parameters"
                )
                for p, (start, stop) in zip(members, bucket.slices, strict=True):
                    view = _view(buffer, start, stop, p.shape)
                    on_device_of(p, p.__setitem__, Ellipsis, view)

    # -- forward -------------------------------------------------------------------------

    def __call__(self, /, *inputs: Any, **kwargs: Any) -> Output:
        """``fn(params, *inputs, **kwargs)``, its gradients averaged over the group."""
        tapes = [tape for tape in active_tapes() if isinstance(tape, Tape)]
        self._reread_params()
        unreduced = 0
        with self._lock:
            params, arrays, sync = self._params, self._arrays, self._unsynced == 0
            if tapes and not sync:  # one more local forward
                self._local_forwards.append(weakref.WeakSet(tapes))
            elif tapes:  # a reducing forward: the local ones on its tapes are reduced with it
                unreduced = sum(
                    not any(tape in local for tape in tapes) for local in self._local_forwards
                )
                self._local_forwards = []
        if sync and unreduced:
            warnings.warn(_UNREDUCED.format(unreduced), UserWarning, stacklevel=2)
        for tape in tapes:
            tape.watch(arrays)
            if sync:
                self._hook(tape, arrays)
        return self.fn(params, *inputs, **kwargs)

    def _reread_params(self) -> None:
        """Take up entries of ``ddp.params`` rebound in place since the last call.

        ``ddp.params["w"] = w - lr * g`` changes the tree DDP holds without assigning
        :attr:`params`: the forward would compute with the new array while the hooks watch the
        old one (every rank's gradient local, no error). Each call reads the tree again and,
        where an array leaf is not the one registered, takes the tree as an assignment of
        :attr:`params` would (the same checks, the same errors).
        """
        params = self._params
        _, leaves, spec = flatten(params)
        arrays = self._arrays
        if spec == self._spec and all(
            leaves[k] is a for k, a in zip(self._slots, arrays, strict=True)
        ):
            return
        self.params = params

    def _reread_binding(self, ids: set[int], /) -> None:
        """:meth:`_reread_params` if one of the parameters is an array of id in ``ids``.

        Asked by an optimizer over those arrays before its step (``bindings.hold``), so that a
        leaf of ``ddp.params`` replaced since the last forward call lets its array go now, not
        after one more step moved it unread.
        """
        with self._lock:
            arrays = self._arrays
        if any(id(a) in ids for a in arrays):
            self._reread_params()

    def _hook(self, tape: Tape, arrays: list[Any]) -> None:
        """Register the gradient-ready hooks of ``arrays`` on ``tape``, once.

        Under the lock: two threads calling this DDP under one tape (``parallel_apply``) must
        not both find the tape unhooked, or every pass would reduce twice.
        """
        with self._lock:
            found = self._tapes.get(tape)
            if found is not None:
                if found.ids == [id(a) for a in arrays]:
                    return
                raise ValueError(
                    "ddp.params was replaced between two forward calls recorded on one tape: "
                    "replace the parameters between steps, not within one."
                )
            state = _TapeReduction(self, arrays)
            for i, a in enumerate(arrays):
                tape.register_gradient_ready_hook(a, functools.partial(state.ready, i))
            self._tapes[tape] = state

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """A block whose forward calls record no reduction: their gradients stay rank-local.

        For gradient accumulation (torch's ``no_sync``): sum the gradients of ``k``
        micro-batches computed inside, then average the sum once with
        :meth:`reduce_gradients`. As in torch, the flag is read by the forward call, and it is
        the object's, not the thread's: while a ``no_sync`` block is open in any thread, every
        forward call of this DDP records no reduction (the blocks are counted, so blocks of
        two threads that open and close interleaved leave it synchronising afterwards).

        Example:
            >>> import numpy as np
            >>> import cupy_parallel
            >>> from cupy_parallel import distributed as dist, ops
            >>> dist.init_process_group("mpi")
            >>> ddp = cupy_parallel.DistributedDataParallel(
            ...     lambda p, x: ops.sum(ops.multiply(p, x)), np.ones(2)
            ... )
            >>> total = np.zeros(2)
            >>> with ddp.no_sync():
            ...     for x in [np.array([1.0, 2.0]), np.array([3.0, 4.0])]:
            ...         with cupy_parallel.Tape() as tape:
            ...             loss = ddp(x)
            ...         total = total + tape.gradient(loss, ddp.params)
            >>> ddp.reduce_gradients(total)
            array([4., 6.])
            >>> dist.destroy_process_group()
        """
        with self._lock:
            self._unsynced += 1
        try:
            yield
        finally:
            with self._lock:
                self._unsynced -= 1

    # -- reductions outside a backward pass ----------------------------------------------

    def reduce_gradients(self, grads: Tree, /) -> Tree:
        """Average a gradient pytree shaped as ``params`` over the group, in buckets.

        Every rank of the group must call it. Leaves at the parameters' array positions are
        arrays of the parameters' shapes, dtypes and array types, on their devices (``None``
        counts as zeros); the ranks first compare their trees, and a difference raises on
        every rank (``ValueError``; ``TypeError`` for an array of another type), before any
        bucket is reduced.
        The communication hook (:meth:`register_comm_hook`) reduces each bucket.

        Returns:
            The averaged gradients (new arrays) in ``params``' structure; ``None`` where a
            parameter leaf is not an array.

        Example:
            >>> import numpy as np
            >>> import cupy_parallel
            >>> from cupy_parallel import distributed as dist
            >>> dist.init_process_group("mpi")  # outside mpiexec: a world of one
            >>> ddp = cupy_parallel.DistributedDataParallel(lambda p, x: x, {"w": np.ones(2)})
            >>> ddp.reduce_gradients({"w": np.array([1.0, 3.0])})
            {'w': array([1., 3.])}
            >>> dist.destroy_process_group()
        """
        problems: list[tuple[str, str]] = []
        try:  # the structure of params, where a non-array leaf may be anything (gradient's None)
            leaves: list[Any] = self._spec.flatten_up_to(grads)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            leaves = []
            problems.append(
                (
                    "ValueError",
                    (
                        f"grads must have the structure of params {self._spec} (None where a "
                        f"parameter is no array), got {flatten(grads)[2]}."
                    ),
                )
            )
        pairs = zip(self._slots, self._arrays, self._names, self._where, strict=True)
        for k, param, name, (bucket, _) in pairs if leaves else ():
            leaf = leaves[k]
            where = name.replace("params", "grads", 1)
            if leaf is not None and not (
                is_array(leaf) and leaf.shape == param.shape and leaf.dtype == param.dtype
            ):
                what = f"shape {leaf.shape} {leaf.dtype}" if is_array(leaf) else repr(leaf)
                problems.append(
                    (
                        "ValueError",
                        (
                            f"{where} must be None or an array of its parameter's shape "
                            f"{param.shape} and dtype {param.dtype}, got {what}."
                        ),
                    )
                )
                break
            # all checked before any bucket is written or any collective started
            placement = None if leaf is None else _placement_problem(where, name, bucket, leaf)
            if placement is not None:
                problems.append(placement)
                break
        # every rank learns of any rank's problem, so all raise (none waits in a collective)
        _agree("The gradient trees given to reduce_gradients", "", problems, self.process_group)
        # Accepted: the local passes are averaged now. A refused call averaged nothing and
        # leaves them counted, for the next synchronising forward to warn of.
        with self._lock:
            self._local_forwards = []
        reduction = _Reduction(self)
        for i, k in enumerate(self._slots):
            reduction.put(i, leaves[k])
        buffers = reduction.finish()
        result: list[Any] = [None] * len(leaves)
        for i, k in enumerate(self._slots):
            bucket, slot = self._where[i]
            start, stop = bucket.slices[slot]
            result[k] = _view(buffers[bucket.index], start, stop, self._arrays[i].shape)
        return self._spec.unflatten(result)  # type: ignore[return-value]  # params' structure

    def register_comm_hook(self, state: Any, hook: Callable[[Any, GradBucket], Any]) -> None:
        """Reduce each bucket with ``hook(state, bucket)`` (torch's contract).

        ``bucket`` is a :class:`~cupy_parallel.distributed.algorithms.ddp_comm_hooks.GradBucket`
        (``buffer()``, ``index()``, ``is_last()``, ``gradients()``, ``parameters()``); the hook
        starts reducing ``bucket.buffer()`` and returns a future (``wait()``) of the reduced
        flat buffer. ``default_hooks`` ships ``allreduce_hook`` (the default),
        ``fp16_compress_hook`` and ``bf16_compress_hook``; their ``state`` is the process
        group (``None``: the default group). As in torch a hook is registered at most once,
        before the first backward pass. A compression hook is refused at once when its
        group's backend cannot reduce its dtype (an NCCL older than 2.10 has no ``bfloat16``
        sum; the ``"mpi"`` backend sums it in ``float32``), with the backend's own error type.

        The hook's annotations are checked as torch checks them: a ``bucket`` annotation
        other than ``GradBucket``, or a return annotation other than a ``Future`` (any class
        named so: ours, ``concurrent.futures``', torch's; subscripted or not; string
        annotations by their text), raise ``ValueError`` with torch's messages. Decision:
        ``typing.Any`` passes (torch refuses it), since it states nothing wrong. A hook that
        returns no future (an object without ``wait()``) raises ``RuntimeError`` in the backward
        pass, as torch's; the object needs only ``wait()`` (``done()``, where it has one, is
        asked to move the communication on).

        Raises:
            ValueError: The hook's annotations name no ``GradBucket`` or ``Future`` (torch's
                messages).
            TypeError: ``hook`` is not callable, or the compression hook's process group
                (``state``) has a backend that cannot reduce its dtype (the message names
                the hook and the backend).
            NotImplementedError: the same, where the backend says so with that type (NCCL
                older than 2.10 for ``bfloat16``).
            RuntimeError: A hook is registered already, a backward pass ran already, or
                ``bf16_compress_hook`` without a ``bfloat16`` dtype (``ml_dtypes``).

        Example:
            >>> import numpy as np
            >>> import cupy_parallel
            >>> from cupy_parallel import distributed as dist
            >>> from cupy_parallel.distributed.algorithms.ddp_comm_hooks import default_hooks
            >>> dist.init_process_group("mpi")
            >>> ddp = cupy_parallel.DistributedDataParallel(lambda p, x: x, np.ones(2))
            >>> ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
            >>> ddp.reduce_gradients(np.array([1.0, 1.0 / 3.0]))
            array([1.        , 0.33325195])
            >>> dist.destroy_process_group()
        """
        hook = read_callable(hook, "hook", call="hook(state, bucket)")
        _check_annotations(hook)
        if hook in _COMPRESSED:  # raise now, not in the middle of a backward pass
            _check_compression(hook, _COMPRESSED[hook](), state)
        with self._lock:  # a reduction starting in another thread takes the old hook or this
            if self._comm_hook is not None:
                raise RuntimeError(
                    "register_comm_hook can only be called once (as in torch): a communication "
                    "hook is registered already."
                )
            if self._backward_ran:
                raise RuntimeError(
                    "register_comm_hook must be called before the first backward pass (as in "
                    "torch), but gradients were reduced already."
                )
            self._comm_hook, self._comm_state = hook, state

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Refuse pickling and copying (``copy``/``deepcopy`` come here too).

        A DDP holds its process group, its hooks on live tapes and its buckets; none of that
        can be saved or duplicated (a copy would share the group but not the tapes' hooks).
        """
        raise TypeError(
            "A DistributedDataParallel cannot be pickled or copied (it holds a process group "
            "and hooks on live tapes). To checkpoint, save ddp.params (its arrays, e.g. with "
            "numpy.savez); to restart, build a new DistributedDataParallel from the "
            "loaded params."
        )

    def __repr__(self) -> str:
        name = getattr(self.fn, "__name__", type(self.fn).__name__)
        return (
            f"DistributedDataParallel({name}, parameters={len(self._arrays)}, "
            f"buckets={len(self._buckets)}, bucket_cap_mb={self.bucket_cap_mb:g})"
        )


def _named(annotation: Any, name: str) -> bool:
    """Whether ``annotation`` is (a subscript of) a class called ``name``, or says so in text."""
    if isinstance(annotation, str):
        text = annotation.strip().strip("'\"")  # a quoted annotation under postponed evaluation
        return text.split("[", 1)[0].strip().rsplit(".", 1)[-1] in (name, "Any")
    if annotation is Any:  # states nothing wrong (torch refuses it too; we take it)
        return True
    origin = getattr(annotation, "__origin__", annotation)
    return isinstance(origin, type) and origin.__name__ == name


def _check_annotations(hook: Callable[..., Any]) -> None:
    """Check the bucket's and the result's annotations, if any (torch's ``_check_comm_hook``)."""
    try:
        signature = inspect.signature(hook)
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check
        return
    parameters = list(signature.parameters.values())
    bucket = signature.parameters.get("bucket", parameters[1] if len(parameters) > 1 else None)
    annotation = inspect.Parameter.empty if bucket is None else bucket.annotation
    if annotation is not inspect.Parameter.empty and not _named(annotation, "GradBucket"):
        raise ValueError(
            "Communication hook: bucket annotation should be GradBucket "
            "(cupy_parallel.distributed.algorithms.ddp_comm_hooks.GradBucket), got "
            f"{annotation!r}."
        )
    result = signature.return_annotation
    if result is not inspect.Signature.empty and not _named(result, "Future"):
        raise ValueError(
            "Communication hook: return annotation should be Future (a future of the reduced "
            f"bucket, e.g. work.get_future()), got {result!r}."
        )


def _check_compression(hook: Callable[..., Any], dtype: Any, group: Any) -> None:
    """Refuse a compression ``hook`` whose group's backend cannot sum arrays of ``dtype``.

    The backend says what it reduces (``check_dtype``, which every collective asks first); a
    refusal is raised again naming the hook and the backend (torch's gloo refuses
    ``bf16_compress_hook`` at registration too).
    """
    try:
        pg = resolve_group(group)  # the hook's state: its process group
    except TypeError as error:
        raise TypeError(
            f"state is the process group {hook.__name__} reduces over: {error}"
        ) from None
    if pg is None:  # not a member: the hook's all_reduce does nothing
        return
    backend = pg.live_backend()
    try:
        backend.check_dtype(dtype, ReduceOp.SUM)
    except (TypeError, NotImplementedError) as error:
        raise type(error)(
            f"{hook.__name__} reduces each bucket in {dtype}, which the "
            f"{backend.backend.value!r} backend of process group {pg.name!r} cannot reduce "
            f"({str(error).rstrip('.')}); use fp16_compress_hook, the default allreduce_hook, "
            "or a backend that reduces it (the MPI backend and NCCL >= 2.10 reduce bfloat16)."
        ) from error
