"""FP8 matmuls for autocast: ``dot_general`` per recipe, ``conv_general_dilated`` tensorwise.

A ``dot_general`` is brought to ``[B, P, C] x [B, Q, C]`` (batch, free and
contracting dims each merged; a transpose and a reshape that JAX differentiates
as usual; a product with several batch dims is mapped over all but one, so
that no sharded batch dim is merged with another), and a ``custom_vjp`` runs
the three products in FP8: the forward on ``forward_dtype`` operands, and both
backward products on the incoming gradient in ``gradient_dtype``. An
activation is requantized along the backward product's contracting dim
(rowwise groups differ between the forward and the backward products, as in
torchao). A weight (a parameter: autocast's PLAIN operand) is quantized once:
the input-gradient product reuses its forward codes (``_input_gradient``:
rowwise folds the weight's scales into the gradient, square tiles (blockwise's
128x128, mxfp8's 32x32) are the same tiles transposed (``_tiles.py``); under
the native GEMM they are requantized from the codes, exactly), so that a
sharded weight is all-gathered once per step, in float8.
Under tensorwise scaling, whose groups do not depend on the contracting dim,
the forward's float8 operands are saved and the backward products contract
them along the other dim.
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
from jaxamp._fp8 import _tiles
from jaxamp._fp8._native import native_product, uses_native
from jaxamp._fp8._quantize import groups_for, quantize, scaled_product
from jaxamp._fp8._ragged import fp8_spec, ragged_dot, ragged_form
from jaxamp._fp8._recipe import Float8Recipe
from jaxamp._fp8._scales import WeightAmaxes, weight_amaxes
from jaxamp._fp8._scalings import QUANTIZE_SCOPE, SCOPE_PREFIX
from jaxamp._fp8._scalings import scope_name as _scope_name
from jaxamp._wire._warnings import spans_devices

__all__ = [
    "FP8_PRIMITIVES",
    "SCOPE_PREFIX",
    "fp8_matmul",
    "fp8_operands",
    "fp8_runs",
    "fp8_weight_amaxes",
    "scope_name",
]

FP8_PRIMITIVES = ("dot_general", "conv_general_dilated", "ragged_dot_general")


def fp8_runs(eqn: jex.JaxprEqn) -> bool:
    """Whether ``eqn`` runs in FP8: a dot, a conv, a ``ragged_dot`` in its MoE form."""
    name = eqn.primitive.name
    if name == "ragged_dot_general":
        lhs, rhs = (v.aval.ndim for v in eqn.invars[:2])  # pyright: ignore[reportAttributeAccessIssue]
        return ragged_form(eqn.params, lhs, rhs) is not None
    return name in FP8_PRIMITIVES


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


def _quantized(recipe: Float8Recipe, x, dtype, kind: str, amax=None):
    return quantize(x, dtype, groups_for(recipe.scaling, kind), recipe.exact_scales, amax)


def _product(recipe: Float8Recipe, qa, qb, out_dtype, accumulate=F32):
    # Decided when traced: jax.nn.scaled_matmul where the native MX GEMM runs (_native.py).
    if uses_native(recipe):
        return native_product(qa, qb, out_dtype)
    return scaled_product(qa, qb, out_dtype, accumulate)


def _whole(quantized):
    """A tensorwise-quantized ``[B, P, C]``: (float8 ``[B, P, C]``, inverse ``[B, 1, 1]``)."""
    q, inverse = quantized
    return q[:, :, 0], inverse[:, :1, :1]


def _whole_product(x, y, contract: tuple, out_dtype, accumulate=F32):
    """The product of two tensorwise operands over dims ``contract`` (batch dim 0).

    The backward products contract the saved float8 operands along another dim
    instead of transposing them: the partitioner then all-gathers a weight's
    float8 shard once for the forward and both backward products. The float8
    product comes out in ``accumulate``, the dtype of its cross-device sum.
    """
    (qx, inv_x), (qy, inv_y) = x, y
    dims = ((contract[:1], contract[1:]), ((0,), (0,)))
    out = jax.lax.dot_general(qx, qy, dims, preferred_element_type=accumulate)
    return (out.astype(F32) * inv_x * inv_y).astype(out_dtype)


def _square_tiles(recipe: Float8Recipe) -> int | None:
    """The side of the recipe's square weight tiles (blockwise: 128), if its weights have them."""
    groups = groups_for(recipe.scaling, "weight")
    square = groups.block is not None and groups.rows == groups.block
    return groups.block if square and not uses_native(recipe) else None


