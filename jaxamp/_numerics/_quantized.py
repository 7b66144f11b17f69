"""The statistics of an FP4 quantization, measured as one op from its ``Facts``.

An FP4 quantization's result is its cast to ``float4_e2m1fn``: codes in
``[-6, 6]`` whose value is ``code * block / tensor``. What the float8 maps of
``_stats.Elements`` read off an output (a value at the dtype's max, a value
below its smallest normal) says little there: every block's amax lands near 6
and E2M1's subnormal 0.5 is a regular code. ``Elements`` here maps the
quantization's ``_fp4_facts.Facts`` instead, with the same statistic names, so
``_stats.reduce_rows`` reduces it like any other group of rows
(``_table.Scope`` groups FP4 quantizations apart from other outputs of their
size, so no other output pays for the extra rows).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxamp._fp8._fp4 import E2M1_MAX

__all__ = ["Elements"]


def _stack(values: Sequence[Any]) -> Any:
    # lax, not jnp: jnp's jitted helpers are traced again for every value.
    rows = [jax.lax.reshape(v, (1, v.size)).astype(jnp.float32) for v in values]
    return jax.lax.concatenate(rows, 0)


class Elements:
    """The per-element facts of FP4 quantizations of one size, one row each.

    ``out`` is the codes; ``x``, ``y``, ``block`` and ``tensor`` the ``Facts``
    (the input, the scaled input before the clip, the block and tensor scales,
    each per value).
    """

    has_shadow = False

    def __init__(self, outputs: Sequence[Any]):
        self.out = _stack([o.out for o in outputs])
        facts = [o.quantized for o in outputs]
        self.x = _stack([f.x for f in facts])
        self.y = _stack([f.y for f in facts])
        self.block = _stack([f.block for f in facts])
        self.tensor = _stack([f.tensor for f in facts])

    @functools.cached_property
    def _finite_input(self) -> Any:
        return jnp.isfinite(self.x)

    @functools.cached_property
    def _nonzero_input(self) -> Any:
        return jnp.logical_and(self._finite_input, self.x != 0)

    @property
    def magnitude(self) -> Any:
        """``|code|``: E2M1 has no inf or NaN."""
        return jnp.abs(self.out)

    @property
    def magnitude_float32(self) -> Any:
        """``|y|``, the scaled input before the clip: above 6 where it was clamped."""
        return jnp.where(jnp.isfinite(self.y), jnp.abs(self.y), np.float32(0))

    @property
    def nonfinite(self) -> Any:
        """1 where the dequantized value is inf/NaN: a block or tensor scale is
        (an inf/NaN input makes its block's scale NaN)."""
        finite = jnp.logical_and(jnp.isfinite(self.block), jnp.isfinite(self.tensor))
        return jnp.logical_not(finite).astype(jnp.int32)

    @functools.cached_property
    def _scaled_block(self) -> Any:
        # A block scale of 0 (NVFP4: an E4M3 s_b below its range) dequantizes every
        # code of its block to 0: those values are flushed, not clamped.
        return jnp.logical_and(jnp.isfinite(self.block), self.block != 0)

    @property
    def underflow(self) -> Any:
        """1 where a finite nonzero input dequantizes to 0: the zero code, or a zero
        block scale."""
        zero = jnp.logical_or(self.out == 0, jnp.logical_not(self._scaled_block))
        return jnp.logical_and(self._nonzero_input, zero).astype(jnp.int32)

    lost = underflow  # the quantization is where such a value is lost

    @property
    def saturated(self) -> Any:
        """1 where a finite input's scaled value was beyond 6 and clamped there (in a
        block with a nonzero scale)."""
        beyond = jnp.abs(self.y) > np.float32(E2M1_MAX)
        clamped = jnp.logical_and(self._scaled_block, beyond)
        return jnp.logical_and(self._finite_input, clamped).astype(jnp.int32)

    @property
    def amax(self) -> Any:
        """``|x|`` where finite, else 0: the input's largest magnitude."""
        return jnp.where(self._finite_input, jnp.abs(self.x), np.float32(0))

    @property
    def tensor_scale(self) -> Any:
        """Over the values that are nonzero: an all-zero expert group's (or padding's)
        tensor scale of 1 says nothing."""
        counted = jnp.logical_and(self._nonzero_input, jnp.isfinite(self.tensor))
        return jnp.where(counted, self.tensor, np.float32(np.inf))

    @functools.cached_property
    def _counted_block(self) -> Any:
        # Only blocks that hold a nonzero value: an all-zero block's scale (0 or 1)
        # says nothing; a finite block scale of a block with a nonzero value.
        return jnp.logical_and(self._nonzero_input, jnp.isfinite(self.block))

    @property
    def block_scale_min(self) -> Any:
        return jnp.where(self._counted_block, self.block, np.float32(np.inf))

    @property
    def block_scale_max(self) -> Any:
        return jnp.where(self._counted_block, self.block, np.float32(0))
