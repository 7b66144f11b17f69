"""Gradient accumulation in loss_scaling: one scale, one check and one adjustment per window."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp

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


def _bits(tree):
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


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
            assert _bits(new_state.inner_state) == _bits(state.inner_state)
            assert _bits(new_state.loss_scale) == _bits(state.loss_scale)
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
                assert _bits(new_state.inner_state) == _bits(state.inner_state)
            ref_ls = ref_ls.adjust(jnp.asarray(finite))
            window = []
            assert int(new_state.accumulation.mini_step) == 0
            assert bool(new_state.accumulation.window_finite)
        params = optax.apply_updates(params, updates)
        state = new_state
        assert _bits(params) == _bits(ref_params), f"micro-step {t}"
        assert _bits(state.inner_state) == _bits(ref_inner), f"micro-step {t}"
        assert _bits(state.loss_scale) == _bits(ref_ls), f"micro-step {t}"

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
