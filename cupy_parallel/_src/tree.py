"""Pytrees in cupy_parallel: the one flattener, key paths and structure differences.

Every nested structure the library takes (``scatter``/``gather`` batches, ``replicate``'s
parameters, ``Tape.watch``/``gradient`` sources and targets, ``stop_gradient``, ``grad``'s
arguments) is flattened by :func:`flatten` here and by nothing else, so that all of them agree on
what a container is:

- optree under :data:`NAMESPACE`: a class registered once
  (``optree.register_pytree_node(..., namespace="cupy_parallel")``) is a container everywhere;
- subclasses of tuple, list, dict, ``OrderedDict``, ``defaultdict`` and ``deque`` that are not
  registered are seen through their base, as torch's ``isinstance`` tests treat them (optree alone
  would see such an object as one leaf). Unflattening rebuilds the subclass when it *can be
  rebuilt*: calling the class with the base's contents, ``cls(items)`` (``cls(default_factory,
  items)`` for a ``defaultdict``, ``cls(items, maxlen)`` for a ``deque``), must return an instance
  of the class holding exactly those contents (same keys in the same order, the same objects).
  Otherwise the nearest base comes back, as torch returns plain lists and tuples for subclasses.
  Attributes an instance holds besides its contents are not carried over; register the class
  with optree to control this.

This module is the bottom layer: it imports nothing from the package.
"""

from __future__ import annotations

import math
from collections import OrderedDict, defaultdict, deque
from typing import TYPE_CHECKING, Any

import numpy as np
import optree
from optree import PyTreeAccessor, PyTreeSpec

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = [
    "NAMESPACE",
    "add_array_type",
    "flatten",
    "flatten_leaves",
    "flatten_with_names",
    "key_path",
    "leaves",
    "leaves_equal",
    "structure_difference",
    "tree_map",
]

NAMESPACE = "cupy_parallel"
"""The optree namespace of pytrees in this package (custom nodes register under it)."""


_CONTAINER_BASES: tuple[type[Any], ...] = (OrderedDict, defaultdict, dict, deque, list, tuple)
"""Built-in containers whose unregistered subclasses are split like them (most derived first)."""


def flatten(tree: Any) -> tuple[list[PyTreeAccessor], list[Any], PyTreeSpec]:
    """Flatten with optree, seeing unregistered container subclasses through their base.

    optree leaves such an instance whole (a leaf). When a leaf is one, every such instance is
    replaced by a :class:`_Subclassed` node (a registered node type that flattens like the base
    and whose unflatten rebuilds the subclass) and the tree is flattened again.
    """
    accessors, leaves, spec = optree.tree_flatten_with_accessor(tree, namespace=NAMESPACE)
    if not any(isinstance(leaf, _CONTAINER_BASES) for leaf in leaves):
        return accessors, leaves, spec
    return optree.tree_flatten_with_accessor(_viewed_through_base(tree), namespace=NAMESPACE)


def flatten_leaves(tree: Any, /) -> tuple[list[Any], PyTreeSpec]:
    """:func:`flatten` without the accessors: the leaves and the structure, what a hot path needs.

    optree builds an accessor per leaf (several objects each) in ``tree_flatten_with_accessor``,
    six times the cost of the plain flatten; callers that name leaves only in their errors take
    the names from the structure then (:func:`leaf_names`).

    Example:
        >>> leaves_, spec = flatten_leaves({"w": [1, 2]})
        >>> leaves_, leaf_names(spec, "params")
        ([1, 2], ["params['w'][0]", "params['w'][1]"])
    """
    kind = type(tree)
    if kind in _ARRAY_TYPES:  # the most common tree: one array
        return [tree], _LEAF
    if (kind is tuple or kind is list) and _ARRAY_TYPES.issuperset(map(type, tree)):
        return list(tree), _sequence_spec(kind, len(tree))  # the next: (w, b), [x, y]
    leaves_, spec = optree.tree_flatten(tree, namespace=NAMESPACE)
    if not any(isinstance(leaf, _CONTAINER_BASES) for leaf in leaves_):
        return leaves_, spec
    return optree.tree_flatten(_viewed_through_base(tree), namespace=NAMESPACE)


_LEAF: PyTreeSpec = optree.tree_flatten(0, namespace=NAMESPACE)[1]  # type: ignore[arg-type]
"""The structure of a tree that is one leaf."""

_SEQUENCE_SPECS: dict[tuple[type, int], PyTreeSpec] = {}
"""The structures of flat tuples and lists of arrays, by type and length (made once each)."""


def _sequence_spec(kind: type[tuple[Any, ...]] | type[list[Any]], length: int, /) -> PyTreeSpec:
    """The structure of a flat tuple or list of ``length`` leaves, as optree gives it.

    :func:`flatten_leaves` takes a tuple or list of arrays apart itself: optree's flatten and
    the check for container subclasses cost four times as much (1.6 us against 0.4 for two
    arrays), and a one-op training step flattens two such trees (``watch((w, b))``,
    ``gradient(loss, (w, b))``).
    """
    spec = _SEQUENCE_SPECS.get((kind, length))
    if spec is None:
        leaves = kind([0] * length)
        spec = optree.tree_structure(leaves, namespace=NAMESPACE)  # type: ignore[arg-type]
        _SEQUENCE_SPECS[kind, length] = spec
    return spec


