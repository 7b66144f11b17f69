"""communication_report names each gathered parameter, whatever model library built it.

A tiny FSDP model from each of Flax NNX (Linear and Einsum), Flax Linen,
Equinox and Haiku, differentiated under ``autocast(loss, "mixed_bfloat16")`` on
4 CPU devices; plus integer token ids that the partitioner all-gathers too. All
reports are made in one subprocess (this file run as a script, 4 devices forced
by XLA_FLAGS before jax is imported), which prints what the test checks as JSON.
"""

from tests.helpers import run_with_devices

N_DEVICES = 4
D, F, B = 64, 128, 256  # width, hidden width, batch rows: each splits over the devices
# With B > D the partitioner gathers the weights, not the batch (FSDP), whichever
# dimension of a weight is sharded.


def _gathers(report) -> list:
    return sorted(
        [c.parameter, c.dtype.name, list(c.shape), c in report.small_gathers]
        for c in report.collectives
        if c.kind == "all-gather" and c.parameter
    )


def _assertion(fn, *args) -> str:
    """'' when ``fn(*args)`` passes, else its AssertionError's message."""
    try:
        fn(*args)
    except AssertionError as e:
        return str(e)
    return ""


def _fsdp(jax, tree, mesh):
    """Each leaf, abstract, sharded on its first dimension (all divide by the devices).

    Shapes and shardings are all a report needs: nothing is allocated or run.
    """
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    sharding = NamedSharding(mesh, P("d"))
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), tree)


