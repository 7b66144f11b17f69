"""``jaxamp.numerics_monitor``: a numerics report every N steps, from inside a jitted step."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxamp._numerics._numerics_report import NumericsReport
from jaxamp._numerics._program import NumericsProgram, check_options
from jaxamp._resolve import resolved_spec

__all__ = ["numerics_monitor"]


def numerics_monitor(
    fun: Callable,
    *,
    every: int,
    policy: Any = None,
    grad: bool = False,
    has_aux: bool = False,
    callback: Callable[[int, NumericsReport], Any] | None = None,
) -> Callable[..., None]:
    """A function to call inside a jitted train step: a report every ``every`` steps.

    ``monitor(step, *args, loss_scale=None, **kwargs)`` traces the instrumented
    program of :func:`jaxamp.numerics_report` into the step, under a
    ``lax.cond`` on ``step % every == 0``: on the other steps it costs a branch,
    and on those steps one instrumented run and a host callback (no recompile
    when the loss scale changes: it is a traced argument). The report goes to
    ``callback(step, report)`` on the host (default: print it).

    Args:
      fun: the loss (or model) as for :func:`jaxamp.numerics_report`.
      every: report every this many steps (a positive int).
      policy: as for :func:`jaxamp.numerics_report`.
      grad: as for :func:`jaxamp.numerics_report`.
      has_aux: as for :func:`jaxamp.numerics_report`.
      callback: called on the host with the step number and the report.

    Returns:
      ``monitor(step, *args, loss_scale=None, **kwargs) -> None``; ``loss_scale``
      may be a traced scalar (e.g. the dynamic loss scale of the optimizer state).

    Raises:
      TypeError: ``fun`` or ``callback`` is not callable, a bad ``has_aux``.
      ValueError: ``every`` is not a positive int.

    >>> import jax, jax.numpy as jnp, jaxamp
    >>> seen = []
    >>> monitor = jaxamp.numerics_monitor(
    ...     lambda w: jnp.sum(w * 300.0) ** 2, every=2,
    ...     callback=lambda step, report: seen.append((step, report.first_nonfinite.primitive)))
    >>> @jax.jit
    ... def step(i, w):
    ...     monitor(i, w)
    ...     return w * 2
    >>> w = jnp.ones(3, jnp.float16)
    >>> for i in range(3):
    ...     w = step(i, w)
    >>> jax.effects_barrier(); seen
    [(0, 'integer_pow'), (2, 'integer_pow')]
    """
    check_options(fun, has_aux)
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"every must be a positive int (steps between reports); got {every!r}.")
    if callback is not None and not callable(callback):
        raise TypeError(f"callback must be callable or None; got {callback!r}.")
    resolved = resolved_spec(policy) if policy is not None else None
    report_to = callback if callback is not None else _print_report

    def monitor(step: Any, *args: Any, loss_scale: Any = None, **kwargs: Any) -> None:
        program = NumericsProgram(fun, args, kwargs, resolved, grad, has_aux)
        seed = jnp.asarray(1.0 if loss_scale is None else loss_scale, jnp.float32)
        inputs = program.inputs(seed)
        traced = program.traced(inputs)

        def host(step, floats, ints, finite, scale):
            scale = float(scale) if grad else None
            report_to(int(step), traced.report(floats, ints, finite, scale))

        def report(step, inputs):
            jax.debug.callback(host, step, *traced.run(*inputs), seed)

        step = jnp.asarray(step)
        jax.lax.cond(step % every == 0, report, lambda *_: None, step, inputs)

    return monitor


def _print_report(step: int, report: NumericsReport) -> None:
    print(f"step {step}: {report}")
