"""Products of a weight quantized in square tiles (blockwise's 128x128), both ways from one array.

A weight ``[B, Q, C]`` quantized in ``t x t`` tiles has one scale per tile, so
the same float8 codes serve the forward product (contracting C) and the input
gradient's (contracting Q): the tiles of the transposed weight are the
transposed tiles. Both products here contract one array, the codes laid out as
``[B, KQ, t, KC, kc]`` (tile rows, then blocks along C), so that under SPMD
partitioning the weight is all-gathered once per step, for both products (the
partitioner reuses a value it already gathered; any op between the saved codes
and the second product, a transpose or a reshape, would be gathered again).

The results equal :func:`jaxamp._fp8._quantize.scaled_product`'s on the
operands ``quantize`` gives (the same codes, the same float32 scaling and sum
over the blocks), so nothing changes but the layout.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxamp._casting import F32

__all__ = ["input_gradient", "product", "tiled"]

# (codes [B, KQ, t, KC, kc], inverse scales [B, KQ, KC]): a weight in tiles.
Tiled = tuple[jax.Array, jax.Array]


def tiled(quantized: tuple[jax.Array, jax.Array], rows: int) -> Tiled:
    """The ``quantize`` result of a weight in ``rows x kc`` tiles (``[B, Q, KC, kc]``,
    ``[B, Q, KC]``), laid out by tile rows (Q zero-padded to whole tiles; a Q
    shorter than a tile is one tile of Q rows, unpadded, so that no padding is
    gathered)."""
    q, inverse = quantized
    b, n, kc_blocks, kc = q.shape
    # No pad op where Q is whole tiles (FP4 pads its operands beforehand): the
    # report would count the pad value's cast to float4 as a quantization.
    codes = jnp.pad(q, ((0, 0), (0, -n % rows), (0, 0), (0, 0))) if n % rows else q
    codes = codes.reshape(b, -1, rows, kc_blocks, kc)
    return codes, inverse[:, ::rows]


def _sum_blocks(partial: jax.Array, first, second, accumulate: np.dtype) -> jax.Array:
    # As scaled_product: each block's float32 product scaled (by the left operand's
    # inverse scale, then the right one's), cast, and summed over the blocks.
    return jnp.sum((partial * first * second).astype(accumulate), axis=1)


def product(
    qa: tuple[jax.Array, jax.Array], w: Tiled, n: int, out_dtype, accumulate=F32
) -> jax.Array:
    """``a [B, P, C]`` (quantized: ``[B, P, KC, kc]``) times the tiled weight -> ``[B, P, Q]``."""
    (q, inv_a), (codes, inv_w) = qa, w
    dims = (((3,), (4,)), ((0, 2), (0, 3)))
    partial = jax.lax.dot_general(q, codes, dims, preferred_element_type=F32)  # [B, KC, P, KQ, t]
    first = jnp.transpose(inv_a, (0, 2, 1))[:, :, :, None, None]
    second = jnp.transpose(inv_w, (0, 2, 1))[:, :, None, :, None]
    out = _sum_blocks(partial, first, second, accumulate)
    return out.reshape(*out.shape[:2], -1)[:, :, :n].astype(out_dtype)


def input_gradient(
    qg: tuple[jax.Array, jax.Array], w: Tiled, c: int, out_dtype, accumulate=F32
) -> jax.Array:
    """``g [B, P, Q]`` (quantized in blocks of ``t`` along Q, Q zero-padded to whole
    tiles: ``[B, P, KQ, t]``) times the tiled weight along Q -> ``[B, P, C]``."""
    (q, inv_g), (codes, inv_w) = qg, w
    dims = (((3,), (2,)), ((0, 2), (0, 1)))
    partial = jax.lax.dot_general(q, codes, dims, preferred_element_type=F32)  # [B, KQ, P, KC, kc]
    first = jnp.transpose(inv_g, (0, 2, 1))[:, :, :, None, None]
    out = _sum_blocks(partial, first, inv_w[:, :, None, :, None], accumulate)
    return out.reshape(*out.shape[:2], -1)[:, :, :c].astype(out_dtype)
