"""What crosses the wire under a 16-bit policy: FSDP-sharded params, 8 CPU devices.

The program is read right after the SPMD partitioner (``jaxamp.communication_report``):
each parameter all-gathered once, in the compute dtype; weight gradients reduced in
``policy.reduce_dtype`` (float32 by default, bfloat16 when asked); a sharded loss equal
to the one-device loss. Under Megatron tensor parallelism, autocast's partial sums
are all-reduced in bfloat16: no more bytes than the policy cast. Three models (a Flax
linen GPT, a Flax NNX and an Equinox model), ``jit`` with ``NamedSharding`` (each
weight sharded on its largest dim), and a hand-written FSDP step in ``shard_map``.
One subprocess (this file run as a script, 8 devices forced by XLA_FLAGS before jax
is imported) measures everything and prints
JSON; the tests assert on it.
"""

import collections
import functools
import json
import math
import sys

import pytest

from tests.helpers import run_with_devices

N_DEVICES = 8


def _fsdp_spec(x):
    from jax.sharding import PartitionSpec as P

    # Sharded on the largest dim that the devices divide; replicated otherwise.
    for dim in sorted(range(x.ndim), key=lambda d: -x.shape[d]):
        if x.shape[dim] % N_DEVICES == 0:
            return P(*(("d" if d == dim else None) for d in range(x.ndim)))
    return P()


def _wire(report):
    """Bytes per parameter by kind and dtype, and the parameter gathers.

    The small ones (vectors: layer norms, biases) apart: their counts and
    dtypes are not a decision (``CommunicationReport.small_gathers``).
    """
    per_param = collections.defaultdict(float)
    gathers = collections.Counter()
    f32_gathers, small_f32_gathers = set(), set()
    small = {id(c) for c in report.small_gathers}
    for c in report.collectives:
        kind = "reduce" if c.kind in ("all-reduce", "reduce-scatter") else c.kind
        if not c.shape:
            continue  # a scalar: the loss average
        per_param[f"{kind} {c.dtype.name}"] += c.bytes / report.param_count
        if c.kind == "all-gather" and c.parameter and id(c) in small:
            if c.dtype.itemsize == 4:
                small_f32_gathers.add(c.parameter)
        elif c.kind == "all-gather" and c.parameter:
            gathers[c.parameter] += 1
            if c.dtype.itemsize == 4:
                f32_gathers.add(c.parameter)
    return {
        "per_param": {k: round(v, 4) for k, v in per_param.items()},
        "max_gathers_per_param": max(gathers.values(), default=0),
        "f32_gathers": sorted(f32_gathers),
        "small_f32_gathers": sorted(small_f32_gathers),
    }


