"""The float32 shadow: every value as the program would compute it in float32 arithmetic.

Next to each floating value the report carries its *shadow*: the same value
computed with every 16-bit operation done in float32 instead, along the whole
program (a 16-bit target dtype in an equation's parameters, such as
``convert_element_type``'s ``new_dtype`` or a matmul's ``preferred_element_type``,
becomes float32 too). A shadow of ``None`` means "equal to the value": inputs,
constants, and anything computed only from them in 32-bit arithmetic.

Comparing a value with its shadow gives what 16 bits lost: values that are zero
or subnormal but normal in float32 (underflow, including values flushed earlier
and carried here) and magnitudes beyond the dtype's max (overflow), which the
suggested loss scale needs. Integer and bool values are never shadowed: masks,
indices and loop conditions come from the real program, so both run the same
control flow. Primitives in ``NO_SHADOW`` (bit-level ops, random bits) and any
primitive that rejects float32 inputs restart the shadow from their real output.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np

from jaxamp._casting import is_floating, is_narrow, widen
from jaxamp._engine import _compat as compat
from jaxamp._numerics._retype import check_lowers, every_twin_checked, twin_params

__all__ = ["NO_SHADOW", "Val", "local_twins", "materialize", "shadow_outputs"]

NO_SHADOW = frozenset({"bitcast_convert_type", "random_bits", "random_wrap", "iota", "rng_uniform"})
# Rounding to another dtype: the shadow of the result is the shadow of the input.
_ROUNDING = frozenset({"convert_element_type", "reduce_precision"})


class Val(NamedTuple):
    """An environment entry: the value, whether it is all finite, its float32 shadow,
    and (when it was measured) its statistics, which a reshape of it can reuse."""

    value: Any
    finite: Any
    shadow: Any = None
    stats: Any = None


def _wide_normal(x: Any) -> Any:
    """``x`` in float32 with its 16-bit zero and subnormal values as zero."""
    if not is_narrow(x):
        return x
    # lax, not jnp.where: traced once per input of every twin.
    tiny = jax.lax.full_like(x, jnp.finfo(x.dtype).tiny)
    flushed = jax.lax.lt(jax.lax.abs(x), tiny)
    normal = jax.lax.select(flushed, jax.lax.full_like(x, 0), x)
    return jax.lax.convert_element_type(normal, jnp.float32)


def widened(val: Val) -> Any:
    """The shadow of ``val`` (its value in at least float32 when it has none)."""
    return val.shadow if val.shadow is not None else widen(val.value)


def materialize(val: Val) -> Any:
    """The shadow as an array for a floating value (loop carries need a fixed structure)."""
    return widened(val) if is_floating(val.value) else None


def shadow_outputs(eqn: jex.JaxprEqn, ins: Sequence[Val], outs: Sequence[Any]) -> list:
    """The shadow of each output of ``eqn`` (None where it equals the value)."""
    floating = [is_floating(out) for out in outs]
    if not _shadowed(eqn, ins, outs, floating):
        return [None] * len(outs)
    if eqn.primitive.name in _ROUNDING and is_floating(ins[0].value):
        target = jnp.float32 if is_narrow(outs[0]) else outs[0].dtype
        return [widened(ins[0]).astype(target)]
    # A primitive that insists on its dtypes restarts the shadow.
    return _twins(eqn, [widened(v) for v in ins], outs, floating)


def _shadowed(eqn: jex.JaxprEqn, ins: Sequence[Val], outs: Sequence[Any], floating) -> bool:
    """Whether some output's shadow may differ from it."""
    if not any(floating) or eqn.primitive.name in NO_SHADOW:
        return False
    # 32-bit arithmetic on exact inputs gives the value itself.
    return any(v.shadow is not None for v in ins) or any(is_narrow(out) for out in outs)


def _twins(eqn: jex.JaxprEqn, args: list, outs: Sequence[Any], wanted: Sequence[bool]) -> list:
    """``eqn`` bound in float32 on ``args``, per output if ``wanted``; None where it fails."""
    try:
        params, risky = twin_params(eqn)
        if risky or every_twin_checked():
            check_lowers(eqn, params, args)
        twins = compat.bind_eqn(eqn.replace(params=params), args)
    except Exception:  # a primitive that insists on its dtypes
        return [None] * len(outs)
    return [
        twin if want and np.shape(twin) == np.shape(out) else None
        for out, twin, want in zip(outs, twins, wanted, strict=True)
    ]


def local_twins(eqn: jex.JaxprEqn, ins: Sequence[Val], outs: Sequence[Any], shadows) -> list:
    """Each 16-bit output of ``eqn`` computed in float32 on its *real* inputs, or None.

    The shadow carries float32 values along the whole program; this twin restarts
    from the 16-bit inputs with their zero and subnormal values as zero, so comparing
    it with the output tells what this op flushed (a value an earlier op made zero or
    subnormal is not counted again). None where it equals the shadow (no input has a
    shadow) or where the output is not 16-bit; where the twin fails, the shadow alone
    decides.
    """
    wanted = [
        shadow is not None and is_narrow(out) for out, shadow in zip(outs, shadows, strict=True)
    ]
    if not any(wanted) or all(v.shadow is None for v in ins):
        return [None] * len(outs)
    if eqn.primitive.name in _ROUNDING:
        return [widen(ins[0].value)]
    return _twins(eqn, [_wide_normal(v.value) for v in ins], outs, wanted)
