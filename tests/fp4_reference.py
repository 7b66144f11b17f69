"""An independent NumPy/ml_dtypes reference of the FP4 recipes, written from their formulas.

Operands are 2-D matrices ``[rows, contract]``, quantized block by block in
explicit loops, zero-padded to whole blocks. NVFP4: ``S_enc = 448 * 6 / amax``
per tensor, ``s_b = e4m3(min(block_amax * (S_enc / 6), 448))`` per 16 values
(16x16 tiles for 2-D weights), ``q = e2m1(clip(x * min(1 / (s_b / S_enc),
f32_max), -6, 6))`` and the value ``q * s_b / S_enc``. MXFP4: per 32 values
``X = 2**(floor(log2(amax)) - 2)`` (or ``2**ceil(log2(amax / 6))``),
``q = e2m1(clip(x / X, -6, 6))``, the value ``q * X``. Round to nearest even
only (the stochastic rounding is tested for its statistics). The ``block``,
``scale`` and ``hadamard`` arguments make the wrong variants the tests must
tell apart. Nothing here imports jaxamp.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

F32 = np.float32
E2M1 = np.dtype(ml_dtypes.float4_e2m1fn)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
F32_MAX = F32(np.finfo(np.float32).max)
SIGNS = [1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1]
BLOCKS = {"nvfp4": 16, "mxfp4": 32}


def _padded(x, rows, cols):
    x = np.asarray(x, F32)
    out = np.zeros((-(-x.shape[0] // rows) * rows, -(-x.shape[1] // cols) * cols), F32)
    out[: x.shape[0], : x.shape[1]] = x
    return out


def _nvfp4_block(block, s_enc, scale):
    bamax = F32(np.max(np.abs(block)))
    s_b = np.minimum(bamax * F32(s_enc / F32(6)), F32(448))
    if scale == "e4m3":
        s_b = F32(s_b.astype(E4M3).astype(F32))
    decode = F32(s_b / s_enc)
    encode = F32_MAX if decode == 0 else min(F32(F32(1) / decode), F32_MAX)
    q = np.clip(block * F32(encode), -6, 6).astype(E2M1)
    return q.astype(np.float64) * np.float64(decode)


def _mx_scale(amax, ceil):
    if amax == 0:
        return 1.0
    exp = math.ceil(math.log2(F32(amax) / F32(6))) if ceil else math.floor(math.log2(amax)) - 2
    return 2.0 ** min(max(exp, -126), 126)


def dequantized(x, fmt, rows=1, *, block=None, scale=None, ceil=False):
    """The values the product sees for ``x [R, C]``, blocks of ``rows x block`` along C."""
    block = block or BLOCKS[fmt]
    shape = np.shape(x)
    x = _padded(x, rows, block)
    out = np.zeros(x.shape, np.float64)
    amax = F32(np.max(np.abs(x)))
    s_enc = F32(1) if amax == 0 else min(F32(F32(2688) / amax), F32_MAX)
    s_enc = F32(1) if s_enc == 0 else s_enc
    for r in range(0, x.shape[0], rows):
        for c in range(0, x.shape[1], block):
            blk = x[r : r + rows, c : c + block]
            if fmt == "nvfp4":
                out[r : r + rows, c : c + block] = _nvfp4_block(blk, s_enc, scale or "e4m3")
            else:
                s = _mx_scale(float(np.max(np.abs(blk))), ceil)
                if scale == "float32":  # the wrong variant: a scale that is no power of two
                    s = float(np.max(np.abs(blk))) / 6 or 1.0
                q = np.clip(blk / F32(s), -6, 6).astype(E2M1)
                out[r : r + rows, c : c + block] = q.astype(np.float64) * s
    return out[: shape[0], : shape[1]]


def hadamard(x, n):
    """``diag(s) @ H_n / sqrt(n)`` on each block of ``n`` along the last dim of ``x [R, C]``."""
    h = np.array([[1.0]], F32)
    while len(h) < n:
        h = np.block([[h, h], [h, -h]]).astype(F32)
    signed = (np.array([SIGNS[i % 16] for i in range(n)], F32)[:, None] * h).astype(F32)
    x = _padded(x, 1, n)
    out = np.zeros_like(x)
    for c in range(0, x.shape[1], n):
        out[:, c : c + n] = (x[:, c : c + n] @ signed.T) * F32(1 / np.sqrt(n))
    return out


def forward(x, w, fmt, *, weight_2d=True, ceil=False, **variant):
    """``x [M, K] @ w [K, N]`` on the quantized operands, in float64."""
    rows = 16 if fmt == "nvfp4" and weight_2d else 1
    qx = dequantized(x, fmt, ceil=ceil, **variant)
    qw = dequantized(np.asarray(w).T, fmt, rows, ceil=ceil, **variant)
    return qx @ qw.T


def gradients(x, w, g, fmt, *, hadamard_on=True, weight_2d=True, ceil=False, placement="wgrad"):
    """(dx, dw) of ``x @ w`` for the output gradient ``g``, nearest rounding throughout.

    ``placement="dgrad"``: the wrong variant, the Hadamard transform on the
    input-gradient product instead of the weight-gradient one.
    """
    x, w, g = (np.asarray(v, F32) for v in (x, w, g))
    n = BLOCKS[fmt]
    m, k = x.shape
    if fmt == "nvfp4" and weight_2d:  # the forward's 16x16 tiles: the same values
        w_t = dequantized(w.T, fmt, 16)  # [N, K]
    else:
        w_t = dequantized(w, fmt, ceil=ceil).T  # blocks along N
    g_q = dequantized(g, fmt, ceil=ceil)
    if hadamard_on and placement == "dgrad":
        g_q = dequantized(hadamard(g, n), fmt, ceil=ceil)
        w_t = dequantized(hadamard(w, n), fmt, ceil=ceil).T
    dx = g_q[:, : w_t.shape[0]] @ w_t
    g_t, x_t = g.T, x.T  # [N, M], [K, M]: blocks along the token dim M
    if hadamard_on and placement == "wgrad":
        g_t, x_t = hadamard(g_t, n), hadamard(x_t, n)
    dw = dequantized(x_t, fmt, ceil=ceil) @ dequantized(g_t, fmt, ceil=ceil).T
    return dx[:m, :k], dw[:k]


def _block_scales(blk, fmt, s_enc, ceil):
    """(stored block scale, encode) of one block: NVFP4's E4M3 ``s_b``, MXFP4's ``X``."""
    bamax = F32(np.max(np.abs(blk)))
    if fmt == "nvfp4":
        s_b = F32(np.minimum(bamax * F32(s_enc / F32(6)), F32(448)).astype(E4M3).astype(F32))
        decode = F32(s_b / s_enc)
        return s_b, F32_MAX if decode == 0 else min(F32(F32(1) / decode), F32_MAX)
    s = _mx_scale(float(bamax), ceil)
    return F32(s), F32(1 / s)


def statistics(x, fmt, rows=1, *, ceil=False):
    """What numerics_report says of quantizing ``x [R, C]`` (blocks along C), by loops.

    A dict: ``amax`` (of ``x``), ``tensor_scale`` (NVFP4's ``S_enc``, 1 under
    MXFP4), ``block_scale_min``/``block_scale_max`` (the stored block scales of
    the blocks holding a nonzero value), ``flushed`` (the fraction of nonzero
    values that dequantize to 0: the zero code or a zero block scale) and
    ``clamped`` (the fraction whose scaled value is beyond 6 in a block with a
    nonzero scale), over the zero-padded ``x``.
    """
    n = BLOCKS[fmt]
    x = _padded(x, rows, n)
    amax = F32(np.max(np.abs(x)))
    s_enc = F32(1)
    if fmt == "nvfp4" and amax != 0:
        s_enc = min(F32(F32(2688) / amax), F32_MAX)
    scales, flushed, clamped = [], 0, 0
    for r in range(0, x.shape[0], rows):
        for c in range(0, x.shape[1], n):
            blk = x[r : r + rows, c : c + n]
            s_b, encode = _block_scales(blk, fmt, s_enc, ceil)
            y = blk * F32(encode)
            codes = np.clip(y, -6, 6).astype(E2M1).astype(F32)
            nonzero = blk != 0
            if nonzero.any():
                scales.append(float(s_b))
            flushed += int(np.sum(nonzero & ((codes == 0) | (s_b == 0))))
            clamped += int(np.sum((np.abs(y) > 6) & (s_b != 0)))
    return {
        "amax": float(amax),
        "tensor_scale": float(s_enc),
        "block_scale_min": min(scales),
        "block_scale_max": max(scales),
        "flushed": flushed / x.size,
        "clamped": clamped / x.size,
    }
