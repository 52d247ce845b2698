"""``get_state_dict`` / ``set_state_dict``: a model's and its optimizer's state to checkpoint.

torch's ``torch.distributed.checkpoint.state_dict`` pair, for the models and optimizers here:
the model a :class:`~cupy_parallel.DistributedDataParallel` (replicated parameters) or a
:class:`~cupy_parallel.FullyShardedDataParallel` (dim-0 shards), the optimizer any
:mod:`cupy_parallel.optim` optimizer over the model's parameters or a
:class:`~cupy_parallel.distributed.optim.ZeroRedundancyOptimizer`. The dicts say what
:func:`cupy_parallel.distributed.checkpoint.save` / ``load`` need to know about shards, so that
``{"model": model_sd, "optim": optim_sd}`` saved on N ranks loads on M ranks, whatever the
sharding on either side (ZeRO on 4 ranks → FSDP on 2, DDP + Adam → ZeRO, ...).

Layout (torch's, with *fully qualified names*):

- ``model_sd``: ``{fqn: leaf}`` where ``fqn`` names a parameter by its key path in the model's
  params, the keys joined by dots (``{"layers": [{"w": ...}]}`` → ``"layers.0.w"``, torch's
  module-path names); a leaf is the parameter array itself (DDP: replicated) or a
  :class:`~cupy_parallel._src.checkpoint.shard.Shard` of this rank's rows (FSDP). Non-array
  leaves of the params (a name, a number) are kept as values.
- ``optim_sd``: ``{"state": {fqn: {key: value}}, "param_groups": [{..., "params": [fqn, ...]}]}``:
  torch's optimizer layout with names for indices, so that resharding never depends on the
  parameters' order. A state array is replicated (an optimizer over DDP's parameters: every
  rank holds the same), a ``Shard`` of the real rows (over FSDP's shards), or a ``Shard`` of
  all rows on its ZeRO owner and none elsewhere; ``step`` and 0-d state are values.

Names instead of indices: two leaves whose dotted names collide (a key holding a dot) are
refused with a ``ValueError``.

An optimizer without any state (never stepped, e.g. freshly built to load into) gets zero
state first, so that the dict is a template a load can fill: torch's ``get_state_dict`` does
the same (with a zero-gradient step at lr 0; here the zeros are written directly and the
parameters are untouched). Loading a checkpoint overwrites it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from cupy_parallel._src import tree
from cupy_parallel._src.arrays import device_of, empty, is_array, to_device
from cupy_parallel._src.checkpoint.shard import Shard
from cupy_parallel._src.compute import on_device_of
from cupy_parallel._src.ddp import DistributedDataParallel
from cupy_parallel._src.hostarray import plain_buffer
from cupy_parallel._src.optim.optimizer import Optimizer
from cupy_parallel._src.recording import note_overwritten, tapes_exist
from cupy_parallel._src.sharded.zero import ZeroRedundancyOptimizer, init_state

if TYPE_CHECKING:
    from optree import PyTreeAccessor

__all__ = ["get_state_dict", "set_state_dict"]


def _fqn(accessor: PyTreeAccessor) -> str:
    return ".".join(str(entry.entry) for entry in accessor)


class _Model:
    """A model's parameters by name: each leaf, and for FSDP its Shard (real rows, offset)."""

    def __init__(self, model: Any) -> None:
        if isinstance(model, DistributedDataParallel):
            params, described = model.params, None
        elif callable(getattr(model, "sharded_params", None)) and hasattr(model, "params"):
            params, described = model.params, model.sharded_params()
        else:
            raise TypeError(
                "model must be a DistributedDataParallel or a FullyShardedDataParallel, got "
                f"{type(model).__name__}."
            )
        accessors, leaves, _ = tree.flatten(params)
        self.names = [_fqn(a) for a in accessors]
        seen: dict[str, int] = {}
        for k, name in enumerate(self.names):
            if name in seen:
                raise ValueError(
                    f"the parameters {tree.key_path(accessors[seen[name]], 'params')} and "
                    f"{tree.key_path(accessors[k], 'params')} have one dotted name {name!r}: "
                    "rename a key (a dot inside a key makes names collide)."
                )
            seen[name] = k
        self.leaves = leaves
        self.shards: list[Any] = (
            tree.leaves(described) if described is not None else [None] * len(leaves)
        )
        if len(self.shards) != len(leaves):
            raise ValueError("the model's sharded_params() do not line up with its params.")
        self.by_id = {id(leaf): k for k, leaf in enumerate(leaves) if is_array(leaf)}

    def state(self) -> dict[str, Any]:
        return {
            name: shard if shard is not None else leaf
            for name, leaf, shard in zip(self.names, self.leaves, self.shards, strict=True)
        }

    def index_of(self, param: Any, where: str) -> int:
        k = self.by_id.get(id(param))
        if k is None:
            raise ValueError(
                f"{where} is not one of the model's parameters: build the optimizer over "
                "model.params (DDP's arrays, FSDP's shards)."
            )
        return k


