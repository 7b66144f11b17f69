"""precision_report: the dtype, FLOPs and Tensor Core alignment of every matmul and conv.

It traces the function (nothing runs) and walks the jaxpr, into jit, custom_jvp,
custom_vjp, scan (FLOPs times the trip count), while, cond and checkpoint. What
it returns is defined in ``_precision_report.py``.
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
from jaxamp._precision_report import MatmulInfo, PrecisionReport

__all__ = ["precision_report"]


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
