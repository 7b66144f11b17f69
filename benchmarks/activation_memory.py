"""Activation memory of a GPT-style model: float32 vs three ways to get mixed_bfloat16.

The platform-independent measure is the bytes of the residuals saved for the backward pass:
the leaves of the function returned by ``jax.vjp`` (taken with ``jax.eval_shape``, so nothing
runs). On XLA:CPU, bfloat16 dots run as float32 and compiled temp memory does not shrink, so
the ``memory_analysis()`` of the compiled ``value_and_grad`` is recorded too, but it is only
meaningful on an accelerator.

Ways to mixed_bfloat16:
- ``layer_dtypes``: Flax layers built with ``policy.module_kwargs()`` (dtype=bf16, params f32);
- ``policy_casting``: the float32 model applied to ``policy.cast_to_compute(params)``;
- ``autocast``: ``jaxamp.autocast(loss, "mixed_bfloat16")`` on the float32 model's loss;
- ``autocast_remat``: the same with ``remat_float32=True`` (float32 intermediates are
  recomputed in the backward pass instead of saved).

The run time of the compiled ``value_and_grad`` (median of ``--repeats`` calls) is
recorded too: the price of the recomputation, on this backend.

    python -m benchmarks.activation_memory            # full run
    python -m benchmarks.activation_memory --smoke    # seconds
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

import jaxamp
from benchmarks import _harness, _models

NAME = "activation_memory"
REFERENCE = "float32"


def _variants(config: _models.GPTConfig) -> dict[str, tuple[Callable | None, Any, str]]:
    """``name -> (loss(params, batch) or None, params, note)``."""
    policy = jaxamp.get_policy("mixed_bfloat16")
    f32_model = _models.GPT(config)
    f32_params = _models.gpt_init(f32_model, config)
    f32_loss = _models.gpt_loss_fn(f32_model)
    layer_model = _models.GPT(config, **policy.module_kwargs())
    layer_params = _models.gpt_init(layer_model, config)

    # Casting the params only helps when the layers take their dtype from their inputs
    # (dtype=None); layers pinned to float32 would cast everything back.
    inferred_loss = _models.gpt_loss_fn(_models.GPT(config, dtype=None))

    def cast_loss(params, batch):
        return inferred_loss(policy.cast_to_compute(params), batch)

    variants: dict[str, tuple[Callable | None, Any, str]] = {
        "float32": (f32_loss, f32_params, "Flax layers with dtype=float32"),
        "mixed_bf16_layer_dtypes": (
            _models.gpt_loss_fn(layer_model),
            layer_params,
            "Flax layers with policy.module_kwargs()",
        ),
        "mixed_bf16_policy_casting": (
            cast_loss,
            f32_params,
            "Flax layers with dtype=None applied to policy.cast_to_compute(params)",
        ),
    }
    if hasattr(jaxamp, "autocast"):
        variants["mixed_bf16_autocast"] = (
            jaxamp.autocast(f32_loss, policy),
            f32_params,
            "jaxamp.autocast(float32 loss, 'mixed_bfloat16')",
        )
        variants["mixed_bf16_autocast_remat"] = (
            jaxamp.autocast(f32_loss, policy, remat_float32=True),
            f32_params,
            "jaxamp.autocast(float32 loss, 'mixed_bfloat16', remat_float32=True)",
        )
    else:
        variants["mixed_bf16_autocast"] = (None, None, "jaxamp.autocast is not available")
    return variants


def residual_bytes(loss: Callable, params: Any, batch: Any) -> dict[str, Any]:
    """Bytes (total and per dtype) of the residuals ``jax.vjp`` keeps for the backward pass."""

    def vjp_fun(p):
        return jax.vjp(lambda q: loss(q, batch), p)[1]

    leaves = jax.tree.leaves(jax.eval_shape(vjp_fun, params))
    by_dtype: dict[str, int] = {}
    for leaf in leaves:
        nbytes = int(np.prod(leaf.shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
        by_dtype[str(np.dtype(leaf.dtype))] = by_dtype.get(str(np.dtype(leaf.dtype)), 0) + nbytes
    return {"total": sum(by_dtype.values()), "by_dtype": by_dtype, "n_residuals": len(leaves)}


def compiled_value_and_grad(loss: Callable, params: Any, batch: Any) -> tuple[Any, dict]:
    """The compiled ``value_and_grad(loss)`` and its ``memory_analysis()`` fields."""
    compiled = jax.jit(jax.value_and_grad(loss)).lower(params, batch).compile()
    analysis = compiled.memory_analysis()
    fields = (
        "temp_size_in_bytes",
        "argument_size_in_bytes",
        "output_size_in_bytes",
        "generated_code_size_in_bytes",
    )
    return compiled, {f: getattr(analysis, f, None) for f in fields}


def run(config: _models.GPTConfig, repeats: int = 10) -> list[dict[str, Any]]:
    batch = _models.gpt_batch(config)
    results = []
    for name, (loss, params, note) in _variants(config).items():
        if loss is None:
            results.append({"variant": name, "status": "not available", "note": note})
            continue
        compiled, memory = compiled_value_and_grad(loss, params, batch)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(compiled(params, batch))
            times.append(time.perf_counter() - start)
        results.append(
            {
                "variant": name,
                "status": "ok",
                "note": note,
                "loss": float(compiled(params, batch)[0]),
                "residual_bytes": residual_bytes(loss, params, batch),
                "compiled_memory": memory,
                "value_and_grad_seconds": times,
                "value_and_grad_median_s": _harness.median(times),
            }
        )
    ref = next(r for r in results if r["variant"] == REFERENCE)
    for r in results:
        if r["status"] == "ok":
            r["residual_ratio"] = r["residual_bytes"]["total"] / ref["residual_bytes"]["total"]
            r["temp_ratio"] = r["compiled_memory"]["temp_size_in_bytes"] / max(
                1, ref["compiled_memory"]["temp_size_in_bytes"]
            )
            r["time_ratio"] = r["value_and_grad_median_s"] / ref["value_and_grad_median_s"]
    return results


def table(results: list[dict[str, Any]]) -> str:
    headers = [
        "variant",
        "loss",
        "residual MiB",
        "x float32",
        "of which bf16 MiB",
        "compiled temp MiB",
        "x float32 (temp)",
        "value_and_grad ms",
        "x float32 (time)",
    ]
    mib = 1 / 2**20
    rows = []
    for r in results:
        if r["status"] != "ok":
            rows.append([r["variant"], r["status"], "", "", "", "", "", "", ""])
            continue
        res = r["residual_bytes"]
        rows.append(
            [
                r["variant"],
                r["loss"],
                res["total"] * mib,
                r["residual_ratio"],
                res["by_dtype"].get("bfloat16", 0) * mib,
                r["compiled_memory"]["temp_size_in_bytes"] * mib,
                r["temp_ratio"],
                # Runs recorded before the timing was added have none.
                r["value_and_grad_median_s"] * 1e3 if "time_ratio" in r else "",
                r.get("time_ratio", ""),
            ]
        )
    return _harness.format_table(headers, rows)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = _harness.parse_args(__doc__.splitlines()[0], argv)
    if args.smoke:
        config = _models.GPTConfig(
            vocab=32, seq=8, d_model=16, n_heads=2, d_ff=32, n_layers=1, batch=2
        )
    else:
        config = _models.GPTConfig(
            vocab=1024, seq=256, d_model=256, n_heads=8, d_ff=1024, n_layers=4, batch=8
        )
    with jax.numpy_dtype_promotion("standard"):
        results = run(config, repeats=2 if args.smoke else 10)
    print(table(results))
    described = {
        **config.__dict__,
        "n_params": config.n_params(),
        "measure": "jax.eval_shape of the jax.vjp residuals w.r.t. params",
    }
    return _harness.save(NAME, NAME, args, described, results)


if __name__ == "__main__":
    main()
