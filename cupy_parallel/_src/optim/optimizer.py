"""The optimizer base: torch.optim.Optimizer's param groups, state and state dict, over pytrees.

An :class:`Optimizer` holds the parameter arrays (the leaves of a pytree, or of one pytree per
param group) and updates them **in place** in :meth:`Optimizer.step`, given the gradients as a
tree shaped as the parameters. Subclasses say what a group's hyper-parameters are
(:attr:`Optimizer._hyper`, checked for every group as torch checks the constructor's), which
state keys a parameter has (:meth:`Optimizer._state_keys`), and how one parameter is updated
(:meth:`Optimizer._update`, which runs on the parameter's device through :mod:`.updates`).
"""

from __future__ import annotations

import copy
import itertools
import operator
from collections.abc import Iterator, MappingView
from typing import TYPE_CHECKING, Any, ClassVar

from cupy_parallel._src import tree
from cupy_parallel._src.arguments import read_real
from cupy_parallel._src.arrays import (
    _bounds_meet,
    check_outs,
    device_of,
    empty,
    is_array,
    shares_memory,
    to_device,
)
from cupy_parallel._src.bindings import let_go, track
from cupy_parallel._src.optim.updates import Workspace
from cupy_parallel._src.recording import note_overwritten, tapes_exist

if TYPE_CHECKING:
    from collections.abc import Callable

    from optree import PyTreeSpec

__all__ = ["Optimizer", "check_nonnegative", "zeros_like"]


def check_nonnegative(value: Any, what: str, /) -> float:
    """``value`` as a float, ``ValueError("Invalid {what}: value")`` below 0 or NaN (torch's words).

    torch's Adam refuses NaN (``not 0.0 <= lr``), its SGD lets it through (``lr < 0.0``) to
    make every parameter NaN; both refuse it here, at construction and at every step (a
    scheduler's NaN lr too).

    Example:
        >>> check_nonnegative(0.1, "learning rate")
        0.1
        >>> check_nonnegative(-1, "learning rate")
        Traceback (most recent call last):
        ...
        ValueError: Invalid learning rate: -1
        >>> check_nonnegative(float("nan"), "learning rate")
        Traceback (most recent call last):
        ...
        ValueError: Invalid learning rate: nan
    """
    number = read_real(value, what)
    if not number >= 0.0:  # NaN too: torch's Adam refuses it; a NaN step makes every entry NaN
        raise ValueError(f"Invalid {what}: {value}")
    return number


def _is_group_list(params: Any) -> bool:
    """Whether ``params`` is torch's list of param groups (dicts with a ``"params"`` key)."""
    if not isinstance(params, list | tuple) or not params:
        return False
    marked = [isinstance(g, dict) and "params" in g for g in params]
    if any(marked) and not all(marked):
        raise TypeError(
            "params mixes param groups (dicts with a 'params' key) with other entries: pass "
            "either a pytree of arrays or a list of param groups "
            "[{'params': tree, 'lr': ...}, ...], got entries of types "
            f"{[type(g).__name__ for g in params]}."
        )
    return all(marked)


