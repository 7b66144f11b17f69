"""Compile time of a loss-scaled train step as the number of parameter leaves grows.

For each model size (a chain of dense layers with exactly N parameter leaves, Adam, so the
optimizer state holds 2N more) every variant of ``_variants.VARIANTS`` is lowered and
compiled from a freshly built step function after ``jax.clear_caches()``; variants are
interleaved in one process (rotating order) and medians are reported, as ratios to the plain
optax step measured in the same run. Both wall time and this process's CPU time are recorded:
on a shared machine, CPU time is the less noisy of the two, and the budget below is in CPU s.

A variant whose compile time, extrapolated linearly from the previous size (a lower bound for
a super-linear variant), exceeds the per-(variant, size) budget is skipped at that size and the
larger ones, and recorded as skipped with the reason; no number is ever made up.

    python -m benchmarks.compile_scaling            # full run (sizes 10, 100, 300, 1000)
    python -m benchmarks.compile_scaling --model gpt  # GPT blocks: 22, 102, 310 leaves
    python -m benchmarks.compile_scaling --smoke    # seconds
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import jax
import optax

from benchmarks import _harness, _models
from benchmarks._variants import REFERENCE, VARIANTS

NAME = "compile_scaling"


def workload(model: str, size: int) -> tuple[Any, Any, Any]:
    """``(loss_fn, params, batch)``; ``size`` is the leaf count (mlp) or block count (gpt)."""
    if model == "mlp":
        return _models.mlp_loss, _models.mlp_params(size), _models.mlp_batch()
    config = _models.GPTConfig(
        vocab=256, seq=32, d_model=64, n_heads=2, d_ff=128, n_layers=size, batch=4
    )
    gpt = _models.GPT(config)
    return _models.gpt_loss_fn(gpt), _models.gpt_init(gpt, config), _models.gpt_batch(config)


def _measure(name: str, loss_fn: Any, state: Any, batch: Any) -> tuple[float, float]:
    def build_step():
        return VARIANTS[name](loss_fn, optax.adam(1e-3)).step

    cpu_start = time.process_time()
    wall = _harness.time_compile(build_step, (state, batch))
    return wall, time.process_time() - cpu_start


def run(
    sizes: Sequence[int],
    reps: int,
    budget_s: float,
    variants: Sequence[str] = tuple(VARIANTS),
    model: str = "mlp",
) -> list[dict[str, Any]]:
    """Measures every (variant, size); returns one record per pair, skipped ones included."""
    results: list[dict[str, Any]] = []
    previous: dict[str, tuple[int, float]] = {}  # variant -> (leaves, median cpu s)
    skipped: dict[str, str] = {}
    for size in sizes:
        loss_fn, params, batch = workload(model, size)
        n_leaves = len(jax.tree.leaves(params))
        active = []
        for name in variants:
            # The reference is never skipped: every ratio needs it.
            if name != REFERENCE and name not in skipped and name in previous:
                prev_size, prev_cpu = previous[name]
                predicted = prev_cpu * n_leaves / prev_size
                if predicted > budget_s:
                    skipped[name] = (
                        f"{prev_cpu:.1f} CPU s at {prev_size} leaves extrapolates linearly (a "
                        f"lower bound) to {predicted:.0f} s at {n_leaves} leaves, over the "
                        f"{budget_s:.0f} CPU s budget per (variant, size)"
                    )
            if name in skipped:
                results.append(
                    {
                        "variant": name,
                        "n_leaves": n_leaves,
                        "status": "skipped",
                        "reason": skipped[name],
                    }
                )
            else:
                active.append(name)
        states = {name: VARIANTS[name](loss_fn, optax.adam(1e-3)).init(params) for name in active}
        walls: dict[str, list[float]] = {name: [] for name in active}
        cpus: dict[str, list[float]] = {name: [] for name in active}
        for rep in range(reps):
            for name in _harness.rotated(active, rep):
                # Later repetitions only while this (variant, size) is within its budget.
                if rep and sum(cpus[name]) + cpus[name][-1] > budget_s:
                    continue
                wall, cpu = _measure(name, loss_fn, states[name], batch)
                walls[name].append(wall)
                cpus[name].append(cpu)
                print(
                    f"  {n_leaves:5d} leaves  {name:22s} rep {rep}: wall {wall:7.2f} s  "
                    f"cpu {cpu:7.2f} s",
                    flush=True,
                )
        for name in active:
            median_wall = _harness.median(walls[name])
            previous[name] = (n_leaves, _harness.median(cpus[name]))
            results.append(
                {
                    "variant": name,
                    "n_leaves": n_leaves,
                    "status": "ok",
                    "reps": len(walls[name]),
                    "wall_s": walls[name],
                    "cpu_s": cpus[name],
                    "median_wall_s": median_wall,
                    "median_cpu_s": _harness.median(cpus[name]),
                }
            )
    _add_ratios(results)
    return results


def _add_ratios(results: list[dict[str, Any]]) -> None:
    reference = {
        r["n_leaves"]: r for r in results if r["variant"] == REFERENCE and r["status"] == "ok"
    }
    for r in results:
        ref = reference.get(r["n_leaves"])
        if r["status"] == "ok" and ref is not None:
            r["ratio_wall"] = r["median_wall_s"] / ref["median_wall_s"]
            r["ratio_cpu"] = r["median_cpu_s"] / ref["median_cpu_s"]


def table(results: list[dict[str, Any]]) -> str:
    headers = ["variant", "leaves", "reps", "wall s", "x plain (wall)", "cpu s", "x plain (cpu)"]
    rows = []
    for r in results:
        if r["status"] == "ok":
            rows.append(
                [
                    r["variant"],
                    r["n_leaves"],
                    r["reps"],
                    r["median_wall_s"],
                    r.get("ratio_wall"),
                    r["median_cpu_s"],
                    r.get("ratio_cpu"),
                ]
            )
        else:
            rows.append([r["variant"], r["n_leaves"], 0, "skipped", "", "", ""])
    return _harness.format_table(headers, rows)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    def extra(parser):
        parser.add_argument(
            "--model",
            choices=("mlp", "gpt"),
            default="mlp",
            help="mlp: 16x16 dense chain, sizes in leaves (default); gpt: small GPT blocks, "
            "sizes in blocks (16 leaves each + 6)",
        )

        parser.add_argument(
            "--budget",
            type=float,
            default=60.0,
            help="CPU seconds per (variant, size) before a variant is skipped (default 60)",
        )
        parser.add_argument(
            "--variants",
            nargs="+",
            choices=tuple(VARIANTS),
            default=tuple(VARIANTS),
            help="the variants to measure (default: all)",
        )

    args = _harness.parse_args(__doc__.splitlines()[0], argv, extra)
    name = NAME if args.model == "mlp" else f"{NAME}_gpt"
    if args.smoke:
        config = {"sizes": [4] if args.model == "mlp" else [1], "reps": 1}
    elif args.model == "mlp":
        config = {"sizes": [10, 100, 300, 1000], "reps": 3}
    else:
        config = {"sizes": [1, 6, 19], "reps": 3}
    config["budget_s"] = args.budget
    config.update(
        model="chain of 16x16 dense layers (weight + bias per layer), batch 8"
        if args.model == "mlp"
        else "GPT blocks: vocab 256, seq 32, d_model 64, 2 heads, d_ff 128, batch 4",
        optimizer="optax.adam(1e-3)",
        timed="jax.jit(step).lower(state, batch).compile()",
    )
    # optax.adam mixes Python floats with int32 counts, which strict promotion rejects.
    with jax.numpy_dtype_promotion("standard"):
        results = run(
            config["sizes"], config["reps"], config["budget_s"], args.variants, args.model
        )
    print(table(results))
    return _harness.save(NAME, name, args, config, results)


if __name__ == "__main__":
    main()
