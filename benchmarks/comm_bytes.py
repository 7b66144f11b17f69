"""Bytes on the wire per training step: a sharded GPT under each precision setting.

A GPT (``GPTConfig(vocab=512, seq=64, d_model=256, n_heads=8, d_ff=1024,
n_layers=3)``, 2.65M parameters) trains one SGD step on 8 devices in two
layouts:

- ``fsdp``: every weight sharded over the 8 devices on its largest dim that 8
  divides, the batch sharded too (ZeRO-3 / FSDP);
- ``tp``: Megatron tensor parallelism: query/key/value and the first MLP layer
  column-parallel, the attention output and second MLP layer row-parallel,
  the rest replicated, the batch replicated.

For each setting (float32; a policy cast ``policy.cast_to_compute``; autocast
with ``"mixed_bfloat16"``, each also with ``reduce=bfloat16``; autocast with
``"mixed_float8"``; and, ``fsdp`` only, the policy cast on a mesh of
``AxisType.Explicit`` axes, ``policy_cast_bf16_explicit``: the GPT's embeddings
read by one-hot products, ``benchmarks._models.OneHotGPT``, and its matrices
passed as ``matmul_operands``) ``jaxamp.communication_report`` lists the collectives of
the program as the SPMD partitioner leaves it (backend-independent): bytes per
parameter by kind and dtype, for ``tp`` also in units of one bfloat16
``[batch, seq, d_model]`` activation. Nothing runs; the arguments are
``jax.ShapeDtypeStruct``\\ s.

With the ``libtpu`` wheel importable (``pip install libtpu``; not a dependency),
each program is also compiled ahead of time for a TPU v5e 2x4 topology
(``jax.experimental.topologies``, no TPU needed), and the final TPU program's
collectives and ``memory_analysis()`` are recorded next to the partitioner's.

    python -m benchmarks.comm_bytes            # 8 CPU devices (set in the script)
    python -m benchmarks.comm_bytes --smoke    # a tiny GPT, seconds
    python -m benchmarks.comm_bytes --settings policy_cast_bf16_explicit  # some settings
"""

from __future__ import annotations

import os

if __name__ == "__main__" and "--xla_force_host_platform_device_count" not in os.environ.get(
    "XLA_FLAGS", ""
):
    # Before jax is imported: 8 CPU devices for the partitioner.
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import importlib.util
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

import jaxamp
from benchmarks import _harness
from benchmarks._models import GPT, GPTConfig, OneHotGPT, gpt_loss_fn
from benchmarks._sharding import LAYOUTS, TP_SPECS, batch_spec, param_specs
from jaxamp._wire._collectives import report_from_hlo

NAME = "comm_bytes"
N_DEVICES = 8
CONFIG = GPTConfig(vocab=512, seq=64, d_model=256, n_heads=8, d_ff=1024, n_layers=3, batch=16)
SMOKE_CONFIG = GPTConfig(vocab=64, seq=16, d_model=64, n_heads=8, d_ff=128, n_layers=1, batch=8)
REDUCE_BF16 = "params=float32,compute=bfloat16,output=float32,reduce=bfloat16"
TPU_TOPOLOGY = "v5e:2x4"


def _policy_cast(spec: str) -> Callable[[Callable], Callable]:
    policy = jaxamp.get_policy(spec)
    return lambda loss: lambda params, batch: loss(policy.cast_to_compute(params), batch)


def _matrices(path: tuple, x: Any) -> bool:
    # What products alone read: the GPT's matrices but its attention biases ([heads, dim]).
    return x.ndim >= 2 and getattr(path[-1], "key", None) != "bias"


def _policy_cast_explicit(spec: str) -> Callable[[Callable], Callable]:
    policy = jaxamp.get_policy(spec)
    return lambda loss: (
        lambda params, batch: loss(policy.cast_to_compute(params, matmul_operands=_matrices), batch)
    )


