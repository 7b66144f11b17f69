"""numerics_report: inf/NaN origins at the user's line, underflow against float32, loss scales."""

import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp

F16_MAX = float(jnp.finfo(jnp.float16).max)
F16_TINY = float(jnp.finfo(jnp.float16).tiny)
F32_TINY = float(jnp.finfo(jnp.float32).tiny)
_LINES = pathlib.Path(__file__).read_text().splitlines()


def _line(marker: str) -> str:
    """``"this/file.py:N"`` of the line carrying ``# <marker>``."""
    (n,) = [i + 1 for i, text in enumerate(_LINES) if text.rstrip().endswith(f"# {marker}")]
    return f"{__file__}:{n}"


def _planted(w, x):
    h = x @ w  # matmul-autocast
    big = h * 4096.0  # plant-autocast
    return jnp.mean(jnp.tanh(big))


def test_planted_overflow_at_its_line_under_autocast():
    w, x = jnp.ones((4, 3)), jnp.full((2, 4), 20.0)
    report = jaxamp.numerics_report(_planted, w, x, policy="mixed_float16")
    # tanh(inf) is 1: the overflow never reaches the loss, so it is absorbed, not blamed.
    assert report.first_nonfinite is None and len(report.absorbed) == 1
    origin = report.absorbed[0]
    assert origin.source == _line("plant-autocast")
    assert (origin.primitive, origin.dtype, origin.phase) == ("mul", np.float16, "forward")
    assert origin.nonfinite == 6 and origin.max_abs == 0.0
    assert origin.max_abs_float32 == 80.0 * 4096  # what float32 arithmetic gives
    assert "plant-autocast" not in str(report)  # the table names file:line, not the code
    assert f"test_numerics_report.py:{origin.source.rsplit(':', 1)[1]}" in str(report)
    # The matmul before it is finite: float32 accumulation, then 80 / 65504 of float16's range.
    matmul = [op for op in report.ops if op.source == _line("matmul-autocast")]
    assert [(op.primitive, op.dtype) for op in matmul[-2:]] == [
        ("dot_general", np.float32),
        ("convert_element_type", np.float16),
    ]
    assert all(op.nonfinite == 0 and op.max_abs == 80.0 for op in matmul[-2:])
    assert matmul[-1].headroom == pytest.approx(80.0 / F16_MAX)
    # Under float32 the same program is clean.
    clean = jaxamp.numerics_report(_planted, w, x, policy="float32")
    assert clean.first_nonfinite is None and not clean.nonfinite_ops


def test_planted_overflow_through_a_flax_layer_dtype_model():
    nn = pytest.importorskip("flax.linen")

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.Dense(3, dtype=jnp.float16)(x)
            return jnp.sum(h * 8192.0)  # plant-flax

    model = Model()
    x = jnp.full((2, 4), 3.0)
    params = model.init(jax.random.key(0), x)
    params = jax.tree.map(jnp.ones_like, params)
    report = jaxamp.numerics_report(model.apply, params, x)
    assert report.first_nonfinite.source == _line("plant-flax")
    assert report.first_nonfinite.primitive == "mul"
    # The Dense's own ops are attributed to the user's line, not to flax's files.
    for op in report.ops:
        assert op.source.startswith(__file__), op


def _sqrt_loss(x):
    return jnp.sum(jnp.sqrt(x))  # plant-sqrt


def _log_loss(x):
    return jnp.sum(jnp.log(x))  # plant-log


@pytest.mark.parametrize(
    "loss, x, marker",
    [
        (_sqrt_loss, jnp.zeros(3), "plant-sqrt"),  # d/dx sqrt(0) = 1 / 0
        (_log_loss, jnp.full(3, 1e-5, jnp.float16), "plant-log"),  # 1 / 1e-5 > float16 max
    ],
)
def test_nonfinite_born_in_the_gradient_is_reported_at_the_forward_line(loss, x, marker):
    forward = jaxamp.numerics_report(loss, x)
    assert forward.first_nonfinite is None and not forward.nonfinite_ops
    report = jaxamp.numerics_report(loss, x, grad=True)
    origin = report.first_nonfinite
    assert origin.source == _line(marker) and origin.phase == "backward"
    assert origin.primitive == "div"
    assert all(op.nonfinite == 0 for op in report.ops if op.phase == "forward")


