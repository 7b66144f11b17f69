"""The numerics pipeline as one object: trace, catalog, instrument, report.

``NumericsProgram(fun, args, kwargs, policy, grad, has_aux)`` is ``fun`` on these
arguments: its array leaves are the program's inputs (``_engine._trace.flatten_call``),
the rest static; with ``grad=True`` the program is the loss-scaled gradient.
``numerics_report`` compiles it (cached, ``compiled``); ``numerics_monitor``
traces it into a user's jitted step (``traced``). Both get a ``Compiled`` whose
``report`` turns one run's statistics into a :class:`NumericsReport`.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Hashable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxamp._autocast import autocast
from jaxamp._casting import is_floating
from jaxamp._checks import check_callable
from jaxamp._engine._trace import flatten_call, is_array
from jaxamp._fp8._fp4_facts import observing
from jaxamp._numerics._compiled import (
    Compiled,
    cache_key,
    cached,
    compile_with_fallback,
    materializes_values,
)
from jaxamp._numerics._flow import site_graph
from jaxamp._numerics._instrument import all_finite_flag, instrumented
from jaxamp._numerics._sites import catalog
from jaxamp._numerics._stats import any_nonfinite

__all__ = ["NumericsProgram", "check_options"]


def check_options(fun: Any, has_aux: Any) -> None:
    """The options every entry point checks before it traces anything."""
    check_callable(fun)
    if not isinstance(has_aux, bool):
        raise TypeError(f"has_aux must be True or False; got {has_aux!r}.")


class NumericsProgram:
    """``fun`` on these arguments, measured (``policy``: already resolved, or None)."""

    def __init__(self, fun, args, kwargs, policy, grad: bool, has_aux: bool):
        self.fun, self.args, self.policy, self.grad, self.has_aux = fun, args, policy, grad, has_aux
        wrapped = autocast(fun, policy) if policy is not None else fun
        self.flat = flatten_call(wrapped, args, kwargs)

    def inputs(self, seed: Any) -> list:
        """The program's arguments: the array leaves, then (``grad``) the float32 seed."""
        arrays = list(self.flat.arrays)
        return [*arrays, seed] if self.grad else arrays

    def cache_key(self, screen: bool = False) -> Hashable | None:
        flat = self.flat
        key = cache_key(
            self.fun, self.policy, self.grad, self.has_aux, flat.treedef, flat.static, flat.arrays
        )
        return key if key is None or not screen else (key, "screen")

    def catalogued(self, inputs: list) -> tuple[Any, list]:
        """``(closed jaxpr, sites)`` of the program on ``inputs``."""
        if self.grad:
            program, phases = _gradient_program(
                self.flat.call, self.args, self.flat.arrays, self.has_aux
            )
        else:
            program, phases = self.flat.call, None
        # FP4 quantizations pass what the report measures of them (``_fp4_facts``).
        with observing():
            closed = jax.make_jaxpr(program)(*inputs)
        tainted = [False] * len(inputs)
        if self.grad:
            tainted[-1] = True  # the cotangent seed: what depends on it is the backward pass
        out_phases = phases() if phases else ["forward"] * len(closed.jaxpr.outvars)
        return closed, catalog(closed, tainted, out_phases)

    def traced(self, inputs: list, screen: bool = False) -> Compiled:
        """The instrumented program as a function to trace into a caller's program;
        ``screen``: the screened program (``_screened``).

        It is compiled with the caller's options, where XLA may keep a fused chain's
        16-bit values in float32: each measured value is kept in a buffer of its own,
        so every one is rounded to its dtype, as in ``compiled``."""
        closed, sites = self.catalogued(inputs)
        program = _screened if screen else _measuring
        return Compiled(
            program(closed, sites, materialize=True),
            sites,
            self.paths(),
            site_graph(closed, (site.key for site in sites)),
            screen,
        )

    def compiled(self, inputs: list, screen: bool = False) -> Compiled:
        """The instrumented program compiled for ``inputs``, cached across calls;
        ``screen``: the screening pass alone (``_screening``)."""

        def build() -> Compiled:
            closed, sites = self.catalogued(inputs)
            values = sum(math.prod(site.shape) for site in sites)
            program = _screening if screen else _measuring

            # A fresh jit per attempt: the fallback traces it again, checking every twin.
            def make() -> Callable:
                return jax.jit(program(closed, sites))

            run = compile_with_fallback(make, inputs, values)
            return Compiled(
                run, sites, self.paths(), site_graph(closed, (site.key for site in sites)), screen
            )

        return cached(self.cache_key(screen), build)

    def screened_run(self, inputs: list) -> tuple[Compiled, tuple]:
        """``(program, outputs)``: the screening pass on ``inputs`` and, when it found an
        inf/NaN, the full program (``compiled``, the one ``numerics_report`` runs) on
        the same inputs; ``outputs`` end with whether the full one ran. Reading that
        one flag back waits for the screen: the inputs are still alive here (a train
        step that donates them has not run yet), and a clean run never compiles the
        full program."""
        screen = self.compiled(inputs, screen=True)
        outputs = screen.run(*inputs)
        if not bool(outputs[-1]):
            return screen, outputs
        full = self.compiled(inputs)
        return full, (*full.run(*inputs), True)

    def paths(self) -> list[str]:
        return [_arg_path(self.fun, path) for path in self.flat.paths]


