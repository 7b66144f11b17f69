"""Helpers shared by the examples: the jitted Flax NNX train step, measurements, tables, plots.

The examples train Flax NNX models the way the README recommends:

* layers get ``policy.module_kwargs()`` (``dtype`` = compute dtype, ``param_dtype`` =
  float32 master weights), and the model casts its output to ``policy.output_dtype``;
* ``nnx.Optimizer(model, jaxamp.loss_scaling(tx, loss_scale), wrt=nnx.Param)``;
* the train step differentiates the SCALED loss and lets the optimizer unscale,
  check and skip.

The step is a pure function of the split NNX state compiled once with ``jax.jit``
(``nnx.split``/``nnx.merge`` around it), so that ``jax.jit(step).lower(...)`` gives
the compiled memory statistics of exactly the step that trains.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxamp

LossFn = Callable[..., jax.Array]

# The results committed with the repository (refreshed only on request) and, for
# every other run, a folder under the working directory that git ignores.
COMMITTED_RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_OUT = Path("jaxamp-results")


def add_output_arguments(parser: argparse.ArgumentParser, files: str) -> None:
    """``--out DIR`` and ``--refresh-committed``: where an example writes ``files``.

    By default an example writes to ``./jaxamp-results/`` so that running it
    never modifies the repository; ``--refresh-committed`` rewrites the committed
    results in ``examples/results/``.
    """
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"folder for {files} (default: {DEFAULT_OUT}/ in the working directory)",
    )
    group.add_argument(
        "--refresh-committed",
        action="store_true",
        help="write to examples/results/, replacing the committed results",
    )


def add_language_model_arguments(parser: argparse.ArgumentParser) -> None:
    """charlm's settings and its mixture of experts', as the fidelity experiments take them."""
    parser.add_argument("--charlm-steps", type=int, default=300)
    parser.add_argument("--charlm-width", type=int, default=64)
    parser.add_argument("--charlm-layers", type=int, default=2)
    parser.add_argument("--charlm-batch", type=int, default=16)
    parser.add_argument("--charlm-context", type=int, default=64)
    parser.add_argument("--experts", type=int, default=4, help="experts per block of moe")
    parser.add_argument("--moe-batch", type=int, default=8, help="sequences per step of moe")


def output_dir(args: argparse.Namespace) -> Path:
    """The folder the parsed ``--out`` / ``--refresh-committed`` arguments ask for."""
    if args.refresh_committed:
        return COMMITTED_RESULTS
    return args.out if args.out is not None else DEFAULT_OUT


def make_train_step(
    graphdef: Any, loss_fn: LossFn, *, with_zero_fraction: bool = False
) -> Callable[..., tuple[Any, dict[str, jax.Array]]]:
    """The pure train step ``step(state, *batch) -> (state, metrics)``.

    Args:
      graphdef: the graph definition from ``nnx.split((model, optimizer))``.
      loss_fn: ``loss_fn(model, *batch)`` -> float32 scalar loss (unscaled).
      with_zero_fraction: also report the fraction of gradient entries that are
        exactly zero (of the gradients of the scaled loss, as the backward pass
        produced them), which shows float16 underflow.

    Returns:
      A function to pass to ``jax.jit``; its metrics are the unscaled ``loss``,
      the ``loss_scale`` used for this step, ``skipped`` (this step was skipped)
      and, if asked, ``zero_fraction``.
    """

    def step(state, *batch):
        model, optimizer = nnx.merge(graphdef, state)
        scale = jaxamp.get_loss_scale(optimizer.opt_state)
        skipped_before = jaxamp.loss_scaling_metrics(optimizer.opt_state)["skipped_steps"]

        # The true loss, and the gradients of the scaled loss that the optimizer expects.
        grad_fn = jaxamp.scaled_value_and_grad(loss_fn, scale, value_and_grad=nnx.value_and_grad)
        loss, grads = grad_fn(model, *batch)
        metrics = {"loss": loss, "loss_scale": scale.loss_scale}
        if with_zero_fraction:
            metrics["zero_fraction"] = zero_fraction(grads)
        optimizer.update(model, grads)
        skipped_after = jaxamp.loss_scaling_metrics(optimizer.opt_state)["skipped_steps"]
        metrics["skipped"] = skipped_after > skipped_before
        return nnx.state((model, optimizer)), metrics

    return step


def autocast_loss(loss_fn: LossFn, policy: Any) -> LossFn:
    """``loss_fn(model, *batch)`` of a float32 NNX model, run under ``jaxamp.autocast``.

    autocast rewrites a pure function's jaxpr, so the model is split into its
    graph definition and state and merged back inside.
    """

    def loss(model: nnx.Module, *batch: Any) -> jax.Array:
        graphdef, state = nnx.split(model)

        def pure(state, *batch):
            return loss_fn(nnx.merge(graphdef, state), *batch)

        return jaxamp.autocast(pure, policy)(state, *batch)

    return loss


def mean_std(values: Sequence[float], digits: int = 4) -> str:
    """``"mean +- std"`` over seeds (sample std; 0 for one value)."""
    values = np.asarray(values, np.float64)
    std = values.std(ddof=1) if len(values) > 1 else 0.0
    return f"{values.mean():.{digits}f} +- {std:.{digits}f}"


def zero_fraction(tree: Any) -> jax.Array:
    """The fraction of floating-point entries of ``tree`` that are exactly zero."""
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]
    zeros = sum(jnp.sum(x == 0, dtype=jnp.int32) for x in leaves)
    total = sum(x.size for x in leaves)
    return zeros.astype(jnp.float32) / jnp.float32(total)


def compiled_memory(compiled: Any) -> dict[str, int | None]:
    """Temp and argument bytes of a compiled step (``None`` where the backend gives none)."""
    stats = compiled.memory_analysis()
    if stats is None:
        return {"temp_bytes": None, "argument_bytes": None}
    return {
        "temp_bytes": int(stats.temp_size_in_bytes),
        "argument_bytes": int(stats.argument_size_in_bytes),
    }


def residual_bytes(loss_fn: LossFn, model: nnx.Module, *batch: Any) -> int:
    """Bytes the backward pass keeps from the forward pass (the VJP's residuals).

    This is the activation memory of training, independent of the platform and of
    XLA's buffer assignment: the leaves of the ``jax.vjp`` function of the loss with
    respect to the parameters. Shapes only; nothing is computed.
    """
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def residual_leaves(params, rest, *batch):
        def of_params(params):
            return loss_fn(nnx.merge(graphdef, params, rest), *batch)

        return jax.tree.leaves(jax.vjp(of_params, params)[1])

    shapes = jax.eval_shape(residual_leaves, params, rest, *batch)
    return int(sum(s.size * np.dtype(s.dtype).itemsize for s in shapes))


def matmul_report(loss_fn: LossFn, model: nnx.Module, *batch: Any) -> Any:
    """``jaxamp.precision_report`` of the gradient computation (forward and backward).

    Says in which dtype each matmul/convolution of a train step runs and which
    have a dimension that misses the Tensor Core multiple. Traced, not run.
    """
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def grads(params, rest, *batch):
        return jax.grad(lambda p: loss_fn(nnx.merge(graphdef, p, rest), *batch))(params)

    return jaxamp.precision_report(grads, params, rest, *batch)


class Timer:
    """Wall-clock seconds of a block; call ``.stop(value)`` to wait for device work first."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.seconds = 0.0

    def stop(self, value: Any = None) -> float:
        if value is not None:
            jax.block_until_ready(value)
        self.seconds = time.perf_counter() - self.start
        return self.seconds


def progress(total: int, desc: str, enabled: bool = True) -> Any:
    """A tqdm progress bar (a silent stand-in when ``enabled`` is false)."""
    if not enabled:
        return contextlib.nullcontext(_SilentBar())
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, leave=True, dynamic_ncols=True)


