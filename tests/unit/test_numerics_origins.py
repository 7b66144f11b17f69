"""numerics_report's origin against an op-by-op oracle, constants, inputs, phases, cache.

The oracle for ``first_nonfinite`` is JAX's own ``jax_debug_nans``/``jax_debug_infs``
run op by op (``jax.disable_jit``): it raises at the first primitive whose output
holds an inf/NaN, and its traceback holds the user's line. The report must name
the same primitive at the same line, including inside JAX's own jitted functions
(``jnp.where``, ``jnp.linalg.norm``, ``jax.nn.softmax``).
"""

from __future__ import annotations

import os
import traceback

import jax
import jax.numpy as jnp
import pytest

import jaxamp

_HERE = os.path.realpath(__file__)


def _masked_softmax(s, m):
    s = jnp.where(m, s, -1e9)  # a float16 -inf: a fully masked row is NaN
    return jax.nn.softmax(s, axis=-1)


def _norm(x):
    y = jnp.where(x > 0, x, 0.0)
    return jnp.linalg.norm(y)  # its gradient at 0 is 0/0


def _log_softmax_loss(w, x):
    logits = (x @ w) * 300.0
    return -jnp.mean(jax.nn.log_softmax(logits.astype(jnp.float16), axis=-1))


def _sqrt_sum(x):
    return jnp.sum(jnp.sqrt(jnp.clip(x, 0.0, 1.0)))


_MASK = jnp.array([[True, True, False], [False, False, False]])
ORIGINS = {
    # name: (fun, args, grad): the plain program, differentiated wrt args[0] if grad
    "attention_mask": (_masked_softmax, (jnp.ones((2, 3), jnp.float16), _MASK), False),
    "norm_gradient_at_zero": (_norm, (jnp.zeros(3),), True),
    "log_softmax": (
        _log_softmax_loss,
        (jnp.ones((4, 3)), jnp.ones((2, 4)).at[0, 0].set(1000.0)),
        False,
    ),
    "sqrt_gradient_at_zero": (_sqrt_sum, (jnp.zeros(3),), True),
}

# The gradient of the norm at 0 is 0/0, which the where's gradient then discards.
ABSORBED = frozenset({"norm_gradient_at_zero"})


def _op_by_op_origin(fun, args, grad):
    """``(primitive, user line)`` where ``jax_debug_nans``/``infs`` stop, op by op."""
    program = jax.grad(fun) if grad else fun
    jax.config.update("jax_debug_nans", True)
    jax.config.update("jax_debug_infs", True)
    try:
        with jax.disable_jit():
            program(*args)
    except FloatingPointError as err:
        primitive = str(err).rsplit(" in ", 1)[1].split()[0]
        frames = traceback.extract_tb(err.__traceback__)
        lines = [f.lineno for f in frames if os.path.realpath(f.filename) == _HERE]
        return primitive, lines[-1]
    finally:
        jax.config.update("jax_debug_nans", False)
        jax.config.update("jax_debug_infs", False)
    return None


@pytest.mark.parametrize("name", list(ORIGINS))
def test_first_nonfinite_matches_op_by_op_debug_nans(name):
    fun, args, grad = ORIGINS[name]
    want = _op_by_op_origin(fun, args, grad)
    assert want is not None, "the oracle found no inf/NaN"
    report = jaxamp.numerics_report(fun, *args, grad=grad)
    origin = report.first_nonfinite
    if name in ABSORBED:  # the NaN never reaches the gradient: listed, not blamed
        assert origin is None and len(report.absorbed) == 1
        origin = report.absorbed[0]
    assert origin is not None
    path, line = origin.source.rsplit(":", 1)
    assert (origin.primitive, os.path.realpath(path), int(line)) == (want[0], _HERE, want[1])
    assert "jax/_src" not in str(report)  # no row points into JAX
    assert "source_info_util.py" not in str(report)


def _big_literal(x):
    return x * 1e5  # 1e5 is a float16 inf once traced


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")
def test_out_of_range_constant_is_an_origin_at_its_line():
    x = jnp.ones(3, jnp.float16)
    report = jaxamp.numerics_report(_big_literal, x)
    origin = report.first_nonfinite
    assert origin is not None and origin.primitive == "mul"
    assert origin.source.endswith(f":{_big_literal.__code__.co_firstlineno + 1}")
    assert "non-finite inputs" not in str(report) and not report.nonfinite_inputs
    # An -inf in a float32 mask is written on purpose: not an origin.
    masked = jaxamp.numerics_report(lambda s: jnp.where(s > 1, s, -jnp.inf), jnp.ones(3))
    assert masked.first_nonfinite is None and masked.nonfinite_ops
    assert "float32 constants" in str(masked)


def test_nonfinite_inputs_are_named_by_argument_and_path():
    def loss(params, x, *, scale):
        return jnp.mean((x @ params["w"]) * scale)

    params = {"w": jnp.ones((3, 2)), "b": jnp.ones(2).at[1].set(jnp.inf)}
    x = jnp.ones((1, 3)).at[0, 0].set(jnp.nan)
    report = jaxamp.numerics_report(loss, params, x, scale=jnp.float32(2.0), grad=True)
    assert report.nonfinite_inputs == ("params['b']", "x")
    assert report.first_nonfinite is None
    assert "non-finite inputs: params['b'], x" in str(report)


def test_has_aux_state_updates_get_their_own_phase():
    def loss(params, x):
        h = x @ params["w"]
        codebook = 0.99 * params["codebook"] + 0.01 * jnp.mean(h)  # an EMA update
        return jnp.mean(h * h), {"codebook": codebook}

    params = {"w": jnp.ones((3, 2)), "codebook": jnp.ones(4)}
    report = jaxamp.numerics_report(loss, params, jnp.ones((5, 3)), grad=True, has_aux=True)
    phases = {op.phase for op in report.ops}
    assert phases == {"forward", "backward", "state"}
    state = [op for op in report.ops if op.phase == "state"]
    assert [op.primitive for op in state] == ["mul", "reduce_sum", "div", "mul", "add"]
    assert not any(op.scaled for op in state)
    with pytest.raises(TypeError, match="has_aux"):
        jaxamp.numerics_report(
            lambda p, x: jnp.mean(x @ p["w"]), params, jnp.ones((5, 3)), grad=True, has_aux=True
        )


def test_the_compiled_program_is_reused_across_calls_and_loss_scales():
    from jaxamp._numerics import _compiled

    def loss(w, x):
        return jnp.mean(jnp.tanh(x @ w))

    w, x = jnp.ones((4, 3)), jnp.ones((2, 4))
    _compiled.cache_clear()
    first = jaxamp.numerics_report(loss, w, x, policy="mixed_float16", grad=True)
    again = jaxamp.numerics_report(
        loss, w * 2, x, policy="mixed_float16", grad=True, loss_scale=8.0
    )
    assert len(_compiled._CACHE) == 1  # the second call compiled nothing
    assert again.loss_scale == 8.0
    assert max(op.max_abs for op in again.ops) != max(op.max_abs for op in first.ops)
    jaxamp.numerics_report(loss, w, x[:1], policy="mixed_float16", grad=True)  # new shape
    assert len(_compiled._CACHE) == 2
