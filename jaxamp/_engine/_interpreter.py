"""The one jaxpr evaluation loop of jaxamp.

``eval_jaxpr`` re-runs a closed jaxpr equation by equation under the caller's
trace, handing each equation to an ``apply`` callback: a tool's dispatch into
its rule table (autocast's rules, the numerics report's instruments) or a plain
function (the float32-accumulating backward pass of a matmul). Sub-jaxprs are
entered by the rules themselves, through ``_visit``.

Values in the environment are whatever the caller uses (plain arrays, or
``(value, role)`` pairs for autocast): ``lift`` turns a constant or a literal
into one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax.extend.core as jex
import numpy as np

from jaxamp._engine import _compat as compat

__all__ = ["Apply", "eval_jaxpr"]

Apply = Callable[[jex.JaxprEqn, list[Any]], Sequence[Any]]


def _identity(x: Any) -> Any:
    return x


def eval_jaxpr(
    closed: jex.ClosedJaxpr,
    args: Sequence[Any],
    apply: Apply,
    lift: Callable[[Any], Any] = _identity,
) -> list[Any]:
    """Evaluates ``closed`` on ``args``; ``apply(eqn, inputs)`` runs each equation.

    Each equation runs under its own source location and name stack, so the
    equations it binds (and XLA metadata, profiles, error messages) name the
    user's line rather than jaxamp's. Literals and closed-over constants enter
    the environment through ``lift`` (literals as NumPy arrays of their traced
    dtype, so they stay constants).
    """
    env: dict[jex.Var, Any] = {}

    def read(atom: Any) -> Any:
        if isinstance(atom, jex.Literal):
            return lift(np.asarray(compat.literal_value(atom), atom.aval.dtype))
        return env[atom]

    jaxpr = closed.jaxpr
    for var, const in zip(jaxpr.constvars, closed.consts, strict=True):
        env[var] = lift(const)
    for var, arg in zip(jaxpr.invars, args, strict=True):
        env[var] = arg
    for eqn in jaxpr.eqns:
        with compat.equation_context(eqn):
            outs = apply(eqn, [read(atom) for atom in eqn.invars])
        for var, out in zip(eqn.outvars, outs, strict=True):
            if not isinstance(var, jex.DropVar):
                env[var] = out
    return [read(atom) for atom in jaxpr.outvars]
