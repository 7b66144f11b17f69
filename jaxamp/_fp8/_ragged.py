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
tiles are numbered from the cumulative group sizes, within a static bound.

A recipe supplies only :class:`RaggedSpec` (its groups per operand kind,
dtypes, and a quantizer: amax -> (scale, inverse), scaled values -> stored
format); everything above is shared.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.lax import RaggedDotDimensionNumbers

from jaxamp._casting import F32, QUANTIZE_SCOPE
from jaxamp._engine._contractions import dot_dims
from jaxamp._fp8._quantize import saturating_cast, scale_from_amax
from jaxamp._fp8._scalings import Groups, scaling_named, scope_name

__all__ = ["RaggedSpec", "fp8_spec", "ragged_dot", "ragged_form", "ragged_matmul"]

# lhs [M, C] (ragged rows) x rhs [G, Q, C] (expert first) -> [M, Q].
_ROWS = RaggedDotDimensionNumbers((((1,), (2,)), ((), ())), (0,), (0,))
# The same per block along C: lhs [KB, M, kb] x rhs [G, KB, Q, kb] -> [KB, M, Q].
_ROWS_BLOCKED = RaggedDotDimensionNumbers((((2,), (3,)), ((0,), (1,))), (1,), (0,))
# Contracting the ragged rows: lhs [M, Q] x rhs [M, C] -> [tiles, Q, C].
_CONTRACT = RaggedDotDimensionNumbers((((0,), (0,)), ((), ())), (0,), ())


class RaggedSpec(NamedTuple):
    """What a recipe gives the ragged products; the rest is shared.

    Attributes:
      groups: operand kind (``"act"``, ``"weight"``, ``"grad"``) -> its
        :class:`Groups` for a dense product (``_scalings.SCALINGS``).
      forward_dtype: the stored format of the forward operands.
      gradient_dtype: the stored format of the incoming gradient.
      compute_dtype: the forward product's result dtype.
      scales: ``(amax float32, dtype) -> (scale, inverse)``, elementwise.
      cast: ``(scaled float32 values, dtype) -> stored values`` (saturating).
      scope: the name scope of every product (``precision_report`` reads it).
    """

    groups: Mapping[str, Groups]
    forward_dtype: np.dtype
    gradient_dtype: np.dtype
    compute_dtype: np.dtype
    scales: Callable[[jax.Array, np.dtype], tuple[jax.Array, jax.Array]]
    cast: Callable[[jax.Array, np.dtype], jax.Array]
    scope: str


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


class Tiles(NamedTuple):
    """Tiles of rows along the ragged dim, each within one group (traced numbering).

    ``ids``: each row's tile, ``count`` (static) for rows past the last group;
    ``sizes``: rows per tile ``[count]``; ``owner``: each tile's group, ``G``
    for the unused ones.
    """

    ids: jax.Array
    count: int
    sizes: jax.Array
    owner: jax.Array