def _names_of(optimizer: Any, model: _Model) -> list[int]:
    """For each parameter of the optimizer (flatten order, groups in order): its model leaf."""
    out = []
    for g, group in enumerate(optimizer.param_groups):
        for j, p in enumerate(group["params"]):
            out.append(model.index_of(p, f"parameter {j} of the optimizer's param group {g}"))
    return out


def _groups(optimizer: Any, model: _Model, leaves: list[int]) -> list[dict[str, Any]]:
    groups, start = [], 0
    for group in optimizer.param_groups:
        packed = {k: v for k, v in group.items() if k != "params"}
        count = len(group["params"])
        packed["params"] = [model.names[k] for k in leaves[start : start + count]]
        start += count
        groups.append(packed)
    return groups


def _shard_like(value: Any, shard: Shard) -> Any:
    """A state array of a padded FSDP shard as a Shard of its real rows (a view)."""
    rows = int(shard.local.shape[0])
    return Shard(value[:rows], shard.offset, tuple(shard.global_shape))


def get_state_dict(model: Any, optimizer: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model's and the optimizer's state dicts for a distributed checkpoint (see the module).

    Every rank of the model's group calls it (a ZeRO optimizer exchanges which parameters
    have state). The arrays are the live ones (not copies): a checkpoint ``load`` into the
    dicts writes the parameters and the ZeRO partitions' state in place;
    :func:`set_state_dict` completes the load.

    Args:
        model: A ``DistributedDataParallel`` or ``FullyShardedDataParallel``.
        optimizer: An optimizer over ``model.params`` or a ``ZeroRedundancyOptimizer`` over them.

    Returns:
        ``(model_sd, optim_sd)``.

    Raises:
        TypeError: ``model`` or ``optimizer`` has a wrong type.
        ValueError: the optimizer holds an array that is not a parameter of the model.

    Example:
        >>> import numpy as np
        >>> import cupy_parallel
        >>> from cupy_parallel import distributed as dist
        >>> from cupy_parallel.distributed.checkpoint import get_state_dict
        >>> from cupy_parallel.optim import SGD
        >>> dist.init_process_group("mpi")
        >>> ddp = cupy_parallel.DistributedDataParallel(lambda p, x: x, {"w": np.ones(2)})
        >>> model_sd, optim_sd = get_state_dict(ddp, SGD(ddp.params, lr=0.1, momentum=0.9))
        >>> model_sd, optim_sd["param_groups"][0]["params"]
        ({'w': array([1., 1.])}, ['w'])
        >>> optim_sd["state"]["w"]["momentum_buffer"]  # zeros: a template to load into
        array([0., 0.])
        >>> dist.destroy_process_group()
    """
    described = _Model(model)
    if not isinstance(optimizer, Optimizer):
        raise TypeError(
            "optimizer must be a cupy_parallel.optim optimizer or a ZeroRedundancyOptimizer, "
            f"got {type(optimizer).__name__}."
        )
    leaves = _names_of(optimizer, described)
    state: dict[str, Any] = {}
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        optimizer.init_state()
        for index, entry in optimizer.sharded_state().items():
            state[described.names[leaves[index]]] = entry
    else:
        init_state(optimizer)
        for index, entry in sorted(optimizer.state.items()):
            if not entry:
                continue
            shard = described.shards[leaves[index]]
            state[described.names[leaves[index]]] = {
                key: _shard_like(v, shard)
                if shard is not None and is_array(v) and v.ndim >= 1
                else v
                for key, v in entry.items()
            }
    return described.state(), {
        "state": state,
        "param_groups": _groups(optimizer, described, leaves),
    }


def _copy_into(target: Any, value: Any, where: str) -> None:
    if not is_array(value):
        raise TypeError(f"{where} must be an array, got {type(value).__name__}.")
    if tuple(value.shape) != tuple(target.shape):
        raise ValueError(f"{where} has shape {tuple(value.shape)}, expected {tuple(target.shape)}.")
    if value is target:
        return
    raw = plain_buffer(target)
    source = plain_buffer(value)
    if device_of(value) != device_of(target):
        source = plain_buffer(to_device(value, device_of(target)))
    on_device_of(raw, raw.__setitem__, Ellipsis, source)


def set_state_dict(
    model: Any,
    optimizer: Any,
    *,
    model_state_dict: dict[str, Any],
    optim_state_dict: dict[str, Any],
) -> None:
    """Load :func:`get_state_dict`'s layout into the model and the optimizer (every rank).

    The parameters are written in place (DDP: each whole array; FSDP: this rank's rows), the
    optimizer's state replaced (its own ``load_state_dict``: checked, copied onto the
    parameters' devices; a ZeRO optimizer keeps its partition's). Usually the dicts are those
    :func:`get_state_dict` returned and a checkpoint ``load`` filled.

    Raises:
        TypeError: a wrong model, optimizer or leaf type.
        ValueError: a missing or unknown name, a shape that differs (before anything changes
            in the model).

    Example:
        >>> import numpy as np
        >>> import cupy_parallel
        >>> from cupy_parallel import distributed as dist
        >>> from cupy_parallel.distributed.checkpoint import get_state_dict, set_state_dict
        >>> from cupy_parallel.optim import Adam
        >>> dist.init_process_group("mpi")
        >>> ddp = cupy_parallel.DistributedDataParallel(lambda p, x: x, {"w": np.ones(2)})
        >>> opt = Adam(ddp.params)
        >>> model_sd, optim_sd = get_state_dict(ddp, opt)
        >>> set_state_dict(ddp, opt, model_state_dict={"w": np.full(2, 3.0)},
        ...                optim_state_dict=optim_sd)
        >>> ddp.params["w"]
        array([3., 3.])
        >>> dist.destroy_process_group()
    """
    described = _Model(model)
    if not isinstance(optimizer, Optimizer):
        raise TypeError(
            "optimizer must be a cupy_parallel.optim optimizer or a ZeroRedundancyOptimizer, "
            f"got {type(optimizer).__name__}."
        )
    if not isinstance(model_state_dict, dict):
        raise TypeError(f"model_state_dict must be a dict, got {type(model_state_dict).__name__}.")
    missing = [
        n
        for n, leaf in zip(described.names, described.leaves, strict=True)
        if is_array(leaf) and n not in model_state_dict
    ]
    unknown = [n for n in model_state_dict if n not in described.names]
    if missing or unknown:
        raise ValueError(
            f"model_state_dict does not match the model: missing {missing}, unknown {unknown}."
        )
    writes = []
    for name, leaf, shard in zip(described.names, described.leaves, described.shards, strict=True):
        if not is_array(leaf):
            continue
        value = model_state_dict[name]
        if shard is not None:
            local = value.local if isinstance(value, Shard) else value
            writes.append((shard.local, local, f"model_state_dict[{name!r}]"))
        else:
            writes.append((leaf, value, f"model_state_dict[{name!r}]"))
    for target, value, where in writes:  # every check before any write
        if not is_array(value):
            raise TypeError(f"{where} must be an array or a Shard, got {type(value).__name__}.")
        if tuple(value.shape) != tuple(target.shape):
            raise ValueError(
                f"{where} has shape {tuple(value.shape)}, expected {tuple(target.shape)}."
            )
    leaves = _names_of(optimizer, described)
    whole = _optim_to_indices(optim_state_dict, described, leaves, optimizer)
    for target, value, where in writes:
        _copy_into(target, value, where)
    written = [t for t, v, _ in writes if v is not t]
    if written and tapes_exist():
        note_overwritten(written, "set_state_dict")
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        optimizer.load_sharded_state(whole["state"], whole["param_groups"])
        return
    state: dict[int, dict[str, Any]] = {}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for index, entry in whole["state"].items():
        shard = described.shards[leaves[index]]
        state[index] = {
            key: _padded(v, params[index])
            if isinstance(v, Shard) and shard is not None
            else (v.local if isinstance(v, Shard) else v)
            for key, v in entry.items()
        }
    optimizer.load_state_dict({"state": state, "param_groups": whole["param_groups"]})


def _padded(value: Shard, param: Any) -> Any:
    """A Shard's real rows as an array of the padded FSDP shard's shape (zeros below)."""
    out = empty(tuple(param.shape), value.local.dtype, device_of(param))
    raw = plain_buffer(out)
    rows = int(value.local.shape[0])

    def fill() -> None:
        raw[...] = 0
        raw[:rows] = plain_buffer(value.local)

    on_device_of(raw, fill)
    return out


def _optim_to_indices(
    optim_sd: Any, model: _Model, leaves: list[int], optimizer: Any
) -> dict[str, Any]:
    """``optim_sd`` (names) as the optimizer's torch layout (indices), checked."""
    if not isinstance(optim_sd, dict) or {"state", "param_groups"} - set(optim_sd):
        raise ValueError(
            "optim_state_dict must be a dict with 'state' and 'param_groups' entries (what "
            "get_state_dict returns)."
        )
    index_of = {model.names[k]: i for i, k in enumerate(leaves)}
    state = {}
    for name, entry in optim_sd["state"].items():
        if name not in index_of:
            raise ValueError(
                f"optim_state_dict['state'] has an entry for {name!r}, which is not a parameter "
                "of this optimizer."
            )
        state[index_of[name]] = dict(entry)
    saved_groups = optim_sd["param_groups"]
    counts = [len(g["params"]) for g in optimizer.param_groups]
    if not isinstance(saved_groups, list | tuple) or len(saved_groups) != len(counts):
        raise ValueError(
            f"optim_state_dict has {len(saved_groups)} param groups, the optimizer {len(counts)}."
        )
    groups, start = [], 0
    for g, (group, count) in enumerate(zip(saved_groups, counts, strict=True)):
        names = group.get("params") if isinstance(group, dict) else None
        mine = list(range(start, start + count))
        if (
            not isinstance(names, list | tuple)
            or sorted(index_of.get(n, -1) for n in names) != mine
        ):
            raise ValueError(
                f"optim_state_dict['param_groups'][{g}]['params'] must name the parameters of "
                f"the optimizer's param group {g}, "
                f"{[model.names[leaves[i]] for i in mine]}, got {names!r}."
            )
        groups.append({**group, "params": mine})
        start += count
    return {"state": dict(sorted(state.items())), "param_groups": groups}
