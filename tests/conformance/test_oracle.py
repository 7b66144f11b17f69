"""The sweep's oracles themselves: each must flag what it is meant to catch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from tests.conformance import _oracles, _sweep

F32 = jnp.float32


def _ints(*values):
    return np.array(values, np.int32)


def test_integer_outputs_may_differ_only_where_hand_cast_differs():
    want = [_ints(0, 1, 2, 3)]
    tied = [_ints(1, 0, 2, 3)]  # the hand-cast reference swaps a 16-bit tie
    assert _oracles.compare(want, tied, want, tied, F32) == []
    assert _oracles.compare(want, tied, want, want, F32) == [
        "2 integer/bool elements differ from float32's > hand-cast 0"
    ]
    worse = [_ints(3, 0, 2, 1)]
    assert _oracles.compare(want, worse, want, tied, F32) != []


def test_integer_outputs_keep_float32_dtype_and_bit_identity():
    want = [_ints(0, 1)]
    assert _oracles.compare(want, [want[0].astype(np.int16)], want, want, F32) == [
        "integer/bool output dtype differs from float32's"
    ]
    assert _oracles.compare(want, want, [_ints(1, 1)], want, F32) == [
        "float32 policy not bit-identical"
    ]


def test_mixed_outputs_split_by_kind():
    mantissa, exponent = np.float32([0.5, 0.75]), _ints(1, 2)
    want = [mantissa, exponent]
    assert _oracles.compare(want, [mantissa, _ints(1, 3)], want, want, F32) != []
    far = [np.float32([0.9, 0.75]), exponent]
    assert any("error" in f for f in _oracles.compare(want, far, want, want, F32))


def test_applicability_of_discrete_and_static_outputs():
    argmax = _sweep.signature_of("jax.numpy", "argmax", jnp.argmax)
    assert isinstance(argmax, _sweep.Case)
    assert _sweep.signature_of("jax.numpy", "ndim", jnp.ndim) == _sweep.STATIC_OUTPUT


def test_float32_policy_proof_needs_the_same_jaxpr_and_constants():
    x = np.ones(3, np.float32)
    twice = jax.make_jaxpr(lambda v: v * 2.0)(x)
    assert _sweep._same_jaxpr(twice, jax.make_jaxpr(lambda v: v * 2.0)(x))
    assert not _sweep._same_jaxpr(twice, jax.make_jaxpr(lambda v: v * 3.0)(x))
    a, b = np.float32([1, 2, 3]), np.float32([1, 2, 4])
    with_a = jax.make_jaxpr(lambda v: v * jnp.asarray(a))(x)
    assert not _sweep._same_jaxpr(with_a, jax.make_jaxpr(lambda v: v * jnp.asarray(b))(x))
