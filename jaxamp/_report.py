"""precision_report: the dtype, FLOPs and Tensor Core alignment of every matmul and conv.

It traces the function (nothing runs) and walks the jaxpr, into jit, custom_jvp,
custom_vjp, scan (FLOPs times the trip count), while, cond and checkpoint.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np

from jaxamp._alignment import tensor_core_multiple
from jaxamp._checks import check_callable
from jaxamp._engine._contractions import conv_axes, dot_dims
from jaxamp._engine._visit import walk_scoped
from jaxamp._fp8._scalings import family_of, kept_in_scope, native_scaling, scaling_of_scope
from jaxamp._report_table import report_text

__all__ = [
    "MatmulInfo",
    "PrecisionReport",
    "assert_matmuls_aligned",
    "assert_matmuls_in",
    "precision_report",
]


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
    """What :func:`precision_report` found.

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


def _in_blocks(eqn: jex.JaxprEqn, stack: str) -> bool:
    """A float4 product of an FP4 recipe: its last lhs batch dim numbers K's blocks.

    ``_fp4`` and ``_ragged`` run a product as one per block along the contracting
    dim, ``[.., K/16, 16] x [.., K/16, 16]``, the blocks a batch dim.
    """
    scaling = scaling_of_scope(stack)
    dtypes = {np.dtype(v.aval.dtype).name for v in eqn.invars[:2]}  # pyright: ignore[reportAttributeAccessIssue]
    return bool(scaling) and family_of(scaling) == "fp4" and dtypes == {"float4_e2m1fn"}


def _gemm_info(
    eqn: jex.JaxprEqn, count: int, stack: str, dimension_numbers, rhs_other=()
) -> MatmulInfo:
    lhs, rhs = (v.aval for v in eqn.invars[:2])
    dims = dot_dims(dimension_numbers, lhs.ndim, rhs.ndim, rhs_other)
    lb, lf, lc, rf = dims.lhs_batch, dims.lhs_free, dims.lhs_contract, dims.rhs_free
    if lb and _in_blocks(eqn, stack):  # the blocks count towards K: the dense product's dims
        lb, lc = lb[:-1], (*lc, lb[-1])
    batch, m, k = (math.prod(lhs.shape[d] for d in ds) for ds in (lb, lf, lc))
    n = math.prod(rhs.shape[d] for d in rf)
    return _info(eqn, count, stack, 2 * batch * m * n * k, {"M": m, "N": n, "K": k})


def _dot_info(eqn: jex.JaxprEqn, count: int, stack: str) -> MatmulInfo:
    return _gemm_info(eqn, count, stack, eqn.params["dimension_numbers"])


def _ragged_dot_info(eqn: jex.JaxprEqn, count: int, stack: str) -> MatmulInfo:
    # Each lhs row meets one group's weights: the FLOPs of a dot with K x N
    # weights, however many groups there are.
    numbers = eqn.params["ragged_dot_dimension_numbers"]
    dimension_numbers = numbers.dot_dimension_numbers
    return _gemm_info(eqn, count, stack, dimension_numbers, numbers.rhs_group_dimensions)


def _scaled_matmul_info(eqn: jex.JaxprEqn, count: int, stack: str) -> MatmulInfo:
    # jax.nn.scaled_matmul: [B, M, K] x [B, N, K] with per-block scales (operands 2, 3).
    lhs, rhs = (v.aval for v in eqn.invars[:2])
    batch, m, k = lhs.shape
    n = rhs.shape[1]
    info = _info(eqn, count, stack, 2 * batch * m * n * k, {"M": m, "N": n, "K": k})
    # Its block scales make it an MX (or NVFP4) product wherever it was written.
    if info.fp8_recipe or not (info.is_fp8 or "float4_e2m1fn" in info.operand_dtypes):
        return info
    scale = np.dtype(eqn.invars[2].aval.dtype).name  # pyright: ignore[reportAttributeAccessIssue]
    return dataclasses.replace(info, fp8_recipe=native_scaling(info.operand_dtypes[0], scale))


