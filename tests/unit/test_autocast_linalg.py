"""Linear algebra under autocast: a custom_jvp function built on a float32
factorization runs its whole rule in float32, and no tracer escapes a rebuilt
custom_jvp that closes over traced values.

Each test is the reproducer of a failure the conformance sweep's linear-algebra
generator (``tests/conformance/_edges.py``) finds.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp
from tests.helpers import conditioned, dot_dtypes, rel_err

F32 = jnp.dtype(jnp.float32)
POLICIES = ("mixed_bfloat16", "mixed_float16")


@pytest.mark.parametrize("policy", POLICIES)
def test_no_tracer_escapes_a_custom_jvp_that_closes_over_traced_values(policy):
    # pinv's rtol is a nondiff argument: traced, it is a closed-over constant of the
    # custom_jvp call, and the rule's jaxpr closed over the ended trace's tracer
    # (UnexpectedTracerError, or "No constant handler" under grad of jit).
    def pinv(w, x):
        a = x @ w
        return jnp.linalg.pinv(a, rtol=jax.lax.stop_gradient(jnp.mean(a)) * 1e-3)

    w, x = jnp.eye(8), conditioned(4, 8, 10.0)

    def loss(fun):
        return lambda w, x: jnp.sum(jnp.tanh(fun(w, x)))

    want = jax.grad(loss(pinv))(w, x)
    auto = jaxamp.autocast(pinv, policy)
    for grad in (jax.jit(jax.grad(loss(auto))), jax.grad(jax.jit(loss(auto)))):
        got = grad(w, x)
        assert rel_err(got, want) < 0.05


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("shape", [(4, 8), (8, 8)])
def test_pinv_runs_its_whole_rule_in_float32(policy, shape):
    # pinv's SVD runs in float32; its primal and JVP matmuls must too: with 16-bit
    # matmuls around the float32 SVD the gradient on a matrix of condition number
    # 2000 was 37x (bfloat16) further from float32 than the hand-cast program's,
    # non-finite in float16. The hand-cast program: the activation computed in
    # 16 bits, pinv (no 16-bit kernel) on it in float32.
    def pinv(w, x):
        return jnp.linalg.pinv(x @ w)

    def loss(fun):
        return lambda w, x: jnp.sum(jnp.tanh(fun(w, x)))

    dtype = jaxamp.get_policy(policy).compute_dtype
    w, x = jnp.eye(shape[1]), conditioned(*shape, 2000.0 if shape[0] == shape[1] else 10.0)

    def hand(w, x):
        return jnp.linalg.pinv((x.astype(dtype) @ w.astype(dtype)).astype(F32))

    want = jax.grad(loss(pinv))(w, x)
    got = jax.jit(jax.grad(loss(jaxamp.autocast(pinv, policy))))(w, x)
    by_hand = jax.grad(loss(hand))(w, x)
    assert np.isfinite(np.asarray(got)).all()
    assert rel_err(got, want) <= 1.5 * rel_err(by_hand, want) + 1e-3
    # Only the activation's matmul runs in 16 bits; pinv's own run in float32.
    name = np.dtype(dtype).name
    assert dot_dtypes(jaxamp.autocast(pinv, policy), w, x) == [(name, name)] + [
        ("float32", "float32")
    ] * (len(dot_dtypes(pinv, w, x)) - 1)


def test_float32_core_results_are_pinned_and_the_float32_policy_is_exact():
    def fun(w, x):
        return jnp.linalg.pinv(x @ w) @ w[:, :4].T

    w, x = jnp.eye(8) + 0.1, conditioned(4, 8, 10.0)
    jaxpr = jax.make_jaxpr(jaxamp.autocast(fun, "mixed_bfloat16"))(w, x).jaxpr
    # pinv's call (the first; then the saturating cast of its result into the matmul).
    call = next(e for e in jaxpr.eqns if e.primitive.name == "custom_jvp_call")
    assert all(v.aval.dtype == F32 for v in call.invars + call.outvars)
    exact = jax.jit(jaxamp.autocast(fun, "float32"))(w, x)
    np.testing.assert_array_equal(exact, jax.jit(fun)(w, x))


@pytest.mark.parametrize("policy", POLICIES)
def test_lstsq_runs_its_whole_jit_in_float32_and_its_gradient_is_finite(policy):
    # lstsq is a jit around an SVD, not a custom_jvp: its matmuls and residual ran
    # in 16 bits around the float32 SVD. On a wide matrix the float16 residual is
    # exactly 0 and its norm's gradient NaN, where float32's (and the hand-cast
    # program's: lstsq has no 16-bit kernel, it runs on the widened activation)
    # is finite. A call built on a factorization runs as a whole in float32.
    b = np.random.default_rng(1).uniform(0.2, 0.8, (4, 2)).astype(np.float32)

    def lstsq(w, x):
        solution, residuals, _, singular_values = jnp.linalg.lstsq(x @ w, b)
        return solution, residuals, singular_values

    def loss(fun):
        return lambda w, x: sum(jnp.sum(jnp.tanh(o.astype(F32))) for o in fun(w, x))

    dtype = jaxamp.get_policy(policy).compute_dtype
    w, x = jnp.eye(8), conditioned(4, 8, 10.0)

    def hand(w, x):
        return lstsq(jnp.eye(8), (x.astype(dtype) @ w.astype(dtype)).astype(F32))

    want = jax.grad(loss(lstsq))(w, x)
    by_hand = jax.grad(loss(hand))(w, x)
    auto = jaxamp.autocast(lstsq, policy)
    got = jax.jit(jax.grad(loss(auto)))(w, x)
    assert np.isfinite(np.asarray(by_hand)).all() and np.isfinite(np.asarray(got)).all()
    assert rel_err(got, want) <= 1.5 * rel_err(by_hand, want) + 1e-3
    name = np.dtype(dtype).name
    assert dot_dtypes(auto, w, x) == [(name, name)] + [("float32", "float32")] * (
        len(dot_dtypes(lstsq, w, x)) - 1
    )
