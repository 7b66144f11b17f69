"""``jaxamp.numerics_report``: trace, catalog, run instrumented under jit, summarise."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxamp._autocast import autocast
from jaxamp._casting import is_floating
from jaxamp._checks import check_callable
from jaxamp._engine._trace import flatten_call, is_array
from jaxamp._numerics._instrument import NEVER, instrumented
from jaxamp._numerics._sites import Site, catalog
from jaxamp._numerics._types import SAFETY_FACTOR, NumericsReport, OpStats
from jaxamp._policy import get_policy

__all__ = ["numerics_report", "prepare"]


def numerics_report(
    fun: Callable,
    *args: Any,
    policy: Any = None,
    grad: bool = False,
    loss_scale: float | None = None,
    **kwargs: Any,
) -> NumericsReport:
    """Runs ``fun(*args, **kwargs)`` once, measuring the range of every floating op.

    For every floating output of every equation (inside jit, scan, while, cond,
    checkpoint, custom_jvp/custom_vjp too) it records the largest finite
    magnitude, the inf/NaN count, the fraction flushed to zero by a 16-bit dtype,
    and the source line; it names the op where the first inf/NaN was born and,
    with ``grad=True``, suggests a loss scale. The program runs instrumented under
    one ``jax.jit`` (statistics are extra outputs and loop carries).

    Args:
      fun: the function (a model's apply or a loss). Array leaves of the arguments
        are traced; other leaves are static.
      *args: its positional arguments.
      policy: ``None`` runs ``fun`` as written (a Flax model with layer dtypes, a
        hand-cast model); anything :func:`jaxamp.get_policy` accepts runs it under
        ``jaxamp.autocast(fun, policy)``.
      grad: ``True``: ``fun`` returns a scalar loss, and the report also covers its
        gradient with respect to the floating arrays of the first argument, with the
        loss multiplied by ``loss_scale`` first (as a loss-scaled train step does).
      loss_scale: the loss scale for ``grad=True`` (a positive number, default 1).
      **kwargs: keyword arguments of ``fun``.

    Returns:
      A :class:`jaxamp.NumericsReport`.

    Raises:
      TypeError: ``fun`` is not callable, or with ``grad=True`` it does not return
        a floating scalar or its first argument has no floating array.
      ValueError: a bad ``loss_scale``, or ``loss_scale`` without ``grad=True``.

    >>> import jax.numpy as jnp, jaxamp
    >>> def loss(w, x):
    ...     return jnp.sum((x @ w) ** 2)
    >>> w = jnp.full((4, 2), 300.0, jnp.float16)
    >>> report = jaxamp.numerics_report(loss, w, jnp.ones((3, 4), jnp.float16))
    >>> report.first_nonfinite.primitive  # 1200**2 overflows float16
    'integer_pow'
    """
    run, inputs, finish = prepare(fun, args, kwargs, policy, grad, loss_scale)
    return finish(*jax.device_get(run(*inputs)))


def prepare(fun, args, kwargs, policy, grad, loss_scale) -> tuple[Callable, list, Callable]:
    """``(run, inputs, finish)``: ``finish(*run(*inputs))`` is the report.

    ``run`` is the jitted, instrumented program (what ``benchmarks/numerics_cost.py``
    times against a plain ``value_and_grad``); ``finish`` turns its statistics
    (host arrays) into a :class:`NumericsReport`.
    """
    check_callable(fun)
    scale = _check_loss_scale(loss_scale, grad)
    if policy is not None:
        fun = autocast(fun, get_policy(policy))
    call, dynamic = flatten_call(fun, args, kwargs)
    if grad:
        program, inputs = _gradient_program(call, args, dynamic, scale)
    else:
        program, inputs = call, dynamic
    closed = jax.make_jaxpr(program)(*inputs)
    tainted = [False] * len(inputs)
    if grad:
        tainted[-1] = True  # the cotangent seed: what depends on it is the backward pass
    primal = [not grad or i == 0 for i in range(len(closed.jaxpr.outvars))]
    sites = catalog(closed, tainted, primal)

    def finish(floats, ints) -> NumericsReport:
        return _summarise(sites, np.asarray(floats), np.asarray(ints), scale if grad else None)

    return instrumented(closed, sites), inputs, finish


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


def _gradient_program(call: Callable, args: tuple, dynamic: list, scale: float):
    """``program(*dynamic, seed)``: the loss and its gradient wrt the first argument."""
    n_first = sum(map(is_array, jax.tree.leaves(args[:1])))
    wrt = [i for i in range(n_first) if is_floating(dynamic[i])]
    if not args or not wrt:
        got = _describe(args[0]) if args else "no arguments"
        raise TypeError(
            "numerics_report(grad=True) differentiates with respect to the floating "
            f"arrays of the first argument, and it has none (got {got}). Pass the "
            "parameters (a pytree of floating arrays) first."
        )
    out = jax.eval_shape(call, *dynamic)
    if not (is_floating(out) and getattr(out, "shape", None) == ()):
        raise TypeError(
            "numerics_report(grad=True) needs fun to return a floating scalar loss; got "
            f"{_describe(out)}. Reduce the "
            "output to a scalar (e.g. jnp.mean) or pass grad=False."
        )

    def program(*inputs):
        *dyn, seed = inputs

        def of_wrt(diff):
            full = list(dyn)
            for i, value in zip(wrt, diff, strict=True):
                full[i] = value
            return call(*full)

        loss, backward = jax.vjp(of_wrt, [dyn[i] for i in wrt])
        return loss, backward(seed)

    return program, [*dynamic, jnp.asarray(scale, out.dtype)]


def _describe(tree: Any) -> str:
    def one(x):
        if hasattr(x, "dtype") and hasattr(x, "shape"):
            return f"{np.dtype(x.dtype).name}{list(x.shape)}"
        return type(x).__name__

    leaves = jax.tree.leaves(tree)
    return str(jax.tree.map(one, tree)) if len(leaves) != 1 else one(leaves[0])


def _summarise(sites: list[Site], floats, ints, scale: float | None) -> NumericsReport:
    ops, origin, origin_clock = [], None, NEVER
    for site, (max_abs, max32), row in zip(sites, floats, ints, strict=True):
        nonfinite, underflow, executions, clock, first_iter = (int(v) for v in row)
        size = math.prod(site.shape) * executions
        op = OpStats(
            primitive=site.primitive,
            source=site.source,
            phase=site.phase,
            scaled=site.scaled,
            dtype=site.dtype,
            shape=site.shape,
            max_abs=float(max_abs),
            nonfinite=nonfinite,
            underflow_fraction=underflow / size if size else 0.0,
            headroom=float(max_abs) / float(jnp.finfo(site.dtype).max),
            max_abs_float32=float(max32),
            executions=executions,
            first_nonfinite_iteration=first_iter if site.in_loop and first_iter >= 0 else None,
        )
        ops.append(op)
        if clock < origin_clock:
            origin, origin_clock = op, clock
    largest = _largest_loss_scale(ops, scale)
    suggested = None if largest is None else largest / SAFETY_FACTOR
    return NumericsReport(tuple(ops), origin, suggested, scale, largest)


def _largest_loss_scale(ops: list[OpStats], scale: float | None) -> float | None:
    """The largest power of two at which every backward op stays below its dtype's max.

    Cotangents (``scaled`` ops) are linear in the loss scale: an op that reached ``m`` at
    scale ``s`` reaches ``m * S / s`` at scale ``S``; ``m`` is the float32 twin's
    magnitude, so an op that already overflowed still gives its true size.
    """
    backward = [op for op in ops if op.scaled]
    if scale is None or not any(np.dtype(op.dtype).itemsize < 4 for op in backward):
        return None
    limits = [
        float(jnp.finfo(op.dtype).max) * scale / op.max_abs_float32
        for op in backward
        if op.max_abs_float32 > 0
    ]
    if not limits:
        return None
    return 2.0 ** math.floor(math.log2(min(limits)))
