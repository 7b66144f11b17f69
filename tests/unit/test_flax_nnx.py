"""Flax NNX: nnx.Optimizer with loss_scaling, skipping, and per-module policies."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxamp
import jaxamp.flax
from tests.helpers import bits, dot_dtypes


class MLP(nnx.Module):
    def __init__(self, rngs, **kwargs):
        self.hidden = nnx.Linear(4, 8, rngs=rngs, **kwargs)
        self.norm = nnx.LayerNorm(8, rngs=rngs, **kwargs)
        self.head = nnx.Linear(8, 3, rngs=rngs, **kwargs)

    def __call__(self, x):
        return self.head(self.norm(nnx.relu(self.hidden(x))))


def _loss(model, x, y):
    logits = model(x).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def _data():
    x = jax.random.normal(jax.random.key(1), (16, 4))
    return x, jnp.arange(16, dtype=jnp.int32) % 3


@nnx.jit
def _train_step(model, optimizer, x, y):
    scale = jaxamp.get_loss_scale(optimizer.opt_state)
    grad_fn = jaxamp.scaled_value_and_grad(_loss, scale, value_and_grad=nnx.value_and_grad)
    loss, grads = grad_fn(model, x, y)
    optimizer.update(model, grads)
    return loss


def test_get_loss_scale_of_nnx_optimizer_returns_plain_arrays():
    model = MLP(nnx.Rngs(0))
    ls = jaxamp.DynamicLossScale(loss_scale=2.0**8, growth_interval=3)
    optimizer = nnx.Optimizer(model, jaxamp.loss_scaling(optax.sgd(0.1), ls), wrt=nnx.Param)
    scale = jaxamp.get_loss_scale(optimizer.opt_state)
    assert type(scale) is jaxamp.DynamicLossScale
    assert type(scale.loss_scale) is type(jnp.zeros(())) and float(scale.loss_scale) == 256.0
    assert scale.growth_interval == 3
    metrics = jaxamp.loss_scaling_metrics(optimizer.opt_state)
    assert all(isinstance(v, jax.Array) for v in metrics.values())


def test_nnx_optimizer_matches_functional_optax_and_skips_bit_identically():
    ls = jaxamp.DynamicLossScale(loss_scale=2.0**8, growth_interval=2)
    inner = optax.sgd(0.1, momentum=0.9)
    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, jaxamp.loss_scaling(inner, ls), wrt=nnx.Param)
    x, y = _data()

    # Functional reference: plain optax on the unscaled float32 grads.
    graphdef, params = nnx.split(model, nnx.Param)
    params = nnx.as_pure(params)  # plain arrays, not Variables shared with the model
    ref_state = inner.init(params)

    @jax.jit
    def ref_step(params, ref_state):
        value, grads = jax.value_and_grad(lambda p: _loss(nnx.merge(graphdef, p), x, y))(params)
        updates, ref_state = inner.update(grads, ref_state, params)
        return value, optax.apply_updates(params, updates), ref_state

    scales = []
    for step in range(4):
        xb = x.at[0, 0].set(jnp.inf) if step == 1 else x
        before = bits(nnx.state(model, nnx.Param))
        momentum_before = bits(nnx.as_pure(optimizer.opt_state).inner_state)
        scale_before = bits(jaxamp.get_loss_scale(optimizer.opt_state))
        loss = _train_step(model, optimizer, xb, y)
        scales.append(float(jaxamp.get_loss_scale(optimizer.opt_state).loss_scale))
        if step == 1:
            assert not np.isfinite(float(loss))
            assert bits(nnx.state(model, nnx.Param)) == before
            assert bits(nnx.as_pure(optimizer.opt_state).inner_state) == momentum_before
            # (a non-trivial momentum from step 0, kept exactly)
            momentum = jax.tree.leaves(nnx.as_pure(optimizer.opt_state).inner_state)
            assert any(np.any(np.asarray(m) != 0) for m in momentum)
            assert scale_before != bits(jaxamp.get_loss_scale(optimizer.opt_state))
            continue
        ref_value, params, ref_state = ref_step(params, ref_state)
        np.testing.assert_allclose(float(loss), float(ref_value), rtol=1e-6)
        for a, b in zip(
            jax.tree.leaves(nnx.state(model, nnx.Param)), jax.tree.leaves(params), strict=True
        ):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    # 256 -> skip halves to 128 -> two finite steps grow it back to 256.
    assert scales == [256.0, 128.0, 128.0, 256.0]
    assert int(jaxamp.loss_scaling_metrics(optimizer.opt_state)["skipped_steps"]) == 1


def test_float16_nnx_training_keeps_float32_params_and_scales_within_range():
    policy = jaxamp.get_policy("mixed_float16")
    model = MLP(nnx.Rngs(0), **policy.module_kwargs())
    # Flax's normalization calls jnp.promote_types(float16, float32), which strict
    # promotion rejects; LayerNorm in float32 is the usual recipe anyway.
    jaxamp.flax.set_policy(model, policy, overrides={nnx.LayerNorm: "float32"})
    assert model.hidden.dtype == jnp.float16 and model.norm.dtype == jnp.float32
    optimizer = nnx.Optimizer(
        model, jaxamp.loss_scaling(optax.sgd(0.1), jaxamp.DynamicLossScale()), wrt=nnx.Param
    )
    x, y = _data()
    losses = [float(_train_step(model, optimizer, x, y)) for _ in range(5)]
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]
    assert {p.dtype for p in jax.tree.leaves(nnx.state(model, nnx.Param))} == {jnp.dtype("float32")}
    assert float(jaxamp.get_loss_scale(optimizer.opt_state).loss_scale) == 2.0**15


def test_set_policy_with_class_and_path_overrides():
    model = MLP(nnx.Rngs(0))
    jaxamp.flax.set_policy(
        model, "mixed_bfloat16", overrides={nnx.LayerNorm: "float32", "head": "float32"}
    )
    assert model.hidden.dtype == jnp.bfloat16 and model.hidden.param_dtype == jnp.float32
    assert model.norm.dtype == jnp.float32 and model.head.dtype == jnp.float32
    x, _ = _data()
    graphdef, state = nnx.split(model)
    out = nnx.merge(graphdef, state)(x)
    assert out.dtype == jnp.float32
    # hidden's matmul runs in bfloat16, the head's (the logits) in float32.
    dots = dot_dtypes(lambda s, x: nnx.merge(graphdef, s)(x), state, x)
    assert dots == [("bfloat16", "bfloat16"), ("float32", "float32")]

    # A pure float16 policy casts the params themselves.
    jaxamp.flax.set_policy(model, "float16", overrides={"head": "float32"})
    assert model.hidden.kernel.dtype == jnp.float16 and model.head.kernel.dtype == jnp.float32
    assert model.norm.scale.dtype == jnp.float16


def test_set_policy_bad_arguments():
    with pytest.raises(TypeError, match="model must be an nnx.Module"):
        jaxamp.flax.set_policy({"w": 1}, "float32")
    with pytest.raises(TypeError, match="overrides keys must be module classes"):
        jaxamp.flax.set_policy(MLP(nnx.Rngs(0)), "float32", {3: "float32"})
    with pytest.raises(TypeError, match="overrides must be a dict"):
        jaxamp.flax.set_policy(MLP(nnx.Rngs(0)), "float32", [nnx.LayerNorm])
    with pytest.raises(ValueError, match="invalid policy spec"):
        jaxamp.flax.set_policy(MLP(nnx.Rngs(0)), "float32", {"head": "fp8"})


class Decoder(nnx.Module):
    def __init__(self, rngs):
        self.proj = nnx.Linear(4, 8, rngs=rngs)
        self.head = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
        return self.head(nnx.relu(self.proj(x)))


class Nested(nnx.Module):
    def __init__(self, rngs):
        self.blocks = nnx.List([nnx.Linear(4, 4, rngs=rngs) for _ in range(2)])
        self.decoder = Decoder(rngs)

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return self.decoder(x)


@pytest.mark.parametrize("key", ["head", "decoder/head", "decoder.head"])
def test_set_policy_path_keys_match_nested_modules_at_any_depth(key):
    model = jaxamp.flax.set_policy(Nested(nnx.Rngs(0)), "mixed_float16", {key: "float32"})
    assert model.decoder.head.dtype == jnp.float32
    assert model.decoder.proj.dtype == jnp.float16 and model.blocks[1].dtype == jnp.float16
    x = jnp.ones((2, 4))
    assert dot_dtypes(model, x)[-1] == ("float32", "float32")


def test_set_policy_deepest_path_wins_and_list_entries_are_addressable():
    model = jaxamp.flax.set_policy(
        Nested(nnx.Rngs(0)),
        "float32",
        {"decoder": "bfloat16", "decoder/head": "float16", "blocks.1": "bfloat16"},
    )
    assert model.decoder.proj.dtype == jnp.bfloat16 and model.decoder.head.dtype == jnp.float16
    assert model.blocks[0].dtype == jnp.float32 and model.blocks[1].dtype == jnp.bfloat16


def test_set_policy_casts_the_model_output_to_the_policy_output_dtype():
    model = jaxamp.flax.set_policy(Nested(nnx.Rngs(0)), "mixed_float16")
    assert isinstance(model, Nested) and type(model).__name__ == "Nested"
    x = jnp.ones((2, 4))
    assert dot_dtypes(model, x)[-1] == ("float16", "float16")
    assert model(x).dtype == jnp.float32
    graphdef, state = nnx.split(model)
    assert nnx.merge(graphdef, state)(x).dtype == jnp.float32
    # Setting a policy again replaces the output dtype (no cast stacked on a cast).
    jaxamp.flax.set_policy(model, "float16")
    assert model(x).dtype == jnp.float16 and type(model).__mro__[2] is nnx.Module


def test_set_policy_unmatched_key_raises_naming_close_paths_and_changes_nothing():
    model = Nested(nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"'hed' \(closest paths: 'decoder/head'"):
        jaxamp.flax.set_policy(model, "mixed_float16", {"hed": "float32"})
    assert model.decoder.head.dtype is None and model.blocks[0].dtype is None
    with pytest.raises(ValueError, match=r"'BatchNorm' \(module classes in the model: .*Linear"):
        jaxamp.flax.set_policy(model, "mixed_float16", {nnx.BatchNorm: "float32"})
    with pytest.raises(ValueError, match="'encoder/head'"):
        jaxamp.flax.set_policy(model, "mixed_float16", {"encoder/head": "float32"})


def test_orbax_checkpoint_of_an_nnx_optimizer_round_trips_the_loss_scale_configuration(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    import flax.serialization

    def build(loss_scale):
        model = MLP(nnx.Rngs(0))
        tx = jaxamp.loss_scaling(optax.sgd(0.1), loss_scale)
        return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

    def checkpoint(model, optimizer):
        scale = jaxamp.get_loss_scale(optimizer.opt_state)
        return {
            "model": nnx.state(model),
            "optimizer": nnx.state(optimizer),
            "loss_scale": flax.serialization.to_state_dict(scale),
        }

    model, optimizer = build(jaxamp.DynamicLossScale(2.0**8, growth_interval=3, growth_factor=4.0))
    x, y = _data()
    for _ in range(2):
        _train_step(model, optimizer, x, y)
    saved_scale = jaxamp.get_loss_scale(optimizer.opt_state)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "ckpt", checkpoint(model, optimizer))
    checkpointer.wait_until_finished()

    # Into a default-built optimizer, nnx.state alone restores the arrays only.
    plain_model, plain = build(jaxamp.DynamicLossScale())
    restored = checkpointer.restore(tmp_path / "ckpt", checkpoint(plain_model, plain))
    nnx.update(plain, restored["optimizer"])
    assert jaxamp.get_loss_scale(plain.opt_state).growth_interval == 2000

    # The documented route: the configuration comes from the checkpoint.
    stored = checkpointer.restore(tmp_path / "ckpt")["loss_scale"]
    loss_scale = flax.serialization.from_state_dict(jaxamp.DynamicLossScale(), stored)
    model2, optimizer2 = build(loss_scale)
    restored = checkpointer.restore(tmp_path / "ckpt", checkpoint(model2, optimizer2))
    nnx.update(model2, restored["model"])
    nnx.update(optimizer2, restored["optimizer"])
    scale = jaxamp.get_loss_scale(optimizer2.opt_state)
    assert (scale.growth_interval, scale.growth_factor) == (3, 4.0)
    assert bits(scale.loss_scale) == bits(saved_scale.loss_scale)
    assert int(scale.counter) == int(saved_scale.counter) == 2
    assert bits(nnx.state(model2)) == bits(nnx.state(model))  # the params too
