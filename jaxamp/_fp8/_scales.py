"""The tensorwise amaxes of a step's weights from one reduction.

torchao's ``precompute_float8_dynamic_scale_for_fsdp``: under FSDP every
weight is sharded, so its tensorwise amax is a maximum across devices; reducing
each weight on its own costs one scalar all-reduce per weight. Here autocast's
pre-pass (:func:`weight_operands`) finds, before anything is evaluated, the
contraction operands that are the step's inputs (parameters) seen through views
only (reshape, transpose, ...), and :func:`weight_amaxes` computes all their
amaxes at once: each device reduces its own shards, stacks the maxima into one
vector, and one all-reduce over the mesh axes the weights are sharded on gives
every amax. The quantization then runs on each shard with the global scale, so
the float8 values are those of quantizing after the gather.

The reduction is a JAX ``custom_partitioning`` op: the SPMD partitioner hands
it the weights' shardings, and it reduces each device's local maxima with one
``pmax`` over the mesh axes any weight is sharded on. It is used where the
trace sees a mesh of several devices (the weights' types, or ``jax.set_mesh``);
elsewhere (one device, inside ``shard_map`` or ``vmap``, or compiled ahead of time
for another platform's topology) each quantization computes its own amax, as
without the pre-pass.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.extend.core as jex
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from jaxamp._casting import F32
from jaxamp._engine import _compat as compat

__all__ = ["SCOPE", "WeightAmaxes", "weight_amaxes", "weight_operands"]

SCOPE = "fp8_weight_amaxes"

# Operations that move or relabel values without changing any: the amax of
# the result is the amax of the operand.
_VIEWS = frozenset({"reshape", "transpose", "squeeze", "expand_dims", "copy", "copy_p"})
_CONTRACTIONS = frozenset({"dot_general", "conv_general_dilated"})
# high_precision's contractions: the mixture-of-experts products too.
ALL_CONTRACTIONS = _CONTRACTIONS | {"ragged_dot_general"}


def _inner_jaxpr(eqn: jex.JaxprEqn) -> jex.ClosedJaxpr | None:
    """The jaxpr autocast evaluates for ``eqn`` with the eqn's operands, if any."""
    name = eqn.primitive.name
    if name in compat.JIT_NAMES:
        return compat.jit_parts(eqn).jaxpr
    if name in compat.CALL_NAMES or name == "custom_jvp_call":
        return compat.call_jaxpr(eqn)  # a custom_jvp call's primal body, as autocast runs it
    if name in compat.REMAT_NAMES:
        return compat.remat_parts(eqn).jaxpr
    return None


def _scan_sources(eqn: jex.JaxprEqn, ins: list) -> tuple[jex.Jaxpr, dict]:
    """A scan body and the inputs its consts and per-iteration slices (xs) come from.

    A slice of a stacked weight counts as the stacked leaf: a ``high_precision``
    rule matching it keeps that product in every iteration (every layer of the
    stack). The carry changes from one iteration to the next: it is no input.
    """
    parts = compat.scan_parts(eqn)
    consts, _, xs = parts.split(list(range(len(ins))))
    body = parts.jaxpr.jaxpr
    kept = [*consts, *xs]
    return body, {body.invars[i]: ins[i] for i in kept if ins[i] is not None}


def _visit(
    jaxpr: jex.Jaxpr, sources: dict, found: dict, contractions: frozenset, scans: bool = False
) -> None:
    """Records, for each contraction operand, the input it views (None: not an input).

    ``scans``: follow inputs into scan bodies (:func:`_scan_sources`).
    """
    for eqn in jaxpr.eqns:
        ins = [sources.get(v) if isinstance(v, jex.Var) else None for v in eqn.invars]
        name = eqn.primitive.name
        if name in contractions:
            for i in range(2):
                key = (id(eqn), i)
                # A jaxpr reached twice (a jitted layer called on two weights) must
                # see the same input each time, else its operand is not one weight.
                found[key] = ins[i] if found.get(key, ins[i]) == ins[i] else None
        elif name in _VIEWS and ins[0] is not None:
            sources[eqn.outvars[0]] = ins[0]
        elif (inner := _inner_jaxpr(eqn)) is not None:
            inner_sources = {
                var: src
                for var, src in zip(inner.jaxpr.invars, ins, strict=False)
                if src is not None
            }
            _visit(inner.jaxpr, inner_sources, found, contractions, scans)
        elif scans and name == "scan":
            _visit(*_scan_sources(eqn, ins), found, contractions, scans)


def weight_operands(
    closed: jex.ClosedJaxpr, contractions: frozenset = _CONTRACTIONS, scans: bool = False
) -> dict[tuple[int, int], int]:
    """``{(id(contraction eqn), operand index): input index}`` for operands that are inputs.

    ``contractions``: the primitives whose operands count (FP8's fused weight
    amaxes: dots and convolutions; ``ALL_CONTRACTIONS`` adds ``ragged_dot_general``).

    Follows views and the call-like primitives autocast evaluates in place (jit,
    checkpoint, custom_jvp). Operands inside while or cond bodies are per
    iteration or per branch and are left out; so are scan bodies', unless
    ``scans`` (``high_precision``: a slice of a stacked weight is that weight;
    not the fused amaxes, whose slices each have their own).
    """
    sources = {var: i for i, var in enumerate(closed.jaxpr.invars)}
    found: dict = {}
    _visit(closed.jaxpr, sources, found, contractions, scans)
    return {key: src for key, src in found.items() if src is not None}


