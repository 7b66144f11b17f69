"""Every entry point that takes a policy accepts the same forms, read by one resolver.

One table of specs, each with the policy and recipe it stands for; every entry
point is run on every spec and must show that policy (and, where it runs
matmuls, the recipe's float8 operands).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import jmp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx

import jaxamp
from jaxamp._resolve import resolve
from tests.helpers import dot_dtypes

F32, BF16, F16 = np.dtype("float32"), np.dtype(jnp.bfloat16), np.dtype("float16")
E4M3 = np.dtype(jnp.float8_e4m3fn)

# spec -> (param, compute, output dtypes of its policy; its recipe or None).
SPECS = [
    ("mixed_bfloat16", (F32, BF16, F32), None),
    ("float16", (F16, F16, F16), None),
    ("p=f32,c=f16,o=f32", (F32, F16, F32), None),
    (jaxamp.Policy(F32, BF16, F16), (F32, BF16, F16), None),
    (jmp.get_policy("p=f32,c=bf16,o=bf16"), (F32, BF16, BF16), None),
    ("mixed_float8", (F32, BF16, F32), jaxamp.Float8Recipe()),
    (jaxamp.Float8Recipe("rowwise", compute_dtype=jnp.float16), (F32, F16, F32), "same"),
]
IDS = [str(spec) for spec, _, _ in SPECS]
BAD = [("mixed_float9", ValueError), ("c=bf17", ValueError), (3, TypeError), (None, TypeError)]

W = jnp.linspace(-1.0, 1.0, 32).reshape(8, 4)
X = jnp.linspace(0.5, 2.0, 16).reshape(2, 8)


def _loss(w, x):
    return jnp.sum(jnp.tanh(x @ w))


def _expected(spec, dtypes, recipe):
    return jaxamp.Policy(*dtypes), (spec if recipe == "same" else recipe)


@pytest.mark.parametrize(("spec", "dtypes", "recipe"), SPECS, ids=IDS)
def test_resolve(spec, dtypes, recipe):
    assert resolve(spec) == _expected(spec, dtypes, recipe)


@pytest.mark.parametrize(("spec", "dtypes", "recipe"), SPECS, ids=IDS)
def test_autocast(spec, dtypes, recipe):
    fun = jaxamp.autocast(lambda w, x: x @ w, spec)
    operands = E4M3 if recipe is not None else dtypes[1]
    assert dot_dtypes(fun, W, X) == [(operands.name, operands.name)]
    assert fun(W, X).dtype == dtypes[2]


@pytest.mark.parametrize(("spec", "dtypes", "recipe"), SPECS, ids=IDS)
def test_numerics_report_and_monitor(spec, dtypes, recipe):
    # The report runs the program autocast gives, and the monitor reports the same.
    report = jaxamp.numerics_report(_loss, W, X, policy=spec)
    seen_dtypes = {op.dtype for op in report.ops}
    assert dtypes[1] in seen_dtypes and (E4M3 in seen_dtypes) == (recipe is not None)
    seen = []
    monitor = jaxamp.numerics_monitor(
        _loss, every=1, policy=spec, callback=lambda step, r: seen.append(r)
    )
    jax.jit(monitor)(0, W, X)
    jax.effects_barrier()
    assert [(op.primitive, op.dtype, op.max_abs) for op in seen[0].ops] == [
        (op.primitive, op.dtype, op.max_abs) for op in report.ops
    ]


@pytest.mark.parametrize(("spec", "dtypes", "recipe"), SPECS, ids=IDS)
def test_flax_adapters(spec, dtypes, recipe):
    param, compute, output = dtypes
    model = nnx.Linear(8, 4, rngs=nnx.Rngs(0))
    jaxamp.flax.set_policy(model, spec)
    assert (model.dtype, model.kernel.dtype) == (compute, param)
    pair = nnx.Sequential(nnx.Linear(8, 4, rngs=nnx.Rngs(0)), nnx.LayerNorm(4, rngs=nnx.Rngs(0)))
    jaxamp.flax.set_policy(pair, "float32", {nnx.LayerNorm: spec})
    assert (pair.layers[0].dtype, pair.layers[1].dtype) == (F32, compute)

    dense = nn.Dense(4)
    with jaxamp.flax.linen_policy(spec):
        variables = dense.init(jax.random.key(0), X)
        out = dense.apply(variables, X)
    # The model's output follows the policy's output dtype.
    assert (variables["params"]["kernel"].dtype, out.dtype) == (param, output)
    with jaxamp.flax.linen_policy("float32", {nn.Dense: spec}):
        assert dense.apply(variables, X).dtype == F32  # the root's output: the default policy


@pytest.mark.parametrize(("spec", "error"), BAD, ids=[repr(s) for s, _ in BAD])
def test_every_entry_point_rejects_the_same_specs(spec, error):
    calls = [
        lambda: resolve(spec),
        lambda: jaxamp.autocast(_loss, spec),
        lambda: jaxamp.numerics_report(_loss, W, X, policy=spec),
        lambda: jaxamp.numerics_monitor(_loss, every=1, policy=spec),
        lambda: jaxamp.flax.set_policy(nnx.Linear(8, 4, rngs=nnx.Rngs(0)), spec),
        lambda: jaxamp.flax.set_policy(nnx.Linear(8, 4, rngs=nnx.Rngs(0)), "float32", {"x": spec}),
    ]
    if spec is None:  # None is numerics_*'s "run as written"
        calls = [calls[0], calls[1], *calls[4:]]
    for call in calls:
        with pytest.raises(error, match="Float8Recipe.*'mixed_float8'"):
            call()
    with pytest.raises(error, match="Float8Recipe"), jaxamp.flax.linen_policy(spec):
        pass
