"""The path scheme of sub-jaxprs and the static visit of a jaxpr.

- ``sub_path(path, index, branch)`` is the one path scheme: the position of a
  sub-jaxpr is the path of its parent jaxpr plus ``(equation index, branch)``,
  branch ``0`` for a single body and the branch number of a ``cond``. A tool
  that keys anything by position builds it here, so two tables agree.
- ``walk(jaxpr)`` visits every equation without running anything, into every
  jaxpr an equation holds, known primitive or not (``precision_report`` and the
  rule-table checks); ``walk_scoped(jaxpr)`` also gives each equation's whole
  name stack, its enclosing equations' included.

The tools that run or rebuild sub-jaxprs enter them through ``_control``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jax.extend.core as jex

from jaxamp._engine import _compat as compat

__all__ = ["sub_path", "walk", "walk_scoped"]


def sub_path(path: tuple, index: int, branch: int = 0) -> tuple:
    """The path of a sub-jaxpr: its parent's ``path`` plus ``(index, branch)``.

    ``index`` is the equation's position in the parent jaxpr and ``branch`` the
    sub-jaxpr's number in the equation (``0`` for a call or loop body, ``b`` for
    branch ``b`` of a ``cond``). An inner jaxpr shared by two equations thus has
    two paths.
    """
    return (*path, (index, branch))


def walk(jaxpr: jex.Jaxpr, count: int = 1) -> Iterator[tuple[jex.JaxprEqn, int]]:
    """Yields ``(eqn, times it runs)`` for every equation, sub-jaxprs included.

    Equations in a scan body run ``length`` times per scan; a while body is
    counted once (its trip count is not known statically).
    """
    for eqn, times, _ in walk_scoped(jaxpr, count):
        yield eqn, times


def walk_scoped(
    jaxpr: jex.Jaxpr, count: int = 1, scope: str = ""
) -> Iterator[tuple[jex.JaxprEqn, int, str]]:
    """As :func:`walk`, with each equation's name stack below its enclosing equations'.

    An equation of a sub-jaxpr (a jit's, a ``custom_vjp``'s) carries the name
    stack of its own trace only; a ``jax.named_scope`` around the call is on the
    enclosing equation.
    """
    for eqn in jaxpr.eqns:
        own = str(eqn.source_info.name_stack)
        stack = "/".join(s for s in (scope, own) if s)
        yield eqn, count, stack
        inner = count * _trip_count(eqn)
        for sub in compat.sub_closed_jaxprs(eqn):
            yield from walk_scoped(sub.jaxpr, inner, stack)


def _trip_count(eqn: Any) -> int:
    return compat.scan_parts(eqn).length if eqn.primitive.name == "scan" else 1
