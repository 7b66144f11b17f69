"""autocast's matmul rule: 16-bit operands, float32 accumulation, 16-bit result.

The forward product is ``dot_general``/``conv_general_dilated`` with
``preferred_element_type=float32`` followed by a cast to the compute dtype. Left
to JAX's own transpose rules, the backward products would mix a float32
cotangent with a 16-bit operand (the transpose of that cast is an upcast) and
run in float32. A ``custom_vjp`` keeps the backward pass in the compute dtype
too: the cotangent stays 16-bit, and each backward product again accumulates in
float32 and is cast back. Its fwd and bwd are plain products, so JAX can run
them under an outer forward transform (second derivatives: ``jax.hessian``); a
``custom_vjp`` has no forward mode of its own (``jax.jacfwd`` of the function
itself), and a ``custom_jvp`` would give JAX the backward products to transpose
into 16-bit-result products, which XLA:CPU runs in float32. Also: zero-padding
of dims to a Tensor Core multiple.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.extend.core as jex
import numpy as np

from jaxamp._alignment import align_dim
from jaxamp._casting import F32
from jaxamp._engine import _compat as compat
from jaxamp._engine._contractions import MATMUL_PRIMITIVES, conv_axes, dot_dims
from jaxamp._engine._interpreter import eval_jaxpr

__all__ = ["padded", "run_matmul"]


def _canonical_dot(params: dict, x, w):
    # (batch, free, contract) x (batch, contract, free): the layout XLA:CPU's
    # YNNPACK kernel takes for bf16 x bf16 -> f32 (a rhs already laid out as
    # (batch, free, contract) stays so). The result layout (batch, lhs free, rhs
    # free) is the same as the original's because free dims keep their order.
    lb, lf, lc, rb, rf, rc = dot_dims(params["dimension_numbers"], x.ndim, w.ndim)
    lhs_perm, rhs_perm = (*lb, *lf, *lc), (*rb, *rc, *rf)
    if (*rb, *rf, *rc) == tuple(range(w.ndim)):
        rhs_perm = (*rb, *rf, *rc)
    if lhs_perm != tuple(range(x.ndim)):
        x = jax.lax.transpose(x, lhs_perm)
    if rhs_perm != tuple(range(w.ndim)):
        w = jax.lax.transpose(w, rhs_perm)
    nb, nf, nc = len(lb), len(lf), len(lc)
    batch = tuple(range(nb))
    rhs_contract = nb + len(rf) if rhs_perm == (*rb, *rf, *rc) else nb
    contract = (tuple(range(nb + nf, nb + nf + nc)), tuple(range(rhs_contract, rhs_contract + nc)))
    return {**params, "dimension_numbers": (contract, (batch, batch))}, x, w


def _cpu_product(prim: jex.Primitive, params: dict, x, w, *extra):
    """The XLA:CPU form of a 16-bit product with float32 accumulation.

    XLA:CPU runs bf16 x bf16 -> f32 only in YNNPACK (canonical layouts, M, N > 1)
    and upcasts the dots YNNPACK cannot take to float32 when it decides which is
    which. Later passes may still fold a transpose (its own, or a gather's) into
    an accepted dot; the result reaches the generic dot kernel, which has no
    bf16 x bf16 -> f32 and fails at run time. The canonical layout plus an
    optimization barrier on the operands leaves the dot exactly as emitted, so
    the decision stays right: fast where YNNPACK runs it, float32 (the same
    products, exact in float32) elsewhere. tests/integration/test_autocast_cpu_dots.py
    holds the forms that used to fail; BENCHMARKS.md the speed.
    """
    if prim.name == "dot_general":
        params, x, w = _canonical_dot(params, x, w)
    x, w = jax.lax.optimization_barrier((x, w))
    return prim.bind(x, w, *extra, **params)


def _accumulating(prim: jex.Primitive, params: dict, dtype: np.dtype, x, w, *extra):
    # ``extra``: non-floating operands after the two factors (ragged_dot's group sizes).
    params = {**params, "preferred_element_type": F32}
    if jax.default_backend() == "cpu":
        out = _cpu_product(prim, params, x, w, *extra)
    else:  # GPU/TPU: the native 16-bit product, as written
        out = prim.bind(x, w, *extra, **params)
    return out if out.dtype == dtype else jax.lax.convert_element_type(out, dtype)


def _eval_accumulating(closed: jex.ClosedJaxpr, args: list) -> list:
    """Evaluates a backward jaxpr, re-running its products with float32 accumulation."""

    def apply(eqn: jex.JaxprEqn, ins: list) -> list:
        if eqn.primitive.name in MATMUL_PRIMITIVES:
            return [_accumulating(eqn.primitive, eqn.params, eqn.outvars[0].aval.dtype, *ins)]
        return compat.bind_eqn(eqn, ins)

    return eval_jaxpr(closed, args, apply)


def _mixed_matmul(prim: jex.Primitive, params: dict, dtype: np.dtype) -> Callable:
    low_params = {**params, "preferred_element_type": dtype}

    @jax.custom_vjp
    def matmul(x, w, *extra):
        return _accumulating(prim, params, dtype, x, w, *extra)

    def fwd(x, w, *extra):
        # The product itself, not ``matmul``: under forward-over-reverse (jax.hessian,
        # jax.jvp of jax.grad) fwd and bwd run on JVP tracers of the outer transform,
        # which JAX differentiates through primitives but not through a custom_vjp.
        return _accumulating(prim, params, dtype, x, w, *extra), (x, w, extra)

    def bwd(residuals, ct):
        x, w, extra = residuals

        def pullback(x, w, extra, ct):
            # Transposes of the two linear maps (not jax.vjp: that would re-run the
            # forward product, dead code that precision_report would count).
            (dx,) = jax.linear_transpose(lambda a: prim.bind(a, w, *extra, **low_params), x)(ct)
            (dw,) = jax.linear_transpose(lambda b: prim.bind(x, b, *extra, **low_params), w)(ct)
            return dx, dw

        closed = jax.make_jaxpr(pullback)(x, w, extra, ct)
        dx, dw = _eval_accumulating(closed, [x, w, *extra, ct])
        return (dx, dw, *(None for _ in extra))

    matmul.defvjp(fwd, bwd)
    return matmul


def _transposable(prim: jex.Primitive, params: dict, dtype: np.dtype, x, w, *extra):
    # The product as hand-written 16-bit code has it (Flax's dtype=bfloat16 layers):
    # a 16-bit dot_general whose result is 16-bit, which backends accumulate in
    # float32. JAX differentiates and transposes it itself (no custom_vjp, no
    # optimization barrier), and checkpoint policies see a dot_general.
    return prim.bind(x, w, *extra, **{**params, "preferred_element_type": dtype})


def run_matmul(
    eqn: jex.JaxprEqn, x: Any, w: Any, *extra: Any, dtype: np.dtype, transposable: bool = False
) -> Any:
    """The product of ``eqn`` on compute-dtype operands, result in ``dtype``.

    ``extra`` are the equation's non-floating operands after the two factors.
    ``transposable``: for code JAX linearizes and transposes itself (the JVP
    rule of a ``custom_jvp`` under ``jax.grad``), which a ``custom_vjp`` breaks,
    and for ``jax.checkpoint`` bodies whose policy must see the dots.
    """
    if dtype.itemsize >= 4:
        # float32 (or wider) compute: run as written, so a float32 policy is exact.
        return compat.bind_eqn(eqn, [x, w, *extra])[0]
    if transposable:
        return _transposable(eqn.primitive, dict(eqn.params), dtype, x, w, *extra)
    return _mixed_matmul(eqn.primitive, dict(eqn.params), dtype)(x, w, *extra)


def _pad_axis(x, axis: int, multiple: int):
    extra = align_dim(x.shape[axis], multiple) - x.shape[axis]
    if extra == 0:
        return x, 0
    widths = [(0, 0, 0)] * x.ndim
    widths[axis] = (0, extra, 0)
    return jax.lax.pad(x, np.zeros((), x.dtype), widths), extra


def _slicer(out_axes: list[tuple[int, int]]) -> Callable | None:
    out_axes = [(axis, size) for axis, size in out_axes if size is not None]
    if not out_axes:
        return None

    def unpad(out):
        for axis, size in out_axes:
            out = jax.lax.slice_in_dim(out, 0, size, axis=axis)
        return out

    return unpad


def _pad_dot(params: dict, x, w, multiple: int):
    lb, lhs_free, lc, _, rhs_free, rc = dot_dims(params["dimension_numbers"], x.ndim, w.ndim)
    if lc and math.prod(x.shape[d] for d in lc) % multiple:
        x, _ = _pad_axis(x, lc[-1], multiple)
        w, _ = _pad_axis(w, rc[-1], multiple)
    out_axes = []
    if lhs_free and math.prod(x.shape[d] for d in lhs_free) % multiple:
        size = x.shape[lhs_free[-1]]
        x, _ = _pad_axis(x, lhs_free[-1], multiple)
        out_axes.append((len(lb) + len(lhs_free) - 1, size))
    if rhs_free and math.prod(w.shape[d] for d in rhs_free) % multiple:
        size = w.shape[rhs_free[-1]]
        w, _ = _pad_axis(w, rhs_free[-1], multiple)
        out_axes.append((len(lb) + len(lhs_free) + len(rhs_free) - 1, size))
    return x, w, _slicer(out_axes)


def _pad_conv(params: dict, x, w, multiple: int):
    if params["feature_group_count"] != 1 or params["batch_group_count"] != 1:
        return x, w, None  # grouped/depthwise convolutions keep their channel layout
    axes = conv_axes(params["dimension_numbers"])
    if x.shape[axes.lhs_feature] % multiple:
        x, _ = _pad_axis(x, axes.lhs_feature, multiple)
        w, _ = _pad_axis(w, axes.rhs_in, multiple)
    out_axes = []
    if w.shape[axes.rhs_out] % multiple:
        size = w.shape[axes.rhs_out]
        w, _ = _pad_axis(w, axes.rhs_out, multiple)
        out_axes.append((axes.out_feature, size))
    return x, w, _slicer(out_axes)


def padded(name: str, params: dict, x, w, multiple: int):
    """Zero-pads ``x`` and ``w`` so the product's dims are multiples of ``multiple``.

    Returns ``(x, w, unpad)`` where ``unpad`` slices the padded result back (or is
    None). Zeros in a contracting dim add nothing; padded output rows and columns
    are sliced away, so the result is unchanged.
    """
    if name == "dot_general":
        return _pad_dot(params, x, w, multiple)
    if name == "conv_general_dilated":
        return _pad_conv(params, x, w, multiple)
    return x, w, None  # ragged_dot: padding would change which rows form a group
