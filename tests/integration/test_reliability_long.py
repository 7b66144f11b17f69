"""Long runs, saturation, compile-once and no host transfers per step."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp
from jaxamp.testing import inject_fault_in_leaf

INT32_MAX = 2**31 - 1


def python_reference(flags, scale, interval, lo, hi, growth=2.0, backoff=0.5):
    """The loss-scaling rules in plain Python, one step at a time."""
    counter = skipped = consecutive = 0
    scales, counters, skips, runs = [], [], [], []
    for finite in flags:
        if finite:
            counter += 1
            consecutive = 0
            if counter >= interval:
                scale, counter = min(float(np.float32(scale * growth)), hi), 0
        else:
            scale, counter = max(float(np.float32(scale * backoff)), lo), 0
            skipped, consecutive = skipped + 1, consecutive + 1
        scales.append(scale)
        counters.append(counter)
        skips.append(skipped)
        runs.append(consecutive)
    return [np.array(v) for v in (scales, counters, skips, runs)]


@pytest.mark.parametrize("steps", [10_000, pytest.param(100_000, marks=pytest.mark.slow)])
def test_long_scan_with_random_faults_matches_python_reference(steps):
    rng = np.random.default_rng(1234)
    # Bursts of faults and long clean runs, so both clamps are hit many times.
    rates = np.repeat(rng.choice([0.0, 0.02, 0.5, 1.0], size=steps // 500), 500)
    flags = rng.random(steps) >= rates
    config = dict(
        loss_scale=2.0**8, growth_interval=20, min_loss_scale=2.0**-2, max_loss_scale=2.0**24
    )
    tx = jaxamp.loss_scaling(optax.sgd(1e-3), jaxamp.DynamicLossScale(**config))
    params = {"w": jnp.ones(3), "b": jnp.zeros((2, 2), jnp.bfloat16)}

    def body(carry, inputs):
        params, state = carry
        index, finite = inputs
        grads = jax.tree.map(jnp.ones_like, params)
        grads = jaxamp.get_loss_scale(state).scale(grads)
        bad = jnp.where(finite, -1, index)  # inject only on the unlucky steps
        grads = inject_fault_in_leaf(grads, 0, index, bad[None], float("nan"))
        updates, state = tx.update(grads, state, params)
        out = (
            state.loss_scale.loss_scale,
            state.loss_scale.counter,
            state.skipped_steps,
            state.consecutive_skips,
        )
        return (optax.apply_updates(params, updates), state), out

    run = jax.jit(lambda c, xs: jax.lax.scan(body, c, xs))
    (_, final), outs = run((params, tx.init(params)), (jnp.arange(steps), jnp.asarray(flags)))
    expected = python_reference(flags, 2.0**8, 20, 2.0**-2, 2.0**24)
    for got, want, name in zip(
        outs, expected, ["scale", "counter", "skipped", "consecutive"], strict=True
    ):
        assert np.array_equal(np.asarray(got), want), name
    scales = np.asarray(outs[0])
    assert np.all(np.isfinite(scales)) and scales.min() == 2.0**-2 and scales.max() == 2.0**24
    assert int(final.skipped_steps) == int((~flags).sum())


def test_skip_counters_saturate_instead_of_overflowing():
    tx = jaxamp.loss_scaling(optax.sgd(0.1))
    params = {"w": jnp.ones(2)}
    state = tx.init(params)._replace(
        skipped_steps=jnp.int32(INT32_MAX - 1), consecutive_skips=jnp.int32(INT32_MAX - 1)
    )
    update = jax.jit(tx.update)
    for _ in range(3):
        _, state = update({"w": jnp.full(2, jnp.inf)}, state, params)
    assert int(state.skipped_steps) == INT32_MAX and int(state.consecutive_skips) == INT32_MAX
    _, state = update({"w": jnp.ones(2)}, state, params)
    assert int(state.skipped_steps) == INT32_MAX and int(state.consecutive_skips) == 0


def _train_setup():
    tx = jaxamp.loss_scaling(
        optax.sgd(0.01, momentum=0.9),
        jaxamp.DynamicLossScale(loss_scale=2.0**4, growth_interval=3),
        max_consecutive_skips=2,  # the guard itself must transfer nothing per step
    )
    params = {"w": jnp.zeros((8, 4)), "b": jnp.zeros(4)}
    policy = jaxamp.get_policy("mixed_float16")
    traces = []

    def loss_fn(p, x):
        p, x = policy.cast_to_compute((p, x))
        return jnp.mean(policy.cast_to_output(x @ p["w"] + p["b"]) ** 2)

    @jax.jit
    def step(params, opt_state, x, index):
        traces.append(1)  # runs once per trace, i.e. per compilation
        scale = jaxamp.get_loss_scale(opt_state)
        grads = jax.grad(lambda p: scale.scale(loss_fn(p, x)))(params)
        grads = inject_fault_in_leaf(grads, 0, index % 5, 0, float("inf"))
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return tx, params, step, traces


def test_thousand_steps_compile_once_and_transfer_nothing():
    tx, params, step, traces = _train_setup()
    opt_state = tx.init(params)
    x = jax.device_put(jnp.ones((16, 8)))
    indices = [jax.device_put(jnp.int32(i)) for i in range(1000)]
    params, opt_state = step(params, opt_state, x, indices[0])  # compile outside the guard
    scales = []
    with jax.transfer_guard("disallow"):
        for i in range(1, 1000):
            params, opt_state = step(params, opt_state, x, indices[i])
            if i % 100 == 0:
                scales.append(opt_state.loss_scale.loss_scale)
    assert len(traces) == 1
    metrics = jax.device_get(jaxamp.loss_scaling_metrics(opt_state))
    assert int(metrics["skipped_steps"]) == 200  # every fifth step injected a fault
    # The scale changed every few steps (a fault every fifth step, growth after three
    # finite ones) and followed the rules exactly, all without a retrace or a transfer.
    flags = [i % 5 != 0 for i in range(1000)]
    expected, *_ = python_reference(flags, 2.0**4, 3, 1.0, float(np.finfo(np.float32).max))
    assert np.array_equal(np.asarray(jax.device_get(scales)), expected[100::100])
