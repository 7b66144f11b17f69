"""The one flatten-and-trace step in front of every jaxpr tool.

A user function takes pytrees of arrays and static leaves (Python scalars,
strings, configuration). ``flatten_call`` splits the arguments into the array
leaves, which become the traced inputs, and a function of those leaves alone
that puts the static leaves back; ``trace`` also flattens the output and gives
the closed jaxpr. ``jaxamp.autocast`` traces with ``trace``; ``numerics_report``
builds its gradient program around ``flatten_call``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.extend.core as jex
import numpy as np

__all__ = ["ARRAY_TYPES", "FlatCall", "Traced", "flatten_call", "is_array", "trace"]

# The leaves that are values (traced) rather than configuration. Tracers are
# jax.Array instances, so values inside jit/grad/vmap count too.
ARRAY_TYPES = (jax.Array, np.ndarray, np.generic)


def is_array(leaf: Any) -> bool:
    """Whether a pytree leaf is an array (JAX, NumPy or a NumPy scalar)."""
    return isinstance(leaf, ARRAY_TYPES)


class FlatCall(NamedTuple):
    """``call(*arrays)`` is ``fun(*args, **kwargs)`` with the array leaves as arguments."""

    call: Callable[..., Any]
    arrays: list[Any]
    # What identifies the call besides the arrays' types (a cache key): the
    # structure of ``(args, kwargs)`` and the non-array leaves.
    treedef: Any
    static: list[Any]
    # The key path of each array in ``(args, kwargs)``: ``(SequenceKey(0), ...)``
    # for ``args[0]``, ``(SequenceKey(1), DictKey(name), ...)`` for a keyword.
    paths: list[tuple]


def flatten_call(fun: Callable, args: Sequence[Any], kwargs: dict[str, Any]) -> FlatCall:
    """Splits a call into its array leaves and a function of them alone."""
    flat, treedef = jax.tree_util.tree_flatten_with_path((tuple(args), kwargs))
    leaves = [leaf for _, leaf in flat]
    dynamic = [is_array(leaf) for leaf in leaves]

    def call(*arrays: Any) -> Any:
        it = iter(arrays)
        full = [next(it) if d else leaf for leaf, d in zip(leaves, dynamic, strict=True)]
        a, k = jax.tree.unflatten(treedef, full)
        return fun(*a, **k)

    pairs = list(zip(flat, dynamic, strict=True))
    return FlatCall(
        call,
        [leaf for (_, leaf), d in pairs if d],
        treedef,
        [leaf for (_, leaf), d in pairs if not d],
        [path for (path, _), d in pairs if d],
    )


class Traced(NamedTuple):
    """A call traced to a closed jaxpr of its array leaves, with flat outputs."""

    closed: jex.ClosedJaxpr
    arrays: list[Any]
    out_tree: Any  # the output's treedef: jax.tree.unflatten(out_tree, flat outputs)


def trace(fun: Callable, args: Sequence[Any], kwargs: dict[str, Any]) -> Traced:
    """Traces ``fun(*args, **kwargs)`` with ``jax.make_jaxpr`` (its array leaves as inputs)."""
    call, arrays = flatten_call(fun, args, kwargs)[:2]
    out_trees: list = []

    def flat_call(*leaves: Any) -> list[Any]:
        flat, out_tree = jax.tree.flatten(call(*leaves))
        out_trees.append(out_tree)
        return flat

    closed = jax.make_jaxpr(flat_call)(*arrays)
    return Traced(closed, arrays, out_trees[-1])
