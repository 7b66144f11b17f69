"""The statistics of the numerics report, declared once.

A statistic is a per-element map of one floating output (its finite magnitude,
1 where it is inf/NaN, ...) reduced with an associative ``combine`` (max or
sum) from an ``initial`` value. From the table ``STATISTICS`` come the one
variadic reduction over outputs of one size stacked as rows (``Elements``,
``reduce_rows``), the statistics a
value-preserving op passes on (``moved``), the running statistics of a site
over every time it runs (``Stat``, ``accumulate``), their packing into two
arrays (float32 and int32) that loops carry and the program returns
(``pack``, ``unpack_row``), and the :class:`jaxamp.OpStats` field each one
fills (``field``, ``report``).

>>> [s.name for s in STATISTICS]  # doctest: +NORMALIZE_WHITESPACE
['max_abs', 'max_abs_float32', 'nonfinite', 'underflow', 'lost', 'saturated', 'amax',
 'tensor_scale', 'block_scale_min', 'block_scale_max']
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxamp._casting import is_narrow
from jaxamp._numerics import _quantized

__all__ = [
    "EMPTY",
    "NEVER",
    "STATISTICS",
    "Elements",
    "Output",
    "Stat",
    "Statistic",
    "accumulate",
    "any_nonfinite",
    "moved",
    "pack",
    "reduce_output",
    "reduce_rows",
    "unpack_row",
]

NEVER = np.iinfo(np.int32).max  # the clock value of "no non-finite origin"
_F32, _I32 = np.dtype(np.float32), np.dtype(np.int32)


def _finite_abs(x: Any) -> tuple[Any, Any]:
    finite = jnp.isfinite(x)
    return jnp.where(finite, jnp.abs(x), jnp.zeros((), x.dtype)).astype(jnp.float32), finite


def _normal32(x: Any) -> Any:
    return jnp.abs(x) >= np.asarray(jnp.finfo(jnp.float32).tiny, x.dtype)


class Output(NamedTuple):
    """One measured output: its value, its float32 twin along the whole program
    (None: equal to the value) and this op alone in float32 on its real inputs
    (None: not computed), see ``_shadow``; for the float4 cast of an FP4
    quantization, its ``_fp4_facts.Facts`` (measured by ``_quantized.Elements``)."""

    out: Any
    shadow: Any = None
    local: Any = None
    quantized: Any = None


def _column(values: Sequence[Any], dtype: Any) -> Any:
    return np.asarray(values, dtype)[:, None]


def _first_given(*values: Any) -> Any:
    return next(v for v in values if v is not None)


class Elements:
    """The per-element facts the statistics map from, for outputs of one size.

    The outputs are stacked as the rows of one ``[outputs, elements]`` array in
    float32 (float64 if one is 64-bit; widening is exact, so every fact is the
    one of the value in its own dtype), and what depends on an output's dtype is a
    column of per-row constants. Each map is then one operation over every output
    at once: XLA compiles a few kernels per size rather than several per output,
    which is what the report's compile time follows (BENCHMARKS.md,
    "numerics_report: the first call, compile included"). A map that is all zero
    for every row (no twin, no float8 output) is None and not reduced.
    """

    def __init__(self, outputs: Sequence[Output], screen: bool = False):
        # The screening pass: is there an inf/NaN at all, and the largest magnitude
        # where there is none (``_abs_finite``); every count is the full pass's to give.
        self.screen = screen
        wide = any(np.dtype(o.out.dtype).itemsize > 4 for o in outputs)
        self.dtype = np.dtype(np.float64 if wide else np.float32)
        dtypes = [np.dtype(o.out.dtype) for o in outputs]
        shadowed = [o.shadow is not None for o in outputs]
        self.out = self._stack([o.out for o in outputs])
        self.shadow = self._stack([o.out if o.shadow is None else o.shadow for o in outputs])
        self.has_shadow = any(shadowed)
        # Rows whose loss counts, and those where this op's own flushing does.
        self.lost_rows = _column(shadowed, bool)
        self.underflow_rows = _column(
            [s and is_narrow(d) for s, d in zip(shadowed, dtypes, strict=True)], bool
        )
        self.has_underflow = bool(self.underflow_rows.any())
        self.local = None  # a row without a local twin uses its shadow: no effect
        if any(o.local is not None for o in outputs):
            self.local = self._stack([_first_given(o.local, o.shadow, o.out) for o in outputs])
        self.tiny = _column([jnp.finfo(d).tiny for d in dtypes], self.dtype)
        float8 = [d.itemsize == 1 for d in dtypes]
        self.has_float8 = any(float8)
        self.float8_max = _column(
            [jnp.finfo(d).max if f else np.inf for d, f in zip(dtypes, float8, strict=True)],
            np.float32,
        )

    def _stack(self, values: Sequence[Any]) -> Any:
        # lax, not jnp: jnp's jitted helpers are traced again for every value.
        rows: dict[int, Any] = {}
        for v in values:
            if id(v) not in rows:
                row = jax.lax.reshape(v, (1, v.size))
                rows[id(v)] = jax.lax.convert_element_type(row, self.dtype)
        return jax.lax.concatenate([rows[id(v)] for v in values], 0)

    @functools.cached_property
    def _abs_finite(self) -> tuple[Any, Any]:
        if self.screen:
            # |x| unmasked: max carries an inf or NaN through to the row's result, which
            # then flags the row (``reduce_rows``); one map and one reduction less.
            return jax.lax.abs(self.out), None
        return _finite_abs(self.out)

    @property
    def magnitude(self) -> Any:
        """float32 ``|x|`` where finite, else 0."""
        return self._abs_finite[0]

    @property
    def nonfinite(self) -> Any:
        if self.screen:
            return None  # from the largest magnitude (``reduce_rows``)
        return jnp.logical_not(self._abs_finite[1]).astype(jnp.int32)

    @property
    def magnitude_float32(self) -> Any:
        if self.screen:
            return None  # no shadow ran: not reported (``_summary``)
        return _finite_abs(self.shadow)[0] if self.has_shadow else self.magnitude

    @functools.cached_property
    def _lost_here(self) -> Any:
        return jnp.logical_and(jnp.abs(self.out) < self.tiny, _normal32(self.shadow))

    @property
    def underflow(self) -> Any:
        """1 where *this* op flushed: zero/subnormal here, normal in the twin and locally.

        0 for an output without a twin (it is what float32 would compute) and for a
        32-bit output (its arithmetic is its twin's, so what is lost in it was lost
        before: ``lost``)."""
        if not self.has_underflow:
            return None
        here = jnp.logical_and(self._lost_here, self.underflow_rows)
        if self.local is not None:
            here = jnp.logical_and(here, _normal32(self.local))
        return here.astype(jnp.int32)

    @property
    def lost(self) -> Any:
        """1 where zero/subnormal here and normal in the twin, wherever it was flushed."""
        if not self.has_shadow:
            return None
        return jnp.logical_and(self._lost_here, self.lost_rows).astype(jnp.int32)

    @property
    def saturated(self) -> Any:
        """1 where a float8 value sits at its dtype's max: clipped there by a saturating cast."""
        if not self.has_float8:
            return None  # all zero: only float8 casts saturate
        return (self.magnitude >= self.float8_max).astype(jnp.int32)

    # An FP4 quantization's own statistics (``_quantized.Elements``): none here.
    amax = tensor_scale = block_scale_min = block_scale_max = None


