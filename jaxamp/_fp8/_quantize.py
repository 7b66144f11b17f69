"""Current scaling: per-group amax, scale, saturating cast to float8, and the scaled product.

Every operand reaches here in a canonical layout ``[B, P, C]``: batch, free
(rows) and contracting dims, each merged into one. A recipe's groups are then
``(whole batch?, rows per group, contracting values per group)``; the
quantized operand is ``[B, P, KB, kb]`` (``KB`` blocks of ``kb`` along ``C``)
and its inverse scales ``[B, P, KB]`` broadcast over the block.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxamp._casting import F32
from jaxamp._fp8._scalings import KINDS, QUANTIZE_SCOPE, Groups, scaling_named

__all__ = ["Groups", "groups_for", "quantize", "scale_from_amax", "scaled_product"]

# Scales are kept within [2**-126, 2**126] so that a scale and its inverse are
# normal float32 numbers (XLA:CPU flushes float32 subnormals to zero).
_MAX_EXP = 126


def groups_for(scaling: str, kind: str) -> Groups:
    """The scaling groups of an operand of ``kind`` ("act", "weight" or "grad").

    Raises:
      ValueError: a scaling that is not in ``_scalings.SCALINGS``, or another kind.
    """
    if kind not in KINDS:
        raise ValueError(f"operand kind must be one of {KINDS}; got {kind!r}.")
    return scaling_named(scaling).groups[kind]


def fp8_max(dtype: np.dtype) -> float:
    return float(ml_dtypes.finfo(dtype).max)


def scale_from_amax(amax: jax.Array, dtype: np.dtype, power_of_two: bool) -> jax.Array:
    """``s = fp8_max / amax`` (1 where amax is 0, NaN where it is not finite).

    With ``power_of_two`` the scale is rounded down to a power of two exactly,
    from the binary exponents (``frexp``/``ldexp``): ``2**floor(log2(max / amax))``,
    the E8M0 scale of the MX formats that never saturates.
    """
    amax = amax.astype(F32)
    top = fp8_max(dtype)
    if power_of_two:
        mantissa, exponent = jnp.frexp(amax)
        top_mantissa, top_exponent = np.frexp(np.float32(top))
        exp = top_exponent - exponent - (mantissa > top_mantissa).astype(exponent.dtype)
        exp = jnp.clip(exp, -_MAX_EXP, _MAX_EXP)
        scale = jnp.ldexp(jnp.ones_like(amax), exp)
    else:
        quotient = np.float32(top) / amax  # inf for an all-zero group, replaced below
        scale = jnp.clip(quotient, 2.0**-_MAX_EXP, 2.0**_MAX_EXP)
    scale = jnp.where(amax == 0, np.float32(1), scale)
    # An inf or NaN in the group makes its scale NaN, so the product is NaN too
    # (a finite scale would saturate an inf into a finite, silently wrong value).
    return jnp.where(jnp.isfinite(amax), scale, np.float32(np.nan))


def saturating_cast(x: jax.Array, dtype: np.dtype) -> jax.Array:
    """Clips to ``+-fp8_max`` and casts (a plain cast makes overflow NaN in e4m3fn)."""
    top = np.float32(fp8_max(dtype))
    return jnp.clip(x, -top, top).astype(dtype)


def _pad_to(x: jax.Array, axis: int, multiple: int) -> jax.Array:
    extra = -x.shape[axis] % multiple
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)


def quantize(
    x: jax.Array, dtype: np.dtype, groups: Groups, power_of_two: bool, amax: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """``x`` ``[B, P, C]`` -> (float8 ``[B, P, KB, kb]``, inverse scales ``[B, P, KB]``).

    A dim that does not divide into its groups is zero-padded for the amax (a
    partial group is scaled by the amax of the values it has); ``C`` stays
    padded (zeros add nothing to the product), ``P`` is sliced back. A ``C``
    shorter than a block is one block, unpadded. ``amax``: the amax of the
    whole operand, computed beforehand (tensorwise groups only; the fused
    weight amaxes of ``_scales``).

    It runs in ``QUANTIZE_SCOPE``: ``numerics_report`` measures a quantization
    as one op, by its float8 output.
    """
    with jax.named_scope(QUANTIZE_SCOPE):
        return _quantize(x, dtype, groups, power_of_two, amax)


def _quantize(x, dtype, groups, power_of_two, amax):
    x = x.astype(F32)
    b, p, c = x.shape
    block = min(groups.block or c, c)
    x = _pad_to(x, 2, block)
    nblocks = x.shape[2] // block
    rows = groups.rows or p
    tiles = _pad_to(x, 1, rows).reshape(b, -1, rows, nblocks, block)
    axes = (0, 2, 4) if groups.whole_batch else (2, 4)
    if amax is None:
        amax = jnp.max(jnp.abs(tiles), axis=axes, keepdims=True)
    scale = scale_from_amax(amax, dtype, power_of_two)
    q = saturating_cast(tiles * scale, dtype).reshape(b, -1, nblocks, block)[:, :p]
    inverse = jnp.broadcast_to(1 / scale, (b, tiles.shape[1], rows, nblocks, 1))
    return q, inverse.reshape(b, -1, nblocks)[:, :p]


def scaled_product(
    a: tuple[jax.Array, jax.Array],
    b: tuple[jax.Array, jax.Array],
    out_dtype: np.dtype,
    accumulate: np.dtype = F32,
) -> jax.Array:
    """``[B, P, C] x [B, Q, C] -> [B, P, Q]`` from two quantized operands.

    Float8 operands, float32 accumulation (``preferred_element_type``), then the
    inverse scales per group; with blocks along C the partial products of each
    block are scaled and summed in float32 (DeepSeek-V3's promotion per block).
    ``accumulate``: the dtype of the float8 product's result (of the scaled
    blocks' sum with blocks along C), in which the SPMD partitioner reduces it
    across devices when C is sharded (a weight gradient's ``reduce_dtype``).
    """
    (qa, inv_a), (qb, inv_b) = a, b
    nblocks = qa.shape[2]
    if nblocks == 1:
        dims = (((2,), (2,)), ((0,), (0,)))
        out = jax.lax.dot_general(qa[:, :, 0], qb[:, :, 0], dims, preferred_element_type=accumulate)
        out = out.astype(F32) * inv_a * jnp.swapaxes(inv_b, 1, 2)
    else:
        partial = jax.lax.dot_general(
            qa, qb, (((3,), (3,)), ((0, 2), (0, 2))), preferred_element_type=F32
        )  # [B, KB, P, Q]
        a_scale = jnp.transpose(inv_a, (0, 2, 1))[..., None]
        b_scale = jnp.transpose(inv_b, (0, 2, 1))[:, :, None, :]
        out = jnp.sum((partial * a_scale * b_scale).astype(accumulate), axis=1)
    return out.astype(out_dtype)