def test_float32_run_reports_no_problem():
    w = jax.random.normal(jax.random.key(0), (8, 4))
    x = jax.random.normal(jax.random.key(1), (16, 8))
    report = jaxamp.numerics_report(lambda w, x: jnp.mean(jnp.tanh(x @ w) ** 2), w, x, grad=True)
    assert report.first_nonfinite is None
    assert all(op.nonfinite == 0 and op.underflow_fraction == 0.0 for op in report.ops)
    assert {op.phase for op in report.ops} == {"forward", "backward"}
    assert report.suggested_loss_scale is None  # nothing 16-bit to protect
    assert "no inf/NaN" in str(report) and "most underflow: none" in str(report)


def _flushed_fraction(reference):
    """Fraction of a float32 reference that float16 makes zero or subnormal."""
    magnitude = np.abs(np.asarray(reference, np.float32))
    return float(np.mean((magnitude < F16_TINY) & (magnitude >= F32_TINY)))


def test_underflow_fractions_count_what_each_op_flushes():
    x = np.exp(np.linspace(-25.0, 0.0, 1000)).astype(np.float32)  # 1.4e-11 .. 1
    factor = np.float16(1e-3)

    def fun(x):
        x16 = x.astype(jnp.float16)
        return x16 * factor

    report = jaxamp.numerics_report(fun, x)
    cast, mul = report.ops
    assert (cast.primitive, mul.primitive) == ("convert_element_type", "mul")
    assert cast.underflow_fraction == pytest.approx(_flushed_fraction(x), abs=1e-3)
    # A direct count at the mul: zero or subnormal there, from a normal float16 input,
    # normal in float32 (flushes the cast made are the cast's, not counted again).
    x16 = np.asarray(x.astype(np.float16))
    out = np.abs(np.asarray(fun(x), np.float32))
    normal_in = np.where(np.abs(x16) >= F16_TINY, x16, 0).astype(np.float32)
    here = (out < F16_TINY) & (np.abs(normal_in * np.float32(factor)) >= F32_TINY)
    here &= np.abs(x * np.float32(factor)) >= F32_TINY
    assert mul.underflow_fraction == pytest.approx(float(np.mean(here)), abs=1e-9)
    assert 0.2 < mul.underflow_fraction < cast.underflow_fraction
    assert report.most_underflow(1) == [cast]  # the culprit first
    # A cast that flushes everything, then * 2: only the cast flushed.
    tiny = jaxamp.numerics_report(lambda x: x.astype(jnp.float16) * 2, np.full(8, 1e-9, np.float32))
    assert [op.underflow_fraction for op in tiny.ops] == [1.0, 0.0]


def test_a_32_bit_op_flushes_nothing_and_keeps_what_was_lost():
    x = np.exp(np.linspace(-25.0, 0.0, 1000)).astype(np.float32)

    def fun(x):
        return (x.astype(jnp.float16) * np.float16(1e-3)).astype(jnp.float32) * 2.0

    cast, mul, widened, doubled = jaxamp.numerics_report(fun, x).ops
    assert (widened.dtype, doubled.dtype) == (np.float32, np.float32)
    # float32 arithmetic on the float16 values is its own float32 twin: whatever is
    # zero there was flushed before; lost_fraction keeps it (zeros of the float16 mul).
    assert widened.underflow_fraction == doubled.underflow_fraction == 0.0
    want = float(np.mean(np.asarray(fun(x)) == 0))
    assert widened.lost_fraction == doubled.lost_fraction == pytest.approx(want, abs=1e-9)
    assert want > 0.5
    assert jaxamp.numerics_report(fun, x).most_underflow(2) == [cast, mul]


@pytest.mark.parametrize("policy", ["mixed_float16", jaxamp.Float8Recipe("rowwise")])
def test_each_value_in_a_buffer_of_its_own_reports_the_same(monkeypatch, policy):
    # On the CPU under jax 0.12 each measured value is kept in a buffer of its own
    # (it compiles faster); under jax 0.10 not. Both programs report the same, bit
    # for bit, including in a loop body and a branch: every 16-bit value is rounded
    # to its dtype however XLA fuses (no excess precision). (Transcendental functions
    # may differ in the last bit between fusions, so this loss has none.)
    from jaxamp._numerics import _compiled, _program

    def loss(w, x):
        def body(h, _):
            h = h @ w
            h = jnp.maximum(h, 0.1 * h) * 3.0
            return jax.lax.cond(jnp.sum(h) > 0, lambda a: a * 2.0, lambda a: -a, h), None

        h = jax.lax.scan(body, x, None, length=2)[0]
        return jnp.mean(jnp.where(h > 0, h, 1e-9) ** 2)

    w = jnp.asarray(np.random.default_rng(0).normal(size=(16, 16)), jnp.float32)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(8, 16)), jnp.float32)
    reports = []
    for materialize in (False, True):
        monkeypatch.setattr(_program, "materializes_values", lambda _, m=materialize: m)
        _compiled.cache_clear()
        reports.append(jaxamp.numerics_report(loss, w, x, policy=policy, grad=True))
    plain, materialized = reports
    assert len(plain.ops) > 20 and plain.ops == materialized.ops
    assert plain.suggested_loss_scale == materialized.suggested_loss_scale


