"""Checkpointing the loss-scaling state with orbax and flax.serialization; exact resume."""

import functools

import flax.serialization
import jax
import jax.numpy as jnp
import optax
import orbax.checkpoint as ocp
import pytest

import jaxamp
from tests.helpers import bits

POLICY = jaxamp.get_policy("mixed_float16")
CONFIG = {"growth_interval": 2, "growth_factor": 4.0, "backoff_factor": 0.25}
CONFIG.update(min_loss_scale=2.0, max_loss_scale=2.0**20)


def _tx(loss_scale, accumulation_steps):
    inner = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.05, momentum=0.9))
    return jaxamp.loss_scaling(inner, loss_scale, accumulation_steps=accumulation_steps)


def _batches(n):
    xs = jax.random.normal(jax.random.key(0), (n, 8, 5))
    xs = xs.at[2, 0, 0].set(jnp.inf)  # batch 2 overflows
    return xs, (jnp.arange(8, dtype=jnp.int32) % 3)


def _loss_fn(params, x, y):
    p, x = POLICY.cast_to_compute((params, x))
    logits = POLICY.cast_to_output(x @ p["w"] + p["b"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


@functools.cache
def _make_step(accumulation_steps):
    # update() reads the scale from the state; the tx's loss_scale is only init's.
    tx = _tx(None, accumulation_steps)

    @jax.jit
    def step(params, opt_state, x, y):
        scale = jaxamp.get_loss_scale(opt_state)
        _, grads = jaxamp.scaled_value_and_grad(_loss_fn, scale)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step


def _init_params():
    return {"w": jnp.full((5, 3), 0.1), "b": jnp.zeros(3)}


def _run(params, opt_state, xs, y, start, stop):
    step = _make_step(1 if opt_state.accumulation is None else 2)
    for t in range(start, stop):
        params, opt_state = step(params, opt_state, xs[t], y)
    return params, opt_state


def _save_orbax(path, tree):
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(path, tree)
    checkpointer.wait_until_finished()
    return checkpointer


@pytest.mark.parametrize(("via", "accumulation_steps"), [("orbax", 2), ("flax_bytes", 1)])
def test_resume_mid_training_is_bit_identical(tmp_path, via, accumulation_steps):
    n, cut = 8, 3  # cut mid-window when accumulating, after the overflow
    xs, y = _batches(n)
    tx = _tx(jaxamp.DynamicLossScale(loss_scale=2.0**12, **CONFIG), accumulation_steps)
    params = _init_params()
    full_params, full_state = _run(params, tx.init(params), xs, y, 0, n)
    assert int(jaxamp.loss_scaling_metrics(full_state)["skipped_steps"]) == 1

    mid_params, mid_state = _run(params, tx.init(params), xs, y, 0, cut)
    saved = flax.serialization.to_state_dict({"params": mid_params, "opt_state": mid_state})
    # The target knows only the structure: a default scale, different config.
    fresh_tx = _tx(jaxamp.DynamicLossScale(), accumulation_steps)
    target = {"params": _init_params(), "opt_state": fresh_tx.init(_init_params())}
    if via == "orbax":
        checkpointer = _save_orbax(tmp_path / "ckpt", saved)
        restored = flax.serialization.from_state_dict(
            target, checkpointer.restore(tmp_path / "ckpt")
        )
    else:
        restored = flax.serialization.from_bytes(target, flax.serialization.to_bytes(saved))

    scale = jaxamp.get_loss_scale(restored["opt_state"])
    for name, value in CONFIG.items():
        assert getattr(scale, name) == value and type(getattr(scale, name)) is type(value)
    assert bits(restored) == bits({"params": mid_params, "opt_state": mid_state})
    end_params, end_state = _run(restored["params"], restored["opt_state"], xs, y, cut, n)
    assert bits(end_params) == bits(full_params)
    assert bits(end_state) == bits(full_state)
    assert float(jaxamp.get_loss_scale(end_state).loss_scale) == float(
        jaxamp.get_loss_scale(full_state).loss_scale
    )


def test_orbax_with_a_same_config_target_restores_the_pytree_directly(tmp_path):
    tx = _tx(jaxamp.DynamicLossScale(loss_scale=2.0**12, **CONFIG), 1)
    xs, y = _batches(4)
    params, opt_state = _run(_init_params(), tx.init(_init_params()), xs, y, 0, 4)
    state = {"params": params, "opt_state": opt_state}
    checkpointer = _save_orbax(tmp_path / "ckpt", state)
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
    restored = checkpointer.restore(tmp_path / "ckpt", abstract)
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    assert bits(restored) == bits(state)
    metrics = jaxamp.loss_scaling_metrics(restored["opt_state"])
    # 2**12, grown x4 after two finite steps, cut x0.25 by batch 2's overflow.
    assert int(metrics["skipped_steps"]) == 1 and float(metrics["loss_scale"]) == 2.0**12
