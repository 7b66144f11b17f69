"""Every capability on every model of the zoo (tests/zoo.py), under jit.

Each capability is tested deeply on its own data in tests/unit/; this file runs the cross
product of capabilities and real models, where two regressions in the defaults once hid
(an FP8 pre-pass that crashed on ``jax.nn.relu``, a typed key closed over by an outer
``jit``). Every cell checks at least that it runs, that what it returns is finite and that
the dtypes are the documented ones; where an oracle is cheap it is checked too (a float32
reference, bit-identical skips). tests/README.md has the table of which capability runs
on which model; ``communication_report`` runs on 8 devices in one subprocess
(``test_communication_on_8_devices``).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp
from jaxamp._fp8 import names
from tests import zoo
from tests.helpers import bits, rel_err, run_with_devices

pytest.importorskip("haiku")
pytest.importorskip("equinox")

F32 = np.dtype(np.float32)
# XLA's cheapest compile: the matrix checks what jaxamp builds, not what XLA's
# optimizations make of it, and compiling is most of its time (a third with these).
jit = functools.partial(
    jax.jit,
    compiler_options={
        "xla_backend_optimization_level": 0,
        "xla_llvm_disable_expensive_passes": True,
    },
)
# Each preset's documented matmul operand dtype, and how far its loss and gradients
# may be from float32's (relative; measured at a few times the largest seen on the zoo).
SIXTEEN_BIT = {"mixed_bfloat16": ("bfloat16", 0.03), "mixed_float16": ("float16", 0.02)}
FP8_SPECS = {
    "mixed_float8": jaxamp.Float8Recipe(),
    **{s: jaxamp.Float8Recipe(scaling=s) for s in names("fp8") if s != "tensorwise"},
}
FP8_TOL = 0.25
# FP4: the loss within 10% of float32's, the gradients (rounded stochastically) within
# 75% in norm (up to 0.5 measured on the zoo); what stays 16-bit by design: convolutions
# and products of two activations (attention).
FP4_SPECS = ("mixed_nvfp4", "mixed_mxfp4")
FP4_LOSS_TOL, FP4_GRAD_TOL = 0.1, 0.75
STAYS_16_BIT = {
    "linen_cnn": {"conv_general_dilated"},
    "gpt": {"dot_general"},
}


def _finite(tree) -> bool:
    return all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(tree))


@functools.cache
def _reference(name: str):
    """The float32 loss and gradients of the zoo's model ``name``."""
    m = zoo.model(name)
    return jit(jax.value_and_grad(zoo.closed_loss(m)))(m.params)


def _grad_error(got, want) -> float:
    g, w = (
        np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(t)])
        for t in (got, want)
    )
    return float(np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-30))


def _autocast_step(m: zoo.Model, spec, closed: bool = True):
    """loss and grads of ``m`` under ``autocast(loss, spec)``, the batch closed over or not."""
    if closed:
        fun = jaxamp.autocast(zoo.closed_loss(m), spec)
        return jit(jax.value_and_grad(fun))(m.params)
    fun = jaxamp.autocast(m.loss, spec)
    return jit(jax.value_and_grad(fun))(m.params, *m.batch)


def _check_step(m: zoo.Model, loss, grads, tol: float) -> None:
    assert loss.dtype == F32 and _finite(loss), loss
    assert jax.tree.structure(grads) == jax.tree.structure(m.params)
    assert {x.dtype for x in jax.tree.leaves(grads)} == {F32}
    assert _finite(grads), m.name
    ref_loss, ref_grads = _reference(m.name)
    assert rel_err(loss, ref_loss) <= tol, (float(loss), float(ref_loss))
    assert _grad_error(grads, ref_grads) <= tol, _grad_error(grads, ref_grads)


