"""FP4 ``ragged_dot`` (mixture of experts): the dense FP4 recipe applied expert by expert.

The oracle of every product is the dense FP4 product of each group's rows with
its expert's weights (``autocast(x @ w, recipe)`` per group), compiled in the
same program as the ragged product; the forward also against the independent
NumPy reference of tests/fp4_reference.py per group. Stochastic rounding off,
the backward is deterministic and checked bit for bit up to float32 summation
order; with it on, the bits hash the whole ragged gradient (not each expert's),
so it is checked for reproducibility and accuracy. Group sizes are traced: one
compile serves every split of the rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp
from tests import fp4_reference as ref
from tests.unit.test_fp8_ragged import _FAST, _groups, _pullback, _ragged, _ragged_and_dense

F4 = "float4_e2m1fn"
# Empty groups in the middle and at the end; group 0's 20 rows are no whole
# number of blocks (its weight-gradient tiles along the tokens are padded), and
# 7 rows lie past the last group. K = 40 is no multiple of 16 or 32.
SIZES = np.array([20, 0, 13, 0], np.int32)
M, K, N = 40, 40, 24
CONFIGS = {
    "nvfp4": {},
    "nvfp4-no-hadamard-1d": {"hadamard": False, "weight_blocks_2d": False},
    "mxfp4-ceil": {"format": "mxfp4", "scale_rounding": "ceil"},
}


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(M, K)).astype(np.float32)
    x[3] *= 50  # an outlier row in group 0: a tensor scale shared across groups shows
    w = (rng.normal(size=(len(SIZES), K, N)) * 0.05).astype(np.float32)
    w[2] *= 30  # an expert with another scale
    g = rng.normal(size=(M, N)).astype(np.float32)
    g[25] *= 40
    return x, w, g


def assert_same_rounding(got, want):
    """Equal but for a float32 sum rounded the other way to bfloat16 (one ulp, or a
    cancellation to a float32 rounding of the result's scale)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert (got != want).mean() < 0.02, (got != want).mean()
    np.testing.assert_allclose(got, want, rtol=2**-7, atol=1e-6 * np.abs(want).max())


@pytest.mark.parametrize("name", list(CONFIGS))
def test_forward_and_gradients_are_the_dense_recipe_expert_by_expert(name):
    kwargs = CONFIGS[name]
    recipe = jaxamp.Float4Recipe(stochastic_rounding=False, **kwargs)
    x, w, g = _data()
    ragged, dense = _ragged_and_dense(recipe, SIZES)(x, w, g, SIZES)
    out, dx, dw = (np.asarray(v, np.float32) for v in ragged)
    dense = iter(dense)
    for e, start, end in _groups(SIZES):
        rows = slice(start, end)
        if start == end:  # an empty expert: no rows, a zero weight gradient
            np.testing.assert_array_equal(dw[e], 0)
            continue
        want_out, want_dx, want_dw = (np.asarray(v, np.float32) for v in next(dense))
        assert_same_rounding(out[rows], want_out)
        for got, want in ((dx[rows], want_dx), (dw[e], want_dw)):
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * np.abs(want).max())
        fmt = kwargs.get("format", "nvfp4")
        ceil = kwargs.get("scale_rounding") == "ceil"
        rows_2d = 16 if fmt == "nvfp4" and kwargs.get("weight_blocks_2d", True) else 1
        a = ref.dequantized(x[rows], fmt, ceil=ceil)
        b = ref.dequantized(w[e].T, fmt, rows_2d, ceil=ceil)
        want = (a @ b.T).astype(np.float32)
        np.testing.assert_allclose(out[rows], want, rtol=2**-7, atol=1e-6 * np.abs(want).max())
    np.testing.assert_array_equal(out[SIZES.sum() :], 0)
    np.testing.assert_array_equal(dx[SIZES.sum() :], 0)


def _reference_forward(x, w, sizes):
    return [
        (a, b, ref.dequantized(x[a:b], "nvfp4") @ ref.dequantized(w[e].T, "nvfp4", 16).T)
        for e, a, b in _groups(sizes)
        if a < b
    ]


