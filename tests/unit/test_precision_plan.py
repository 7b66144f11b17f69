"""jaxamp.precision_plan: per-product errors, per-path sensitivities, the recipe it keeps.

The oracles are independent of the plan's instrumented program: the step's
deviation and each path's sensitivity against ``jax.grad`` of ``autocast(loss,
recipe)``, of ``autocast(loss, recipe.policy)`` and of ``autocast(loss,
recipe with high_precision=that path)``, each jitted on its own; a product's
error against the two autocast products of a one-matmul function; the kept
recipe against ``precision_report``'s reading of its jaxpr.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp
from jaxamp._plan._types import path_pattern

F32 = jnp.float32
RECIPES = {
    "nvfp4": jaxamp.Float4Recipe(),
    "mxfp4": jaxamp.Float4Recipe(format="mxfp4"),
    "fp8-rowwise": jaxamp.Float8Recipe(scaling="rowwise"),
}
B, D_IN, D_MID, D_OUT, D_LAST = 32, 48, 64, 80, 16


def _outlier_model():
    """Three layers; the inputs of ``b`` carry outlier channels (every 16th), its rows scaled down.

    The product ``h @ b`` is of ordinary size, but a block (FP4) or row (FP8)
    holding an outlier channel scales the ordinary values of ``h`` to nothing.
    """
    ks = jax.random.split(jax.random.key(0), 5)
    gain = jnp.ones(D_MID, F32).at[::16].set(3e4)
    params = {
        "a": jax.random.normal(ks[0], (D_IN, D_MID)) / 8,
        "b": jax.random.normal(ks[1], (D_MID, D_OUT)) / 8 / gain[:, None],
        "c": jax.random.normal(ks[2], (D_OUT, D_LAST)) / 8,
    }
    x = jax.random.normal(ks[3], (B, D_IN))
    y = jax.random.normal(ks[4], (B, D_LAST))

    def loss(p, x, y):
        h = jnp.tanh(x @ p["a"]) * gain
        return jnp.mean((jnp.tanh(h @ p["b"]) @ p["c"] - y) ** 2)

    return loss, params, x, y


def _flat(tree):
    return np.concatenate([np.asarray(v, np.float64).ravel() for v in jax.tree.leaves(tree)])


def _deviation(recipe, loss, params, *args):
    reference = _flat(jax.jit(jax.grad(jaxamp.autocast(loss, recipe.policy)))(params, *args))
    low = _flat(jax.jit(jax.grad(jaxamp.autocast(loss, recipe)))(params, *args))
    return np.linalg.norm(low - reference) / np.linalg.norm(reference)


@pytest.mark.parametrize("name", list(RECIPES))
def test_planted_outlier_layer_ranks_first_and_keep_one_keeps_exactly_it(name):
    loss, params, x, y = _outlier_model()
    plan = jaxamp.precision_plan(loss, params, x, y, recipe=RECIPES[name])
    assert plan.paths[0] == "['b']"
    assert [r.path for r in plan.rows[:3]] == ["['b']"] * 3
    kept = plan.keep(count=1)
    assert kept.high_precision == (r"^\['b'\]$",)
    assert dataclasses.replace(kept, high_precision=None) == RECIPES[name]
    report = jaxamp.precision_report(jax.grad(jaxamp.autocast(loss, kept)), params, x, y)
    # b's three products (fprop h @ b, dgrad g @ b.T, wgrad h.T @ g) in bfloat16, kept ...
    assert sorted((m.lhs_shape, m.rhs_shape) for m in report.kept) == [
        ((B, D_MID), (D_MID, D_OUT)),
        ((B, D_OUT), (D_MID, D_OUT)),
        ((D_OUT, B), (B, D_MID)),
    ]
    assert {m.operand_dtypes for m in report.kept} == {("bfloat16", "bfloat16")}
    # ... and the other six at low bits.
    low = [m for m in report.matmuls if not m.high_precision]
    assert len(low) == 6 and all(m.fp8_recipe for m in low)


def test_rows_flops_errors_and_sensitivities_against_autocast():
    loss, params, x, y = _outlier_model()
    recipe = RECIPES["nvfp4"]
    plan = jaxamp.precision_plan(loss, params, x, y, recipe=recipe)
    assert plan.target == "gradient" and set(plan.paths) == {"['a']", "['b']", "['c']"}
    flops = {"['a']": 2 * B * D_IN * D_MID, "['b']": 2 * B * D_MID * D_OUT}
    flops["['c']"] = 2 * B * D_OUT * D_LAST
    for path, each in flops.items():
        rows = [r for r in plan.rows if r.path == path]
        assert sorted(r.kind for r in rows) == ["dgrad", "fprop", "wgrad"]
        assert all(r.flops == each for r in rows)
        assert all(
            r.source.endswith("test_precision_plan.py:" + r.source.split(":")[-1]) for r in rows
        )
        assert len({r.sensitivity for r in rows}) == 1
    assert plan.total_flops == 3 * sum(flops.values())
    np.testing.assert_allclose(sum(r.share for r in plan.rows), 1.0, rtol=1e-12)
    # The ranking is by sensitivity, most sensitive first.
    sens = [next(r.sensitivity for r in plan.rows if r.path == p) for p in plan.paths]
    assert sens == sorted(sens, reverse=True)
    # The step's deviation and each path's sensitivity, from three autocast steps.
    deviation = _deviation(recipe, loss, params, x, y)
    np.testing.assert_allclose(plan.deviation, deviation, rtol=1e-5)
    for path in plan.paths:
        kept = dataclasses.replace(recipe, high_precision=path_pattern(path))
        reference = _flat(jax.jit(jax.grad(jaxamp.autocast(loss, recipe.policy)))(params, x, y))
        probe = _flat(jax.jit(jax.grad(jaxamp.autocast(loss, kept)))(params, x, y))
        expected = 1 - np.linalg.norm(probe - reference) / np.linalg.norm(reference) / deviation
        got = next(r.sensitivity for r in plan.rows if r.path == path)
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-6)
    assert "['b']" in str(plan) and "sensitivity" in str(plan).splitlines()[1]


@pytest.mark.parametrize("name", ["nvfp4", "fp8-rowwise"])
def test_forward_error_is_the_norm_wise_error_against_the_compute_dtype_product(name):
    recipe = RECIPES[name]
    kx, kw = jax.random.split(jax.random.key(1))
    params = {"w": jax.random.normal(kw, (64, 48))}
    x = jax.random.normal(kx, (32, 64))

    def f(p, x):
        return x @ p["w"]

    plan = jaxamp.precision_plan(f, params, x, recipe=recipe, grad=False)
    (row,) = plan.rows
    assert (row.path, row.kind, row.flops, plan.target) == (
        "['w']",
        "fprop",
        2 * 32 * 64 * 48,
        "output",
    )
    low = np.asarray(jax.jit(jaxamp.autocast(f, recipe))(params, x), np.float64)
    ref = np.asarray(jax.jit(jaxamp.autocast(f, recipe.policy))(params, x), np.float64)
    expected = np.linalg.norm(low - ref) / np.linalg.norm(ref)
    assert expected > 1e-3  # a low-bit product is not the bfloat16 one
    np.testing.assert_allclose(row.error, expected, rtol=1e-5)
    np.testing.assert_allclose(plan.deviation, expected, rtol=1e-5)
    np.testing.assert_allclose(row.sensitivity, 1.0, atol=1e-6)  # keeping w removes it all


def test_ragged_dot_products_are_planned_per_expert_weight():
    rng = np.random.default_rng(0)
    params = {
        "experts": jnp.asarray(rng.normal(size=(4, 32, 24)), F32),
        "out": jnp.asarray(rng.normal(size=(24, 8)), F32),
    }
    x = jnp.asarray(rng.normal(size=(40, 32)), F32)
    sizes = jnp.asarray([16, 0, 20, 4], jnp.int32)

    def loss(p, x, sizes):
        h = jax.lax.ragged_dot(x, p["experts"], sizes)
        return jnp.mean(jnp.tanh(h) @ p["out"])

    plan = jaxamp.precision_plan(loss, params, x, sizes, recipe="mixed_nvfp4")
    rows = [r for r in plan.rows if r.path == "['experts']"]
    assert sorted(r.kind for r in rows) == ["dgrad", "fprop", "wgrad"]
    assert {r.flops for r in rows} == {2 * 40 * 32 * 24}  # each row meets one expert
    assert all(0 < r.error < 1 for r in rows)
    kept = dataclasses.replace(RECIPES["nvfp4"], high_precision=(r"^\['experts'\]$",))
    assert plan.keep(count=2) == dataclasses.replace(
        kept, high_precision=tuple(path_pattern(p) for p in plan.paths)
    )
    report = jaxamp.precision_report(jax.grad(jaxamp.autocast(loss, kept)), params, x, sizes)
    assert {m.primitive for m in report.kept} == {"ragged_dot_general"}


def test_keep_by_fraction_is_a_greedy_budget_of_the_low_bit_flops():
    loss, params, x, y = _outlier_model()
    plan = jaxamp.precision_plan(loss, params, x, y, recipe=RECIPES["nvfp4"])
    share = {p: plan.path_flops(p) / plan.total_flops for p in plan.paths}
    assert plan.keep(fraction=0.0).high_precision is None
    assert plan.keep(count=0).high_precision is None
    assert plan.keep(fraction=1.0) == plan.keep(count=3)
    first, second, third = plan.paths
    budget = share[first] + share[third]
    expected = [first, third] if share[second] > share[third] else [first, second]
    kept = plan.keep(fraction=budget).high_precision
    assert kept == tuple(path_pattern(p) for p in plan.paths if p in expected)
    assert plan.keep(fraction=share[first] * 0.999).high_precision != (path_pattern(first),)


def test_patterns_are_anchored_and_escaped():
    pattern = path_pattern("['blocks'][1]['w']")
    names = ["['blocks'][1]['w']", "['blocks'][11]['w']", "['blocks'][1]['w']['b']"]
    assert [bool(re.search(pattern, n)) for n in names] == [True, False, False]


def test_recipe_high_precision_is_ignored_and_every_product_measured():
    loss, params, x, y = _outlier_model()
    recipe = dataclasses.replace(RECIPES["fp8-rowwise"], high_precision=r"\['b'\]")
    plan = jaxamp.precision_plan(loss, params, x, y, recipe=recipe)
    assert plan.recipe.high_precision is None and len(plan.paths) == 3


def test_invalid_arguments_name_what_is_wrong():
    loss, params, x, y = _outlier_model()
    with pytest.raises(TypeError, match="recipe"):
        jaxamp.precision_plan(loss, params, x, y, recipe=jaxamp.get_policy("mixed_bfloat16"))
    with pytest.raises(ValueError, match="recipe"):
        jaxamp.precision_plan(loss, params, x, y, recipe="mixed_bfloat16")
    with pytest.raises(TypeError, match="grad"):
        jaxamp.precision_plan(loss, params, x, y, recipe="mixed_nvfp4", grad="yes")
    with pytest.raises(TypeError, match="fun"):
        jaxamp.precision_plan(None, params, x, y, recipe="mixed_nvfp4")
    with pytest.raises(ValueError, match="no product at low bits"):
        jaxamp.precision_plan(lambda p: jnp.sum(p["a"] ** 2), params, recipe="mixed_nvfp4")
    plan = jaxamp.precision_plan(loss, params, x, y, recipe="mixed_float8", grad=False)
    with pytest.raises(TypeError, match="exactly one"):
        plan.keep()
    with pytest.raises(TypeError, match="exactly one"):
        plan.keep(count=1, fraction=0.1)
    with pytest.raises(TypeError, match="count"):
        plan.keep(count=1.0)
    with pytest.raises(ValueError, match="count"):
        plan.keep(count=-1)
    with pytest.raises(TypeError, match="fraction"):
        plan.keep(fraction="0.1")
    with pytest.raises(ValueError, match="fraction"):
        plan.keep(fraction=1.5)
