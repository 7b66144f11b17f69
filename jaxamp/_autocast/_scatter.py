"""autocast's rules for the scatter family (``x.at[i].add``, ``segment_sum``, ...).

A scatter holds a typed combiner jaxpr (``add`` for scatter-add on scalars of the
traced dtype), so it cannot be re-bound with operands of another dtype. Its
operand and updates follow like any elementwise operation; then the public
``lax.scatter*`` function builds the scatter again, combiner included, for the
dtype they now have. A ``scatter`` that applies a function to the operand at the
indices (``lax.scatter_apply``, ``x.at[i].apply(f)``) is rebuilt by
``lax.scatter_apply``, its function evaluated under autocast in the operand's
dtype (as ``f`` on a 16-bit array would run).
"""

from __future__ import annotations

import jax

from jaxamp._autocast._values import PLAIN, cast
from jaxamp._casting import is_floating
from jaxamp._engine import _compat as compat

__all__ = ["SCATTER_RULES"]

_SCATTERS = {
    "scatter": jax.lax.scatter,
    "scatter-add": jax.lax.scatter_add,
    "scatter-sub": jax.lax.scatter_sub,
    "scatter-mul": jax.lax.scatter_mul,
    "scatter-min": jax.lax.scatter_min,
    "scatter-max": jax.lax.scatter_max,
}


def _handle_scatter(ac, eqn, ins):
    (operand, indices, updates), role = ac.follow_values(eqn, ins)
    parts = compat.scatter_parts(eqn)
    if parts.apply is not None:
        return [(_scatter_apply(ac, parts, operand, indices, updates.shape, role), role)]
    out = _SCATTERS[eqn.primitive.name](
        operand,
        indices,
        updates,
        parts.dimension_numbers,
        indices_are_sorted=parts.indices_are_sorted,
        unique_indices=parts.unique_indices,
        mode=parts.mode,
    )
    return [(out, role if is_floating(out) else PLAIN)]


def _scatter_apply(ac, parts, operand, indices, update_shape, role):
    def func(element):
        zero = jax.numpy.zeros_like(element)
        ((out, _),) = ac.eval_jaxpr(parts.apply, [(element, role), (zero, PLAIN)])
        return cast(out, element.dtype)

    return jax.lax.scatter_apply(
        operand,
        indices,
        func,
        parts.dimension_numbers,
        update_shape=update_shape,
        indices_are_sorted=parts.indices_are_sorted,
        unique_indices=parts.unique_indices,
        mode=parts.mode,
    )


SCATTER_RULES = dict.fromkeys(_SCATTERS, _handle_scatter)
