"""A mixture-of-experts feed-forward layer (Flax NNX) through ``jax.lax.ragged_dot``.

charlm's blocks use it in place of their MLP with ``--experts N``: a linear
router picks the top 2 of ``N`` experts for every token, the tokens are sorted
by expert, and each expert's GELU MLP runs as one ``ragged_dot`` per layer over
the sorted rows (the grouped GEMM that FP8 and FP4 recipes quantize per expert
group). The two outputs of a token are summed, weighted by its renormalised
router probabilities.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

TOP_K = 2


class MoEFeedForward(nnx.Module):
    """Top-2-of-``experts`` GELU MLPs; ``up``/``down`` are ``[experts, in, out]`` kernels."""

    def __init__(
        self, width: int, hidden: int, experts: int, rngs: nnx.Rngs, *, dtype, param_dtype
    ):
        init = jax.nn.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
        kwargs = {"dtype": dtype, "param_dtype": param_dtype}
        self.router = nnx.Linear(width, experts, use_bias=False, rngs=rngs, **kwargs)
        self.up = nnx.Param(init(rngs.params(), (experts, width, hidden), param_dtype))
        self.down = nnx.Param(init(rngs.params(), (experts, hidden, width), param_dtype))
        self.experts = experts
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        probs = jax.nn.softmax(self.router(tokens).astype(jnp.float32))
        gates, chosen = jax.lax.top_k(probs, TOP_K)
        gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
        expert = chosen.reshape(-1)
        order = jnp.argsort(expert)
        token = order // TOP_K
        sizes = jnp.bincount(expert, length=self.experts).astype(jnp.int32)
        rows = tokens[token].astype(self.dtype)
        hidden = nnx.gelu(jax.lax.ragged_dot(rows, self.up[...].astype(self.dtype), sizes))
        out = jax.lax.ragged_dot(hidden, self.down[...].astype(self.dtype), sizes)
        out = out * gates.reshape(-1)[order][:, None].astype(out.dtype)
        mixed = jnp.zeros_like(tokens).at[token].add(out.astype(tokens.dtype))
        return mixed.reshape(shape)
