"""Fault injection: every fault skips its step bit-identically, backs off, and training recovers."""

import functools

import jax
import jax.numpy as jnp
import optax
import pytest

import jaxamp
from jaxamp.testing import inject_fault, inject_fault_in_leaf
from tests.helpers import bits

POLICY = jaxamp.get_policy("mixed_float16")
FAULT_STEPS = (3, 7)
STEPS = 14


def _data():
    key = jax.random.key(0)
    x = jax.random.normal(key, (32, 4))
    y = x @ jnp.array([[1.0], [-2.0], [0.5], [3.0]]) + 0.25
    return x, y


def _params():
    return {"w": jnp.zeros((4, 1)), "b": jnp.zeros(1)}


def _loss(params, x, y, step, fault):
    p, xc = POLICY.cast_to_compute((params, x))
    if fault == "activation":
        # A float16 overflow in the forward pass: 70000 > float16 max (65504).
        xc = inject_fault(xc, step, FAULT_STEPS, value=70000.0, index=5)
    pred = POLICY.cast_to_output(xc @ p["w"] + p["b"])
    loss = jnp.mean((pred - y) ** 2)
    if fault == "loss":
        loss = inject_fault(loss, step, FAULT_STEPS, value=float("nan"))
    return loss


def _make_step(fault, tx):
    @jax.jit
    def step(params, opt_state, step_index, x, y):
        scale = jaxamp.get_loss_scale(opt_state)
        loss, grads = jax.value_and_grad(lambda p: scale.scale(_loss(p, x, y, step_index, fault)))(
            params
        )
        if fault == "grad":
            grads = inject_fault_in_leaf(grads, 1, step_index, FAULT_STEPS, float("-inf"))
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, scale.unscale(loss)

    return step


@pytest.mark.parametrize("fault", ["grad", "loss", "activation"])
def test_each_fault_is_skipped_bit_identically_and_training_recovers(fault):
    tx = jaxamp.loss_scaling(
        optax.sgd(0.1, momentum=0.9), jaxamp.DynamicLossScale(loss_scale=2.0**12)
    )
    step = _make_step(fault, tx)
    x, y = _data()
    params, opt_state = _params(), tx.init(_params())
    losses = []
    for i in range(STEPS):
        before = (bits(params), bits(opt_state.inner_state))
        scale_before = float(jaxamp.get_loss_scale(opt_state).loss_scale)
        params, opt_state, loss = step(params, opt_state, jnp.int32(i), x, y)
        scale_after = float(jaxamp.get_loss_scale(opt_state).loss_scale)
        if i in FAULT_STEPS:
            assert (bits(params), bits(opt_state.inner_state)) == before, f"step {i}"
            assert scale_after == scale_before / 2
            assert bool(jaxamp.loss_scaling_metrics(opt_state)["last_step_skipped"])
        else:
            assert bits(params) != before[0], f"step {i} should have updated"
            assert scale_after == scale_before
            losses.append(float(loss))
    assert int(opt_state.skipped_steps) == len(FAULT_STEPS)
    assert int(opt_state.consecutive_skips) == 0
    assert losses[-1] < 0.2 * losses[0]  # training went on after the faults


def test_same_trajectory_as_a_run_without_the_faulty_steps():
    # Skipping must be exactly "as if the step never happened" (apart from the scale).
    tx = jaxamp.loss_scaling(optax.sgd(0.05, momentum=0.9), jaxamp.StaticLossScale(2.0**8))
    faulty, clean = _make_step("grad", tx), _make_step(None, tx)
    x, y = _data()
    p1, s1 = _params(), tx.init(_params())
    p2, s2 = _params(), tx.init(_params())
    for i in range(STEPS):
        p1, s1, _ = faulty(p1, s1, jnp.int32(i), x, y)
        if i not in FAULT_STEPS:
            p2, s2, _ = clean(p2, s2, jnp.int32(i), x, y)
    assert bits(p1) == bits(p2) and bits(s1.inner_state) == bits(s2.inner_state)


def test_persistent_faults_stop_at_min_scale_and_never_update():
    tx = jaxamp.loss_scaling(
        optax.sgd(0.05),
        jaxamp.DynamicLossScale(loss_scale=2.0**15, min_loss_scale=2.0**10),
    )
    x, y = _data()
    params, opt_state = _params(), tx.init(_params())
    step = jax.jit(functools.partial(_make_step("grad", tx).__wrapped__))
    initial = bits(params)
    for _ in range(40):
        params, opt_state, _ = step(params, opt_state, jnp.int32(3), x, y)  # always step 3
    assert bits(params) == initial
    metrics = jaxamp.loss_scaling_metrics(opt_state)
    assert float(metrics["loss_scale"]) == 2.0**10
    assert int(metrics["skipped_steps"]) == 40 and int(metrics["consecutive_skips"]) == 40


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan"), 70000.0])
def test_inject_fault_values_and_dtypes(value):
    for dtype in (jnp.float16, jnp.bfloat16, jnp.float32):
        out = inject_fault(jnp.ones((2, 2), dtype), 1, [0, 1], value=value, index=3)
        assert out.dtype == dtype and out.shape == (2, 2)
        expect_finite = value == 70000.0 and dtype != jnp.float16
        assert bool(jnp.isfinite(out.reshape(-1)[3])) == expect_finite
        assert bool(jnp.all(out.reshape(-1)[:3] == 1))
    untouched = inject_fault(jnp.ones(3), 2, [0, 1], value=value)
    assert bool(jnp.all(untouched == 1))


