"""loss_scaling: unscaling, skipping bit-identically, scale adjustment, finding the state,
the raw-grad finite check, and gradient accumulation (one scale, one check and one adjustment
per window)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp
from jaxamp._loss_scaling._transform import raw_grads_checkable
from tests.helpers import bits


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


@pytest.mark.parametrize("accumulation_steps", [1, 2])
def test_state_can_be_donated_and_owns_its_arrays(accumulation_steps):
    # A state holding one array twice fails with "donate the same buffer twice".
    ls = jaxamp.DynamicLossScale(loss_scale=8.0)
    tx = jaxamp.loss_scaling(optax.sgd(0.1), ls, accumulation_steps=accumulation_steps)
    params = {"w": jnp.ones(2)}
    state = tx.init(params)
    assert state.loss_scale.loss_scale is not ls.loss_scale
    leaves = jax.tree.leaves(state)
    assert len({id(x) for x in leaves}) == len(leaves)  # no buffer appears twice
    step = jax.jit(tx.update, donate_argnums=(1,))
    _, state = step({"w": jnp.ones(2)}, state, params)
    assert float(tx.init(params).loss_scale.loss_scale) == 8.0 == float(ls.loss_scale)


@pytest.mark.parametrize(
    ("loss_scale", "grad_reduction", "checkable"),
    [
        (jaxamp.NoOpLossScale(), None, True),
        (jaxamp.DynamicLossScale(), None, True),  # min_loss_scale=1: 1/scale <= 1
        (jaxamp.DynamicLossScale(loss_scale=4.0, min_loss_scale=2.0), None, True),
        (jaxamp.DynamicLossScale(loss_scale=4.0, min_loss_scale=0.5), None, False),
        (jaxamp.StaticLossScale(4.0), None, False),  # its value is state, may be < 1
        (jaxamp.StaticLossScale(0.5), None, False),
        (jaxamp.NoOpLossScale(), "mean", False),  # the reduced grads are other arrays
        (jaxamp.DynamicLossScale(), "sum", False),
    ],
)
def test_raw_grads_are_checked_only_where_unscaling_keeps_finiteness(
    loss_scale, grad_reduction, checkable
):
    assert raw_grads_checkable(loss_scale, grad_reduction) is checkable


@pytest.mark.parametrize("checkable", [True, False])
def test_finite_check_agrees_on_raw_and_unscaled_grads(checkable):
    # Whichever grads the check reads, a skip happens exactly on non-finite grads,
    # including a float16 grad that unscaling by 1/scale (scale >= 1) keeps finite.
    min_scale = 1.0 if checkable else 0.5
    loss_scale = jaxamp.DynamicLossScale(loss_scale=8.0, min_loss_scale=min_scale)
    assert raw_grads_checkable(loss_scale, None) is checkable
    tx = jaxamp.loss_scaling(optax.sgd(1.0), loss_scale)
    params = {"w": jnp.ones(2, jnp.float16)}
    update = jax.jit(tx.update)
    for raw, skipped in [
        ([65504.0, 1.0], 0),
        ([jnp.inf, 1.0], 1),
        ([jnp.nan, 1.0], 1),
    ]:
        state = tx.init(params)
        _, state = update({"w": jnp.array(raw, jnp.float16)}, state, params)
        assert int(state.skipped_steps) == skipped, raw


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


# Gradient accumulation.

K = 2  # micro-batches per window


def _micro_grads():
    """Unscaled micro-batch grads; micro-batch 2 (first of window 1) overflows."""
    grads = []
    for t in range(10):
        w = jnp.array([0.25, -0.5, 1.0]) * (t + 1)
        h = jnp.array([0.125, 2.0], jnp.bfloat16) * (t + 1)
        grads.append({"w": w, "h": h})
    grads[2] = {"w": grads[2]["w"].at[1].set(jnp.inf), "h": grads[2]["h"]}
    return grads


def test_accumulation_matches_mean_grads_trajectory_and_skips_whole_window():
    params = {"w": jnp.array([1.0, 2.0, 3.0]), "h": jnp.array([1.0, -1.0], jnp.bfloat16)}
    inner = optax.sgd(0.5, momentum=0.5)
    ls0 = jaxamp.DynamicLossScale(loss_scale=8.0, growth_interval=2)
    tx = jaxamp.loss_scaling(inner, ls0, accumulation_steps=K)
    state = tx.init(params)
    update = jax.jit(tx.update)

    ref_params, ref_inner, ref_ls = params, inner.init(params), ls0
    window = []
    scales_seen = []
    for t, g in enumerate(_micro_grads()):
        scale = jaxamp.get_loss_scale(state)
        scales_seen.append(float(scale.loss_scale))
        # The scale the user multiplies the loss by is the reference's for the whole window.
        assert float(scale.loss_scale) == float(ref_ls.loss_scale)
        updates, new_state = update(scale.scale(g), state, params)
        window.append(g)
        if len(window) < K:
            # Mid-window: zero updates; inner state, scale and counters untouched.
            assert not any(np.any(np.asarray(u, np.float32)) for u in jax.tree.leaves(updates))
            assert bits(new_state.inner_state) == bits(state.inner_state)
            assert bits(new_state.loss_scale) == bits(state.loss_scale)
            assert int(new_state.accumulation.mini_step) == len(window)
        else:
            finite = all(bool(jaxamp.all_finite(w)) for w in window)
            if finite:
                mean = jax.tree.map(
                    lambda a, b: ((a.astype(jnp.float32) + b.astype(jnp.float32)) / K).astype(
                        a.dtype
                    ),
                    *window,
                )
                ref_updates, ref_inner = inner.update(mean, ref_inner, ref_params)
                ref_params = optax.apply_updates(ref_params, ref_updates)
            else:
                assert bits(new_state.inner_state) == bits(state.inner_state)
            ref_ls = ref_ls.adjust(jnp.asarray(finite))
            window = []
            assert int(new_state.accumulation.mini_step) == 0
            assert bool(new_state.accumulation.window_finite)
        params = optax.apply_updates(params, updates)
        state = new_state
        assert bits(params) == bits(ref_params), f"micro-step {t}"
        assert bits(state.inner_state) == bits(ref_inner), f"micro-step {t}"
        assert bits(state.loss_scale) == bits(ref_ls), f"micro-step {t}"

    # Window 1 overflowed: halved once (8 -> 4) for the whole window, then two
    # finite windows grew it back; nothing non-finite leaked into later windows.
    assert scales_seen == [8.0, 8.0, 8.0, 8.0, 4.0, 4.0, 4.0, 4.0, 8.0, 8.0]
    metrics = jaxamp.loss_scaling_metrics(state)
    assert int(metrics["skipped_steps"]) == 1 and int(metrics["consecutive_skips"]) == 0
    assert all(bool(jnp.isfinite(s).all()) for s in jax.tree.leaves(state.accumulation.grad_sum))
    assert state.accumulation.grad_sum["h"].dtype == jnp.float32  # bf16 grads sum in f32


def test_accumulation_inside_jit_scan_has_no_python_loop_over_steps():
    params = {"w": jnp.ones(3)}
    tx = jaxamp.loss_scaling(optax.sgd(1.0), jaxamp.StaticLossScale(4.0), accumulation_steps=4)
    grads = jnp.arange(12.0).reshape(4, 3)

    @jax.jit
    def run(params, state):
        def body(carry, g):
            params, state = carry
            scale = jaxamp.get_loss_scale(state)
            updates, state = tx.update(scale.scale({"w": g}), state, params)
            return (optax.apply_updates(params, updates), state), None

        return jax.lax.scan(body, (params, state), grads)[0]

    params, state = run(params, tx.init(params))
    np.testing.assert_array_equal(params["w"], 1.0 - grads.mean(0))
    assert int(state.accumulation.mini_step) == 0


def test_accumulation_bad_arguments():
    with pytest.raises(ValueError, match="accumulation_steps must be an int >= 1; got 0"):
        jaxamp.loss_scaling(optax.sgd(0.1), accumulation_steps=0)
    with pytest.raises(ValueError, match="accumulation_steps must be an int >= 1"):
        jaxamp.loss_scaling(optax.sgd(0.1), accumulation_steps=2.0)
    with pytest.raises(ValueError, match="needs the params"):
        jaxamp.loss_scaling(optax.sgd(0.1), accumulation_steps=2).init(None)
    plain = jaxamp.loss_scaling(optax.sgd(0.1)).init({"w": jnp.ones(1)})
    with pytest.raises(TypeError, match="no AccumulationState"):
        jaxamp.loss_scaling(optax.sgd(0.1), accumulation_steps=2).update({"w": jnp.ones(1)}, plain)
    with pytest.raises(ValueError, match="grad_reduction='mean' needs axis_name"):
        jaxamp.loss_scaling(optax.sgd(0.1), grad_reduction="mean")
    with pytest.raises(ValueError, match="grad_reduction must be None, 'mean' or 'sum'"):
        jaxamp.loss_scaling(optax.sgd(0.1), axis_name="d", grad_reduction="avg")
    with pytest.raises(TypeError, match="axis_name must be None"):
        jaxamp.loss_scaling(optax.sgd(0.1), axis_name=3)


def test_float16_grads_accumulate_unscaled_in_float32_without_underflow():
    params = {"h": jnp.zeros(2, jnp.float16)}
    ls = jaxamp.StaticLossScale(2.0**15)
    tx = jaxamp.loss_scaling(optax.sgd(1.0), ls, accumulation_steps=2)
    tiny = 2.0**-26  # below float16's smallest subnormal (2**-24); 2**-11 once scaled
    scaled = {"h": jnp.full(2, tiny * 2.0**15, jnp.float16)}
    assert float(scaled["h"][0]) == 2.0**-11
    _, state = tx.update(scaled, tx.init(params), params)
    assert state.accumulation.grad_sum["h"].dtype == jnp.float32
    np.testing.assert_array_equal(state.accumulation.grad_sum["h"], [tiny, tiny])
    updates, state = tx.update(scaled, state, params)
    assert updates["h"].dtype == jnp.float16  # inner works in the grads' dtype


@pytest.mark.parametrize("inner", [optax.sgd(0.1), optax.adam(1e-3)])
@pytest.mark.parametrize("dtype", [jnp.int32, jnp.bool_])
def test_update_refuses_integer_gradients_naming_the_leaf(inner, dtype):
    params = {"w": jnp.ones(3), "step": jnp.zeros((), dtype)}
    tx = jaxamp.loss_scaling(inner)
    state = tx.init(params)
    grads = {"w": jnp.ones(3), "step": jnp.zeros((), dtype)}
    pattern = rf"the leaf at \['step'\] has dtype {jnp.dtype(dtype).name}"
    with pytest.raises(TypeError, match=pattern):
        tx.update(grads, state, params)
    with pytest.raises(TypeError, match=pattern):
        jax.jit(tx.update)(grads, state, params)
