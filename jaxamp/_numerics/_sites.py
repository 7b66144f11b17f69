"""The static half of the numerics report: which outputs are measured, where, in which phase.

``catalog`` walks the traced program once, before anything runs, entering the
same sub-jaxprs as the instrumented evaluation (both tables come from the
engine's skeleton, ``_engine._control.structured_rules``), and lists one
``Site`` per floating output of every other equation. A site's key is its
position (``site_key``): the path of ``(equation index, sub-jaxpr number)``
pairs that leads to its jaxpr (``_engine._visit.sub_path``), then the equation
index and output index, so an inner jaxpr that two call sites share still gives
two sites.

The phase comes from data flow, not from names. An equation is ``"forward"`` when
the program's primal outputs (the loss) depend on it, ``"backward"`` when only the
gradients do (the cotangent computation and the derivative-only values computed
alongside the forward pass, ``0.5 / sqrt(x)`` for ``sqrt``), so an inf/NaN that only
the gradient sees is reported as backward, and ``"state"`` when only the auxiliary
outputs of ``has_aux`` do (updated batch statistics, an EMA codebook). Code that
nothing returns is backward if it depends on the seed, else forward.

Separately, the gradient program takes the cotangent seed (the loss scale) as its
last argument, and an output that depends on it is ``scaled``: proportional to the
loss scale, which is what the suggested loss scale is computed from (a
rematerialised forward value inside the backward pass is not, nor is a forward
value that a barrier groups with a cotangent, nor an integer or bool value).
"""

from __future__ import annotations

import functools
import os
import sysconfig
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np

from jaxamp._engine import _compat as compat
from jaxamp._engine import _control as control
from jaxamp._engine._visit import sub_path
from jaxamp._fp8._fp4_facts import FACTS_SCOPE, quantization_of
from jaxamp._fp8._scalings import QUANTIZE_SCOPE
from jaxamp._reporting import is_jaxamp_file

__all__ = [
    "PER_OPERAND",
    "PHASES",
    "Site",
    "catalog",
    "in_quantization",
    "is_facts",
    "is_quantize_step",
    "site_key",
    "user_frame",
    "user_source",
]


def site_key(path: tuple, index: int, output: int) -> tuple:
    """The key of a site: output ``output`` of equation ``index`` of the jaxpr at ``path``.

    ``path`` is built by ``_engine._visit.sub_path``; the catalog and the
    instrumented evaluation both key sites with this function.
    """
    return (path, index, output)


class Site(NamedTuple):
    """One measured floating output (static facts only)."""

    key: tuple
    primitive: str
    source: str
    phase: str
    scaled: bool
    dtype: np.dtype
    shape: tuple[int, ...]
    in_loop: bool
    internal: bool = False  # jaxamp's own values (autocast's operand barriers)
    quantization: str | None = None  # the output of a quantization: "fp8", "nvfp4", "mxfp4"


def _library_dirs() -> tuple[str, ...]:
    dirs = {
        os.path.dirname(os.path.dirname(jax.__file__)),
        os.path.dirname(os.path.dirname(__file__)),
    }
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        path = sysconfig.get_paths().get(key)
        if path:
            dirs.add(path)
    return tuple(os.path.join(os.path.realpath(d), "") for d in dirs)


_LIBRARY_DIRS = _library_dirs()


def user_frame(eqn: jex.JaxprEqn) -> str | None:
    """``"path/to/file.py:LINE"`` of the innermost frame outside JAX, jaxamp and libraries.

    Installed libraries (Flax, Haiku, Equinox, optax) count as library code, so a
    ``nn.Dense`` is attributed to the user's line that calls it. None when every
    frame is library code: an equation of a jaxpr that JAX traced inside its own
    jitted function (``jnp.where``, ``jax.nn.relu``, ``jnp.linalg.norm``), whose
    user line is that of the equation calling the function.
    """
    for file_name, line in compat.source_frames(eqn):
        if not _is_library(file_name):
            return f"{file_name}:{line}"
    return None


@functools.lru_cache(maxsize=4096)
def _is_library(file_name: str) -> bool:
    # Cached: ``realpath`` walks the file system, and a program's equations share
    # a few hundred files.
    return file_name.startswith("<") or os.path.realpath(file_name).startswith(_LIBRARY_DIRS)


def user_source(eqn: jex.JaxprEqn, caller: str | None = None) -> str:
    """:func:`user_frame`, else the calling equation's (``caller``), else the innermost frame."""
    found = user_frame(eqn) or caller
    if found is not None:
        return found
    frames = compat.source_frames(eqn)
    return f"{frames[0][0]}:{frames[0][1]}" if frames else "<unknown>:0"


# Phases, strongest first: an equation takes the strongest phase of the outputs that
# need it (what the loss needs is forward even if the gradient needs it too).
PHASES = ("forward", "backward", "state")
_RANK = {phase: rank for rank, phase in enumerate(PHASES)}
_NONE = len(PHASES)  # needed by no output of the program (dead code)


