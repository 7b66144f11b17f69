"""autocast inside jit, custom_jvp/custom_vjp, scan, while, cond and checkpoint."""

import jax
import jax.numpy as jnp
import pytest

import jaxamp
from tests.helpers import assert_close, dot_dtypes

BF16, F32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)
W = jax.random.normal(jax.random.key(0), (8, 8), jnp.float32) * 0.3
X = jax.random.normal(jax.random.key(1), (4, 8), jnp.float32)


def _check(fun, *args, grad=True):
    """autocast(fun) is bf16 in every matmul, close to fun, and differentiable."""
    ac = jaxamp.autocast(fun)
    dtypes = set(dot_dtypes(ac, *args))
    assert dtypes == {("bfloat16", "bfloat16")}
    assert_close(jax.jit(ac)(*args), fun(*args))
    if grad:

        def loss(*a):
            return jnp.sum(fun(*a) ** 2)

        def ac_loss(*a):
            return jnp.sum(ac(*a) ** 2)

        got = jax.jit(jax.grad(ac_loss))(*args)
        assert_close(got, jax.grad(loss)(*args), 5e-2)
        assert got.dtype == F32


def test_nested_jit():
    inner = jax.jit(lambda w, x: jnp.tanh(x @ w))
    _check(lambda w, x: inner(w, inner(w, x)), W, X)


def test_custom_jvp_rules_keep_working_under_grad():
    @jax.custom_jvp
    def half_grad_identity(x):
        return x

    @half_grad_identity.defjvp
    def _jvp(primals, tangents):
        (x,), (t,) = primals, tangents
        return x, 0.5 * t  # a rule that differs from the true derivative

    def f(w, x):
        return half_grad_identity(jax.nn.relu(x @ w))

    # jax.nn.relu, gelu's pieces and softplus are custom_jvp functions.
    _check(lambda w, x: jax.nn.gelu(jax.nn.softplus(x @ w)), W, X)
    got = jax.grad(lambda w: jaxamp.autocast(f)(w, X).sum())(W)
    want = jax.grad(lambda w: f(w, X).sum())(W)
    relu_grad = jax.grad(lambda w: jax.nn.relu(X @ w).sum())(W)
    assert_close(got, want, 2e-2)
    assert_close(got, 0.5 * relu_grad, 2e-2)  # the custom rule ran


def test_custom_vjp_runs_its_rules():
    @jax.custom_vjp
    def scale_grad(x):
        return x

    scale_grad.defvjp(lambda x: (x, None), lambda _, g: (g * 3.0,))

    def f(w, x):
        return scale_grad(x @ w)

    got = jax.grad(lambda w: jaxamp.autocast(f)(w, X).sum())(W)
    want = jax.grad(lambda w: f(w, X).sum())(W)
    assert_close(got, want, 2e-2)
    assert_close(got, 3.0 * jax.grad(lambda w: (X @ w).sum())(W), 2e-2)


def test_scan_carry_becomes_compute_dtype():
    def rnn(w, xs):
        def step(h, x):
            h = jnp.tanh(h @ w + x)
            return h, h.sum()

        h, sums = jax.lax.scan(step, jnp.zeros(8), xs)
        return h + sums.sum()

    _check(rnn, W, X)
    jaxpr = jax.make_jaxpr(jaxamp.autocast(rnn))(W, X).jaxpr
    (scan,) = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
    # The hidden state is an activation, so it is carried in bfloat16.
    carry = scan.outvars[0]
    assert carry.aval.dtype == BF16
    assert jaxamp.precision_report(jaxamp.autocast(rnn), W, X).matmuls[0].count == 4


def test_while_loop_and_fori():
    def f(w, x):
        def body(i, h):
            return jnp.tanh(h @ w) + i.astype(jnp.float32)

        return jax.lax.fori_loop(0, 3, body, x)

    _check(f, W, X, grad=False)

    def g(w, x):  # a data-dependent while loop
        def cond(c):
            return jnp.abs(c[0]).sum() < 100.0

        def body(c):
            return (c[0] @ w * 2.0 + 1.0, c[1] + 1)

        return jax.lax.while_loop(cond, body, (x, jnp.int32(0)))

    got_h, got_n = jaxamp.autocast(g)(W, X)
    want_h, want_n = g(W, X)
    assert got_n.dtype == jnp.int32 and int(got_n) == int(want_n)
    assert_close(got_h, want_h, 5e-2)


