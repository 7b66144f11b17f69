"""FP4 products for autocast: NVFP4 and MXFP4 quantization and the three products of a dot.

A ``dot_general`` is brought to ``[B, P, C] x [B, Q, C]`` (as FP8's, ``_matmul``),
zero-padded to whole blocks along P, Q and C (zeros change neither an amax nor
a product; each dim is a contracting dim of one of the three products), and a
``custom_vjp`` runs:

- fprop ``[B, P, Q]``: both operands round to nearest, blocks along C;
- dgrad ``da = g . b`` over Q: the gradient stochastically rounded, blocks along
  Q; the weight's 16x16 NVFP4 tiles are the forward's codes, contracted
  along Q from one tiled array (``_tiles``: a sharded weight gathered once);
- wgrad ``db = g^T . a^T`` over P (the token dim): both operands after a
  random-sign Hadamard transform of one block along P, the gradient stochastic.

Codes are ``float4_e2m1fn`` ``[B, R, KB, n]`` with float32 scales ``[B, R, KB]``
(the value is code x scale). Each product is a per-block batched float4
``dot_general`` (the form XLA:CPU compiles) with float32 results, scaled per
block and summed in float32.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxamp._casting import F32
from jaxamp._engine import _compat as compat
from jaxamp._engine._contractions import dot_dims
from jaxamp._fp8 import _native, _tiles
from jaxamp._fp8._fp4_facts import Facts, mark, quantize_scope
from jaxamp._fp8._fp4_recipe import Float4Recipe
from jaxamp._fp8._matmul import _t, _to_canonical, _to_dtype
from jaxamp._fp8._ragged import ragged_form
from jaxamp._fp8._scalings import SCALINGS, block_size, scope_name

__all__ = [
    "HADAMARD_SIGNS",
    "Quantized",
    "fp4_operands",
    "hadamard",
    "quantize4",
    "rounding_bits",
    "uses_native",
]

E2M1 = np.dtype(ml_dtypes.float4_e2m1fn)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E2M1_MAX = 6.0
E4M3_MAX = 448.0
F32_MAX = np.float32(np.finfo(np.float32).max)
# MXFP4 scales stay within [2**-126, 2**126]: a scale and its inverse are then
# normal float32 numbers (XLA:CPU flushes float32 subnormals to zero).
_MAX_EXP = 126
# Transformer Engine's fixed signs of its 16-point random Hadamard transform;
# tiled for MXFP4's 32 points.
HADAMARD_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)


def hadamard(x: jax.Array, n: int) -> jax.Array:
    """``diag(s) @ H_n / sqrt(n)`` applied to each block of ``n`` along ``x``'s last dim.

    ``H_n`` is Sylvester's (``[[H, H], [H, -H]]``), applied as the fast
    Walsh-Hadamard butterfly: additions only, no ``dot_general`` (a float32
    matmul would show in ``precision_report`` as one). Then the signs and one
    multiply by ``1/sqrt(n)`` (0.25 for 16 points): the transform of values on
    a coarse grid is exact.
    """
    *lead, c = x.shape
    y = x.astype(F32).reshape(*lead, c // n, 1, n)
    while y.shape[-1] > 1:  # [..., G, L] -> [..., 2G, L/2]: (first + second, first - second)
        half = y.shape[-1] // 2
        first, second = y[..., :half], y[..., half:]
        y = jnp.stack([first + second, first - second], axis=-2)
        y = y.reshape(*y.shape[:-3], -1, half)
    signs = np.resize(np.asarray(HADAMARD_SIGNS, np.float32), n) * np.float32(1 / np.sqrt(n))
    return (y[..., 0] * signs).reshape(x.shape)


def _fmix32(h: jax.Array) -> jax.Array:
    """MurmurHash3's 32-bit finalizer: a bijection mixing every input bit into every output bit."""
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> np.uint32(13))
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> np.uint32(16))


