"""``policy.cast_to_compute`` under an explicit mesh reduces weight gradients in ``reduce_dtype``.

On a mesh of ``AxisType.Explicit`` axes the cast gathers each FSDP shard in
``gather_dtype`` and types the leaves products read (``matmul_operands``) as
``reduced``, so their gradients are summed at the cast's transpose, after it
widened them to float32. A GPT (``benchmarks._models.OneHotGPT``, the
benchmarks' smoke size: 42,880 parameters) takes one FSDP step on 8 CPU devices
(this file run as a script); the tests read its partitioned program
(``communication_report``) and compare its gradients with the one-device
hand-cast step's. Skipped on a JAX whose ``PartitionSpec`` has no ``reduced``. The
warning under an ``Auto`` mesh, which names the explicit mesh, is checked in
``test_wire_warnings.py``.
"""

import functools
import json
import warnings

import pytest

from tests.helpers import run_with_devices

N_DEVICES = 8
# The one-device bfloat16 step rounds each weight gradient's batch sum once, the
# sharded one each device's part: both are 1-3% from the float32 gradient.
BF16_TOL = 5e-2


def _products_read(path, x):
    # The GPT's matrices but for attention biases ([heads, head_dim]): those are added.
    return x.ndim >= 2 and getattr(path[-1], "key", None) != "bias"


def _gpt():
    from benchmarks._models import GPTConfig, OneHotGPT, gpt_batch, gpt_init, gpt_loss_fn

    config = GPTConfig(vocab=64, seq=16, d_model=64, n_heads=8, d_ff=128, n_layers=1, batch=8)
    model = OneHotGPT(config, dtype=None)  # each layer computes in the cast params' dtype
    params = gpt_init(model, config)
    return gpt_loss_fn(model), params, gpt_batch(config)


def _grad_step(loss, policy, matmul_operands):
    import jax

    def grads(params, batch):
        cast = lambda p: policy.cast_to_compute(p, matmul_operands=matmul_operands)  # noqa: E731
        return jax.grad(lambda p: loss(cast(p), batch))(params)

    return jax.jit(grads)


def _report(step, params, batch):
    import jaxamp

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = jaxamp.communication_report(step, params, batch)
    messages = [str(c.message) for c in caught if issubclass(c.category, jaxamp.WireDtypeWarning)]
    return report, messages


def _summary(report, messages):
    reductions = [
        c for c in report.collectives if c.kind in ("all-reduce", "reduce-scatter") and c.shape
    ]
    by_dtype = {}
    for c in reductions:
        by_dtype[c.dtype.name] = by_dtype.get(c.dtype.name, 0.0) + c.bytes / report.param_count
    gathers = {c.dtype.name for c in report.collectives if c.kind == "all-gather"}
    return {
        "reduce_B_per_param": {k: round(v, 4) for k, v in by_dtype.items()},
        "gathered_in": sorted(gathers),
        "warnings": messages,
    }


def _rel_errs(grads, want):
    """Each leaf's largest error relative to its largest element, by path.

    The key bias's gradient is zero in exact arithmetic (a softmax ignores a shift
    shared by all keys): its rounding noise is measured against the tree's largest
    element instead.
    """
    import jax
    import numpy as np

    scale = max(float(np.abs(np.asarray(w)).max()) for w in jax.tree.leaves(want))
    return {
        jax.tree_util.keystr(path): float(
            np.abs(np.asarray(g) - np.asarray(w)).max()
            / max(float(np.abs(np.asarray(w)).max()), 1e-1 * scale)
        )
        for (path, g), w in zip(
            jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(want), strict=True
        )
    }


def _worker() -> dict:
    import jax
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxamp
    from benchmarks._sharding import param_specs
    from jaxamp._engine import _compat as compat

    # Standard promotion, as the benchmarks run this GPT: Flax's LayerNorm with dtype=None
    # promotes its bfloat16 input with float32.
    if not compat.has_reduced_types():
        return {"skipped": f"jax {jax.__version__}: PartitionSpec has no reduced="}
    loss, params, batch = _gpt()
    policy = jaxamp.get_policy("mixed_bfloat16")
    one_device = jax.jit(jax.grad(lambda p, b: loss(policy.cast_to_compute(p), b)))(params, batch)
    out = {}
    cases = {
        "Explicit, matmul_operands": (AxisType.Explicit, _products_read, policy),
        "Explicit, no matmul_operands": (AxisType.Explicit, None, policy),
        "Explicit, gather=float32": (
            AxisType.Explicit,
            _products_read,
            policy.with_gather_dtype("float32"),
        ),
    }
    specs = param_specs(params, "fsdp", N_DEVICES)
    for name, (axis_type, operands, pol) in cases.items():
        mesh = jax.make_mesh((N_DEVICES,), ("d",), axis_types=(axis_type,))
        shardings = jax.tree.map(functools.partial(NamedSharding, mesh), specs)
        with jax.set_mesh(mesh):
            sharded = jax.device_put(params, shardings)
            tokens = jax.device_put(batch, NamedSharding(mesh, P("d")))
            step = _grad_step(loss, pol, operands)
            out[name] = _summary(*_report(step, sharded, tokens))
            if name == "Explicit, matmul_operands":
                grads = step(sharded, tokens)
                out[name]["rel_err"] = _rel_errs(grads, one_device)
                out[name]["grads_sharded_like_params"] = all(
                    g.sharding.spec == s
                    for g, s in zip(jax.tree.leaves(grads), jax.tree.leaves(specs), strict=True)
                )
    return out


@pytest.fixture(scope="module")
def measured():
    out = run_with_devices(__file__, N_DEVICES)
    if "skipped" in out:
        pytest.skip(out["skipped"])
    return out


def test_weight_gradients_are_reduced_in_float32_under_an_explicit_mesh(measured):
    case = measured["Explicit, matmul_operands"]
    # The GPT's matrices: 4 B/param in float32; its biases and norm params (0.02 B/param)
    # are reduced by the additions that read them, in bfloat16.
    assert 3.8 <= case["reduce_B_per_param"]["float32"] <= 4.2, case
    assert case["reduce_B_per_param"].get("bfloat16", 0.0) < 0.05, case
    assert case["gathered_in"] == ["bfloat16"], case
    assert case["warnings"] == [], case


def test_sharded_gradients_equal_the_one_device_gradients(measured):
    case = measured["Explicit, matmul_operands"]
    assert max(case["rel_err"].values()) <= BF16_TOL, case["rel_err"]
    assert case["grads_sharded_like_params"], case


def test_gather_dtype_is_honoured_under_an_explicit_mesh(measured):
    case = measured["Explicit, gather=float32"]
    assert case["gathered_in"] == ["float32"], case
    assert 3.8 <= case["reduce_B_per_param"]["float32"] <= 4.2, case
    assert case["warnings"] == [], case


def test_without_matmul_operands_it_warns_and_reduces_in_bfloat16(measured):
    case = measured["Explicit, no matmul_operands"]
    assert case["reduce_B_per_param"].get("float32", 0.0) < 0.05, case
    assert len(case["warnings"]) == 1, case
    assert "matmul_operands" in case["warnings"][0], case
    assert "explicit mesh" in case["warnings"][0], case


if __name__ == "__main__":
    print(json.dumps(_worker()))
