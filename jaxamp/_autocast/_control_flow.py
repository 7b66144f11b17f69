"""autocast's rules for higher-order primitives: jit, custom_jvp, scan, while, cond, remat,
shard_map (and, from ``_scatter``, the scatter family).

Each rebuilds the primitive with JAX's public API (``jax.jit``, ``jax.custom_jvp``,
``lax.scan``, ``lax.while_loop``, ``lax.switch``, ``lax.platform_dependent``,
``jax.checkpoint``, ``jax.shard_map``) around a
function that evaluates the inner jaxpr with autocast, so the structure (and a
custom_jvp's rule, a checkpoint's policy) is kept. The structure (operands split
into consts, carry and xs; how a primitive is built again) is the engine's
(``_engine._control``): one rule per shape (call, loop, branch). Loop carries and
cond outputs need one dtype for every iteration or branch: it is found by tracing
the body abstractly (``jax.eval_shape``) until the carried dtypes stop changing
(``_control.carry_fixpoint``).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from jaxamp._autocast._caster import keep
from jaxamp._autocast._custom import around_float32_core, handle_custom_jvp
from jaxamp._autocast._scatter import SCATTER_RULES
from jaxamp._autocast._values import PINNED, PLAIN, aval, cast, promote
from jaxamp._autocast._wide import accumulator_carries
from jaxamp._casting import is_floating
from jaxamp._engine import _compat as compat
from jaxamp._engine import _control as control

__all__ = ["HIGHER_ORDER_RULES"]


def _split(ins: Sequence[tuple]) -> tuple[list, list]:
    return [v for v, _ in ins], [r for _, r in ins]


def _handle_call(ac, eqn, ins):
    # A call built on a factorization or solve (jnp.linalg.lstsq's jit) runs as a
    # whole in float32, as a custom_jvp function built on one does (_custom.py).
    body = control.call_of(eqn).body
    return around_float32_core(ac, eqn, body, ins, lambda ac, ins: _call(ac, eqn, ins))


def _call(ac, eqn, ins):
    call = control.call_of(eqn)
    if call.rebuild is None:
        return ac.eval_jaxpr(call.body, ins)
    values, roles = _split(ins)
    box: list = []
    if call.policy is not None:  # dots_saveable & co. must see dot_generals
        ac = ac.with_transposable_matmuls()
    fun = _noting_constants(ac, ac.function_of(call.body, (), roles, box), ins)
    if call.name is not None:
        fun.__name__ = fun.__qualname__ = call.name
    outs = call.rebuild(fun)(*values)
    return list(zip(outs, box, strict=True))


def _noting_constants(ac, fun, ins):
    # A constant passed into a call (jnp.where's fill value into its jit) is a
    # tracer inside: its values are noted, so the constant rule sees it there.
    arrays = [ac.constants.values_of(v) if r == PLAIN else None for v, r in ins]

    def noting(*args):
        for arg, array in zip(args, arrays, strict=True):
            ac.constants.note(arg, array)
        return fun(*args)

    noting.__name__ = noting.__qualname__ = fun.__name__
    return noting


def _join(carry: tuple, out: tuple) -> tuple:
    # Loop-carried (dtype, role): a body that moves a value to another dtype on
    # purpose (a role above PLAIN) decides; otherwise the traced dtype stays.
    (in_dtype, in_role), (out_dtype, out_role) = carry, out
    if out_role == PLAIN:
        return carry
    dtype = out_dtype if in_role == PLAIN else promote([in_dtype, out_dtype])
    return np.dtype(dtype), max(in_role, out_role)


def _carry_types(ac, loop: control.Loop) -> list[tuple]:
    """The (dtype, role) of each carry of ``loop`` over all its iterations."""
    init = loop.carry
    types = [(np.dtype(v.dtype) if is_floating(v) else None, r) for v, r in init]
    # A float32 accumulator (running sum, EMA, Euler step) stays float32: see _wide.
    n_consts = len(loop.consts)
    traced = loop.body.jaxpr.invars[n_consts : n_consts + loop.n_carry]
    accumulators = accumulator_carries(loop.body.jaxpr, n_consts, loop.n_carry)
    fixed = [
        acc and t[0] is not None and np.dtype(var.aval.dtype).itemsize > ac.compute_dtype.itemsize
        for acc, t, var in zip(accumulators, types, traced, strict=True)
    ]
    types = [
        (np.dtype(var.aval.dtype), PINNED) if f else t
        for f, t, var in zip(fixed, types, traced, strict=True)
    ]
    x_types = [(jax.ShapeDtypeStruct(np.shape(v)[1:], v.dtype), r) for v, r in loop.xs]

    def body(types):
        avals = [(aval(v, dt), r) for (v, _), (dt, r) in zip(init, types, strict=True)]
        return ac.probe(loop.body, loop.consts, avals + x_types)

    def join(types, outs):
        return [
            _join(t, o) if t[0] is not None and not f else t
            for t, o, f in zip(types, outs, fixed, strict=True)
        ]

    return control.carry_fixpoint(body, types, join)


def _cast_to_types(values, types):
    return [v if dt is None else cast(v, dt) for v, (dt, _) in zip(values, types, strict=True)]


def _handle_loop(ac, eqn, ins):
    loop = control.loop_of(eqn, ins)
    if loop.batched_predicate():
        # vmap of a while loop with a batched predicate (jax.scipy.special.expi):
        # lax.while_loop cannot rebuild it; running it as traced is always correct.
        return keep(ac, eqn, ins)
    types = _carry_types(ac, loop)
    carry_roles = [r for _, r in types]
    xs, x_roles = _split(loop.xs)
    box: list = []

    def body(carry, x):
        args = [*zip(carry, carry_roles, strict=True), *zip(x, x_roles, strict=True)]
        outs = ac.eval_jaxpr(loop.body, [*loop.consts, *args])
        box[:] = [r for _, r in outs[loop.n_carry :]]
        new_carry = _cast_to_types([v for v, _ in outs[: loop.n_carry]], types)
        return new_carry, [v for v, _ in outs[loop.n_carry :]]

    def cond(carry):
        args = [*loop.cond_consts, *zip(carry, carry_roles, strict=True)]
        return ac.eval_jaxpr(loop.cond, args)[0][0]

    init = _cast_to_types([v for v, _ in loop.carry], types)
    carry, ys = loop.rebuild(body, init, xs, cond)
    return [*zip(carry, carry_roles, strict=True), *zip(ys, box, strict=True)]


def _handle_cond(ac, eqn, ins):
    branch = control.branch_of(eqn, ins)
    (index, _), operands = branch.index, branch.operands
    types_in = [(aval(v), r) for v, r in operands]
    per_branch = [ac.probe(b, (), types_in) for b in branch.branches]
    out_types = []
    for outs in zip(*per_branch, strict=True):
        dtypes = {dt for dt, _ in outs}
        out_types.append((promote(sorted(dtypes, key=str)), max(r for _, r in outs)))
    values, roles = _split(operands)

    def make(body):
        def fun(*args):
            outs = ac.eval_jaxpr(body, list(zip(args, roles, strict=True)))
            return _cast_to_types([v for v, _ in outs], out_types)

        return fun

    outs = branch.rebuild(index, [make(b) for b in branch.branches], *values)
    return list(zip(outs, [r for _, r in out_types], strict=True))


def _handle_shard_map(ac, eqn, ins):
    # The body runs per shard; rewriting it changes dtypes, never shapes or axes,
    # so the original specs stay valid for the rewritten body.
    parts = compat.shard_map_parts(eqn)
    values, roles = _split(ins)
    box: list = []
    body = ac.function_of(parts.jaxpr, (), roles, box)
    outs = jax.shard_map(
        lambda *args: tuple(body(*args)),
        mesh=parts.mesh,
        in_specs=parts.in_specs,
        out_specs=parts.out_specs,
        axis_names=parts.axis_names,
        check_vma=parts.check_vma,
    )(*values)
    return list(zip(outs, box, strict=True))


# Primitive name -> rule, for the primitives AUTOCAST_RULES names "recurse" (and
# the call primitives of every supported JAX, which a user may name "recurse"):
# the engine's skeleton, with custom_jvp rebuilt with its rule, custom_vjp left to
# its own rules (it is not entered), shard_map and the scatter family added.
HIGHER_ORDER_RULES = control.structured_rules(
    call=_handle_call,
    loop=_handle_loop,
    branch=_handle_cond,
    extra={
        "custom_jvp_call": handle_custom_jvp,
        "custom_vjp_call": None,
        "shard_map": _handle_shard_map,
        **SCATTER_RULES,
    },
)