def rounding_bits(y: jax.Array, seed: jax.Array | int) -> jax.Array:
    """Random uint32 bits for stochastic rounding, one per value of ``y``.

    Counter-based and stateless: each value's position is hashed, a digest of
    the whole array's bits (a sum of hashes of value and position) keys it with
    the seed, and the bits are a hash of both. The same seed and ``y`` give
    the same bits; a new step's gradient (any value changed) gives new ones,
    with nothing to thread through the training loop and no host round trip.
    """
    index = _fmix32(jnp.arange(y.size, dtype=jnp.uint32).reshape(y.shape))
    values = jax.lax.bitcast_convert_type(y.astype(F32), jnp.uint32)
    digest = jnp.sum(_fmix32(values ^ index), dtype=jnp.uint32)
    key = _fmix32(digest ^ _fmix32(jnp.asarray(seed, jnp.uint32) + np.uint32(0x9E3779B9)))
    return _fmix32(index ^ key)


def _stochastic_e2m1(y: jax.Array, bits: jax.Array) -> jax.Array:
    """``y`` (within +-6) rounded up to its next E2M1 magnitude with probability
    ``(|y| - lo) / step``, else down: unbiased. All of it exact in float32."""
    a = jnp.abs(y)
    step = jnp.where(a < 2, np.float32(0.5), jnp.where(a < 4, np.float32(1), np.float32(2)))
    lo = jnp.floor(a / step) * step
    u = (bits >> np.uint32(8)).astype(F32) * np.float32(2.0**-24)  # uniform in [0, 1)
    up = u < (a - lo) / step
    return jnp.copysign(jnp.where(up, lo + step, lo), y)


def _encode(y: jax.Array, seed: int | None, facts: Callable[[], Facts]) -> jax.Array:
    """E2M1 codes of ``y`` saturated to +-6: nearest even, or stochastic with ``seed``.

    ``facts``: what ``numerics_report`` measures of the quantization (``_fp4_facts.mark``).
    """
    rounded = jnp.clip(y, -E2M1_MAX, E2M1_MAX)
    if seed is not None:
        rounded = _stochastic_e2m1(rounded, rounding_bits(rounded, seed))
    return mark(rounded, facts).astype(E2M1)


def _nvfp4_scales(tiles: jax.Array, amax: jax.Array | None) -> tuple[jax.Array, ...]:
    """(encode, decode, s_b, S_enc) of NVFP4 tiles ``[B, R/rows, rows, KB, 16]``, per tile.

    ``amax``: the tensor's, for ``S_enc`` (None: ``tiles``'; the ragged products
    pass each expert group's, broadcast as ``[B, 1, 1, 1, 1]``).
    """
    amax = jnp.max(jnp.abs(tiles)) if amax is None else amax
    s_enc = np.float32(E4M3_MAX * E2M1_MAX) / amax
    s_enc = jnp.where((amax == 0) | (s_enc == 0), np.float32(1), jnp.minimum(s_enc, F32_MAX))
    block_amax = jnp.max(jnp.abs(tiles), axis=(2, 4), keepdims=True)
    s_b = jnp.minimum(block_amax * (s_enc / np.float32(E2M1_MAX)), np.float32(E4M3_MAX))
    s_b = s_b.astype(E4M3).astype(F32)
    decode = s_b / s_enc
    return jnp.minimum(1 / decode, F32_MAX), decode, s_b, s_enc


def _mxfp4_scales(tiles: jax.Array, ceil: bool) -> tuple[jax.Array, ...]:
    """(encode, decode, decode, 1): E8M0 scales of MXFP4 blocks ``[B, R, 1, KB, 32]``.

    Exact powers of two; floor: ``2**(floor(log2(amax)) - 2)``; ceil: ``2**ceil(log2(amax / 6))``,
    from the binary exponents (``frexp``), 1 for an all-zero block.
    """
    amax = jnp.max(jnp.abs(tiles), axis=(2, 4), keepdims=True)
    if ceil:
        mantissa, exponent = jnp.frexp(amax / np.float32(E2M1_MAX))
        exp = exponent - (mantissa == 0.5).astype(exponent.dtype)
    else:
        exp = jnp.frexp(amax)[1] - 3  # amax = m * 2**e, m in [0.5, 1): floor(log2) = e - 1
    exp = jnp.where(amax == 0, 0, jnp.clip(exp, -_MAX_EXP, _MAX_EXP))
    one = jnp.ones_like(amax)
    decode = jnp.ldexp(one, exp)
    return jnp.ldexp(one, -exp), decode, decode, jnp.ones((), F32)


