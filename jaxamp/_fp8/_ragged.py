"""Low-precision ``ragged_dot`` (mixture of experts): the dense recipe, expert by expert.

``ragged_dot_general`` in its mixture-of-experts form, rows of ``x`` in ``G``
consecutive groups of traced sizes times one expert's weights each, is brought
to ``x [M, C] x w [G, Q, C] -> [M, Q]`` and runs as the dense recipe applied
to each group's rows and its expert's weights (``_quantize.py``'s groups,
read for each group on its own):

- ``x``'s scaling tiles start at its group's first row: per row (rowwise,
  blockwise, mxfp8) nothing changes; tiles of several rows (tensorwise: the
  whole group) take their amax with a segment max over the rows of each tile.
- ``w``'s tiles are per expert (tensorwise: one scale per expert).
- The weight gradient ``[G, Q, C]`` contracts along the ragged dim: its
  operands (the output gradient and ``x``) are scaled in tiles along ``M``
  that start at each group's first row, and each tile's float8 product
  (``ragged_dot_general`` with a contracting ragged dim, one "group" per tile)
  is rescaled and summed into its expert in float32, as the dense product
  sums its blocks along the contracting dim.

The group sizes stay traced values (no host sync, one compile for all sizes):
tiles are numbered from the cumulative group sizes, within a static bound
(``_ragged_quantize.py``). Under one scale per group and per expert
(tensorwise), the backward products reuse the forward's float8 operands.

A recipe supplies only :class:`RaggedSpec` (its groups per operand kind,
dtypes, and a quantizer: amax -> (scale, inverse), scaled values -> stored
format); everything above is shared. ``fp8_spec`` is FP8's.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.lax import RaggedDotDimensionNumbers

from jaxamp._casting import F32
from jaxamp._engine._contractions import dot_dims
from jaxamp._fp8._quantize import saturating_cast, scale_from_amax
from jaxamp._fp8._ragged_quantize import (
    RaggedSpec,
    Segments,
    Tiles,
    quantize_experts,
    quantize_rows,
    segments,
)
from jaxamp._fp8._scalings import QUANTIZE_SCOPE, Groups, scaling_named, scope_name

__all__ = [
    "RaggedSpec",
    "fp8_spec",
    "ragged_apply",
    "ragged_dot",
    "ragged_form",
    "ragged_matmul",
    "scaled_rows",
]

# lhs [M, C] (ragged rows) x rhs [G, Q, C] (expert first) -> [M, Q].
_ROWS = RaggedDotDimensionNumbers((((1,), (2,)), ((), ())), (0,), (0,))
# The same per block along C: lhs [KB, M, kb] x rhs [G, KB, Q, kb] -> [KB, M, Q].
_ROWS_BLOCKED = RaggedDotDimensionNumbers((((2,), (3,)), ((0,), (1,))), (1,), (0,))
# The input gradient from w as it is: lhs [M, Q] x rhs [G, Q, C] -> [M, C].
_ROWS_BY_Q = RaggedDotDimensionNumbers((((1,), (1,)), ((), ())), (0,), (0,))
# Contracting the ragged rows: lhs [M, Q] x rhs [M, C] -> [tiles, Q, C].
_CONTRACT = RaggedDotDimensionNumbers((((0,), (0,)), ((), ())), (0,), ())


class RaggedForm(NamedTuple):
    """A ``ragged_dot_general`` in the mixture-of-experts form, as canonical dims."""

    lhs_perm: tuple[int, ...]  # x -> [M, contracting...]
    rhs_perm: tuple[int, ...]  # w -> [G, free..., contracting...]
    rhs_free: tuple[int, ...]  # w's free dims (the result's after M)


def ragged_form(params: Mapping[str, Any], lhs_ndim: int, rhs_ndim: int) -> RaggedForm | None:
    """The canonical dims of a ``ragged_dot_general`` these products run, else None.

    The form of ``jax.lax.ragged_dot`` and its generalization: no batch dims,
    the lhs's one free dim is ragged, the rhs has one group dim, no
    ``group_offset``. The others (a ragged contracting or batch dim) keep
    autocast's 16-bit product.
    """
    numbers = params["ragged_dot_dimension_numbers"]
    ragged, group = tuple(numbers.lhs_ragged_dimensions), tuple(numbers.rhs_group_dimensions)
    if params.get("group_offset") is not None or len(ragged) != 1 or len(group) != 1:
        return None
    dims = dot_dims(numbers.dot_dimension_numbers, lhs_ndim, rhs_ndim, group)
    if dims.lhs_batch or dims.rhs_batch or dims.lhs_free != ragged:
        return None
    return RaggedForm(
        (*ragged, *dims.lhs_contract), (*group, *dims.rhs_free, *dims.rhs_contract), dims.rhs_free
    )


def _row_tiles(seg: Segments, groups: Groups) -> Tiles | None:
    return None if groups.rows == 1 else seg.tiles(groups.rows)


def _experts(spec, w, w_kind, w_dtype):
    """``w [G, Q, C]`` quantized per expert in ``w_kind``'s groups."""
    return quantize_experts(spec, w, w_dtype, spec.groups[w_kind]._replace(whole_batch=False))


