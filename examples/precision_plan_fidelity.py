"""Which layers to keep in bfloat16 under NVFP4: ``jaxamp.precision_plan`` against the paper's rule.

For charlm and its mixture-of-experts twin (``charlm.py --experts 4``), per
seed: ``jaxamp.precision_plan`` of the loss on the initial weights and the
first training batch under ``jaxamp.Float4Recipe()`` (NVFP4), then for each
budget ``f`` (a share of the step's FP4 matmul FLOPs, forward and backward)
three trainings that keep paths in bfloat16 within it:

- ``plan@f``: ``plan.keep(fraction=f)``, the plan's ranking (sensitivity);
- ``paper@f``: the NVFP4 paper's ranking (the LM head, then the blocks from
  the last to the first), cut to the same budget the same way;
- ``random@f``: a random ranking (seeded by the seed), cut the same way.

Each ranking is cut by the plan's greedy knapsack (a path that no longer fits
is skipped), so the three differ only in the order; ``kept`` is the share each
actually kept. Rankings that keep the same paths train once. The bfloat16,
full-NVFP4 and ``keep_last`` rows (the paper's rule in full) come from
``fp8_fidelity.py``'s log of the same settings (``--baseline-log``).

Each finished run is appended to ``--out``/precision_plan_fidelity.jsonl;
``--from-log`` writes the table from logs without training.

Run: ``python examples/precision_plan_fidelity.py`` (``--fast``: one tiny run).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # the examples folder is not a package: import by path
import charlm

import jaxamp

BASELINES = ("autocast_bfloat16", "autocast_nvfp4", "autocast_nvfp4_keep_last")
RANKINGS = ("plan", "paper", "random")


def run_args(args: argparse.Namespace, example: str, seed: int) -> argparse.Namespace:
    """charlm's arguments as ``fp8_fidelity.py`` passes them."""
    experts = args.experts if example == "moe" else 0
    batch = args.moe_batch if example == "moe" else args.charlm_batch
    return charlm.parse_args(
        [
            *("--experts", str(experts), "--steps", str(args.charlm_steps)),
            *("--width", str(args.charlm_width), "--batch-size", str(batch)),
            *("--context", str(args.charlm_context), "--layers", str(args.charlm_layers)),
            *("--eval-every", str(args.charlm_steps), "--seed", str(seed)),
            *("--sample-chars", "8", "--no-progress"),
        ]
    )


def plan_for(example: str, seed: int, args: argparse.Namespace, ids: np.ndarray) -> dict:
    """The plan of the initial weights on the first batch, and its cost."""
    cargs = run_args(args, example, seed)
    dims = charlm.sizes(cargs)
    model, _ = charlm.build("autocast_nvfp4", dims, seed)
    graphdef, state = nnx.split(model)

    def loss(state, tokens):
        return charlm.next_char_loss(nnx.merge(graphdef, state), tokens)

    length = dims["context"] + 1
    starts = np.random.default_rng(seed).integers(0, len(ids) - length, cargs.batch_size)
    tokens = charlm.windows(ids, starts, length)
    recipe = jaxamp.Float4Recipe()
    start = time.perf_counter()
    step = jax.jit(jax.value_and_grad(jaxamp.autocast(loss, recipe)))
    jax.block_until_ready(step(state, tokens))
    step_s = time.perf_counter() - start
    start = time.perf_counter()
    plan = jaxamp.precision_plan(loss, state, tokens, recipe=recipe)
    plan_s = time.perf_counter() - start
    print(plan, flush=True)
    flops = {p: plan.path_flops(p) / plan.total_flops for p in plan.paths}
    return {"plan": plan, "flops": flops, "step_s": step_s, "plan_s": plan_s}