@pytest.mark.parametrize(
    "call, error, fragment",
    [
        (lambda: inject_fault(jnp.arange(3), 0, 0), TypeError, "x must be a floating array"),
        (lambda: inject_fault(jnp.ones(3), 0, 0, index=3), ValueError, "index must be in"),
        (lambda: inject_fault(jnp.ones(3), 0, "3"), TypeError, "at_steps must be an int"),
        (lambda: inject_fault_in_leaf([jnp.ones(1)], 2, 0, 0), ValueError, "leaf must be in"),
    ],
)
def test_inject_fault_bad_input(call, error, fragment):
    with pytest.raises(error, match=fragment):
        call()


def _guarded_run(limit, faulty_steps, total, accumulation_steps=1, loss_scale=None):
    tx = jaxamp.loss_scaling(
        optax.sgd(0.1),
        loss_scale or jaxamp.DynamicLossScale(loss_scale=2.0**4),
        max_consecutive_skips=limit,
        accumulation_steps=accumulation_steps,
    )
    params = {"w": jnp.ones(3)}
    state = tx.init(params)
    update = jax.jit(tx.update)
    for i in range(total):
        grads = {"w": jnp.full(3, jnp.inf if i in faulty_steps else 1.0)}
        _, state = update(grads, state, params)
        jaxamp.check_skips(state)  # outside jit, after every step
    return state


def test_guard_raises_a_catchable_error_after_too_many_consecutive_skips():
    with (
        pytest.warns(RuntimeWarning, match="skipped 5 steps in a row") as warned,
        pytest.raises(jaxamp.TooManySkippedSteps) as raised,
    ):
        _guarded_run(5, set(range(2, 100)), 100)
    assert len(warned) == 1  # the jitted step warns once, on the step that hits the limit
    message = str(raised.value)
    assert "skipped 5 steps in a row (the limit is max_consecutive_skips=5)" in message
    assert "The loss scale has shrunk to 1 (min_loss_scale=1)" in message
    with pytest.warns(RuntimeWarning), pytest.raises(jaxamp.TooManySkippedSteps, match="4 steps"):
        _guarded_run(4, set(range(100)), 10)


def test_guard_message_fits_the_kind_of_loss_scale():
    with pytest.warns(RuntimeWarning), pytest.raises(jaxamp.TooManySkippedSteps) as raised:
        _guarded_run(2, set(range(10)), 10, loss_scale=jaxamp.NoOpLossScale())
    assert "No loss scaling was in use (NoOpLossScale)" in str(raised.value)
    assert "loss scale is now" not in str(raised.value)
    with pytest.warns(RuntimeWarning), pytest.raises(jaxamp.TooManySkippedSteps) as raised:
        _guarded_run(2, set(range(10)), 10, loss_scale=jaxamp.StaticLossScale(8.0))
    assert "The loss scale is static at 8." in str(raised.value)


def test_check_skips_refuses_an_unguarded_state_and_traced_counters():
    tx = jaxamp.loss_scaling(optax.sgd(0.1))
    with pytest.raises(ValueError, match="max_consecutive_skips=N"):
        jaxamp.check_skips(tx.init({"w": jnp.ones(3)}))
    guarded = jaxamp.loss_scaling(optax.sgd(0.1), max_consecutive_skips=3)
    with pytest.raises(TypeError, match="call it outside jax.jit"):
        jax.jit(jaxamp.check_skips)(guarded.init({"w": jnp.ones(3)}))


def test_guard_stays_quiet_when_skips_are_interrupted_by_finite_steps():
    faulty = {i for i in range(60) if i % 5}  # four skips, then one good step, repeated
    state = _guarded_run(5, faulty, 60)
    assert int(state.skipped_steps) == len(faulty) and int(state.consecutive_skips) == 4


def test_guard_counts_windows_with_accumulation():
    # 3 faulty windows of 2 micro-batches in a row: the limit of 3 is hit at micro-step 6.
    with pytest.warns(RuntimeWarning), pytest.raises(jaxamp.TooManySkippedSteps, match="3 steps"):
        _guarded_run(3, set(range(100)), 6, accumulation_steps=2)
    state = _guarded_run(3, set(range(100)), 5, accumulation_steps=2)
    assert int(state.consecutive_skips) == 2


@pytest.mark.parametrize(
    "value, error", [(0, ValueError), (2.5, TypeError), (True, TypeError), ("3", TypeError)]
)
def test_guard_option_is_validated(value, error):
    with pytest.raises(error, match="max_consecutive_skips must be"):
        jaxamp.loss_scaling(optax.sgd(0.1), max_consecutive_skips=value)