@pytest.mark.parametrize("preset", sorted(SIXTEEN_BIT))
@pytest.mark.parametrize("name", zoo.NAMES)
def test_autocast_16_bit(name, preset):
    m = zoo.model(name)
    dtype, tol = SIXTEEN_BIT[preset]
    loss, grads = _autocast_step(m, preset)
    _check_step(m, loss, grads, tol)
    report = jaxamp.precision_report(jaxamp.autocast(zoo.closed_loss(m), preset), m.params)
    assert report.matmuls
    assert {mm.operand_dtypes for mm in report.matmuls} == {(dtype, dtype)}, report
    assert {mm.accumulation_dtype for mm in report.matmuls} == {"float32"}
    if preset != "mixed_bfloat16":
        return
    # The batch (and its key) as arguments rather than constants: the same step, up to
    # what XLA's constant folding changes in float32 (the plain float32 step too).
    loss_args, grads_args = _autocast_step(m, preset, closed=False)
    assert rel_err(loss_args, loss) <= 1e-5 and _grad_error(grads_args, grads) <= 1e-3


@pytest.mark.parametrize("spec", sorted(FP8_SPECS))
@pytest.mark.parametrize("name", zoo.NAMES)
def test_autocast_fp8(name, spec):
    m = zoo.model(name)
    recipe = FP8_SPECS[spec]
    loss, grads = _autocast_step(m, spec if spec == "mixed_float8" else recipe)
    _check_step(m, loss, grads, FP8_TOL)
    report = jaxamp.precision_report(jaxamp.autocast(zoo.closed_loss(m), recipe), m.params)
    e4m3 = ("float8_e4m3fn", "float8_e4m3fn")
    assert report.matmuls and {mm.operand_dtypes for mm in report.matmuls} == {e4m3}, report
    scalings = {mm.fp8_recipe for mm in report.matmuls}
    want = {recipe.scaling} | ({"tensorwise"} if m.convolutions else set())
    assert scalings == want, scalings


@pytest.mark.parametrize("spec", FP4_SPECS)
@pytest.mark.parametrize("name", zoo.NAMES)
def test_autocast_fp4(name, spec):
    m = zoo.model(name)
    loss, grads = _autocast_step(m, spec)
    assert loss.dtype == F32 and _finite(loss) and _finite(grads)
    assert {x.dtype for x in jax.tree.leaves(grads)} == {F32}
    ref_loss, ref_grads = _reference(m.name)
    assert rel_err(loss, ref_loss) <= FP4_LOSS_TOL, (float(loss), float(ref_loss))
    assert _grad_error(grads, ref_grads) <= FP4_GRAD_TOL
    report = jaxamp.precision_report(jaxamp.autocast(zoo.closed_loss(m), spec), m.params)
    fp4 = ("float4_e2m1fn", "float4_e2m1fn")
    low = {mm.fp8_recipe for mm in report.matmuls if mm.operand_dtypes == fp4}
    assert low == {spec.removeprefix("mixed_")}, report
    rest = {(mm.primitive, mm.operand_dtypes) for mm in report.matmuls if mm.operand_dtypes != fp4}
    assert rest == {(p, ("bfloat16", "bfloat16")) for p in STAYS_16_BIT.get(name, ())}, rest


@pytest.mark.parametrize("name", zoo.NAMES)
def test_numerics_report(name):
    m = zoo.model(name)
    report = jaxamp.numerics_report(m.loss, m.params, *m.batch, policy="mixed_float16", grad=True)
    assert report.first_nonfinite is None, report
    assert {op.phase for op in report.ops} == {"forward", "backward"}
    # A matmul's op is its float32 accumulation; the policy's float16 values are the rest.
    matmuls = ("dot_general", "conv_general_dilated")
    assert any(op.primitive in matmuls for op in report.ops)
    assert np.dtype(np.float16) in {op.dtype for op in report.ops}
    assert all(op.nonfinite == 0 for op in report.ops)
    assert report.suggested_loss_scale is not None and report.suggested_loss_scale >= 1.0


