"""jaxamp.autocast: numerics against float32, dtypes in the jaxpr, float32 exact, bad arguments."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp
from tests.helpers import rel_err

BF16, F16, F32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)


def _normal(key, shape, scale=1.0):
    return scale * jax.random.normal(key, shape, jnp.float32)


# -- three tiny models written in float32 -------------------------------------------


def mlp_init(key):
    k = jax.random.split(key, 3)
    return {
        "w1": _normal(k[0], (12, 32), 0.3),
        "b1": _normal(k[1], (32,), 0.1),
        "w2": _normal(k[2], (32, 5), 0.2),
        "b2": jnp.zeros(5),
    }


def mlp(p, x):
    h = jax.nn.gelu(x @ p["w1"] + p["b1"])
    return h @ p["w2"] + p["b2"]


def cnn_init(key):
    k = jax.random.split(key, 3)
    return {
        "c1": _normal(k[0], (3, 3, 3, 8), 0.3),
        "c2": _normal(k[1], (3, 3, 8, 8), 0.2),
        "w": _normal(k[2], (8, 4), 0.3),
    }


def cnn(p, x):
    dn = ("NHWC", "HWIO", "NHWC")
    h = jax.nn.relu(jax.lax.conv_general_dilated(x, p["c1"], (1, 1), "SAME", dimension_numbers=dn))
    h = jax.nn.relu(jax.lax.conv_general_dilated(h, p["c2"], (2, 2), "SAME", dimension_numbers=dn))
    return h.mean(axis=(1, 2)) @ p["w"]


def block_init(key, d=16, heads=2):
    k = jax.random.split(key, 6)
    return {
        "wq": _normal(k[0], (d, d), d**-0.5),
        "wk": _normal(k[1], (d, d), d**-0.5),
        "wv": _normal(k[2], (d, d), d**-0.5),
        "wo": _normal(k[3], (d, d), d**-0.5),
        "w1": _normal(k[4], (d, 4 * d), d**-0.5),
        "w2": _normal(k[5], (4 * d, d), (4 * d) ** -0.5),
        "g1": jnp.ones(d),
        "g2": jnp.ones(d),
        "bias": jnp.zeros(d),
    }


def layer_norm(x, g, b):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * g + b


def block(p, x, heads=2):
    b, t, d = x.shape

    def split(y):
        return y.reshape(b, t, heads, d // heads)

    h = layer_norm(x, p["g1"], p["bias"])
    q, k, v = split(h @ p["wq"]), split(h @ p["wk"]), split(h @ p["wv"])
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(jnp.float32(d // heads))
    attn = jax.nn.softmax(scores, axis=-1)
    x = x + jnp.einsum("bhqk,bkhd->bqhd", attn, v).reshape(b, t, d) @ p["wo"]
    h = layer_norm(x, p["g2"], p["bias"])
    return x + jax.nn.gelu(h @ p["w1"]) @ p["w2"]


def block_loss(p, x):
    y = block(p, x)
    return jax.nn.log_softmax(y, axis=-1)[..., 0].mean()


MODELS = {
    "mlp": (mlp_init, mlp, (6, 12)),
    "cnn": (cnn_init, cnn, (2, 8, 8, 3)),
    "block": (block_init, block, (2, 8, 16)),
}


def _model(name):
    init, apply, shape = MODELS[name]
    kp, kx = jax.random.split(jax.random.key(sum(map(ord, name))))
    return apply, init(kp), jax.random.normal(kx, shape, jnp.float32)


def _loss(apply):
    return lambda p, x: jnp.mean(jnp.square(apply(p, x)))


@functools.cache
def _float32_reference(name):
    apply, params, x = _model(name)
    return jax.jit(lambda p, x: (apply(p, x), jax.grad(_loss(apply))(p, x)))(params, x)


def _hand_cast_grads(apply, params, x, dtype):
    # The reference a careful user would write by hand: params and inputs cast to
    # 16 bits, the loss (a mean of squares) computed in float32.
    def cast_loss(p, x):
        out = apply(jaxamp.cast_floating(p, dtype), x.astype(dtype))
        return jnp.mean(jnp.square(out.astype(jnp.float32)))

    with jax.numpy_dtype_promotion("standard"):
        return jax.jit(jax.grad(cast_loss))(params, x)


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize(("policy", "tol"), [("mixed_bfloat16", 2e-2), ("mixed_float16", 3e-3)])
def test_outputs_and_grads_match_float32(name, policy, tol):
    apply, params, x = _model(name)
    loss = _loss(apply)
    want_out, want_grads = _float32_reference(name)
    out_and_grads = jax.jit(
        lambda p, x: (
            jaxamp.autocast(apply, policy)(p, x),
            jax.grad(jaxamp.autocast(loss, policy))(p, x),
        )
    )
    got_out, got_grads = out_and_grads(params, x)
    hand = _hand_cast_grads(apply, params, x, jaxamp.get_policy(policy).compute_dtype)
    assert got_out.dtype == F32
    assert 0 < rel_err(got_out, want_out) < tol  # > 0: the 16-bit rounding is real
    for key in params:
        assert got_grads[key].dtype == F32
        err = rel_err(got_grads[key], want_grads[key])
        # Gradients through several 16-bit layers (max-norm relative error): within
        # 5x the output tolerance, and no worse than casting everything by hand.
        assert err < 5 * tol, key
        assert err <= 1.25 * rel_err(hand[key], want_grads[key]) + tol / 10, key


@pytest.mark.parametrize("name", sorted(MODELS))
def test_float32_policy_is_bit_identical(name):
    apply, params, x = _model(name)
    loss = _loss(apply)
    f = jaxamp.autocast(loss, "float32")
    want_loss, want_grads = jax.jit(jax.value_and_grad(loss))(params, x)
    got_loss, got_grads = jax.jit(jax.value_and_grad(f))(params, x)
    np.testing.assert_array_equal(got_loss, want_loss)
    for key in params:
        np.testing.assert_array_equal(got_grads[key], want_grads[key])
    assert str(jax.make_jaxpr(f)(params, x)).count("bf16") == 0


def _eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _eqns(inner)


def test_activations_stay_in_compute_dtype_and_sensitive_ops_in_float32():
    _, params, x = _model("block")
    jaxpr = jax.make_jaxpr(jaxamp.autocast(block_loss))(params, x).jaxpr
    by_name: dict[str, set] = {}
    for eqn in _eqns(jaxpr):
        for var in eqn.outvars:
            by_name.setdefault(eqn.primitive.name, set()).add(var.aval.dtype)
    # Matmuls accumulate in float32; their results are cast to bfloat16.
    for eqn in _eqns(jaxpr):
        if eqn.primitive.name == "dot_general":
            assert {v.aval.dtype for v in eqn.invars} == {BF16}
            assert eqn.params["preferred_element_type"] == F32
    # Precision-sensitive ops run in float32 only.
    for name in ("exp", "log", "rsqrt", "reduce_sum"):
        assert by_name[name] == {F32}, name
    # The elementwise ops between matmuls (gelu's tanh and cube) stay 16-bit; the
    # layer norm's square of (x - float32 mean) stays float32.
    assert by_name["tanh"] == {BF16}
    assert by_name["integer_pow"] == {BF16, F32}


def test_bias_follows_activation_and_loss_stays_float32():
    def f(w, b, x):
        y = x @ w + b  # a float32 bias meets a bfloat16 activation
        return y, jax.nn.log_softmax(y)

    w, b, x = jnp.ones((4, 3)), jnp.ones(3), jnp.ones((2, 4))
    policy = jaxamp.Policy(jnp.float32, jnp.bfloat16, jnp.bfloat16)
    jaxpr = jax.make_jaxpr(jaxamp.autocast(f, policy))(w, b, x).jaxpr
    adds = [e for e in jaxpr.eqns if e.primitive.name == "add"]
    assert [e.outvars[0].aval.dtype for e in adds] == [BF16]
    y, logp = jaxamp.autocast(f, policy)(w, b, x)
    assert y.dtype == BF16 and logp.dtype == BF16  # output dtype of this policy
    # log_softmax ran in float32: its subtraction of the float32 normaliser did too.
    subs = [e.outvars[0].aval.dtype for e in _eqns(jaxpr) if e.primitive.name == "sub"]
    assert F32 in subs


def test_integer_and_bool_values_are_untouched():
    def f(w, x, idx, mask):
        h = (x @ w)[idx]
        counts = jnp.cumsum(idx) * 3  # integer cumsum: a float32 rule never casts ints
        return jnp.where(mask, h, 0.0).sum(), counts, mask & (idx > 0)

    w, x = jnp.ones((4, 3)), jnp.ones((5, 4))
    idx, mask = jnp.array([0, 2, 4], jnp.int32), jnp.array([True, False, True])
    total, counts, m = jax.jit(jaxamp.autocast(f))(w, x, idx, mask)
    assert counts.dtype == jnp.int32 and m.dtype == jnp.bool_
    np.testing.assert_array_equal(counts, jnp.cumsum(idx) * 3)
    assert float(total) == 24.0


def test_composes_with_vmap_jit_and_value_and_grad():
    apply, params, x = _model("mlp")
    loss = _loss(apply)
    per_example = jax.jit(jax.vmap(jaxamp.autocast(loss), in_axes=(None, 0)))(params, x[:, None])
    one = jax.jit(jaxamp.autocast(loss))
    direct = jnp.stack([one(params, x[i : i + 1]) for i in range(x.shape[0])])
    # Batched and one-by-one runs compile to different kernels: equal to bf16 rounding.
    np.testing.assert_allclose(per_example, direct, rtol=1e-2)
    vmapped = jax.vmap(jaxamp.autocast(loss), in_axes=(None, 0))
    report = jaxamp.precision_report(vmapped, params, x[:, None])
    assert report.fraction_in(jnp.bfloat16) == 1.0
    value, grads = jax.jit(jax.value_and_grad(jaxamp.autocast(loss)))(params, x)
    assert value.dtype == F32 and rel_err(value, loss(params, x)) < 4e-2
    # grad inside autocast (the backward pass is rewritten too).
    inner = jax.jit(jaxamp.autocast(jax.grad(loss)))(params, x)
    for key in params:
        assert inner[key].dtype == F32
        assert rel_err(inner[key], grads[key]) < 4e-2


def test_pytree_and_static_arguments():
    def f(params, x, *, scale, name):
        assert isinstance(scale, float) and name == "ok"  # static leaves stay Python
        return {"out": x @ params["w"] * scale, "n": jnp.int32(3)}

    out = jaxamp.autocast(f)({"w": jnp.ones((4, 2))}, jnp.ones((3, 4)), scale=2.0, name="ok")
    assert out["out"].dtype == F32 and out["n"].dtype == jnp.int32
    np.testing.assert_array_equal(out["out"], jnp.full((3, 2), 8.0))


def test_explicit_casts_in_hand_written_mixed_code_are_kept():
    def f(w, x):
        h = x.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16)  # already mixed by hand
        return jnp.tanh(h.astype(jnp.float32))  # an explicit upcast: the tanh stays float32

    w, x = jnp.ones((4, 3)), jnp.ones((2, 4))
    jaxpr = jax.make_jaxpr(jaxamp.autocast(f))(w, x).jaxpr
    assert [e.outvars[0].aval.dtype for e in _eqns(jaxpr) if e.primitive.name == "tanh"] == [F32]
    dots = [e for e in _eqns(jaxpr) if e.primitive.name == "dot_general"]
    assert [d.params["preferred_element_type"] for d in dots] == [F32]  # now accumulates in f32
    np.testing.assert_allclose(jaxamp.autocast(f)(w, x), f(w, x), rtol=1e-6)


def test_bad_arguments_are_named_in_the_error():
    with pytest.raises(TypeError, match="fun must be callable"):
        jaxamp.autocast(3)
    with pytest.raises(ValueError, match="invalid policy spec"):
        jaxamp.autocast(jnp.sin, "mixed_bf17")
    with pytest.raises(ValueError, match=r"rules\['exp'\] must be one of"):
        jaxamp.autocast(jnp.sin, rules={"exp": "fast"})
    with pytest.raises(ValueError, match="'recurse' needs a built-in handler"):
        jaxamp.autocast(jnp.sin, rules={"my_loop": "recurse"})
    with pytest.raises(TypeError, match="rules keys must be jax primitives"):
        jaxamp.autocast(jnp.sin, rules={3: "keep"})
    with pytest.raises(TypeError, match="rules must be a mapping"):
        jaxamp.autocast(jnp.sin, rules=["exp"])
    with pytest.raises(TypeError, match=r"rules\['exp'\] must be a rule name or a callable"):
        jaxamp.autocast(jnp.sin, rules={"exp": 1})
    for bad in (0, -8, 2.5, True, "big"):
        with pytest.raises(ValueError, match="pad_to must be None, 'auto'"):
            jaxamp.autocast(jnp.sin, pad_to=bad)


def test_the_returned_wrapper_behaves_like_the_function_it_wraps():
    import inspect

    def layer(w, x, *, bias=1.0):
        """Docs."""
        return x @ w + bias

    fast = jaxamp.autocast(layer)
    assert fast.__name__ == "layer" and fast.__doc__ == "Docs." and fast.__wrapped__ is layer
    assert inspect.signature(fast) == inspect.signature(layer)

    class Model:
        apply = jaxamp.autocast(lambda self, x: x @ self.w)
        w = jnp.ones((3, 2))

    assert Model().apply(jnp.ones((1, 3))).dtype == jnp.float32
    with pytest.raises(TypeError, match="not a context manager"), fast:
        pass
