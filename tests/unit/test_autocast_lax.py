"""Regression tests for what the ``jax.lax`` conformance sweep found.

Each compares autocast against the plain float32 function and against the same
code written by hand in 16 bits (JAX's standard promotion), under ``jax.jit``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp
from tests.helpers import rel_err

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
