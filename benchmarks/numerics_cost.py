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
- ``host``: ``jaxamp.numerics_monitor(every=2)`` called from the host loop, then the
  plain step, at a step that does not report (``idle``: the monitor returns at once)
  and at one that does (``fires``: the cached report program dispatched, the plain
  step, and ``flush()`` until the report reached the callback); ``host idle call``:
  the plain step plus one idle call of the monitor timed on its own (1000 calls),
  which the noise of timing whole steps on shared cores hides;
- ``in-step``: a jitted step holding ``value_and_grad`` and a
  ``jaxamp.numerics_monitor(every=2)`` vs the plain step, at a step that does not
  report (``idle``: one untaken branch) and at one that does (``fires``: the
  instrumented run and the host callback); ``callback only``: the same step with an
  untaken ``lax.cond`` around a ``jax.debug.callback`` and no report program (what
  the idle cost comes from); all timed interleaved with the others;
- ``in-step compile ratio``: XLA's compile of the in-step step against the plain
  step's (the host loop's train step is the plain step), once each.

- ``first calls`` (``--first-calls``): the first call of ``numerics_report(grad=True)``
  against the first call of ``jax.jit(jax.value_and_grad(autocast(loss, policy)))``
  (trace, compile, run), for a one-block transformer with a causal mask (d_model 96,
  50 tokens) and the small GPT, under ``"mixed_float16"``, ``"mixed_bfloat16"`` and
  ``Float8Recipe("rowwise")``; caches are cleared before each call (``jax.clear_caches``,
  ``jaxamp``'s program cache), the pair is measured ``--first-repeats`` times in turns,
  and the report's XLA compile and the plain step's are timed on their own too.

    python -m benchmarks.numerics_cost            # full run
    python -m benchmarks.numerics_cost --first-calls --models   # only the first calls
    python -m benchmarks.numerics_cost --smoke    # seconds
    python -m benchmarks.numerics_cost --where --models larger   # where the run goes
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jaxamp
from benchmarks import _harness, _models, _monitor_steps, _numerics_parts
from jaxamp._numerics._api import prepare
from jaxamp._numerics._compiled import cache_clear

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
    compiles, monitored = _monitor_steps.step_compiles(loss, params, batch)
    callback_only = _monitor_steps.callback_only_step(loss)
    jax.block_until_ready(callback_only(1, params, batch))  # compile
    host = jaxamp.numerics_monitor(loss, every=2, grad=True, callback=lambda *_: None)

    def host_step(i: int) -> Any:
        host(i, params, batch)  # the host loop: the monitor, then the plain step
        out = plain(params, batch)
        if i % 2 == 0:
            host.flush()  # the report has reached the callback
        return out

    host_step(0)  # the report program is cached already: nothing compiles here
    calls = {
        "plain": lambda: plain(params, batch),
        "instrumented": lambda: run(*inputs),
        "again": lambda: jaxamp.numerics_report(loss, params, batch, grad=True),
        "host_idle": lambda: host_step(1),
        "host_fires": lambda: host_step(2),
        "monitor_idle": lambda: monitored(1, params, batch),
        "monitor_fires": lambda: _monitor_steps.with_callbacks(monitored(2, params, batch)),
        "callback_only": lambda: callback_only(1, params, batch),
    }
    times: dict[str, list[float]] = {k: [] for k in calls}
    for rep in range(repeats):
        for variant in _harness.rotated(list(calls), rep):
            times[variant].append(_timed(calls[variant]))
    med = {k: _harness.median(v) for k, v in times.items()}
    plain_s, instrumented_s = med["plain"], med["instrumented"]
    idle_call_s = _monitor_steps.idle_call(host, params, batch)
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
        "host_idle_ratio": med["host_idle"] / plain_s,
        "host_idle_call_s": idle_call_s,
        "host_idle_call_ratio": (plain_s + idle_call_s) / plain_s,
        "host_fires_ratio": med["host_fires"] / plain_s,
        "monitor_idle_ratio": med["monitor_idle"] / plain_s,
        "monitor_fires_ratio": med["monitor_fires"] / plain_s,
        "callback_only_ratio": med["callback_only"] / plain_s,
        **compiles,
        "in_step_compile_ratio": compiles["in_step_compile_s"] / compiles["plain_compile_s"],
    }


# ----------------------------------------------------------------- first calls

FIRST_CALL_POLICIES = {
    "mixed_float16": "mixed_float16",
    "mixed_bfloat16": "mixed_bfloat16",
    "fp8_rowwise": jaxamp.Float8Recipe("rowwise"),
}
_TF = {"d_model": 96, "seq": 50, "batch": 2, "heads": 4}


