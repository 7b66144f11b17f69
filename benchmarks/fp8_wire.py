"""FP8 over the wire: what an FSDP step of a GPT sends under each FP8 (and FP4) recipe.

The 3-layer GPT of ``_models`` (d_model 256, d_ff 1024, vocab 512: 2.65M
params), each parameter sharded on its largest dim over 8 devices, the batch
sharded too; ``jax.value_and_grad(jaxamp.autocast(loss, recipe))`` read by
``jaxamp.communication_report`` right after the SPMD partitioner (nothing runs).
Per recipe: the all-gathered bytes per parameter by dtype, the weights'
float8 (float4) gathers, the scale reductions (scalar all-reduces, and the fused
all-reduce of every weight amax) and the gradient reductions' dtype and bytes.
Byte counts of the partitioned program, not timings: they hold on any backend.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m benchmarks.fp8_wire
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m benchmarks.fp8_wire --smoke
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

import jaxamp
from benchmarks import _harness, _models

NAME = "fp8_wire"
N_DEVICES = 8
FUSED_SCOPE = "fp8_weight_amaxes"


def recipes(smoke: bool) -> dict[str, jaxamp.Float8Recipe | jaxamp.Float4Recipe]:
    if smoke:
        return {"mixed_float8": jaxamp.Float8Recipe()}
    return {
        "mixed_float8": jaxamp.Float8Recipe(),
        "tensorwise_reduce_bf16": jaxamp.Float8Recipe(reduce_dtype=jnp.bfloat16),
        "rowwise": jaxamp.Float8Recipe("rowwise"),
        "blockwise": jaxamp.Float8Recipe("blockwise"),
        "mxfp8": jaxamp.Float8Recipe("mxfp8", gemm="emulated"),
        "nvfp4": jaxamp.Float4Recipe("nvfp4", gemm="emulated"),
        "mxfp4": jaxamp.Float4Recipe("mxfp4", gemm="emulated"),
    }


def _fsdp(mesh: jax.sharding.Mesh, x: jax.Array) -> NamedSharding:
    spec: list[Any] = [None] * x.ndim
    axis = int(np.argmax(x.shape))
    if x.shape[axis] % N_DEVICES == 0:
        spec[axis] = "d"
    return NamedSharding(mesh, PartitionSpec(*spec))


def _summary(report: jaxamp.CommunicationReport) -> dict[str, Any]:
    n = report.param_count
    gathers: dict[str, float] = {}
    for c in report.collectives:
        if c.kind == "all-gather":
            gathers[c.dtype.name] = gathers.get(c.dtype.name, 0.0) + c.bytes / n
    reduces = [c for c in report.collectives if c.kind in ("all-reduce", "reduce-scatter")]
    scalars = [c for c in reduces if math_prod(c.shape) == 1]
    # Scale reductions: of a group amax (a scalar or a vector of row/block amaxes).
    amaxes = [c for c in reduces if "reduce_max" in c.op_name or FUSED_SCOPE in c.op_name]
    fused = [c for c in reduces if FUSED_SCOPE in c.op_name]
    grads = [c for c in reduces if c.backward and math_prod(c.shape) > 1]
    grad_bytes: dict[str, float] = {}
    for c in grads:
        grad_bytes[c.dtype.name] = grad_bytes.get(c.dtype.name, 0.0) + c.bytes / n
    return {
        "gather_bytes_per_param": {k: round(v, 3) for k, v in sorted(gathers.items())},
        # Weights gathered as float8 (float4) codes, one count per gather.
        "float8_weight_gathers": sum(
            c.kind == "all-gather"
            and c.dtype.name.startswith(("float8", "float4"))
            and c.parameter is not None
            for c in report.collectives
        ),
        "scalar_all_reduces": len(scalars),
        "amax_all_reduces": len(amaxes),
        "amax_all_reduce_bytes_per_param": round(sum(c.bytes for c in amaxes) / n, 4),
        "fused_weight_amax_all_reduces": len(fused),
        "fused_weight_amaxes": [list(c.shape) for c in fused],
        "gradient_reduce_bytes_per_param": {k: round(v, 3) for k, v in sorted(grad_bytes.items())},
    }


def math_prod(shape: Sequence[int]) -> int:
    return int(np.prod(shape)) if len(shape) else 1


def run(config: _models.GPTConfig, smoke: bool) -> dict[str, Any]:
    if jax.device_count() < N_DEVICES:
        raise RuntimeError(
            f"fp8_wire needs {N_DEVICES} devices; got {jax.device_count()}. Run it with "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={N_DEVICES}."
        )
    mesh = jax.make_mesh((N_DEVICES,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    model = _models.GPT(config)
    params = _models.gpt_init(model, config)
    params = jax.tree.map(lambda x: jax.device_put(x, _fsdp(mesh, x)), params)
    batch = jax.device_put(_models.gpt_batch(config), NamedSharding(mesh, PartitionSpec("d")))
    loss = _models.gpt_loss_fn(model)
    results = {}
    for name, recipe in recipes(smoke).items():
        step = jax.value_and_grad(jaxamp.autocast(loss, recipe))
        results[name] = {
            "recipe": repr(recipe),
            **_summary(jaxamp.communication_report(step, params, batch)),
        }
    return results


def table(results: dict[str, Any]) -> str:
    headers = [
        "recipe",
        "gathers B/param",
        "f8/f4 weight gathers",
        "amax all-reduces",
        "scalar",
        "fused",
        "grad reduce B/param",
    ]
    rows = [
        [
            name,
            " ".join(f"{k} {v}" for k, v in r["gather_bytes_per_param"].items()),
            r["float8_weight_gathers"],
            r["amax_all_reduces"],
            r["scalar_all_reduces"],
            r["fused_weight_amax_all_reduces"],
            " ".join(f"{k} {v}" for k, v in r["gradient_reduce_bytes_per_param"].items()),
        ]
        for name, r in results.items()
    ]
    return _harness.format_table(headers, rows)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = _harness.parse_args(__doc__.splitlines()[0], argv)
    if args.smoke:
        config = _models.GPTConfig(
            vocab=64, seq=8, d_model=32, n_heads=2, d_ff=64, n_layers=1, batch=8
        )
    else:
        config = _models.GPTConfig(
            vocab=512, seq=64, d_model=256, n_heads=4, d_ff=1024, n_layers=3, batch=8
        )
    results = run(config, args.smoke)
    print(table(results))
    described = {
        **config.__dict__,
        "n_params": config.n_params(),
        "devices": N_DEVICES,
        "sharding": "FSDP: each parameter on its largest dim, the batch on its first",
        "measure": "jaxamp.communication_report of jax.value_and_grad(autocast(loss, recipe))",
    }
    return _harness.save(NAME, NAME, args, described, results)


if __name__ == "__main__":
    main()
