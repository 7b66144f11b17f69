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

import functools
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


def _cpu_product(prim: jex.Primitive, params: dict, x, w, *extra, pinned: tuple = ()):
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

    ``pinned``: operands that are already the outputs of such a barrier (the
    forward product's, saved for the backward one). They are used as they are
    when their layout is canonical: a second barrier would be a second value
    for the SPMD partitioner, which then all-gathers a sharded weight once per
    barrier instead of once per step.
    """
    if prim.name == "dot_general":
        params, x, w = _canonical_dot(params, x, w)
    x, w = _barrier(x, w, pinned)
    return prim.bind(x, w, *extra, **params)


def _barrier(x, w, pinned: tuple = ()):
    # An optimization barrier on the operands that are not pinned already.
    fresh = [i for i, v in enumerate((x, w)) if not any(v is p for p in pinned)]
    values = [x, w]
    if fresh:
        barred = jax.lax.optimization_barrier([values[i] for i in fresh])
        for i, value in zip(fresh, barred, strict=True):
            values[i] = value
    return tuple(values)


def _accumulating(
    prim: jex.Primitive,
    params: dict,
    dtype: np.dtype,
    x,
    w,
    *extra,
    accumulate: np.dtype = F32,
    pinned: tuple = (),
):
    # ``extra``: non-floating operands after the two factors (ragged_dot's group sizes).
    # ``accumulate``: the product's result dtype before the cast to ``dtype``; under
    # SPMD partitioning, the dtype its cross-device sum (if any) runs in.
    params = {**params, "preferred_element_type": accumulate}
    if jax.default_backend() == "cpu":
        out = _cpu_product(prim, params, x, w, *extra, pinned=pinned)
    else:  # GPU/TPU: the native 16-bit product, as written
        out = prim.bind(x, w, *extra, **params)
    return out if out.dtype == dtype else jax.lax.convert_element_type(out, dtype)


def _eval_accumulating(closed: jex.ClosedJaxpr, args: list, accumulate: np.dtype, pinned) -> list:
    """Evaluates a backward jaxpr, re-running its products with ``accumulate`` results."""

    def apply(eqn: jex.JaxprEqn, ins: list) -> list:
        if eqn.primitive.name in MATMUL_PRIMITIVES:
            dtype = eqn.outvars[0].aval.dtype
            return [
                _accumulating(
                    eqn.primitive, eqn.params, dtype, *ins, accumulate=accumulate, pinned=pinned
                )
            ]
        return compat.bind_eqn(eqn, ins)

    return eval_jaxpr(closed, args, apply)


def _canonical_operands(prim: jex.Primitive, params: dict, x, w) -> tuple[dict, Any, Any]:
    # On XLA:CPU, the product with its operands in the canonical layout
    # (``_canonical_dot``), as plain transposes that JAX differentiates itself.
    if jax.default_backend() == "cpu" and prim.name == "dot_general":
        return _canonical_dot(params, x, w)
    return params, x, w


def _pin(x, w):
    # The operands of the forward product behind one barrier on XLA:CPU, which
    # the backward products then reuse as they are (``_cpu_product``).
    if jax.default_backend() != "cpu":
        return x, w
    return _barrier(x, w)


def _mixed_matmul(
    prim: jex.Primitive,
    params: dict,
    dtype: np.dtype,
    grad_dtypes: tuple[np.dtype, np.dtype],
    result_dtype: np.dtype = F32,
) -> Callable:
    # ``grad_dtypes``: the result dtypes of the products that give the cotangents of
    # x and w (before their cast to ``dtype``): the SPMD partitioner reduces a
    # gradient across devices right after its product, in that dtype.
    # ``result_dtype``: the forward product's, for the same reason.
    low_params = {**params, "preferred_element_type": dtype}

    def product(x, w, *extra):
        x, w = _pin(x, w)
        out = _accumulating(
            prim, params, dtype, x, w, *extra, accumulate=result_dtype, pinned=(x, w)
        )
        return out, (x, w)

    @jax.custom_vjp
    def matmul(x, w, *extra):
        return product(x, w, *extra)[0]

    def fwd(x, w, *extra):
        # The product itself, not ``matmul``: under forward-over-reverse (jax.hessian,
        # jax.jvp of jax.grad) fwd and bwd run on JVP tracers of the outer transform,
        # which JAX differentiates through primitives but not through a custom_vjp.
        out, (x, w) = product(x, w, *extra)
        return out, (x, w, extra)

    def bwd(residuals, ct):
        x, w, extra = residuals
        grads = []
        for i, accumulate in enumerate(grad_dtypes):
            closed = jax.make_jaxpr(functools.partial(_pullback, prim, low_params, i))(
                x, w, extra, ct
            )
            args = [x, w, *extra, ct]
            grads.append(_eval_accumulating(closed, args, np.dtype(accumulate), (x, w))[0])
        return (*grads, *(None for _ in extra))

    matmul.defvjp(fwd, bwd)
    return matmul


def _pullback(prim: jex.Primitive, params: dict, i: int, x, w, extra, ct):
    # The cotangent of operand ``i``: the transpose of the linear map (not jax.vjp,
    # which would re-run the forward product, dead code that precision_report counts).
    def linear(a):
        operands = [x, w]
        operands[i] = a
        return prim.bind(*operands, *extra, **params)

    return jax.linear_transpose(linear, (x, w)[i])(ct)[0]


def _transposable(prim: jex.Primitive, params: dict, dtype: np.dtype, x, w, *extra):
    # The product as hand-written 16-bit code has it (Flax's dtype=bfloat16 layers):
    # a 16-bit dot_general whose result is 16-bit, which backends accumulate in
    # float32. JAX differentiates and transposes it itself (no custom_vjp, no
    # optimization barrier), and checkpoint policies see a dot_general.
    return prim.bind(x, w, *extra, **{**params, "preferred_element_type": dtype})


def run_matmul(
    eqn: jex.JaxprEqn,
    x: Any,
    w: Any,
    *extra: Any,
    dtype: np.dtype,
    transposable: bool = False,
    grad_dtypes: tuple[Any, Any] = (F32, F32),
    result_dtype: Any = F32,
) -> Any:
    """The product of ``eqn`` on compute-dtype operands, result in ``dtype``.

    ``extra`` are the equation's non-floating operands after the two factors.
    ``transposable``: for code JAX linearizes and transposes itself (the JVP
    rule of a ``custom_jvp`` under ``jax.grad``), which a ``custom_vjp`` breaks,
    and for ``jax.checkpoint`` bodies whose policy must see the dots.
    ``grad_dtypes``: the result dtypes of the backward products giving the
    cotangents of ``x`` and ``w`` (float32 accumulation, or a 16-bit policy
    ``reduce_dtype`` for a parameter): under SPMD partitioning a weight
    gradient is reduced across devices in it.
    ``result_dtype``: the forward product's result dtype before the cast to
    ``dtype``: float32, or ``dtype`` itself where the program spans several
    devices, so that a row-parallel layer's partial sums are reduced in it
    (the product still accumulates in float32 on GPU/TPU; XLA:CPU computes
    it in float32 and rounds).
    """
    if dtype.itemsize >= 4:
        # float32 (or wider) compute: run as written, so a float32 policy is exact.
        return compat.bind_eqn(eqn, [x, w, *extra])[0]
    if transposable:
        return _transposable(eqn.primitive, dict(eqn.params), dtype, x, w, *extra)
    params, x, w = _canonical_operands(eqn.primitive, dict(eqn.params), x, w)
    return _mixed_matmul(eqn.primitive, params, dtype, grad_dtypes, np.dtype(result_dtype))(
        x, w, *extra
    )


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
