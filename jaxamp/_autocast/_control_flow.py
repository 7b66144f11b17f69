"""autocast's rules for higher-order primitives: jit, custom_jvp, scan, while, cond, remat,
shard_map (and, from ``_scatter``, the scatter family).

Each rebuilds the primitive with JAX's public API (``jax.jit``, ``jax.custom_jvp``,
``lax.scan``, ``lax.while_loop``, ``lax.switch``, ``lax.platform_dependent``,
``jax.checkpoint``, ``jax.shard_map``) around a
function that evaluates the inner jaxpr with autocast, so the structure (and a
custom_jvp's rule, a checkpoint's policy) is kept. Loop carries and cond outputs
need one dtype for every iteration or branch: it is found by tracing the body
abstractly (``jax.eval_shape``) until the carried dtypes stop changing.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from jaxamp._autocast._caster import keep
from jaxamp._autocast._custom import handle_custom_jvp
from jaxamp._autocast._scatter import SCATTER_RULES
from jaxamp._autocast._values import PINNED, PLAIN, aval, cast, is_float, promote
from jaxamp._autocast._wide import accumulator_carries
from jaxamp._engine import _compat as compat

__all__ = ["CARRY_TYPE_ROUNDS", "HIGHER_ORDER_RULES"]

# How often a loop body is traced abstractly to find the (dtype, role) of its
# carries. It terminates: ``_join`` only moves a carry up a finite order (its
# role only rises, PLAIN -> ACTIVATION -> PINNED, and once above PLAIN its dtype
# only promotes), and a round that moves nothing ends the search. The bound caps the tracing cost of
# long dependency chains between carries; if it is reached first, the carries
# are still cast to the last types found, so the loop stays well-typed.
CARRY_TYPE_ROUNDS = 4


def _split(ins: Sequence[tuple]) -> tuple[list, list]:
    return [v for v, _ in ins], [r for _, r in ins]


def _handle_jit(ac, eqn, ins):
    parts = compat.jit_parts(eqn)
    values, roles = _split(ins)
    box: list = []
    fun = ac.function_of(parts.jaxpr, (), roles, box)
    fun.__name__ = fun.__qualname__ = parts.name
    outs = jax.jit(fun, inline=parts.inline)(*values)
    return list(zip(outs, box, strict=True))


def _handle_call(ac, eqn, ins):
    return ac.eval_jaxpr(compat.call_jaxpr(eqn), ins)


def _handle_remat(ac, eqn, ins):
    parts = compat.remat_parts(eqn)
    values, roles = _split(ins)
    box: list = []
    if parts.policy is not None:  # dots_saveable & co. must see dot_generals
        ac = ac.with_transposable_matmuls()
    fun = ac.function_of(parts.jaxpr, (), roles, box)
    outs = jax.checkpoint(fun, prevent_cse=parts.prevent_cse, policy=parts.policy)(*values)
    return list(zip(outs, box, strict=True))


def _join(carry: tuple, out: tuple) -> tuple:
    # Loop-carried (dtype, role): a body that moves a value to another dtype on
    # purpose (a role above PLAIN) decides; otherwise the traced dtype stays.
    (in_dtype, in_role), (out_dtype, out_role) = carry, out
    if out_role == PLAIN:
        return carry
    dtype = out_dtype if in_role == PLAIN else promote([in_dtype, out_dtype])
    return np.dtype(dtype), max(in_role, out_role)


def _fixpoint(ac, closed, prefix, init, extra_types, n_carry) -> list[tuple]:
    types = [(np.dtype(v.dtype) if is_float(v) else None, r) for v, r in init]
    # A float32 accumulator (running sum, EMA, Euler step) stays float32: see _wide.
    traced = closed.jaxpr.invars[len(prefix) : len(prefix) + n_carry]
    fixed = [
        acc and t[0] is not None and np.dtype(var.aval.dtype).itemsize > ac.compute_dtype.itemsize
        for acc, t, var in zip(
            accumulator_carries(closed.jaxpr, len(prefix), n_carry), types, traced, strict=True
        )
    ]
    types = [
        (np.dtype(var.aval.dtype), PINNED) if f else t
        for f, t, var in zip(fixed, types, traced, strict=True)
    ]
    for _ in range(CARRY_TYPE_ROUNDS):
        avals = [
            (aval(v, dt), r) for (v, _), (dt, r) in zip(init, types, strict=True)
        ] + extra_types
        outs = ac.probe(closed, prefix, avals)[:n_carry]
        new = [
            _join(t, o) if t[0] is not None and not f else t
            for t, o, f in zip(types, outs, fixed, strict=True)
        ]
        if new == types:
            break
        types = new
    return types


def _cast_to_types(values, types):
    return [v if dt is None else cast(v, dt) for v, (dt, _) in zip(values, types, strict=True)]


def _handle_scan(ac, eqn, ins):
    p = compat.scan_parts(eqn)
    consts = list(ins[: p.num_consts])
    init = list(ins[p.num_consts : p.num_consts + p.num_carry])
    xs = list(ins[p.num_consts + p.num_carry :])
    x_types = [(jax.ShapeDtypeStruct(np.shape(v)[1:], v.dtype), r) for v, r in xs]
    types = _fixpoint(ac, p.jaxpr, consts, init, x_types, p.num_carry)
    carry_roles = [r for _, r in types]
    x_roles = [r for _, r in xs]
    box: list = []

    def body(carry, x):
        args = [*zip(carry, carry_roles, strict=True), *zip(x, x_roles, strict=True)]
        outs = ac.eval_jaxpr(p.jaxpr, [*consts, *args])
        box[:] = [r for _, r in outs[p.num_carry :]]
        new_carry = _cast_to_types([v for v, _ in outs[: p.num_carry]], types)
        return new_carry, [v for v, _ in outs[p.num_carry :]]

    init_values = _cast_to_types([v for v, _ in init], types)
    carry, ys = jax.lax.scan(
        body,
        init_values,
        [v for v, _ in xs],
        length=p.length,
        reverse=p.reverse,
        unroll=p.unroll,
    )
    return [*zip(carry, carry_roles, strict=True), *zip(ys, box, strict=True)]


def _handle_while(ac, eqn, ins):
    p = compat.while_parts(eqn)
    if p.cond_jaxpr.out_avals[0].shape != ():
        # vmap of a while loop with a batched predicate (jax.scipy.special.expi):
        # lax.while_loop cannot rebuild it; running it as traced is always correct.
        return keep(ac, eqn, ins)
    cond_consts = list(ins[: p.cond_nconsts])
    body_consts = list(ins[p.cond_nconsts : p.cond_nconsts + p.body_nconsts])
    init = list(ins[p.cond_nconsts + p.body_nconsts :])
    types = _fixpoint(ac, p.body_jaxpr, body_consts, init, [], len(init))
    roles = [r for _, r in types]

    def cond_fun(carry):
        outs = ac.eval_jaxpr(p.cond_jaxpr, [*cond_consts, *zip(carry, roles, strict=True)])
        return outs[0][0]

    def body_fun(carry):
        outs = ac.eval_jaxpr(p.body_jaxpr, [*body_consts, *zip(carry, roles, strict=True)])
        return _cast_to_types([v for v, _ in outs], types)

    out = jax.lax.while_loop(cond_fun, body_fun, _cast_to_types([v for v, _ in init], types))
    return list(zip(out, roles, strict=True))


def _handle_cond(ac, eqn, ins):
    parts = compat.cond_parts(eqn)
    (index, _), operands = ins[0], list(ins[1:])
    types_in = [(aval(v), r) for v, r in operands]
    per_branch = [ac.probe(b, (), types_in) for b in parts.branches]
    out_types = []
    for outs in zip(*per_branch, strict=True):
        dtypes = {dt for dt, _ in outs}
        out_types.append((promote(sorted(dtypes, key=str)), max(r for _, r in outs)))
    values, roles = _split(operands)

    def make(branch):
        def fun(*args):
            outs = ac.eval_jaxpr(branch, list(zip(args, roles, strict=True)))
            return _cast_to_types([v for v, _ in outs], out_types)

        return fun

    branches = [make(b) for b in parts.branches]
    if parts.platforms is None:
        outs = jax.lax.switch(index, branches, *values)
    else:
        outs = _platform_dependent(parts.platforms, branches, values)
    return list(zip(outs, [r for _, r in out_types], strict=True))


def _platform_dependent(platforms, branches, values):
    # Rebuilt with lax.platform_dependent (its own platform_index), so only the
    # branch of the platform being lowered for is compiled, as in the original.
    per_platform, default = {}, None
    for names, branch in zip(platforms, branches, strict=True):
        if names is None:
            default = branch
        else:
            per_platform.update(dict.fromkeys(names, branch))
    return jax.lax.platform_dependent(*values, default=default, **per_platform)


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
# the call primitives of every supported JAX, which a user may name "recurse").
HIGHER_ORDER_RULES = {
    **dict.fromkeys(compat.JIT_NAMES, _handle_jit),
    **dict.fromkeys(compat.CALL_NAMES, _handle_call),
    **dict.fromkeys(compat.REMAT_NAMES, _handle_remat),
    "custom_jvp_call": handle_custom_jvp,
    "scan": _handle_scan,
    "while": _handle_while,
    "cond": _handle_cond,
    "shard_map": _handle_shard_map,
    **SCATTER_RULES,
}