class Optimizer:
    """Base class of the optimizers: torch.optim.Optimizer for pytrees of arrays.

    ``params`` is a pytree of arrays (NumPy, HostArray or CuPy: each updated on its own device)
    or torch's list of param groups ``[{"params": tree, "lr": ..., ...}, ...]``; a group's
    missing hyper-parameters come from ``defaults``. ``param_groups`` is torch's list of
    dicts: ``group["params"]`` lists the group's arrays in flatten order, and the other entries
    are the hyper-parameters, read at every :meth:`step` (a scheduler sets ``"lr"``).

    The parameters are the tree's real floating-point array leaves; other leaves (a model's
    name, a Python number, an integer table) ride along untouched, as the tape does not
    differentiate them (``DistributedDataParallel.params`` may hold such leaves), and their
    gradient must be ``None``. A NumPy scalar (``np.float64(0.5)``) is such a leaf too: it is
    immutable, so nothing can update it in place; a trainable scalar is a 0-d array.

    Decided where torch differs because arrays are values here:

    * :meth:`step` takes the gradients (``step(grads)``), as trees shaped as the params (with
      param groups: a list, one tree per group); there is no ``.grad`` and so no ``zero_grad``
      (the tape returns fresh gradients every pass) and no ``closure``.
    * ``state`` is keyed by the parameter's index (its position in flatten order, groups in
      order) instead of by the parameter (arrays are not hashable): the index the state dict
      uses.
    * float16 parameters: each step computes in float32 (torch's "opmath") and rounds the
      parameter and its state to float16 once, at the end. torch rounds after each of its ops,
      so values differ within float16's rounding; and torch's ``eps=1e-8`` becomes 0 in a
      float16 op, so it divides by zero (inf, NaN) where ``exp_avg_sq`` underflows, which
      this update does not.
    * The state's ``step`` is a Python ``float`` (torch keeps a 0-d float32 tensor and reads it
      with ``.item()``; a float is device-free and exact up to 2**53 steps). torch's
      ``load_state_dict`` accepts it as it is (it converts a non-tensor step).
    * The optimizer keeps each group's params tree as given (your dict or list, or
      ``ddp.params``), and every :meth:`step` checks, before anything is written, that the
      tree's parameter leaves are still the arrays it updates in place: a leaf replaced by
      another array (``params["w"] = w - lr * g``, ``ddp.params["w"] = new``), or a changed
      structure, is a ``ValueError`` naming the leaf. torch steps the old tensor silently
      then, and the new one never moves. Update parameters in place (``params["w"][...] =
      new``, ``params["w"] -= lr * g``) or build a new optimizer over the new arrays (loading
      the old one's :meth:`state_dict` keeps the state; :meth:`state_dict` does not check,
      for that). The check flattens each tree once per step and compares identities. A
      model object that lets the arrays go is seen too: after ``ddp.params = new_tree`` (a
      :class:`~cupy_parallel.DistributedDataParallel`'s tree replaced whole, by arrays
      other than the optimizer's), the step raises ``ValueError`` naming the parameter,
      whichever tree the optimizer was given. Only binding a plain name to a new tree
      (``params = {...}``) stays unseen: nothing holds the old one but the optimizer.

    Example:
        >>> import numpy as np
        >>> from cupy_parallel.optim import SGD
        >>> params = {"w": np.ones(2), "b": np.zeros(1)}
        >>> opt = SGD(params, lr=0.5)
        >>> opt.step({"w": np.array([1.0, 2.0]), "b": None})
        >>> params["w"], params["b"]
        (array([0.5, 0. ]), array([0.]))
        >>> [len(g["params"]) for g in opt.param_groups], opt.param_groups[0]["lr"]
        ([2], 0.5)
        >>> params["w"][...] = [3.0, 3.0]  # in place: the optimizer's array, fine
        >>> params["w"] = params["w"] * 2  # a new array: the step would move the old one
        >>> opt.step({"w": np.ones(2), "b": None})
        Traceback (most recent call last):
        ...
        ValueError: params['w'] is no longer the array this SGD updates: ...
    """

    _hyper: ClassVar[dict[str, Callable[[Any], Any]]] = {}
    """Each hyper-parameter's check (it returns the value to keep), for defaults and groups."""

    def __init__(self, params: Any, defaults: dict[str, Any]) -> None:
        self.defaults = dict(defaults)
        self.param_groups: list[dict[str, Any]] = []
        self.state: dict[int, dict[str, Any]] = {}
        self._specs: list[PyTreeSpec] = []
        self._masks: list[list[bool]] = []
        self._dotted: list[list[str]] = []  # each parameter's path, joined by dots (torch's name)
        self._roots: list[Any] = []  # each group's params tree, as given: checked at each step
        self._grouped = _is_group_list(params)
        self._workspace = Workspace()
        for group in params if self._grouped else [{"params": params}]:
            self.add_param_group(group)

    def __repr__(self) -> str:
        lines = [f"{type(self).__name__} ("]
        for i, group in enumerate(self.param_groups):
            lines.append(f"Parameter Group {i}")
            lines.extend(f"    {k}: {v}" for k, v in sorted(group.items()) if k != "params")
        return "\n".join([*lines, ")"])

    # -----------------------------------------------------------------------------------------
    # param groups

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group ``{"params": tree, **hyper-parameters}`` (torch's ``add_param_group``).

        Its arrays take the next indices; missing hyper-parameters come from ``defaults``.
        With groups, :meth:`step` then takes one more gradient tree.

        Example:
            >>> import numpy as np
            >>> from cupy_parallel.optim import SGD
            >>> opt = SGD([{"params": [np.ones(1)]}], lr=0.1)
            >>> opt.add_param_group({"params": {"b": np.ones(2)}, "lr": 0.01})
            >>> [g["lr"] for g in opt.param_groups]
            [0.1, 0.01]
        """
        if not isinstance(param_group, dict) or "params" not in param_group:
            raise TypeError(
                "param_group must be a dict with a 'params' entry, got "
                f"{type(param_group).__name__}."
            )
        if self.param_groups and not self._grouped:
            raise ValueError(
                "this optimizer was given one pytree of params, so step(grads) takes one tree; "
                "construct it with a list of param groups to add groups."
            )
        names, leaves, spec = tree.flatten_with_names(param_group["params"], "params")
        for name, leaf in zip(names, leaves, strict=True):
            if isinstance(leaf, Iterator | MappingView):  # torch's model.parameters() habit
                raise TypeError(
                    f"{name} is a {type(leaf).__name__}, which is no pytree (its arrays would "
                    "not be parameters): pass a list of the arrays (list(...)) or the dict "
                    "itself."
                )
            if is_array(leaf) and leaf.dtype.kind == "c":  # it would ride along, never updated
                raise TypeError(
                    f"{name} is a complex array ({leaf.dtype}); the optimizers update real "
                    "floating-point arrays: pass its real view instead (torch's view_as_real: "
                    "p.view(p.real.dtype), and the gradient likewise), which the step updates "
                    "in place, real and imaginary parts as separate entries as torch does."
                )
        mask = [is_parameter(leaf) for leaf in leaves]
        named = [(n, leaf) for n, leaf, keep in zip(names, leaves, mask, strict=True) if keep]
        leaves = [leaf for _, leaf in named]
        if not leaves and not self._grouped:  # torch: an empty group in a list is fine
            raise ValueError(
                "optimizer got an empty parameter list (no floating-point array among the "
                f"leaves {names})"
            )
        seen = {id(p) for g in self.param_groups for p in g["params"]}
        if len({id(p) for p in leaves}) != len(leaves) or seen & {id(p) for p in leaves}:
            raise ValueError("some parameters appear in more than one parameter group")
        # the step writes every parameter in place: a read-only one would fail mid-step (after
        # the parameters before it were updated), a self-overlapping one (a zero stride) would
        # keep only its last element's update, and two that share memory would overwrite each
        # other's update; refused here, before any step
        if self._grouped:
            root = f"param_groups[{len(self.param_groups)}]['params']"
            named = [(root + n.removeprefix("params"), leaf) for n, leaf in named]
        earlier = [
            (f"param_groups[{i}]['params'][{j}]", p)
            for i, g in enumerate(self.param_groups)
            for j, p in enumerate(g["params"])
        ]
        check_outs(earlier + named, [], f"{type(self).__name__}.step")
        # keys beyond the defaults are kept as given, as torch keeps them ("initial_lr", names)
        group = {k: v for k, v in param_group.items() if k != "params"}
        for key in self.defaults:
            group.setdefault(key, self.defaults[key])
        group.update(self._read_hyper(group))
        group["params"] = leaves
        track(self, leaves)
        self.param_groups.append(group)
        self._roots.append(param_group["params"])
        self._specs.append(spec)
        self._masks.append(mask)
        self._dotted.append(
            [
                ".".join(str(getattr(e, "field", None) or e.entry) for e in accessor)
                for accessor, keep in zip(spec.accessors(), mask, strict=True)
                if keep
            ]
        )

    # -----------------------------------------------------------------------------------------
    # step

    def _check_bound(self) -> None:
        """Refuse a params tree whose parameters are no longer the arrays this optimizer updates.

        Each group's tree, as given (the user's dict or list, ``ddp.params``), is flattened again
        and its parameter leaves compared by identity with the arrays the step writes: a leaf
        replaced by another array (``params["w"] = w - lr * g``) would leave the step moving the
        old array, which nothing reads any more. Costs one flatten per group (no array is read).
        A parameter a model object let go (``ddp.params = new_tree``) is refused too.
        """
        for i, (root, spec, mask, group) in enumerate(
            zip(self._roots, self._specs, self._masks, self.param_groups, strict=True)
        ):
            leaves, now = tree.flatten_leaves(root)
            params = group["params"]
            if now == spec:
                kept = list(itertools.compress(leaves, mask))
                if len(kept) == len(params) and all(map(operator.is_, kept, params)):
                    others = itertools.compress(leaves, map(operator.not_, mask))
                    if not any(map(is_parameter, others)):
                        continue
            self._refuse_rebound(i, leaves, now)
        gone = let_go(self)
        if gone:
            self._refuse_let_go(gone)

    def _refuse_let_go(self, gone: dict[int, str]) -> None:
        """The error for parameters a model object no longer reads (``gone``: id -> its name)."""
        name = type(self).__name__
        for i, (spec, mask, group) in enumerate(
            zip(self._specs, self._masks, self.param_groups, strict=True)
        ):
            root = f"param_groups[{i}]['params']" if self._grouped else "params"
            paths = itertools.compress(tree.leaf_names(spec, root), mask)
            for path, param in zip(paths, group["params"], strict=True):
                holder = gone.get(id(param))
                if holder is None:
                    continue
                raise ValueError(
                    f"{path} is an array {holder} no longer holds: a new tree was bound to "
                    f"{holder} after this {name} was built, so the step would move the old "
                    "array, which the model no longer reads, and never the new one. Build the "
                    f"{name} over the new parameters ({name}({holder}, ...); load the old one's "
                    "state_dict into it to keep the state), or update the parameters in place "
                    f"({holder}['w'][...] = new) instead of binding a new tree."
                )

    def _refuse_rebound(self, group: int, leaves: list[Any], now: PyTreeSpec) -> None:
        """The error for :meth:`_check_bound`'s group ``group``, naming the first leaf replaced."""
        root = f"param_groups[{group}]['params']" if self._grouped else "params"
        name = type(self).__name__
        spec, mask = self._specs[group], self._masks[group]
        fresh = (
            f"build a new {name} over the new arrays (load the old one's state_dict into it to "
            "keep the state)"
        )
        if now != spec:
            difference = tree.structure_difference(spec, now)
            where, before, after = difference if difference else ("(the root)", "?", "?")
            raise ValueError(
                f"{root} changed structure after the {name} was built (at {root}"
                f"{where.removeprefix('(the root)')}: {before} then, {after} now): the "
                "optimizer updates the arrays it was given in place, so a parameter added to "
                "the tree would never be updated and a removed one would still be. Keep the "
                f"tree's structure, or {fresh}; add new parameters in a tree of their own with "
                "add_param_group."
            )
        names = tree.leaf_names(spec, root)
        params = iter(self.param_groups[group]["params"])
        for path, leaf, is_param in zip(names, leaves, mask, strict=True):
            if not is_param:
                if is_parameter(leaf):
                    raise ValueError(
                        f"{path} is a floating-point array now, but was no parameter when the "
                        f"{name} was built, so the step would never update it: {fresh}."
                    )
                continue
            held = next(params, None)
            if leaf is not held:
                raise ValueError(
                    f"{path} is no longer the array this {name} updates: another object was "
                    f"put in its place after the optimizer was built ({path} = ...), but the "
                    "optimizer updates its parameters in place and still holds the old array, "
                    "so the step would move an array nothing reads. Update the parameter in "
                    f"place instead ({path}[...] = new, or {path} -= lr * g), or {fresh}."
                )
        raise ValueError(  # the group's list of parameters itself was changed
            f"param_groups[{group}]['params'] no longer lists the arrays of {root} the "
            f"{name} was built with: {fresh}."
        )

    def _grads_of(self, grads: Any) -> list[list[Any]]:
        """The gradients of each group, flattened as its params; every check before any update."""
        if self._grouped:
            if not isinstance(grads, list | tuple) or len(grads) != len(self.param_groups):
                got = (
                    f"a {type(grads).__name__} of {len(grads)}"
                    if isinstance(grads, list | tuple)
                    else f"a {type(grads).__name__}"
                )
                raise ValueError(
                    f"grads must be a list of {len(self.param_groups)} gradient trees, one per "
                    f"param group, got {got}."
                )
            trees = list(grads)
        else:
            trees = [grads]
        out = []
        checked: list[tuple[str, Any, Any]] = []
        for i, (group, spec, mask, grad_tree) in enumerate(
            zip(self.param_groups, self._specs, self._masks, trees, strict=True)
        ):
            root = f"grads[{i}]" if self._grouped else "grads"
            named = _flatten_like(grad_tree, spec, mask, group["params"], root)
            out.append([grad for _, grad in named])
            checked += [
                (path, grad, param)
                for (path, grad), param in zip(named, group["params"], strict=True)
                if grad is not None
            ]
        _refuse_aliasing(checked)
        return out

    def step(self, grads: Any) -> None:
        """One update of every parameter with a gradient, in place; ``None`` gradients skip theirs.

        ``grads``: a tree shaped as the params (with param groups: a list, one tree per group);
        a ``None`` leaf leaves its parameter and its state as they are (torch's ``.grad is
        None``). Each gradient must have its parameter's shape, dtype and device. Everything is
        checked before anything is written, and so are the params: a leaf of the tree given
        at construction that is no longer the array this optimizer updates (replaced, not
        updated in place) is a ``ValueError`` (see the class). Every tape that still needs a
        parameter (or its state) is told it was overwritten: its ``gradient`` then raises.
        """
        self._check_bound()
        per_group = self._grads_of(grads)
        hypers = [self._read_hyper(group) for group in self.param_groups]
        index = 0
        for group, hyper, group_grads in zip(self.param_groups, hypers, per_group, strict=True):
            wanted = self._state_keys(hyper)
            for param, grad in zip(group["params"], group_grads, strict=True):
                state = self.state.get(index)
                if grad is not None and state and any(k not in state for k in wanted):
                    raise ValueError(
                        f"the state of parameter {index} has {sorted(state)}, but "
                        f"{type(self).__name__} with this group's hyper-parameters needs "
                        f"{sorted(wanted)} (was a hyper-parameter such as amsgrad switched on "
                        "mid-run?)."
                    )
                del param
                index += 1
        index = 0
        for group, hyper, group_grads in zip(self.param_groups, hypers, per_group, strict=True):
            written = []
            for param, grad in zip(group["params"], group_grads, strict=True):
                if grad is not None:
                    state = self.state.setdefault(index, {})
                    self._update(param, grad, state, hyper)
                    written.append(param)
                    written.extend(v for v in state.values() if is_array(v))
                index += 1
            if written and tapes_exist():
                note_overwritten(written, f"{type(self).__name__}.step")

    def _read_hyper(self, group: dict[str, Any]) -> dict[str, Any]:
        """A group's hyper-parameters, each checked (torch's constructor checks, every group)."""
        hyper = {key: check(group[key]) for key, check in self._hyper.items()}
        self._check_group(hyper)
        return hyper

    def _check_group(self, hyper: dict[str, Any]) -> None:
        """Checks across a group's hyper-parameters (after each one's own)."""

    def _update(self, param: Any, grad: Any, state: dict[str, Any], hyper: dict[str, Any]) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not define its update")

    def _state_keys(self, hyper: dict[str, Any]) -> tuple[str, ...]:
        """The keys a parameter's (non-empty) state has under a group's hyper-parameters."""
        raise NotImplementedError(f"{type(self).__name__} does not define its state")

    # -----------------------------------------------------------------------------------------
    # state dict

    def state_dict(self) -> dict[str, Any]:
        """Torch's layout: ``{"state": {index: {...}}, "param_groups": [{..., "params": [...]}]}``.

        ``index`` is the parameter's position in flatten order, groups in order; a parameter
        that never had a gradient has no entry. Each entry is the parameter's own state dict,
        as in torch (not a copy: its arrays and its ``step`` follow later steps, so a checkpoint
        loader may fill it in place, and a snapshot to keep needs ``copy.deepcopy``); the groups
        are copies.

        Example:
            >>> import numpy as np
            >>> from cupy_parallel.optim import Adam
            >>> opt = Adam([np.ones(2), np.ones(3)], lr=0.1)
            >>> opt.step([np.ones(2), None])
            >>> sd = opt.state_dict()
            >>> sorted(sd["state"]), sorted(sd["state"][0]), sd["param_groups"][0]["params"]
            ([0], ['exp_avg', 'exp_avg_sq', 'step'], [0, 1])
        """
        groups = []
        start = 0
        for group in self.param_groups:
            packed = {k: copy.deepcopy(v) for k, v in group.items() if k != "params"}
            packed["params"] = list(range(start, start + len(group["params"])))
            start += len(group["params"])
            groups.append(packed)
        # each parameter's own state dict, as torch's: a copy would freeze "step" (a float)
        # while the arrays go on changing, a torn snapshot that resumes with the wrong bias
        # correction
        state = {i: s for i, s in sorted(self.state.items()) if s}
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load :meth:`state_dict`'s layout (ours or torch's, with arrays for tensors): copies.

        Checked before anything changes: the number of groups and of parameters in each, the
        state's keys for this optimizer, and every array's shape (torch checks only the
        counts). Arrays are copied onto their parameter's device in its dtype (``step`` as a
        float); the groups' hyper-parameters replace this optimizer's (the ``params`` stay).
        """
        if not isinstance(state_dict, dict) or {"state", "param_groups"} - set(state_dict):
            raise ValueError(
                "state_dict must be a dict with 'state' and 'param_groups' entries (what "
                f"state_dict() returns), got {_describe(state_dict)}."
            )
        saved_groups = state_dict["param_groups"]
        if not isinstance(saved_groups, list | tuple) or len(saved_groups) != len(
            self.param_groups
        ):
            count = len(saved_groups) if isinstance(saved_groups, list | tuple) else saved_groups
            raise ValueError(
                "loaded state dict has a different number of parameter groups: "
                f"{count} saved, {len(self.param_groups)} in this optimizer."
            )
        ids: dict[Any, tuple[int, Any]] = {}
        new_groups = []
        start = 0
        for i, (group, saved) in enumerate(zip(self.param_groups, saved_groups, strict=True)):
            if not isinstance(saved, dict) or not isinstance(saved.get("params"), list | tuple):
                raise ValueError(
                    f"loaded param_groups[{i}] must be a dict with a 'params' list, got "
                    f"{_describe(saved)}."
                )
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(
                    "loaded state dict contains a parameter group that doesn't match the size "
                    f"of optimizer's group: param_groups[{i}] has {len(saved['params'])} "
                    f"parameters saved, {len(group['params'])} here."
                )
            new = {k: copy.deepcopy(v) for k, v in saved.items() if k != "params"}
            for key in self.defaults:
                new.setdefault(key, group[key])
            hyper = self._read_hyper(new)
            for j, saved_id in enumerate(saved["params"]):
                k = self._position_of(i, j, saved.get("param_names"))
                ids[saved_id] = (start + k, (group["params"][k], hyper))
            if self._reordered(i, saved.get("param_names")):
                new["param_names"] = list(self._dotted[i])  # in the order of our indices
            new["params"] = group["params"]
            new_groups.append(new)
            start += len(group["params"])
        state: dict[int, dict[str, Any]] = {}
        saved_state = state_dict["state"]
        if not isinstance(saved_state, dict):
            raise ValueError(f"state_dict['state'] must be a dict, got {_describe(saved_state)}.")
        for saved_id, entry in saved_state.items():
            if saved_id not in ids:
                raise ValueError(
                    f"state_dict['state'] has an entry for parameter {saved_id!r}, which no "
                    "param group lists."
                )
            index, (param, hyper) = ids[saved_id]
            state[index] = self._load_entry(
                entry, param, hyper, f"state_dict['state'][{saved_id!r}]"
            )
        self.param_groups[:] = new_groups
        self.state = state

    def _position_of(self, group: int, saved: int, saved_names: Any) -> int:
        """Where the ``saved``-th parameter of a saved group is in ours, by torch's names.

        A torch optimizer built from ``model.named_parameters()`` saves each group's
        ``param_names`` in the model's order, while a dict of those names flattens in sorted
        key order (``"10.weight"`` before ``"2.weight"``): when the saved names are a
        permutation of this group's (each leaf's path, joined by dots: ``{"0": {"weight": w}}``
        is ``"0.weight"``), the state goes to the parameter of that name, not of that position
        (equal shapes would otherwise take each other's state silently). Otherwise, as in
        torch, the position decides.
        """
        if not self._reordered(group, saved_names):
            return saved
        return self._dotted[group].index(str(saved_names[saved]))

    def _reordered(self, group: int, saved_names: Any) -> bool:
        """Whether ``saved_names`` are this group's names in another order."""
        ours = self._dotted[group]
        return (
            isinstance(saved_names, list | tuple)
            and list(saved_names) != ours
            and len(set(ours)) == len(ours)
            and sorted(map(str, saved_names)) == sorted(ours)
        )

    def _load_entry(
        self, entry: Any, param: Any, hyper: dict[str, Any], where: str
    ) -> dict[str, Any]:
        if not isinstance(entry, dict):
            raise ValueError(f"{where} must be a dict, got {_describe(entry)}.")
        if not entry:
            return {}
        wanted = self._state_keys(hyper)
        missing = [k for k in wanted if k not in entry]
        if missing:
            raise ValueError(
                f"{where} lacks {missing} for {type(self).__name__} with these "
                f"hyper-parameters (it has {sorted(entry)})."
            )
        loaded: dict[str, Any] = {}
        for key in wanted:
            value = entry[key]
            if key == "step":
                loaded[key] = _read_step(value, f"{where}['step']")
                continue
            if value is None:
                loaded[key] = None
                continue
            moved = to_device(value, device_of(param))  # also takes DLPack producers (torch)
            if tuple(moved.shape) != tuple(param.shape):
                raise ValueError(
                    f"{where}[{key!r}] has shape {tuple(moved.shape)}, its parameter "
                    f"{tuple(param.shape)}."
                )
            if moved.dtype.kind not in "fiu":
                raise TypeError(f"{where}[{key!r}] must be a real array, got dtype {moved.dtype}.")
            device = device_of(param)
            out = empty(param.shape, param.dtype, device)
            with device:  # a CuPy kernel runs on the current device: make it the array's
                out[...] = moved  # a copy, in the parameter's dtype (torch casts the same way)
            loaded[key] = out
        return loaded


def zeros_like(param: Any) -> Any:
    """Zeros shaped as ``param``, C-contiguous, on its device (a state array).

    Example:
        >>> import numpy as np
        >>> zeros_like(np.ones((2, 1), np.float32))
        array([[0.],
               [0.]], dtype=float32)
    """
    device = device_of(param)
    out = empty(param.shape, param.dtype, device)
    with device:  # a CuPy kernel runs on the current device: make it the array's
        out[...] = 0
    return out


def is_parameter(leaf: Any, /) -> bool:
    """Whether a leaf of the params is a parameter: a real floating-point array.

    Other leaves (strings, Python numbers, integer arrays) ride along untouched, as the tape
    does not differentiate them; their gradient must be ``None``.

    Example:
        >>> import numpy as np
        >>> is_parameter(np.zeros(2)), is_parameter(np.zeros(2, int)), is_parameter(1.0)
        (True, False, False)
    """
    return is_array(leaf) and leaf.dtype.kind == "f"


def _read_step(value: Any, where: str) -> float:
    if is_array(value) or hasattr(value, "__dlpack__"):
        if getattr(value, "shape", None) not in ((), (1,)):
            raise ValueError(f"{where} must be a number or a 0-d array, got shape {value.shape}.")
        value = to_device(value, "cpu").reshape(()).item()
    return read_real(value, where)


def _describe(value: Any) -> str:
    if isinstance(value, dict):
        return f"a dict with keys {sorted(map(str, value))}"
    return f"a {type(value).__name__}"


def _flatten_like(
    grads: Any, spec: PyTreeSpec, mask: list[bool], params: list[Any], root: str
) -> list[tuple[str, Any]]:
    """``(path, grad)`` at the params' leaf positions (``None`` allowed), or a clear error."""
    _, leaves, grad_spec = tree.flatten(grads)
    if grad_spec == spec:
        flat = leaves
    else:
        try:
            flat = spec.flatten_up_to(grads)
        except (ValueError, TypeError):
            difference = tree.structure_difference(spec, grad_spec)
            where = (
                f" at {root}{difference[0]}" if difference and difference[0] != "(the root)" else ""
            )
            said = f": params have {difference[1]}, grads {difference[2]}" if difference else ""
            raise ValueError(
                f"{root} must be shaped as the params (a None leaf for a parameter without a "
                f"gradient), but its structure differs{where}{said}."
            ) from None
    paths = [a.codify(root) for a in spec.accessors()]
    kept = []
    for path, is_param, grad in zip(paths, mask, flat, strict=True):
        if is_param:
            kept.append((path, grad))
        elif grad is not None:
            raise ValueError(
                f"{path} must be None: its leaf in the params is not a floating-point array, so "
                f"it is no parameter, but the gradient is a {type(grad).__name__}."
            )
    for (path, grad), param in zip(kept, params, strict=True):
        if grad is None:
            continue
        if not is_array(grad):
            raise TypeError(f"{path} must be an array or None, got {type(grad).__name__}.")
        if grad.shape != param.shape or grad.dtype != param.dtype:
            raise ValueError(
                f"{path} must have its parameter's shape and dtype {tuple(param.shape)} "
                f"{param.dtype}, got {tuple(grad.shape)} {grad.dtype}."
            )
        if device_of(grad) != device_of(param):
            raise ValueError(
                f"{path} is on {device_of(grad)}, its parameter on {device_of(param)}: move the "
                "gradient to the parameter's device."
            )
    return kept


def _refuse_aliasing(checked: list[tuple[str, Any, Any]]) -> None:
    """Refuse a gradient sharing memory with a parameter: the in-place steps would change it.

    ``checked``: ``(path, grad, param)`` of every gradient to apply. Its own parameter's
    update would change the gradient it reads; another parameter's update, made first, would
    change the gradient before its step reads it (grads ``{"a": b, "b": a}`` for the
    gradient of ``sum(a * b)``: ``b`` moved by the new ``a``). Only arrays whose memory
    bounds meet are tested (a sort, not every pair).
    """
    count = len(checked)
    named = [(path, param) for path, _, param in checked]
    named += [(path, grad) for path, grad, _ in checked]
    for i, j in _bounds_meet(named):
        if (i < count) == (j < count):  # two parameters (refused when added) or two gradients
            continue
        own, other = (j - count, i) if i < count else (i - count, j)
        if not shares_memory(named[i][1], named[j][1]):
            continue
        path = checked[own][0]
        if own == other:
            raise ValueError(
                f"{path} shares memory with its parameter, which the step writes in place; "
                "pass a copy of it."
            )
        raise ValueError(
            f"{path} shares memory with another parameter (the one {checked[other][0]} is "
            "for), which the step writes in place: pass a copy of it."
        )