def _rows_product(
    spec, x, x_kind, x_dtype, w, w_kind, w_dtype, seg, sizes, out_dtype, accumulate, qw=None
):
    """``x [M, C]`` (ragged rows) times ``w [G, Q, C]`` -> ``[M, Q]``, each group its expert.

    ``qw``: ``w`` already quantized (:func:`_experts`).
    """
    ax = spec.groups[x_kind]
    qx, inv_x, _ = quantize_rows(spec, x, x_dtype, _row_tiles(seg, ax), ax.block)
    q_w, inv_w = _experts(spec, w, w_kind, w_dtype) if qw is None else qw
    return scaled_rows(qx, inv_x, q_w, inv_w, seg, sizes, out_dtype, accumulate)


def _weight_input_gradient(spec, g, qw, seg, sizes, c: int, accumulate):
    """``g [M, Q]`` times each expert's weight along Q -> ``[M, C]``, from the forward's codes.

    As the dense product's (``_matmul._input_gradient``): whole-row
    weight groups fold their inverse scales into ``g`` before it is quantized
    and the codes are contracted unscaled; blocks are requantized from the
    codes along Q.
    """
    codes, inverse = qw  # [G, Q, KB, kb], [G, Q, KB]
    ag = spec.groups["grad"]
    if spec.groups["weight"].block is None:
        with jax.named_scope(QUANTIZE_SCOPE):
            per_row = inverse[jnp.minimum(seg.ids, codes.shape[0] - 1)][:, :, 0]  # [M, Q]
            folded = g.astype(F32) * per_row
            unscaled = jnp.swapaxes(codes[:, :, 0], 1, 2)[:, :, None, :]  # [G, C, 1, Q]
            ones = jnp.ones(unscaled.shape[:3], F32)
        qg, inv_g, _ = quantize_rows(
            spec, folded, spec.gradient_dtype, _row_tiles(seg, ag), ag.block
        )
        return scaled_rows(qg, inv_g, unscaled, ones, seg, sizes, F32, accumulate)
    with jax.named_scope(QUANTIZE_SCOPE):
        values = (codes.astype(F32) * inverse[..., None]).reshape(*codes.shape[:2], -1)
        values = jnp.swapaxes(values[:, :, :c], 1, 2)  # [G, C, Q]
    return _rows_product(
        spec,
        g,
        "grad",
        spec.gradient_dtype,
        values,
        "weight",
        spec.forward_dtype,
        seg,
        sizes,
        F32,
        accumulate,
    )


