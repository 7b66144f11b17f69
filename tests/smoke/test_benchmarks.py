"""Every benchmark script runs in its smoke mode and writes a well-formed result.

No timing is asserted (speed is measured by benchmarks/, never by tests); what is asserted is
that each script measures every variant it promises, on the same work, with sane numbers.
"""

import json
import math

import jax
import optax
import pytest

import jaxamp
from benchmarks import (
    _low_bit,
    _models,
    _multi_gpu,
    _variants,
    activation_memory,
    autocast_cpu_speed,
    compile_scaling,
    follow_rule,
    gpu_speed,
    low_precision,
    numerics_cost,
    step_overhead,
)
from jaxamp._fp8 import _native

PEERS = set(_variants.VARIANTS)


def _load(path):
    payload = json.loads(path.read_text())
    machine = payload["machine"]
    assert machine["nproc"] >= 1 and machine["date_utc"] and machine["backend"]
    assert machine["versions"]["jaxamp"] == jaxamp.__version__
    return payload


def _positive(x):
    return isinstance(x, float) and math.isfinite(x) and x > 0


def test_compile_scaling_smoke(tmp_path, capsys):
    out = tmp_path / "compile.json"
    compile_scaling.main(["--smoke", "--out", str(out)])
    payload = _load(out)
    results = payload["results"]
    assert {r["variant"] for r in results} == PEERS
    for r in results:
        assert r["status"] == "ok" and r["n_leaves"] == payload["config"]["sizes"][0]
        assert _positive(r["median_wall_s"]) and _positive(r["median_cpu_s"])
        assert _positive(r["ratio_cpu"])
    assert next(r for r in results if r["variant"] == "plain_optax")["ratio_wall"] == 1.0
    assert "| jaxamp " in capsys.readouterr().out


def test_compile_scaling_skips_over_budget_with_a_reason():
    with jax.numpy_dtype_promotion("standard"):
        results = compile_scaling.run([2, 400], reps=1, budget_s=1e-6, variants=["jaxamp"])
    first, second = results
    assert first["status"] == "ok" and first["reps"] == 1
    assert second["status"] == "skipped" and "400 leaves" in second["reason"]


def test_step_overhead_smoke(tmp_path):
    out = tmp_path / "step.json"
    step_overhead.main(["--smoke", "--out", str(out)])
    results = _load(out)["results"]
    assert {r["variant"] for r in results if r["workload"] == "mlp"} == PEERS
    assert {r["variant"] for r in results if r["workload"] == "transformer"} == {
        "plain_optax",
        "jaxamp",
    }
    assert {(r["workload"], r["donate"]) for r in results} == {
        ("mlp", False),
        ("transformer", True),
    }
    for r in results:
        assert len(r["per_step_s"]) == r["reps"] and _positive(r["median_s"])
        assert r["min_s"] <= r["median_s"] and _positive(r["ratio_median"])


@pytest.mark.slow  # compiles every setting's step (about 25 s of CPU)
def test_activation_memory_smoke(tmp_path):
    out = tmp_path / "memory.json"
    activation_memory.main(["--smoke", "--out", str(out)])
    results = {r["variant"]: r for r in _load(out)["results"]}
    assert set(results) == {
        "float32",
        "mixed_bf16_layer_dtypes",
        "mixed_bf16_policy_casting",
        "mixed_bf16_autocast",
        "mixed_bf16_autocast_remat",
    }
    f32 = results["float32"]
    assert f32["residual_bytes"]["by_dtype"].keys() <= {"float32", "int32", "bool"}
    assert f32["residual_ratio"] == 1.0
    losses = [r["loss"] for r in results.values() if r["status"] == "ok"]
    # The same initial params and batch: bf16 changes the loss only a little.
    assert max(losses) - min(losses) < 0.05 * abs(f32["loss"])
    for r in results.values():
        if r["variant"] != "float32" and r["status"] == "ok":
            assert r["residual_bytes"]["by_dtype"]["bfloat16"] > 0
            assert r["residual_ratio"] < 1.0
            assert len(r["value_and_grad_seconds"]) == 2
    # Recomputing the float32 intermediates keeps fewer residual bytes.
    remat = results["mixed_bf16_autocast_remat"]["residual_bytes"]
    assert remat["total"] < results["mixed_bf16_autocast"]["residual_bytes"]["total"]