def _monitored_steps(m, policy: str, steps: int = 3) -> tuple[list, Any]:
    """``steps`` jitted SGD steps under ``policy`` with a monitor firing every second step.

    Returns the monitor's ``(step, report)`` pairs and the final params.
    """
    seen = []
    monitor = jaxamp.numerics_monitor(
        m.loss, every=2, policy=policy, grad=True, callback=lambda s, r: seen.append((s, r))
    )
    loss = jaxamp.autocast(zoo.closed_loss(m), policy)

    @jit
    def step(i, params):
        monitor(i, params, *m.batch)  # the batch and its key are constants of this trace
        grads = jax.grad(loss)(params)
        return jax.tree.map(lambda p, g: p - 0.01 * g, params, grads)

    params = m.params
    for i in range(steps):
        params = step(i, params)
    jax.effects_barrier()
    return seen, params


@pytest.mark.parametrize("name", zoo.NAMES)
def test_numerics_monitor_in_a_jitted_step(name):
    seen, params = _monitored_steps(zoo.model(name), "mixed_float16")
    assert [s for s, _ in seen] == [0, 2]
    assert all(r.first_nonfinite is None for _, r in seen)
    assert _finite(params)


@pytest.mark.parametrize("name", zoo.NAMES)
def test_numerics_monitor_from_the_host_loop(name):
    # The monitor called from the host loop, around a plain jitted step: reports on
    # the asked steps, the first one the report numerics_report gives on those params.
    m = zoo.model(name)
    seen = []

    def callback(step, report):
        seen.append((step, report))

    monitor = jaxamp.numerics_monitor(
        m.loss, every=2, policy="mixed_float16", grad=True, callback=callback
    )
    loss = jaxamp.autocast(zoo.closed_loss(m), "mixed_float16")
    step = jit(lambda p: jax.tree.map(lambda a, g: a - 0.01 * g, p, jax.grad(loss)(p)))
    params = m.params
    for i in range(3):
        monitor(i, params, *m.batch)
        params = step(params)
    monitor.flush()
    assert [s for s, _ in seen] == [0, 2]
    expected = jaxamp.numerics_report(m.loss, m.params, *m.batch, policy="mixed_float16", grad=True)
    assert seen[0][1] == expected
    assert all(r.first_nonfinite is None for _, r in seen)
    assert _finite(params)


# MXFP4 compiles a few times slower here: with -m slow (its report: tests/unit).
@pytest.mark.parametrize(
    "spec", ["mixed_nvfp4", pytest.param("mixed_mxfp4", marks=pytest.mark.slow)]
)
def test_numerics_monitor_fp4_in_a_jitted_step(spec):
    # Each FP4 quantization is one op, its float4 codes, with the input's amax and the
    # scales, measured inside the caller's jitted step.
    seen, params = _monitored_steps(zoo.model("nnx_mlp"), spec)
    assert [s for s, _ in seen] == [0, 2]
    for _, report in seen:
        assert report.first_nonfinite is None
        small = [op for op in report.ops if jnp.finfo(op.dtype).bits <= 8]
        assert small and small == report.fp4_quantizations
        assert {op.quantization for op in small} == {spec.removeprefix("mixed_")}
        assert {op.phase for op in small} >= {"forward", "backward"}
        assert all(op.amax > 0 and op.tensor_scale > 0 for op in small)
        assert all(0 < op.block_scale_max <= 448 for op in small)
    assert _finite(params)


def _loss_scaled_trajectory(loss, params, loss_scale, steps: int = 3):
    tx = jaxamp.loss_scaling(optax.sgd(0.05), loss_scale)

    def step(carry, _):
        params, opt_state = carry
        scale = jaxamp.get_loss_scale(opt_state)
        value, grads = jaxamp.scaled_value_and_grad(loss, scale)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), value

    run = jit(lambda p: jax.lax.scan(step, (p, tx.init(p)), length=steps))
    return run(params)


