"""From the statistics of one run to a :class:`NumericsReport`: origin, loss scale."""

from __future__ import annotations

import math

import jax.numpy as jnp

from jaxamp._numerics._instrument import NEVER
from jaxamp._numerics._sites import Site
from jaxamp._numerics._types import SAFETY_FACTOR, NumericsReport, OpStats

__all__ = ["summarise"]


def summarise(
    sites: list[Site], floats, ints, scale: float | None, nonfinite_inputs: tuple[str, ...] = ()
) -> NumericsReport:
    ops, origin, origin_clock = [], None, NEVER
    for site, (max_abs, max32), row in zip(sites, floats, ints, strict=True):
        nonfinite, underflow, lost, saturated, executions, clock, first_iter = (int(v) for v in row)
        size = math.prod(site.shape) * executions
        op = OpStats(
            primitive=site.primitive,
            source=site.source,
            phase=site.phase,
            scaled=site.scaled,
            dtype=site.dtype,
            shape=site.shape,
            max_abs=float(max_abs),
            nonfinite=nonfinite,
            underflow_fraction=underflow / size if size else 0.0,
            headroom=float(max_abs) / float(jnp.finfo(site.dtype).max),
            max_abs_float32=float(max32),
            executions=executions,
            first_nonfinite_iteration=first_iter if site.in_loop and first_iter >= 0 else None,
            lost_fraction=lost / size if size else 0.0,
            internal=site.internal,
            saturated_fraction=saturated / size if size else 0.0,
        )
        ops.append(op)
        if clock < origin_clock:
            origin, origin_clock = op, clock
    largest = _largest_loss_scale(ops, scale)
    suggested = None if largest is None else largest / SAFETY_FACTOR
    return NumericsReport(tuple(ops), origin, suggested, scale, largest, nonfinite_inputs)


def _narrow_range(dtype) -> bool:
    """A floating dtype whose range is smaller than float32's (float16, not bfloat16)."""
    return jnp.finfo(dtype).maxexp < jnp.finfo(jnp.float32).maxexp


def _largest_loss_scale(ops: list[OpStats], scale: float | None) -> float | None:
    """The largest power of two at which every backward op stays below its dtype's max.

    Cotangents (``scaled`` ops) are linear in the loss scale: an op that reached ``m`` at
    scale ``s`` reaches ``m * S / s`` at scale ``S``; ``m`` is the float32 twin's
    magnitude, so an op that already overflowed still gives its true size.
    """
    backward = [op for op in ops if op.scaled and _narrow_range(op.dtype)]
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
