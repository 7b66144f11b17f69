"""autocast's rules for parameters that cross devices' wire.

A parameter shard all-gathered inside ``shard_map`` is gathered in the policy's
``gather_dtype``; an embedding table read by a ``gather`` is cast before the
lookup (so a sharded table is gathered in 16 bits); and the gradients of both,
and of parameters broadcast against activations (biases, position tables), are
summed in ``reduce_dtype`` (``jaxamp/_wire/_gather.py`` holds the gather and the
mark; :func:`narrowed_linear` here the widened transpose). Called from the
``follow`` and ``compute`` rules and ``Autocaster.follow_values`` in ``_caster.py``,
which passes itself as ``ac``: this module reads it through :class:`Caster` and
never imports ``_caster``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.extend.core as jex
import numpy as np

from jaxamp._autocast._values import ACTIVATION, PLAIN, saturate_finite
from jaxamp._casting import F32, is_floating
from jaxamp._engine import _compat as compat
from jaxamp._policy import Policy
from jaxamp._wire._gather import all_gather_cast, vary_before_cast
from jaxamp._wire._warnings import spans_devices

__all__ = [
    "Caster",
    "gathered_parameter",
    "gathers_a_parameter",
    "gradient_dtype",
    "mark_parameter",
    "narrow_lookup",
    "narrowed_linear",
    "product_dtypes",
    "wide_broadcast",
    "wide_gradient_of",
]


class Caster(Protocol):
    """What these rules read of ``_caster.Autocaster``."""

    @property
    def policy(self) -> Policy: ...

    @property
    def compute_dtype(self) -> np.dtype: ...

    @property
    def transposable(self) -> bool: ...


def gathers_a_parameter(ac: Caster, eqn: jex.JaxprEqn, ins: list[tuple]) -> bool:
    # An ``all_gather`` of a float parameter shard (FSDP inside shard_map).
    if eqn.primitive.name != "all_gather" or eqn.params.get("axis_index_groups"):
        return False
    (shard, role), *_ = ins
    narrower = is_floating(shard) and ac.compute_dtype.itemsize < np.dtype(shard.dtype).itemsize
    return role == PLAIN and narrower


def gathered_parameter(ac: Caster, eqn: jex.JaxprEqn, shard: Any) -> Any:
    """The all-gather in ``gather_dtype``, its gradient reduce-scattered in ``reduce_dtype``."""
    p = eqn.params
    return all_gather_cast(shard, ac.policy, p["axis_name"], p["all_gather_dimension"], p["tiled"])


def narrow_lookup(ac: Caster, eqn: jex.JaxprEqn, ins: list[tuple]) -> list | None:
    """A ``gather`` from a traced float table (an embedding), read in the compute dtype.

    The rows it picks would meet the activations, and be cast, anyway; cast
    first, a table sharded across devices is all-gathered in 16 bits, like the
    weights the matmuls cast, and what follows (a position embedding added,
    the residual stream) runs in the compute dtype from the start. Its
    gradient is scatter-added in ``reduce_dtype`` (:func:`narrowed_linear`).
    """
    if eqn.primitive.name != "gather":
        return None
    (table, role), *rest = ins
    narrower = is_floating(table) and ac.compute_dtype.itemsize < np.dtype(table.dtype).itemsize
    if role != PLAIN or not narrower or np.ndim(table) < 2 or isinstance(table, np.ndarray):
        return None
    indices = [v for v, _ in rest]
    table = vary_before_cast(table, ac.policy.reduce_dtype, *indices)
    out = wide_gradient_of(ac, table, lambda t, *idx: compat.bind_eqn(eqn, [t, *idx])[0], indices)
    return [(out, ACTIVATION)]


def wide_gradient_of(
    ac: Caster, x: Any, fn: Callable, rest: list, dtype: np.dtype | None = None
) -> Any:
    # fn(x in ``dtype`` (the compute dtype), *rest), linear in x; its gradient for x
    # in x's dtype unless reduce_dtype is narrower.
    dtype = ac.compute_dtype if dtype is None else dtype
    if ac.transposable or np.dtype(ac.policy.reduce_dtype).itemsize < x.dtype.itemsize:
        return fn(saturate_finite(x, dtype), *rest)
    return narrowed_linear(fn, x, dtype, *rest)


def product_dtypes(
    ac: Caster, lhs: Any, rhs: Any, roles: tuple[int, int]
) -> tuple[tuple[np.dtype, np.dtype], np.dtype]:
    """The result dtypes of a product's two backward products and of the product itself.

    Across devices, a product's partial sums are reduced in its result dtype:
    the compute dtype there, float32 (then a cast) on one device.
    """
    partitioned = spans_devices(lhs, rhs)
    grads = (gradient_dtype(ac, roles[0], partitioned), gradient_dtype(ac, roles[1], partitioned))
    return grads, ac.compute_dtype if partitioned else F32


def gradient_dtype(ac: Caster, role: int, partitioned: bool = False) -> np.dtype:
    """The result dtype of the backward product giving a contraction operand's cotangent.

    Under SPMD partitioning the partitioner reduces a cotangent across
    devices right after that product, in its result dtype. The gradient
    of a parameter (a PLAIN operand) comes out in ``policy.reduce_dtype``
    (float32 unless it is 16-bit); an activation's in the compute dtype
    where the program spans several devices (``partitioned``: Megatron's
    16-bit partial sums), else float32 (accumulation, then a cast).
    """
    reduce = np.dtype(ac.policy.reduce_dtype)
    if role == PLAIN:
        return reduce if reduce.itemsize < 4 else F32
    return ac.compute_dtype if partitioned else F32


def mark_parameter(ac: Caster, value: Any, role: int, other: Any) -> Any:
    """A contraction operand, a parameter marked varying like ``other`` before its cast.

    Inside ``shard_map``, so that its gradient's ``psum`` runs in
    ``reduce_dtype``'s width (:func:`vary_before_cast`); anything else as is.
    """
    if role != PLAIN or not is_floating(value):
        return value
    if ac.compute_dtype.itemsize < np.dtype(value.dtype).itemsize:
        return vary_before_cast(value, ac.policy.reduce_dtype, other)
    return value


def wide_broadcast(ac: Caster, value: Any, dtype: np.dtype, shape: tuple, like: list) -> Any:
    """A plain operand broadcast to ``shape`` in ``dtype``, its gradient summed wide.

    An elementwise op broadcasts it against a batch (a bias, a position
    embedding): broadcast here, the sum over the batch that is its gradient
    runs in ``reduce_dtype``, where the SPMD partitioner sums a data-parallel
    batch's shards. ``like``: the activations it meets (their varying axes).
    """
    dims = tuple(range(len(shape)))
    value = vary_before_cast(value, ac.policy.reduce_dtype, *like)
    return wide_gradient_of(
        ac, value, lambda a: jax.lax.broadcast_in_dim(a, shape, dims), [], dtype
    )


def narrowed_linear(fn: Any, x: Any, dtype: Any, *rest: Any) -> Any:
    """``fn(saturate_finite(x, dtype), *rest)`` whose gradient for ``x`` stays in ``x``'s dtype.

    ``fn`` is linear in its first argument (a broadcast, an embedding lookup)
    and its backward pass sums over the rows of a batch: a bias's sum over the
    batch, a table's scatter-add. JAX would transpose it on the 16-bit
    cotangent, so that the SPMD partitioner sums the shards of a data-parallel
    batch in 16 bits; here the cotangent is widened first and ``fn`` transposed
    in ``x``'s dtype. ``rest``: integer operands (indices), not differentiated.
    """

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
