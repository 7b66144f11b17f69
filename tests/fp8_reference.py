"""An independent NumPy/ml_dtypes reference of the FP8 recipes, written from their formulas.

Each operand is a 2-D matrix ``[rows, contract]``; a recipe groups its values in
tiles of ``(tile_rows, tile_cols)`` (``None``: the whole extent). Per tile:
``s = fp8_max / amax`` (1 where amax is 0; rounded down to a power of two
when asked, as ``2**floor(log2(fp8_max / amax))``), ``q = fp8(clip(x * s))``,
and the value the product sees is ``q / s``. Nothing here imports jaxamp.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E5M2 = np.dtype(ml_dtypes.float8_e5m2)

# (tile_rows, tile_cols) per recipe and operand kind, along the contracting dim.
TILES = {
    "tensorwise": {"act": (None, None), "weight": (None, None), "grad": (None, None)},
    "rowwise": {"act": (1, None), "weight": (1, None), "grad": (1, None)},
    "blockwise": {"act": (1, 128), "weight": (128, 128), "grad": (1, 128)},
    "mxfp8": {"act": (1, 32), "weight": (32, 32), "grad": (1, 32)},
}


def scale(amax: float, dtype: np.dtype, power_of_two: bool) -> float:
    top = float(ml_dtypes.finfo(dtype).max)
    if not np.isfinite(amax):
        return np.nan
    if amax == 0:
        return 1.0
    if power_of_two:
        return float(2.0 ** np.clip(np.floor(np.log2(top / amax)), -126, 126))
    return float(np.clip(np.float32(top) / np.float32(amax), 2.0**-126, 2.0**126))


def dequantized(x, dtype, tile, power_of_two) -> np.ndarray:
    """``q / s`` for every value of the 2-D ``x`` (float64), tile by tile."""
    x = np.asarray(x, np.float32)
    rows, cols = x.shape
    tr, tc = tile[0] or rows, tile[1] or cols
    top = np.float32(ml_dtypes.finfo(dtype).max)
    out = np.zeros(x.shape, np.float64)
    for r in range(0, rows, tr):
        for c in range(0, cols, tc):
            block = x[r : r + tr, c : c + tc]
            s = np.float32(scale(float(np.max(np.abs(block))), dtype, power_of_two))
            q = np.clip(block * s, -top, top).astype(dtype)
            out[r : r + tr, c : c + tc] = q.astype(np.float64) / np.float64(s)
    return out


def tensorwise_dequantized(x, dtype, power_of_two) -> np.ndarray:
    flat = np.asarray(x, np.float32).reshape(1, -1)
    return dequantized(flat, dtype, (None, None), power_of_two).reshape(np.shape(x))


def product(a, a_kind, a_dtype, b, b_kind, b_dtype, scaling, power_of_two=False):
    """``a [P, C] @ b [C, Q]`` of the two quantized operands, in float64."""
    pow2 = power_of_two or scaling == "mxfp8"
    qa = dequantized(a, a_dtype, TILES[scaling][a_kind], pow2)
    qb = dequantized(np.asarray(b).T, b_dtype, TILES[scaling][b_kind], pow2).T
    return qa @ qb


def forward(x, w, scaling, power_of_two=False, rhs_kind="weight"):
    return product(x, "act", E4M3, w, rhs_kind, E4M3, scaling, power_of_two)


def codes(x, dtype, tile, power_of_two):
    """(float8 codes as float64, float32 inverse scale per value) of the 2-D ``x``, per tile."""
    x = np.asarray(x, np.float32)
    rows, cols = x.shape
    tr, tc = tile[0] or rows, tile[1] or cols
    top = np.float32(ml_dtypes.finfo(dtype).max)
    q, inverse = np.zeros(x.shape, np.float64), np.zeros(x.shape, np.float32)
    for r in range(0, rows, tr):
        for c in range(0, cols, tc):
            block = x[r : r + tr, c : c + tc]
            s = np.float32(scale(float(np.max(np.abs(block))), dtype, power_of_two))
            q[r : r + tr, c : c + tc] = np.clip(block * s, -top, top).astype(dtype)
            inverse[r : r + tr, c : c + tc] = np.float32(1) / s
    return q, inverse


def weight_input_gradient(g, w, scaling, power_of_two=False):
    """``g [P, Q] @ w [C, Q].T``: the input-gradient product of a weight, from its forward codes.

    The weight is quantized once, in the forward groups of ``w.T`` (``[Q, C]``,
    along C). Whole-row groups (rowwise) fold its inverse scales into ``g``
    before ``g`` is quantized, and the codes are contracted unscaled; blocks are
    requantized along Q from the forward's float32 values ``code * inverse``.
    """
    pow2 = power_of_two or scaling == "mxfp8"
    tile, grad_tile = TILES[scaling]["weight"], TILES[scaling]["grad"]
    q, inverse = codes(np.asarray(w, np.float32).T, E4M3, tile, pow2)  # [Q, C]
    g = np.asarray(g, np.float32)
    if tile[1] is None:
        folded = g * inverse[:, 0][None, :]  # float32, as the product computes it
        return dequantized(folded, E5M2, grad_tile, pow2) @ q
    values = (q.astype(np.float32) * inverse).T  # [C, Q]
    requantized = dequantized(values, E4M3, tile, pow2)
    return dequantized(g, E5M2, grad_tile, pow2) @ requantized.T


def gradients(x, w, g, scaling, power_of_two=False, rhs_kind="weight"):
    """(dx, dw) of ``x @ w`` for the output gradient ``g``, both products in FP8.

    A weight (``rhs_kind="weight"``) reaches the input-gradient product from its
    forward codes (:func:`weight_input_gradient`); an activation is quantized
    again along the new contracting dim. Tensorwise groups do not depend on the
    layout: the forward's values serve both products.
    """
    if rhs_kind == "weight" and TILES[scaling]["weight"] != (None, None):
        dx = weight_input_gradient(g, w, scaling, power_of_two)
    else:
        dx = product(g, "grad", E5M2, np.asarray(w).T, rhs_kind, E4M3, scaling, power_of_two)
    dw = product(np.asarray(g).T, "grad", E5M2, x, "act", E4M3, scaling, power_of_two).T
    return dx, dw
