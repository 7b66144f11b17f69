"""FP8 autocast under jit, vmap, scan, remat, shard_map and loss scaling."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp
from jaxamp import _fp8
from tests import fp8_reference as ref
from tests.helpers import bits

SCALINGS = _fp8.names("fp8")


def _rand(key, shape, scale=1.0):
    return np.asarray(jax.random.normal(jax.random.key(key), shape), np.float32) * scale


def _mlp(ws, x):
    for w in ws:
        x = jnp.tanh(x @ w)
    return x


@pytest.mark.parametrize("scaling", SCALINGS)
def test_vmap_is_the_per_example_function(scaling):
    f = jax.jit(jaxamp.autocast(lambda x, w: x @ w, jaxamp.Float8Recipe(scaling)))
    xs, w = _rand(0, (3, 4, 64)), _rand(1, (64, 8))
    batched = jax.jit(jax.vmap(f, in_axes=(0, None)))(xs, w)
    for i in range(3):
        assert bits(batched[i]) == bits(f(xs[i], w))
        want = ref.forward(xs[i], w, scaling)
        np.testing.assert_allclose(np.asarray(batched[i]), want, rtol=2.0**-8, atol=1e-6)


def test_scan_over_layers_runs_fp8_and_matches_the_unrolled_loop():
    ws, x = _rand(2, (2, 32, 32), 0.3), _rand(3, (4, 32))
    recipe = jaxamp.Float8Recipe("rowwise")

    def scanned(ws, x):
        return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0]

    f = jaxamp.autocast(scanned, recipe)
    report = jaxamp.precision_report(jax.grad(lambda ws: f(ws, x).sum()), ws)
    assert {m.operand_dtypes[0][:6] for m in report.matmuls} == {"float8"}
    assert all(m.count == 2 for m in report.matmuls)
    # The scan carries the activation in bfloat16 from the start (its body gives
    # bfloat16), so the unrolled loop starts from the same bfloat16 input. It runs
    # op by op: jit would fuse its bfloat16 tanh differently, and one bfloat16 ulp
    # can move a value across an FP8 rounding boundary.
    unrolled = jaxamp.autocast(lambda ws, x: _mlp(list(ws), x.astype(jnp.bfloat16)), recipe)
    with jax.numpy_dtype_promotion("standard"):  # bf16 @ f32 in the unrolled trace
        assert bits(jax.jit(f)(ws, x)) == bits(unrolled(ws, x))
        g = jax.jit(jax.grad(lambda ws: f(ws, x).sum()))(ws)
        assert bits(g) == bits(jax.grad(lambda ws: unrolled(ws, x).sum())(ws))


@pytest.mark.parametrize("scaling", ["blockwise"])
def test_remat_recomputes_the_same_fp8_products(scaling):
    ws, x = [_rand(4, (64, 64), 0.2), _rand(5, (64, 16), 0.2)], _rand(6, (8, 64))
    f = jaxamp.autocast(lambda ws, x: jnp.sum(_mlp(ws, x) ** 2), jaxamp.Float8Recipe(scaling))
    plain = jax.jit(jax.grad(f))(ws, x)
    remat = jax.jit(jax.grad(jax.checkpoint(f)))(ws, x)
    assert bits(plain) == bits(remat)
    inner = jaxamp.autocast(
        lambda ws, x: jnp.sum(jax.checkpoint(_mlp)(ws, x) ** 2), jaxamp.Float8Recipe(scaling)
    )
    report = jaxamp.precision_report(jax.grad(inner), ws, x)
    assert all(m.operand_dtypes[1].startswith("float8") for m in report.matmuls)
    np.testing.assert_allclose(
        np.asarray(jax.jit(jax.grad(inner))(ws, x)[0]), np.asarray(plain[0]), rtol=1e-2, atol=1e-5
    )


def test_shard_map_body_runs_fp8():
    spec = jax.sharding.PartitionSpec
    mesh = jax.make_mesh((1,), ("i",), axis_types=(jax.sharding.AxisType.Auto,))

    def f(w, x):
        body = lambda w, x: jax.lax.psum(jnp.tanh(x @ w), "i")  # noqa: E731
        return jax.shard_map(body, mesh=mesh, in_specs=(spec(), spec("i")), out_specs=spec())(
            w, x
        ).sum(0)

    w, x = _rand(7, (32, 8)), _rand(8, (4, 32))
    ac = jaxamp.autocast(f, "mixed_float8")
    report = jaxamp.precision_report(jax.grad(lambda w: ac(w, x).sum()), w)
    assert {m.operand_dtypes[1] for m in report.matmuls} == {"float8_e4m3fn"}
    want = np.tanh(ref.forward(x, w, "tensorwise")).sum(0)
    np.testing.assert_allclose(np.asarray(jax.jit(ac)(w, x)), want, rtol=2e-2, atol=1e-2)


def test_loss_scaling_is_exact_with_power_of_two_scales():
    # Current scaling is scale-invariant: with power-of-two scales the loss-scaled
    # gradients, unscaled, are bit-identical to the unscaled ones.
    ws, x = [_rand(9, (64, 64), 0.2), _rand(10, (64, 16), 0.2)], _rand(11, (8, 64))
    recipe = jaxamp.Float8Recipe("mxfp8")
    loss = jaxamp.autocast(lambda ws: jnp.mean(_mlp(ws, x) ** 2), recipe)
    scale = jaxamp.StaticLossScale(2.0**12)
    value, scaled = jax.jit(jaxamp.scaled_value_and_grad(loss, scale))(ws)
    plain_value, plain = jax.jit(jax.value_and_grad(loss))(ws)
    assert bits(value) == bits(plain_value)
    assert bits(scale.unscale(scaled)) == bits(plain)
    assert bool(jaxamp.all_finite(scaled))
    # A non-finite activation makes the gradients non-finite: the step is skipped.
    bad = jaxamp.autocast(
        lambda ws: jnp.mean(_mlp(ws, jnp.asarray(x).at[0, 0].set(jnp.inf)) ** 2), recipe
    )
    _, grads = jax.jit(jaxamp.scaled_value_and_grad(bad, scale))(ws)
    assert not bool(jaxamp.all_finite(grads))
