"""Provenance: which measured outputs carry an inf/NaN on to the program's outputs.

An inf is not always a fault: ``softmax`` of an ``-inf`` mask entry is 0, a
``where`` discards what it does not select, ``tanh(inf)`` is 1. The report
blames an op only if its inf/NaN *reaches* the program's outputs (the loss, the
gradients with ``grad=True``, the ``aux`` state): the op is non-finite and a
chain of non-finite ops leads from it to a non-finite program output.

The chain is read from two things the report already has: the static data flow
between sites (``site_graph``: per site, the sites whose floating values it
reads, through calls, loop carries and branches, entered with the engine's
skeleton ``_engine._control.structured_rules`` as the catalog enters them), and
each site's measured inf/NaN count (``reaching``, on the host after the run).
Counts are per site, over all elements and iterations: an op that is non-finite
somewhere and feeds a non-finite op downstream counts as reaching.

>>> import jax, jax.numpy as jnp
>>> closed = jax.make_jaxpr(lambda x: jnp.exp(-x) * 2.0)(jnp.ones(2))
>>> graph = site_graph(closed)
>>> sorted(graph.returned), sorted(graph.reads[((), 1, 0)])
([((), 2, 0)], [((), 0, 0)])
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

import jax.extend.core as jex
import jax.numpy as jnp

from jaxamp._engine import _control as control
from jaxamp._engine._visit import sub_path
from jaxamp._numerics._sites import site_key

__all__ = ["SiteGraph", "reaching", "site_graph"]

_NONE: frozenset = frozenset()


class SiteGraph(NamedTuple):
    """The data flow between sites."""

    reads: dict  # site key -> the keys of the sites whose floating values it reads
    returned: frozenset  # the keys of the sites whose values are program outputs


class _Walk(NamedTuple):
    reads: dict  # what ``SiteGraph.reads`` becomes
    sites: frozenset | None  # the catalog's keys (None: every floating output)


def site_graph(closed: jex.ClosedJaxpr, sites: Iterable[tuple] | None = None) -> SiteGraph:
    """The site graph of ``closed``, keyed as the catalog keys its sites (``site_key``).

    ``sites``: the catalog's keys; a floating output that is not one (a step of a
    quantization, ``_sites.is_quantize_step``) passes on the sites it read.
    """
    walk = _Walk({}, None if sites is None else frozenset(sites))
    outs = _flow(closed.jaxpr, [_NONE] * len(closed.jaxpr.invars), (), walk)
    return SiteGraph(walk.reads, frozenset().union(*outs))


def reaching(graph: SiteGraph, nonfinite: Callable[[tuple], bool]) -> set:
    """The sites whose inf/NaN reach a program output: a backward search from the
    non-finite returned sites through non-finite sites only."""
    found = {key for key in graph.returned if nonfinite(key)}
    todo = list(found)
    while todo:
        for key in graph.reads.get(todo.pop(), _NONE):
            if key not in found and nonfinite(key):
                found.add(key)
                todo.append(key)
    return found


def _union(sources: Iterable[frozenset]) -> frozenset:
    return frozenset().union(*sources)


def _flow(jaxpr: jex.Jaxpr, ins: Sequence[frozenset], path: tuple, walk: _Walk) -> list:
    # Per variable: the sites whose values it holds (directly or through calls,
    # loop carries and branch outputs, which are not sites themselves).
    env = dict(zip(jaxpr.invars, ins, strict=True))

    def read(atom) -> frozenset:
        return env.get(atom, _NONE) if isinstance(atom, jex.Var) else _NONE

    for index, eqn in enumerate(jaxpr.eqns):
        rule = _RULES.get(eqn.primitive.name, _flow_op)
        outs = rule(eqn, [read(atom) for atom in eqn.invars], path, index, walk)
        env.update(zip(eqn.outvars, outs, strict=True))
    return [read(atom) for atom in jaxpr.outvars]


def _flow_op(eqn, ins, path, index, walk: _Walk) -> list:
    fed = _union(ins)
    outs = []
    for k, var in enumerate(eqn.outvars):
        dtype = getattr(var.aval, "dtype", None)
        if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
            outs.append(_NONE)  # an integer or bool value holds no inf/NaN
            continue
        key = site_key(path, index, k)
        if walk.sites is not None and key not in walk.sites:
            outs.append(fed)  # a step of a quantization: its value holds what it read
            continue
        walk.reads[key] = walk.reads.get(key, _NONE) | fed
        outs.append(frozenset({key}))
    return outs


def _flow_call(eqn, ins, path, index, walk: _Walk) -> list:
    return _flow(control.call_of(eqn).body.jaxpr, ins, sub_path(path, index), walk)


def _flow_loop(eqn, ins, path, index, walk: _Walk) -> list:
    loop = control.loop_of(eqn, ins)
    body_path = sub_path(path, index)
    carry = list(loop.carry)
    while True:  # the sources only grow, and there are finitely many sites
        outs = _flow(loop.body.jaxpr, [*loop.consts, *carry, *loop.xs], body_path, walk)
        grown = [a | b for a, b in zip(carry, outs[: loop.n_carry], strict=True)]
        if grown == carry:
            return [*carry, *outs[loop.n_carry :]]
        carry = grown


def _flow_cond(eqn, ins, path, index, walk: _Walk) -> list:
    branch = control.branch_of(eqn, ins)
    outs = [
        _flow(body.jaxpr, branch.operands, sub_path(path, index, b), walk)
        for b, body in enumerate(branch.branches)
    ]
    return [_union(sources) for sources in zip(*outs, strict=True)]


_RULES = control.structured_rules(call=_flow_call, loop=_flow_loop, branch=_flow_cond)
