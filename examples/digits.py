"""Train a small classifier on scikit-learn's digits under several precision policies.

Minimal version: a two-layer MLP in plain JAX, float32 vs mixed_bfloat16 vs
mixed_float16 with dynamic loss scaling. Run: ``python examples/digits.py``.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits

import jaxamp


def load_data(seed: int = 0):
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    split = int(0.8 * len(x))
    return (x[:split], y[:split]), (x[split:], y[split:])


def init_params(key, hidden=128):
    k1, k2 = jax.random.split(key)
    return {
        "w1": jax.random.normal(k1, (64, hidden)) / 8.0,
        "b1": jnp.zeros(hidden),
        "w2": jax.random.normal(k2, (hidden, 10)) / np.sqrt(hidden),
        "b2": jnp.zeros(10),
    }


def forward(params, x, policy):
    params, x = policy.cast_to_compute((params, x))
    h = jax.nn.relu(x @ params["w1"] + params["b1"])
    return policy.cast_to_output(h @ params["w2"] + params["b2"])


def train(policy_name: str, steps: int, batch: int, seed: int):
    policy = jaxamp.get_policy(policy_name)
    (x_train, y_train), (x_test, y_test) = load_data(seed)
    params = init_params(jax.random.key(seed))
    needs_scaling = policy.compute_dtype == jnp.float16
    scale = jaxamp.DynamicLossScale() if needs_scaling else jaxamp.NoOpLossScale()
    tx = jaxamp.loss_scaling(optax.sgd(0.1, momentum=0.9), scale)
    opt_state = tx.init(params)

    def loss_fn(p, x, y):
        logits = forward(p, x, policy)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    @jax.jit
    def step(p, s, x, y):
        ls = jaxamp.get_loss_scale(s)
        loss, grads = jax.value_and_grad(lambda p: ls.scale(loss_fn(p, x, y)))(p)
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s, ls.unscale(loss)

    rng = np.random.default_rng(seed)
    start = time.perf_counter()
    for _ in range(steps):
        idx = rng.integers(0, len(x_train), batch)
        params, opt_state, loss = step(params, opt_state, x_train[idx], y_train[idx])
    loss = float(loss)
    seconds = time.perf_counter() - start
    logits = jax.jit(forward, static_argnums=2)(params, x_test, policy)
    accuracy = float((logits.argmax(-1) == y_test).mean())
    metrics = jaxamp.loss_scaling_metrics(opt_state)
    return {
        "policy": policy_name,
        "accuracy": accuracy,
        "loss": loss,
        "skipped": int(metrics["skipped_steps"]),
        "loss_scale": float(metrics["loss_scale"]),
        "seconds": seconds,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--policies",
        default="float32,mixed_bfloat16,mixed_float16",
        help="comma-separated policy names",
    )
    args = parser.parse_args(argv)
    rows = [train(p, args.steps, args.batch_size, args.seed) for p in args.policies.split(",")]
    print(f"{'policy':<16}{'accuracy':>10}{'loss':>10}{'skipped':>9}{'scale':>10}{'time s':>8}")
    for r in rows:
        print(
            f"{r['policy']:<16}{r['accuracy']:>10.4f}{r['loss']:>10.4f}{r['skipped']:>9d}"
            f"{r['loss_scale']:>10.0f}{r['seconds']:>8.2f}"
        )
    return rows


if __name__ == "__main__":
    main()
