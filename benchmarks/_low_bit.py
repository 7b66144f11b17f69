"""The low-bit rows of ``benchmarks/gpu_speed.py``: each FP8 and FP4 recipe against bf16 autocast.

Square GEMMs and the GPT training step (float32 model, loss under
``jaxamp.autocast``), each ``jaxamp.Float8Recipe`` scaling and each
``jaxamp.Float4Recipe`` format against ``"mixed_bfloat16"`` through the same
autocast, timed interleaved in one process (medians). The recipes with a native
GEMM (``mxfp8``, ``nvfp4``, ``mxfp4``: ``jax.nn.scaled_matmul``) run in both forms
of ``gemm=``; on a GPU each native form first compiles and runs once in a
separate process (:func:`native_probe`), so that a compiler abort there (a cuDNN
without the chip's FP4 or MXFP8 kernel) cannot end the run.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

import jaxamp
from benchmarks import _harness, _models
from jaxamp._fp8 import SCALINGS, names  # the scaling table: a new scaling gets its rows

GEMMS = ("emulated", "native")  # the forms of a recipe with a native GEMM (gemm=...)
SMOKE_STEP_VARIANTS = ("bf16", "fp8_tensorwise", "fp4_nvfp4_emulated")


def _recipe(family: str, scaling: str, gemm: str = "auto") -> Any:
    if family == "fp8":
        return jaxamp.Float8Recipe(scaling, gemm=gemm)
    return jaxamp.Float4Recipe(format=scaling, gemm=gemm)


def low_bit_variants() -> dict[str, Any]:
    """Row name -> policy: bf16, each FP8 scaling and FP4 format, native ones in both forms."""
    variants: dict[str, Any] = {"bf16": "mixed_bfloat16"}
    for family in ("fp8", "fp4"):
        for s in names(family):
            # Every FP4 format has a native form (Float4Recipe(gemm=...)); FP8 the MX one.
            if family == "fp4" or SCALINGS[s].native:
                variants.update({f"{family}_{s}_{g}": _recipe(family, s, g) for g in GEMMS})
            else:
                variants[f"{family}_{s}"] = _recipe(family, s)
    return variants


def native_rows() -> tuple[str, ...]:
    return tuple(name for name in low_bit_variants() if name.endswith("_native"))


def _interleaved(fns: dict[str, Any], args: tuple, reps: int, inner: int) -> dict[str, Any]:
    """Median seconds per call of each compiled fn, timed in rotating order; or its error."""
    compiled, out = {}, {}
    for name, fn in fns.items():
        try:
            jax.block_until_ready(fn(*args))
            compiled[name] = fn
        except Exception as error:  # an out-of-memory row is a result, not a crash
            out[name] = f"failed: {type(error).__name__}: {str(error)[:200]}"
    times: dict[str, list[float]] = {name: [] for name in compiled}
    order = list(compiled)
    for rep in range(reps):
        for name in order[rep % len(order) :] + order[: rep % len(order)]:
            start = time.perf_counter()
            for _ in range(inner):
                result = compiled[name](*args)
            jax.block_until_ready(result)
            times[name].append((time.perf_counter() - start) / inner)
    return {**out, **{name: _harness.median(t) for name, t in times.items()}}


_NATIVE_PROBE = """
import jax, jax.numpy as jnp, jaxamp
from benchmarks._low_bit import low_bit_variants
mm = jaxamp.autocast(lambda x, w: x @ w, low_bit_variants()[{name!r}])
x = jnp.ones((256, 256), jnp.bfloat16)
print(float(jax.jit(jax.grad(lambda x, w: mm(x, w).astype(jnp.float32).sum()))(x, x).sum()))
"""


def native_probe(name: str) -> dict[str, str]:
    """``{}`` if the native row ``name``'s product and gradient compile and run in a fresh process.

    Else ``{name: why}``: the rows skip it. A separate process, because a compiler
    that aborts (a cuDNN without the kernel for the chip) would otherwise end the run.
    """
    code = _NATIVE_PROBE.format(name=name)
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=900
        )
    except subprocess.TimeoutExpired:
        return {name: "skipped: the native probe timed out"}
    if proc.returncode == 0:
        return {}
    lines = proc.stderr.strip().splitlines() or [""]
    errors = [line for line in lines if re.match(r"^[\w.]*(Error|Exception)\b", line)]
    why = (errors or lines)[-1][:200]
    return {name: f"skipped: native probe exited {proc.returncode}: {why}"}


def native_skips() -> dict[str, str]:
    """On a GPU, the native rows whose probe fails (and why); elsewhere none."""
    if jax.default_backend() != "gpu":
        return {}
    skips: dict[str, str] = {}
    for name in native_rows():
        skips.update(native_probe(name))
    return skips


def _matmul(x, w):
    return x @ w


def _fns(make: Any, skip: dict[str, str], only: Sequence[str] | None = None) -> dict[str, Any]:
    return {
        name: make(policy)
        for name, policy in low_bit_variants().items()
        if name not in skip and (only is None or name in only)
    }


def low_bit_gemm_rows(
    sizes: Sequence[int], reps: int, inner: int, skip: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    """``x @ w`` of n x n bfloat16 operands under autocast, each recipe against bf16.

    ``skip``: row name -> why it does not run (recorded as its error).
    """
    skip = skip or {}
    rows = []
    for n in sizes:
        keys = jax.random.split(jax.random.key(n))
        x, w = (jax.random.normal(k, (n, n), jnp.bfloat16) for k in keys)
        fns = _fns(lambda policy: jax.jit(jaxamp.autocast(_matmul, policy)), skip)
        timed = {**skip, **_interleaved(fns, (x, w), reps, inner)}
        rows.append(_ratio_row({"n": n}, timed, 2.0 * n**3))
    return rows


def low_bit_step_rows(
    config: _models.GPTConfig,
    reps: int,
    inner: int,
    skip: dict[str, str] | None = None,
    only: Sequence[str] | None = None,
) -> dict[str, Any]:
    """One GPT training step (float32 model, loss under autocast), each recipe against bf16.

    ``only``: the row names to run (all of ``low_bit_variants()`` when ``None``).
    """
    model = _models.GPT(config)
    params = _models.gpt_init(model, config)
    loss_fn = _models.gpt_loss_fn(model)
    batch = _models.gpt_batch(config)
    tx = optax.adamw(3e-4)

    def step_of(policy):
        loss = jaxamp.autocast(loss_fn, policy)

        def step(params, opt_state, batch):
            value, grads = jax.value_and_grad(loss)(params, batch)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, value

        return jax.jit(step)

    skip = skip or {}
    args = (params, tx.init(params), batch)
    timed = {**skip, **_interleaved(_fns(step_of, skip, only), args, reps, inner)}
    return _ratio_row({"model": "gpt"}, timed, config.train_flops_per_step())


def _ratio_row(row: dict[str, Any], timed: dict[str, Any], flops: float) -> dict[str, Any]:
    """Each timed row's TFLOP/s and speedup over bf16; ``<name>_native_vs_emulated`` ratios."""
    base = timed.get("bf16")
    for name, t in timed.items():
        if isinstance(t, str):
            row[name] = {"error": t}
            continue
        ratio = None if not isinstance(base, float) else base / t
        row[name] = {"median_s": t, "tflops_per_s": flops / t / 1e12, "speedup_vs_bf16": ratio}
    for native in native_rows():
        stem = native.removesuffix("_native")
        fast, slow = timed.get(native), timed.get(f"{stem}_emulated")
        if isinstance(fast, float) and isinstance(slow, float):
            row[f"{stem.split('_', 1)[1]}_native_vs_emulated"] = slow / fast
    return row


def _cell(c: dict[str, Any]) -> str:
    if "error" in c:
        return c["error"][:30]
    ratio = c.get("speedup_vs_bf16")
    return f"{c['tflops_per_s']:.1f} ({ratio:.2f}x)" if ratio else f"{c['tflops_per_s']:.1f}"


def low_bit_table(rows: list[dict[str, Any]]) -> str:
    """One line per case, one column per recipe: TFLOP/s (speedup over bf16)."""
    variants = list(low_bit_variants())
    headers = ["case", *(f"{n} TFLOP/s (x bf16)" for n in variants)]
    body = [
        [
            f"n={r['n']}" if "n" in r else r["model"],
            *(_cell(r.get(n, {"error": "not run"})) for n in variants),
        ]
        for r in rows
    ]
    return _harness.format_table(headers, body)
