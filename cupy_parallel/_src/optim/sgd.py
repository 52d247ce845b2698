"""Stochastic gradient descent with momentum, dampening, Nesterov and weight decay (torch's SGD)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from cupy_parallel._src.arguments import read_bool, read_real
from cupy_parallel._src.optim.optimizer import Optimizer, check_nonnegative, zeros_like
from cupy_parallel._src.optim.updates import apply, elementwise_kernel, opmath

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["SGD"]


def _sgd_numpy(
    p: Any,
    g: Any,
    states: list[Any],
    t1: Any,
    t2: Any,
    *,
    lr: float,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    maximize: bool,
    first: bool,
) -> None:
    d = g
    if maximize:
        d = np.negative(g, out=t1)
    if weight_decay != 0:
        np.multiply(p, weight_decay, out=t2)
        d = np.add(d, t2, out=t1)  # grad + weight_decay * param
    if momentum != 0:
        buf = states[0]
        if first:
            np.copyto(buf, d)
        else:
            np.multiply(buf, momentum, out=buf)
            # (a product by 1.0 is exact: skipped without dampening)
            damped = np.multiply(d, 1 - dampening, out=t2) if dampening != 0 else d
            np.add(buf, damped, out=buf)  # buf * momentum + (1 - dampening) * grad
        if nesterov:
            np.multiply(buf, momentum, out=t2)
            d = np.add(d, t2, out=t1)  # grad + momentum * buf
        else:
            d = buf
    np.multiply(d, -lr, out=t2)
    np.add(p, t2, out=p)  # param + (-lr) * grad


def _sgd_cuda(
    p: Any,
    g: Any,
    states: list[Any],
    *,
    lr: float,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    maximize: bool,
    first: bool,
) -> None:
    # O (the opmath type) holds every intermediate; the arrays are written once at the end
    lines = ["O d = -g;" if maximize else "O d = g;"]
    if weight_decay != 0:
        lines.append("d = d + weight_decay * p;")
    outs = "T p"
    if momentum != 0:
        outs += ", T buf"
        lines.append("O b = d;" if first else "O b = buf * momentum + one_minus_dampening * d;")
        lines.append("d = d + momentum * b;" if nesterov else "d = b;")
        lines.append("buf = b;")
    lines.append("p = p + neg_lr * d;")
    kernel = elementwise_kernel(
        "T g, O weight_decay, O momentum, O one_minus_dampening, O neg_lr",
        outs,
        "\n".join(lines),
        "cupy_parallel_sgd",
    )
    o = opmath(p.dtype).type  # the scalars' type binds O
    kernel(g, o(weight_decay), o(momentum), o(1 - dampening), o(-lr), p, *states[:1])


def _check_dampening(value: Any) -> float:
    number = read_real(value, "dampening")
    if np.isnan(number):  # any other value is torch's (it checks none)
        raise ValueError(f"Invalid dampening value: {value}")
    return number


class SGD(Optimizer):
    r"""Stochastic gradient descent, optionally with momentum: ``torch.optim.SGD``'s math.

    For each parameter ``p`` with gradient ``g`` (torch's order of operations)::

        g = -g                                   if maximize
        g = g + weight_decay * p                 if weight_decay != 0
        if momentum != 0:
            buf = g  (first step)  or  buf = momentum * buf + (1 - dampening) * g
            g = g + momentum * buf               if nesterov, else g = buf
        p = p - lr * g

    State: ``momentum_buffer`` (only with momentum). ``lr`` defaults to ``1e-3`` as in torch
    2.x. torch's ``foreach``/``fused``/``differentiable`` switches do not exist here: NumPy and
    host arrays are updated block by block with ``out=`` ufuncs, CuPy arrays by one fused kernel
    per parameter. See :class:`~cupy_parallel.optim.Optimizer` for ``params``, ``step(grads)``
    (there is no ``zero_grad``: gradients are returned by the tape, not stored) and the state
    dict.

    Raises:
        ValueError: ``lr``, ``momentum`` or ``weight_decay`` below 0, or ``nesterov`` without a
            momentum and zero dampening (torch's messages).
        TypeError: a hyper-parameter that is not a number (a flag that is not a bool).

    Example:
        >>> import numpy as np
        >>> from cupy_parallel.optim import SGD
        >>> w = np.array([1.0, -2.0])
        >>> opt = SGD([w], lr=0.1, momentum=0.9)
        >>> for _ in range(2):
        ...     opt.step([2 * w])          # the gradient of sum(w**2)
        >>> w
        array([ 0.46, -0.92])
        >>> opt.state_dict()["state"][0]["momentum_buffer"]
        array([ 3.4, -6.8])
    """

    _hyper: ClassVar[dict[str, Callable[[Any], Any]]] = {
        "lr": lambda v: check_nonnegative(v, "learning rate"),
        "momentum": lambda v: check_nonnegative(v, "momentum value"),
        "dampening": _check_dampening,
        "weight_decay": lambda v: check_nonnegative(v, "weight_decay value"),
        "nesterov": lambda v: read_bool(v, "nesterov"),
        "maximize": lambda v: read_bool(v, "maximize"),
    }

    def __init__(  # noqa: PLR0917 - torch's signature
        self,
        params: Any,
        lr: float = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
    ) -> None:
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "dampening": dampening,
            "weight_decay": weight_decay,
            "nesterov": nesterov,
            "maximize": maximize,
        }
        checked = {key: check(defaults[key]) for key, check in self._hyper.items()}
        self._check_group(checked)
        super().__init__(params, checked)

    def _check_group(self, hyper: dict[str, Any]) -> None:
        if hyper["nesterov"] and (hyper["momentum"] <= 0 or hyper["dampening"] != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")

    def _state_keys(self, hyper: dict[str, Any]) -> tuple[str, ...]:
        return ("momentum_buffer",) if hyper["momentum"] != 0 else ()

    def _update(self, param: Any, grad: Any, state: dict[str, Any], hyper: dict[str, Any]) -> None:
        first = False
        if hyper["momentum"] != 0 and state.get("momentum_buffer") is None:
            state["momentum_buffer"] = zeros_like(param)
            first = True
        states = [state["momentum_buffer"]] if hyper["momentum"] != 0 else []
        apply(
            _sgd_numpy,
            _sgd_cuda,
            param,
            grad,
            states=states,
            workspace=self._workspace,
            first=first,
            **hyper,
        )
