"""``ZeroRedundancyOptimizer``: each rank keeps the optimizer state of its partition only (ZeRO-1).

The counterpart of ``torch.distributed.optim.ZeroRedundancyOptimizer`` for the optimizers of
:mod:`cupy_parallel.optim`. Every rank of a process group holds the whole parameter tree (as
with :class:`~cupy_parallel.DistributedDataParallel`) but builds its *local* optimizer
(:attr:`ZeroRedundancyOptimizer.optim`) over its own partition of the parameters only, so the
optimizer state (Adam's two moments: twice the parameters) is divided among the ranks. A step
updates this rank's partition with the averaged gradients every rank holds, then every rank
receives every updated parameter from its owner.

Partition (torch's rule, kept on purpose): parameter group by parameter group, the parameters
sorted by size (largest first, ties in flatten order) go each to the rank with the fewest
elements so far (the lowest such rank). This is the longest-processing-time rule: the largest
partition is at most 4/3 of the best possible one, and the same rule as torch means the same
parameters on the same ranks as torch's optimizer (``zero.optim`` holds what torch's holds).
An exact balance is a bin-packing problem (NP-hard) and LPT is within 4/3 of it; on
``benchmarks/bench_zero.py``'s MLP the two ranks' partitions differ by 0.17% (2,105,344
against 2,101,776 elements).

Sync: after the local step every rank receives every updated parameter from its owner, one of
three ways (``param_sync``):

- ``"broadcast"`` (the default; torch's default sync): each parameter broadcast from its owner
  straight into every rank's array, one collective each. No buffer: a rank holds its parameters,
  its gradients and its partition's state, nothing more (``benchmarks/bench_sharded.py``, 4
  ranks: exactly 0.625 of DDP's bytes, the issue's ``(2 + 2/N) / 4``).
- ``"broadcast_packed"``: the same for each parameter of at least :data:`IN_PLACE_BYTES`, and
  an owner's smaller parameters of one dtype and device together in one flat buffer, one
  collective for them all. It pays when a model has many small parameters (biases, norms'
  scales): ``benchmarks/bench_zero.py``'s second model, 96 units of a 64 x 64 weight and three
  64-vectors (288 small parameters), steps in 0.54-0.58x the time of ``"broadcast"`` on 2 ranks (the
  same model on 4 ranks, two per core: 0.37x); on ``bench_sharded``'s MLP (8 biases among
  512 x 512 weights) it is no faster. The price is those small parameters' bytes in
  buffers while the broadcasts are in flight (16 KiB there: 0.6255 of DDP's bytes), which is
  why it is not the default: the contract's memory is the parameters, gradients and
  state / N, exactly.
- ``"all_gather"``: each rank's partition packed into a flat buffer (one per dtype and
  device) padded to the largest partition, and one ``all_gather_into_tensor``: the whole model
  once more in buffers during the sync, and slower here (``bench_zero.py``, the 4.2 M-parameter
  float32 MLP, 2 MPI processes on 2 shared cores: 26-32 ms against the broadcasts' 15-19 ms;
  0.94 of DDP's bytes in ``bench_sharded``). NCCL is unmeasured without a GPU; it is one switch.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import numpy as np

from cupy_parallel._src.arguments import read_int
from cupy_parallel._src.arrays import device_of, empty, is_array, to_device
from cupy_parallel._src.checkpoint.shard import Shard
from cupy_parallel._src.compute import on_device_of
from cupy_parallel._src.distributed.exchanges import all_gather_into_tensor
from cupy_parallel._src.distributed.groups import (
    get_global_rank,
    get_rank,
    get_world_size,
    resolve_group,
)
from cupy_parallel._src.distributed.objects import all_gather_object, gather_object
from cupy_parallel._src.distributed.rooted import broadcast
from cupy_parallel._src.hostarray import plain_buffer
from cupy_parallel._src.optim.optimizer import Optimizer, zeros_like
from cupy_parallel._src.recording import note_overwritten, tapes_exist
from cupy_parallel._src.sharded.fsdp import is_shard
from cupy_parallel._src.tree import tree_map

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["IN_PLACE_BYTES", "ZeroRedundancyOptimizer", "partition_sizes"]


def partition_sizes(group_sizes: list[list[int]], world_size: int, /) -> list[list[list[int]]]:
    """The greedy partition (torch's): ``[group][rank]`` -> the positions a rank owns.

    Group by group, positions sorted by size, largest first (a stable sort: ties in order), each
    to the rank with the fewest elements so far (the lowest such rank); the totals carry over
    from one group to the next. A rank's positions are listed in the order assigned (its local
    optimizer's order, as torch's).

    Example:
        >>> partition_sizes([[3, 10, 4, 4]], 2)
        [[[1], [2, 3, 0]]]
        >>> partition_sizes([[5], [5, 1]], 2)
        [[[0], []], [[1], [0]]]
    """
    totals = [0] * world_size
    out = []
    for sizes in group_sizes:
        owned: list[list[int]] = [[] for _ in range(world_size)]
        for position in sorted(range(len(sizes)), key=lambda k: -sizes[k]):
            rank = totals.index(min(totals))
            owned[rank].append(position)
            totals[rank] += sizes[position]
        out.append(owned)
    return out


# --------------------------------------------------------------------------------------------
# Flat buffers of the parameters, one per dtype and device


class _Bucket:
    """The parameters of one dtype and device: each rank's, in its order, and their offsets."""

    __slots__ = ("device", "dtype", "members", "sizes")

    def __init__(self, members: list[list[tuple[int, Any]]], dtype: Any, device: Any) -> None:
        self.members = members  # [rank] -> [(global index, array)]
        self.sizes = [sum(int(a.size) for _, a in owned) for owned in members]
        self.dtype = dtype
        self.device = device


