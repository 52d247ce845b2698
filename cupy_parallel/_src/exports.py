"""Public names report the public module they are used from (JAX's ``set_module``).

``repr(cupy_parallel.Tape)`` reads ``<class 'cupy_parallel.Tape'>``, not the ``_src`` module that
defines it, and pickle, ``help()`` and tracebacks name the module users import. Each public shell
(``cupy_parallel/__init__.py``, ``comm.py``, ``ops.py``, ...) calls :func:`set_module` on its
``__all__``. A class's own methods move with it, so that doctests are collected (once) with the
public name, in the public module's namespace.
"""

from __future__ import annotations

import inspect
from typing import Any

__all__ = ["set_module"]


def _relabel(obj: Any, module: str, owner: str) -> None:
    if getattr(obj, "__module__", None) == owner:
        obj.__module__ = module


def set_module(module: str, namespace: dict[str, Any], names: list[str], /) -> None:
    """Set ``__module__`` to ``module`` on the functions and classes ``names`` of ``namespace``.

    Only objects defined under ``cupy_parallel._src`` are relabelled; submodules, constants and
    names not imported yet (lazy submodules) are left alone.

    Example:
        >>> import cupy_parallel
        >>> cupy_parallel.Tape.__module__, cupy_parallel.comm.scatter.__module__
        ('cupy_parallel', 'cupy_parallel.comm')
    """
    for name in names:
        obj = namespace.get(name)
        owner = getattr(obj, "__module__", None)
        if not (inspect.isclass(obj) or inspect.isfunction(obj)) or not isinstance(owner, str):
            continue
        if not owner.startswith("cupy_parallel._src"):
            continue
        _relabel(obj, module, owner)
        if inspect.isclass(obj):
            for member in vars(obj).values():
                target = member.fget if isinstance(member, property) else member
                target = getattr(target, "__func__", target)  # staticmethod, classmethod
                if inspect.isfunction(target):
                    _relabel(target, module, owner)
