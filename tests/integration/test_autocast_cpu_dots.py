"""autocast never hands XLA:CPU a bf16 x bf16 -> f32 dot it cannot run, and keeps the fast one.

XLA:CPU runs bf16 x bf16 -> f32 only in its YNNPACK kernel and upcasts to float32 the dots
YNNPACK does not take; a dot it accepted and later rewrote (a transpose folded into it,
from a column gather or from autodiff) reached the generic dot kernel and failed at run time
with "Unsupported element type for DotThunk::Execute: BF16 x BF16 = F32". Every form here
failed so before the fix; each must now run under jit, forward and backward, and give the
float32 product of the bf16-rounded operands.

Tolerances: the operands are rounded to bf16 (unit roundoff u = 2**-8), the products are
exact in float32 and accumulate in float32; the result is rounded to bf16 once more. So the
forward result is within u * (|a| @ |b|) of the float32 product of the rounded operands
(plus float32 accumulation, negligible). The gradients go through bf16 cotangents and one
more rounded product each: within 4 u of the float32 gradient, measured in norm.
"""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp
from tests.helpers import bits

BF16, F32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)
U = 2.0**-8
PERM = np.random.default_rng(1).permutation(16)


def _normal(seed, *shape):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), F32)


def _rounded(x):
    return x.astype(BF16).astype(F32)


def _dot(dims):
    return lambda a, b: jax.lax.dot_general(a, b, dims)


# Each form: (function of two float32 arrays, lhs, rhs). All crashed under jit before.
CRASHING_FORMS = {
    "column_gather_constant_perm": (lambda a, b: a[:, PERM] @ b, _normal(0, 8, 16), None),
    "column_gather_traced_perm": (
        lambda a, b: a[:, jnp.argsort(a[0])] @ b,
        _normal(0, 8, 16),
        None,
    ),
    "two_contracting_dims": (_dot((((1, 2), (0, 1)), ((), ()))), _normal(0, 8, 4, 4), "k"),
    "two_contracting_dims_swapped": (
        _dot((((1, 2), (1, 0)), ((), ()))),
        _normal(0, 8, 4, 4),
        "k",
    ),
}


def _rhs(form_lhs, marker):
    if marker == "k":
        return _normal(2, 4, 4, 12)
    return _normal(2, form_lhs.shape[-1], 12)


@pytest.mark.parametrize("name", sorted(CRASHING_FORMS))
def test_forward_runs_under_jit_and_is_the_rounded_product(name):
    fun, a, marker = CRASHING_FORMS[name]
    b = _rhs(a, marker)
    out = jax.jit(jaxamp.autocast(fun))(a, b)
    # mixed_bfloat16 outputs float32; the values are the bf16 result's.
    assert out.dtype == F32 and bool(jnp.all(_rounded(out) == out))
    reference = fun(_rounded(a), _rounded(b))
    bound = U * fun(jnp.abs(_rounded(a)), jnp.abs(_rounded(b))) + 1e-6
    assert bool(jnp.all(jnp.abs(out - reference) <= bound))


@pytest.mark.parametrize("name", sorted(CRASHING_FORMS))
def test_gradient_runs_under_jit_and_matches_float32(name):
    fun, a, marker = CRASHING_FORMS[name]
    b = _rhs(a, marker)

    def loss(f):
        return lambda a, b: jnp.sum(jnp.sin(f(a, b).astype(F32)))

    grads = jax.jit(jax.grad(loss(jaxamp.autocast(fun)), (0, 1)))(a, b)
    reference = jax.grad(loss(fun), (0, 1))(a, b)
    for g, r in zip(grads, reference, strict=True):
        assert g.dtype == F32
        assert float(jnp.linalg.norm(g - r)) <= 4 * U * float(jnp.linalg.norm(r))


def test_vmapped_autocast_of_a_column_gather_runs():
    fun, a, _ = CRASHING_FORMS["column_gather_constant_perm"]
    b = jnp.stack([_normal(2, 16, 12), _normal(3, 16, 12)])
    vmapped = jax.jit(jax.vmap(jaxamp.autocast(fun), in_axes=(None, 0)))
    out = vmapped(a, b)
    reference = jax.vmap(fun, in_axes=(None, 0))(_rounded(a), _rounded(b))
    assert out.shape == (2, 8, 12) and out.dtype == F32
    np.testing.assert_allclose(out, reference, rtol=2 * U, atol=4 * U)


def test_equinox_mlp_gradient_runs_under_filter_jit():
    # The transposed product of the weight gradient was rewritten into a dot
    # contracting the lhs's leading dim, which XLA:CPU cannot run in bf16.
    model = eqx.nn.MLP(32, 10, width_size=64, depth=2, key=jax.random.key(0))
    x, y = _normal(4, 8, 32), jnp.arange(8, dtype=jnp.int32) % 10

    def loss(m, x, y):
        logits = jax.vmap(m)(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    grads = eqx.filter_jit(eqx.filter_grad(jaxamp.autocast(loss)))(model, x, y)
    reference = eqx.filter_grad(loss)(model, x, y)
    # Worst case, roundings add up: each of the 3 layers rounds its input, its output,
    # its cotangent and its two gradient products to bf16 (5 per layer). Measured over
    # all leaves together (a bias gradient alone is a sum with cancellation).
    assert {g.dtype for g in jax.tree.leaves(grads)} == {F32}
    error = optax.tree.norm(jax.tree.map(jnp.subtract, grads, reference))
    assert float(error) <= 5 * 3 * U * float(optax.tree.norm(reference))


def _compiled_dot_operand_types(fun, *args):
    # Operand dtypes of every dot in the optimized HLO (inside fusions too).
    text = jax.jit(fun).lower(*args).compile().as_text()
    types = dict(re.findall(r"(%[\w.\-]+) = (\w+)\[", text))
    dots = re.findall(r" dot\((%[\w.\-]+), (%[\w.\-]+)\)", text)
    return [(types[lhs], types[rhs]) for lhs, rhs in dots]


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's dot forms")
def test_canonical_products_keep_bf16_operands_in_the_compiled_program():
    # The fast path: a plain (M, K) x (K, N) product stays a bf16 x bf16 -> f32 dot after
    # compilation (XLA does not upcast it); so does the column gather's product now.
    a, b = _normal(0, 8, 16), _normal(2, 16, 12)
    for fun in (lambda a, b: a @ b, CRASHING_FORMS["column_gather_constant_perm"][0]):
        assert _compiled_dot_operand_types(jaxamp.autocast(fun), a, b) == [("bf16", "bf16")]


def test_the_jaxpr_pins_16_bit_operands_and_the_report_shows_them():
    fun, a, _ = CRASHING_FORMS["column_gather_constant_perm"]
    b = _normal(2, 16, 12)
    jaxpr = jax.make_jaxpr(jaxamp.autocast(fun))(a, b)
    names = [eqn.primitive.name for eqn in jaxpr.jaxpr.eqns]
    expect_barrier = jax.default_backend() == "cpu"
    assert ("optimization_barrier" in str(jaxpr)) == expect_barrier, names
    (matmul,) = jaxamp.precision_report(jaxamp.autocast(fun), a, b).matmuls
    assert matmul.operand_dtypes == ("bfloat16", "bfloat16")
    assert matmul.accumulation_dtype == "float32"


def test_float32_policy_is_the_plain_function():
    fun, a, _ = CRASHING_FORMS["column_gather_constant_perm"]
    b = _normal(2, 16, 12)
    out = jax.jit(jaxamp.autocast(fun, "float32"))(a, b)
    assert bits(out) == bits(jax.jit(fun)(a, b))