class Quantized(NamedTuple):
    """An operand ``[B, R, C]`` in FP4: its values are ``codes * decode``.

    ``block``: the block scales as their format stores them (NVFP4's E4M3
    ``s_b``, MXFP4's E8M0 ``X``), float32 ``[B, R, KB]``; ``tensor``: NVFP4's
    ``S_enc`` (``decode = block / tensor``), 1 for MXFP4. The native GEMM takes
    ``block`` and applies ``tensor`` after.
    """

    codes: jax.Array  # float4_e2m1fn [B, R, KB, n]
    decode: jax.Array  # float32 [B, R, KB]
    block: jax.Array  # float32 [B, R, KB]
    tensor: jax.Array  # float32 []


def quantize4(
    x: jax.Array,
    fmt: str,
    rows: int,
    *,
    ceil: bool = False,
    seed: int | None = None,
    tensor_amax: jax.Array | None = None,
) -> Quantized:
    """``x`` ``[B, R, C]`` (R a multiple of ``rows``, C of the block) in FP4.

    ``rows``: 1, or 16 for NVFP4's 16x16 weight tiles. ``seed``: stochastic
    rounding (None: nearest even). ``tensor_amax``: NVFP4's amax for
    ``S_enc``, broadcastable to ``[B, 1, 1, 1, 1]`` (None: the whole ``x``'s).
    """
    with jax.named_scope(quantize_scope(fmt)):
        b, r, c = x.shape
        n = block_size(fmt)
        tiles = x.astype(F32).reshape(b, r // rows, rows, c // n, n)
        if SCALINGS[fmt].tensor_scale:
            encode, decode, block, tensor = _nvfp4_scales(tiles, tensor_amax)
        else:
            encode, decode, block, tensor = _mxfp4_scales(tiles, ceil)
        # An inf or NaN in a block makes its scale NaN, so the product is NaN too: E2M1
        # has neither, and a saturated code would hide an overflow from loss scaling.
        finite = jnp.isfinite(jnp.max(jnp.abs(tiles), axis=(2, 4), keepdims=True))

        def per_row(scale):
            scale = jnp.where(finite, scale, np.float32(np.nan))
            return jnp.broadcast_to(scale[..., 0], (b, r // rows, rows, c // n)).reshape(b, r, -1)

        # Reshaped before the cast: numerics_report sees one float4 result per operand.
        y = (tiles * encode).reshape(b, r, c // n, n)

        def facts() -> Facts:
            def each(v):
                return jnp.broadcast_to(v, tiles.shape).reshape(y.shape)

            nan = np.float32(np.nan)
            return Facts(each(tiles), y, each(jnp.where(finite, block, nan)), each(tensor))

        codes = _encode(y, seed, facts)
        return Quantized(codes, per_row(decode), per_row(block), jnp.asarray(tensor, F32))


def _transposed_tiles(quantized: Quantized, n: int) -> Quantized:
    """The codes of ``[B, Q, C]`` in ``n x n`` tiles as those of ``[B, C, Q]``: the same tiles."""
    codes = quantized.codes
    b, q, kb, _ = codes.shape
    codes = jnp.swapaxes(codes.reshape(b, q, kb * n), 1, 2).reshape(b, kb * n, q // n, n)

    def per_row(scale):  # [B, Q, KB] (rows of a tile alike) -> [B, C, Q/n]
        return jnp.repeat(jnp.swapaxes(scale[:, ::n], 1, 2), n, axis=1)

    return Quantized(codes, per_row(quantized.decode), per_row(quantized.block), quantized.tensor)


def uses_native(recipe: Float4Recipe) -> bool:
    """Whether ``recipe``'s products run as ``jax.nn.scaled_matmul`` (decided when traced).

    ``"auto"``: on NVIDIA GPUs of compute capability 10.0 or newer (Blackwell's
    block-scaled FP4 Tensor Cores), as for MXFP8 (``_native``).
    """
    if recipe.gemm == "emulated":
        return False
    backend, capability = _native.platform()
    if recipe.gemm == "auto":
        return backend == "gpu" and capability >= _native.NATIVE_MIN_CAPABILITY
    if not _native.native_lowers(backend):
        raise ValueError(
            f"Float4Recipe(gemm='native'): jax {jax.__version__} has no lowering of "
            f"jax.nn.scaled_matmul for the {backend} backend (GPUs have one; CPUs from "
            "jax 0.12). Use gemm='auto' (native where it runs) or gemm='emulated'."
        )
    return True


def _native_product(a: Quantized, b: Quantized, out_dtype: np.dtype, fmt: str) -> jax.Array:
    """The product in one ``jax.nn.scaled_matmul``: E2M1 operands, E4M3/E8M0 block scales.

    The block scales are values of their format (exact casts); NVFP4's tensor
    scales divide the float32 result.
    """
    scale_dtype = np.dtype(getattr(ml_dtypes, SCALINGS[fmt].scale_format))
    with jax.named_scope(quantize_scope(fmt)):  # steps of the quantizations: not measured
        operands = [q.codes.reshape(*q.codes.shape[:2], -1) for q in (a, b)]
        scales = [q.block.astype(scale_dtype) for q in (a, b)]
    out = jax.nn.scaled_matmul(*operands, *scales, preferred_element_type=F32)
    out = compat.vary_like(out, a.codes, b.codes)
    return (out / (a.tensor * b.tensor)).astype(out_dtype)


def _product(a: Quantized, b: Quantized, out_dtype: np.dtype, native: str | None) -> jax.Array:
    """``[B, P, C] x [B, Q, C] -> [B, P, Q]``: float4 products per block, scaled, summed.

    ``native``: the format, for ``jax.nn.scaled_matmul`` (None: emulated).
    """
    if native is not None:
        return _native_product(a, b, out_dtype, native)
    partial = jax.lax.dot_general(
        a.codes, b.codes, (((3,), (3,)), ((0, 2), (0, 2))), preferred_element_type=F32
    )  # [B, KB, P, Q], exact: 16 or 32 products of E2M1 values
    a_scale = jnp.transpose(a.decode, (0, 2, 1))[..., None]
    b_scale = jnp.transpose(b.decode, (0, 2, 1))[:, :, None, :]
    return jnp.sum(partial * a_scale * b_scale, axis=1).astype(out_dtype)


def _canonical_matmul(recipe: Float4Recipe, weight_tiles: bool, dtypes: tuple):
    """``[B, P, C] x [B, Q, C] -> [B, P, Q]`` in FP4 with FP4 backward products (padded dims)."""
    fmt, n, out_dtype = recipe.format, recipe.block, recipe.compute_dtype
    ceil = recipe.scale_rounding == "ceil"
    sr = recipe.seed if recipe.stochastic_rounding else None
    scope = scope_name(fmt, False)
    native = fmt if uses_native(recipe) else None
    # Emulated, both products contract one tiled array of the weight's codes
    # (FP8 blockwise's _tiles), so that an FSDP-sharded weight is gathered once.
    one_array = weight_tiles and native is None

    def forward(a, b):
        with jax.named_scope(scope):
            qa = quantize4(a, fmt, 1, ceil=ceil)
            qb = quantize4(b, fmt, n if weight_tiles else 1, ceil=ceil)
            if one_array:
                with jax.named_scope(quantize_scope(fmt)):
                    w = _tiles.tiled((qb.codes, qb.decode), n)
                out = _tiles.product((qa.codes, qa.decode), w, b.shape[1], out_dtype)
                return out, (a, w)
            return _product(qa, qb, out_dtype, native), (a, qb if weight_tiles else b)

    @jax.custom_vjp
    def matmul(a, b):
        return forward(a, b)[0]

    def bwd(saved, g):
        a, b = saved
        g = g.astype(F32)
        with jax.named_scope(scope):
            # dgrad da[B, P, C] = g[B, P, Q] . b over Q.
            qg = quantize4(g, fmt, 1, ceil=ceil, seed=sr)
            if one_array:
                da = _tiles.input_gradient((qg.codes, qg.decode), b, a.shape[2], F32)
            elif weight_tiles:  # the forward's codes, moved: a step of that quantization
                with jax.named_scope(quantize_scope(fmt)):
                    qb_t = _transposed_tiles(b, n)
                da = _product(qg, qb_t, F32, native)
            else:
                da = _product(qg, quantize4(_t(b), fmt, 1, ceil=ceil), F32, native)
            # wgrad db[B, Q, C] = g^T[B, Q, P] . a^T[B, C, P] over P, the token dim.
            g_t, a_t = _t(g), _t(a)
            if recipe.hadamard:
                g_t, a_t = hadamard(g_t, n), hadamard(a_t, n)
            qg_t = quantize4(g_t, fmt, 1, ceil=ceil, seed=sr)
            db = _product(qg_t, quantize4(a_t, fmt, 1, ceil=ceil), F32, native)
        return da.astype(dtypes[0]), db.astype(dtypes[1])

    matmul.defvjp(forward, bwd)
    return matmul


def _pad(x: jax.Array, multiple: int) -> jax.Array:
    """``[B, R, C]`` zero-padded to whole blocks along R and C."""
    widths = [(0, 0), (0, -x.shape[1] % multiple), (0, -x.shape[2] % multiple)]
    return jnp.pad(x, widths) if any(w for _, w in widths) else x


def _fp4_dot(recipe: Float4Recipe, params: dict, x, w, weight: bool):
    lb, lf, lc, rb, rf, rc = dot_dims(params["dimension_numbers"], x.ndim, w.ndim)
    out_shape = (
        *(x.shape[d] for d in lb),
        *(x.shape[d] for d in lf),
        *(w.shape[d] for d in rf),
    )
    a, b = _to_canonical(x, lb, lf, lc), _to_canonical(w, rb, rf, rc)
    p, q = a.shape[1], b.shape[1]
    tiles = weight and SCALINGS[recipe.format].groups["weight"].rows != 1
    matmul = _canonical_matmul(recipe, tiles and recipe.weight_blocks_2d, (a.dtype, b.dtype))
    out = matmul(_pad(a, recipe.block), _pad(b, recipe.block))[:, :p, :q]
    return out.reshape(out_shape)


def fp4_operands(
    recipe: Float4Recipe,
    eqn: jex.JaxprEqn,
    x,
    w,
    plain: tuple[bool, bool],
    ragged: Callable | None = None,
):
    """autocast's hook under a Float4Recipe: ``(x, w, matmul)``, or None to run it as usual.

    FP4 takes ``dot_general`` (convolutions stay in the compute dtype, as in
    the NVFP4 paper: GEMMs only) and, given ``ragged`` (``_fp4_ragged``'s
    product), ``ragged_dot_general`` in its mixture-of-experts form; of those
    the ones with a parameter, input or constant operand (``plain``) unless
    ``quantize_activation_products``. A plain right operand is a weight
    (NVFP4's 16x16 tiles).
    """
    name = eqn.primitive.name
    if name == "ragged_dot_general":
        lhs, rhs = (v.aval.ndim for v in eqn.invars[:2])  # pyright: ignore[reportAttributeAccessIssue]
        if ragged is None or ragged_form(eqn.params, lhs, rhs) is None:
            return None
    elif name != "dot_general":
        return None
    if not any(plain) and not recipe.quantize_activation_products:
        return None
    x, w = (
        v if p else _to_dtype(v, recipe.compute_dtype) for v, p in zip((x, w), plain, strict=True)
    )

    def matmul(eqn: jex.JaxprEqn, x, w, *extra, dtype: np.dtype):
        del dtype  # the recipe gives the dtype
        if ragged is not None and eqn.primitive.name == "ragged_dot_general":
            return ragged(recipe, eqn.params, x, w, *extra, weight=plain[1])  # extra: the sizes
        return _fp4_dot(recipe, eqn.params, x, w, plain[1])

    return x, w, matmul
