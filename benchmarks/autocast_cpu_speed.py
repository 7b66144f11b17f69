"""CPU speed of mixed_bfloat16: float32 vs autocast vs Flax bfloat16 layer dtypes.

The work is ``examples/charlm.py``'s character transformer (width 128, context 64, batch 32,
2 blocks; the example's own classes): its jitted ``value_and_grad`` under

- ``float32``: the float32 model;
- ``autocast_bfloat16``: the same float32 model under ``jaxamp.autocast(..., "mixed_bfloat16")``
  (bf16 x bf16 -> f32 matmuls);
- ``bf16_layer_dtypes``: the model built with Flax ``dtype=jnp.bfloat16`` layers (bf16 result
  matmuls), params in float32.

Every round runs each setup once in a shuffled order; the reported numbers are medians over
rounds and ratios to float32 within this one process, so a noisy shared machine moves all
setups alike. Whether XLA:CPU runs bfloat16 fast depends on the CPU's ISA (AMX-BF16,
AVX512-BF16), so the CPU model and those flags are recorded with the result. For each setup
the compiled program's dots are counted by operand dtype (``bf16_dots``: run as bf16 x bf16
by XLA:CPU's YNNPACK kernel; ``f32_dots``: run in float32).

    python -m benchmarks.autocast_cpu_speed            # full run (40 rounds)
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
import numpy as np
from flax import nnx

from benchmarks import _harness

NAME = "autocast_cpu_speed"
REFERENCE = "float32"
SETUPS = {"float32": "float32", "autocast_bfloat16": "autocast_bfloat16"}
SETUPS["bf16_layer_dtypes"] = "mixed_bfloat16"  # charlm's name for Flax bf16 layer dtypes
ISA_FLAGS = ("amx_bf16", "amx_tile", "avx512_bf16", "avx512f", "avx2")
FULL = {"batch": 32, "context": 64, "width": 128, "layers": 2, "rounds": 40}
SMOKE = {"batch": 2, "context": 8, "width": 32, "layers": 1, "rounds": 3}


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
    """Dots of a compiled program by lhs dtype (``bf16``/``f32``), fusions included."""
    text = compiled.as_text()
    types = dict(re.findall(r"(%[\w.\-]+) = (\w+)\[", text))
    counts: dict[str, int] = {}
    for lhs in re.findall(r" dot\((%[\w.\-]+), ", text):
        counts[types.get(lhs, "?")] = counts.get(types.get(lhs, "?"), 0) + 1
    return counts


def _value_and_grad(charlm: Any, setup: str, dims: dict[str, int]) -> tuple[Callable, Any]:
    model, loss_fn = charlm.build(SETUPS[setup], dims, seed=0)
    graphdef, state = nnx.split(model)

    def loss(state, tokens):
        return loss_fn(nnx.merge(graphdef, state), tokens)

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
            "per_round_ms": [1e3 * s for s in seconds[setup]],
        }
        for setup in SETUPS
    ]


def table(results: Sequence[dict[str, Any]]) -> str:
    rows = [
        [
            r["setup"],
            r["median_ms"],
            r["ratio_to_float32"],
            f"{1 / r['ratio_to_float32']:.2f}x",
            r["bf16_dots"],
            r["f32_dots"],
        ]
        for r in results
    ]
    headers = ["setup", "median ms", "x float32", "speed-up", "bf16 dots", "f32 dots"]
    return _harness.format_table(headers, rows)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = _harness.parse_args(__doc__.split("\n\n")[0], argv)
    config = dict(SMOKE if args.smoke else FULL)
    results = run(config)
    config["isa"] = cpu_isa()
    print(f"CPU ISA flags: {', '.join(config['isa']) or 'none of ' + ', '.join(ISA_FLAGS)}")
    print(table(results))
    return _harness.save(NAME, NAME, args, config, results)


if __name__ == "__main__":
    main()
