"""The Autocaster (evaluates a jaxpr under a policy and a dispatch table) and the
first-order rules: one function per rule kind of ``AUTOCAST_RULES``.

A rule is ``rule(autocaster, eqn, ins) -> outs`` on ``(value, role)`` pairs; the
higher-order rules (``_control_flow``, ``_scatter``) have the same signature.
See README.md in this folder for the roles of values (PLAIN, ACTIVATION, PINNED)
and how each rule kind treats them.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.extend.core as jex
import numpy as np

from jaxamp._autocast._context import AutocastContext
from jaxamp._autocast._matmul import padded, run_matmul
from jaxamp._autocast._sharded import (
    gathered_parameter,
    gathers_a_parameter,
    mark_parameter,
    narrow_lookup,
    product_dtypes,
    wide_broadcast,
)
from jaxamp._autocast._values import (
    ACTIVATION,
    PINNED,
    PLAIN,
    cast,
    promote,
    saturate_finite,
)
from jaxamp._autocast._wide import KnownConstants, breaks_in, feeds_reduction
from jaxamp._casting import F32, is_floating
from jaxamp._engine import _compat as compat
from jaxamp._engine._interpreter import eval_jaxpr
from jaxamp._fp8 import Recipe, kept_scope, recipe_operands
from jaxamp._policy import Policy

__all__ = [
    "KIND_RULES",
    "Autocaster",
    "Rule",
    "UnknownPrimitiveWarning",
    "unknown_higher_order_message",
]

# Elementwise primitives whose operands may broadcast (size-1 dims) to the result.
_BROADCASTING = frozenset({"add", "sub", "mul", "div", "max", "min", "pow", "atan2", "rem"})


# A rule: ``rule(autocaster, eqn, ins) -> outs`` on ``(value, role)`` pairs.
Rule = Callable[["Autocaster", jex.JaxprEqn, list], list]


class Autocaster:
    """Evaluates jaxprs under a policy and a dispatch table (one per autocast call).

    ``table`` maps primitive names to rules (``_dispatch.rule_table``); a
    primitive it does not list follows, or, when it holds jaxprs, runs as
    traced with a warning.
    """

    def __init__(
        self,
        policy: Policy,
        table: Mapping[str, Rule],
        pad_to: int | None,
        recipe: Recipe | None = None,
    ):
        self.policy = policy
        self.compute_dtype = np.dtype(policy.compute_dtype)
        self.table = table
        self.pad_to = pad_to
        # A Float8Recipe or Float4Recipe: the contractions it takes run in FP8/FP4 (jaxamp/_fp8).
        self.recipe = recipe
        self.recipe_weights: Any = (
            None  # the pre-pass: weight amaxes, high_precision (recipe_weights)
        )
        # precision_plan's instrumentation (jaxamp._fp8._probe.Bound), else None.
        self.plan_probe: Any = None
        # What a user's rule sees: the public part, nothing of the evaluation.
        self.context = AutocastContext(policy)
        # id(jaxpr) -> (jaxpr, ids of its powers/products that feed a float32 sum).
        self._wide_powers: dict[int, tuple[Any, set[int]]] = {}
        # True inside a custom_jvp's JVP rule (JAX transposes what it computes) and
        # inside a checkpoint with a policy (which must see the dot_generals).
        self.transposable = False
        # Constants, traced ones included (a jit's argument, a broadcast): see _wide.
        self.constants = KnownConstants()

    def with_transposable_matmuls(self) -> Autocaster:
        """The same autocaster, emitting matmuls as JAX's own 16-bit dot_generals."""
        child = copy.copy(self)
        child.transposable = True
        return child

    # -- evaluation ---------------------------------------------------------------

    def eval_jaxpr(self, closed: jex.ClosedJaxpr, args: Sequence[tuple]) -> list[tuple]:
        """Evaluates ``closed`` on ``(value, role)`` pairs; returns such pairs."""
        key = id(closed.jaxpr)
        if key not in self._wide_powers:  # the jaxpr is kept alive with its ids
            self._wide_powers[key] = (closed.jaxpr, feeds_reduction(closed.jaxpr))
        return eval_jaxpr(closed, args, self._apply, lift=_plain)

    def _apply(self, eqn: jex.JaxprEqn, ins: list[tuple]) -> list[tuple]:
        rule = self.table.get(eqn.primitive.name) or _unlisted(eqn)
        outs = rule(self, eqn, ins)
        self.constants.carry(eqn, [v for v, _ in ins], [v for v, _ in outs])
        return outs

    def follow_values(self, eqn: jex.JaxprEqn, ins: list[tuple]) -> tuple[list, int]:
        """The operands of a "follow" equation brought to one dtype, and its role.

        A plain operand (a parameter or constant) narrowed to an activation's
        dtype saturates: a finite value stays finite.
        """
        values = [v for v, _ in ins]
        for idxs in _groups(eqn, ins).values():
            pinned = [ins[i][0].dtype for i in idxs if ins[i][1] == PINNED]
            active = [ins[i][0].dtype for i in idxs if ins[i][1] == ACTIVATION]
            if pinned or active:
                target = promote(pinned + active)
                moved = [ins[i][0] for i in idxs if ins[i][1] != PLAIN]
                for i in idxs:
                    plain = ins[i][1] == PLAIN
                    values[i] = (
                        self._narrow_plain(eqn, values[i], target, moved)
                        if plain
                        else cast(values[i], target)
                    )
        return values, max((r for v, r in ins if is_floating(v)), default=PLAIN)

    def _narrow_plain(self, eqn: jex.JaxprEqn, value: Any, dtype: np.dtype, like: list) -> Any:
        """A plain operand brought to ``dtype`` (saturating), to meet an activation.

        One that an elementwise op broadcasts against a batch (a bias, a
        position embedding) is broadcast by ``_sharded.wide_broadcast``, its
        gradient summed in ``reduce_dtype``.
        """
        shape = eqn.outvars[0].aval.shape
        broadcast = (
            eqn.primitive.name in _BROADCASTING
            and np.ndim(value) == len(shape)  # size-1 dims; a scalar stays a scalar
            and np.shape(value) != shape
        )
        if not broadcast or isinstance(value, np.ndarray) or value.dtype.itemsize <= dtype.itemsize:
            return saturate_finite(value, dtype)
        return wide_broadcast(self, value, dtype, shape, like)

    def breaks_in_compute_dtype(self, eqn: jex.JaxprEqn, ins: list[tuple]) -> bool:
        """Whether "follow" would narrow a value that 16 bits break (see ``_wide``)."""
        roles = [r for v, r in ins if is_floating(v)]
        if PINNED in roles or ACTIVATION not in roles:
            return False  # nothing is narrowed
        if any(id(eqn) in wide for _, wide in self._wide_powers.values()):
            return True  # a power or product on its way into a float32 sum
        plain = [v for v, r in ins if is_floating(v) and r == PLAIN]
        if any(breaks_in(self.constants.values_of(v), self.compute_dtype) for v in plain):
            return True  # a constant it cannot hold (an eps, a 1e5 scale)
        if eqn.primitive.name == "div":
            divisor, role = ins[1]
            # A traced float32 divisor (a count, a norm) may be tiny; a constant
            # that fits (x / 2.0, x / sqrt(d)) is safe, one that does not broke above.
            return (
                is_floating(divisor)
                and role == PLAIN
                and _wider(divisor, self.compute_dtype)
                and self.constants.values_of(divisor) is None
            )
        return False

    def role_of_cast(self, dtype: np.dtype) -> int:
        """The role of a value moved to ``dtype`` on purpose (a cast, a rule's choice)."""
        return ACTIVATION if dtype == self.compute_dtype else PINNED

    # -- helpers for the higher-order rules ---------------------------------------

    def function_of(self, closed: jex.ClosedJaxpr, prefix: Sequence[tuple], roles, box: list):
        """A plain function of the non-prefix inputs that evaluates ``closed``.

        ``prefix`` are (value, role) pairs bound first (closure constants);
        the output roles are written to ``box`` each time it is traced.
        """

        def fun(*args):
            outs = self.eval_jaxpr(closed, [*prefix, *zip(args, roles, strict=True)])
            box[:] = [r for _, r in outs]
            return [v for v, _ in outs]

        return fun

    def probe(self, closed, prefix, types) -> list[tuple[np.dtype, int]]:
        """Output (dtype, role) of ``closed`` for inputs of the given (aval, role)."""
        box: list = []
        fun = self.function_of(closed, prefix, [r for _, r in types], box)
        shapes = jax.eval_shape(fun, *[a for a, _ in types])
        return [(np.dtype(s.dtype), r) for s, r in zip(shapes, box, strict=True)]


