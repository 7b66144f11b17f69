"""The one way into the jaxprs that higher-order equations hold.

A tool is a table ``{primitive name: rule}``; its ``apply`` callback of
``_interpreter.eval_jaxpr`` looks each equation's rule up once and calls it.
For the higher-order primitives the engine knows, the rules come from one place:

- ``structured_rules(inline=, scan=, while_=, cond=)`` builds the entries of a
  tool that enters sub-jaxprs by *structure*: every call-like primitive
  (``_compat.INLINE_NAMES``: jit, call, remat, custom_jvp/custom_vjp) gets the
  ``inline`` rule, which evaluates ``_compat.inline_body(eqn)`` in place;
  ``scan``, ``while`` and ``cond`` get their own. The numerics report's catalog
  and its instrumented evaluation are two such tables, so they enter exactly the
  same jaxprs. autocast, which rebuilds each primitive with its own public API
  (``jax.jit``, ``jax.checkpoint``, ...), lists its rules per primitive by the
  name constants of ``_compat``.
- ``sub_path(path, index, branch)`` is the one path scheme: the position of a
  sub-jaxpr is the path of its parent jaxpr plus ``(equation index, branch)``,
  branch ``0`` for a single body and the branch number of a ``cond``. A tool
  that keys anything by position builds it here, so two tables agree.
- ``walk(jaxpr)`` visits every equation without running anything, into every
  jaxpr an equation holds, known primitive or not (``precision_report`` and the
  rule-table checks).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import jax.extend.core as jex

from jaxamp._engine import _compat as compat

__all__ = ["LOOP_NAMES", "STRUCTURED_NAMES", "structured_rules", "sub_path", "walk"]

# The primitives whose bodies run repeatedly or conditionally: each has its own rule.
LOOP_NAMES = ("scan", "while", "cond")
# Every primitive ``structured_rules`` covers.
STRUCTURED_NAMES = compat.INLINE_NAMES + LOOP_NAMES


def sub_path(path: tuple, index: int, branch: int = 0) -> tuple:
    """The path of a sub-jaxpr: its parent's ``path`` plus ``(index, branch)``.

    ``index`` is the equation's position in the parent jaxpr and ``branch`` the
    sub-jaxpr's number in the equation (``0`` for a call or loop body, ``b`` for
    branch ``b`` of a ``cond``). An inner jaxpr shared by two equations thus has
    two paths.
    """
    return (*path, (index, branch))


def structured_rules(
    *, inline: Callable, scan: Callable, while_: Callable, cond: Callable
) -> dict[str, Callable]:
    """A rule table entering sub-jaxprs by structure: ``{primitive name: rule}``.

    Args:
      inline: the rule of every call-like primitive (``_compat.INLINE_NAMES``),
        which runs ``_compat.inline_body(eqn)`` once on the equation's operands.
      scan: the rule of ``scan`` (``_compat.scan_parts``).
      while_: the rule of ``while`` (``_compat.while_parts``).
      cond: the rule of ``cond`` (``_compat.cond_parts``; branch ``b`` has
        ``sub_path(path, index, b)``).
    """
    return {
        **dict.fromkeys(compat.INLINE_NAMES, inline),
        "scan": scan,
        "while": while_,
        "cond": cond,
    }


def walk(jaxpr: jex.Jaxpr, count: int = 1) -> Iterator[tuple[jex.JaxprEqn, int]]:
    """Yields ``(eqn, times it runs)`` for every equation, sub-jaxprs included.

    Equations in a scan body run ``length`` times per scan; a while body is
    counted once (its trip count is not known statically).
    """
    for eqn in jaxpr.eqns:
        yield eqn, count
        inner = count * _trip_count(eqn)
        for sub in compat.sub_closed_jaxprs(eqn):
            yield from walk(sub.jaxpr, inner)


def _trip_count(eqn: Any) -> int:
    return compat.scan_parts(eqn).length if eqn.primitive.name == "scan" else 1