def _same(value: Any, repeat: Any) -> Any:
    return value


def _repeated(value: Any, repeat: Any) -> Any:
    return value * repeat


def _none(value: Any, repeat: Any) -> Any:
    return np.int32(0)


def _optional(value: Any, size: int) -> float | None:
    """A smallest scale taken over no value (its initial inf) is None."""
    value = float(value)
    return value if value < np.inf else None


def _fraction(count: Any, size: int) -> float:
    return int(count) / size if size else 0.0


def _as_float(value: Any, size: int) -> float:
    return float(value)


def _as_int(value: Any, size: int) -> int:
    return int(value)


class Statistic(NamedTuple):
    """One statistic of every measured output."""

    name: str
    dtype: np.dtype  # float32 (a magnitude) or int32 (a count)
    element: Callable[[Elements], Any]  # the per-element map; None: all zero (not reduced)
    combine: Callable[[Any, Any], Any]  # associative and commutative: max or sum
    initial: Any  # the identity of ``combine`` on the values (before anything ran)
    # (the input's statistic, how often each value repeats) -> the output's, for an
    # op that moves values without changing them (reshape, broadcast).
    moved: Callable[[Any, Any], Any]
    field: str  # the OpStats field it fills
    report: Callable[[Any, int], Any]  # (host value, elements measured) -> that field


