"""The one place that knows how jaxprs and their higher-order primitives look.

Everything here uses ``jax.extend.core`` (the public API for jaxpr work). The
parameter names of higher-order primitives (``jit``'s ``jaxpr``, ``scan``'s
``num_carry``, ...) change between JAX versions; reading them is confined to
this file so that a JAX upgrade touches one module. Supported: jax 0.10.2
to 0.12 (what differs is marked with the version where it changed).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import jax
import jax.extend.core as jex
import jax.extend.source_info_util as source_info
import numpy as np

__all__ = [
    "CALL_NAMES",
    "CUSTOM_CALL_NAMES",
    "HI_PRIMITIVE_NAMES",
    "INLINE_NAMES",
    "JIT_NAMES",
    "REMAT_NAMES",
    "VERSION_SPECIFIC_PRIMITIVES",
    "CondParts",
    "CustomJvpParts",
    "JitParts",
    "RematParts",
    "ScanParts",
    "ScatterParts",
    "ShardMapParts",
    "WhileParts",
    "as_closed",
    "bind_eqn",
    "call_jaxpr",
    "cond_parts",
    "custom_jvp_parts",
    "eqn_has_subjaxprs",
    "equation_context",
    "float0_zeros",
    "has_reduced_types",
    "hi_primitive_expansion",
    "is_float0",
    "jit_parts",
    "literal_value",
    "output_dtypes",
    "remat_parts",
    "scan_parts",
    "scatter_parts",
    "shard_map_parts",
    "source_frames",
    "spec_partitions",
    "sub_closed_jaxprs",
    "tracks_variance",
    "vary_like",
    "varying_axes",
    "while_parts",
]

JIT_NAMES = ("jit",)
REMAT_NAMES = ("remat2",)
# Call primitives (a ``call_jaxpr`` run inline): "call" and "closed_call" up to
# jax 0.11; jax 0.12 merged both into "eval_jaxpr".
CALL_NAMES = ("call", "closed_call", "eval_jaxpr")
# Primitive names of one supported JAX that the other lacks: the rule table holds
# both, and the table's drift test allows a name missing from the installed JAX
# only when it is listed here.
VERSION_SPECIFIC_PRIMITIVES = {
    "call": "jax < 0.12",
    "closed_call": "jax < 0.12",
    "eval_jaxpr": "jax >= 0.12",
    "call_hi_primitive": "jax >= 0.12",
    "log2": "jax >= 0.12",
    "one_minus_square": "jax >= 0.12",
    "polynomial": "jax >= 0.12",
}
# jax 0.12: operations defined as a Python object (frexp, ldexp, searchsorted,
# nonzero(size=), lax.custom_root) bind this one primitive; the object, with its
# own functions and jaxprs, is the ``_prim`` param and ``_prim.expand`` is what
# it lowers to.
HI_PRIMITIVE_NAMES = ("call_hi_primitive",)
# custom_jvp / custom_vjp calls: the primal function is ``call_jaxpr``, taking
# all the equation's operands.
CUSTOM_CALL_NAMES = ("custom_jvp_call", "custom_vjp_call")
# Call-like primitives: each runs one body once on its own operands and returns
# the body's outputs, so a tool may evaluate the body in place (``inline_body``).
INLINE_NAMES = JIT_NAMES + CALL_NAMES + REMAT_NAMES + CUSTOM_CALL_NAMES


def bind_eqn(eqn: jex.JaxprEqn, args: Sequence[Any]) -> list[Any]:
    """Runs ``eqn`` as written on ``args`` (under whatever trace is current)."""
    out = eqn.primitive.bind(*args, **_bind_params(eqn))
    return list(out) if eqn.primitive.multiple_results else [out]


def _bind_params(eqn: jex.JaxprEqn) -> dict:
    # Higher-order primitives keep functions in their params under "subfuns";
    # get_bind_params turns an equation's params back into bind's keywords.
    return eqn.primitive.get_bind_params(eqn.params)


@contextlib.contextmanager
def equation_context(eqn: jex.JaxprEqn) -> Iterator[None]:
    """Binds made inside carry ``eqn``'s source location, name stack and context.

    The same as JAX's own ``eval_jaxpr``: the name stack is appended to the
    current one, and the equation's context (``eqn.ctx``: compute type, XLA
    metadata) is re-entered.
    """
    info = eqn.source_info
    name_stack = source_info.current_name_stack() + info.name_stack
    ctx = getattr(eqn, "ctx", None)
    manager = getattr(ctx, "manager", contextlib.nullcontext())
    with source_info.user_context(info.traceback, name_stack=name_stack), manager:
        yield


def output_dtypes(prim: Any, avals: Sequence[Any], params: dict) -> list[np.dtype] | None:
    """The dtypes of what ``prim`` returns for inputs of these avals, or None if unknown.

    ``Primitive.abstract_eval`` returns ``(out_aval or out_avals, effects)`` in jax 0.10.
    """
    try:
        out = prim.abstract_eval(*avals, **params)
    except (NotImplementedError, TypeError, ValueError):  # no rule, or one needing more
        return None
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], (set, frozenset)):
        out = out[0]
    outs = out if prim.multiple_results else [out]
    return [np.dtype(o.dtype) for o in outs if hasattr(o, "dtype")]


def literal_value(atom: jex.Literal) -> Any:
    return atom.val


def as_closed(jaxpr: jex.Jaxpr | jex.ClosedJaxpr) -> jex.ClosedJaxpr:
    if isinstance(jaxpr, jex.ClosedJaxpr):
        return jaxpr
    return jex.ClosedJaxpr(jaxpr, ())


def hi_primitive_expansion(eqn: jex.JaxprEqn) -> jex.ClosedJaxpr:
    """What a jax 0.12 ``call_hi_primitive`` equation computes, as a closed jaxpr.

    Its ``_prim`` object holds functions and jaxprs in its own attributes, out
    of sight of the param scan below; ``_prim.expand`` on the operands is the
    computation it lowers to (the same call JAX makes when lowering it).
    """
    prim = eqn.params["_prim"]

    def expanded(*flat):
        out = prim.expand(*prim.in_tree.unflatten(flat))
        return prim.out_tree.flatten_up_to(out)

    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in eqn.invars]
    return jax.make_jaxpr(expanded)(*avals)


def sub_closed_jaxprs(eqn: jex.JaxprEqn) -> list[jex.ClosedJaxpr]:
    """The jaxprs held directly in ``eqn``'s params (closed; not recursive)."""
    if eqn.primitive.name in HI_PRIMITIVE_NAMES:
        return [hi_primitive_expansion(eqn)]
    found = []
    for value in eqn.params.values():
        items = value if isinstance(value, (tuple, list)) else (value,)
        for item in items:
            if isinstance(item, (jex.Jaxpr, jex.ClosedJaxpr)):
                found.append(as_closed(item))
    return found


