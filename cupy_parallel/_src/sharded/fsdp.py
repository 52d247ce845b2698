"""``FullyShardedDataParallel``: parameters, gradients and optimizer state sharded over the ranks.

The counterpart of torch's FSDP2 (``fully_shard``, ZeRO-3) for a module that is a pure function
``fn(params, *inputs)``. Every parameter is cut along dimension 0 into one shard per rank; a rank
keeps only its shard (and an optimizer stepping ``fsdp.params`` keeps state for it only). The
top-level entries of ``params`` (a dict's values, a list's or tuple's items) are the **units**:
the forward call hands ``fn`` a mapping (or sequence) that gathers a unit, with one flat
all-gather per dtype, when ``fn`` first reads it.

How it is differentiated: the gather is recorded on the tape as one node per unit, whose adjoint
is the all-gather's, a reduce-scatter (``nn.functional``'s pair), started asynchronously as soon
as the pass has summed the unit's gradients; each rank gets the average over the group of its
rows. So ``tape.gradient(loss, fsdp.params)`` returns this rank's gradient shards, equal to the
rows of :class:`~cupy_parallel.DistributedDataParallel`'s averaged gradients.

Memory (``reshard_after_forward=True``, FSDP's FULL_SHARD): once ``fn`` holds a unit no more (it
reads another unit, or returns), the unit's gathered arrays are swapped out of the tape
(:func:`~cupy_parallel._src.recording.swap_out`: the tape's nodes keep stand-ins, and the
backward pass gathers the unit again, once, at the last node that holds its arrays, on every
rank whether or not a gradient reached that node there), so a rank holds its shards plus the
units in use (and the one prefetched). ``False`` (SHARD_GRAD_OP) keeps them until
the tape is released.

Layout (FSDP2's): a parameter of ``n`` rows on ``W`` ranks has shards of ``c = ceil(n / W)``
rows: rank ``r`` holds rows ``r*c : (r+1)*c``, zero rows past ``n`` (padding; a rank past the
end holds only padding). A 0-d parameter is a one-row vector: rank 0 holds it. A unit's shards of
one dtype (and device) are views of one flat buffer (the reduce-scatter's output). The gather
receives each shard where its rows go in a buffer that holds the parameters one after another,
so each full parameter is a view of it, nothing copied out (FSDP2 gathers the flat shard and
copies each parameter out: 5-8 % of the step here, see
:meth:`FullyShardedDataParallel._issue`).
"""

from __future__ import annotations

import hashlib
import math
import sys
import threading
import weakref
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Generic

from cupy_parallel._src.arguments import read_bool, read_callable, read_int
from cupy_parallel._src.arrays import array_namespace, device_of, empty, is_array, shares_memory
from cupy_parallel._src.arraytypes import Output, Params
from cupy_parallel._src.checkpoint.shard import Shard
from cupy_parallel._src.compute import on_device_of, zeros_like
from cupy_parallel._src.ddp import _agree
from cupy_parallel._src.distributed.exchanges import (
    all_gather_coalesced_unchecked,
    all_gather_into_tensor,
)
from cupy_parallel._src.distributed.groups import (
    get_global_rank,
    get_rank,
    get_world_size,
    resolve_group,
)
from cupy_parallel._src.distributed.objects import _buffer, _host, all_gather_object
from cupy_parallel._src.distributed.reductions import reduce_scatter_tensor
from cupy_parallel._src.distributed.rooted import gather, scatter
from cupy_parallel._src.enums import ReduceOp
from cupy_parallel._src.hostarray import HostArray, host_array, host_buffer, plain_buffer
from cupy_parallel._src.optim.clip import mark_sharded_gradients
from cupy_parallel._src.recording import (
    active_tapes,
    backward_schedule,
    mark_collective,
    mark_shapes_only,
    node_count,
    pause_recording,
    record,
    swap_out,
)
from cupy_parallel._src.tape import Tape
from cupy_parallel._src.tree import flatten_with_names

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from cupy_parallel._src.recording import Swap

__all__ = ["FullyShardedDataParallel", "is_shard"]

_SHARDS: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
"""Every live FullyShardedDataParallel's shards (the leaves of its ``params``), by id."""


def is_shard(x: Any) -> bool:
    """Whether ``x`` is a leaf of a live :class:`FullyShardedDataParallel`'s ``params``."""
    return _SHARDS.get(id(x)) is x


# --------------------------------------------------------------------------------------------
# Layout


