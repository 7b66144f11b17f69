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

Low-bit rows (``payload["low_bit_gemm"]``, ``payload["low_bit_step"]``,
``benchmarks/_low_bit.py``): square GEMMs of 1k to 16k and the GPT step (float32 model, loss
under ``jaxamp.autocast``), each ``jaxamp.Float8Recipe`` scaling and each
``jaxamp.Float4Recipe`` format (``fp4_nvfp4_*``, ``fp4_mxfp4_*``) against
``"mixed_bfloat16"`` through the same autocast, timed interleaved in one process (medians):
TFLOP/s and the ratio to bf16. The recipes with a native GEMM (mxfp8, nvfp4, mxfp4) run in
both forms of ``gemm=``: ``*_emulated``, a low-bit ``dot_general`` per block scaled and summed
in float32, and ``*_native``, ``jax.nn.scaled_matmul`` (cuDNN's block-scaled GEMM on
Blackwell; elsewhere XLA expands it into a dequantize and a float32 dot), with
``<format>_native_vs_emulated`` the speedup of the native form. On a GPU each native form is
first compiled and run once in a separate process (``native_probe``), so that a compiler
abort there cannot end the run; if it fails its rows record why. A row that fails (out of
memory: blockwise and the emulated block forms materialise one float32 partial product per K
block; a backend without a lowering of ``scaled_matmul``) records its error.

    python -m benchmarks.gpu_speed            # full size, GPU only
    python -m benchmarks.gpu_speed --smoke    # seconds, any backend
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import jax
import optax

import jaxamp
from benchmarks import _harness, _models, low_precision
from benchmarks._low_bit import (
    SMOKE_STEP_VARIANTS,
    low_bit_gemm_rows,
    low_bit_step_rows,
    low_bit_table,
    native_skips,
)
from benchmarks._multi_gpu import multi_gpu_rows

NAME = "gpu_speed"
PAD_MULTIPLE = 64
PRECISIONS = ("float32", "mixed_bfloat16", "mixed_float16")
GEMM_SIZES = (1024, 2048, 4096, 8192, 16384)
# The optimizer-step part: 4 layers of 8192 x 8192 (268M params), 20 interleaved repetitions.
OPTIMIZER = {"sizes": {"n_leaves": 8, "width": 8192, "batch": 8}, "reps": 20, "rep_seconds": 0.2}
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
    sizes, low_reps, inner = ((128,), 1, 1) if args.smoke else (GEMM_SIZES, 10, 5)
    # On a GPU each native block-scaled GEMM is first tried in a separate process (it may abort).
    skip = native_skips()
    with jax.numpy_dtype_promotion("standard"):
        payload["low_bit_gemm"] = low_bit_gemm_rows(sizes, low_reps, inner, skip)
        # Smoke: every recipe in the GEMM row, three in the step (each compiles a GPT step).
        only = SMOKE_STEP_VARIANTS if args.smoke else None
        payload["low_bit_step"] = low_bit_step_rows(config, low_reps, inner, skip, only)
    payload["status"] = "ok"
    payload["results"] = results
    print(table(results))
    print(low_bit_table([*payload["low_bit_gemm"], payload["low_bit_step"]]))
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
