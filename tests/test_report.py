"""precision_report, the jaxamp.testing matmul helpers, and autocast's Tensor Core padding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp
from jaxamp.testing import assert_matmuls_aligned, assert_matmuls_in

DN = ("NHWC", "HWIO", "NHWC")


def test_dot_shapes_flops_dtypes_and_alignment():
    def f(x, w):
        return jnp.einsum("bmk,kn->bmn", x, w)

    report = jaxamp.precision_report(f, jnp.ones((3, 16, 12)), jnp.ones((12, 10)))
    (m,) = report.matmuls
    assert (m.lhs_shape, m.rhs_shape, m.out_shape) == ((3, 16, 12), (12, 10), (3, 16, 10))
    assert m.flops == 2 * 3 * 16 * 10 * 12
    assert m.dims == {"M": 48, "N": 10, "K": 12}
    assert m.operand_dtypes == ("float32", "float32") and m.accumulation_dtype == "float32"
    assert m.multiple == 4  # float32 (tf32) needs multiples of 4
    assert m.aligned == {"M": True, "N": False, "K": True}
    assert report.flops_by_dtype == {"float32": m.flops} and report.total_flops == m.flops
    assert report.misaligned == (m,)

    bf = jaxamp.precision_report(
        f, jnp.ones((3, 16, 12), jnp.bfloat16), jnp.ones((12, 10), jnp.bfloat16)
    )
    assert bf.matmuls[0].multiple == 8
    assert bf.matmuls[0].aligned == {"M": True, "N": False, "K": False}


def test_batched_dot_and_conv_flops():
    def attn(q, k):
        return jnp.einsum("bqhd,bkhd->bhqk", q, k)

    q = jax.ShapeDtypeStruct((2, 8, 4, 16), jnp.float16)  # abstract arguments are enough
    (m,) = jaxamp.precision_report(attn, q, q).matmuls
    assert m.flops == 2 * (2 * 4) * 8 * 8 * 16 and m.dims == {"M": 8, "N": 8, "K": 16}

    def conv(x, k):
        return jax.lax.conv_general_dilated(x, k, (1, 1), "VALID", dimension_numbers=DN)

    (c,) = jaxamp.precision_report(conv, jnp.ones((2, 9, 9, 3)), jnp.ones((3, 3, 3, 16))).matmuls
    assert c.out_shape == (2, 7, 7, 16)
    assert c.flops == 2 * (2 * 7 * 7 * 16) * 3 * (3 * 3)
    assert c.dims == {"C_in": 3, "C_out": 16}
    assert c.aligned == {"C_in": False, "C_out": True}


def test_scan_multiplies_flops_and_nested_calls_are_found():
    w = jnp.ones((8, 8))

    def f(xs):
        def body(h, x):
            return jax.jit(lambda h: jnp.tanh(h @ w))(h + x), None

        return jax.lax.scan(body, jnp.zeros((4, 8)), xs)[0]

    (m,) = jaxamp.precision_report(f, jnp.ones((5, 4, 8))).matmuls
    assert m.count == 5 and m.flops == 5 * 2 * 4 * 8 * 8


def test_autocast_report_is_all_compute_dtype_with_float32_rule_ops_in_float32():
    def model(w1, w2, x):
        h = jax.nn.gelu(x @ w1)
        logits = h @ w2
        mean = logits.mean(-1, keepdims=True)
        var = ((logits - mean) ** 2).mean(-1, keepdims=True)
        return jax.nn.log_softmax((logits - mean) * jax.lax.rsqrt(var + 1e-5)).sum()

    args = (jnp.ones((16, 32)), jnp.ones((32, 8)), jnp.ones((4, 16)))
    for fun in (jaxamp.autocast(model), jax.grad(jaxamp.autocast(model), argnums=(0, 1))):
        report = assert_matmuls_in(fun, args, jnp.bfloat16, accumulation=jnp.float32)
        assert report.fraction_in(jnp.bfloat16) == 1.0
        float32_ops = [op for op in report.op_dtypes if jaxamp.AUTOCAST_RULES.get(op) == "float32"]
        assert {"exp", "log", "rsqrt", "reduce_sum"} <= set(float32_ops)
        for op in float32_ops:
            assert set(report.op_dtypes[op]) == {"float32"}, op
    # The plain function fails the same check, naming the float32 matmuls.
    with pytest.raises(
        AssertionError, match=r"(?s)0\.0% of matmul FLOPs have bfloat16.*dot_general"
    ):
        assert_matmuls_in(model, args, jnp.bfloat16)


def test_str_is_a_table():
    f = jaxamp.autocast(lambda w, x: x @ w)
    text = str(jaxamp.precision_report(f, jnp.ones((12, 16)), jnp.ones((8, 12))))
    lines = text.splitlines()
    assert lines[0].split()[:7] == ["op", "lhs", "rhs", "operands", "accum", "out", "FLOPs"]
    assert lines[1].split()[:7] == ["dot", "8x12", "12x16", "bf16/bf16", "f32", "f32", "3.07K"]
    assert "K=12*" in lines[1] and "M=8 " in lines[1]
    assert lines[-1] == "1 matmul/conv ops, 3.07K FLOPs (bf16 100.0%); 1 with a misaligned dim"


def _mlp(p, x):
    return jax.nn.relu(x @ p["w1"]) @ p["w2"]


def _cnn(p, x):
    h = jax.lax.conv_general_dilated(x, p["k"], (1, 1), "SAME", dimension_numbers=DN)
    return jax.nn.relu(h).mean((1, 2)) @ p["w"]


PAD_CASES = {
    "mlp": (_mlp, {"w1": (13, 27), "w2": (27, 5)}, (6, 13)),
    "cnn": (_cnn, {"k": (3, 3, 3, 5), "w": (5, 3)}, (2, 6, 6, 3)),
}


@pytest.mark.parametrize("name", sorted(PAD_CASES))
@pytest.mark.parametrize("policy", ["mixed_bfloat16", "float32"])
def test_padding_aligns_every_dim_and_keeps_results(name, policy):
    fun, shapes, x_shape = PAD_CASES[name]
    keys = jax.random.split(jax.random.key(0), len(shapes) + 1)
    params = {
        k: jax.random.normal(key, s) for (k, s), key in zip(shapes.items(), keys, strict=False)
    }
    x = jax.random.normal(keys[-1], x_shape)
    plain = jaxamp.autocast(fun, policy)
    padded = jaxamp.autocast(fun, policy, pad_to="auto")
    with pytest.raises(AssertionError, match="misaligned matmuls"):
        assert_matmuls_aligned(plain, (params, x))
    report = assert_matmuls_aligned(padded, (params, x))
    multiple = jaxamp.tensor_core_multiple(jaxamp.get_policy(policy).compute_dtype)
    assert {m.multiple for m in report.matmuls} == {multiple}
    if name == "mlp":
        # Also in the backward pass. (A conv's weight-gradient conv has the batch
        # size as its channel dims, which padding channels cannot align.)
        assert_matmuls_aligned(jax.grad(lambda p, x: padded(p, x).sum()), (params, x))
    # Zero padding adds exact zeros: the same sums, though the backend may block
    # a padded float32 sum differently (K=27 -> 32): equal to the rounding of a
    # length-32 float32 sum, 32 * 2**-24 relative to the largest result.
    out_pad, out_plain = jax.jit(padded)(params, x), jax.jit(plain)(params, x)
    tol = 32 * 2.0**-24
    np.testing.assert_allclose(out_pad, out_plain, rtol=tol, atol=tol * np.abs(out_plain).max())
    if name != "mlp":
        return  # (compile time: the gradients are compared on the MLP)
    g_pad = jax.jit(jax.grad(lambda p, x: padded(p, x).sum()))(params, x)
    g_plain = jax.jit(jax.grad(lambda p, x: plain(p, x).sum()))(params, x)
    for key in params:
        assert g_pad[key].shape == params[key].shape
        np.testing.assert_allclose(g_pad[key], g_plain[key], rtol=1e-6, atol=1e-6)


def test_bad_arguments():
    with pytest.raises(TypeError, match="fun must be callable"):
        jaxamp.precision_report("f", jnp.ones(2))