SETTINGS: dict[str, Callable[[Callable], Callable]] = {
    "float32": lambda loss: loss,
    "policy_cast_bf16": _policy_cast("mixed_bfloat16"),
    "policy_cast_bf16_reduce_bf16": _policy_cast(REDUCE_BF16),
    "autocast_bf16": lambda loss: jaxamp.autocast(loss, "mixed_bfloat16"),
    "autocast_bf16_reduce_bf16": lambda loss: jaxamp.autocast(loss, jaxamp.get_policy(REDUCE_BF16)),
    "autocast_fp8": lambda loss: jaxamp.autocast(loss, "mixed_float8"),
    "policy_cast_bf16_explicit": _policy_cast_explicit("mixed_bfloat16"),
}
# Settings on a mesh of AxisType.Explicit axes, FSDP only (tensor parallelism's
# row-parallel products would need out_sharding= in the model).
EXPLICIT = {"policy_cast_bf16_explicit"}
SMOKE_SETTINGS = ["float32", "autocast_bf16"]


def _abstract(tree: Any, specs: Any, mesh: Any) -> Any:
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, s)),
        tree,
        specs,
    )


def sharded_step(config: GPTConfig, setting: str, layout: str, mesh: Any) -> tuple:
    """The jitted SGD step and its abstract sharded arguments."""
    # dtype=None: each layer computes in its inputs' dtype, so that a policy cast of
    # the params is what the matmuls see (dtype=float32 would cast them back).
    model = (OneHotGPT if setting in EXPLICIT else GPT)(config, dtype=None)
    tokens = jax.ShapeDtypeStruct((1, config.seq), jnp.int32)
    params = jax.eval_shape(model.init, jax.random.key(0), tokens)["params"]
    loss = SETTINGS[setting](gpt_loss_fn(model))
    p_specs = param_specs(params, layout, N_DEVICES)
    b_spec = batch_spec(layout)
    batch = {
        k: jax.ShapeDtypeStruct((config.batch, config.seq), jnp.int32)
        for k in ("inputs", "targets")
    }

    def step(params, batch):
        grads = jax.grad(loss)(params, batch)
        return jax.tree.map(lambda p, g: p - 0.01 * g, params, grads)

    p_sh = jax.tree.map(lambda s: NamedSharding(mesh, s), p_specs)
    jitted = jax.jit(step, out_shardings=p_sh)
    args = (_abstract(params, p_specs, mesh), _abstract(batch, {k: b_spec for k in batch}, mesh))
    return jitted, args


def summarize(report: jaxamp.CommunicationReport, activation_bytes: int) -> dict[str, Any]:
    """Bytes per parameter by kind/dtype, and the gather / reduction / scalar totals."""
    by_kind = {
        f"{kind}/{dtype.name}": {
            "count": count,
            "bytes": total,
            "B_per_param": round(total / report.param_count, 4),
        }
        for (kind, dtype), (count, total) in report.totals().items()
    }
    # One-element all-reduces are scalars (a loss average, an FP8 amax), not gradients.
    reductions = [
        c
        for c in report.collectives
        if c.kind in ("all-reduce", "reduce-scatter") and math.prod(c.shape) > 1
    ]
    total = report.bytes_by()
    return {
        "param_count": report.param_count,
        "by_kind_dtype": by_kind,
        "gather_B_per_param": round(report.bytes_per_param("all-gather"), 4),
        "reduce_B_per_param": round(sum(c.bytes for c in reductions) / report.param_count, 4),
        "scalar_all_reduces": sum(
            1 for c in report.collectives if c.kind == "all-reduce" and math.prod(c.shape) == 1
        ),
        "total_B_per_param": round(total / report.param_count, 4),
        "total_in_bf16_activations": round(total / activation_bytes, 2),
    }


def _tpu_mesh() -> Any:
    if importlib.util.find_spec("libtpu") is None:
        return None
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(platform="tpu", topology_name=TPU_TOPOLOGY)
    devices = np.array(topology.devices).reshape(N_DEVICES)
    return jax.sharding.Mesh(devices, ("d",), axis_types=(jax.sharding.AxisType.Auto,))


