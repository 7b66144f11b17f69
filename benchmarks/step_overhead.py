"""Run time per train step of each loss-scaling variant, relative to the plain optax step.

Two workloads (a small MLP whose step is short, so any overhead shows, and a GPT-style
transformer), each with and without donation of the train state. Every variant is compiled
once; then repetitions interleave the variants in rotating order, each repetition timing a
block of steps that ends with ``block_until_ready``. Reported: the median and the minimum
wall time per step over repetitions, and the median of this process's CPU time per step (on a
shared machine the minimum and the CPU time are the least disturbed estimates), each with its
ratio to the plain optax step.

    python -m benchmarks.step_overhead            # full run
    python -m benchmarks.step_overhead --smoke    # seconds
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

from benchmarks import _harness, _models
from benchmarks._variants import REFERENCE, VARIANTS

NAME = "step_overhead"


def _workload(kind: str, smoke: bool) -> tuple[Any, Any, Any, dict[str, Any]]:
    """``(loss_fn, params, batch, description)`` of a workload."""
    if kind == "mlp":
        width, n_leaves, batch_size = (16, 4, 4) if smoke else (256, 8, 64)
        params = _models.mlp_params(n_leaves, width=width)
        batch = _models.mlp_batch(width=width, batch=batch_size)
        desc = {"layers": n_leaves // 2, "width": width, "batch": batch_size}
        return _models.mlp_loss, params, batch, desc
    if smoke:
        config = _models.GPTConfig(
            vocab=32, seq=8, d_model=16, n_heads=2, d_ff=32, n_layers=1, batch=2
        )
    else:
        config = _models.GPTConfig()
    model = _models.GPT(config)
    params = _models.gpt_init(model, config)
    desc = {**config.__dict__, "n_params": config.n_params()}
    return _models.gpt_loss_fn(model), params, _models.gpt_batch(config), desc


def _run_steps(step: Any, state: Any, batch: Any, n: int) -> tuple[Any, float, float]:
    """Runs ``n`` steps; returns the state and the wall and process-CPU seconds per step."""
    start, cpu_start = time.perf_counter(), time.process_time()
    for _ in range(n):
        state, loss = step(state, batch)
    jax.block_until_ready((state, loss))
    return state, (time.perf_counter() - start) / n, (time.process_time() - cpu_start) / n


def measure(
    kind: str,
    donate: bool,
    smoke: bool,
    reps: int,
    rep_seconds: float,
    variants: Sequence[str] = tuple(VARIANTS),
) -> list[dict[str, Any]]:
    variants = [name for name in VARIANTS if name in variants]  # reference first
    loss_fn, params, batch, desc = _workload(kind, smoke)
    tx = optax.adam(1e-3)
    steps, states = {}, {}
    for name, make in VARIANTS.items():
        if name not in variants:
            continue
        variant = make(loss_fn, tx)
        jit_kwargs = {"donate_argnums": (0,)} if donate else {}
        steps[name] = jax.jit(variant.step, **jit_kwargs)
        # Fresh buffers for every leaf: inits may share one array between fields,
        # which donation would then try to donate twice.
        states[name] = jax.tree.map(lambda x: jnp.array(x, copy=True), variant.init(params))
        states[name], _, _ = _run_steps(steps[name], states[name], batch, 3)  # compile + warm up
    # One block length for every variant, from the reference step's time.
    states[REFERENCE], t_ref, _ = _run_steps(steps[REFERENCE], states[REFERENCE], batch, 3)
    n_steps = max(1, round(rep_seconds / max(t_ref, 1e-6)))
    times: dict[str, list[float]] = {name: [] for name in variants}
    cpu_times: dict[str, list[float]] = {name: [] for name in variants}
    for rep in range(reps):
        for name in _harness.rotated(variants, rep):
            states[name], per_step, cpu_per_step = _run_steps(
                steps[name], states[name], batch, n_steps
            )
            times[name].append(per_step)
            cpu_times[name].append(cpu_per_step)
    results = []
    for name in variants:
        results.append(
            {
                "workload": kind,
                "workload_config": desc,
                "donate": donate,
                "variant": name,
                "reps": reps,
                "steps_per_rep": n_steps,
                "per_step_s": times[name],
                "median_s": _harness.median(times[name]),
                "min_s": min(times[name]),
                "cpu_per_step_s": cpu_times[name],
                "median_cpu_s": _harness.median(cpu_times[name]),
            }
        )
    ref = next(r for r in results if r["variant"] == REFERENCE)
    for r in results:
        r["ratio_median"] = r["median_s"] / ref["median_s"]
        r["ratio_min"] = r["min_s"] / ref["min_s"]
        r["ratio_cpu"] = r["median_cpu_s"] / ref["median_cpu_s"]
    return results


def table(results: list[dict[str, Any]]) -> str:
    headers = [
        "workload",
        "donate",
        "variant",
        "median ms",
        "x plain",
        "min ms",
        "x plain (min)",
        "cpu ms",
        "x plain (cpu)",
    ]
    rows = [
        [
            r["workload"],
            r["donate"],
            r["variant"],
            1e3 * r["median_s"],
            r["ratio_median"],
            1e3 * r["min_s"],
            r["ratio_min"],
            1e3 * r["median_cpu_s"],
            r["ratio_cpu"],
        ]
        for r in results
    ]
    return _harness.format_table(headers, rows)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = _harness.parse_args(__doc__.splitlines()[0], argv)
    config = {
        "reps": 3 if args.smoke else 40,
        "rep_seconds": 0.002 if args.smoke else 0.05,
        "optimizer": "optax.adam(1e-3)",
        "timed": "a block of steps ending in jax.block_until_ready, per-step average",
    }
    every = tuple(VARIANTS)
    cases = [(k, d, every) for k in ("mlp", "transformer") for d in (False, True)]
    if args.smoke:
        # Both workloads and donation modes, every variant on the (cheap) MLP; the
        # transformer, which costs seconds to compile per variant on CPU, with two.
        cases = [("mlp", False, every), ("transformer", True, (REFERENCE, "jaxamp"))]
    config["cases"] = cases
    results = []
    # optax.adam mixes Python floats with int32 counts, which strict promotion rejects.
    with jax.numpy_dtype_promotion("standard"):
        for kind, donate, variants in cases:
            case = measure(
                kind, donate, args.smoke, config["reps"], config["rep_seconds"], variants
            )
            print(table(case), flush=True)
            results += case
    print(table(results))
    return _harness.save(NAME, NAME, args, config, results)


if __name__ == "__main__":
    main()