def _conv_info(eqn: jex.JaxprEqn, count: int, stack: str) -> MatmulInfo:
    lhs, rhs = (v.aval for v in eqn.invars[:2])
    out = eqn.outvars[0].aval
    axes = conv_axes(eqn.params["dimension_numbers"])
    c_in, c_out = lhs.shape[axes.lhs_feature], rhs.shape[axes.rhs_out]
    kernel = math.prod(rhs.shape[d] for d in axes.rhs_spatial)
    # Each output element is a dot over (in-features per group) x kernel taps.
    flops = 2 * math.prod(out.shape) * rhs.shape[axes.rhs_in] * kernel
    return _info(eqn, count, stack, flops, {"C_in": c_in, "C_out": c_out})


def _info(
    eqn: jex.JaxprEqn, count: int, stack: str, flops: int, dims: dict[str, int]
) -> MatmulInfo:
    """The info of ``eqn``; ``stack``: its whole name stack (``walk_scoped``)."""
    lhs, rhs = (v.aval for v in eqn.invars[:2])
    out = eqn.outvars[0].aval
    preferred = eqn.params.get("preferred_element_type")
    accumulation = np.dtype(preferred if preferred is not None else out.dtype).name
    wider = lhs.dtype if np.dtype(lhs.dtype).itemsize >= np.dtype(rhs.dtype).itemsize else rhs.dtype
    multiple = tensor_core_multiple(wider)
    return MatmulInfo(
        primitive=eqn.primitive.name,
        lhs_shape=tuple(lhs.shape),
        rhs_shape=tuple(rhs.shape),
        out_shape=tuple(out.shape),
        operand_dtypes=(np.dtype(lhs.dtype).name, np.dtype(rhs.dtype).name),
        accumulation_dtype=accumulation,
        out_dtype=np.dtype(out.dtype).name,
        flops=flops * count,
        dims=dims,
        multiple=multiple,
        aligned={k: v % multiple == 0 for k, v in dims.items()},
        count=count,
        fp8_recipe=scaling_of_scope(stack),
        high_precision=kept_in_scope(stack),
    )


_MATMUL_INFO = {
    "dot_general": _dot_info,
    "conv_general_dilated": _conv_info,
    "ragged_dot_general": _ragged_dot_info,
    "scaled_matmul_wrapper": _scaled_matmul_info,
}


def _matmuls(jaxpr: jex.Jaxpr, op_dtypes: dict) -> Iterator[MatmulInfo]:
    for eqn, count, stack in walk_scoped(jaxpr):
        name = eqn.primitive.name
        if name in _MATMUL_INFO:
            yield _MATMUL_INFO[name](eqn, count, stack)
        else:
            for var in eqn.outvars:
                dtype = getattr(var.aval, "dtype", None)
                if dtype is not None and jnp.issubdtype(dtype, jnp.floating):
                    per_dtype = op_dtypes.setdefault(name, {})
                    per_dtype[np.dtype(dtype).name] = per_dtype.get(np.dtype(dtype).name, 0) + 1


def precision_report(fun: Callable, *args: Any, **kwargs: Any) -> PrecisionReport:
    """Traces ``fun(*args, **kwargs)`` (no execution) and reports its matmuls and convs.

    For every ``dot_general`` and ``conv_general_dilated``, including those inside
    jit, scan, cond, while, checkpoint and custom derivative rules: shapes,
    operand and accumulation dtypes, FLOPs and whether each GEMM dim is a multiple
    of ``jaxamp.tensor_core_multiple`` of its dtype. ``args`` may be arrays or
    ``jax.ShapeDtypeStruct``. Matmuls in a scan body count once per iteration;
    in a while body once; every branch of a cond is listed.

    >>> import jax.numpy as jnp, jaxamp
    >>> report = jaxamp.precision_report(lambda a, b: a @ b, jnp.ones((8, 12)), jnp.ones((12, 16)))
    >>> report.flops_by_dtype, [m.aligned for m in report.matmuls]
    ({'float32': 3072}, [{'M': True, 'N': True, 'K': True}])
    """
    check_callable(fun)
    closed = jax.make_jaxpr(fun)(*args, **kwargs)
    op_dtypes: dict[str, dict[str, int]] = {}
    matmuls = tuple(_matmuls(closed.jaxpr, op_dtypes))
    return PrecisionReport(matmuls, op_dtypes)


