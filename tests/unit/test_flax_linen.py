"""Flax Linen: LossScaledTrainState and linen_policy with per-module overrides."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax.training import train_state

import jaxamp
import jaxamp.flax
from tests.helpers import bits, dot_dtypes


class MLP(nn.Module):
    head_dtype: object = None

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(8, name="hidden")(x))
        x = nn.LayerNorm(name="norm")(x)
        return nn.Dense(3, name="head", dtype=self.head_dtype)(x)


def _setup(loss_scale):
    model = MLP()
    x = jax.random.normal(jax.random.key(1), (16, 4))
    y = jnp.arange(16, dtype=jnp.int32) % 3
    params = model.init(jax.random.key(0), x)["params"]
    tx = optax.sgd(2.0**-4, momentum=0.5)
    state = jaxamp.flax.LossScaledTrainState.create(
        apply_fn=model.apply, params=params, tx=tx, loss_scale=loss_scale
    )
    ref = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
    return state, ref, x, y


def _loss_fn(apply_fn, x, y):
    def loss(params):
        logits = apply_fn({"params": params}, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    return loss


@jax.jit
def _step(state, x, y):
    loss, grads = state.value_and_grad(_loss_fn(state.apply_fn, x, y))(state.params)
    return state.apply_gradients(grads=grads), loss


def test_train_state_matches_plain_train_state_and_skips_without_advancing_step():
    state, ref, x, y = _setup(jaxamp.DynamicLossScale(loss_scale=2.0**10, growth_interval=2))
    assert float(state.loss_scale.loss_scale) == 1024.0
    ref_step = jax.jit(
        lambda r, x, y: r.apply_gradients(grads=jax.grad(_loss_fn(r.apply_fn, x, y))(r.params))
    )
    scales = []
    for t in range(4):
        if t == 1:
            before = state
            state, loss = _step(state, x.at[3, 1].set(jnp.nan), y)
            assert not np.isfinite(float(loss))
            assert bits(state.params) == bits(before.params)
            assert int(state.step) == int(before.step)  # skipped steps do not count
            # The scale moved; the optimizer's own state did not.
            assert bits(state.opt_state.inner_state) == bits(before.opt_state.inner_state)
            assert float(state.loss_scale.loss_scale) == 512.0
        else:
            state, loss = _step(state, x, y)
            ref = ref_step(ref, x, y)
            # Same trajectory as the plain TrainState on the unscaled grads.
            for a, b in zip(
                jax.tree.leaves(state.params), jax.tree.leaves(ref.params), strict=True
            ):
                np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
        scales.append(float(state.loss_scale.loss_scale))
    assert scales == [1024.0, 512.0, 512.0, 1024.0]
    assert int(state.step) == int(ref.step) == 3
    assert int(jaxamp.loss_scaling_metrics(state.opt_state)["skipped_steps"]) == 1


def test_create_accepts_a_wrapped_tx_and_rejects_two_scales():
    params = {"w": jnp.ones(2)}
    wrapped = jaxamp.loss_scaling(optax.sgd(0.1), jaxamp.StaticLossScale(8.0))
    state = jaxamp.flax.LossScaledTrainState.create(apply_fn=None, params=params, tx=wrapped)
    assert float(state.loss_scale.loss_scale) == 8.0
    with pytest.raises(ValueError, match="tx already contains jaxamp.loss_scaling"):
        jaxamp.flax.LossScaledTrainState.create(
            apply_fn=None, params=params, tx=wrapped, loss_scale=jaxamp.StaticLossScale(2.0)
        )
    with pytest.raises(TypeError, match="tx must be an optax.GradientTransformation"):
        jaxamp.flax.LossScaledTrainState.create(apply_fn=None, params=params, tx="sgd")
    default = jaxamp.flax.LossScaledTrainState.create(
        apply_fn=None, params=params, tx=optax.sgd(0.1)
    )
    assert float(default.loss_scale.loss_scale) == 2.0**15


def test_linen_policy_overrides_by_class_and_path():
    model = MLP()
    x = jnp.ones((2, 4))
    with jaxamp.flax.linen_policy("mixed_bfloat16", {nn.LayerNorm: "float32", "head": "float32"}):
        variables = model.init(jax.random.key(0), x)
        dots = dot_dtypes(model.apply, variables, x)
        out = jax.jit(model.apply)(variables, x)
    assert {p.dtype for p in jax.tree.leaves(variables)} == {jnp.dtype("float32")}
    # hidden computes in bfloat16; the head (logits) in float32.
    assert dots == [("bfloat16", "bfloat16"), ("float32", "float32")]
    assert out.dtype == jnp.float32
    # Outside the context the model is the plain float32 model again.
    assert dot_dtypes(model.apply, variables, x) == [("float32", "float32")] * 2

    # Without a path override, the head follows the policy; a float16 policy
    # creates float16 params.
    with jaxamp.flax.linen_policy("float16", {nn.LayerNorm: "float32"}):
        half = model.init(jax.random.key(0), x)
        assert model.apply(half, x).dtype == jnp.float16
    assert half["params"]["hidden"]["kernel"].dtype == jnp.float16
    assert half["params"]["norm"]["scale"].dtype == jnp.float32


def test_linen_policy_keeps_explicit_dtypes_unless_overridden():
    model = MLP(head_dtype=jnp.float32)
    x = jnp.ones((2, 4))
    with jaxamp.flax.linen_policy("mixed_bfloat16", {nn.LayerNorm: "float32"}):
        variables = model.init(jax.random.key(0), x)
        assert dot_dtypes(model.apply, variables, x) == [
            ("bfloat16", "bfloat16"),
            ("float32", "float32"),
        ]
    with jaxamp.flax.linen_policy("float32", {nn.Dense: "mixed_bfloat16"}):
        assert dot_dtypes(model.apply, variables, x) == [("bfloat16", "bfloat16")] * 2
    with (
        pytest.raises(TypeError, match="overrides keys must be module classes"),
        jaxamp.flax.linen_policy("float32", {1.5: "float32"}),
    ):
        pass


def test_train_state_step_counts_applied_windows_when_accumulating():
    params = {"w": jnp.ones(2)}
    tx = jaxamp.loss_scaling(optax.sgd(1.0), jaxamp.StaticLossScale(4.0), accumulation_steps=2)
    state = jaxamp.flax.LossScaledTrainState.create(apply_fn=None, params=params, tx=tx)
    grads = [jnp.array([1.0, 2.0]), jnp.array([3.0, 4.0]), jnp.array([jnp.inf, 0.0]), jnp.ones(2)]
    steps = []
    for g in grads:
        state = state.apply_gradients(grads=state.loss_scale.scale({"w": g}))
        steps.append(int(state.step))
    assert steps == [0, 1, 1, 1]  # window 1 applied; window 2 skipped
    np.testing.assert_array_equal(state.params["w"], [-1.0, -2.0])


class Decoder(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3, name="head")(nn.relu(nn.Dense(8, name="proj")(x)))


class Nested(nn.Module):
    @nn.compact
    def __call__(self, x):
        return Decoder(name="decoder")(nn.Dense(4, name="block")(x))


@pytest.mark.parametrize("key", ["head", "decoder/head", "decoder.head"])
def test_linen_policy_path_keys_match_nested_modules_at_any_depth(key):
    model, x = Nested(), jnp.ones((2, 4))
    with jaxamp.flax.linen_policy("mixed_float16", {key: "float32"}):
        variables = model.init(jax.random.key(0), x)
        dots = dot_dtypes(model.apply, variables, x)
    assert dots == [("float16", "float16")] * 2 + [("float32", "float32")]


def test_linen_policy_casts_the_output_to_the_policy_output_dtype():
    model, x = Nested(), jnp.ones((2, 4))
    with jaxamp.flax.linen_policy("mixed_float16"):
        variables = model.init(jax.random.key(0), x)
        assert dot_dtypes(model.apply, variables, x)[-1] == ("float16", "float16")
        assert model.apply(variables, x).dtype == jnp.float32
        assert jax.jit(model.apply)(variables, x).dtype == jnp.float32
    # A root module with a dtype of its own (a bare Dense) too.
    with jaxamp.flax.linen_policy("params=float32,compute=float16,output=bfloat16"):
        dense = nn.Dense(2)
        assert dense.apply(dense.init(jax.random.key(0), x), x).dtype == jnp.bfloat16


def test_linen_policy_unmatched_key_raises_naming_close_paths():
    model, x = Nested(), jnp.ones((2, 4))
    with (
        pytest.raises(ValueError, match=r"'hed' \(closest paths: 'decoder/head'"),
        jaxamp.flax.linen_policy("mixed_float16", {"hed": "float32"}),
    ):
        model.init(jax.random.key(0), x)
    # A context whose calls all hit a jit cache runs no module: nothing to check.
    step = jax.jit(model.apply)
    variables = model.init(jax.random.key(0), x)
    with jaxamp.flax.linen_policy("mixed_float16", {"head": "float32"}):
        step(variables, x)
    with jaxamp.flax.linen_policy("mixed_float16", {"hed": "float32"}):
        step(variables, x)