def eqn_has_subjaxprs(eqn: jex.JaxprEqn) -> bool:
    """Whether ``eqn`` is a higher-order primitive (holds jaxprs or functions)."""
    if sub_closed_jaxprs(eqn):
        return True
    return bool(_bind_params(eqn).get("subfuns"))


class ShardMapParts(NamedTuple):
    jaxpr: jex.ClosedJaxpr
    mesh: Any
    in_specs: tuple
    out_specs: tuple
    axis_names: frozenset
    check_vma: bool


def shard_map_parts(eqn: jex.JaxprEqn) -> ShardMapParts:
    """What ``jax.shard_map(f, mesh=, in_specs=, out_specs=, axis_names=, check_vma=)`` needs."""
    p = eqn.params
    return ShardMapParts(
        as_closed(p["jaxpr"]),
        p["mesh"],
        tuple(p["in_specs"]),
        tuple(p["out_specs"]),
        frozenset(p["newly_manual_axes"]),
        bool(p["check_vma"]),
    )


class ScatterParts(NamedTuple):
    dimension_numbers: Any
    indices_are_sorted: bool
    unique_indices: bool
    mode: Any
    # A ``scatter`` built by ``lax.scatter_apply`` (``x.at[i].apply(f)``): ``f`` as
    # ``(operand element, unused update element) -> new element``; None otherwise.
    apply: jex.ClosedJaxpr | None


def scatter_parts(eqn: jex.JaxprEqn) -> ScatterParts:
    """The arguments of ``lax.scatter*`` (the combiner jaxpr is rebuilt by them)."""
    p = eqn.params
    update = p.get("update_jaxpr")
    apply = None
    if eqn.primitive.name == "scatter" and update is not None:
        apply = jex.ClosedJaxpr(update, list(p.get("update_consts", ())))
    return ScatterParts(
        p["dimension_numbers"], p["indices_are_sorted"], p["unique_indices"], p["mode"], apply
    )