def _input_gradient(recipe: Float8Recipe, g, qb, c: int, accumulate):
    """``g [B, P, Q]`` times the weight ``[B, Q, C]`` along Q, from the weight's forward
    codes ``qb`` (``[B, Q, KB, kb]``, inverse scales ``[B, Q, KB]``).

    The product contracts the weight along Q, where its forward groups do not
    lie; quantizing it again from the parameter would quantize (and, sharded,
    all-gather) each weight twice per step. Whole-row groups (rowwise: one scale
    per Q row) fold into the gradient instead: ``sum_q g[p, q] w[q, c] =
    sum_q (g[p, q] / s_q) code[q, c]``, so the gradient is quantized scaled by
    the weight's inverse scales, and the forward's codes are contracted along
    Q as they are (the partitioner gathers them once, for both products).
    Square tiles (blockwise, mxfp8), where not contracted from one tiled array
    (the native GEMM), are requantized from the codes along Q: exact, the same
    tiles transposed.
    """
    q, inverse = qb
    grad_groups, weight_groups = (groups_for(recipe.scaling, k) for k in ("grad", "weight"))
    if weight_groups.block is None:
        with jax.named_scope(QUANTIZE_SCOPE):
            folded = g.astype(F32) * jax.numpy.swapaxes(inverse, 1, 2)
        codes, inverse_g = quantize(folded, recipe.gradient_dtype, grad_groups, recipe.exact_scales)
        qg = (codes[:, :, 0], inverse_g)  # one scale per row: [B, P, Q], [B, P, 1]
        unscaled = (q, jax.numpy.ones((), F32))  # the forward's [B, Q, C] codes
        return _whole_product(qg, unscaled, (2, 1), F32, accumulate)
    qg = quantize(g, recipe.gradient_dtype, grad_groups, recipe.exact_scales)
    with jax.named_scope(QUANTIZE_SCOPE):
        values = (q.astype(F32) * inverse[..., None]).reshape(q.shape[0], q.shape[1], -1)
        values = jax.numpy.swapaxes(values[:, :, :c], 1, 2)
    qw = quantize(values, recipe.forward_dtype, weight_groups, recipe.exact_scales)
    return _product(recipe, qg, qw, F32, accumulate)