def test_scales_are_per_expert_group_and_one_compile_serves_every_split():
    recipe = jaxamp.Float4Recipe(stochastic_rounding=False)
    x, w, _ = _data()
    step = jax.jit(_ragged(recipe), compiler_options=_FAST)
    for sizes in (SIZES, np.array([0, 30, 0, 10], np.int32)):
        out = np.asarray(step(x, w, sizes), np.float32)
        for a, b, want in _reference_forward(x, w, sizes):
            want = want.astype(np.float32)
            np.testing.assert_allclose(out[a:b], want, rtol=2**-7, atol=1e-6 * np.abs(want).max())
        np.testing.assert_array_equal(out[sizes.sum() :], 0)
    # A non-finite value stays non-finite where the dense product per expert
    # has it: an inf in its block's row, a NaN (the group's S_enc) in its group.
    for bad, rows in ((np.inf, [22]), (np.nan, list(range(20, 33)))):
        poisoned = x.copy()
        poisoned[22, 5] = bad
        finite = np.isfinite(np.asarray(step(poisoned, w, SIZES), np.float32)).all(axis=1)
        np.testing.assert_array_equal(np.flatnonzero(~finite), rows)
    # Group 2 quantized with an outlier row of group 0 (5e6 times the others)
    # in its tensor scale would lose its E4M3 block scales to underflow.
    x[3] *= 1e5
    with np.errstate(over="ignore"):  # the underflown scales' inverses saturate
        shared = ref.dequantized(x[:33], "nvfp4")[20:33] @ ref.dequantized(w[2].T, "nvfp4", 16).T
    exact = x[20:33].astype(np.float64) @ w[2]
    out = np.asarray(step(x, w, SIZES)[20:33], np.float64)
    assert np.abs(out - exact).mean() < 0.2 * np.abs(shared - exact).mean()
    assert step._cache_size() == 1


def test_all_three_products_have_float4_operands_and_report_the_format():
    recipe = jaxamp.Float4Recipe("mxfp4")
    x, w, g = _data()

    def loss(x, w, s):
        return jnp.sum(_ragged(recipe)(x, w, s).astype(jnp.float32) * g)

    report = jaxamp.precision_report(jax.grad(loss, argnums=(0, 1)), x, w, SIZES)
    lines = [line for line in str(report).splitlines() if line.startswith(("ragged", "dot"))]
    assert all(f"{F4}/{F4}" in line for line in lines), report
    assert len([line for line in lines if line.startswith("ragged")]) == 2, report
    assert len([line for line in lines if line.startswith("dot")]) == 1, report  # the wgrad
    assert all("fp4:mxfp4" in line for line in lines), report
    assert "bf16" not in "".join(line for line in str(report).splitlines() if "ragged" in line)


def test_stochastic_rounding_is_reproducible_and_accurate():
    x, w, g = _data()

    def grads(recipe):
        f = jax.jit(
            lambda x, w, g, s: _pullback(_ragged(recipe), x, w, g, s)[1:], compiler_options=_FAST
        )
        return lambda: [np.asarray(v, np.float64) for v in f(x, w, g, SIZES)]

    run = grads(jaxamp.Float4Recipe())
    sr, again, other = run(), run(), grads(jaxamp.Float4Recipe(seed=7))()
    g16 = np.asarray(jnp.asarray(g, jnp.bfloat16), np.float64)
    exact_dw = np.stack([x[a:b].T @ g16[a:b] for _, a, b in _groups(SIZES)])
    for got, same, changed in zip(sr, again, other, strict=True):
        np.testing.assert_array_equal(got, same)
        assert np.any(got != changed)
    # The seeds' errors are independent: their mean is closer to the exact product.
    err, err_other = (np.abs(v[1] - exact_dw).mean() for v in (sr, other))
    err_mean = np.abs((sr[1] + other[1]) / 2 - exact_dw).mean()
    assert err < 0.3 * np.abs(exact_dw).mean() and err_mean < 0.95 * min(err, err_other)


@pytest.mark.parametrize("cls", [jaxamp.Float4Recipe, jaxamp.Float8Recipe])
def test_high_precision_keeps_matching_experts_in_the_compute_dtype(cls):
    x, w, _ = _data()
    params = {"experts": w, "router": np.ones((K, 4), np.float32)}

    def moe(params, x, sizes):
        return jnp.sum(
            jax.lax.ragged_dot(x @ params["router"] @ params["router"].T, params["experts"], sizes)
        )

    def operands(recipe):  # per product: its operand dtypes, forward and backward
        report = jaxamp.precision_report(jax.grad(jaxamp.autocast(moe, recipe)), params, x, SIZES)
        return sorted((mm.primitive, mm.operand_dtypes[0]) for mm in report.matmuls)

    low = F4 if cls is jaxamp.Float4Recipe else "float8_e4m3fn"
    kept = operands(cls(high_precision=r"\['experts'\]"))
    assert [d for p, d in kept if p == "ragged_dot_general"] == ["bfloat16"] * 3, (
        kept
    )  # the 16-bit three
    assert {d for p, d in kept if p == "dot_general"} <= {low, "float8_e5m2"}, kept
    with pytest.warns(UserWarning, match="'router_not' matches no leaf"):
        unmatched = operands(cls(high_precision="router_not"))
    assert ("ragged_dot_general", "bfloat16") not in unmatched
