"""A small GPT trained with FSDP on 8 devices, in four precision settings, with its wire bytes.

Every weight matrix is sharded over the 8 devices on its first dim (FSDP /
ZeRO-3: each device keeps one eighth of the parameters and of the Adam state),
and the batch is sharded too. The same model from the same initial weights
trains a few steps on the same batches in each setting:

* ``float32``: the reference;
* ``mixed_bfloat16``: ``jaxamp.autocast(loss, "mixed_bfloat16")`` (bfloat16
  matmuls; weight gradients reduced in the policy's ``reduce_dtype``, float32);
* ``mixed_bfloat16_reduce_bf16``: the same with ``reduce=bfloat16``;
* ``mixed_float8``: ``jaxamp.autocast(loss, "mixed_float8")``.

For each it prints the loss at the first and last step and what one training
step sends between devices, read by ``jaxamp.communication_report`` from the
partitioned program: all-gather and gradient-reduction bytes per parameter by
dtype, and the total bytes per step.

Without real accelerators the 8 devices are CPU devices: the script sets
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` before importing jax
(unless ``XLA_FLAGS`` already forces a count). The tokens follow a fixed
random bigram table, so the loss falls within a few steps.

Run: ``python examples/sharded_gpt.py`` (``--fast`` is the tiny test mode;
``--json`` prints the rows as JSON on the last line). It writes no files.
"""

from __future__ import annotations

import os

if __name__ == "__main__" and "--xla_force_host_platform_device_count" not in os.environ.get(
    "XLA_FLAGS", ""
):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import argparse
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxamp

SETTINGS = {
    "float32": None,
    "mixed_bfloat16": "mixed_bfloat16",
    "mixed_bfloat16_reduce_bf16": "params=float32,compute=bfloat16,output=float32,reduce=bfloat16",
    "mixed_float8": "mixed_float8",
}


@dataclass(frozen=True)
class Size:
    vocab: int
    seq: int
    d_model: int
    n_heads: int
    d_ff: int
    n_layers: int
    batch: int
    steps: int


FULL = Size(vocab=256, seq=64, d_model=256, n_heads=8, d_ff=1024, n_layers=2, batch=32, steps=20)
FAST = Size(vocab=64, seq=16, d_model=64, n_heads=4, d_ff=128, n_layers=1, batch=8, steps=3)


def init_params(size: Size, key: jax.Array) -> dict[str, Any]:
    keys = iter(jax.random.split(key, 4 + 4 * size.n_layers))
    d, f = size.d_model, size.d_ff

    def dense(shape):
        return jax.random.normal(next(keys), shape) / math.sqrt(shape[0])

    blocks = [
        {
            "ln1": jnp.ones(d),
            "qkv": dense((d, 3 * d)),
            "out": dense((d, d)),
            "ln2": jnp.ones(d),
            "up": dense((d, f)),
            "down": dense((f, d)),
        }
        for _ in range(size.n_layers)
    ]
    return {
        "embed": 0.02 * jax.random.normal(next(keys), (size.vocab, d)),
        "pos": 0.02 * jax.random.normal(next(keys), (size.seq, d)),
        "blocks": blocks,
        "ln_f": jnp.ones(d),
        "head": dense((d, size.vocab)),
    }


def layer_norm(x: jax.Array, scale: jax.Array) -> jax.Array:
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * scale


