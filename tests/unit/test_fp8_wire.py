"""FP8 over the wire on one device: the weight pre-pass and the reduce dtype.

The 8-device behaviour (one float8 gather per weight, one fused amax
all-reduce, sharded == one device) is in tests/integration/test_fp8_sharding.py.
"""

import types

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp
from jaxamp._engine._trace import trace
from jaxamp._fp8._scales import _compiled_elsewhere, weight_operands
from tests.helpers import bits, dot_dtypes


def _operand_inputs(fn, *args) -> list[int | None]:
    """For each dot_general operand of ``fn``'s jaxpr (in order), the input it views."""
    closed, _, _ = trace(fn, args, {})
    found = weight_operands(closed)
    eqns = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general" and all(e is not eqn for e in eqns):
                eqns.append(eqn)
            for sub in jex.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(closed.jaxpr)
    return [found.get((id(e), i)) for e in eqns for i in range(2)]


def test_weight_operands_are_inputs_seen_through_views_and_jit():
    layer = jax.jit(lambda w, x: x @ w)

    def fn(w1, w2, x):
        h = x @ w1.T.reshape(8, 8)  # a view of input 0
        h = layer(w2, h)  # input 1 through jit
        return layer(w2, h * 2.0) @ (w1 * 2.0)  # the same jaxpr, the same weight; a computed one

    w, x = jnp.ones((8, 8)), jnp.ones((4, 8))
    # x, w1 | h, w2 (the jit body, reached twice with w2) | jit's out, w1 * 2
    assert _operand_inputs(fn, w, w, x) == [2, 0, None, 1, None, None]


def test_a_jitted_layer_called_on_two_weights_has_no_single_weight():
    layer = jax.jit(lambda w, x: x @ w)

    def fn(w1, w2, x):
        return layer(w2, layer(w1, x))

    w, x = jnp.ones((8, 8)), jnp.ones((4, 8))
    assert _operand_inputs(fn, w, w, x) == [None, None]


def test_weight_operands_are_seen_through_a_custom_jvp_call():
    # Regression: the pre-pass read custom_jvp bodies through a helper the engine
    # no longer had, so "mixed_float8" crashed on any model with jax.nn.relu.
    @jax.custom_jvp
    def layer(w, x):
        return x @ w

    layer.defjvp(lambda p, t: (layer(*p), t[1] @ p[0] + p[1] @ t[0]))

    def fn(w, x):
        return jax.nn.relu(layer(w, x))

    w, x = jnp.ones((8, 8)), jnp.ones((4, 8))
    assert _operand_inputs(fn, w, x) == [1, 0]


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_mixed_float8_runs_a_custom_jvp_activation_as_its_plain_twin(scaling):
    # The reproducer: relu is a custom_jvp; jnp.maximum the same function without one.
    def loss(act):
        return lambda w, x: jnp.sum(act(x @ w) @ w)

    w, x = (
        jnp.asarray(np.random.default_rng(0).standard_normal((32, 32)), jnp.float32),
        jnp.ones((8, 32)),
    )
    recipe = jaxamp.Float8Recipe(scaling=scaling)
    relu = jax.jit(jax.value_and_grad(jaxamp.autocast(loss(jax.nn.relu), recipe)))(w, x)
    plain = jax.jit(jax.value_and_grad(jaxamp.autocast(loss(lambda h: jnp.maximum(h, 0)), recipe)))
    assert bits(relu) == bits(plain(w, x))
    assert (
        dot_dtypes(jaxamp.autocast(loss(jax.nn.relu), recipe), w, x)
        == [("float8_e4m3fn", "float8_e4m3fn")] * 2
    )


def test_reduce_dtype_is_the_weight_gradient_product_dtype():
    recipe = jaxamp.Float8Recipe(reduce_dtype=jnp.bfloat16)
    assert str(recipe) == "fp8:tensorwise,reduce=bfloat16"
    assert recipe.policy.reduce_dtype == jnp.bfloat16
    assert jaxamp.Float8Recipe().policy.reduce_dtype == jnp.float32

    def loss(w, x):
        return jnp.sum(jnp.tanh(x @ w))

    w, x = jnp.ones((16, 8)) / 4, jnp.ones((4, 16))
    for r, dtype in ((recipe, "bf16"), (jaxamp.Float8Recipe(), "f32")):
        text = jax.jit(jax.grad(jaxamp.autocast(loss, r))).lower(w, x).as_text()
        dots = [line for line in text.splitlines() if "dot_general" in line and "f8E5M2" in line]
        # The one backward product left (x's gradient is not asked for): the weight's.
        results = [line.rsplit("->", 1)[1].split("x")[-1].rstrip(">") for line in dots]
        assert results == [dtype], dots
    g32 = jax.grad(jaxamp.autocast(loss, jaxamp.Float8Recipe()))(w, x)
    g16 = jax.grad(jaxamp.autocast(loss, recipe))(w, x)
    np.testing.assert_allclose(g16, g32, rtol=2**-8)


def test_a_topology_compiled_ahead_of_time_reduces_each_amax_on_its_own():
    # The custom_partitioning rule of the fused weight-amax reduction runs in this
    # process's partitioner only: a mesh of TPU devices on a CPU-only machine (a
    # jax.experimental.topologies compile) takes the per-weight reductions.
    local = jax.make_mesh((1,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    assert not _compiled_elsewhere(local.abstract_mesh)
    elsewhere = "tpu" if jax.default_backend() != "tpu" else "cuda"
    fake = types.SimpleNamespace(abstract_device=types.SimpleNamespace(platform=elsewhere))
    assert _compiled_elsewhere(fake)