class Segments(NamedTuple):
    """The groups of the rows, from the cumulative group sizes."""

    sizes: jax.Array  # [G] int32
    starts: jax.Array  # [G]: each group's first row
    ids: jax.Array  # [M]: each row's group, G past the last group
    valid: jax.Array  # [M]: the row belongs to a group

    def tiles(self, rows: int | None) -> Tiles:
        """Tiles of ``rows`` rows from each group's first row (None: the whole group)."""
        g, m = self.sizes.shape[0], self.ids.shape[0]
        if rows is None:
            return Tiles(self.ids, g, self.sizes, jnp.arange(g))
        per_group = (self.sizes + rows - 1) // rows
        ends = jnp.cumsum(per_group)
        first = ends - per_group
        group = jnp.minimum(self.ids, g - 1)
        count = -(-m // rows) + g  # sum over groups of ceil(size / rows), at most
        within = jnp.arange(m, dtype=jnp.int32) - self.starts[group]
        ids = jnp.where(self.valid, first[group] + within // rows, count)
        tile = jnp.arange(count, dtype=jnp.int32)
        owner = jnp.searchsorted(ends, tile, side="right").astype(jnp.int32)
        safe = jnp.minimum(owner, g - 1)
        sizes = jnp.clip(self.sizes[safe] - (tile - first[safe]) * rows, 0, rows)
        return Tiles(ids, count, jnp.where(owner < g, sizes, 0), owner)


def segments(group_sizes: jax.Array, m: int) -> Segments:
    """Each row's group from ``group_sizes`` (traced), for ``m`` rows."""
    sizes = jnp.asarray(group_sizes, jnp.int32)
    ends = jnp.cumsum(sizes)
    rows = jnp.arange(m, dtype=jnp.int32)
    ids = jnp.searchsorted(ends, rows, side="right").astype(jnp.int32)
    return Segments(sizes, ends - sizes, ids, rows < ends[-1])


def _columns(v: jax.Array, block: int | None) -> jax.Array:
    """``[M, F]`` -> ``[M, nF, f]``: blocks of ``block`` along F (zero-padded; None: one)."""
    f = v.shape[1]
    size = min(block or f, f)
    v = jnp.pad(v, ((0, 0), (0, -f % size)))
    return v.reshape(v.shape[0], -1, size)


def _amax(v: jax.Array, axes) -> jax.Array:
    # A NaN counts as an inf: its group's scale is NaN either way, and the
    # segment max needs no NaN semantics.
    magnitude = jnp.abs(v)
    return jnp.max(jnp.where(jnp.isnan(magnitude), jnp.inf, magnitude), axis=axes)


def quantize_rows(spec: RaggedSpec, v, dtype, tiles: Tiles | None, block: int | None):
    """A ragged-row operand ``v [M, F]`` in tiles of rows x ``block`` values along F.

    ``tiles``: the row tiles (None: each row its own). Returns the stored
    values ``[M, nF, f]`` (F zero-padded), each row's inverse scales
    ``[M, nF]`` and each tile's ``[tiles.count, nF]`` (None without tiles).
    """
    with jax.named_scope(QUANTIZE_SCOPE):
        v = _columns(v.astype(F32), block)
        amax = _amax(v, 2)
        tile_inverse = None
        if tiles is not None:
            per_tile = jax.ops.segment_max(
                amax, tiles.ids, num_segments=tiles.count + 1, indices_are_sorted=True
            )
            tile_inverse = spec.scales(per_tile, dtype)[1][: tiles.count]
            amax = per_tile[tiles.ids]
        scale, inverse = spec.scales(amax, dtype)
        return spec.cast(v * scale[..., None], dtype), inverse, tile_inverse


def quantize_experts(spec: RaggedSpec, w, dtype, groups: Groups):
    """``w [G, Q, C]`` in tiles per expert: ``[G, Q, KB, kb]`` and inverses ``[G, Q, KB]``."""
    with jax.named_scope(QUANTIZE_SCOPE):
        g, q, c = w.shape
        block, rows = min(groups.block or c, c), min(groups.rows or q, q)
        w = jnp.pad(w.astype(F32), ((0, 0), (0, -q % rows), (0, -c % block)))
        tiles = w.reshape(g, -1, rows, w.shape[2] // block, block)
        scale, inverse = spec.scales(_amax(tiles, (2, 4))[:, :, None, :, None], dtype)
        stored = spec.cast(tiles * scale, dtype).reshape(g, -1, tiles.shape[3], block)
        inverse = jnp.broadcast_to(inverse, (*tiles.shape[:4], 1)).reshape(g, -1, tiles.shape[3])
        return stored[:, :q], inverse[:, :q]


def _row_tiles(seg: Segments, groups: Groups) -> Tiles | None:
    return None if groups.rows == 1 else seg.tiles(groups.rows)


def _rows_product(spec, x, x_kind, x_dtype, w, w_kind, w_dtype, seg, sizes, out_dtype, accumulate):
    """``x [M, C]`` (ragged rows) times ``w [G, Q, C]`` -> ``[M, Q]``, each group its expert."""
    ax, aw = spec.groups[x_kind], spec.groups[w_kind]
    qx, inv_x, _ = quantize_rows(spec, x, x_dtype, _row_tiles(seg, ax), ax.block)
    qw, inv_w = quantize_experts(spec, w, w_dtype, aw._replace(whole_batch=False))
    # Each row's expert's inverse scales (rows past the last group: masked below).
    inv_w = inv_w[jnp.minimum(seg.ids, w.shape[0] - 1)]  # [M, Q, KB]
    if qx.shape[1] == 1:
        out = jax.lax.ragged_dot_general(
            qx[:, 0], qw[:, :, 0], sizes, _ROWS, preferred_element_type=accumulate
        )
        out = out.astype(F32) * inv_x * inv_w[:, :, 0]
    else:
        partial = jax.lax.ragged_dot_general(
            jnp.swapaxes(qx, 0, 1),
            jnp.swapaxes(qw, 1, 2),
            sizes,
            _ROWS_BLOCKED,
            preferred_element_type=F32,
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

    def forward(x, w, sizes):
        with jax.named_scope(spec.scope):
            seg = segments(sizes, x.shape[0])
            return _rows_product(
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
            )

    @jax.custom_vjp
    def matmul(x, w, sizes):
        return forward(x, w, sizes)

    def fwd(x, w, sizes):
        return forward(x, w, sizes), (x, w, sizes)

    def bwd(residuals, g):
        x, w, sizes = residuals
        with jax.named_scope(spec.scope):
            seg = segments(sizes, x.shape[0])
            # dx[M, C] = g[M, Q] . w[group] over Q; dw[G, Q, C] = g^T . x over each group's rows.
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
    form = ragged_form(params, x.ndim, w.ndim)
    a = _canonical(x, form.lhs_perm, None)
    b = _canonical(w, form.rhs_perm, len(form.rhs_free))
    kinds = ("act", "weight" if plain[1] else "act")
    reduce = tuple(np.dtype(reduce_dtype) if p else F32 for p in plain)
    out = ragged_matmul(spec, kinds, (a.dtype, b.dtype), reduce)(a, b, sizes)
    return out.reshape(x.shape[form.lhs_perm[0]], *(w.shape[d] for d in form.rhs_free))


def _canonical(v, perm: tuple[int, ...], free: int | None):
    """``v`` transposed to ``perm``, merged: ``[M, C]``, or ``[G, Q, C]`` (``free`` dims in Q)."""
    if perm != tuple(range(v.ndim)):
        v = jax.lax.transpose(v, perm)
    lead = 1 if free is None else 1 + free
    head = v.shape[:1] if free is None else (v.shape[0], math.prod(v.shape[1:lead]))
    return v.reshape(*head, math.prod(v.shape[lead:]))
