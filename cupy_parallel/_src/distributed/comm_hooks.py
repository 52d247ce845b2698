"""DDP communication hooks: :class:`GradBucket` and torch's three default hooks.

:class:`~cupy_parallel.DistributedDataParallel` reduces its gradients in buckets. For each
bucket it calls a *communication hook* ``hook(state, bucket)`` (torch's
``DistributedDataParallel.register_comm_hook`` contract): the hook starts the reduction of
``bucket.buffer()``, the bucket's gradients laid end to end in one flat array, and returns a
future (:class:`~cupy_parallel._src.distributed.work.Future`) whose value is the reduced flat
buffer. Without a registered hook DDP uses :func:`allreduce_hook`.

The futures these hooks return are *polled*: no helper thread waits on the collective (as
``Work.get_future`` does). The collective progresses while someone asks: ``done()`` tests it
once without blocking, ``wait()``/``result()``/``value()`` complete it in the calling thread,
and a future made by ``then()`` asks its parent. DDP asks at every gradient-ready hook of the
backward pass (the MPI backend moves a nonblocking collective on only while its rank calls into
MPI), and waits for them all before ``gradient`` returns.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from cupy_parallel._src.distributed.groups import get_world_size
from cupy_parallel._src.distributed.reductions import all_reduce
from cupy_parallel._src.distributed.work import Future

if TYPE_CHECKING:
    from collections.abc import Callable

    from cupy_parallel._src.distributed.work import Work

__all__ = [
    "GradBucket",
    "PolledFuture",
    "allreduce_hook",
    "bf16_compress_hook",
    "bfloat16",
    "fp16_compress_hook",
]


class GradBucket:
    """One bucket of gradients as a communication hook sees it (torch's ``dist.GradBucket``).

    ``buffer()`` is the bucket's flat 1-D array: the gradients of ``parameters()`` one after the
    other (in the bucket's order, the reverse of the parameters' order), and ``gradients()``
    views of it shaped as the parameters. A hook may write into the buffer (the default hooks
    divide it in place) and returns a future of the reduced buffer.

    Example:
        >>> import numpy as np
        >>> bucket = GradBucket(0, np.arange(3.0), [np.zeros(2), np.zeros(1)], [(0, 2), (2, 3)])
        >>> bucket.index(), bucket.is_last(), [g.shape for g in bucket.gradients()]
        (0, True, [(2,), (1,)])
    """

    __slots__ = ("_buffer", "_index", "_last", "_parameters", "_slices")

    def __init__(
        self,
        index: int,
        buffer: Any,
        parameters: list[Any],
        slices: list[tuple[int, int]],
        *,
        last: bool = True,
    ) -> None:
        self._index = index
        self._buffer = buffer
        self._parameters = parameters
        self._slices = slices
        self._last = last

    def index(self) -> int:
        """The bucket's position in the order the buckets are reduced (0 first)."""
        return self._index

    def buffer(self) -> Any:
        """The flat array of the bucket's gradients."""
        return self._buffer

    def set_buffer(self, buffer: Any, /) -> None:
        """Replace the flat array (torch's ``set_buffer``; same shape and dtype)."""
        self._buffer = buffer

    def gradients(self) -> list[Any]:
        """Views of :meth:`buffer`, one per parameter, shaped as the parameters."""
        return [
            self._buffer[start:stop].reshape(p.shape)
            for p, (start, stop) in zip(self._parameters, self._slices, strict=True)
        ]

    def parameters(self) -> list[Any]:
        """The parameter arrays whose gradients the bucket holds, in its order."""
        return list(self._parameters)

    def is_last(self) -> bool:
        """Whether this is the last bucket of the backward pass."""
        return self._last


class PolledFuture(Future[Any]):
    """A :class:`Future` completed by asking, not by a helper thread.

    ``poll(block)`` settles the future when the operation behind it has finished (with
    ``block=True`` it first waits for it). ``done()`` polls once without blocking;
    ``result()`` (so ``wait()`` and ``value()``) blocks. A future made by :meth:`then` polls
    this one, so a chain completes whichever end is asked.

    Example:
        >>> import numpy as np
        >>> from cupy_parallel import distributed as dist
        >>> dist.init_process_group("mpi")  # outside mpiexec: a world of one
        >>> x = np.arange(2.0)
        >>> future = PolledFuture.of_work(dist.all_reduce(x, async_op=True))
        >>> future.then(lambda f: f.value()[0] * 2).wait()
        array([0., 2.])
        >>> dist.destroy_process_group()
    """

    def __init__(self, poll: Callable[[bool], None]) -> None:
        super().__init__()
        self._poll = poll

    @classmethod
    def of_work(cls, work: Work) -> PolledFuture:
        """The future of ``work``'s output arrays (as ``work.get_future()``, without a thread)."""

        def poll(block: bool) -> None:
            if future.done_unpolled():
                return
            if block:
                try:
                    work.wait()
                except Exception as error:  # noqa: BLE001 - handed to the future
                    future.set_exception(error)
                    return
            elif not work.is_completed():
                return
            failure = work.exception()
            if failure is not None:
                future.set_exception(failure)
            else:
                future.set_result(list(work.outputs) if work.outputs is not None else [])

        future = cls(poll)
        return future

    def done_unpolled(self) -> bool:
        """Whether the future is settled, without asking the operation."""
        return super().done()

    def done(self) -> bool:
        """Whether the future is settled; asks the operation once, without blocking."""
        if not super().done():
            self._poll(False)  # noqa: FBT003 - the poll's one argument: block or not
        return super().done()

    def result(self, timeout: float | None = None) -> Any:
        """Complete the operation in this thread, then return the value (or raise)."""
        if not super().done():
            self._poll(True)  # noqa: FBT003 - the poll's one argument: block or not
        return super().result(timeout)

    def _dependent(self) -> Future[Any]:
        """:meth:`then`'s future polls this one (see the class)."""
        return PolledFuture(lambda block: self._poll(block) if not self.done_unpolled() else None)


def _world_size(process_group: Any) -> int:
    return get_world_size(process_group)


def allreduce_hook(process_group: Any, bucket: GradBucket) -> Future[Any]:
    """Average the bucket over ``process_group`` (``None``: the world): DDP's default.

    torch's ``default_hooks.allreduce_hook``: divides the buffer by the group's size in place,
    starts an asynchronous ``all_reduce`` (sum) of it and returns a future of the buffer.

    Example:
        >>> import numpy as np
        >>> from cupy_parallel import distributed as dist
        >>> from cupy_parallel.distributed.algorithms.ddp_comm_hooks import GradBucket
        >>> dist.init_process_group("mpi")  # outside mpiexec: a world of one
        >>> bucket = GradBucket(0, np.array([2.0, 4.0]), [np.zeros(2)], [(0, 2)])
        >>> allreduce_hook(None, bucket).wait()
        array([2., 4.])
        >>> dist.destroy_process_group()
    """
    buffer = bucket.buffer()
    buffer /= _world_size(process_group)
    work = all_reduce(buffer, group=process_group, async_op=True)
    return PolledFuture.of_work(work).then(lambda future: future.value()[0])


def _compress_hook(process_group: Any, bucket: GradBucket, dtype: Any) -> Future[Any]:
    """Reduce the bucket in ``dtype``, write the average back into its buffer.

    A complex bucket travels as its real and imaginary parts (``dtype`` is real): casting it
    would drop the imaginary parts.
    """
    compressed = _parts(bucket.buffer()).astype(dtype)
    compressed /= _world_size(process_group)
    work = all_reduce(compressed, group=process_group, async_op=True)

    def decompress(future: Future[Any]) -> Any:
        out = bucket.buffer()
        _parts(out)[...] = future.value()[0]
        return out

    return PolledFuture.of_work(work).then(decompress)


def _parts(buffer: Any) -> Any:
    """A flat complex buffer as a view of its real and imaginary parts; a real one as it is."""
    if buffer.dtype.kind != "c":
        return buffer
    return buffer.view(np.dtype(f"f{buffer.dtype.itemsize // 2}"))


def fp16_compress_hook(process_group: Any, bucket: GradBucket) -> Future[Any]:
    """Average the bucket in ``float16`` (half the bytes on the wire), then cast back.

    torch's ``default_hooks.fp16_compress_hook``: the buffer is cast to ``float16`` and divided
    by the group's size, all-reduced (sum), and the result is written back into the bucket's
    buffer, which the future holds. The ``"mpi"`` backend sums ``float16`` in ``float32`` and
    rounds once. A complex buffer is sent as its real and imaginary parts, each in ``float16``
    (torch casts it to ``float16``, which keeps the real parts only).

    Example:
        >>> import numpy as np
        >>> from cupy_parallel import distributed as dist
        >>> from cupy_parallel.distributed.algorithms.ddp_comm_hooks import GradBucket
        >>> dist.init_process_group("mpi")  # outside mpiexec: a world of one
        >>> bucket = GradBucket(0, np.array([1.0, 1.0 / 3.0]), [np.zeros(2)], [(0, 2)])
        >>> fp16_compress_hook(None, bucket).wait()  # rounded to float16's 11 bits
        array([1.        , 0.33325195])
        >>> dist.destroy_process_group()
    """
    return _compress_hook(process_group, bucket, np.float16)


def bfloat16() -> Any:
    """NumPy's ``bfloat16`` dtype from ``ml_dtypes``; ``RuntimeError`` when it is missing.

    NumPy has no ``bfloat16``; the ``ml_dtypes`` package adds one (JAX uses it).

    Example:
        >>> try:
        ...     dtype = bfloat16()
        ... except RuntimeError as error:
        ...     dtype = str(error)[:41]
        >>> print(dtype)  # the dtype, or the error without ml_dtypes
        bf...
    """
    try:
        import ml_dtypes  # type: ignore[import-not-found, unused-ignore]  # optional
    except ImportError:
        raise RuntimeError(
            "bf16_compress_hook needs a bfloat16 dtype, which NumPy lacks: install ml_dtypes "
            "(pip install ml_dtypes), or use fp16_compress_hook."
        ) from None
    return np.dtype(ml_dtypes.bfloat16)


def bf16_compress_hook(process_group: Any, bucket: GradBucket) -> Future[Any]:
    """Average the bucket in ``bfloat16``, then cast back (torch's ``bf16_compress_hook``).

    As :func:`fp16_compress_hook` with ``bfloat16`` (8 exponent bits: float32's range, 8 bits
    of mantissa). NumPy has no ``bfloat16``: it comes from the ``ml_dtypes`` package, and
    without it the hook raises ``RuntimeError`` (``DistributedDataParallel.register_comm_hook``
    raises it at registration, before any backward pass). The ``"mpi"`` backend (thread ranks
    too) sums ``bfloat16`` in ``float32`` and rounds once, to nearest even, as it does
    ``float16``; ``"nccl"`` sums it in ``bfloat16`` (NCCL >= 2.10; older ones refuse it, and
    ``register_comm_hook`` then refuses the hook for that group, with NCCL's
    ``NotImplementedError``).

    Example:
        >>> bf16_compress_hook.__name__
        'bf16_compress_hook'
    """
    return _compress_hook(process_group, bucket, bfloat16())
