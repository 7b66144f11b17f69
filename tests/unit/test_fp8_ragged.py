"""FP8 ``ragged_dot`` (mixture of experts): the dense recipe applied expert by expert.

The oracle of every product is the dense FP8 product of each group's rows with
its expert's weights (``autocast(x @ w, recipe)`` per group), and the
independent NumPy reference of tests/fp8_reference.py per group. Group sizes
are traced: one compile serves every split of the rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxamp
from jaxamp import _fp8
from jaxamp._engine._visit import walk
from tests import fp8_reference as ref
from tests.unit.test_fp8 import assert_bf16_of, assert_f32_of

SCALINGS = _fp8.names("fp8")
E4, E5 = "float8_e4m3fn", "float8_e5m2"
# An empty group in the middle and at the end. Rows and contracting dims span
# several blocks of the scaling (blockwise: 128, mxfp8: 32, the last partial),
# so that the weight gradient's tiles along the rows split within a group.
SIZES = np.array([70, 0, 40, 0], np.int32)
M, K, N = int(SIZES.sum()), 72, 16
BLOCKWISE_SIZES, BLOCKWISE_K = np.array([130, 0, 70, 0], np.int32), 160


def _data(m=M, k=K):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(m, k)).astype(np.float32)
    x[5:8] *= 40  # outlier rows in group 0: a scale shared across groups shows
    w = (rng.normal(size=(len(SIZES), k, N)) * 0.05).astype(np.float32)
    w[2] *= 20  # an expert with another scale
    g = rng.normal(size=(m, N)).astype(np.float32)
    return x, w, g


def assert_same_rounding(got, want):
    """Equal but for a float32 sum rounded the other way to bfloat16 (at most one ulp)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    differ = got != want
    assert differ.mean() < 0.01, differ.mean()
    assert np.all(np.abs(got - want) <= 2.0**-7 * np.abs(want)), np.abs(got - want).max()


def _ragged(recipe):
    return jaxamp.autocast(lambda x, w, s: jax.lax.ragged_dot(x, w, s), recipe)


# Compiled with XLA's cheapest settings: these programs are tested for their
# values (IEEE float32 products and scales), not their speed.
_FAST = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _pullback(f, x, w, g, *rest):
    out, pullback = jax.vjp(lambda x, w: f(x, w, *rest), x, w)
    return (out, *pullback(g.astype(out.dtype)))


def _value_and_grads(f):
    """``(f(x, w, *rest), dx, dw)`` for the output gradient ``g``."""
    return jax.jit(lambda x, w, g, *rest: _pullback(f, x, w, g, *rest), compiler_options=_FAST)


def _groups(sizes):
    ends = np.cumsum(sizes)
    return [
        (i, int(end - size), int(end))
        for i, (size, end) in enumerate(zip(sizes, ends, strict=True))
    ]


def _ragged_and_dense(recipe, sizes):
    """The ragged product, and the dense one on each group's rows with its expert's weights."""
    dense = jaxamp.autocast(lambda x, w: x @ w, recipe)

    def run(x, w, g, sizes_arg):
        per_expert = [_pullback(dense, x[a:b], w[e], g[a:b]) for e, a, b in _groups(sizes) if a < b]
        return _pullback(_ragged(recipe), x, w, g, sizes_arg), per_expert

    return jax.jit(run, compiler_options=_FAST)


