"""numerics_report on FP4 recipes: each quantization is one op with its amax, scales,
flushed and clamped fractions, checked against loops over the blocks in NumPy
(tests/fp4_reference.py).

The data plant each block's amax (a power of two times a factor in [1, 2),
some with more bits than E4M3 holds, so NVFP4 clamps too), with in every
block a zero (never flushed) and a value 1% of the block's amax (flushed: it
scales below E2M1's 0.25), an all-zero block (left out of the block scales),
a block 2**-30 of its planted amax (NVFP4's E4M3 block scale of it is 0: the
whole block is flushed) and a tensor amax of 10.5, whose NVFP4 tensor scale
256 is a power of two: XLA may arrange the divisions of the scales
differently from NumPy (a value one ulp off a rounding boundary of E2M1),
which an exact power of two makes moot. Dense (emulated and, where this jax
lowers it, native) and ragged products, forward and gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxamp
from jaxamp._fp8 import _native
from tests import fp4_reference as ref

M, K, N = 32, 64, 64  # tokens, contracting, outputs: whole blocks of 16 and 32
FORMATS = ("nvfp4", "mxfp4")
FIELDS = ("amax", "tensor_scale", "block_scale_min", "block_scale_max")


def planted(seed: int, shape: tuple[int, int], block: int = 16) -> np.ndarray:
    """``shape`` float32 values, bfloat16-exact, with a planted amax per 1 x ``block``."""
    rng = np.random.default_rng(seed)
    rows, cols = shape
    base = rng.integers(-15, 16, size=shape).astype(np.float32)
    base[:, ::block] = 16.0  # the block's amax: 16 times its planted scale
    base[:, 1::block] = 0.0  # a zero: not flushed
    base[:, 2::block] = 0.15625  # 1% of the amax: flushed in both formats
    power = rng.integers(-6, 3, size=(rows, cols // block)).astype(np.float32)
    # 1.0625 and 1.8125 have more bits than E4M3's mantissa: NVFP4's block scale rounds
    # down and the block's amax is clamped.
    factor = rng.choice([1.0, 1.0625, 1.25, 1.5, 1.8125], power.shape)
    scale = np.repeat(np.exp2(power) * factor, block, 1)
    x = (base * scale.astype(np.float32) / 16).astype(np.float32)
    x[0, :block] = 0.0  # an all-zero block
    x[1, :block] *= np.float32(2.0**-30)  # NVFP4's block scale underflows E4M3
    # The tensor's amax (the rest is below 2**2 * 1.8125): NVFP4's S_enc = 2688 / 10.5
    # is 256, so its decode scales are exact, however XLA arranges the divisions.
    x[2, 0] = 10.5
    return x.astype(ml_dtypes.bfloat16).astype(np.float32)


def _recipe(fmt: str, **kwargs) -> jaxamp.Float4Recipe:
    return jaxamp.Float4Recipe(fmt, hadamard=False, stochastic_rounding=False, **kwargs)


def _summary(op: jaxamp.OpStats) -> tuple:
    flushed, clamped = op.underflow_fraction, op.saturated_fraction
    return (op.shape[1], *(getattr(op, f) for f in FIELDS), flushed, clamped)


def _expected(v: np.ndarray, fmt: str, rows: int = 1) -> tuple:
    s = ref.statistics(v, fmt, rows)
    return (v.shape[0], *(s[f] for f in FIELDS), s["flushed"], s["clamped"])


def _fp4_ops(report: jaxamp.NumericsReport) -> list[jaxamp.OpStats]:
    """Every op with a float8 or float4 value: the quantizations, and nothing else."""
    small = [op for op in report.ops if jnp.finfo(op.dtype).bits <= 8]
    assert all(op.quantization is not None for op in small), small
    assert all(op.dtype == np.dtype(ml_dtypes.float4_e2m1fn) for op in small), small
    assert report.fp4_quantizations == small
    return small


def _inputs():
    x, w = planted(0, (M, K)), planted(1, (N, K)).T  # w [K, N]: blocks along K
    t = planted(2, (M, N))  # the output gradient of sum(out * t)
    return {"w": jnp.asarray(w)}, jnp.asarray(x), jnp.asarray(t)


def _loss(p, x, t):
    return jnp.sum((x @ p["w"]) * t)


@pytest.mark.parametrize("fmt", FORMATS)
def test_forward_quantization_is_one_op_with_the_reference_statistics(fmt):
    params, x, t = _inputs()
    report = jaxamp.numerics_report(_loss, params, x, t, policy=_recipe(fmt))
    ops = _fp4_ops(report)
    assert {op.quantization for op in ops} == {fmt}
    tiles = 16 if fmt == "nvfp4" else 1  # NVFP4's weights in 16x16 tiles
    want = [_expected(np.asarray(x), fmt), _expected(np.asarray(params["w"]).T, fmt, tiles)]
    assert sorted(map(_summary, ops)) == sorted(want)
    x_op = next(op for op in ops if op.shape[1] == M)
    assert x_op.amax == float(np.max(np.abs(np.asarray(x))))
    # The planted data flush and clamp values: the fractions are not trivially 0.
    assert x_op.underflow_fraction > 0 and x_op.saturated_fraction > 0
    assert x_op.lost_fraction == x_op.underflow_fraction
    if fmt == "nvfp4":  # the 2**-30 block's E4M3 scale is 0: the whole block flushed
        assert x_op.block_scale_min == 0.0 and x_op.underflow_fraction >= 16 / x_op.shape[1] / K
    else:
        assert x_op.tensor_scale == 1.0
        assert np.log2(x_op.block_scale_min) == np.round(np.log2(x_op.block_scale_min))


@pytest.mark.parametrize("fmt", FORMATS)
def test_gradient_quantizations_are_one_op_each(fmt):
    params, x, t = _inputs()
    report = jaxamp.numerics_report(
        _loss, params, x, t, policy=_recipe(fmt), grad=True, loss_scale=1.0
    )
    ops = _fp4_ops(report)
    w = np.asarray(params["w"])
    x, t = np.asarray(x), np.asarray(t)
    # forward: x, w^T; dgrad: the output gradient t (blocks along N) and, without
    # NVFP4's tiles, w (blocks along N; the gradient of x is dead code, and its
    # quantization of w, from no cotangent, is labelled forward); wgrad: t^T and
    # x^T, blocks along the tokens.
    cotangents = [_expected(t, fmt), _expected(t.T, fmt)]
    rest = [_expected(x, fmt), _expected(w.T, fmt, 16 if fmt == "nvfp4" else 1)]
    rest.append(_expected(x.T, fmt))
    if fmt == "mxfp4":
        rest.append(_expected(w, fmt))
    assert len(ops) == len(cotangents) + len(rest)
    assert sorted(_summary(op) for op in ops if op.scaled) == sorted(cotangents)
    assert sorted(_summary(op) for op in ops if not op.scaled) == sorted(rest)
    assert {op.phase for op in ops if op.scaled} == {"backward"}
    # A quantization scales by its own amax, not the loss scale: nothing to suggest.
    assert report.suggested_loss_scale is None


def test_the_report_table_lists_each_fp4_quantization():
    params, x, t = _inputs()
    report = jaxamp.numerics_report(_loss, params, x, t, policy="mixed_nvfp4")
    text = str(report)
    assert "FP4 quantizations:" in text
    rows = text.split("FP4 quantizations:")[1].splitlines()[2:4]
    assert len(rows) == 2 and all(" nvfp4 " in row for row in rows)
    x_op = next(op for op in report.fp4_quantizations if op.shape[1] == M)
    assert f"{x_op.amax:.3g}" in text and f"{x_op.saturated_fraction:.1%}" in text


@pytest.mark.parametrize(("fmt", "quantizations"), [("nvfp4", 5), ("mxfp4", 6)])
def test_ragged_quantizations_are_one_op_each(fmt, quantizations):
    # Mixture of experts: the rows and each expert's weights quantized once each (the
    # ragged product's views of the codes are steps), S_enc per expert group.
    x = planted(3, (M, K))
    w = np.stack([planted(4, (N, K)).T, planted(5, (N, K)).T / 4])  # [G, K, N]
    sizes = jnp.array([M // 2, M // 2], jnp.int32)

    def loss(p, x):
        return jnp.sum(jax.lax.ragged_dot(x, p["w"], sizes) ** 2)

    report = jaxamp.numerics_report(
        loss, {"w": jnp.asarray(w)}, jnp.asarray(x), policy=_recipe(fmt), grad=True
    )
    ops = _fp4_ops(report)
    assert len(ops) == quantizations and {op.quantization for op in ops} == {fmt}
    rows = next(op for op in ops if op.phase == "forward" and op.shape[0] == M)
    assert rows.amax == float(np.max(np.abs(x)))
    # The smallest S_enc over the groups is that of the largest group amax: x's.
    want = np.float32(2688) / np.float32(np.max(np.abs(x))) if fmt == "nvfp4" else 1.0
    assert rows.tensor_scale == float(want)
    halves = [ref.statistics(x[: M // 2], fmt), ref.statistics(x[M // 2 :], fmt)]
    assert rows.underflow_fraction == (halves[0]["flushed"] + halves[1]["flushed"]) / 2
    assert rows.saturated_fraction == (halves[0]["clamped"] + halves[1]["clamped"]) / 2


@pytest.mark.skipif(
    not _native.native_lowers(jax.default_backend()),
    reason="this jax has no lowering of jax.nn.scaled_matmul for this backend",
)
@pytest.mark.parametrize("fmt", FORMATS)
def test_native_gemm_quantizations_are_the_emulated_ones(fmt):
    # jax.nn.scaled_matmul takes the codes and the block scales cast to E4M3/E8M0:
    # those casts and moves are steps, and the statistics are the emulated form's.
    params, x, t = _inputs()
    reports = [
        jaxamp.numerics_report(_loss, params, x, t, policy=_recipe(fmt, gemm=g), grad=True)
        for g in ("native", "emulated")
    ]
    native, emulated = (sorted(map(_summary, _fp4_ops(r))) for r in reports)
    assert native == emulated and len(native) == (5 if fmt == "nvfp4" else 6)
