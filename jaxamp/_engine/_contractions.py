"""Contractions: which primitives are matmuls, and their dims, read from the params once.

autocast (padding, its CPU product layout), the FP8 products and
precision_report all need the same split of a ``dot_general``'s dims into
batch, free and contracting ones, and of a convolution's into feature and
spatial ones; they all take it from here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

__all__ = ["MATMUL_PRIMITIVES", "ConvAxes", "DotDims", "conv_axes", "dot_dims"]

# Contractions: autocast's "compute" rule, the matmuls of precision_report, and
# the products the backward pass re-runs with float32 accumulation. One set.
MATMUL_PRIMITIVES = ("dot_general", "conv_general_dilated", "ragged_dot_general")


class DotDims(NamedTuple):
    """The dims of both operands of a ``dot_general``, each group in ascending order."""

    lhs_batch: tuple[int, ...]
    lhs_free: tuple[int, ...]
    lhs_contract: tuple[int, ...]
    rhs_batch: tuple[int, ...]
    rhs_free: tuple[int, ...]
    rhs_contract: tuple[int, ...]


def dot_dims(
    dimension_numbers: Any, lhs_ndim: int, rhs_ndim: int, rhs_other: Sequence[int] = ()
) -> DotDims:
    """Splits a ``dot_general``'s ``dimension_numbers`` into batch, free and contracting dims.

    ``rhs_other``: rhs dims that are none of the three (``ragged_dot``'s group dim).

    >>> dims = dot_dims((((1,), (0,)), ((), ())), 2, 2)  # a @ b
    >>> dims.lhs_free, dims.lhs_contract, dims.rhs_contract, dims.rhs_free
    ((0,), (1,), (0,), (1,))
    """
    (lc, rc), (lb, rb) = dimension_numbers
    lf = tuple(d for d in range(lhs_ndim) if d not in (*lc, *lb))
    rf = tuple(d for d in range(rhs_ndim) if d not in (*rc, *rb, *rhs_other))
    return DotDims(tuple(lb), lf, tuple(lc), tuple(rb), rf, tuple(rc))


class ConvAxes(NamedTuple):
    """The feature and spatial axes of a ``conv_general_dilated``'s operands and result."""

    lhs_feature: int  # the input's channels (C_in)
    rhs_in: int  # the kernel's input-feature axis
    rhs_out: int  # the kernel's output-feature axis (C_out)
    out_feature: int  # the result's channels
    rhs_spatial: tuple[int, ...]  # the kernel's taps


def conv_axes(dimension_numbers: Any) -> ConvAxes:
    """The axes of a convolution from its ``ConvDimensionNumbers`` (lhs, rhs, out specs).

    >>> import jax
    >>> layouts = ("NHWC", "HWIO", "NHWC")
    >>> numbers = jax.lax.conv_dimension_numbers((1, 8, 8, 3), (3, 3, 3, 16), layouts)
    >>> conv_axes(numbers)
    ConvAxes(lhs_feature=3, rhs_in=2, rhs_out=3, out_feature=3, rhs_spatial=(0, 1))
    """
    lhs_spec, rhs_spec, out_spec = dimension_numbers
    return ConvAxes(lhs_spec[1], rhs_spec[1], rhs_spec[0], out_spec[1], tuple(rhs_spec[2:]))