class _SilentBar:
    def update(self, n: int = 1) -> None:
        del n

    def set_postfix_str(self, text: str) -> None:
        del text


def stack_history(history: Sequence[dict[str, jax.Array]]) -> dict[str, np.ndarray]:
    """Per-step metrics (kept on the device while training) as numpy arrays."""
    if not history:
        return {}
    host = jax.device_get(list(history))
    return {key: np.asarray([h[key] for h in host]) for key in host[0]}


def batches(n: int, batch_size: int, seed: int) -> Iterator[np.ndarray]:
    """Endless random index batches; the same seed gives every policy the same batches."""
    rng = np.random.default_rng(seed)
    while True:
        yield rng.integers(0, n, batch_size)


def format_bytes(n: int | None) -> str:
    if n is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str]]) -> str:
    """A Markdown table of ``rows``; ``columns`` are ``(key, header)`` pairs."""
    header = "| " + " | ".join(h for _, h in columns) + " |"
    rule = "|" + "|".join("---" for _ in columns) + "|"
    lines = [header, rule]
    for row in rows:
        lines.append("| " + " | ".join(str(row[k]) for k, _ in columns) + " |")
    return "\n".join(lines)


def machine_description() -> str:
    """Platform, CPU count and JAX devices, for the results README."""
    devices = ", ".join(sorted({d.device_kind for d in jax.devices()}))
    return (
        f"{platform.platform()}, {os.cpu_count()} CPU cores, "
        f"Python {platform.python_version()}, jax {jax.__version__}, devices: {devices}"
    )