def _tpu_view(config: GPTConfig, setting: str, layout: str, mesh: Any, act: int) -> dict:
    jitted, args = sharded_step(config, setting, layout, mesh)
    compiled = jitted.lower(*args).compile()
    param_count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(args[0]))
    memory = compiled.memory_analysis()
    fields = ("argument", "output", "temp", "alias", "generated_code")
    return {
        **summarize(report_from_hlo(compiled.as_text(), param_count), act),
        "memory_bytes": {f: int(getattr(memory, f"{f}_size_in_bytes", -1)) for f in fields},
    }


def _mesh(setting: str) -> Any:
    kind = jax.sharding.AxisType.Explicit if setting in EXPLICIT else jax.sharding.AxisType.Auto
    return jax.make_mesh((N_DEVICES,), ("d",), axis_types=(kind,))


def measure(config: GPTConfig, settings: Sequence[str]) -> list[dict[str, Any]]:
    tpu_mesh = _tpu_mesh()
    activation = config.batch * config.seq * config.d_model * 2
    results = []
    for layout in LAYOUTS:
        for setting in settings:
            if setting in EXPLICIT and layout != "fsdp":
                continue
            mesh = _mesh(setting)
            jitted, args = sharded_step(config, setting, layout, mesh)
            with jax.set_mesh(mesh):  # an explicit mesh's reshards read it
                report = jaxamp.communication_report(jitted, *args)
            row = {
                "layout": layout,
                "setting": setting,
                "partitioned": summarize(report, activation),
            }
            if tpu_mesh is not None and setting not in EXPLICIT:
                try:
                    row["tpu_final"] = _tpu_view(config, setting, layout, tpu_mesh, activation)
                except jax.errors.JaxRuntimeError as e:  # recorded, the other rows still run
                    row["tpu_final"] = {"error": str(e).strip().splitlines()[0]}
            results.append(row)
            print(layout, setting, row["partitioned"]["by_kind_dtype"], flush=True)
    return results


def table(results: list[dict[str, Any]]) -> str:
    headers = ["layout", "setting", "gather B/p", "reduce B/p", "scalar ARs", "total B/p", "x act"]
    headers += ["TPU gather B/p", "TPU reduce B/p"]
    rows = []
    for r in results:
        part, tpu = r["partitioned"], r.get("tpu_final", {})
        rows.append(
            [r["layout"], r["setting"]]
            + [part[k] for k in ("gather_B_per_param", "reduce_B_per_param")]
            + [part[k] for k in ("scalar_all_reduces", "total_B_per_param")]
            + [part["total_in_bf16_activations"]]
            + [tpu.get("gather_B_per_param", "-"), tpu.get("reduce_B_per_param", "-")]
        )
    return _harness.format_table(headers, rows)


def _settings_argument(parser: Any) -> None:
    parser.add_argument(
        "--settings",
        default=None,
        help=f"comma-separated settings to run (default: all): {', '.join(SETTINGS)}",
    )


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = _harness.parse_args(__doc__.splitlines()[0], argv, _settings_argument)
    if len(jax.devices()) < N_DEVICES:
        raise SystemExit(f"needs {N_DEVICES} devices (XLA_FLAGS is set before jax is imported)")
    config = SMOKE_CONFIG if args.smoke else CONFIG
    settings = SMOKE_SETTINGS if args.smoke else list(SETTINGS)
    if args.settings:
        settings = args.settings.split(",")
        unknown = sorted(set(settings) - set(SETTINGS))
        if unknown:
            raise SystemExit(f"unknown settings {unknown}; known: {', '.join(SETTINGS)}")
    run_config = {
        "gpt": config.__dict__,
        "n_params": config.n_params(),
        "devices": N_DEVICES,
        "layouts": {"fsdp": "largest dim sharded, batch sharded", "tp": str(TP_SPECS)},
        "settings": settings,
        "view": "after SPMD partitioning (communication_report); tpu_final: the TPU "
        f"program compiled ahead of time for {TPU_TOPOLOGY} when libtpu is importable",
        "libtpu": importlib.util.find_spec("libtpu") is not None,
    }
    results = measure(config, settings)
    print(table(results))
    return _harness.save(NAME, NAME, args, run_config, results)


if __name__ == "__main__":
    main()