def _measure(loss, params, batch, policies):
    """Wire numbers per policy, and sharded/one-device losses under autocast."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxamp

    mesh = jax.make_mesh((N_DEVICES,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    sharded = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, _fsdp_spec(x))), params)
    batch_sharded = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P("d"))), batch)
    out = {}
    for name, policy in policies.items():
        step = jax.value_and_grad(jaxamp.autocast(loss, policy))
        out[name] = _wire(jaxamp.communication_report(step, sharded, batch_sharded))
    # Layer-norm scales and biases multiply float32 statistics: gathered in float32.
    paths = jax.tree_util.tree_leaves_with_path(params)
    layer_norm = sum(x.size for path, x in paths if "LayerNorm" in jax.tree_util.keystr(path))
    out["layer_norm_bytes_per_param"] = 4 * layer_norm / sum(x.size for _, x in paths)
    fn = jax.jit(jaxamp.autocast(loss, "mixed_bfloat16"))
    out["loss_sharded"] = float(fn(sharded, batch_sharded))
    out["loss_one_device"] = float(fn(params, batch))
    return out


def _gpt(config=None):
    from benchmarks._models import GPT, GPTConfig, gpt_batch, gpt_init, gpt_loss_fn

    small = GPTConfig(vocab=128, seq=32, d_model=64, n_heads=2, d_ff=256, n_layers=2, batch=32)
    config = config or small
    model = GPT(config)
    batch = gpt_batch(config)
    return gpt_loss_fn(model), gpt_init(model, config), batch


def _token_batch(vocab, seed=0):
    import jax.numpy as jnp
    import numpy as np

    tokens = np.random.default_rng(seed).integers(0, vocab, (32, 33), dtype=np.int32)
    return {"inputs": jnp.asarray(tokens[:, :-1]), "targets": jnp.asarray(tokens[:, 1:])}


def _cross_entropy(logits, targets):
    import jax
    import jax.numpy as jnp

    logp = jax.nn.log_softmax(logits.astype(jnp.float32))
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def _nnx():
    import jax
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(128, 64, rngs=rngs)
            self.up = nnx.Linear(64, 256, rngs=rngs)
            self.down = nnx.Linear(256, 64, rngs=rngs)
            self.head = nnx.Linear(64, 128, rngs=rngs)

        def __call__(self, tokens):
            x = self.embed(tokens)
            x = x + self.down(jax.nn.gelu(self.up(x)))
            return self.head(x)

    graphdef, state = nnx.split(Net(nnx.Rngs(0)))

    def loss(state, batch):
        return _cross_entropy(nnx.merge(graphdef, state)(batch["inputs"]), batch["targets"])

    return loss, state, _token_batch(128)


def _equinox():
    import equinox as eqx
    import jax

    keys = jax.random.split(jax.random.key(1), 4)
    net = {
        "embed": eqx.nn.Embedding(128, 64, key=keys[0]),
        "up": eqx.nn.Linear(64, 256, key=keys[1]),
        "down": eqx.nn.Linear(256, 64, key=keys[2]),
        "head": eqx.nn.Linear(64, 128, key=keys[3]),
    }

    def forward(net, token):
        x = net["embed"](token)
        x = x + net["down"](jax.nn.gelu(net["up"](x)))
        return net["head"](x)

    def loss(net, batch):
        logits = jax.vmap(jax.vmap(functools.partial(forward, net)))(batch["inputs"])
        return _cross_entropy(logits, batch["targets"])

    return loss, net, _token_batch(128, seed=1)


def _shard_map_fsdp():
    """A hand-written FSDP step: params sharded on dim 0 (biases replicated)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxamp

    mesh = jax.make_mesh((N_DEVICES,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
    rng = np.random.default_rng(2)
    params = {
        "w1": jnp.asarray(rng.normal(size=(64, 256)) / 8, jnp.float32),
        "b1": jnp.zeros(256, jnp.float32),
        "w2": jnp.asarray(rng.normal(size=(256, 64)) / 16, jnp.float32),
    }
    x = jnp.asarray(rng.normal(size=(64, 64)), jnp.float32)
    axes = {"w1": 0, "b1": None, "w2": 0}
    specs = {k: P() if a is None else P("d") for k, a in axes.items()}

    def model(p, x):
        x = x.astype(p["w1"].dtype)  # the compute dtype, for the hand-cast params
        h = jnp.tanh(x @ p["w1"] + p["b1"])
        return jnp.mean(jnp.square((h @ p["w2"] - x).astype(jnp.float32)))

    def by_helper(policy):
        def loss(shards, x):
            return jax.lax.pmean(model(jaxamp.gather_params(shards, policy, "d", axes), x), "d")

        return loss

    def by_autocast(policy):
        def loss(shards, x):
            p = {
                k: v if axes[k] is None else jax.lax.all_gather(v, "d", tiled=True)
                for k, v in shards.items()
            }
            return jax.lax.pmean(model(p, x), "d")

        return jaxamp.autocast(loss, policy)

    def smap(loss):
        return jax.shard_map(loss, mesh=mesh, in_specs=(specs, P("d")), out_specs=P())

    shards = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()}
    xs = jax.device_put(x, NamedSharding(mesh, P("d")))
    f32 = jaxamp.get_policy("mixed_bfloat16")
    b16 = f32.with_reduce_dtype(jnp.bfloat16)
    out = {}
    for name, make in (("helper", by_helper), ("autocast", by_autocast)):
        for suffix, policy in (("", f32), ("_reduce_bf16", b16)):
            step = jax.value_and_grad(smap(make(policy)))
            out[name + suffix] = _wire(jaxamp.communication_report(step, shards, xs))
        out[name + "_loss"] = float(jax.jit(smap(make(f32)))(shards, xs))
    out["loss_float32"] = float(model(params, x))
    return out


# FP8's amax reductions: the weights' fused one, and the output gradients' of
# products mapped over several batch dims (one amax per mapped slice).
_SCALE_REDUCTIONS = ("fp8_weight_amaxes", "reduce_max")


def _tensor_parallel():
    """Megatron tensor parallel (benchmarks/_sharding.py's layout) on a one-layer GPT."""
    import jax
    from jax.sharding import NamedSharding

    import jaxamp
    from benchmarks._models import GPT, GPTConfig, gpt_batch, gpt_init, gpt_loss_fn
    from benchmarks._sharding import batch_spec, param_specs

    config = GPTConfig(vocab=64, seq=16, d_model=64, n_heads=8, d_ff=128, n_layers=1, batch=8)
    model = GPT(config, dtype=None)  # each layer computes in its inputs' dtype
    loss, params, batch = gpt_loss_fn(model), gpt_init(model, config), gpt_batch(config)
    mesh = jax.make_mesh((N_DEVICES,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    specs = param_specs(params, "tp", N_DEVICES)
    sharded = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, specs)
    replicated = NamedSharding(mesh, batch_spec("tp"))
    batch_sharded = jax.tree.map(lambda x: jax.device_put(x, replicated), batch)
    policy = jaxamp.get_policy("mixed_bfloat16")
    settings = {
        "policy_cast": lambda p, b: loss(policy.cast_to_compute(p), b),
        "autocast": jaxamp.autocast(loss, policy),
        "fp8": jaxamp.autocast(loss, "mixed_float8"),
    }
    out = {}
    for name, fn in settings.items():
        # Flax's layer norm promotes bfloat16 params to float32 implicitly.
        with jax.numpy_dtype_promotion("standard"):
            report = jaxamp.communication_report(jax.value_and_grad(fn), sharded, batch_sharded)
        # Scalars (a loss average, activation amaxes) and vectors of amaxes.
        scalars = sum(
            c.bytes
            for c in report.collectives
            if math.prod(c.shape) == 1 or any(k in c.op_name for k in _SCALE_REDUCTIONS)
        )
        out[name] = {
            **_wire(report),
            "total": report.bytes_per_param(),
            "without_scalars": report.bytes_per_param() - scalars / report.param_count,
        }
    fn = jax.jit(settings["autocast"])
    out["loss_sharded"] = float(fn(sharded, batch_sharded))
    out["loss_one_device"] = float(fn(params, batch))
    return out


def _worker() -> dict:
    import jax
    import jax.numpy as jnp

    import jaxamp

    jax.config.update("jax_numpy_dtype_promotion", "strict")
    assert jax.device_count() == N_DEVICES, jax.devices()
    policy = jaxamp.get_policy("mixed_bfloat16")
    policies = {"reduce_f32": policy, "reduce_bf16": policy.with_reduce_dtype(jnp.bfloat16)}
    out = {}
    for name, make in (("gpt", _gpt), ("nnx", _nnx), ("equinox", _equinox)):
        out[name] = _measure(*make(), policies)
    out["shard_map"] = _shard_map_fsdp()
    out["tensor_parallel"] = _tensor_parallel()
    return out


@pytest.fixture(scope="module")
def measured():
    return run_with_devices(__file__, N_DEVICES, timeout=600)


@pytest.mark.parametrize("model", ["gpt", "nnx", "equinox"])
def test_autocast_gathers_each_parameter_once_in_bfloat16(measured, model):
    for policy in ("reduce_f32", "reduce_bf16"):
        wire = measured[model][policy]
        assert wire["max_gathers_per_param"] == 1, (model, policy, wire)
        # Embedding tables included; only parameters autocast computes with in
        # float32 (layer-norm scales and biases, after float32 statistics) stay
        # so, and those are small gathers (only the GPT has layer norms).
        assert not wire["f32_gathers"], wire["f32_gathers"]
        small_f32 = wire["small_f32_gathers"]
        assert all("LayerNorm" in p for p in small_f32), small_f32
        assert bool(small_f32) == (model == "gpt"), small_f32
        gathers = wire["per_param"]
        assert gathers["all-gather bfloat16"] <= 2.1, gathers
        # A layer norm's scale is gathered again for the backward pass: 1.5x its share.
        layer_norm = measured[model]["layer_norm_bytes_per_param"]
        assert gathers.get("all-gather float32", 0.0) <= 1.5 * layer_norm + 1e-4, gathers


@pytest.mark.parametrize("model", ["gpt", "nnx", "equinox"])
def test_weight_gradients_are_reduced_in_the_policys_reduce_dtype(measured, model):
    default = measured[model]["reduce_f32"]["per_param"]
    assert 3.95 <= default["reduce float32"] <= 4.05, default
    assert default.get("reduce bfloat16", 0.0) <= 0.01, default
    narrow = measured[model]["reduce_bf16"]["per_param"]
    assert 1.95 <= narrow["reduce bfloat16"] <= 2.05, narrow
    layer_norm = measured[model]["layer_norm_bytes_per_param"]
    assert narrow.get("reduce float32", 0.0) <= layer_norm + 1e-4, narrow


@pytest.mark.parametrize("model", ["gpt", "nnx", "equinox"])
def test_the_sharded_loss_is_the_one_device_loss(measured, model):
    got, want = measured[model]["loss_sharded"], measured[model]["loss_one_device"]
    assert abs(got - want) <= 2.0**-8 * abs(want)


def test_shard_map_fsdp_gathers_in_bfloat16_and_reduces_in_the_reduce_dtype(measured):
    out = measured["shard_map"]
    for name in ("helper", "autocast"):
        wire = out[name]["per_param"]
        assert out[name]["max_gathers_per_param"] == 1
        assert wire["all-gather bfloat16"] > 1.9 and "all-gather float32" not in wire, wire
        # The weights' reduce-scatter and the replicated bias's psum, all in float32.
        assert wire["reduce float32"] >= 3.95 and "reduce bfloat16" not in wire, wire
        narrow = out[name + "_reduce_bf16"]["per_param"]
        assert narrow["reduce bfloat16"] >= 1.9, narrow
        assert abs(out[name + "_loss"] - out["loss_float32"]) <= 2.0**-7 * out["loss_float32"]


def test_tensor_parallel_autocast_moves_no_more_than_the_policy_cast(measured):
    # Row-parallel partial sums (and column-parallel activation gradients) are
    # all-reduced in bfloat16, as Megatron does: not in float32.
    out = measured["tensor_parallel"]
    autocast, cast = out["autocast"], out["policy_cast"]
    assert autocast["total"] <= cast["total"], (autocast, cast)
    assert autocast["per_param"]["reduce bfloat16"] > 0.5, autocast
    # float32 only where the policy cast has it too (small replicated gradients).
    f32 = autocast["per_param"].get("reduce float32", 0.0)
    assert f32 <= cast["per_param"].get("reduce float32", 0.0), (autocast, cast)
    got, want = out["loss_sharded"], out["loss_one_device"]
    assert abs(got - want) <= 2.0**-8 * abs(want)


def test_fp8_tensor_parallel_moves_no_more_than_16_bit_autocast(measured):
    # FP8 partial sums in the compute dtype too; the attention's products of two
    # activations (several batch dims) stay sharded by heads, as in 16 bits.
    out = measured["tensor_parallel"]
    fp8, autocast = out["fp8"], out["autocast"]
    assert fp8["without_scalars"] <= autocast["without_scalars"] + 1e-9, (fp8, autocast)
    assert fp8["per_param"]["reduce bfloat16"] == autocast["per_param"]["reduce bfloat16"]
    assert "all-gather bfloat16" not in fp8["per_param"], fp8
    # The scalars (a loss average, an amax per quantized activation) and amax vectors.
    assert fp8["total"] - fp8["without_scalars"] <= 0.01, fp8


def _gpt_2_65m() -> dict:
    """The numbers of docs/api/autocast.md: a 3-layer, width-256 GPT (2.65M params)."""
    import jax
    import jax.numpy as jnp

    import jaxamp
    from benchmarks._models import GPTConfig

    jax.config.update("jax_numpy_dtype_promotion", "strict")
    config = GPTConfig(vocab=512, seq=64, d_model=256, n_heads=4, d_ff=1024, n_layers=3, batch=64)
    policy = jaxamp.get_policy("mixed_bfloat16")
    policies = {"reduce_f32": policy, "reduce_bf16": policy.with_reduce_dtype(jnp.bfloat16)}
    return _measure(*_gpt(config), policies)


if __name__ == "__main__":
    # With --gpt-2.65m: the larger model's numbers (XLA_FLAGS as in ``measured``).
    print(json.dumps(_gpt_2_65m() if "--gpt-2.65m" in sys.argv else _worker()))