def paper_ranking(paths: list[str], layers: int) -> list[str]:
    """The NVFP4 paper's order: embeddings and LM head, then the blocks from the last."""
    first = [p for p in paths if "head" in p or "embed" in p]
    blocks = [[p for p in paths if f"['blocks'][{i}]" in p] for i in reversed(range(layers))]
    rest = [p for p in paths if p not in first and not any(p in b for b in blocks)]
    return [*first, *(p for b in blocks for p in b), *rest]


def cut(ranking: list[str], flops: dict[str, float], fraction: float) -> list[str]:
    """``PrecisionPlan.keep(fraction=)``'s greedy knapsack on another ranking."""
    kept, spent = [], 0.0
    for path in ranking:
        if spent + flops[path] <= fraction * (1 + 1e-9):
            kept.append(path)
            spent += flops[path]
    return kept


def picks(found: dict, fraction: float, seed: int, layers: int) -> dict[str, list[str]]:
    plan, flops = found["plan"], found["flops"]
    paths = list(plan.paths)
    order = sorted(paths)  # the tree's order, for the paper's rule and the random draw
    shuffled = [order[i] for i in np.random.default_rng(1000 + seed).permutation(len(order))]
    return {
        "plan": cut(paths, flops, fraction),
        "paper": cut(paper_ranking(order, layers), flops, fraction),
        "random": cut(shuffled, flops, fraction),
    }


def train(example: str, seed: int, args: argparse.Namespace, kept: list[str]) -> float:
    cargs = run_args(args, example, seed)
    recipe = jaxamp.Float4Recipe(
        high_precision=tuple("^" + re.escape(p) + "$" for p in kept) or None
    )
    train_ids, valid_ids = charlm.split_blocks(charlm.encode(charlm.load_text()))
    row, _, _ = charlm.train("plan", train_ids, valid_ids, cargs, charlm.sizes(cargs), recipe)
    return float(row["valid_bits"])


def run(args: argparse.Namespace, log: Path) -> list[dict[str, Any]]:
    records = []
    train_ids, _ = charlm.split_blocks(charlm.encode(charlm.load_text()))
    for seed in range(args.first_seed, args.seeds):
        for example in args.examples:
            found = plan_for(example, seed, args, train_ids)
            head = {"example": example, "seed": seed}
            plan_record = {
                **head,
                "setup": "plan",
                "ranking": list(found["plan"].paths),
                "flops": found["flops"],
                "step_first_call_s": found["step_s"],
                "plan_s": found["plan_s"],
            }
            _append(log, plan_record, records)
            if args.cost_only:
                continue
            trained: dict[tuple, float] = {}
            for fraction in args.fractions:
                for ranking, kept in picks(found, fraction, seed, args.charlm_layers).items():
                    key = tuple(sorted(kept))
                    if key not in trained:
                        trained[key] = train(example, seed, args, kept)
                    record = {
                        **head,
                        "setup": f"{ranking}@{fraction:g}",
                        "metric": trained[key],
                        "kept": kept,
                        "kept_share": sum(found["flops"][p] for p in kept),
                    }
                    _append(log, record, records)
    return records


def _append(log: Path, record: dict, records: list) -> None:
    print(json.dumps(record), flush=True)
    with log.open("a") as f:
        f.write(json.dumps(record) + "\n")
    records.append(record)


