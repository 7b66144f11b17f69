"""``OpStats`` and ``NumericsReport``: what :func:`jaxamp.numerics_report` returns."""

from __future__ import annotations

import dataclasses
import math
import os

import numpy as np

from jaxamp._reporting import text_table

__all__ = ["NumericsReport", "OpStats"]

_ROWS = 10  # ops per table in str(report); the full list is report.ops


@dataclasses.dataclass(frozen=True)
class OpStats:
    """One floating output of one equation, aggregated over every time it ran.

    Attributes:
      primitive: the JAX primitive (``"mul"``, ``"dot_general"``, ...).
      source: ``"path/to/file.py:LINE"`` of the user's code that made it. A
        backward equation points at the forward line whose derivative it is.
      phase: ``"forward"`` (the loss depends on it: the primal computation),
        ``"backward"`` (only the gradient does: the cotangents and the derivative
        factors computed alongside the forward pass; ``grad=True`` only) or
        ``"state"`` (only the ``aux`` outputs of ``has_aux=True`` do: updated batch
        statistics, an EMA codebook). Code nothing returns is ``"backward"`` if it
        depends on the loss scale, else ``"forward"``.
      scaled: the value is a cotangent, proportional to the loss scale (what
        the suggested loss scale is computed from).
      dtype: the output dtype.
      shape: the output shape.
      max_abs: the largest finite magnitude (0.0 if none).
      nonfinite: how many inf/NaN values it produced (summed over loop iterations).
      underflow_fraction: the fraction of values that *this op* flushed: zero or
        subnormal in ``dtype``, normal in the float32 twin, and normal when this op
        runs in float32 on its 16-bit inputs with their zero and subnormal values as
        zero (a value an earlier op flushed counts there, not here; 0.0 for 32-bit
        outputs). ``most_underflow`` sorts by it, so its first row is the culprit.
      headroom: ``max_abs`` divided by the dtype's largest finite value; 1.0 means
        at the edge of overflow.
      max_abs_float32: the largest finite magnitude of the op computed in float32
        on the same inputs (for a 16-bit output; else ``max_abs``). Larger than the
        dtype's max when the 16-bit result overflowed.
      executions: how many times the equation ran (loop iterations).
      first_nonfinite_iteration: inside a scan/while body, the iteration of the
        innermost loop in which it first produced an inf/NaN; else None.
      lost_fraction: the fraction of values that are zero or subnormal here and
        normal in the float32 twin, wherever they were flushed (at this op or
        before): how much of this value float16 lost. At least ``underflow_fraction``.
      internal: jaxamp's own value: a barrier that autocast inserted around a
        matmul's operands (it moves values): in ``ops``, left out of the
        tables, never ``first_nonfinite``. autocast computes no value it then
        discards: a saturating cast chooses in float32 and casts once. (The
        steps of a quantization, such as the scale of an all-zero group or
        NVFP4's E4M3 block scales, are not measured at all: the quantization
        is one op, its float8 or float4 output.)
      saturated_fraction: for a float8 output, the fraction of values at the
        dtype's largest finite magnitude (``448`` in ``float8_e4m3fn``): clipped
        there by FP8 autocast's saturating cast, or scaled exactly onto it (the
        amax of each group under current scaling). For an FP4 quantization, the
        fraction of finite inputs clamped at the largest code: scaled beyond
        6 (``max_abs_float32``, the scaled input's largest magnitude, is then
        above 6). 0.0 for other dtypes.
      quantization: the output of a quantization, measured as one op:
        ``"fp8"`` (an FP8 recipe's float8 operand), ``"nvfp4"`` or ``"mxfp4"``
        (a ``Float4Recipe``'s ``float4_e2m1fn`` codes); None for other ops.
        For an FP4 quantization ``max_abs`` is the largest code (at most 6),
        ``underflow_fraction`` and ``lost_fraction`` the fraction of values
        that were finite and nonzero and are the zero code (flushed: E2M1's
        0.5 is a regular code, not a loss), and ``nonfinite`` counts the
        values whose block scale is NaN (a block holding an inf/NaN).
      amax: for an FP4 quantization, its input's largest finite magnitude,
        before any scale (the largest over executions); else None.
      tensor_scale: for an FP4 quantization, the per-tensor scale ``S_enc``
        that NVFP4 multiplies by before its block scales
        (``448 * 6 / amax``; the smallest over expert groups and executions),
        1.0 under MXFP4; else None. A value is ``code * block / S_enc``.
      block_scale_min: for an FP4 quantization, the smallest block scale as
        its format stores it, over the blocks that hold a nonzero value:
        NVFP4's E4M3 ``s_b`` (one per 16 values, in ``[0, 448]``; 0 means a
        whole nonzero block was flushed), MXFP4's E8M0 power of two (one per
        32 values); None when every block is zero or the op is no FP4
        quantization.
      block_scale_max: the largest such block scale (None as the smallest).
    """

    primitive: str
    source: str
    phase: str
    scaled: bool
    dtype: np.dtype
    shape: tuple[int, ...]
    max_abs: float
    nonfinite: int
    underflow_fraction: float
    headroom: float
    max_abs_float32: float
    executions: int
    first_nonfinite_iteration: int | None = None
    lost_fraction: float = 0.0
    internal: bool = False
    saturated_fraction: float = 0.0
    quantization: str | None = None
    amax: float | None = None
    tensor_scale: float | None = None
    block_scale_min: float | None = None
    block_scale_max: float | None = None

    def _row(self) -> tuple[str, ...]:
        it = self.first_nonfinite_iteration
        return (
            _short_path(self.source),
            self.primitive,
            self.phase,
            f"{np.dtype(self.dtype).name}{list(self.shape)}",
            f"{self.max_abs:.3g}",
            f"{self.headroom:.2g}",
            _percent(self.underflow_fraction),
            f"{self.nonfinite}" + (f" (iter {it})" if it is not None else ""),
        )

    def _fp4_row(self) -> tuple[str, ...]:
        return (
            _short_path(self.source),
            f"{self.quantization}",
            self.phase,
            f"{list(self.shape)}",
            f"{self.amax:.3g}",
            f"{self.tensor_scale:.3g}",
            _scale_range(self.block_scale_min, self.block_scale_max),
            f"{self.underflow_fraction:.1%}",
            f"{self.saturated_fraction:.1%}",
        )