@pytest.mark.slow  # compiles and times every setting (about 35 s of CPU)
def test_autocast_cpu_speed_smoke(tmp_path):
    out = tmp_path / "cpu_speed.json"
    # Flax's bfloat16 LayerNorm mixes dtypes inside flax, which strict promotion rejects.
    with jax.numpy_dtype_promotion("standard"):
        autocast_cpu_speed.main(["--smoke", "--out", str(out)])
    payload = _load(out)
    assert set(payload["config"]["isa"]) <= set(autocast_cpu_speed.ISA_FLAGS)
    config = payload["config"]
    results = {r["setup"]: r for r in payload["results"] if r["part"] == "main"}
    assert set(results) == set(autocast_cpu_speed.SETUPS)
    swept = [(r["width"], r["setup"]) for r in payload["results"] if r["part"] == "sweep"]
    assert sorted(swept) == sorted(
        (w, s) for w in config["sweep"]["widths"] for s in autocast_cpu_speed.SETUPS
    )
    matmuls = {r["setup"]: r for r in payload["results"] if r["part"] == "matmul"}
    assert set(matmuls) == set(autocast_cpu_speed.MATMULS)
    assert matmuls["bf16_operands_f32_accumulation"]["bf16_dots"] == 1
    for r in payload["results"]:  # every part: ratios within its own interleaved rounds
        assert _positive(r["ratio_to_float32"]) and r["converts"] >= 0
    assert results["float32"]["ratio_to_float32"] == 1.0
    for r in results.values():
        assert len(r["per_round_ms"]) == payload["config"]["rounds"]
        assert _positive(r["median_ms"]) and _positive(r["ratio_to_float32"])
    # The same initial weights and tokens: bf16 changes the loss only a little.
    f32_loss = results["float32"]["loss"]
    for r in results.values():
        assert abs(r["loss"] - f32_loss) < 0.02 * abs(f32_loss)
    # float32 compiles to float32 dots only; under autocast every dot keeps bf16 operands.
    assert results["float32"]["bf16_dots"] == 0 and results["float32"]["f32_dots"] > 0
    if jax.default_backend() == "cpu":
        autocast = results["autocast_bfloat16"]
        assert autocast["bf16_dots"] > 0 and autocast["f32_dots"] == 0
        # float32 elementwise work: the same bfloat16 dots, fewer conversions.
        f32_elementwise = results["autocast_f32_elementwise"]
        assert f32_elementwise["bf16_dots"] == autocast["bf16_dots"]
        assert f32_elementwise["converts"] < autocast["converts"]


@pytest.mark.slow  # eight value_and_grad compiles under autocast: about 30 s of CPU
def test_follow_rule_smoke(tmp_path):
    out = tmp_path / "follow_rule.json"
    follow_rule.main(["--smoke", "--out", str(out)])
    results = _load(out)["results"]
    setups = set(follow_rule.RULES)
    accuracy = [r for r in results if r["part"] == "accuracy"]
    assert {r["setup"] for r in accuracy} == setups | {"hand_cast"}
    by = {(r["function"], r["setup"]): r for r in accuracy}
    # float16 squares an activation of 300 to inf: the hand-cast reference and JAX's
    # promotion (a power of a 16-bit value stays 16-bit) lose the norm, autocast does not.
    assert by[("rms_norm_outlier", "promotion")]["output_error"] >= 0.5
    assert by[("rms_norm_outlier", "autocast")]["output_error"] < 0.01
    memory = {(r["setup"], r["remat_float32"]): r for r in results if r["part"] == "memory"}
    assert set(memory) == {(s, remat) for s in setups for remat in (False, True)}
    for r in memory.values():
        assert 0 < r["residual_ratio"] < 1
    speed = [r for r in results if r["part"] == "speed"]
    timed = setups | {f"{s}_remat" for s in setups} | {"float32"}
    assert {(r["model"], r["setup"]) for r in speed} == {
        (m, s) for m in ("charlm", "gpt") for s in timed
    }
    for r in speed:
        assert _positive(r["ratio_to_float32"]) and len(r["per_round_ms"]) == 2


