"""Regression tests for what the ``jax.lax`` and ``optax.losses`` conformance sweep found.

Each compares autocast against the plain float32 function and against the same
code written by hand in 16 bits (JAX's standard promotion), under ``jax.jit``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp
from tests.helpers import rel_err

optax = pytest.importorskip("optax")

W = jnp.eye(4)
X = jnp.array(np.random.default_rng(0).uniform(0.2, 0.8, (4, 4)), jnp.float32)
SCATTER = jax.lax.ScatterDimensionNumbers(
    update_window_dims=(1,), inserted_window_dims=(0,), scatter_dims_to_operand_dims=(0,)
)


def _apply_at_rows(w, x):
    rows = jnp.array([[2], [0]], jnp.int32)
    return jax.lax.scatter_apply(x @ w, rows, jnp.exp, SCATTER, update_shape=(2, 4))


def _at_apply(w, x):
    return (x @ w).at[1].apply(jnp.sin)


@pytest.mark.parametrize("fun", [_apply_at_rows, _at_apply])
@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_scatter_apply_applies_its_function(fun, policy):
    # The scatter holds the applied function as its update jaxpr; rebuilding it
    # as a replacing scatter wrote zeros at the indices.
    want = jax.jit(fun)(W, X)
    np.testing.assert_array_equal(jax.jit(jaxamp.autocast(fun, "float32"))(W, X), want)
    got = jax.jit(jaxamp.autocast(fun, policy))(W, X)
    dtype = jaxamp.get_policy(policy).compute_dtype
    hand = jax.jit(fun)(W.astype(dtype), X.astype(dtype))
    assert rel_err(got, want) <= 2 * rel_err(hand, want) + float(jnp.finfo(dtype).eps)


def _ctc(w, logits, logit_paddings, labels, label_paddings):
    return optax.losses.ctc_loss(logits @ w, logit_paddings, labels, label_paddings)


def test_ctc_loss_of_a_padded_sequence_stays_finite_in_float16():
    # CTC's forward variables hold log_epsilon = -1e5 (float32 on purpose) and
    # pick the loss out with a one-hot einsum: cast to float16, -1e5 became -inf
    # and 0 x -inf = NaN for every sequence with padded labels.
    logits = jnp.array(np.random.default_rng(1).uniform(-2, 2, (2, 5, 4)), jnp.float32)
    logit_paddings = jnp.array([[0, 0, 0, 0, 0], [0, 0, 0, 1, 1]], jnp.float32)
    labels = jnp.array([[1, 2, 1], [3, 3, 0]], jnp.int32)
    label_paddings = jnp.array([[0, 0, 0], [0, 0, 1]], jnp.float32)
    args = (W, logits, logit_paddings, labels, label_paddings)
    want = jax.jit(_ctc)(*args)
    got = jax.jit(jaxamp.autocast(_ctc, "mixed_float16"))(*args)
    assert np.isfinite(np.asarray(got)).all(), got
    assert rel_err(got, want) < 2e-3
    grads = jax.jit(jax.grad(lambda w: jaxamp.autocast(_ctc, "mixed_float16")(w, *args[1:]).sum()))(
        W
    )
    assert np.isfinite(np.asarray(grads)).all()


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_saturating_a_float32_operand_saves_nothing_extra_for_the_backward(policy):
    # softmax (a float32 rule) feeds a matmul: its float32 output saturates into
    # the compute dtype. The saturation passes gradients straight through, so the
    # backward pass keeps no masks and no extra float32 copy: the residuals are
    # those of the same function with a plain cast.
    def attention(w, x):
        return jnp.sum(jax.nn.softmax(x @ w) @ w)

    def by_hand(w, x):
        dtype = jaxamp.get_policy(policy).compute_dtype
        x16, w16 = x.astype(dtype), w.astype(dtype)
        p = jax.nn.softmax(jnp.matmul(x16, w16, preferred_element_type=jnp.float32))
        return jnp.sum(jnp.matmul(p.astype(dtype), w16, preferred_element_type=jnp.float32))

    def residuals(fun):
        leaves = jax.tree.leaves(jax.eval_shape(lambda w, x: jax.vjp(fun, w, x)[1], W, X))
        return sorted((str(r.dtype), r.size) for r in leaves)

    got = residuals(jaxamp.autocast(attention, policy))
    assert not [r for r in got if r[0] == "bool"]
    assert sum(n for d, n in got if d == "float32") <= sum(
        n for d, n in residuals(by_hand) if d == "float32"
    )
    want = jax.grad(attention)(W, X)
    grad = jax.jit(jax.grad(jaxamp.autocast(attention, policy)))(W, X)
    assert rel_err(grad, want) < 4 * rel_err(jax.grad(by_hand)(W, X), want) + 1e-2