_ARRAY_TYPES: set[type] = {np.ndarray}
"""Array classes, always leaves: :func:`flatten_leaves` takes one of them as a leaf at once."""


def add_array_type(cls: type, /) -> None:
    """Declare ``cls`` an array class (never a container): its instances are leaves.

    The host array registers itself; NumPy's class is one from the start.

    Example:
        >>> import numpy as np
        >>> add_array_type(np.ndarray)
        >>> flatten_leaves(np.zeros(2))[1] == flatten_leaves(0)[1]
        True
    """
    _ARRAY_TYPES.add(cls)


def leaf_names(spec: PyTreeSpec, root: str, /) -> list[str]:
    """The Python expression reaching each leaf of ``spec`` from ``root`` (for messages)."""
    return [accessor.codify(root) for accessor in spec.accessors()]


def _viewed_through_base(tree: Any) -> Any:
    try:
        return _view_through_base(tree)
    except RecursionError:
        raise ValueError(
            "the structure contains itself (a container subclass holds a container that holds "
            "it) or nests deeper than Python's recursion limit, so it cannot be flattened; pass "
            "a structure without cycles."
        ) from None


def _is_unregistered_subclass(node: object) -> bool:
    return (
        isinstance(node, _CONTAINER_BASES)
        and optree.register_pytree_node.get(type(node), namespace=NAMESPACE) is None
    )


def _view_through_base(tree: Any) -> Any:
    """``tree`` with every unregistered container subclass instance as a :class:`_Subclassed`."""
    return optree.tree_map(
        lambda leaf: _Subclassed(leaf) if _is_unregistered_subclass(leaf) else leaf,
        tree,
        is_leaf=_is_unregistered_subclass,
        namespace=NAMESPACE,
    )


class _Subclassed:
    """An instance of an unregistered subclass of a built-in container, seen through its base."""

    __slots__ = ("base", "cls")

    def __init__(self, instance: Any) -> None:
        self.cls = type(instance)
        base = next(b for b in _CONTAINER_BASES if isinstance(instance, b))
        if base is defaultdict:
            contents: Any = defaultdict(instance.default_factory, instance)
        elif base is deque:
            contents = deque(instance, instance.maxlen)
        else:
            contents = base(instance)
        self.base = _view_through_base(contents)  # subclasses inside are seen the same way


class _SubclassMetadata:
    """The node data of a :class:`_Subclassed` node: the class and its base's node data."""

    __slots__ = ("base_metadata", "cls")

    def __init__(self, cls: type, base_metadata: Any) -> None:
        self.cls = cls
        self.base_metadata = base_metadata

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, _SubclassMetadata)
            and self.cls is other.cls
            and self.base_metadata == other.base_metadata
        )

    def __hash__(self) -> int:
        return hash(self.cls)

    def __repr__(self) -> str:
        return f"{self.cls.__qualname__}, {self.base_metadata!r}"


def _subclassed_flatten(node: _Subclassed) -> tuple[list[Any], _SubclassMetadata, tuple[Any, ...]]:
    children, metadata, entries, _ = optree.tree_flatten_one_level(node.base, namespace=NAMESPACE)
    return children, _SubclassMetadata(node.cls, metadata), entries


def _subclassed_unflatten(metadata: Any, children: Any) -> Any:
    base_type = next(b for b in _CONTAINER_BASES if issubclass(metadata.cls, b))
    base = _BASE_UNFLATTEN[base_type](metadata.base_metadata, list(children))
    return _rebuild(metadata.cls, base_type, base)


def _rebuild(cls: type, base_type: type, base: Any) -> Any:
    """``cls`` holding ``base``'s contents if its constructor rebuilds them exactly, else ``base``.

    See the module docstring for what "rebuilt exactly" means.
    """
    try:
        if base_type is defaultdict:
            rebuilt = cls(base.default_factory, base)
        elif base_type is deque:
            rebuilt = cls(base, base.maxlen)
        else:
            rebuilt = cls(base)
    except Exception:  # noqa: BLE001 - a constructor that cannot rebuild: the base comes back
        return base
    if type(rebuilt) is not cls or not _same_contents(rebuilt, base, base_type):
        return base
    return rebuilt


