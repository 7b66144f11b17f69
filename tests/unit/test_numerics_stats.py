"""The numerics statistics table: the reduction, the packing and OpStats derive from it."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import jaxamp
from jaxamp._numerics import _compiled, _stats, _table


def test_every_statistic_fills_an_opstats_field_and_packs_by_dtype():
    fields = {f.name for f in dataclasses.fields(jaxamp.OpStats)}
    for stat in _stats.STATISTICS:
        assert stat.field in fields, stat.name
        assert stat.dtype in (np.dtype(np.float32), np.dtype(np.int32))
    floats, ints = _stats.pack([_stats.EMPTY, _stats.EMPTY])
    n_float = sum(s.dtype == np.float32 for s in _stats.STATISTICS)
    assert floats.shape == (2, n_float) and floats.dtype == jnp.float32
    assert ints.shape == (2, len(_stats.STATISTICS) - n_float + 3) and ints.dtype == jnp.int32
    empty = _stats.pack([])
    assert empty[0].shape == (0, n_float) and empty[1].shape == (0, ints.shape[1])


def test_reduce_output_against_numpy():
    tiny16 = float(jnp.finfo(jnp.float16).tiny)
    out = jnp.array([0.0, -3.0, jnp.inf, 1e-6, 5.0, jnp.nan], jnp.float16)
    # The float32 twin: the flushed 1e-6 and a 0 are normal there; 7 is its largest.
    shadow = jnp.array([1e-30, -3.0, 7.0, 1e-6, 5.0, 1.0], jnp.float32)
    local = jnp.array([0.0, -3.0, 7.0, 1e-6, 5.0, 1.0], jnp.float32)  # 0 flushed earlier
    names = [s.name for s in _stats.STATISTICS]
    got = dict(zip(names, _stats.reduce_output(out, shadow, local), strict=True))
    assert float(got["max_abs"]) == 5.0 and float(got["max_abs_float32"]) == 7.0
    assert int(got["nonfinite"]) == 2
    small = (np.abs(np.asarray(out, np.float32)) < tiny16) & (np.abs(np.asarray(shadow)) >= 1e-38)
    assert int(got["lost"]) == int(small.sum()) == 2  # 0 (normal 1e-30 in the twin), 1e-6
    assert int(got["underflow"]) == 1  # only 1e-6 flushed here
    assert int(got["saturated"]) == 0
    fp8 = jnp.array([448.0, -448.0, 1.0], jnp.float8_e4m3fn)
    saturated = _stats.reduce_output(fp8)[[s.name for s in _stats.STATISTICS].index("saturated")]
    assert int(saturated) == 2


def test_outputs_of_mixed_dtypes_stacked_as_rows_keep_their_own_statistics():
    # One reduction over rows of float16, float32 and float8 values, with and without
    # twins, gives each row what it gives alone: a row's dtype (its tiny, its float8
    # max) and its twins are per row, not the group's.
    f16 = jnp.array([1e-6, 0.0, 2.0, jnp.inf], jnp.float16)
    shadow16 = jnp.array([1e-6, 1e-30, 2.0, 9.0], jnp.float32)
    local16 = jnp.array([1e-6, 0.0, 2.0, 9.0], jnp.float32)
    f32 = jnp.array([1e-6, 1e-39, -4.0, 1.0], jnp.float32)  # 1e-39: subnormal in float32
    shadow32 = jnp.array([1e-6, 1e-30, -4.0, 1.0], jnp.float32)
    fp8 = jnp.array([448.0, 0.0, -1.0, 448.0], jnp.float8_e4m3fn)
    outputs = [
        _stats.Output(f16, shadow16, local16),
        _stats.Output(f32, shadow32),
        _stats.Output(fp8),
        _stats.Output(f16),
        _stats.Output(f16, shadow16),  # a twin along the program, none of its own
    ]
    stacked = _stats.reduce_rows(_stats.Elements(outputs))
    for row, output in enumerate(outputs):
        alone = _stats.reduce_output(*output)
        assert [float(col[row]) for col in stacked] == [float(v) for v in alone], row
    names = [s.name for s in _stats.STATISTICS]
    got = {n: [float(v) for v in col] for n, col in zip(names, stacked, strict=True)}
    assert got["underflow"] == [1, 0, 0, 0, 2]  # float32 flushes nothing it did not lose
    assert got["lost"] == [2, 1, 0, 0, 2]  # 1e-6 and the 0 in float16; 1e-39 in float32
    assert got["saturated"] == [0, 0, 2, 0, 0]
    assert got["max_abs_float32"] == [9.0, 4.0, 448.0, 2.0, 9.0]


def test_accumulate_and_unpack_row_round_trip():
    stats = _stats.reduce_output(jnp.array([1.0, jnp.inf], jnp.float32))
    once = _stats.accumulate(_stats.EMPTY, stats, jnp.bool_(True), 5, 2)
    twice = _stats.accumulate(once, stats, jnp.bool_(True), 9, 3)
    assert (int(twice.executions), int(twice.origin_clock)) == (2, 5)
    assert int(twice.first_nonfinite_iteration) == 2
    floats, ints = _stats.pack([twice])
    back = _stats.unpack_row(np.asarray(floats[0]), np.asarray(ints[0]))
    assert [float(v) for v in back.measured] == [float(v) for v in twice.measured]
    assert int(back.measured[_stats.NONFINITE]) == 2
    moved = _stats.moved(stats, np.int32(3))
    assert [float(v) for v in moved][:3] == [1.0, 1.0, 3.0]


def _flushing_loss(w, x):
    # Underflow (x * 1e-4 flushes some float16 values), an overflow in a scan, a cond,
    # and outputs of several sizes: both sides of the stacking threshold.
    w, x = w.astype(jnp.float16), x.astype(jnp.float16)
    h = jnp.tanh(x @ w) * jnp.float16(1e-4)
    h = h * h

    def body(c, row):
        return c + jnp.sum(row * jnp.float16(3e3)) ** 2, row * 2

    total, _ = jax.lax.scan(body, jnp.float16(0), h)
    big = jax.lax.cond(total >= 0, lambda a: a * jnp.float16(4e3), lambda a: a, x @ w)
    return (jnp.mean(big.astype(jnp.float32)) + total.astype(jnp.float32)).astype(jnp.float32)


def test_stacking_outputs_is_a_layout_not_a_result(monkeypatch):
    # Stacked with the outputs of their size or reduced alone (over
    # STACK_MAX_ELEMENTS, in a program of over FAST_COMPILE_VALUES values), every
    # statistic is the same: max and integer counts do not depend on how elements
    # are grouped.
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.normal(size=(32, 256)), jnp.float32)
    x = jnp.asarray(rng.normal(size=(96, 32)), jnp.float32)
    reports = []
    monkeypatch.setattr(_compiled, "FAST_COMPILE_VALUES", 0)  # a "large" program
    for limit in (float("inf"), 0, 2**12):
        monkeypatch.setattr(_table, "STACK_MAX_ELEMENTS", limit)
        _compiled.cache_clear()
        reports.append(jaxamp.numerics_report(_flushing_loss, w, x, grad=True, loss_scale=2.0**8))
    _compiled.cache_clear()
    stacked, alone, mixed = reports
    assert any(op.underflow_fraction > 0 for op in stacked.ops)
    assert any(op.nonfinite > 0 for op in stacked.ops)
    assert alone == stacked and mixed == stacked
