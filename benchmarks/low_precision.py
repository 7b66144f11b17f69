"""Memory and step time of 16-bit params and Adam state (``jaxamp.low_precision_optimizer``).

Bytes of params plus optimizer state per parameter, counted exactly from the arrays
(``size * itemsize`` of every leaf, step counters and keys included), for Adam with:
float32 params and moments (the reference), optax's ``mu_dtype=bfloat16``, bfloat16
params with float32 moments, and bfloat16 params and moments rounded to nearest,
stochastically or with Kahan compensation. Then the step time of each, on an MLP,
against the float32-master step: every variant compiled once, repetitions
interleaved in rotating order in this process, medians and ratios.

    python -m benchmarks.low_precision            # full run
    python -m benchmarks.low_precision --smoke    # seconds
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

import jaxamp
from benchmarks import _harness, _models

NAME = "low_precision"
REFERENCE = "float32_master"


def _adam(**kwargs: Any) -> optax.GradientTransformation:
    return optax.adam(1e-3, **kwargs)


def _low(rounding: str, state_dtype: Any) -> Callable[[], optax.GradientTransformation]:
    return lambda: jaxamp.low_precision_optimizer(
        _adam(), rounding=rounding, state_dtype=state_dtype
    )


# name: (param dtype, optimizer factory)
VARIANTS: dict[str, tuple[Any, Callable[[], optax.GradientTransformation]]] = {
    REFERENCE: (jnp.float32, _adam),
    "optax_mu_dtype_bf16": (jnp.float32, lambda: _adam(mu_dtype=jnp.bfloat16)),
    "bf16_params_f32_state": (jnp.bfloat16, _low("stochastic", None)),
    "bf16_nearest": (jnp.bfloat16, _low("nearest", jnp.bfloat16)),
    "bf16_stochastic": (jnp.bfloat16, _low("stochastic", jnp.bfloat16)),
    "bf16_kahan": (jnp.bfloat16, _low("kahan", jnp.bfloat16)),
}


def bytes_per_param(params: Any, opt_state: Any) -> dict[str, float]:
    """Bytes of params and of optimizer state per parameter, exactly from the arrays."""
    count = sum(x.size for x in jax.tree.leaves(params))

    def nbytes(tree: Any) -> int:
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))

    return {
        "n_params": count,
        "params_bytes_per_param": nbytes(params) / count,
        "state_bytes_per_param": nbytes(opt_state) / count,
        "total_bytes_per_param": (nbytes(params) + nbytes(opt_state)) / count,
        "state_fixed_bytes": sum(
            x.size * x.dtype.itemsize for x in jax.tree.leaves(opt_state) if x.size <= 2
        ),
    }


def _step_fn(tx: optax.GradientTransformation, batch: Any) -> Callable:
    def loss(params):
        # Same float32 compute for every variant: only the optimizer differs.
        return _models.mlp_loss(jaxamp.cast_floating(params, jnp.float32), batch)

    def step(state):
        params, opt_state = state
        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), value

    return step


def _run(step: Callable, state: Any, n: int) -> tuple[Any, float]:
    start = time.perf_counter()
    for _ in range(n):
        state, value = step(state)
    jax.block_until_ready((state, value))
    return state, (time.perf_counter() - start) / n


def measure(smoke: bool, reps: int, rep_seconds: float) -> list[dict[str, Any]]:
    width, n_leaves, batch_size = (16, 4, 4) if smoke else (512, 8, 32)
    params32 = _models.mlp_params(n_leaves, width=width)
    batch = _models.mlp_batch(width=width, batch=batch_size)
    steps, states, results = {}, {}, {}
    for name, (dtype, make_tx) in VARIANTS.items():
        tx = make_tx()
        params = jaxamp.cast_floating(params32, dtype)
        opt_state = tx.init(params)
        results[name] = {"variant": name, **bytes_per_param(params, opt_state)}
        steps[name] = jax.jit(_step_fn(tx, batch), donate_argnums=0)
        state = jax.tree.map(lambda x: jnp.array(x, copy=True), (params, opt_state))
        states[name], _ = _run(steps[name], state, 3)  # compile and warm up
    states[REFERENCE], t_ref = _run(steps[REFERENCE], states[REFERENCE], 3)
    n_steps = max(1, round(rep_seconds / max(t_ref, 1e-6)))
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for rep in range(reps):
        for name in _harness.rotated(list(VARIANTS), rep):
            states[name], per_step = _run(steps[name], states[name], n_steps)
            times[name].append(per_step)
    ref = _harness.median(times[REFERENCE])
    for name, r in results.items():
        r.update(
            steps_per_rep=n_steps,
            per_step_s=times[name],
            median_s=_harness.median(times[name]),
            ratio_median=_harness.median(times[name]) / ref,
        )
    return list(results.values())


def table(results: list[dict[str, Any]]) -> str:
    headers = ["variant", "params B/param", "state B/param", "total B/param", "median ms", "x f32"]
    rows = [
        [
            r["variant"],
            r["params_bytes_per_param"],
            r["state_bytes_per_param"],
            r["total_bytes_per_param"],
            1e3 * r["median_s"],
            r["ratio_median"],
        ]
        for r in results
    ]
    return _harness.format_table(headers, rows)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = _harness.parse_args(__doc__.splitlines()[0], argv)
    config = {
        "reps": 3 if args.smoke else 30,
        "rep_seconds": 0.002 if args.smoke else 0.1,
        "optimizer": "optax.adam(1e-3)",
        "workload": "MLP " + ("4 leaves, width 16" if args.smoke else "8 leaves, width 512"),
        "timed": "a block of steps ending in jax.block_until_ready, per-step average",
    }
    # optax.adam mixes Python floats with int32 counts, which strict promotion rejects.
    with jax.numpy_dtype_promotion("standard"):
        results = measure(args.smoke, config["reps"], config["rep_seconds"])
    print(table(results))
    return _harness.save(NAME, NAME, args, config, results)


if __name__ == "__main__":
    main()
