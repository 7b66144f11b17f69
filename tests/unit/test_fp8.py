"""FP8 recipes against the independent NumPy reference in tests/fp8_reference.py.

Forward products in bfloat16 must be the reference rounded once to bfloat16;
gradients of float32 parameters (computed in float32 from FP8 products) must
match it to float32 accuracy. A wrong scale, group or format moves the result by
several percent, far outside these tolerances.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxamp
from jaxamp import _fp8
from tests import fp8_reference as ref

SCALINGS = _fp8.names("fp8")
BF16_TOL = 2.0**-8  # half a bfloat16 ulp, relative
F32_TOL = 1e-5


def _rand(key, shape, scale=1.0):
    return np.asarray(jax.random.normal(jax.random.key(key), shape), np.float32) * scale


def _matmul(recipe):
    return jax.jit(jaxamp.autocast(lambda x, w: x @ w, recipe))


def assert_bf16_of(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    tol = BF16_TOL * np.abs(want) + 1e-6 * np.abs(want).max()
    assert np.all(np.abs(got - want) <= tol), np.abs(got - want).max()


def assert_f32_of(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.abs(got - want).max() <= F32_TOL * max(np.abs(want).max(), 1e-30)


@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("shape", [(16, 256, 128), (5, 130, 7)])
def test_forward_and_gradients_match_reference(scaling, shape):
    m, k, n = shape
    x, w, g = _rand(0, (m, k)), _rand(1, (k, n), 0.05), _rand(2, (m, n))
    recipe = jaxamp.Float8Recipe(scaling)
    f = jax.jit(_matmul(recipe))
    assert_bf16_of(f(x, w), ref.forward(x, w, scaling))
    # The output gradient reaches the matmul in bfloat16 (the output's cast back).
    g16 = g.astype(ml_dtypes.bfloat16).astype(np.float32)
    dx, dw = jax.jit(jax.grad(lambda x, w: jnp.sum(f(x, w) * g), argnums=(0, 1)))(x, w)
    want_dx, want_dw = ref.gradients(x, w, g16, scaling)
    assert_f32_of(dx, want_dx)
    assert_f32_of(dw, want_dw)


@pytest.mark.parametrize("scaling", SCALINGS)
def test_each_recipe_differs_from_the_others(scaling):
    # The tolerance above tells the recipes apart: a test that cannot fail is none.
    x, w = _rand(3, (8, 256)), _rand(4, (256, 256), 0.05)
    x[:, 0] *= 40.0  # an outlier channel: groups along K see different amaxes
    got = np.asarray(_matmul(jaxamp.Float8Recipe(scaling))(x, w), np.float64)
    for other in SCALINGS:
        want = ref.forward(x, w, other)
        close = np.all(np.abs(got - want) <= BF16_TOL * np.abs(want) + 1e-6 * np.abs(want).max())
        assert close == (other == scaling), other


def test_power_of_two_scale_matches_reference():
    x, w = _rand(5, (8, 96)), _rand(6, (96, 24), 3.0)
    for scaling in ("tensorwise", "rowwise"):
        recipe = jaxamp.Float8Recipe(scaling, power_of_two_scale=True)
        assert_bf16_of(_matmul(recipe)(x, w), ref.forward(x, w, scaling, power_of_two=True))


def test_e5m2_forward_and_float16_compute():
    x, w = _rand(7, (8, 64)), _rand(8, (64, 16))
    recipe = jaxamp.Float8Recipe(forward_dtype=jnp.float8_e5m2, compute_dtype=jnp.float16)
    out = _matmul(recipe)(x, w)
    want = ref.product(x, "act", ref.E5M2, w, "weight", ref.E5M2, "tensorwise")
    np.testing.assert_allclose(np.asarray(out), want, rtol=2.0**-10, atol=1e-5)


@pytest.mark.parametrize("scaling", SCALINGS)
def test_one_outlier_per_row(scaling):
    # Row i has one value 1000x the rest: tensorwise flushes the small rows' values,
    # rowwise and finer groups keep each row's own range.
    x = _rand(9, (4, 64)) * 1e-3
    x[np.arange(4), np.arange(4)] = 10.0 ** np.arange(4)
    w = _rand(10, (64, 8))
    got = _matmul(jaxamp.Float8Recipe(scaling))(x, w)
    assert_bf16_of(got, ref.forward(x, w, scaling))


def test_zeros_values_at_fp8_max_and_subnormals():
    f = _matmul("mixed_float8")
    zeros = np.zeros((4, 32), np.float32)
    assert np.all(np.asarray(f(zeros, _rand(11, (32, 4)))) == 0)
    # At fp8_max the scale is 1 and the cast exact.
    top = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)
    x = np.full((2, 4), top, np.float32)
    w = np.eye(4, dtype=np.float32)
    assert np.all(np.asarray(f(x, w)) == top)
    # At scale 1, 2**-8 and 3 * 2**-9 are e4m3 subnormals (below the min normal
    # 2**-6, multiples of 2**-9); 2**-11 is under half the smallest one: zero.
    x = np.array([[top, 2.0**-8, 3 * 2.0**-9, 2.0**-11]], np.float32)
    w = np.diag(np.ones(4, np.float32))
    got = np.asarray(f(x, w))[0]
    np.testing.assert_array_equal(got, [top, 2.0**-8, 3 * 2.0**-9, 0.0])
    assert_bf16_of(got[None], ref.forward(x, w, "tensorwise"))


@pytest.mark.parametrize("scaling", SCALINGS)
def test_non_finite_operand_gives_non_finite_result(scaling):
    f = jaxamp.autocast(lambda x, w: x @ w, jaxamp.Float8Recipe(scaling))
    x, w = jnp.asarray(_rand(12, (4, 64))), jnp.asarray(_rand(13, (64, 8)))

    @jax.jit
    def run(bad):
        xb, wb = x.at[1, 3].set(bad), w.at[5, 2].set(bad)
        dw = jax.grad(lambda w: jnp.sum(f(xb, w)))(w)  # x's bad value reaches dw via x^T g
        return f(xb, w)[1], dw, f(x, wb)

    for bad in (np.inf, -np.inf, np.nan):
        for out in run(np.float32(bad)):
            assert not np.all(np.isfinite(np.asarray(out))), bad


@pytest.mark.parametrize("scaling", SCALINGS)
def test_batch_dims_and_einsum_layouts(scaling):
    # 'bmk,bnk->bmn': a batch dim, and the rhs contracting on its last dim.
    x, w = _rand(14, (3, 5, 96)), _rand(15, (3, 6, 96))
    f = jax.jit(
        jaxamp.autocast(lambda x, w: jnp.einsum("bmk,bnk->bmn", x, w), jaxamp.Float8Recipe(scaling))
    )
    got = np.asarray(f(x, w))
    if scaling == "tensorwise":  # one scale over the whole operand, batch included
        qx = ref.tensorwise_dequantized(x, ref.E4M3, False)
        qw = ref.tensorwise_dequantized(w, ref.E4M3, False)
        want = np.einsum("bmk,bnk->bmn", qx, qw)
    else:
        want = np.stack([ref.forward(x[i], w[i].T, scaling) for i in range(3)])
    assert_bf16_of(got, want)


@pytest.mark.parametrize("scaling", SCALINGS)
def test_two_batch_dims_are_the_product_of_the_merged_batch(scaling):
    # Attention's scores: 'bhqd,bhkd->bhqk' is mapped over b (not merged with h,
    # so that a sharded h stays sharded); each scale group is what the merged
    # product's is (tensorwise: one over the whole operand and gradient).
    x, w, g = _rand(20, (2, 3, 5, 64)), _rand(21, (2, 3, 7, 64)), _rand(22, (2, 3, 5, 7))
    recipe = jaxamp.Float8Recipe(scaling)

    def two(x, w):
        return jnp.sum(jnp.einsum("bhqd,bhkd->bhqk", x, w).astype(jnp.float32) * g)

    def merged(x, w):
        out = jnp.einsum("nqd,nkd->nqk", x.reshape(6, 5, 64), w.reshape(6, 7, 64))
        return jnp.sum(out.reshape(2, 3, 5, 7).astype(jnp.float32) * g)

    got, want = (
        jax.jit(jax.value_and_grad(jaxamp.autocast(f, recipe), argnums=(0, 1)))(x, w)
        for f in (two, merged)
    )
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=0)


def test_conv_tensorwise_forward_and_gradients():
    x, w = _rand(16, (2, 3, 9, 9)), _rand(17, (4, 3, 3, 3), 0.2)
    g = _rand(18, (2, 4, 9, 9))

    def conv(x, w):
        return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME")

    f = jax.jit(jaxamp.autocast(conv, "mixed_float8"))
    qx = ref.tensorwise_dequantized(x, ref.E4M3, False)
    qw = ref.tensorwise_dequantized(w, ref.E4M3, False)
    with jax.default_matmul_precision("highest"):
        want = np.asarray(conv(qx.astype(np.float32), qw.astype(np.float32)))
        assert_bf16_of(f(x, w), want)
        g16 = g.astype(ml_dtypes.bfloat16).astype(np.float32)
        qg = ref.tensorwise_dequantized(g16, ref.E5M2, False).astype(np.float32)
        _, pull = jax.vjp(conv, qx.astype(np.float32), qw.astype(np.float32))
        want_dx, want_dw = pull(qg)
        dx, dw = jax.jit(jax.grad(lambda x, w: jnp.sum(f(x, w) * g), argnums=(0, 1)))(x, w)
    assert_f32_of(dx, want_dx)
    assert_f32_of(dw, want_dw)


@pytest.mark.parametrize("recipe", ["mixed_float8", jaxamp.Float8Recipe("blockwise")])
def test_jaxpr_and_lowered_program_show_fp8_dots_accumulating_in_float32(recipe):
    x, w = jnp.ones((16, 256)), jnp.ones((256, 32))
    mm = jaxamp.autocast(lambda x, w: x @ w, recipe)
    f = jax.value_and_grad(lambda x, w: jnp.sum(mm(x, w)), (0, 1))
    report = jaxamp.precision_report(f, x, w)
    pairs = {(m.operand_dtypes, m.accumulation_dtype) for m in report.matmuls}
    assert pairs == {
        (("float8_e4m3fn", "float8_e4m3fn"), "float32"),
        (("float8_e5m2", "float8_e4m3fn"), "float32"),
    }
    text = jax.jit(f).lower(x, w).as_text()
    dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
    assert len(dots) == 3
    assert all("f8E4M3FN" in d and "xf32>" in d.split("->")[-1] for d in dots)
    assert sum("f8E5M2" in d for d in dots) == 2


def test_mixed_float8_is_the_default_recipe_and_recipes_compare_by_value():
    x, w = _rand(19, (4, 32)), _rand(20, (32, 8))
    a = _matmul("mixed_float8")(x, w)
    b = _matmul(jaxamp.Float8Recipe())(x, w)
    assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    r = jaxamp.Float8Recipe("rowwise", power_of_two_scale=True)
    assert r == jaxamp.Float8Recipe("rowwise", power_of_two_scale=np.bool_(True))
    assert len({r, jaxamp.Float8Recipe("rowwise", power_of_two_scale=True)}) == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.scaling = "tensorwise"


def test_everything_but_the_matmuls_runs_as_mixed_bfloat16():
    def fn(x, w):
        h = x @ w
        return jax.nn.log_softmax(jnp.tanh(h) + 1.0), jnp.exp(x).sum()

    x, w = _rand(21, (4, 32)), _rand(22, (32, 8))
    fp8 = jaxamp.precision_report(jaxamp.autocast(fn, "mixed_float8"), x, w)
    bf16 = jaxamp.precision_report(jaxamp.autocast(fn, "mixed_bfloat16"), x, w)
    for name in ("tanh", "exp", "log", "exp2", "logistic"):
        if name not in bf16.op_dtypes:
            continue
        assert fp8.op_dtypes[name] == bf16.op_dtypes[name], name
    outs = jax.eval_shape(jaxamp.autocast(fn, "mixed_float8"), x, w)
    assert [o.dtype for o in outs] == [jnp.float32, jnp.float32]
    # A matmul that cannot run in FP8 (integer operands) follows as before.
    ints = jaxamp.autocast(lambda a, b: a @ b, "mixed_float8")(
        jnp.ones((2, 2), jnp.int32), jnp.ones((2, 2), jnp.int32)
    )
    assert ints.dtype == jnp.int32


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"scaling": "colwise"}, ValueError, ["scaling", "'colwise'", "'rowwise'"]),
        ({"forward_dtype": jnp.bfloat16}, TypeError, ["forward_dtype", "float8_e4m3fn"]),
        ({"gradient_dtype": "int8"}, TypeError, ["gradient_dtype", "float8_e5m2"]),
        ({"compute_dtype": jnp.float32}, TypeError, ["compute_dtype", "16-bit", "bfloat16"]),
        ({"compute_dtype": jnp.float8_e4m3fn}, TypeError, ["compute_dtype"]),
        ({"power_of_two_scale": 1}, TypeError, ["power_of_two_scale", "True or False"]),
        ({"gemm": "cudnn"}, ValueError, ["gemm", "'cudnn'", "'native'", "'emulated'"]),
        ({"gemm": "native"}, ValueError, ["gemm='native'", "scaling='mxfp8'", "'tensorwise'"]),
        ({"reduce_dtype": jnp.float8_e4m3fn}, TypeError, ["reduce_dtype", "float32", "bfloat16"]),
    ],
)
def test_bad_recipe_fields_name_the_argument_and_the_fix(kwargs, error, words):
    with pytest.raises(error) as info:
        jaxamp.Float8Recipe(**kwargs)
    for word in words:
        assert word in str(info.value)


def test_precision_report_names_fp8_operands_recipe_and_share():
    def fn(x, w, k):
        h = jnp.tanh(x @ w)
        return jax.lax.conv_general_dilated(h[:, None, :, None], k, (1, 1), "SAME").sum()

    args = jnp.ones((8, 256)), jnp.ones((256, 64)), jnp.ones((4, 1, 3, 1))
    recipe = jaxamp.Float8Recipe("rowwise", power_of_two_scale=True)
    report = jaxamp.precision_report(jax.grad(jaxamp.autocast(fn, recipe), (0, 1, 2)), *args)
    rows = {(m.primitive, m.operand_dtypes, m.fp8_recipe) for m in report.matmuls}
    e4, e5, bf = "float8_e4m3fn", "float8_e5m2", "bfloat16"
    assert rows == {
        ("dot_general", (e4, e4), "rowwise+pow2"),
        ("dot_general", (e5, e4), "rowwise+pow2"),
        ("conv_general_dilated", (e4, e4), "tensorwise+pow2"),
        # lax.conv_general_dilated takes one operand dtype: e5m2 x e4m3 widened.
        ("conv_general_dilated", (bf, bf), "tensorwise+pow2"),
    }
    fp8_flops = sum(m.flops for m in report.matmuls if m.operand_dtypes[0] != bf)
    assert report.fp8_fraction == fp8_flops / report.total_flops
    assert str(report).splitlines()[-1] == (
        f"FP8: {100 * report.fp8_fraction:.1f}% of FLOPs (rowwise+pow2, tensorwise+pow2)"
    )
    plain = jaxamp.precision_report(jaxamp.autocast(fn), *args)
    assert plain.fp8_fraction == 0.0 and not any(m.fp8_recipe for m in plain.matmuls)
    assert "FP8" not in str(plain)


def test_numerics_report_measures_each_fp8_quantization_as_one_op():
    x = np.ones((4, 16), np.float32)
    x[0, :4] = 1e-6  # below half the smallest e4m3 subnormal once scaled by 448
    w = np.full((16, 8), 0.5, np.float32)
    report = jaxamp.numerics_report(lambda w, x: jnp.sum(x @ w), w, x, policy="mixed_float8")
    casts = [op for op in report.ops if op.primitive == "convert_element_type"]
    fp8 = [op for op in casts if np.dtype(op.dtype) == np.dtype(jnp.float8_e4m3fn)]
    assert sorted((op.shape[2], op.underflow_fraction, op.max_abs) for op in fp8) == [
        (4, 4 / 64, 448.0),  # x: 4 of its 64 values flush to zero
        (8, 0.0, 448.0),  # w: 0.5 everywhere, exact at scale 896
    ]
    # A quantization is measured as one op, by its float8 output: its amaxes and
    # scales are steps, not sites; each amax is the max_abs of the value quantized.
    assert not [op for op in report.ops if op.primitive in ("reduce_max", "div", "abs")]
    quantized = sorted(op.max_abs for op in report.ops if op.shape in [(1, 4, 16), (1, 8, 16)])
    assert quantized[:2] == [0.5, 1.0]


@pytest.mark.parametrize(
    ("peak", "power_of_two", "x_saturated"),
    [
        (4.0, False, 2 / 64),  # current scaling maps exactly the amax values onto 448
        (4.0, True, 0.0),  # 2**floor(log2(448 / 4)) = 64: the peak lands on 256
        (3.5, True, 2 / 64),  # 448 / 3.5 = 128 is a power of two: the peak lands on 448
    ],
)
def test_numerics_report_shows_the_saturated_fraction_of_each_fp8_operand(
    peak, power_of_two, x_saturated
):
    x = np.ones((4, 16), np.float32)
    x[1, 3], x[2, 5] = peak, -peak  # the two values at the amax, both signs
    w = np.full((16, 8), 0.5, np.float32)
    recipe = jaxamp.Float8Recipe(power_of_two_scale=power_of_two)
    report = jaxamp.numerics_report(lambda w, x: jnp.sum(x @ w), w, x, policy=recipe)
    e4m3 = np.dtype(jnp.float8_e4m3fn)
    casts = [op for op in report.ops if op.primitive == "convert_element_type"]
    fp8 = sorted((op.shape[2], op.saturated_fraction) for op in casts if op.dtype == e4m3)
    # w is 0.5 everywhere: every value is its amax (scale 896, or 512 -> 256 with pow2)
    assert fp8 == [(4, x_saturated), (8, 0.0 if power_of_two else 1.0)]
    assert all(op.saturated_fraction == 0.0 for op in report.ops if op.dtype != e4m3)


def test_saturated_fraction_is_zero_for_a_value_at_a_16_bit_dtypes_max():
    x = np.full((8,), 32752, np.float16)  # * 2 = 65504, float16's largest finite value
    report = jaxamp.numerics_report(lambda x: jnp.sum(x * np.float16(2)), x)
    (mul,) = [op for op in report.ops if op.primitive == "mul"]
    assert (mul.headroom, mul.saturated_fraction) == (1.0, 0.0)


class _Gpu:
    platform, device_kind = "gpu", "NVIDIA GPU"

    def __init__(self, capability):
        self.compute_capability = capability


def test_policy_for_device_says_where_fp8_pays_and_that_a_cpu_emulates_it():
    _, cpu = jaxamp.policy_for_device(jax.devices("cpu")[0], with_reason=True)
    assert "'mixed_float8'" in cpu and "emulated" in cpu
    for capability, has_fp8 in (("9.0", True), ("8.9", True), ("8.6", False), ("8.0", False)):
        policy, reason = jaxamp.policy_for_device(_Gpu(capability), with_reason=True)
        assert policy == jaxamp.get_policy("mixed_bfloat16")
        assert ("FP8 Tensor Cores" in reason) == has_fp8, capability
    for capability, native_mx in (("10.0", True), ("12.0", True), ("9.0", False)):
        _, reason = jaxamp.policy_for_device(_Gpu(capability), with_reason=True)
        assert ("jax.nn.scaled_matmul" in reason) == native_mx, capability
