"""The Autocaster: evaluates a jaxpr under a policy and a rule table.

See README.md in this folder for the roles of values (PLAIN, ACTIVATION, PINNED)
and how each rule kind treats them.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.extend.core as jex
import numpy as np

from jaxamp._autocast._control_flow import HANDLERS
from jaxamp._autocast._matmul import padded, run_matmul
from jaxamp._autocast._values import (
    ACTIVATION,
    PINNED,
    PLAIN,
    cast,
    is_float,
    promote,
    saturating_cast,
)
from jaxamp._autocast._wide import breaks_in, feeds_reduction, is_constant
from jaxamp._engine import _compat as compat
from jaxamp._engine._interpreter import eval_jaxpr
from jaxamp._policy import Policy

__all__ = ["Autocaster", "UnknownPrimitiveWarning", "unknown_higher_order_message"]

_F32 = np.dtype(np.float32)


class Autocaster:
    """Evaluates jaxprs under a policy and a rule table (one per autocast call).

    Custom rules receive it as their first argument: ``policy``, ``compute_dtype``
    and ``bind(eqn, *args)`` (run an equation as written) are public.
    """

    def __init__(self, policy: Policy, rules: Mapping[str, Any], pad_to: int | None):
        self.policy = policy
        self.compute_dtype = np.dtype(policy.compute_dtype)
        self.rules = rules
        self.pad_to = pad_to
        # id(jaxpr) -> (jaxpr, ids of its powers/products that feed a float32 sum).
        self._wide_powers: dict[int, tuple[Any, set[int]]] = {}
        # True inside a custom_jvp's JVP rule (JAX transposes what it computes) and
        # inside a checkpoint with a policy (which must see the dot_generals).
        self.transposable = False

    def with_transposable_matmuls(self) -> Autocaster:
        """The same autocaster, emitting matmuls as JAX's own 16-bit dot_generals."""
        child = copy.copy(self)
        child.transposable = True
        return child

    @staticmethod
    def bind(eqn: jex.JaxprEqn, *args: Any) -> list[Any]:
        """Runs ``eqn`` as written on ``args``."""
        return compat.bind_eqn(eqn, args)

    # -- evaluation ---------------------------------------------------------------

    def eval_jaxpr(self, closed: jex.ClosedJaxpr, args: Sequence[tuple]) -> list[tuple]:
        """Evaluates ``closed`` on ``(value, role)`` pairs; returns such pairs."""
        key = id(closed.jaxpr)
        if key not in self._wide_powers:  # the jaxpr is kept alive with its ids
            self._wide_powers[key] = (closed.jaxpr, feeds_reduction(closed.jaxpr))
        return eval_jaxpr(closed, args, self._apply, lift=_plain)

    def _breaks_in_compute_dtype(self, eqn: jex.JaxprEqn, ins: list[tuple]) -> bool:
        """Whether "follow" would narrow a value that 16 bits break (see ``_wide``)."""
        roles = [r for v, r in ins if is_float(v)]
        if PINNED in roles or ACTIVATION not in roles:
            return False  # nothing is narrowed
        if any(id(eqn) in wide for _, wide in self._wide_powers.values()):
            return True  # a power or product on its way into a float32 sum
        plain = [v for v, r in ins if is_float(v) and r == PLAIN]
        if any(breaks_in(v, self.compute_dtype) for v in plain):
            return True  # an eps that underflows
        if eqn.primitive.name == "div":
            divisor, role = ins[1]
            # A traced float32 divisor (a count, a norm) may be tiny; a constant
            # that fits (x / 2.0, x / sqrt(d)) is safe, one that does not broke above.
            return (
                is_float(divisor)
                and role == PLAIN
                and _wider(divisor, self.compute_dtype)
                and not is_constant(divisor)
            )
        return False

    def _apply(self, eqn: jex.JaxprEqn, ins: list[tuple]) -> list[tuple]:
        name = eqn.primitive.name
        rule = self.rules.get(name)
        if rule is None:
            rule = "follow"
            if compat.eqn_has_subjaxprs(eqn):
                warnings.warn(unknown_higher_order_message(name), UnknownPrimitiveWarning, 2)
                rule = "keep"
        if callable(rule):
            return self._custom(rule, eqn, ins)
        if rule == "recurse":
            return HANDLERS[name](self, eqn, ins)
        if rule == "follow" and name == "convert_element_type":
            return self._convert(eqn, ins)
        if rule == "follow" and self._breaks_in_compute_dtype(eqn, ins):
            return self._float32(eqn, ins)
        return _FIRST_ORDER[rule](self, eqn, ins)

    # -- first-order rules ----------------------------------------------------------

    def _groups(self, eqn: jex.JaxprEqn, ins: list[tuple]) -> dict[np.dtype, list[int]]:
        # Operands traced with the same dtype must again share one dtype.
        groups: dict[np.dtype, list[int]] = {}
        for i, (atom, (value, _)) in enumerate(zip(eqn.invars, ins, strict=True)):
            if is_float(value):
                groups.setdefault(np.dtype(atom.aval.dtype), []).append(i)
        return groups

    def follow_values(self, eqn: jex.JaxprEqn, ins: list[tuple]) -> tuple[list, int]:
        """The operands of a "follow" equation brought to one dtype, and its role.

        A plain operand (a parameter or constant) narrowed to an activation's
        dtype saturates: a finite value stays finite.
        """
        values = [v for v, _ in ins]
        for idxs in self._groups(eqn, ins).values():
            pinned = [ins[i][0].dtype for i in idxs if ins[i][1] == PINNED]
            active = [ins[i][0].dtype for i in idxs if ins[i][1] == ACTIVATION]
            if pinned or active:
                target = promote(pinned + active)
                for i in idxs:
                    to = saturating_cast if ins[i][1] == PLAIN else cast
                    values[i] = to(values[i], target)
        return values, max((r for v, r in ins if is_float(v)), default=PLAIN)

    def _follow(self, eqn: jex.JaxprEqn, ins: list[tuple]) -> list[tuple]:
        values, role = self.follow_values(eqn, ins)
        return [(o, role if is_float(o) else PLAIN) for o in compat.bind_eqn(eqn, values)]

    def _float32(self, eqn: jex.JaxprEqn, ins: list[tuple]) -> list[tuple]:
        values = [v for v, _ in ins]
        for idxs in self._groups(eqn, ins).values():
            target = promote([_F32] + [ins[i][0].dtype for i in idxs])
            for i in idxs:
                values[i] = cast(values[i], target)
        touched = any(r != PLAIN for v, r in ins if is_float(v))
        outs = compat.bind_eqn(eqn, values)
        return [
            (o, PINNED if is_float(o) and (touched or o.dtype != var.aval.dtype) else PLAIN)
            for o, var in zip(outs, eqn.outvars, strict=True)
        ]

    def _keep(self, eqn: jex.JaxprEqn, ins: list[tuple]) -> list[tuple]:
        values = [
            cast(v, np.dtype(atom.aval.dtype)) if is_float(v) else v
            for atom, (v, _) in zip(eqn.invars, ins, strict=True)
        ]
        return [(o, PLAIN) for o in compat.bind_eqn(eqn, values)]

    def _convert(self, eqn: jex.JaxprEqn, ins: list[tuple]) -> list[tuple]:
        ((value, role),) = ins
        (out,) = compat.bind_eqn(eqn, [value])
        if not is_float(out) or not is_float(value) or role == PLAIN:
            return [(out, PLAIN)]
        # An explicit cast of an autocast value: respected, and it decides the role.
        return [(out, ACTIVATION if out.dtype == self.compute_dtype else PINNED)]

    def _compute(self, eqn: jex.JaxprEqn, ins: list[tuple]) -> list[tuple]:
        (lhs, _), (rhs, _), *rest = ins
        if not (is_float(lhs) and is_float(rhs)):
            return self._follow(eqn, ins)
        lhs, rhs = cast(lhs, self.compute_dtype), cast(rhs, self.compute_dtype)
        unpad = None
        if self.pad_to is not None:
            lhs, rhs, unpad = padded(eqn.primitive.name, eqn.params, lhs, rhs, self.pad_to)
        extra = [v for v, _ in rest]
        out = run_matmul(
            eqn, lhs, rhs, *extra, dtype=self.compute_dtype, transposable=self.transposable
        )
        if unpad is not None:
            out = unpad(out)
        return [(out, ACTIVATION)]

    def _custom(self, rule: Callable, eqn: jex.JaxprEqn, ins: list[tuple]) -> list[tuple]:
        outs = list(rule(self, eqn, *[v for v, _ in ins]))
        in_role = max((r for v, r in ins if is_float(v)), default=PLAIN)
        roles = []
        for out, var in zip(outs, eqn.outvars, strict=True):
            if not is_float(out):
                roles.append(PLAIN)
            elif out.dtype == var.aval.dtype:
                roles.append(in_role)
            else:
                roles.append(ACTIVATION if out.dtype == self.compute_dtype else PINNED)
        return list(zip(outs, roles, strict=True))

    # -- helpers for the higher-order handlers -------------------------------------

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


def _plain(value: Any) -> tuple:
    return value, PLAIN


def _wider(value: Any, dtype: np.dtype) -> bool:
    return np.dtype(value.dtype).itemsize > dtype.itemsize


class UnknownPrimitiveWarning(UserWarning):
    """autocast met a higher-order primitive with no rule and ran it as traced."""


def unknown_higher_order_message(name: str) -> str:
    return (
        f"jaxamp.autocast has no rule for the higher-order primitive {name!r}: it holds "
        "jaxprs or functions whose meaning autocast does not know, so it runs exactly as "
        "traced (its inputs are cast back to their traced dtypes; what it computes stays "
        "in those dtypes). To silence this, say so: jaxamp.autocast(fun, policy, "
        f"rules={{{name!r}: 'keep'}}); to rewrite it, pass a callable "
        "rule(autocaster, eqn, *args) -> list of outputs."
    )


# Rule kind -> method: the dispatch for first-order rules ("recurse" goes to HANDLERS).
_FIRST_ORDER = {
    "follow": Autocaster._follow,
    "float32": Autocaster._float32,
    "keep": Autocaster._keep,
    "compute": Autocaster._compute,
}
