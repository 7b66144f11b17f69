"""Where 16 bits would break a float32 value: the exceptions to "follow".

A careful engineer converting code to 16 bits by hand casts parameters and
inputs to 16 bits but keeps in float32 what 16 bits would break:

- powers and products that a sum consumes (norm statistics, ``mean(x**2)``): in
  float16 a channel with ``|x| >= 256`` squares to inf, in bfloat16 Flax's fast
  variance ``E[x^2] - E[x]^2`` cancels. Only the reduction after them was
  float32; now the products are too (they fuse into the reduction, so nothing
  16-bit is stored less);
- loop accumulators (a running sum, an EMA, an Euler step): a float32 carry the
  body updates arithmetically from its old value stays float32, as JAX's own
  promotion (float32 + bfloat16 -> float32) keeps it in hand-cast code; a
  carry recomputed through a matmul or a nonlinearity (an RNN's hidden state)
  still takes the body's 16-bit dtype;
- divisors: ``x / (n + 1e-5)`` with a traced float32 ``n`` divides in float32
  (in float16, 1/1e-5 is inf);
- constants the compute dtype cannot hold: an ``eps`` of ``1e-8`` is 0 in
  float16, so ``log(p + 1e-8)`` becomes ``log(0)``, and a scale of ``1e5``
  saturates to 65504 (35% too little). An equation meeting such a constant runs
  in float32, as the hand-cast program (a 16-bit activation times a float32
  array) does. A constant stays one through a ``jit`` it is passed into and
  through broadcasts, reshapes and converts (``jnp.where``'s fill value:
  ``KnownConstants``). Operands whose values cannot be looked at (parameters,
  traced values such as a mask bias computed from the inputs) saturate instead,
  see ``_values.saturate_finite``: a mask fill value stays finite, and a fully
  masked row with it.

The measurements behind these choices are in docs/api/autocast.md.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.extend.core as jex
import numpy as np

__all__ = ["KnownConstants", "accumulator_carries", "breaks_in", "feeds_reduction"]

# Powers and products computed in float32 when a float32 sum consumes them.
_POWERS = frozenset({"square", "integer_pow", "mul"})
# Reductions that run in float32 (the "float32" rule).
_SUMS = frozenset({"reduce_sum", "cumsum", "reduce_window_sum", "reduce_prod"})
# What a value passes through on its way into a sum without being recomputed.
_SHAPE = frozenset(
    {
        "convert_element_type",
        "reshape",
        "squeeze",
        "expand_dims",
        "broadcast_in_dim",
        "transpose",
        "slice",
        "dynamic_slice",
        "rev",
        "copy",
        "copy_p",
    }
)
# Operations a value passes through around a loop without being recomputed by a
# matmul or a nonlinearity.
_ARITHMETIC = _SHAPE | {
    "add",
    "add_any",
    "sub",
    "mul",
    "div",
    "neg",
    "square",
    "integer_pow",
    "select_n",
}
_ACCUMULATE = frozenset({"add", "add_any", "sub"})


def _consumers(jaxpr: jex.Jaxpr) -> dict[Any, list[jex.JaxprEqn]]:
    users: dict[Any, list[jex.JaxprEqn]] = {}
    for eqn in jaxpr.eqns:
        for atom in eqn.invars:
            if isinstance(atom, jex.Var):
                users.setdefault(atom, []).append(eqn)
    return users


def feeds_reduction(jaxpr: jex.Jaxpr) -> set[int]:
    """``id``s of the power/product equations whose result a float32 sum consumes.

    Directly, through shape operations and converts (``mean(square(x).reshape(...))``),
    or, for a power, through one product (``sum(x**2 * mask)``). Not through other
    arithmetic: a scale applied long before some later sum stays with the activation.
    """
    users = _consumers(jaxpr)
    memo: dict[Any, bool] = {}

    def reaches_sum(var: Any) -> bool:
        if var not in memo:
            memo[var] = False  # jaxprs are acyclic; this only guards re-entry
            for eqn in users.get(var, ()):
                name = eqn.primitive.name
                if name in _SUMS or (name in _SHAPE and any(reaches_sum(o) for o in eqn.outvars)):
                    memo[var] = True
                    break
        return memo[var]

    def product_reaches_sum(var: Any) -> bool:
        return any(
            eqn.primitive.name == "mul" and any(reaches_sum(o) for o in eqn.outvars)
            for eqn in users.get(var, ())
        )

    wide = set()
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name not in _POWERS:
            continue
        if any(reaches_sum(o) for o in eqn.outvars) or (
            name != "mul" and any(product_reaches_sum(o) for o in eqn.outvars)
        ):
            wide.add(id(eqn))
    return wide


def accumulator_carries(jaxpr: jex.Jaxpr, first_carry: int, n_carry: int) -> list[bool]:
    """For each loop carry: is its new value an add/sub chain on its old value?

    ``jaxpr`` is a scan or while body whose carries are the inputs
    ``first_carry : first_carry + n_carry`` and the first ``n_carry`` outputs.
    """
    producer = {id(o): eqn for eqn in jaxpr.eqns for o in eqn.outvars}

    def accumulates(out: Any, carry_in: Any) -> bool:
        # Whether ``out`` is computed from ``carry_in`` by arithmetic alone, with
        # at least one add or sub on the way.
        stack, seen = [(out, False)], set()
        while stack:
            var, added = stack.pop()
            if var is carry_in:
                if added:
                    return True
                continue
            eqn = producer.get(id(var))
            if eqn is None or (id(eqn), added) in seen or eqn.primitive.name not in _ARITHMETIC:
                continue
            seen.add((id(eqn), added))
            now = added or eqn.primitive.name in _ACCUMULATE
            stack.extend((a, now) for a in eqn.invars if isinstance(a, jex.Var))
        return False

    carries_in = jaxpr.invars[first_carry : first_carry + n_carry]
    return [
        isinstance(out, jex.Var) and accumulates(out, var)
        for var, out in zip(carries_in, jaxpr.outvars[:n_carry], strict=True)
    ]


def _concrete(value: Any) -> np.ndarray | None:
    if isinstance(value, (np.ndarray, np.generic)):
        return np.asarray(value)
    concrete = isinstance(value, jax.Array) and not isinstance(value, jax.core.Tracer)
    # A typed PRNG key (an extended dtype) has no NumPy values to look at.
    numeric = concrete and not jax.dtypes.issubdtype(value.dtype, jax.dtypes.extended)
    if numeric and value.size <= 4096:  # a constant worth looking at, not a weight matrix
        return np.asarray(value)
    return None


# Equations whose output holds its first operand's values, only shaped or typed
# differently (``neg`` negated): a constant stays one through them.
_CARRY_VALUES = frozenset(
    {
        "broadcast_in_dim",
        "reshape",
        "squeeze",
        "expand_dims",
        "transpose",
        "rev",
        "copy",
        "copy_p",
        "convert_element_type",
        "neg",
    }
)


class KnownConstants:
    """The values of the constants of one autocast call, traced or not.

    A literal or a small closed-over array can be looked at directly. A
    constant passed into a ``jit`` (``jnp.where``'s fill value) is a tracer
    inside it, and so is its broadcast: ``note`` records the values of such a
    tracer (the tracer is kept with them, so its ``id`` is not reused), and
    ``carry`` records the outputs of ``_CARRY_VALUES`` equations on a constant.
    """

    def __init__(self) -> None:
        self._known: dict[int, tuple[Any, np.ndarray]] = {}

    def values_of(self, value: Any) -> np.ndarray | None:
        """The values of a constant (for a broadcast: those broadcast), else None."""
        array = _concrete(value)
        if array is not None:
            return array
        entry = self._known.get(id(value))
        return entry[1] if entry is not None and entry[0] is value else None

    def note(self, value: Any, array: np.ndarray | None) -> None:
        if array is not None and isinstance(value, jax.core.Tracer):
            self._known[id(value)] = (value, array)

    def carry(self, eqn: jex.JaxprEqn, values: list, outs: list) -> None:
        """Records ``outs`` of an equation that carries a constant's values."""
        name = eqn.primitive.name
        if name not in _CARRY_VALUES or not values or len(outs) != 1:
            return
        array = self.values_of(values[0])
        if array is None:
            return
        with np.errstate(over="ignore", invalid="ignore"):  # a 16-bit view may be inf
            array = -array if name == "neg" else array.astype(outs[0].dtype)
        self.note(outs[0], array)


def breaks_in(array: np.ndarray | None, dtype: np.dtype) -> bool:
    """Whether a constant's values (``KnownConstants.values_of``) lose their meaning in ``dtype``.

    True when some nonzero finite value becomes 0 or loses more than a few bits
    of precision as a subnormal (``1e-8`` in float16), or lies beyond ``dtype``'s
    largest finite value (``1e5`` in float16, which would saturate or become
    inf). Infinities and NaN keep their meaning in any floating dtype.
    """
    if array is None or array.size == 0:
        return False
    info = jax.numpy.finfo(dtype)
    magnitude = np.abs(array.astype(np.float64))
    finite = np.isfinite(magnitude)
    underflows = (magnitude > 0) & (magnitude < float(info.tiny))
    overflows = magnitude > float(info.max)
    return bool(np.any(finite & (underflows | overflows)))
