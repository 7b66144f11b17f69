"""Scaling the operands of a ragged product: groups of rows, tiles within them, per expert.

The rows of a ``ragged_dot``'s lhs fall into consecutive groups of traced
sizes. ``segments`` numbers each row's group from the cumulative sizes;
``Segments.tiles`` numbers tiles of rows that start at each group's first row,
within a static bound, so that nothing depends on the sizes' values (no host
sync, one compile). A recipe's quantizer enters through :class:`RaggedSpec`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxamp._casting import F32
from jaxamp._fp8._scalings import QUANTIZE_SCOPE, Groups

__all__ = ["RaggedSpec", "Segments", "Tiles", "quantize_experts", "quantize_rows", "segments"]


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
