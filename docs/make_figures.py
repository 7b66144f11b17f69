"""Regenerates every figure of the documentation: ``python docs/make_figures.py``.

Writes to ``docs/figures/``:

- ``bit_layouts.png``: sign, exponent and mantissa bits of float32, float16 and bfloat16.
- ``range_precision.png``: dynamic range (smallest subnormal, smallest normal,
  largest finite) and precision (machine epsilon) of the three formats, read
  from ``jnp.finfo`` rather than typed in.
- ``fp16_underflow.png`` and ``fp16_underflow.json``: a real training run of a
  small MLP on scikit-learn's digits with ``jaxamp.loss_scaling``, probing every
  ``--probe-every`` steps which share of the non-zero float32 gradient entries
  become exactly zero when the backward pass runs in float16 without loss
  scaling, and with the run's dynamic loss scale.
- ``low_bit_fidelity.png``: the committed results of ``examples/fp8_fidelity.py``
  (``examples/results/fp8_fidelity.jsonl``) drawn by that example's ``plot``:
  each FP8 and FP4 setup's validation loss relative to bfloat16, per seed.
  ``--fidelity-only`` redraws just this one.

Deterministic on a given machine (fixed seeds); takes a few seconds on a CPU.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxamp

FIGURES = Path(__file__).resolve().parent / "figures"
FORMATS = (("float32", jnp.float32), ("float16", jnp.float16), ("bfloat16", jnp.bfloat16))
COLORS = {"sign": "#d62728", "exponent": "#2ca02c", "mantissa": "#1f77b4"}


def format_facts() -> dict[str, dict[str, float]]:
    """Bit counts and limits of the three formats, from ``jnp.finfo``."""
    facts = {}
    for name, dtype in FORMATS:
        info = jnp.finfo(dtype)
        facts[name] = {
            "bits": int(info.bits),
            "exponent_bits": int(info.nexp),
            "mantissa_bits": int(info.nmant),
            "max": float(info.max),
            "smallest_normal": float(info.smallest_normal),
            "smallest_subnormal": float(info.smallest_subnormal),
            "eps": float(info.eps),
        }
    return facts


def plot_bit_layouts(facts, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 2.6))
    for row, (name, f) in enumerate(facts.items()):
        y = len(facts) - 1 - row
        fields = (("sign", 1), ("exponent", f["exponent_bits"]), ("mantissa", f["mantissa_bits"]))
        x = 0
        for field, width in fields:
            for _ in range(width):
                ax.add_patch(
                    plt.Rectangle((x, y), 1, 0.8, facecolor=COLORS[field], edgecolor="white")
                )
                x += 1
            label = f"{width}" if field == "sign" else f"{field} {width}"
            ax.text(
                x - width / 2,
                y + 0.4,
                label,
                ha="center",
                va="center",
                color="white",
                fontsize=8 if width > 4 else 7,
                fontweight="bold",
            )
        ax.text(-0.6, y + 0.4, f"{name}\n({f['bits']} bits)", ha="right", va="center", fontsize=9)
    ax.set_xlim(-6, 32.5)
    ax.set_ylim(-0.2, len(facts))
    ax.axis("off")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()]
    ax.legend(
        handles,
        list(COLORS),
        loc="lower center",
        ncol=3,
        frameon=False,
        fontsize=8,
        bbox_to_anchor=(0.5, -0.12),
    )
    fig.suptitle(
        "Bit layouts: bfloat16 keeps float32's 8 exponent bits, float16 keeps more mantissa bits",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def plot_range_precision(facts, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.2), width_ratios=(2.2, 1))
    names = list(facts)
    for i, name in enumerate(names):
        f = facts[name]
        y = len(names) - 1 - i
        lo, mid, hi = (math.log10(f[k]) for k in ("smallest_subnormal", "smallest_normal", "max"))
        left.barh(y, mid - lo, left=lo, color="#9ecae1", height=0.5)
        left.barh(y, hi - mid, left=mid, color="#3182bd", height=0.5)
        # Subnormal limit below the bar, normal limits above it, so labels never collide.
        left.text(lo, y - 0.3, f"{f['smallest_subnormal']:.3g}", ha="center", va="top", fontsize=7)
        left.text(mid, y + 0.3, f"{f['smallest_normal']:.3g}", ha="center", va="bottom", fontsize=7)
        left.text(hi, y + 0.3, f"{f['max']:.3g}", ha="center", va="bottom", fontsize=7)
        right.barh(y, -math.log10(f["eps"]), color="#3182bd", height=0.5)
        right.text(
            -math.log10(f["eps"]) + 0.1,
            y,
            f"eps = 2^-{f['mantissa_bits']}\n= {f['eps']:.3g}",
            va="center",
            fontsize=7,
        )
    for ax in (left, right):
        ax.set_yticks(range(len(names)), names[::-1])
    left.set_xlabel("log10 of magnitude (light: subnormal, dark: normal range)")
    left.set_title("Dynamic range", fontsize=10)
    left.set_ylim(-0.7, len(names) - 0.2)
    right.set_xlabel("decimal digits of precision, -log10(eps)")
    right.set_title("Precision", fontsize=10)
    right.set_xlim(0, 9.5)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def _digits():
    from sklearn.datasets import load_digits

    digits = load_digits()
    return (digits.data / 16.0).astype(np.float32), digits.target.astype(np.int32)


def _init(key, sizes):
    keys = jax.random.split(key, len(sizes) - 1)
    params = {}
    for i, (k, fan_in, fan_out) in enumerate(zip(keys, sizes[:-1], sizes[1:], strict=True)):
        params[f"w{i}"] = jax.random.normal(k, (fan_in, fan_out)) / np.sqrt(fan_in)
        params[f"b{i}"] = jnp.zeros(fan_out)
    return params


def _forward(params, x, policy):
    params, x = policy.cast_to_compute((params, x))
    layers = len(params) // 2
    for i in range(layers):
        x = x @ params[f"w{i}"] + params[f"b{i}"]
        if i < layers - 1:
            x = jax.nn.relu(x)
    return policy.cast_to_output(x)


def _loss(params, x, y, policy):
    logits = _forward(params, x, policy)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def _underflow_share(reference, grads):
    """Share of the non-zero entries of ``reference`` that are exactly zero in ``grads``."""
    pairs = list(zip(jax.tree.leaves(reference), jax.tree.leaves(grads), strict=True))
    nonzero = sum(jnp.sum(r != 0) for r, _ in pairs)
    lost = sum(jnp.sum((r != 0) & (g == 0)) for r, g in pairs)
    return lost / nonzero


def underflow_run(steps=1000, probe_every=25, batch=128, hidden=128, seed=0):
    """Trains a 3-layer MLP on digits with mixed_float16 and probes gradient underflow.

    Training itself uses ``jaxamp.loss_scaling`` with the default
    ``DynamicLossScale``. At each probe the same batch is differentiated three
    ways: in float32 (the reference), in float16 with no loss scaling, and in
    float16 with the run's current loss scale (then unscaled).

    Returns:
      A dict of lists: ``step``, ``loss``, ``loss_scale``, ``share_unscaled``,
      ``share_scaled``, plus ``final_log2_abs_grad`` (the float32 reference
      gradient magnitudes at the last probe) and the run's settings.
    """
    x_all, y_all = _digits()
    mixed = jaxamp.get_policy("mixed_float16")
    full = jaxamp.get_policy("float32")
    params = _init(jax.random.key(seed), (64, hidden, hidden, 10))
    tx = jaxamp.loss_scaling(optax.sgd(0.1, momentum=0.9), jaxamp.DynamicLossScale())
    opt_state = tx.init(params)

    @jax.jit
    def train_step(params, opt_state, x, y):
        scale = jaxamp.get_loss_scale(opt_state)
        loss, grads = jax.value_and_grad(lambda p: scale.scale(_loss(p, x, y, mixed)))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, scale.unscale(loss)

    @jax.jit
    def probe(params, opt_state, x, y):
        reference = jax.grad(_loss)(params, x, y, full)
        unscaled = jax.grad(_loss)(params, x, y, mixed)
        scale = jaxamp.get_loss_scale(opt_state)
        scaled = scale.unscale(jax.grad(lambda p: scale.scale(_loss(p, x, y, mixed)))(params))
        magnitudes = jnp.concatenate([jnp.abs(g).ravel() for g in jax.tree.leaves(reference)])
        return (
            _underflow_share(reference, unscaled),
            _underflow_share(reference, scaled),
            scale.loss_scale,
            magnitudes,
        )

    rng = np.random.default_rng(seed)
    record = {key: [] for key in ("step", "loss", "loss_scale", "share_unscaled", "share_scaled")}
    magnitudes = None
    loss = None  # no step taken yet at the first probe (JSON null)
    for step in range(steps + 1):
        idx = rng.integers(0, len(x_all), batch)
        x, y = x_all[idx], y_all[idx]
        if step % probe_every == 0 or step == steps:
            share_unscaled, share_scaled, loss_scale, magnitudes = probe(params, opt_state, x, y)
            record["step"].append(step)
            record["loss"].append(None if loss is None else float(loss))
            record["loss_scale"].append(float(loss_scale))
            record["share_unscaled"].append(float(share_unscaled))
            record["share_scaled"].append(float(share_scaled))
        if step < steps:
            params, opt_state, loss = train_step(params, opt_state, x, y)
    nonzero = np.asarray(magnitudes)[np.asarray(magnitudes) > 0]
    record["final_log2_abs_grad"] = np.log2(nonzero).round(3).tolist()
    record["skipped_steps"] = int(jaxamp.loss_scaling_metrics(opt_state)["skipped_steps"])
    record["settings"] = {
        "model": f"MLP 64-{hidden}-{hidden}-10, ReLU",
        "data": "scikit-learn digits (1797 images, 8x8)",
        "optimizer": "jaxamp.loss_scaling(optax.sgd(0.1, momentum=0.9), DynamicLossScale())",
        "policy": "mixed_float16",
        "steps": steps,
        "batch": batch,
        "seed": seed,
        "backend": jax.default_backend(),
        "jax": jax.__version__,
    }
    return record


def summarize(record) -> dict[str, float]:
    """The numbers the primer quotes (as fractions), so the text can be checked against them."""
    half = len(record["step"]) // 2
    log2 = np.asarray(record["final_log2_abs_grad"])
    f16 = jnp.finfo(jnp.float16)
    return {
        "peak_share_unscaled": max(record["share_unscaled"]),
        "mean_share_unscaled_second_half": float(np.mean(record["share_unscaled"][half:])),
        "mean_share_scaled_second_half": float(np.mean(record["share_scaled"][half:])),
        "final_share_below_f16_normal": float(
            np.mean(log2 < math.log2(float(f16.smallest_normal)))
        ),
        "final_share_below_f16_subnormal": float(
            np.mean(log2 < math.log2(float(f16.smallest_subnormal)))
        ),
    }


def plot_underflow(record, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    steps = record["step"]
    left.plot(steps, [100 * s for s in record["share_unscaled"]], label="float16, no loss scaling")
    left.plot(
        steps,
        [100 * s for s in record["share_scaled"]],
        label=f"float16, loss scale {record['loss_scale'][-1]:.0f}",
    )
    left.set_xlabel("training step")
    left.set_ylabel("% of non-zero f32 gradient entries\nthat are exactly 0 in float16")
    left.set_title("Gradient underflow in a real run (digits MLP)", fontsize=10)
    # Below the axes: inside them the legend would hide part of a curve.
    left.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2)
    left.grid(alpha=0.3)

    # Entries below 2^-50 are few; clip them into the first bin to keep the axis readable.
    log2 = np.clip(np.asarray(record["final_log2_abs_grad"]), -50, None)
    scale_log2 = math.log2(record["loss_scale"][-1])
    bins = np.arange(-51, max(18, math.ceil(log2.max() + scale_log2) + 2))
    right.hist(log2, bins=bins, alpha=0.7, label="float32 gradients")
    right.hist(log2 + scale_log2, bins=bins, alpha=0.5, label=f"x loss scale 2^{scale_log2:.0f}")
    f16 = jnp.finfo(jnp.float16)
    # The labels sit in headroom above the tallest bar, each at its own height,
    # so that none covers a bar or another label.
    peak = right.get_ylim()[1]
    right.set_ylim(top=peak * 1.55)
    for value, text, height, align in (
        (f16.smallest_subnormal, "f16 smallest subnormal 2^-24 ", 1.42, "right"),
        (f16.smallest_normal, "f16 smallest normal 2^-14 ", 1.24, "right"),
        (f16.max, "f16 max 65504 ", 1.42, "right"),
    ):
        right.axvline(math.log2(float(value)), color="k", linestyle="--", linewidth=0.8)
        right.text(math.log2(float(value)), peak * height, text, ha=align, va="center", fontsize=7)
    right.set_xlabel("log2 |gradient entry| at the last probe (below -50 shown at -50)")
    right.set_ylabel("entries")
    right.set_title("Loss scaling shifts gradients into float16's range", fontsize=10)
    right.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def plot_fidelity(path: Path) -> None:
    """``examples/fp8_fidelity.py``'s figure of its committed results."""
    examples = Path(__file__).resolve().parents[1] / "examples"
    sys.path.insert(0, str(examples))
    fp8_fidelity = importlib.import_module("fp8_fidelity")  # examples/ is not a package

    log = examples / "results" / "fp8_fidelity.jsonl"
    records = [json.loads(line) for line in log.read_text().splitlines() if line]
    fp8_fidelity.plot(records, ["charlm", "moe"], path)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--probe-every", type=int, default=25)
    parser.add_argument("--out", type=Path, default=FIGURES)
    parser.add_argument("--fidelity-only", action="store_true")
    args = parser.parse_args(argv)

    import matplotlib

    matplotlib.use("Agg")
    args.out.mkdir(parents=True, exist_ok=True)
    plot_fidelity(args.out / "low_bit_fidelity.png")
    if args.fidelity_only:
        return
    facts = format_facts()
    plot_bit_layouts(facts, args.out / "bit_layouts.png")
    plot_range_precision(facts, args.out / "range_precision.png")
    record = underflow_run(steps=args.steps, probe_every=args.probe_every)
    plot_underflow(record, args.out / "fp16_underflow.png")
    summary = {k: v for k, v in record.items() if k != "final_log2_abs_grad"}
    summary["summary"] = summarize(record)
    (args.out / "fp16_underflow.json").write_text(json.dumps(summary, indent=1) + "\n")
    peak = max(record["share_unscaled"])
    print(
        f"wrote figures to {args.out}; peak unscaled underflow {100 * peak:.2f}%, "
        f"final {100 * record['share_unscaled'][-1]:.2f}% unscaled vs "
        f"{100 * record['share_scaled'][-1]:.2f}% scaled"
    )


if __name__ == "__main__":
    main()
