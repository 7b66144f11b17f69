"""``jaxamp.numerics_report``: trace, catalog, run instrumented under jit, summarise."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxamp._numerics._numerics_report import NumericsReport
from jaxamp._numerics._program import NumericsProgram, check_options
from jaxamp._resolve import resolved_spec

__all__ = ["numerics_report", "prepare"]


def numerics_report(
    fun: Callable,
    *args: Any,
    policy: Any = None,
    grad: bool = False,
    loss_scale: float | None = None,
    has_aux: bool = False,
    **kwargs: Any,
) -> NumericsReport:
    """Runs ``fun(*args, **kwargs)`` once, measuring the range of every floating op.

    For every floating output of every equation (inside jit, scan, while, cond,
    checkpoint, custom_jvp/custom_vjp too) it records the largest finite
    magnitude, the inf/NaN count, the fraction flushed to zero by a 16-bit dtype,
    and the source line; it names the op where the first inf/NaN was born and,
    with ``grad=True``, suggests a loss scale. The program runs instrumented under
    one ``jax.jit`` (statistics are extra outputs and loop carries).

    The compiled program is cached per function, array shapes and dtypes,
    non-array arguments, policy, ``grad`` and ``has_aux`` (not per loss scale), so
    calling it again on the next batch of a training run costs one run, not a
    compile.

    Args:
      fun: the function (a model's apply or a loss). Array leaves of the arguments
        are traced; other leaves are static.
      *args: its positional arguments.
      policy: ``None`` runs ``fun`` as written (a Flax model with layer dtypes, a
        hand-cast model); anything :func:`jaxamp.autocast` accepts (a policy, a
        ``jaxamp.Float8Recipe``, ``"mixed_float8"``) runs it under
        ``jaxamp.autocast(fun, policy)``.
      grad: ``True``: ``fun`` returns a scalar loss, and the report also covers its
        gradient with respect to the floating arrays of the first argument, with the
        loss multiplied by ``loss_scale`` first (as a loss-scaled train step does).
      loss_scale: the loss scale for ``grad=True`` (a positive number, default 1).
      has_aux: as in ``jax.value_and_grad``: ``fun`` returns ``(loss, aux)``; ops
        that only ``aux`` depends on are in phase ``"state"``.
      **kwargs: keyword arguments of ``fun``.

    Returns:
      A :class:`jaxamp.NumericsReport`.

    Raises:
      TypeError: ``fun`` is not callable, or with ``grad=True`` it does not return
        a floating scalar (or ``(loss, aux)`` with ``has_aux=True``) or its first
        argument has no floating array.
      ValueError: a bad ``loss_scale``, or ``loss_scale`` without ``grad=True``.

    >>> import jax.numpy as jnp, jaxamp
    >>> def loss(w, x):
    ...     return jnp.sum((x @ w) ** 2)
    >>> w = jnp.full((4, 2), 300.0, jnp.float16)
    >>> report = jaxamp.numerics_report(loss, w, jnp.ones((3, 4), jnp.float16))
    >>> report.first_nonfinite.primitive  # 1200**2 overflows float16
    'integer_pow'
    """
    run, inputs, finish = prepare(fun, args, kwargs, policy, grad, loss_scale, has_aux)
    return finish(*jax.device_get(run(*inputs)))


def prepare(
    fun, args, kwargs, policy, grad, loss_scale, has_aux=False
) -> tuple[Callable, list, Callable]:
    """``(run, inputs, finish)``: ``finish(*run(*inputs))`` is the report.

    ``run`` is the compiled, instrumented program (what ``benchmarks/numerics_cost.py``
    times against a plain ``value_and_grad``), cached across calls; ``finish`` turns
    its statistics (host arrays) into a :class:`NumericsReport`.
    """
    check_options(fun, has_aux)
    scale = _check_loss_scale(loss_scale, grad)
    resolved = None if policy is None else resolved_spec(policy)
    program = NumericsProgram(fun, args, kwargs, resolved, grad, has_aux)
    inputs = program.inputs(jnp.asarray(scale, jnp.float32))
    compiled = program.compiled(inputs)

    def finish(floats, ints, finite) -> NumericsReport:
        return compiled.report(floats, ints, finite, scale if grad else None)

    return compiled.run, inputs, finish


def _check_loss_scale(loss_scale: Any, grad: bool) -> float:
    if loss_scale is None:
        return 1.0
    if not grad:
        raise ValueError(
            f"loss_scale only applies to the gradient; got loss_scale={loss_scale!r} with "
            "grad=False. Pass grad=True to measure the scaled backward pass."
        )
    if isinstance(loss_scale, bool) or not isinstance(loss_scale, (int, float, np.number)):
        raise TypeError(
            f"loss_scale must be a Python number such as 1024.0; got "
            f"{type(loss_scale).__name__}: {loss_scale!r}."
        )
    if not (math.isfinite(loss_scale) and loss_scale > 0):
        raise ValueError(f"loss_scale must be finite and > 0; got {loss_scale!r}.")
    return float(loss_scale)