def catalog(
    closed: jex.ClosedJaxpr, tainted: Sequence[bool], out_phases: Sequence[str]
) -> list[Site]:
    """Every measured output of ``closed``, in program order.

    ``tainted``: which arguments are the cotangent seed; ``out_phases``: the phase of
    each program output (``"forward"`` for the loss, ``"backward"`` for gradients,
    ``"state"`` for auxiliary outputs such as updated statistics).
    """
    sites: list[Site] = []
    # Without a seed (no gradient) every op is forward, dead code included.
    dead = None if any(tainted) else "forward"
    where = _Where((), False, [_RANK[phase] for phase in out_phases], dead)
    _visit(closed.jaxpr, list(tainted), where, sites)
    return sites


class _Where(NamedTuple):
    path: tuple
    in_loop: bool
    live_outs: list[int]  # per output of this jaxpr: the rank of the strongest phase needing it
    dead: str | None = None  # the phase of dead code (None: by its data flow)
    caller: str | None = None  # the user line of the equation whose body this is
    quantizing: str | None = None  # inside a quantization (``in_quantization``)


def _live_eqns(jaxpr: jex.Jaxpr, live_outs: list[int]) -> list[list[int]]:
    """Per equation, per output, the strongest phase that needs it (backward liveness)."""
    need: dict = {}
    for var, rank in zip(jaxpr.outvars, live_outs, strict=True):
        if isinstance(var, jex.Var):
            need[var] = min(need.get(var, _NONE), rank)
    per_eqn = []
    for eqn in reversed(jaxpr.eqns):
        outs = [need.get(v, _NONE) if isinstance(v, jex.Var) else _NONE for v in eqn.outvars]
        rank = min(outs, default=_NONE)
        for v in eqn.invars:
            if isinstance(v, jex.Var):
                need[v] = min(need.get(v, _NONE), rank)
        per_eqn.append(outs)
    return per_eqn[::-1]


def _phase(where: _Where, scaled: bool) -> str:
    rank = min(where.live_outs, default=_NONE)
    if rank == _NONE:  # dead code: what nothing returns
        # A cotangent JAX computed and dropped is backward; a value computed from the
        # inputs that nothing uses (a model's unused branch) is forward.
        return where.dead or ("backward" if scaled else "forward")
    return PHASES[rank]


def _visit(jaxpr: jex.Jaxpr, in_taint: list[bool], where: _Where, sites) -> list:
    taint: dict = dict(zip(jaxpr.invars, in_taint, strict=True))

    def read(atom):
        return isinstance(atom, jex.Var) and taint.get(atom, False)

    for index, (eqn, live) in enumerate(
        zip(jaxpr.eqns, _live_eqns(jaxpr, where.live_outs), strict=True)
    ):
        ins = [read(atom) for atom in eqn.invars]
        outs = _visit_eqn(eqn, ins, where._replace(live_outs=live), index, sites)
        taint.update(zip(eqn.outvars, outs, strict=True))
    return [read(atom) for atom in jaxpr.outvars]


def _visit_eqn(eqn, ins, where: _Where, index, sites) -> list[bool]:
    # Bodies traced inside JAX's own jitted functions have no user frame: they
    # inherit the user line of the equation that calls them.
    where = where._replace(caller=user_frame(eqn) or where.caller)
    visit = _SITE_RULES.get(eqn.primitive.name, _visit_op)
    return visit(eqn, ins, where, index, sites)


def _visit_op(eqn, ins, where: _Where, index, sites) -> list[bool]:
    """A measured equation: one site per floating output."""
    scaled = scaled_outputs(eqn, ins)
    if is_quantize_step(eqn, where.quantizing):
        return scaled
    phase = _phase(where, any(scaled))
    for k, var in enumerate(eqn.outvars):
        dtype = getattr(var.aval, "dtype", None)
        if dtype is not None and jnp.issubdtype(dtype, jnp.floating):
            sites.append(
                Site(
                    site_key(where.path, index, k),
                    eqn.primitive.name,
                    user_source(eqn, where.caller),
                    phase,
                    scaled[k],
                    np.dtype(dtype),
                    tuple(var.aval.shape),
                    where.in_loop,
                    _is_internal(eqn),
                    _quantization(eqn, where.quantizing),
                )
            )
    return scaled


def _is_internal(eqn: jex.JaxprEqn) -> bool:
    """jaxamp's own values: a barrier autocast inserted around a matmul's operands
    (it moves values). autocast computes no value it then discards: its saturating
    cast chooses in the wider dtype and casts once."""
    frames = compat.source_frames(eqn)
    return (
        eqn.primitive.name == "optimization_barrier"
        and bool(frames)
        and is_jaxamp_file(frames[0][0])
    )