@pytest.mark.parametrize("name", zoo.NAMES)
def test_loss_scaling_steps(name):
    m = zoo.model(name)
    loss = jaxamp.autocast(zoo.closed_loss(m), "mixed_float16")
    (params, state), losses = _loss_scaled_trajectory(
        loss, m.params, jaxamp.DynamicLossScale(loss_scale=2.0**8)
    )
    assert jaxamp.loss_scaling_metrics(state)["skipped_steps"] == 0
    assert _finite(losses) and _finite(params)
    assert {x.dtype for x in jax.tree.leaves(params)} == {F32}
    (_, _), ref = _loss_scaled_trajectory(
        zoo.closed_loss(m), m.params, jaxamp.DynamicLossScale(loss_scale=2.0**8)
    )
    assert rel_err(losses, ref) <= 0.01
    # A scale that overflows float16 skips every step: params bit-identical, scale halved.
    (params, state), _ = _loss_scaled_trajectory(
        loss, m.params, jaxamp.DynamicLossScale(loss_scale=2.0**100), steps=1
    )
    assert bits(params) == bits(m.params)
    metrics = jaxamp.loss_scaling_metrics(state)
    assert metrics["skipped_steps"] == 1 and float(metrics["loss_scale"]) == 2.0**99


@pytest.mark.parametrize("name", zoo.NAMES)
def test_low_precision_optimizer(name):
    m = zoo.model(name)
    params = jaxamp.cast_floating(m.params, jnp.bfloat16)
    tx = jaxamp.low_precision_optimizer(optax.sgd(0.05, momentum=0.5))
    loss = jaxamp.autocast(zoo.closed_loss(m, jnp.bfloat16), "mixed_bfloat16")

    @jit
    def step(params, state):
        value, grads = jax.value_and_grad(loss)(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    state = tx.init(params)
    new, state, value = step(params, state)
    new, state, value = step(new, state)
    assert value.dtype == F32 and _finite(value)
    assert {x.dtype for x in jax.tree.leaves(new)} == {np.dtype(jnp.bfloat16)}
    assert _finite(new) and bits(new) != bits(params)


# ----------------------------------------------------------------- 8 devices


# FSDP: each weight sharded on the input dim of its forward product where 8 divides it
# (flax and haiku kernels are [in, out], equinox's [out, in]), so that the partitioner
# gathers it before its use rather than reducing partial products.
SHARDED = {
    "nnx_mlp": lambda x: range(x.ndim),
    "equinox_mlp": lambda x: reversed(range(x.ndim)),
    "gpt": lambda x: range(x.ndim),
}


def _sharded(tree, mesh, dims):
    """Each array of ``tree`` sharded on the first of ``dims(x)`` that 8 divides, else not."""
    from jax.sharding import NamedSharding, PartitionSpec

    def place(x):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            return x
        spec = [None] * x.ndim
        for d in dims(x):
            if x.shape[d] % mesh.size == 0:
                spec[d] = "d"
                break
        return jax.device_put(x, NamedSharding(mesh, PartitionSpec(*spec)))

    return jax.tree.map(place, tree)


def _communication_worker() -> dict:
    """FSDP with data parallelism: weights and the batch sharded on the one mesh axis."""
    from jaxamp.testing import assert_reduces_in

    mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    out = {}
    for name, dims in SHARDED.items():
        m = zoo.model(name)
        params = _sharded(m.params, mesh, dims)
        batch = _sharded(m.batch, mesh, lambda x: range(min(x.ndim, 1)))
        for spec, gather in GATHER_DTYPES.items():
            if name not in ONLY_ON.get(spec, (name,)):
                continue
            report = jaxamp.communication_report(
                jax.grad(jaxamp.autocast(m.loss, spec)), params, *batch
            )
            assert_reduces_in(report, jnp.float32)
            small = {id(c) for c in report.small_gathers}  # norm scales, biases
            gathers = [
                c
                for c in report.collectives
                if c.kind == "all-gather" and c.parameter and id(c) not in small
            ]
            out[f"{name}/{spec}"] = {
                "sharded": sum(not x.sharding.is_fully_replicated for x in jax.tree.leaves(params)),
                "gathered": len({c.parameter for c in gathers}),
                "other_dtypes": sorted(
                    {f"{c.parameter}: {c.dtype.name}" for c in gathers if c.dtype != gather}
                ),
                # Bytes per element on the wire, per gathered dtype (float4: half a byte).
                "bytes_per_element": {
                    c.dtype.name: c.bytes / math.prod(c.shape)
                    for c in gathers
                    if c.shape and not c.staged
                },
            }
    return out


GATHER_DTYPES = {
    "mixed_bfloat16": np.dtype(jnp.bfloat16),
    "mixed_float8": np.dtype(jnp.float8_e4m3fn),
    # Measured, not designed: each device quantizes its own shard of a weight
    # (NVFP4's per-tensor amax is one all-reduce of the shards' amaxes), and the
    # SPMD partitioner gathers the E2M1 codes, not the bfloat16 weight. Their
    # block scales travel as float32 vectors beside them.
    "mixed_nvfp4": np.dtype(jnp.float4_e2m1fn),
}
# Recipes measured on some models only: FP4's compile time on 8 devices is the
# matrix's largest; the GPT has every kind of weight (embeddings, attention, MLP).
ONLY_ON = {"mixed_nvfp4": ("gpt",)}
# Gathers (of more than a small vector) in another dtype than the policy's. On purpose:
# a norm's scale and bias multiply float32 statistics (float32); under FP8 a bias and an
# embedding are not matmul operands (the compute dtype). Not yet otherwise: the attention
# output kernel [heads, head_dim, d] has two contracting dims, merged by a reshape after
# its shard is gathered, and is quantized after that.
_NORM = ["params['norm']['bias'].value: float32", "params['norm']['scale'].value: float32"]
_ATTENTION = "params['_Block_0']['MultiHeadDotProductAttention_0']"
OTHER_GATHERS = {
    "nnx_mlp/mixed_bfloat16": _NORM,
    "nnx_mlp/mixed_float8": ["params['l1']['bias'].value: bfloat16", *_NORM],
    "gpt/mixed_float8": [
        "params['Embed_0']['embedding']: bfloat16",
        f"{_ATTENTION}['key']['bias']: bfloat16",
        f"{_ATTENTION}['out']['kernel']: float32",
        f"{_ATTENTION}['query']['bias']: bfloat16",
        f"{_ATTENTION}['value']['bias']: bfloat16",
        "params['pos_embedding']: bfloat16",
    ],
}
# NVFP4 as FP8: the embeddings and biases are no matmul operands, and the
# attention output kernel is gathered before its reshape, then quantized.
OTHER_GATHERS["gpt/mixed_nvfp4"] = OTHER_GATHERS["gpt/mixed_float8"]


def test_communication_on_8_devices():
    out = run_with_devices(__file__, 8)
    assert set(out) == {
        f"{n}/{s}" for n in SHARDED for s in GATHER_DTYPES if n in ONLY_ON.get(s, (n,))
    }
    for key, cell in out.items():
        assert cell["sharded"] > 0 and cell["gathered"] > 0, (key, cell)
        assert cell["other_dtypes"] == OTHER_GATHERS.get(key, []), (key, cell)
        for dtype, size in cell["bytes_per_element"].items():
            expected = 0.5 if dtype == "float4_e2m1fn" else np.dtype(getattr(jnp, dtype)).itemsize
            assert size == expected, (key, dtype, cell)
    assert out["gpt/mixed_nvfp4"]["bytes_per_element"]["float4_e2m1fn"] == 0.5


if __name__ == "__main__":
    import json

    print(json.dumps(_communication_worker()))
