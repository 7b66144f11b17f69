"""The native form of mxfp8 products (``jax.nn.scaled_matmul``) against the emulated one.

Both forms quantize with the same code, so they multiply the same float8 values
with the same power-of-two scales: they differ only in the order the float32
sums are taken (one GEMM over K against one partial product per block of 32,
scaled and summed). Forward results (rounded once to bfloat16) therefore match
the reference to half a bfloat16 ulp and gradients to float32 accuracy, like the
emulated form; ``jax.nn.scaled_dot_general`` (JAX's own MX quantizer, written
from the E8M0 bits) is a second, independent oracle. Running the native form
on CPU needs jax 0.12's CPU lowering of ``scaled_matmul``; its selection, its
jaxpr and its CUDA lowering are checked on every supported JAX.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxamp
from jaxamp._engine._visit import walk
from jaxamp._fp8 import _native
from tests import fp8_reference as ref
from tests.helpers import bits
from tests.unit.test_fp8 import _rand, assert_bf16_of, assert_f32_of

NATIVE = jaxamp.Float8Recipe("mxfp8", gemm="native")
EMULATED = jaxamp.Float8Recipe("mxfp8", gemm="emulated")
runs_native = pytest.mark.skipif(
    not _native.native_lowers(jax.default_backend()),
    reason=f"jax {jax.__version__} cannot lower jax.nn.scaled_matmul for this backend",
)


def _matmul_and_grads(recipe, x, w, g):
    mm = jaxamp.autocast(lambda x, w: x @ w, recipe)
    out = jax.jit(mm)(x, w)
    grads = jax.jit(jax.grad(lambda x, w: jnp.sum(mm(x, w) * g), argnums=(0, 1)))(x, w)
    return out, *grads


@pytest.fixture
def blackwell(monkeypatch):
    """Makes ``gemm="auto"`` see a GPU of compute capability 10.0 (tracing only)."""
    monkeypatch.setattr(_native, "platform", lambda: ("gpu", 10.0))


@runs_native
@pytest.mark.parametrize(
    "shape", [(5, 130, 7), (3, 20, 40), pytest.param((16, 256, 128), marks=pytest.mark.slow)]
)
def test_native_matches_the_reference_and_the_emulated_form(shape):
    m, k, n = shape
    x, w, g = _rand(0, (m, k)), _rand(1, (k, n), 0.05), _rand(2, (m, n))
    x[0] *= 100.0  # one outlier row: its blocks get their own scales
    native = _matmul_and_grads(NATIVE, x, w, g)
    emulated = _matmul_and_grads(EMULATED, x, w, g)
    assert_bf16_of(native[0], ref.forward(x, w, "mxfp8"))
    g16 = g.astype(ml_dtypes.bfloat16).astype(np.float32)
    for got, want in zip(native[1:], ref.gradients(x, w, g16, "mxfp8"), strict=True):
        assert_f32_of(got, want)
    # The same float8 values and scales: at most a float32 rounding apart.
    assert np.asarray(native[0]).dtype == np.asarray(emulated[0]).dtype
    for a, b in zip(native, emulated, strict=True):
        assert_f32_of(a, b)


@runs_native
def test_native_agrees_with_jax_scaled_dot_general():
    # JAX's own MX quantizer (scale 2**ceil(log2(amax / 448)) from the float32
    # bits) on nonzero blocks, every dim a multiple of 32, e4m3 in both passes.
    x, w, g = _rand(3, (64, 96)), _rand(4, (96, 32), 0.05), _rand(5, (64, 32))
    e4m3 = jaxamp.Float8Recipe("mxfp8", gradient_dtype=jnp.float8_e4m3fn, gemm="native")
    out, dx, dw = _matmul_and_grads(e4m3, x, w, g)
    configs = [jax.nn.get_scaled_dot_general_config("mxfp8")] * 3
    numbers = (((1,), (0,)), ((), ()))

    def jax_mx(x, w):
        return jax.nn.scaled_dot_general(x, w, numbers, configs=configs)

    @jax.jit
    def oracle(x, w, g):
        out, pullback = jax.vjp(jax_mx, x, w)
        return out, *pullback(g.astype(jnp.bfloat16).astype(jnp.float32))

    want, want_dx, want_dw = oracle(jnp.asarray(x), jnp.asarray(w), jnp.asarray(g))
    assert_bf16_of(out, want)
    assert_f32_of(dx, want_dx)
    assert_f32_of(dw, want_dw)


@runs_native
def test_native_zeros_and_non_finite_operands():
    f = jax.jit(jaxamp.autocast(lambda x, w: x @ w, NATIVE))
    x, w = _rand(6, (4, 64)), _rand(7, (64, 8))
    x[1, :32] = 0.0  # an all-zero block: scale 1, exact zeros, no NaN
    got = np.asarray(f(x, w))
    assert np.all(np.isfinite(got))
    assert_bf16_of(got, ref.forward(x, w, "mxfp8"))
    np.testing.assert_array_equal(np.asarray(f(np.zeros_like(x), w)), 0.0)
    for bad in (np.inf, np.nan):
        xb = x.copy()
        xb[2, 40] = bad
        assert not np.all(np.isfinite(np.asarray(f(xb, w))[2])), bad


@pytest.mark.parametrize(
    ("recipe", "where", "native"),
    [
        (jaxamp.Float8Recipe("mxfp8"), ("gpu", 10.0), True),
        (jaxamp.Float8Recipe("mxfp8"), ("gpu", 12.0), True),
        (jaxamp.Float8Recipe("mxfp8"), ("gpu", 9.0), False),  # Hopper: no MX Tensor Cores
        (jaxamp.Float8Recipe("mxfp8"), ("cpu", 0.0), False),
        (jaxamp.Float8Recipe("mxfp8"), ("tpu", 0.0), False),
        (EMULATED, ("gpu", 10.0), False),
        (jaxamp.Float8Recipe("blockwise"), ("gpu", 10.0), False),
        (jaxamp.Float8Recipe("tensorwise"), ("gpu", 10.0), False),
        (NATIVE, ("gpu", 9.0), True),
    ],
)
def test_auto_picks_native_on_blackwell_only(monkeypatch, recipe, where, native):
    monkeypatch.setattr(_native, "platform", lambda: where)
    monkeypatch.setattr(_native, "native_lowers", lambda backend: True)
    assert _native.uses_native(recipe) is native


def test_forcing_native_where_it_cannot_lower_names_the_field_and_the_fix(monkeypatch):
    monkeypatch.setattr(_native, "native_lowers", lambda backend: False)
    x, w = jnp.ones((4, 64)), jnp.ones((64, 8))
    with pytest.raises(ValueError, match=r"gemm='native'.*gemm='auto'.*gemm='emulated'"):
        jax.make_jaxpr(jaxamp.autocast(lambda x, w: x @ w, NATIVE))(x, w)


def test_cpu_runs_the_emulated_form_by_default():
    if _native.platform()[0] == "gpu":
        pytest.skip("checks the CPU default")
    x, w = _rand(8, (8, 100)), _rand(9, (100, 16))
    auto = jax.jit(jaxamp.autocast(lambda x, w: x @ w, jaxamp.Float8Recipe("mxfp8")))(x, w)
    emulated = jax.jit(jaxamp.autocast(lambda x, w: x @ w, EMULATED))(x, w)
    assert bits(auto) == bits(emulated)


def _products(recipe, x, w):
    mm = jaxamp.autocast(lambda x, w: x @ w, recipe)
    f = jax.value_and_grad(lambda x, w: jnp.sum(mm(x, w)), (0, 1))
    return f, [e for e, _ in walk(jax.make_jaxpr(f)(x, w).jaxpr)]


def test_jaxpr_of_each_form(blackwell):
    x, w = jnp.ones((32, 256)), jnp.ones((256, 32))
    f, eqns = _products(jaxamp.Float8Recipe("mxfp8"), x, w)
    native = [e for e in eqns if e.primitive.name == "scaled_matmul_wrapper"]
    assert not [e for e in eqns if e.primitive.name == "dot_general"]
    # Forward e4m3 x e4m3, both backward products e5m2 x e4m3; E8M0 scales, float32 out.
    assert sorted(tuple(v.aval.dtype.name for v in e.invars) for e in native) == [
        ("float8_e4m3fn", "float8_e4m3fn", "float8_e8m0fnu", "float8_e8m0fnu"),
        ("float8_e5m2", "float8_e4m3fn", "float8_e8m0fnu", "float8_e8m0fnu"),
        ("float8_e5m2", "float8_e4m3fn", "float8_e8m0fnu", "float8_e8m0fnu"),
    ]
    assert all(e.params["preferred_element_type"] == np.float32 for e in native)
    report = jaxamp.precision_report(f, x, w)
    assert {m.primitive for m in report.matmuls} == {"scaled_matmul_wrapper"}
    assert {m.fp8_recipe for m in report.matmuls} == {"mxfp8"}
    assert report.fp8_fraction == 1.0
    assert report.total_flops == 3 * 2 * 32 * 256 * 32

    _, eqns = _products(EMULATED, x, w)
    assert not [e for e in eqns if e.primitive.name == "scaled_matmul_wrapper"]
    dots = [e for e in eqns if e.primitive.name == "dot_general"]
    assert len(dots) == 3
    assert all(e.invars[0].aval.dtype.itemsize == 1 for e in dots)


def test_native_form_lowers_to_the_cudnn_block_scaled_dot_on_cuda(blackwell):
    # What XLA:GPU receives: its MXFP8 custom call (cuDNN on Blackwell), no float8 dot.
    x, w = jnp.ones((16, 256)), jnp.ones((256, 32))
    f, _ = _products(jaxamp.Float8Recipe("mxfp8"), x, w)
    text = jax.jit(f).trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
    calls = [line for line in text.splitlines() if "custom_call @__op$block_scaled_dot" in line]
    assert len(calls) == 3
    assert all("f8E8M0FNU" in c and "xf32>" in c.split("->")[-1] for c in calls)
    assert not [ln for ln in text.splitlines() if "dot_general" in ln and "f8E" in ln]


def test_recipe_field_and_its_errors():
    assert jaxamp.Float8Recipe("mxfp8").gemm == "auto"
    assert str(NATIVE) == "fp8:mxfp8,native" and str(jaxamp.Float8Recipe("mxfp8")) == "fp8:mxfp8"
    assert "gemm='native'" in repr(NATIVE)
    assert NATIVE != EMULATED and dataclasses.replace(NATIVE, gemm="emulated") == EMULATED
    with pytest.raises(ValueError, match=r"gemm=.*'auto', 'native', 'emulated'.*'fast'"):
        jaxamp.Float8Recipe("mxfp8", gemm="fast")
    with pytest.raises(ValueError, match=r"gemm='native'.*scaling='mxfp8'.*'rowwise'"):
        jaxamp.Float8Recipe("rowwise", gemm="native")


@runs_native
def test_native_form_under_vmap_and_shard_map():
    f = jax.jit(jaxamp.autocast(lambda x, w: x @ w, NATIVE))
    xs, w = _rand(10, (3, 4, 64)), _rand(11, (64, 8))
    batched = jax.jit(jax.vmap(f, in_axes=(0, None)))(xs, w)
    for i in range(3):
        assert_f32_of(batched[i], f(xs[i], w))
    # scaled_matmul's result is invariant in shard_map (jax 0.12): marked varying again.
    spec = jax.sharding.PartitionSpec
    mesh = jax.make_mesh((1,), ("i",), axis_types=(jax.sharding.AxisType.Auto,))

    def sharded(w, x):
        body = lambda w, x: jax.lax.psum(x @ w, "i")  # noqa: E731
        return jax.shard_map(body, mesh=mesh, in_specs=(spec(), spec("i")), out_specs=spec())(w, x)

    got = jax.jit(jaxamp.autocast(sharded, NATIVE))(w, xs[0])
    assert_bf16_of(got, ref.forward(xs[0], w, "mxfp8"))


@runs_native
@pytest.mark.slow
def test_native_form_under_scan_and_loss_scaling():
    ws, x = _rand(12, (2, 64, 64), 0.2), _rand(13, (8, 64))

    def scanned(ws):
        return jnp.mean(jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0] ** 2)

    loss = jaxamp.autocast(scanned, NATIVE)
    scale = jaxamp.StaticLossScale(2.0**12)
    value, scaled = jax.jit(jaxamp.scaled_value_and_grad(loss, scale))(ws)
    plain_value, plain = jax.jit(jax.value_and_grad(loss))(ws)
    # Power-of-two scales: the loss scale cancels exactly, as in the emulated form.
    assert bits(value) == bits(plain_value) and bits(scale.unscale(scaled)) == bits(plain)
    emulated = jax.jit(jax.grad(jaxamp.autocast(scanned, EMULATED)))(ws)
    assert_f32_of(plain, emulated)


def test_native_result_varies_over_the_mesh_axes_inside_shard_map(blackwell):
    # Traced on every JAX: without the pcast, psum rejects scaled_matmul's invariant result.
    spec = jax.sharding.PartitionSpec
    mesh = jax.make_mesh((1,), ("i",), axis_types=(jax.sharding.AxisType.Auto,))

    def sharded(w, x):
        body = lambda w, x: jax.lax.psum(x @ w, "i")  # noqa: E731
        return jax.shard_map(body, mesh=mesh, in_specs=(spec(), spec("i")), out_specs=spec())(w, x)

    w, x = jnp.ones((64, 8)), jnp.ones((4, 64))
    loss = jaxamp.autocast(lambda w: jnp.sum(sharded(w, x)), jaxamp.Float8Recipe("mxfp8"))
    eqns = [e for e, _ in walk(jax.make_jaxpr(jax.grad(loss))(w).jaxpr)]
    names = [e.primitive.name for e in eqns]
    assert names.count("scaled_matmul_wrapper") == 3
    assert "pcast" in names or "pvary" in names
