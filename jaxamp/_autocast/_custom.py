"""autocast's rule for ``custom_jvp`` calls (``jax.nn.relu``, ``gelu``, ``jnp.linalg.pinv``).

The call is rebuilt with ``jax.custom_jvp`` around its primal jaxpr and its JVP
rule's jaxpr, both evaluated under autocast, so the rule is kept. Two things
decide how:

- **Values the function closes over** (the equation's ``num_consts`` leading
  operands, such as ``pinv``'s traced ``rtol``) become explicit arguments of the
  rebuilt function, and their tangents are dropped: JAX differentiates a
  custom_jvp function only with respect to its explicit inputs. The JVP rule's
  jaxpr, traced lazily from the equation, closes over the tracers of the trace
  that recorded the user's function, which has ended (evaluating them raises
  ``UnexpectedTracerError``, in plain JAX too); they are replaced by the
  equation's constant operands, the values of this evaluation.
- **A float32 core**: a function built around a factorization or solve (a
  primitive of ``LINALG_PRIMITIVES`` whose rule runs it in float32, as
  ``pinv``'s SVD) runs as a whole, primal and JVP rule, in float32, and its
  results are PINNED. Its matmuls only make sense with the factorization's
  precision: ``pinv``'s gradient on a matrix of condition number 2000 was 14x
  further from float32 than the hand-cast program's with 16-bit matmuls around
  a float32 SVD. A call (a ``jit``, a ``checkpoint``) built on one runs in
  float32 the same way (``around_float32_core``, used by
  ``_control_flow._handle_call``): ``jnp.linalg.lstsq`` is a jit around an SVD,
  whose float16 residual was exactly 0 on a wide matrix, its gradient NaN.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np

from jaxamp._autocast._caster import Autocaster, float32, keep
from jaxamp._autocast._values import PINNED, PLAIN, aval, cast, promote
from jaxamp._casting import is_floating
from jaxamp._engine import _compat as compat
from jaxamp._engine._visit import walk
from jaxamp._policy import get_policy

__all__ = ["LINALG_PRIMITIVES", "around_float32_core", "handle_custom_jvp"]


# Factorizations and solves: float32 (no 16-bit kernels on most backends), and a
# custom_jvp function or a call built around one (``pinv``, ``lstsq``) runs as a
# whole, rule included, in float32 (here). ``custom_linear_solve``
# (``solve``) is "keep". ``_rules`` reads this list for its table.
LINALG_PRIMITIVES = (
    "cholesky",
    "eig",
    "eigh",
    "lu",
    "qr",
    "svd",
    "schur",
    "hessenberg",
    "householder_product",
    "triangular_solve",
    "tridiagonal",
    "tridiagonal_solve",
    "custom_linear_solve",
)


_F32 = np.dtype(np.float32)


def handle_custom_jvp(ac: Autocaster, eqn: jex.JaxprEqn, ins: list[tuple]) -> list[tuple]:
    """The rule of ``custom_jvp_call`` (see the module docstring)."""
    parts = compat.custom_jvp_parts(eqn)
    return around_float32_core(
        ac, eqn, parts.call_jaxpr, ins, lambda ac, ins: _rebuilt(ac, eqn, parts, ins)
    )


def around_float32_core(
    ac: Autocaster, eqn: jex.JaxprEqn, body: jex.ClosedJaxpr, ins: list[tuple], run
) -> list[tuple]:
    """``run(ac, ins)``, or, where ``body`` has a float32 core and the compute dtype
    is 16-bit, ``run`` under the ``"float32"`` policy on float32 operands, its
    results PINNED (where an operand was not PLAIN)."""
    if ac.compute_dtype.itemsize >= 4 or not _has_float32_core(ac, body):
        return run(ac, ins)
    pinned = any(r != PLAIN for v, r in ins if is_floating(v))
    ins = [(_to_float32(v, var), PLAIN) for (v, _), var in zip(ins, eqn.invars, strict=True)]
    outs = run(_float32_autocaster(ac), ins)
    if pinned:
        return [(v, PINNED if is_floating(v) else PLAIN) for v, _ in outs]
    return outs


def _rebuilt(ac: Autocaster, eqn: jex.JaxprEqn, parts: Any, ins: list[tuple]) -> list[tuple]:
    n = parts.num_consts
    values, roles = [v for v, _ in ins], [r for _, r in ins]
    box: list = []
    primal = ac.function_of(parts.call_jaxpr, (), roles, box)
    primal.__name__ = primal.__qualname__ = parts.name  # profiles and jaxprs keep it
    out_types = ac.probe(parts.call_jaxpr, (), [(aval(v), r) for v, r in ins])
    traced_consts = [var.aval for var in eqn.invars[:n]]

    def jvp(primals, tangents):
        consts, primals, tangents = primals[:n], primals[n:], tangents[n:]
        zeros = [compat.is_float0(t) for t in tangents]
        closed, out_zeros = parts.jvp_jaxpr(zeros)
        closed = _current_consts(closed, traced_consts, consts)
        if closed is None:  # the rule closes over a value the call does not pass
            return jax.jvp(lambda *a: primal(*consts, *a), list(primals), list(tangents))
        nonzero = [(t, r) for t, r, z in zip(tangents, roles[n:], zeros, strict=True) if not z]
        rule_ac = ac.with_transposable_matmuls()  # JAX transposes the tangent products under grad
        outs = rule_ac.eval_jaxpr(closed, [*zip(primals, roles[n:], strict=True), *nonzero])
        return _jvp_outputs([v for v, _ in outs], out_zeros, out_types)

    fun = jax.custom_jvp(primal)
    fun.defjvp(jvp)
    outs = fun(*values)
    return list(zip(outs, [r for _, r in out_types], strict=True))


def _jvp_outputs(outs: list, out_zeros: list[bool], out_types: list) -> tuple[list, list]:
    """The rule's (primal outputs, tangents) in the dtypes of the rebuilt primal."""
    primal_outs, nonzero_out = outs[: len(out_zeros)], iter(outs[len(out_zeros) :])
    p_out, t_out = [], []
    for p, zero, (dtype, _) in zip(primal_outs, out_zeros, out_types, strict=True):
        p = cast(p, dtype) if is_floating(p) else p
        p_out.append(p)
        if not jnp.issubdtype(dtype, jnp.inexact):
            t_out.append(compat.float0_zeros(np.shape(p)))
        elif zero:
            t_out.append(jnp.zeros(np.shape(p), dtype))
        else:
            t_out.append(cast(next(nonzero_out), dtype))
    return p_out, t_out


