"""FP4 ``ragged_dot`` (mixture of experts): the dense FP4 recipe (``_fp4``), expert by expert.

``x [M, C]`` (rows in ``G`` consecutive groups of traced sizes) times
``w [G, Q, C]`` runs as ``_fp4``'s three products of each group's rows with its
expert's weights, with the scales the dense recipe takes per tensor taken per
expert group (NVFP4's ``S_enc``: from the group's rows' amax for ``x`` and the
output gradient, from each expert's for ``w``):

- fprop and dgrad: rows quantized in blocks along the contracting dim (its
  codes, scales and stochastic rounding as dense), the expert's weights per
  expert (16x16 NVFP4 tiles, transposed for the dgrad, as dense); the float4
  product is ``_ragged.scaled_rows``' per-block ``ragged_dot_general``.
- wgrad ``[G, Q, C]``: contracting the token dim within each group. The rows of
  the output gradient and of ``x`` are laid out in tiles of one block (16 or
  32) that start at each group's first row, a group's last tile zero-padded (as
  the dense recipe pads its token dim), then the Hadamard transform, the
  quantization (blocks along the tokens) and a batched float4 ``dot_general``
  per tile, scaled and summed into each tile's expert.

The group sizes stay traced (tiles numbered within a static bound,
``_ragged_quantize.Segments``): no host sync, one compile for all splits. With
stochastic rounding the bits hash the whole ragged gradient (``_fp4.rounding_bits``):
statistically those of the dense recipe, not the same bits as per expert. The
products run emulated under every ``gemm`` (JAX has no grouped block-scaled GEMM).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from jaxamp._casting import F32
from jaxamp._fp8._fp4 import Quantized, _product, _transposed_tiles, hadamard, quantize4
from jaxamp._fp8._fp4_facts import quantize_scope
from jaxamp._fp8._fp4_recipe import Float4Recipe
from jaxamp._fp8._ragged import ragged_apply, scaled_rows
from jaxamp._fp8._ragged_quantize import Segments, Tiles, segments
from jaxamp._fp8._scalings import SCALINGS, scope_name

__all__ = ["fp4_ragged_dot"]


def _pad_last(v: jax.Array, n: int, axes: tuple[int, ...]) -> jax.Array:
    widths = [(0, -v.shape[d] % n if d in axes else 0) for d in range(v.ndim)]
    return jnp.pad(v, widths) if any(w for _, w in widths) else v


def _per_group(amax: jax.Array, ids: jax.Array, groups: int) -> jax.Array:
    """Each item's group's amax (``ids``: items' groups, ``groups`` past the last), 5-D."""
    group = jax.ops.segment_max(amax, ids, num_segments=groups + 1)
    return group[ids][:, None, None, None, None]


def _rows(recipe: Float4Recipe, v, seg: Segments, seed: int | None) -> Quantized:
    """``v [M, F]`` (F whole blocks) per row, blocks along F, ``S_enc`` per group."""
    v = jnp.where(seg.valid[:, None], v.astype(F32), 0)
    amax = _per_group(jnp.max(jnp.abs(v), axis=1), seg.ids, seg.sizes.shape[0])
    ceil = recipe.scale_rounding == "ceil"
    return quantize4(v[:, None], recipe.format, 1, ceil=ceil, seed=seed, tensor_amax=amax)


def _experts(recipe: Float4Recipe, w, rows: int) -> Quantized:
    """``w [G, Q, C]`` (whole blocks) per expert: ``S_enc`` from each expert's amax."""
    amax = jnp.max(jnp.abs(w.astype(F32)), axis=(1, 2))[:, None, None, None, None]
    ceil = recipe.scale_rounding == "ceil"
    return quantize4(w, recipe.format, rows, ceil=ceil, tensor_amax=amax)


def _rows_product(qx: Quantized, qw: Quantized, seg: Segments, sizes, out_dtype, fmt: str):
    scope = quantize_scope(fmt)  # moves of the codes: steps of their quantization
    with jax.named_scope(scope):
        x_codes, x_decode = qx.codes[:, 0], qx.decode[:, 0]
    return scaled_rows(x_codes, x_decode, qw.codes, qw.decode, seg, sizes, out_dtype, F32, scope)


def _token_tiles(v, seg: Segments, tiles: Tiles, n: int) -> jax.Array:
    """``v [M, F]`` -> ``[tiles, F, n]``: each group's rows in tiles of ``n`` from its first row."""
    m, f = v.shape
    group = jnp.minimum(seg.ids, seg.sizes.shape[0] - 1)
    within = jnp.arange(m, dtype=jnp.int32) - seg.starts[group]
    # Rows past the last group go out of bounds: dropped.
    slot = jnp.where(seg.valid, tiles.ids * n + within % n, tiles.count * n)
    laid = jnp.zeros((tiles.count * n, f), F32).at[slot].set(v.astype(F32), mode="drop")
    return jnp.swapaxes(laid.reshape(tiles.count, n, f), 1, 2)


def _wgrad(recipe: Float4Recipe, g, x, seg: Segments, seed: int | None) -> jax.Array:
    """``dw [G, Q, C]``: ``g [M, Q]`` and ``x [M, C]`` contracted over each group's rows."""
    n, experts = recipe.block, seg.sizes.shape[0]
    ceil = recipe.scale_rounding == "ceil"
    tiles = seg.tiles(n)
    quantized = []
    for v, s in ((g, seed), (x, None)):
        t = _token_tiles(v, seg, tiles, n)
        if recipe.hadamard:
            t = hadamard(t, n)
        amax = _per_group(jnp.max(jnp.abs(t), axis=(1, 2)), tiles.owner, experts)
        quantized.append(quantize4(t, recipe.format, 1, ceil=ceil, seed=s, tensor_amax=amax))
    partial = _product(quantized[0], quantized[1], F32, None)  # [tiles, Q, C]
    return jax.ops.segment_sum(partial, tiles.owner, num_segments=experts + 1)[:experts]


def _ragged_matmul(recipe: Float4Recipe, weight_tiles: bool, dtypes: tuple) -> Callable:
    """``x [M, C] x w [G, Q, C] -> [M, Q]`` (C, Q whole blocks) with FP4 backward products."""
    n, scope = recipe.block, scope_name(recipe.format, False)
    sr = recipe.seed if recipe.stochastic_rounding else None

    def forward(x, w, sizes):
        with jax.named_scope(scope):
            seg = segments(sizes, x.shape[0])
            qw = _experts(recipe, w, n if weight_tiles else 1)
            qx = _rows(recipe, x, seg, None)
            out = _rows_product(qx, qw, seg, sizes, recipe.compute_dtype, recipe.format)
            return out, (x, qw if weight_tiles else w, sizes)

    @jax.custom_vjp
    def matmul(x, w, sizes):
        return forward(x, w, sizes)[0]

    def bwd(saved, g):
        x, w, sizes = saved
        with jax.named_scope(scope):
            seg = segments(sizes, x.shape[0])
            # dgrad dx[M, C] = g[M, Q] . w[group] over Q.
            qg = _rows(recipe, g, seg, sr)
            if weight_tiles:  # the forward's codes, moved: a step of that quantization
                with jax.named_scope(quantize_scope(recipe.format)):
                    qw_t = _transposed_tiles(w, n)
            else:
                qw_t = _experts(recipe, _swap(w), 1)
            dx = _rows_product(qg, qw_t, seg, sizes, F32, recipe.format)
            dw = _wgrad(recipe, g, x, seg, sr)
        return dx.astype(dtypes[0]), dw.astype(dtypes[1]), None

    matmul.defvjp(forward, bwd)
    return matmul


def _swap(w):
    return jnp.swapaxes(w, 1, 2)


def fp4_ragged_dot(recipe: Float4Recipe, params: Mapping[str, Any], x, w, sizes, *, weight: bool):
    """A ``ragged_dot_general`` in ``_ragged.ragged_form`` under ``recipe``.

    ``weight``: ``w`` is a parameter, input or constant (NVFP4's 16x16 tiles).
    """
    tiled = SCALINGS[recipe.format].groups["weight"].rows != 1
    tiles = weight and recipe.weight_blocks_2d and tiled
    n = recipe.block

    def product(a, b, sizes):
        q = b.shape[1]
        matmul = _ragged_matmul(recipe, tiles, (a.dtype, b.dtype))
        return matmul(_pad_last(a, n, (1,)), _pad_last(b, n, (1, 2)), sizes)[:, :q]

    return ragged_apply(params, x, w, sizes, product)
