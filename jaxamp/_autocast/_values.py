"""autocast's bookkeeping: the role each value plays, and dtype helpers.

- ``PLAIN``: as traced (inputs, parameters, constants, and what only they feed);
- ``ACTIVATION``: moved to the compute dtype by a matmul rule, or computed from one;
- ``PINNED``: float32 on purpose (a float32-rule result, an explicit cast).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "ACTIVATION",
    "PINNED",
    "PLAIN",
    "aval",
    "cast",
    "promote",
    "saturate_finite",
]

PLAIN, ACTIVATION, PINNED = 0, 1, 2


def cast(x: Any, dtype: np.dtype) -> Any:
    if x.dtype == dtype:
        return x
    if isinstance(x, (np.ndarray, np.generic)):
        return np.asarray(x).astype(dtype)  # literals stay literals
    return jax.lax.convert_element_type(x, dtype)


def saturate_finite(x: Any, dtype: np.dtype) -> Any:
    """``cast``, except that finite values beyond ``dtype``'s range become its max.

    For parameters and constants that follow an activation into the compute
    dtype: a finite fill value such as ``jnp.finfo(jnp.float32).min`` (attention
    masks) must stay finite, or a fully masked row computes -inf - (-inf) = NaN.
    Infinities and NaN are kept as they are.
    """
    top = jnp.finfo(dtype).max
    if x.dtype == dtype or jnp.finfo(x.dtype).max <= top:
        return cast(x, dtype)
    if isinstance(x, (np.ndarray, np.generic)):
        x = np.asarray(x)
        return np.where(np.isfinite(x), np.clip(x, -top, top), x).astype(dtype)
    return _saturate(x, np.dtype(dtype))


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _saturate(x: jax.Array, dtype: np.dtype) -> jax.Array:
    top = jnp.finfo(dtype).max
    clipped = jax.lax.clamp(np.asarray(-top, x.dtype), x, np.asarray(top, x.dtype))
    # Chosen in x's dtype, then cast once: nothing is computed in ``dtype`` and then
    # discarded (a cast of x itself would overflow where it is finite and clipped).
    return cast(jax.lax.select(jax.lax.is_finite(x), clipped, x), dtype)


@_saturate.defjvp
def _saturate_jvp(dtype: np.dtype, primals: tuple, tangents: tuple) -> tuple:
    # The cast's derivative (straight through): the clamp is a guard against
    # overflow, not a function to differentiate, and a tangent that needs no
    # masks leaves nothing for the backward pass to save (a clamp's derivative
    # would keep a float32 copy and two masks per operand).
    (x,), (t,) = primals, tangents
    return _saturate(x, dtype), cast(t, dtype)


def promote(dtypes: Sequence[Any]) -> np.dtype:
    # Our own choice, independent of jax_numpy_dtype_promotion (which may be strict).
    with jax.numpy_dtype_promotion("standard"):
        return np.dtype(functools.reduce(jnp.promote_types, dtypes))


def aval(value: Any, dtype: Any = None) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(np.shape(value), dtype or value.dtype)