@pytest.mark.parametrize("scaling", SCALINGS)
def test_forward_and_gradients_are_the_dense_recipe_expert_by_expert(scaling):
    sizes, k = (BLOCKWISE_SIZES, BLOCKWISE_K) if scaling == "blockwise" else (SIZES, K)
    x, w, g = _data(int(sizes.sum()), k)
    recipe = jaxamp.Float8Recipe(scaling)
    ragged, dense = _ragged_and_dense(recipe, sizes)(x, w, g, sizes)
    out, dx, dw = (np.asarray(v) for v in ragged)
    dense = iter(dense)
    g16 = g.astype(ml_dtypes.bfloat16).astype(np.float32)  # the cotangent the product sees
    for e, start, end in _groups(sizes):
        rows = slice(start, end)
        if start == end:  # an empty expert: no rows, a zero weight gradient
            np.testing.assert_array_equal(dw[e], 0)
            continue
        want_out, want_dx, want_dw = (np.asarray(v) for v in next(dense))
        # The same quantized operands and float32 products, summed in XLA's
        # order: the forward within one bfloat16 rounding, the gradients to
        # float32 accuracy (the weight gradient sums its tiles along the rows).
        assert_same_rounding(out[rows], want_out)
        for got, want in ((dx[rows], want_dx), (dw[e], want_dw)):
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * np.abs(want).max())
        # The independent reference, group by group.
        assert_bf16_of(out[rows], ref.forward(x[rows], w[e], scaling))
        ref_dx, ref_dw = ref.gradients(x[rows], w[e], g16[rows], scaling)
        assert_f32_of(dx[rows], ref_dx)
        assert_f32_of(dw[e], ref_dw)
    if scaling == "tensorwise":
        # One scale per group of rows: quantized with the outlier rows of group
        # 0 (one scale for all of x), group 2's product would be far coarser.
        _, start, end = _groups(sizes)[2]
        own = out[start:end] - ref.forward(x[start:end], w[2], scaling)
        shared = out[start:end] - ref.forward(x, w[2], scaling)[start:end]
        assert np.abs(shared).max() > 10 * np.abs(own).max()


def test_a_weight_computed_from_an_activation_is_an_activation_blockwise():
    # Only a parameter (or input) is a weight: one computed from an activation
    # (here times a product's result, 1) takes the activations' 1x128 tiles
    # instead of 128x128 weight tiles, as in a dense product.
    sizes, k = BLOCKWISE_SIZES, BLOCKWISE_K
    x, w, _ = _data(int(sizes.sum()), k)
    w = w.astype(ml_dtypes.bfloat16).astype(np.float32)  # exact in the compute dtype
    one = np.ones((1, 1), np.float32)
    recipe = jaxamp.Float8Recipe("blockwise")
    computed = jaxamp.autocast(
        lambda x, w, c, s: jax.lax.ragged_dot(x, w * (c @ c)[0, 0], s), recipe
    )
    dense = jaxamp.autocast(lambda x, w, c: x @ (w * (c @ c)[0, 0]), recipe)

    def run(x, w, c):
        per_expert = [dense(x[a:b], w[e], c) for e, a, b in _groups(sizes) if a < b]
        return computed(x, w, c, sizes), _ragged(recipe)(x, w, sizes), per_expert

    out, as_weight, per_expert = jax.jit(run, compiler_options=_FAST)(x, w, one)
    got = [np.asarray(out)[a:b] for _, a, b in _groups(sizes) if a < b]
    for got_e, want_e in zip(got, per_expert, strict=True):
        assert_same_rounding(got_e, want_e)
    assert np.abs(np.asarray(out) - np.asarray(as_weight)).max() > 1e-3


def test_rows_past_the_last_group_are_zero_and_get_no_gradient():
    x, w, g = _data()
    sizes = np.array([10, 0, 35, 0], np.int32)  # 45 of the 200 rows
    out, dx, _ = _value_and_grads(_ragged("mixed_float8"))(x, w, g, sizes)
    np.testing.assert_array_equal(np.asarray(out)[45:], 0)
    np.testing.assert_array_equal(np.asarray(dx)[45:], 0)
    assert np.abs(np.asarray(out)[:45]).min() > 0


def _ragged_dots(report):
    return {
        (m.operand_dtypes, m.accumulation_dtype, m.fp8_recipe)
        for m in report.matmuls
        if m.primitive == "ragged_dot_general"
    }


@pytest.mark.parametrize("scaling", SCALINGS)
def test_float8_operands_in_the_jaxpr_and_the_report(scaling):
    x, w, g = _data()
    f = _ragged(jaxamp.Float8Recipe(scaling))
    step = jax.grad(lambda x, w: jnp.sum(f(x, w, SIZES) * g), argnums=(0, 1))
    report = jaxamp.precision_report(step, x, w)
    assert _ragged_dots(report) == {
        ((E4, E4), "float32", scaling),  # forward
        ((E5, E4), "float32", scaling),  # both gradients: the gradient in e5m2
    }
    assert sum(m.primitive == "ragged_dot_general" for m in report.matmuls) == 3
    assert report.fp8_fraction == 1.0
    # Quantizations: x, w and the gradient once each where the scales do not
    # depend on the contracting dim (tensorwise: the backward products reuse
    # the forward's float8 operands); else each product quantizes its two,
    # except the weight, quantized once from the parameter: its rowwise codes
    # are contracted as they are (the scales folded into the gradient), its
    # blocks requantized from the codes.
    closed = jax.make_jaxpr(step)(x, w)
    casts = [
        eqn
        for eqn, _ in walk(closed.jaxpr)
        if eqn.primitive.name == "convert_element_type"
        and np.dtype(eqn.params["new_dtype"]).name in (E4, E5)
    ]
    assert len(casts) == {"tensorwise": 3, "rowwise": 5}.get(scaling, 6)