@pytest.mark.slow  # every recipe's step at smoke size (about 50 s of CPU)
def test_gpu_speed_smoke(tmp_path):
    out = tmp_path / "gpu.json"
    gpu_speed.main(["--smoke", "--out", str(out)])
    multi = _load(out)["multi_gpu"]
    if jax.default_backend() != "gpu" or len(jax.devices()) < 2:
        assert multi["status"].startswith("skipped: needs 2 or more GPUs") and not multi["results"]
    else:
        assert {r["setting"] for r in multi["results"]} == set(_multi_gpu.SETTINGS)
    payload = _load(out)
    assert payload["status"] == "ok"
    combos = {(r["precision"], r["padded"]) for r in payload["results"]}
    # Smoke mode runs float32 unpadded and the loss-scaled float16 path padded.
    assert combos == {("float32", False), ("mixed_float16", True)}
    for r in payload["results"]:
        assert math.isfinite(r["final_loss"]) and _positive(r["median_step_s"])
        dims = r["dims"]
        aligned = all(d % gpu_speed.PAD_MULTIPLE == 0 for d in dims.values())
        assert aligned == r["padded"]
    # Low-bit rows: one GEMM size and the GPT step, every FP8 and FP4 recipe next to bf16
    # autocast, the block-scaled ones in both forms; native where this JAX lowers
    # scaled_matmul here.
    variants = set(_low_bit.low_bit_variants())
    natives = {f"{f}_native" for f in ("fp8_mxfp8", "fp4_nvfp4", "fp4_mxfp4")}
    assert {"bf16", "fp8_tensorwise", *natives, *(n[:-6] + "emulated" for n in natives)} == (
        variants - {f"fp8_{s}" for s in ("rowwise", "blockwise")}
    )
    native_runs = _native.native_lowers(jax.default_backend())
    step = payload["low_bit_step"]
    assert set(_low_bit.SMOKE_STEP_VARIANTS) <= set(step) and "fp8_rowwise" not in step
    assert _positive(step["fp8_tensorwise"]["tflops_per_s"])
    assert _positive(step["fp4_nvfp4_emulated"]["tflops_per_s"])
    for row in payload["low_bit_gemm"]:
        assert variants <= set(row)
        assert row["bf16"]["speedup_vs_bf16"] == 1.0
        assert all(_positive(row[v]["tflops_per_s"]) for v in variants - natives)
        for name in natives:
            ratio = f"{name.split('_')[1]}_native_vs_emulated"
            if native_runs:
                assert _positive(row[name]["tflops_per_s"]) and _positive(row[ratio])
            else:
                assert "gemm='native'" in row[name]["error"] and ratio not in row
    # The optimizer step of every low_precision variant, timed against float32 Adam.
    optimizer = {r["variant"]: r for r in payload["optimizer"]["results"]}
    assert set(optimizer) == set(low_precision.VARIANTS)
    assert optimizer["float32_master"]["update"]["ratio_median"] == 1.0
    assert all(_positive(r["update"]["ratio_median"]) for r in optimizer.values())


def test_gpu_speed_full_size_is_never_faked_without_a_gpu(tmp_path):
    if jax.default_backend() == "gpu":
        pytest.skip("a GPU is present: the full size would really run")
    out = tmp_path / "gpu_full.json"
    gpu_speed.main(["--out", str(out)])
    payload = _load(out)
    assert payload["status"].startswith("skipped") and payload["results"] == []
    assert "optimizer" not in payload


def test_every_variant_trains_identically_on_finite_steps():
    # The comparison is fair only if every variant does the same work: with finite
    # gradients all of them follow the plain optax trajectory.
    params = _models.mlp_params(4)
    batch = _models.mlp_batch()
    losses = {}
    with jax.numpy_dtype_promotion("standard"):
        for name, make in _variants.VARIANTS.items():
            variant = make(_models.mlp_loss, optax.adam(1e-2))
            state, step = variant.init(params), jax.jit(variant.step)
            trajectory = []
            for _ in range(3):
                state, loss = step(state, batch)
                trajectory.append(float(loss))
            losses[name] = trajectory
    for name, trajectory in losses.items():
        assert trajectory == pytest.approx(losses["plain_optax"], rel=1e-5), name


def test_report_renders_every_recorded_run(capsys):
    from benchmarks import _harness, report

    report.main()
    printed = capsys.readouterr().out
    recorded = [
        p.stem for p in _harness.RESULTS_DIR.glob("*.json") if not p.stem.endswith("_smoke")
    ]
    assert recorded
    for stem in recorded:
        assert f"### {stem}\n" in printed, stem


def test_numerics_cost_smoke(tmp_path, capsys):
    out = tmp_path / "numerics.json"
    numerics_cost.main(["--smoke", "--out", str(out)])
    (result,) = _load(out)["results"]
    assert result["model"] == "smoke" and result["ops_measured"] > 20
    for key in ("plain_run_s", "instrumented_run_s", "run_ratio", "first_call_ratio"):
        assert _positive(result[key]), key
    assert result["run_ratio"] == result["instrumented_run_s"] / result["plain_run_s"]
    assert "| smoke " in capsys.readouterr().out