def _local_amaxes(*weights):
    return jnp.stack([jnp.max(jnp.abs(w)).astype(F32) for w in weights])


def _spec_axes(spec: PartitionSpec) -> list[str]:
    axes = []
    for entry in spec:
        axes.extend(entry if isinstance(entry, tuple) else (entry,))
    return [a for a in axes if a is not None]


def _replicated(mesh, arg_shapes, result_shape):
    del arg_shapes, result_shape
    return NamedSharding(mesh, PartitionSpec())


def _partition(mesh, arg_shapes, result_shape):
    """Each device reduces its shards; one all-reduce over every axis a weight is sharded on."""
    del result_shape
    shardings = tuple(a.sharding for a in arg_shapes)
    axes = tuple(dict.fromkeys(a for s in shardings for a in _spec_axes(s.spec)))

    def lower(*weights):
        local = _local_amaxes(*weights)
        return jax.lax.pmax(local, axes) if axes else local

    return mesh, lower, NamedSharding(mesh, PartitionSpec()), shardings


@functools.lru_cache(maxsize=64)
def _fused_amaxes(ranks: tuple[int, ...]):
    """``_local_amaxes`` with a partitioning rule (one per tuple of operand ranks)."""
    fused = custom_partitioning(_local_amaxes)
    factors = iter(range(sum(ranks)))
    operands = ", ".join(" ".join(f"d{next(factors)}" for _ in range(r)) for r in ranks)
    fused.def_partition(
        infer_sharding_from_operands=_replicated,
        partition=_partition,
        sharding_rule=f"{operands} -> k",
    )
    return fused


def _mesh_of(weights: Sequence[jax.Array]):
    """The mesh of the weights' types, else the one ``jax.set_mesh`` set (may be empty)."""
    for w in weights:
        mesh = getattr(getattr(jax.typeof(w), "sharding", None), "mesh", None)
        if mesh is not None and not mesh.empty:
            return mesh
    return jax.sharding.get_abstract_mesh()


def _compiled_elsewhere(mesh) -> bool:
    """Whether ``mesh`` holds devices of a platform this process has no backend for.

    That is a program compiled ahead of time for a topology
    (``jax.experimental.topologies``, e.g. a TPU slice from a CPU machine): the
    partitioner of that compiler cannot call back into Python, where the
    ``custom_partitioning`` rule lives, so each weight's amax is reduced on its own.
    """
    platform = getattr(getattr(mesh, "abstract_device", None), "platform", None)
    if platform is None:
        return False
    try:
        jax.devices(platform)
    except RuntimeError:
        return True
    return False


def _reduced(weights: Sequence[jax.Array]) -> jax.Array | None:
    """The amaxes of ``weights`` from one all-reduce, or None where nothing is sharded.

    None leaves each operand's amax to its quantization, as without the pre-pass:
    on one device, and under ``jit(in_shardings=...)`` of uncommitted arrays,
    whose mesh the trace does not see (unless ``jax.set_mesh`` sets it).
    """
    mesh = _mesh_of(weights)
    if mesh.empty or mesh.size < 2 or jax.sharding.AxisType.Manual in mesh.axis_types:
        return None  # one device, or inside shard_map (local values)
    if _compiled_elsewhere(mesh):
        return None
    try:
        fused = _fused_amaxes(tuple(w.ndim for w in weights))
        with jax.named_scope(SCOPE):  # communication_report's source of the all-reduce
            return fused(*[jax.lax.stop_gradient(w) for w in weights])
    except NotImplementedError:  # under vmap: custom_partitioning has no batching rule
        return None


class WeightAmaxes:
    """The amaxes of the weights of one autocast evaluation, from one reduction."""

    def __init__(self, operands: dict[tuple[int, int], int], inputs: Sequence):
        order = sorted(set(operands.values()))
        position = {src: k for k, src in enumerate(order)}
        self._index = {key: position[src] for key, src in operands.items()}
        weights = [inputs[i] for i in order]
        self._amaxes = _reduced(weights) if weights else None

    def get(self, eqn: jex.JaxprEqn, operand: int) -> jax.Array | None:
        """The amax of ``eqn``'s operand ``operand``, or None if it is not a weight."""
        k = self._index.get((id(eqn), operand))
        return None if k is None or self._amaxes is None else self._amaxes[k]


def weight_amaxes(closed: jex.ClosedJaxpr, inputs: Sequence) -> WeightAmaxes:
    """The amaxes of the contraction operands of ``closed`` that are its inputs."""
    floats = {
        key: src
        for key, src in weight_operands(closed).items()
        if jnp.issubdtype(closed.jaxpr.invars[src].aval.dtype, jnp.floating)
    }
    return WeightAmaxes(floats, inputs)
