"""The multi-GPU row of benchmarks/gpu_speed.py: an FSDP GPT step over every GPU.

The GPT is sharded over all devices (``benchmarks/_sharding.py``'s ``fsdp``
layout), and each precision setting of ``SETTINGS`` runs the same SGD step:
median step time, tokens per second and, from ``jaxamp.communication_report``,
the bytes per parameter each step sends by kind and dtype. With fewer than two
GPUs the row records that it was skipped.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
from jax.sharding import NamedSharding

import jaxamp
from benchmarks import _harness, _models
from benchmarks._sharding import batch_spec, param_specs

SETTINGS = {
    "float32": None,
    "autocast_bf16": "mixed_bfloat16",
    "autocast_bf16_reduce_bf16": "params=float32,compute=bfloat16,output=float32,reduce=bfloat16",
    "autocast_fp8": "mixed_float8",
}


def _step(config: _models.GPTConfig, policy: str | None, mesh: Any) -> tuple[Any, tuple]:
    model = _models.GPT(config, dtype=None)
    loss = _models.gpt_loss_fn(model)
    if policy is not None:
        loss = jaxamp.autocast(loss, policy)
    params = _models.gpt_init(model, config)
    shardings = jax.tree.map(
        lambda s: NamedSharding(mesh, s), param_specs(params, "fsdp", mesh.size)
    )
    params = jax.device_put(params, shardings)
    batch = jax.device_put(_models.gpt_batch(config), NamedSharding(mesh, batch_spec("fsdp")))

    def step(params, batch):
        value, grads = jax.value_and_grad(loss)(params, batch)
        return jax.tree.map(lambda p, g: p - 1e-4 * g, params, grads), value

    return jax.jit(step, out_shardings=(shardings, None), donate_argnums=(0,)), (params, batch)


def multi_gpu_rows(config: _models.GPTConfig, reps: int, steps_per_rep: int) -> dict[str, Any]:
    devices = jax.devices()
    if jax.default_backend() != "gpu" or len(devices) < 2:
        found = f"{len(devices)} {jax.default_backend()} device(s)"
        return {"status": f"skipped: needs 2 or more GPUs; found {found}", "results": []}
    mesh = jax.make_mesh((len(devices),), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    # The batch is sharded: a whole number of sequences per device.
    per_device = -(-config.batch // len(devices))
    config = dataclasses.replace(config, batch=per_device * len(devices))
    rows = []
    for name, policy in SETTINGS.items():
        step, (params, batch) = _step(config, policy, mesh)
        report = jaxamp.communication_report(step, params, batch)
        params, loss = step(params, batch)  # compile
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            for _ in range(steps_per_rep):
                params, loss = step(params, batch)
            jax.block_until_ready(loss)
            times.append((time.perf_counter() - start) / steps_per_rep)
        step_s = _harness.median(times)
        rows.append(
            {
                "setting": name,
                "devices": len(devices),
                "median_step_s": step_s,
                "tokens_per_s": config.batch * config.seq / step_s,
                "B_per_param": {
                    f"{kind}/{dtype.name}": total / report.param_count
                    for (kind, dtype), (_, total) in report.totals().items()
                },
                "final_loss": float(loss),
            }
        )
        print(rows[-1], flush=True)
    return {"status": "ok", "layout": "fsdp", "results": rows}