def scaled_rows(qx, inv_x, qw, inv_w, seg, sizes, out_dtype, accumulate, scope=None):
    """The product of quantized ``x [M, KB, kb]`` and ``w [G, Q, KB, kb]``, rescaled.

    ``scope``: a name scope for the moves of the quantized operands (FP4's
    quantization scope, so that ``numerics_report`` counts them as its steps).
    """
    # Each row's expert's inverse scales (rows past the last group: masked below).
    inv_w = inv_w[jnp.minimum(seg.ids, qw.shape[0] - 1)]  # [M, Q, KB]
    blocked = qx.shape[1] != 1
    with jax.named_scope(scope) if scope else contextlib.nullcontext():
        if blocked:
            lhs, rhs = jnp.swapaxes(qx, 0, 1), jnp.swapaxes(qw, 1, 2)
        else:
            lhs, rhs = qx[:, 0], qw[:, :, 0]
    if not blocked:
        out = jax.lax.ragged_dot_general(lhs, rhs, sizes, _ROWS, preferred_element_type=accumulate)
        out = out.astype(F32) * inv_x * inv_w[:, :, 0]
    else:
        partial = jax.lax.ragged_dot_general(
            lhs, rhs, sizes, _ROWS_BLOCKED, preferred_element_type=F32
        )  # [KB, M, Q]
        x_scale = jnp.transpose(inv_x)[:, :, None]
        w_scale = jnp.transpose(inv_w, (2, 0, 1))
        out = jnp.sum((partial * x_scale * w_scale).astype(accumulate), axis=0)
    return jnp.where(seg.valid[:, None], out, 0).astype(out_dtype)


def _contract_product(spec, g, g_kind, g_dtype, x, x_kind, x_dtype, seg, accumulate):
    """``g [M, Q]`` and ``x [M, C]`` contracted over each group's rows -> ``[G, Q, C]``.

    The dense product per group transposes both operands (``[Q, rows]``,
    ``[C, rows]``): a group's ``rows`` of ``Groups`` run along Q and C here,
    its ``block`` along the group's rows.
    """
    ag, ax = spec.groups[g_kind], spec.groups[x_kind]
    if ag.block != ax.block:
        raise NotImplementedError(
            f"a ragged weight gradient needs the same blocks along the rows for both "
            f"operands; got {ag} and {ax}."
        )
    tiles = seg.tiles(ag.block)
    q_g, _, inv_g = quantize_rows(spec, g, g_dtype, tiles, ag.rows)
    q_x, _, inv_x = quantize_rows(spec, x, x_dtype, tiles, ax.rows)
    whole = ag.block is None  # one tile per group: the product is the expert's
    # As a dense product's: ``accumulate`` (the dtype a cross-device sum of the
    # rows runs in) is the float8 product's result, or the scaled tiles' sum's.
    partial = jax.lax.ragged_dot_general(
        _flat(q_g, g.shape[1]),
        _flat(q_x, x.shape[1]),
        tiles.sizes,
        _CONTRACT,
        preferred_element_type=accumulate if whole else F32,
    )  # [tiles, Q, C]
    g_scale = _repeat(inv_g, ag.rows, g.shape[1])[:, :, None]
    x_scale = _repeat(inv_x, ax.rows, x.shape[1])[:, None, :]
    scaled = partial.astype(F32) * g_scale * x_scale
    # An empty group's tile has no rows (its scales are another group's).
    scaled = jnp.where(tiles.sizes[:, None, None] > 0, scaled, 0)
    if whole:
        return scaled
    experts = seg.sizes.shape[0]
    scaled = scaled.astype(accumulate)
    return jax.ops.segment_sum(scaled, tiles.owner, num_segments=experts + 1)[:experts]


def _flat(q, f: int):
    return q.reshape(q.shape[0], -1)[:, :f]


def _repeat(inverse, block: int | None, f: int):
    """Per-block inverse scales ``[T, nF]`` -> per value ``[T, F]``."""
    size = min(block or f, f)
    return jnp.repeat(inverse, size, axis=1, total_repeat_length=inverse.shape[1] * size)[:, :f]


