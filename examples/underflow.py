"""float16 gradients underflow to zero without loss scaling; dynamic loss scaling recovers.

The digits CNN of ``digits.py`` is trained with its loss multiplied by a small
weight (default ``2**-20``, about 1e-6). Such weights are common: a loss summed
over a micro-batch and divided by the token count of a large global batch, or an
auxiliary loss with a small coefficient. Adam is invariant to the scale of the
gradients, so in float32 the weight changes nothing. In float16 the gradients of
the logits, about ``1e-6 * 0.5 / batch``, are below float16's smallest subnormal
(6e-8) and round to zero: every weight gradient is zero and training stalls.
Multiplying the loss by a scale of 2**15 or more before the backward pass (and
dividing the gradients by it after, in float32) brings them back into float16's
range; ``DynamicLossScale`` finds such a scale by itself. bfloat16 has float32's
exponent range and does not underflow.

Before training, ``jaxamp.numerics_report`` measures one float16 gradient step of
the untrained CNN with no loss scale: per layer (source line), the share of
gradient values that float16 flushes to zero while float32 keeps them, and the
loss scale it suggests (the largest power of two with no overflow in the scaled
backward pass, divided by 8). The setup ``mixed_float16_suggested_scale`` trains
with that scale as a ``StaticLossScale``.

The script prints, for each setup, the fraction of gradient entries that are
exactly zero (of the gradients the backward pass produced, i.e. of the scaled
loss where there is a scale), test accuracy and final loss, and writes
``underflow.md`` and ``underflow.png`` to ``--out``.

Run: ``python examples/underflow.py`` (``--fast`` is the few-step test mode).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np
from flax import nnx

import jaxamp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # the examples folder is not a package: import by path
import digits

SETUPS = [
    "float32",
    "mixed_bfloat16",
    "mixed_float16_no_scaling",
    "mixed_float16",
    "mixed_float16_suggested_scale",
]
SUGGESTED = "mixed_float16_suggested_scale"
DEFAULT_LOSS_WEIGHT = 2.0**-20

COLUMNS = [
    ("setup", "setup"),
    ("zero_first", "zero grads, step 1"),
    ("zero_mean", "zero grads, mean"),
    ("accuracy", "test acc"),
    ("test_loss", "test loss"),
    ("skipped", "skipped"),
    ("loss_scale", "final scale"),
]


def weight_text(weight: float) -> str:
    """``2**-20`` for powers of two, else ``%g``."""
    exponent = np.log2(weight)
    return f"2**{int(exponent)}" if exponent == int(exponent) else f"{weight:g}"


def display_rows(rows: list[dict[str, Any]]) -> list[dict[str, str]]:
    return [
        {
            "setup": r["setup"],
            "zero_first": f"{100 * r['history']['zero_fraction'][0]:.1f}%",
            "zero_mean": f"{100 * r['zero_fraction']:.1f}%",
            "accuracy": f"{r['accuracy']:.4f}",
            "test_loss": f"{r['test_loss']:.4f}",
            "skipped": str(r["skipped"]),
            "loss_scale": f"{r['loss_scale']:g}",
        }
        for r in rows
    ]


def measure_underflow(data: dict, batch_size: int, seed: int, weight: float) -> dict[str, Any]:
    """numerics_report of one float16 gradient step of the untrained CNN, loss scale 1.

    Returns the report, its suggested loss scale and one row per layer: the
    float16 cotangents (gradient values) attributed to that source line and the
    share of them flushed to zero where float32 arithmetic keeps them normal.
    """
    model = digits.CNN(jaxamp.get_policy("mixed_float16"), rngs=nnx.Rngs(seed))
    graphdef, params = nnx.split(model)

    def loss(params, x, y):
        return digits.cross_entropy(nnx.merge(graphdef, params), x, y, weight)

    x, y = data["x_train"][:batch_size], data["y_train"][:batch_size]
    report = jaxamp.numerics_report(loss, params, x, y, grad=True)
    layers: dict[str, list[float]] = {}
    for op in report.ops:
        if op.scaled and np.dtype(op.dtype).itemsize == 2:  # float16 cotangents
            size = float(np.prod(op.shape)) * op.executions
            flushed, total = layers.setdefault(op.source, [0.0, 0.0])
            layers[op.source] = [flushed + op.lost_fraction * size, total + size]
    rows = [
        {
            "layer": f"`{_code_at(source)}`",
            "line": source.rsplit(":", 1)[1],
            "flushed": f"{100 * flushed / total:.1f}%",
        }
        for source, (flushed, total) in layers.items()
    ]
    return {"report": report, "scale": report.suggested_loss_scale, "rows": rows, "layers": layers}


def _code_at(source: str) -> str:
    path, _, line = source.rpartition(":")
    return Path(path).read_text().splitlines()[int(line) - 1].strip()


LAYER_COLUMNS = [
    ("layer", "source line (digits.py)"),
    ("line", "line"),
    ("flushed", "float16 gradient values flushed to 0"),
]


def plot(histories: dict[str, dict[str, np.ndarray]], path: Path, title: str) -> None:
    """Loss, zero-gradient fraction and loss scale over the steps."""
    plt = _common.use_agg_backend()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for name, hist in histories.items():
        steps = np.arange(1, len(hist["loss"]) + 1)
        style = {"label": name, "color": _common.COLORS.get(name)}
        axes[0].plot(steps, _common.smooth(hist["loss"], 20), **style)
        axes[1].plot(steps, 100 * hist["zero_fraction"], **style)
    _common.plot_loss_scales(axes[2], histories)
    axes[0].set(xlabel="step", ylabel="train loss / weight (moving average of 20)")
    axes[0].set_title("loss")
    axes[1].set(xlabel="step", ylabel="% of gradient entries exactly 0", ylim=(-2, 102))
    axes[1].set_title("underflow")
    axes[2].set(xlabel="step", ylabel="loss scale used")
    axes[2].set_yscale("log", base=2)
    axes[2].set_title("loss scale (1 = no scaling)")
    _common.finish_figure(fig, axes, title, path)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=None, help="train steps (500; --fast: 40)")
    parser.add_argument("--batch-size", type=int, default=None, help="batch size (128; --fast: 32)")
    parser.add_argument(
        "--policies", default=",".join(SETUPS), help=f"comma-separated, from: {', '.join(SETUPS)}"
    )
    parser.add_argument(
        "--loss-weight", type=float, default=DEFAULT_LOSS_WEIGHT, help="multiplies the loss"
    )
    parser.add_argument(
        "--learning-rate", type=float, default=digits.LEARNING_RATE, help="Adam's (%(default)g)"
    )
    _common.add_output_arguments(parser, "underflow.md/.png")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fast", action="store_true", help="a few steps (what the tests run)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    args.out = _common.output_dir(args)
    args.steps = args.steps if args.steps is not None else (40 if args.fast else 500)
    args.batch_size = args.batch_size or (32 if args.fast else 128)
    args.setups = [s.strip() for s in args.policies.split(",") if s.strip()]
    unknown = [s for s in args.setups if s not in SETUPS]
    if unknown or not args.setups:
        valid = ", ".join(SETUPS)
        parser.error(f"--policies: unknown {unknown or args.policies!r}; valid: {valid}")
    if not args.loss_weight > 0:
        parser.error(f"--loss-weight must be > 0; got {args.loss_weight}")
    return args


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Runs the demo; returns one dict per setup (with its ``history``)."""
    args = parse_args(argv)
    data = digits.load_data()
    weight = weight_text(args.loss_weight)
    print(
        f"underflow: digits CNN, loss x {weight}, Adam, {args.steps} steps of "
        f"batch {args.batch_size}"
    )
    measured = measure_underflow(data, args.batch_size, args.seed, args.loss_weight)
    layer_table = _common.markdown_table(measured["rows"], LAYER_COLUMNS)
    print(layer_table)
    print(f"suggested loss scale: {measured['scale']:g}")
    rows, histories = [], {}
    for setup in args.setups:
        suggested = setup == SUGGESTED
        row, hist = digits.train(
            "mixed_float16" if suggested else setup,
            data,
            loss_scale=jaxamp.StaticLossScale(measured["scale"]) if suggested else None,
            steps=args.steps,
            batch_size=args.batch_size,
            seed=args.seed,
            learning_rate=args.learning_rate,
            loss_weight=args.loss_weight,
            show_progress=not args.no_progress,
        )
        row["setup"] = setup
        rows.append({**row, "history": hist, "measured": measured})
        histories[setup] = hist
    table = _common.markdown_table(display_rows(rows), COLUMNS)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    given = sys.argv[1:] if argv is None else argv
    notes = (
        "`zero grads`: share of all gradient entries (every parameter) that are exactly "
        "0.0, as the backward pass produced them (gradients of the scaled loss where a "
        "loss scale is used), at the first step and averaged over all steps. float32 "
        "has a few zeros of its own (ReLUs that are off for a whole batch). "
        f"Dynamic loss scaling: `DynamicLossScale(growth_interval={digits.GROWTH_INTERVAL})`."
        f"\n\n## numerics_report: float16 gradients of the untrained CNN, loss scale 1\n\n"
        f"`jaxamp.numerics_report(loss, params, x, y, grad=True)` on one batch, per source "
        f"line of the model: the share of float16 gradient values (cotangents) that are "
        f"zero or subnormal where float32 arithmetic keeps them normal.\n\n{layer_table}\n\n"
        f"Suggested loss scale: {measured['scale']:g} (2**{np.log2(measured['scale']):g}), "
        f"used as `StaticLossScale` by `{SUGGESTED}`."
    )
    _common.write_markdown(
        args.out / "underflow.md",
        f"underflow: float16 without and with loss scaling (loss x {weight})",
        " ".join(["python examples/underflow.py", *given]),
        table,
        notes,
    )
    plot(
        histories,
        args.out / "underflow.png",
        f"digits CNN with loss x {weight}: {args.steps} steps, batch {args.batch_size}",
    )
    print(f"wrote {args.out / 'underflow.md'} and {args.out / 'underflow.png'}")
    return rows


if __name__ == "__main__":
    main()