def test_numerics_cost_where_smoke(tmp_path, capsys):
    out = tmp_path / "numerics_where.json"
    numerics_cost.main(["--smoke", "--where", "--repeats", "1", "--out", str(out)])
    (result,) = _load(out)["results"]
    assert result["model"] == "smoke" and result["part"] == "where"
    for variant in ("shipped", "screen", "fires", "fires screened"):
        assert _positive(result[f"{variant} ratio"]), variant
    assert "| smoke " in capsys.readouterr().out


def test_low_precision_smoke(tmp_path):
    out = tmp_path / "low_precision.json"
    low_precision.main(["--smoke", "--out", str(out)])
    results = {r["variant"]: r for r in _load(out)["results"]}
    assert set(results) == set(low_precision.VARIANTS)
    total = {name: r["total_bytes_per_param"] for name, r in results.items()}
    n = results["float32_master"]["n_params"]
    # Exact from the arrays: per-param bytes plus a few fixed scalars over n params.
    for name, per_param in [
        ("float32_master", 12),
        ("optax_mu_dtype_bf16", 10),
        ("bf16_params_f32_state", 10),
        ("bf16_nearest", 6),
        ("bf16_stochastic", 6),
        ("bf16_kahan", 8),
        ("bf16_kahan_f32_state", 12),
        ("f16_stochastic", 6),
    ]:
        fixed = results[name]["state_fixed_bytes"]
        assert per_param <= total[name] <= per_param + fixed / n + 1e-9, name
    for r in results.values():
        assert _positive(r["median_s"]) and _positive(r["ratio_median"])
        for kind in ("update", "step"):  # the optimizer alone, and a whole training step
            timed = r[kind]
            assert len(timed["per_step_s"]) == len(timed["per_step_cpu_s"]) == 3
            assert _positive(timed["ratio_median"]) and _positive(timed["ratio_cpu"])
    assert results["float32_master"]["ratio_median"] == 1.0
    assert results["float32_master"]["update"]["ratio_cpu"] == 1.0


@pytest.mark.slow  # 8-device GPT programs; test_fp8_sharding.py asserts this in CI
def test_fp8_wire_smoke(tmp_path):
    # 8 CPU devices must be forced before jax is imported: a fresh interpreter.
    import os
    import subprocess
    import sys

    out = tmp_path / "fp8_wire.json"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
        "JAX_PLATFORMS": "cpu",
    }
    cmd = [sys.executable, "-m", "benchmarks.fp8_wire", "--smoke", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (result,) = json.loads(out.read_text())["results"].values()
    # The GPT's 7 matmul weights: each gathered once in float8, their amaxes in one all-reduce.
    assert result["float8_weight_gathers"] == 7
    assert result["fused_weight_amax_all_reduces"] == 1
    assert result["fused_weight_amaxes"] == [[7]]
    assert 0 < result["gather_bytes_per_param"]["float8_e4m3fn"] <= 1.1
    assert set(result["gradient_reduce_bytes_per_param"]) >= {"float32"}


@pytest.mark.slow  # four partitioned GPT programs compiled on 8 CPU devices
def test_comm_bytes_smoke_reports_both_layouts(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "comm_bytes.json"
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    env["JAX_PLATFORMS"] = "cpu"
    root = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "benchmarks.comm_bytes", "--smoke", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    payload = _load(out)
    rows = {(r["layout"], r["setting"]): r["partitioned"] for r in payload["results"]}
    assert set(rows) == {(lay, s) for lay in ("fsdp", "tp") for s in ("float32", "autocast_bf16")}
    f32 = rows[("fsdp", "float32")]
    # float32 FSDP: floating collectives only in float32 (token ids may move as int32),
    # each weight gathered and reduced.
    floating = [k for k in f32["by_kind_dtype"] if "float" in k]
    assert floating and all(k.endswith("/float32") for k in floating)
    assert f32["gather_B_per_param"] >= 3.5 and f32["reduce_B_per_param"] >= 3.5
    # Tensor parallel replicates the batch: reductions of activations, no weight gathers.
    assert rows[("tp", "float32")]["gather_B_per_param"] == 0
    assert rows[("tp", "float32")]["reduce_B_per_param"] > 0