_HEADER = ("source", "op", "phase", "value", "max_abs", "max/dtype max", "underflow", "inf/NaN")
_FP4_HEADER = (
    "source",
    "format",
    "phase",
    "codes",
    "amax",
    "tensor scale",
    "block scales",
    "flushed",
    "clamped",
)


def _percent(fraction: float) -> str:
    return "-" if math.isnan(fraction) else f"{fraction:.1%}"


def _scale_range(low: float | None, high: float | None) -> str:
    return "-" if low is None or high is None else f"{low:.3g}..{high:.3g}"


@dataclasses.dataclass(frozen=True)
class NumericsReport:
    """What :func:`jaxamp.numerics_report` measured. ``str()`` gives tables to read first.

    Attributes:
      ops: one :class:`OpStats` per floating output of every equation run, in
        program order (forward, then backward with ``grad=True``).
      first_nonfinite: the first op, in execution order, that produced an inf/NaN
        from finite inputs (where a NaN was born, not where it flowed) that
        *reaches* the outputs: a chain of non-finite ops leads from it to a
        non-finite loss, gradient or ``aux`` output. None when no inf/NaN made
        in the program reaches them. An inf that is absorbed on the way (the
        ``-inf`` of a mask after ``softmax``, a ``where`` that discards it,
        ``tanh(inf)``) is listed in ``absorbed`` instead, and autocast's
        ``internal`` barriers are never blamed.
      suggested_loss_scale: with ``grad=True`` and a 16-bit floating op in the
        backward pass, a power of two at which no ``scaled`` op overflows, 8x
        (:data:`SAFETY_FACTOR`) below the largest such power of two; else None.
      loss_scale: the loss scale the gradient was computed with (None without grad).
      max_loss_scale: the largest power of two with no backward overflow (the
        suggestion times the safety factor), or None.
      nonfinite_inputs: the arguments that hold an inf/NaN, each named by its
        parameter and its path inside it (``"params['w1']"``), in argument order.
      absorbed: the ops that made an inf/NaN from finite inputs which never
        reaches the outputs (each with its ``nonfinite`` count), in program order.
      screened: True for a report of :func:`jaxamp.numerics_monitor`'s screening
        pass alone (``screen=True``, a firing that found no inf/NaN): the float32
        shadow and twins did not run, so each op's ``max_abs_float32``,
        ``underflow_fraction`` and ``lost_fraction`` are NaN (an FP4
        quantization's, measured from its own input, are kept) and there is no
        suggested loss scale; every other field is the full report's. False for
        :func:`jaxamp.numerics_report` and for a screened firing that found an
        inf/NaN (the full report, on the same inputs).
    """

    ops: tuple[OpStats, ...]
    first_nonfinite: OpStats | None
    suggested_loss_scale: float | None
    loss_scale: float | None = None
    max_loss_scale: float | None = None
    nonfinite_inputs: tuple[str, ...] = ()
    absorbed: tuple[OpStats, ...] = ()
    screened: bool = False

    def nearest_overflow(self, n: int = _ROWS) -> list[OpStats]:
        """The ``n`` ops with the largest ``headroom`` (closest to their dtype's max)."""
        return sorted(self._visible(), key=lambda op: -op.headroom)[:n]

    def most_underflow(self, n: int = _ROWS) -> list[OpStats]:
        """The ``n`` ops with the largest ``underflow_fraction`` (ops with none left out)."""
        flushed = [op for op in self._visible() if op.underflow_fraction > 0]
        return sorted(flushed, key=lambda op: -op.underflow_fraction)[:n]

    @property
    def fp4_quantizations(self) -> list[OpStats]:
        """The FP4 quantizations measured with their amax and scales, in program order."""
        return [op for op in self.ops if op.quantization in _FP4 and op.tensor_scale is not None]

    def _visible(self) -> list[OpStats]:
        return [op for op in self.ops if not op.internal]

    @property
    def nonfinite_ops(self) -> list[OpStats]:
        """Every op that produced an inf/NaN, in program order."""
        return [op for op in self.ops if op.nonfinite]

    def __str__(self) -> str:
        phases = {}
        for op in self.ops:
            phases[op.phase] = phases.get(op.phase, 0) + 1
        counts = ", ".join(f"{n} {phase}" for phase, n in phases.items())
        lines = [f"numerics_report: {len(self.ops)} op outputs ({counts})"]
        origin = self.first_nonfinite
        if self.nonfinite_inputs:
            lines.append("non-finite inputs: " + ", ".join(self.nonfinite_inputs))
        if origin is None:
            lines.append(
                _no_origin(
                    len(self.nonfinite_ops), bool(self.nonfinite_inputs), bool(self.absorbed)
                )
            )
        else:
            lines.append("first inf/NaN made from finite inputs that reaches the outputs:")
            lines += _table([origin])
        if self.absorbed:
            lines.append("inf/NaN absorbed before the outputs (not the origin):")
            lines += _table(self.absorbed[:_ROWS])
        lines.append("nearest to overflow:")
        lines += _table(self.nearest_overflow())
        flushed = self.most_underflow()
        none = "not measured (screened)" if self.screened else "none"
        lines.append("most underflow:" if flushed else f"most underflow: {none}")
        lines += _table(flushed) if flushed else []
        lines += _fp4_table(self.fp4_quantizations)
        if self.suggested_loss_scale is not None:
            lines.append(
                f"suggested loss scale: {_power(self.suggested_loss_scale)} "
                f"(largest without backward overflow {_power(self.max_loss_scale)}, "
                f"safety factor {SAFETY_FACTOR}; measured at loss scale {self.loss_scale:g})"
            )
        elif self.screened:
            lines.append(
                "screened: no inf/NaN; the float32 shadow did not run (no float32 "
                "magnitudes, underflow or suggested loss scale)"
            )
        elif self.loss_scale is not None:
            lines.append("loss scale: not needed (no float16 value in the backward pass)")
        if len(self.ops) > _ROWS:
            lines.append(f"(tables cut to {_ROWS} rows; report.ops has all {len(self.ops)})")
        return "\n".join(lines)


