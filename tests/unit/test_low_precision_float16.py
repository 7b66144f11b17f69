"""float16 with low_precision_optimizer: state that holds Adam's moments, loss-scaled
gradients that reach the optimizer unflushed, checked against float32 Adam."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp

F16, BF16 = jnp.float16, jnp.bfloat16
N = 4096


def _run(tx, params, grads, steps):
    """``steps`` jitted steps of ``tx`` with the same grads; the final params."""

    @jax.jit
    def run(params, state):
        def body(carry, _):
            params, state = carry
            updates, state = tx.update(grads, state, params)
            return (optax.apply_updates(params, updates), state), None

        return jax.lax.scan(body, (params, state), None, length=steps)[0]

    with jax.numpy_dtype_promotion("standard"):  # optax's adam mixes floats and int32
        return run(params, tx.init(params))[0]


def _float32_adam_moves(p0, grads32, steps, lr=1e-3):
    """How far float32 Adam moves float32 params ``p0`` (the reference)."""
    params = {"w": jnp.asarray(p0, jnp.float32)}
    final = _run(optax.adam(lr), params, {"w": jnp.asarray(grads32, jnp.float32)}, steps)
    return np.asarray(final["w"], np.float64) - np.asarray(p0, np.float64)


def test_float16_state_is_refused_with_the_reason():
    with pytest.raises(ValueError, match=r"state_dtype.*float16.*second moments.*bfloat16"):
        jaxamp.low_precision_optimizer(optax.adam(1e-3), state_dtype=F16)


@pytest.mark.parametrize("rounding", ["stochastic", "kahan"])
def test_float16_params_with_bfloat16_state_move_like_float32_adam(rounding):
    # Gradients of 1e-5: g**2 = 1e-10 lies below float16's smallest subnormal
    # (6e-8), so float16 moments would make Adam's steps 6.6 times too long.
    rng = np.random.default_rng(0)
    p0 = rng.uniform(0.01, 0.02, N).astype(np.float16)
    g = (rng.choice([-1.0, 1.0], N) * rng.uniform(0.5, 1.5, N) * 1e-5).astype(np.float16)
    tx = jaxamp.low_precision_optimizer(optax.adam(1e-3), rounding=rounding, state_dtype=BF16)
    final = _run(tx, {"w": jnp.asarray(p0)}, {"w": jnp.asarray(g)}, steps=20)
    moved = np.asarray(final["w"], np.float64) - p0.astype(np.float64)
    want = _float32_adam_moves(p0, g.astype(np.float32), steps=20)
    assert np.abs(want).min() > 0.015  # about 20 * 1e-3, one float16 ulp is 1e-5 here
    # Within 2% of float32 Adam's move, element by element: float16 ulps and
    # bfloat16 moments (8 bits) round, but nothing is flushed.
    np.testing.assert_allclose(moved, want, rtol=0.02)


def _loss_scaled(rounding, accumulation_steps, steps):
    """Float16 params trained by the documented order on a true gradient of 1e-9."""
    scale = 2.0**20
    p0 = np.full(N, 0.01, np.float16)
    scaled = np.full(N, 1e-9 * scale, np.float16)  # what backprop of the scaled loss gives
    tx = jaxamp.loss_scaling(
        jaxamp.low_precision_optimizer(optax.adam(1e-3), rounding=rounding),
        jaxamp.StaticLossScale(scale),
        accumulation_steps=accumulation_steps,
    )
    final = _run(tx, {"w": jnp.asarray(p0)}, {"w": jnp.asarray(scaled)}, steps)
    assert final["w"].dtype == F16
    moved = np.asarray(final["w"], np.float64) - p0.astype(np.float64)
    true_grad = scaled.astype(np.float32) / np.float32(scale)  # 1e-9: 0 in float16
    assert true_grad.astype(np.float16).max() == 0
    want = _float32_adam_moves(p0, true_grad, steps // accumulation_steps)
    return moved, want


@pytest.mark.parametrize("rounding", ["stochastic", "kahan", "nearest"])
def test_loss_scaled_float16_grads_reach_the_optimizer_unflushed(rounding):
    moved, want = _loss_scaled(rounding, accumulation_steps=1, steps=50)
    # float32 Adam moves 0.0045 (Adam's step is lr * g / (|g| + eps) with eps =
    # 1e-8); unscaled into float16 the gradient would be 0 and nothing would move.
    np.testing.assert_allclose(want, -0.0045, rtol=0.02)
    np.testing.assert_allclose(moved.mean(), want.mean(), rtol=0.02)
    np.testing.assert_allclose(moved, want, rtol=0.05)  # ulp at 0.01: 7.6e-6


def test_loss_scaled_float16_grads_reach_the_optimizer_unflushed_when_accumulating():
    moved, want = _loss_scaled("stochastic", accumulation_steps=2, steps=40)
    np.testing.assert_allclose(want, -0.0018, rtol=0.03)  # 20 applied steps
    np.testing.assert_allclose(moved, want, rtol=0.05)


def test_plain_optax_inner_still_gets_grads_in_the_param_dtype():
    # Only low_precision_optimizer declares that it takes float32 grads; optax's
    # own transformations keep their state in the params' dtype.
    seen = []

    def record(updates, state, params=None):
        seen.append(updates["w"].dtype)
        return updates, state

    inner = optax.GradientTransformation(lambda p: optax.EmptyState(), record)
    tx = jaxamp.loss_scaling(inner, jaxamp.StaticLossScale(4.0))
    params = {"w": jnp.ones(3, F16)}
    tx.update({"w": jnp.ones(3, F16)}, tx.init(params), params)
    lp = jaxamp.loss_scaling(
        jaxamp.low_precision_optimizer(
            optax.GradientTransformation(lambda p: optax.EmptyState(), record)
        ),
        jaxamp.StaticLossScale(4.0),
    )
    lp.update({"w": jnp.ones(3, F16)}, lp.init(params), params)
    assert seen == [F16, jnp.float32]


def test_multisteps_inside_loss_scaling_points_to_the_alternatives():
    inner = optax.MultiSteps(optax.sgd(0.1), 2)
    with pytest.raises(TypeError, match=r"accumulation_steps.*gradient_transformation\(\)"):
        jaxamp.loss_scaling(inner)
    tx = jaxamp.loss_scaling(inner.gradient_transformation(), jaxamp.StaticLossScale(2.0))
    params = {"w": jnp.ones(3)}
    state = tx.init(params)
    with jax.numpy_dtype_promotion("standard"):  # MultiSteps mixes floats and int32
        for _ in range(2):
            updates, state = tx.update({"w": jnp.full(3, 2.0)}, state, params)
    np.testing.assert_array_equal(np.asarray(updates["w"]), np.full(3, -0.1, np.float32))


@pytest.mark.parametrize("seed", [2**32, 2**32 + 5, -1, -(2**40)])
def test_seeds_that_would_alias_are_refused(seed):
    with pytest.raises(ValueError, match=r"seed must be in \[0, 2\*\*32 - 1\]"):
        jaxamp.low_precision_optimizer(optax.sgd(0.1), seed=seed)


def test_the_largest_seed_is_its_own_stream():
    def run(seed):
        tx = jaxamp.low_precision_optimizer(optax.sgd(1e-3), seed=seed)
        params = {"w": jnp.ones(N, BF16)}
        updates, _ = jax.jit(tx.update)({"w": -jnp.ones(N, BF16)}, tx.init(params), params)
        return np.asarray(updates["w"], np.float32)

    last = run(2**32 - 1)
    assert (last != run(0)).any() and (last != run(2**31 - 1)).any()