STATISTICS = (
    Statistic("max_abs", _F32, lambda e: e.magnitude, jnp.maximum, 0, _same, "max_abs", _as_float),
    Statistic(
        "max_abs_float32",
        _F32,
        lambda e: e.magnitude_float32,
        jnp.maximum,
        0,
        _same,
        "max_abs_float32",
        _as_float,
    ),
    Statistic(
        "nonfinite", _I32, lambda e: e.nonfinite, operator.add, 0, _repeated, "nonfinite", _as_int
    ),
    # Moving values flushes none.
    Statistic(
        "underflow",
        _I32,
        lambda e: e.underflow,
        operator.add,
        0,
        _none,
        "underflow_fraction",
        _fraction,
    ),
    Statistic(
        "lost", _I32, lambda e: e.lost, operator.add, 0, _repeated, "lost_fraction", _fraction
    ),
    Statistic(
        "saturated",
        _I32,
        lambda e: e.saturated,
        operator.add,
        0,
        _repeated,
        "saturated_fraction",
        _fraction,
    ),
    # An FP4 quantization's input and scales (``_quantized.Elements``; initial elsewhere).
    Statistic("amax", _F32, lambda e: e.amax, jnp.maximum, 0, _same, "amax", _as_float),
    Statistic(
        "tensor_scale",
        _F32,
        lambda e: e.tensor_scale,
        jnp.minimum,
        np.inf,
        _same,
        "tensor_scale",
        _optional,
    ),
    Statistic(
        "block_scale_min",
        _F32,
        lambda e: e.block_scale_min,
        jnp.minimum,
        np.inf,
        _same,
        "block_scale_min",
        _optional,
    ),
    Statistic(
        "block_scale_max",
        _F32,
        lambda e: e.block_scale_max,
        jnp.maximum,
        0,
        _same,
        "block_scale_max",
        _as_float,
    ),
)
_INDEX = {s.name: i for i, s in enumerate(STATISTICS)}
NONFINITE, MAX_ABS = _INDEX["nonfinite"], _INDEX["max_abs"]
_FLOATS = [i for i, s in enumerate(STATISTICS) if s.dtype == _F32]
_INTS = [i for i, s in enumerate(STATISTICS) if s.dtype == _I32]
if len(_FLOATS) + len(_INTS) != len(STATISTICS):
    raise TypeError("every numerics statistic is float32 or int32")


def reduce_output(
    out: Any, shadow: Any = None, local: Any = None, quantized: Any = None
) -> tuple[Any, ...]:
    """Every statistic of one output, in ``STATISTICS`` order (``reduce_rows`` of one)."""
    output = Output(out, shadow, local, quantized)
    elements = (Elements if quantized is None else _quantized.Elements)([output])
    return tuple(column[0] for column in reduce_rows(elements))


