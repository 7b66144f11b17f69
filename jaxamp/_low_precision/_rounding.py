"""Stochastic rounding of float32 values to bfloat16 or float16.

Rounding to nearest is biased for a sum of many small terms: an update below half
a 16-bit ulp of its weight is dropped every time, so the weight never moves.
Stochastic rounding picks one of the two neighbouring 16-bit values with
probability proportional to the distance to the other, so its expectation is the
float32 value and small updates survive on average (Zamirai et al., "Revisiting
BFloat16 Training", arXiv 2010.06192).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxamp._casting import canonical_float_dtype

__all__ = [
    "SIXTEEN_BIT_DTYPES",
    "check_sixteen_bit",
    "counter_bits",
    "mix32",
    "round_with_bits",
    "stochastic_round",
]

SIXTEEN_BIT_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))


def check_sixteen_bit(dtype: Any, argument: str) -> np.dtype:
    """``dtype`` as bfloat16 or float16, or a ValueError naming ``argument``."""
    result = canonical_float_dtype(dtype, argument)
    if result not in SIXTEEN_BIT_DTYPES:
        raise ValueError(
            f"{argument} must be a 16-bit floating dtype, jnp.bfloat16 or jnp.float16; "
            f"got {result.name}. Use jnp.bfloat16 (or jnp.float16) to store 16-bit values."
        )
    return result


def mix32(x: Any) -> Any:
    """A bijection of uint32 with full avalanche: Wellons' "lowbias32" integer hash.

    Every output bit flips with probability close to 1/2 when any input bit
    flips, so consecutive counters give bits that pass as independent uniform
    draws for stochastic rounding (tests/unit/test_low_precision.py checks the
    rounding statistics).
    """
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(0x7FEB352D)
    x = x ^ (x >> np.uint32(15))
    x = x * np.uint32(0x846CA68B)
    return x ^ (x >> np.uint32(16))


def counter_bits(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Uniform uint32 bits for an array of ``shape``: ``mix32(element index ^ key)``.

    Counter-based: element ``i`` of every call with the same ``key`` gets the same
    bits, on any device and under any sharding, and the work is a few integer
    operations per element that fuse into the elementwise update that uses them
    (with threefry, ``jax.random.bits``, the step was several times slower:
    BENCHMARKS.md, "low_precision"). Indices wrap at 2**32 elements per array.

    Args:
      key: a uint32 scalar, already mixed from the seed, step and array.
      shape: the shape of the bits.
    """
    size = int(np.prod(shape, dtype=np.int64))
    index = jax.lax.iota(jnp.uint32, size).reshape(shape)
    return mix32(index ^ key)


def _as_float32(x: Any) -> jax.Array:
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype.itemsize > 4:
        raise TypeError(
            "x must be a float32 array (or a 16-bit float array, widened exactly); "
            f"got dtype {x.dtype}. Cast it with x.astype(jnp.float32) first."
        )
    return x.astype(jnp.float32)


def _bfloat16_from_bits(x: jax.Array, bits: jax.Array) -> jax.Array:
    # Adding 16 uniform low bits to the float32 pattern carries into bit 16 with
    # probability (low 16 bits) / 2**16, which is the distance to the lower
    # bfloat16 neighbour in ulps; truncation then keeps the upper half. The
    # pattern is sign-magnitude, so this rounds the magnitude, for either sign.
    pattern = jax.lax.bitcast_convert_type(x, jnp.uint32)
    rounded = (pattern + (bits & np.uint32(0xFFFF))) >> np.uint32(16)
    out = jax.lax.bitcast_convert_type(rounded.astype(jnp.uint16), jnp.bfloat16)
    # A NaN's pattern can carry into the sign bit; +-inf never changes.
    return jnp.where(jnp.isnan(x), jnp.asarray(jnp.nan, jnp.bfloat16), out)