def summarise(records: list[dict], baselines: list[dict], example: str, fractions: list) -> str:
    by_setup: dict[str, list[dict]] = {}
    for r in [*baselines, *records]:
        if r["example"] == example and "metric" in r:
            by_setup.setdefault(r["setup"], []).append(r)
    if "autocast_bfloat16" not in by_setup:
        return ""
    base = np.mean([r["metric"] for r in by_setup["autocast_bfloat16"]])
    order = [*BASELINES, *(f"{k}@{f:g}" for f in fractions for k in RANKINGS)]
    rows = []
    for setup in (s for s in order if s in by_setup):
        got = sorted(by_setup[setup], key=lambda r: r["seed"])
        values = np.array([r["metric"] for r in got])
        kept = [r["kept_share"] for r in got if "kept_share" in r]
        rows.append(
            {
                "setup": setup,
                "seeds": str(len(values)),
                "metric": f"{values.mean():.4f} ± {values.std():.4f}",
                "vs": f"{100 * (values.mean() / base - 1):+.2f}%",
                "kept": f"{100 * np.mean(kept):.1f}%" if kept else "",
                "per_seed": ", ".join(f"{v:.4f}" for v in values),
            }
        )
    columns = [
        ("setup", "setup"),
        ("seeds", "seeds"),
        ("metric", "validation bits/char, mean ± sd"),
        ("vs", "vs autocast_bfloat16"),
        ("kept", "FP4 FLOPs kept in bf16 (mean)"),
        ("per_seed", "per seed"),
    ]
    return f"## {example}\n\n" + _common.markdown_table(rows, columns)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--examples", default="charlm,moe")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--first-seed", type=int, default=0, help="run seeds first..seeds-1")
    parser.add_argument("--fractions", default="0.05,0.15,0.3")
    _common.add_language_model_arguments(parser)
    parser.add_argument(
        "--baseline-log",
        type=Path,
        default=_common.COMMITTED_RESULTS / "fp8_fidelity.jsonl",
        help="fp8_fidelity.py's log with the bfloat16, NVFP4 and keep_last runs",
    )
    _common.add_output_arguments(parser, "precision_plan_fidelity.md/.jsonl")
    parser.add_argument("--fast", action="store_true", help="one tiny run (tests)")
    parser.add_argument(
        "--cost-only", action="store_true", help="only the plans and their cost, no training"
    )
    parser.add_argument("--from-log", type=Path, nargs="*", default=None)
    args = parser.parse_args(argv)
    args.out = _common.output_dir(args)
    if args.fast:
        args.seeds, args.charlm_steps, args.charlm_width, args.charlm_layers = 1, 4, 32, 1
        args.charlm_batch, args.charlm_context, args.moe_batch = 4, 16, 2
    args.examples = [e for e in args.examples.split(",") if e]
    args.fractions = [float(f) for f in args.fractions.split(",") if f]
    return args


def _read(paths: list[Path]) -> list[dict]:
    return [json.loads(line) for p in paths for line in p.read_text().splitlines() if line]


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "precision_plan_fidelity.jsonl"
    records = _read(args.from_log) if args.from_log is not None else run(args, log)
    if args.from_log is not None:
        log.write_text("".join(json.dumps(r) + "\n" for r in records))
    baselines = [
        r
        for r in (_read([args.baseline_log]) if args.baseline_log.is_file() else [])
        if r["setup"] in BASELINES and not args.fast
    ]
    tables = "\n\n".join(
        t for t in (summarise(records, baselines, e, args.fractions) for e in args.examples) if t
    )
    plans = [r for r in records if r["setup"] == "plan"]
    cost = "; ".join(
        f"{r['example']} seed {r['seed']}: plan {r['plan_s']:.1f} s, step's first call "
        f"{r['step_first_call_s']:.1f} s"
        for r in plans
    )
    given = sys.argv[1:] if argv is None else argv
    _common.write_markdown(
        args.out / "precision_plan_fidelity.md",
        "precision_plan under NVFP4: the plan's picks against the paper's rule and random picks",
        " ".join(["python examples/precision_plan_fidelity.py", *given]),
        tables,
        f"charlm: {args.charlm_layers} blocks, width {args.charlm_width}, "
        f"{args.charlm_steps} steps (fp8_fidelity.py's settings). `f` is a budget, a share of "
        "the step's FP4 matmul FLOPs; each ranking is cut to it by the same greedy knapsack, "
        "so `kept` (the share kept) can be under `f`. Baseline rows from "
        f"{args.baseline_log.name}. Cost: {cost}.",
    )
    print(tables)
    return records


if __name__ == "__main__":
    main()
