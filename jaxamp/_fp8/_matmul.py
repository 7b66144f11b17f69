"""FP8 matmuls for autocast: ``dot_general`` per recipe, ``conv_general_dilated`` tensorwise.

A ``dot_general`` is brought to ``[B, P, C] x [B, Q, C]`` (batch, free and
contracting dims each merged; a transpose and a reshape that JAX differentiates
as usual), and a ``custom_vjp`` runs the three products in FP8: the forward on
``forward_dtype`` operands, and both backward products on the incoming gradient
in ``gradient_dtype`` and the saved operands requantized in ``forward_dtype``
along the backward product's contracting dim (rowwise groups differ between the
forward and the backward products, as in torchao). Residuals are the operands
as they reached the matmul (parameters in their own dtype, activations in the
compute dtype).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.extend.core as jex
import numpy as np

from jaxamp._casting import F32
from jaxamp._engine import _compat as compat
from jaxamp._engine._contractions import dot_dims
from jaxamp._engine._interpreter import eval_jaxpr
from jaxamp._fp8._native import native_product, uses_native
from jaxamp._fp8._quantize import groups_for, quantize, scaled_product
from jaxamp._fp8._recipe import Float8Recipe
from jaxamp._fp8._scalings import SCOPE_PREFIX
from jaxamp._fp8._scalings import scope_name as _scope_name

__all__ = ["FP8_PRIMITIVES", "SCOPE_PREFIX", "fp8_matmul", "fp8_operands", "scope_name"]

FP8_PRIMITIVES = ("dot_general", "conv_general_dilated")


def _to_canonical(x, batch, free, contract):
    """``x`` as ``[B, P, C]`` (each group of dims merged), and the free dims' sizes."""
    perm = (*batch, *free, *contract)
    if perm != tuple(range(x.ndim)):
        x = jax.lax.transpose(x, perm)
    sizes = [math.prod(x.shape[i] for i in range(a, b)) for a, b in _spans(batch, free, contract)]
    return x.reshape(sizes)


def _spans(batch, free, contract):
    nb, nf = len(batch), len(free)
    return ((0, nb), (nb, nb + nf), (nb + nf, nb + nf + len(contract)))


def scope_name(recipe: Float8Recipe, scaling: str | None = None) -> str:
    """The name scope of an FP8 product: precision_report reads the recipe from it."""
    return _scope_name(scaling or recipe.scaling, recipe.power_of_two_scale)


def _product(recipe: Float8Recipe, a, a_dtype, a_kind, b, b_dtype, b_kind, out_dtype):
    pow2 = recipe.exact_scales
    # Decided when traced: jax.nn.scaled_matmul where the native MX GEMM runs (_native.py).
    product = native_product if uses_native(recipe) else scaled_product
    with jax.named_scope(scope_name(recipe)):
        qa = quantize(a, a_dtype, groups_for(recipe.scaling, a_kind), pow2)
        qb = quantize(b, b_dtype, groups_for(recipe.scaling, b_kind), pow2)
        return product(qa, qb, out_dtype)


def _canonical_matmul(recipe: Float8Recipe, kinds: tuple[str, str]) -> Callable:
    """``[B, P, C] x [B, Q, C] -> [B, P, Q]`` in FP8, with FP8 backward products."""
    fwd_dtype, grad_dtype, out_dtype = (
        recipe.forward_dtype,
        recipe.gradient_dtype,
        recipe.compute_dtype,
    )
    a_kind, b_kind = kinds

    @jax.custom_vjp
    def matmul(a, b):
        return _product(recipe, a, fwd_dtype, a_kind, b, fwd_dtype, b_kind, out_dtype)

    def fwd(a, b):
        return matmul(a, b), (a, b)

    def bwd(residuals, g):
        a, b = residuals
        # da[B, P, C] = g[B, P, Q] . b over Q;  db[B, Q, C] = g^T[B, Q, P] . a over P.
        da = _product(recipe, g, grad_dtype, "grad", _t(b), fwd_dtype, b_kind, F32)
        db = _product(recipe, _t(g), grad_dtype, "grad", _t(a), fwd_dtype, a_kind, F32)
        return da.astype(a.dtype), db.astype(b.dtype)

    matmul.defvjp(fwd, bwd)
    return matmul


def _t(x):
    return jax.numpy.swapaxes(x, 1, 2)


def _fp8_dot(recipe: Float8Recipe, params: dict, x, w, rhs_is_weight: bool):
    lb, lf, lc, rb, rf, rc = dot_dims(params["dimension_numbers"], x.ndim, w.ndim)
    out_shape = (
        *(x.shape[d] for d in lb),
        *(x.shape[d] for d in lf),
        *(w.shape[d] for d in rf),
    )
    a = _to_canonical(x, lb, lf, lc)
    b = _to_canonical(w, rb, rf, rc)
    kinds = ("act", "weight" if rhs_is_weight else "act")
    out = _canonical_matmul(recipe, kinds)(a, b)
    return out.reshape(out_shape)


