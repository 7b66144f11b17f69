"""Differentiating the scaled loss while returning the true one."""

from __future__ import annotations

from typing import Any

import jax

from jaxamp._checks import check_callable

__all__ = ["scaled_value_and_grad"]


def scaled_value_and_grad(
    fun: Any,
    loss_scale: Any,
    *,
    has_aux: bool = False,
    argnums: int | tuple[int, ...] | None = None,
    value_and_grad: Any = jax.value_and_grad,
) -> Any:
    """``value_and_grad`` of ``loss_scale.scale(fun(...))``: the true loss, scaled grads.

    The grads are what :func:`loss_scaling`'s ``update`` expects; the returned
    loss (and aux) are unscaled, ready to log.

    Args:
      fun: returns the scalar loss (or ``(loss, aux)`` with ``has_aux=True``).
      loss_scale: a jaxamp loss scale, e.g. ``jaxamp.get_loss_scale(opt_state)``.
      has_aux: as in ``jax.value_and_grad``.
      argnums: as in ``jax.value_and_grad``; ``None`` (default) passes none, so
        transforms without the argument (``equinox.filter_value_and_grad``)
        work, and ``jax.value_and_grad`` differentiates the first argument.
      value_and_grad: the differentiation transform, e.g. ``flax.nnx.value_and_grad``
        for NNX modules.

    >>> import jax.numpy as jnp, jaxamp
    >>> f = jaxamp.scaled_value_and_grad(lambda w: (w**2).sum(), jaxamp.StaticLossScale(8.0))
    >>> f(jnp.array([1.0, 2.0]))
    (Array(5., dtype=float32), Array([16., 32.], dtype=float32))
    """
    check_callable(fun)
    if not hasattr(loss_scale, "scale") or not hasattr(loss_scale, "unscale"):
        raise TypeError(
            "loss_scale must be a jaxamp loss scale such as jaxamp.get_loss_scale(opt_state); "
            f"got {type(loss_scale).__name__}: {loss_scale!r}."
        )

    def scaled(*args, **kwargs):
        out = fun(*args, **kwargs)
        if has_aux:
            return loss_scale.scale(out[0]), out[1]
        return loss_scale.scale(out)

    options = {} if argnums is None else {"argnums": argnums}
    grad_fn = value_and_grad(scaled, has_aux=has_aux, **options)

    def wrapped(*args, **kwargs):
        value, grads = grad_fn(*args, **kwargs)
        if has_aux:
            return (loss_scale.unscale(value[0]), value[1]), grads
        return loss_scale.unscale(value), grads

    return wrapped
