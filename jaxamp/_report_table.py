"""The text of a :class:`jaxamp.PrecisionReport`: one row per matmul, then a summary.

The summary gives the FLOP shares per operand dtype and, where a recipe ran,
the FP8 and FP4 shares with their scalings and the products its
``high_precision`` kept in the compute dtype.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxamp._fp8._scalings import family_of

if TYPE_CHECKING:
    from jaxamp._report import MatmulInfo, PrecisionReport

__all__ = ["report_text", "short"]

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
    widths = [max(len(r[i]) for r in rows) for i in range(len(_HEADER))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join(lines + _summary(report))


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
