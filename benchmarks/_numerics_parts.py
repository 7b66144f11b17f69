"""Where the instrumented run of ``numerics_report`` goes: the same program without a part.

``python -m benchmarks.numerics_cost --where`` builds, for each config, the report's
program as shipped and with one part taken out, and times them interleaved with the
plain ``value_and_grad`` (medians of ``--repeats``). A part taken out changes what the
report can say (the variants are for timing only):

- ``shipped``: the program ``numerics_report`` runs;
- ``stacked``: every output stacked with the others of its size, whatever its size
  (``_table.STACK_MAX_ELEMENTS`` infinite: the program before it was bounded);
- ``no local twin``: no 16-bit op computed again in float32 on its real inputs
  (what ``underflow_fraction`` needs to count only what an op flushed itself);
- ``no shadow``: no float32 shadow along the program either (``max_abs_float32``,
  ``lost_fraction``, the suggested loss scale need it); what is left is every op's
  output kept unfused and reduced;
- ``screen``: the screening pass of ``numerics_monitor(screen=True)`` as shipped
  (``NumericsProgram.compiled(screen=True)``: no shadow nor twin, and whether it
  found an inf/NaN), what a firing on a clean step runs.

Each variant's build (trace, compile, first run) is timed once too. Two firings
are timed with them: ``fires``, ``numerics_monitor(every=1)`` called from the host
loop, then the plain step, then ``flush()`` until the report reached the callback
(a full report), and ``fires screened``, the same with ``screen=True`` (the
workload holds no inf/NaN: the screen's report).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp

import jaxamp
from benchmarks import _harness
from jaxamp._numerics import _instrument, _table
from jaxamp._numerics._api import prepare
from jaxamp._numerics._compiled import cache_clear
from jaxamp._numerics._program import NumericsProgram

VARIANTS = ("shipped", "stacked", "no local twin", "no shadow", "screen")
FIRINGS = ("fires", "fires screened")


@contextlib.contextmanager
def _without(variant: str) -> Iterator[None]:
    saved = (_instrument.local_twins, _instrument.shadow_outputs, _table.STACK_MAX_ELEMENTS)
    if variant == "stacked":
        _table.STACK_MAX_ELEMENTS = float("inf")  # type: ignore[assignment]
    if variant in ("no local twin", "no shadow"):
        _instrument.local_twins = lambda eqn, ins, outs, shadows: [None] * len(outs)
    if variant == "no shadow":
        _instrument.shadow_outputs = lambda eqn, ins, outs: [None] * len(outs)
    try:
        yield
    finally:
        _instrument.local_twins, _instrument.shadow_outputs, _table.STACK_MAX_ELEMENTS = saved


def measure(name: str, loss: Any, params: Any, batch: Any, repeats: int) -> dict[str, Any]:
    """Run ratios (to the plain step) of each variant of the report's program."""
    plain = jax.jit(jax.value_and_grad(loss))
    jax.block_until_ready(plain(params, batch))
    calls = {"plain": lambda: plain(params, batch)}
    build_s = {}
    for variant in VARIANTS:
        cache_clear()
        start = time.perf_counter()
        with _without(variant):
            run, inputs = _program(variant, loss, params, batch)
        jax.block_until_ready(run(*inputs))
        build_s[variant] = time.perf_counter() - start  # trace, compile, first run
        calls[variant] = lambda run=run, inputs=inputs: run(*inputs)
    cache_clear()
    for firing in FIRINGS:
        calls[firing] = _firing(loss, params, batch, plain, screen=firing == "fires screened")
        calls[firing]()  # compiles the report's programs
    times: dict[str, list[float]] = {k: [] for k in calls}
    for rep in range(repeats):
        for variant in _harness.rotated(list(calls), rep):
            start = time.perf_counter()
            jax.block_until_ready(calls[variant]())
            times[variant].append(time.perf_counter() - start)
    med = {k: _harness.median(v) for k, v in times.items()}
    return {
        "model": name,
        "part": "where",
        "plain_run_s": med["plain"],
        **{f"{v} ratio": med[v] / med["plain"] for v in (*VARIANTS, *FIRINGS)},
        "build_s": build_s,
    }


def _program(variant: str, loss: Any, params: Any, batch: Any) -> tuple[Any, list]:
    """``(run, inputs)`` of the variant's compiled program."""
    if variant == "screen":
        program = NumericsProgram(loss, (params, batch), {}, None, True, False)
        inputs = program.inputs(jnp.float32(1.0))
        return program.compiled(inputs, screen=True).run, inputs
    run, inputs, _ = prepare(loss, (params, batch), {}, None, True, None)
    return run, inputs


def _firing(loss: Any, params: Any, batch: Any, plain: Any, screen: bool) -> Any:
    """A reporting step of the host loop: the monitor, the plain step, the delivery."""
    monitor = jaxamp.numerics_monitor(
        loss, every=1, grad=True, callback=lambda *_: None, screen=screen
    )

    def step() -> Any:
        monitor(0, params, batch)
        out = jax.block_until_ready(plain(params, batch))
        monitor.flush()
        return out

    return step


def table(results: list[dict[str, Any]]) -> str:
    shown = (*VARIANTS, *FIRINGS)
    headers = ["model", "plain run ms", *shown, *(f"{v} build s" for v in VARIANTS)]
    rows = [
        [
            r["model"],
            1e3 * r["plain_run_s"],
            *(r.get(f"{v} ratio", "-") for v in shown),
            *(r.get("build_s", {}).get(v, "-") for v in VARIANTS),
        ]
        for r in results
    ]
    return _harness.format_table(headers, rows)
