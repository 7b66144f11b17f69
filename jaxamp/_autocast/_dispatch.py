"""autocast's dispatch table: ``AUTOCAST_RULES`` and a call's ``rules`` turned into rules.

``AUTOCAST_RULES`` is the public contract (``{primitive name: kind}``, kinds as
strings). The table the Autocaster dispatches on holds the rule itself for every
primitive: a first-order kind becomes its function (``_caster.KIND_RULES``),
``"recurse"`` the primitive's own higher-order rule
(``_control_flow.HIGHER_ORDER_RULES``), a user's callable a wrapper that runs it.
The lookup happens once, here, when ``autocast`` is called.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax.extend.core as jex

from jaxamp._autocast._caster import KIND_RULES, Autocaster, Rule
from jaxamp._autocast._control_flow import HIGHER_ORDER_RULES
from jaxamp._autocast._rules import AUTOCAST_RULES, MATMUL_PRIMITIVES, RULE_KINDS
from jaxamp._autocast._values import PLAIN
from jaxamp._casting import is_floating

__all__ = ["rule_of_kind", "rule_table"]


def rule_of_kind(name: str, kind: str) -> Rule:
    """The rule a kind string stands for at primitive ``name``."""
    return HIGHER_ORDER_RULES[name] if kind == "recurse" else KIND_RULES[kind]


def rule_table(rules: Mapping | None) -> dict[str, Rule]:
    """``AUTOCAST_RULES`` with the call's ``rules`` on top, as ``{name: rule}``.

    Raises:
      TypeError, ValueError: ``rules`` is not a mapping of primitives (or their
        names) to a valid kind or a callable.
    """
    table = {name: rule_of_kind(name, kind) for name, kind in AUTOCAST_RULES.items()}
    if rules is None:
        return table
    if not isinstance(rules, Mapping):
        raise TypeError(
            "rules must be a mapping {primitive or primitive name: rule}; "
            f"got {type(rules).__name__}: {rules!r}."
        )
    for key, rule in rules.items():
        name = _primitive_name(key)
        if isinstance(rule, str):
            _check_rule_kind(name, rule)
            table[name] = rule_of_kind(name, rule)
        elif callable(rule):
            table[name] = custom_rule(rule)
        else:
            raise TypeError(
                f"rules[{name!r}] must be a rule name or a callable "
                f"rule(context, eqn, *args); got {type(rule).__name__}: {rule!r}."
            )
    return table


def _primitive_name(key: Any) -> str:
    if isinstance(key, jex.Primitive):
        return key.name
    if isinstance(key, str):
        return key
    raise TypeError(
        "rules keys must be jax primitives (e.g. jax.lax.exp_p) or their names "
        f"(e.g. 'exp'); got {type(key).__name__}: {key!r}."
    )


def _check_rule_kind(name: str, rule: str) -> None:
    if rule not in RULE_KINDS:
        raise ValueError(
            f"rules[{name!r}] must be one of {', '.join(map(repr, RULE_KINDS))} "
            f"or a callable; got {rule!r}."
        )
    if rule == "compute" and name not in MATMUL_PRIMITIVES:
        raise ValueError(
            f"rules[{name!r}] = 'compute' is for contractions, which exist only for "
            f"{', '.join(MATMUL_PRIMITIVES)}; for an elementwise primitive use 'follow' "
            "(or 'float32'), or a callable."
        )
    if rule == "recurse" and name not in HIGHER_ORDER_RULES:
        raise ValueError(
            f"rules[{name!r}] = 'recurse' needs a built-in handler, which exists "
            f"only for {', '.join(sorted(HIGHER_ORDER_RULES))}; use 'keep' or a callable."
        )


def custom_rule(fn: Callable) -> Rule:
    """The rule that runs a user's callable ``fn(context, eqn, *values)``.

    ``context`` is the call's :class:`jaxamp.AutocastContext`.

    Outputs in their traced dtype take the operands' role; others were moved on
    purpose, and their dtype decides.
    """

    def rule(ac: Autocaster, eqn: jex.JaxprEqn, ins: list[tuple]) -> list[tuple]:
        outs = list(fn(ac.context, eqn, *[v for v, _ in ins]))
        in_role = max((r for v, r in ins if is_floating(v)), default=PLAIN)
        roles = []
        for out, var in zip(outs, eqn.outvars, strict=True):
            if not is_floating(out):
                roles.append(PLAIN)
            elif out.dtype == var.aval.dtype:
                roles.append(in_role)
            else:
                roles.append(ac.role_of_cast(out.dtype))
        return list(zip(outs, roles, strict=True))

    return rule
