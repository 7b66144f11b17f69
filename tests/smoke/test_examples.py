"""The examples' fast modes, end to end: they run, write their outputs, and the numbers agree.

Each example runs once per module (a fixture) and the tests read its results.
optax's adam/adamw do not run under the suite's strict dtype promotion (inside
optax itself), so the example runs are wrapped in standard promotion.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

pytest.importorskip("flax")
pytest.importorskip("sklearn")
pytest.importorskip("matplotlib")
pytest.importorskip("tqdm")

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
sys.path.insert(0, str(EXAMPLES))

# The examples folder is not a package: import the scripts by path.
charlm = importlib.import_module("charlm")
charlm_low_precision = importlib.import_module("charlm_low_precision")
digits = importlib.import_module("digits")
fp8_fidelity = importlib.import_module("fp8_fidelity")
plan_fidelity = importlib.import_module("precision_plan_fidelity")
underflow = importlib.import_module("underflow")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run(main, argv):
    with jax.numpy_dtype_promotion("standard"):
        return {row["setup"]: row for row in main(argv)}


def git_status() -> str | None:
    """``git status`` of ``examples/`` (where results were written), or None outside git.

    Only ``examples/``: an edit elsewhere while the tests run is not the example's doing.
    """
    command = ["git", "status", "--porcelain", "--untracked-files=all", "--", "examples"]
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return done.stdout


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory):
    # As the Quickstart runs it: no --out, from a working directory of the user's.
    cwd = tmp_path_factory.mktemp("digits")
    setups = "float32,mixed_bfloat16,mixed_float16,autocast_bfloat16"
    before, here = git_status(), os.getcwd()
    os.chdir(cwd)
    try:
        rows = run(digits.main, ["--fast", "--no-progress", "--policies", setups])
    finally:
        os.chdir(here)
    return rows, cwd / "jaxamp-results", (before, git_status())


@pytest.fixture(scope="module")
def underflow_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("underflow")
    setups = "mixed_float16_no_scaling,mixed_float16,mixed_float16_suggested_scale"
    rows = run(underflow.main, ["--fast", "--no-progress", "--out", str(out), "--policies", setups])
    return rows, out


def run_charlm(out: Path, setups: str):
    argv = ["--fast", "--no-progress", "--out", str(out), "--sample-chars", "8"]
    return run(charlm.main, [*argv, "--policies", setups]), out


@pytest.fixture(scope="module")
def charlm_run(tmp_path_factory):
    # The layer-dtype bfloat16 variant runs in the slow test below (XLA's CPU compile
    # of a transformer train step takes seconds); digits covers layer dtypes by default.
    return run_charlm(tmp_path_factory.mktemp("charlm"), "float32,autocast_bfloat16")


def assert_outputs(out: Path, name: str, setups) -> None:
    table = (out / f"{name}.md").read_text()
    assert table.startswith("# ")
    assert f"Command: `python examples/{name}.py --fast" in table
    for setup in setups:
        assert f"| {setup} |" in table
    png = (out / f"{name}.png").read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 10_000


def window_means(values, window=10):
    return values[: len(values) // window * window].reshape(-1, window).mean(axis=1)


# -- digits -----------------------------------------------------------------------


def test_digits_by_default_writes_under_the_working_directory_not_the_checkout(digits_run):
    _, out, (before, after) = digits_run
    assert (out / "digits.md").is_file() and (out / "digits.png").is_file()
    if before is not None:
        assert after == before, "running the example changed files of the checkout"


@pytest.mark.parametrize(
    "example", [digits, underflow, charlm, charlm_low_precision, fp8_fidelity, plan_fidelity]
)
def test_examples_write_the_committed_results_only_when_asked(example, tmp_path):
    committed = EXAMPLES / "results"
    assert example.parse_args([]).out == Path("jaxamp-results")
    assert example.parse_args(["--out", str(tmp_path)]).out == tmp_path
    assert example.parse_args(["--refresh-committed"]).out == committed
    with pytest.raises(SystemExit):
        example.parse_args(["--refresh-committed", "--out", str(tmp_path)])
    if git_status() is not None:  # the default folder is one git ignores
        ignored = subprocess.run(
            ["git", "check-ignore", "-q", "jaxamp-results/digits.md"], cwd=ROOT, check=False
        )
        assert ignored.returncode == 0


def test_digits_writes_table_and_plot(digits_run):
    rows, out, _ = digits_run
    assert list(rows) == ["float32", "mixed_bfloat16", "mixed_float16", "autocast_bfloat16"]
    assert_outputs(out, "digits", rows)
    for row in rows.values():  # --fast runs one seed
        assert row["seeds"]["accuracy"] == [row["accuracy"]]


def test_digits_mixed_runs_agree_with_float32(digits_run):
    rows, _, _ = digits_run
    reference = rows["float32"]
    ref_loss = reference["history"]["loss"]
    assert ref_loss[-10:].mean() < ref_loss[:10].mean() - 0.2  # it learns
    assert reference["accuracy"] > 0.4  # 10 classes: chance is 0.1
    for setup in ("mixed_bfloat16", "mixed_float16", "autocast_bfloat16"):
        row = rows[setup]
        loss = row["history"]["loss"]
        assert loss.shape == ref_loss.shape
        # Same weights, same batches: the curves differ only by rounding, which
        # compounds over the steps (measured: <= 0.06 per step, <= 0.012 per
        # 10-step mean, 0.03 in test loss, while the loss falls from 2.3 to 0.8).
        np.testing.assert_allclose(loss, ref_loss, atol=0.15)
        np.testing.assert_allclose(window_means(loss), window_means(ref_loss), atol=0.04)
        assert abs(row["test_loss"] - reference["test_loss"]) < 0.08
        assert abs(row["accuracy"] - reference["accuracy"]) < 0.05


def test_digits_loss_scaling_state(digits_run):
    rows, _, _ = digits_run
    assert rows["mixed_float16"]["skipped"] == 0
    # 60 steps < growth interval: the dynamic scale stays at its initial 2**15.
    np.testing.assert_array_equal(rows["mixed_float16"]["history"]["loss_scale"], 2.0**15)
    for setup in ("float32", "mixed_bfloat16", "autocast_bfloat16"):
        np.testing.assert_array_equal(rows[setup]["history"]["loss_scale"], 1.0)
        assert rows[setup]["skipped"] == 0


def test_digits_16_bit_compute_halves_activation_memory(digits_run):
    rows, _, _ = digits_run
    f32 = rows["float32"]["residual_bytes"]
    for setup in ("mixed_bfloat16", "mixed_float16"):
        assert rows[setup]["residual_bytes"] < 0.65 * f32
    for row in rows.values():
        assert row["temp_bytes"] is None or row["temp_bytes"] > 0
        assert row["step_ms"] > 0


def test_digits_reports_mean_and_std_over_seeds(tmp_path):
    argv = ["--fast", "--no-progress", "--out", str(tmp_path), "--steps", "3"]
    rows = run(digits.main, [*argv, "--seeds", "2", "--policies", "float32"])
    accuracies = rows["float32"]["seeds"]["accuracy"]
    assert len(accuracies) == 2 and rows["float32"]["accuracy"] == np.mean(accuracies)
    table = (tmp_path / "digits.md").read_text()
    assert f"| float32 | {digits._common.mean_std(accuracies)} |" in table
    assert "+-" in table and "seeds 0..1" in table


def test_digits_rejects_unknown_setup():
    with pytest.raises(SystemExit):
        digits.parse_args(["--policies", "float32,float8"])
    with pytest.raises(ValueError, match="unknown setup 'float8'"):
        digits.train("float8", {}, steps=1, batch_size=1, seed=0)


# -- underflow --------------------------------------------------------------------


def test_underflow_float16_without_scaling_gets_only_zero_gradients(underflow_run):
    rows, out = underflow_run
    assert_outputs(out, "underflow", rows)
    stalled = rows["mixed_float16_no_scaling"]
    # Every gradient entry underflowed at every step: Adam never moved the weights.
    np.testing.assert_array_equal(stalled["history"]["zero_fraction"], 1.0)
    assert stalled["skipped"] == 0  # nothing overflowed: the failure is silent
    assert stalled["test_loss"] == pytest.approx(math.log(10), abs=0.05)


def test_underflow_dynamic_loss_scaling_recovers(underflow_run):
    rows, _ = underflow_run
    rescued, stalled = rows["mixed_float16"], rows["mixed_float16_no_scaling"]
    assert rescued["history"]["zero_fraction"].max() < 0.5
    assert rescued["loss_scale"] >= 2.0**15
    assert rescued["test_loss"] < stalled["test_loss"] - 0.1
    assert rescued["accuracy"] > stalled["accuracy"] + 0.1


def test_underflow_numerics_report_finds_the_flush_and_a_scale_that_trains(underflow_run):
    rows, _ = underflow_run
    stalled, suggested = rows["mixed_float16_no_scaling"], rows["mixed_float16_suggested_scale"]
    measured = suggested["measured"]
    # Every layer of the CNN loses most of its float16 gradient values at loss scale 1
    # (relu-masked zeros are zero in float32 too and do not count).
    layers = measured["layers"]
    assert len(layers) == 4  # conv1, conv2, dense1, dense2: the lines of digits.CNN.__call__
    assert all(source.rsplit(":", 1)[0].endswith("digits.py") for source in layers)
    assert all(flushed / total > 0.3 for flushed, total in layers.values())
    report = measured["report"]
    assert report.first_nonfinite is None and report.loss_scale == 1.0
    scale = measured["scale"]
    assert math.log2(scale).is_integer() and scale >= 2.0**20
    # Trained with that scale as a StaticLossScale: no step skipped, the gradients are back.
    assert suggested["loss_scale"] == scale and suggested["skipped"] == 0
    assert suggested["history"]["zero_fraction"].max() < 0.5
    assert suggested["test_loss"] < stalled["test_loss"] - 0.1


# -- charlm -----------------------------------------------------------------------


def test_charlm_writes_table_plot_and_samples(charlm_run):
    rows, out = charlm_run
    assert list(rows) == ["float32", "autocast_bfloat16"]
    assert_outputs(out, "charlm", rows)
    for row in rows.values():
        sample = row["sample"]
        assert sample.startswith("def ") and len(sample) == len("def ") + 8
        assert set(sample) <= set(charlm.VOCAB)


def assert_bfloat16_agrees(rows, setup):
    reference, row = rows["float32"], rows[setup]
    first = reference["history"]["loss"][0] / math.log(2)
    assert first > math.log2(96) - 0.5  # untrained: no better than uniform over 96
    assert reference["valid_bits"] < first - 0.8  # it learns
    # Same weights, same batches: the curves differ only by rounding.
    np.testing.assert_allclose(row["history"]["loss"], reference["history"]["loss"], atol=0.05)
    assert abs(row["valid_bits"] - reference["valid_bits"]) < 0.05
    assert row["residual_bytes"] < reference["residual_bytes"]
    # Every matmul of the float32 run is float32; the bfloat16 run's are (nearly) all
    # bfloat16, and the aligned sizes leave none misaligned.
    assert reference["bf16_share"] == 0.0
    assert row["bf16_share"] > 0.95
    assert row["misaligned"] == 0 and reference["misaligned"] == 0


def test_charlm_autocast_agrees_with_float32(charlm_run):
    rows, _ = charlm_run
    assert_bfloat16_agrees(rows, "autocast_bfloat16")


@pytest.mark.slow
def test_charlm_layer_dtypes_agree_with_float32(tmp_path):
    rows, out = run_charlm(tmp_path, "float32,mixed_bfloat16")
    assert_outputs(out, "charlm", rows)
    assert_bfloat16_agrees(rows, "mixed_bfloat16")


def test_charlm_text_and_alignment():
    text = charlm.load_text(max_chars=5_000)
    assert set(text) <= set(charlm.VOCAB) and len(text) == 5_000
    assert charlm.decode(charlm.encode(text)) == text
    ids = np.arange(25_000)
    train_ids, valid_ids = charlm.split_blocks(ids, block=1000, every=10)
    np.testing.assert_array_equal(valid_ids, np.r_[9000:10_000, 19_000:20_000])
    assert len(train_ids) == 23_000 and not set(train_ids) & set(valid_ids)
    args = charlm.parse_args(["--fast", "--width", "40"])
    dims = charlm.sizes(args)
    assert dims["padded_vocab"] == 128 and dims["vocab"] == 96
    assert dims["width"] == 64 and dims["mlp"] == 256


@pytest.mark.slow  # two charlm runs (about 30 s); tests/unit covers the optimizer's modes
def test_charlm_low_precision_rounding_modes(tmp_path):
    argv = ["--fast", "--no-progress", "--out", str(tmp_path), "--steps", "2"]
    with jax.numpy_dtype_promotion("standard"):
        runs = charlm_low_precision.main([*argv, "--modes", "bf16_nearest,bf16_kahan"])
    by_mode = {r["mode"]: r for r in runs}
    assert set(by_mode) == {"bf16_nearest", "bf16_kahan"}
    # bf16 params + bf16 AdamW moments: 6 bytes; Kahan's buffer: 2 more (plus a
    # few fixed bytes of counters and key over the parameter count).
    assert 6.0 < by_mode["bf16_nearest"]["bytes_per_param"] < 6.01
    assert 8.0 < by_mode["bf16_kahan"]["bytes_per_param"] < 8.01
    for r in runs:
        assert math.isfinite(r["valid_bits"]) and r["valid_bits"] < 7.0
    assert_outputs(tmp_path, "charlm_low_precision", ["bf16_nearest", "bf16_kahan"])
    with pytest.raises(SystemExit):
        charlm_low_precision.parse_args(["--modes", "bf16_float8"])


def test_fp8_fidelity_fast_runs_an_fp8_recipe_next_to_bfloat16(tmp_path):
    fidelity = importlib.import_module("fp8_fidelity")
    setups = "autocast_bfloat16,autocast_fp8_rowwise"
    with jax.numpy_dtype_promotion("standard"):
        records = fidelity.main(
            ["--fast", "--examples", "charlm", "--setups", setups, "--out", str(tmp_path)]
        )
    assert [(r["setup"], r["fp8_share"]) for r in records] == [
        ("autocast_bfloat16", 0.0),
        ("autocast_fp8_rowwise", 1.0),
    ]
    assert all(math.isfinite(r["metric"]) for r in records)
    table = (tmp_path / "fp8_fidelity.md").read_text()
    assert "| autocast_fp8_rowwise | 1 |" in table
    assert len((tmp_path / "fp8_fidelity.jsonl").read_text().splitlines()) == 2
    assert (tmp_path / "fp8_fidelity.png").stat().st_size > 0


@pytest.mark.slow  # three runs (about 50 s); the FP8 smoke above runs the same script in CI
def test_fp8_fidelity_fast_runs_fp4_on_the_moe_model_and_not_on_digits(tmp_path):
    fidelity = importlib.import_module("fp8_fidelity")
    setups = "autocast_bfloat16,autocast_mxfp4_ceil"
    argv = ["--fast", "--examples", "moe", "--setups", setups, "--out", str(tmp_path)]
    with jax.numpy_dtype_promotion("standard"):
        records = fidelity.main(argv)
        # digits is convolutional: FP4 leaves convolutions in bfloat16, so it runs no FP4.
        digits = ["--fast", "--examples", "digits", "--setups", "autocast_mxfp4_ceil"]
        skipped = fidelity.main([*digits, "--out", str(tmp_path / "digits")])
    assert skipped == []
    assert [(r["example"], r["setup"]) for r in records] == [
        ("moe", "autocast_bfloat16"),
        ("moe", "autocast_mxfp4_ceil"),
    ]
    assert records[0]["fp4_share"] == 0.0 and 0.5 < records[1]["fp4_share"] < 1.0
    assert all(math.isfinite(r["metric"]) for r in records)
    assert "| autocast_mxfp4_ceil | 1 |" in (tmp_path / "fp8_fidelity.md").read_text()


def test_charlm_fp4_rules_keep_the_head_and_the_last_block_of_the_moe_model():
    args = charlm.parse_args(["--fast", "--layers", "2", "--experts", "4"])
    dims = charlm.sizes(args)
    sample = charlm.windows(charlm.encode(charlm.load_text(5000)), np.zeros(2, np.int64), 17)
    counts = {}
    for setup in ("autocast_nvfp4", "autocast_nvfp4_keep_last", "autocast_nvfp4_keep_head"):
        model, loss = charlm.build(setup, dims, 0)
        with jax.numpy_dtype_promotion("standard"):
            report = importlib.import_module("_common").matmul_report(loss, model, sample)
        assert {m.primitive for m in report.matmuls if m.is_fp4} == {
            "dot_general",
            "ragged_dot_general",
        }
        counts[setup] = (len(report.matmuls), len(report.kept))
    # 2 blocks of q, k, v, out and 2 experts' ragged products, and the head: 3 products
    # each, plus attention's activation products and the routers (kept in bfloat16).
    assert counts["autocast_nvfp4"][1] == 0
    assert counts["autocast_nvfp4_keep_head"][1] == 3
    assert counts["autocast_nvfp4_keep_last"][1] == 3 + 3 * 7


def test_loss_scale_plot_draws_setups_with_the_same_constant_scale_as_one_line():
    common = importlib.import_module("_common")
    plt = common.use_agg_backend()
    ones, growing = np.ones(4), np.array([2.0**15, 2.0**15, 2.0**16, 2.0**16])
    histories = {
        "float32": {"loss_scale": ones},
        "mixed_bfloat16": {"loss_scale": ones},
        "mixed_float16": {"loss_scale": growing},
        "mixed_float16_suggested_scale": {"loss_scale": np.full(4, 2.0**37)},
    }
    fig, ax = plt.subplots()
    common.plot_loss_scales(ax, histories)
    labels = sorted(line.get_label() for line in ax.get_lines())
    plt.close(fig)
    assert labels == [
        "float32, mixed_bfloat16: scale 1",
        "mixed_float16",
        "mixed_float16_suggested_scale",
    ]


def test_sharded_gpt_fast_trains_on_8_devices_and_reads_its_wire_bytes():
    from tests.helpers import run_with_devices

    args = ("--fast", "--settings", "float32,mixed_bfloat16", "--json")
    rows = {
        r["setting"]: r for r in run_with_devices(str(EXAMPLES / "sharded_gpt.py"), 8, 600, args)
    }
    assert set(rows) == {"float32", "mixed_bfloat16"}
    f32, bf16 = rows["float32"], rows["mixed_bfloat16"]
    for r in rows.values():
        assert len(r["losses"]) == 3 and r["losses"][-1] < r["losses"][0]
    # Same weights, same batch: the first losses differ by bfloat16 rounding only.
    assert abs(bf16["losses"][0] - f32["losses"][0]) < 2e-2
    # FSDP in float32: every weight gathered and its gradient reduced in float32,
    # about 4 bytes per parameter each (all matrices are sharded, vectors are not).
    assert set(f32["B_per_param"]) == {"gather float32", "reduce float32"}
    assert 3.5 < f32["B_per_param"]["gather float32"] <= 4.1
    assert 3.5 < f32["B_per_param"]["reduce float32"] <= 4.1
    # bfloat16 compute gathers the weights in bfloat16; gradients are reduced in float32.
    assert bf16["B_per_param"].get("gather bfloat16", 0) > 1.0
    assert 3.5 < bf16["B_per_param"]["reduce float32"] <= 4.1
    assert f32["bytes_per_step"] > 0 and bf16["bytes_per_step"] > 0


def test_precision_plan_fidelity_ranks_cuts_and_tables_from_a_log(tmp_path):
    paths = ["['blocks'][0]['up']", "['blocks'][1]['up']", "['head']", "['router']"]
    assert plan_fidelity.paper_ranking(paths, 2) == [
        "['head']",
        "['blocks'][1]['up']",
        "['blocks'][0]['up']",
        "['router']",
    ]
    # The plan's greedy knapsack: a path that no longer fits is skipped, not the end.
    flops = {"a": 0.2, "b": 0.1, "c": 0.05}
    assert plan_fidelity.cut(["a", "b", "c"], flops, 0.15) == ["b", "c"]
    head = {"example": "charlm", "seed": 0}
    records = [
        {
            **head,
            "setup": "plan",
            "ranking": ["b"],
            "flops": flops,
            "plan_s": 2.0,
            "step_first_call_s": 1.0,
        },
        {**head, "setup": "plan@0.15", "metric": 3.1, "kept": ["b", "c"], "kept_share": 0.15},
        {**head, "setup": "paper@0.15", "metric": 3.2, "kept": ["b"], "kept_share": 0.1},
    ]
    log = tmp_path / "in.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in records))
    argv = ["--from-log", str(log), "--fractions", "0.15", "--out", str(tmp_path / "out")]
    assert plan_fidelity.main(argv) == records
    table = (tmp_path / "out" / "precision_plan_fidelity.md").read_text()
    assert "| plan@0.15 | 1 | 3.1000 ± 0.0000 |" in table
    assert "| paper@0.15 | 1 | 3.2000 ± 0.0000 |" in table
    assert "| autocast_bfloat16 | 3 |" in table  # fp8_fidelity's committed runs
    assert "charlm seed 0: plan 2.0 s, step's first call 1.0 s" in table
