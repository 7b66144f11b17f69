"""The statistics of one evaluation of one jaxpr body, reduced together at its end.

Measuring each output with its own reduction and updating each site's running
statistics as traced scalars gives XLA one kernel per output and a few per site
(the scalar updates and the packing of each row): on CPU most of the
instrumented program's compile time went there (BENCHMARKS.md,
"numerics_report"). A ``Scope`` instead collects the outputs measured while one
body is evaluated (the whole program, or one loop iteration, or one branch of a
cond) and reduces them at its end (``flush``):

- the outputs of one flattened size are stacked as the rows of one array (with
  their float32 twins), each statistic's per-element map is computed once over
  it, and one variadic reduction gives every statistic of ``_stats.STATISTICS``
  for every row (``_stats.Elements``, ``_stats.reduce_rows``): a few kernels per
  distinct size, not several per output; an output over ``STACK_MAX_ELEMENTS``
  is reduced alone, its own one-row ``Elements``;
- a value-preserving op (reshape, broadcast) is an entry pointing at its
  source's measurement (``_stats.Statistic.moved``, which composes along a
  chain of such ops);
- whether each op's inputs were finite, the clock of each entry, and the
  update of the running statistics (``_stats.accumulate``) are vector
  operations on the table, which is what loops carry and the program returns
  (``_stats.pack``'s layout: one row per site).

The results are those of one reduction per output: max and integer sums do not
depend on the order in which elements are combined.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxamp._numerics import _compiled, _quantized
from jaxamp._numerics._stats import (
    EMPTY,
    NEVER,
    NONFINITE,
    STATISTICS,
    Elements,
    Output,
    pack,
    reduce_rows,
)

__all__ = ["STACK_MAX_ELEMENTS", "Ref", "Scope", "empty_table", "host_flag", "stack_limit"]

# In a program of over ``_compiled.FAST_COMPILE_VALUES`` measured values (one
# compiled for its run time), outputs of up to this many elements are stacked with
# the others of their size and a larger one is reduced on its own, in one kernel
# that reads it once: stacking copies every value into a float32 array (its shadow
# and twin too), which for large outputs costs more run time than the kernels it
# saves cost compile time (BENCHMARKS.md, "numerics_report: where the instrumented
# run goes"). A smaller program, whose compile is most of a report, stacks all.
STACK_MAX_ELEMENTS = 2**14


def stack_limit(values: int) -> float:
    """The largest output a program measuring ``values`` values stacks with others."""
    return STACK_MAX_ELEMENTS if values > _compiled.FAST_COMPILE_VALUES else float("inf")


_FLOATS = [i for i, s in enumerate(STATISTICS) if s.dtype == np.float32]
_INTS = [i for i, s in enumerate(STATISTICS) if s.dtype == np.int32]
_EXECUTIONS, _ORIGIN, _ITERATION = (len(_INTS) + k for k in range(3))


class Ref(NamedTuple):
    """A measurement still pending in ``scope``: entry ``entry`` of its flush."""

    scope: Any
    entry: int


def host_flag(flag: Any) -> bool | None:
    """The flag's value if it is known while tracing (a constant), else None."""
    if isinstance(flag, (Ref, jax.core.Tracer)):
        return None
    try:
        return bool(flag)
    except (TypeError, jax.errors.ConcretizationTypeError):
        return None


def empty_table(n: int) -> tuple[Any, Any]:
    """``(floats, ints)`` of ``n`` sites that have not run (constants)."""
    floats, ints = pack([EMPTY])
    return jnp.tile(floats, (n, 1)), jnp.tile(ints, (n, 1))


class _Entry(NamedTuple):
    row: int  # the site's row in the table
    output: Output | None  # what is measured; None if moved
    source: int  # the measured entry whose statistics this one has (itself if measured)
    repeat: int  # how often each of the source's values repeats here (moved entries)
    inputs: tuple  # per input: ("entry", i), ("flag", i) into the external flags
    clock: tuple  # (index into the clock bases, offset)