def code_version() -> str:
    """The git commit of the checkout, and whether jaxamp/ or examples/ differ from it."""
    root = Path(__file__).resolve().parents[1]

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else ""

    commit = git("rev-parse", "--short", "HEAD")
    if not commit:
        return f"jaxamp {jaxamp.__version__} (not a git checkout)"
    dirty = git("status", "--porcelain", "--", "jaxamp", "examples", ":!examples/results")
    return f"commit {commit}" + (" with uncommitted changes" if dirty else "")


def write_markdown(path: Path, title: str, command: str, table: str, notes: str = "") -> None:
    """Writes a results file: title, the command that produced it, machine, date, table."""
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    text = (
        f"# {title}\n\n"
        f"Command: `{command}`\n\n"
        f"Machine: {machine_description()}\n\n"
        f"Code: {code_version()}\n\n"
        f"Date: {stamp}\n\n{table}\n"
    )
    if notes:
        text += f"\n{notes}\n"
    path.write_text(text)


# One color per setup in every plot.
COLORS = {
    "float32": "C0",
    "mixed_bfloat16": "C1",
    "mixed_float16": "C2",
    "mixed_float16_no_scaling": "C3",
    "autocast_bfloat16": "C4",
    "mixed_float16_suggested_scale": "C5",
}


def use_agg_backend() -> Any:
    """matplotlib with the file-only Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def finish_figure(fig: Any, axes: Sequence[Any], title: str, path: Path) -> None:
    """Grids, one legend below the plots, a title; then save ``fig`` to ``path`` and close it.

    The legend lists each label once and sits outside the axes, where it cannot
    hide a curve.
    """
    entries: dict[str, Any] = {}
    for ax in axes:
        ax.grid(alpha=0.3)
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            entries.setdefault(label, handle)
    columns = min(len(entries), 3)
    rows = -(-len(entries) // columns) if entries else 0
    if entries:
        fig.legend(
            list(entries.values()), list(entries), loc="lower center", ncol=columns, fontsize=8
        )
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.045 * rows, 1, 1))
    fig.savefig(path, dpi=110)
    use_agg_backend().close(fig)


def constant_groups(
    histories: dict[str, dict[str, np.ndarray]], key: str
) -> dict[float, list[str]]:
    """Setups whose ``key`` series is one value throughout, grouped by that value."""
    groups: dict[float, list[str]] = {}
    for name, hist in histories.items():
        values = np.asarray(hist[key])
        if values.size and np.all(values == values[0]):
            groups.setdefault(float(values[0]), []).append(name)
    return groups


def plot_loss_scales(ax: Any, histories: dict[str, dict[str, np.ndarray]]) -> None:
    """Each setup's loss scale; setups with the same constant scale as one labelled line.

    Four setups at a scale of 1 would otherwise draw four lines on top of each
    other, showing only the last one's colour.
    """
    constant = constant_groups(histories, "loss_scale")
    merged = {name for names in constant.values() for name in names}
    for name, hist in histories.items():
        steps = np.arange(1, len(hist["loss_scale"]) + 1)
        if name not in merged:
            ax.plot(steps, hist["loss_scale"], label=name, color=COLORS.get(name))
    for value, names in constant.items():
        steps = np.arange(1, len(histories[names[0]]["loss_scale"]) + 1)
        style = {"color": COLORS.get(names[0]) if len(names) == 1 else "0.35", "linestyle": "--"}
        label = f"{', '.join(names)}: scale {value:g}" if len(names) > 1 else names[0]
        ax.plot(steps, np.full(len(steps), value), label=label, **style)


def smooth(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing moving average (shorter at the start) for readable loss curves."""
    values = np.asarray(values, np.float64)
    window = max(1, min(window, len(values)))
    cumsum = np.cumsum(np.insert(values, 0, 0.0))
    end = np.arange(1, len(values) + 1)
    start = np.maximum(0, end - window)
    return (cumsum[end] - cumsum[start]) / (end - start)
