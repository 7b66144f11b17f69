"""What crosses the wire inside ``shard_map``: parameters all-gathered in a policy's
``gather_dtype``, their gradients reduced in its ``reduce_dtype``.

JAX differentiates ``all_gather(cast(shard))`` into a ``psum_scatter`` of the
cast's (16-bit) cotangent, and a replicated parameter cast before it meets a
batch-sharded activation into a 16-bit ``psum``. Both reductions here run in
``reduce_dtype`` instead: the gather's backward upcasts before its
reduce-scatter (as PyTorch FSDP2 does), and a replicated parameter is marked
varying before its cast, so the ``psum`` that transposes that mark sums the
wide gradient.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np

from jaxamp._casting import is_floating
from jaxamp._engine import _compat as compat
from jaxamp._policy import Policy, get_policy

__all__ = ["all_gather_cast", "gather_params", "vary_before_cast"]


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _all_gather(shard, axis_name, axis: int, tiled: bool, dtypes: tuple):
    # dtypes: (gather, compute, reduce); the shard's own dtype is the gradient's.
    gather_dtype, compute_dtype, _ = dtypes
    full = jax.lax.all_gather(shard.astype(gather_dtype), axis_name, axis=axis, tiled=tiled)
    return full.astype(compute_dtype)


def _all_gather_fwd(shard, axis_name, axis, tiled, dtypes):
    return _all_gather(shard, axis_name, axis, tiled, dtypes), jax.numpy.zeros((), shard.dtype)


def _all_gather_bwd(axis_name, axis, tiled, dtypes, like, ct):
    summed = jax.lax.psum_scatter(
        ct.astype(dtypes[2]), axis_name, scatter_dimension=axis, tiled=tiled
    )
    return (summed.astype(like.dtype),)


_all_gather.defvjp(_all_gather_fwd, _all_gather_bwd)


def all_gather_cast(shard: Any, policy: Policy, axis_name: Any, axis: int = 0, tiled: bool = True):
    """``jax.lax.all_gather`` of a parameter shard in ``policy.gather_dtype``.

    The result is in the compute dtype; the gradient is reduce-scattered in
    ``policy.reduce_dtype`` and returned in the shard's dtype.
    """
    dtypes = (policy.gather_dtype, policy.compute_dtype, policy.reduce_dtype)
    return _all_gather(shard, axis_name, axis, tiled, tuple(map(np.dtype, dtypes)))


def vary_before_cast(value: Any, reduce_dtype: Any, *like: Any) -> Any:
    """``value`` marked varying over the mesh axes ``like`` vary over (inside ``shard_map``).

    A replicated parameter that meets a varying activation is marked varying
    where it meets it, and the transpose of that mark is the ``psum`` of its
    gradient, in the dtype it had there. Marked before its cast, the gradient
    is summed in the parameter's own dtype; so unless ``reduce_dtype`` is
    narrower than that. Outside ``shard_map`` nothing varies: ``value`` as is.
    """
    if np.dtype(reduce_dtype).itemsize < np.dtype(value.dtype).itemsize:
        return value
    if isinstance(value, (np.ndarray, np.generic)):
        return value  # a constant: no gradient
    return compat.vary_like(value, *like)


def gather_params(shards: Any, policy: Any, axis_name: Any, axis: Any = 0) -> Any:
    """Parameters for the compute, inside ``shard_map``: FSDP's all-gather, by a policy.

    Each floating leaf is all-gathered along ``axis`` (a tiled gather, as
    ``jax.lax.all_gather(..., tiled=True)``) in ``policy.gather_dtype`` and
    returned in ``policy.compute_dtype``; in the backward pass its gradient is
    reduce-scattered in ``policy.reduce_dtype`` (default float32) and returned
    in the leaf's dtype, as PyTorch FSDP2's ``MixedPrecisionPolicy`` does. A
    leaf whose axis is ``None`` is replicated: it is cast, and its gradient
    ``psum``-ed over ``axis_name`` in ``reduce_dtype``. Integer leaves and
    non-array leaves come back unchanged.

    Args:
      shards: a pytree of this device's parameter shards.
      policy: a :class:`jaxamp.Policy` or a policy string.
      axis_name: the mesh axis (or tuple of axes) the parameters are sharded over.
      axis: the dim each leaf is sharded on: an int for all leaves, or a pytree
        of ints and ``None`` with the structure of ``shards``.

    Returns:
      A pytree of the same structure with the full parameters.

    >>> import jax, jax.numpy as jnp, jaxamp
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jax.make_mesh((1,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    >>> def loss(w_shard, x):
    ...     w = jaxamp.gather_params(w_shard, "mixed_bfloat16", "d")
    ...     return jax.lax.psum(jnp.sum((x.astype(w.dtype) @ w).astype(jnp.float32)), "d")
    >>> f = jax.shard_map(jax.grad(loss), mesh=mesh, in_specs=(P("d"), P("d")), out_specs=P("d"))
    >>> f(jnp.ones((4, 2)), jnp.ones((3, 4))).dtype
    dtype('float32')
    """
    policy = get_policy(policy)
    if isinstance(axis, int):
        return jax.tree.map(lambda x: _gather_leaf(x, policy, axis_name, axis), shards)
    return jax.tree.map(
        lambda a, x: _gather_leaf(x, policy, axis_name, a),
        axis,
        shards,
        is_leaf=lambda a: a is None,
    )


def _gather_leaf(x: Any, policy: Policy, axis_name: Any, axis: int | None) -> Any:
    if not is_floating(x):
        return x
    if axis is not None:
        return all_gather_cast(x, policy, axis_name, axis)
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    missing = tuple(a for a in names if a not in compat.varying_axes(x))
    if missing and np.dtype(policy.reduce_dtype).itemsize >= np.dtype(x.dtype).itemsize:
        x = jax.lax.pcast(x, missing, to="varying")
    return x.astype(policy.compute_dtype)
