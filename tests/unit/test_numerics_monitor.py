"""numerics_monitor from the host loop: the report numerics_report gives, on the asked steps only.

Called with a Python int step outside ``jax.jit``, the monitor dispatches the
compiled program ``numerics_report`` caches on every ``every``-th step and hands
the report to its callback from a worker thread; on the other steps it touches
nothing. Called inside ``jax.jit`` it is the in-step form (tests/integration/
test_capability_matrix.py, tests/unit/test_policy_forms.py).
"""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp
from jaxamp._numerics import _monitor
from jaxamp._numerics._program import NumericsProgram


def _loss(params, x):
    h = jnp.tanh(x @ params["w"]) * 300.0
    return jnp.mean((h @ params["v"]) ** 2)  # 300**2 * 4 overflows float16


def _inputs():
    rng = np.random.default_rng(0)
    params = {
        "w": jnp.asarray(rng.normal(size=(8, 16)), jnp.float32),
        "v": jnp.asarray(rng.normal(size=(16, 4)), jnp.float32),
    }
    return params, jnp.asarray(rng.normal(size=(5, 8)), jnp.float32)


@pytest.fixture
def counted(monkeypatch):
    """Counts the instrumented runs the monitor dispatches (calls of the compiled program)."""
    runs = []

    class Counting(NumericsProgram):
        def compiled(self, inputs):
            compiled = super().compiled(inputs)

            def run(*args):
                runs.append(threading.get_ident())
                return compiled.run(*args)

            return compiled._replace(run=run)

    monkeypatch.setattr(_monitor, "NumericsProgram", Counting)
    return runs


def test_reports_equal_numerics_report_field_for_field():
    params, x = _inputs()
    seen = []
    monitor = jaxamp.numerics_monitor(
        _loss, every=1, policy="mixed_float16", grad=True, callback=lambda s, r: seen.append(r)
    )
    monitor(0, params, x, loss_scale=2.0**6)
    monitor.flush()
    expected = jaxamp.numerics_report(
        _loss, params, x, policy="mixed_float16", grad=True, loss_scale=2.0**6
    )
    (report,) = seen
    assert expected.first_nonfinite is not None  # the planted overflow is found
    assert report == expected
    assert str(report) == str(expected)


def test_fires_exactly_on_every_nth_step_and_idle_steps_dispatch_nothing(counted):
    params, x = _inputs()
    seen = []
    monitor = jaxamp.numerics_monitor(
        _loss, every=3, policy="mixed_float16", grad=True, callback=lambda s, r: seen.append(s)
    )
    step = jax.jit(lambda p, x: jax.tree.map(lambda a, g: a - 1e-3 * g, p, jax.grad(_loss)(p, x)))
    for i in range(10):
        monitor(i, params, x, loss_scale=jnp.float32(4.0))
        params = step(params, x)
    monitor.flush()
    assert seen == [0, 3, 6, 9]
    assert len(counted) == 4  # one run per report, none on the idle steps
    assert set(counted) == {threading.get_ident()}  # dispatched from the loop's thread


def test_idle_steps_touch_no_array():
    # A deleted array raises on any use (a read, a transfer, a dispatch): the idle
    # steps never look at their arguments.
    params, x = _inputs()
    monitor = jaxamp.numerics_monitor(_loss, every=2, grad=True, callback=lambda *_: None)
    gone = jax.tree.map(jnp.copy, (params, x))
    for leaf in jax.tree.leaves(gone):
        leaf.delete()
    for i in (1, 3, np.int64(5)):
        monitor(i, *gone, loss_scale=jnp.float32(8.0))
    monitor.flush()
    with pytest.raises(RuntimeError):
        monitor(4, *gone)  # a reporting step reads them


def test_loss_scale_array_and_report_order():
    params, x = _inputs()
    seen = []
    monitor = jaxamp.numerics_monitor(
        _loss, every=2, policy="mixed_float16", grad=True, callback=lambda s, r: seen.append((s, r))
    )
    scales = [2.0**k for k in range(6)]
    for i, scale in enumerate(scales):
        monitor(i, params, x, loss_scale=jnp.asarray(scale, jnp.float32))
    monitor.flush()
    assert [s for s, _ in seen] == [0, 2, 4]
    assert [r.loss_scale for _, r in seen] == [scales[0], scales[2], scales[4]]
    expected = jaxamp.numerics_report(
        _loss, params, x, policy="mixed_float16", grad=True, loss_scale=scales[4]
    )
    assert seen[-1][1] == expected


def test_flush_raises_the_callbacks_error_and_keeps_delivering():
    seen = []

    def callback(step, report):
        seen.append(step)
        if step == 0:
            raise ZeroDivisionError("in the callback")

    monitor = jaxamp.numerics_monitor(lambda w: jnp.sum(w), every=1, callback=callback)
    for i in range(3):
        monitor(i, jnp.ones(4, jnp.bfloat16))
    with pytest.raises(ZeroDivisionError, match="in the callback"):
        monitor.flush()
    assert seen == [0, 1, 2]
    monitor.flush()  # raised once


def test_a_traced_argument_or_step_keeps_the_in_step_form(counted):
    seen = []
    monitor = jaxamp.numerics_monitor(
        lambda w: jnp.sum(w * 300.0) ** 2, every=2, callback=lambda s, r: seen.append(s)
    )
    w = jnp.ones(3, jnp.float16)
    jax.jit(lambda w: monitor(0, w))(w)  # a Python step, a traced argument
    jax.jit(monitor)(np.int32(2), w)  # both traced
    jax.effects_barrier()
    assert seen == [0, 2] and counted == []  # traced into the steps, not dispatched


def test_returns_a_numerics_monitor_and_checks_every():
    monitor = jaxamp.numerics_monitor(lambda w: jnp.sum(w), every=4)
    assert isinstance(monitor, jaxamp.NumericsMonitor)
    with pytest.raises(ValueError, match="every must be a positive int"):
        jaxamp.numerics_monitor(lambda w: jnp.sum(w), every=0)
