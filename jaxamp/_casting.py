"""Dtype helpers: casting the floating-point leaves of a pytree (and nothing else),
dtype names, and widening narrow floats to float32."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxamp._engine._trace import ARRAY_TYPES

__all__ = [
    "F32",
    "canonical_float_dtype",
    "cast_floating",
    "is_floating",
    "is_narrow",
    "widen",
]

# float32: what jaxamp accumulates, widens and keeps precision-sensitive values in.
F32 = np.dtype(np.float32)

# Leaves whose dtype casting may change: arrays (the engine's ARRAY_TYPES, tracers
# included) and the avals of jax.eval_shape.
_CASTABLE_TYPES = (*ARRAY_TYPES, jax.ShapeDtypeStruct)


# Short names accepted wherever a dtype is (jmp's spellings).
DTYPE_ALIASES = {
    "float32": "float32",
    "f32": "float32",
    "full": "float32",
    "single": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "f16": "float16",
    "half": "float16",  # always float16 here, unlike jmp where it depends on the platform
    "float64": "float64",
    "f64": "float64",
}


def canonical_float_dtype(dtype: Any, argument: str) -> np.dtype:
    """Returns ``dtype`` as a floating ``np.dtype`` or raises naming ``argument``."""
    if isinstance(dtype, str):
        dtype = DTYPE_ALIASES.get(dtype.strip().lower(), dtype)
    if dtype is None:  # jnp.dtype(None) is float64: never what a caller meant
        raise TypeError(
            f"{argument} must be a floating-point dtype such as jnp.float32, "
            "jnp.bfloat16 or jnp.float16; got None."
        )
    try:
        result = jnp.dtype(dtype)
    except TypeError as error:
        raise TypeError(
            f"{argument} must be a floating-point dtype such as jnp.float32, "
            f"jnp.bfloat16 or jnp.float16; got {dtype!r} ({error})."
        ) from None
    if not jnp.issubdtype(result, jnp.floating):
        raise TypeError(
            f"{argument} must be a floating-point dtype such as jnp.float32, "
            f"jnp.bfloat16 or jnp.float16; got {result.name}. Integer, bool and "
            "complex values are never cast by jaxamp, so they cannot be a target."
        )
    return result


def is_floating(x: Any) -> bool:
    """Whether ``x`` has a real floating dtype (arrays, NumPy scalars, avals)."""
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.floating)


def is_narrow(x: Any) -> bool:
    """Whether ``x`` (a value, an aval or a dtype) is a float narrower than 32 bits.

    >>> import jax.numpy as jnp
    >>> is_narrow(jnp.ones(2, jnp.bfloat16)), is_narrow(jnp.float16), is_narrow(None)
    (True, True, False)
    """
    try:
        dtype = np.dtype(getattr(x, "dtype", x))
    except (TypeError, ValueError):
        return False
    return jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4


def widen(x: Any) -> Any:
    """``x`` in float32 when it is a float narrower than 32 bits, else unchanged.

    Loss scaling multiplies, sums and all-reduces 16-bit gradients in float32, so
    that neither a scale above float16's maximum nor a sum of micro-batches
    overflows or loses the small values the scale protected; the numerics report
    computes its float32 shadow from it; the low-precision optimizer runs its
    inner optimizer on it.
    """
    return x.astype(jnp.float32) if is_narrow(x) else x


def _check_x64(dtype: np.dtype) -> None:
    # Without x64, jnp silently turns a float64 request into float32; say so instead.
    if dtype.itemsize == 8 and not jax.config.jax_enable_x64:
        raise ValueError(
            f"cannot cast JAX arrays to {dtype.name}: 64-bit types are disabled. "
            "Enable them first with jax.config.update('jax_enable_x64', True), "
            "or use float32."
        )


def _cast_leaf(x: Any, dtype: np.dtype) -> Any:
    if not isinstance(x, _CASTABLE_TYPES):
        return x  # Python scalars, strings and other non-array leaves.
    if not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype == dtype:
        return x
    if isinstance(x, jax.ShapeDtypeStruct):
        return x.update(dtype=dtype)
    if isinstance(x, jax.Array):
        _check_x64(dtype)
    return x.astype(dtype)


def cast_floating(tree: Any, dtype: Any) -> Any:
    """Casts every floating-point array leaf of ``tree`` to ``dtype``.

    Integer, bool, complex and PRNG-key arrays, non-array leaves (Python scalars,
    strings) and ``None`` come back unchanged, and so does the tree structure.
    NumPy arrays stay NumPy arrays and JAX arrays stay JAX arrays.

    Args:
      tree: any pytree.
      dtype: a floating-point dtype (``jnp.bfloat16``, ``"float16"``, ...).

    Returns:
      A pytree of the same structure.

    Raises:
      TypeError: ``dtype`` is not a floating-point dtype.

    >>> import jax.numpy as jnp, jaxamp
    >>> out = jaxamp.cast_floating({"w": jnp.ones(2), "step": jnp.int32(3)}, jnp.bfloat16)
    >>> out["w"].dtype, out["step"].dtype
    (dtype(bfloat16), dtype('int32'))
    """
    dtype = canonical_float_dtype(dtype, "dtype")
    return jax.tree.map(lambda x: _cast_leaf(x, dtype), tree)
