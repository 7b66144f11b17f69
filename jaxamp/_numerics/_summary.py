"""From the statistics of one run to a :class:`NumericsReport`: origin, loss scale."""

from __future__ import annotations

import math

import jax.numpy as jnp

from jaxamp._numerics._flow import SiteGraph, reaching
from jaxamp._numerics._numerics_report import SAFETY_FACTOR, NumericsReport, OpStats
from jaxamp._numerics._sites import Site
from jaxamp._numerics._stats import NEVER, STATISTICS, unpack_row

__all__ = ["summarise"]


def summarise(
    sites: list[Site],
    graph: SiteGraph,
    floats,
    ints,
    scale: float | None,
    nonfinite_inputs: tuple[str, ...] = (),
    screened: bool = False,
) -> NumericsReport:
    """The report; ``screened``: the statistics of the screening pass alone (no float32
    shadow nor twin ran: the fields only they give are NaN, ``_UNMEASURED_BY_SCREEN``)."""
    ops, clocks = [], []
    for site, float_row, int_row in zip(sites, floats, ints, strict=True):
        op, clock = _op_stats(site, unpack_row(float_row, int_row), screened)
        ops.append(op)
        clocks.append(clock)
    origin, absorbed = _blame(sites, graph, ops, clocks)
    largest = None if screened else _largest_loss_scale(ops, scale)
    suggested = None if largest is None else largest / SAFETY_FACTOR
    return NumericsReport(
        tuple(ops), origin, suggested, scale, largest, nonfinite_inputs, absorbed, screened
    )


# What only the float32 shadow and twin give: NaN in a screened report (an FP4
# quantization's come from its own inputs and scales: kept).
_UNMEASURED_BY_SCREEN = ("max_abs_float32", "underflow_fraction", "lost_fraction")


def _blame(sites, graph: SiteGraph, ops: list[OpStats], clocks: list[int]):
    """``(origin, absorbed)``: the first op that made an inf/NaN from finite inputs
    which reaches the outputs, and the ops whose inf/NaN never did (autocast's own
    internal values are neither)."""
    row = {site.key: i for i, site in enumerate(sites)}
    reach = reaching(graph, lambda key: key in row and ops[row[key]].nonfinite > 0)
    born = [i for i, clock in enumerate(clocks) if clock != NEVER and not ops[i].internal]
    blamed = [i for i in born if sites[i].key in reach]
    origin = ops[min(blamed, key=clocks.__getitem__)] if blamed else None
    return origin, tuple(ops[i] for i in born if sites[i].key not in reach)


def _op_stats(site: Site, stat, screened: bool = False) -> tuple[OpStats, int]:
    """The site's ``OpStats`` (each statistic fills its field) and its origin clock;
    ``screened``: NaN for the fields the screening pass does not measure."""
    executions, first_iter = int(stat.executions), int(stat.first_nonfinite_iteration)
    size = math.prod(site.shape) * executions
    measured = {s.field: s.report(v, size) for s, v in zip(STATISTICS, stat.measured, strict=True)}
    _fp4_fields(site, measured)
    if screened and measured["tensor_scale"] is None:
        measured.update(dict.fromkeys(_UNMEASURED_BY_SCREEN, math.nan))
    op = OpStats(
        primitive=site.primitive,
        source=site.source,
        phase=site.phase,
        scaled=site.scaled,
        dtype=site.dtype,
        shape=site.shape,
        headroom=measured["max_abs"] / float(jnp.finfo(site.dtype).max),
        executions=executions,
        first_nonfinite_iteration=first_iter if site.in_loop and first_iter >= 0 else None,
        internal=site.internal,
        quantization=site.quantization,
        **measured,
    )
    return op, int(stat.origin_clock)


_FP4_FIELDS = ("amax", "tensor_scale", "block_scale_min", "block_scale_max")


def _fp4_fields(site: Site, measured: dict) -> None:
    """None where not measured: any op but an FP4 quantization traced by the report
    (one JAX had traced before is measured as a plain cast: no tensor scale)."""
    if site.quantization in (None, "fp8") or measured["tensor_scale"] is None:
        measured.update(dict.fromkeys(_FP4_FIELDS))
    elif measured["block_scale_min"] is None:  # every block was zero
        measured["block_scale_max"] = None


def _narrow_range(dtype) -> bool:
    """A floating dtype whose range is smaller than float32's (float16, not bfloat16)."""
    return jnp.finfo(dtype).maxexp < jnp.finfo(jnp.float32).maxexp


def _largest_loss_scale(ops: list[OpStats], scale: float | None) -> float | None:
    """The largest power of two at which every backward op stays below its dtype's max.

    Cotangents (``scaled`` ops) are linear in the loss scale: an op that reached ``m`` at
    scale ``s`` reaches ``m * S / s`` at scale ``S``; ``m`` is the float32 twin's
    magnitude, so an op that already overflowed still gives its true size.
    """
    # A quantization's output is scaled by its own amax, not by the loss scale.
    backward = [
        op for op in ops if op.scaled and op.quantization is None and _narrow_range(op.dtype)
    ]
    if scale is None or not backward:
        return None  # no float16 cotangent: loss scaling is not needed
    limits = [
        float(jnp.finfo(op.dtype).max) * scale / op.max_abs_float32
        for op in backward
        if op.max_abs_float32 > 0
    ]
    if not limits:
        return None
    return 2.0 ** math.floor(math.log2(min(limits)))
