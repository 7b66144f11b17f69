"""Mixed precision on real data: a Flax NNX CNN on scikit-learn's digits, five ways.

The 1,797 8x8 scans of handwritten digits that ship with scikit-learn (no
download) train the same small CNN, from the same initial weights on the same
batches, under five precision setups, each over several seeds (mean +- std):

* ``float32``: the reference;
* ``mixed_bfloat16``: float32 master weights, bfloat16 compute, no loss scaling
  (bfloat16 has float32's range);
* ``mixed_float16``: float16 compute with jaxamp's dynamic loss scaling;
* ``mixed_float16_no_scaling``: float16 compute with ``NoOpLossScale`` (jaxamp
  still skips non-finite steps, but never scales);
* ``autocast_bfloat16``: the float32 model with its loss wrapped in
  ``jaxamp.autocast(loss, "mixed_bfloat16")`` (convolutions and matmuls in
  bfloat16 with float32 accumulation; the model code untouched).

It prints one table row per setup (test accuracy, final loss, skipped steps,
final loss scale, compiled train-step memory, activation memory, step time) and
writes the table (``digits.md``) and a PNG of the loss curves and loss-scale
trajectories (``digits.png``) to ``--out`` (default ``./jaxamp-results/``;
``--refresh-committed`` for the committed ``examples/results/``). ``--fast`` is
the few-step mode the tests run. The defaults (3 seeds, 600 steps) take about
3 minutes on 2 CPU cores.
One seed's numbers are noise as much as signal: compare setups by the mean and
the spread over seeds.

How mixed precision enters a Flax NNX model (the three lines to copy):

1. ``policy = jaxamp.get_policy("mixed_bfloat16")`` and give every layer
   ``**policy.module_kwargs()`` (``dtype`` = compute, ``param_dtype`` = float32);
   cast the model's output to ``policy.output_dtype``.
2. ``nnx.Optimizer(model, jaxamp.loss_scaling(tx, loss_scale), wrt=nnx.Param)``.
3. In the step, differentiate ``scale.scale(loss)`` where
   ``scale = jaxamp.get_loss_scale(optimizer.opt_state)``, then
   ``optimizer.update(model, grads)`` unscales, checks and skips.

Run: ``python examples/digits.py`` (``--help`` for the flags).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx
from sklearn.datasets import load_digits

import jaxamp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # the examples folder is not a package: import by path

# setup name -> (policy preset of the layers, whether it uses dynamic loss scaling)
SETUPS: dict[str, tuple[str, bool]] = {
    "float32": ("float32", False),
    "mixed_bfloat16": ("mixed_bfloat16", False),
    "mixed_float16": ("mixed_float16", True),
    "mixed_float16_no_scaling": ("mixed_float16", False),
    "autocast_bfloat16": ("float32", False),
}
# Setups whose float32 model runs its loss under jaxamp.autocast(loss, policy).
AUTOCAST: dict[str, Any] = {"autocast_bfloat16": "mixed_bfloat16"}
DEFAULT_SETUPS = tuple(SETUPS)
# FP8 matmuls and convolutions, one per recipe (opt-in: --policies; docs/fp8.md).
for _scaling in ("tensorwise", "rowwise", "blockwise", "mxfp8"):
    SETUPS[f"autocast_fp8_{_scaling}"] = ("float32", False)
    AUTOCAST[f"autocast_fp8_{_scaling}"] = jaxamp.Float8Recipe(_scaling)
# torch's GradScaler grows the scale every 2000 finite steps; these runs are only
# 600 steps long, so the scale may grow every 200 to show the whole trajectory.
GROWTH_INTERVAL = 200
LEARNING_RATE = 3e-3  # Adam's


class CNN(nnx.Module):
    """Two 3x3 convolutions with average pooling, then two dense layers (8x8x1 -> 10).

    Every layer computes in ``policy.compute_dtype`` and keeps its parameters in
    ``policy.param_dtype``; the logits come out in ``policy.output_dtype``.
    """

    def __init__(self, policy: jaxamp.Policy, *, rngs: nnx.Rngs, width: int = 16):
        dtypes = policy.module_kwargs()
        self.conv1 = nnx.Conv(1, width, (3, 3), rngs=rngs, **dtypes)
        self.conv2 = nnx.Conv(width, 2 * width, (3, 3), rngs=rngs, **dtypes)
        self.dense1 = nnx.Linear(2 * 2 * 2 * width, 4 * width, rngs=rngs, **dtypes)
        self.dense2 = nnx.Linear(4 * width, 10, rngs=rngs, **dtypes)
        self.output_dtype = policy.output_dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        x = nnx.avg_pool(nnx.relu(self.conv1(x)), (2, 2), strides=(2, 2))  # 4x4
        x = nnx.avg_pool(nnx.relu(self.conv2(x)), (2, 2), strides=(2, 2))  # 2x2
        x = nnx.relu(self.dense1(x.reshape(x.shape[0], -1)))
        return self.dense2(x).astype(self.output_dtype)


def load_data() -> dict[str, np.ndarray]:
    """Digits as NHWC float32 images in [0, 1]; a fixed 80/20 split (same for every seed)."""
    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[..., None]
    labels = digits.target.astype(np.int32)
    order = np.random.default_rng(0).permutation(len(images))
    split = int(0.8 * len(images))
    train, test = order[:split], order[split:]
    return {
        "x_train": images[train],
        "y_train": labels[train],
        "x_test": images[test],
        "y_test": labels[test],
    }


def cross_entropy(model: CNN, x: jax.Array, y: jax.Array, weight: float = 1.0) -> jax.Array:
    """Mean cross-entropy of the float32 logits, times ``weight``."""
    logits = model(x)
    return weight * optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def make_loss_scale(dynamic: bool) -> Any:
    if dynamic:
        return jaxamp.DynamicLossScale(growth_interval=GROWTH_INTERVAL)
    return jaxamp.NoOpLossScale()


def train(
    setup: str,
    data: dict[str, np.ndarray],
    *,
    steps: int,
    batch_size: int,
    seed: int,
    learning_rate: float = LEARNING_RATE,
    loss_weight: float = 1.0,
    loss_scale: Any = None,
    show_progress: bool = True,
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Trains the CNN under ``setup``; returns the table row and the per-step history.

    Args:
      setup: a key of ``SETUPS``.
      data: from :func:`load_data`.
      steps, batch_size, seed: the run; the seed fixes the initial weights and the
        batches, so that every setup sees the same ones.
      learning_rate: Adam's learning rate.
      loss_weight: multiplies the loss (the underflow demo makes it tiny).
      loss_scale: overrides the setup's loss scale.
      show_progress: draw a tqdm progress bar.
    """
    if setup not in SETUPS:
        raise ValueError(f"unknown setup {setup!r}; valid: {', '.join(SETUPS)}.")
    preset, dynamic = SETUPS[setup]
    policy = jaxamp.get_policy(preset)
    if loss_scale is None:
        loss_scale = make_loss_scale(dynamic)
    model = CNN(policy, rngs=nnx.Rngs(seed))
    tx = jaxamp.loss_scaling(optax.adam(learning_rate), loss_scale)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    def loss_fn(model, x, y):
        return cross_entropy(model, x, y, loss_weight)

    if setup in AUTOCAST:
        loss_fn = _common.autocast_loss(loss_fn, AUTOCAST[setup])

    graphdef, state = nnx.split((model, optimizer))
    step = _common.make_train_step(graphdef, loss_fn, with_zero_fraction=True)
    x_train, y_train = data["x_train"], data["y_train"]
    sample = x_train[:batch_size], y_train[:batch_size]
    compiled = jax.jit(step).lower(state, *sample).compile()
    memory = _common.compiled_memory(compiled)
    residuals = _common.residual_bytes(loss_fn, model, *sample)

    history = []
    indices = _common.batches(len(x_train), batch_size, seed)
    timer = _common.Timer()
    with _common.progress(steps, f"{setup:<24}", show_progress) as bar:
        for i in range(steps):
            idx = next(indices)
            state, metrics = compiled(state, x_train[idx], y_train[idx])
            history.append(metrics)  # stays on the device: no sync per step
            bar.update()
            if i % 100 == 99:
                bar.set_postfix_str(f"loss {float(metrics['loss']) / loss_weight:.4f}")
    seconds = timer.stop(state)

    model, optimizer = nnx.merge(graphdef, state)
    test_logits = nnx.jit(lambda m, x: m(x))(model, data["x_test"])  # evaluated in float32
    test_loss = optax.softmax_cross_entropy_with_integer_labels(test_logits, data["y_test"])
    hist = _common.stack_history(history)
    hist["loss"] = hist["loss"] / loss_weight
    tail = max(1, min(50, steps // 10))
    summary = jaxamp.loss_scaling_metrics(optimizer.opt_state)
    row = {
        "setup": setup,
        "accuracy": float(np.mean(np.asarray(test_logits).argmax(-1) == data["y_test"])),
        "test_loss": float(test_loss.mean()),
        "final_loss": float(np.mean(hist["loss"][-tail:])),
        "skipped": int(summary["skipped_steps"]),
        "loss_scale": float(summary["loss_scale"]),
        "zero_fraction": float(np.mean(hist["zero_fraction"])),
        "residual_bytes": residuals,
        "step_ms": 1e3 * seconds / steps,
        **memory,
    }
    return row, hist


COLUMNS = [
    ("setup", "setup"),
    ("accuracy", "test acc (mean +- std)"),
    ("test_loss", "test loss"),
    ("final_loss", "train loss (last steps)"),
    ("skipped", "skipped"),
    ("loss_scale", "final scale"),
    ("temp", "step temp mem"),
    ("argument", "step arg mem"),
    ("residuals", "activations (residuals)"),
    ("step_ms", "ms/step"),
]


def display_rows(rows: list[dict[str, Any]]) -> list[dict[str, str]]:
    """Rows formatted for the printed and Markdown tables."""
    return [
        {
            "setup": r["setup"],
            "accuracy": _common.mean_std(r["seeds"]["accuracy"]),
            "test_loss": _common.mean_std(r["seeds"]["test_loss"]),
            "final_loss": _common.mean_std(r["seeds"]["final_loss"]),
            "skipped": str(r["skipped"]),
            "loss_scale": f"{r['loss_scale']:g}",
            "temp": _common.format_bytes(r["temp_bytes"]),
            "argument": _common.format_bytes(r["argument_bytes"]),
            "residuals": _common.format_bytes(r["residual_bytes"]),
            "step_ms": f"{r['step_ms']:.2f}",
        }
        for r in rows
    ]


def plot(histories: dict[str, dict[str, np.ndarray]], path: Path, title: str) -> None:
    """Loss curves (smoothed) and loss-scale trajectories, side by side."""
    plt = _common.use_agg_backend()
    fig, (ax_loss, ax_scale) = plt.subplots(1, 2, figsize=(11, 4))
    for name, hist in histories.items():
        steps = np.arange(1, len(hist["loss"]) + 1)
        style = {"label": name, "color": _common.COLORS.get(name)}
        ax_loss.plot(steps, _common.smooth(hist["loss"], 20), **style)
    _common.plot_loss_scales(ax_scale, histories)
    ax_loss.set(xlabel="step", ylabel="train loss (moving average of 20)", yscale="log")
    ax_loss.set_title("loss")
    ax_scale.set(xlabel="step", ylabel="loss scale used", yscale="log")
    ax_scale.set_yscale("log", base=2)
    ax_scale.set_title("loss scale (1 = no scaling)")
    _common.finish_figure(fig, (ax_loss, ax_scale), title, path)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=None, help="train steps (600; --fast: 60)")
    parser.add_argument("--batch-size", type=int, default=None, help="batch size (128; --fast: 32)")
    parser.add_argument(
        "--policies",
        default=",".join(DEFAULT_SETUPS),
        help=f"comma-separated setups, from: {', '.join(SETUPS)} (default: the first five)",
    )
    _common.add_output_arguments(parser, "digits.md/.png")
    parser.add_argument("--seed", type=int, default=0, help="first seed (weights, batches)")
    parser.add_argument("--seeds", type=int, default=None, help="seeds per setup (3; --fast: 1)")
    parser.add_argument(
        "--learning-rate", type=float, default=LEARNING_RATE, help="Adam's (%(default)g)"
    )
    parser.add_argument("--fast", action="store_true", help="a few steps (what the tests run)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    args.out = _common.output_dir(args)
    args.steps = args.steps if args.steps is not None else (60 if args.fast else 600)
    args.seeds = args.seeds if args.seeds is not None else (1 if args.fast else 3)
    args.batch_size = args.batch_size or (32 if args.fast else 128)
    args.setups = [s.strip() for s in args.policies.split(",") if s.strip()]
    unknown = [s for s in args.setups if s not in SETUPS]
    if unknown or not args.setups:
        valid = ", ".join(SETUPS)
        parser.error(f"--policies: unknown {unknown or args.policies!r}; valid: {valid}")
    if args.steps < 1 or args.batch_size < 1 or args.seeds < 1:
        parser.error("--steps, --batch-size and --seeds must be >= 1")
    return args


def seeds_text(args: argparse.Namespace) -> str:
    last = args.seed + args.seeds - 1
    return f"seed {args.seed}" if args.seeds == 1 else f"seeds {args.seed}..{last}"


def over_seeds(runs: list[tuple[dict[str, Any], dict[str, np.ndarray]]]) -> dict[str, Any]:
    """One setup's row: the first seed's, with means over seeds and every seed's values."""
    rows = [row for row, _ in runs]
    seeds = {key: [r[key] for r in rows] for key in ("accuracy", "test_loss", "final_loss")}
    means = {key: float(np.mean(values)) for key, values in seeds.items()}
    step_ms = float(np.median([r["step_ms"] for r in rows]))
    return {**rows[0], **means, "step_ms": step_ms, "seeds": seeds, "history": runs[0][1]}


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Runs the comparison; returns one dict per setup (with its ``history``)."""
    args = parse_args(argv)
    data = load_data()
    recommended, reason = jaxamp.policy_for_device(with_reason=True)
    print(f"jaxamp.policy_for_device(): {recommended}  ({reason})")
    print(
        f"digits: {len(data['x_train'])} train / {len(data['x_test'])} test images, "
        f"{args.steps} steps of batch {args.batch_size}, {seeds_text(args)}"
    )
    rows, histories = [], {}
    for setup in args.setups:
        runs = [
            train(
                setup,
                data,
                steps=args.steps,
                batch_size=args.batch_size,
                seed=seed,
                learning_rate=args.learning_rate,
                show_progress=not args.no_progress,
            )
            for seed in range(args.seed, args.seed + args.seeds)
        ]
        rows.append(over_seeds(runs))
        histories[setup] = rows[-1]["history"]
    table = _common.markdown_table(display_rows(rows), COLUMNS)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    given = sys.argv[1:] if argv is None else argv
    command = " ".join(["python examples/digits.py", *given])
    notes = (
        "Memory: `step temp mem`/`step arg mem` are XLA's `memory_analysis()` of the "
        "compiled train step (scratch buffers / inputs: float32 master weights, Adam state, "
        "batch); `activations (residuals)` is the size of what the backward pass keeps "
        "from the forward pass (the leaves of `jax.vjp`), independent of the platform. "
        "`ms/step` is wall time after compilation, including host-side batching. "
        f"Dynamic loss scaling: `DynamicLossScale(growth_interval={GROWTH_INTERVAL})`. "
        f"Accuracy and losses: mean +- sample std over {seeds_text(args)} (each seed sets "
        "the initial weights and the batches); the other columns and the plot: the first "
        "seed, `ms/step` the median over seeds. `autocast_bfloat16` evaluates the test set "
        "in float32 (only its training loss runs under autocast)."
    )
    _common.write_markdown(
        args.out / "digits.md",
        "digits: one CNN, five precision setups",
        command,
        table,
        notes,
    )
    plot(
        histories,
        args.out / "digits.png",
        f"digits CNN, {args.steps} steps, batch {args.batch_size}, seed {args.seed} (first)",
    )
    print(f"wrote {args.out / 'digits.md'} and {args.out / 'digits.png'}")
    return rows


if __name__ == "__main__":
    main()