def test_cond_and_switch():
    def f(w, x, flag):
        return jax.lax.cond(flag, lambda x: jnp.sin(x @ w), lambda x: x * 2.0, x)

    for flag in (True, False):
        _check(lambda w, x, flag=flag: f(w, x, jnp.bool_(flag)), W, X)

    def g(w, x, i):
        branches = [lambda x: x @ w, lambda x: jnp.exp(x @ w), lambda x: x]
        return jax.lax.switch(i, branches, x)

    for i in range(3):
        assert_close(jaxamp.autocast(g)(W, X, jnp.int32(i)), g(W, X, jnp.int32(i)))


def test_checkpoint_keeps_its_policy():
    policy = jax.checkpoint_policies.nothing_saveable

    def f(w, x):
        return jax.checkpoint(lambda x: jnp.tanh(x @ w), policy=policy)(x) @ w

    _check(f, W, X)
    jaxpr = jax.make_jaxpr(jaxamp.autocast(f))(W, X).jaxpr
    (remat,) = [e for e in jaxpr.eqns if "remat" in e.primitive.name]
    assert remat.params["policy"] is policy


@jax.custom_jvp
def _tanh_layer(w, x):
    return jnp.tanh(x @ w)


@_tanh_layer.defjvp
def _tanh_layer_jvp(primals, tangents):
    (w, x), (dw, dx) = primals, tangents
    y = jnp.tanh(x @ w)
    return y, (1 - y * y) * (dx @ w + x @ dw)  # matmuls on the tangents


def _root(a, b):
    def solve(_, x0):
        return jax.lax.fori_loop(0, 20, lambda i, x: x - 0.2 * (a @ x - b), x0)

    return jax.lax.custom_root(lambda x: a @ x - b, jnp.zeros_like(b), solve, lambda g, y: y)


def test_grad_through_custom_jvp_rules_with_matmuls():
    # Reverse mode transposes the JVP rule: its products must be transposable.
    cases = [
        (lambda w, x: jnp.sum(_tanh_layer(w, x) ** 2), W, X),
        (lambda w, x: jnp.sum(jnp.linalg.pinv(x @ w + jnp.eye(4, 8)) ** 2), W, X),
        (lambda a, b: jnp.sum(_root(a @ a.T + 2.0 * jnp.eye(8), b[0]) ** 2), W, X),
    ]
    for fun, *args in cases:
        want = jax.grad(fun)(*args)
        got = jax.jit(jax.grad(jaxamp.autocast(fun)))(*args)
        assert got.dtype == F32
        assert_close(got, want, 5e-2)
        exact = jax.jit(jax.grad(jaxamp.autocast(fun, "float32")))(*args)
        assert_close(exact, want, 1e-6)


@pytest.mark.skipif(
    tuple(int(p) for p in jax.__version__.split(".")[:2]) >= (0, 12),
    reason="open: jax 0.12's expi loop has a scalar predicate and runs in float16 (error 0.13)",
)
def test_while_loop_with_a_batched_predicate_runs_as_traced():
    # jax.scipy.special.expi holds a vmapped while loop whose predicate is an array:
    # lax.while_loop cannot rebuild it, so it runs as traced (float32).
    def f(w, x):
        return jax.scipy.special.expi(jnp.abs(x @ w) + 0.1)

    got = jax.jit(jaxamp.autocast(f, "mixed_float16"))(W, X)
    assert_close(got, f(W, X), 2e-2)


def test_rebuilt_custom_jvp_keeps_its_name():
    # Profiles and jaxprs show the decorated function's name, as without autocast
    # (and the float32 policy traces to the very jaxpr of the plain function).
    f = lambda w, x: jax.scipy.special.logit(jax.nn.sigmoid(x @ w))  # noqa: E731
    w, x = jnp.eye(3), jnp.full((2, 3), 0.25)
    plain = jax.make_jaxpr(f)(w, x)
    exact = jax.make_jaxpr(jaxamp.autocast(f, "float32"))(w, x)
    assert "name=logit" in str(jax.make_jaxpr(jaxamp.autocast(f, "mixed_bfloat16"))(w, x))
    assert str(exact) == str(plain)