def _eval_fp8_pullback(closed: jex.ClosedJaxpr, args: list, widen: np.dtype) -> list:
    """The transposed convolutions, bound on float8 operands with float32 accumulation.

    ``lax.conv_general_dilated`` takes one operand dtype: when the gradient's
    format differs from the forward one, both float8 operands are widened
    (exactly) to ``widen``, the same products at 16-bit speed.
    """

    def apply(eqn: jex.JaxprEqn, ins: list) -> list:
        if eqn.primitive.name == "conv_general_dilated":
            if ins[0].dtype != ins[1].dtype:
                ins = [jax.lax.convert_element_type(v, widen) for v in ins]
            params = {**eqn.params, "preferred_element_type": F32}
            return [eqn.primitive.bind(*ins, **params)]
        return compat.bind_eqn(eqn, ins)

    return eval_jaxpr(closed, args, apply)


def _fp8_conv(recipe: Float8Recipe, prim: jex.Primitive, params: dict, x, w):
    """A tensorwise-scaled FP8 convolution (one scale per operand) with FP8 backward."""
    fwd_dtype, grad_dtype, out_dtype = (
        recipe.forward_dtype,
        recipe.gradient_dtype,
        recipe.compute_dtype,
    )
    tensorwise, pow2 = groups_for("tensorwise", "act"), recipe.exact_scales
    f32_params = {**params, "preferred_element_type": F32}

    def q(v, dtype):
        quantized, inverse = quantize(v.reshape(1, 1, -1), dtype, tensorwise, pow2)
        return quantized.reshape(v.shape), inverse.reshape(())

    scope = scope_name(recipe, "tensorwise")

    @jax.custom_vjp
    def conv(x, w):
        with jax.named_scope(scope):
            (qx, ix), (qw, iw) = q(x, fwd_dtype), q(w, fwd_dtype)
            return (prim.bind(qx, qw, **f32_params) * (ix * iw)).astype(out_dtype)

    def fwd(x, w):
        return conv(x, w), (x, w)

    def bwd(residuals, g):
        x, w = residuals
        (qx, ix), (qw, iw), (qg, ig) = q(x, fwd_dtype), q(w, fwd_dtype), q(g, grad_dtype)

        def pullback(x, w, g):
            (dx,) = jax.linear_transpose(lambda a: prim.bind(a, w, **f32_params), x)(g)
            (dw,) = jax.linear_transpose(lambda b: prim.bind(x, b, **f32_params), w)(g)
            return dx, dw

        avals = [jax.ShapeDtypeStruct(v.shape, F32) for v in (x, w, g)]
        closed = jax.make_jaxpr(pullback)(*avals)
        with jax.named_scope(scope):
            dx, dw = _eval_fp8_pullback(closed, [qx, qw, qg], out_dtype)
        return (dx * (ig * iw)).astype(x.dtype), (dw * (ig * ix)).astype(w.dtype)

    conv.defvjp(fwd, bwd)
    return conv(x, w)


def fp8_matmul(recipe: Float8Recipe, eqn: jex.JaxprEqn, x, w, *, rhs_is_weight: bool):
    """The FP8 product of ``eqn`` (a ``dot_general`` or conv) under ``recipe``."""
    if eqn.primitive.name == "dot_general":
        return _fp8_dot(recipe, eqn.params, x, w, rhs_is_weight)
    return _fp8_conv(recipe, eqn.primitive, dict(eqn.params), x, w)


def fp8_operands(recipe: Float8Recipe, x, w, plain: tuple[bool, bool]):
    """autocast's hook: the operands to quantize, and the matmul to run on them.

    ``plain[i]``: operand ``i`` is a parameter, an input or a constant (autocast's
    PLAIN role). Those are quantized from their own dtype (as Transformer Engine
    casts master weights); activations arrive in the compute dtype. A plain right
    operand is a weight for the blockwise recipe's 128x128 tiles.
    """
    x, w = (
        v if p else _to_dtype(v, recipe.compute_dtype) for v, p in zip((x, w), plain, strict=True)
    )

    def matmul(eqn: jex.JaxprEqn, x, w, *extra, dtype: np.dtype):
        del extra, dtype  # dots and convs have no extra operands; the recipe gives the dtype
        return fp8_matmul(recipe, eqn, x, w, rhs_is_weight=plain[1])

    return x, w, matmul


def _to_dtype(v, dtype: np.dtype):
    return v if v.dtype == dtype else jax.lax.convert_element_type(v, dtype)
