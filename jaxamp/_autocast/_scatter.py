"""autocast's rules for the scatter family (``x.at[i].add``, ``segment_sum``, ...).

A scatter holds a typed combiner jaxpr (``add`` for scatter-add on scalars of the
traced dtype), so it cannot be re-bound with operands of another dtype. Its
operand and updates follow like any elementwise operation; then the public
``lax.scatter*`` function builds the scatter again, combiner included, for the
dtype they now have. A ``scatter`` that applies a function to the operand at the
indices (``lax.scatter_apply``, ``x.at[i].apply(f)``) is rebuilt by
``lax.scatter_apply``, its function evaluated under autocast in the operand's
dtype (as ``f`` on a 16-bit array would run).

A float32 buffer that 16-bit updates are combined into (``jnp.zeros(n,
jnp.float32).at[ids].add(act)``, ``segment_sum``, a scatter-max of scores) is
an accumulator, like a float32 loop carry (``_wide``): the hand-cast program
keeps the buffer's dtype (``.at[]`` casts the updates to it), so the updates
are widened to float32 and the result is PINNED. Summing many repeated indices
in 16 bits loses most of the precision (bfloat16: 0.17 relative error where the
float32 buffer has 0.0007).
"""

from __future__ import annotations

import jax
import numpy as np

from jaxamp._autocast._values import ACTIVATION, PINNED, PLAIN, cast
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


# Scatters that combine the updates with the buffer's values (not ``scatter``,
# which overwrites them).
_COMBINING = frozenset(_SCATTERS) - {"scatter"}


def _into_float32_buffer(ac, eqn, ins) -> bool:
    """Whether 16-bit updates are combined into a wider buffer as traced (an accumulator)."""
    (operand, operand_role), _, (_, updates_role) = ins
    return (
        eqn.primitive.name in _COMBINING
        and is_floating(operand)
        and operand_role == PLAIN
        and updates_role == ACTIVATION
        and np.dtype(eqn.invars[0].aval.dtype).itemsize > ac.compute_dtype.itemsize
    )


def _scatter_operands(ac, eqn, ins) -> tuple[list, int]:
    """(operand, indices, updates) in the dtypes the scatter runs in, and its role."""
    if not _into_float32_buffer(ac, eqn, ins):
        return ac.follow_values(eqn, ins)
    (operand, _), (indices, _), (updates, _) = ins
    operand = cast(operand, np.dtype(eqn.invars[0].aval.dtype))
    return [operand, indices, cast(updates, operand.dtype)], PINNED


def _handle_scatter(ac, eqn, ins):
    (operand, indices, updates), role = _scatter_operands(ac, eqn, ins)
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
