"""Low-bit fidelity: charlm, its mixture-of-experts twin and digits under each FP8 and FP4 recipe.

Every setup trains the same float32 model from the same initial weights on the
same batches (per seed); ``autocast_bfloat16`` runs the loss under
``jaxamp.autocast(loss, "mixed_bfloat16")``, ``autocast_fp8_<scaling>``
under ``jaxamp.autocast(loss, jaxamp.Float8Recipe(<scaling>))`` and the
``autocast_nvfp4*`` / ``autocast_mxfp4*`` setups under a ``jaxamp.Float4Recipe``
(``charlm.FP4_SETUPS``: each switch turned off in turn, and ``high_precision``
rules), so the low-bit rows differ from the bfloat16 one only in their matmuls
and convolutions. ``moe`` is charlm with every block's MLP replaced by top-2 of
4 experts through ``jax.lax.ragged_dot`` (``charlm.py --experts 4``). The FP4
setups run on the two language models (digits is a convolutional network: FP4
leaves convolutions in bfloat16). On a CPU the FP8 and FP4 products are
emulated: step times here say nothing about GPU speed.

Each finished run is appended to ``--out``/fp8_fidelity.jsonl (so an
interrupted run keeps what it has), and the table over seeds is written to
``fp8_fidelity.md``.

Run: ``python examples/fp8_fidelity.py`` (``--fast``: one tiny run per setup).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # the examples folder is not a package: import by path
import charlm
import digits

SETUPS = ("float32", "autocast_bfloat16", *charlm.FP8_SETUPS, *charlm.FP4_SETUPS)
BASELINE = "autocast_bfloat16"


def charlm_run(setup: str, seed: int, args: argparse.Namespace, experts: int = 0) -> dict[str, Any]:
    argv = [
        *("--experts", str(experts)),
        *("--steps", str(args.charlm_steps), "--width", str(args.charlm_width)),
        *("--batch-size", str(args.charlm_batch), "--context", str(args.charlm_context)),
        *("--layers", str(args.charlm_layers), "--eval-every", str(args.charlm_steps)),
        *("--seed", str(seed), "--sample-chars", "8", "--no-progress"),
    ]
    run_args = charlm.parse_args(argv)
    train_ids, valid_ids = charlm.split_blocks(charlm.encode(charlm.load_text()))
    row, _, _ = charlm.train(setup, train_ids, valid_ids, run_args, charlm.sizes(run_args))
    return {
        "metric": row["valid_bits"],
        "fp8_share": row["fp8_share"],
        "fp4_share": row["fp4_share"],
        "step_ms": row["step_ms"],
    }


def moe_run(setup: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    moe_args = argparse.Namespace(**{**vars(args), "charlm_batch": args.moe_batch})
    return charlm_run(setup, seed, moe_args, experts=args.experts)


def digits_run(setup: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    row, _ = digits.train(
        setup,
        digits.load_data(),
        steps=args.digits_steps,
        batch_size=args.digits_batch,
        seed=seed,
        show_progress=False,
    )
    return {"metric": row["test_loss"], "accuracy": row["accuracy"], "step_ms": row["step_ms"]}


RUNS = {"charlm": charlm_run, "moe": moe_run, "digits": digits_run}
METRICS = {
    "charlm": "validation bits/char",
    "moe": "validation bits/char",
    "digits": "test cross-entropy (nats)",
}
# digits is convolutional: FP4 recipes run convolutions in bfloat16 (docs/fp4.md).
SKIPPED = {"digits": set(charlm.FP4_SETUPS)}


def summarise(records: list[dict[str, Any]], example: str) -> str:
    by_setup: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        if r["example"] == example:
            by_setup.setdefault(r["setup"], []).append(r)
    if BASELINE not in by_setup:
        return ""
    base = np.mean([r["metric"] for r in by_setup[BASELINE]])
    rows = []
    for setup in SETUPS:
        if setup not in by_setup:
            continue
        values = np.array([r["metric"] for r in by_setup[setup]])
        row = {
            "setup": setup,
            "seeds": str(len(values)),
            "metric": f"{values.mean():.4f} ± {values.std():.4f}",
            "vs": f"{100 * (values.mean() / base - 1):+.2f}%",
            "per_seed": ", ".join(f"{v:.4f}" for v in values),
        }
        if example == "digits":
            acc = [r["accuracy"] for r in by_setup[setup]]
            row["extra"] = f"{100 * np.mean(acc):.1f}%"
        else:
            first = by_setup[setup][0]
            low = first.get("fp8_share", 0.0) + first.get("fp4_share", 0.0)
            row["extra"] = f"{100 * low:.0f}%"
        rows.append(row)
    columns = [
        ("setup", "setup"),
        ("seeds", "seeds"),
        ("metric", f"{METRICS[example]}, mean ± sd"),
        ("vs", f"vs {BASELINE}"),
        ("per_seed", "per seed"),
    ]
    columns.append(("extra", "test accuracy" if example == "digits" else "matmul FLOPs in FP8/FP4"))
    return f"## {example}\n\n" + _common.markdown_table(rows, columns)


def relative_by_setup(records: list[dict[str, Any]], example: str) -> dict[str, np.ndarray]:
    """Setup -> each seed's metric relative to the baseline's on the same seed (in %).

    Paired by seed: a seed fixes the initial weights and the batches, so the
    pairing takes the seed-to-seed spread out of the comparison. In ``SETUPS`` order.
    """
    runs = [r for r in records if r["example"] == example]
    base = {r["seed"]: r["metric"] for r in runs if r["setup"] == BASELINE}
    if not base:
        return {}
    return {
        setup: np.array(
            [
                100 * (r["metric"] / base[r["seed"]] - 1)
                for r in runs
                if r["setup"] == setup and r["seed"] in base
            ]
        )
        for setup in SETUPS
        if any(r["setup"] == setup and r["seed"] in base for r in runs)
    }


def plot(records: list[dict[str, Any]], examples: list[str], path: Path) -> None:
    """Per example, each setup's metric relative to bfloat16: mean (bar) and each seed (dots)."""
    shown = [e for e in examples if relative_by_setup(records, e)]
    if not shown:
        return
    plt = _common.use_agg_backend()
    fig, axes = plt.subplots(1, len(shown), figsize=(5.5 * len(shown), 5), squeeze=False)
    for ax, example in zip(axes[0], shown, strict=True):
        rel = relative_by_setup(records, example)
        names = list(rel)[::-1]  # the first setup on top
        y = np.arange(len(names))
        ax.barh(y, [rel[n].mean() for n in names], color="0.75")
        for i, n in enumerate(names):
            ax.plot(rel[n], np.full(len(rel[n]), i), "k.", ms=5)
        ax.axvline(0.0, color="k", lw=0.8)
        ax.set_yticks(y, [n.removeprefix("autocast_") for n in names], fontsize=8)
        ax.set_xlabel(f"{METRICS[example]}, % vs {BASELINE.removeprefix('autocast_')}")
        ax.set_title(example)
        ax.grid(axis="x", alpha=0.3)
    fig.suptitle(
        "Low-bit fidelity against bfloat16 on the same seed: mean (bars), each seed (dots)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", default="charlm,moe,digits")
    parser.add_argument("--setups", default=",".join(SETUPS))
    parser.add_argument("--seeds", type=int, default=3)
    _common.add_language_model_arguments(parser)
    parser.add_argument("--digits-steps", type=int, default=300)
    parser.add_argument("--digits-batch", type=int, default=64)
    _common.add_output_arguments(parser, "fp8_fidelity.md/.jsonl")
    parser.add_argument("--fast", action="store_true", help="one tiny run per setup (tests)")
    parser.add_argument(
        "--from-log",
        type=Path,
        nargs="*",
        default=None,
        help="write the tables from these fp8_fidelity.jsonl files instead of training",
    )
    args = parser.parse_args(argv)
    args.out = _common.output_dir(args)
    if args.fast:
        args.seeds, args.charlm_steps, args.charlm_width, args.charlm_layers = 1, 4, 32, 1
        args.charlm_batch, args.charlm_context, args.digits_steps, args.digits_batch = 4, 16, 4, 16
        args.moe_batch = 2
    args.examples = [e for e in args.examples.split(",") if e]
    args.setups = [s for s in args.setups.split(",") if s]
    bad = [e for e in args.examples if e not in RUNS] + [s for s in args.setups if s not in SETUPS]
    if bad:
        parser.error(f"unknown {bad}; examples: {', '.join(RUNS)}; setups: {', '.join(SETUPS)}")
    return args


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "fp8_fidelity.jsonl"
    records = []
    if args.from_log is not None:
        latest: dict[tuple, dict[str, Any]] = {}
        for path in args.from_log:
            for line in path.read_text().splitlines():
                if line:
                    record = json.loads(line)
                    latest[(record["example"], record["setup"], record["seed"])] = record
        records = list(latest.values())
        args.examples = [e for e in RUNS if any(r["example"] == e for r in records)]
        log.write_text("".join(json.dumps(r) + "\n" for r in records))
    for example in args.examples if args.from_log is None else ():
        for seed in range(args.seeds):
            for setup in (s for s in args.setups if s not in SKIPPED.get(example, ())):
                record = {"example": example, "setup": setup, "seed": seed}
                record.update(RUNS[example](setup, seed, args))
                print(json.dumps(record), flush=True)
                with log.open("a") as f:
                    f.write(json.dumps(record) + "\n")
                records.append(record)
    tables = "\n\n".join(t for t in (summarise(records, e) for e in args.examples) if t)
    given = sys.argv[1:] if argv is None else argv
    _common.write_markdown(
        args.out / "fp8_fidelity.md",
        "Low-bit fidelity: each FP8 and FP4 recipe next to float32 and bfloat16, over seeds",
        " ".join(["python examples/fp8_fidelity.py", *given]),
        tables,
        f"charlm: {args.charlm_layers} blocks, width {args.charlm_width}, batch "
        f"{args.charlm_batch} x {args.charlm_context} characters, {args.charlm_steps} steps. "
        f"digits: {args.digits_steps} steps of {args.digits_batch} images. Convolutions are "
        "FP8 tensorwise under every FP8 recipe (docs/fp8.md). FP4 rows: "
        "`keep_last` keeps the LM head and the last block in bfloat16 (the NVFP4 paper's "
        "rule), `keep_head` the LM head; the others switch off one part of the recipe "
        "(docs/fp4.md). "
        + (
            "Tables joined (--from-log) from the jsonl logs of runs of this script with the "
            "same settings, one per example (`--examples charlm`, `--examples moe`, "
            "`--examples digits`), run side by side; where a log repeats a run (same "
            "example, setup and seed) the later record counts."
            if args.from_log is not None
            else ""
        ),
    )
    plot(records, args.examples, args.out / "fp8_fidelity.png")
    print(tables)
    return records


if __name__ == "__main__":
    main()