def reduce_rows(elements: Any) -> tuple[Any, ...]:
    """Per statistic, in ``STATISTICS`` order, a vector over the rows of ``elements``
    (an ``Elements``, or FP4 quantizations' ``_quantized.Elements``).

    One variadic reduction over the elements of every row: XLA fuses the maps of
    every statistic into one kernel. A map of None (all zero) is not reduced.
    """
    maps = [s.element(elements) for s in STATISTICS]
    live = [k for k, m in enumerate(maps) if m is not None]
    out = jax.lax.reduce(
        tuple(maps[k] for k in live),
        tuple(STATISTICS[k].dtype.type(STATISTICS[k].initial) for k in live),
        lambda a, b: tuple(STATISTICS[k].combine(x, y) for k, x, y in zip(live, a, b, strict=True)),
        (1,),
    )
    columns = dict(zip(live, out, strict=True))
    if getattr(elements, "screen", False):
        # A row holding an inf/NaN has a non-finite largest magnitude: it counts 1 (the
        # full pass counts them), and its magnitude is the full pass's to give.
        bad = jnp.logical_not(jnp.isfinite(columns[MAX_ABS]))
        columns[NONFINITE] = bad.astype(jnp.int32)
        columns[MAX_ABS] = jnp.where(bad, jnp.zeros((), columns[MAX_ABS].dtype), columns[MAX_ABS])
    rows = elements.out.shape[0]
    return tuple(
        columns[k] if k in columns else jnp.full((rows,), s.initial, s.dtype)
        for k, s in enumerate(STATISTICS)
    )


def moved(stats: Sequence[Any], repeat: Any) -> tuple[Any, ...]:
    """The statistics of a value-preserving op's output, from its input's."""
    return tuple(s.moved(v, repeat) for s, v in zip(STATISTICS, stats, strict=True))


class Stat(NamedTuple):
    """The running statistics of one site (traced scalars)."""

    measured: tuple  # per ``STATISTICS``: combined over every run
    executions: Any  # int32: how often the equation ran
    origin_clock: Any  # int32: clock of the first inf/NaN made from finite inputs
    first_nonfinite_iteration: Any  # int32: innermost loop iteration, -1 if none


EMPTY = Stat(
    tuple(s.dtype.type(s.initial) for s in STATISTICS), *np.array([0, NEVER, -1], np.int32)
)


def accumulate(old: Stat, stats: Sequence[Any], finite_inputs: Any, clock, iteration) -> Stat:
    """``old`` after one more run with statistics ``stats``."""
    nonfinite = stats[NONFINITE] > 0
    first_origin = nonfinite & finite_inputs & (old.origin_clock == NEVER)
    first_bad = nonfinite & (old.first_nonfinite_iteration < 0)
    return Stat(
        tuple(s.combine(a, b) for s, a, b in zip(STATISTICS, old.measured, stats, strict=True)),
        old.executions + 1,
        jnp.where(first_origin, clock, old.origin_clock),
        jnp.where(first_bad, iteration, old.first_nonfinite_iteration),
    )


def pack(stats: Sequence[Stat]) -> tuple[Any, Any]:
    """``(float32 [n, f], int32 [n, i])``: per site the float statistics, then the int
    statistics and the bookkeeping (what loops carry and the program returns)."""
    if not stats:
        return jnp.zeros((0, len(_FLOATS)), jnp.float32), jnp.zeros((0, len(_INTS) + 3), jnp.int32)
    floats = [[jnp.asarray(s.measured[i], jnp.float32) for i in _FLOATS] for s in stats]
    ints = [[jnp.asarray(v, jnp.int32) for v in _int_row(s)] for s in stats]
    return jnp.stack([jnp.stack(row) for row in floats]), jnp.stack([jnp.stack(r) for r in ints])


def any_nonfinite(ints: Any) -> Any:
    """Whether some site of ``pack``'s int32 table counted an inf/NaN (traced bool)."""
    return jnp.any(ints[:, _INTS.index(NONFINITE)] > 0)


def _int_row(stat: Stat) -> list:
    return [stat.measured[i] for i in _INTS] + list(stat[1:])


def unpack_row(floats: Any, ints: Any) -> Stat:
    """One row of ``pack``'s two arrays as a ``Stat`` (also on host arrays)."""
    measured: list = [None] * len(STATISTICS)
    for row, i in enumerate(_FLOATS):
        measured[i] = floats[row]
    for row, i in enumerate(_INTS):
        measured[i] = ints[row]
    return Stat(tuple(measured), *(ints[len(_INTS) + k] for k in range(3)))
