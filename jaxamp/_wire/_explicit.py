"""``Policy.cast_to_compute`` under explicit sharding: gradients reduced in ``reduce_dtype``.

Under ``jax.jit`` of a mesh with ``AxisType.Auto`` axes the SPMD partitioner
reduces a weight gradient inside the product that computes it, in that
product's (16-bit) result dtype. A mesh of ``AxisType.Explicit`` axes lets the
forward pass say where that reduction happens: a parameter resharded to
``reduced`` over the mesh axes gets an unreduced cotangent from the products
that read it, and the transpose of that reshard is the reduction. Here the
cast's backward widens the cotangent to ``reduce_dtype`` before that point, so
the reduction runs in ``reduce_dtype``. A parameter sharded over the mesh
(FSDP) is gathered here in ``gather_dtype``, and its gradient reduce-scattered
back to its sharding in ``reduce_dtype``.

A leaf of the import graph, like ``_warnings``: ``jaxamp._policy`` calls
:func:`cast_explicit`, so it reads a policy through ``WireDtypes``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.core import Tracer

from jaxamp._casting import is_floating
from jaxamp._engine import _compat as compat
from jaxamp._wire._warnings import WireDtypes

__all__ = ["cast_explicit", "check_matmul_operands", "explicit_mesh"]

MatmulOperands = bool | Callable[[tuple, Any], bool] | None


def explicit_mesh(values: list) -> Any:
    """The mesh of ``AxisType.Explicit`` axes (over 2+ devices) the traced ``values`` live on.

    None where a cast cannot place the reduction: concrete arrays (no gradient),
    an ``Auto`` or ``Manual`` mesh, one device, or a JAX without ``reduced``
    shardings.
    """
    if not compat.has_reduced_types():
        return None
    for value in values:
        if not isinstance(value, Tracer):
            continue
        mesh = getattr(getattr(jax.typeof(value), "sharding", None), "mesh", None)
        if mesh is None or mesh.empty or mesh.size < 2:
            continue
        types = set(mesh.axis_types)
        if jax.sharding.AxisType.Explicit in types and jax.sharding.AxisType.Manual not in types:
            return mesh
    return None


def _axes(entry: Any) -> tuple:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _reshard_cast(x, full, back, dtypes: tuple, gather: bool):
    # full: the sharding the products read; back: x's own, where the gradient goes.
    # dtypes: (gather, compute, reduce).
    sent = x.astype(dtypes[0]) if gather else x
    return jax.sharding.reshard(sent, full).astype(dtypes[1])


def _reshard_cast_fwd(x, full, back, dtypes, gather):
    # A scalar residual: only x's dtype is needed (a zero of x's size would be kept alive).
    return _reshard_cast(x, full, back, dtypes, gather), jax.numpy.zeros((), x.dtype)


def _reshard_cast_bwd(full, back, dtypes, gather, like, ct):
    # Cast to reduce_dtype first: the reshard back to the parameter's sharding is
    # where an unreduced cotangent is summed.
    summed = jax.sharding.reshard(ct.astype(dtypes[2]), back)
    return (summed.astype(like.dtype),)


_reshard_cast.defvjp(_reshard_cast_fwd, _reshard_cast_bwd)


def _cast_leaf(x: Any, policy: WireDtypes, reduced: bool) -> Any:
    sharding = getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if sharding is None or mesh is None or mesh.empty or not isinstance(x, Tracer):
        return x.astype(policy.compute_dtype)  # a constant: no gradient to reduce
    explicit = {
        a
        for a, t in zip(mesh.axis_names, mesh.axis_types, strict=True)
        if t == jax.sharding.AxisType.Explicit
    }
    entries = compat.spec_partitions(sharding.spec)
    dims = [tuple(a for a in _axes(e) if a not in explicit) for e in entries]
    gather = any(len(d) < len(_axes(e)) for d, e in zip(dims, entries, strict=True))
    extra = explicit - {a for d in dims for a in d} if reduced else set()
    if sharding.spec.unreduced or not (gather or extra - set(sharding.spec.reduced)):
        return x.astype(policy.compute_dtype)  # nothing to gather, no reduction to place
    full = jax.sharding.PartitionSpec(
        *(d if len(d) > 1 else (d[0] if d else None) for d in dims),
        reduced=frozenset(sharding.spec.reduced) | frozenset(extra),
    )
    dtypes = tuple(map(np.dtype, (policy.gather_dtype, policy.compute_dtype, policy.reduce_dtype)))
    full_sharding = jax.sharding.NamedSharding(mesh, full)
    return _reshard_cast(x, full_sharding, sharding, dtypes, gather)


def check_matmul_operands(matmul_operands: Any) -> None:
    """Raises TypeError unless ``matmul_operands`` is None, a bool or a callable.

    Checked on every call, so that a wrong argument fails on one device too.
    """
    if matmul_operands is None or isinstance(matmul_operands, bool) or callable(matmul_operands):
        return
    raise TypeError(
        "matmul_operands must be None, a bool or a callable (path, leaf) -> bool, got "
        f"{type(matmul_operands).__name__}"
    )


def _selector(matmul_operands: MatmulOperands) -> Callable[[tuple, Any], bool]:
    if matmul_operands is None or isinstance(matmul_operands, bool):
        return lambda path, x: bool(matmul_operands)
    return matmul_operands


def cast_explicit(tree: Any, policy: WireDtypes, matmul_operands: MatmulOperands) -> Any:
    """``tree``'s floating leaves in the compute dtype, for a mesh of explicit axes.

    A leaf sharded over explicit axes is gathered in ``gather_dtype`` (its
    gradient reduce-scattered back in ``reduce_dtype``). A leaf that
    ``matmul_operands(path, leaf)`` selects is typed ``reduced`` over the
    explicit axes it is not sharded over, so its gradient is summed at the
    cast's transpose, in ``reduce_dtype``; the others are replicated and their
    gradients summed by the operations that read them, in those operations'
    result dtype.
    """
    select = _selector(matmul_operands)

    def leaf(path: tuple, x: Any) -> Any:
        if not is_floating(x):
            return x
        return _cast_leaf(x, policy, select(path, x))

    return jax.tree_util.tree_map_with_path(leaf, tree)
