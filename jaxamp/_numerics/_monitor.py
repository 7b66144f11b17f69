"""``jaxamp.numerics_monitor``: a numerics report every N steps, from the host loop or in a step.

The object it returns has two forms, chosen by where it is called:

- **host loop** (``step`` a Python or NumPy int, no argument traced): on every
  ``every``-th step it dispatches the cached compiled program of
  :func:`jaxamp.numerics_report` and hands its device arrays to ``_delivery``'s
  worker thread, which reads them back and calls the callback; on the other
  steps it returns before touching any array. The train step is not changed.
- **in step** (called while ``jax.jit`` traces): the instrumented program is
  traced into the step under a ``lax.cond`` on ``step % every == 0`` and the
  report goes to a ``jax.debug.callback``.

A Python int ``step`` that is not a reporting step returns at once wherever it is
called (a step function retraced per step by a static ``step`` traces nothing).

With ``screen=True`` a firing runs the screening pass first and the full program
only when it found an inf/NaN (``NumericsProgram.screened_run`` from the host
loop, after reading its flag back; ``_program._screened``'s ``lax.cond`` in a step).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.core import Tracer

from jaxamp._numerics._delivery import Delivery
from jaxamp._numerics._numerics_report import NumericsReport
from jaxamp._numerics._program import NumericsProgram, check_options
from jaxamp._resolve import resolved_spec

__all__ = ["NumericsMonitor", "numerics_monitor"]


def numerics_monitor(
    fun: Callable,
    *,
    every: int,
    policy: Any = None,
    grad: bool = False,
    has_aux: bool = False,
    callback: Callable[[int, NumericsReport], Any] | None = None,
    screen: bool = False,
) -> NumericsMonitor:
    """A numerics report every ``every`` steps, from the host loop or inside a jitted step.

    ``monitor(step, *args, loss_scale=None, **kwargs)`` measures ``fun(*args,
    **kwargs)`` as :func:`jaxamp.numerics_report` does on the steps where
    ``step % every == 0`` and sends the report to ``callback(step, report)``
    (default: print it). Where it is called decides how:

    - **From the host loop** (``step`` a Python int, outside ``jax.jit``): the
      steps that do not report cost nothing (no device work, no host sync, the
      train step unchanged); a reporting step dispatches the compiled program
      ``numerics_report`` caches (compiled on the first one) and returns while it
      runs; a worker thread reads the statistics back and calls ``callback``.
      :meth:`NumericsMonitor.flush` waits for the reports dispatched so far.
      The form for a long run.
    - **Inside a jitted step** (any argument traced): the instrumented program is
      traced into the step under a ``lax.cond`` on ``step % every == 0``; the other
      steps cost an untaken branch, and the step's compile includes the
      program's. The callback is a ``jax.debug.callback``
      (``jax.effects_barrier()`` waits for it). No recompile when the loss scale
      changes: it is a traced argument.

    Args:
      fun: the loss (or model) as for :func:`jaxamp.numerics_report`.
      every: report every this many steps (a positive int).
      policy: as for :func:`jaxamp.numerics_report`.
      grad: as for :func:`jaxamp.numerics_report`.
      has_aux: as for :func:`jaxamp.numerics_report`.
      callback: called on the host with the step number and the report.
      screen: False (default): every firing runs the full report, equal to
        :func:`jaxamp.numerics_report`'s. True: every firing first runs a
        screening pass (the program and each op's own statistics, no float32
        shadow nor twin, a fraction of the full report's cost); only when it
        finds an inf/NaN (in an op or an input) does the full report run, on the
        same inputs, in the same dispatch, and the callback gets it (equal to
        :func:`jaxamp.numerics_report`'s). A firing that finds none delivers the
        screen's report (``report.screened``: no float32 magnitudes, underflow
        fractions or suggested loss scale; every other field as in the full
        report). The form for a long run that fires often.

    Returns:
      A :class:`jaxamp.NumericsMonitor`: ``monitor(step, *args, loss_scale=None,
      **kwargs) -> None``; ``loss_scale`` may be an array (e.g. the dynamic loss
      scale of the optimizer state), traced inside a step.

    Raises:
      TypeError: ``fun`` or ``callback`` is not callable, a bad ``has_aux``.
      ValueError: ``every`` is not a positive int.
      TypeError: ``screen`` is not a bool.

    Inside a jitted step:

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

    From the host loop (the train step is a plain jitted function):

    >>> seen.clear()
    >>> train = jax.jit(lambda w: w * 2)
    >>> w = jnp.ones(3, jnp.float16)
    >>> for i in range(3):
    ...     monitor(i, w)  # steps 0 and 2 dispatch the report's program; step 1 nothing
    ...     w = train(w)
    >>> monitor.flush(); seen
    [(0, 'integer_pow'), (2, 'integer_pow')]
    """
    check_options(fun, has_aux)
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"every must be a positive int (steps between reports); got {every!r}.")
    if not isinstance(screen, bool):
        raise TypeError(f"screen must be True or False; got {screen!r}.")
    if callback is not None and not callable(callback):
        raise TypeError(f"callback must be callable or None; got {callback!r}.")
    resolved = resolved_spec(policy) if policy is not None else None
    report_to = callback if callback is not None else _print_report
    return NumericsMonitor(fun, every, resolved, grad, has_aux, report_to, screen)


class NumericsMonitor:
    """What :func:`jaxamp.numerics_monitor` returns: call it every step.

    ``monitor(step, *args, loss_scale=None, **kwargs)`` reports on the steps where
    ``step % every == 0``: from the host loop when ``step`` is a Python (or NumPy)
    int and no argument is traced, else traced into the jitted step that calls it
    (see :func:`jaxamp.numerics_monitor`).

    >>> import jax.numpy as jnp, jaxamp
    >>> seen = []
    >>> monitor = jaxamp.numerics_monitor(
    ...     lambda w: jnp.sum(w), every=10, callback=lambda step, r: seen.append(step))
    >>> for step in range(25):
    ...     monitor(step, jnp.ones(4, jnp.bfloat16))
    >>> monitor.flush(); seen
    [0, 10, 20]
    """

    def __init__(
        self, fun, every: int, policy, grad: bool, has_aux: bool, report_to, screen: bool = False
    ) -> None:
        self.fun, self.every, self.policy = fun, every, policy
        self.grad, self.has_aux, self.screen = grad, has_aux, screen
        self._report_to = report_to
        self._delivery = Delivery(report_to)

    def __call__(self, step: Any, *args: Any, loss_scale: Any = None, **kwargs: Any) -> None:
        host_step = not isinstance(step, bool) and isinstance(step, numbers.Integral)
        if host_step and step % self.every:
            return  # not a reporting step: nothing to trace, dispatch or read
        if host_step and not _traced((args, kwargs, loss_scale)):
            self._host(int(step), args, kwargs, loss_scale)
        else:
            self._in_step(step, args, kwargs, loss_scale)

    def flush(self) -> None:
        """Waits until the callback has had every report dispatched from the host loop.

        Raises:
          Exception: the first exception the callback raised since the last ``flush``
            (the reports after it were still delivered).
        """
        self._delivery.flush()

    def _program(self, args: tuple, kwargs: dict) -> NumericsProgram:
        return NumericsProgram(self.fun, args, kwargs, self.policy, self.grad, self.has_aux)

    def _host(self, step: int, args: tuple, kwargs: dict, loss_scale: Any) -> None:
        program = self._program(args, kwargs)
        seed = jnp.asarray(1.0 if loss_scale is None else loss_scale, jnp.float32)
        inputs = program.inputs(seed)
        if self.screen:
            compiled, outputs = program.screened_run(inputs)
        else:
            compiled = program.compiled(inputs)
            outputs = compiled.run(*inputs)
        self._delivery.put(step, compiled, outputs, seed if self.grad else None)

    def _in_step(self, step: Any, args: tuple, kwargs: dict, loss_scale: Any) -> None:
        program = self._program(args, kwargs)
        seed = jnp.asarray(1.0 if loss_scale is None else loss_scale, jnp.float32)
        inputs = program.inputs(seed)
        traced = program.traced(inputs, self.screen)
        grad, report_to = self.grad, self._report_to

        def host(step, scale, floats, ints, finite, *full):
            scale = float(scale) if grad else None
            full = [bool(f) for f in full]  # the screened program says whether it ran
            report_to(int(step), traced.report(floats, ints, finite, scale, *full))

        def report(step, inputs):
            jax.debug.callback(host, step, seed, *traced.run(*inputs))

        step = jnp.asarray(step)
        jax.lax.cond(step % self.every == 0, report, lambda *_: None, step, inputs)


def _traced(tree: Any) -> bool:
    """Whether a leaf of ``tree`` is traced (the monitor is called inside ``jax.jit``)."""
    return any(isinstance(x, Tracer) for x in jax.tree.leaves(tree))


def _print_report(step: int, report: NumericsReport) -> None:
    print(f"step {step}: {report}")