def _pack(buffer: Any, arrays: list[Any]) -> None:
    """``buffer[:n] = concatenation of arrays`` (raveled), the rest zeros, on its device."""
    raw = plain_buffer(buffer)

    def write() -> None:
        start = 0
        for a in arrays:
            raw[start : start + a.size] = plain_buffer(a).reshape(-1)
            start += a.size
        raw[start:] = 0

    on_device_of(raw, write)


def _unpack(buffer: Any, arrays: list[Any]) -> None:
    """The arrays' values from the front of ``buffer``, written into them in place."""
    raw = plain_buffer(buffer)

    def read() -> None:
        start = 0
        for a in arrays:
            flat = plain_buffer(a).reshape(-1)  # a view: parameters are contiguous (see class)
            flat[...] = raw[start : start + a.size]
            start += a.size

    on_device_of(raw, read)


def _sync_all_gather(zero: ZeroRedundancyOptimizer) -> list[Any]:
    """One all-gather per bucket of every rank's partition, padded to the largest."""
    flights = []
    for bucket in zero._buckets:
        width = max(bucket.sizes)
        if width == 0:
            continue
        send = empty(width, bucket.dtype, bucket.device)
        _pack(send, [a for _, a in bucket.members[zero._rank]])
        out = empty(width * zero._world, bucket.dtype, bucket.device)
        work = all_gather_into_tensor(out, send, group=zero.process_group, async_op=True)
        flights.append((work, bucket, out, width))
    written: list[Any] = []
    for work, bucket, out, width in flights:
        work.wait()
        raw = plain_buffer(out)
        for rank, owned in enumerate(bucket.members):
            if rank != zero._rank and owned:
                _unpack(raw[rank * width : (rank + 1) * width], [a for _, a in owned])
                written.extend(a for _, a in owned)
    return written


IN_PLACE_BYTES = 256 * 1024
"""With ``param_sync="broadcast_packed"``, a parameter of at least this many bytes is broadcast in
place; an owner's smaller ones of one dtype and device travel together in one flat buffer."""


