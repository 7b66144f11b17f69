"""Prints the markdown tables of BENCHMARKS.md from the JSON files in benchmarks/results/.

python -m benchmarks.report            # every full (non-smoke) result
"""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import (
    _harness,
    activation_memory,
    autocast_cpu_speed,
    comm_bytes,
    compile_scaling,
    follow_rule,
    fp8_wire,
    gpu_speed,
    low_precision,
    numerics_cost,
    step_overhead,
)

# Result files are named <script>[_<model>][_<date>_<commit>].json (e.g. compile_scaling_gpt,
# step_overhead_2026-11-29_c6a15ad for an older run); the script's own table renders each.
TABLES = {
    "compile_scaling": compile_scaling.table,
    "step_overhead": step_overhead.table,
    "activation_memory": activation_memory.table,
    "gpu_speed": gpu_speed.table,
    "autocast_cpu_speed": autocast_cpu_speed.table,
    "follow_rule": follow_rule.table,
    "low_precision": low_precision.table,
    "numerics_cost": numerics_cost.table,
    "comm_bytes": comm_bytes.table,
    "fp8_wire": fp8_wire.table,
}


def render(path: Path) -> str:
    payload = json.loads(path.read_text())
    m = payload["machine"]
    lines = [
        f"### {path.stem}",
        "",
        f"- command: `{m['command']}`",
        f"- machine: {m['nproc']} CPUs ({m['cpu_model']}), backend {m['backend']} "
        f"({m['device_kind']}), jax {m['versions']['jax']}, flax {m['versions']['flax']}, "
        f"optax {m['versions']['optax']}, jmp {m['versions']['jmp']}",
        f"- date (UTC): {m['date_utc']}; jaxamp commit {m.get('jaxamp_commit')}",
        "",
    ]
    if payload.get("status", "ok") != "ok":
        lines.append(f"Not run: {payload['status']}.")
    else:
        script = next(name for name in TABLES if path.stem.startswith(name))
        lines.append(TABLES[script](payload["results"]))
        rows = payload["results"]
        rows = rows.values() if isinstance(rows, dict) else rows
        reasons = {r["reason"] for r in rows if r.get("status") == "skipped"}
        lines += [f"- skipped: {reason}" for reason in sorted(reasons)]
    return "\n".join(lines) + "\n"


def main() -> None:
    for script in TABLES:
        for path in sorted(_harness.RESULTS_DIR.glob(f"{script}*.json")):
            if not path.stem.endswith("_smoke"):
                print(render(path))


if __name__ == "__main__":
    main()