def in_quantization(eqn: jex.JaxprEqn, quantizing: str | None) -> str | None:
    """The quantization ``eqn`` is part of (``QUANTIZE_SCOPE``): ``"fp8"``, an FP4
    format (``"nvfp4"``, ``"mxfp4"``), or None.

    ``quantizing``: that of the body holding ``eqn`` (the name scope is on the
    call of a jitted helper such as ``jnp.clip``, not on the equations of its body).
    """
    if quantizing is not None:
        return quantizing
    stack = str(eqn.source_info.name_stack)
    if QUANTIZE_SCOPE not in stack:
        return None
    return quantization_of(stack) or "fp8"


def is_quantize_step(eqn: jex.JaxprEqn, quantizing: str | None) -> bool:
    """A step of a quantization other than its result: not a site.

    A quantization is measured as one op, its result: an FP8 quantization's
    float8 output (magnitude, saturation, what fell below float8's range), an
    FP4 quantization's cast to ``float4_e2m1fn``, measured with its ``Facts``
    (``jaxamp/_fp8/_fp4_facts.py``: the input's amax, the scales, what was
    flushed or clamped). Its amax, scales and clipping are not sites. On the FP8
    transformer of BENCHMARKS.md they were about two thirds of the sites, and
    so of the instrumented program's compile.
    """
    kind = in_quantization(eqn, quantizing)
    if kind is None:
        return False
    if kind == "fp8":
        return not any(_is_float8_var(var) for var in eqn.outvars)
    # FP4: the E4M3 block-scale cast, the moved codes and the facts are steps.
    is_cast = eqn.primitive.name == "convert_element_type"
    return not (is_cast and any(_is_float4_var(var) for var in eqn.outvars))


def _quantization(eqn: jex.JaxprEqn, quantizing: str | None) -> str | None:
    """The kind of quantization whose result ``eqn``'s output is (its cast), else None."""
    if eqn.primitive.name != "convert_element_type":
        return None  # a float8 result moved inside its quantization is not another one
    return in_quantization(eqn, quantizing)


def is_facts(eqn: jex.JaxprEqn) -> bool:
    """The barrier that passes an FP4 quantization's ``Facts`` to the report."""
    return eqn.primitive.name == "optimization_barrier" and FACTS_SCOPE in str(
        eqn.source_info.name_stack
    )


def _is_float4_var(var) -> bool:
    return _is_floating_var(var) and jnp.finfo(var.aval.dtype).bits == 4


def _is_float8_var(var) -> bool:
    return _is_floating_var(var) and np.dtype(var.aval.dtype).itemsize == 1


# Primitives whose output i is operand i, unchanged (grouped only to order them): the
# barrier autocast puts around a matmul's operands pairs a cotangent with forward
# values. The evaluation passes each operand's statistics on to its output.
PER_OPERAND = frozenset({"optimization_barrier"})


def scaled_outputs(eqn: jex.JaxprEqn, ins: Sequence[bool]) -> list[bool]:
    """Which outputs of a first-order ``eqn`` depend on the seed, from which inputs do.

    Data flow of the cotangent only: an output of a per-operand primitive follows
    its own operand, and an integer or bool output (a mask, a comparison) is never
    scaled: it is not proportional to the loss scale.
    """
    if eqn.primitive.name in PER_OPERAND and len(ins) == len(eqn.outvars):
        flags = list(ins)
    else:
        flags = [any(ins)] * len(eqn.outvars)
    return [flag and _is_floating_var(var) for flag, var in zip(flags, eqn.outvars, strict=True)]


def _is_floating_var(var) -> bool:
    dtype = getattr(var.aval, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.floating)


def _visit_call(eqn, ins, where: _Where, index, sites) -> list[bool]:
    inner = where._replace(
        path=sub_path(where.path, index), quantizing=in_quantization(eqn, where.quantizing)
    )
    return _visit(control.call_of(eqn).body.jaxpr, ins, inner, sites)


def _visit_loop(eqn, ins, where, index, sites):
    loop = control.loop_of(eqn, ins)
    # A loop body runs for the strongest phase that needs any output of the loop.
    live = [min(where.live_outs, default=_NONE)] * len(loop.body.jaxpr.outvars)
    inner = where._replace(path=sub_path(where.path, index), in_loop=True, live_outs=live)

    def body(carry, found):
        return _visit(loop.body.jaxpr, [*loop.consts, *carry, *loop.xs], inner, found)

    # A carry depends on the seed if its initial value or any iteration's update does.
    def join(carry, outs):
        return [a or b for a, b in zip(carry, outs, strict=True)]

    carry = control.carry_fixpoint(lambda c: body(c, []), loop.carry, join)
    outs = body(carry, sites)
    return outs if loop.returns_body_outputs else [*carry, *outs[loop.n_carry :]]


def _visit_cond(eqn, ins, where, index, sites):
    branch = control.branch_of(eqn, ins)
    outs = [
        _visit(
            body.jaxpr, branch.operands, where._replace(path=sub_path(where.path, index, b)), sites
        )
        for b, body in enumerate(branch.branches)
    ]
    return [any(flags) for flags in zip(*outs, strict=True)]


_SITE_RULES = control.structured_rules(call=_visit_call, loop=_visit_loop, branch=_visit_cond)
