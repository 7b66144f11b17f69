"""Step time and model FLOP utilisation of a GPT-style model: float32 vs mixed bf16 vs mixed f16.

Each precision runs with the model's natural dims (vocab 50257, width 1000, MLP 4000: not
multiples of 8, as real vocabularies are not) and with vocab/width/MLP padded to a multiple of
64 (``jaxamp.align_dim``). float32 and mixed_bfloat16 use plain ``optax.adamw``;
mixed_float16 wraps it in ``jaxamp.loss_scaling`` (float16 needs loss scaling). MFU counts the
FLOPs of the UNPADDED model (6 N per token + attention), so padding shows up as a gain only if
it makes the step faster, and divides by the chip's dense bf16 peak.

Then the optimizer step alone (``tx.update`` plus ``optax.apply_updates``, params and state
donated) of ``benchmarks/low_precision.py``'s variants (16-bit params and Adam state through
``jaxamp.low_precision_optimizer``, each rounding mode) on 268M params, interleaved, medians,
ratios to float32-master Adam: on a GPU that step is bound by the bytes it moves.

The full size runs only on a GPU; on another backend the script records that it was skipped.
``--smoke`` runs tiny dims on any backend (CI; the numbers mean nothing).

Multi-GPU row (``payload["multi_gpu"]``, ``benchmarks/_multi_gpu.py``): with two or more
GPUs, the GPT sharded FSDP-style over all of them, float32 and autocast bf16 (float32 and
bf16 gradient reduction) and fp8: step time, tokens/s and the bytes per parameter each step
sends (``jaxamp.communication_report``); skipped otherwise.

FP8 rows (``payload["fp8_gemm"]``, ``payload["fp8_step"]``): square GEMMs of 1k to 16k and
the GPT step (float32 model, loss under ``jaxamp.autocast``), each ``jaxamp.Float8Recipe``
scaling against ``"mixed_bfloat16"`` through the same autocast, timed interleaved in one
process (medians): TFLOP/s and the ratio to bf16. mxfp8 runs in both its forms
(``Float8Recipe(gemm=...)``): ``fp8_mxfp8_emulated``, a float8 ``dot_general`` per block of 32
scaled and summed in float32, and ``fp8_mxfp8_native``, ``jax.nn.scaled_matmul`` (cuDNN's MXFP8
GEMM on Blackwell; elsewhere XLA expands it into a dequantize and a float32 dot), with
``mxfp8_native_vs_emulated`` the speedup of the native form. On a GPU the native form is
first compiled and run once in a separate process (``native_mx_probe``), so that a compiler
abort there cannot end the run; if it fails its rows record why. A row that fails (out of memory:
blockwise and emulated mxfp8 materialise one float32 partial product per K block; a backend
without a lowering of ``scaled_matmul``) records its error.

    python -m benchmarks.gpu_speed            # full size, GPU only
    python -m benchmarks.gpu_speed --smoke    # seconds, any backend
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
from benchmarks import _harness, _models, low_precision
from benchmarks._multi_gpu import multi_gpu_rows
from jaxamp._fp8 import SCALINGS, names  # the scaling table: a new scaling gets its rows

NAME = "gpu_speed"
PAD_MULTIPLE = 64
PRECISIONS = ("float32", "mixed_bfloat16", "mixed_float16")
FP8_SCALINGS = names("fp8")
MX_GEMMS = ("emulated", "native")  # mxfp8 runs in both forms (Float8Recipe.gemm)
GEMM_SIZES = (1024, 2048, 4096, 8192, 16384)
# The optimizer-step part: 4 layers of 8192 x 8192 (268M params), 20 interleaved repetitions.
OPTIMIZER = {"sizes": {"n_leaves": 8, "width": 8192, "batch": 8}, "reps": 20, "rep_seconds": 0.2}
SMOKE_STEP_VARIANTS = ("bf16", "fp8_tensorwise")
SMOKE_OPTIMIZER = {"sizes": low_precision.SMOKE_SIZES, "reps": 2, "rep_seconds": 0.001}

# Dense bfloat16 peak FLOP/s by device_kind substring (vendor datasheets, no sparsity).
PEAK_BF16_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "L4": 121e12,
    "A10": 125e12,
    "V100": 125e12,  # float16; V100 has no bfloat16 Tensor Cores
}


def peak_flops(device_kind: str) -> float | None:
    for key, value in PEAK_BF16_FLOPS.items():
        if key.lower() in device_kind.lower():
            return value
    return None


def _train_step(config: _models.GPTConfig, precision: str) -> tuple[Any, Any]:
    """``(jitted step(state, batch) -> (state, loss), state)`` for one precision."""
    policy = jaxamp.get_policy(precision)
    model = _models.GPT(config, **policy.module_kwargs())
    params = _models.gpt_init(model, config)
    loss_fn = _models.gpt_loss_fn(model)
    tx = optax.adamw(3e-4)
    if precision == "mixed_float16":
        tx = jaxamp.loss_scaling(tx, jaxamp.DynamicLossScale())

    def step(state, batch):
        params, opt_state = state
        if precision == "mixed_float16":
            scale = jaxamp.get_loss_scale(opt_state)
            loss, grads = jax.value_and_grad(lambda p: scale.scale(loss_fn(p, batch)))(params)
            loss = scale.unscale(loss)
        else:
            loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    return jax.jit(step, donate_argnums=(0,)), (params, tx.init(params))


def measure(
    config: _models.GPTConfig,
    model_flops: float,
    precision: str,
    padded: bool,
    reps: int,
    steps_per_rep: int,
    peak: float | None,
) -> dict[str, Any]:
    run_config = config.padded(PAD_MULTIPLE) if padded else config
    step, state = _train_step(run_config, precision)
    batch = _models.gpt_batch(run_config)
    start = time.perf_counter()
    state, loss = step(state, batch)
    jax.block_until_ready(loss)
    compile_s = time.perf_counter() - start
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(steps_per_rep):
            state, loss = step(state, batch)
        jax.block_until_ready((state, loss))
        times.append((time.perf_counter() - start) / steps_per_rep)
    step_s = _harness.median(times)
    achieved = model_flops / step_s
    return {
        "precision": precision,
        "padded": padded,
        "dims": {"vocab": run_config.vocab, "d_model": run_config.d_model, "d_ff": run_config.d_ff},
        "first_step_s": compile_s,
        "step_s": times,
        "median_step_s": step_s,
        "tokens_per_s": config.batch * config.seq / step_s,
        "model_tflops_per_s": achieved / 1e12,
        "mfu": None if peak is None else achieved / peak,
        "final_loss": float(loss),
    }


def fp8_variants() -> dict[str, Any]:
    """Row name -> policy: bf16, each scaling, and mxfp8 in both its forms."""
    variants: dict[str, Any] = {"bf16": "mixed_bfloat16"}
    for s in FP8_SCALINGS:
        if SCALINGS[s].native:
            variants.update({f"fp8_{s}_{g}": jaxamp.Float8Recipe(s, gemm=g) for g in MX_GEMMS})
        else:
            variants[f"fp8_{s}"] = jaxamp.Float8Recipe(s)
    return variants


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
    names = list(compiled)
    for rep in range(reps):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            start = time.perf_counter()
            for _ in range(inner):
                result = compiled[name](*args)
            jax.block_until_ready(result)
            times[name].append((time.perf_counter() - start) / inner)
    return {**out, **{name: _harness.median(t) for name, t in times.items()}}


_NATIVE_PROBE = """
import jax, jax.numpy as jnp, jaxamp
mm = jaxamp.autocast(lambda x, w: x @ w, jaxamp.Float8Recipe("mxfp8", gemm="native"))
x = jnp.ones((256, 256), jnp.bfloat16)
print(float(jax.jit(jax.grad(lambda x, w: mm(x, w).astype(jnp.float32).sum()))(x, x).sum()))
"""


def native_mx_probe() -> dict[str, str]:
    """``{}`` if a native mxfp8 product and its gradient compile and run in a fresh process.

    Else ``{"fp8_mxfp8_native": why}``: the rows skip it. A separate process, because
    a compiler that aborts (a cuDNN without an MXFP8 kernel for the chip) would
    otherwise end the whole run.
    """
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _NATIVE_PROBE], capture_output=True, text=True, timeout=900
        )
    except subprocess.TimeoutExpired:
        return {"fp8_mxfp8_native": "skipped: the native probe timed out"}
    if proc.returncode == 0:
        return {}
    lines = proc.stderr.strip().splitlines() or [""]
    errors = [line for line in lines if re.match(r"^[\w.]*(Error|Exception)\b", line)]
    why = (errors or lines)[-1][:200]
    return {"fp8_mxfp8_native": f"skipped: native probe exited {proc.returncode}: {why}"}


def _matmul(x, w):
    return x @ w


def _fns(make: Any, skip: dict[str, str], only: Sequence[str] | None = None) -> dict[str, Any]:
    return {
        name: make(policy)
        for name, policy in fp8_variants().items()
        if name not in skip and (only is None or name in only)
    }


def fp8_gemm_rows(
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


def fp8_step_rows(
    config: _models.GPTConfig,
    reps: int,
    inner: int,
    skip: dict[str, str] | None = None,
    only: Sequence[str] | None = None,
) -> dict[str, Any]:
    """One GPT training step (float32 model, loss under autocast), each recipe against bf16.

    ``only``: the row names to run (all of ``fp8_variants()`` when ``None``).
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
    base = timed.get("bf16")
    for name, t in timed.items():
        if isinstance(t, str):
            row[name] = {"error": t}
            continue
        ratio = None if not isinstance(base, float) else base / t
        row[name] = {"median_s": t, "tflops_per_s": flops / t / 1e12, "speedup_vs_bf16": ratio}
    native, emulated = timed.get("fp8_mxfp8_native"), timed.get("fp8_mxfp8_emulated")
    if isinstance(native, float) and isinstance(emulated, float):
        row["mxfp8_native_vs_emulated"] = emulated / native
    return row