class Scope:
    """The table of the sites ``keys`` and what one evaluation measured for them."""

    def __init__(
        self,
        keys: Sequence[tuple],
        table: tuple[Any, Any],
        iteration: Any,
        stack_max: float,
        screen: bool = False,
    ):
        self.row = {key: i for i, key in enumerate(keys)}
        self.stack_max = stack_max  # outputs of more elements are reduced alone
        self.screen = screen  # the screening pass: ``_stats.Elements(screen=True)``
        self.floats, self.ints = table
        self.iteration = iteration
        self.entries: list[_Entry] = []
        self.flags: list[Any] = []  # traced input flags from outside this scope
        self.bases: list[Any] = []  # traced clock values entries count from
        self.finite: Any = None  # after ``flush``: per entry, no inf/NaN

    def rows(self, keys: Sequence[tuple]) -> tuple[Any, Any]:
        """The table rows of ``keys`` (the statistics a nested loop carries)."""
        idx = np.asarray([self.row[k] for k in keys], np.int32)
        return self.floats[idx], self.ints[idx]

    def set_rows(self, keys: Sequence[tuple], table: tuple[Any, Any]) -> None:
        if not keys:
            return
        idx = np.asarray([self.row[k] for k in keys], np.int32)
        self.floats = self.floats.at[idx].set(table[0], unique_indices=True)
        self.ints = self.ints.at[idx].set(table[1], unique_indices=True)

    def add(self, key, output: Output | None, moved_from, inputs, clock) -> Ref:
        """Records one output of site ``key``; ``moved_from``: ``(Ref, repeat)`` of the
        measurement a value-preserving op passes on, or None (``output`` measured).
        ``inputs``: the finite flags of the op's inputs (``Ref`` or traced or constant)."""
        entry = len(self.entries)
        if moved_from is None:
            source, repeat = entry, 1
        else:
            ref, repeat = moved_from
            output, source = None, self.entries[ref.entry].source
            repeat *= self.entries[ref.entry].repeat
        refs = tuple(self._input(flag) for flag in inputs)
        self.entries.append(_Entry(self.row[key], output, source, repeat, refs, self._clock(clock)))
        return Ref(self, entry)

    def _input(self, flag: Any) -> tuple | None:
        if isinstance(flag, Ref) and flag.scope is self:
            return ("entry", flag.entry)
        known = host_flag(flag)
        if known is True:
            return None
        self.flags.append(jnp.asarray(False if known is False else flag))
        return ("flag", len(self.flags) - 1)

    def _clock(self, clock: tuple) -> tuple:
        base, offset = clock
        if isinstance(base, int):
            return (-1, base + offset)
        self.bases.append(base)
        return (len(self.bases) - 1, offset)

    def flag(self, flag: Any) -> Any:
        """A finite flag as a traced bool (after ``flush`` for this scope's ``Ref``)."""
        if isinstance(flag, Ref):
            return self.finite[flag.entry]
        return flag

    # -- the flush -----------------------------------------------------------------
    def flush(self) -> tuple[Any, Any]:
        """Reduces every pending measurement into the table; returns the table."""
        if self.entries:
            stats = self._statistics()
            self.finite = stats[NONFINITE] == 0
            self._accumulate(stats, self._inputs_finite(), self._clocks())
        return self.floats, self.ints

    def _statistics(self) -> list[Any]:
        """Per statistic a vector over the entries (moved entries from their source)."""
        measured = {i: e.output for i, e in enumerate(self.entries) if e.output is not None}
        # FP4 quantizations apart: their rows map their ``Facts`` (``_quantized``).
        groups: dict[tuple, list[int]] = collections.defaultdict(list)
        for i, output in measured.items():
            size = output.out.size
            alone = i if size > self.stack_max else None  # reduced on its own
            groups[size, output.quantized is not None, alone].append(i)
        order, parts = [], []
        for (_, quantized, _), members in groups.items():
            order += members
            rows = [measured[i] for i in members]
            elements = _quantized.Elements(rows) if quantized else Elements(rows, self.screen)
            parts.append(reduce_rows(elements))
        position = {entry: p for p, entry in enumerate(order)}
        source = np.asarray([position[e.source] for e in self.entries], np.int32)
        repeat = np.asarray([e.repeat for e in self.entries], np.int32)
        is_moved = np.asarray([e.output is None for e in self.entries])
        out = []
        for k, stat in enumerate(STATISTICS):
            values = jnp.concatenate([part[k] for part in parts])[source]
            moved = stat.moved(values, repeat)
            out.append(jnp.where(is_moved, moved, values) if is_moved.any() else values)
        return out

    def _inputs_finite(self) -> Any:
        """Per entry: every input of its op was finite (a gather and an all)."""
        width = max([len([r for r in e.inputs if r is not None]) for e in self.entries] + [0])
        if width == 0:
            return np.ones(len(self.entries), bool)
        n = len(self.entries)
        true_slot = n + len(self.flags)
        idx = np.full((n, width), true_slot, np.int32)
        for i, entry in enumerate(self.entries):
            refs = [r for r in entry.inputs if r is not None]
            for j, (kind, at) in enumerate(refs):
                idx[i, j] = at if kind == "entry" else n + at
        flags = [jnp.stack(self.flags)] if self.flags else []
        every = jnp.concatenate([self.finite, *flags, jnp.ones((1,), bool)])
        return jnp.all(every[idx], axis=1)

    def _clocks(self) -> Any:
        base_idx = np.asarray([e.clock[0] for e in self.entries], np.int32)
        offsets = np.asarray([e.clock[1] for e in self.entries], np.int32)
        if not self.bases:
            return offsets
        bases = jnp.concatenate([jnp.stack(self.bases).astype(jnp.int32), jnp.zeros(1, jnp.int32)])
        return bases[base_idx] + offsets

    def _accumulate(self, stats: list[Any], inputs_finite: Any, clocks: Any) -> None:
        """``_stats.accumulate`` for every entry at once, written into the table."""
        rows = np.asarray([e.row for e in self.entries], np.int32)
        if len(set(rows.tolist())) != len(rows):
            raise RuntimeError(
                "numerics_report: a site was measured twice in one evaluation of its body. "
                "Please report this as a jaxamp bug."
            )
        old_f, old_i = self.floats[rows], self.ints[rows]
        combined = [
            STATISTICS[k].combine(old, new)
            for k, old, new in zip(
                range(len(STATISTICS)), _columns(old_f, old_i), stats, strict=True
            )
        ]
        nonfinite = stats[NONFINITE] > 0
        old_origin, old_iter = old_i[:, _ORIGIN], old_i[:, _ITERATION]
        first_origin = nonfinite & inputs_finite & (old_origin == NEVER)
        first_bad = nonfinite & (old_iter < 0)
        ints = [combined[i] for i in _INTS] + [
            old_i[:, _EXECUTIONS] + 1,
            jnp.where(first_origin, clocks, old_origin),
            jnp.where(first_bad, self.iteration, old_iter),
        ]
        floats = jnp.stack([combined[i].astype(jnp.float32) for i in _FLOATS], axis=1)
        ints = jnp.stack([jnp.asarray(v, jnp.int32) for v in ints], axis=1)
        self.floats = self.floats.at[rows].set(floats, unique_indices=True)
        self.ints = self.ints.at[rows].set(ints, unique_indices=True)


def _columns(floats: Any, ints: Any) -> list[Any]:
    """The table's statistic columns in ``STATISTICS`` order."""
    cols: list[Any] = [None] * len(STATISTICS)
    for c, i in enumerate(_FLOATS):
        cols[i] = floats[:, c]
    for c, i in enumerate(_INTS):
        cols[i] = ints[:, c]
    return cols
