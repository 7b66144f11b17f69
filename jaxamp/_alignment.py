"""Tensor Core alignment: sizes and padding that meet NVIDIA's multiples.

NVIDIA's matrix-multiplication guide asks for the M, N and K dimensions of a
GEMM to be multiples of 16 bytes: 8 elements for float16 and bfloat16, 4 for
tf32/float32, 16 for int8 and fp8, 32 for 4-bit types. These are the minimums
for Tensor Cores to be used at all; on A100 and H100, multiples of 64 elements
(128 bytes for 16-bit types) are what reach the best efficiency, and the
vocabulary or hidden size of a model is usually padded to 64 or 128.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxamp._checks import check_python_int

__all__ = ["align_dim", "pad_to_multiple", "tensor_core_multiple"]

_FOUR_BIT = {"int4", "uint4", "float4_e2m1fn"}


def align_dim(n: int, multiple: int = 8) -> int:
    """The smallest multiple of ``multiple`` that is >= ``n``.

    >>> import jaxamp
    >>> jaxamp.align_dim(50257, 64), jaxamp.align_dim(0), jaxamp.align_dim(16)
    (50304, 0, 16)

    Raises:
      ValueError: ``n < 0`` or ``multiple < 1``.
      TypeError: either is not an integer.
    """
    n = check_python_int(n, "n")
    multiple = check_python_int(multiple, "multiple")
    if n < 0:
        raise ValueError(f"n must be >= 0; got {n}.")
    if multiple < 1:
        raise ValueError(f"multiple must be >= 1; got {multiple}.")
    return -(-n // multiple) * multiple


def pad_to_multiple(x: Any, multiple: int, axis: int = -1, value: Any = 0) -> jax.Array:
    """Pads ``x`` with ``value`` at the end of ``axis`` up to a multiple of ``multiple``.

    Returns ``x`` itself (as a JAX array) when that axis is already aligned.

    >>> import jax.numpy as jnp, jaxamp
    >>> jaxamp.pad_to_multiple(jnp.ones((2, 5)), 8).shape
    (2, 8)

    Raises:
      ValueError: ``multiple < 1`` or ``axis`` out of range.
    """
    x = jnp.asarray(x)
    multiple = check_python_int(multiple, "multiple")
    axis = check_python_int(axis, "axis")
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"axis {axis} is out of range for an array of shape {x.shape}.")
    axis %= x.ndim
    size = x.shape[axis]
    extra = align_dim(size, multiple) - size
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=jnp.asarray(value, x.dtype))


def tensor_core_multiple(dtype: Any) -> int:
    """The element multiple NVIDIA Tensor Cores need for ``dtype`` (16-byte rule).

    8 for float16/bfloat16, 4 for float32 (run as tf32), 2 for float64, 16 for
    int8 and the fp8 types, 32 for 4-bit types. For peak efficiency on A100/H100
    prefer multiples of 64 (or 128) elements: ``align_dim(n, 64)``.

    >>> import jax.numpy as jnp, jaxamp
    >>> [jaxamp.tensor_core_multiple(d) for d in (jnp.bfloat16, jnp.float32, jnp.int8)]
    [8, 4, 16]
    """
    try:
        dt = jnp.dtype(dtype)
    except TypeError:
        raise TypeError(f"dtype must be a numeric dtype; got {dtype!r}.") from None
    if dt == np.bool_ or not (jnp.issubdtype(dt, jnp.floating) or jnp.issubdtype(dt, jnp.integer)):
        raise TypeError(
            f"dtype must be a floating or integer dtype that Tensor Cores run; got {dt.name}."
        )
    if dt.name in _FOUR_BIT:
        return 32
    return max(1, 16 // dt.itemsize)
