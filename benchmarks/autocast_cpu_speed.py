"""CPU speed of mixed_bfloat16: float32 vs autocast vs Flax bfloat16 layer dtypes.

The work is ``examples/charlm.py``'s character transformer (width 128, context 64, batch 32,
2 blocks; the example's own classes): its jitted ``value_and_grad`` under

- ``float32``: the float32 model;
- ``autocast_bfloat16``: the same float32 model under ``jaxamp.autocast(..., "mixed_bfloat16")``
  (bf16 x bf16 -> f32 matmuls);
- ``bf16_layer_dtypes``: the model built with Flax ``dtype=jnp.bfloat16`` layers (bf16 result
  matmuls), params in float32;
- ``autocast_f32_elementwise``: autocast with ``rules`` that run every "follow" operation
  (elementwise and layout operations) in float32, so that bfloat16 appears only as matmul
  operands.

Every round runs each setup once in a shuffled order; the reported numbers are medians over
rounds and ratios to float32 within this one process, so a noisy shared machine moves all
setups alike. A width sweep (128 to 1024, batch 8) then shows where bfloat16 matmuls start to
pay: the larger the width, the larger the share of the step in matmuls. Last, one square
matmul in float32, with a bfloat16 result, and with bfloat16 operands and float32
accumulation. Whether XLA:CPU runs bfloat16 fast depends on the CPU's ISA (AMX-BF16,
AVX512-BF16), so the CPU model and those flags are recorded with the result. For each setup
the compiled program's dots are counted by operand dtype (``bf16_dots``: run as bf16 x bf16
by XLA:CPU's YNNPACK kernel; ``f32_dots``: run in float32) and its element-type
conversions (``converts``, fused or not), the price of bfloat16 around the matmuls.

    python -m benchmarks.autocast_cpu_speed            # full run (40 rounds, then the sweep)
    python -m benchmarks.autocast_cpu_speed --smoke    # seconds
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxamp
from benchmarks import _harness

NAME = "autocast_cpu_speed"
REFERENCE = "float32"
SETUPS = {"float32": "float32", "autocast_bfloat16": "autocast_bfloat16"}
SETUPS["bf16_layer_dtypes"] = "mixed_bfloat16"  # charlm's name for Flax bf16 layer dtypes
# autocast with every "follow" operation in float32: bfloat16 only as matmul operands.
# XLA:CPU computes a bfloat16 elementwise operation in float32 between two conversions,
# so on a CPU this drops conversions at the price of float32 activations.
SETUPS["autocast_f32_elementwise"] = "float32"
F32_ELEMENTWISE = {
    name: "float32" for name, rule in jaxamp.AUTOCAST_RULES.items() if rule == "follow"
}
ISA_FLAGS = ("amx_bf16", "amx_tile", "avx512_bf16", "avx512f", "avx2")
FULL = {"batch": 32, "context": 64, "width": 128, "layers": 2, "rounds": 40}
SMOKE = {"batch": 2, "context": 8, "width": 32, "layers": 1, "rounds": 3}
SWEEP = {"widths": [128, 256, 512, 1024], "batch": 8, "rounds": 9}
SMOKE_SWEEP = {"widths": [16], "batch": 2, "rounds": 2}
MATMUL = {"size": 1024, "rounds": 21}
SMOKE_MATMUL = {"size": 64, "rounds": 3}
# One matmul three ways: float32, bfloat16 result (Flax bf16 layers), bfloat16 operands
# with float32 accumulation (what autocast emits).
MATMULS = {
    "float32": lambda a, b: a @ b,
    "bf16_result": lambda a, b: a.astype(jnp.bfloat16) @ b.astype(jnp.bfloat16),
    "bf16_operands_f32_accumulation": lambda a, b: jnp.matmul(
        a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), preferred_element_type=jnp.float32
    ),
}


def _charlm():
    path = Path(__file__).resolve().parent.parent / "examples" / "charlm.py"
    spec = importlib.util.spec_from_file_location("charlm", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("charlm", module)
    spec.loader.exec_module(module)
    return module


def cpu_isa() -> list[str]:
    """The bfloat16-relevant ISA flags of this CPU (empty where /proc/cpuinfo is absent)."""
    return _harness.cpu_flags(ISA_FLAGS)


def compiled_dot_dtypes(compiled: Any) -> dict[str, int]:
    """Dots of a compiled program by lhs dtype (``bf16``/``f32``), fusions included.

    Also ``converts``: the program's element-type conversions, fused or not.
    """
    text = compiled.as_text()
    types = dict(re.findall(r"(%[\w.\-]+) = (\w+)\[", text))
    counts: dict[str, int] = {}
    for lhs in re.findall(r" dot\((%[\w.\-]+), ", text):
        counts[types.get(lhs, "?")] = counts.get(types.get(lhs, "?"), 0) + 1
    counts["converts"] = len(re.findall(r" convert\(", text))
    return counts


def _value_and_grad(charlm: Any, setup: str, dims: dict[str, int]) -> tuple[Callable, Any]:
    model, loss_fn = charlm.build(SETUPS[setup], dims, seed=0)
    graphdef, state = nnx.split(model)

    def loss(state, tokens):
        return loss_fn(nnx.merge(graphdef, state), tokens)

    if setup == "autocast_f32_elementwise":
        loss = jaxamp.autocast(loss, "mixed_bfloat16", rules=F32_ELEMENTWISE)
    return jax.jit(jax.value_and_grad(loss)), state


def run(config: dict[str, int], seed: int = 0) -> list[dict[str, Any]]:
    charlm = _charlm()
    keys = ("width", "layers", "context")
    dims = charlm.sizes(argparse.Namespace(head_dim=32, **{k: config[k] for k in keys}))
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, dims["vocab"], (config["batch"], config["context"] + 1))
    tokens = jax.numpy.asarray(tokens, jax.numpy.int32)
    steps, states, dots, losses = {}, {}, {}, {}
    for setup in SETUPS:
        fun, states[setup] = _value_and_grad(charlm, setup, dims)
        compiled = fun.lower(states[setup], tokens).compile()
        dots[setup] = compiled_dot_dtypes(compiled)
        steps[setup] = compiled
        losses[setup] = float(jax.block_until_ready(compiled(states[setup], tokens))[0])
    seconds: dict[str, list[float]] = {setup: [] for setup in SETUPS}
    for _ in range(config["rounds"]):
        for setup in rng.permutation(list(SETUPS)):
            start = time.perf_counter()
            jax.block_until_ready(steps[setup](states[setup], tokens))
            seconds[setup].append(time.perf_counter() - start)
    reference = _harness.median(seconds[REFERENCE])
    return [
        {
            "setup": setup,
            "loss": losses[setup],
            "median_ms": 1e3 * _harness.median(seconds[setup]),
            "ratio_to_float32": _harness.median(seconds[setup]) / reference,
            "bf16_dots": dots[setup].get("bf16", 0),
            "f32_dots": dots[setup].get("f32", 0),
            "converts": dots[setup]["converts"],
            "width": config["width"],
            "batch": config["batch"],
            "per_round_ms": [1e3 * s for s in seconds[setup]],
        }
        for setup in SETUPS
    ]


def sweep(config: dict[str, int], sweep_config: dict[str, Any]) -> list[dict[str, Any]]:
    """:func:`run` at each width of ``sweep_config`` (its batch and rounds)."""
    rows = []
    for width in sweep_config["widths"]:
        sized = {**config, "width": width, "batch": sweep_config["batch"]}
        rows += [{**r, "part": "sweep"} for r in run({**sized, "rounds": sweep_config["rounds"]})]
    return rows


def matmul(config: dict[str, int], seed: int = 0) -> list[dict[str, Any]]:
    """A square matmul of ``config["size"]`` in the three forms of ``MATMULS``, interleaved."""
    rng = np.random.default_rng(seed)
    n = config["size"]
    a, b = (jnp.asarray(rng.standard_normal((n, n)), jnp.float32) for _ in range(2))
    compiled = {name: jax.jit(f).lower(a, b).compile() for name, f in MATMULS.items()}
    seconds: dict[str, list[float]] = {name: [] for name in MATMULS}
    for _ in range(config["rounds"]):
        for name in rng.permutation(list(MATMULS)):
            start = time.perf_counter()
            jax.block_until_ready(compiled[name](a, b))
            seconds[name].append(time.perf_counter() - start)
    reference = _harness.median(seconds["float32"])
    rows = []
    for name, c in compiled.items():
        dots = compiled_dot_dtypes(c)
        rows.append(
            {
                "part": "matmul",
                "setup": name,
                "width": n,
                "batch": n,
                "median_ms": 1e3 * _harness.median(seconds[name]),
                "ratio_to_float32": _harness.median(seconds[name]) / reference,
                "bf16_dots": dots.get("bf16", 0),
                "f32_dots": dots.get("f32", 0),
                "converts": dots["converts"],
                "per_round_ms": [1e3 * t for t in seconds[name]],
            }
        )
    return rows


def table(results: Sequence[dict[str, Any]]) -> str:
    rows = [
        [
            r["setup"],
            r.get("width"),
            r.get("batch"),
            r["median_ms"],
            r["ratio_to_float32"],
            f"{1 / r['ratio_to_float32']:.2f}x",
            r["bf16_dots"],
            r["f32_dots"],
            r.get("converts"),
        ]
        for r in results
    ]
    headers = ["setup", "width", "batch", "median ms", "x float32", "speed-up"]
    headers += ["bf16 dots", "f32 dots", "converts"]
    return _harness.format_table(headers, rows)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = _harness.parse_args(__doc__.split("\n\n")[0], argv)
    config = dict(SMOKE if args.smoke else FULL)
    config["sweep"] = dict(SMOKE_SWEEP if args.smoke else SWEEP)
    config["matmul"] = dict(SMOKE_MATMUL if args.smoke else MATMUL)
    main_rows = [{**r, "part": "main"} for r in run(config)]
    results = main_rows + sweep(config, config["sweep"]) + matmul(config["matmul"])
    config["isa"] = cpu_isa()
    print(f"CPU ISA flags: {', '.join(config['isa']) or 'none of ' + ', '.join(ISA_FLAGS)}")
    print(table(results))
    return _harness.save(NAME, NAME, args, config, results)


if __name__ == "__main__":
    main()
