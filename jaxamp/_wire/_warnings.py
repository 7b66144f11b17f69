"""Where a policy's wire dtypes cannot take effect: :class:`WireDtypeWarning`.

A leaf of the import graph: ``jaxamp._policy`` calls
:func:`warn_unhonoured_wire_dtypes` from ``Policy.cast_to_compute``, so this
module reads a policy by its three dtypes (:class:`WireDtypes`) and never
imports ``jaxamp._policy``.
"""

from __future__ import annotations

import warnings
from typing import Any, Protocol

import jax
import numpy as np

from jaxamp._engine import _compat as compat

__all__ = ["WireDtypeWarning", "WireDtypes", "spans_devices", "warn_unhonoured_wire_dtypes"]


class WireDtypes(Protocol):
    """What the warning reads of a :class:`jaxamp.Policy`."""

    @property
    def compute_dtype(self) -> Any: ...

    @property
    def gather_dtype(self) -> Any: ...

    @property
    def reduce_dtype(self) -> Any: ...


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


# Where policy.cast_to_compute honours both wire dtypes (the policies page, "Across devices").
EXPLICIT_MESH = (
    "a mesh of AxisType.Explicit axes (jax.make_mesh(shape, names, "
    "axis_types=(jax.sharding.AxisType.Explicit,) * len(names)) under jax.set_mesh, "
    "on jax >= 0.10.2, whose PartitionSpec takes reduced=), where "
    "policy.cast_to_compute(params, matmul_operands=...) gathers in gather_dtype and "
    "reduces the gradients of the leaves products read in reduce_dtype"
)


def _fix(program: str, by_cast: bool, explicit: bool) -> str:
    # What honours the policy in ``program``: named in the warning.
    if explicit:
        return (
            "say which leaves only products read (jnp.dot, einsum), whose gradients "
            "are then reduced at the cast in reduce_dtype: "
            "policy.cast_to_compute(params, matmul_operands=lambda path, x: ...) "
            "(True for all)"
        )
    if program == "shard_map":
        return "jaxamp.gather_params(shards, policy, axis_name) gathers and reduces by the policy"
    if by_cast:
        return (
            "jaxamp.autocast(fn, policy) owns the products and reduces in reduce_dtype, "
            "jaxamp.gather_params inside shard_map honours both, and so does " + EXPLICIT_MESH
        )
    return "gather the shards inside shard_map (jaxamp.gather_params, or jax.lax.all_gather)"


def warn_unhonoured_wire_dtypes(
    policy: WireDtypes, values: list, autocast_of: str = "", explicit: bool = False
) -> None:
    """Warns (:class:`WireDtypeWarning`) where ``policy``'s wire dtypes cannot take effect.

    ``values`` are cast by ``policy.cast_to_compute`` (neither wire dtype can be
    chosen there, but for a mesh of explicit axes, ``explicit``, where the cast
    gathers and only ``reduce_dtype`` waits for ``matmul_operands``), or by
    ``autocast`` of the function named ``autocast_of`` (under ``jax.jit`` only
    ``gather_dtype`` cannot).
    """
    by_cast = not autocast_of
    compute = np.dtype(policy.compute_dtype)
    wrong, accept = [], "policy"
    if np.dtype(policy.gather_dtype) != compute and not explicit:
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
    program = "jax.jit, explicit mesh" if explicit else _partitioned_or_manual(values)
    if program is None or (program == "shard_map" and not by_cast):
        return
    who = "policy.cast_to_compute" if by_cast else f"jaxamp.autocast({autocast_of})"
    warnings.warn(
        f"{who} in a program over several devices ({program}): {'; '.join(wrong)}. "
        f"To honour the policy: {_fix(program, by_cast, explicit)}. "
        f"To accept what is sent, say so in the policy: {accept}.",
        WireDtypeWarning,
        stacklevel=3,
    )
