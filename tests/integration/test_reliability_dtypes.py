"""dtype hygiene: every public API returns its documented dtypes with x64 on and off."""

import jax
import jax.numpy as jnp
import optax
import pytest

import jaxamp


@pytest.fixture(params=[False, True], ids=["x64-off", "x64-on"])
def x64(request):
    before = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", request.param)
    try:
        yield request.param
    finally:
        jax.config.update("jax_enable_x64", before)


def _params():
    return {
        "w": jnp.ones((3, 2), jnp.float32),
        "h": jnp.ones(2, jnp.bfloat16),
        "step": jnp.zeros((), jnp.int32),
    }


def test_loss_scales_keep_float32_and_int32(x64):
    for ls in (jaxamp.DynamicLossScale(), jaxamp.StaticLossScale(2.0**4), jaxamp.NoOpLossScale()):
        assert ls.loss_scale.dtype == jnp.float32
        adjusted = jax.jit(lambda s: s.adjust(jnp.asarray(False)))(ls)
        assert adjusted.loss_scale.dtype == jnp.float32
    dyn = jaxamp.DynamicLossScale(growth_interval=1).adjust(jnp.asarray(True))
    assert dyn.loss_scale.dtype == jnp.float32 and dyn.counter.dtype == jnp.int32
    tree = _params()
    for method in ("scale", "unscale"):
        out = getattr(jaxamp.StaticLossScale(8.0), method)(tree)
        assert jax.tree.map(lambda x: x.dtype, out) == jax.tree.map(lambda x: x.dtype, tree)


def test_loss_scaling_never_promotes_params_to_float64(x64):
    params = {k: v for k, v in _params().items() if k != "step"}  # optax wants float params
    tx = jaxamp.loss_scaling(optax.sgd(0.1, momentum=0.9), jaxamp.DynamicLossScale())
    state = tx.init(params)
    scale = jaxamp.get_loss_scale(state)
    grads = scale.scale(jax.tree.map(lambda x: jnp.ones_like(x) * 2, params))
    for grads_in in (grads, {**grads, "w": grads["w"].at[0, 0].set(jnp.nan)}):
        updates, new_state = jax.jit(tx.update)(grads_in, state, params)
        new_params = optax.apply_updates(params, updates)
        assert jax.tree.map(lambda x: x.dtype, new_params) == jax.tree.map(
            lambda x: x.dtype, params
        )
        metrics = jaxamp.loss_scaling_metrics(new_state)
        assert metrics["loss_scale"].dtype == jnp.float32
        assert metrics["skipped_steps"].dtype == jnp.int32
        assert metrics["consecutive_skips"].dtype == jnp.int32
        assert metrics["last_step_skipped"].dtype == jnp.bool_


def test_policies_and_helpers_return_documented_dtypes(x64):
    policy = jaxamp.get_policy("mixed_bfloat16")
    out = policy.cast_to_compute(_params())
    assert out["w"].dtype == jnp.bfloat16 and out["step"].dtype == jnp.int32
    assert policy.cast_to_param(out)["w"].dtype == jnp.float32
    assert jaxamp.all_finite(_params()).dtype == jnp.bool_
    assert jaxamp.pad_to_multiple(jnp.ones(3, jnp.float16), 8).dtype == jnp.float16
    assert type(jaxamp.align_dim(3)) is int
    if x64:
        assert jaxamp.cast_floating(jnp.ones(2, jnp.float32), "f64").dtype == jnp.float64
    else:
        with pytest.raises(ValueError, match="jax_enable_x64"):
            jaxamp.cast_floating(jnp.ones(2, jnp.float32), "f64")


def test_strict_promotion_is_on_for_the_suite():
    assert jax.config.jax_numpy_dtype_promotion == "strict"
    with pytest.raises(jax.dtypes.TypePromotionError):
        _ = jnp.ones(2, jnp.bfloat16) + jnp.ones(2, jnp.float32)