def _wider(value: Any, dtype: np.dtype) -> bool:
    return np.dtype(value.dtype).itemsize > dtype.itemsize


def _groups(eqn: jex.JaxprEqn, ins: list[tuple]) -> dict[np.dtype, list[int]]:
    # Operands traced with the same dtype must again share one dtype.
    groups: dict[np.dtype, list[int]] = {}
    for i, (atom, (value, _)) in enumerate(zip(eqn.invars, ins, strict=True)):
        if is_floating(value):
            groups.setdefault(np.dtype(atom.aval.dtype), []).append(i)
    return groups


# -- the first-order rules: the kinds of AUTOCAST_RULES ------------------------------


def follow(ac: Autocaster, eqn: jex.JaxprEqn, ins: list[tuple]) -> list[tuple]:
    """Operands to a common dtype by role; the outputs take the highest role.

    An output in a dtype none of the operands has (a ``convert_element_type``
    of an autocast value) was cast on purpose: the cast is kept, and its target
    decides the role.
    """
    if ac.breaks_in_compute_dtype(eqn, ins):
        return float32(ac, eqn, ins)
    if gathers_a_parameter(ac, eqn, ins):
        (shard, _), *_ = ins
        return [(gathered_parameter(ac, eqn, shard), ACTIVATION)]
    looked_up = narrow_lookup(ac, eqn, ins)
    if looked_up is not None:
        return looked_up
    values, role = ac.follow_values(eqn, ins)
    operand_dtypes = {v.dtype for v in values if is_floating(v)}
    outs = []
    for out in compat.bind_eqn(eqn, values):
        if not is_floating(out) or role == PLAIN:
            outs.append((out, PLAIN))
        elif out.dtype in operand_dtypes:
            outs.append((out, role))
        else:
            outs.append((out, ac.role_of_cast(out.dtype)))
    return outs