def _canonical_matmul(
    recipe: Float8Recipe,
    kinds: tuple[str, str],
    dtypes: tuple,
    reduce: tuple,
    accumulate: np.dtype = F32,
    axes: tuple = (),
) -> Callable:
    """``[B, P, C] x [B, Q, C] -> [B, P, Q]`` in FP8, with FP8 backward products.

    ``dtypes``: the operands' dtypes (their cotangents'); ``reduce``: the result
    dtypes of the products giving each cotangent, which the partitioner reduces
    across devices (a parameter's: ``recipe.reduce_dtype``); ``accumulate``:
    the forward product's (its partial sums' where C is sharded); ``axes``: the
    ``jax.vmap`` axes it is mapped over (``_batched_dot``), which a tensorwise
    gradient's amax spans.

    ``amaxes``: each operand's amax when computed beforehand (a weight's, from
    the step's one fused reduction, ``_scales``; tensorwise only), else None.
    """
    fwd_dtype, grad_dtype, out_dtype = (
        recipe.forward_dtype,
        recipe.gradient_dtype,
        recipe.compute_dtype,
    )
    a_kind, b_kind = kinds
    scope = scope_name(recipe)
    # Tensorwise groups do not depend on the contracting dim: the backward
    # products reuse the forward's float8 operands (saved instead of a and b).
    reuse = recipe.scaling == "tensorwise"
    # Rowwise: the weight's codes are saved for the input-gradient product, and
    # the forward product contracts that same array (one all-gather of it).
    rows = all(groups_for(recipe.scaling, k).block is None for k in (a_kind, b_kind))
    # Square weight tiles (blockwise): both products contract the same tiled codes.
    tiles = _square_tiles(recipe) if b_kind == "weight" else None

    def forward(a, b, amaxes):
        with jax.named_scope(scope):
            qa = _quantized(recipe, a, fwd_dtype, a_kind, amaxes[0])
            qb = _quantized(recipe, b, fwd_dtype, b_kind, amaxes[1])
            if reuse:
                qa, qb = _whole(qa), _whole(qb)
                return _whole_product(qa, qb, (2, 2), out_dtype, accumulate), (qa, qb)
            if tiles:
                w = _tiles.tiled(qb, min(tiles, b.shape[1]))
                return _tiles.product(qa, w, b.shape[1], out_dtype, accumulate), (a, w)
            if rows:  # one scale per row of each operand: its codes are [B, P, C]
                codes = qb[0][:, :, 0]
                a_rows, b_rows = (qa[0][:, :, 0], qa[1]), (codes, _t(qb[1]))
                out = _whole_product(a_rows, b_rows, (2, 2), out_dtype, accumulate)
                return out, (a, (codes, qb[1]) if b_kind == "weight" else b)
            # A weight's codes are saved: the input-gradient product reuses them,
            # so a sharded weight is all-gathered once per step, in float8.
            out = _product(recipe, qa, qb, out_dtype, accumulate)
            return out, (a, qb if b_kind == "weight" else b)

    @jax.custom_vjp
    def matmul(a, b, amaxes):
        return forward(a, b, amaxes)[0]

    def fwd(a, b, amaxes):
        out, saved = forward(a, b, amaxes)
        return out, (saved, amaxes)

    def bwd(residuals, g):
        saved, amaxes = residuals
        # da[B, P, C] = g[B, P, Q] . b over Q;  db[B, Q, C] = g^T[B, Q, P] . a over P.
        with jax.named_scope(scope):
            if reuse:
                qa, qb = saved
                amax = _mapped_amax(g, axes)
                qg = _whole(_quantized(recipe, g, grad_dtype, "grad", amax))
                da = _whole_product(qg, qb, (2, 1), F32, reduce[0])
                db = _whole_product(qg, qa, (1, 1), F32, reduce[1])
            else:
                a, b = saved
                if tiles:
                    # g's blocks along Q are the tiles' rows (Q zero-padded to whole tiles).
                    rows = min(tiles, g.shape[2])
                    padded = jax.numpy.pad(g, ((0, 0), (0, 0), (0, -g.shape[2] % rows)))
                    qg = _quantized(recipe, padded, grad_dtype, "grad")
                    da = _tiles.input_gradient(qg, b, a.shape[2], F32, reduce[0])
                elif b_kind == "weight":
                    da = _input_gradient(recipe, g, b, a.shape[2], reduce[0])
                else:
                    qg = _quantized(recipe, g, grad_dtype, "grad")
                    qb_t = _quantized(recipe, _t(b), fwd_dtype, b_kind)
                    da = _product(recipe, qg, qb_t, F32, reduce[0])
                qg_t = _quantized(recipe, _t(g), grad_dtype, "grad")
                qa_t = _quantized(recipe, _t(a), fwd_dtype, a_kind)
                db = _product(recipe, qg_t, qa_t, F32, reduce[1])
        zeros = jax.tree.map(jax.numpy.zeros_like, amaxes)  # amaxes are not differentiated
        return da.astype(dtypes[0]), db.astype(dtypes[1]), zeros

    matmul.defvjp(fwd, bwd)
    return matmul


def _mapped_amax(v, axes: tuple):
    """The amax of ``v`` over every slice of the ``jax.vmap`` axes ``axes`` (None: none)."""
    if not axes:
        return None
    return jax.lax.pmax(jax.numpy.max(jax.numpy.abs(v.astype(F32))), axes)


def _t(x):
    return jax.numpy.swapaxes(x, 1, 2)


def _fp8_dot(recipe: Float8Recipe, params: dict, x, w, plain: tuple, amaxes: tuple):
    # Across devices the partitioner sums partial products in their result dtype:
    # a parameter's gradient in reduce_dtype, the others in the compute dtype
    # (Megatron's and 16-bit autocast's partial sums); one device: float32.
    partial = recipe.compute_dtype if spans_devices(x, w) else F32
    (contract, batch) = params["dimension_numbers"]
    if len(batch[0]) > 1 and not uses_native(recipe):
        return _batched_dot(recipe, contract, batch, x, w, plain, amaxes, partial)
    return _dot(recipe, params["dimension_numbers"], x, w, plain, amaxes, partial)


