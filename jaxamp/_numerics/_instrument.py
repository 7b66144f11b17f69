"""The traced half of the numerics report: run the program and measure every site.

``Recorder.run`` evaluates a closed jaxpr with jaxamp's one evaluation loop
(``_engine._interpreter.eval_jaxpr``). Environment values are ``Val(value,
finite, shadow)``: ``finite`` is a traced bool saying the array holds no inf/NaN
(so an equation knows whether its inputs were finite without measuring them
again) and ``shadow`` the value in float32 arithmetic (``_shadow``). Each
first-order equation runs as written (``compat.bind_eqn``), its shadow next to
it, and each floating output updates its site's statistics (the table
``_stats.STATISTICS``), which are traced scalars: the whole instrumented program
runs under one ``jax.jit``. Sub-jaxprs are entered through the engine's skeleton
(``_engine._control.structured_rules``), as the catalog (``_sites``) enters them.

Loops carry the statistics of the sites in their body (packed into two arrays)
together with a clock and the iteration number, and ``cond`` passes them through
every branch, so a loop is measured over all its iterations without Python
loops or host syncs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxamp._casting import is_floating
from jaxamp._engine import _compat as compat
from jaxamp._engine import _control as control
from jaxamp._engine._interpreter import eval_jaxpr
from jaxamp._engine._visit import sub_path
from jaxamp._fp8._fp4_facts import Facts
from jaxamp._numerics._shadow import Val, is_narrow, local_twins, materialize, shadow_outputs
from jaxamp._numerics._sites import (
    PER_OPERAND,
    Site,
    in_quantization,
    is_facts,
    is_quantize_step,
    site_key,
)
from jaxamp._numerics._stats import Output
from jaxamp._numerics._table import Ref, Scope, empty_table, stack_limit

__all__ = ["Recorder", "all_finite_flag", "instrumented"]


def all_finite_flag(x: Any) -> Any:
    if not is_floating(x):
        return jnp.bool_(True)
    x = jnp.asarray(x)
    return jax.lax.reduce_and(jax.lax.is_finite(x), tuple(range(x.ndim)))


def _lift(const: Any) -> Val:
    # Behind a barrier, statistics of constants (masks, broadcast literals) run at run
    # time: XLA would otherwise constant-fold their reductions, slowly, at compile time.
    dtype = getattr(const, "dtype", None)
    finite = True if _rounded_to_nonfinite(const) else _host_finite(const)
    if dtype is not None and (jnp.issubdtype(dtype, jnp.number) or dtype == np.bool_):
        const = jax.lax.optimization_barrier(jnp.asarray(const))
    return Val(const, finite)


def _host_finite(const: Any) -> Any:
    """Whether a constant is all finite, decided while tracing (no reduction to compile)."""
    if not is_floating(const):
        return True
    if isinstance(const, jax.core.Tracer):
        return all_finite_flag(const)
    try:
        return bool(np.all(np.isfinite(np.asarray(const).astype(np.float64))))
    except (TypeError, jax.errors.TracerArrayConversionError):
        return all_finite_flag(const)


def _rounded_to_nonfinite(const: Any) -> bool:
    """A 16-bit constant holding inf/NaN: JAX rounded an out-of-range number while tracing.

    ``x * 1e5`` on a float16 ``x`` holds the literal ``inf:f16``. Such a constant counts
    as a finite input, so the op that uses it is the origin, at the user's line; an
    inf in a 32-bit constant (an ``-inf`` mask) was written on purpose and does not.
    """
    if not is_narrow(const):
        return False
    try:
        return not bool(np.all(np.isfinite(np.asarray(const))))
    except (TypeError, jax.errors.TracerArrayConversionError):
        return False


# Primitives that move values without changing them: an output's statistics are its
# input's, with the counts scaled by how often each value appears (broadcast).
_SAME_VALUES = frozenset(
    {
        "reshape",
        "transpose",
        "squeeze",
        "expand_dims",
        "copy",
        "copy_p",
        "rev",
        "stop_gradient",
        "broadcast_in_dim",
    }
)


def _moved_from(eqn, ins: Sequence[Val], outs: Sequence[Any], k: int, scope: Scope) -> Any:
    """``(Ref, repeat)`` of the input's measurement for output ``k`` of a
    value-preserving primitive (its statistics pass on), else None (measure)."""
    name = eqn.primitive.name
    widening = scope.screen and name == "convert_element_type" and _widens(ins[0].value, outs[0])
    if name in PER_OPERAND and len(ins) == len(outs):
        source_val = ins[k]  # output k is operand k
    elif (name in _SAME_VALUES and len(outs) == 1 and ins) or widening:
        source_val = ins[0]
    else:
        return None
    stats = source_val.stats
    if stats is None or stats.scope is not scope:
        return None
    source, out = source_val.value, outs[k]
    if np.dtype(source.dtype) != np.dtype(out.dtype) and not widening:
        return None
    return stats, max(out.size, 1) // max(source.size, 1)


def _widens(source: Any, out: Any) -> bool:
    """Whether casting ``source`` to ``out``'s dtype keeps every value (float16 or
    bfloat16 to float32): in the screening pass the output's largest magnitude and
    inf/NaN are its input's, so it is not reduced again. (The full pass measures it:
    its underflow and loss are counted against float32's range, not the input's.)"""
    if not (is_floating(source) and is_floating(out)):
        return False
    src, dst = jnp.finfo(source.dtype), jnp.finfo(out.dtype)
    return (
        src.bits >= 16  # not float8/float4: their saturation is counted per dtype
        and dst.bits > src.bits
        and dst.nmant >= src.nmant
        and dst.maxexp >= src.maxexp
        and dst.minexp <= src.minexp
    )


class AllFinite(tuple):
    """The finite flag of an unmeasured value: all of these flags (its inputs')."""


class Recorder:
    """Evaluates a jaxpr, measuring every site it passes into a ``Scope``.

    ``clock`` is ``(base, offset)``: a traced count (after a loop) or 0, plus the
    equations evaluated since, counted in Python.
    """

    def __init__(
        self,
        sites: dict[tuple, Site],
        scope: Scope,
        clock: Any,
        reached: set,
        quantizing: str | None = None,
        materialize: bool = False,
        facts: dict | None = None,
        shadow: bool = True,
    ):
        self.sites = sites
        self.scope = scope
        self.clock = (clock, 0)
        self.reached = reached  # the sites measured so far (shared with nested bodies)
        self.quantizing = quantizing  # inside a quantization (``_sites.in_quantization``)
        self.materialize = materialize  # each measured value computed once (``measure``)
        # id of the value an FP4 cast reads -> (it, its quantization's ``Facts``): ``unmeasured``
        self.facts = {} if facts is None else facts
        # False: the screening pass (``instrumented(shadow=False)``), no float32 twins.
        self.shadow = shadow

    def now(self) -> Any:
        """The clock as one (traced) int32."""
        base, offset = self.clock
        return jnp.asarray(base, jnp.int32) + offset

    def child(self, keys, packed, clock, iteration) -> Recorder:
        scope = Scope(keys, packed, iteration, self.scope.stack_max, self.scope.screen)
        return Recorder(
            self.sites,
            scope,
            clock,
            self.reached,
            self.quantizing,
            self.materialize,
            self.facts,
            self.shadow,
        )

    def keys_under(self, prefix: tuple) -> list[tuple]:
        return [key for key in self.sites if key[0][: len(prefix)] == prefix]

    # -- evaluation ----------------------------------------------------------------
    def run(self, closed, args: Sequence[Val], path: tuple) -> list[Val]:
        positions = {id(eqn): i for i, eqn in enumerate(closed.jaxpr.eqns)}

        def apply(eqn, ins):
            return self.equation(eqn, ins, path, positions[id(eqn)])

        return eval_jaxpr(closed, args, apply, lift=_lift)

    def equation(self, eqn, ins, path, index) -> list[Val]:
        rule = _RULES.get(eqn.primitive.name, Recorder.measure)
        return rule(self, eqn, ins, path, index)

    def measure(self, eqn, ins: Sequence[Val], path, index) -> list[Val]:
        if is_quantize_step(eqn, self.quantizing):
            return self.unmeasured(eqn, ins)
        outs = compat.bind_eqn(eqn, [v.value for v in ins])
        if not ins:  # iota and friends: constants too (see _lift)
            outs = list(jax.lax.optimization_barrier(outs))
        if self.shadow:
            shadows = shadow_outputs(eqn, ins, outs)
            locals_ = local_twins(eqn, ins, outs, shadows)
        else:  # the screening pass: the 16-bit program and its own statistics only
            shadows = locals_ = [None] * len(outs)
        if self.materialize:
            # Each value, shadow and twin in a buffer of its own: XLA would otherwise
            # compute a chain of them again inside every kernel that stacks one for
            # the statistics, which its MLIR fusion emitters compile slowly
            # (BENCHMARKS.md, "numerics_report: the first call, compile included").
            outs, shadows, locals_ = jax.lax.optimization_barrier(
                (list(outs), list(shadows), list(locals_))
            )
        inputs = [flag for v in ins for flag in self.flags_of(v)]
        vals = []
        for k, (out, shadow) in enumerate(zip(outs, shadows, strict=True)):
            key = site_key(path, index, k)
            if key not in self.sites:
                if is_floating(out):
                    raise _unmeasured(eqn, key)
                vals.append(Val(out, all_finite_flag(out), shadow))
                continue
            moved = _moved_from(eqn, ins, outs, k, self.scope)
            output = None if moved else Output(out, shadow, locals_[k], self.facts_of(eqn, ins))
            ref = self.scope.add(key, output, moved, inputs, self.clock)
            self.reached.add(key)
            vals.append(Val(out, ref, shadow, ref))
        self.clock = (self.clock[0], self.clock[1] + 1)
        return vals

    def unmeasured(self, eqn, ins: Sequence[Val]) -> list[Val]:
        """A step of a quantization (``_sites.is_quantize_step``): run as written,
        not measured. Its outputs count as finite when its inputs are (the float8 or
        float4 output is measured, and blamed for an inf/NaN the steps make), and their
        shadow restarts from the value: the quantization's output is compared
        with the scaled operand it rounds, without computing the steps again in
        float32 (BENCHMARKS.md, "numerics_report: the first call, compile included")."""
        outs = compat.bind_eqn(eqn, [v.value for v in ins])
        if is_facts(eqn):  # (rounded, *facts): kept for the float4 cast that reads ``rounded``
            # The value is kept with them: alive, its id is not reused by another.
            self.facts[id(outs[0])] = (outs[0], Facts(*outs[1:]))
        flags = AllFinite(tuple(flag for v in ins for flag in self.flags_of(v)))
        self.clock = (self.clock[0], self.clock[1] + 1)
        return [Val(out, flags) for out in outs]

    def facts_of(self, eqn, ins: Sequence[Val]) -> Facts | None:
        """The ``Facts`` of the FP4 quantization whose float4 cast ``eqn`` is, else None
        (another op, or a quantization traced outside the report: a jitted function's
        body that JAX had traced before, measured as a plain cast)."""
        kind = in_quantization(eqn, self.quantizing)
        if kind is None or kind == "fp8" or not ins:
            return None
        value, facts = self.facts.get(id(ins[0].value), (None, None))
        return facts if value is ins[0].value else None

    def flags_of(self, val: Val) -> list[Any]:
        """``val.finite`` as flags this scope can use: a ``Ref`` of another scope (a
        loop constant, a cond operand) is measured again here."""
        finite = val.finite
        flags = list(finite) if isinstance(finite, AllFinite) else [finite]
        if any(isinstance(f, Ref) and f.scope is not self.scope for f in flags):
            return [all_finite_flag(val.value)]
        return flags

    def entering(self, val: Val) -> Any:
        """``val.finite`` as one traced bool now, for a nested body (a cond's operand):
        a measurement still pending in this scope is measured again."""
        flags = self.flags_of(val)
        if any(isinstance(f, Ref) for f in flags):
            return all_finite_flag(val.value)
        return self.traced_flag(AllFinite(flags))

    def finished(self, vals: Sequence[Val]) -> list[Any]:
        """Flushes the scope; each value's finite flag, traced."""
        self.scope.flush()
        return [self.traced_flag(v.finite) for v in vals]

    def traced_flag(self, finite: Any) -> Any:
        """A finite flag (or ``AllFinite`` of them) as one traced bool (a ``Ref`` of
        this scope only after its flush)."""
        if isinstance(finite, AllFinite):
            return jnp.all(jnp.stack([self.traced_flag(f) for f in finite] or [jnp.bool_(True)]))
        return jnp.asarray(self.scope.flag(finite))


def _unmeasured(eqn, key) -> RuntimeError:
    # The catalog and the evaluation disagree on where this output is: a bug of
    # jaxamp's, said at once rather than leaving the site unmeasured.
    return RuntimeError(
        f"numerics_report: the floating output {key} of {eqn.primitive.name!r} has no "
        "site in the catalog; the catalog and the instrumented evaluation enter "
        "sub-jaxprs differently. Please report this as a jaxamp bug."
    )


def _run_call(rec: Recorder, eqn, ins, path, index):
    outer = rec.quantizing
    rec.quantizing = in_quantization(eqn, outer)
    try:
        return rec.run(control.call_of(eqn).body, ins, sub_path(path, index))
    finally:
        rec.quantizing = outer


def _vals(values: Sequence[Any], shadows: Sequence[Any]) -> list[Val]:
    return [Val(v, all_finite_flag(v), s) for v, s in zip(values, shadows, strict=True)]


def _values(vals: Sequence[Val]) -> list[Any]:
    return [v.value for v in vals]


def _shadows(vals: Sequence[Val]) -> list[Any]:
    return [materialize(v) for v in vals]


def _outer(rec: Recorder, vals: Sequence[Val]) -> list[Val]:
    """Values entering a nested body: their finite flags no longer pending here."""
    return [Val(v.value, rec.entering(v), v.shadow) for v in vals]


def _handle_loop(rec: Recorder, eqn, ins, path, index):
    loop = control.loop_of(eqn, ins)
    body_path = sub_path(path, index)
    keys = rec.keys_under(body_path)
    consts = [Val(v.value, all_finite_flag(v.value), v.shadow) for v in loop.consts]

    def body(carry, xs):
        values, shadows, packed, clock, iteration = carry
        sub = rec.child(keys, packed, clock, iteration)
        args = [*consts, *_vals(values, shadows), *_vals(*xs)]
        outs = sub.run(loop.body, args, body_path)
        sub.finished([])
        carried, ys = outs[: loop.n_carry], outs[loop.n_carry :]
        new = (_values(carried), _shadows(carried), sub.scope.rows(keys), sub.now(), iteration + 1)
        return new, (_values(ys), _shadows(ys))

    def cond(carry):
        # The loop condition runs as written (not measured): it decides, it does not compute.
        args = [*_values(loop.cond_consts), *carry[0]]
        return eval_jaxpr(loop.cond, args, compat.bind_eqn)[0]

    carry0 = (_values(loop.carry), _shadows(loop.carry), rec.scope.rows(keys), rec.now())
    carry0 = (*carry0, jnp.int32(0))
    xs = (_values(loop.xs), _shadows(loop.xs))
    (values, shadows, packed, clock, _), ys = loop.rebuild(body, carry0, xs, cond)
    rec.scope.set_rows(keys, packed)
    rec.clock = (clock, 0)
    return [*_vals(values, shadows), *_vals(*ys)]


def _handle_cond(rec: Recorder, eqn, ins, path, index):
    branch = control.branch_of(eqn, ins)
    paths = [sub_path(path, index, b) for b in range(len(branch.branches))]
    keys = [key for body_path in paths for key in rec.keys_under(body_path)]

    def make(body, body_path):
        def fun(packed, clock, values, flags, shadows):
            sub = rec.child(keys, packed, clock, rec.scope.iteration)
            args = [Val(*v) for v in zip(values, flags, shadows, strict=True)]
            outs = sub.run(body, args, body_path)
            flags = sub.finished(outs)
            return _values(outs), flags, _shadows(outs), sub.scope.rows(keys), sub.now()

        return fun

    operands = _outer(rec, branch.operands)
    values, flags, shadows, packed, clock = branch.rebuild(
        branch.index.value,
        [make(body, body_path) for body, body_path in zip(branch.branches, paths, strict=True)],
        rec.scope.rows(keys),
        rec.now(),
        _values(operands),
        [v.finite for v in operands],
        _shadows(operands),
    )
    rec.scope.set_rows(keys, packed)
    rec.clock = (clock, 0)
    return [Val(*v) for v in zip(values, flags, shadows, strict=True)]


# Primitive name -> rule for the equations whose sub-jaxprs are measured inside;
# every other equation is measured as one op (``Recorder.measure``).
_RULES: dict[str, Callable] = control.structured_rules(
    call=_run_call, loop=_handle_loop, branch=_handle_cond
)


def instrumented(
    closed, sites: Sequence[Site], materialize: bool = False, shadow: bool = True
) -> Callable:
    """A jitted function of the program's arguments returning ``(floats, ints)`` per site;
    ``materialize``: each measured value in a buffer of its own (``Recorder.measure``);
    ``shadow=False``: the screening pass, no float32 shadow nor local twin (the
    statistics that need them keep their initial values: ``_summary.summarise(screened=True)``)."""
    by_key = {site.key: site for site in sites}
    keys = list(by_key)
    stack_max = stack_limit(sum(math.prod(site.shape) for site in sites))

    def run(*args):
        scope = Scope(keys, empty_table(len(keys)), jnp.int32(-1), stack_max, not shadow)
        rec = Recorder(by_key, scope, 0, set(), materialize=materialize, shadow=shadow)
        rec.run(closed, _vals(args, [None] * len(args)), ())
        rec.finished([])
        missing = [key for key in keys if key not in rec.reached]
        if missing:
            raise RuntimeError(
                f"numerics_report: the evaluation never reached the sites {missing}; the "
                "catalog and the instrumented evaluation disagree. Please report this as "
                "a jaxamp bug."
            )
        return scope.floats, scope.ints

    return jax.jit(run)