def _same_contents(rebuilt: Any, base: Any, base_type: Any) -> bool:
    """Whether ``rebuilt`` stores exactly ``base``'s entries (read through the base's methods)."""
    if issubclass(base_type, dict):
        mine, theirs = list(dict.items(rebuilt)), list(dict.items(base))
        same = len(mine) == len(theirs) and all(
            k is j and v is w for (k, v), (j, w) in zip(mine, theirs, strict=True)
        )
        if base_type is defaultdict:
            same = same and rebuilt.default_factory is base.default_factory
        return same
    mine, theirs = list(base_type.__iter__(rebuilt)), list(base)
    same = len(mine) == len(theirs) and all(a is b for a, b in zip(mine, theirs, strict=True))
    if base_type is deque:
        same = same and rebuilt.maxlen == base.maxlen
    return same


_BASE_UNFLATTEN: dict[type, Callable[[Any, list[Any]], Any]] = {
    base: optree.tree_flatten_one_level(base(), namespace=NAMESPACE).unflatten_func
    for base in _CONTAINER_BASES
}
optree.register_pytree_node(
    _Subclassed,  # type: ignore[arg-type]
    _subclassed_flatten,  # type: ignore[arg-type]
    _subclassed_unflatten,
    path_entry_type=optree.GetItemEntry,
    namespace=NAMESPACE,
)


def key_path(accessor: PyTreeAccessor, root: str = "") -> str:
    """``root['a'][0]``: where a leaf or node sits, in the Python that reaches it.

    Without a ``root``, the root itself reads ``(the root)``.
    """
    return accessor.codify(root) or "(the root)"


class _Placeholder:
    def __repr__(self) -> str:
        return "*"


def _describe(spec: PyTreeSpec) -> str:
    if spec.is_leaf():
        return "a leaf"
    node = spec.one_level()
    if node is not None and spec.type is _Subclassed:  # rebuilt with placeholders
        instance = node.unflatten([_Placeholder()] * node.num_leaves)
        return f"{type(instance).__qualname__}({_Subclassed(instance).base!r})"
    text = repr(spec.one_level()).removeprefix("PyTreeSpec(").removesuffix(")")
    return text.removesuffix(f", namespace={NAMESPACE!r}")


def structure_difference(first: PyTreeSpec, second: PyTreeSpec) -> tuple[str, str, str] | None:
    """The first node (depth-first, in leaf order) where two treespecs differ, or ``None``.

    Returns the node's key path and a one-level description of it in each spec, so an error can
    say ``['a']: defaultdict(<class 'list'>, {'k': *}) vs defaultdict(<class 'int'>, ...)``.
    The walk is over treespecs, which optree builds; containers themselves are never recursed.
    """
    pending: list[tuple[PyTreeAccessor, PyTreeSpec, PyTreeSpec]] = [
        (optree.PyTreeAccessor(), first, second)
    ]
    while pending:
        path, a, b = pending.pop()
        if a == b:
            continue
        top_a, top_b = a.one_level(), b.one_level()
        if top_a is None or top_b is None or top_a != top_b:
            return key_path(path), _describe(a), _describe(b)
        children = zip(top_a.accessors(), a.children(), b.children(), strict=True)
        pending.extend(reversed([(path + acc, ca, cb) for acc, ca, cb in children]))
    return None


def leaves_equal(a: object, b: object) -> bool:
    """Whether two non-array leaves are the same value: identical, or equal and of one type.

    NaN floats (Python or NumPy scalars, and complex numbers with a NaN part) equal each other
    here, so a NaN computed in every replica is one value, as bit-identical arrays are.
    """
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, float | complex | np.inexact):
        pairs = ((a.real, b.real), (a.imag, b.imag))  # type: ignore[attr-defined]
        return all(x == y or (math.isnan(x) and math.isnan(y)) for x, y in pairs)
    try:
        return bool(a == b)
    except (TypeError, ValueError):  # an __eq__ that returns no truth value (arrays-like)
        return False


def flatten_with_names(tree: Any, root: str, /) -> tuple[list[str], list[Any], PyTreeSpec]:
    """The leaves of ``tree``, each with the Python expression that reaches it from ``root``.

    Example:
        >>> flatten_with_names({"w": [1, 2]}, "params")[:2]
        (["params['w'][0]", "params['w'][1]"], [1, 2])
        >>> class L(list): ...
        >>> flatten_with_names(L([1, 2]), "x")[:2]
        (['x[0]', 'x[1]'], [1, 2])
    """
    leaves_, spec = flatten_leaves(tree)
    return leaf_names(spec, root), leaves_, spec


def leaves(tree: Any, /) -> list[Any]:
    """The leaves of ``tree``, as :func:`flatten` sees them.

    Example:
        >>> class L(list): ...
        >>> leaves({"a": L([1, 2]), "b": 3})
        [1, 2, 3]
    """
    return flatten_leaves(tree)[0]


def tree_map(fn: Callable[[Any], Any], tree: Any, /) -> Any:
    """``tree`` with every leaf replaced by ``fn(leaf)``, rebuilt as :func:`flatten` sees it.

    Example:
        >>> class L(list): ...
        >>> tree_map(lambda x: 2 * x, L([1, 2]))
        [2, 4]
    """
    leaves_, spec = flatten_leaves(tree)
    return spec.unflatten([fn(leaf) for leaf in leaves_])
