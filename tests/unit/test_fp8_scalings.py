"""The table of FP8 scalings: the one place a scaling is declared, and what a missed entry says.

A toy scaling registered here (blocks of 64 along the contracting dim) runs end
to end: the recipe accepts it, its products match the independent reference
with the same tiles, it differs from the built-in scalings, and
precision_report names it. Without the entry every consumer says which names
exist.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxamp
from jaxamp._fp8 import _scalings
from jaxamp._fp8._quantize import groups_for
from jaxamp._fp8._scalings import KINDS, Groups, Scaling
from tests import fp8_reference as ref
from tests.unit.test_fp8 import BF16_TOL, _rand, assert_bf16_of, assert_f32_of

TOY = "block64"


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(_scalings.SCALINGS, TOY, Scaling.uniform(Groups(False, 1, 64)))
    monkeypatch.setitem(ref.TILES, TOY, dict.fromkeys(KINDS, (1, 64)))
    return TOY


def test_the_reference_has_the_tiles_of_every_registered_scaling():
    # The reference is written from the formulas, apart from the table: they must agree.
    assert set(ref.TILES) == set(_scalings.names("fp8"))  # FP4: tests/fp4_reference.py
    for name in _scalings.names("fp8"):
        scaling = _scalings.SCALINGS[name]
        for kind, groups in scaling.groups.items():
            tile = (None, None) if groups.whole_batch else (groups.rows, groups.block)
            assert ref.TILES[name][kind] == tile, (name, kind)


def test_a_registered_toy_scaling_runs_end_to_end(toy):
    m, k, n = 6, 256, 16
    x, w, g = _rand(0, (m, k)), _rand(1, (k, n), 0.05), _rand(2, (m, n))
    x[:, 0] *= 40.0  # an outlier channel: each block of 64 sees its own amax
    recipe = jaxamp.Float8Recipe(toy)
    assert str(recipe) == f"fp8:{toy}" and not recipe.exact_scales
    f = jax.jit(jaxamp.autocast(lambda x, w: x @ w, recipe))
    got = f(x, w)
    assert_bf16_of(got, ref.forward(x, w, toy))
    for other in ("rowwise", "blockwise"):  # the toy's groups, not a built-in's
        want = ref.forward(x, w, other)
        diff = np.abs(np.asarray(got, np.float64) - want)
        assert not np.all(diff <= BF16_TOL * np.abs(want) + 1e-6 * np.abs(want).max()), other
    g16 = g.astype(ml_dtypes.bfloat16).astype(np.float32)
    dx, dw = jax.jit(jax.grad(lambda x, w: jnp.sum(f(x, w) * g), argnums=(0, 1)))(x, w)
    for got_grad, want in zip((dx, dw), ref.gradients(x, w, g16, toy), strict=True):
        assert_f32_of(got_grad, want)
    report = jaxamp.precision_report(jax.grad(lambda x, w: jnp.sum(f(x, w))), x, w)
    assert {m.fp8_recipe for m in report.matmuls} == {toy}


def test_a_scaling_missing_from_the_table_is_named_with_the_registered_ones():
    with pytest.raises(ValueError, match=r"scaling=\.\.\.\) must be one of .*'mxfp8'.*'block64'"):
        jaxamp.Float8Recipe(TOY)
    with pytest.raises(ValueError, match=r"unknown FP8 scaling 'block64'.*'tensorwise'"):
        groups_for(TOY, "act")
    with pytest.raises(ValueError, match="operand kind"):
        groups_for("rowwise", "bias")
    # precision_report reads only registered names back from a name scope.
    assert _scalings.scaling_of_scope("fp8_block64/dot_general") == ""


def test_an_incomplete_table_entry_is_an_error():
    with pytest.raises(ValueError, match=r"each operand kind .*'grad'.*got \['act', 'weight'\]"):
        Scaling({"act": Groups(False, 1, 64), "weight": Groups(False, 1, 64)})
    with pytest.raises(ValueError, match=r"native=True.*scaled_matmul"):
        Scaling.uniform(Groups(False, 1, 64), exact_scales=True, native=True)


def test_the_table_decides_the_native_form_and_exact_scales(toy):
    assert _scalings.native_scaling() == "mxfp8"
    with pytest.raises(ValueError, match=r"gemm='native'.*scaling='mxfp8'.*'block64'"):
        jaxamp.Float8Recipe(toy, gemm="native")
    assert jaxamp.Float8Recipe("mxfp8").exact_scales
    assert str(jaxamp.Float8Recipe(toy, power_of_two_scale=True)) == f"fp8:{toy},pow2"
