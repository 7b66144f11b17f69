"""An equation's float32 twin: the same primitive, its parameters retyped for float32 operands.

The shadow (``_shadow``) re-binds each equation with float32 operands. Most
parameters do not care about the operand dtype, but some are typed for the
equation's own dtype and make a float32 bind fail, often only when XLA compiles
the whole program (outside any ``try``):

- a parameter naming a 16-bit output dtype (``convert_element_type``'s
  ``new_dtype``, a matmul's ``preferred_element_type``) becomes float32;
- a matmul ``precision`` that is a ``jax.lax.DotAlgorithmPreset`` names its operand
  types (``F16_F16_F32``): the twin uses the default precision, float32 operands;
- a sub-jaxpr typed for 16 bits (the combiner of ``scatter-add``/``scatter-max``,
  ``reduce``, ``reduce_window``, ``reduce_precision``-free bodies) is traced again for
  float32 operands.

``twin_params`` returns the parameters, or raises ``NoTwin``; ``check_lowers``
lowers one retyped equation on its own (at trace time, cheaply) for the
equations whose parameters held a sub-jaxpr or an algorithm, so that a twin that
XLA would reject falls back to "no shadow" instead of crashing the report.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np

from jaxamp._casting import is_narrow, widen
from jaxamp._engine import _compat as compat
from jaxamp._engine._interpreter import eval_jaxpr

__all__ = ["NoTwin", "check_lowers", "checking_every_twin", "every_twin_checked", "twin_params"]

# Parameters that name an output dtype (a 16-bit one is widened in the twin).
DTYPE_PARAMS = ("new_dtype", "preferred_element_type", "out_dtype", "dtype")


_CHECK_EVERY_TWIN = contextvars.ContextVar("jaxamp_check_every_twin", default=False)


@contextlib.contextmanager
def checking_every_twin() -> Iterator[None]:
    """Lowers every twin on its own before using it: the slow, safe way to trace.

    The report uses it only after the instrumented program failed to lower, so a
    primitive this module does not know how to retype costs time, not a crash.
    """
    token = _CHECK_EVERY_TWIN.set(True)
    try:
        yield
    finally:
        _CHECK_EVERY_TWIN.reset(token)


def every_twin_checked() -> bool:
    return _CHECK_EVERY_TWIN.get()


class NoTwin(Exception):
    """The equation has no float32 twin (its shadow restarts from the real value)."""


def twin_params(eqn: jex.JaxprEqn) -> tuple[dict, bool]:
    """``(params, risky)``: ``eqn``'s parameters for float32 operands.

    ``risky`` says a sub-jaxpr or an algorithm was retyped, so the twin should be
    lowered once on its own before it goes into the program (``check_lowers``).
    """
    params, risky = {}, False
    for name, value in eqn.params.items():
        if name in DTYPE_PARAMS and is_narrow(value):
            value = jnp.float32
        elif name == "precision" and isinstance(value, jax.lax.DotAlgorithmPreset):
            value, risky = None, True
        elif isinstance(value, (jex.Jaxpr, jex.ClosedJaxpr)):
            value, risky = _retyped(value), True
        params[name] = value
    return params, risky


def _wide_aval(aval: Any) -> jax.ShapeDtypeStruct:
    dtype = jnp.float32 if is_narrow(aval.dtype) else aval.dtype
    return jax.ShapeDtypeStruct(aval.shape, dtype)


def _apply_twin(eqn: jex.JaxprEqn, ins: list[Any]) -> list[Any]:
    params, _ = twin_params(eqn)
    return compat.bind_eqn(eqn.replace(params=params), ins)


def _retyped(jaxpr: jex.Jaxpr | jex.ClosedJaxpr) -> jex.Jaxpr | jex.ClosedJaxpr:
    """``jaxpr`` traced again with its 16-bit floating inputs (and literals) as float32."""
    closed = compat.as_closed(jaxpr)
    if not any(is_narrow(getattr(v.aval, "dtype", None)) for v in closed.jaxpr.invars):
        return jaxpr
    avals = [_wide_aval(v.aval) for v in closed.jaxpr.invars]

    def fun(*args):
        return eval_jaxpr(closed, args, _apply_twin, lift=widen)

    try:
        new = jax.make_jaxpr(fun)(*avals)
    except Exception as err:  # any rejection means "no twin"
        raise NoTwin(str(err)) from err
    if isinstance(jaxpr, jex.ClosedJaxpr):
        return new
    if new.consts:  # an open jaxpr cannot take new constants
        raise NoTwin("the retyped sub-jaxpr closes over constants")
    return new.jaxpr


def check_lowers(eqn: jex.JaxprEqn, params: dict, args: Sequence[Any]) -> None:
    """Raises ``NoTwin`` unless the twin of ``eqn`` lowers on float32 operands like ``args``."""
    twin = eqn.replace(params=params)
    avals = [jax.ShapeDtypeStruct(np.shape(a), a.dtype) for a in args]
    try:
        jax.jit(lambda *a: compat.bind_eqn(twin, a)).lower(*avals)
    except Exception as err:  # any rejection means "no twin"
        raise NoTwin(str(err)) from err