class JitParts(NamedTuple):
    jaxpr: jex.ClosedJaxpr
    name: str
    inline: Any  # bool, or jax 0.12's Inline enum: passed back to jax.jit as it is


def jit_parts(eqn: jex.JaxprEqn) -> JitParts:
    p = eqn.params
    return JitParts(as_closed(p["jaxpr"]), str(p.get("name", "jit")), p.get("inline", False))


def call_jaxpr(eqn: jex.JaxprEqn) -> jex.ClosedJaxpr:
    """The body of a call primitive, or the primal function of a custom_jvp/custom_vjp call."""
    return as_closed(eqn.params["call_jaxpr"])


def source_frames(eqn: jex.JaxprEqn) -> list[tuple[str, int]]:
    """``(file name, line)`` of the frames that traced ``eqn``, innermost first."""
    traceback = eqn.source_info.traceback
    if traceback is None:
        return []
    return [(frame.file_name, int(frame.line_num)) for frame in traceback.frames]


class CustomJvpParts(NamedTuple):
    call_jaxpr: jex.ClosedJaxpr
    num_consts: int
    # (zero flags of the non-const tangents) -> (closed jvp jaxpr, output zero flags).
    # The jvp jaxpr takes (*non-const primals, *nonzero tangents) and returns
    # (*primal outputs, *nonzero output tangents).
    jvp_jaxpr: Callable[[Sequence[bool]], tuple[jex.ClosedJaxpr, list[bool]]]
    name: str = "custom_jvp"  # the decorated function's name, kept when rebuilt

    def split(self, ins: Sequence[Any]) -> tuple[list, list]:
        """``(consts, args)`` of the equation's operands."""
        return _split_at(ins, self.num_consts)


def custom_jvp_parts(eqn: jex.JaxprEqn) -> CustomJvpParts:
    p = eqn.params
    jvp_fun = p.get("jvp_jaxpr_fun", p.get("jvp_jaxpr_thunk"))

    def jvp_jaxpr(zeros: Sequence[bool]) -> tuple[jex.ClosedJaxpr, list[bool]]:
        call = getattr(jvp_fun, "call_wrapped", jvp_fun)
        jaxpr, consts, out_zeros = call(*zeros)
        return jex.ClosedJaxpr(jaxpr, list(consts)), list(out_zeros)

    call = as_closed(p["call_jaxpr"])
    info = getattr(call.jaxpr, "debug_info", None)  # what the jaxpr printer shows as name=
    name = getattr(info, "func_name", None) or "custom_jvp"
    return CustomJvpParts(call, int(p["num_consts"]), jvp_jaxpr, name)


def _split_at(ins: Sequence[Any], *counts: int) -> tuple[list, ...]:
    """``ins`` cut into runs of ``counts`` operands, then the rest."""
    runs, at = [], 0
    for n in counts:
        runs.append(list(ins[at : at + n]))
        at += n
    return (*runs, list(ins[at:]))


class ScanParts(NamedTuple):
    jaxpr: jex.ClosedJaxpr
    num_consts: int
    num_carry: int
    length: int
    reverse: bool
    unroll: int | bool

    def split(self, ins: Sequence[Any]) -> tuple[list, list, list]:
        """``(consts, carry, xs)`` of the equation's operands."""
        return _split_at(ins, self.num_consts, self.num_carry)


def scan_parts(eqn: jex.JaxprEqn) -> ScanParts:
    p = eqn.params
    if "num_consts" in p:  # jax < 0.12
        num_consts, num_carry = int(p["num_consts"]), int(p["num_carry"])
    else:  # jax 0.12: ft_in is a flat tree (consts, carry, xs); len() counts operands
        consts, carry, xs = p["ft_in"].unpack()
        num_consts, num_carry = len(consts), len(carry)
        if num_consts + num_carry + len(xs) != len(eqn.invars):
            raise NotImplementedError(
                f"jaxamp does not understand this jax's scan parameters: ft_in={p['ft_in']!r} "
                f"for {len(eqn.invars)} operands."
            )
    return ScanParts(
        as_closed(p["jaxpr"]),
        num_consts,
        num_carry,
        int(p["length"]),
        bool(p["reverse"]),
        p.get("unroll", 1),
    )


