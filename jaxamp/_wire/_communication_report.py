"""What :func:`jaxamp.communication_report` returns: :class:`Collective` and
:class:`CommunicationReport`, and the table ``str()`` prints.

The report is made in ``_collectives.py``, from the program ``_hlo.py`` reads.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import numpy as np

from jaxamp._reporting import text_table
from jaxamp._wire._hlo import COLLECTIVE_KINDS

__all__ = ["Collective", "CommunicationReport", "as_dtype"]

# CommunicationReport.small_gathers: vectors at least this many times smaller
# than the largest all-gather.
_SMALL_GATHER_RATIO = 16


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of the partitioned program (one entry per operand of a variadic one).

    Attributes:
      kind: ``"all-gather"``, ``"reduce-scatter"``, ``"all-reduce"``,
        ``"all-to-all"`` or ``"collective-permute"``.
      dtype: the element type on the wire.
      shape: the gathered shape for an all-gather, the full input's shape for a
        reduce-scatter, the operand's for the others.
      bytes: the bytes of that shape (one device's view of the logical tensor),
        half a byte per element of a 4-bit type (``float4_e2m1fn``, HLO's
        ``f4e2m1fn``), rounded up; for a ``staged`` all-gather only the
        bytes it adds to its input.
      parameter: the argument the collective's data comes from (e.g.
        ``"params['w1']"``) when it is one followed through casts, layout
        changes, optimization barriers and elementwise scaling or shifts;
        else ``None``.
      op_name: JAX's name of the operation that caused it (e.g.
        ``"jit(step)/transpose(jvp())/dot_general"``).
      location: ``file:line`` of the user code that caused it (the innermost
        frame outside jaxamp), when the program records it.
      parameter_dtype: that argument's dtype (``None`` without ``parameter``):
        an integer one (token ids) is data, not a parameter whose wire dtype
        a policy decides.
      staged: an all-gather of what an earlier all-gather gathered (the
        partitioner gathers a dim split over two array dims in stages): the
        stages' ``bytes`` add up to one gather of the whole tensor.
    """

    kind: str
    dtype: np.dtype
    shape: tuple[int, ...]
    bytes: int
    parameter: str | None
    op_name: str
    location: str | None
    parameter_dtype: np.dtype | None = None
    staged: bool = False

    @property
    def backward(self) -> bool:
        """Whether the backward pass caused it (its ``op_name`` is under a ``transpose``)."""
        return "transpose(" in self.op_name

    @property
    def source(self) -> str:
        """Where it came from: the parameter, else the op (and ``file:line``)."""
        if self.parameter is not None:
            return self.parameter
        place = f" ({os.path.basename(self.location)})" if self.location else ""
        return f"{self.op_name.rsplit('/', 2)[-1] if self.op_name else '?'}{place}"


