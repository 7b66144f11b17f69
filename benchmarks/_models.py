"""Models shared by the benchmarks: a deep MLP with an exact leaf count, and a GPT-style Flax model.

Every loss returns a float32 scalar whatever the compute dtype, as a mixed-precision
training loop would.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

# ----------------------------------------------------------------------------- MLP


def mlp_params(n_leaves: int, width: int = 16, seed: int = 0) -> dict[str, jax.Array]:
    """Parameters of a chain of ``n_leaves // 2`` dense layers (one weight, one bias each).

    The leaf count is the knob of ``compile_scaling``: real models have hundreds of
    leaves (a 24-layer transformer: 300+).
    """
    if n_leaves < 2 or n_leaves % 2:
        raise ValueError(f"n_leaves must be an even number >= 2; got {n_leaves}.")
    rng = np.random.default_rng(seed)
    params = {}
    for i in range(n_leaves // 2):
        w = rng.normal(0.0, 1.0 / np.sqrt(width), (width, width)).astype(np.float32)
        params[f"layer{i:04d}_w"] = jnp.asarray(w)
        params[f"layer{i:04d}_b"] = jnp.zeros((width,), jnp.float32)
    return params


def mlp_batch(width: int = 16, batch: int = 8, seed: int = 1) -> dict[str, jax.Array]:
    rng = np.random.default_rng(seed)
    return {
        "x": jnp.asarray(rng.normal(size=(batch, width)).astype(np.float32)),
        "y": jnp.asarray(rng.normal(size=(batch, width)).astype(np.float32)),
    }


def mlp_loss(params: dict[str, jax.Array], batch: dict[str, jax.Array]) -> jax.Array:
    """Mean squared error of the tanh chain; the last layer is linear."""
    names = sorted(k[:-2] for k in params if k.endswith("_w"))
    x = batch["x"]
    for i, name in enumerate(names):
        x = x @ params[name + "_w"] + params[name + "_b"]
        if i + 1 < len(names):
            x = jnp.tanh(x)
    return jnp.mean(jnp.square(x - batch["y"]))


# ----------------------------------------------------------------------------- GPT


@dataclass(frozen=True)
class GPTConfig:
    """A GPT-2 style decoder; ``vocab``, ``d_model``, ``d_ff`` are the dims Tensor Cores see."""

    vocab: int = 256
    seq: int = 64
    d_model: int = 128
    n_heads: int = 4
    d_ff: int = 512
    n_layers: int = 4
    batch: int = 8

    def padded(self, multiple: int) -> GPTConfig:
        """The same model with vocab, model and MLP widths rounded up to ``multiple``."""
        from jaxamp import align_dim

        return GPTConfig(
            vocab=align_dim(self.vocab, multiple),
            seq=self.seq,
            d_model=align_dim(self.d_model, multiple),
            n_heads=self.n_heads,
            d_ff=align_dim(self.d_ff, multiple),
            n_layers=self.n_layers,
            batch=self.batch,
        )

    def n_params(self) -> int:
        per_layer = 4 * self.d_model**2 + 2 * self.d_model * self.d_ff + 9 * self.d_model
        per_layer += self.d_ff
        return (
            self.vocab * self.d_model
            + self.seq * self.d_model
            + self.n_layers * per_layer
            + 2 * self.d_model
            + self.d_model * self.vocab
            + self.vocab
        )

    def train_flops_per_step(self) -> float:
        """Model FLOPs of one forward+backward (PaLM appendix B: 6N per token + attention)."""
        tokens = self.batch * self.seq
        attention = 12 * self.n_layers * self.d_model * self.seq
        return float(tokens * (6 * self.n_params() + attention))


class _Block(nn.Module):
    config: GPTConfig
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        kw = {"dtype": self.dtype, "param_dtype": self.param_dtype}
        h = nn.LayerNorm(**kw)(x)
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
        h = nn.MultiHeadDotProductAttention(
            num_heads=c.n_heads, qkv_features=c.d_model, out_features=c.d_model, **kw
        )(h, h, mask=mask)
        x = x + h
        h = nn.LayerNorm(**kw)(x)
        h = nn.Dense(c.d_ff, **kw)(h)
        h = nn.gelu(h)
        h = nn.Dense(c.d_model, **kw)(h)
        return x + h


class _OneHotEmbed(nn.Module):
    """``nn.Embed``'s table (same name, shape and init), read by a one-hot product.

    Under explicit sharding (``AxisType.Explicit``) a table gather by
    batch-sharded tokens has no output sharding JAX can infer; a product has.
    """

    num_embeddings: int
    features: int
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        init = nn.initializers.variance_scaling(1.0, "fan_in", "normal", out_axis=0)
        shape = (self.num_embeddings, self.features)
        table = self.param("embedding", init, shape, self.param_dtype)
        dtype = self.dtype or table.dtype
        return jax.nn.one_hot(tokens, self.num_embeddings, dtype=dtype) @ table.astype(dtype)


class GPT(nn.Module):
    """Token + position embedding, ``n_layers`` pre-LN blocks, final LN, untied LM head."""

    config: GPTConfig
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    # Not a field: OneHotGPT sets it (Flax modules are dataclasses).
    one_hot: ClassVar[bool] = False

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        c = self.config
        kw = {"dtype": self.dtype, "param_dtype": self.param_dtype}
        if self.one_hot:
            x = _OneHotEmbed(c.vocab, c.d_model, name="Embed_0", **kw)(tokens)
        else:
            x = nn.Embed(c.vocab, c.d_model, **kw)(tokens)
        pos = self.param("pos_embedding", nn.initializers.normal(0.02), (c.seq, c.d_model))
        if self.one_hot:
            # Positions shaped (and sharded) like the tokens: the product's gradient
            # is then a sum over the batch, as the products of a reduced value must be.
            positions = jnp.zeros_like(tokens) + jnp.arange(c.seq, dtype=tokens.dtype)
            pos = jax.nn.one_hot(positions, c.seq, dtype=pos.dtype) @ pos
        x = x + jnp.asarray(pos, x.dtype)
        for _ in range(c.n_layers):
            x = _Block(c, **kw)(x)
        x = nn.LayerNorm(**kw)(x)
        return nn.Dense(c.vocab, **kw)(x)


class OneHotGPT(GPT):
    """The GPT with both embeddings read by one-hot products (the same parameters and values).

    For meshes of ``AxisType.Explicit`` axes: there a table gather by batch-sharded
    tokens has no output sharding JAX can infer, and a parameter typed ``reduced``
    (``policy.cast_to_compute(..., matmul_operands=...)``) meets batch-sharded
    values in products only.
    """

    one_hot: ClassVar[bool] = True


def gpt_batch(config: GPTConfig, seed: int = 0) -> dict[str, jax.Array]:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, config.vocab, (config.batch, config.seq + 1), dtype=np.int32)
    return {"inputs": jnp.asarray(tokens[:, :-1]), "targets": jnp.asarray(tokens[:, 1:])}


def gpt_init(model: GPT, config: GPTConfig, seed: int = 0) -> Any:
    """Fresh parameters (new buffers: safe to donate); equal for models differing only in
    ``dtype``, so the variants of one benchmark start from the same point."""
    params = _gpt_init_cached(config, np.dtype(model.param_dtype), seed)
    return jax.tree.map(lambda x: jnp.array(x, copy=True), params)


@functools.lru_cache(maxsize=8)
def _gpt_init_cached(config: GPTConfig, param_dtype: np.dtype, seed: int) -> Any:
    # Flax's init costs seconds of tracing and compiling on CPU; do it once per config.
    model = GPT(config, param_dtype=param_dtype)
    tokens = jnp.zeros((1, config.seq), jnp.int32)
    return jax.jit(model.init)(jax.random.key(seed), tokens)["params"]


def gpt_loss_fn(model: GPT) -> Any:
    """``loss(params, batch)``: next-token cross-entropy, computed in float32."""

    def loss(params: Any, batch: dict[str, jax.Array]) -> jax.Array:
        logits = model.apply({"params": params}, batch["inputs"]).astype(jnp.float32)
        logp = jax.nn.log_softmax(logits)
        if model.one_hot:  # no gather by batch-sharded indices under explicit sharding
            hot = jax.nn.one_hot(batch["targets"], logp.shape[-1], dtype=logp.dtype)
            return -jnp.mean(jnp.sum(logp * hot, axis=-1))
        picked = jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)
        return -jnp.mean(picked)

    return loss