class WhileParts(NamedTuple):
    cond_jaxpr: jex.ClosedJaxpr
    cond_nconsts: int
    body_jaxpr: jex.ClosedJaxpr
    body_nconsts: int

    def split(self, ins: Sequence[Any]) -> tuple[list, list, list]:
        """``(cond consts, body consts, carry)`` of the equation's operands."""
        return _split_at(ins, self.cond_nconsts, self.body_nconsts)


def while_parts(eqn: jex.JaxprEqn) -> WhileParts:
    p = eqn.params
    return WhileParts(
        as_closed(p["cond_jaxpr"]),
        int(p["cond_nconsts"]),
        as_closed(p["body_jaxpr"]),
        int(p["body_nconsts"]),
    )


class CondParts(NamedTuple):
    branches: tuple[jex.ClosedJaxpr, ...]
    # For lax.platform_dependent: the platforms of each branch (None: the default
    # branch), or None for an ordinary cond.
    platforms: tuple | None

    def split(self, ins: Sequence[Any]) -> tuple[Any, list]:
        """``(branch index, operands)`` of the equation's operands."""
        return ins[0], list(ins[1:])


def cond_parts(eqn: jex.JaxprEqn) -> CondParts:
    """The branches of a ``cond``; its first operand is the branch index."""
    p = eqn.params
    return CondParts(tuple(as_closed(b) for b in p["branches"]), p.get("branches_platforms"))


class RematParts(NamedTuple):
    jaxpr: jex.ClosedJaxpr
    prevent_cse: bool
    policy: Any


def remat_parts(eqn: jex.JaxprEqn) -> RematParts:
    p = eqn.params
    return RematParts(as_closed(p["jaxpr"]), bool(p.get("prevent_cse", True)), p.get("policy"))


def float0_zeros(shape: Sequence[int]) -> np.ndarray:
    """The tangent of an integer value (what custom_jvp rules see for ints)."""
    return np.zeros(tuple(shape), dtype=jax.dtypes.float0)


def is_float0(x: Any) -> bool:
    return getattr(x, "dtype", None) == jax.dtypes.float0


def varying_axes(x: Any) -> frozenset:
    """The mesh axes ``x`` varies over inside ``shard_map`` (empty outside)."""
    aval = jax.typeof(x)
    # jax 0.10 to 0.12: aval.mat.varying; the older spelling was aval.vma.
    axes = getattr(getattr(aval, "mat", None), "varying", None)
    return frozenset(axes if axes is not None else getattr(aval, "vma", ()))


def tracks_variance(axis_name: str) -> bool:
    """Whether the enclosing map tracks which values vary over ``axis_name``.

    True inside ``jax.shard_map`` with ``check_vma=True`` (the default), where
    ``axis_index`` varies over its axis; False under ``check_vma=False`` and
    ``pmap``, where every value reads as invariant.
    """
    return axis_name in varying_axes(jax.lax.axis_index(axis_name))


def vary_like(out: Any, *inputs: Any) -> Any:
    """``out`` marked varying over every mesh axis one of ``inputs`` varies over.

    A primitive whose abstract evaluation drops the varying axes (jax 0.12's
    ``scaled_matmul``) would otherwise give an invariant value inside
    ``shard_map``, which a later ``psum`` rejects.
    """
    missing = frozenset().union(*map(varying_axes, inputs)) - varying_axes(out)
    if not missing:
        return out
    return jax.lax.pcast(out, tuple(sorted(missing)), to="varying")


def has_reduced_types() -> bool:
    """Whether ``PartitionSpec`` takes ``reduced=`` (explicit sharding's unreduced gradients).

    jax 0.10.2 to 0.12 do; a JAX without it cannot place a gradient reduction
    after a cast, so ``Policy.cast_to_compute`` keeps its warning there.
    """
    return hasattr(jax.sharding.PartitionSpec(), "reduced")


def spec_partitions(spec: Any) -> tuple:
    """The per-dim entries of a ``PartitionSpec`` (``spec.partitions``: ``*spec`` raises
    once the spec has a ``reduced`` or ``unreduced`` set)."""
    return tuple(getattr(spec, "partitions", spec))