def _describe(m: MatmulInfo) -> str:
    return (
        f"{m.primitive} {m.lhs_shape} x {m.rhs_shape} operands "
        f"{'/'.join(m.operand_dtypes)} accumulating in {m.accumulation_dtype}"
    )


def assert_matmuls_in(
    fun: Callable,
    args: tuple | list,
    dtype: Any,
    *,
    kwargs: dict | None = None,
    accumulation: Any = None,
    min_fraction: float = 1.0,
) -> PrecisionReport:
    """Asserts that matmuls/convs of ``fun(*args)`` run with ``dtype`` operands.

    Args:
      fun: the function to trace (nothing runs).
      args: its positional arguments (arrays or ``jax.ShapeDtypeStruct``).
      dtype: the operand dtype every matmul must use.
      kwargs: its keyword arguments.
      accumulation: if given, the accumulation dtype every matmul must use.
      min_fraction: the fraction of matmul FLOPs that must be in ``dtype``
        (1.0: all of them; then ``accumulation`` is checked on every matmul).

    Returns:
      The report, for further checks.

    Raises:
      AssertionError: listing the offending matmuls.

    >>> import jax.numpy as jnp, jaxamp
    >>> from jaxamp.testing import assert_matmuls_in
    >>> f = jaxamp.autocast(lambda w, x: x @ w)
    >>> _ = assert_matmuls_in(f, (jnp.ones((4, 4)), jnp.ones((2, 4))), jnp.bfloat16,
    ...                       accumulation=jnp.float32)
    """
    name = np.dtype(dtype).name
    report = precision_report(fun, *args, **(kwargs or {}))
    wrong = [m for m in report.matmuls if m.compute_dtype != name]
    if accumulation is not None:
        acc = np.dtype(accumulation).name
        wrong += [m for m in report.matmuls if m.accumulation_dtype != acc and m not in wrong]
    fraction = report.fraction_in(name)
    if fraction < min_fraction or (min_fraction >= 1.0 and wrong):
        listing = "\n  ".join(_describe(m) for m in wrong) or "(none)"
        raise AssertionError(
            f"{100 * fraction:.1f}% of matmul FLOPs have {name} operands "
            f"(required: {100 * min_fraction:.1f}%"
            + (f", accumulating in {np.dtype(accumulation).name}" if accumulation else "")
            + f"). Offending ops:\n  {listing}\n{report}"
        )
    return report


def assert_matmuls_aligned(
    fun: Callable, args: tuple | list, *, kwargs: dict | None = None
) -> PrecisionReport:
    """Asserts every matmul/conv dim of ``fun(*args)`` is a Tensor Core multiple.

    >>> import jax.numpy as jnp, jaxamp
    >>> from jaxamp.testing import assert_matmuls_aligned
    >>> f = jaxamp.autocast(lambda w, x: x @ w, pad_to=8)
    >>> _ = assert_matmuls_aligned(f, (jnp.ones((5, 3)), jnp.ones((2, 5))))
    """
    report = precision_report(fun, *args, **(kwargs or {}))
    if report.misaligned:
        listing = "\n  ".join(
            f"{_describe(m)}: {m.dims} not all multiples of {m.multiple}" for m in report.misaligned
        )
        raise AssertionError(f"misaligned matmuls:\n  {listing}")
    return report
