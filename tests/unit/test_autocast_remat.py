"""autocast(..., remat_float32=True): only 16-bit values are saved for the backward pass.

And jax.checkpoint policies that name dots see autocast's matmuls.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp
from tests.helpers import assert_close, dot_dtypes, rel_err
from tests.unit.test_autocast import _float32_reference, _loss, _model

F32 = np.dtype(np.float32)


def _residuals(loss, params, x):
    """Shape and dtype of every value ``jax.vjp`` keeps for the backward pass."""
    return jax.tree.leaves(jax.eval_shape(lambda p: jax.vjp(lambda q: loss(q, x), p)[1], params))


def _bytes(leaves, dtype=None):
    return sum(
        int(np.prod(r.shape)) * r.dtype.itemsize
        for r in leaves
        if dtype is None or r.dtype == dtype
    )


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_no_float32_activation_is_saved(policy):
    apply, params, x = _model("block")
    loss = _loss(apply)
    plain = _residuals(jaxamp.autocast(loss, policy), params, x)
    remat = _residuals(jaxamp.autocast(loss, policy, remat_float32=True), params, x)
    compute = jaxamp.get_policy(policy).compute_dtype
    inputs = {tuple(v.shape) for v in jax.tree.leaves((params, x))}
    # Without remat the softmax, LayerNorm statistics and loss leave float32 arrays
    # behind, e.g. of the attention's shape (batch, heads, query, key)...
    assert any(r.dtype == F32 and r.shape == (2, 2, 8, 8) for r in plain)
    assert sum(r.dtype == F32 and r.shape not in inputs for r in plain) >= 5
    # ...with it, the only float32 arrays kept are the inputs themselves (params, x),
    # and the total shrinks.
    kept = [r.shape for r in remat if r.dtype == F32]
    assert kept and all(shape in inputs for shape in kept), kept
    assert _bytes(remat) < _bytes(plain)
    assert _bytes(remat, compute) >= _bytes(plain, compute)


@pytest.mark.parametrize(("policy", "tol"), [("mixed_bfloat16", 2e-2), ("mixed_float16", 3e-3)])
def test_grads_match_float32_like_without_remat(policy, tol):
    apply, params, x = _model("block")
    loss = _loss(apply)
    _, want = _float32_reference("block")
    without = jax.jit(jax.grad(jaxamp.autocast(loss, policy)))(params, x)
    with_remat = jax.jit(jax.grad(jaxamp.autocast(loss, policy, remat_float32=True)))(params, x)
    for key in params:
        assert with_remat[key].dtype == F32
        err = rel_err(with_remat[key], want[key])
        # The recomputation repeats the forward's operations on the same saved
        # values; XLA may fuse (and so round 16-bit chains) differently, no more.
        assert err < 5 * tol, key
        assert err <= 1.25 * rel_err(without[key], want[key]) + tol / 10, key


def test_float32_compute_dtype_makes_it_a_no_op():
    apply, params, x = _model("block")
    loss = _loss(apply)
    f = jaxamp.autocast(loss, "float32", remat_float32=True)
    assert "checkpoint" not in str(jax.make_jaxpr(f)(params, x))
    np.testing.assert_array_equal(jax.jit(f)(params, x), jax.jit(loss)(params, x))


def test_the_policy_saves_outputs_it_cannot_type():
    from jaxamp._autocast._remat import save_narrow_values

    f32 = jax.core.ShapedArray((4,), jnp.float32)
    bf16 = jax.core.ShapedArray((4,), jnp.bfloat16)
    assert not save_narrow_values(jax.lax.exp_p, f32)
    assert save_narrow_values(jax.lax.exp_p, bf16)
    assert save_narrow_values(
        jax.lax.convert_element_type_p, f32, new_dtype=jnp.bfloat16, weak_type=False, sharding=None
    )
    assert save_narrow_values(jax.lax.exp_p)  # no avals: unknown, so saved


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_remat_float32_bad_input(bad):
    with pytest.raises(TypeError, match="remat_float32 must be True or False; got"):
        jaxamp.autocast(jnp.sin, remat_float32=bad)


def _compiled_dots(fun, *args) -> int:
    text = jax.jit(jax.grad(fun)).lower(*args).compile().as_text()
    return len(re.findall(r"= \S+ dot\(", text))


def _two_matmul_layer(h, w):
    w1, w2 = w
    return jnp.tanh(jnp.tanh(h @ w1) @ w2), None


@pytest.mark.parametrize(
    "policy",
    [
        jax.checkpoint_policies.dots_saveable,
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
    ],
)
def test_checkpoint_policies_that_name_dots_see_the_matmuls(policy):
    # Saved dots are not recomputed: the compiled backward has as many dots as float32's.
    def net(ws, x):
        body = jax.checkpoint(_two_matmul_layer, policy=policy)
        return jnp.sum(jax.lax.scan(body, x, ws)[0] ** 2)

    key = jax.random.key(3)
    ws = tuple(0.3 * jax.random.normal(k, (3, 16, 16)) for k in jax.random.split(key))
    x = jax.random.normal(jax.random.key(4), (8, 16))
    want = _compiled_dots(net, ws, x)
    assert want == 6  # 2 forward, 4 backward: nothing recomputed
    assert _compiled_dots(jaxamp.autocast(net), ws, x) == want
    got = jax.jit(jax.grad(jaxamp.autocast(net)))(ws, x)
    assert_close(got, jax.grad(net)(ws, x), 5e-2)
    assert set(dot_dtypes(jaxamp.autocast(net), ws, x)) == {("bfloat16", "bfloat16")}


def test_linen_and_nnx_remat_policies_see_the_matmuls():
    from flax import linen as nn
    from flax import nnx

    policy = jax.checkpoint_policies.dots_with_no_batch_dims_saveable

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            return jnp.tanh(nn.Dense(16)(jnp.tanh(nn.Dense(16)(x))))

    linen_block = nn.remat(Block, policy=policy)()
    x = jax.random.normal(jax.random.key(0), (8, 16))
    stacked = jax.vmap(lambda k: linen_block.init(k, x))(jax.random.split(jax.random.key(1), 3))

    def linen_loss(params, x):
        h, _ = jax.lax.scan(lambda h, p: (linen_block.apply(p, h), None), x, params)
        return jnp.sum(h**2)

    want = _compiled_dots(linen_loss, stacked, x)
    assert want == 6 and _compiled_dots(jaxamp.autocast(linen_loss), stacked, x) == want

    class NnxBlock(nnx.Module):
        def __init__(self, rngs):
            self.a, self.b = nnx.Linear(16, 16, rngs=rngs), nnx.Linear(16, 16, rngs=rngs)

    graphdef, _ = nnx.split(NnxBlock(nnx.Rngs(0)))
    states = jax.vmap(lambda k: nnx.split(NnxBlock(nnx.Rngs(k)))[1])(
        jax.random.split(jax.random.key(2), 3)
    )

    @nnx.remat(policy=policy)
    def run(model, h):
        return jnp.tanh(model.b(jnp.tanh(model.a(h))))

    def nnx_loss(states, x):
        h, _ = jax.lax.scan(lambda h, s: (run(nnx.merge(graphdef, s), h), None), x, states)
        return jnp.sum(h**2)

    want = _compiled_dots(nnx_loss, states, x)
    assert want == 6 and _compiled_dots(jaxamp.autocast(nnx_loss), states, x) == want
