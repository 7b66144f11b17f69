"""numerics_report against oracles over a corpus of models and losses nobody tuned for it.

- No crash where the plain program runs (forward and gradient), and the float32
  twin of each layer is a real float32 computation (its range matches float32's).
- ``max_loss_scale`` against brute force: the largest power of two at which the
  real loss-scaled float16 backward (``jaxamp.scaled_value_and_grad``) is finite,
  found by bisection; they agree within ``SAFETY_FACTOR``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp
from jaxamp._numerics import SAFETY_FACTOR

F16_MAX = float(jnp.finfo(jnp.float16).max)


def _keys(n):
    return jax.random.split(jax.random.key(0), n)


# -- the corpus: (loss, params, *batch), policy -------------------------------------------


def _mlp_tanh(w, x):
    return jnp.mean(jnp.tanh(x @ w))


def _mlp(params, x, y):
    h = jax.nn.relu(x @ params["w1"] + params["b1"])
    logits = h @ params["w2"]
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y))


def _mlp_params(n_in):
    k = _keys(2)
    return {
        "w1": jax.random.normal(k[0], (n_in, 32)) / math.sqrt(n_in),
        "b1": jnp.zeros((32,)),
        "w2": jax.random.normal(k[1], (32, 10)) / math.sqrt(32.0),
    }


def _f16_loss(w, x):  # a hand-cast model whose loss is float16 itself
    return jnp.mean(jnp.square(x @ w))


def _attention(params, x):
    q, k, v = (x @ params[n] for n in ("q", "k", "v"))
    s = (q @ jnp.swapaxes(k, -1, -2)) / 4.0
    causal = jnp.tril(jnp.ones((s.shape[-1], s.shape[-1]), bool))
    s = jnp.where(causal, s, -3e4)  # in float16's range (-1e9 is a float16 -inf)
    out = jax.nn.softmax(s, axis=-1) @ v
    return jnp.mean(jnp.square(out @ params["o"]))


def _embedding_xent(params, ids, labels):
    h = jnp.mean(jnp.take(params["embed"], ids, axis=0), axis=1)
    logits = h @ params["out"]
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))


def _corpus():
    k = _keys(8)
    attn = {n: jax.random.normal(k[i], (16, 16)) * 0.25 for i, n in enumerate("qkvo")}
    return {
        "mlp_tanh_large_inputs": (
            _mlp_tanh,
            (jnp.ones((4, 3)) * 0.1, jnp.ones((2, 4)) * 100.0),
            "mixed_float16",
        ),
        "mlp_normalised_inputs": (
            _mlp,
            (_mlp_params(16), jax.random.normal(k[4], (8, 16)), jnp.arange(8) % 10),
            "mixed_float16",
        ),
        "mlp_raw_pixels": (
            _mlp,
            (
                _mlp_params(64),
                jax.random.randint(k[5], (8, 64), 0, 256).astype(jnp.float32),
                jnp.arange(8) % 10,
            ),
            "mixed_float16",
        ),
        "float16_loss": (
            _f16_loss,
            (
                jnp.full((8, 4), 0.5, jnp.float16),
                jax.random.normal(k[6], (4, 8)).astype(jnp.float16),
            ),
            None,
        ),
        "attention": (_attention, (attn, jax.random.normal(k[7], (2, 6, 16))), "mixed_float16"),
        "embedding_xent": (
            _embedding_xent,
            (
                {
                    "embed": jax.random.normal(k[4], (50, 16)),
                    "out": jax.random.normal(k[5], (16, 10)) * 0.25,
                },
                jax.random.randint(k[6], (8, 5), 0, 50),
                jnp.arange(8) % 10,
            ),
            "mixed_float16",
        ),
    }


CORPUS = _corpus()


# -- the brute-force oracle ----------------------------------------------------------------


def _finite_at(loss, policy, args):
    """``finite(p)``: whether the real loss-scaled gradient at scale ``2**p`` is all finite."""
    fun = jaxamp.autocast(loss, policy) if policy is not None else loss

    @jax.jit
    def grads_finite(scale, *args):
        _, grads = jaxamp.scaled_value_and_grad(fun, jaxamp.StaticLossScale(scale))(*args)
        return jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))

    return lambda p: bool(grads_finite(jnp.float32(2.0**p), *args))


def brute_force_max_scale(loss, policy, args, top: int = 64) -> int | None:
    """``log2`` of the largest power of two with a finite scaled gradient (None: above 2**top)."""
    finite = _finite_at(loss, policy, args)
    lo, hi = 0, top  # finite at 2**lo, not finite at 2**hi
    assert finite(lo), "the unscaled gradient must be finite"
    if finite(hi):
        return None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if finite(mid) else (lo, mid)
    return lo


@pytest.mark.parametrize("name", list(CORPUS))
def test_corpus_runs_and_loss_scale_matches_brute_force(name):
    # One report covers the forward and the backward pass; the brute force runs the
    # plain program (and asserts its unscaled gradient is finite).
    loss, args, policy = CORPUS[name]
    report = jaxamp.numerics_report(loss, *args, policy=policy, grad=True)
    assert report.first_nonfinite is None and not report.nonfinite_ops
    assert {op.phase for op in report.ops} == {"forward", "backward"}

    brute = brute_force_max_scale(loss, policy, args)
    got = math.log2(report.max_loss_scale)
    assert abs(got - brute) <= math.log2(SAFETY_FACTOR), (got, brute)
    assert report.suggested_loss_scale <= 2.0**brute  # the suggestion itself is safe
    # Measured at a scale that overflows, the float32 twins still give the same answer.
    over = jaxamp.numerics_report(
        loss, *args, policy=policy, grad=True, loss_scale=2.0 ** (brute + 4)
    )
    assert over.nonfinite_ops and over.max_loss_scale == report.max_loss_scale


def test_brute_force_finds_the_float16_loss_seed_limit():
    # A float16 loss: the seed (the scale itself, in float16) overflows above 65504.
    loss, args, _ = CORPUS["float16_loss"]
    report = jaxamp.numerics_report(loss, *args, grad=True)
    assert report.max_loss_scale <= 2.0**15 == 2.0 ** brute_force_max_scale(loss, None, args)


def test_bfloat16_needs_no_loss_scale():
    loss, args, _ = CORPUS["mlp_tanh_large_inputs"]
    report = jaxamp.numerics_report(loss, *args, policy="mixed_bfloat16", grad=True)
    assert report.max_loss_scale is None and report.suggested_loss_scale is None
    assert "loss scale: not needed" in str(report)
    assert brute_force_max_scale(loss, "mixed_bfloat16", args) is None  # finite at 2**64


def test_barrier_grouping_does_not_mark_forward_values_scaled():
    loss, args, policy = CORPUS["mlp_tanh_large_inputs"]
    report = jaxamp.numerics_report(loss, *args, policy=policy, grad=True)
    barriers = [op for op in report.ops if op.primitive == "optimization_barrier"]
    assert barriers and all(not op.scaled for op in barriers if op.max_abs == 100.0)
    assert report.max_loss_scale == 2.0**18  # the float16 cotangent 2**18 / 6 < 65504


# -- layers whose float32 twin needs retyped parameters -----------------------------------

_IDS = jnp.array([0, 1, 1, 3])
_BIG = jnp.array([4e4, 4e4, 1.0, 2.0], jnp.float16)  # pairs that overflow float16 when added


def _variadic_reduce(x):
    def combine(a, b):
        return a[0] + b[0], jnp.maximum(a[1], b[1])

    zero = jnp.zeros((), x.dtype)
    return jax.lax.reduce((x, x), (zero, zero), combine, (0,))[0]


LAYERS = {
    # name: (fun of one 16-bit array, input, the primitive whose twin is checked)
    "scatter_add": (lambda x: jnp.zeros(5, x.dtype).at[_IDS].add(x), _BIG, "scatter-add"),
    "scatter_max": (lambda x: jnp.zeros(5, x.dtype).at[_IDS].max(x), _BIG, "scatter-max"),
    "segment_sum": (lambda x: jax.ops.segment_sum(x, _IDS, 4), _BIG, "scatter-add"),
    "reduce_window": (
        lambda x: jax.lax.reduce_window(x, jnp.ones((), x.dtype), jax.lax.mul, (2,), (1,), "VALID"),
        jnp.array([300.0, 300.0, 2.0], jnp.float16),
        "reduce_window",
    ),
    "variadic_reduce": (_variadic_reduce, _BIG, "reduce"),
}


@pytest.mark.parametrize("name", list(LAYERS))
def test_layer_twins_are_float32_computations(name):
    fun, x, primitive = LAYERS[name]
    want = float(jnp.max(jnp.abs(fun(x.astype(jnp.float32)))))  # float32 on the same values
    report = jaxamp.numerics_report(fun, x)
    op = next(op for op in report.ops if op.primitive == primitive)
    assert op.max_abs_float32 == pytest.approx(want, rel=1e-6)
    if want > F16_MAX:  # the float16 result overflowed where float32 did not
        assert op.nonfinite and report.first_nonfinite == op


def _walk_dots(jaxpr):
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            yield eqn
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from _walk_dots(sub)


def test_dot_algorithm_presets_are_not_bound_on_float32_operands():
    # F16_F16_F32 names float16 operands: its float32 twin runs at the default precision.
    from jaxamp._numerics._program import NumericsProgram

    preset = jax.lax.DotAlgorithmPreset.F16_F16_F32

    def fun(a, b):
        a = a * 2  # a float16 op: its float32 twin feeds the matmul's twin
        return jax.lax.dot(a, b, precision=preset, preferred_element_type=jnp.float32)

    x = jnp.ones((4, 4), jnp.float16)
    # Traced only: on CPU, XLA rejects F16_F16_F32 for the plain program too.
    program = NumericsProgram(fun, (x, x), {}, None, False, False)
    inputs = program.inputs(None)
    dots = list(_walk_dots(jax.make_jaxpr(program.traced(inputs).run)(*inputs).jaxpr))
    assert len(dots) == 2  # the real matmul and its twin
    for eqn in dots:
        operands = {np.dtype(v.aval.dtype) for v in eqn.invars}
        assert (eqn.params["precision"] == preset) == (operands == {np.dtype(jnp.float16)})


def _embed_loss(state, graphdef, ids, labels):
    from flax import nnx

    h = nnx.merge(graphdef, state)(ids)
    logits = jnp.mean(h, axis=1).astype(jnp.float32)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_nnx_embed_and_integer_label_cross_entropy_gradients(dtype):
    nnx = pytest.importorskip("flax.nnx")
    embed = nnx.Embed(20, 10, dtype=dtype, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(embed)
    ids, labels = jnp.arange(12).reshape(4, 3) % 20, jnp.arange(4) % 10

    def loss(state, ids, labels):
        return _embed_loss(state, graphdef, ids, labels)

    jax.block_until_ready(jax.jit(jax.grad(loss))(state, ids, labels))  # the plain program runs
    report = jaxamp.numerics_report(loss, state, ids, labels, grad=True)
    scatter = [op for op in report.ops if op.primitive == "scatter-add"]
    assert scatter and all(op.phase == "backward" and op.scaled for op in scatter)
    assert all(op.max_abs_float32 > 0 for op in scatter)  # a float32 twin, not a restart