def fp8_table(rows: list[dict[str, Any]]) -> str:
    names = list(fp8_variants())
    headers = ["case", *(f"{n} TFLOP/s (x bf16)" for n in names)]
    body = []
    for r in rows:
        cells = [f"n={r['n']}" if "n" in r else r["model"]]
        for n in names:
            c = r.get(n, {"error": "not run"})
            ratio = c.get("speedup_vs_bf16")
            cells.append(
                c["error"][:30]
                if "error" in c
                else f"{c['tflops_per_s']:.1f} ({ratio:.2f}x)"
                if ratio
                else f"{c['tflops_per_s']:.1f}"
            )
        body.append(cells)
    return _harness.format_table(headers, body)


def table(results: list[dict[str, Any]]) -> str:
    headers = [
        "precision",
        "padded",
        "vocab/d/ff",
        "step ms",
        "x float32",
        "tokens/s",
        "TFLOP/s",
        "MFU",
    ]
    ref = {r["padded"]: r["median_step_s"] for r in results if r["precision"] == "float32"}
    rows = []
    for r in results:
        d = r["dims"]
        rows.append(
            [
                r["precision"],
                r["padded"],
                f"{d['vocab']}/{d['d_model']}/{d['d_ff']}",
                1e3 * r["median_step_s"],
                r["median_step_s"] / ref[r["padded"]] if r["padded"] in ref else None,
                r["tokens_per_s"],
                r["model_tflops_per_s"],
                "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%",
            ]
        )
    return _harness.format_table(headers, rows)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = _harness.parse_args(__doc__.splitlines()[0], argv)
    machine = _harness.machine_info()
    out = args.out or _harness.default_out(NAME, args.smoke)
    if args.smoke:
        config = _models.GPTConfig(
            vocab=61, seq=16, d_model=30, n_heads=2, d_ff=60, n_layers=1, batch=2
        )
        reps, steps_per_rep = 1, 1
    else:
        config = _models.GPTConfig(
            vocab=50257, seq=1024, d_model=1000, n_heads=8, d_ff=4000, n_layers=12, batch=8
        )
        reps, steps_per_rep = 10, 5
    payload: dict[str, Any] = {
        "benchmark": NAME,
        "machine": machine,
        "config": {
            **config.__dict__,
            "n_params_unpadded": config.n_params(),
            "pad_multiple": PAD_MULTIPLE,
            "reps": reps,
            "steps_per_rep": steps_per_rep,
        },
    }
    if not args.smoke and jax.default_backend() != "gpu":
        payload["status"] = f"skipped: full size needs a GPU; backend is {jax.default_backend()}"
        payload["results"] = []
        print(payload["status"])
        _harness.write_json(out, payload)
        return payload
    peak = peak_flops(machine["device_kind"])
    payload["peak_bf16_flops"] = peak
    model_flops = config.train_flops_per_step()
    cases = [(precision, padded) for padded in (False, True) for precision in PRECISIONS]
    if args.smoke:  # both paddings, float32 and the loss-scaled float16 path (seconds each)
        cases = [("float32", False), ("mixed_float16", True)]
    payload["cases"] = cases
    results = []
    with jax.numpy_dtype_promotion("standard"):  # optax.adamw under strict promotion fails
        for precision, padded in cases:
            result = measure(config, model_flops, precision, padded, reps, steps_per_rep, peak)
            results.append(result)
            print(table([result]), flush=True)
    sizes, fp8_reps, inner = ((128,), 1, 1) if args.smoke else (GEMM_SIZES, 10, 5)
    # On a GPU the native MX GEMM is first tried in a separate process (it may abort).
    skip = native_mx_probe() if jax.default_backend() == "gpu" else {}
    with jax.numpy_dtype_promotion("standard"):
        payload["fp8_gemm"] = fp8_gemm_rows(sizes, fp8_reps, inner, skip)
        # Smoke: every recipe in the GEMM row, two in the step (each compiles a GPT step).
        only = SMOKE_STEP_VARIANTS if args.smoke else None
        payload["fp8_step"] = fp8_step_rows(config, fp8_reps, inner, skip, only)
    payload["status"] = "ok"
    payload["results"] = results
    print(table(results))
    print(fp8_table([*payload["fp8_gemm"], payload["fp8_step"]]))
    optimizer = SMOKE_OPTIMIZER if args.smoke else OPTIMIZER
    with jax.numpy_dtype_promotion("standard"):  # optax.adam mixes floats and int32
        payload["optimizer"] = {
            **optimizer,
            "results": low_precision.measure(
                optimizer["sizes"], optimizer["reps"], optimizer["rep_seconds"], kinds=("update",)
            ),
        }
    print(low_precision.table(payload["optimizer"]["results"]))
    # FSDP over every GPU (skipped with fewer than two); batch divisible by the count.
    with jax.numpy_dtype_promotion("standard"):
        payload["multi_gpu"] = multi_gpu_rows(config, reps, steps_per_rep)
    print(payload["multi_gpu"]["status"])
    _harness.write_json(out, payload)
    return payload


if __name__ == "__main__":
    main()
