"""The native form of FP4 products, ``jax.nn.scaled_matmul``: selection, jaxpr, CUDA lowering.

Its numbers are checked against the reference where JAX lowers it for the CPU
(jax 0.12); its jaxpr (E2M1 operands, E4M3 or E8M0 block scales) and its CUDA
lowering (XLA's block-scaled dot, cuDNN's FP4 GEMM on Blackwell) on every JAX.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import jaxamp
from jaxamp._engine._visit import walk
from jaxamp._fp8 import _fp4, _native
from tests import fp4_reference as ref
from tests.unit.test_fp4 import SHAPE, _data, _run
from tests.unit.test_fp8 import assert_bf16_of, assert_f32_of

SCALE_DTYPES = {"nvfp4": "float8_e4m3fn", "mxfp4": "float8_e8m0fnu"}
runs_native = pytest.mark.skipif(
    not _native.native_lowers(jax.default_backend()),
    reason="this JAX has no lowering of jax.nn.scaled_matmul for this backend",
)


@pytest.fixture
def blackwell(monkeypatch):
    """Makes ``gemm="auto"`` see a GPU of compute capability 10.0 (tracing only)."""
    monkeypatch.setattr(_native, "platform", lambda: ("gpu", 10.0))


def _products(recipe, x, w):
    mm = jaxamp.autocast(lambda x, w: x @ w, recipe)
    f = jax.value_and_grad(lambda x, w: jnp.sum(mm(x, w)), (0, 1))
    return f, [e for e, _ in walk(jax.make_jaxpr(f)(x, w).jaxpr)]


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_jaxpr_and_cuda_lowering_of_the_native_form(blackwell, fmt):
    x, w = jnp.ones((32, 64)), jnp.ones((64, 96))  # three products of distinct shapes
    f, eqns = _products(jaxamp.Float4Recipe(fmt), x, w)
    native = [e for e in eqns if e.primitive.name == "scaled_matmul_wrapper"]
    scale = SCALE_DTYPES[fmt]
    assert [tuple(v.aval.dtype.name for v in e.invars) for e in native] == [
        ("float4_e2m1fn", "float4_e2m1fn", scale, scale)
    ] * 3
    assert not [e for e in eqns if e.primitive.name == "dot_general"]
    report = jaxamp.precision_report(f, x, w)
    assert {m.fp8_recipe for m in report.matmuls} == {fmt}
    text = jax.jit(f).trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
    calls = [line for line in text.splitlines() if "custom_call @__op$block_scaled_dot" in line]
    assert len(calls) == 3 and all("f4E2M1FN" in c for c in calls)


@pytest.mark.parametrize(
    ("recipe", "where", "native"),
    [
        (jaxamp.Float4Recipe(), ("gpu", 10.0), True),
        (jaxamp.Float4Recipe("mxfp4"), ("gpu", 12.0), True),
        (jaxamp.Float4Recipe(), ("gpu", 9.0), False),
        (jaxamp.Float4Recipe(), ("cpu", 0.0), False),
        (jaxamp.Float4Recipe(gemm="emulated"), ("gpu", 10.0), False),
        (jaxamp.Float4Recipe(gemm="native"), ("gpu", 9.0), True),
    ],
)
def test_auto_picks_native_on_blackwell_only(monkeypatch, recipe, where, native):
    monkeypatch.setattr(_native, "platform", lambda: where)
    monkeypatch.setattr(_native, "native_lowers", lambda backend: True)
    assert _fp4.uses_native(recipe) is native


def test_forcing_native_where_it_cannot_lower_names_the_field_and_the_fix(monkeypatch):
    monkeypatch.setattr(_native, "native_lowers", lambda backend: False)
    x, w = jnp.ones((4, 64)), jnp.ones((64, 8))
    recipe = jaxamp.Float4Recipe(gemm="native")
    with pytest.raises(ValueError, match=r"Float4Recipe\(gemm='native'\).*gemm='emulated'"):
        jax.make_jaxpr(jaxamp.autocast(lambda x, w: x @ w, recipe))(x, w)


@runs_native
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_native_matches_the_reference(fmt):
    x, w, g = _data(SHAPE)
    recipe = jaxamp.Float4Recipe(fmt, stochastic_rounding=False, gemm="native")
    out, dx, dw = _run(recipe, x, w, g)
    assert_bf16_of(out, ref.forward(x, w, fmt))
    want_dx, want_dw = ref.gradients(x, w, g, fmt)
    assert_f32_of(dx, want_dx)
    assert_f32_of(dw, want_dw)
