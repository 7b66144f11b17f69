"""What "follow" keeps in float32: norm statistics, loop accumulators, divisors, tiny constants.

Each test is the minimal reproducer of a way 16 bits broke a float32 value, checked
against float32 and against the same code cast to 16 bits by hand (JAX's promotion
keeps float32 + bfloat16 in float32).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp
from jaxamp._engine import _compat as compat
from tests.helpers import bits, rel_err

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


def _hand_cast(fun, dtype, *args):
    # The same code on 16-bit inputs under JAX's standard promotion.
    with jax.numpy_dtype_promotion("standard"):
        return fun(*[a.astype(dtype) for a in args])


@pytest.mark.parametrize("scale", [70000.0, 100000.0])
def test_constants_beyond_the_range_are_not_saturated(scale):
    # float16's max is 65504: a saturated scale returns 6.5% (70000) or 34.5%
    # (100000) too little, forward and gradient. The hand-cast program multiplies
    # a float16 activation by a float32 array in float32.
    def scaled(w, x):
        return jnp.tanh(x @ w) * jnp.float32(scale)

    def loss(fun):
        return lambda w, x: jnp.mean(fun(w, x))

    w, x = _rng(6, 16, 16, scale=0.25), _rng(7, 8, 16)
    auto = jaxamp.autocast(scaled, "mixed_float16")
    hand = functools.partial(_hand_cast, scaled, jnp.float16)
    want, got = scaled(w, x), jax.jit(auto)(w, x)
    assert rel_err(got, want) <= 2 * rel_err(hand(w, x), want)
    assert rel_err(got, want) < 1e-2
    grad_want = jax.grad(loss(scaled))(w, x)
    grad_got = jax.jit(jax.grad(loss(auto)))(w, x)
    grad_hand = jax.grad(loss(hand))(w, x)
    assert rel_err(grad_got, grad_want) <= 2 * rel_err(grad_hand, grad_want) + 1e-3
    muls = [e for e in jax.make_jaxpr(auto)(w, x).jaxpr.eqns if e.primitive.name == "mul"]
    assert [e.outvars[0].aval.dtype for e in muls] == [F32]


def _selects(fun, *args):
    # The select_n equations of fun's jaxpr, jit bodies included.
    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "select_n":
                yield eqn
            for sub in compat.sub_closed_jaxprs(eqn):
                yield from walk(sub.jaxpr)

    return list(walk(jax.make_jaxpr(fun)(*args).jaxpr))


def _masked(fill):
    def masked(w, x):
        h = jnp.tanh(x @ w)
        return jnp.where(h > 0, h, -fill)

    return masked


def _scaled_in_a_jit(scale):
    def scaled(w, x):
        return jax.jit(lambda h, c: h * c)(jnp.tanh(x @ w), scale)

    return scaled


@pytest.mark.parametrize("use", [_masked, _scaled_in_a_jit])
@pytest.mark.parametrize("factor", [1.5, 10.0])
def test_constants_beyond_the_range_are_constants_inside_a_jit(use, factor):
    # jnp.where's fill value reaches select_n as an argument of its jit, then
    # broadcast: traced values inside. Saturated, a fill of 1.5x float16's max
    # became 65504; the hand-cast program (float16 activation, float32 fill)
    # selects in float32. A constant passed to the user's own jit is the same.
    fun = use(np.float32(factor * 65504.0))

    def loss(f):
        return lambda w, x: jnp.mean(f(w, x) * x[:, :1])

    w, x = _rng(13, 16, 16, scale=0.25), _rng(14, 8, 16)
    auto = jaxamp.autocast(fun, "mixed_float16")
    want, got = fun(w, x), jax.jit(auto)(w, x)
    hand = _hand_cast(fun, jnp.float16, w, x)
    assert got.dtype == F32 and hand.dtype == F32
    assert rel_err(got, want) <= 2 * rel_err(hand, want) + 1e-6 < 1e-2
    grad_want = jax.grad(loss(fun))(w, x)
    grad_got = jax.jit(jax.grad(loss(auto)))(w, x)
    grad_hand = jax.grad(loss(functools.partial(_hand_cast, fun, jnp.float16)))(w, x)
    assert rel_err(grad_got, grad_want) <= 2 * rel_err(grad_hand, grad_want) + 1e-3
    if use is _masked:
        assert [e.outvars[0].aval.dtype for e in _selects(auto, w, x)] == [F32]


def test_a_traced_fill_value_still_saturates():
    # A fill that is an input (not a constant) cannot be looked at: it saturates
    # to float16's largest value, the select stays in float16.
    def masked(w, x, fill):
        h = jnp.tanh(x @ w)
        return jnp.where(h > 0, h, -fill)

    w, x, fill = _rng(13, 16, 16, scale=0.25), _rng(14, 8, 16), jnp.float32(1e5)
    auto = jaxamp.autocast(masked, "mixed_float16")
    got = jax.jit(auto)(w, x, fill)
    assert float(jnp.min(got)) == -65504.0
    # The where's select stays in float16; the saturating cast chooses between the
    # clipped and the non-finite fill in float32, then casts once.
    dtypes = [e.outvars[0].aval.dtype for e in _selects(auto, w, x, fill)]
    assert sorted(map(str, dtypes)) == ["float16", "float32"]


@pytest.mark.parametrize("fill", [-1e9, float(jnp.finfo(jnp.float32).min)])
def test_mask_fill_values_keep_fully_masked_rows_finite(fill):
    # A fill value beyond float16's range runs its select in float32 now (it is a
    # constant float16 cannot hold): a fully masked row is uniform, as in float32.
    def attention(w, x):
        s = x @ w
        mask = (jnp.arange(8)[:, None] >= jnp.arange(8)[None, :]).at[2].set(False)
        return jax.nn.softmax(jnp.where(mask, s, fill), axis=-1)

    w, x = _rng(8, 8, 8), _rng(9, 8, 8)
    want = attention(w, x)
    for policy in ("mixed_float16", "mixed_bfloat16"):
        got = jax.jit(jaxamp.autocast(attention, policy))(w, x)
        assert np.isfinite(np.asarray(got)).all()
        assert rel_err(got, want) < 3e-2
        np.testing.assert_allclose(got[2], np.full(8, 1 / 8), rtol=1e-6)


SCATTERS = {
    "add": lambda ids, u: jnp.zeros(4, F32).at[ids].add(u),
    "segment_sum": lambda ids, u: jax.ops.segment_sum(u, ids, num_segments=4),
    "max": lambda ids, u: jnp.full(4, -5.0, F32).at[ids].max(u),
    "min": lambda ids, u: jnp.full(4, 5.0, F32).at[ids].min(u),
    "mul": lambda ids, u: jnp.ones(4, F32).at[ids[:16]].mul(1 + 0.01 * u[:16], unique_indices=True),
}


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
@pytest.mark.parametrize("name", sorted(SCATTERS))
def test_scatters_into_a_float32_buffer_accumulate_in_float32(policy, name):
    # 4096 updates on 4 indices: summed in bfloat16 the buffer has 0.04 relative
    # error (0.17 in longer runs), in float32 0.001. .at[] casts the updates to the
    # buffer's dtype, so the hand-cast program keeps the float32 buffer too.
    rng = np.random.default_rng(10)
    ids = jnp.asarray(rng.permutation(4096) % 4 if name == "mul" else rng.integers(0, 4, 4096))
    scatter = SCATTERS[name]

    def fun(w, x):
        return scatter(ids, (x @ w)[:, 0])

    w, x = _rng(11, 8, 1, scale=0.3) + 1.0, _rng(12, 4096, 8)
    dtype = jaxamp.get_policy(policy).compute_dtype
    want, got = fun(w, x), jax.jit(jaxamp.autocast(fun, policy))(w, x)
    hand = _hand_cast(fun, dtype, w, x)
    assert rel_err(got, want) <= 2 * rel_err(hand, want) + 1e-6
    jaxpr = jax.make_jaxpr(jaxamp.autocast(fun, policy))(w, x).jaxpr
    scatters = [e for e in jaxpr.eqns if e.primitive.name.startswith("scatter")]
    assert scatters and all(e.outvars[0].aval.dtype == F32 for e in scatters)
    assert all(e.invars[2].aval.dtype == F32 for e in scatters)
    grad = jax.jit(jax.grad(lambda w, x: jnp.sum(jaxamp.autocast(fun, policy)(w, x))))(w, x)
    assert np.isfinite(np.asarray(grad)).all()


def test_a_typed_prng_key_closed_over_by_an_outer_jit_is_not_a_constant_to_look_at():
    # Regression: a typed key that is a constant of the trace reached the check
    # for constants beyond the compute dtype's range, which read it as NumPy.
    key = jax.random.key(1)
    reparam = jax.jit(lambda rng, m: m + jax.random.normal(rng, m.shape))
    f = jaxamp.autocast(lambda w, x, k: jnp.sum(reparam(k, x @ w)), "mixed_float16")
    x, w = _rng(0, 4, 8), _rng(1, 8, 8)
    closed_over = jax.jit(jax.value_and_grad(lambda w: f(w, x, key)))(w)
    as_argument = jax.jit(jax.value_and_grad(lambda w, k: f(w, x, k)))(w, key)
    assert bits(closed_over) == bits(as_argument)
    # The product ran in float16, and the noise was drawn as traced (float32).
    hand = x.astype(jnp.float16) @ w.astype(jnp.float16)
    want = jnp.sum(hand.astype(F32) + jax.random.normal(key, (4, 8)))
    assert rel_err(closed_over[0], want) < 1e-3
