"""Shared plumbing of the benchmark scripts: machine info, timing, tables and JSON results."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on: enough to compare two runs honestly."""
    cpu_model = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu_model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    import flax
    import jmp
    import optax

    import jaxamp

    devices = jax.devices()
    return {
        "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S"),
        "command": _command(),
        "jaxamp_commit": _git_commit(),
        "nproc": os.cpu_count(),
        "cpu_model": cpu_model,
        "backend": jax.default_backend(),
        "device_kind": devices[0].device_kind,
        "device_count": len(devices),
        "python": platform.python_version(),
        "versions": {
            "jax": jax.__version__,
            "jaxlib": jax.lib.__version__ if hasattr(jax, "lib") else None,
            "flax": flax.__version__,
            "optax": optax.__version__,
            "jmp": getattr(jmp, "__version__", "unknown"),
            "jaxamp": jaxamp.__version__,
        },
    }


def cpu_flags(wanted: Sequence[str]) -> list[str]:
    """Those of ``wanted`` that this CPU's /proc/cpuinfo lists (empty where it is absent)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next(line.split(":", 1)[1].split() for line in f if line.startswith("flags"))
    except (OSError, StopIteration):
        return []
    return [flag for flag in wanted if flag in flags]


def _git_commit() -> str | None:
    """The checked-out commit (with ``-dirty`` when jaxamp/ has local changes), if any."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "jaxamp"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("-dirty" if dirty else "")


def _command() -> str:
    """How this process was started, as ``python -m benchmarks.<name> ...`` when it was."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name:
        return " ".join(["python", "-m", spec.name, *sys.argv[1:]])
    return " ".join(["python", *sys.argv])


def parse_args(
    description: str,
    argv: Sequence[str] | None = None,
    extra: Callable[[argparse.ArgumentParser], None] | None = None,
) -> argparse.Namespace:
    """The command line shared by every script (``--smoke``, ``--out``), plus ``extra``'s."""
    parser = argparse.ArgumentParser(description=description)
    if extra is not None:
        extra(parser)
    parser.add_argument(
        "--smoke", action="store_true", help="tiny sizes and few repetitions (seconds; for CI)"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="JSON output path (default: benchmarks/results/<name>[_smoke].json)",
    )
    return parser.parse_args(argv)


def default_out(name: str, smoke: bool) -> Path:
    return RESULTS_DIR / f"{name}{'_smoke' if smoke else ''}.json"


def write_json(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n")
    print(f"wrote {path}")


def save(benchmark: str, out_name: str, args: Any, config: Any, results: Any) -> dict[str, Any]:
    """Writes the run's JSON (benchmark, machine, config, results) and returns it."""
    payload = {
        "benchmark": benchmark,
        "machine": machine_info(),
        "config": config,
        "results": results,
    }
    write_json(args.out or default_out(out_name, args.smoke), payload)
    return payload


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def time_compile(build_step: Callable[[], Callable], args: tuple, **jit_kwargs: Any) -> float:
    """Wall time of ``jax.jit(step).lower(*args).compile()`` for a freshly built step.

    ``build_step`` returns a new function object each call and every JAX cache is
    cleared first, so no repetition reuses a trace or an executable of an earlier one.
    """
    jax.clear_caches()
    step = build_step()
    start = time.perf_counter()
    jax.jit(step, **jit_kwargs).lower(*args).compile()
    return time.perf_counter() - start


def rotated(items: Sequence[Any], rep: int) -> list[Any]:
    """``items`` rotated by ``rep``: interleaving without a fixed first/last variant."""
    k = rep % len(items) if items else 0
    return [*items[k:], *items[:k]]


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub-markdown table (also readable in a terminal)."""

    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.3g}" if abs(value) < 1e4 else f"{value:.4g}"
        return "" if value is None else str(value)

    text = [[cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in text)) for i, h in enumerate(headers)]
    lines = [
        "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |",
        "|" + "|".join("-" * (w + 2) for w in widths) + "|",
    ]
    for r in text:
        lines.append("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |")
    return "\n".join(lines)
