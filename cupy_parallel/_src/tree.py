"""Pytrees in cupy_parallel: the optree namespace and leaf names every nested structure uses.

Every module that flattens a nested structure does it with optree under :data:`NAMESPACE`, so a
class registered once (``optree.register_pytree_node(..., namespace="cupy_parallel")``) is a
container everywhere: in ``scatter``/``gather``, ``replicate``, ``Tape.watch``/``gradient`` and
``grad``.
"""

from __future__ import annotations

from typing import Any

import optree

__all__ = ["NAMESPACE", "flatten_with_names"]

NAMESPACE = "cupy_parallel"
"""The optree namespace of pytrees in this package (custom nodes register under it)."""


def flatten_with_names(tree: Any, root: str, /) -> tuple[list[str], list[Any], optree.PyTreeSpec]:
    """The leaves of ``tree``, each with the Python expression that reaches it from ``root``.

    Example:
        >>> flatten_with_names({"w": [1, 2]}, "params")[:2]
        (["params['w'][0]", "params['w'][1]"], [1, 2])
    """
    accessors, leaves, treedef = optree.tree_flatten_with_accessor(tree, namespace=NAMESPACE)
    return [a.codify(root) for a in accessors], leaves, treedef
