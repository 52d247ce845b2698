"""Key/value stores that processes use to find each other: TCP, file, in-memory, prefixed.

A store maps ``str`` keys to ``bytes`` values. Every process of a job opens the same store (one
process hosts a :class:`TCPStore` server, or all share a :class:`FileStore` file) and uses it to
exchange small pieces of set-up data: who has arrived, the NCCL unique id, group membership.
The API is PyTorch 2's ``torch.distributed.Store``: ``set``, ``get`` (waits for the key),
``add`` (an atomic counter), ``compare_set``, ``append``, ``multi_get``/``multi_set``, ``wait``,
``check``, ``delete_key``, ``num_keys``, ``queue_push``/``queue_pop``/``queue_len``, ``clone``
and ``has_extended_api``.

One module per part: :mod:`.interface` (the :class:`Store` base class, its errors and argument
checks, and the exception policy), :mod:`.table` (the in-memory state and :class:`HashStore`),
:mod:`.prefix` (:class:`PrefixStore`), :mod:`.filestore` (the log file), :mod:`.wire` (the TCP
wire format), :mod:`.server` (the TCP server) and :mod:`.client` (:class:`TCPStore`).

Decisions where PyTorch is silent or differs:

- ``num_keys`` counts only keys written through the API (PyTorch's TCPStore adds one for its
  own bookkeeping key; here worker registration lives outside the key space). Queues live
  beside keys: ``check`` and ``wait`` see a non-empty queue (as torch's), ``get`` and
  ``num_keys`` do not.
- ``add`` keeps the counter as the ASCII decimal of its value, as PyTorch does, so ``get``
  after ``add(key, 5)`` returns ``b"5"``. Adding to a key that holds anything else raises
  ``ValueError`` (PyTorch's server drops the connection). Counters are signed 64-bit integers.
- Keys are at most :data:`MAX_KEY_BYTES` bytes in UTF-8, values at most
  :data:`MAX_VALUE_BYTES` bytes, and one call names at most :data:`MAX_WAIT_KEYS` keys
  (PyTorch has no bounds; the TCP server needs them to refuse hostile input).
- Timeouts are ``datetime.timedelta`` or seconds, as ``init_process_group`` accepts them.
- ``Store`` objects are context managers; ``close()`` releases the connection, the server or
  the file. Closing a ``PrefixStore`` leaves its underlying store open.

Example:
    >>> import cupy_parallel
    >>> from cupy_parallel.distributed import PrefixStore, TCPStore
    >>> with TCPStore("127.0.0.1", 0, is_master=True, timeout=5) as store:
    ...     group = PrefixStore("g", store)
    ...     group.set("x", "1")
    ...     store.get("g/x"), group.add("n", 2), store.multi_get(["g/x", "g/n"])
    (b'1', 2, [b'1', b'2'])
"""

from cupy_parallel._src.distributed.store.client import SECRET_ENV, TCPStore
from cupy_parallel._src.distributed.store.filestore import FileStore
from cupy_parallel._src.distributed.store.interface import (
    MAX_KEY_BYTES,
    MAX_VALUE_BYTES,
    MAX_WAIT_KEYS,
    DistBackendError,
    DistError,
    DistNetworkError,
    DistStoreError,
    DistTimeoutError,
    QueueEmptyError,
    Store,
)
from cupy_parallel._src.distributed.store.prefix import PrefixStore
from cupy_parallel._src.distributed.store.table import HashStore

__all__ = [
    "MAX_KEY_BYTES",
    "MAX_VALUE_BYTES",
    "MAX_WAIT_KEYS",
    "SECRET_ENV",
    "DistBackendError",
    "DistError",
    "DistNetworkError",
    "DistStoreError",
    "DistTimeoutError",
    "FileStore",
    "HashStore",
    "PrefixStore",
    "QueueEmptyError",
    "Store",
    "TCPStore",
]
