"""communication_report on 8 CPU devices: an FSDP-sharded MLP and a shard_map program.

The reports are made in a subprocess (this file run as a script, 8 devices forced
by XLA_FLAGS before jax is imported), which prints them as JSON. The test checks
them against a hand computation of the parameter all-gathers and against an
independent reading of the partitioned program's text.
"""

import re

import numpy as np

from tests.helpers import run_with_devices

N_DEVICES = 8
SHAPES = {"b1": (32,), "w1": (64, 32), "w2": (32, 16)}  # FSDP: each weight sharded on dim 0
N_PARAMS = sum(int(np.prod(s)) for s in SHAPES.values())


def _as_json(report, checks=None) -> dict:
    return {
        "collectives": [
            [c.kind, c.dtype.name, list(c.shape), c.bytes, c.parameter, c.backward]
            for c in report.collectives
        ],
        "param_count": report.param_count,
        "num_devices": report.num_devices,
        "hlo": report.hlo,
        "table": str(report),
        "bytes_by": {
            f"{kind}/{dtype.name}": report.bytes_by(kind, dtype) for kind, dtype in report.totals()
        },
        "checks": checks or {},
    }


def _assertion(fn, *args) -> str:
    """'' when ``fn(*args)`` passes, else its AssertionError's first line."""
    try:
        fn(*args)
    except AssertionError as e:
        return str(e).splitlines()[0] or "failed"
    return ""


def _worker() -> dict:
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxamp
    from jaxamp.testing import assert_gathers_in, assert_reduces_in

    mesh = jax.make_mesh((N_DEVICES,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    fsdp = {k: NamedSharding(mesh, P("d")) for k in SHAPES}
    key = iter(jax.random.split(jax.random.key(0), 4))
    params = {
        k: jax.device_put(jax.random.normal(next(key), s), fsdp[k]) for k, s in SHAPES.items()
    }
    x = jax.device_put(jax.random.normal(next(key), (32, 64)), NamedSharding(mesh, P("d")))
    policy = jaxamp.get_policy("mixed_bfloat16")

    def loss(p, x):
        h = jax.nn.relu(x.astype(p["w1"].dtype) @ p["w1"] + p["b1"])
        return jnp.mean(jnp.square(h @ p["w2"]).astype(jnp.float32))

    def step(p, x):
        grads = jax.grad(loss)(p, x)
        return jax.tree.map(lambda a, g: a - 0.1 * g, p, grads)

    def cast_step(p, x):
        grads = jax.grad(lambda p, x: loss(policy.cast_to_compute(p), x))(p, x)
        return jax.tree.map(lambda a, g: a - 0.1 * g, p, grads)

    def shard_map_fn(a, b, w):
        # A variadic psum (one all-reduce, two operands) and a bf16 all_gather.
        sa, sb = jax.lax.psum((a, b), "d")
        return sa, sb, jax.lax.all_gather(w.astype(jnp.bfloat16), "d", tiled=True)

    smap = jax.jit(
        jax.shard_map(
            shard_map_fn,
            mesh=mesh,
            in_specs=(P(), P(), P("d")),
            out_specs=(P(), P(), P()),
            check_vma=False,  # the gathered value is the same everywhere
        )
    )
    # An abstract argument with a sharding: nothing is allocated or run.
    w_abstract = jax.ShapeDtypeStruct((64, 32), jnp.float32, sharding=fsdp["w1"])
    f32 = jaxamp.communication_report(step, params, x)
    cast = jaxamp.communication_report(jax.jit(cast_step), params, x)
    checks = {
        "f32_gathers_f32": _assertion(assert_gathers_in, f32, jnp.float32),
        "f32_gathers_bf16": _assertion(assert_gathers_in, f32, jnp.bfloat16),
        "f32_reduces_f32": _assertion(assert_reduces_in, f32, jnp.float32),
        "cast_gathers_bf16": _assertion(assert_gathers_in, cast, jnp.bfloat16),
        "cast_gathers_f32": _assertion(assert_gathers_in, cast, jnp.float32),
    }
    return {
        "float32": _as_json(f32, checks),
        "cast": _as_json(cast),
        "shard_map": _as_json(
            jaxamp.communication_report(smap, jnp.ones((4, 4)), jnp.ones(3), w_abstract)
        ),
    }


def _independent_totals(hlo: str) -> dict:
    """kind/dtype -> bytes, read from the program's text with one regular expression.

    For these collectives (no reduce-scatter, see the test) the counted tensor has
    the shape of the result; a variadic all-reduce has a tuple of them.
    """
    sizes = {"f32": 4, "bf16": 2, "s32": 4, "pred": 1, "f16": 2}
    names = {"f32": "float32", "bf16": "bfloat16", "s32": "int32", "pred": "bool", "f16": "float16"}
    totals: dict = {}
    pattern = (
        r"= (\(.*?\)|\S+) (all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)\("
    )
    for result, kind in re.findall(pattern, hlo):
        for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", result):
            n = int(np.prod([int(d) for d in dims.split(",") if d]))
            key = f"{kind}/{names[dtype]}"
            totals[key] = totals.get(key, 0) + n * sizes[dtype]
    return totals


def _param_gathers(out: dict) -> dict:
    return {
        c[4]: (c[1], tuple(c[2]), c[3]) for c in out["collectives"] if c[0] == "all-gather" and c[4]
    }


def test_report_matches_the_partitioned_program_and_a_hand_count():
    out = run_with_devices(__file__, N_DEVICES)
    for name in ("float32", "cast", "shard_map"):
        report = out[name]
        assert report["num_devices"] == N_DEVICES
        assert "reduce-scatter(" not in report["hlo"]  # _independent_totals assumes it
        assert report["bytes_by"] == _independent_totals(report["hlo"]), name
        assert report["bytes_by"], name

    # FSDP: each weight is gathered whole before its use, in the dtype it is used in.
    f32, cast = out["float32"], out["cast"]
    assert f32["param_count"] == cast["param_count"] == N_PARAMS
    for report, dtype, size in ((f32, "float32", 4), (cast, "bfloat16", 2)):
        gathers = _param_gathers(report)
        for k in ("w1", "w2"):
            assert gathers[f"p['{k}']"] == (dtype, SHAPES[k], size * np.prod(SHAPES[k])), k
    assert {c[1] for c in f32["collectives"]} == {"float32"}
    assert any(c[0] == "all-reduce" and c[5] for c in f32["collectives"])  # gradient reductions
    assert "B/param" in f32["table"] and "p['w1']" in f32["table"]

    checks = f32["checks"]
    assert checks["f32_gathers_f32"] == "" and checks["f32_reduces_f32"] == ""
    assert checks["f32_gathers_bf16"].startswith(
        "2 of 2 (floating parameter all-gather) not in bfloat16"
    )
    assert checks["cast_gathers_bf16"] == "" and checks["cast_gathers_f32"]

    # shard_map: the code's own collectives, one entry per operand of the variadic psum.
    smap = out["shard_map"]["collectives"]
    assert [c[:4] for c in smap] == [
        ["all-reduce", "float32", [4, 4], 64],
        ["all-reduce", "float32", [3], 12],
        ["all-gather", "bfloat16", [64, 32], 64 * 32 * 2],
    ]
    assert smap[2][4] == "w"  # traced back through the cast to the argument
    assert out["shard_map"]["param_count"] == 16  # the first argument's elements


if __name__ == "__main__":
    import json

    print(json.dumps(_worker()))
