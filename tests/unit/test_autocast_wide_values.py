"""What "follow" keeps in float32: norm statistics, loop accumulators, divisors, tiny constants.

Each test is the minimal reproducer of a way 16 bits broke a float32 value, checked
against float32 and against the same code cast to 16 bits by hand (JAX's promotion
keeps float32 + bfloat16 in float32).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp
from tests.helpers import rel_err

F32 = jnp.dtype(jnp.float32)


def _rng(seed, *shape, scale=1.0):
    return jnp.asarray(scale * np.random.default_rng(seed).standard_normal(shape), F32)


def test_powers_before_a_reduction_run_in_float32():
    # float16: 300**2 is inf; the mean of squares must not be.
    def mean_square(w, x):
        return jnp.mean((x @ w) ** 2)

    w, x = jnp.eye(4), jnp.array([[300.0, 1.0, -2.0, 0.5]])
    got = jax.jit(jaxamp.autocast(mean_square, "mixed_float16"))(w, x)
    np.testing.assert_allclose(got, mean_square(w, x), rtol=1e-3)

    def rms_norm(w, x):
        h = x @ w
        return h * jax.lax.rsqrt(jnp.mean(jnp.square(h), -1, keepdims=True) + 1e-6)

    x = _rng(0, 8, 16).at[0, 3].set(400.0)
    w = jnp.eye(16)
    for policy in ("mixed_float16", "mixed_bfloat16"):
        got = jax.jit(jaxamp.autocast(rms_norm, policy))(w, x)
        assert np.isfinite(np.asarray(got)).all() and rel_err(got, rms_norm(w, x)) < 1e-2


def test_fast_variance_does_not_cancel_in_bfloat16():
    # Flax's use_fast_variance: E[x^2] - E[x]^2, with a mean far from zero.
    def variance(w, x):
        h = x @ w
        return jnp.mean(jnp.square(h), -1) - jnp.square(jnp.mean(h, -1))

    w, x = jnp.eye(64), 8.0 + _rng(1, 16, 64, scale=0.5)
    want = variance(w, x)
    # Not jitted: XLA:CPU fuses the square into the sum and drops its 16-bit
    # rounding, which GPUs keep; op by op every rounding happens (0.15 before).
    got = jaxamp.autocast(variance)(w, x)
    assert rel_err(got, want) < 2e-2
    squares = [
        e
        for e in jax.make_jaxpr(jaxamp.autocast(variance))(w, x).eqns
        if e.primitive.name in ("square", "integer_pow")
    ]
    assert squares and {e.outvars[0].aval.dtype for e in squares} == {F32}


def test_float32_loop_accumulators_stay_float32():
    def pool(w, xs):
        total, _ = jax.lax.scan(lambda a, x: (a + jnp.tanh(x @ w), None), jnp.zeros((4, 16)), xs)
        return total / xs.shape[0]

    def euler(w, y0):
        return jax.lax.fori_loop(0, 200, lambda i, y: y + 0.01 * jnp.tanh(y @ w), y0)

    def ema(w, xs):
        step = lambda m, x: (0.99 * m + 0.01 * jnp.tanh(x @ w), None)  # noqa: E731
        return jax.lax.scan(step, jnp.zeros((4, 16)), xs)[0]

    w = _rng(2, 16, 16, scale=0.25)
    xs = _rng(3, 512, 4, 16)
    for fun, arg in ((pool, xs), (euler, xs[0]), (ema, xs)):
        want = fun(w, arg)
        got = jax.jit(jaxamp.autocast(fun))(w, arg)
        bf16 = jnp.bfloat16
        with jax.numpy_dtype_promotion("standard"):  # hand-cast: the f32 carry stays f32
            hand = fun(w.astype(bf16), arg.astype(bf16)).astype(F32)
        assert rel_err(got, want) < max(2 * rel_err(hand, want), 5e-3), fun.__name__
    jaxpr = jax.make_jaxpr(jaxamp.autocast(pool))(w, xs).jaxpr
    (scan,) = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
    assert scan.outvars[0].aval.dtype == F32


def test_small_float32_divisor_is_not_narrowed():
    # hk.nets.VectorQuantizerEMA: an unused code's count is ~1e-5; 1/1e-5 is inf in float16.
    def normalise(w, x, counts):
        return (x @ w) / (counts + 1e-5)

    w, x, counts = jnp.eye(4), jnp.zeros((2, 4)).at[0].set(1.0), jnp.array([3.0, 0.0, 1.0, 0.0])
    want = normalise(w, x, counts)
    got = jax.jit(jaxamp.autocast(normalise, "mixed_float16"))(w, x, counts)
    assert np.isfinite(np.asarray(got)).all()
    np.testing.assert_allclose(got, want, rtol=1e-3)


@pytest.mark.parametrize("eps", [1e-8, 1e-7])
def test_constants_that_underflow_are_not_narrowed(eps):
    def log_prob(w, x):
        p = jax.nn.relu(x @ w)
        return jnp.log(p + eps)

    w, x = jnp.eye(4), jnp.array([[0.0, 0.5, -1.0, 2.0]])
    got = jax.jit(jaxamp.autocast(log_prob, "mixed_float16"))(w, x)
    assert np.isfinite(np.asarray(got)).all()
    np.testing.assert_allclose(got, log_prob(w, x), rtol=1e-3)


def test_rnn_state_and_biases_still_follow_the_activation():
    # The exceptions are narrow: a hidden state recomputed through a matmul and a
    # nonlinearity is carried in 16 bits, and a bias add runs in 16 bits.
    def rnn(w, xs):
        return jax.lax.scan(lambda h, x: (jnp.tanh(h @ w + x), None), jnp.zeros(16), xs)[0]

    w, xs = _rng(4, 16, 16, scale=0.25), _rng(5, 8, 16)
    jaxpr = jax.make_jaxpr(jaxamp.autocast(rnn))(w, xs).jaxpr
    (scan,) = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
    assert scan.outvars[0].aval.dtype == jnp.bfloat16

    def dense(w, b, x):
        return jnp.tanh(x @ w + b) / 2.0

    jaxpr = jax.make_jaxpr(jaxamp.autocast(dense))(w, w[0], xs).jaxpr
    adds = [e for e in jaxpr.eqns if e.primitive.name in ("add", "div")]
    assert {e.outvars[0].aval.dtype for e in adds} == {jnp.dtype(jnp.bfloat16)}


def test_polynomials_with_large_coefficients_evaluate_in_float32():
    # jax 0.12 evaluates jnp.polyval as one `polynomial` primitive (jax 0.10: a scan
    # whose accumulator stays float32); expi's rational approximation has
    # coefficients up to 1.6e6, which float16 cannot hold (0.97 relative error).
    coeffs = np.array([-5.35, 218.5, -4176.6, 55411.8, -331338.1, 1592627.2], np.float32)

    def poly(w, x):
        return jnp.polyval(coeffs, x @ w)

    def expi(w, x):
        return jax.scipy.special.expi(x @ w)

    w = jnp.eye(4)
    x = jnp.asarray(np.random.default_rng(5).uniform(0.2, 1.8, (4, 4)), F32)
    for fun in (poly, expi):
        want = fun(w, x)
        got = jax.jit(jaxamp.autocast(fun, "mixed_float16"))(w, x)
        assert np.isfinite(np.asarray(got)).all(), fun.__name__
        assert rel_err(got, want) < 1e-2, fun.__name__