def _float16_from_bits(x: jax.Array, bits: jax.Array) -> jax.Array:
    # Between the two neighbouring float16 magnitudes lo < |x| < hi, round up with
    # probability (|x| - lo) / (hi - lo). Both differences are exact in float32
    # (Sterbenz, or a power-of-two ulp), and the probability has at most 23
    # significant bits, so a 24-bit uniform draw makes it exactly unbiased,
    # subnormals included.
    magnitude = jnp.abs(x)
    nearest = magnitude.astype(jnp.float16)
    pattern = jax.lax.bitcast_convert_type(nearest, jnp.uint16)
    above = nearest.astype(jnp.float32) > magnitude
    lo_pattern = jnp.where(above, pattern - np.uint16(1), pattern)
    lo = jax.lax.bitcast_convert_type(lo_pattern, jnp.float16)
    hi = jax.lax.bitcast_convert_type(lo_pattern + np.uint16(1), jnp.float16)
    lo32 = lo.astype(jnp.float32)
    up_probability = (magnitude - lo32) / (hi.astype(jnp.float32) - lo32)
    uniform = (bits >> np.uint32(8)).astype(jnp.float32) * np.float32(2.0**-24)
    rounded = jnp.where(uniform < up_probability, hi, lo)
    rounded = jnp.where(jnp.signbit(x), -rounded, rounded)
    # Beyond the float16 range (and for inf and NaN) the result is the cast's:
    # inf where round-to-nearest overflows, 65504 just above it.
    cast = x.astype(jnp.float16)
    outside = ~jnp.isfinite(cast) | (magnitude > np.float32(np.finfo(np.float16).max))
    return jnp.where(outside, cast, rounded)


def round_with_bits(x: jax.Array, dtype: np.dtype, bits: jax.Array) -> jax.Array:
    """Stochastic rounding of float32 ``x`` with given uniform uint32 ``bits``."""
    if dtype == np.dtype(jnp.bfloat16):
        return _bfloat16_from_bits(x, bits)
    return _float16_from_bits(x, bits)


def stochastic_round(x: Any, dtype: Any, key: jax.Array) -> jax.Array:
    """Rounds ``x`` to ``dtype`` up or down at random, unbiased: ``E[result] = x``.

    Each element becomes one of its two neighbouring ``dtype`` values, the upper
    one with probability (distance to the lower) / (distance between them).
    Values ``dtype`` represents exactly, signed zeros and +-inf stay the same;
    NaN stays NaN. Out of range: for float16, where ``x.astype(jnp.float16)``
    overflows to inf (``|x| >= 65520``) the result is inf, and for
    ``65504 < |x| < 65520`` it is 65504, both exactly like the cast. bfloat16
    shares float32's exponent range: the float32 values above the largest
    finite bfloat16 round up to inf with probability proportional to their
    distance from it (as if 2**128 were the next value).

    Pure, jittable and vmappable; the same ``key`` gives the same result.

    Args:
      x: a float32 array (16-bit float arrays are widened exactly first).
      dtype: ``jnp.bfloat16`` or ``jnp.float16`` (or ``"bf16"``, ``"f16"``).
      key: a JAX PRNG key (``jax.random.key(0)`` or a raw ``PRNGKey``).

    Returns:
      An array of ``x``'s shape in ``dtype``.

    Raises:
      ValueError: ``dtype`` is not a 16-bit floating dtype.
      TypeError: ``x`` is not a floating array of at most 32 bits.

    >>> import jax, jax.numpy as jnp, jaxamp
    >>> x = jnp.full(10_000, 1.0 + 2.0**-9)  # a quarter of the way to the next bfloat16
    >>> y = jaxamp.stochastic_round(x, jnp.bfloat16, jax.random.key(0))
    >>> sorted(set(y.astype(jnp.float32).tolist()))
    [1.0, 1.0078125]
    >>> round(float(y.astype(jnp.float32).mean() - 1.0) * 2**9, 1)
    1.0
    """
    dtype = check_sixteen_bit(dtype, "dtype")
    x = _as_float32(x)
    bits = jax.random.bits(key, x.shape, jnp.uint32)
    return round_with_bits(x, dtype, bits)