def _models(jax, jnp):
    """(name, loss(params, x), abstract params) per library: two products and an RMSNorm."""
    import equinox as eqx
    import flax.linen as nn
    import haiku as hk
    from flax import nnx

    class Nnx(nnx.Module):
        def __init__(self, rngs):
            self.up = nnx.Linear(D, F, rngs=rngs)
            self.down = nnx.Einsum("bf,fd->bd", (F, D), rngs=rngs)
            self.norm = nnx.RMSNorm(D, rngs=rngs)

        def __call__(self, x):
            return self.norm(self.down(jax.nn.relu(self.up(x))))

    graphdef, nnx_state = nnx.split(nnx.eval_shape(lambda: Nnx(nnx.Rngs(0))))

    class Linen(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = jax.nn.relu(nn.Dense(F, name="up")(x))
            return nn.RMSNorm(name="norm")(nn.Einsum((F, D), "bf,fd->bd", name="down")(h))

    x0 = jax.ShapeDtypeStruct((B, D), jnp.float32)
    linen_params = jax.eval_shape(Linen().init, jax.random.key(0), x0)
    eqx_model = eqx.filter_eval_shape(
        lambda: (
            eqx.nn.Linear(D, F, key=jax.random.key(1)),
            eqx.nn.Linear(F, D, key=jax.random.key(2)),
        )
    )

    def eqx_apply(m, x):
        up, down = m
        return jax.vmap(lambda row: down(jax.nn.relu(up(row))))(x)

    haiku = hk.without_apply_rng(
        hk.transform(
            lambda x: hk.RMSNorm(-1, name="norm")(
                hk.Linear(D, name="down")(jax.nn.relu(hk.Linear(F, name="up")(x)))
            )
        )
    )

    def loss_of(apply):
        return lambda p, x: jnp.mean(jnp.square(apply(p, x).astype(jnp.float32)))

    return [
        ("nnx", loss_of(lambda s, x: nnx.merge(graphdef, s)(x)), nnx_state),
        ("linen", loss_of(Linen().apply), linen_params),
        ("equinox", loss_of(eqx_apply), eqx_model),
        ("haiku", loss_of(haiku.apply), jax.eval_shape(haiku.init, jax.random.key(3), x0)),
    ]


def _worker() -> dict:
    import jax
    import jax.numpy as jnp

    import jaxamp
    from jaxamp.testing import assert_gathers_in

    jax.config.update("jax_numpy_dtype_promotion", "strict")
    mesh = jax.make_mesh((N_DEVICES,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    x = _fsdp(jax, jax.ShapeDtypeStruct((B, D), jnp.float32), mesh)
    out = {}
    for name, loss, params in _models(jax, jnp):
        mixed = jaxamp.autocast(loss, "mixed_bfloat16")
        report = jaxamp.communication_report(
            lambda p, x, mixed=mixed: jax.grad(mixed)(p, x), _fsdp(jax, params, mesh), x
        )
        out[name] = {
            "gathers": _gathers(report),
            "bf16": _assertion(assert_gathers_in, report, jnp.bfloat16),
            "table": str(report),
        }

    # Integer token ids are all-gathered too: no parameter dtype decision.
    w, xs, ids = _fsdp(
        jax, (jnp.ones((16, 8)), jnp.ones((8, 16)), jnp.arange(8, dtype=jnp.int32)), mesh
    )
    loss = jaxamp.autocast(
        lambda w, x, ids: jnp.sum(jnp.cumsum(ids).astype(x.dtype)[:, None] * jnp.tanh(x @ w)),
        "mixed_bfloat16",
    )
    report = jaxamp.communication_report(lambda w, x, ids: jax.grad(loss)(w, x, ids), w, xs, ids)
    out["ids"] = {
        "gathers": _gathers(report),
        "bf16": _assertion(assert_gathers_in, report, jnp.bfloat16),
        "f32": _assertion(assert_gathers_in, report, jnp.float32),
    }
    return out


def _expected(prefix: str, matrices: dict, vectors: dict, twice: str = "") -> list:
    """Sorted [parameter, dtype, shape, small] rows: matrices are never small, vectors are.

    ``twice``: the vector gathered a second time, for the backward pass.
    """
    rows = [[prefix + k, dtype, list(shape), False] for k, (dtype, shape) in matrices.items()]
    rows += [[prefix + k, dtype, list(shape), True] for k, (dtype, shape) in vectors.items()]
    rows += [[prefix + twice, vectors[twice][0], list(vectors[twice][1]), True]] if twice else []
    return sorted(rows)


BF16, F32 = "bfloat16", "float32"
UP, DOWN = (BF16, (D, F)), (BF16, (F, D))
EXPECTED = {
    # autocast gathers each weight and the biases added to 16-bit activations in
    # bfloat16; a norm's scale, which multiplies float32 statistics, in float32
    # (twice: the backward pass gathers it again).
    "nnx": _expected(
        "p",
        {"['up']['kernel'].value": UP, "['down']['kernel'].value": DOWN},
        {"['up']['bias'].value": (BF16, (F,)), "['norm']['scale'].value": (F32, (D,))},
        twice="['norm']['scale'].value",
    ),
    "linen": _expected(
        "p['params']",
        {"['up']['kernel']": UP, "['down']['kernel']": DOWN},
        {
            "['up']['bias']": (BF16, (F,)),
            "['down']['bias']": (BF16, (D,)),
            "['norm']['scale']": (F32, (D,)),
        },
        twice="['norm']['scale']",
    ),
    # Equinox keeps weights as (out, in).
    "equinox": _expected(
        "p",
        {"[0].weight": (BF16, (F, D)), "[1].weight": (BF16, (D, F))},
        {"[0].bias": (BF16, (F,)), "[1].bias": (BF16, (D,))},
    ),
    # Haiku broadcasts a bias to the activation's shape before adding it: the
    # float32 vector is gathered, then cast.
    "haiku": _expected(
        "p",
        {"['up']['w']": UP, "['down']['w']": DOWN},
        {
            "['up']['b']": (F32, (F,)),
            "['down']['b']": (F32, (D,)),
            "['norm']['scale']": (F32, (D,)),
        },
    ),
}


def test_each_library_s_gathers_name_their_parameters_and_small_ones_are_marked():
    out = run_with_devices(__file__, N_DEVICES)
    for name, want in EXPECTED.items():
        assert sorted(out[name]["gathers"]) == sorted(want), name
        # The weights carry bfloat16; the float32 vectors are small, not judged.
        assert out[name]["bf16"] == "", name

    table = out["nnx"]["table"].splitlines()
    rows = {line.split()[4]: line for line in table if line.startswith("all-gather")}
    assert rows["p['up']['kernel'].value"].split()[-1] != "small"
    assert rows["p['norm']['scale'].value"].split()[-1] == "small"
    n_params = 2 * D * F + F + D
    small_bytes = 2 * F + 2 * 4 * D  # the bfloat16 bias, the float32 scale twice
    assert table[-1] == (
        "small: 3 all-gathers of vectors, each at least 16x smaller than the largest "
        f"({small_bytes} bytes, {small_bytes / n_params:.2f} B/param together): "
        "not worth a dtype decision"
    )

    # The int32 token ids are gathered too: not judged, and said so.
    ids = out["ids"]
    assert ids["gathers"] == [["ids", "int32", [8], False], ["w", BF16, [16, 8], False]]
    assert ids["bf16"] == ""
    skipped = "\nnot judged (1):\n  all-gather int32[8] from ids (not floating)"
    assert ids["f32"] == (
        "1 of 1 (floating parameter all-gather) not in float32:\n"
        "  all-gather bfloat16[16,8] from w" + skipped
    )


if __name__ == "__main__":
    import json

    print(json.dumps(_worker()))
