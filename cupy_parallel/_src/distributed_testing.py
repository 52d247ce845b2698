"""Property tests of distributed code: per-rank arrays, and a distributed run against one process.

A distributed function is tested as any other: hypothesis draws a world size and each rank's
input (:func:`rank_arrays`), and :func:`assert_distributed_matches` runs the function on that
many thread ranks (:func:`~cupy_parallel.distributed.spawn`: in this process, no launch per
example) and compares each rank's result with what a one-process oracle computes from all the
ranks' inputs at once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
from hypothesis import strategies as st

from cupy_parallel._src.arguments import read_callable, read_int, read_real, read_sequence
from cupy_parallel._src.arrays import is_array
from cupy_parallel._src.distributed.spawn import spawn
from cupy_parallel._src.testing import arrays, assert_tree_equal, host_values
from cupy_parallel._src.tree import flatten, key_path, leaves_equal, structure_difference

if TYPE_CHECKING:
    from collections.abc import Callable

    from hypothesis.strategies import DrawFn, SearchStrategy

__all__ = ["assert_distributed_matches", "rank_arrays"]


@st.composite
def _rank_arrays(
    draw: DrawFn, sizes: SearchStrategy[int], first: SearchStrategy[Any], options: dict[str, Any]
) -> list[Any]:
    n = draw(sizes)
    x = draw(first)
    return [x, *(draw(arrays(x.dtype, x.shape, **options)) for _ in range(n - 1))]


def rank_arrays(
    dtype: Any = None,
    shape: Any = None,
    *,
    world_size: Any = None,
    min_size: int = 1,
    max_size: int = 4,
    **options: Any,
) -> SearchStrategy[list[Any]]:
    """A strategy for one array per rank: a world size, then that many arrays of one dtype/shape.

    What a collective's inputs are: every rank holds an array of the same dtype and shape, each
    with its own values. The arrays are drawn by :func:`~cupy_parallel.testing.arrays` (so, by
    default, with every bit pattern: pass ``finite=True`` for finite floats).

    Args:
        dtype: As for :func:`~cupy_parallel.testing.arrays` (a dtype, a strategy, or ``None``
            for every dtype); the ranks share the dtype drawn.
        shape: As for :func:`~cupy_parallel.testing.arrays`; the ranks share the shape drawn.
        world_size: A number of ranks, a strategy of them, or ``None`` for ``min_size`` to
            ``max_size``.
        min_size: Fewest ranks when ``world_size`` is ``None``.
        max_size: Most ranks when ``world_size`` is ``None``.
        **options: Passed on to :func:`~cupy_parallel.testing.arrays` (``finite``,
            ``max_side``, ``non_contiguous``, ``device``, ...).

    Returns:
        A hypothesis strategy of lists of arrays, one per rank, in rank order.

    Example:
        >>> import numpy as np
        >>> from hypothesis import given
        >>> @given(rank_arrays(np.int32, (3,), max_size=3))
        ... def test(xs):
        ...     assert 1 <= len(xs) <= 3
        ...     assert all(x.shape == (3,) and x.dtype == np.int32 for x in xs)
        >>> test()
    """
    if world_size is None:
        low = read_int(min_size, "min_size", minimum=1)
        sizes = st.integers(low, read_int(max_size, "max_size", minimum=low))
    elif isinstance(world_size, st.SearchStrategy):
        sizes = world_size
    else:
        sizes = st.just(read_int(world_size, "world_size", minimum=1))
    return _rank_arrays(sizes, arrays(dtype, shape, **options), options)


def assert_distributed_matches(
    fn: Callable[..., Any],
    inputs: Any,
    oracle: Callable[[list[Any]], Any],
    *,
    backend: str = "threads",
    rtol: float = 0.0,
    atol: float = 0.0,
    timeout: float = 60.0,
) -> list[Any]:
    """Assert that ``fn`` run on ranks gives, on each rank, what ``oracle`` computes in one process.

    Runs ``fn(inputs[rank])`` on ``len(inputs)`` ranks with
    :func:`~cupy_parallel.distributed.spawn` (each rank sees its own default process group),
    computes ``expected = oracle(inputs)`` (one result per rank, from every rank's input at
    once: the one-process model of the distributed computation) and compares rank by rank:
    bit-exactly (:func:`~cupy_parallel.testing.assert_tree_equal`) when ``rtol`` and ``atol``
    are 0, else with ``numpy.testing.assert_allclose``'s tolerance on every array leaf.

    Args:
        fn: The distributed function: ``fn(my_input)`` on each rank.
        inputs: One input per rank (any pytree each), in rank order: their number is the world
            size.
        oracle: ``oracle(inputs)`` returns the list of the ranks' expected results.
        backend: :func:`~cupy_parallel.distributed.spawn`'s backend.
        rtol: Relative tolerance (0: bit-exact).
        atol: Absolute tolerance (0: bit-exact).
        timeout: :func:`~cupy_parallel.distributed.spawn`'s timeout, in seconds.

    Returns:
        The ranks' results, in rank order.

    Raises:
        AssertionError: a rank's result differs from the oracle's (the message names the rank).

    Example:
        >>> import numpy as np
        >>> import cupy_parallel.distributed as dist
        >>> def total(x):
        ...     y = x.copy()
        ...     dist.all_reduce(y)
        ...     return y
        >>> xs = [np.array([1.0, 2.0]), np.array([3.0, 4.0])]
        >>> results = assert_distributed_matches(total, xs, lambda xs: [sum(xs)] * len(xs))
        >>> results[1]
        array([4., 6.])
    """
    fn = read_callable(fn, "fn", call="fn(my_input)")
    oracle = read_callable(oracle, "oracle", call="oracle(inputs)")
    inputs = read_sequence(inputs, "inputs", expected="a sequence of one input per rank")
    rtol = read_real(rtol, "rtol", expected="a real number >= 0")
    atol = read_real(atol, "atol", expected="a real number >= 0")
    if not inputs:
        raise ValueError("inputs must hold one input per rank, got an empty sequence.")
    if rtol < 0 or atol < 0:
        raise ValueError(f"rtol and atol must be >= 0, got rtol={rtol}, atol={atol}.")
    results = spawn(_call_own, len(inputs), (fn, inputs), backend=backend, timeout=timeout)
    expected = list(oracle(list(inputs)))
    if len(expected) != len(inputs):
        raise ValueError(
            f"oracle must return one result per rank ({len(inputs)}), got {len(expected)}."
        )
    for rank, (got, want) in enumerate(zip(results, expected, strict=True)):
        problem = _difference(got, want, rtol, atol)
        if problem is not None:
            raise AssertionError(f"rank {rank} of {len(inputs)} differs from the oracle: {problem}")
    return results


def _difference(actual: Any, expected: Any, rtol: float, atol: float) -> str | None:
    """How ``actual`` differs from ``expected`` (bit-exactly, or within the tolerance), if it does.

    Within a tolerance: the same structure, array leaves of one shape and dtype whose values
    agree within ``numpy.testing.assert_allclose``'s ``rtol``/``atol``, other leaves equal.
    """
    accessors, leaves_a, spec_a = flatten(actual)
    _, leaves_e, spec_e = flatten(expected)
    try:
        if (rtol == 0 and atol == 0) or structure_difference(spec_a, spec_e) is not None:
            assert_tree_equal(actual, expected, check_device=False)
            return None
        for accessor, a, e in zip(accessors, leaves_a, leaves_e, strict=True):
            where = f"at {key_path(accessor)}"
            if is_array(a) and is_array(e):
                np.testing.assert_allclose(
                    host_values(a), host_values(e), rtol=rtol, atol=atol, err_msg=where, strict=True
                )
            elif is_array(a) or is_array(e) or not leaves_equal(a, e):
                raise AssertionError(f"{where}: {a!r} != {e!r}")
    except AssertionError as error:
        return str(error)
    return None


def _call_own(rank: int, fn: Callable[[Any], Any], inputs: list[Any]) -> Any:
    return fn(inputs[rank])
