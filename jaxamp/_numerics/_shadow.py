"""The float32 twin of a 16-bit equation: what the op would give in float32 arithmetic.

For every equation with a 16-bit floating output, the report also runs the same
primitive on the same inputs upcast to float32 (a 16-bit target dtype in the
parameters, such as ``convert_element_type``'s ``new_dtype`` or a matmul's
``preferred_element_type``, becomes float32 too). Comparing the two gives the
values this op flushed to zero or into subnormals (underflow) and the magnitude it
would reach if the 16-bit result overflowed, which the suggested loss scale needs.

The twin is local: its inputs are the real (16-bit) inputs, so it measures what
this op loses, not what earlier ops lost. Primitives in ``NO_TWIN`` (bit-level
ops, random bits) and any primitive that does not accept float32 inputs have no
twin: their underflow counts as zero and their float32 magnitude is their own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np

from jaxamp._autocast import _compat as compat
from jaxamp._casting import is_floating

__all__ = ["NO_TWIN", "float32_outputs"]

NO_TWIN = frozenset({"bitcast_convert_type", "random_bits", "random_wrap", "iota", "rng_uniform"})
# Parameters that name an output dtype (a 16-bit one is widened for the twin).
_DTYPE_PARAMS = ("new_dtype", "preferred_element_type", "out_dtype", "dtype")
# A value casts to 16 bits: its twin is the value before the cast.
_ROUNDING = frozenset({"convert_element_type", "reduce_precision"})


def is_narrow(x: Any) -> bool:
    return is_floating(x) and np.dtype(x.dtype).itemsize < 4


def float32_outputs(eqn: jex.JaxprEqn, values: Sequence[Any], outs: Sequence[Any]) -> list:
    """The float32 twin of each output of ``eqn`` (None where there is none)."""
    if not any(is_narrow(out) for out in outs) or eqn.primitive.name in NO_TWIN:
        return [None] * len(outs)
    if eqn.primitive.name in _ROUNDING and is_floating(values[0]):
        return [values[0].astype(jnp.float32)]
    wide = [v.astype(jnp.float32) if is_narrow(v) else v for v in values]
    params = {
        name: (jnp.float32 if name in _DTYPE_PARAMS and _is_narrow_dtype(value) else value)
        for name, value in eqn.params.items()
    }
    try:
        twins = compat.bind_eqn(eqn.replace(params=params), wide)
    except Exception:  # a primitive that insists on its dtypes: no twin
        return [None] * len(outs)
    return [
        twin if is_narrow(out) and getattr(twin, "dtype", None) == jnp.float32 else None
        for out, twin in zip(outs, twins, strict=True)
    ]


def _is_narrow_dtype(value: Any) -> bool:
    try:
        dtype = np.dtype(value)
    except (TypeError, ValueError):
        return False
    return jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4
