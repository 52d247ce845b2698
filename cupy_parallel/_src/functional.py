"""The functional form of the tape: ``grad`` and ``value_and_grad`` (JAX's shape).

``value_and_grad(fn)(params, *args)`` watches the arguments named by ``argnums`` on a fresh
:class:`~cupy_parallel.Tape`, calls ``fn``, and returns its value with the gradient of that
value with respect to those arguments, each in its argument's pytree shape. Because every active
tape records, these compose: ``grad(grad(f))`` differentiates the gradient, and a ``grad`` called
under an outer tape is recorded on it.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Concatenate, Literal, ParamSpec, overload

from cupy_parallel._src import tree
from cupy_parallel._src.arguments import read_bool, read_callable
from cupy_parallel._src.arrays import is_array
from cupy_parallel._src.compute import compute
from cupy_parallel._src.recording import active_tapes, name_nodes, record_unary
from cupy_parallel._src.tape import DisconnectedError, Tape, refuse_untrackable, scalar_problem

if TYPE_CHECKING:
    from collections.abc import Callable

    from cupy_parallel._src.arraytypes import Output, Tree

__all__ = ["grad", "value_and_grad"]

Args = ParamSpec("Args")  # the arguments of the function differentiated


def _read_argnums(argnums: Any) -> tuple[int, ...]:
    """``argnums`` as a tuple of ints (a single int is one); refuse anything else."""
    single = isinstance(argnums, int) and not isinstance(argnums, bool)
    numbers = (argnums,) if single else argnums
    if not isinstance(numbers, tuple) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in numbers
    ):
        raise TypeError(f"argnums must be an int or a tuple of ints, got {argnums!r}.")
    if not numbers:
        raise ValueError("argnums must name at least one argument, got an empty tuple.")
    if len(set(numbers)) != len(numbers):
        raise ValueError(f"argnums must not repeat an argument, got {argnums!r}.")
    return numbers


def _positions(numbers: tuple[int, ...], count: int) -> tuple[int, ...]:
    """The argument positions ``numbers`` name in a call with ``count`` positional arguments."""
    for i in numbers:
        if not -count <= i < count:
            raise ValueError(
                f"argnums names argument {i}, but the function was called with {count} "
                "positional arguments."
            )
    positions = tuple(i % count for i in numbers)
    if len(set(positions)) != len(positions):
        raise ValueError(
            f"argnums {numbers} names one argument twice in a call with {count} positional "
            "arguments (a negative position counts from the end)."
        )
    return positions


def _view_of(x: Any) -> Any:
    return x.view()


def _own_variable(leaf: Any) -> Any:
    """An array ``leaf`` as a new view of its memory, recorded as the identity; others as is."""
    if not is_array(leaf):
        return leaf
    view = compute(_view_of, leaf)
    if active_tapes():
        record_unary(_own_variable_vjp, leaf, view, None)
    return view


def _own_variable_vjp(gs: list[Any], xs: tuple[Any, ...], needs: Any, zs: Any, aux: None) -> Any:
    return (gs[0],)


name_nodes(_own_variable_vjp, lambda aux: "grad's view of a differentiated argument")


@overload  # argnums=0: the gradient has the first argument's type (first match wins)
def value_and_grad(  # type: ignore[overload-overlap]
    fn: Callable[Concatenate[Tree, Args], Output], argnums: Literal[0] = 0, *, has_aux: bool = False
) -> Callable[Concatenate[Tree, Args], tuple[Output, Tree]]: ...
@overload
def value_and_grad(
    fn: Callable[Args, Output], argnums: int | tuple[int, ...], *, has_aux: bool = False
) -> Callable[Args, tuple[Output, Any]]: ...
def value_and_grad(
    fn: Callable[..., Any], argnums: int | tuple[int, ...] = 0, *, has_aux: bool = False
) -> Callable[..., tuple[Any, Any]]:
    """``fn`` turned into a function returning ``(value, gradient)``, as ``jax.value_and_grad``.

    The returned function takes ``fn``'s arguments. Arguments named by ``argnums`` are pytrees
    of floating-point or complex arrays (leaves that are not arrays are skipped and get ``None``,
    as :meth:`Tape.watch <cupy_parallel.Tape.watch>` skips them); ``fn`` must return a real
    array with one element built from recorded operations (or, with ``has_aux``, a pair
    ``(value, aux)``). A complex argument ``z`` gets PyTorch's gradient (``torch.func.grad``'s),
    ``dL/dRe(z) + i dL/dIm(z)``, the direction of steepest ascent; ``jax.grad`` returns its
    conjugate, so code ported from JAX conjugates it (``ops.conj``) or flips the sign of the
    imaginary part in its update.

    Each array leaf of a differentiated argument is its own variable, as in ``jax.grad``:
    ``grad(f, argnums=(0, 1))(x, x)`` returns the two partial derivatives, not the total
    derivative twice, and so does one array at two leaves of a params tree. ``fn`` receives
    these arguments rebuilt, with each array leaf replaced by a view of it (the same memory
    under a new identity); any other reference to the same array (a closure, an argument not
    named by ``argnums``) is a constant. :meth:`Tape.gradient <cupy_parallel.Tape.gradient>`
    differs: it knows arrays by identity, so ``tape.gradient(y, (x, x))`` returns the total
    derivative for both entries, as ``torch.autograd.grad(y, (x, x))`` does.

    Args:
        fn: the function to differentiate.
        argnums: the position of the argument to differentiate with respect to, or a tuple of
            positions (then the gradient is a tuple, one entry per position).
        has_aux: ``fn`` returns ``(value, aux)``; ``aux`` is passed through undifferentiated.

    Returns:
        A function returning ``(value, gradient)``, or ``((value, aux), gradient)``.

    Raises:
        TypeError: ``fn`` is not callable, ``argnums`` is not an int or tuple of ints,
            ``has_aux`` is not a bool (at once); with ``has_aux``, ``fn`` did not return a
            pair (when called).
        ValueError: ``argnums`` names no argument or repeats one (at once), or an argument
            the call does not have or one argument twice, as ``1`` and ``-1`` in a call with
            two arguments (when called); the errors of
            :meth:`Tape.gradient <cupy_parallel.Tape.gradient>`.

    Example:
        >>> import numpy as np
        >>> import cupy_parallel
        >>> from cupy_parallel import ops
        >>> loss = lambda p, x: ops.sum(ops.square(ops.multiply(p["w"], x)))
        >>> value, grads = cupy_parallel.value_and_grad(loss)({"w": np.array(2.0)}, np.ones(3))
        >>> value, grads
        (array(12.), {'w': array(12.)})
    """
    return _value_and_grad(fn, argnums, has_aux, "value_and_grad")


def _value_and_grad(
    fn: Callable[..., Any], argnums: int | tuple[int, ...], has_aux: bool, caller: str
) -> Callable[..., tuple[Any, Any]]:
    """:func:`value_and_grad`, its messages naming ``caller`` (``grad`` or ``value_and_grad``)."""
    read_callable(fn, "fn")
    numbers = _read_argnums(argnums)
    aux_flag = read_bool(has_aux, "has_aux")
    single = not isinstance(argnums, tuple)

    @functools.wraps(fn)
    def value_and_gradient(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
        positions = _positions(numbers, len(args))
        flat = [tree.flatten_with_names(args[i], f"argument {i}") for i in positions]
        for names, leaves, _ in flat:  # named as fn's arguments, before anything is recorded
            refuse_untrackable(names, leaves, f"{caller}() differentiates")
        sources = tuple(spec.unflatten([_own_variable(x) for x in xs]) for _, xs, spec in flat)
        args = tuple(
            sources[positions.index(i)] if i in positions else a for i, a in enumerate(args)
        )
        with Tape() as tape:
            tape.watch(sources)
            out = fn(*args, **kwargs)
        if aux_flag and not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError(
                f"has_aux=True needs fn to return a pair (value, aux), got {type(out).__name__}."
            )
        value = out[0] if aux_flag else out
        what = "fn's value" + (" (the first item of its pair)" if aux_flag else "")
        if not is_array(value):
            raise TypeError(
                f"{caller}() needs {what} to be an array computed with cupy_parallel.ops, got "
                f"{type(value).__name__}."
            )
        if not tape.tracks(value):
            raise ValueError(
                f"{caller}() needs {what} to be computed from the arguments it differentiates "
                "(argnums) with cupy_parallel.ops; it was not recorded (a raw NumPy/CuPy "
                "expression such as `x @ w` instead of ops.matmul(x, w), or no argument in it)."
            )
        problem = scalar_problem(value, what)
        if problem is not None:  # as jax.grad: only functions with one real value
            raise type(problem)(
                f"{problem} {caller}() differentiates a function returning one real number: "
                "reduce the value first (ops.sum, ops.mean; ops.abs or ops.real of a complex one)."
            )
        own = {id(x) for x in tree.flatten(sources)[0]}
        foreign = any(leaf not in own for leaf in tape._leaves)  # watched by fn itself
        try:
            grads = tape.gradient(value, sources)
        except DisconnectedError as error:
            if not foreign:
                raise
            raise DisconnectedError(
                f"{error} {caller}() differentiates with respect to the arguments it passes to "
                "fn (copies of them), but fn's value was computed from other arrays watched "
                "on its tape: parameters that an object holds and reads itself, as "
                "DistributedDataParallel's forward reads ddp.params whatever fn is given. For "
                "DDP gradients use a Tape: `with cupy_parallel.Tape() as tape: loss = ...ddp(x)"
                "...` then `tape.gradient(loss, ddp.params)`."
            ) from None
        return out, grads[0] if single else grads

    return value_and_gradient


@overload  # argnums=0: the gradient has the first argument's type (first match wins)
def grad(  # type: ignore[overload-overlap]
    fn: Callable[Concatenate[Tree, Args], Any],
    argnums: Literal[0] = 0,
    *,
    has_aux: Literal[False] = False,
) -> Callable[Concatenate[Tree, Args], Tree]: ...
@overload
def grad(  # type: ignore[overload-overlap]
    fn: Callable[Concatenate[Tree, Args], Any], argnums: Literal[0] = 0, *, has_aux: Literal[True]
) -> Callable[Concatenate[Tree, Args], tuple[Tree, Any]]: ...
@overload
def grad(
    fn: Callable[Args, Any], argnums: int | tuple[int, ...], *, has_aux: bool = False
) -> Callable[Args, Any]: ...
def grad(
    fn: Callable[..., Any], argnums: int | tuple[int, ...] = 0, *, has_aux: bool = False
) -> Callable[..., Any]:
    """``fn`` turned into a function returning its gradient, as ``jax.grad``.

    See :func:`value_and_grad` for the arguments; with ``has_aux`` the function returns
    ``(gradient, aux)``. Applied twice, it differentiates the gradient. Each differentiated
    argument (each array leaf of one) is its own variable, as in ``jax.grad``, even when one
    array is passed twice: then ``grad`` returns the partial derivatives, where
    :meth:`Tape.gradient <cupy_parallel.Tape.gradient>`, which knows arrays by identity,
    returns the total derivative for each (as ``torch.autograd.grad`` does).

    Example:
        >>> import numpy as np
        >>> import cupy_parallel
        >>> from cupy_parallel import ops
        >>> cube = lambda x: ops.sum(ops.multiply(ops.multiply(x, x), x))
        >>> x = np.array([1.0, 2.0])
        >>> cupy_parallel.grad(cube)(x)
        array([ 3., 12.])
        >>> cupy_parallel.grad(lambda x: ops.sum(cupy_parallel.grad(cube)(x)))(x)  # 6 x
        array([ 6., 12.])
        >>> dot = lambda a, b: ops.sum(ops.multiply(a, b))
        >>> cupy_parallel.grad(dot, argnums=(0, 1))(x, x)  # the partials b and a, not 2 x
        (array([1., 2.]), array([1., 2.]))
    """
    inner = _value_and_grad(fn, argnums, has_aux, "grad")

    @functools.wraps(fn)
    def gradient(*args: Any, **kwargs: Any) -> Any:
        out, grads = inner(*args, **kwargs)
        return (grads, out[1]) if has_aux else grads

    return gradient