def ragged_matmul(
    spec: RaggedSpec, kinds: tuple[str, str], dtypes: tuple, reduce: tuple
) -> Callable:
    """``x [M, C] x w [G, Q, C]`` (ragged rows of x) -> ``[M, Q]`` with low-precision backward.

    ``kinds``: x's and w's operand kinds; ``dtypes``: their (and their
    cotangents') dtypes; ``reduce``: the result dtypes of the products giving
    each cotangent (a parameter's: the recipe's ``reduce_dtype``).
    """
    x_kind, w_kind = kinds
    fwd_dtype, grad_dtype = spec.forward_dtype, spec.gradient_dtype
    if all(g.rows is None and g.block is None for g in spec.groups.values()):
        return _whole_matmul(spec, kinds, dtypes, reduce)

    weight = w_kind == "weight"

    def forward(x, w, sizes):
        with jax.named_scope(spec.scope):
            seg = segments(sizes, x.shape[0])
            qw = _experts(spec, w, w_kind, fwd_dtype)
            out = _rows_product(
                spec,
                x,
                x_kind,
                fwd_dtype,
                w,
                w_kind,
                fwd_dtype,
                seg,
                sizes,
                spec.compute_dtype,
                F32,
                qw,
            )
            # A weight's codes are saved: the input-gradient product reuses them
            # (a sharded expert weight is all-gathered once per step, in float8).
            return out, (x, qw if weight else w, sizes)

    @jax.custom_vjp
    def matmul(x, w, sizes):
        return forward(x, w, sizes)[0]

    def fwd(x, w, sizes):
        return forward(x, w, sizes)

    def bwd(residuals, g):
        x, w, sizes = residuals
        with jax.named_scope(spec.scope):
            seg = segments(sizes, x.shape[0])
            # dx[M, C] = g[M, Q] . w[group] over Q; dw[G, Q, C] = g^T . x over each group's rows.
            if weight:
                dx = _weight_input_gradient(spec, g, w, seg, sizes, x.shape[1], reduce[0])
            else:
                w_t = jnp.swapaxes(w, 1, 2)
                dx = _rows_product(
                    spec, g, "grad", grad_dtype, w_t, w_kind, fwd_dtype, seg, sizes, F32, reduce[0]
                )
            dw = _contract_product(
                spec, g, "grad", grad_dtype, x, x_kind, fwd_dtype, seg, reduce[1]
            )
        return dx.astype(dtypes[0]), dw.astype(dtypes[1]), None

    matmul.defvjp(fwd, bwd)
    return matmul


def _whole_matmul(spec: RaggedSpec, kinds: tuple, dtypes: tuple, reduce: tuple) -> Callable:
    """:func:`ragged_matmul` with one scale per group of rows and per expert (tensorwise).

    The scales do not depend on the contracting dim: the backward products
    reuse the forward's float8 operands (saved instead of ``x`` and ``w``, as
    a dense tensorwise product does), contracting them along the other dim.
    """
    whole = Groups(False, None, None)

    def forward(x, w, sizes):
        seg = segments(sizes, x.shape[0])
        qx, inv_x, x_tiles = quantize_rows(spec, x, spec.forward_dtype, seg.tiles(None), None)
        qw, inv_w = quantize_experts(spec, w, spec.forward_dtype, whole)
        out = scaled_rows(qx, inv_x, qw, inv_w, seg, sizes, spec.compute_dtype, F32)
        return out, (qx[:, 0], x_tiles, qw[:, :, 0], inv_w[:, :1, 0], sizes)

    @jax.custom_vjp
    def matmul(x, w, sizes):
        with jax.named_scope(spec.scope):
            return forward(x, w, sizes)[0]

    def fwd(x, w, sizes):
        with jax.named_scope(spec.scope):
            return forward(x, w, sizes)

    def bwd(saved, g):
        qx, x_tiles, qw, w_inverse, sizes = saved
        with jax.named_scope(spec.scope):
            seg = segments(sizes, qx.shape[0])
            qg, g_rows, g_tiles = quantize_rows(spec, g, spec.gradient_dtype, seg.tiles(None), None)
            qg = qg[:, 0]
            # dx[M, C] = g[M, Q] . w[group] over Q (w's own dim 1: no transpose).
            dx = jax.lax.ragged_dot_general(
                qg, qw, sizes, _ROWS_BY_Q, preferred_element_type=reduce[0]
            )
            rows_w = w_inverse[jnp.minimum(seg.ids, qw.shape[0] - 1)]
            dx = jnp.where(seg.valid[:, None], dx.astype(F32) * g_rows * rows_w, 0)
            dw = jax.lax.ragged_dot_general(
                qg, qx, sizes, _CONTRACT, preferred_element_type=reduce[1]
            )
            # Quantized with tiles: each tile has its inverse (quantize_rows' third result).
            dw = dw.astype(F32) * cast(jax.Array, g_tiles)[:, :, None] * x_tiles[:, None, :]
            dw = jnp.where(seg.sizes[:, None, None] > 0, dw, 0)  # an empty expert's: zero
        return dx.astype(dtypes[0]), dw.astype(dtypes[1]), None

    matmul.defvjp(fwd, bwd)
    return matmul


