"""Which arrays a model object reads as its parameters, told to the optimizers updating them.

A :class:`~cupy_parallel.DistributedDataParallel` reads the arrays of ``ddp.params``; binding
a new tree (``ddp.params = new_tree``) lets the old arrays go. An optimizer built over them
updates them in place, so its steps would move arrays the model no longer reads, and the new
ones would never move: no error, no training. The holder says what it lets go and what it takes
up (:func:`rebind`); each optimizer registers the arrays it updates (:func:`track`) and asks,
before every step, which of them were let go since (:func:`let_go`). A holder whose tree can
change in place (``ddp.params["w"] = new``, which it reads again at its next call) registers
with :func:`hold`, so that it reads its tree again before an optimizer over its arrays steps.

This module sits at the bottom of the package and imports nothing from it.
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

__all__ = ["hold", "let_go", "rebind", "track"]

_TRACKED: weakref.WeakKeyDictionary[Any, tuple[set[int], dict[int, tuple[str, int]]]] = (
    weakref.WeakKeyDictionary()
)
"""Each user (an optimizer): the ids of the arrays it updates, and those let go (by whom, from
which of the holder's places).

The user holds its arrays, so their ids stay theirs while it lives.
"""
_LOCK = threading.Lock()
_HOLDERS: weakref.WeakSet[Any] = weakref.WeakSet()
"""The holders that read their tree again on request (:func:`hold`)."""


def hold(holder: Any, /) -> None:
    """Have ``holder`` asked to read its tree again before a user of its arrays steps.

    ``holder._reread_binding(ids)``: if the holder holds an array whose id is in ``ids`` and its
    tree changed in place since it last read it, it reads it again (and calls :func:`rebind`).
    Kept weakly.

    Example:
        >>> import numpy as np
        >>> class Optimizer: ...
        >>> class Holder:
        ...     def __init__(self, tree):
        ...         self.tree, self.arrays = tree, list(tree.values())
        ...
        ...     def _reread_binding(self, ids):
        ...         if ids & {id(a) for a in self.arrays}:
        ...             old, self.arrays = self.arrays, list(self.tree.values())
        ...             rebind(old, self.arrays, "holder.tree")
        >>> opt, tree = Optimizer(), {"w": np.ones(2)}
        >>> holder = Holder(tree)
        >>> hold(holder)
        >>> track(opt, [tree["w"]])
        >>> tree["w"] = np.zeros(2)  # replaced in place, not yet read again
        >>> list(let_go(opt).values())
        ['holder.tree']
    """
    with _LOCK:
        _HOLDERS.add(holder)


def track(user: Any, arrays: Iterable[Any], /) -> None:
    """Have ``user`` (an optimizer, which keeps ``arrays`` alive) told when they are let go.

    Example:
        >>> import numpy as np
        >>> class Optimizer: ...
        >>> opt, w = Optimizer(), np.ones(2)
        >>> track(opt, [w])
        >>> rebind([w], [np.ones(2)], "ddp.params")
        >>> let_go(opt) == {id(w): "ddp.params"}
        True
    """
    with _LOCK:
        ids, _ = _TRACKED.setdefault(user, (set(), {}))
        ids.update(id(a) for a in arrays)


def rebind(old: Sequence[Any], new: Sequence[Any], holder: str, /) -> None:
    """``holder`` (named in the caller's words) reads the arrays ``new`` instead of ``old``.

    ``old`` and ``new`` are the holder's arrays place by place (its leaves, in order). Each
    user's array that left its place is let go by ``holder``, also when it is held at another
    place now: a tree holding the same arrays at swapped leaves gets the gradient of one leaf
    for the other's array, which the user's step would apply to the array it held there. One
    that comes back to the place it was let go from is held again (a tree bound back).

    Example:
        >>> import numpy as np
        >>> class Optimizer: ...
        >>> opt, w, v = Optimizer(), np.ones(2), np.ones(2)
        >>> track(opt, [w, v])
        >>> rebind([w, v], [v, w], "ddp.params")  # swapped: each array at the other's leaf
        >>> sorted(let_go(opt).values())
        ['ddp.params', 'ddp.params']
        >>> rebind([v, w], [w, v], "ddp.params")  # bound back: each at its own leaf again
        >>> let_go(opt)
        {}
    """
    if not _TRACKED:
        return
    gone: dict[int, int] = {}  # id -> the first place it left
    taken: dict[int, int] = {}  # id -> the first place it was put at
    for place, (before, after) in enumerate(zip(old, new, strict=True)):
        if before is not after:
            gone.setdefault(id(before), place)
            taken.setdefault(id(after), place)
    with _LOCK:
        for ids, released in _TRACKED.values():
            for key in gone.keys() & ids:
                released.setdefault(key, (holder, gone[key]))  # where the user last saw it
            for key in taken.keys() & released.keys():
                if released[key] == (holder, taken[key]):
                    del released[key]


def let_go(user: Any, /) -> dict[int, str]:
    """The ids of ``user``'s arrays a holder let go since it tracked them, each with the holder.

    Example:
        >>> class Optimizer: ...
        >>> let_go(Optimizer())
        {}
    """
    with _LOCK:
        found = _TRACKED.get(user)
        holders = list(_HOLDERS)
    if found is None:
        return {}
    for holder in holders:  # outside the lock: a holder that reads again calls rebind
        holder._reread_binding(found[0])
    with _LOCK:
        return {key: who for key, (who, _) in found[1].items()}