@dataclasses.dataclass(frozen=True)
class CommunicationReport:
    """What :func:`jaxamp.communication_report` found. ``str()`` gives a table.

    Attributes:
      collectives: every collective of the partitioned program, in program
        order. One inside a loop body is listed once, not once per trip.
      param_count: the floating-point elements of the first positional
        argument (the parameters of a ``step(params, ...)`` by convention):
        the divisor of ``bytes_per_param``. ``dataclasses.replace(report,
        param_count=n)`` when the parameters are elsewhere.
      num_devices: the partitions of the program.
      hlo: the partitioned program's text.
    """

    collectives: tuple[Collective, ...]
    param_count: int
    num_devices: int
    hlo: str = dataclasses.field(repr=False)

    @property
    def small_gathers(self) -> tuple[Collective, ...]:
        """The all-gathers too small for a dtype decision, in program order.

        Those whose shape is a vector (at most one dimension above 1: a norm's
        scale, a bias) at least 16 times smaller than the program's largest
        all-gather (the rule and why: docs/many-devices.md, "Small gathers").
        ``str(report)`` marks them; :func:`jaxamp.testing.assert_gathers_in`
        does not judge them.

        >>> CommunicationReport((), 0, 1, "").small_gathers
        ()
        """
        gathers = [c for c in self.collectives if c.kind == "all-gather"]
        largest = max((c.bytes for c in gathers), default=0)
        return tuple(
            c
            for c in gathers
            if sum(d > 1 for d in c.shape) <= 1 and c.bytes * _SMALL_GATHER_RATIO <= largest
        )

    def bytes_by(self, kind: str | None = None, dtype: Any = None) -> int:
        """Total bytes of the collectives of one kind and/or dtype (None: all).

        >>> report = CommunicationReport((), 0, 1, "")
        >>> report.bytes_by("all-gather", "bfloat16")
        0
        """
        return sum(c.bytes for c in self._select(kind, dtype))

    def count_by(self, kind: str | None = None, dtype: Any = None) -> int:
        """How many collectives of one kind and/or dtype (None: all)."""
        return len(self._select(kind, dtype))

    def bytes_per_param(self, kind: str | None = None, dtype: Any = None) -> float:
        """``bytes_by(kind, dtype) / param_count`` (``nan`` without parameters)."""
        total = self.bytes_by(kind, dtype)
        return total / self.param_count if self.param_count else math.nan

    def totals(self) -> dict[tuple[str, np.dtype], tuple[int, int]]:
        """(kind, dtype) -> (count, bytes), in the order kinds are listed above."""
        out: dict[tuple[str, np.dtype], tuple[int, int]] = {}
        order = {k: i for i, k in enumerate(COLLECTIVE_KINDS)}
        for c in sorted(self.collectives, key=lambda c: (order[c.kind], c.dtype.name)):
            count, total = out.get((c.kind, c.dtype), (0, 0))
            out[(c.kind, c.dtype)] = (count + 1, total + c.bytes)
        return out

    def _select(self, kind: str | None, dtype: Any) -> list[Collective]:
        if kind is not None and kind not in COLLECTIVE_KINDS:
            raise ValueError(f"kind must be None or one of {COLLECTIVE_KINDS}; got {kind!r}.")
        wanted = None if dtype is None else as_dtype(dtype, "dtype")
        return [
            c
            for c in self.collectives
            if (kind is None or c.kind == kind) and (wanted is None or c.dtype == wanted)
        ]

    def __str__(self) -> str:
        rows = [("kind", "dtype", "count", "bytes", "B/param")]
        for (kind, dtype), (count, total) in self.totals().items():
            rows.append((kind, dtype.name, str(count), str(total), self._per_param(total)))
        everything = self.bytes_by()
        rows.append(
            ("total", "", str(len(self.collectives)), str(everything), self._per_param(everything))
        )
        small = {id(c) for c in self.small_gathers}
        listing = [("kind", "dtype", "shape", "bytes", "source", "")] + [
            (
                c.kind,
                c.dtype.name,
                "x".join(map(str, c.shape)) or "()",
                str(c.bytes),
                c.source,
                "small" if id(c) in small else "",
            )
            for c in self.collectives
        ]
        return "\n".join(
            [
                f"communication on {self.num_devices} devices, "
                f"{self.param_count} parameters (floating elements of the first argument)",
                *text_table(rows),
                "",
                *text_table(listing),
                *self._small_note(),
            ]
        )

    def _small_note(self) -> list[str]:
        small = self.small_gathers
        total = sum(c.bytes for c in small)
        note = (
            f"small: {len(small)} all-gathers of vectors, each at least {_SMALL_GATHER_RATIO}x "
            f"smaller than the largest ({total} bytes, {self._per_param(total)} B/param "
            "together): not worth a dtype decision"
        )
        return ["", note] if small else []

    def _per_param(self, total: int) -> str:
        return f"{total / self.param_count:.2f}" if self.param_count else "-"


def as_dtype(dtype: Any, name: str) -> np.dtype:
    try:
        return np.dtype(dtype)
    except TypeError:
        raise TypeError(
            f"{name} must be a dtype (e.g. jnp.bfloat16 or 'float32'); got {dtype!r}."
        ) from None