SAFETY_FACTOR = 8
_FP4 = ("nvfp4", "mxfp4")


def _fp4_table(ops: list[OpStats]) -> list[str]:
    """The FP4 quantizations, one row each (none: no lines)."""
    if not ops:
        return []
    more = f" (first {_ROWS} of {len(ops)})" if len(ops) > _ROWS else ""
    rows = [op._fp4_row() for op in ops[:_ROWS]]
    return [f"FP4 quantizations{more}:", *_aligned(_FP4_HEADER, rows)]


def _no_origin(bad: int, bad_inputs: bool, absorbed: bool) -> str:
    if not bad:
        return "no inf/NaN"
    if absorbed and not bad_inputs:
        return f"no inf/NaN made here reaches the outputs ({bad} ops hold one)"
    if bad_inputs:
        return f"inf/NaN only from the non-finite inputs ({bad} ops)"
    return f"inf/NaN only from non-finite float32 constants, such as an -inf mask ({bad} ops)"


def _power(scale: float) -> str:
    return f"2**{math.log2(scale):g} = {scale:g}"


def _short_path(source: str) -> str:
    path, _, line = source.rpartition(":")
    try:
        rel = os.path.relpath(path)
    except ValueError:  # another drive on Windows
        rel = path
    return f"{rel if not rel.startswith('..') else path}:{line}"


def _table(ops: list[OpStats]) -> list[str]:
    return _aligned(_HEADER, [op._row() for op in ops])


def _aligned(header: tuple[str, ...], body: list[tuple[str, ...]]) -> list[str]:
    return text_table([header, *body], indent="  ", strip=False)
