"""Memory and step time of 16-bit params and Adam state (``jaxamp.low_precision_optimizer``).

Bytes of params plus optimizer state per parameter, counted exactly from the arrays
(``size * itemsize`` of every leaf, step counters and keys included), for Adam with:
float32 params and moments (the reference), optax's ``mu_dtype=bfloat16``, 16-bit params
with float32 moments, and 16-bit params and bfloat16 moments rounded to nearest,
stochastically or with Kahan compensation. Then two times of each against the
float32-master reference:

- ``update``: the jitted optimizer step alone, ``tx.update`` plus ``optax.apply_updates`` on
  fixed gradients (the params and state donated), where the optimizer is all the work;
- ``step``: a whole training step of an MLP (``grad``, update, apply), float32
  compute for every variant so that only the optimizer differs.

Every variant is compiled once, then blocks of steps run interleaved in rotating order in
this process; medians of wall time and of process CPU time (all threads; steadier than
wall time on a shared machine), and their ratios to the reference.

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
SIZES = {"n_leaves": 8, "width": 512, "batch": 32}  # 1,050,624 params
SMOKE_SIZES = {"n_leaves": 4, "width": 16, "batch": 4}
ISA_FLAGS = ("amx_bf16", "avx512_bf16", "avx512_fp16", "avx512f", "avx2", "f16c")


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
    "bf16_kahan_f32_state": (jnp.bfloat16, _low("kahan", None)),
    "bf16_nearest": (jnp.bfloat16, _low("nearest", jnp.bfloat16)),
    "bf16_stochastic": (jnp.bfloat16, _low("stochastic", jnp.bfloat16)),
    "bf16_kahan": (jnp.bfloat16, _low("kahan", jnp.bfloat16)),
    "f16_stochastic": (jnp.float16, _low("stochastic", jnp.bfloat16)),
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


def _update_fn(tx: optax.GradientTransformation) -> Callable:
    def update(state, grads):
        params, opt_state = state
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return update


def _step_fn(tx: optax.GradientTransformation, batch: Any) -> Callable:
    def loss(params):
        # Same float32 compute for every variant: only the optimizer differs.
        return _models.mlp_loss(jaxamp.cast_floating(params, jnp.float32), batch)

    def step(state, _):
        params, opt_state = state
        grads = jax.grad(loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step


def _run(fun: Callable, state: Any, arg: Any, n: int) -> tuple[Any, float, float]:
    """``n`` calls of ``fun``; the state after them, wall and CPU seconds per call."""
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(n):
        state = fun(state, arg)
    jax.block_until_ready(state)
    return state, (time.perf_counter() - wall) / n, (time.process_time() - cpu) / n


def _copy(tree: Any) -> Any:
    return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


def _prepare(sizes: dict[str, int], kinds: Sequence[str]) -> tuple[dict, dict]:
    """Per variant: bytes, and [jitted function, state, argument] for each timed kind."""
    params32 = _models.mlp_params(sizes["n_leaves"], width=sizes["width"])
    batch = _models.mlp_batch(width=sizes["width"], batch=sizes["batch"])
    grads32 = jax.tree.map(lambda p: 1e-3 * jnp.cos(p), params32)
    results, runs = {}, {}
    for name, (dtype, make_tx) in VARIANTS.items():
        tx = make_tx()
        params = jaxamp.cast_floating(params32, dtype)
        opt_state = tx.init(params)
        results[name] = {"variant": name, **bytes_per_param(params, opt_state)}
        funs = {
            "update": (_update_fn(tx), jaxamp.cast_floating(grads32, dtype)),
            "step": (_step_fn(tx, batch), None),
        }
        for kind in kinds:
            fun, arg = funs[kind]
            fun = jax.jit(fun, donate_argnums=0)
            state, _, _ = _run(fun, _copy((params, opt_state)), arg, 3)  # compile, warm up
            runs[(kind, name)] = [fun, state, arg]
    return results, runs


def measure(
    sizes: dict[str, int],
    reps: int,
    rep_seconds: float,
    kinds: Sequence[str] = ("update", "step"),
) -> list[dict[str, Any]]:
    """Bytes and interleaved times of every variant, for each of ``kinds``."""
    results, runs = _prepare(sizes, kinds)
    times: dict[tuple[str, str], tuple[list[float], list[float]]] = {k: ([], []) for k in runs}
    n_steps = {}
    for kind in kinds:
        fun, state, arg = runs[(kind, REFERENCE)]
        runs[(kind, REFERENCE)][1], t_ref, _ = _run(fun, state, arg, 3)
        n_steps[kind] = max(1, round(rep_seconds / max(t_ref, 1e-6)))
    keys = list(runs)
    for rep in range(reps):
        for key in _harness.rotated(keys, rep):
            fun, state, arg = runs[key]
            runs[key][1], wall, cpu = _run(fun, state, arg, n_steps[key[0]])
            times[key][0].append(wall)
            times[key][1].append(cpu)
    for name, r in results.items():
        for kind in kinds:
            wall, cpu = times[(kind, name)]
            ref_wall, ref_cpu = times[(kind, REFERENCE)]
            r[kind] = {
                "steps_per_rep": n_steps[kind],
                "per_step_s": wall,
                "per_step_cpu_s": cpu,
                "median_s": _harness.median(wall),
                "ratio_median": _harness.median(wall) / _harness.median(ref_wall),
                "median_cpu_s": _harness.median(cpu),
                "ratio_cpu": _harness.median(cpu) / _harness.median(ref_cpu),
            }
        # The last kind's numbers (the whole step's) at the top level, as earlier runs have.
        last = r[kinds[-1]]
        r["median_s"], r["ratio_median"] = last["median_s"], last["ratio_median"]
    return list(results.values())


def table(results: list[dict[str, Any]]) -> str:
    headers = ["variant", "params B", "state B", "total B/param"]
    headers += ["update x f32", "update cpu x f32", "step x f32", "step cpu x f32"]
    rows = []
    for r in results:
        update, step = r.get("update", {}), r.get("step", {})
        rows.append(
            [
                r["variant"],
                r["params_bytes_per_param"],
                r["state_bytes_per_param"],
                r["total_bytes_per_param"],
                update.get("ratio_median"),
                update.get("ratio_cpu"),
                step.get("ratio_median", r.get("ratio_median")),
                step.get("ratio_cpu"),
            ]
        )
    return _harness.format_table(headers, rows)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = _harness.parse_args(__doc__.splitlines()[0], argv)
    config = {
        "reps": 3 if args.smoke else 25,
        "rep_seconds": 0.002 if args.smoke else 0.05,
        "optimizer": "optax.adam(1e-3)",
        "sizes": SMOKE_SIZES if args.smoke else SIZES,
        "timed": "blocks of calls ending in jax.block_until_ready, per-call average; "
        "update = tx.update + optax.apply_updates on fixed grads, step = grad + "
        "update + apply; params and state donated",
        "isa": _harness.cpu_flags(ISA_FLAGS),
    }
    # optax.adam mixes Python floats with int32 counts, which strict promotion rejects.
    with jax.numpy_dtype_promotion("standard"):
        results = measure(config["sizes"], config["reps"], config["rep_seconds"])
    print(table(results))
    return _harness.save(NAME, NAME, args, config, results)


if __name__ == "__main__":
    main()
