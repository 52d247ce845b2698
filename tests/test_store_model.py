"""Random sequences of store operations: every store kind answers as PyTorch's HashStore does.

The oracle is ``torch.distributed.HashStore`` when PyTorch is installed (else our
:class:`HashStore`, so the kinds are at least compared with each other). Failures are compared
by kind: ``ValueError`` (``add`` on a non-counter), a timeout (``DistStoreError``, a
``RuntimeError`` in both libraries) and an empty non-blocking ``queue_pop``.

One deliberate difference: torch's ``add`` reads a leading integer out of any value (``b"12a"``
counts as 12, ``b"1e3"`` as 1, a NUL byte ends the number too) where ours raises ``ValueError``
for a value that is not a decimal counter. Where torch answered a number and ours refused such a
value, the expected answer is ``ValueError`` and torch's store gets the value back, so that both
go on from the same state.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cupy_parallel.distributed import FileStore, HashStore, PrefixStore, TCPStore

if TYPE_CHECKING:
    from collections.abc import Iterator

SHORT = 0.02
_COUNTER = re.compile(rb"[+-]?[0-9]{1,19}")  # what our add() accepts

_keys = st.sampled_from(["a", "b", "c"])
_values = st.binary(max_size=3)
_key_lists = st.lists(_keys, max_size=3)
_ops = st.one_of(
    st.tuples(st.just("set"), _keys, _values),
    st.tuples(st.just("get"), _keys),
    st.tuples(st.just("add"), _keys, st.integers(-3, 3)),
    st.tuples(st.just("compare_set"), _keys, _values, _values),
    st.tuples(st.just("append"), _keys, _values),
    st.tuples(st.just("delete_key"), _keys),
    st.tuples(st.just("check"), _key_lists),
    st.tuples(st.just("wait"), _key_lists),
    st.tuples(st.just("num_keys")),
    st.tuples(
        st.just("multi_set"),
        _key_lists.flatmap(
            lambda keys: st.tuples(
                st.just(keys), st.lists(_values, min_size=len(keys), max_size=len(keys))
            )
        ),
    ),
    st.tuples(st.just("multi_get"), _key_lists),
    st.tuples(st.just("queue_push"), _keys, _values),
    st.tuples(st.just("queue_pop"), _keys),
    st.tuples(st.just("queue_len"), _keys),
)


def _oracle() -> Any:
    try:
        import torch.distributed as torch_dist
    except ImportError:
        return HashStore()
    return torch_dist.HashStore()


@contextlib.contextmanager
def _stores() -> Iterator[dict[str, Any]]:
    directory = tempfile.mkdtemp()
    master = TCPStore("127.0.0.1", 0, is_master=True)
    stores = {
        "oracle": _oracle(),
        "hash": HashStore(),
        "file": FileStore(os.path.join(directory, "store")),
        "tcp": master,
        "prefix": PrefixStore("p", HashStore()),
    }
    for store in stores.values():
        store.set_timeout(timedelta(seconds=SHORT))
    try:
        yield stores
    finally:
        for name in ("file", "tcp"):
            stores[name].close()


def _apply(store: Any, op: tuple[Any, ...]) -> object:
    name, *args = op
    if name == "multi_set":
        ((keys, values),) = args
        args = [keys, values]
    try:
        if name == "queue_pop":
            return store.queue_pop(args[0], False)
        if name == "wait":
            return store.wait(args[0], timedelta(seconds=SHORT))
        return getattr(store, name)(*args)
    except ValueError:
        return "ValueError"
    except RuntimeError as exc:
        return "empty" if type(exc).__name__ == "QueueEmptyError" else "timeout"


@pytest.mark.slow
@settings(deadline=None)
@given(ops=st.lists(_ops, max_size=12))
def test_every_kind_answers_like_the_oracle(ops: list[tuple[Any, ...]]) -> None:
    with _stores() as stores:
        for op in ops:
            answers = {name: _apply(store, op) for name, store in stores.items()}
            expected = answers.pop("oracle")
            if op[0] == "add" and isinstance(expected, int) and answers["hash"] == "ValueError":
                value = stores["hash"].get(op[1])  # unchanged by the refused add
                assert value, op
                assert _COUNTER.fullmatch(value) is None, (op, value)
                stores["oracle"].set(op[1], value)
                expected = "ValueError"
            assert answers == dict.fromkeys(answers, expected), op
