"""autocast(..., remat_float32=True): only 16-bit values are saved for the backward pass."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp
from tests.helpers import rel_err
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
