"""numerics_monitor(screen=True): a screening pass, and the full report only when it finds inf/NaN.

The screened program runs the instrumented program without its float32 shadow
and twins, then, under a ``lax.cond``, the full program on the same inputs when
the screen counted an inf/NaN in some op or input. Checked on the corpus of the
origin and loss-scale oracles: the screen flags exactly when the full report
holds an inf/NaN, a flagged firing delivers ``numerics_report``'s report, and
an unflagged one the same report with NaN where only the float32 shadow
measures (and no suggested loss scale).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp
from jaxamp._numerics._program import NumericsProgram
from jaxamp._resolve import resolved_spec
from tests.unit.test_numerics_oracles import CORPUS
from tests.unit.test_numerics_origins import ORIGINS

_FLOAT32_FIELDS = ("max_abs_float32", "underflow_fraction", "lost_fraction")


def _cases():
    cases = {}
    for name, (fun, args, policy) in CORPUS.items():
        for scale in (1.0, 2.0**20):  # the larger overflows some backward float16 op
            cases[f"{name}@{scale:g}"] = (fun, args, policy, True, scale)
    for name, (fun, args, grad) in ORIGINS.items():
        cases[name] = (fun, args, None, grad, 1.0 if grad else None)
    return cases


CASES = _cases()


def _screened(fun, args, policy, grad, scale):
    """``(screened report, full report)`` on the same inputs."""
    resolved = None if policy is None else resolved_spec(policy)
    program = NumericsProgram(fun, args, {}, resolved, grad, False)
    inputs = program.inputs(jnp.asarray(1.0 if scale is None else scale, jnp.float32))
    compiled, outputs = program.screened_run(inputs)
    floats, ints, finite, full = jax.device_get(outputs)
    report = compiled.report(floats, ints, finite, scale, bool(full))
    kwargs = {"grad": grad, "policy": policy}
    if scale is not None:
        kwargs["loss_scale"] = scale
    return report, jaxamp.numerics_report(fun, *args, **kwargs)


def _without_float32(report):
    """The full report as the screen gives it (what only the float32 shadow measures NaN)."""
    nan = math.nan
    ops = tuple(
        op
        if op.tensor_scale is not None
        else dataclasses.replace(op, **dict.fromkeys(_FLOAT32_FIELDS, nan))
        for op in report.ops
    )
    return dataclasses.replace(
        report, ops=ops, suggested_loss_scale=None, max_loss_scale=None, screened=True
    )


@pytest.mark.parametrize("name", list(CASES))
def test_screen_flags_exactly_when_the_full_report_holds_an_inf_or_nan(name):
    report, full = _screened(*CASES[name])
    found = bool(full.nonfinite_ops or full.nonfinite_inputs)
    assert report.screened is not found
    if found:
        assert report == full  # the full pass ran on the same inputs
        assert str(report) == str(full)
    else:
        # repr: NaN equals NaN there (dataclass equality compares fields with == on 3.13)
        assert repr(report) == repr(_without_float32(full))
        assert report.first_nonfinite is None and report.suggested_loss_scale is None
        assert all(math.isnan(op.max_abs_float32) for op in report.ops)
        assert report.most_underflow() == []
        assert "screened: no inf/NaN" in str(report)


def test_corpus_covers_both_outcomes():
    screened = [_screened(*case)[0].screened for case in CASES.values()]
    assert any(screened) and not all(screened)


def _loss(params, x):
    h = jnp.tanh(x @ params["w"]) * params["gain"]
    return jnp.mean((h @ params["v"]) ** 2)  # overflows float16 once gain is 300


def _params(gain):
    rng = np.random.default_rng(0)
    return {
        "w": jnp.asarray(rng.normal(size=(8, 16)), jnp.float32),
        "v": jnp.asarray(rng.normal(size=(16, 4)), jnp.float32),
        "gain": jnp.float32(gain),
    }


@pytest.mark.parametrize("gain", [1.0, 300.0])
def test_monitor_host_and_in_step_forms_deliver_the_screened_report(gain):
    params, x = _params(gain), jnp.ones((5, 8), jnp.float32)
    host, in_step = [], []
    kwargs = {"every": 2, "policy": "mixed_float16", "grad": True, "screen": True}
    monitor = jaxamp.numerics_monitor(_loss, callback=lambda s, r: host.append((s, r)), **kwargs)
    traced = jaxamp.numerics_monitor(_loss, callback=lambda s, r: in_step.append((s, r)), **kwargs)

    @jax.jit
    def step(i, p):
        traced(i, p, x, loss_scale=jnp.float32(4.0))
        return p

    for i in range(3):
        monitor(i, params, x, loss_scale=jnp.float32(4.0))
        step(i, params)
    monitor.flush()
    jax.effects_barrier()
    full = jaxamp.numerics_report(
        _loss, params, x, policy="mixed_float16", grad=True, loss_scale=4.0
    )
    want = full if full.nonfinite_ops else _without_float32(full)
    assert want.screened is (gain == 1.0)
    assert [s for s, _ in host] == [0, 2] and [s for s, _ in in_step] == [0, 2]
    assert all(repr(r) == repr(want) for _, r in host)
    # In the step XLA compiles with the step's options: the same sites, the same verdict.
    for _, r in in_step:
        assert r.screened is want.screened
        assert [op.nonfinite for op in r.ops] == [op.nonfinite for op in want.ops]
        assert (r.first_nonfinite is None) is (want.first_nonfinite is None)


def test_screen_must_be_a_bool():
    not_a_bool: Any = 1
    with pytest.raises(TypeError, match="screen"):
        jaxamp.numerics_monitor(_loss, every=1, screen=not_a_bool)