class _Param:
    """One array leaf of a unit: its full shape, its rows per rank, its place in a flat shard."""

    __slots__ = ("c", "name", "offset", "rest", "rows", "shape", "width")

    def __init__(self, name: str, shape: tuple[int, ...], world: int) -> None:
        self.name = name
        self.shape = shape
        self.rows = shape[0] if shape else 1  # a 0-d parameter is one row
        self.rest = shape[1:]
        self.width = math.prod(self.rest)  # elements per row
        self.c = -(-self.rows // world)  # rows per rank (ceil): FSDP2's chunks, padded
        self.offset = 0  # in its group's flat shard, set by _Group

    @property
    def shard_shape(self) -> tuple[int, ...]:
        return (self.c, *self.rest)

    def real_rows(self, rank: int) -> int:
        """How many of rank ``rank``'s ``c`` rows are rows of the parameter (not padding)."""
        return max(0, min(self.c, self.rows - rank * self.c))


class _Group:
    """A unit's parameters of one dtype and device: one flat shard, one all-gather."""

    __slots__ = ("device", "dtype", "members", "size")

    def __init__(self, members: list[_Param], dtype: Any, device: Any) -> None:
        self.members = members
        self.dtype = dtype
        self.device = device
        start = 0
        for p in members:
            p.offset = start
            start += p.c * p.width
        self.size = start  # elements per rank


class _Unit:
    """A top-level entry of ``params``: its structure, parameters (by group) and shards."""

    __slots__ = ("groups", "key", "leaves", "name", "params", "shards", "slots", "spec")

    def __init__(self, key: Any, name: str, tree: Any, world: int) -> None:
        self.key = key
        self.name = name
        names, leaves, spec = flatten_with_names(tree, name)
        self.spec = spec
        self.slots = [k for k, leaf in enumerate(leaves) if is_array(leaf)]
        # the non-array leaves are handed to fn as they are; the arrays are not kept
        self.leaves = [None if is_array(leaf) else leaf for leaf in leaves]
        self.params = [_Param(names[k], tuple(leaves[k].shape), world) for k in self.slots]
        by_kind: dict[Any, list[int]] = {}
        for i, k in enumerate(self.slots):
            a = leaves[k]
            by_kind.setdefault((a.dtype, device_of(a), type(a)), []).append(i)
        self.groups = [
            (_Group([self.params[i] for i in members], dtype, device), members)
            for (dtype, device, _), members in by_kind.items()
        ]
        self.shards: list[Any] = [None] * len(self.params)

    def tree(self, arrays: list[Any]) -> Any:
        """The unit's structure with ``arrays`` at its array leaves."""
        leaves = list(self.leaves)
        for k, a in zip(self.slots, arrays, strict=True):
            leaves[k] = a
        return self.spec.unflatten(leaves)


def _flat_view(buffer: Any, start: int, stop: int, shape: tuple[int, ...]) -> Any:
    """``buffer[start:stop]`` shaped ``shape``, of the buffer's own array type (a view)."""
    if type(buffer) is HostArray:
        return host_array(host_buffer(buffer)[start:stop].reshape(shape), buffer.device)
    return buffer[start:stop].reshape(shape)


def _blocks(buffer: Any, group: _Group, p: _Param, world: int) -> Any:
    """Parameter ``p``'s rows in a gathered flat buffer of ``group``: shape ``(W, c, *rest)``.

    A view (``buffer`` plain, NumPy or CuPy): rank ``r``'s chunk of the buffer holds ``p``'s
    ``c`` rows at ``p.offset``.
    """
    table = buffer.reshape(world, group.size)
    return table[:, p.offset : p.offset + p.c * p.width].reshape(world, p.c, *p.rest)


def _pack(buffer: Any, group: _Group, arrays: list[Any], world: int, divisor: int | None) -> None:
    """Write full arrays (``None``: zeros) into a flat buffer of ``W`` padded chunks, on its device.

    ``divisor``: each value divided by it as it is copied (the gradient average, rounded once
    in the dtype as DDP's ``allreduce_hook``).
    """
    raw = plain_buffer(buffer)
    divide = array_namespace(raw).divide

    def write() -> None:
        for p, a in zip(group.members, arrays, strict=True):
            blocks = _blocks(raw, group, p, world)
            src = None if a is None else plain_buffer(a).reshape(p.rows, *p.rest)
            for r in range(world):
                n = p.real_rows(r)
                if src is None or n == 0:
                    blocks[r] = 0
                    continue
                block, rows = blocks[r], src[r * p.c : r * p.c + n]
                if divisor is None:
                    block[:n] = rows
                else:  # one pass: divided as copied, rounded once in the buffer's dtype
                    divide(rows, divisor, out=block[:n], dtype=block.dtype)
                if n < p.c:
                    block[n:] = 0

    on_device_of(raw, write)


def _gathered_rows(out: Any, group: _Group, p: _Param, world: int) -> list[Any]:
    """Rank ``r``'s rows of ``p`` in a gathered buffer laid out parameter by parameter."""
    start, rows = world * p.offset, p.c * p.width
    return [
        _flat_view(out, start + r * rows, start + (r + 1) * rows, p.shard_shape)
        for r in range(world)
    ]


def _unpack(out: Any, group: _Group, world: int) -> tuple[list[Any], list[Any]]:
    """The full arrays of ``group`` in its gathered buffer, views; and their memory's owner.

    The buffer holds the parameters one after another, each as its ``W * c`` rows (padding
    last), so each full parameter is its first ``n`` rows: a view, nothing copied (see
    :meth:`FullyShardedDataParallel._issue`).
    """
    fulls = [
        _flat_view(out, world * p.offset, world * p.offset + p.rows * p.width, p.shape)
        for p in group.members
    ]
    return fulls, [out]


def _copied_out(out: Any, group: _Group, world: int) -> list[Any]:
    """The full arrays of a buffer gathered rank after rank (a flat all-gather), new arrays."""
    raw = plain_buffer(out)
    fulls = []
    for p in group.members:
        full = empty(p.shape, group.dtype, group.device)
        dst = plain_buffer(full).reshape(p.rows, *p.rest)
        blocks = _blocks(raw, group, p, world)

        def copy(dst: Any = dst, blocks: Any = blocks, p: _Param = p) -> None:
            for r in range(world):
                n = p.real_rows(r)
                if n:
                    dst[r * p.c : r * p.c + n] = blocks[r, :n]

        on_device_of(raw, copy)
        fulls.append(full)
    return fulls


# --------------------------------------------------------------------------------------------
# What the tape records


IN_FLIGHT = 1
"""How many reduce-scatters a backward pass keeps in flight: issuing one more waits for the oldest
and frees its send buffer (a unit's size), so the pass holds at most this many. One, as FSDP2:
a unit's reduce-scatter runs while the backward pass computes the next unit's gradients."""


class _Flight:
    """One reduce-scatter in flight: its work and send buffer (freed once waited), its output."""

    __slots__ = ("out", "send", "trace", "unit", "work")

    def __init__(self, work: Any, send: Any, out: Any, unit: int, trace: list[Any] | None):
        self.work, self.send, self.out, self.unit, self.trace = work, send, out, unit, trace

    def finish(self) -> None:
        """Wait for it (once) and drop the send buffer."""
        work, self.work, self.send = self.work, None, None
        if work is not None:
            work.wait()
            if self.trace is not None:
                self.trace.append(("reduce_scatter waited", self.unit))


class _Pending:
    """The reduce-scatters a unit's gathers started in a backward pass, waited by its alias node."""

    __slots__ = ("flights", "gathers", "lock", "world")

    def __init__(self, world: int) -> None:
        self.world = world
        self.lock = threading.Lock()
        self.flights: list[_Flight] = []
        self.gathers = 0  # gathers recorded on the unit's alias: more than one add up there

    def wait(self) -> None:
        with self.lock:
            flights, self.flights = self.flights, []
        for flight in flights:
            flight.finish()


class _Gathered:
    """One recorded gather of a unit (the aux of its node): what its adjoint and a swap need.

    Never holds the gathered arrays once the forward pass is done with them: ``owners`` is
    dropped when they are swapped out, and ``restored`` lives for one backward pass.
    """

    __slots__ = ("first", "fsdp", "owners", "pending", "restored", "unit")

    def __init__(self, fsdp: FullyShardedDataParallel[Any, Any], unit: int, pending: _Pending):
        self.fsdp = fsdp
        self.unit = unit
        self.pending = pending
        self.owners: list[Any] | None = None
        self.first: dict[Tape, int] = {}
        self.restored: list[Any] | None = None

    def restore(self) -> list[Any]:
        """The unit's gathered owners again (one all-gather per dtype), once per pass."""
        if self.restored is None:
            fsdp = self.fsdp
            outs = fsdp._issue(self.unit, "regather")
            # the reduce-scatter in flight ends (its send buffer freed) before the unit is
            # unpacked: the pass holds two units' worth of buffers, not three
            fsdp._finish_flights()
            self.restored = _wait_and_unpack(fsdp._units[self.unit], outs, fsdp._world)[1]
        return self.restored


def _alias_kernel(x: Any) -> Any:
    return x.view()


def _alias(x: Any) -> Any:
    """A new array object viewing ``x``'s memory (the tape knows arrays by identity)."""
    if type(x) is HostArray:
        return host_array(host_buffer(x).view(), x.device)
    return on_device_of(x, _alias_kernel, x)


def _alias_vjp(gs: list[Any], xs: Any, needs: Any, ys: Any, aux: Any) -> Any:
    """The identity, once the unit's reduce-scatters of this pass are complete.

    Recorded when a forward call starts, so the pass runs it after every gather of the call:
    the reduce-scatters overlap the rest of the backward pass, and the gradients are final
    before anything adds to them.
    """
    aux.wait()
    if aux.world > 1:  # the shards' final gradients: clip_grad_norm then asks for the group
        mark_sharded_gradients([g for g in gs if g is not None])
    return tuple(gs)


def _gather_vjp(gs: list[Any], xs: Any, needs: Any, ys: Any, gathered: _Gathered) -> Any:
    """The all-gather's adjoint: a reduce-scatter of the averaged gradients, started now."""
    for tape in active_tapes():
        if any(tape.tracks(x) for x in xs):
            raise NotImplementedError(
                "FullyShardedDataParallel's gradients cannot be differentiated again: a "
                "gradient() is computed while an outer tape tracks the parameters (torch's FSDP "
                "has no double backward either)."
            )
    fsdp = gathered.fsdp
    gathered.restored = None  # the unit's last node in this pass: its gathered arrays go
    unit = fsdp._units[gathered.unit]
    world = fsdp._world
    grads: list[Any] = [None] * len(unit.params)
    for group, members in unit.groups:
        send = empty(world * group.size, group.dtype, group.device)
        _pack(send, group, [gs[i] for i in members], world, world if world > 1 else None)
        out = empty(group.size, group.dtype, group.device)
        work = None
        if group.size:
            work = reduce_scatter_tensor(out, send, ReduceOp.SUM, fsdp.process_group, async_op=True)
        flight = _Flight(work, send, out, gathered.unit, fsdp._trace)
        del send
        if gathered.pending.gathers > 1:
            # the unit was gathered twice in one forward call: the pass adds this gradient
            # to the other gather's at the alias, so it must be final now
            flight.finish()
        else:
            with gathered.pending.lock:
                gathered.pending.flights.append(flight)
            fsdp._in_flight(flight)
        for i, p in zip(members, group.members, strict=True):
            grads[i] = _flat_view(out, p.offset, p.offset + p.c * p.width, p.shard_shape)
    if fsdp._trace is not None:
        fsdp._trace.append(("reduce_scatter issued", gathered.unit))
    return tuple(grads)


mark_collective(_gather_vjp)
mark_shapes_only(_gather_vjp)


def _references_outside(swaps: list[Swap], owners: list[Any]) -> bool:
    """Whether anything besides the swaps still holds an array they took out of the tapes.

    What matters is the arrays the tapes recorded (the gathered arrays and the views recorded
    of them): one still referenced elsewhere (``fn`` keeping the unit, its output, a global)
    could be used in an operation recorded later, whose gradient would not reach the swapped
    nodes; the swaps are then undone. Counted (CPython's reference counts): an array's
    references from its swaps' records, from ``owners`` and from the recorded views whose
    ``base`` it is; any other is from elsewhere.
    """
    objects: dict[int, Any] = {}
    internal: dict[int, int] = {}
    for a in [r.original for swap in swaps for r in swap.rebuilds.values()]:
        objects[id(a)] = a
        internal[id(a)] = internal.get(id(a), 0) + 1
    for a in owners:
        if id(a) in internal:
            internal[id(a)] += 1
    for a in objects.values():
        base = None if type(a) is HostArray else getattr(a, "base", None)
        if base is not None and id(base) in internal:
            internal[id(base)] += 1
    a = base = None  # only `objects` holds them now (one reference each; none recorded: none)
    return any(_count(objects, k) - 1 > held for k, held in internal.items())


def _count(objects: dict[int, Any], k: int) -> int:
    """References to ``objects[k]`` besides this call's own (its argument, the lookup)."""
    return sys.getrefcount(objects[k]) - 1


# --------------------------------------------------------------------------------------------
# One forward call


class _Call:
    """A forward call's state: gathered units, the prefetch in flight, the order of reads."""

    def __init__(self, fsdp: FullyShardedDataParallel[Any, Any], tapes: list[Tape]) -> None:
        self.fsdp = fsdp
        self.tapes = tapes
        n = len(fsdp._units)
        self.cache: list[tuple[list[Any], _Gathered | None] | None] = [None] * n
        self.inflight: dict[int, list[tuple[Any, Any]]] = {}
        self.order: list[int] = []
        self.gathers: list[int] = []  # every unit gathered for fn, in order (the ranks compare)
        self.pending = [_Pending(fsdp._world) for _ in range(n)]
        self.aliases: list[list[Any] | None] = [None] * n
        self.live: list[_Gathered] = []  # gathers whose arrays are not swapped out yet
        self.recorded: list[_Gathered] = []  # every gather recorded, in order (ranks compare)
        self.swaps: dict[int, list[Swap]] = {}  # id(gathered) -> its committed swaps
        self.closed = False
        self.lock = threading.RLock()
        self.starts = [node_count(tape) for tape in tapes]  # where the call's nodes begin
        if tapes:  # every unit's alias node first: the pass runs them after all gathers
            for u, unit in enumerate(fsdp._units):
                if unit.shards:
                    aliases = [_alias(s) for s in unit.shards]
                    record(_alias_vjp, tuple(unit.shards), tuple(aliases), self.pending[u])
                    self.aliases[u] = aliases

    def get(self, u: int) -> Any:
        """Unit ``u``'s gathered tree (gathering it, or the cached arrays of this call)."""
        fsdp = self.fsdp
        with self.lock:
            if self.closed:
                raise RuntimeError(
                    "The parameters FullyShardedDataParallel hands fn are gathered during the "
                    "forward call only: fn read one after returning (keep the arrays it needs, "
                    "not the mapping)."
                )
            cached = self.cache[u]
            if cached is not None:
                return fsdp._units[u].tree(cached[0])
            if fsdp.reshard_after_forward:  # first the units fn read before (and let go of)
                self._reshard(keep=u)
            first = u not in self.order
            if first:
                self.order.append(u)
            self.gathers.append(u)
            outs = self.inflight.pop(u, None)
            if outs is None:
                outs = fsdp._issue(u, "all_gather")
            if first:
                self._prefetch_after(u)
            fulls, owners = _wait_and_unpack(fsdp._units[u], outs, fsdp._world)
            del outs  # the buffers live on in owners only
            if fsdp._trace is not None:
                fsdp._trace.append(("all_gather waited", u))
            fulls = _in_leaf_order(fsdp._units[u], fulls)
            gathered = self._record(u, fulls, owners)
            del owners
            self.cache[u] = (fulls, gathered)
            return fsdp._units[u].tree(fulls)

    def _record(self, u: int, fulls: list[Any], owners: list[Any]) -> _Gathered | None:
        if not self.tapes or not fulls:
            return None
        gathered = _Gathered(self.fsdp, u, self.pending[u])
        gathered.owners = owners
        for tape in self.tapes:
            gathered.first[tape] = node_count(tape)
        aliases = self.aliases[u]
        assert aliases is not None
        self.pending[u].gathers += 1
        record(_gather_vjp, tuple(aliases), tuple(fulls), gathered)
        self.live.append(gathered)
        self.recorded.append(gathered)
        return gathered

    def _prefetch_after(self, u: int) -> None:
        """Start the all-gather of the unit expected after ``u`` (forward prefetch)."""
        order = self.fsdp._order
        if u not in order:
            return
        for v in order[order.index(u) + 1 :]:
            if v not in self.order and v not in self.inflight:
                self.inflight[v] = self.fsdp._issue(v, "prefetch")
                return

    def _reshard(self, keep: int | None) -> None:
        """Swap out of the tapes the gathered arrays of every unit but ``keep`` fn holds no more."""
        for u in range(len(self.cache)):
            cached = self.cache[u]
            if u == keep or cached is None:
                continue
            self.cache[u] = None  # a later read gathers again
            del cached
        self.live = [g for g in self.live if g.unit == keep or not self._swap(g)]

    def _swap(self, gathered: _Gathered) -> bool:
        owners = gathered.owners
        assert owners is not None
        swaps: list[Swap] = []
        for tape in self.tapes:
            swap = swap_out(tape, gathered.first[tape], owners, gathered.restore)
            if swap is None:
                for done in swaps:
                    done.undo(owners)
                return False
            swaps.append(swap)
        gathered.owners = None
        if _references_outside(swaps, owners):
            for swap in swaps:
                swap.undo(owners)
            gathered.owners = owners
            return False
        for swap in swaps:
            swap.commit()
        self.swaps[id(gathered)] = swaps
        if self.fsdp._trace is not None:
            self.fsdp._trace.append(("resharded", gathered.unit))
        return True

    def close(self) -> None:
        """After ``fn`` returned: drop the prefetch fn did not read, reshard what is left."""
        with self.lock:
            self.closed = True
            for outs in self.inflight.values():
                for _, work in outs:
                    if work is not None:
                        work.wait()
            self.inflight = {}
            if self.fsdp.reshard_after_forward:
                self._reshard(keep=None)
            self.cache = [None] * len(self.cache)
            self.live = []


def _wait_and_unpack(
    unit: _Unit, outs: list[tuple[Any, Any]], world: int
) -> tuple[list[Any], list[Any]]:
    """Wait for a unit's all-gathers; its full arrays (group after group) and their owners."""
    fulls, owners = [], []
    for (group, _), (out, work) in zip(unit.groups, outs, strict=True):
        if work is not None:
            work.wait()
        f, o = _unpack(out, group, world)
        fulls.extend(f)
        owners.extend(o)
    return fulls, owners


def _in_leaf_order(unit: _Unit, by_group: list[Any]) -> list[Any]:
    """Arrays listed group after group, put back in the unit's parameter order."""
    result: list[Any] = [None] * len(unit.params)
    it = iter(by_group)
    for _, members in unit.groups:
        for i in members:
            result[i] = next(it)
    return result


class _UnitsMapping(Mapping[Any, Any]):
    """What ``fn`` gets for a dict of units: reading a key gathers that unit."""

    def __init__(self, call: _Call, keys: list[Any]) -> None:
        self._call = call
        self._index = {k: i for i, k in enumerate(keys)}

    def __getitem__(self, key: Any) -> Any:
        return self._call.get(self._index[key])

    def __contains__(self, key: object) -> bool:  # without gathering
        return key in self._index

    def __iter__(self) -> Iterator[Any]:
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._index)

    def __repr__(self) -> str:
        return f"<FSDP units {list(self._index)!r}, gathered when read>"


