"""FP8 over the wire: an FSDP-sharded model under "mixed_float8" on 8 CPU devices.

The subprocess (this file run as a script, 8 devices forced by XLA_FLAGS) reads
the program right after the SPMD partitioner with ``communication_report`` and
runs the step sharded and on one device; it prints its measurements as JSON.
"""

import pytest

from tests.helpers import run_with_devices

N_DEVICES = 8
WEIGHTS = ("w1", "w2", "head")  # the matmul weights; emb and ln are not matmul operands
VOCAB, D, F, B, T = 64, 64, 256, 32, 8
N_PRODUCTS = 3  # dense layers: each quantizes one activation and one gradient tensorwise
# Recipes whose weight groups depend on the contracting dim, gathered once all the same,
# and the dtype each gathers a weight in.
GATHERED_ONCE = {
    "rowwise": "float8_e4m3fn",
    "blockwise": "float8_e4m3fn",
    "mxfp8": "float8_e4m3fn",
    "nvfp4": "float4_e2m1fn",
}


def _recipe(jaxamp, name):
    if name == "nvfp4":  # 16x16 weight tiles
        return jaxamp.Float4Recipe("nvfp4", gemm="emulated")
    return jaxamp.Float8Recipe(name, gemm="emulated")


def _params(jnp, jax):
    keys = iter(jax.random.split(jax.random.key(0), 5))
    normal = jax.random.normal
    return {
        "emb": normal(next(keys), (VOCAB, D)) * 0.5,
        "ln": 1.0 + 0.1 * normal(next(keys), (D,)),
        "w1": normal(next(keys), (D, F)) / D**0.5,
        "w2": normal(next(keys), (F, D)) / F**0.5,
        "head": normal(next(keys), (D, VOCAB)) / D**0.5,
    }


