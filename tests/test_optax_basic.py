"""loss_scaling: unscaling, skipping bit-identically, scale adjustment, finding the state."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp


def _params():
    return {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(3, jnp.bfloat16)}


def test_finite_step_applies_inner_to_unscaled_grads():
    ls = jaxamp.DynamicLossScale(loss_scale=2.0**10, growth_interval=2)
    inner = optax.sgd(0.5, momentum=0.9)
    tx = jaxamp.loss_scaling(inner, ls)
    params = _params()
    grads = {"w": jnp.full((2, 3), 0.25), "b": jnp.full(3, 0.5, jnp.bfloat16)}
    state = tx.init(params)
    updates, state = jax.jit(tx.update)(ls.scale(grads), state, params)
    ref_updates, ref_inner = inner.update(grads, inner.init(params), params)
    for a, b in zip(jax.tree.leaves(updates), jax.tree.leaves(ref_updates), strict=True):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    assert jax.tree.all(jax.tree.map(np.array_equal, state.inner_state, ref_inner))
    assert int(jaxamp.get_loss_scale(state).counter) == 1
    assert int(state.skipped_steps) == 0


def test_skipped_step_is_bit_identical_and_zero():
    tx = jaxamp.loss_scaling(optax.sgd(0.5, momentum=0.9), jaxamp.DynamicLossScale(loss_scale=8.0))
    params = _params()
    state = tx.init(params)
    good = {"w": jnp.full((2, 3), 8.0), "b": jnp.full(3, 8.0, jnp.bfloat16)}
    _, state = tx.update(good, state, params)
    bad = {"w": good["w"].at[0, 0].set(jnp.nan), "b": good["b"]}
    updates, new_state = jax.jit(tx.update)(bad, state, params)
    for u, p in zip(jax.tree.leaves(updates), jax.tree.leaves(params), strict=True):
        assert u.dtype == p.dtype and not np.any(np.asarray(u, np.float32))
    same = jax.tree.map(
        lambda a, b: a.tobytes() == b.tobytes(), new_state.inner_state, state.inner_state
    )
    assert all(jax.tree.leaves(same))
    assert float(jaxamp.get_loss_scale(new_state).loss_scale) == 4.0
    metrics = jaxamp.loss_scaling_metrics(new_state)
    assert int(metrics["skipped_steps"]) == 1 and int(metrics["consecutive_skips"]) == 1
    assert bool(metrics["last_step_skipped"])
    new_params = optax.apply_updates(params, updates)
    assert all(
        jax.tree.leaves(jax.tree.map(lambda a, b: a.tobytes() == b.tobytes(), new_params, params))
    )


def test_params_none_and_extra_args_reach_inner():
    seen = {}

    def update(updates, state, params=None, *, value=None):
        seen["value"] = value
        return updates, state

    inner = optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(), update)
    tx = jaxamp.loss_scaling(inner, jaxamp.StaticLossScale(4.0))
    updates, _ = tx.update({"w": jnp.full(2, 8.0)}, tx.init(None), value=3)
    assert seen["value"] == 3 and np.array_equal(updates["w"], [2.0, 2.0])


def test_clipping_inside_inner_sees_unscaled_grads():
    tx = jaxamp.loss_scaling(
        optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1.0)), jaxamp.StaticLossScale(2.0**12)
    )
    grads = {"w": jnp.array([0.3, 0.4])}  # norm 0.5 < 1: no clipping if unscaled first
    updates, _ = tx.update(jaxamp.StaticLossScale(2.0**12).scale(grads), tx.init(grads))
    np.testing.assert_allclose(updates["w"], [-0.3, -0.4], rtol=1e-6)


def test_get_loss_scale_finds_nested_states():
    ls = jaxamp.DynamicLossScale(loss_scale=16.0)
    params = {"w": jnp.ones(2)}
    wrapped = jaxamp.loss_scaling(optax.sgd(0.1), ls)
    for state in (
        wrapped.init(params),
        optax.chain(optax.clip(1.0), wrapped).init(params),
        (1, {"deep": [wrapped.init(params)]}),
        optax.inject_hyperparams(
            lambda learning_rate: jaxamp.loss_scaling(optax.sgd(learning_rate), ls)
        )(learning_rate=0.1).init(params),
    ):
        assert float(jaxamp.get_loss_scale(state).loss_scale) == 16.0
    with jax.numpy_dtype_promotion("standard"):  # MultiSteps itself needs it
        multi = optax.MultiSteps(wrapped, every_k_schedule=2).init(params)
    assert float(jaxamp.get_loss_scale(multi).loss_scale) == 16.0
    with pytest.raises(ValueError, match="no jaxamp loss-scaling state"):
        jaxamp.get_loss_scale(optax.sgd(0.1).init(params))


def test_bad_arguments():
    with pytest.raises(TypeError, match="loss_scale must be a jaxamp"):
        jaxamp.loss_scaling(optax.sgd(0.1), 2.0**15)
    with pytest.raises(TypeError, match="inner must be an optax.GradientTransformation"):
        jaxamp.loss_scaling(lambda g: g)
    tx = jaxamp.loss_scaling(optax.sgd(0.1))
    with pytest.raises(TypeError, match="state must be the LossScalingState"):
        tx.update({"w": jnp.ones(1)}, optax.EmptyState())


def test_state_can_be_donated_and_owns_its_arrays():
    ls = jaxamp.DynamicLossScale(loss_scale=8.0)
    tx = jaxamp.loss_scaling(optax.sgd(0.1), ls, accumulation_steps=2)
    params = {"w": jnp.ones(2)}
    state = tx.init(params)
    assert state.loss_scale.loss_scale is not ls.loss_scale
    leaves = jax.tree.leaves(state)
    assert len({id(x) for x in leaves}) == len(leaves)  # no buffer appears twice
    step = jax.jit(tx.update, donate_argnums=(1,))
    _, state = step({"w": jnp.ones(2)}, state, params)
    assert float(tx.init(params).loss_scale.loss_scale) == 8.0 == float(ls.loss_scale)


def test_out_of_range_scale_array_is_skipped_and_clamped_not_overflowed():
    # The finite check reads the raw grads, valid while scale >= min_loss_scale >= 1.
    # A scale array built below the minimum (not caught without a host sync) must not
    # let an unscaled float16 gradient overflow into the optimizer.
    tx = jaxamp.loss_scaling(optax.sgd(1.0), jaxamp.DynamicLossScale(loss_scale=2.0**15))
    params = {"w": jnp.ones(2, jnp.float16)}
    state = tx.init(params)
    bad_scale = jaxamp.DynamicLossScale(loss_scale=jnp.float32(0.5))
    assert float(bad_scale.loss_scale) == 0.5  # accepted: an array is not range-checked
    state = state._replace(loss_scale=bad_scale)
    grads = {"w": jnp.array([40000.0, 1.0], jnp.float16)}  # x 2 would overflow float16
    updates, state = jax.jit(tx.update)(grads, state, params)
    np.testing.assert_array_equal(updates["w"], np.zeros(2, np.float16))
    assert float(state.loss_scale.loss_scale) == 1.0  # clamped to min_loss_scale
    assert int(state.skipped_steps) == 1
    updates, state = jax.jit(tx.update)(grads, state, params)
    np.testing.assert_array_equal(updates["w"], -np.asarray(grads["w"]))