def test_mixed_bfloat16_and_other_ragged_forms_stay_16_bit():
    x, w, _ = _data()
    bf = "bfloat16"
    plain = jaxamp.precision_report(_ragged("mixed_bfloat16"), x, w, SIZES)
    assert _ragged_dots(plain) == {((bf, bf), "float32", "")}

    # A ragged contracting dim (the weight-gradient form, written by hand) is
    # not the mixture-of-experts form: it keeps the 16-bit product.
    numbers = jax.lax.RaggedDotDimensionNumbers((((0,), (0,)), ((), ())), (0,), ())
    contract = jaxamp.autocast(
        lambda a, b, s: jax.lax.ragged_dot_general(a, b, s, numbers), "mixed_float8"
    )
    report = jaxamp.precision_report(contract, x, np.ones((M, N), np.float32), SIZES)
    assert _ragged_dots(report) == {((bf, bf), "float32", "")}


def test_group_sizes_are_traced_one_compile_for_every_split():
    x, w, g = _data()
    traces = []

    def step(x, w, sizes):
        traces.append(None)
        f = _ragged("mixed_float8")
        return jax.value_and_grad(lambda w: jnp.sum(f(x, w, sizes) * g))(w)

    jitted = jax.jit(step)
    first = jitted(x, w, SIZES)
    other = jitted(x, w, np.array([0, 100, 50, 50], np.int32))
    assert len(traces) == 1
    assert not np.array_equal(first[0], other[0])


def test_a_top2_moe_layer_trains_under_mixed_float8():
    experts, d, hidden, tokens = 4, 16, 32, 16
    rng = np.random.default_rng(1)

    def normal(*shape, scale):
        return (rng.normal(size=shape) * scale).astype(np.float32)

    params = {
        "router": normal(d, experts, scale=0.1),
        "up": normal(experts, d, hidden, scale=d**-0.5),
        "down": normal(experts, hidden, d, scale=hidden**-0.5),
    }
    x = jnp.asarray(normal(tokens, d, scale=1.0))
    y = np.tanh(x @ normal(d, d, scale=d**-0.5))

    def moe(params, x):
        gates, chosen = jax.lax.top_k(jax.nn.softmax(x @ params["router"]), 2)
        expert = chosen.reshape(-1)  # each token twice, sorted by expert below
        order = jnp.argsort(expert)
        token = order // 2
        sizes = jnp.bincount(expert, length=experts).astype(jnp.int32)
        h = jax.nn.gelu(jax.lax.ragged_dot(x[token], params["up"], sizes))
        out = jax.lax.ragged_dot(h, params["down"], sizes) * gates.reshape(-1)[order][:, None]
        return jnp.zeros_like(x).at[token].add(out)

    def loss(params):
        return jnp.mean((moe(params, x) - y) ** 2)

    fp8_loss = jax.value_and_grad(jaxamp.autocast(loss, "mixed_float8"))
    report = jaxamp.precision_report(fp8_loss, params)
    fp8 = [m for m in report.matmuls if m.primitive == "ragged_dot_general" and m.fp8_recipe]
    assert len(fp8) == 6  # two layers, each forward and two gradient products

    def train_step(params):
        value, grads = fp8_loss(params)
        return value, jax.tree.map(lambda p, g: p - 0.5 * g, params, grads)

    step = jax.jit(train_step, compiler_options=_FAST)
    losses = []
    for _ in range(5):
        value, params = step(params)
        losses.append(float(value))
    assert np.all(np.isfinite(losses))
    assert np.all(np.diff(losses) < 0), losses