def test_the_cpu_program_is_built_one_way_or_the_other():
    # Exact rounding on every CPU program; the classic emitters where this XLA has
    # them (jax 0.10), else each value in a buffer of its own (jax 0.12); nothing
    # of it off the CPU.
    from jaxamp._numerics import _compiled

    for values in (0, _compiled.FAST_COMPILE_VALUES + 1):
        options = _compiled.compiler_options("cpu", values)
        assert options["xla_allow_excess_precision"] is False
        classic = "xla_cpu_use_fusion_emitters" in options
        assert classic != _compiled.materializes_values("cpu")
    assert classic == (tuple(int(p) for p in jax.__version__.split(".")[:2]) < (0, 12))
    assert _compiled.compiler_options("gpu") is None
    assert not _compiled.materializes_values("gpu")


def _scaled_loss(w, x):
    return jnp.sum(jnp.tanh(x @ w))


def _backward_overflows(report):
    return any(op.nonfinite for op in report.ops if op.phase == "backward")


def test_suggested_loss_scale_fits_and_is_at_most_16x_below_the_largest():
    w = jax.random.normal(jax.random.key(0), (16, 8)) * 0.1
    x = jax.random.normal(jax.random.key(1), (32, 16)) * 30.0
    report = jaxamp.numerics_report(_scaled_loss, w, x, policy="mixed_float16", grad=True)
    suggested, largest = report.suggested_loss_scale, report.max_loss_scale
    assert math.log2(suggested).is_integer() and largest == 8 * suggested

    def at(scale):
        return jaxamp.numerics_report(
            _scaled_loss, w, x, policy="mixed_float16", grad=True, loss_scale=scale
        )

    assert not _backward_overflows(at(suggested))
    assert not _backward_overflows(at(largest))
    assert _backward_overflows(at(2 * largest))  # so suggested >= (largest that fits) / 8
    # Computed from float32 magnitudes: measuring at an overflowing scale agrees.
    assert at(4 * largest).suggested_loss_scale == suggested


def test_scan_aggregates_over_iterations_with_the_first_nonfinite_iteration():
    def fun(c, xs):
        def body(c, x):
            c = c * x  # plant-scan
            return c, jnp.sum(c)

        return jax.lax.scan(body, c, xs)[1]

    c, xs = jnp.ones(3, jnp.float16), jnp.full((6, 3), 10.0, jnp.float16)
    report = jaxamp.numerics_report(jax.jit(fun), c, xs)
    (mul,) = [op for op in report.ops if op.source == _line("plant-scan")]
    # 10, 100, ..., 1e4 are finite; 1e5 (iteration 4) and 1e6 overflow float16.
    assert (mul.executions, mul.nonfinite, mul.first_nonfinite_iteration) == (6, 6, 4)
    assert mul.max_abs == 1e4 and mul.max_abs_float32 == 1e6  # the float32 shadow carries on
    assert report.first_nonfinite is mul


def test_while_and_cond_aggregate_and_find_the_origin():
    def fun(v):
        def body(state):
            i, v = state
            v = jax.lax.cond(i < 3, lambda a: a * 2.0, lambda a: a * 1000.0, v)  # plant-cond
            return i + 1, v

        return jax.lax.while_loop(lambda s: s[0] < 5, body, (0, v))[1]

    report = jaxamp.numerics_report(fun, jnp.ones(2, jnp.float16))
    # lax.cond's branches are (false, true): program order puts the false one first.
    thousand, doubling = [op for op in report.ops if op.primitive == "mul"]
    assert (doubling.executions, doubling.max_abs, doubling.nonfinite) == (3, 8.0, 0)
    # 8 * 1000 is finite (iteration 3), 8e6 is not (iteration 4).
    assert (thousand.executions, thousand.max_abs, thousand.nonfinite) == (2, 8000.0, 2)
    assert thousand.first_nonfinite_iteration == 4
    assert report.first_nonfinite is thousand and thousand.source == _line("plant-cond")


