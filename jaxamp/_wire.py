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
import warnings
from typing import Any

import jax
import numpy as np

from jaxamp._casting import is_floating
from jaxamp._engine import _compat as compat
from jaxamp._policy import Policy, get_policy

__all__ = [
    "WireDtypeWarning",
    "all_gather_cast",
    "gather_params",
    "spans_devices",
    "vary_before_cast",
    "warn_unhonoured_wire_dtypes",
]


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


def spans_devices(*values: Any) -> bool:
    """Whether the trace sees ``values`` on a mesh of several devices, partitioned by XLA.

    ``jit`` with sharded arguments gives every traced value's type the mesh
    (``jax.typeof(v).sharding.mesh``), ``jax.set_mesh`` gives the trace one;
    the SPMD partitioner then inserts the collectives, in the dtype of the
    values they sum. False on one device, inside ``shard_map`` (manual axes:
    the code's own collectives), and under ``jit(in_shardings=...)`` of
    arrays whose mesh the trace does not see.
    """
    mesh = jax.sharding.get_abstract_mesh()
    for value in values:
        own = getattr(getattr(jax.typeof(value), "sharding", None), "mesh", None)
        if own is not None and not own.empty:
            mesh = own
            break
    if mesh.empty or mesh.size < 2:
        return False
    return jax.sharding.AxisType.Manual not in mesh.axis_types


class WireDtypeWarning(UserWarning):
    """A policy asks for a wire dtype that this program cannot send.

    Raised as a warning (once per call site, Python's default) when a traced
    program spans several devices and a policy's ``gather_dtype`` or
    ``reduce_dtype`` cannot take effect where it is used: ``policy.cast_to_compute``
    under ``jax.jit`` or inside ``shard_map``, or ``autocast`` under ``jax.jit``
    with a ``gather_dtype`` other than the compute dtype. The message says what
    crosses the wire instead and what honours the policy. To make it an error:
    ``warnings.simplefilter("error", jaxamp.WireDtypeWarning)``.
    """


def _partitioned_or_manual(values: list) -> str | None:
    # Which multi-device program a trace of ``values`` is part of, if any.
    if not any(isinstance(v, jax.core.Tracer) for v in values):
        return None  # eager: a cast of concrete arrays has no gradient to reduce
    if spans_devices(*values):
        return "jax.jit"
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size < 2:
        return None
    manual = [
        a
        for a, t in zip(mesh.axis_names, mesh.axis_types, strict=True)
        if t == jax.sharding.AxisType.Manual
    ]
    # Under check_vma=False (and pmap) JAX inserts no reduction: the code's own
    # psum (or loss_scaling's grad_reduction) decides its dtype.
    return "shard_map" if any(compat.tracks_variance(a) for a in manual) else None


def warn_unhonoured_wire_dtypes(policy: Policy, values: list, autocast_of: str = "") -> None:
    """Warns (:class:`WireDtypeWarning`) where ``policy``'s wire dtypes cannot take effect.

    ``values`` are cast by ``policy.cast_to_compute`` (neither wire dtype can be
    chosen there), or by ``autocast`` of the function named ``autocast_of``
    (under ``jax.jit`` only ``gather_dtype`` cannot).
    """
    by_cast = not autocast_of
    compute = np.dtype(policy.compute_dtype)
    wrong, accept = [], "policy"
    if np.dtype(policy.gather_dtype) != compute:
        wrong.append(
            f"parameters are all-gathered in {compute.name} (the dtype of the cast "
            f"shards), not gather_dtype={np.dtype(policy.gather_dtype).name}"
        )
        accept += f".with_gather_dtype({compute.name!r})"
    if by_cast and np.dtype(policy.reduce_dtype) != compute:
        wrong.append(
            f"weight gradients are reduced in the result dtype of the products that read "
            f"the cast values ({compute.name} for {compute.name} factors), not "
            f"reduce_dtype={np.dtype(policy.reduce_dtype).name}"
        )
        accept += f".with_reduce_dtype({compute.name!r})"
    if not wrong:
        return  # checked first: most policies never look at the trace's mesh
    program = _partitioned_or_manual(values)
    if program is None or (program == "shard_map" and not by_cast):
        return
    who = "policy.cast_to_compute" if by_cast else f"jaxamp.autocast({autocast_of})"
    if program == "shard_map":
        fix = "jaxamp.gather_params(shards, policy, axis_name) gathers and reduces by the policy"
    elif by_cast:
        fix = (
            "jaxamp.autocast(fn, policy) owns the products and reduces in reduce_dtype, "
            "and jaxamp.gather_params inside shard_map honours both"
        )
    else:
        fix = "gather the shards inside shard_map (jaxamp.gather_params, or jax.lax.all_gather)"
    warnings.warn(
        f"{who} in a program over several devices ({program}): {'; '.join(wrong)}. "
        f"To honour the policy: {fix}. To accept what is sent, say so in the policy: {accept}.",
        WireDtypeWarning,
        stacklevel=3,
    )


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


def narrowed_linear(fn: Any, x: Any, dtype: Any, *rest: Any) -> Any:
    """``fn(saturate_finite(x, dtype), *rest)`` whose gradient for ``x`` stays in ``x``'s dtype.

    ``fn`` is linear in its first argument (a broadcast, an embedding lookup)
    and its backward pass sums over the rows of a batch: a bias's sum over the
    batch, a table's scatter-add. JAX would transpose it on the 16-bit
    cotangent, so that the SPMD partitioner sums the shards of a data-parallel
    batch in 16 bits; here the cotangent is widened first and ``fn`` transposed
    in ``x``'s dtype. ``rest``: integer operands (indices), not differentiated.
    """
    from jaxamp._autocast._values import saturate_finite

    @jax.custom_vjp
    def narrowed(x, *rest):
        return fn(saturate_finite(x, dtype), *rest)

    def fwd(x, *rest):
        # The function itself, not ``narrowed``: under forward-over-reverse
        # (jax.hessian) fwd runs on JVP tracers, which JAX differentiates through
        # primitives but not through a custom_vjp.
        return fn(saturate_finite(x, dtype), *rest), (x, rest)

    def bwd(residuals, ct):
        x, rest = residuals  # x: for its type only (inside shard_map: its varying axes)
        (grad,) = jax.linear_transpose(lambda a: fn(a, *rest), x)(ct.astype(x.dtype))
        return (grad, *(None for _ in rest))

    narrowed.defvjp(fwd, bwd)
    return narrowed(x, *rest)
