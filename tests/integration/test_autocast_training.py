"""autocast on a Flax NNX transformer: training with loss scaling, and compiled memory."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp

nnx = pytest.importorskip("flax.nnx")


class Block(nnx.Module):
    def __init__(self, d, heads, dtype, rngs):
        self.ln1 = nnx.LayerNorm(d, dtype=dtype, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(heads, d, dtype=dtype, decode=False, rngs=rngs)
        self.ln2 = nnx.LayerNorm(d, dtype=dtype, rngs=rngs)
        self.fc1 = nnx.Linear(d, 4 * d, dtype=dtype, rngs=rngs)
        self.fc2 = nnx.Linear(4 * d, d, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(jax.nn.gelu(self.fc1(self.ln2(x))))


class TinyLM(nnx.Module):
    """A pre-LayerNorm transformer language model; ``dtype`` is Flax's compute dtype."""

    def __init__(self, vocab, d, heads, layers, dtype=None, *, rngs):
        self.embed = nnx.Embed(vocab, d, dtype=dtype, rngs=rngs)
        self.blocks = nnx.List([Block(d, heads, dtype, rngs) for _ in range(layers)])
        self.ln = nnx.LayerNorm(d, dtype=dtype, rngs=rngs)
        self.head = nnx.Linear(d, vocab, dtype=dtype, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


@functools.cache  # building the model initialises eagerly (slow); share it between tests
def _lm(dtype=None, vocab=32, d=32, heads=2, layers=1):
    graphdef, params = nnx.split(TinyLM(vocab, d, heads, layers, dtype, rngs=nnx.Rngs(0)))

    def loss_fn(params, tokens):
        logits = nnx.merge(graphdef, params)(tokens[:, :-1])
        labels = tokens[:, 1:]
        logits = logits.astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    return loss_fn, params


def _tokens(batch=4, length=9, vocab=32):
    # A learnable pattern: each row counts up from a random start.
    starts = jax.random.randint(jax.random.key(1), (batch, 1), 0, vocab)
    return (starts + jnp.arange(length)[None]) % vocab


def _train(loss_fn, params, tokens, steps, policy=None):
    if policy is not None:
        loss_fn = jaxamp.autocast(loss_fn, policy)
    tx = jaxamp.loss_scaling(optax.sgd(0.3, momentum=0.9), jaxamp.DynamicLossScale(2.0**15))
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, tokens):
        scale = jaxamp.get_loss_scale(opt_state)
        loss, grads = jax.value_and_grad(lambda p: scale.scale(loss_fn(p, tokens)))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, scale.unscale(loss)

    losses = []
    for _ in range(steps):
        params, opt_state, loss = step(params, opt_state, tokens)
        losses.append(float(loss))
    return params, opt_state, np.array(losses)


@functools.cache
def _float32_losses():
    loss_fn, params = _lm()
    return _train(loss_fn, params, _tokens(), steps=12)[2]


def test_nnx_model_trains_through_autocast_with_loss_scaling():
    policy = "mixed_float16"  # the policy that needs loss scaling (bf16 runs in the other tests)
    loss_fn, params = _lm()
    tokens = _tokens()
    want = _float32_losses()
    new_params, opt_state, got = _train(loss_fn, params, tokens, steps=12, policy=policy)
    # Master weights stay float32; the loss falls like the float32 run's.
    assert {leaf.dtype for leaf in jax.tree.leaves(new_params)} == {jnp.dtype(jnp.float32)}
    assert got[-1] < 0.5 * got[0]
    np.testing.assert_allclose(got, want, rtol=0.1)
    assert not np.array_equal(got, want)  # it did compute in 16 bits
    metrics = jaxamp.loss_scaling_metrics(opt_state)
    assert int(metrics["skipped_steps"]) == 0
    # Every matmul of the training step, backward included, is 16-bit.
    grad_fn = jax.grad(jaxamp.autocast(loss_fn, policy))
    report = jaxamp.precision_report(grad_fn, params, tokens)
    assert report.fraction_in(jaxamp.get_policy(policy).compute_dtype) == 1.0
    assert {m.accumulation_dtype for m in report.matmuls} == {"float32"}


def _temp_bytes(loss_fn, params, tokens):
    def step(params, tokens):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss

    compiled = jax.jit(step).lower(params, tokens).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_compiled_memory_matches_hand_written_bfloat16():
    tokens = _tokens(batch=4, length=33)
    loss_f32, params_f32 = _lm(None)  # the model of the training test (built once)
    loss_bf16, params_bf16 = _lm(jnp.bfloat16)
    autocast_bytes = _temp_bytes(jaxamp.autocast(loss_f32), params_f32, tokens)
    with jax.numpy_dtype_promotion("standard"):  # Flax's bf16 layers mix dtypes
        hand_bytes = _temp_bytes(loss_bf16, params_bf16, tokens)
    ratio = autocast_bytes / hand_bytes
    print(
        f"compiled temp memory: autocast {autocast_bytes} B, hand bf16 {hand_bytes} B, {ratio=:.3f}"
    )
    assert ratio <= 1.1
