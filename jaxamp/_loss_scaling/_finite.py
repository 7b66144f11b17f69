"""Finiteness checks and selection over whole pytrees, built to compile fast.

One reduction per leaf (jmp's and optax's pattern) is one more kernel per leaf
for XLA to schedule, fuse and compile: with hundreds of leaves compile time
grows with them. So leaves under 2**16 elements are flattened and concatenated,
per dtype, into a few groups, each checked by one ``isfinite``-and-reduce.
Larger leaves get a reduction of their own: a concatenation copies its operands
(XLA:CPU with a slow elemental loop), which costs more at run time than a
reduction in place. The measurements: BENCHMARKS.md, "Why the numbers are what
they are" (the finite check).
"""

from __future__ import annotations

import cmath
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["all_finite", "check_finite_flag", "check_float_grads", "select", "select_tree"]


def all_finite(tree: Any) -> jax.Array:
    """True when every floating leaf of ``tree`` is free of inf and NaN.

    Python ``float`` and ``complex`` leaves are checked too (on the host: they
    are constants). Integer, bool and other non-array leaves count as finite; an
    empty tree is finite.

    >>> import jax.numpy as jnp, jaxamp
    >>> jaxamp.all_finite({"a": jnp.ones(3), "n": jnp.int32(7)})
    Array(True, dtype=bool)
    >>> jaxamp.all_finite([jnp.ones(3), jnp.array([1.0, jnp.inf])])
    Array(False, dtype=bool)
    >>> jaxamp.all_finite({"a": float("nan")})
    Array(False, dtype=bool)
    """
    flags = []
    small_by_dtype: dict[np.dtype, list[Any]] = {}
    for x in jax.tree.leaves(tree):
        if isinstance(x, (float, complex)):
            if not cmath.isfinite(x):
                return jnp.asarray(False)
            continue
        if not (hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)):
            continue
        if np.size(x) >= _OWN_REDUCTION_ELEMENTS:
            flags.append(jnp.isfinite(x).all())
        else:
            small_by_dtype.setdefault(np.dtype(x.dtype), []).append(jnp.ravel(x))
    flags += [
        jnp.isfinite(group[0] if len(group) == 1 else jnp.concatenate(group)).all()
        for leaves in small_by_dtype.values()
        for group in _groups(leaves)
    ]
    if not flags:
        return jnp.asarray(True)
    if len(flags) == 1:
        return flags[0]
    return jnp.stack(flags).all()


# Leaves this large are checked on their own: below it a reduction per leaf costs
# more compile time than the concatenation saves at run time, above it the copy
# costs more (BENCHMARKS.md, "Why the numbers are what they are").
_OWN_REDUCTION_ELEMENTS = 1 << 16

# Elements per concatenated group: a concatenation is a copy (XLA:CPU does not
# fuse it into the reduction), so each group's copy stays under 16 MiB of float32.
_GROUP_ELEMENTS = 1 << 22


def _groups(leaves: list[Any]) -> list[list[Any]]:
    """Consecutive runs of flat leaves of at most ``_GROUP_ELEMENTS`` (or one big leaf)."""
    groups: list[list[Any]] = []
    size = 0
    for x in leaves:
        if not groups or size + x.size > _GROUP_ELEMENTS:
            groups.append([])
            size = 0
        groups[-1].append(x)
        size += x.size
    return groups


def check_float_grads(grads: Any, name: str = "grads") -> None:
    """Raises TypeError naming the first integer or bool leaf of ``grads``.

    A gradient is floating: an integer leaf is a label, a step counter or a
    mask passed where gradients belong (``jax.grad`` of an integer input is
    ``float0``, which passes). Refused here, it is named; let through, it failed
    later in a select with no leaf path, or was silently accepted.
    """
    for path, leaf in jax.tree_util.tree_flatten_with_path(grads)[0]:
        dtype = getattr(leaf, "dtype", None)
        if dtype is not None and (
            jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.bool_)
        ):
            raise TypeError(
                f"{name} must be floating (gradients of the scaled loss); the leaf at "
                f"{jax.tree_util.keystr(path) or '(the root)'} has dtype {dtype}. Pass "
                "only the gradients of floating params (nnx.Optimizer(..., wrt=nnx.Param) "
                "does), not integer state, counters or labels."
            )


def check_finite_flag(flag: Any, name: str = "grads_finite") -> jax.Array:
    """Returns ``flag`` as a bool scalar array, or raises a clear error."""
    if isinstance(flag, (bool, np.bool_)):
        return jnp.asarray(flag)
    dtype = getattr(flag, "dtype", None)
    shape = getattr(flag, "shape", None)
    if dtype is None or shape is None:
        raise TypeError(
            f"{name} must be a bool scalar array such as jaxamp.all_finite(grads); "
            f"got {type(flag).__name__}: {flag!r}."
        )
    if dtype != np.bool_ or shape != ():
        raise TypeError(
            f"{name} must be a bool scalar array such as jaxamp.all_finite(grads); "
            f"got an array of dtype {dtype} and shape {shape}."
        )
    return jnp.asarray(flag)


def select_tree(pred: Any, on_true: Any, on_false: Any) -> Any:
    """Chooses between two pytrees of the same structure with a bool scalar.

    >>> import jax.numpy as jnp, jaxamp
    >>> jaxamp.select_tree(jnp.asarray(False), {"a": jnp.ones(2)}, {"a": jnp.zeros(2)})
    {'a': Array([0., 0.], dtype=float32)}
    """
    pred = check_finite_flag(pred, "pred")
    true_leaves, true_def = jax.tree.flatten(on_true)
    false_leaves, false_def = jax.tree.flatten(on_false)
    if true_def != false_def:
        raise ValueError(
            f"on_true and on_false must have the same tree structure; got {true_def} "
            f"and {false_def}."
        )
    for a, b in zip(true_leaves, false_leaves, strict=True):
        if jnp.shape(a) != jnp.shape(b) or jnp.result_type(a) != jnp.result_type(b):
            raise ValueError(
                "on_true and on_false leaves must match in shape and dtype; got "
                f"{jnp.result_type(a)}{list(jnp.shape(a))} and "
                f"{jnp.result_type(b)}{list(jnp.shape(b))}."
            )
    return jax.tree.unflatten(
        true_def, [select(pred, a, b) for a, b in zip(true_leaves, false_leaves, strict=True)]
    )


def select(pred: jax.Array, on_true: Any, on_false: Any) -> jax.Array:
    """``on_true`` where the bool scalar ``pred`` holds, else ``on_false`` (same shape and dtype).

    ``lax.select_n`` with the scalar predicate, not ``jnp.where``: ``jnp.where`` is
    a nested jit per call, and with one per leaf XLA's call inliner and call-graph
    passes (and the lowering) grew with the leaf count (BENCHMARKS.md, "Why the
    numbers are what they are").
    """
    return jax.lax.select_n(pred, jnp.asarray(on_false), jnp.asarray(on_true))