def _worker() -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxamp

    jax.config.update("jax_numpy_dtype_promotion", "strict")
    mesh = jax.make_mesh((N_DEVICES,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    batch_sharded = NamedSharding(mesh, P("d"))

    def loss(p, tokens):
        # FSDP: activations stay sharded on the batch, each weight is gathered.
        def act(h):
            return jax.lax.with_sharding_constraint(h, batch_sharded)

        x = act(p["emb"][tokens])
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * p["ln"]
        x = x + act(jax.nn.gelu(act(x @ p["w1"])) @ p["w2"])
        logits = act(x @ p["head"]).astype(jnp.float32)
        picked = jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[..., None], axis=-1)
        return -jnp.mean(picked)

    def fsdp(x):  # each parameter sharded on its largest dim
        spec = [None] * x.ndim
        spec[int(np.argmax(x.shape))] = "d"
        return NamedSharding(mesh, P(*spec))

    params = _params(jnp, jax)
    tokens = jax.random.randint(jax.random.key(1), (B, T), 0, VOCAB)
    sharded = (jax.tree.map(lambda x: jax.device_put(x, fsdp(x)), params), tokens)
    sharded = (sharded[0], jax.device_put(tokens, batch_sharded))
    out = {}
    for name, recipe in {
        "tensorwise": jaxamp.Float8Recipe(),
        "bf16_reduce": jaxamp.Float8Recipe(reduce_dtype=jnp.bfloat16),
        **{s: _recipe(jaxamp, s) for s in GATHERED_ONCE},
    }.items():
        step = jax.value_and_grad(jaxamp.autocast(loss, recipe))
        report = jaxamp.communication_report(step, *sharded)
        out[name] = {
            "collectives": [
                [c.kind, c.dtype.name, list(c.shape), c.bytes, c.parameter, c.backward, c.staged]
                for c in report.collectives
            ],
            "param_count": report.param_count,
        }
    # Numerics: the sharded step against the same step on one device.
    step = jax.jit(jax.value_and_grad(jaxamp.autocast(loss, "mixed_float8")))
    (l_one, g_one), (l_sharded, g_sharded) = step(params, tokens), step(*sharded)
    out["loss"] = [float(l_one), float(l_sharded)]
    out["grad_err"] = _grad_err(g_one, g_sharded)
    for scaling in GATHERED_ONCE:
        recipe = _recipe(jaxamp, scaling)
        step = jax.jit(jax.value_and_grad(jaxamp.autocast(loss, recipe)))
        (l_one, g_one), (l_sharded, g_sharded) = step(params, tokens), step(*sharded)
        out[scaling]["loss"] = [float(l_one), float(l_sharded)]
        out[scaling]["grad_err"] = _grad_err(g_one, g_sharded)
    return out


def _grad_err(one, sharded):
    import jax.numpy as jnp

    return {k: float(jnp.max(jnp.abs(one[k] - sharded[k])) / jnp.max(jnp.abs(one[k]))) for k in one}


_WEIGHT_KEYS = tuple(f"['{w}']" for w in WEIGHTS)


@pytest.fixture(scope="module")
def fp8_fsdp():
    import os

    return run_with_devices(os.path.abspath(__file__), N_DEVICES, timeout=900)


def test_fp8_fsdp_gathers_weights_once_in_fp8_and_reduces_their_amaxes_once(fp8_fsdp):
    res = fp8_fsdp
    n_params = res["tensorwise"]["param_count"]
    cols = res["tensorwise"]["collectives"]
    weight_gathers = [
        c
        for c in cols
        if c[0] == "all-gather" and (c[4] or "").endswith(tuple(f"['{w}']" for w in WEIGHTS))
    ]
    # Each matmul weight: quantized on its shard, gathered once, in float8.
    assert sorted(c[4][-6:] for c in weight_gathers) == sorted(f"['{w}']"[-6:] for w in WEIGHTS)
    assert {c[1] for c in weight_gathers} == {"float8_e4m3fn"}
    f8_bytes = sum(c[3] for c in cols if c[0] == "all-gather" and c[1].startswith("float8"))
    assert f8_bytes / n_params <= 1.1
    # Scale reductions: one all-reduce of every weight amax at once; the scalar
    # ones left are the activations' and gradients' (2 per product) and the loss.
    amax_vectors = [c for c in cols if c[0] == "all-reduce" and c[2] == [len(WEIGHTS)]]
    assert len(amax_vectors) == 1 and amax_vectors[0][1] == "float32"
    scalars = [c for c in cols if c[0] == "all-reduce" and all(n == 1 for n in c[2])]
    assert len(scalars) == 2 * N_PRODUCTS + 1, scalars
    # Weight gradients are reduced in the recipe's reduce_dtype.
    for name, dtype in (("tensorwise", "float32"), ("bf16_reduce", "bfloat16")):
        grads = [
            c
            for c in res[name]["collectives"]
            if c[0] in ("all-reduce", "reduce-scatter") and c[5] and c[2] and c[4] is None
        ]
        weight_grads = [c for c in grads if len(c[2]) == 3 and c[2][0] == 1]
        assert len(weight_grads) == len(WEIGHTS), grads
        assert {c[1] for c in weight_grads} == {dtype}, weight_grads
    # The sharded step is the one-device step: every scale is the global one.
    one, sharded = res["loss"]
    assert one == sharded
    assert max(res["grad_err"].values()) == 0.0, res["grad_err"]


if __name__ == "__main__":
    import json

    print(json.dumps(_worker()))


@pytest.mark.parametrize("scaling", GATHERED_ONCE)
def test_block_scaled_recipes_gather_each_weight_once_in_low_precision(fp8_fsdp, scaling):
    res = fp8_fsdp[scaling]
    cols, n_params = res["collectives"], res["param_count"]
    gathers = [c for c in cols if c[0] == "all-gather"]
    weight_gathers = [c for c in gathers if (c[4] or "").endswith(_WEIGHT_KEYS)]
    # One gather per weight (its later stages, if any, add the rest of it), in float8.
    assert sorted(c[4][-6:] for c in weight_gathers) == sorted(k[-6:] for k in _WEIGHT_KEYS)
    assert {c[1] for c in weight_gathers} == {GATHERED_ONCE[scaling]}
    # Float8 (float4) gathers (weights, gradients), per parameter: as tensorwise's.
    f8_bytes = sum(c[3] for c in gathers if c[1].startswith(("float8", "float4")))
    assert f8_bytes / n_params <= 1.1, gathers
    # The sharded step is the one-device step (float32 sums in another order).
    one, sharded = res["loss"]
    assert abs(one - sharded) <= 1e-6 * abs(one)
    assert max(res["grad_err"].values()) <= 1e-5, res["grad_err"]
