"""16-bit params and Adam state on the charlm transformer: rounding decides.

The model, text and batches of ``examples/charlm.py``, trained four ways, each
over several seeds (mean +- std of the final validation bits per character):

* ``float32_master``: float32 params and AdamW moments, bfloat16 compute (the
  ``mixed_bfloat16`` layer dtypes): 12 bytes of params and state per parameter;
* ``bf16_nearest``: bfloat16 params and bfloat16 AdamW moments, each step
  rounded to nearest (what optax, Flax and jmp do): 6 bytes;
* ``bf16_stochastic``: the same, rounded stochastically by
  ``jaxamp.low_precision_optimizer(..., rounding="stochastic")``: 6 bytes;
* ``bf16_kahan``: params rounded to nearest with a bfloat16 Kahan compensation
  buffer (moments rounded stochastically): 8 bytes.

Every bfloat16 setup runs its optimizer in float32 inside
``jaxamp.low_precision_optimizer(inner, rounding=..., state_dtype=jnp.bfloat16)``
(``rounding="nearest"`` for the first). Writes ``charlm_low_precision.md`` and
``.png`` to ``--out``.

Run: ``python examples/charlm_low_precision.py`` (``--fast`` is the test mode).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxamp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # the examples folder is not a package: import by path
import charlm

MODES = ("float32_master", "bf16_nearest", "bf16_stochastic", "bf16_kahan")
COLORS = {"float32_master": "C0", "bf16_nearest": "C3", "bf16_stochastic": "C2", "bf16_kahan": "C1"}
# bfloat16 params, bfloat16 compute and float32 logits for the loss.
BF16_PARAMS = "params=bfloat16,compute=bfloat16,output=float32"


def build(mode: str, dims: dict[str, int], args: argparse.Namespace, seed: int) -> Any:
    """The model and the optimizer of a mode."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; valid: {', '.join(MODES)}.")
    master = mode == "float32_master"
    policy = jaxamp.get_policy("mixed_bfloat16" if master else BF16_PARAMS)
    model = charlm.CharTransformer(policy, rngs=nnx.Rngs(seed), **dims)
    inner = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(args.learning_rate, b2=0.99, weight_decay=0.01),
    )
    if not master:
        inner = jaxamp.low_precision_optimizer(
            inner, rounding=mode.removeprefix("bf16_"), state_dtype=jnp.bfloat16, seed=seed
        )
    # bfloat16 has float32's range: no loss scaling, but non-finite steps are skipped.
    tx = jaxamp.loss_scaling(inner, jaxamp.NoOpLossScale())
    return model, nnx.Optimizer(model, tx, wrt=nnx.Param)


def state_bytes_per_param(model: nnx.Module, optimizer: nnx.Optimizer) -> float:
    """Bytes of params plus optimizer state per parameter, from the arrays."""
    params = nnx.state(model, nnx.Param)
    count = sum(x.size for x in jax.tree.leaves(params))
    arrays = jax.tree.leaves((params, nnx.state(optimizer)))
    return sum(x.size * x.dtype.itemsize for x in arrays if hasattr(x, "dtype")) / count


def train(mode: str, seed: int, data: tuple[np.ndarray, ...], args: argparse.Namespace) -> dict:
    """Trains one mode from one seed; returns its final numbers and curves."""
    train_ids, valid_ids = data
    dims = charlm.sizes(args)
    model, optimizer = build(mode, dims, args, seed)
    graphdef, state = nnx.split((model, optimizer))
    step = jax.jit(_common.make_train_step(graphdef, charlm.next_char_loss), donate_argnums=0)
    length = dims["context"] + 1
    valid_starts = np.linspace(0, len(valid_ids) - length - 1, args.eval_windows).astype(np.int64)
    valid_batch = charlm.windows(valid_ids, valid_starts, length)

    @jax.jit
    def valid_loss(state):
        model, _ = nnx.merge(graphdef, state)
        return charlm.next_char_loss(model, valid_batch)

    rng = np.random.default_rng(seed)
    evals, losses = [], []
    with _common.progress(args.steps, f"{mode} seed {seed}", not args.no_progress) as bar:
        for i in range(args.steps):
            starts = rng.integers(0, len(train_ids) - length, args.batch_size)
            state, metrics = step(state, charlm.windows(train_ids, starts, length))
            losses.append(metrics["loss"])
            bar.update()
            if (i + 1) % args.eval_every == 0 or i + 1 == args.steps:
                evals.append((i + 1, float(valid_loss(state)) / math.log(2)))
    model, optimizer = nnx.merge(graphdef, state)
    print(f"{mode} seed {seed}: {evals[-1][1]:.4f} bits/char", flush=True)
    return {
        "mode": mode,
        "seed": seed,
        "valid_bits": evals[-1][1],
        "bytes_per_param": state_bytes_per_param(model, optimizer),
        "valid_steps": np.asarray([s for s, _ in evals]),
        "valid_curve": np.asarray([b for _, b in evals]),
        "train_bits": np.asarray(jax.device_get(losses)) / math.log(2),
    }


