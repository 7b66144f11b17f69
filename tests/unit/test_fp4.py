"""FP4 recipes (NVFP4, MXFP4) against the independent NumPy reference in tests/fp4_reference.py.

Data are small integers times a power of two planted per block (so block
amaxes differ, and the Hadamard transform is exact in float32). Forward
products in bfloat16 must be the reference rounded once to bfloat16; with
stochastic rounding off, the gradients of float32 inputs must match it to
float32 accumulation order. The wrong variants (block size, scale format,
scale rounding, Hadamard placement) are each far outside those tolerances.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxamp
from jaxamp._fp8 import _fp4
from tests import fp4_reference as ref
from tests.helpers import dot_dtypes
from tests.unit.test_fp8 import assert_bf16_of, assert_f32_of

F4 = "float4_e2m1fn"
CONFIGS = {
    "nvfp4": {"format": "nvfp4"},
    "nvfp4-no-hadamard": {"format": "nvfp4", "hadamard": False},
    "nvfp4-weights-1d": {"format": "nvfp4", "weight_blocks_2d": False},
    "mxfp4": {"format": "mxfp4"},
    "mxfp4-ceil": {"format": "mxfp4", "scale_rounding": "ceil"},
    "mxfp4-no-hadamard": {"format": "mxfp4", "hadamard": False},
}


def planted(seed, shape, block=16):
    """Integers in [-31, 31] / 16 times a power of two in [2**-4, 2**4] per 1 x block."""
    rng = np.random.default_rng(seed)
    ints = rng.integers(-31, 32, size=shape).astype(np.float32) / 16
    exps = rng.integers(-4, 5, size=(shape[0], -(-shape[1] // block)))
    return ints * np.repeat(2.0 ** exps.astype(np.float32), block, axis=1)[:, : shape[1]]


def _data(shape):
    m, k, n = shape
    x, w, g = planted(0, (m, k)), planted(1, (k, n)) / 8, planted(2, (m, n))
    g = g.astype(ml_dtypes.bfloat16).astype(np.float32)  # exact: the output's cast back
    return x, w, g


@functools.cache
def _compiled(recipe):
    """The jitted product and its gradients, once per recipe (recipes are hashable)."""
    f = jaxamp.autocast(lambda x, w: x @ w, recipe)
    grads = jax.grad(lambda x, w, g: jnp.sum(f(x, w) * g), argnums=(0, 1))
    return jax.jit(f), jax.jit(grads)


def _run(recipe, x, w, g):
    f, grads = _compiled(recipe)
    return (f(x, w), *grads(x, w, g))


def _ref_kwargs(kwargs):
    return {
        "weight_2d": kwargs.get("weight_blocks_2d", True),
        "ceil": kwargs.get("scale_rounding") == "ceil",
    }


SHAPE = (32, 64, 48)  # one shape for most tests: one compile per recipe


# The Hadamard switch is the same code under both formats: NVFP4's case runs with -m slow.
SLOW = {"nvfp4-no-hadamard"}


@pytest.mark.parametrize(
    ("name", "shape"),
    [
        pytest.param(name, SHAPE, marks=[pytest.mark.slow] if name in SLOW else [])
        for name in CONFIGS
    ]
    + [("nvfp4", (20, 40, 7)), ("mxfp4", (20, 40, 7))],  # padded along M, N and K
)
def test_products_match_reference(name, shape):
    kwargs = CONFIGS[name]
    x, w, g = _data(shape)
    recipe = jaxamp.Float4Recipe(**kwargs, stochastic_rounding=False)
    out, dx, dw = _run(recipe, x, w, g)
    common = _ref_kwargs(kwargs)
    assert_bf16_of(out, ref.forward(x, w, kwargs["format"], **common))
    want_dx, want_dw = ref.gradients(
        x, w, g, kwargs["format"], hadamard_on=kwargs.get("hadamard", True), **common
    )
    assert_f32_of(dx, want_dx)
    assert_f32_of(dw, want_dw)


def _close(got, want, tol):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return np.abs(got - want).max() <= tol * np.abs(want).max()


@pytest.mark.parametrize(
    ("fmt", "variant"),
    [
        ("nvfp4", {"block": 32}),
        ("nvfp4", {"scale": "float32"}),
        ("nvfp4", {"weight_2d": False}),
        ("mxfp4", {"block": 16}),
        ("mxfp4", {"scale": "float32"}),
        ("mxfp4", {"ceil": True}),
    ],
)
def test_wrong_forward_variants_are_far_outside_tolerance(fmt, variant):
    x, w, g = _data(SHAPE)
    out = _run(jaxamp.Float4Recipe(fmt, stochastic_rounding=False), x, w, g)[0]
    assert _close(out, ref.forward(x, w, fmt), 2.0**-8)
    assert not _close(out, ref.forward(x, w, fmt, **variant), 2e-2), variant


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("variant", [{"hadamard_on": False}, {"placement": "dgrad"}])
def test_wrong_hadamard_placement_is_far_outside_tolerance(fmt, variant):
    x, w, g = _data(SHAPE)
    _, dx, dw = _run(jaxamp.Float4Recipe(fmt, stochastic_rounding=False), x, w, g)
    want_dx, want_dw = ref.gradients(x, w, g, fmt)
    assert _close(dx, want_dx, 1e-5) and _close(dw, want_dw, 1e-5)
    wrong_dx, wrong_dw = ref.gradients(x, w, g, fmt, **variant)
    assert not (_close(dx, wrong_dx, 1e-2) and _close(dw, wrong_dw, 1e-2))


@pytest.mark.parametrize("spec", ["mixed_nvfp4", "mixed_mxfp4"])
def test_all_three_products_have_float4_operands(spec):
    x, w = jnp.ones((16, 32)), jnp.ones((32, 16))
    f = jaxamp.autocast(lambda x, w: jnp.sum(jnp.tanh(x @ w)), spec)
    grad = jax.grad(f, argnums=(0, 1))
    assert dot_dtypes(f, x, w) == [(F4, F4)]
    assert dot_dtypes(grad, x, w) == [(F4, F4)] * 3
    report = jaxamp.precision_report(grad, x, w)
    assert {m.fp8_recipe for m in report.matmuls} == {spec.removeprefix("mixed_")}
    assert f"fp4:{spec.removeprefix('mixed_')}" in str(report)
    # Everything that is not a chosen matmul runs as under mixed_bfloat16.
    bf16 = jaxamp.precision_report(jax.grad(jaxamp.autocast(f.__wrapped__)), x, w)
    assert report.op_dtypes["tanh"] == bf16.op_dtypes["tanh"] == {"bfloat16": 1}


def test_activation_products_and_convolutions_stay_in_the_compute_dtype():
    x, w = jnp.ones((16, 32)), jnp.ones((32, 32))

    def attention(x, w):
        h = x @ w
        return (h @ h.T) @ h  # two products of activations

    assert (
        dot_dtypes(jaxamp.autocast(attention, "mixed_nvfp4"), x, w)
        == [(F4, F4)] + [("bfloat16", "bfloat16")] * 2
    )
    every = jaxamp.Float4Recipe(quantize_activation_products=True)
    assert dot_dtypes(jaxamp.autocast(attention, every), x, w) == [(F4, F4)] * 3
    img, kernel = jnp.ones((1, 8, 8, 4)), jnp.ones((3, 3, 4, 8))
    conv = jaxamp.autocast(
        lambda a, b: jax.lax.conv_general_dilated(
            a, b, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
        ),
        "mixed_mxfp4",
    )
    assert dot_dtypes(conv, img, kernel) == [("bfloat16", "bfloat16")]


def test_stochastic_rounding_is_reproducible_and_changes_with_seed_and_data():
    x, w, g = _data(SHAPE)

    def grads(seed, g=g, **kwargs):
        return [np.asarray(v) for v in _run(jaxamp.Float4Recipe(seed=seed, **kwargs), x, w, g)[1:]]

    first, other = grads(0), grads(1)
    # A fresh trace and compile of the same recipe: the same bits.
    fresh = jaxamp.autocast(lambda x, w: x @ w, "mixed_nvfp4")  # seed 0
    again = jax.jit(jax.grad(lambda x, w, g: jnp.sum(fresh(x, w) * g), argnums=(0, 1)))(x, w, g)
    for a, b in zip(first, again, strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))
    assert all(not np.array_equal(a, b) for a, b in zip(first, other, strict=True))
    nearest = grads(0, stochastic_rounding=False)
    assert all(not np.array_equal(a, b) for a, b in zip(first, nearest, strict=True))
    # A new step's gradient: new bits, so the same values elsewhere round differently
    # (one sign flipped: no amax, hence no scale, changes).
    g2 = g.copy()
    assert g2[0, 1] != 0
    g2[0, 1] = -g2[0, 1]
    moved = grads(0, g=g2)[0]
    assert not np.array_equal(moved[1:], first[0][1:])
    # The forward product rounds to nearest under either setting.
    assert_bf16_of(_run(jaxamp.Float4Recipe(seed=1), x, w, g)[0], ref.forward(x, w, "nvfp4"))
    # One changed gradient value (a new step) changes the bits of every value.
    y = jnp.asarray(planted(3, (8, 64)))
    bits = np.asarray(_fp4.rounding_bits(y, 0))
    changed = np.asarray(_fp4.rounding_bits(y.at[0, 0].add(1.0), 0))
    assert np.mean(bits == changed) < 0.01
    np.testing.assert_array_equal(bits, np.asarray(jax.jit(_fp4.rounding_bits)(y, 0)))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_stochastic_rounding_is_unbiased(fmt):
    # Values that never saturate: MXFP4's ceil scale and NVFP4's exact 448 scale.
    x = np.linspace(-1.0, 1.0, 4 * 32, dtype=np.float32).reshape(1, 4, 32) * np.float32(5.9 / 6)
    x[..., ::16] = 1.0  # every block's amax
    seeds = jnp.arange(2048, dtype=jnp.uint32)

    def values(seed):
        q = _fp4.quantize4(jnp.asarray(x), fmt, 1, ceil=True, seed=seed)
        return q.codes.astype(jnp.float32) * q.decode[..., None]

    got = np.asarray(jax.jit(jax.vmap(values))(seeds), np.float64).reshape(len(seeds), -1)
    err = got - x.reshape(1, -1)
    assert np.abs(err).max() > 0.05  # it does round
    # Per value (128 of them: 5 standard errors) and overall, the mean error is zero.
    se = err.std(axis=0) / np.sqrt(len(seeds)) + 1e-7
    assert np.all(np.abs(err.mean(axis=0)) <= 5 * se + 1e-6)
    total = err.sum(axis=1)
    assert abs(total.mean()) <= 4 * total.std() / np.sqrt(len(seeds))
    # Round to nearest's error is far outside those bounds: the test can fail.
    nearest = np.asarray(values(None), np.float64).reshape(-1) - x.reshape(-1)
    assert np.any(np.abs(nearest) > 10 * se + 1e-6)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_an_overflow_stays_non_finite(fmt):
    # Loss scaling must see an inf gradient: saturated codes would hide it.
    x = jnp.asarray(planted(0, (1, 32, 32)))
    n = ref.BLOCKS[fmt]
    for bad in (np.inf, -np.inf, np.nan):
        q = _fp4.quantize4(x.at[0, 3, 5].set(bad), fmt, 1)
        values = np.asarray(q.codes.astype(jnp.float32) * q.decode[..., None]).reshape(32, 32)
        assert np.isnan(values[3, :n]).all(), bad
        if np.isinf(bad):  # the other blocks keep finite values
            assert np.isfinite(values[3, n:]).all() and np.isfinite(values[4:]).all()


def test_scan_over_layers_gives_the_unrolled_bits():
    # Stochastic rounding keys on values, not on a step counter: a scanned stack of
    # layers rounds as the same layers written out, bit for bit.
    ws, x = jnp.asarray(planted(4, (2 * 32, 32)).reshape(2, 32, 32)) / 8, planted(5, (16, 32))

    def scanned(ws, x):
        return jnp.sum(jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0])

    def unrolled(ws, x):
        return jnp.sum(jnp.tanh(jnp.tanh(x @ ws[0]) @ ws[1]))

    got, want = (
        jax.jit(jax.grad(jaxamp.autocast(f, "mixed_nvfp4")))(ws, x) for f in (scanned, unrolled)
    )
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_presets_and_recipe():
    assert jaxamp.Float4Recipe() == jaxamp.Float4Recipe("nvfp4")
    assert hash(jaxamp.Float4Recipe()) == hash(jaxamp.Float4Recipe("nvfp4"))
    x, w = planted(0, (16, 64)), planted(1, (64, 16))
    for name, fmt in [("mixed_nvfp4", "nvfp4"), ("mixed_mxfp4", "mxfp4")]:
        assert jaxamp._resolve.resolve(name)[1] == jaxamp.Float4Recipe(format=fmt)
        a = jax.jit(jaxamp.autocast(lambda x, w: x @ w, name))(x, w)
        b = jax.jit(jaxamp.autocast(lambda x, w: x @ w, jaxamp.Float4Recipe(format=fmt)))(x, w)
        np.testing.assert_array_equal(a, b)
        assert str(jaxamp._resolve.resolve(name)[1]) == f"fp4:{fmt}"
    recipe = jaxamp.Float4Recipe(compute_dtype=jnp.float16)
    assert str(recipe.policy) == "params=float32,compute=float16,output=float32"
    assert str(recipe) == "fp4:nvfp4,float16"
    assert jaxamp.Float4Recipe(high_precision=None).high_precision is None


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"format": "fp4"}, ValueError, r"format=\.\.\.\) must be one of 'nvfp4', 'mxfp4'"),
        ({"format": "nvfp4", "scale_rounding": "ceil"}, ValueError, "MXFP4's alone"),
        ({"format": "mxfp4", "scale_rounding": "up"}, ValueError, "'floor', 'ceil'; got 'up'"),
        ({"gemm": "fast"}, ValueError, r"gemm=\.\.\.\) must be one of"),
        ({"hadamard": 1}, TypeError, r"hadamard=\.\.\.\) must be True or False; got int"),
        ({"stochastic_rounding": "no"}, TypeError, "stochastic_rounding"),
        ({"seed": 1.5}, TypeError, r"seed=\.\.\.\) must be an int"),
        ({"seed": -1}, ValueError, r"\[0, 2\*\*32\); got -1"),
        ({"compute_dtype": jnp.float32}, TypeError, "must be 16-bit.*got float32"),
        ({"high_precision": ["a"]}, TypeError, "high_precision"),
        ({"high_precision": "a("}, ValueError, "not a regular expression"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        jaxamp.Float4Recipe(**kwargs)


@pytest.mark.parametrize("cls", [jaxamp.Float4Recipe, jaxamp.Float8Recipe])
def test_high_precision_keeps_matching_parameters_in_the_compute_dtype(cls):
    recipe = cls(high_precision=r"\['head'\]")
    assert recipe.high_precision == (r"\['head'\]",) and "high-precision" in str(recipe)
    params = {"body": jnp.ones((32, 16)), "head": jnp.ones((16, 16))}
    x = jnp.ones((16, 32))

    def net(params, x):
        head = jax.jit(lambda h, w: h @ w.T)  # seen through jit and a transpose
        return jnp.sum(head(jnp.tanh(x @ params["body"]), params["head"]))

    def kinds(fun):  # "low" (float4/float8) or "bf16" per product
        return sorted(
            "bf16" if d == ("bfloat16",) * 2 else "low" for d in dot_dtypes(fun, params, x)
        )

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a pattern that matches warns nothing
        assert kinds(jaxamp.autocast(net, recipe)) == ["bf16", "low"]
    assert kinds(jax.grad(jaxamp.autocast(net, recipe))) == ["bf16"] * 3 + ["low"] * 3
    # A pattern that names no parameter (a typo) keeps nothing, and says so.
    every = cls(high_precision=("nothing", r"\['head'\]"))
    with pytest.warns(UserWarning, match=r"'nothing' matches no leaf .*\['body'\]") as seen:
        assert kinds(jaxamp.autocast(net, every)) == ["bf16", "low"]
    assert len(seen) == 1
    if cls is jaxamp.Float4Recipe:
        assert dot_dtypes(jaxamp.autocast(net, recipe), params, x)[0] == (F4, F4)


@pytest.mark.parametrize("cls", [jaxamp.Float4Recipe, jaxamp.Float8Recipe])
def test_high_precision_keeps_a_scanned_stack_whole(cls):
    # A stack of layers under scan is one leaf: a rule keeps every layer of it or none.
    params = {"stack": jnp.ones((3, 32, 32)) / 32, "head": jnp.ones((32, 16)) / 8}
    x = jnp.ones((16, 32))

    def net(params, x):
        h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, params["stack"])
        return jnp.sum(h @ params["head"])

    def kinds(fun):  # (operand kind, runs) per product, in trace order
        report = jaxamp.precision_report(fun, params, x)
        return [
            ("bf16" if m.compute_dtype == "bfloat16" else "low", m.count) for m in report.matmuls
        ]

    stack, head = cls(high_precision=r"\['stack'\]"), cls(high_precision=r"\['head'\]")
    assert kinds(jaxamp.autocast(net, stack)) == [("bf16", 3), ("low", 1)]
    assert kinds(jaxamp.autocast(net, head)) == [("low", 3), ("bf16", 1)]
    grads = kinds(jax.grad(jaxamp.autocast(net, stack)))
    assert sorted(grads) == [("bf16", 3)] * 3 + [("low", 1)] * 3
    # Kept in bfloat16, the stack's products are bit for bit those of mixed_bfloat16.
    loss = jax.jit(jaxamp.autocast(net, stack))(params, x)
    plain = jax.jit(jaxamp.autocast(net, cls(high_precision=(r"\['stack'\]", r"\['head'\]"))))
    assert loss.dtype == jnp.float32 and bool(jnp.isfinite(loss))
    assert plain(params, x) == jax.jit(jaxamp.autocast(net, "mixed_bfloat16"))(params, x)


@pytest.mark.parametrize("cls", [jaxamp.Float4Recipe, jaxamp.Float8Recipe])
def test_high_precision_warns_when_its_leaves_reach_no_matmul_it_can_follow(cls):
    params = {"inner": jnp.ones((32, 32)) / 32, "norm": jnp.ones(32)}
    x = jnp.ones((16, 32))

    def net(params, x):  # the weight is used only inside a cond branch
        h = jax.lax.cond(True, lambda h: h @ params["inner"], lambda h: h, x)
        return jnp.sum(h * params["norm"])

    for pattern in (r"\['inner'\]", r"\['norm'\]"):
        with pytest.warns(UserWarning, match=r"none of them is a matmul operand"):
            jaxamp.autocast(net, cls(high_precision=pattern))(params, x)


def test_fp8_recipe_rejects_an_fp4_format():
    with pytest.raises(ValueError, match="Float4Recipe"):
        jaxamp.Float8Recipe("nvfp4")
    with pytest.raises(ValueError, match="mixed_nvfp4"):
        jaxamp.autocast(lambda x: x, "mixed_fp4")
