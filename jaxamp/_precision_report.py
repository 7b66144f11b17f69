"""What :func:`jaxamp.precision_report` returns: :class:`MatmulInfo` per matmul or
conv, :class:`PrecisionReport` for the function, and the table ``str()`` prints
(one row per matmul, then a summary: the FLOP shares per operand dtype and,
where a recipe ran, the FP8 and FP4 shares with their scalings and the products
its ``high_precision`` kept in the compute dtype).

The report is made in ``_matmuls.py``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jaxamp._fp8._scalings import family_of
from jaxamp._reporting import text_table

__all__ = ["MatmulInfo", "PrecisionReport", "report_text", "short"]


@dataclasses.dataclass(frozen=True)
class MatmulInfo:
    """One matmul-like equation of the traced function.

    Attributes:
      primitive: ``"dot_general"``, ``"conv_general_dilated"``,
        ``"ragged_dot_general"`` (``jax.lax.ragged_dot``, mixture of experts)
        or ``"scaled_matmul_wrapper"`` (``jax.nn.scaled_matmul``, the native
        form of autocast's ``"mxfp8"`` products).
      lhs_shape, rhs_shape, out_shape: operand and result shapes.
      operand_dtypes: dtypes of the two operands (names).
      accumulation_dtype: ``preferred_element_type`` if set, else the result dtype.
      out_dtype: the result dtype.
      flops: 2 * multiply-adds, times the trip count of enclosing scans.
      dims: the GEMM dims checked for alignment: ``{"M", "N", "K"}`` for a dot
        (batch dims excluded; products over free/contracting dims; for an FP4
        recipe's per-block float4 product, ``[.., K/16, 16] x [.., K/16, 16]``,
        ``K`` spans the blocks: the dims of the dense product), ``{"C_in",
        "C_out"}`` (channels, NVIDIA's rule for convolutions) for a conv, as the
        conv is written: for the weight-gradient conv of a backward pass these
        are batch-like dims.
      multiple: ``jaxamp.tensor_core_multiple`` of the operand dtype.
      aligned: dim name -> whether it is a multiple of ``multiple``.
      count: how many times it runs (scan trip counts multiplied; a while loop
        counts once).
      fp8_recipe: for an FP8 product of ``autocast(fun, jaxamp.Float8Recipe(...))``
        its scaling (a ``Float8Recipe.scaling`` such as ``"rowwise"``, with
        ``"+pow2"`` for power-of-two scales), for an FP4 product its
        ``Float4Recipe.format`` (``"nvfp4"``, ``"mxfp4"``), read from the
        product's name scope (``jaxamp/_fp8/_scalings.py``); else ``""``.
      high_precision: the recipe's ``high_precision=`` kept this product in the
        compute dtype (its name scope ``kept_high_precision``), forward or
        backward; ``fp8_recipe`` is then ``""``.
    """

    primitive: str
    lhs_shape: tuple[int, ...]
    rhs_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    operand_dtypes: tuple[str, str]
    accumulation_dtype: str
    out_dtype: str
    flops: int
    dims: dict[str, int]
    multiple: int
    aligned: dict[str, bool]
    count: int = 1
    fp8_recipe: str = ""
    high_precision: bool = False

    @property
    def compute_dtype(self) -> str:
        """The operand dtype (the wider one when the two differ)."""
        a, b = (np.dtype(d) for d in self.operand_dtypes)
        return (a if a.itemsize >= b.itemsize else b).name

    @property
    def is_aligned(self) -> bool:
        return all(self.aligned.values())

    @property
    def is_fp8(self) -> bool:
        """Both operands are 8-bit floats."""
        return all(np.dtype(d).itemsize == 1 and "float8" in d for d in self.operand_dtypes)

    @property
    def is_fp4(self) -> bool:
        """Both operands are 4-bit floats (``float4_e2m1fn``: NVFP4, MXFP4)."""
        return all("float4" in d for d in self.operand_dtypes)


@dataclasses.dataclass(frozen=True)
class PrecisionReport:
    """What :func:`jaxamp.precision_report` found.

    ``str()`` gives a table, one row per matmul, then a summary: the FLOP
    shares per operand dtype; with a recipe, ``"FP8: x% of FLOPs (rowwise)"``
    and ``"FP4: x% of FLOPs (nvfp4)"``, and ``"kept in bfloat16 by
    high_precision: N products, x% of FLOPs"``.

    Attributes:
      matmuls: every matmul/conv, in trace order.
      op_dtypes: for every other primitive with floating results: result dtype
        name -> how many equations produce it (e.g. ``{"exp": {"float32": 2}}``).
    """

    matmuls: tuple[MatmulInfo, ...]
    op_dtypes: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)

    @property
    def flops_by_dtype(self) -> dict[str, int]:
        """Total matmul/conv FLOPs per operand dtype."""
        totals: dict[str, int] = {}
        for m in self.matmuls:
            totals[m.compute_dtype] = totals.get(m.compute_dtype, 0) + m.flops
        return totals

    @property
    def total_flops(self) -> int:
        return sum(m.flops for m in self.matmuls)

    @property
    def fp8_fraction(self) -> float:
        """The fraction of matmul/conv FLOPs with float8 operands (0.0 if none)."""
        total = self.total_flops
        return 0.0 if total == 0 else sum(m.flops for m in self.matmuls if m.is_fp8) / total

    @property
    def fp4_fraction(self) -> float:
        """The fraction of matmul/conv FLOPs with float4 operands (0.0 if none)."""
        total = self.total_flops
        return 0.0 if total == 0 else sum(m.flops for m in self.matmuls if m.is_fp4) / total

    @property
    def kept(self) -> tuple[MatmulInfo, ...]:
        """The products a recipe's ``high_precision=`` kept in the compute dtype."""
        return tuple(m for m in self.matmuls if m.high_precision)

    def fraction_in(self, dtype: Any) -> float:
        """The fraction of matmul/conv FLOPs whose operands are ``dtype`` (1.0 if none)."""
        name = np.dtype(dtype).name
        total = self.total_flops
        return 1.0 if total == 0 else self.flops_by_dtype.get(name, 0) / total

    @property
    def misaligned(self) -> tuple[MatmulInfo, ...]:
        """The matmuls with a dim that is not a Tensor Core multiple."""
        return tuple(m for m in self.matmuls if not m.is_aligned)

    def __str__(self) -> str:
        return report_text(self)


_OP_NAMES = {
    "dot_general": "dot",
    "conv_general_dilated": "conv",
    "ragged_dot_general": "ragged",
    "scaled_matmul_wrapper": "mx",
}
_SHORT = {
    "float32": "f32",
    "bfloat16": "bf16",
    "float16": "f16",
    "float64": "f64",
    "float8_e4m3fn": "e4m3",
    "float8_e5m2": "e5m2",
}
_HEADER = ("op", "lhs", "rhs", "operands", "accum", "out", "FLOPs", "dims (* = misaligned)")


def short(name: str) -> str:
    """A dtype name as the table spells it (``"bf16"`` for ``"bfloat16"``)."""
    return _SHORT.get(name, name)


def report_text(report: PrecisionReport) -> str:
    """The table of ``report``'s matmuls, then its summary lines."""
    rows = [_HEADER, *(_row(m) for m in report.matmuls)]
    return "\n".join(text_table(rows) + _summary(report))


def _row(m: MatmulInfo) -> tuple[str, ...]:
    """One line of the table: the op, shapes, dtypes, FLOPs and dims of ``m``."""
    dims = " ".join(f"{k}={v}{'' if m.aligned[k] else '*'}" for k, v in m.dims.items())
    count = f" (x{m.count})" if m.count != 1 else ""
    recipe = f" {family_of(m.fp8_recipe)}:{m.fp8_recipe}" if m.fp8_recipe else ""
    kept = " kept:high_precision" if m.high_precision else ""
    return (
        _OP_NAMES[m.primitive],
        "x".join(map(str, m.lhs_shape)),
        "x".join(map(str, m.rhs_shape)),
        "/".join(short(d) for d in m.operand_dtypes),
        short(m.accumulation_dtype),
        short(m.out_dtype),
        si(m.flops),
        dims + count + recipe + kept,
    )


def si(n: int) -> str:
    """``n`` with an SI suffix: ``"16.4K"``."""
    for div, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.3g}{suffix}"
    return str(n)


def _percent(flops: int, total: int) -> str:
    return f"{100.0 * flops / total:.1f}%" if total else "0.0%"


def _summary(report: PrecisionReport) -> list[str]:
    total = report.total_flops
    shares = ", ".join(f"{short(d)} {_percent(f, total)}" for d, f in report.flops_by_dtype.items())
    lines = [
        f"{len(report.matmuls)} matmul/conv ops, {si(total)} FLOPs"
        + (f" ({shares})" if total else "")
        + f"; {len(report.misaligned)} with a misaligned dim"
    ]
    for family, fraction, low in (
        ("fp8", report.fp8_fraction, [m for m in report.matmuls if m.is_fp8]),
        ("fp4", report.fp4_fraction, [m for m in report.matmuls if m.is_fp4]),
    ):
        if low:
            scalings = sorted({m.fp8_recipe for m in low if family_of(m.fp8_recipe) == family})
            lines.append(
                f"{family.upper()}: {100.0 * fraction:.1f}% of FLOPs"
                + (f" ({', '.join(scalings)})" if scalings else "")
            )
    kept = report.kept
    if kept:
        dtypes = "/".join(sorted({m.compute_dtype for m in kept}))
        lines.append(
            f"kept in {dtypes} by high_precision: {len(kept)} products, "
            f"{_percent(sum(m.flops for m in kept), total)} of FLOPs"
        )
    return lines
