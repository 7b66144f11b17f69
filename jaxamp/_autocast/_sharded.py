"""autocast's rules for parameters that cross devices' wire.

A parameter shard all-gathered inside ``shard_map`` is gathered in the policy's
``gather_dtype``; an embedding table read by a ``gather`` is cast before the
lookup (so a sharded table is gathered in 16 bits); and the gradients of both,
and of parameters broadcast against activations (biases, position tables), are
summed in ``reduce_dtype`` (``jaxamp/_wire.py`` holds the differentiable pieces).
Called from the ``follow`` rule and ``Autocaster.follow_values`` in ``_caster.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax.extend.core as jex
import numpy as np

from jaxamp._autocast._values import ACTIVATION, PLAIN, saturate_finite
from jaxamp._casting import is_floating
from jaxamp._engine import _compat as compat
from jaxamp._wire import all_gather_cast, narrowed_linear, vary_before_cast

if TYPE_CHECKING:
    from jaxamp._autocast._caster import Autocaster

__all__ = ["gathered_parameter", "gathers_a_parameter", "narrow_lookup", "wide_gradient_of"]


def gathers_a_parameter(ac: Autocaster, eqn: jex.JaxprEqn, ins: list[tuple]) -> bool:
    # An ``all_gather`` of a float parameter shard (FSDP inside shard_map).
    if eqn.primitive.name != "all_gather" or eqn.params.get("axis_index_groups"):
        return False
    (shard, role), *_ = ins
    narrower = is_floating(shard) and ac.compute_dtype.itemsize < np.dtype(shard.dtype).itemsize
    return role == PLAIN and narrower


def gathered_parameter(ac: Autocaster, eqn: jex.JaxprEqn, shard: Any) -> Any:
    """The all-gather in ``gather_dtype``, its gradient reduce-scattered in ``reduce_dtype``."""
    p = eqn.params
    return all_gather_cast(shard, ac.policy, p["axis_name"], p["all_gather_dimension"], p["tiled"])


def narrow_lookup(ac: Autocaster, eqn: jex.JaxprEqn, ins: list[tuple]) -> list | None:
    """A ``gather`` from a traced float table (an embedding), read in the compute dtype.

    The rows it picks would meet the activations, and be cast, anyway; cast
    first, a table sharded across devices is all-gathered in 16 bits, like the
    weights the matmuls cast, and what follows (a position embedding added,
    the residual stream) runs in the compute dtype from the start. Its
    gradient is scatter-added in ``reduce_dtype`` (``_wire.narrowed_linear``).
    """
    if eqn.primitive.name != "gather":
        return None
    (table, role), *rest = ins
    narrower = is_floating(table) and ac.compute_dtype.itemsize < np.dtype(table.dtype).itemsize
    if role != PLAIN or not narrower or np.ndim(table) < 2 or isinstance(table, np.ndarray):
        return None
    indices = [v for v, _ in rest]
    table = vary_before_cast(table, ac.policy.reduce_dtype, *indices)
    out = wide_gradient_of(ac, table, lambda t, *idx: compat.bind_eqn(eqn, [t, *idx])[0], indices)
    return [(out, ACTIVATION)]


def wide_gradient_of(
    ac: Autocaster, x: Any, fn: Callable, rest: list, dtype: np.dtype | None = None
) -> Any:
    # fn(x in ``dtype`` (the compute dtype), *rest), linear in x; its gradient for x
    # in x's dtype unless reduce_dtype is narrower.
    dtype = ac.compute_dtype if dtype is None else dtype
    if ac.transposable or np.dtype(ac.policy.reduce_dtype).itemsize < x.dtype.itemsize:
        return fn(saturate_finite(x, dtype), *rest)
    return narrowed_linear(fn, x, dtype, *rest)