def _measuring(closed, sites, materialize: bool | None = None, shadow: bool = True) -> Callable:
    """``f(*inputs) -> (floats, ints, finite)``: the statistics and which inputs are finite;
    ``materialize`` (default: ``_compiled.materializes_values``): each measured value
    in a buffer of its own; ``shadow=False``: the screening pass (no float32 twins)."""
    if materialize is None:
        materialize = materializes_values(jax.default_backend())
    measure = instrumented(closed, sites, materialize, shadow)
    return lambda *a: (*measure(*a), jnp.stack([all_finite_flag(x) for x in a]))


def _screening(closed, sites, materialize: bool | None = None) -> Callable:
    """``f(*inputs) -> (floats, ints, finite, found)``: the screening pass (the program
    and its own statistics, no float32 shadow nor twin) and whether it found an inf/NaN
    in an op or an input (``found``: the full report is needed)."""
    screen = _measuring(closed, sites, materialize, shadow=False)

    def run(*inputs):
        floats, ints, finite = screen(*inputs)
        return floats, ints, finite, any_nonfinite(ints) | ~jnp.all(finite)

    return run


def _screened(closed, sites, materialize: bool | None = None) -> Callable:
    """``_screening``, then, under a ``lax.cond`` and only when it found an inf/NaN,
    the full instrumented program on the same inputs, whose statistics replace the
    screen's (the in-step form: one traced program, no host sync)."""
    screen = _screening(closed, sites, materialize)
    full = _measuring(closed, sites, materialize)

    def run(*inputs):
        *table, found = screen(*inputs)
        return jax.lax.cond(
            found,
            lambda args, _: (*full(*args), jnp.bool_(True)),
            lambda _, table: (*table, jnp.bool_(False)),
            inputs,
            tuple(table),
        )

    return run


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


def _gradient_program(call: Callable, args: tuple, dynamic: list, has_aux: bool):
    """``(program, out_phases)``: ``program(*dynamic, seed)`` returns the loss (and aux)
    and the gradient wrt the first argument; ``out_phases()``, once ``program`` was
    traced, names each output's phase. ``fun`` is traced once, by the caller's
    ``make_jaxpr`` (its output is checked there)."""
    n_first = sum(map(is_array, jax.tree.leaves(args[:1])))
    wrt = [i for i in range(n_first) if is_floating(dynamic[i])]
    if not args or not wrt:
        got = _describe(args[0]) if args else "no arguments"
        raise TypeError(
            "numerics_report(grad=True) differentiates with respect to the floating "
            f"arrays of the first argument, and it has none (got {got}). Pass the "
            "parameters (a pytree of floating arrays) first."
        )
    n_aux: list[int] = []

    def program(*inputs):
        *dyn, seed = inputs

        def of_wrt(diff):
            full = list(dyn)
            for i, value in zip(wrt, diff, strict=True):
                full[i] = value
            out = call(*full)
            _check_loss(out, has_aux)
            n_aux.append(len(jax.tree.leaves(out[1])) if has_aux else 0)
            return out

        loss, backward, *aux = jax.vjp(of_wrt, [dyn[i] for i in wrt], has_aux=has_aux)
        # The seed is a float32 argument rounded to the loss dtype here: the rounding is
        # a measured op, so a float16 loss's seed counts for the loss scale, and its
        # float32 twin is the true scale even where the float16 seed overflows.
        return loss, aux, backward(seed.astype(loss.dtype))

    def out_phases() -> list[str]:
        return ["forward"] + ["state"] * n_aux[-1] + ["backward"] * len(wrt)

    return program, out_phases


def _check_loss(out: Any, has_aux: bool) -> None:
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


def _describe(tree: Any) -> str:
    def one(x):
        if hasattr(x, "dtype") and hasattr(x, "shape"):
            return f"{np.dtype(x.dtype).name}{list(x.shape)}"
        return type(x).__name__

    leaves = jax.tree.leaves(tree)
    return str(jax.tree.map(one, tree)) if len(leaves) != 1 else one(leaves[0])
