"""``jaxamp.numerics_report``: trace, catalog, run instrumented under jit, summarise."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxamp._autocast import autocast
from jaxamp._casting import is_floating
from jaxamp._checks import check_callable
from jaxamp._engine._trace import is_array
from jaxamp._numerics._compiled import Compiled, cache_key, cached, compile_with_fallback
from jaxamp._numerics._instrument import all_finite_flag, instrumented
from jaxamp._numerics._sites import catalog
from jaxamp._numerics._summary import summarise
from jaxamp._numerics._types import NumericsReport
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
    traced = TracedCall(fun, args, kwargs, resolved, grad, has_aux)
    inputs = traced.inputs(jnp.asarray(scale, jnp.float32))
    key = cache_key(fun, resolved, grad, has_aux, traced.treedef, traced.static, traced.dynamic)

    def build() -> Compiled:
        closed, sites = traced.catalogued(inputs)

        def make():
            return jax.jit(measuring(closed, sites))

        return Compiled(compile_with_fallback(make, inputs), sites, traced.paths())

    compiled = cached(key, build)

    def finish(floats, ints, finite) -> NumericsReport:
        return finish_report(compiled, floats, ints, finite, scale if grad else None)

    return compiled.run, inputs, finish


def check_options(fun: Any, has_aux: Any) -> None:
    check_callable(fun)
    if not isinstance(has_aux, bool):
        raise TypeError(f"has_aux must be True or False; got {has_aux!r}.")


def measuring(closed, sites) -> Callable:
    """``f(*inputs) -> (floats, ints, finite)``: the statistics and which inputs are finite."""
    measure = instrumented(closed, sites)
    return lambda *a: (*measure(*a), jnp.stack([all_finite_flag(x) for x in a]))


def finish_report(compiled: Compiled, floats, ints, finite, scale) -> NumericsReport:
    """The report from one run's statistics (host arrays)."""
    flags = np.asarray(finite)
    bad = tuple(p for p, ok in zip(compiled.paths, flags, strict=False) if not ok)
    return summarise(compiled.sites, np.asarray(floats), np.asarray(ints), scale, bad)


class TracedCall:
    """``fun`` on these arguments: array leaves traced, the rest static, then cataloged."""

    def __init__(self, fun, args, kwargs, resolved, grad, has_aux):
        self.fun, self.args, self.grad, self.has_aux = fun, args, grad, has_aux
        self.wrapped = autocast(fun, resolved) if resolved is not None else fun
        self.flat, self.treedef = jax.tree_util.tree_flatten_with_path((args, kwargs))
        leaves = [leaf for _, leaf in self.flat]
        self.is_dynamic = [is_array(leaf) for leaf in leaves]
        self.leaves = leaves
        pairs = list(zip(leaves, self.is_dynamic, strict=True))
        self.dynamic = [leaf for leaf, d in pairs if d]
        self.static = [leaf for leaf, d in pairs if not d]

    def inputs(self, seed: Any) -> list:
        """The program's arguments: the array leaves, then (``grad``) the float32 seed."""
        return [*self.dynamic, seed] if self.grad else list(self.dynamic)

    def call(self, *dyn):
        it = iter(dyn)
        pairs = zip(self.leaves, self.is_dynamic, strict=True)
        full = [next(it) if d else leaf for leaf, d in pairs]
        a, k = jax.tree.unflatten(self.treedef, full)
        return self.wrapped(*a, **k)

    def catalogued(self, inputs: list) -> tuple[Any, list]:
        """``(closed jaxpr, sites)`` of the program on ``inputs``."""
        if self.grad:
            program, out_phases = _gradient_program(
                self.call, self.args, self.dynamic, self.has_aux
            )
        else:
            program, out_phases = self.call, None
        closed = jax.make_jaxpr(program)(*inputs)
        tainted = [False] * len(inputs)
        if self.grad:
            tainted[-1] = True  # the cotangent seed: what depends on it is the backward pass
        if out_phases is None:
            out_phases = ["forward"] * len(closed.jaxpr.outvars)
        return closed, catalog(closed, tainted, out_phases)

    def paths(self) -> list[str]:
        dyn = [path for (path, _), d in zip(self.flat, self.is_dynamic, strict=True) if d]
        return [_arg_path(self.fun, path) for path in dyn]


def _arg_path(fun: Callable, path: tuple) -> str:
    """``"params['w']"``: the argument name (``args[i]`` if unknown) and the path in it."""
    head, rest = path[0].idx, path[1:]
    if head == 1:  # keyword arguments: the first key is the name
        return f"{rest[0].key}{jax.tree_util.keystr(rest[1:])}"
    index = rest[0].idx
    try:
        params = list(inspect.signature(fun).parameters.values())
    except (TypeError, ValueError):
        params = []
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    name = positional[index].name if index < len(positional) else f"args[{index}]"
    return f"{name}{jax.tree_util.keystr(rest[1:])}"


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


def _gradient_program(call: Callable, args: tuple, dynamic: list, has_aux: bool):
    """``(program, out_phases)``: ``program(*dynamic, seed)`` returns the loss (and aux)
    and the gradient wrt the first argument; ``out_phases`` names each output's phase."""
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
    if has_aux and not (isinstance(out, tuple) and len(out) == 2):
        raise TypeError(
            "numerics_report(has_aux=True) needs fun to return a pair (loss, aux); got "
            f"{_describe(out)}."
        )
    loss_out = out[0] if has_aux else out
    if not (is_floating(loss_out) and getattr(loss_out, "shape", None) == ()):
        raise TypeError(
            "numerics_report(grad=True) needs fun to return a floating scalar loss; got "
            f"{_describe(loss_out)}. Reduce the "
            "output to a scalar (e.g. jnp.mean) or pass grad=False."
        )

    def program(*inputs):
        *dyn, seed = inputs

        def of_wrt(diff):
            full = list(dyn)
            for i, value in zip(wrt, diff, strict=True):
                full[i] = value
            return call(*full)

        loss, backward, *aux = jax.vjp(of_wrt, [dyn[i] for i in wrt], has_aux=has_aux)
        # The seed is a float32 argument rounded to the loss dtype here: the rounding is
        # a measured op, so a float16 loss's seed counts for the loss scale, and its
        # float32 twin is the true scale even where the float16 seed overflows.
        return loss, aux, backward(seed.astype(loss_out.dtype))

    n_aux = len(jax.tree.leaves(out[1])) if has_aux else 0
    return program, ["forward"] + ["state"] * n_aux + ["backward"] * len(wrt)


def _describe(tree: Any) -> str:
    def one(x):
        if hasattr(x, "dtype") and hasattr(x, "shape"):
            return f"{np.dtype(x.dtype).name}{list(x.shape)}"
        return type(x).__name__

    leaves = jax.tree.leaves(tree)
    return str(jax.tree.map(one, tree)) if len(leaves) != 1 else one(leaves[0])
