"""A policy's wire dtypes that a program cannot send are reported, never dropped silently.

``policy.cast_to_compute`` cannot choose what crosses the wire (the partitioner,
or the code's own collectives, gather the cast shard and reduce in the product's
dtype), nor can ``autocast`` choose the gather dtype under ``jax.jit``; both warn
(``jaxamp.WireDtypeWarning``) where the policy asks for something else. Each case
runs on 4 CPU devices (this file as a script) and records its warnings and the
dtypes of the gradient reductions ``communication_report`` finds, so that a
warning is checked against what really crosses the wire.
"""

import json
import warnings

import pytest

from tests.helpers import run_with_devices

N_DEVICES = 4


def _cases():
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxamp

    mesh = jax.make_mesh((N_DEVICES,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    w = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P("d")))
    x = jax.device_put(jnp.ones((8, 8)), NamedSharding(mesh, P("d")))
    bf16 = jaxamp.get_policy("mixed_bfloat16")

    def cast_loss(policy):
        def loss(w, x):
            x, w = policy.cast_to_compute((x, w))
            return jnp.sum((x @ w).astype(jnp.float32))

        return loss

    def autocast_loss(policy):
        return jaxamp.autocast(lambda w, x: jnp.sum(x @ w), policy)

    def shard_map_grad(policy, check_vma):
        def loss(w, x):
            x, w = policy.cast_to_compute((x, w))
            full = jax.lax.all_gather(w, "d", tiled=True)
            return jax.lax.psum(jnp.sum((x @ full).astype(jnp.float32)), "d")

        specs = {"mesh": mesh, "in_specs": (P("d"), P("d")), "out_specs": P("d")}
        return jax.shard_map(jax.grad(loss), check_vma=check_vma, **specs)

    jit_grad = lambda loss: jax.grad(loss)  # noqa: E731  (communication_report jits it)
    return {
        "cast, default policy": (jit_grad(cast_loss(bf16)), (w, x)),
        "cast, reduce=bfloat16": (jit_grad(cast_loss(bf16.with_reduce_dtype("bfloat16"))), (w, x)),
        "cast, gather=float32 reduce=bfloat16": (
            jit_grad(cast_loss(bf16.with_reduce_dtype("bfloat16").with_gather_dtype("float32"))),
            (w, x),
        ),
        "autocast, default policy": (jit_grad(autocast_loss(bf16)), (w, x)),
        "autocast, gather=float32": (
            jit_grad(autocast_loss(bf16.with_gather_dtype("float32"))),
            (w, x),
        ),
        "shard_map cast, check_vma=True": (shard_map_grad(bf16, True), (w, x)),
        "shard_map cast, check_vma=False": (shard_map_grad(bf16, False), (w, x)),
        "cast, one device": (
            jit_grad(cast_loss(bf16)),
            (jnp.ones((8, 4)), jnp.ones((8, 8))),  # committed to no mesh
        ),
    }


def _worker() -> dict:
    import jax

    import jaxamp

    jax.config.update("jax_numpy_dtype_promotion", "strict")
    out = {}
    for name, (fn, args) in _cases().items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            report = jaxamp.communication_report(fn, *args)
        reductions = {
            str(c.dtype)
            for c in report.collectives
            if c.kind in ("all-reduce", "reduce-scatter") and c.bytes > 4
        }
        out[name] = {
            "warnings": [
                str(c.message) for c in caught if issubclass(c.category, jaxamp.WireDtypeWarning)
            ],
            "reduced_in": sorted(reductions),
        }
    # The eager cast of a sharded array has no gradient to reduce: quiet.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        args = _cases()["cast, default policy"][1]
        jaxamp.get_policy("mixed_bfloat16").cast_to_compute(args[0])
    out["eager cast"] = {"warnings": [str(c.message) for c in caught], "reduced_in": []}
    fn, args = _cases()["cast, default policy"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", jaxamp.WireDtypeWarning)
        try:
            jax.jit(fn)(*args)
            raised = None
        except jaxamp.WireDtypeWarning as e:
            raised = type(e).__name__
    out["as an error"] = {"raised": raised}
    return out


@pytest.fixture(scope="module")
def measured():
    return run_with_devices(__file__, N_DEVICES)


def _one(measured, name):
    case = measured[name]
    assert len(case["warnings"]) <= 1, case
    return case["warnings"][0] if case["warnings"] else None, case["reduced_in"]


@pytest.mark.parametrize(
    "name, says, reduced_in",
    [
        # A hand cast: the gradient is reduced in the product's bfloat16, the policy says float32.
        (
            "cast, default policy",
            [
                "reduce_dtype=float32",
                "jaxamp.autocast(fn, policy)",
                # Where the cast itself would honour the policy (test_explicit_reduction.py).
                "AxisType.Explicit",
                "jax >= 0.10.2",
                "jax.set_mesh",
                "matmul_operands",
            ],
            ["bfloat16"],
        ),
        ("cast, reduce=bfloat16", None, ["bfloat16"]),
        ("cast, gather=float32 reduce=bfloat16", ["gather_dtype=float32"], ["bfloat16"]),
        # autocast owns the products: float32 reduction as the policy says, quiet.
        ("autocast, default policy", None, ["float32"]),
        (
            "autocast, gather=float32",
            ["jaxamp.autocast(<lambda>)", "gather_dtype=float32"],
            ["float32"],
        ),
        ("shard_map cast, check_vma=True", ["(shard_map)", "jaxamp.gather_params"], ["bfloat16"]),
        # check_vma=False: JAX inserts no reduction; the code's own psum decides.
        ("shard_map cast, check_vma=False", None, None),
        ("cast, one device", None, []),
        ("eager cast", None, []),
    ],
)
def test_unhonoured_wire_dtypes_warn_and_honoured_ones_do_not(measured, name, says, reduced_in):
    message, reductions = _one(measured, name)
    if says is None:
        assert message is None, message
    else:
        assert message is not None, name
        for part in says:
            assert part in message, (part, message)
    if reduced_in is not None:
        assert reductions == reduced_in, (name, reductions)


def test_the_warning_can_be_made_an_error(measured):
    assert measured["as an error"]["raised"] == "WireDtypeWarning"


if __name__ == "__main__":
    print(json.dumps(_worker()))
