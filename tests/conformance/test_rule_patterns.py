"""Rule patterns: the code shapes where a dtype rule decides, each against float32 and by hand.

Each pattern is a function of ``(w, x)`` whose first operation is ``x @ w``;
under both 16-bit policies its value and its gradient must be finite where
float32's and the hand-cast reference's are, and no worse than ``FACTOR`` x the
hand-cast reference's error. Remat policies with dots are compared by compiled
dot counts in ``tests/unit/test_autocast_remat.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp
from tests.conformance._oracles import FACTOR, rel_error

W = jnp.asarray(np.random.default_rng(0).standard_normal((8, 8)) / 3, jnp.float32)
X = jnp.asarray(np.random.default_rng(1).standard_normal((16, 8)), jnp.float32)


def _loop_carry(w, x):
    return jax.lax.scan(lambda a, r: (a + jnp.tanh(r @ w), None), jnp.zeros(8), x)[0]


def _divisor(w, x):
    counts = jnp.sum(jnp.zeros_like(x), 0)  # a float32 count that is 0: 0 + eps
    return (x @ w) / (counts + 1e-5)


def _power_before_reduction(w, x):
    h = 40.0 * (x @ w)
    return h * jax.lax.rsqrt(jnp.mean(h**2, -1, keepdims=True) + 1e-6)


def _mask_constant(w, x):
    scores = (x @ w) @ x.T
    mask = jnp.arange(16)[:, None] >= jnp.arange(16)[None, :]
    mask = mask.at[3].set(False)  # a fully masked row
    filled = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    return jax.nn.softmax(filled, -1) @ x


@jax.custom_vjp
def _scaled_matmul(x, w):
    return x @ w


_scaled_matmul.defvjp(lambda x, w: (x @ w, (x, w)), lambda r, g: (g @ r[1].T, r[0].T @ g))


def _custom_vjp_matmul(w, x):
    return jnp.tanh(_scaled_matmul(x @ w, w))


@jax.custom_jvp
def _jvp_layer(w, x):
    return jnp.tanh(x @ w)


_jvp_layer.defjvp(
    lambda p, t: (
        jnp.tanh(p[1] @ p[0]),
        (1 - jnp.tanh(p[1] @ p[0]) ** 2) * (t[1] @ p[0] + p[1] @ t[0]),
    )
)


def _custom_jvp_matmul(w, x):
    return _jvp_layer(w, x @ w)


PATTERNS = {
    "loop_carry": _loop_carry,
    "divisor": _divisor,
    "power_before_reduction": _power_before_reduction,
    "mask_constant": _mask_constant,
    "custom_vjp_matmul": _custom_vjp_matmul,
    "custom_jvp_matmul": _custom_jvp_matmul,
}


def _hand(fun, dtype):
    def run(w, x):
        with jax.numpy_dtype_promotion("standard"):
            return fun(w.astype(dtype), x.astype(dtype)).astype(jnp.float32)

    return run


def _check(got, want, hand):
    got, want, hand = (np.asarray(a, np.float64) for a in (got, want, hand))
    assert np.isfinite(got[np.isfinite(want) & np.isfinite(hand)]).all()
    assert rel_error([got], [want]) <= FACTOR * rel_error([hand], [want]) + 1e-2


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_pattern(name, policy):
    fun = PATTERNS[name]
    dtype = jaxamp.get_policy(policy).compute_dtype
    ac = jaxamp.autocast(fun, policy)
    _check(jax.jit(ac)(W, X), fun(W, X), jax.jit(_hand(fun, dtype))(W, X))

    def total(f):
        return lambda w, x: jnp.sum(f(w, x).astype(jnp.float32))

    grad = jax.jit(jax.grad(total(ac)))(W, X)
    _check(grad, jax.grad(total(fun))(W, X), jax.jit(jax.grad(total(_hand(fun, dtype))))(W, X))


def _loss(fun):
    return lambda w, x: jnp.sum(jnp.tanh(fun(w, x).astype(jnp.float32)))


def _two_layers(w, x):
    return jnp.tanh(x @ w) @ w


# Second derivatives, each under one 16-bit policy (the slow test below takes the
# Hessian of every pattern under both). Forward over reverse (jax.hessian is jacfwd
# of jacrev) runs the matmul's custom_vjp fwd and bwd under the outer JVP: they must
# be made of primitives JAX can differentiate, not of the custom_vjp itself.
SECOND_ORDER = {
    "hessian": (jax.hessian, "mixed_bfloat16"),
    "jacfwd_of_grad": (lambda f: jax.jacfwd(jax.grad(f)), "mixed_float16"),
    "jvp_of_grad": (
        lambda f: lambda w, x: jax.jvp(lambda v: jax.grad(f)(v, x), (w,), (W.T,))[1],
        "mixed_bfloat16",
    ),
    "jacrev_of_grad": (lambda f: jax.jacrev(jax.grad(f)), "mixed_float16"),
}


@pytest.mark.parametrize("order", sorted(SECOND_ORDER))
def test_second_order(order):
    transform, policy = SECOND_ORDER[order]
    dtype = jaxamp.get_policy(policy).compute_dtype
    got = jax.jit(transform(_loss(jaxamp.autocast(_two_layers, policy))))(W, X)
    hand = jax.jit(transform(_loss(_hand(_two_layers, dtype))))(W, X)
    _check(got, transform(_loss(_two_layers))(W, X), hand)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_hessian_of_every_pattern(name, policy):
    fun = PATTERNS[name]
    dtype = jaxamp.get_policy(policy).compute_dtype
    got = jax.jit(jax.hessian(_loss(jaxamp.autocast(fun, policy))))(W, X)
    hand = jax.jit(jax.hessian(_loss(_hand(fun, dtype))))(W, X)
    _check(got, jax.hessian(_loss(fun))(W, X), hand)


def test_vmap_of_grad():
    def loss(w, x):
        return jnp.sum(jnp.tanh(x @ w) ** 2)

    per_example = jax.vmap(jax.grad(jaxamp.autocast(loss)), in_axes=(None, 0))
    want = jax.vmap(jax.grad(loss), in_axes=(None, 0))(W, X[:, None])
    got = jax.jit(per_example)(W, X[:, None])
    assert rel_error([got], [want]) < 3e-2