@pytest.mark.parametrize(("first", "origin"), [(300.0, "plant-operand"), (200.0, "plant-branch")])
def test_a_cond_on_a_value_measured_in_the_same_body(first, origin):
    def fun(x):
        y = x * 300.0  # plant-operand
        return jax.lax.cond(x[1] > 0, lambda a: a * 2.0, lambda a: a, y)  # plant-branch

    # 300 * 300 overflows float16; 200 * 300 does not, and twice it does.
    report = jaxamp.numerics_report(fun, jnp.array([first, 1.0], jnp.float16))
    operand, branch = (
        next(op for op in report.ops if op.source == _line(m) and op.primitive == "mul")
        for m in ("plant-operand", "plant-branch")
    )
    assert (operand.nonfinite, branch.nonfinite) == ((1, 1) if first == 300.0 else (0, 1))
    assert report.first_nonfinite is (operand if origin == "plant-operand" else branch)


@jax.custom_vjp
def _scaled_sin(x):
    return jnp.sin(x)


_scaled_sin.defvjp(lambda x: (jnp.sin(x), x), lambda x, g: (g * jnp.cos(x),))


def test_custom_vjp_custom_jvp_and_remat_are_measured_inside():
    def fun(w):
        h = jax.checkpoint(lambda w: jax.nn.relu(w) * 300.0)(w)
        return jnp.sum(_scaled_sin(h) * h * h)  # plant-custom

    w = jnp.ones(4, jnp.float16)
    report = jaxamp.numerics_report(fun, w, grad=True)
    primitives = {op.primitive for op in report.ops}
    assert {"max", "sin", "cos"} <= primitives  # relu, the custom_vjp fwd and bwd
    origin = report.first_nonfinite  # 300 * 300 * sin(300) overflows float16
    assert origin.source == _line("plant-custom") and origin.phase == "forward"


def _mlp_loss_checks(report):
    assert report.first_nonfinite is None
    assert {op.phase for op in report.ops} == {"forward", "backward"}
    matmuls = [op for op in report.ops if op.primitive == "dot_general"]
    assert matmuls and all(op.source.startswith(__file__) for op in matmuls)
    assert math.log2(report.suggested_loss_scale).is_integer()


def test_flax_nnx_haiku_and_equinox_models():
    nnx = pytest.importorskip("flax.nnx")
    hk = pytest.importorskip("haiku")
    eqx = pytest.importorskip("equinox")
    x = jax.random.normal(jax.random.key(0), (4, 3))

    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)

    def nnx_loss(state, x):
        return jnp.mean(nnx.merge(graphdef, state)(x) ** 2)  # nnx line

    _mlp_loss_checks(jaxamp.numerics_report(nnx_loss, state, x, policy="mixed_float16", grad=True))

    net = hk.without_apply_rng(hk.transform(lambda x: hk.Linear(2)(x)))
    params = net.init(jax.random.key(1), x)

    def hk_loss(params, x):
        return jnp.mean(net.apply(params, x) ** 2)  # haiku line

    _mlp_loss_checks(jaxamp.numerics_report(hk_loss, params, x, policy="mixed_float16", grad=True))

    mlp = eqx.nn.MLP(3, 2, 4, 1, key=jax.random.key(2))

    def eqx_loss(mlp, x):
        return jnp.mean(jax.vmap(mlp)(x) ** 2)  # equinox line

    _mlp_loss_checks(jaxamp.numerics_report(eqx_loss, mlp, x, policy="mixed_float16", grad=True))


def test_a_typed_prng_key_argument_is_traced_and_the_program_reused():
    from jaxamp._numerics import _compiled

    def noisy(w, key):
        return jnp.sum(w * jax.random.normal(key, w.shape, w.dtype))  # plant-key

    w = jnp.linspace(1.0, 2.0, 8, dtype=jnp.float32)
    first = jaxamp.numerics_report(noisy, w, jax.random.key(0))
    cached = len(_compiled._CACHE)
    second = jaxamp.numerics_report(noisy, w, jax.random.key(1))
    assert len(_compiled._CACHE) == cached  # same key type and shape: no new program
    for report, seed in ((first, 0), (second, 1)):
        (total,) = [op for op in report.ops if op.source == _line("plant-key")][-1:]
        # The key's own random numbers (key 0 and key 1 differ), summed in another order.
        want = abs(float(noisy(w, jax.random.key(seed))))
        assert total.max_abs == pytest.approx(want, rel=1e-6)
        assert report.nonfinite_inputs == () and report.first_nonfinite is None
    assert first.ops[-1].max_abs != second.ops[-1].max_abs


def test_float8_inputs_of_two_formats_get_two_programs():
    def double(x):
        return x * 2

    # NumPy spells both dtypes '<V1': the cache keys them by name.
    for dtype in (jnp.float8_e4m3fn, jnp.float8_e4m3fnuz):
        report = jaxamp.numerics_report(double, jnp.ones(4, dtype))
        assert [op.dtype for op in report.ops] == [np.dtype(dtype)]
