"""autocast across the ecosystem: haiku, equinox, Flax linen and NNX models, shard_map, plain JAX.

Each model is the library's own class at a tiny size. For each, under jit:

- ``mixed_bfloat16``: the output and the gradients (one ``jax.vjp`` with a fixed random
  cotangent) against the float32 function;
- the jaxpr's matmuls (``precision_report``): bf16 operands, float32 accumulation;
- ``float32``: output and gradients bit-identical to the plain function's.

Tolerances come from bf16's unit roundoff u = 2**-8. A value that passes through L roundings
to bf16 (operands and result of each matmul along the longest path: L = 2 x the matmul depth)
carries a relative error of about u * sqrt(L) if the roundings are independent; we allow
``C * u * sqrt(L)`` in norm over all outputs (or all gradient leaves together: one leaf
alone, a bias gradient, can be a sum with cancellation), with C = 4 for the model's
conditioning (softmax, normalisation, nonlinearities) and gradients taking 2 L (the backward
pass rounds the cotangent and both products again). ``_tol`` computes it; a model with a
recurrence of T steps counts T x its cell's depth.

Attention models with padding masks include a fully padded query row: its softmax is over
``-inf``/huge negative fill values only, and must stay finite under autocast.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp
from tests.helpers import bits

hk = pytest.importorskip("haiku")
eqx = pytest.importorskip("equinox")
from flax import linen as nn  # noqa: E402
from flax import nnx  # noqa: E402

BF16, F32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)
U = 2.0**-8
C = 4.0


def _tol(depth: int) -> float:
    return C * U * math.sqrt(2 * depth)


def _normal(seed, *shape, scale=1.0):
    return jnp.asarray(scale * np.random.default_rng(seed).standard_normal(shape), F32)


def _rel_error(got, want) -> float:
    diff = jax.tree.map(lambda g, w: (g - w).astype(F32), got, want)
    return float(optax.tree.norm(diff)) / max(float(optax.tree.norm(want)), 1e-30)


def _floating(tree):
    return jax.tree.map(lambda x: x if jnp.issubdtype(x.dtype, jnp.floating) else None, tree)


def _vjp(fun, params, *rest):
    """out, grads of ``fun(params, *rest)`` w.r.t. ``params`` for a fixed random cotangent."""
    out, pullback = jax.vjp(lambda p: fun(p, *rest), params)

    def cotangent(o):
        if not jnp.issubdtype(o.dtype, jnp.floating):
            return np.zeros(o.shape, jax.dtypes.float0)
        return jnp.asarray(np.random.default_rng(7).standard_normal(o.shape), o.dtype)

    (grads,) = pullback(jax.tree.map(cotangent, out))
    return out, grads


def check(fun, params, *rest, depth: int, min_matmuls: int = 1, grads: bool = True, f32_dots=0):
    """The three checks of the module docstring for ``fun(params, *rest)``.

    One jitted program computes all three versions (one compile per model).
    ``f32_dots``: how many matmuls are written to stay float32 (inside a custom_vjp).
    """
    mixed = jaxamp.autocast(fun, "mixed_bfloat16")
    versions = (mixed, fun, jaxamp.autocast(fun, "float32"))
    if grads:
        run = jax.jit(lambda *a: [_vjp(f, *a) for f in versions])
    else:
        run = jax.jit(lambda *a: [(f(*a), None) for f in versions])
    (out, g), (ref_out, ref_g), (f32_out, f32_g) = run(params, *rest)
    for leaf in jax.tree.leaves(out):
        assert bool(jnp.all(jnp.isfinite(leaf))), "non-finite output under autocast"
    assert _rel_error(_floating(out), _floating(ref_out)) <= _tol(depth)
    assert bits(f32_out) == bits(ref_out)
    if grads:
        assert _rel_error(g, ref_g) <= _tol(2 * depth)
        assert bits(f32_g) == bits(ref_g)
    report = jaxamp.precision_report(mixed, params, *rest)
    assert len(report.matmuls) >= min_matmuls
    low = [m for m in report.matmuls if m.operand_dtypes == ("bfloat16", "bfloat16")]
    assert len(report.matmuls) - len(low) == f32_dots, report
    assert {m.accumulation_dtype for m in report.matmuls} == {"float32"}
    return out


def train_10_steps(loss_fn, params, *batch):
    """10 loss-scaled SGD steps under autocast(mixed_float16) vs float32: same trajectory.

    Both trajectories are one jitted program (a scan over the steps).
    """
    tx = jaxamp.loss_scaling(optax.sgd(0.05), jaxamp.DynamicLossScale(loss_scale=2.0**8))

    def trajectory(loss):
        def step(carry, _):
            params, opt_state = carry
            scale = jaxamp.get_loss_scale(opt_state)
            value, g = jaxamp.scaled_value_and_grad(loss, scale)(params, *batch)
            updates, opt_state = tx.update(g, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), value

        (_, opt_state), losses = jax.lax.scan(step, (params, tx.init(params)), length=10)
        return losses, jaxamp.loss_scaling_metrics(opt_state)["skipped_steps"]

    run = jax.jit(
        lambda: [trajectory(loss_fn), trajectory(jaxamp.autocast(loss_fn, "mixed_float16"))]
    )
    (f32, f32_skipped), (f16, f16_skipped) = run()
    assert int(f32_skipped) == 0 and int(f16_skipped) == 0
    assert float(f32[-1]) < float(f32[0])
    # float16 (u = 2**-11) rounds each step's products; 10 steps of SGD compound them.
    np.testing.assert_allclose(f16, f32, rtol=C * 2.0**-11 * math.sqrt(2 * 10) * 10)


def _padding_mask(batch: int, q: int, k: int):
    """``mask[b, 0, i, j]``: the last query row of batch 0 sees no key at all."""
    mask = np.tril(np.ones((q, k), bool), k - q)[None, None].repeat(batch, 0)
    mask[0, :, -1, :] = False
    return jnp.asarray(mask)


# -- dm-haiku -------------------------------------------------------------------------


def _hk(fn, *sample):
    f = hk.transform(fn)
    return f.init(jax.random.key(0), *sample), lambda p, *a: f.apply(p, None, *a)


def test_haiku_mlp_and_training():
    x, y = _normal(1, 8, 12), jnp.arange(8, dtype=jnp.int32) % 4
    params, apply = _hk(lambda x: hk.nets.MLP([16, 16, 4])(x), x)
    check(apply, params, x, depth=3, min_matmuls=3)

    def loss(p, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(apply(p, x), y).mean()

    train_10_steps(loss, params, x, y)


def test_haiku_resnet_block_with_batchnorm_state():
    x = _normal(2, 4, 8, 8, 8)
    net = hk.transform_with_state(
        lambda x: hk.nets.ResNet.BlockV1(
            channels=8,
            stride=1,
            use_projection=True,
            bn_config={"decay_rate": 0.9},
            bottleneck=False,
        )(x, is_training=True, test_local_stats=False)
    )
    params, state = net.init(jax.random.key(0), x)

    def fun(params, state, x):
        # haiku's moving averages add an int32 counter to float32 (strict promotion rejects it)
        with jax.numpy_dtype_promotion("standard"):
            return net.apply(params, state, None, x)

    out, new_state = check(fun, params, state, x, depth=2, min_matmuls=3)
    assert out.dtype == F32
    assert {leaf.dtype for leaf in jax.tree.leaves(new_state)} <= {F32, jnp.dtype(jnp.int32)}


def test_haiku_multi_head_attention_with_a_fully_padded_query():
    x = _normal(3, 2, 6, 16)
    mask = _padding_mask(2, 6, 6)
    params, apply = _hk(
        lambda x, m: hk.MultiHeadAttention(2, 8, w_init=hk.initializers.VarianceScaling())(
            x, x, x, mask=m
        ),
        x,
        mask,
    )
    check(apply, params, x, mask, depth=4, min_matmuls=6)


def test_haiku_lstm_dynamic_unroll():
    xs = _normal(4, 5, 2, 6)  # time-major

    def unroll(xs):
        core = hk.LSTM(8)
        out, _ = hk.dynamic_unroll(core, xs, core.initial_state(2))
        return out

    params, apply = _hk(unroll, xs)
    check(apply, params, xs, depth=5 * 2, min_matmuls=1)


# -- equinox --------------------------------------------------------------------------


def _eqx(model):
    params, static = eqx.partition(model, eqx.is_array)
    return params, static


def test_equinox_mlp_filter_jit_filter_grad_and_training():
    model = eqx.nn.MLP(12, 4, width_size=16, depth=2, key=jax.random.key(0))
    x, y = _normal(1, 8, 12), jnp.arange(8, dtype=jnp.int32) % 4
    params, static = _eqx(model)

    def apply(p, x):
        return jax.vmap(eqx.combine(p, static))(x)

    check(apply, params, x, depth=3, min_matmuls=3)

    def loss(m, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(jax.vmap(m)(x), y).mean()

    grads = eqx.filter_jit(eqx.filter_grad(jaxamp.autocast(loss)))(model, x, y)
    reference = eqx.filter_jit(eqx.filter_grad(loss))(model, x, y)
    # The batch mean of per-example gradients cancels: the rounding error is relative to
    # the sum of their magnitudes, larger than the mean's by the factor ``kappa``.
    per_example = eqx.filter_vmap(eqx.filter_grad(loss), in_axes=(None, 0, 0))(
        model, x[:, None], y[:, None]
    )
    magnitudes = jax.tree.map(lambda g: jnp.abs(g).mean(0), _eqx(per_example)[0])
    kappa = float(optax.tree.norm(magnitudes)) / float(optax.tree.norm(_eqx(reference)[0]))
    assert _rel_error(_eqx(grads)[0], _eqx(reference)[0]) <= _tol(6) * max(kappa, 1.0)
    train_10_steps(lambda p, x, y: loss(eqx.combine(p, static), x, y), params, x, y)


def test_equinox_multihead_attention_with_a_fully_padded_query():
    attn = eqx.nn.MultiheadAttention(2, 16, key=jax.random.key(0))
    x = _normal(3, 6, 16)
    mask = _padding_mask(1, 6, 6)[0, 0]
    params, static = _eqx(attn)
    check(lambda p, x, m: eqx.combine(p, static)(x, x, x, mask=m), params, x, mask, depth=4)


def test_equinox_conv2d():
    conv = eqx.nn.Conv2d(3, 8, 3, padding=1, key=jax.random.key(0))
    params, static = _eqx(conv)
    x = _normal(2, 2, 3, 8, 8)
    check(lambda p, x: jax.vmap(eqx.combine(p, static))(x), params, x, depth=1)


def test_equinox_gru_cell_in_a_scan():
    cell = eqx.nn.GRUCell(6, 8, key=jax.random.key(0))
    params, static = _eqx(cell)
    xs = _normal(4, 5, 6)

    def run(p, xs):
        c = eqx.combine(p, static)
        _, hs = jax.lax.scan(lambda h, x: (c(x, h),) * 2, jnp.zeros(8), xs)
        return hs

    check(run, params, xs, depth=5 * 2, min_matmuls=2)


def test_equinox_batchnorm_with_state():
    bn_model, state = eqx.nn.make_with_state(eqx.nn.BatchNorm)(8, axis_name="batch", mode="ema")
    lin = eqx.nn.Linear(4, 8, key=jax.random.key(0))
    params, static = _eqx((lin, bn_model))
    x = _normal(5, 6, 4)

    def run(p, state, x):
        lin, bn = eqx.combine(p, static)
        return jax.vmap(lambda x, s: bn(lin(x), s), axis_name="batch", in_axes=(0, None))(x, state)

    _, new_state = check(run, params, state, x, depth=2)
    floating = [leaf for leaf in jax.tree.leaves(new_state) if leaf.dtype != jnp.bool_]
    assert floating and {leaf.dtype for leaf in floating} == {F32}  # running statistics


# -- Flax linen -----------------------------------------------------------------------


class _LinenCNN(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Conv(8, (3, 3))(x)
        x = nn.BatchNorm(use_running_average=not train)(x)
        x = nn.relu(x)
        x = nn.Conv(8, (3, 3), feature_group_count=2)(x)
        return nn.Dense(4)(x.reshape(x.shape[0], -1))


def test_linen_cnn_with_batchnorm():
    x = _normal(6, 4, 8, 8, 3)
    model = _LinenCNN()
    variables = model.init(jax.random.key(0), x)
    params, stats = variables["params"], variables["batch_stats"]

    def apply(p, stats, x):
        return model.apply({"params": p, "batch_stats": stats}, x, mutable=["batch_stats"])

    _, updates = check(apply, params, stats, x, depth=4, min_matmuls=3)
    assert {leaf.dtype for leaf in jax.tree.leaves(updates)} == {F32}


def test_linen_multi_head_dot_product_attention_with_a_fully_padded_query():
    x = _normal(7, 2, 6, 16)
    mask = _padding_mask(2, 6, 6)
    model = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=16)
    params = model.init(jax.random.key(0), x, mask=mask)
    check(lambda p, x, m: model.apply(p, x, mask=m), params, x, mask, depth=4, min_matmuls=6)


class _ScannedRematMLP(nn.Module):
    @nn.compact
    def __call__(self, h, _):
        return nn.tanh(nn.Dense(8)(h)), None


def test_linen_scan_of_remat():
    block = nn.scan(
        nn.remat(_ScannedRematMLP),
        variable_axes={"params": 0},
        split_rngs={"params": True},
        length=4,
    )()
    x = _normal(8, 2, 8)
    params = block.init(jax.random.key(0), x, None)
    check(lambda p, x: block.apply(p, x, None)[0], params, x, depth=4, min_matmuls=1)


# -- Flax NNX -------------------------------------------------------------------------


def test_nnx_multi_head_attention_with_a_fully_padded_query():
    attn = nnx.MultiHeadAttention(2, 16, decode=False, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(attn)
    x = _normal(9, 2, 6, 16)
    mask = _padding_mask(2, 6, 6)
    check(lambda s, x, m: nnx.merge(graphdef, s)(x, mask=m), state, x, mask, depth=4)


def test_nnx_conv_batchnorm():
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.conv = nnx.Conv(3, 8, (3, 3), rngs=rngs)
            self.bn = nnx.BatchNorm(8, rngs=rngs)

        def __call__(self, x):
            return nnx.relu(self.bn(self.conv(x)))

    graphdef, params, stats = nnx.split(Net(nnx.Rngs(0)), nnx.Param, nnx.BatchStat)
    x = _normal(10, 2, 8, 8, 3)

    def run(params, stats, x):
        model = nnx.merge(graphdef, params, stats, copy=True)
        out = model(x)
        return out, nnx.state(model, nnx.BatchStat)

    _, new_stats = check(run, params, stats, x, depth=2)
    assert {leaf.dtype for leaf in jax.tree.leaves(new_stats)} == {F32}


# -- shard_map on 8 CPU devices (a subprocess: XLA_FLAGS must precede jax's import) ----


def _shard_map_worker() -> dict:
    from jax.sharding import PartitionSpec as P

    jax.config.update("jax_numpy_dtype_promotion", "strict")
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    w, x = _normal(1, 16, 8, scale=0.3), _normal(2, 32, 16)

    def loss(w, x):
        return jax.lax.pmean(jnp.mean(jnp.tanh(x @ w) ** 2), "data")

    def sharded(fun):
        return jax.jit(jax.shard_map(fun, mesh=mesh, in_specs=(P(), P("data")), out_specs=P()))

    results = {}
    for name, fun in (("f32", loss), ("bf16", jaxamp.autocast(loss)), ("ref32", None)):
        if fun is None:
            fun = jaxamp.autocast(loss, "float32")
        value, grad = sharded(jax.value_and_grad(fun))(w, x)
        results[name] = {"value": float(value), "grad": np.asarray(grad).tolist()}
    report = jaxamp.precision_report(sharded(jaxamp.autocast(loss)), w, x)
    results["operands"] = [list(m.operand_dtypes) for m in report.matmuls]
    return results


def test_shard_map_on_8_devices():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    code = f"import json, {__name__} as z; print(json.dumps(z._shard_map_worker()))"
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["ref32"] == r["f32"]  # the float32 policy is the plain function
    assert abs(r["bf16"]["value"] - r["f32"]["value"]) <= _tol(2) * abs(r["f32"]["value"])
    assert _rel_error(np.asarray(r["bf16"]["grad"]), np.asarray(r["f32"]["grad"])) <= _tol(4)
    assert r["operands"] and all(ops == ["bfloat16", "bfloat16"] for ops in r["operands"])


# -- plain JAX ops --------------------------------------------------------------------


def test_dot_product_attention_with_a_fully_padded_query():
    q, k, v = _normal(1, 2, 6, 2, 8), _normal(2, 2, 6, 2, 8), _normal(3, 2, 6, 2, 8)
    mask = _padding_mask(2, 6, 6)
    check(
        lambda q, k, v, m: jax.nn.dot_product_attention(q, k, v, mask=m),
        q,
        k,
        v,
        mask,
        depth=2,
        min_matmuls=2,
    )


def test_grouped_conv_and_three_operand_einsum():
    x, w = _normal(1, 2, 8, 8, 4), _normal(2, 3, 3, 2, 6, scale=0.3)
    a, b = _normal(3, 4, 5), _normal(4, 5, 6)

    def fun(w, x, a, b):
        y = jax.lax.conv_general_dilated(
            x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"), feature_group_count=2
        )
        return y, jnp.einsum("ij,jk,kl->il", a, b, w.reshape(-1, 6)[:6])

    check(fun, w, x, a, b, depth=2, min_matmuls=3)


def test_checkpoint_fori_and_while_loops():
    w, x = _normal(1, 8, 8, scale=0.3), _normal(2, 4, 8)

    def fun(w, x):
        layer = jax.checkpoint(lambda h: jnp.tanh(h @ w))
        h = jax.lax.fori_loop(0, 3, lambda i, h: layer(h), x)
        return jax.lax.while_loop(lambda c: c[0] < 2, lambda c: (c[0] + 1, layer(c[1])), (0, h))[1]

    check(fun, w, x, depth=5, grads=False)
    check(lambda w, x: jax.lax.fori_loop(0, 3, lambda i, h: jnp.tanh(h @ w), x), w, x, depth=3)


def test_custom_vjp_keeps_its_dtypes_and_random_runs():
    @jax.custom_vjp
    def clipped_matmul(x, w):
        return x @ w

    clipped_matmul.defvjp(
        lambda x, w: (x @ w, (x, w)),
        lambda res, g: (jnp.clip(g @ res[1].T, -1, 1), res[0].T @ g),
    )
    w, x = _normal(1, 8, 8, scale=0.3), _normal(2, 4, 8)

    def fun(w, x):
        noise = jax.random.normal(jax.random.key(3), x.shape, x.dtype)
        return clipped_matmul(jnp.tanh(x @ w) + 0.1 * noise, w)

    # A custom_vjp's rules run at the dtypes they were written for (float32 here).
    check(fun, w, x, depth=2, f32_dots=1)


def test_linear_algebra_stays_float32():
    a = _normal(1, 6, 6)
    spd = a @ a.T + 6 * jnp.eye(6)
    b = _normal(2, 6, 3)

    def fun(spd, b):
        sol = jnp.linalg.solve(spd, b)
        _, r = jnp.linalg.qr(spd)
        eigvals = jnp.linalg.eigh(spd)[0]
        chol = jnp.linalg.cholesky(spd)
        return sol, jnp.abs(r), eigvals, chol

    out = jax.jit(jaxamp.autocast(fun))(spd, b)
    ref = jax.jit(fun)(spd, b)
    # Linear algebra runs in float32 under autocast: float32 accuracy, not bf16's.
    for o, r in zip(out, ref, strict=True):
        assert o.dtype == F32
        np.testing.assert_allclose(o, r, rtol=1e-4, atol=1e-5)
    f32 = jax.jit(jaxamp.autocast(fun, "float32"))(spd, b)
    jax.tree.map(np.testing.assert_array_equal, f32, ref)


def test_scans_segments_indexing_sorting():
    x = _normal(1, 12)
    w = _normal(2, 12, 12, scale=0.3)
    segments = jnp.asarray(np.arange(12) % 3, jnp.int32)

    def fun(w, x):
        h = x @ w
        return (
            jnp.cumsum(h),
            jax.ops.segment_sum(h, segments, num_segments=3),
            h.at[::2].add(1.0).at[1].set(0.5).at[3].multiply(2.0),
            jnp.sort(h),
            jax.lax.top_k(h, 3)[0],
        )

    check(fun, w, x, depth=1)
    out = jax.jit(jaxamp.autocast(lambda w, x: (jnp.argmax(x @ w), jax.lax.top_k(x @ w, 3)[1])))
    idx, top = out(w, x)
    # Indices are integers (never cast) and, away from ties, those of the float32 product.
    assert idx.dtype == jnp.int32 and top.dtype == jnp.int32
    assert int(idx) == int(jnp.argmax(x @ w))
