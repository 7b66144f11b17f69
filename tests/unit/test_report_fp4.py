"""precision_report under the FP4 and FP8 recipes: float4 FLOPs, and the products
that ``high_precision`` kept in the compute dtype, forward and backward."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp
from jaxamp._autocast import _caster as caster

# Every dim a multiple of 16 and 32 (NVFP4's and MXFP4's blocks): no padding,
# so each product's FLOPs are those of the dense product, 2 * M * N * K.
BATCH = 32
SHAPES = {"w1": (32, 64), "w2": (64, 96), "head": (96, 32)}
RECIPES = {
    "nvfp4": jaxamp.Float4Recipe("nvfp4", high_precision=r"\['w2'\]"),
    "mxfp4": jaxamp.Float4Recipe("mxfp4", high_precision=r"\['w2'\]"),
    "rowwise": jaxamp.Float8Recipe("rowwise", high_precision=r"\['w2'\]"),
}


def _mlp(params, x):
    h = jnp.tanh(x @ params["w1"])
    h = jnp.tanh(h @ params["w2"])
    return jnp.sum(h @ params["head"])


def _args():
    keys = jax.random.split(jax.random.key(0), len(SHAPES) + 1)
    params = {
        k: jax.random.normal(key, s) for (k, s), key in zip(SHAPES.items(), keys, strict=False)
    }
    return params, jax.random.normal(keys[-1], (BATCH, SHAPES["w1"][0]))


def _layer_flops(name):
    k, n = SHAPES[name]
    return 2 * BATCH * k * n


def _gemm(m: jaxamp.MatmulInfo) -> list[int]:
    return sorted(m.dims.values())


@pytest.mark.parametrize("name", sorted(RECIPES))
@pytest.mark.parametrize("backward", [False, True])
def test_kept_products_are_the_matching_layers(name, backward):
    recipe = RECIPES[name]
    fun = jaxamp.autocast(_mlp, recipe)
    if backward:
        fun = jax.grad(fun)
    report = jaxamp.precision_report(fun, *_args())
    w2 = sorted([BATCH, *SHAPES["w2"]])
    # Forward: the w2 product; backward also its two gradient products (the first
    # layer's input gradient too: each recipe's backward rule gives both).
    assert [_gemm(m) for m in report.kept] == [w2] * (3 if backward else 1)
    assert all(m.operand_dtypes == ("bfloat16",) * 2 and not m.fp8_recipe for m in report.kept)
    others = [m for m in report.matmuls if not m.high_precision]
    assert others and all(_gemm(m) != w2 for m in others)
    low = "is_fp4" if isinstance(recipe, jaxamp.Float4Recipe) else "is_fp8"
    assert all(getattr(m, low) and m.fp8_recipe.startswith(name) for m in others)
    # Each product's FLOPs are the dense product's, the per-block FP4 form's too.
    total = sum(_layer_flops(k) for k in SHAPES)
    assert report.total_flops == total * (3 if backward else 1)
    kept_share = _layer_flops("w2") / total
    fraction = report.fp4_fraction if low == "is_fp4" else report.fp8_fraction
    assert fraction == pytest.approx(1 - kept_share, rel=1e-12)
    assert sum(m.flops for m in report.kept) / report.total_flops == pytest.approx(kept_share)


def test_str_names_the_fp4_share_and_the_kept_products():
    report = jaxamp.precision_report(jax.grad(jaxamp.autocast(_mlp, RECIPES["nvfp4"])), *_args())
    lines = str(report).splitlines()
    kept = _layer_flops("w2") / sum(_layer_flops(k) for k in SHAPES)
    assert f"FP4: {100 * (1 - kept):.1f}% of FLOPs (nvfp4)" in lines
    assert f"kept in bfloat16 by high_precision: 3 products, {100 * kept:.1f}% of FLOPs" in lines
    assert not any(line.startswith("FP8") for line in lines)
    assert sum("kept:high_precision" in line for line in lines) == 3
    # The FP4 products' dims are the dense products': K spans the blocks.
    dense = {tuple(sorted([BATCH, *SHAPES[k]])) for k in ("w1", "head")}
    assert {tuple(_gemm(m)) for m in report.matmuls if m.is_fp4} == dense


def test_without_high_precision_nothing_is_kept_and_the_text_says_nothing():
    report = jaxamp.precision_report(jaxamp.autocast(_mlp, "mixed_nvfp4"), *_args())
    assert report.kept == () and report.fp4_fraction == 1.0
    assert "high_precision" not in str(report)
    assert jaxamp.precision_report(jaxamp.autocast(_mlp), *_args()).fp4_fraction == 0.0


def test_the_kept_scope_changes_no_value_and_no_dtype(monkeypatch):
    params, x = _args()
    grad = jax.grad(jaxamp.autocast(_mlp, RECIPES["nvfp4"]))
    scoped = (jax.jit(grad)(params, x), jax.make_jaxpr(grad)(params, x))
    # The same evaluation without the name scope around the kept products.
    monkeypatch.setattr(caster, "kept_scope", lambda eqn, found: contextlib.nullcontext())
    grad = jax.grad(jaxamp.autocast(_mlp, RECIPES["nvfp4"]))
    assert jaxamp.precision_report(grad, params, x).kept == ()
    plain = (jax.jit(grad)(params, x), jax.make_jaxpr(grad)(params, x))
    for key in params:
        np.testing.assert_array_equal(scoped[0][key], plain[0][key])
    assert str(scoped[1]) == str(plain[1])  # the jaxpr: the same equations and dtypes


@pytest.mark.parametrize("cls", [jaxamp.Float4Recipe, jaxamp.Float8Recipe])
def test_kept_expert_products_of_a_mixture_of_experts(cls):
    sizes = np.array([16, 0, 32, 16], np.int32)
    rng = np.random.default_rng(0)
    params = {
        "proj": rng.normal(size=(32, 32)).astype(np.float32),
        "experts": rng.normal(size=(len(sizes), 32, 48)).astype(np.float32),
    }
    x = rng.normal(size=(64, 32)).astype(np.float32)

    def moe(params, x):
        return jnp.sum(jax.lax.ragged_dot(x @ params["proj"], params["experts"], sizes))

    def report(pattern):
        return jaxamp.precision_report(
            jax.grad(jaxamp.autocast(moe, cls(high_precision=pattern))), params, x
        )

    experts = report(r"\['experts'\]")
    assert len(experts.kept) == 3 and all(
        m.primitive == "ragged_dot_general" and m.operand_dtypes == ("bfloat16",) * 2
        for m in experts.kept
    )
    assert not any(
        m.primitive == "ragged_dot_general" for m in experts.matmuls if not m.high_precision
    )
    # The kept products' FLOPs: the dense ones (each row meets one expert), 2 * M * N * K.
    assert [m.flops for m in experts.kept] == [2 * 64 * 32 * 48] * 3
    proj = report(r"\['proj'\]")
    assert [_gemm(m) for m in proj.kept] == [[32, 32, 64]] * 3
    assert all(m.primitive == "dot_general" for m in proj.kept)
    if cls is jaxamp.Float4Recipe:
        # The FP4 forward and input-gradient products, per block along K: the dense FLOPs.
        ragged = [m for m in proj.matmuls if m.primitive == "ragged_dot_general"]
        assert [(m.is_fp4, m.flops) for m in ragged] == [(True, 2 * 64 * 32 * 48)] * 2