class _UnitsSequence(Sequence[Any]):
    """What ``fn`` gets for a list or tuple of units: reading an item gathers that unit."""

    def __init__(self, call: _Call, count: int) -> None:
        self._call = call
        self._count = count

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self._call.get(i) for i in range(self._count)[index]]
        i = read_int(index, "index")
        if not -self._count <= i < self._count:
            raise IndexError(f"unit index {i} out of range for {self._count} units")
        return self._call.get(i % self._count)

    def __len__(self) -> int:
        return self._count

    def __repr__(self) -> str:
        return f"<FSDP {self._count} units, gathered when read>"


# --------------------------------------------------------------------------------------------
# FullyShardedDataParallel


class FullyShardedDataParallel(Generic[Params, Output]):
    r"""A module function whose parameters are sharded over a process group (FSDP2, ZeRO-3).

    Every rank of the group builds one with parameters of the same structure, shapes and
    dtypes, and calls it on its own shard of the batch. ``params`` is a dict (or list, or
    tuple) of **units**; ``fsdp(*inputs, **kwargs)`` calls ``fn(units, *inputs, **kwargs)``
    where ``units`` is a mapping (or sequence) that gathers a unit when ``fn`` reads it, and
    ``tape.gradient(loss, fsdp.params)`` returns this rank's gradient shards, averaged over the
    group (see the module for how).

    Decisions:

    - **Layout** (FSDP2's): along dimension 0, ``ceil(n / W)`` rows per rank, the last ranks
      padded with zero rows (see the module). ``fsdp.params`` holds the padded shards (every
      rank's of one shape); the padding's values are never read and its gradient is zero, so
      an optimizer keeps it at zero. A **0-d** parameter is a one-row vector whose row rank 0
      holds. :meth:`sharded_params` gives the unpadded rows as
      :class:`~cupy_parallel._src.checkpoint.shard.Shard`\ s.
    - Construction takes every rank's shard from the group's first rank's values (one scatter
      per unit and dtype), as DDP broadcasts: ranks start from one model. The ranks first
      compare structure, shapes, dtypes and array types (an error on every rank otherwise).
    - **Tied weights** are refused: one array (or two views of one memory) at two leaves
      raises ``ValueError`` naming both (sharding copies them apart; tie them inside ``fn``
      by reading the one parameter twice).
    - ``fn`` must read the units in the same order on every rank (each first read is a
      collective, as each module's forward is in torch's FSDP), and record the same
      operations. The ranks compare their reads when ``fn`` returns (one object all-gather
      a call): different units read on different ranks raise ``ValueError`` on every rank
      (torch's FSDP would exchange the two units' shards, silently). A unit read twice is
      gathered once while ``fn`` keeps reading it; with ``reshard_after_forward`` it is
      gathered again when read after another unit (two gathers on the tape; the gradients add
      up). A unit no rank reads is not gathered.
    - **Prefetch**: when ``fn`` first reads a unit, the all-gather of the unit expected next
      (the previous call's order of reads; the units' order at the first call) is issued
      before the unit is returned, so it runs while ``fn`` computes.
    - **Gradients**: every shard gets one, zeros for a unit no gradient reached (DDP's rule:
      ``unconnected_gradients`` does not apply to the parameters). The reduce-scatter of a unit
      starts in the backward pass as soon as the pass has summed the unit's gradients (its
      gather's adjoint: the gathered arrays are recorded results, whose gradients are final
      exactly there; the tape's gradient-ready hook is on the shards, which fills the zeros).
      One is in flight at a time (FSDP2's choice): it is waited when the next one starts, or
      (FULL_SHARD) when the next unit is gathered again, before that unit is unpacked, so the
      backward pass holds two units' buffers at most. The gradients cannot be differentiated
      again (``NotImplementedError``, as DDP).
    - **Resharding** (``reshard_after_forward=True``): a unit's gathered arrays leave the tape
      once ``fn`` holds none of them (checked by reference counts: a unit ``fn`` keeps, returns
      or stores stays gathered, so nothing recorded on it is lost); the backward pass gathers it
      again at the last operation that used it, on every rank (whether or not that rank's loss
      uses the result). Where a rank recorded operations the others did not (a statistic
      logged on rank 0) and that moves a re-gather among the backward pass's collectives, the
      call's units stay gathered on every rank. A ``Tape(check_writes=True)`` keeps them (it
      fingerprints their bytes).
    - ``fsdp.params`` is updated in place (any :mod:`cupy_parallel.optim` optimizer does);
      it cannot be replaced.

    Args:
        fn: The module function, called as ``fn(units, *inputs, **kwargs)``.
        params: A dict, list or tuple of units (each a pytree; array leaves floating-point or
            complex, other leaves handed to ``fn`` as they are).
        process_group: The group to shard over (``None``: the default group).
        reshard_after_forward: Free each unit's gathered parameters after the forward pass
            (FULL_SHARD); ``False`` keeps them to the backward pass (SHARD_GRAD_OP).

    Raises:
        TypeError: ``fn`` is not callable, ``params`` is not a dict, list or tuple,
            ``reshard_after_forward`` is not a bool, or a parameter is neither floating-point
            nor complex (on every rank).
        ValueError: The ranks' parameters differ, or two leaves share memory (on every rank).

    Example:
        >>> import numpy as np
        >>> import cupy_parallel
        >>> from cupy_parallel import distributed as dist, ops
        >>> dist.init_process_group("mpi")  # under `mpiexec -n N` every rank runs this
        >>> fsdp = cupy_parallel.FullyShardedDataParallel(
        ...     lambda units, x: ops.matmul(x, units["layer"]["w"]),
        ...     {"layer": {"w": np.ones((2, 1))}},
        ... )
        >>> x = np.full((3, 2), dist.get_rank() + 1.0)  # this rank's shard of the batch
        >>> with cupy_parallel.Tape() as tape:
        ...     loss = ops.mean(fsdp(x))
        >>> tape.gradient(loss, fsdp.params)  # this rank's rows, averaged over the ranks
        {'layer': {'w': array([[1.], [1.]])}}
        >>> dist.destroy_process_group()
    """

    def __init__(
        self,
        fn: Callable[..., Output],
        params: Params,
        *,
        process_group: Any = None,
        reshard_after_forward: bool = True,
    ) -> None:
        read_callable(fn, "fn", call="fn(units, *inputs)")
        reshard_after_forward = read_bool(reshard_after_forward, "reshard_after_forward")
        if isinstance(params, Mapping):
            keys: list[Any] = list(params)
            values = [params[k] for k in keys]
            names = [f"params[{k!r}]" for k in keys]
        elif isinstance(params, list | tuple):
            keys, values = list(range(len(params))), list(params)
            names = [f"params[{i}]" for i in keys]
        else:
            raise TypeError(
                "params must be a dict, list or tuple of units (its entries are gathered one "
                f"at a time), got {type(params).__name__}; for one unit pass {{'unit': params}}."
            )
        if resolve_group(process_group) is None:
            raise ValueError(
                "process_group must be a group this rank is a member of, got "
                "GroupMember.NON_GROUP_MEMBER (a rank outside the group builds no FSDP)."
            )
        world = get_world_size(process_group)
        self._units = [
            _Unit(k, name, v, world) for k, name, v in zip(keys, names, values, strict=True)
        ]
        all_names, leaves, spec = flatten_with_names(params, "params")
        entries, problems = _describe(all_names, leaves)
        problems.extend(_ties(all_names, leaves))
        description = (str(spec), entries, reshard_after_forward)
        _agree("The parameters of FullyShardedDataParallel", description, problems, process_group)
        self.fn = fn
        self.process_group = process_group
        self.reshard_after_forward = reshard_after_forward
        self._world = world
        self._rank = get_rank(process_group)
        self._kind = type(params)
        self._keys = keys
        self._order = list(range(len(self._units)))  # the expected order of reads (prefetch)
        self._trace: list[Any] | None = None  # tests: the order of events, when a list
        self._tapes: weakref.WeakKeyDictionary[Tape, list[Any]] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()
        self._flights: list[_Flight] = []  # reduce-scatters in flight (IN_FLIGHT at most)
        self._flats: list[list[Any]] = []
        for unit, value in zip(self._units, values, strict=True):
            self._flats.append(self._shard(unit, value))
        self._params = self._container([u.tree(u.shards) for u in self._units])

    def _container(self, trees: list[Any]) -> Any:
        if issubclass(self._kind, Mapping):
            return dict(zip(self._keys, trees, strict=True))
        return tuple(trees) if issubclass(self._kind, tuple) else list(trees)

    def _shard(self, unit: _Unit, value: Any) -> list[Any]:
        """Allocate the unit's flat shards and fill them from the group's first rank (scatter)."""
        _, leaves, _ = flatten_with_names(value, unit.name)
        arrays = [leaves[k] for k in unit.slots]
        group_pg = self.process_group
        src = 0 if group_pg is None else get_global_rank(group_pg, 0)
        flats = []
        for group, members in unit.groups:
            flat = empty(group.size, group.dtype, group.device)
            if group.size:
                full = None
                if self._rank == 0:
                    full = empty(self._world * group.size, group.dtype, group.device)
                    _pack(full, group, [arrays[i] for i in members], self._world, None)
                    chunks = [
                        _flat_view(full, r * group.size, (r + 1) * group.size, (group.size,))
                        for r in range(self._world)
                    ]
                    scatter(flat, chunks, src, group_pg)
                else:
                    scatter(flat, None, src, group_pg)
            for i, p in zip(members, group.members, strict=True):
                unit.shards[i] = _flat_view(flat, p.offset, p.offset + p.c * p.width, p.shard_shape)
                _SHARDS[id(unit.shards[i])] = unit.shards[i]
            flats.append(flat)
        return flats

    # -- parameters ----------------------------------------------------------------------

    @property
    def params(self) -> Params:
        """This rank's shards, in ``params``' structure: the tree an optimizer updates in place.

        Each array leaf has ``ceil(n / W)`` rows (padded; a 0-d parameter one row). The leaves
        are views of the units' flat shards, which the all-gathers send: update them in place.
        """
        return self._params

    @params.setter
    def params(self, value: Any) -> None:
        raise AttributeError(
            "FullyShardedDataParallel.params cannot be replaced: its leaves are views of the "
            "flat shards the all-gathers send. Update them in place (p[...] = p - lr * g, or "
            "any cupy_parallel.optim optimizer), or build a new FullyShardedDataParallel."
        )

    def _check_shards(self) -> None:
        """Refuse params whose leaves were replaced (the update would be lost, silently)."""
        names, leaves, _ = flatten_with_names(self._params, "fsdp.params")
        shards = {id(s) for unit in self._units for s in unit.shards}
        found = [(n, leaf) for n, leaf in zip(names, leaves, strict=True) if is_array(leaf)]
        for name, leaf in found:
            if id(leaf) not in shards:
                raise ValueError(
                    f"{name} is no longer this FullyShardedDataParallel's shard: an array was "
                    "put in its place, which the all-gathers would never send. Update the "
                    "shards in place (p[...] = new) instead of replacing them."
                )
        if len(found) != len(shards):
            raise ValueError(
                "fsdp.params lost some of its shards (an entry was removed or replaced by a "
                "non-array): update the shards in place instead."
            )

    def sharded_params(self) -> Any:
        """``params``' structure, a :class:`~cupy_parallel._src.checkpoint.shard.Shard` a leaf.

        Each ``Shard`` holds this rank's real rows (no padding; a view of the shard, so loading a
        checkpoint into it writes the parameters), their offset and the full shape. A 0-d
        parameter is described in its one-row form: ``global_shape == (1,)``. An optimizer's
        state for a leaf of :attr:`params` has the padded shard's shape: its real rows are
        ``state[:len(shard.local)]``, at the same offset.

        Example:
            >>> import numpy as np
            >>> import cupy_parallel
            >>> from cupy_parallel import distributed as dist
            >>> dist.init_process_group("mpi")
            >>> fsdp = cupy_parallel.FullyShardedDataParallel(lambda u: 0, [np.ones((3, 2))])
            >>> fsdp.sharded_params()[0].rows
            range(0, 3)
            >>> dist.destroy_process_group()
        """
        trees = []
        for unit in self._units:
            shards = []
            for p, shard in zip(unit.params, unit.shards, strict=True):
                n = p.real_rows(self._rank)
                local = shard[:n]
                offset = min(self._rank * p.c, p.rows)
                shards.append(Shard(local, offset, (p.rows, *p.rest)))
            trees.append(unit.tree(shards))
        return self._container(trees)

    def full_params(self, to: int | None = None) -> Any:
        """The gathered parameter tree (new arrays, the original shapes), for evaluation and export.

        Every rank of the group must call it. ``to=None`` gathers on every rank; ``to=r``
        (a world rank) only on rank ``r``, where the others get ``None``. Not recorded, so
        it refuses to run while a tape records (``RuntimeError``): a loss built from it would
        get no gradient through it, silently (torch's ``summon_full_params`` drops it too).
        Call it outside the tape, or inside ``tape.stop_recording()``.

        Example:
            >>> import numpy as np
            >>> import cupy_parallel
            >>> from cupy_parallel import distributed as dist
            >>> dist.init_process_group("mpi")
            >>> fsdp = cupy_parallel.FullyShardedDataParallel(
            ...     lambda u: 0, {"b": np.array(2.0), "w": np.arange(3.0)}
            ... )
            >>> fsdp.full_params()
            {'b': array(2.), 'w': array([0., 1., 2.])}
            >>> dist.destroy_process_group()
        """
        if active_tapes():
            raise RuntimeError(
                "full_params() is not recorded, so a loss computed from it inside a recording "
                "tape would get no gradient through those parameters: call it outside the "
                "tape (evaluation, export) or inside tape.stop_recording(); for gradients, "
                "call the FullyShardedDataParallel itself."
            )
        root = None
        if to is not None:
            to = read_int(to, "to", minimum=0)
            pg = resolve_group(self.process_group)
            assert pg is not None
            root = pg.group_rank(to, "to")
        here = root is None or self._rank == root
        trees = []
        with pause_recording():
            for u, unit in enumerate(self._units):
                fulls: list[Any] = []
                for (group, _), flat in zip(unit.groups, self._flats[u], strict=True):
                    out = empty(self._world * group.size, group.dtype, group.device)
                    if group.size and to is None:
                        all_gather_into_tensor(out, flat, self.process_group)
                    elif group.size:
                        size = group.size
                        chunks = [
                            _flat_view(out, r * size, (r + 1) * size, (size,))
                            for r in range(self._world)
                        ]
                        assert to is not None
                        gather(flat, chunks if here else None, to, self.process_group)
                    if here:
                        fulls.extend(_copied_out(out, group, self._world))
                if here:
                    trees.append(unit.tree(_in_leaf_order(unit, fulls)))
        return self._container(trees) if here else None

    # -- collectives ---------------------------------------------------------------------

    def _finish_flights(self) -> None:
        """Wait for every reduce-scatter in flight (each frees its send buffer)."""
        with self._lock:
            flights, self._flights = self._flights, []
        for flight in flights:
            flight.finish()

    def _in_flight(self, flight: _Flight) -> None:
        """Count a reduce-scatter in flight; wait for the oldest beyond :data:`IN_FLIGHT`."""
        with self._lock:
            self._flights.append(flight)
            oldest = self._flights[:-IN_FLIGHT] if len(self._flights) > IN_FLIGHT else []
            self._flights = self._flights[-IN_FLIGHT:]
        for old in oldest:
            old.finish()
        for old in self._flights:  # MPI moves nonblocking collectives on only while asked
            work = old.work
            if work is not None:
                work.is_completed()

    def _issue(self, u: int, why: str) -> list[tuple[Any, Any]]:
        """Start unit ``u``'s all-gathers (one per group): ``[(output buffer, work or None)]``.

        The output holds the group's parameters one after another, each as its ``W * c`` rows
        (rank ``r``'s ``c`` rows at ``r * c``), so that each full parameter is a view of it
        (:func:`_unpack`); one ``all_gather_coalesced`` of the group's shards receives each
        where its rows go (the MPI backend: a shard of 64 KiB or more in its own message,
        straight into its rows; the smaller ones in one packed message).

        FSDP2 gathers the flat shard instead and copies each parameter out of the gathered
        buffer. Measured (``benchmarks/bench_sharded.py``'s unit, a 512 x 512 float32 weight
        and a bias; 2 MPI ranks): with mpi4py alone, 141 us a unit that way against 80 us for
        the shards' own messages; through this library, with the collectives' argument checks
        (which FSDP's own buffers skip: :func:`all_gather_coalesced_unchecked`), 232 us
        against 160 us (4 ranks on 2 cores: 711 against 584).
        """
        outs = []
        unit = self._units[u]
        world = self._world
        for group, members in unit.groups:
            out = empty(world * group.size, group.dtype, group.device)
            work = None
            if group.size:
                columns = [_gathered_rows(out, group, p, world) for p in group.members]
                outputs = [list(rows) for rows in zip(*columns, strict=True)]
                shards = [unit.shards[i] for i in members]
                with pause_recording():
                    work = all_gather_coalesced_unchecked(outputs, shards, self.process_group, out)
            outs.append((out, work))
        if self._trace is not None:
            self._trace.append((f"{why} issued", u))
        return outs

    # -- forward -------------------------------------------------------------------------

    def __call__(self, /, *inputs: Any, **kwargs: Any) -> Output:
        """``fn(units, *inputs, **kwargs)``, each unit gathered when ``fn`` reads it."""
        self._check_shards()
        tapes = [tape for tape in active_tapes() if isinstance(tape, Tape)]
        for tape in tapes:
            self._hook(tape)
        call = _Call(self, tapes)
        units: Any
        if issubclass(self._kind, Mapping):
            units = _UnitsMapping(call, self._keys)
        else:
            units = _UnitsSequence(call, len(self._units))
        try:
            out = self.fn(units, *inputs, **kwargs)
        except BaseException as error:
            del units
            call.close()
            # fn raised (an out-of-memory batch, on every rank, that the loop catches and
            # retries): the call's nodes stay on the tape, and its swaps' last nodes gather
            # again in the backward pass, so the ranks still compare the call's swaps (an error
            # of this comparison carries fn's as its context); without a tape there is
            # nothing to compare, and a rank that raised alone issues nothing more. An
            # interrupt (KeyboardInterrupt, SystemExit) only closes the call.
            if isinstance(error, Exception) and call.tapes:
                self._compare_calls(call)
            raise
        del units
        call.close()
        self._compare_calls(call)
        if call.order:
            self._order = list(call.order)
        return out

    def _compare_calls(self, call: _Call) -> None:
        """Have the ranks compare the units ``fn`` read and the gathers they swapped out.

        Each read is an all-gather that pairs up with whatever the other ranks gather at that
        point: two units of one layout read by different ranks would exchange each other's
        shards without any error (the loss and gradients silently wrong), so the ranks compare
        the order of their reads before ``fn``'s output is returned, and raise alike.

        A swapped-out gather is gathered again in the backward pass, at the last node that
        holds its arrays; one that something else still held (``fn`` kept the array, or a
        reference cycle the collector has not freed yet) stays in the tape. That is each
        rank's own finding, so the ranks compare it too: where they differ, every rank gathers
        the unit once more now and the ranks that had swapped it out take it back, so the
        backward passes make the same collectives (not one rank's re-gather against another's
        reduce-scatter). Then the ranks compare where, among the collectives their backward
        passes will make, each re-gather falls (:func:`backward_schedule`): a node recorded
        on some ranks only (a statistic of a unit logged on rank 0 after the next unit was
        read) moves it; where they differ, every swapped gather of the call is taken back.

        Every call: one all-gather of two 16-byte digests (a collective of fixed size, rather
        than an object all-gather's two, with their pickling); the reads, swaps and schedules
        themselves travel only when the digests differ.
        """
        if self._world == 1:
            return
        swapped = bytes(g.owners is None for g in call.recorded)
        mine = _digest(repr(call.gathers).encode()) + _digest(swapped + self._schedule(call))
        every = self._all_digests(mine)
        if every == mine * self._world:
            return
        size = len(mine)
        reads = {every[r * size : r * size + size // 2] for r in range(self._world)}
        if len(reads) > 1:
            self._refuse_reads(call.gathers)
        seen: list[Any] = [None] * self._world
        all_gather_object(seen, swapped, group=self.process_group)
        if len({len(flags) for flags in seen}) > 1:
            raise ValueError(
                "FullyShardedDataParallel was called under a Tape on some ranks only (rank "
                f"gathers recorded: {[len(flags) for flags in seen]}): its backward pass "
                "reduce-scatters with every rank, so record the call on every rank or on none."
            )
        everywhere = []  # the gathers every rank swapped out
        for g, flags in zip(call.recorded, zip(*seen, strict=True), strict=True):
            if len(set(flags)) == 1:
                everywhere.append(flags[0])
                continue
            everywhere.append(False)
            self._take_back(call, g)
        mine = _digest(self._schedule(call))
        if self._all_digests(mine) != mine * self._world:
            for g, swapped_out in zip(call.recorded, everywhere, strict=True):
                if swapped_out:
                    self._take_back(call, g)

    def _all_digests(self, mine: bytes) -> bytes:
        """Every rank's ``mine`` (bytes of one length), in rank order: one all-gather."""
        pg = resolve_group(self.process_group)
        assert pg is not None
        gathered = _buffer(pg, self._world * len(mine))
        all_gather_into_tensor(gathered, _buffer(pg, mine), self.process_group)
        return bytes(_host(gathered).tobytes())

    def _schedule(self, call: _Call) -> bytes:
        """Where the call's re-gathers fall among its backward collectives, on each tape."""
        names = {
            id(swap): k for k, g in enumerate(call.recorded) for swap in call.swaps.get(id(g), [])
        }
        schedules = [
            backward_schedule(tape, start, names)
            for tape, start in zip(call.tapes, call.starts, strict=True)
        ]
        return repr(schedules).encode()

    def _take_back(self, call: _Call, g: _Gathered) -> None:
        """Gather ``g``'s unit once more (every rank); the ranks that swapped it out take it."""
        owners = _wait_and_unpack(
            self._units[g.unit], self._issue(g.unit, "regather to agree"), self._world
        )[1]
        for swap in call.swaps.pop(id(g), []):
            swap.undo(owners)

    def _refuse_reads(self, gathers: list[int]) -> None:
        """Raise, on every rank alike, the units each rank read (one object all-gather)."""
        names = [self._units[u].name for u in gathers]
        seen: list[Any] = [None] * self._world
        all_gather_object(seen, names, group=self.process_group)
        for rank, other in enumerate(seen):
            if other != seen[0]:
                raise ValueError(
                    "FullyShardedDataParallel's fn read different units on different ranks "
                    f"(rank 0 gathered {seen[0]}, rank {rank} {other}): each read is an "
                    "all-gather the ranks must make together, so the units are garbled. Read "
                    "the same units in the same order on every rank (a unit a rank does not "
                    "need can be read and multiplied by zero)."
                )

    def _hook(self, tape: Tape) -> None:
        """Watch the shards on ``tape`` and hook them once: a gradient no pass reached is zeros."""
        with self._lock:
            if tape in self._tapes:
                return
            handles: list[Any] = []
            for unit in self._units:
                tape.watch(unit.shards)
                handles.extend(
                    tape.register_gradient_ready_hook(shard, _ZerosFor(shard, self._world))
                    for shard in unit.shards
                )
            self._tapes[tape] = handles

    def __repr__(self) -> str:
        name = getattr(self.fn, "__name__", type(self.fn).__name__)
        return (
            f"FullyShardedDataParallel({name}, units={len(self._units)}, world_size="
            f"{self._world}, reshard_after_forward={self.reshard_after_forward})"
        )


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


class _ZerosFor:
    """A shard's gradient-ready hook: zeros where no gradient reached it (DDP's rule)."""

    __slots__ = ("shard", "world")

    def __init__(self, shard: Any, world: int) -> None:
        self.shard = shard
        self.world = world

    def __call__(self, grad: Any) -> Any:
        if grad is not None:
            return None
        zeros = zeros_like(self.shard)
        if self.world > 1:
            mark_sharded_gradients([zeros])
        return zeros


def _describe(names: list[str], leaves: list[Any]) -> tuple[list[Any], list[tuple[str, str]]]:
    """What must agree across ranks (each array leaf's shape, dtype, type) and local problems."""
    entries, problems = [], []
    for name, leaf in zip(names, leaves, strict=True):
        if not is_array(leaf):
            continue
        entries.append(
            (
                name,
                tuple(leaf.shape),
                str(leaf.dtype),
                f"{type(leaf).__name__}/{device_of(leaf).kind}",
            )
        )
        if leaf.dtype.kind not in "fc":
            problems.append(
                (
                    "TypeError",
                    (
                        f"FullyShardedDataParallel trains floating-point and complex arrays, "
                        f"but {name} has dtype {leaf.dtype}. Cast it first (array.astype("
                        "numpy.float32)) or keep it out of params."
                    ),
                )
            )
    return entries, problems


def _ties(names: list[str], leaves: list[Any]) -> list[tuple[str, str]]:
    """Two leaves sharing memory (tied weights), refused: sharding would untie them silently."""
    arrays = [(n, a) for n, a in zip(names, leaves, strict=True) if is_array(a) and a.size]
    for i, (name_a, a) in enumerate(arrays):
        for name_b, b in arrays[i + 1 :]:
            if a is b or (device_of(a) == device_of(b) and shares_memory(a, b)):
                return [
                    (
                        "ValueError",
                        (
                            f"{name_a} and {name_b} share memory (tied weights): "
                            "FullyShardedDataParallel shards each leaf on its own, which would "
                            "untie them. Keep the weight at one leaf and read it twice in fn."
                        ),
                    )
                ]
    return []