def transformer_params(seed: int = 0) -> dict[str, jax.Array]:
    """One pre-LN block: attention (4 heads) and a 4x MLP, float32."""
    d = _TF["d_model"]
    rng = np.random.default_rng(seed)
    shapes = {"wq": (d, d), "wk": (d, d), "wv": (d, d), "wo": (d, d)}
    shapes |= {"up": (d, 4 * d), "down": (4 * d, d)}
    params = {k: jnp.asarray(rng.normal(0, 0.05, s), jnp.float32) for k, s in shapes.items()}
    return params | {"g1": jnp.ones(d), "g2": jnp.ones(d)}


def transformer_batch(seed: int = 1) -> jax.Array:
    shape = (_TF["batch"], _TF["seq"], _TF["d_model"])
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


def _layer_norm(x: jax.Array, g: jax.Array) -> jax.Array:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * g


def transformer_loss(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    """A causal self-attention block (``jnp.where(mask, s, -1e9)``) and an MLP."""
    b, t, d, h = _TF["batch"], _TF["seq"], _TF["d_model"], _TF["heads"]

    def heads(a):
        return a.reshape(b, t, h, d // h).transpose(0, 2, 1, 3)

    y = _layer_norm(x, p["g1"])
    q, k, v = (heads(y @ p[n]) for n in ("wq", "wk", "wv"))
    s = q @ k.transpose(0, 1, 3, 2) / np.float32(np.sqrt(d // h))
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e9)
    a = (jax.nn.softmax(s, axis=-1) @ v).transpose(0, 2, 1, 3).reshape(b, t, d)
    x = x + a @ p["wo"]
    x = x + jax.nn.gelu(_layer_norm(x, p["g2"]) @ p["up"]) @ p["down"]
    return jnp.mean(x**2)


def _first_call_workload(name: str) -> tuple[Any, Any, Any]:
    if name == "transformer":
        return transformer_loss, transformer_params(), transformer_batch()
    fun, params, batch, _ = _workload(name)
    return fun, params, batch


@contextlib.contextmanager
def _compile_timer() -> Iterator[list[float]]:
    """Seconds spent in ``jax.stages.Lowered.compile`` while the block runs."""
    spent: list[float] = []
    original = jax.stages.Lowered.compile

    def timed(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            spent.append(time.perf_counter() - start)

    jax.stages.Lowered.compile = timed
    try:
        yield spent
    finally:
        jax.stages.Lowered.compile = original


def _plain_first_call(loss: Any, params: Any, batch: Any) -> dict[str, float]:
    start = time.perf_counter()
    lowered = jax.jit(jax.value_and_grad(loss)).lower(params, batch)
    traced = time.perf_counter()
    compiled = lowered.compile()
    compiled_at = time.perf_counter()
    jax.block_until_ready(compiled(params, batch))
    return {"total": time.perf_counter() - start, "compile": compiled_at - traced}


def _report_first_call(fun: Any, policy: Any, params: Any, batch: Any) -> dict[str, float]:
    with _compile_timer() as spent:
        start = time.perf_counter()
        jaxamp.numerics_report(fun, params, batch, policy=policy, grad=True)
        total = time.perf_counter() - start
    return {"total": total, "compile": sum(spent)}


def first_calls(name: str, policy_name: str, repeats: int) -> dict[str, Any]:
    """The first call of the report vs the plain step's, both from cold caches."""
    fun, params, batch = _first_call_workload(name)
    policy = FIRST_CALL_POLICIES[policy_name]
    loss = jaxamp.autocast(fun, policy)
    calls = {
        "plain": lambda: _plain_first_call(loss, params, batch),
        "report": lambda: _report_first_call(fun, policy, params, batch),
    }
    times: dict[str, list[dict[str, float]]] = {k: [] for k in calls}
    for rep in range(repeats):
        for variant in _harness.rotated(list(calls), rep):
            jax.clear_caches()
            cache_clear()
            times[variant].append(calls[variant]())
    med = {
        f"{variant}_{part}_s": _harness.median([t[part] for t in runs])
        for variant, runs in times.items()
        for part in ("total", "compile")
    }
    return {
        "model": name,
        "policy": policy_name,
        **med,
        "first_call_ratio": med["report_total_s"] / med["plain_total_s"],
        "compile_ratio": med["report_compile_s"] / med["plain_compile_s"],
        "ratios": [
            r["total"] / p["total"] for r, p in zip(times["report"], times["plain"], strict=True)
        ],
    }


def first_call_table(results: list[dict[str, Any]]) -> str:
    headers = ["model", "policy", "plain first call s", "report first call s", "ratio"]
    headers += ["plain compile s", "report compile s", "compile ratio"]
    rows = [
        [
            r["model"],
            r["policy"],
            r["plain_total_s"],
            r["report_total_s"],
            r["first_call_ratio"],
            r["plain_compile_s"],
            r["report_compile_s"],
            r["compile_ratio"],
        ]
        for r in results
    ]
    return _harness.format_table(headers, rows)


def table(results: list[dict[str, Any]]) -> str:
    """The run, first-call and ``--where`` tables, for the rows a result file holds."""
    runs = [r for r in results if "run_ratio" in r]
    firsts = [r for r in results if "policy" in r]
    wheres = [r for r in results if r.get("part") == "where"]
    parts = ([run_table(runs)] if runs else []) + ([first_call_table(firsts)] if firsts else [])
    parts += [_numerics_parts.table(wheres)] if wheres else []
    return "\n\n".join(parts)


def run_table(results: list[dict[str, Any]]) -> str:
    headers = ["model", "params", "ops", "plain run ms", "report run ms", "run ratio"]
    headers += ["first call ratio", "again ratio", "host idle", "host idle call", "host fires"]
    headers += ["in-step idle", "in-step fires", "callback only", "in-step compile ratio"]
    rows = [
        [
            r["model"],
            r["n_params"],
            r["ops_measured"],
            1e3 * r["plain_run_s"],
            1e3 * r["instrumented_run_s"],
            r["run_ratio"],
            r["first_call_ratio"],
            # runs before the cache, the monitor or the host loop lack these
            *(r.get(k, "-") for k in ("again_ratio", "host_idle_ratio")),
            *(r.get(k, "-") for k in ("host_idle_call_ratio", "host_fires_ratio")),
            *(r.get(k, "-") for k in ("monitor_idle_ratio", "monitor_fires_ratio")),
            *(r.get(k, "-") for k in ("callback_only_ratio", "in_step_compile_ratio")),
        ]
        for r in results
    ]
    return _harness.format_table(headers, rows)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    def extra(parser):
        parser.add_argument("--repeats", type=int, default=None, help="timed calls (10; smoke 3)")
        parser.add_argument(
            "--models", nargs="*", choices=list(CONFIGS), default=None, help="configs to run"
        )
        parser.add_argument("--first-calls", action="store_true", help="also the first-call matrix")
        parser.add_argument(
            "--where", action="store_true", help="only the report program without each part"
        )
        parser.add_argument("--first-repeats", type=int, default=3, help="cold first calls")
        parser.add_argument(
            "--first-models",
            nargs="+",
            choices=["transformer", *CONFIGS],
            default=["transformer", "small"],
        )
        parser.add_argument(
            "--policies", nargs="+", choices=list(FIRST_CALL_POLICIES), default=None
        )

    args = _harness.parse_args(__doc__.split("\n\n")[0], argv, extra)
    repeats = args.repeats or (3 if args.smoke else 10)
    names = ["smoke"] if args.smoke else (list(CONFIGS) if args.models is None else args.models)
    if args.where:
        return _where(args, names, repeats)
    results = [measure(name, repeats) for name in names]
    if results:
        print(run_table(results))
    configs = {k: vars(c) for k, c in CONFIGS.items() if k in names + args.first_models}
    config = {"policy": POLICY, "repeats": repeats, "configs": configs, "transformer": _TF}
    config["first_repeats"] = args.first_repeats if args.first_calls else 0
    firsts: list[dict[str, Any]] = []
    if args.first_calls:  # saved after each pair: a full matrix takes an hour on 2 cores
        for model in args.first_models:
            for policy in args.policies or list(FIRST_CALL_POLICIES):
                firsts.append(first_calls(model, policy, args.first_repeats))
                print(first_call_table(firsts[-1:]), flush=True)
                _harness.save(NAME, NAME, args, config, results + firsts)
        print(first_call_table(firsts))
    return _harness.save(NAME, NAME, args, config, results + firsts)


def _where(args: Any, names: list[str], repeats: int) -> dict[str, Any]:
    """``--where``: the run of the report's program without each part (``_numerics_parts``)."""
    results = []
    for name in names:
        fun, params, batch, _ = _workload(name)
        loss = jaxamp.autocast(fun, POLICY)
        results.append(_numerics_parts.measure(name, loss, params, batch, repeats))
    print(_numerics_parts.table(results))
    variants = [*_numerics_parts.VARIANTS, *_numerics_parts.FIRINGS]
    config = {"policy": POLICY, "repeats": repeats, "variants": variants}
    return _harness.save(NAME, f"{NAME}_where", args, config, results)


if __name__ == "__main__":
    main()