def _sync_broadcast(zero: ZeroRedundancyOptimizer, pack_below: int = 0) -> list[Any]:
    """Per bucket and owner, each parameter broadcast in place from its owner.

    ``pack_below``: an owner's parameters of fewer bytes go together in one flat buffer instead
    (one collective for them all; their bytes once more in buffers while it is in flight).
    """
    flights: list[tuple[Any, int, list[Any], Any]] = []  # (work, owner, arrays, buffer or None)
    for bucket in zero._buckets:
        for rank, owned in enumerate(bucket.members):
            source = get_global_rank(zero.process_group, rank)
            sent = [a for _, a in owned if a.size]  # a zero-size parameter holds nothing to send
            small = [a for a in sent if a.nbytes < pack_below]
            for a in sent:
                if a.nbytes >= pack_below:
                    work = broadcast(a, source, group=zero.process_group, async_op=True)
                    flights.append((work, rank, [a], None))
            if small:
                buffer = empty(sum(int(a.size) for a in small), bucket.dtype, bucket.device)
                if rank == zero._rank:
                    _pack(buffer, small)
                work = broadcast(buffer, source, group=zero.process_group, async_op=True)
                flights.append((work, rank, small, buffer))
    written: list[Any] = []
    for work, rank, arrays, buffer in flights:
        work.wait()
        if rank != zero._rank:
            if buffer is not None:
                _unpack(buffer, arrays)
            written.extend(arrays)
    return written


def _sync_broadcast_packed(zero: ZeroRedundancyOptimizer) -> list[Any]:
    """:func:`_sync_broadcast` with the parameters under :data:`IN_PLACE_BYTES` packed."""
    return _sync_broadcast(zero, IN_PLACE_BYTES)


_SYNCS: dict[str, Callable[[ZeroRedundancyOptimizer], list[Any]]] = {
    "all_gather": _sync_all_gather,
    "broadcast": _sync_broadcast,
    "broadcast_packed": _sync_broadcast_packed,
}
"""How the updated partitions reach every rank (see the module)."""


def _host_copy(value: Any) -> Any:
    """An array as a fresh NumPy array (consolidated state lives in host memory); else as is."""
    if is_array(value):
        return np.array(to_device(value, "cpu"), copy=True)
    return copy.deepcopy(value)


# --------------------------------------------------------------------------------------------
# ZeroRedundancyOptimizer


