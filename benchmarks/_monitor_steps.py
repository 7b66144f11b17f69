"""The jitted steps ``benchmarks/numerics_cost.py`` times ``jaxamp.numerics_monitor`` in."""

from __future__ import annotations

import time
from typing import Any

import jax

import jaxamp
from benchmarks import _harness


def monitored_step(loss: Any) -> Any:
    """``jit(step, params, batch)``: value_and_grad, with a report every 2 steps."""
    monitor = jaxamp.numerics_monitor(loss, every=2, grad=True, callback=lambda *_: None)

    @jax.jit
    def step(i, params, batch):
        monitor(i, params, batch)
        return jax.value_and_grad(loss)(params, batch)

    return step


def callback_only_step(loss: Any) -> Any:
    """The step with what an idle in-step monitor leaves in it, less the report program:
    a ``lax.cond`` on ``i % 2 == 0`` around a ``jax.debug.callback`` of ``i``."""

    @jax.jit
    def step(i, params, batch):
        def report(i):
            jax.debug.callback(lambda *_: None, i)

        jax.lax.cond(i % 2 == 0, report, lambda _: None, i)
        return jax.value_and_grad(loss)(params, batch)

    return step


def with_callbacks(out: Any) -> Any:
    jax.block_until_ready(out)
    jax.effects_barrier()  # the report's host callback has run
    return out


def idle_call(monitor: Any, params: Any, batch: Any, calls: int = 1000) -> float:
    """Seconds of one call of the host-loop monitor on a step that does not report
    (median of 5 runs of ``calls`` calls): what it adds to a step, without the noise
    of timing the step around it."""
    runs = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            monitor(1, params, batch)
        runs.append((time.perf_counter() - start) / calls)
    return _harness.median(runs)


def step_compiles(loss: Any, params: Any, batch: Any) -> tuple[dict[str, float], Any]:
    """XLA's compile of the train step, plain (the host loop's step: the monitor is not
    in it) and with an in-step monitor, once each from fresh ``jax.jit``\\s; and the
    compiled in-step one (``step(i, params, batch)``)."""
    steps = {
        "plain_compile_s": jax.jit(jax.value_and_grad(loss)).lower(params, batch),
        "in_step_compile_s": monitored_step(loss).lower(1, params, batch),
    }
    seconds, compiled = {}, None
    for key, lowered in steps.items():
        start = time.perf_counter()
        compiled = lowered.compile()
        seconds[key] = time.perf_counter() - start
    return seconds, compiled
