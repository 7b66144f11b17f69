"""Custom autocast rules: what ``jaxamp.AutocastContext`` gives them, what their outputs mean."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp
from tests.helpers import dot_dtypes

W = jax.random.normal(jax.random.key(0), (8, 8)) * 0.3
X = jax.random.normal(jax.random.key(1), (4, 8))


def _jaxpr(fun, *args):
    return jax.make_jaxpr(fun)(*args).jaxpr


def test_a_rule_gets_the_public_context_of_its_call():
    seen = []

    def rule(context, eqn, x):
        seen.append(context)
        return context.bind(eqn, x)

    policy = jaxamp.get_policy("mixed_float16")
    jaxamp.autocast(lambda w, x: jnp.tanh(x @ w), policy, rules={"tanh": rule})(W, X)
    (context,) = seen
    assert isinstance(context, jaxamp.AutocastContext)
    assert context.policy == policy and context.compute_dtype == np.dtype(jnp.float16)
    assert repr(context) == f"AutocastContext(policy={policy!r})"


def test_cast_moves_floats_only_and_keeps_numpy_constants():
    context = jaxamp.AutocastContext(jaxamp.get_policy("mixed_bfloat16"))
    assert context.cast(jnp.ones(2), "bf16").dtype == jnp.bfloat16
    assert context.cast(jnp.arange(2), jnp.bfloat16).dtype == jnp.int32
    constant = context.cast(np.ones(2, np.float32), jnp.bfloat16)
    assert isinstance(constant, np.ndarray) and constant.dtype == jnp.bfloat16
    with pytest.raises(TypeError, match="dtype must be a floating-point dtype"):
        context.cast(jnp.ones(2), jnp.int32)


def test_an_output_moved_to_float32_stays_there_until_a_matmul():
    def rule(context, eqn, x):
        return context.bind(eqn, context.cast(x, jnp.float32))

    def f(w, x):
        h = jnp.tanh(x @ w)
        return (h + x @ w) @ w

    g = jaxamp.autocast(f, rules={"tanh": rule})
    jaxpr = _jaxpr(g, W, X)
    (tanh,) = [e for e in jaxpr.eqns if e.primitive.name == "tanh"]
    (add,) = [e for e in jaxpr.eqns if e.primitive.name == "add"]
    assert tanh.outvars[0].aval.dtype == jnp.float32
    # The pinned float32 value wins over the bfloat16 activation it meets ...
    assert add.outvars[0].aval.dtype == jnp.float32
    # ... and the next matmul casts it down.
    assert dot_dtypes(g, W, X) == [("bfloat16", "bfloat16")] * 3


def test_an_output_in_the_compute_dtype_is_an_activation():
    def rule(context, eqn, x):
        (y,) = context.bind(eqn, context.cast(x, jnp.float32))
        return [context.cast(y, context.compute_dtype)]

    def f(w, x):
        return jnp.tanh(x @ w) + w[0]

    jaxpr = _jaxpr(jaxamp.autocast(f, rules={"tanh": rule}), W, X)
    (add,) = [e for e in jaxpr.eqns if e.primitive.name == "add"]
    # The float32 parameter follows the activation the rule returned.
    assert add.outvars[0].aval.dtype == jnp.bfloat16
    np.testing.assert_allclose(
        jaxamp.autocast(f, rules={"tanh": rule})(W, X), f(W, X), rtol=0.05, atol=0.05
    )