def _batched_dot(recipe, contract, batch, x, w, plain, amaxes, partial, axes=()):
    """A product with several batch dims, mapped over the first (``jax.vmap``).

    Merging batch dims into one would merge a sharded dim with another (tensor
    parallel attention: heads sharded, the batch not), which the partitioner
    can only do after gathering it. The groups are per batch element anyway,
    except tensorwise's: its operands' amaxes, over the whole operands, come
    first, and its output gradient's is a ``pmax`` over the mapped axes (``axes``).
    """
    if recipe.scaling == "tensorwise":
        amaxes = tuple(
            jax.numpy.max(jax.numpy.abs(v.astype(F32))) if m is None else m
            for v, m in zip((x, w), amaxes, strict=True)
        )
    (lb, *lbs), (rb, *rbs) = batch
    inner = (
        tuple(tuple(d - (d > b) for d in dims) for dims, b in zip(contract, (lb, rb), strict=True)),
        (tuple(d - (d > lb) for d in lbs), tuple(d - (d > rb) for d in rbs)),
    )

    name = f"jaxamp_fp8_batch{len(axes)}"

    def one(x, w):
        if len(inner[1][0]) > 1:
            return _batched_dot(
                recipe, inner[0], inner[1], x, w, plain, amaxes, partial, (*axes, name)
            )
        return _dot(recipe, inner, x, w, plain, amaxes, partial, (*axes, name))

    return jax.vmap(one, in_axes=(lb, rb), axis_name=name)(x, w)


def _dot(recipe: Float8Recipe, numbers, x, w, plain: tuple, amaxes: tuple, partial, axes=()):
    lb, lf, lc, rb, rf, rc = dot_dims(numbers, x.ndim, w.ndim)
    out_shape = (
        *(x.shape[d] for d in lb),
        *(x.shape[d] for d in lf),
        *(w.shape[d] for d in rf),
    )
    a = _to_canonical(x, lb, lf, lc)
    b = _to_canonical(w, rb, rf, rc)
    kinds = ("act", "weight" if plain[1] else "act")
    reduce = tuple(recipe.reduce_dtype if p else partial for p in plain)
    matmul = _canonical_matmul(recipe, kinds, (a.dtype, b.dtype), reduce, partial, axes)
    return matmul(a, b, amaxes).reshape(out_shape)


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


def fp8_matmul(recipe: Float8Recipe, eqn: jex.JaxprEqn, x, w, *, plain: tuple, amaxes=(None, None)):
    """The FP8 product of ``eqn`` (a ``dot_general`` or conv) under ``recipe``.

    ``plain``: which operands are parameters or inputs (autocast's PLAIN role);
    ``amaxes``: the operands' amaxes when computed beforehand (tensorwise dots).
    """
    if eqn.primitive.name == "dot_general":
        return _fp8_dot(recipe, eqn.params, x, w, plain, amaxes)
    return _fp8_conv(recipe, eqn.primitive, dict(eqn.params), x, w)


def fp8_operands(
    recipe: Float8Recipe, x, w, plain: tuple[bool, bool], weights: WeightAmaxes | None = None
):
    """autocast's hook: the operands to quantize, and the matmul to run on them.

    ``plain[i]``: operand ``i`` is a parameter, an input or a constant (autocast's
    PLAIN role). Those are quantized from their own dtype (as Transformer Engine
    casts master weights); activations arrive in the compute dtype. A plain right
    operand is a weight for the blockwise recipe's 128x128 tiles. ``weights``:
    the step's weight amaxes from one reduction (:func:`fp8_weight_amaxes`).
    """
    x, w = (
        v if p else _to_dtype(v, recipe.compute_dtype) for v, p in zip((x, w), plain, strict=True)
    )

    def matmul(eqn: jex.JaxprEqn, x, w, *extra, dtype: np.dtype):
        del dtype  # the recipe gives the dtype
        if eqn.primitive.name == "ragged_dot_general":  # extra: the group sizes
            spec = fp8_spec(recipe)
            return ragged_dot(
                spec, eqn.params, x, w, *extra, plain=plain, reduce_dtype=recipe.reduce_dtype
            )
        amaxes = tuple(
            weights.get(eqn, i) if weights is not None and p else None for i, p in enumerate(plain)
        )
        return fp8_matmul(recipe, eqn, x, w, plain=plain, amaxes=amaxes)

    return x, w, matmul


def _to_dtype(v, dtype: np.dtype):
    return v if v.dtype == dtype else jax.lax.convert_element_type(v, dtype)


def fp8_weight_amaxes(recipe: Float8Recipe, closed: jex.ClosedJaxpr, inputs) -> WeightAmaxes | None:
    """autocast's pre-pass: the amaxes of the weights ``closed``'s dots quantize, fused.

    Tensorwise scales only (one per weight, the same in the forward and backward
    products): the other recipes' weight groups are per row or block.
    """
    if recipe.scaling != "tensorwise":
        return None
    return weight_amaxes(closed, inputs)
