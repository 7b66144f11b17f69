"""The model zoo every capability runs on (tests/integration/test_capability_matrix.py).

Each model is a real library's own classes at a tiny size, with what real training code
has and unit tests tend to lack: ``custom_jvp`` activations (relu, gelu, silu, softplus),
dropout, typed PRNG keys (as arguments, and as constants of the trace when the batch is
closed over by an outer ``jit``), convolutions, attention with a causal mask, embeddings,
normalization layers, a reparameterization through a jitted function and a mixture of
experts through ``jax.lax.ragged_dot``.

A model is ``Model(name, loss, params, batch)``: ``loss(params, *batch)`` is a float32
scalar, ``params`` a float32 pytree (the first argument, the one that is differentiated
and sharded), ``batch`` a tuple whose last entry is a typed PRNG key. Models are built
once per process (``model(name)``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

F32 = jnp.float32
CLASSES = 4


class Model(NamedTuple):
    name: str
    loss: Callable[..., jax.Array]
    params: Any
    batch: tuple
    convolutions: bool = False  # convolutions run tensorwise under every FP8 recipe


def _normal(seed: int, *shape: int) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), F32)


def _labels(seed: int, n: int) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).integers(0, CLASSES, n), jnp.int32)


def _cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    logp = jax.nn.log_softmax(logits.astype(F32))
    return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=-1))


def _nnx_mlp() -> Model:
    from flax import nnx

    class Mlp(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.l1 = nnx.Linear(16, 32, rngs=rngs)
            self.norm = nnx.LayerNorm(32, rngs=rngs)
            self.drop = nnx.Dropout(0.1)
            self.l2 = nnx.Linear(32, 16, rngs=rngs)
            self.l3 = nnx.Linear(16, CLASSES, rngs=rngs)

        def __call__(self, x, key):
            h = self.drop(jax.nn.relu(self.norm(self.l1(x))), rngs=nnx.Rngs(dropout=key))
            return self.l3(jax.nn.gelu(self.l2(h)))

    graphdef, params = nnx.split(Mlp(nnx.Rngs(0)), nnx.Param)

    def loss(params, x, y, key):
        return _cross_entropy(nnx.merge(graphdef, params)(x, key), y)

    return Model("nnx_mlp", loss, params, (_normal(1, 8, 16), _labels(2, 8), jax.random.key(3)))


def _linen_cnn() -> Model:
    from flax import linen as nn

    class Cnn(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool = True):
            h = jax.nn.silu(nn.Conv(8, (3, 3))(x))
            h = nn.Dropout(0.1, deterministic=not train)(h)
            h = nn.max_pool(h, (2, 2), strides=(2, 2)).reshape(x.shape[0], -1)
            return nn.Dense(CLASSES)(jax.nn.softplus(nn.Dense(16)(h)))

    model = Cnn()
    x = _normal(4, 4, 8, 8, 2)
    params = model.init({"params": jax.random.key(0)}, x, train=False)["params"]

    def loss(params, x, y, key):
        logits = model.apply({"params": params}, x, rngs={"dropout": key})
        return _cross_entropy(logits, y)

    return Model("linen_cnn", loss, params, (x, _labels(5, 4), jax.random.key(6)), True)


def _haiku_mlp() -> Model:
    import haiku as hk

    def forward(x, key):
        h = hk.nets.MLP([32, 16], activation=jax.nn.softplus)(x)
        # hk.dropout promotes a bool mask against floats, which strict promotion rejects.
        keep = jax.random.bernoulli(key, 0.9, h.shape)
        h = jnp.where(keep, jax.nn.relu(h) / 0.9, jnp.zeros((), h.dtype))
        return hk.Linear(CLASSES)(h)

    fn = hk.without_apply_rng(hk.transform(forward))
    x, key = _normal(7, 8, 16), jax.random.key(8)
    params = fn.init(jax.random.key(0), x, key)

    def loss(params, x, y, key):
        return _cross_entropy(fn.apply(params, x, key), y)

    return Model("haiku_mlp", loss, params, (x, _labels(9, 8), key))


def _equinox_mlp() -> Model:
    import equinox as eqx

    mlp = eqx.nn.MLP(16, CLASSES, 32, depth=2, activation=jax.nn.silu, key=jax.random.key(0))
    params, static = eqx.partition(mlp, eqx.is_inexact_array)
    dropout = eqx.nn.Dropout(0.1)

    def loss(params, x, y, key):
        model = eqx.combine(params, static)
        h = jax.vmap(model.layers[0])(x)
        h = dropout(jax.nn.gelu(h), key=key)
        for layer in model.layers[1:-1]:
            h = jax.nn.silu(jax.vmap(layer)(h))
        return _cross_entropy(jax.vmap(model.layers[-1])(h), y)

    return Model(
        "equinox_mlp", loss, params, (_normal(10, 8, 16), _labels(11, 8), jax.random.key(12))
    )


def _gpt() -> Model:
    from benchmarks._models import GPT, GPTConfig, gpt_batch, gpt_init, gpt_loss_fn

    config = GPTConfig(vocab=32, seq=8, d_model=16, n_heads=2, d_ff=32, n_layers=1, batch=8)
    model = GPT(config)
    next_token = gpt_loss_fn(model)

    def loss(params, inputs, targets, key):
        # Embedding noise from a key (the key is one more input a real step carries).
        noisy = {
            **params,
            "pos_embedding": params["pos_embedding"]
            + 1e-3 * jax.random.normal(key, params["pos_embedding"].shape),
        }
        return next_token(noisy, {"inputs": inputs, "targets": targets})

    batch = gpt_batch(config)
    return Model(
        "gpt",
        loss,
        gpt_init(model, config),
        (batch["inputs"], batch["targets"], jax.random.key(13)),
    )


def _vae() -> Model:
    from flax import linen as nn

    class Vae(nn.Module):
        @nn.compact
        def __call__(self, x, key):
            h = jax.nn.relu(nn.Dense(16)(x))
            mean, logvar = nn.Dense(4)(h), nn.Dense(4)(h)
            z = _reparameterize(key, mean, logvar)
            recon = nn.Dense(16)(jax.nn.gelu(nn.Dense(16)(z)))
            return recon, mean, logvar

    model = Vae()
    x = jax.nn.sigmoid(_normal(14, 8, 16))
    key = jax.random.key(15)
    params = model.init(jax.random.key(0), x, key)["params"]

    def loss(params, x, y, key):
        del y
        logits, mean, logvar = model.apply({"params": params}, x, key)
        bce = jnp.mean(jnp.sum(jax.nn.softplus(logits) - x * logits, axis=-1))
        kl = -0.5 * jnp.mean(jnp.sum(1 + logvar - mean**2 - jnp.exp(logvar), axis=-1))
        return (bce + kl).astype(F32)

    return Model("vae", loss, params, (x, _labels(16, 8), key))


def _moe() -> Model:
    """Top-2 of 4 experts through ``jax.lax.ragged_dot``, tokens sorted by expert."""
    experts, d, hidden = 4, 16, 32
    params = {
        "router": 0.1 * _normal(17, d, experts),
        "up": _normal(18, experts, d, hidden) / 4,
        "down": _normal(19, experts, hidden, d) / 6,
        "head": _normal(20, d, CLASSES) / 4,
    }

    def loss(params, x, y, key):
        # Router jitter from the key (the noise Switch Transformers add to the logits).
        logits = x @ params["router"] + 0.01 * jax.random.normal(key, (x.shape[0], experts))
        gates, chosen = jax.lax.top_k(jax.nn.softmax(logits), 2)
        expert = chosen.reshape(-1)
        order = jnp.argsort(expert)
        token = order // 2
        sizes = jnp.bincount(expert, length=experts).astype(jnp.int32)
        h = jax.nn.silu(jax.lax.ragged_dot(x[token], params["up"], sizes))
        out = jax.lax.ragged_dot(h, params["down"], sizes) * gates.reshape(-1)[order][:, None]
        mixed = jnp.zeros_like(x).at[token].add(out.astype(x.dtype))
        return _cross_entropy((x + mixed) @ params["head"], y)

    return Model("moe", loss, params, (_normal(21, 16, d), _labels(22, 16), jax.random.key(23)))


# Flax's VAE example draws its noise in a jitted function: under an outer jit that closes
# over the batch, the key reaches it as a constant of the trace.
@jax.jit
def _reparameterize(key, mean, logvar):
    return mean + jnp.exp(0.5 * logvar) * jax.random.normal(key, logvar.shape)


BUILDERS: dict[str, Callable[[], Model]] = {
    "nnx_mlp": _nnx_mlp,
    "linen_cnn": _linen_cnn,
    "haiku_mlp": _haiku_mlp,
    "equinox_mlp": _equinox_mlp,
    "gpt": _gpt,
    "vae": _vae,
    "moe": _moe,
}
NAMES = tuple(BUILDERS)


@functools.cache
def model(name: str) -> Model:
    """The zoo's model ``name``, built once per process."""
    return BUILDERS[name]()


def closed_loss(m: Model, dtype: Any = None) -> Callable[[Any], jax.Array]:
    """``loss(params)`` with the batch closed over: under ``jit`` it, the key included,
    is a constant of the trace (a training loop over a fixed batch). ``dtype``: the
    batch's floating leaves cast to it (for 16-bit params)."""
    if dtype is None:
        return lambda params: m.loss(params, *m.batch)
    batch = _cast_floating(m.batch, dtype)

    def loss(params):
        # The layer libraries promote 16-bit params against their own float32 values
        # (flax's LayerNorm, a float32 noise draw), which strict promotion rejects: the
        # model's own code runs under standard promotion, as users run it; jaxamp's
        # rewriting of it does not.
        with jax.numpy_dtype_promotion("standard"):
            return m.loss(params, *batch)

    return loss


def _cast_floating(tree: Any, dtype: Any) -> Any:
    def cast(x):
        return x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x

    return jax.tree.map(cast, tree)