def summarize(runs: list[dict]) -> list[dict[str, str]]:
    """One table row per mode: mean +- std over seeds, and the gap to float32_master."""
    by_mode: dict[str, list[dict]] = {}
    for run in runs:
        by_mode.setdefault(run["mode"], []).append(run)
    reference = by_mode.get("float32_master")
    ref_mean = np.mean([r["valid_bits"] for r in reference]) if reference else None
    rows = []
    for mode, group in by_mode.items():
        bits = np.asarray([r["valid_bits"] for r in group])
        gap = "" if ref_mean is None else f"{100 * (bits.mean() / ref_mean - 1):+.2f}%"
        rows.append(
            {
                "mode": mode,
                "valid_bits": _common.mean_std(bits),
                "gap": gap,
                "seeds": ", ".join(f"{b:.4f}" for b in bits),
                "bytes": f"{group[0]['bytes_per_param']:.2f}",
            }
        )
    return rows


COLUMNS = [
    ("mode", "mode"),
    ("valid_bits", "valid bits/char (mean +- std)"),
    ("gap", "vs float32_master"),
    ("seeds", "per seed"),
    ("bytes", "params + opt state bytes/param"),
]


def plot(runs: list[dict], path: Path, title: str) -> None:
    """Validation bits per character: the mean over seeds, and each seed faintly."""
    plt = _common.use_agg_backend()
    fig, (ax_train, ax_valid) = plt.subplots(1, 2, figsize=(11, 4))
    for mode in MODES:
        group = [r for r in runs if r["mode"] == mode]
        if not group:
            continue
        color = COLORS[mode]
        train = np.mean([_common.smooth(r["train_bits"], 20) for r in group], axis=0)
        ax_train.plot(np.arange(1, len(train) + 1), train, color=color, label=mode)
        for r in group:
            ax_valid.plot(r["valid_steps"], r["valid_curve"], color=color, alpha=0.25, lw=0.8)
        mean = np.mean([r["valid_curve"] for r in group], axis=0)
        ax_valid.plot(group[0]["valid_steps"], mean, color=color, marker="o", ms=3, label=mode)
    ax_train.set(xlabel="step", ylabel="train bits/char (moving average of 20, mean of seeds)")
    ax_valid.set(xlabel="step", ylabel="validation bits/char (mean; seeds faint)")
    _common.finish_figure(fig, (ax_train, ax_valid), title, path)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=None, help="train steps (500; --fast: 6)")
    parser.add_argument("--batch-size", type=int, default=None, help="sequences (16; --fast: 4)")
    parser.add_argument("--context", type=int, default=None, help="characters (64; --fast: 16)")
    parser.add_argument("--width", type=int, default=None, help="model width (64; --fast: 32)")
    parser.add_argument("--layers", type=int, default=None, help="blocks (2; --fast: 1)")
    parser.add_argument("--head-dim", type=int, default=32, help="width per attention head")
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--eval-every", type=int, default=None, help="steps (25; --fast: 3)")
    parser.add_argument("--eval-windows", type=int, default=64, help="validation sequences")
    parser.add_argument("--seeds", type=int, default=None, help="seeds per mode (3; --fast: 1)")
    parser.add_argument("--modes", default=",".join(MODES), help=f"from: {', '.join(MODES)}")
    _common.add_output_arguments(parser, "charlm_low_precision.md/.png")
    parser.add_argument("--fast", action="store_true", help="a tiny model, a few steps (tests)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    args.out = _common.output_dir(args)
    fast = {"steps": 6, "batch_size": 4, "context": 16, "width": 32, "layers": 1}
    full = {"steps": 500, "batch_size": 16, "context": 64, "width": 64, "layers": 2}
    fast.update(eval_every=3, seeds=1)
    full.update(eval_every=25, seeds=3)
    for key, value in (fast if args.fast else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.mode_list = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in args.mode_list if m not in MODES]
    if unknown or not args.mode_list:
        parser.error(f"--modes: unknown {unknown or args.modes!r}; valid: {', '.join(MODES)}")
    return args


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Runs every mode over every seed; returns one dict per run."""
    args = parse_args(argv)
    data = charlm.split_blocks(charlm.encode(charlm.load_text()))
    dims = charlm.sizes(args)
    runs = [train(mode, seed, data, args) for seed in range(args.seeds) for mode in args.mode_list]
    table = _common.markdown_table(summarize(runs), COLUMNS)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    given = sys.argv[1:] if argv is None else argv
    notes = (
        f"Model: {dims['layers']} blocks, width {dims['width']}, {dims['heads']} heads, MLP "
        f"{dims['mlp']}, context {dims['context']}; {args.steps} steps of {args.batch_size} "
        f"sequences; AdamW (lr {args.learning_rate}, b2 0.99, weight decay 0.01) with "
        "global-norm clipping, inside `jaxamp.loss_scaling(..., NoOpLossScale())`. "
        f"Seeds 0..{args.seeds - 1} set the initial weights, the batches and the rounding "
        "stream. Validation: "
        f"{args.eval_windows} fixed windows of every tenth 4 kB block of the text. "
        "Bytes per parameter count every array of the params and the optimizer state "
        "(step counters and keys included)."
    )
    _common.write_markdown(
        args.out / "charlm_low_precision.md",
        "charlm with bfloat16 params and AdamW state: round-to-nearest, stochastic, Kahan",
        " ".join(["python examples/charlm_low_precision.py", *given]),
        table,
        notes,
    )
    title = f"charlm, bfloat16 params and AdamW state, {args.steps} steps, {args.seeds} seeds"
    plot(runs, args.out / "charlm_low_precision.png", title)
    print(f"wrote {args.out / 'charlm_low_precision.md'} and .png")
    return runs


if __name__ == "__main__":
    main()