def attention(x: jax.Array, block: dict[str, jax.Array], n_heads: int) -> jax.Array:
    b, t, d = x.shape
    q, k, v = (a.reshape(b, t, n_heads, d // n_heads) for a in jnp.split(x @ block["qkv"], 3, -1))
    scores = jnp.einsum("bthd,bshd->bhts", q, k) / math.sqrt(d // n_heads)
    causal = jnp.tril(jnp.ones((t, t), bool))
    scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
    mixed = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(scores, axis=-1), v)
    return mixed.reshape(b, t, d) @ block["out"]


def loss_fn(params: dict[str, Any], tokens: jax.Array, n_heads: int) -> jax.Array:
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    x = params["embed"][inputs] + params["pos"][: inputs.shape[1]]
    for block in params["blocks"]:
        x = x + attention(layer_norm(x, block["ln1"]), block, n_heads)
        h = jax.nn.gelu(layer_norm(x, block["ln2"]) @ block["up"])
        x = x + h @ block["down"]
    logits = layer_norm(x, params["ln_f"]) @ params["head"]
    logp = jax.nn.log_softmax(logits.astype(jnp.float32))
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def fsdp_specs(params: Any) -> Any:
    """Matrices sharded on their first dim over "data"; vectors replicated."""
    return jax.tree.map(lambda p: P("data") if p.ndim == 2 else P(), params)


def batches(size: Size, seed: int = 0) -> np.ndarray:
    """Token sequences drawn from a fixed random bigram table: [steps, batch, seq + 1]."""
    rng = np.random.default_rng(seed)
    table = rng.dirichlet(np.full(size.vocab, 0.1), size.vocab)
    tokens = np.zeros((size.steps, size.batch, size.seq + 1), np.int32)
    tokens[..., 0] = rng.integers(0, size.vocab, (size.steps, size.batch))
    for i in range(1, size.seq + 1):
        cdf = table[tokens[..., i - 1]].cumsum(-1)
        tokens[..., i] = (rng.random(cdf.shape[:-1])[..., None] > cdf).sum(-1)
    return np.minimum(tokens, size.vocab - 1)


def wire_summary(report: jaxamp.CommunicationReport) -> dict[str, Any]:
    """Bytes per step, and bytes per parameter of gathers and reductions by dtype."""
    per_param: dict[str, float] = {}
    for (kind, dtype), (_, total) in report.totals().items():
        group = {"all-gather": "gather", "reduce-scatter": "reduce", "all-reduce": "reduce"}
        key = f"{group.get(kind, kind)} {dtype.name}"
        per_param[key] = per_param.get(key, 0.0) + total / report.param_count
    return {"bytes_per_step": report.bytes_by(), "B_per_param": per_param}


def train(size: Size, setting: str, mesh: Any) -> dict[str, Any]:
    policy = SETTINGS[setting]
    n_heads = size.n_heads

    def loss(params, tokens):
        return loss_fn(params, tokens, n_heads)

    if policy is not None:
        loss = jaxamp.autocast(loss, policy)
    tx = optax.adamw(1e-3)
    params = init_params(size, jax.random.key(0))
    p_sharding = jax.tree.map(lambda s: NamedSharding(mesh, s), fsdp_specs(params))
    params = jax.device_put(params, p_sharding)
    opt_state = tx.init(params)
    tokens_sharding = NamedSharding(mesh, P("data"))

    @jax.jit
    def step(params, opt_state, tokens):
        value, grads = jax.value_and_grad(loss)(params, tokens)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return jax.lax.with_sharding_constraint(params, p_sharding), opt_state, value

    data = batches(size)
    first = jax.device_put(data[0], tokens_sharding)
    report = jaxamp.communication_report(step, params, opt_state, first)
    losses = []
    for t in range(size.steps):
        tokens = jax.device_put(data[t], tokens_sharding)
        params, opt_state, value = step(params, opt_state, tokens)
        losses.append(float(value))
    return {"setting": setting, "losses": losses, **wire_summary(report)}


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fast", action="store_true", help="tiny model, 3 steps (tests)")
    parser.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON last")
    args = parser.parse_args(argv)
    size = FAST if args.fast else FULL
    n = len(jax.devices())
    mesh = jax.make_mesh((n,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    print(f"{n} {jax.devices()[0].platform} devices, FSDP over all of them; {size}")
    rows = []
    for setting in args.settings.split(","):
        row = train(size, setting, mesh)
        rows.append(row)
        wire = ", ".join(f"{k} {v:.2f}" for k, v in sorted(row["B_per_param"].items()))
        print(
            f"{setting:28s} loss {row['losses'][0]:.3f} -> {row['losses'][-1]:.3f}   "
            f"{row['bytes_per_step'] / 1e6:.2f} MB/step   B/param: {wire}"
        )
    if args.json:
        print(json.dumps(rows))
    return rows


if __name__ == "__main__":
    main()