def float32(ac: Autocaster, eqn: jex.JaxprEqn, ins: list[tuple]) -> list[tuple]:
    """Floating operands to (at least) float32; a result that was touched is PINNED."""
    values = [v for v, _ in ins]
    for idxs in _groups(eqn, ins).values():
        target = promote([F32] + [ins[i][0].dtype for i in idxs])
        for i in idxs:
            values[i] = cast(values[i], target)
    touched = any(r != PLAIN for v, r in ins if is_floating(v))
    outs = compat.bind_eqn(eqn, values)
    return [
        (o, PINNED if is_floating(o) and (touched or o.dtype != var.aval.dtype) else PLAIN)
        for o, var in zip(outs, eqn.outvars, strict=True)
    ]


def keep(ac: Autocaster, eqn: jex.JaxprEqn, ins: list[tuple]) -> list[tuple]:
    """Operands back to their traced dtypes; the equation runs as traced."""
    values = [
        cast(v, np.dtype(atom.aval.dtype)) if is_floating(v) else v
        for atom, (v, _) in zip(eqn.invars, ins, strict=True)
    ]
    return [(o, PLAIN) for o in compat.bind_eqn(eqn, values)]


def compute(ac: Autocaster, eqn: jex.JaxprEqn, ins: list[tuple]) -> list[tuple]:
    """A contraction on compute-dtype factors with float32 accumulation (``_matmul``)."""
    (lhs, lhs_role), (rhs, rhs_role), *rest = ins
    if not (is_floating(lhs) and is_floating(rhs)):
        return follow(ac, eqn, ins)
    extra = [v for v, _ in rest]
    roles = (lhs_role, rhs_role)
    hooked = None
    scope: contextlib.AbstractContextManager = contextlib.nullcontext()
    if ac.recipe is not None:
        plain = (lhs_role == PLAIN, rhs_role == PLAIN)
        hooked = recipe_operands(ac.recipe, eqn, lhs, rhs, plain, ac.recipe_weights)
        # A product the recipe's high_precision keeps: named, for precision_report.
        scope = kept_scope(eqn, ac.recipe_weights)
    if hooked is None:
        with scope:
            return [(_plain_product(ac, eqn, roles, lhs, rhs, *extra), ACTIVATION)]
    if ac.plan_probe is not None and not ac.transposable:  # precision_plan's instrumented step
        low = functools.partial(_recipe_product, ac, eqn, roles)
        ref = functools.partial(_plain_product, ac, eqn, roles)
        return [(ac.plan_probe.product(eqn, low, ref, lhs, rhs, extra), ACTIVATION)]
    x, w, matmul = hooked
    return [(_run(ac, eqn, x, w, matmul, extra), ACTIVATION)]


