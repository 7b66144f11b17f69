"""The structure of higher-order primitives, declared once: calls, loops, branches.

Every jaxpr tool that enters sub-jaxprs (autocast, the numerics catalog, the
numerics measuring pass) does it through this module. A higher-order equation
has one of three shapes, each read from ``_compat``'s parts with its operands
already split:

- ``Call`` (``call_of``): one body run once on the equation's operands (jit,
  call/closed_call/eval_jaxpr, remat, custom_jvp/custom_vjp calls).
  ``rebuild(fun)`` wraps a function of the operands with the primitive's public
  API (``jax.jit``, ``jax.checkpoint``), or is None where the body runs in place.
- ``Loop`` (``loop_of``): a body run repeatedly on ``(consts, carry, xs)``
  (scan, while). ``rebuild(body, init, xs, cond)`` builds it again with
  ``lax.scan`` / ``lax.while_loop``.
- ``Branch`` (``branch_of``): one of several bodies on the same operands (cond).
  ``rebuild(index, fns, *operands)`` builds it again with ``lax.switch`` or
  ``lax.platform_dependent``.

``structured_rules(call=, loop=, branch=, extra=)`` is the one skeleton: a tool
writes three rules and gets the entry of every structured primitive, so two
tools enter the same jaxprs by construction. ``carry_fixpoint`` is the one
search for what loop carries hold (autocast: their dtypes; the catalog: whether
they depend on the loss scale).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.extend.core as jex

from jaxamp._engine import _compat as compat

__all__ = [
    "BRANCH_NAMES",
    "CALL_NAMES",
    "CARRY_ROUNDS",
    "LOOP_NAMES",
    "STRUCTURED_NAMES",
    "Branch",
    "Call",
    "Loop",
    "branch_of",
    "call_of",
    "carry_fixpoint",
    "loop_of",
    "structured_rules",
]

# A body run once on the equation's operands, returning the equation's outputs.
CALL_NAMES = compat.INLINE_NAMES
# A body run repeatedly on (consts, carry, xs).
LOOP_NAMES = ("scan", "while")
# One of several bodies on the same operands.
BRANCH_NAMES = ("cond",)
STRUCTURED_NAMES = CALL_NAMES + LOOP_NAMES + BRANCH_NAMES

# How often ``carry_fixpoint`` runs a loop body (abstractly) at most. The search
# terminates on its own: each tool's ``join`` only moves a carry up a finite order
# (autocast: a role PLAIN -> ACTIVATION -> PINNED and, above PLAIN, a dtype that only
# promotes; the catalog: a flag False -> True), so every round either moves a carry
# up, which can happen finitely often, or moves nothing and ends the search. The
# bound caps the cost of long chains of carries feeding each other; a tool must stay
# correct when it is reached (autocast casts to the last types found, so the loop is
# still well-typed).
CARRY_ROUNDS = 8


class Call(NamedTuple):
    """A call-like equation: ``body`` takes the operands and returns the outputs."""

    body: jex.ClosedJaxpr
    # fun -> fun rebuilt as the primitive (jax.jit, jax.checkpoint); None: run in place.
    rebuild: Callable[[Callable], Callable] | None
    name: str | None = None  # the jitted function's name, kept when rebuilt
    policy: Any = None  # a checkpoint's saving policy (it inspects the equations)


def call_of(eqn: jex.JaxprEqn) -> Call:
    name = eqn.primitive.name
    if name in compat.JIT_NAMES:
        jit = compat.jit_parts(eqn)
        return Call(jit.jaxpr, functools.partial(jax.jit, inline=jit.inline), jit.name)
    if name in compat.REMAT_NAMES:
        remat = compat.remat_parts(eqn)
        rebuild = functools.partial(
            jax.checkpoint, prevent_cse=remat.prevent_cse, policy=remat.policy
        )
        return Call(remat.jaxpr, rebuild, None, remat.policy)
    if name in compat.CALL_NAMES or name in compat.CUSTOM_CALL_NAMES:
        # For custom_jvp and custom_vjp: the primal function; their rules are not part of it.
        return Call(compat.call_jaxpr(eqn), None)
    raise ValueError(f"{name!r} is not a call-like primitive ({', '.join(CALL_NAMES)}).")


def _scan(parts: compat.ScanParts, body, init, xs, cond=None):
    return jax.lax.scan(
        body, init, xs, length=parts.length, reverse=parts.reverse, unroll=parts.unroll
    )


def _while(body, init, xs, cond):
    # A while loop scans nothing: its ys are the (empty) xs, of the tool's own structure.
    return jax.lax.while_loop(cond, lambda carry: body(carry, xs)[0], init), xs


class Loop(NamedTuple):
    """A loop: ``body`` maps ``(*consts, *carry, *x)`` to ``(*carry, *y)``."""

    body: jex.ClosedJaxpr
    consts: list
    carry: list
    xs: list  # operands scanned along their leading axis ([] for a while loop)
    cond: jex.ClosedJaxpr | None  # while: (*cond_consts, *carry) -> bool
    cond_consts: list
    # (body(carry, x) -> (carry, y), init, xs, cond(carry) -> bool) -> (carry, ys)
    rebuild: Callable
    # True: the loop's carry outputs are the body's (a scan); False: the body may
    # not run, so they are the carry's fixpoint (a while loop).
    returns_body_outputs: bool

    @property
    def n_carry(self) -> int:
        return len(self.carry)

    def batched_predicate(self) -> bool:
        """A while loop with a batched predicate (vmap): ``lax.while_loop`` cannot rebuild it."""
        return self.cond is not None and self.cond.out_avals[0].shape != ()


def loop_of(eqn: jex.JaxprEqn, ins: Sequence[Any]) -> Loop:
    if eqn.primitive.name == "scan":
        scan = compat.scan_parts(eqn)
        consts, carry, xs = scan.split(ins)
        rebuild = functools.partial(_scan, scan)
        return Loop(scan.jaxpr, consts, carry, xs, None, [], rebuild, True)
    loop = compat.while_parts(eqn)
    cond_consts, consts, carry = loop.split(ins)
    return Loop(loop.body_jaxpr, consts, carry, [], loop.cond_jaxpr, cond_consts, _while, False)


class Branch(NamedTuple):
    """A cond: ``branches[index]`` runs on ``operands``."""

    index: Any
    operands: list
    branches: tuple[jex.ClosedJaxpr, ...]
    # For lax.platform_dependent: the platforms of each branch (None: the default
    # branch), or None for an ordinary cond.
    platforms: tuple | None

    def rebuild(self, index: Any, fns: Sequence[Callable], *operands: Any) -> Any:
        """``fns[index](*operands)``, built as the original (a switch or per platform)."""
        if self.platforms is None:
            return jax.lax.switch(index, fns, *operands)
        # lax.platform_dependent has its own platform index, so only the branch of
        # the platform being lowered for is compiled, as in the original.
        per_platform, default = {}, None
        for names, fn in zip(self.platforms, fns, strict=True):
            if names is None:
                default = fn
            else:
                per_platform.update(dict.fromkeys(names, fn))
        return jax.lax.platform_dependent(*operands, default=default, **per_platform)


def branch_of(eqn: jex.JaxprEqn, ins: Sequence[Any]) -> Branch:
    parts = compat.cond_parts(eqn)
    index, operands = parts.split(ins)
    return Branch(index, operands, parts.branches, parts.platforms)


def structured_rules(
    *,
    call: Callable,
    loop: Callable,
    branch: Callable,
    extra: Mapping[str, Callable | None] | None = None,
) -> dict[str, Callable]:
    """A tool's rules for every structured primitive: ``{primitive name: rule}``.

    Args:
      call: the rule of every call-like primitive (``CALL_NAMES``; ``call_of``).
      loop: the rule of every loop (``LOOP_NAMES``; ``loop_of``).
      branch: the rule of every branching primitive (``BRANCH_NAMES``;
        ``branch_of``; branch ``b`` has ``_visit.sub_path(path, index, b)``).
      extra: rules by primitive name that replace or add to these (None removes
        a primitive: the tool does not enter it).
    """
    table = {
        **dict.fromkeys(CALL_NAMES, call),
        **dict.fromkeys(LOOP_NAMES, loop),
        **dict.fromkeys(BRANCH_NAMES, branch),
    }
    for name, rule in (extra or {}).items():
        if rule is None:
            table.pop(name, None)
        else:
            table[name] = rule
    return table


def carry_fixpoint(body: Callable[[list], Sequence], init: Sequence, join: Callable) -> list:
    """What a loop's carries hold over every iteration: the least fixpoint from ``init``.

    ``body(carry)`` gives what one iteration makes of ``carry`` (its first
    ``len(init)`` entries are the new carries); ``join(carry, outs)`` merges them
    into the next estimate. The search stops when a round changes nothing, or after
    ``CARRY_ROUNDS`` rounds (see there why it terminates).
    """
    carry = list(init)
    for _ in range(CARRY_ROUNDS):
        new = list(join(carry, list(body(carry))[: len(carry)]))
        if new == carry:
            break
        carry = new
    return carry