class ZeroRedundancyOptimizer(Optimizer):
    """An optimizer whose state is partitioned over a process group (ZeRO-1), as torch's.

    Every rank builds one over the same parameters (``DistributedDataParallel.params``: the
    same structure, shapes and dtypes, and values, on every rank). Each parameter is owned by
    one rank (see :mod:`cupy_parallel._src.sharded.zero` for the partition);
    ``optim`` is ``optimizer_class`` built over this rank's parameters only, with the
    param groups' hyper-parameters and ``**defaults``, so it alone holds optimizer state.

    ``step(grads)`` takes the gradients every rank holds alike (the averaged tree DDP's tape
    returns, shaped as the params; with param groups a list, one tree per group), updates this
    rank's partition in place, and then writes every other rank's updated parameters into this
    rank's arrays in place (see ``param_sync``), so that after a step every rank holds the
    parameters an unsharded optimizer would have computed. Every rank must call it.

    ``param_groups`` is torch's: the global groups, listing all the parameters, with every
    hyper-parameter of ``optimizer_class`` (set them here, e.g. by a scheduler: a step copies
    them to the local optimizer). State dicts have torch's layout with *global* indices (the
    flatten order of the params, groups in order): :meth:`consolidate_state_dict` gathers the
    ranks' state onto one rank, whose :meth:`state_dict` then equals the unsharded optimizer's
    (its arrays NumPy copies in host memory, as torch keeps it on the CPU);
    :meth:`load_state_dict` takes such a dict, or an unsharded optimizer's, saved on any
    number of ranks, and keeps this rank's part. To save without consolidating, use
    :func:`cupy_parallel.distributed.checkpoint.get_state_dict` (each rank writes only its
    partition's state).

    Decisions:

    - ``param_sync``: ``"broadcast"`` (default, torch's: every parameter broadcast in place
      from its owner, no memory beyond the parameters), ``"broadcast_packed"`` (an owner's
      parameters under 256 KiB in one buffer: fewer collectives for models with
      many small parameters, their bytes in buffers during the sync) or ``"all_gather"`` (one
      collective per dtype and device, through buffers). See the module for measurements.
    - The ranks compare the parameters' structure, shapes, dtypes and array kinds, the groups
      and ``param_sync`` at construction (one object all-gather): a difference raises the
      same ``ValueError`` on every rank instead of a hang or a garbled sync.
    - The shards of a :class:`~cupy_parallel.FullyShardedDataParallel` (its ``params``) are
      refused (``ValueError``): they differ from rank to rank, and FSDP's optimizer state is
      sharded already (a plain optimizer over ``fsdp.params``).
    - Parameters must be C-contiguous arrays (the sync writes them in place through a flat
      view): a non-contiguous one is a ``ValueError``.
    - A ``None`` gradient skips the parameter on its owner (torch's ``.grad is None``); it is
      still synced (unchanged).
    - ``optimizer_class`` must be a :class:`~cupy_parallel.optim.Optimizer` subclass (SGD,
      Adam, AdamW or your own).

    Args:
        params: A pytree of arrays, or torch's list of param groups.
        optimizer_class: The optimizer each rank runs on its partition.
        process_group: The group to partition over (``None``: the default group).
        param_sync: ``"broadcast"``, ``"broadcast_packed"`` or ``"all_gather"`` (see above).
        **defaults: ``optimizer_class``'s keyword arguments (``lr=...``).

    Raises:
        TypeError: ``optimizer_class`` is not an optimizer class, or a bad hyper-parameter.
        ValueError: the ranks' parameters differ, a parameter is not contiguous,
            ``param_sync`` is unknown, or this rank is not in ``process_group``.

    Example:
        >>> import numpy as np
        >>> from cupy_parallel import distributed as dist
        >>> from cupy_parallel.distributed.optim import ZeroRedundancyOptimizer
        >>> from cupy_parallel.optim import Adam
        >>> dist.init_process_group("mpi")  # under `mpiexec -n N` every rank runs this
        >>> params = {"w": np.ones((2, 2)), "b": np.zeros(2)}
        >>> zero = ZeroRedundancyOptimizer(params, Adam, lr=0.1)
        >>> zero.step({"w": np.ones((2, 2)), "b": np.ones(2)})  # DDP's averaged gradients
        >>> params["b"]
        array([-0.1, -0.1])
        >>> zero.consolidate_state_dict(to=0)
        >>> sorted(zero.state_dict()["state"][1])  # on rank 0: the whole state
        ['exp_avg', 'exp_avg_sq', 'step']
        >>> dist.destroy_process_group()
    """

    def __init__(
        self,
        params: Any,
        optimizer_class: type[Optimizer],
        *,
        process_group: Any = None,
        param_sync: str = "broadcast",
        **defaults: Any,
    ) -> None:
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, Optimizer)):
            got = (
                f"an instance of {type(optimizer_class).__name__} (pass the class itself)"
                if isinstance(optimizer_class, Optimizer)
                else repr(optimizer_class)
            )
            raise TypeError(
                "optimizer_class must be an optimizer class of cupy_parallel.optim (SGD, Adam, "
                f"AdamW or a subclass of Optimizer), got {got}."
            )
        if issubclass(optimizer_class, ZeroRedundancyOptimizer):
            raise TypeError("optimizer_class cannot be ZeroRedundancyOptimizer itself.")
        if param_sync not in _SYNCS:
            raise ValueError(f"param_sync must be one of {sorted(_SYNCS)}, got {param_sync!r}.")
        if resolve_group(process_group) is None:
            raise ValueError(
                "process_group must be a group this rank is a member of, got "
                "GroupMember.NON_GROUP_MEMBER."
            )
        self.process_group = process_group
        self.param_sync = param_sync
        self._world = get_world_size(process_group)
        self._rank = get_rank(process_group)
        self._optimizer_class = optimizer_class
        self._all_state_dicts: list[dict[str, Any]] = []
        self._initialized = False
        super().__init__(params, defaults)  # global groups, through add_param_group
        self._check_params()
        self._agree()
        self._partition()
        self.optim: Optimizer = optimizer_class(self._local_groups(), **defaults)
        _copy_hyper(self.optim.param_groups, self.param_groups)
        self._initialized = True

    # -- partition ------------------------------------------------------------------------

    def _check_params(self) -> None:
        for i, group in enumerate(self.param_groups):
            for j, p in enumerate(group["params"]):
                if is_shard(p):
                    raise ValueError(
                        f"Parameter {j} of param group {i} (shape {tuple(p.shape)}) is a shard "
                        "of a FullyShardedDataParallel, which differs from rank to rank: "
                        "ZeroRedundancyOptimizer partitions parameters every rank holds alike "
                        "and would overwrite the other ranks' shards with its own. FSDP's "
                        "optimizer state is sharded already: pass fsdp.params to a plain "
                        "cupy_parallel.optim optimizer (Adam(fsdp.params, ...))."
                    )
                flags = getattr(plain_buffer(p), "flags", None)
                if flags is not None and not flags.c_contiguous:
                    raise ValueError(
                        f"ZeroRedundancyOptimizer syncs parameters in place through flat views, "
                        f"but parameter {j} of param group {i} (shape {tuple(p.shape)}) is not "
                        "C-contiguous: pass a contiguous copy (numpy.ascontiguousarray)."
                    )

    def _agree(self) -> None:
        """Every rank compares the parameters, groups and options; raise alike on a difference."""
        devices: dict[Any, int] = {}  # each device as its order of appearance (ranks differ)
        mine = (
            self.param_sync,
            [str(spec) for spec in self._specs],
            [
                [
                    (
                        tuple(p.shape),
                        str(p.dtype),
                        device_of(p).kind,
                        devices.setdefault(device_of(p), len(devices)),
                    )
                    for p in g["params"]
                ]
                for g in self.param_groups
            ],
        )
        gathered: list[Any] = [None] * self._world
        all_gather_object(gathered, mine, group=self.process_group)
        for rank, other in enumerate(gathered):
            if other[0] != gathered[0][0]:  # an option, not the parameters: name both values
                raise ValueError(
                    f"ZeroRedundancyOptimizer's param_sync differs across the ranks: rank "
                    f"{rank} passed {other[0]!r}, rank 0 {gathered[0][0]!r}. Every rank must "
                    "pass the same param_sync."
                )
            if other != gathered[0]:
                what = next(
                    name
                    for name, a, b in zip(
                        ("param_sync", "structures", "shapes, dtypes and devices"),
                        gathered[0],
                        other,
                        strict=True,
                    )
                    if a != b
                )
                raise ValueError(
                    f"ZeroRedundancyOptimizer's parameters differ across the ranks: rank "
                    f"{rank}'s {what} differ from rank 0's. Every rank must pass the same "
                    "parameters (DistributedDataParallel.params) and options."
                )

    def _partition(self) -> None:
        sizes = [[int(p.size) for p in g["params"]] for g in self.param_groups]
        self._owned = partition_sizes(sizes, self._world)  # [group][rank] -> positions
        starts = np.cumsum([0] + [len(g["params"]) for g in self.param_groups]).tolist()
        self._owner: dict[int, int] = {}
        # [rank] -> global indices in the rank's local optimizer's flatten order
        self._local_index: list[list[int]] = [[] for _ in range(self._world)]
        for g, owned in enumerate(self._owned):
            for rank, positions in enumerate(owned):
                for k in positions:
                    self._owner[starts[g] + k] = rank
                    self._local_index[rank].append(starts[g] + k)
        arrays = [p for g in self.param_groups for p in g["params"]]
        keys: dict[Any, list[list[tuple[int, Any]]]] = {}
        for rank in range(self._world):
            for i in self._local_index[rank]:
                key = (str(arrays[i].dtype), device_of(arrays[i]))
                keys.setdefault(key, [[] for _ in range(self._world)])[rank].append((i, arrays[i]))
        self._buckets = [
            _Bucket(members, np.dtype(dtype), device) for (dtype, device), members in keys.items()
        ]

    def _local_groups(self) -> list[dict[str, Any]]:
        groups = []
        for group, owned in zip(self.param_groups, self._owned, strict=True):
            local = {k: v for k, v in group.items() if k != "params"}
            local["params"] = [group["params"][k] for k in owned[self._rank]]
            groups.append(local)
        return groups

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group on every rank (torch's): its parameters are partitioned too.

        The earlier groups keep their owners; this rank's share of the new group joins
        ``optim``. Every rank must call it with the same group.
        """
        super().add_param_group(param_group)
        if not self._initialized:
            return
        self._check_params()
        self._agree()
        self._partition()
        self.optim.add_param_group(self._local_groups()[-1])
        _copy_hyper(self.optim.param_groups[-1:], self.param_groups[-1:])

    # -- step ---------------------------------------------------------------------------------

    def step(self, grads: Any) -> None:
        """Update this rank's partition in place, then receive every other rank's (all ranks).

        ``grads``: shaped as the params (a list of trees with param groups), the same on every
        rank (DDP's averaged gradients); checked on every rank before anything is written,
        as are the params (a leaf replaced since construction is a ``ValueError``, as with any
        optimizer, raised before the step's collectives).
        """
        self._check_bound()
        per_group = self._grads_of(grads)
        _copy_hyper(self.param_groups, self.optim.param_groups)
        local = [
            [group_grads[k] for k in owned[self._rank]]
            for group_grads, owned in zip(per_group, self._owned, strict=True)
        ]
        self.optim.step(local)
        _copy_hyper(self.optim.param_groups, self.param_groups)
        written = _SYNCS[self.param_sync](self)
        if written and tapes_exist():
            note_overwritten(written, "ZeroRedundancyOptimizer.step")

    # -- state dict ---------------------------------------------------------------------------

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather every rank's optimizer state onto group rank ``to`` (every rank calls it).

        Afterwards :meth:`state_dict` on rank ``to`` returns the whole state (NumPy copies in
        host memory); other ranks hold none. torch's ``to`` is a group rank too.
        """
        to = read_int(to, "to")
        if not 0 <= to < self._world:
            raise ValueError(f"to must be a rank of the group, in [0, {self._world}), got {to}.")
        _copy_hyper(self.param_groups, self.optim.param_groups)
        local = self.optim.state_dict()
        local["state"] = tree_map(_host_copy, local["state"])
        dst = get_global_rank(self.process_group, to)
        received: list[Any] | None = [None] * self._world if self._rank == to else None
        gather_object(local, received, dst=dst, group=self.process_group)
        self._all_state_dicts = list(received) if received is not None else []

    def state_dict(self) -> dict[str, Any]:
        """The whole optimizer state in torch's layout, on the rank consolidated to.

        Raises:
            RuntimeError: :meth:`consolidate_state_dict` has not gathered the state onto this
                rank (torch's error).
        """
        if not self._all_state_dicts:
            raise RuntimeError(
                "Optimizer state has not been consolidated on this rank. Please call "
                f"`consolidate_state_dict(to={self._rank})` on all ranks beforehand if you "
                "meant to save the global state."
            )
        packed = Optimizer.state_dict(self)  # the global groups (ZeRO's own state is empty)
        state = {}
        for rank, local in enumerate(self._all_state_dicts):
            order = self._local_index[rank]
            for local_index, entry in local["state"].items():
                state[order[local_index]] = entry
        packed["state"] = dict(sorted(state.items()))
        return packed

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a whole state (global indices; saved on any number of ranks), keep this rank's.

        The local optimizer checks and copies its entries; every other entry's index and
        array shapes are checked too, on every rank, before anything changes. The groups'
        hyper-parameters replace those of ``param_groups``.
        """
        if not isinstance(state_dict, dict) or {"state", "param_groups"} - set(state_dict):
            raise ValueError(
                "state_dict must be a dict with 'state' and 'param_groups' entries (what "
                f"state_dict() returns), got {type(state_dict).__name__}."
            )
        saved_groups, saved_state = state_dict["param_groups"], state_dict["state"]
        counts = [len(g["params"]) for g in self.param_groups]
        if (
            not isinstance(saved_groups, list | tuple)
            or len(saved_groups) != len(counts)
            or any(not isinstance(g, dict) or "params" not in g for g in saved_groups)
            or [len(g["params"]) for g in saved_groups] != counts
        ):
            raise ValueError(
                "loaded state dict's param_groups do not match this optimizer's: it has "
                f"{len(counts)} groups of {counts} parameters."
            )
        if not isinstance(saved_state, dict):
            raise ValueError(f"state_dict['state'] must be a dict, got {type(saved_state)}.")
        # the saved ids of each global position (torch's state dicts number them 0..n-1)
        ids = [i for g in saved_groups for i in g["params"]]
        position = {saved_id: k for k, saved_id in enumerate(ids)}
        arrays = [p for g in self.param_groups for p in g["params"]]
        for saved_id, entry in saved_state.items():
            if saved_id not in position:
                raise ValueError(
                    f"state_dict['state'] has an entry for parameter {saved_id!r}, which no "
                    "param group lists."
                )
            param = arrays[position[saved_id]]
            if not isinstance(entry, dict):
                raise ValueError(f"state_dict['state'][{saved_id!r}] must be a dict.")
            for key, value in entry.items():
                shape = getattr(value, "shape", None)
                if key != "step" and shape is not None and tuple(shape) != tuple(param.shape):
                    raise ValueError(
                        f"state_dict['state'][{saved_id!r}][{key!r}] has shape {tuple(shape)}, "
                        f"its parameter {tuple(param.shape)}."
                    )
        local_of = {i: k for k, i in enumerate(self._local_index[self._rank])}
        local_state = {
            local_of[position[saved_id]]: entry
            for saved_id, entry in saved_state.items()
            if self._owner[position[saved_id]] == self._rank
        }
        local_groups, start = [], 0
        for saved, owned in zip(saved_groups, self._owned, strict=True):
            local = {k: v for k, v in saved.items() if k != "params"}
            local["params"] = list(range(start, start + len(owned[self._rank])))
            start += len(owned[self._rank])
            local_groups.append(local)
        self.optim.load_state_dict({"state": local_state, "param_groups": local_groups})
        for group, loaded in zip(self.param_groups, self.optim.param_groups, strict=True):
            for key in [k for k in group if k != "params" and k not in loaded]:
                del group[key]
        _copy_hyper(self.optim.param_groups, self.param_groups)

    # -- sharded state (distributed checkpoint) ----------------------------------------------

    def sharded_state(self) -> dict[int, dict[str, Any]]:
        """Every parameter's state by global index, as every rank describes it (collective).

        An array state of ``ndim >= 1`` is a
        :class:`~cupy_parallel.distributed.checkpoint.Shard`: on its owner all rows (the local
        optimizer's own array, which a checkpoint load fills in place), elsewhere none.
        Numbers (``step``) and 0-d arrays are replicated (the owners send them in one object
        all-gather, with which parameters have state). Parameters without state have no entry.
        :func:`cupy_parallel.distributed.checkpoint.get_state_dict` names them for a checkpoint.

        Example:
            >>> import numpy as np
            >>> from cupy_parallel import distributed as dist
            >>> from cupy_parallel.optim import SGD
            >>> dist.init_process_group("mpi")
            >>> zero = ZeroRedundancyOptimizer([np.ones(2)], SGD, lr=0.1, momentum=0.9)
            >>> zero.step([np.ones(2)])
            >>> zero.sharded_state()[0]["momentum_buffer"].rows  # a world of one owns all rows
            range(0, 2)
            >>> dist.destroy_process_group()
        """
        arrays = [p for g in self.param_groups for p in g["params"]]
        mine = {
            self._local_index[self._rank][local_index]: {
                k: _describe_value(v) for k, v in own.items()
            }
            for local_index, own in self.optim.state.items()
            if own
        }
        gathered: list[Any] = [None] * self._world
        all_gather_object(gathered, mine, group=self.process_group)
        local_of = {i: k for k, i in enumerate(self._local_index[self._rank])}
        out: dict[int, dict[str, Any]] = {}
        for rank_entries in gathered:
            for i, described in rank_entries.items():
                entry: dict[str, Any] = {}
                for key, (kind, value) in described.items():
                    if kind != "rows":
                        entry[key] = value
                    elif self._owner[i] == self._rank:
                        local = self.optim.state[local_of[i]][key]
                        entry[key] = Shard(local, 0, tuple(local.shape))
                    else:
                        shape = tuple(arrays[i].shape)
                        none = empty((0, *shape[1:]), value, device_of(arrays[i]))
                        entry[key] = Shard(none, 0, shape)
                out[i] = entry
        return dict(sorted(out.items()))

    def load_sharded_state(
        self, state: dict[int, dict[str, Any]], param_groups: list[dict[str, Any]]
    ) -> None:
        """Take :meth:`sharded_state`'s layout (filled by a checkpoint load) as the state.

        ``param_groups``: torch's layout with global indices. The Shards this rank owns carry
        its partition's arrays (all rows); the rest is replicated.

        Example:
            >>> import numpy as np
            >>> from cupy_parallel import distributed as dist
            >>> from cupy_parallel.optim import SGD
            >>> dist.init_process_group("mpi")
            >>> zero = ZeroRedundancyOptimizer([np.ones(2)], SGD, lr=0.1, momentum=0.9)
            >>> zero.step([np.ones(2)])
            >>> state = zero.sharded_state()
            >>> state[0]["momentum_buffer"].local[...] = 5.0  # as a checkpoint load would
            >>> zero.load_sharded_state(state, [{"lr": 0.1, "momentum": 0.9, "params": [0]}])
            >>> zero.optim.state[0]["momentum_buffer"]
            array([5., 5.])
            >>> dist.destroy_process_group()
        """
        mine = {
            i: {k: v.local if isinstance(v, Shard) else v for k, v in entry.items()}
            for i, entry in state.items()
            if self._owner[i] == self._rank
        }
        self.load_state_dict({"state": mine, "param_groups": param_groups})

    def init_state(self) -> None:
        """Give every parameter of this rank's partition a zero state if ``optim`` has none.

        What a checkpoint template needs (torch's ``get_state_dict`` initialises an
        optimizer's state the same way): zeros, ``step`` 0.
        """
        init_state(self.optim)


def _describe_value(value: Any) -> tuple[str, Any]:
    """How a state value travels in :meth:`ZeroRedundancyOptimizer.sharded_state`."""
    if is_array(value) and value.ndim >= 1:
        return ("rows", str(value.dtype))
    return ("value", _host_copy(value))


def init_state(optim: Optimizer) -> None:
    """Zero state for every parameter of ``optim`` when it has no state at all (torch's rule).

    Arrays of zeros for each state key of the parameter's group, ``step`` 0.0 — what
    ``torch.distributed.checkpoint.state_dict`` makes with a zero-gradient step at lr 0,
    without touching the parameters.

    Example:
        >>> import numpy as np
        >>> from cupy_parallel.optim import Adam
        >>> opt = Adam([np.ones(2)])
        >>> init_state(opt)
        >>> opt.state[0]["exp_avg"], opt.state[0]["step"]
        (array([0., 0.]), 0.0)
    """
    if any(optim.state.values()):
        return
    index = 0
    for group in optim.param_groups:
        keys = optim._state_keys(optim._read_hyper(group))
        for p in group["params"]:
            if keys:
                optim.state[index] = {k: 0.0 if k == "step" else zeros_like(p) for k in keys}
            index += 1


def _copy_hyper(source: list[dict[str, Any]], target: list[dict[str, Any]]) -> None:
    """Every entry but ``params`` from each source group into its target group (torch's sync)."""
    for src, dst in zip(source, target, strict=True):
        for key, value in src.items():
            if key != "params":
                dst[key] = value