def _current_consts(
    closed: jex.ClosedJaxpr, traced: Sequence[Any], consts: Sequence[Any]
) -> jex.ClosedJaxpr | None:
    """``closed`` with its ended trace's tracers replaced by ``consts``, or None.

    The rule's tracer constants are the function's closed-over values, in the
    order the function met them; they are matched to the equation's constant
    operands (``traced``: their avals when recorded) in order. None when they do
    not match (the rule closes over a value the function does not use).
    """
    stale = [i for i, c in enumerate(closed.consts) if isinstance(c, jax.core.Tracer)]
    if not stale:
        return closed
    shapes = [(np.shape(closed.consts[i]), np.dtype(closed.consts[i].dtype)) for i in stale]
    if shapes != [(tuple(a.shape), np.dtype(a.dtype)) for a in traced]:
        return None
    new = list(closed.consts)
    for i, value in zip(stale, consts, strict=True):
        new[i] = value
    return jex.ClosedJaxpr(closed.jaxpr, new)


def _has_float32_core(ac: Autocaster, closed: jex.ClosedJaxpr) -> bool:
    """Whether ``closed`` runs a factorization or solve that its rule keeps out of 16 bits."""
    wide = (float32, keep)
    return any(
        eqn.primitive.name in LINALG_PRIMITIVES and ac.table.get(eqn.primitive.name) in wide
        for eqn, _ in walk(closed.jaxpr)
    )


def _to_float32(value: Any, var: Any) -> Any:
    """A floating operand in (at least) float32 and its traced dtype."""
    if not is_floating(value):
        return value
    return cast(value, promote([_F32, np.dtype(var.aval.dtype)]))


def _float32_autocaster(ac: Autocaster) -> Autocaster:
    # The rule runs as under the "float32" policy: as traced, with autocast's
    # rebuilt custom_jvp calls inside (their constants current, see above).
    child = Autocaster(get_policy("float32"), ac.table, None)
    child.transposable = ac.transposable
    return child