def fp8_spec(recipe: Any) -> RaggedSpec:
    """The :class:`RaggedSpec` of a ``Float8Recipe``: its table's groups, current scaling."""
    pow2 = recipe.exact_scales

    def scales(amax, dtype):
        scale = scale_from_amax(amax, dtype, pow2)
        return scale, 1 / scale

    return RaggedSpec(
        groups=scaling_named(recipe.scaling).groups,
        forward_dtype=recipe.forward_dtype,
        gradient_dtype=recipe.gradient_dtype,
        compute_dtype=recipe.compute_dtype,
        scales=scales,
        cast=saturating_cast,
        scope=scope_name(recipe.scaling, recipe.power_of_two_scale),
    )


def ragged_dot(spec: RaggedSpec, params: Mapping[str, Any], x, w, sizes, *, plain, reduce_dtype):
    """The product of a ``ragged_dot_general`` in :func:`ragged_form` under ``spec``.

    ``plain``: which operands are parameters or inputs (autocast's PLAIN role):
    a plain ``w`` is a weight (its groups), and a parameter's gradient product
    has ``reduce_dtype`` results.
    """
    kinds = ("act", "weight" if plain[1] else "act")
    reduce = tuple(np.dtype(reduce_dtype) if p else F32 for p in plain)

    def product(a, b, sizes):
        return ragged_matmul(spec, kinds, (a.dtype, b.dtype), reduce)(a, b, sizes)

    return ragged_apply(params, x, w, sizes, product)


def ragged_apply(params: Mapping[str, Any], x, w, sizes, product: Callable):
    """``product(x [M, C], w [G, Q, C], sizes) -> [M, Q]`` on a :func:`ragged_form` product.

    The operands are brought to the canonical dims and the result back to the
    ``ragged_dot_general``'s (any recipe's ragged products enter here).
    """
    form = ragged_form(params, x.ndim, w.ndim)
    if form is None:  # the recipe's hook chose this product: its form is known
        raise ValueError(f"ragged_dot_general in a form the recipes do not run: {dict(params)}")
    a = _canonical(x, form.lhs_perm, None)
    b = _canonical(w, form.rhs_perm, len(form.rhs_free))
    out = product(a, b, sizes)
    return out.reshape(x.shape[form.lhs_perm[0]], *(w.shape[d] for d in form.rhs_free))


def _canonical(v, perm: tuple[int, ...], free: int | None):
    """``v`` transposed to ``perm``, merged: ``[M, C]``, or ``[G, Q, C]`` (``free`` dims in Q)."""
    if perm != tuple(range(v.ndim)):
        v = jax.lax.transpose(v, perm)
    lead = 1 if free is None else 1 + free
    head = v.shape[:1] if free is None else (v.shape[0], math.prod(v.shape[1:lead]))
    return v.reshape(*head, math.prod(v.shape[lead:]))
