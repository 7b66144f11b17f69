"""The cost of ``jaxamp.numerics_report(grad=True)`` against a plain ``value_and_grad``.

``numerics_report`` runs the forward and backward pass once, instrumented under one
``jax.jit``: every floating op also computes its statistics (max, inf/NaN count,
underflow count) and a float32 shadow of every 16-bit value. This script measures
what that costs on the GPT of ``benchmarks/_models.py`` under
``jaxamp.autocast(loss, "mixed_float16")``, for a small and a larger config
(``--smoke``: a 2-layer MLP):

- ``run``: the compiled instrumented program vs the compiled
  ``jax.jit(jax.value_and_grad(loss))``, both on the same params and batch, timed
  interleaved (the order rotates every repetition), medians of ``--repeats``;
- ``first call``: the whole ``numerics_report`` call (trace, compile, run, summary)
  vs trace + compile + one call of the plain ``value_and_grad``, measured once each;
- ``again``: ``numerics_report`` called again on the same shapes (the compiled
  program is cached: a run and the summary) vs the compiled plain step;
- ``monitor``: a jitted step holding ``value_and_grad`` and a
  ``jaxamp.numerics_monitor(every=2)`` vs the plain step, at a step that does not
  report (``idle``: one untaken branch) and at one that does (``fires``: the
  instrumented run and the host callback), timed interleaved with the others.

    python -m benchmarks.numerics_cost            # full run
    python -m benchmarks.numerics_cost --smoke    # seconds
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import jax

import jaxamp
from benchmarks import _harness, _models
from jaxamp._numerics._api import prepare

NAME = "numerics_cost"
POLICY = "mixed_float16"
CONFIGS = {
    "small": _models.GPTConfig(
        vocab=128, seq=32, d_model=64, n_heads=2, d_ff=256, n_layers=1, batch=4
    ),
    "larger": _models.GPTConfig(n_layers=2),
}


def _timed(fn: Any, *args: Any) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


def _workload(name: str) -> tuple[Any, Any, Any, int]:
    """``(loss, params, batch, parameter count)``; ``smoke`` is a 2-layer MLP (seconds)."""
    if name == "smoke":
        params = _models.mlp_params(4)
        return _models.mlp_loss, params, _models.mlp_batch(), 2 * 16 * 17
    config = CONFIGS[name]
    model = _models.GPT(config)
    params, batch = _models.gpt_init(model, config), _models.gpt_batch(config)
    return _models.gpt_loss_fn(model), params, batch, config.n_params()


def measure(name: str, repeats: int) -> dict[str, Any]:
    fun, params, batch, n_params = _workload(name)
    loss = jaxamp.autocast(fun, POLICY)

    start = time.perf_counter()
    plain = jax.jit(jax.value_and_grad(loss))
    jax.block_until_ready(plain(params, batch))
    plain_first = time.perf_counter() - start
    start = time.perf_counter()
    report = jaxamp.numerics_report(loss, params, batch, grad=True)
    report_first = time.perf_counter() - start

    run, inputs, _ = prepare(loss, (params, batch), {}, None, True, None)
    jax.block_until_ready(run(*inputs))  # compile outside the timed loop
    monitored = _monitored_step(loss)
    jax.block_until_ready(monitored(1, params, batch))  # compile
    calls = {
        "plain": lambda: plain(params, batch),
        "instrumented": lambda: run(*inputs),
        "again": lambda: jaxamp.numerics_report(loss, params, batch, grad=True),
        "monitor_idle": lambda: monitored(1, params, batch),
        "monitor_fires": lambda: _with_callbacks(monitored(2, params, batch)),
    }
    times: dict[str, list[float]] = {k: [] for k in calls}
    for rep in range(repeats):
        for variant in _harness.rotated(list(calls), rep):
            times[variant].append(_timed(calls[variant]))
    med = {k: _harness.median(v) for k, v in times.items()}
    plain_s, instrumented_s = med["plain"], med["instrumented"]
    return {
        "model": name,
        "n_params": n_params,
        "ops_measured": len(report.ops),
        "plain_run_s": plain_s,
        "instrumented_run_s": instrumented_s,
        "run_ratio": instrumented_s / plain_s,
        "plain_first_call_s": plain_first,
        "report_first_call_s": report_first,
        "first_call_ratio": report_first / plain_first,
        "again_s": med["again"],
        "again_ratio": med["again"] / plain_s,
        "monitor_idle_ratio": med["monitor_idle"] / plain_s,
        "monitor_fires_ratio": med["monitor_fires"] / plain_s,
    }


def _monitored_step(loss: Any) -> Any:
    """``jit(step, params, batch)``: value_and_grad, with a report every 2 steps."""
    monitor = jaxamp.numerics_monitor(loss, every=2, grad=True, callback=lambda *_: None)

    @jax.jit
    def step(i, params, batch):
        monitor(i, params, batch)
        return jax.value_and_grad(loss)(params, batch)

    return step


def _with_callbacks(out: Any) -> Any:
    jax.block_until_ready(out)
    jax.effects_barrier()  # the report's host callback has run
    return out


def table(results: list[dict[str, Any]]) -> str:
    headers = ["model", "params", "ops", "plain run ms", "report run ms", "run ratio"]
    headers += ["first call ratio", "again ratio", "monitor idle", "monitor fires"]
    rows = [
        [
            r["model"],
            r["n_params"],
            r["ops_measured"],
            1e3 * r["plain_run_s"],
            1e3 * r["instrumented_run_s"],
            r["run_ratio"],
            r["first_call_ratio"],
            r.get("again_ratio", "-"),  # runs before the cache and the monitor lack these
            r.get("monitor_idle_ratio", "-"),
            r.get("monitor_fires_ratio", "-"),
        ]
        for r in results
    ]
    return _harness.format_table(headers, rows)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    def extra(parser):
        parser.add_argument("--repeats", type=int, default=None, help="timed calls (10; smoke 3)")
        parser.add_argument(
            "--models", nargs="+", choices=list(CONFIGS), default=None, help="configs to run"
        )

    args = _harness.parse_args(__doc__.split("\n\n")[0], argv, extra)
    repeats = args.repeats or (3 if args.smoke else 10)
    names = ["smoke"] if args.smoke else (args.models or list(CONFIGS))
    results = [measure(name, repeats) for name in names]
    print(table(results))
    configs = {k: vars(c) for k, c in CONFIGS.items() if k in names}
    config = {"policy": POLICY, "repeats": repeats, "configs": configs}
    return _harness.save(NAME, NAME, args, config, results)


if __name__ == "__main__":
    main()