def _recipe_product(ac: Autocaster, eqn: jex.JaxprEqn, roles: tuple, lhs: Any, rhs: Any, *extra):
    """The recipe's low-bit product of ``eqn`` (precision_plan runs it next to the plain one)."""
    plain = (roles[0] == PLAIN, roles[1] == PLAIN)
    # Called only for a product the recipe's hook took, on operands of the same types.
    recipe = ac.recipe
    hooked = (
        None if recipe is None else recipe_operands(recipe, eqn, lhs, rhs, plain, ac.recipe_weights)
    )
    if hooked is None:
        raise RuntimeError(f"the recipe {ac.recipe!r} no longer runs {eqn.primitive.name} low-bit")
    x, w, matmul = hooked
    return _run(ac, eqn, x, w, matmul, list(extra))


def _plain_product(ac: Autocaster, eqn: jex.JaxprEqn, roles: tuple, lhs: Any, rhs: Any, *extra):
    """Autocast's compute-dtype product of ``eqn`` (float32 accumulation)."""
    # What the partitioner reduces, in which dtype: read before the operands move.
    grad_dtypes, result_dtype = product_dtypes(ac, lhs, rhs, roles)
    lhs, rhs = (
        _contraction_operand(ac, lhs, roles[0], rhs),
        _contraction_operand(ac, rhs, roles[1], lhs),
    )
    matmul = functools.partial(
        run_matmul,
        transposable=ac.transposable,
        grad_dtypes=grad_dtypes,
        result_dtype=result_dtype,
    )
    return _run(ac, eqn, lhs, rhs, matmul, list(extra))


def _run(ac: Autocaster, eqn: jex.JaxprEqn, lhs: Any, rhs: Any, matmul: Any, extra: list) -> Any:
    """``matmul`` on the operands, padded to ``ac.pad_to`` and back."""
    unpad = None
    if ac.pad_to is not None:
        lhs, rhs, unpad = padded(eqn.primitive.name, eqn.params, lhs, rhs, ac.pad_to)
    out = matmul(eqn, lhs, rhs, *extra, dtype=ac.compute_dtype)
    return out if unpad is None else unpad(out)


def _contraction_operand(ac: Autocaster, value: Any, role: int, other: Any) -> Any:
    """A contraction operand in the compute dtype.

    Inside ``shard_map``, a parameter (PLAIN) that meets a varying operand is
    marked varying before its cast (``_sharded.mark_parameter``).

    A PINNED operand is float32 on purpose (log-probabilities, a loop
    accumulator) and may hold finite values beyond float16's range that a mask
    or one-hot then multiplies by zero (CTC's ``log_epsilon = -1e5``): it
    saturates, so 0 x value stays 0 instead of 0 x inf = NaN. Inputs and
    parameters (PLAIN) are cast as they are: the usual path pays nothing.
    """
    dtype = ac.compute_dtype
    if role == PINNED:
        return saturate_finite(value, dtype)
    return cast(mark_parameter(ac, value, role, other), dtype)


# Rule kind of AUTOCAST_RULES -> rule, for the first-order kinds ("recurse" names a
# rule of its own per primitive: _control_flow.HIGHER_ORDER_RULES).
KIND_RULES: dict[str, Rule] = {
    "compute": compute,
    "float32": float32,
    "follow": follow,
    "keep": keep,
}


def _unlisted(eqn: jex.JaxprEqn) -> Rule:
    # First-order primitives follow; higher-order ones run as traced, with a warning.
    if not compat.eqn_has_subjaxprs(eqn):
        return follow
    warnings.warn(unknown_higher_order_message(eqn.primitive.name), UnknownPrimitiveWarning, 3)
    return keep


def _plain(value: Any) -> tuple:
    return value, PLAIN


class UnknownPrimitiveWarning(UserWarning):
    """autocast met a higher-order primitive with no rule and ran it as traced."""


def unknown_higher_order_message(name: str) -> str:
    return (
        f"jaxamp.autocast has no rule for the higher-order primitive {name!r}: it holds "
        "jaxprs or functions whose meaning autocast does not know, so it runs exactly as "
        "traced (its inputs are cast back to their traced dtypes; what it computes stays "
        "in those dtypes). To silence this, say so: jaxamp.autocast(fun, policy, "
        f"rules={{{name!r}: 'keep'}}); to rewrite it, pass a callable "
        "rule(context, eqn, *args) -> list of outputs (see jaxamp.AutocastContext)."
    )
