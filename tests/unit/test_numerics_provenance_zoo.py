"""The provenance oracle on library attention and padded cross-entropy.

The same substitution oracle as ``test_numerics_provenance.py`` (reused from it),
on causal self-attention as Flax (``nnx.MultiHeadAttention``), Haiku
(``hk.MultiHeadAttention``) and Equinox (``eqx.nn.MultiheadAttention``) write it,
each with its own masking idiom (``finfo.min``, ``-1e30``), and on the two common
ways to pad a cross-entropy, with a padded position whose logits overflow float16:
``first_nonfinite`` is None exactly when the loss and the gradients are finite,
and otherwise the op the oracle finds.
"""

from __future__ import annotations

import functools
import inspect
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from jaxamp._numerics._compiled import compiler_options
from tests.unit.test_numerics_provenance import (
    HEADS,
    PRECISIONS,
    D,
    T,
    _check_against_oracle,
    _padded_cross_entropy,
    _params,
)


def _causal():
    return jnp.tril(jnp.ones((T, T), bool))


def _pad():
    return jnp.arange(T) == T - 1  # the last position is padding


def _pad_logits(p, x):
    # A padded position holds garbage: its logits overflow float16 (not float32).
    x = jnp.where(_pad()[:, None], x * 1e4, x)
    return (x @ p["wq"]) * 100.0


def _nll(logits):
    labels = jnp.arange(T) % D
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.take_along_axis(logp, labels[:, None], axis=-1)[:, 0]


def _padded_nll_where(p, x):
    # The forward pass discards the padded NaN; its gradient does not.
    return jnp.mean(jnp.where(_pad(), 0, _nll(_pad_logits(p, x))))


def _padded_nll_mean(p, x):
    mask = (~_pad()).astype(x.dtype)
    return jnp.sum(mask * _nll(_pad_logits(p, x))) / jnp.sum(mask)


@functools.cache
def _flax_attention():
    nnx = pytest.importorskip("flax.nnx")
    layer = nnx.MultiHeadAttention(
        HEADS, D, decode=False, rngs=nnx.Rngs(0), param_dtype=jnp.float32
    )
    graphdef, state = nnx.split(layer)

    def loss(p, x):
        with jax.numpy_dtype_promotion("standard"):  # as the library is written
            out = nnx.merge(graphdef, p["attention"])(x[None], mask=_causal()[None, None])
        return jnp.mean((out[0] @ p["w_up"]) ** 2)

    return loss, {"attention": jax.tree.map(jnp.asarray, state)}


@functools.cache
def _haiku_attention():
    hk = pytest.importorskip("haiku")

    def forward(x):
        layer = hk.MultiHeadAttention(HEADS, D // HEADS, w_init=hk.initializers.VarianceScaling())
        return layer(x, x, x, mask=_causal()[None])

    model = hk.without_apply_rng(hk.transform(forward))
    params = model.init(jax.random.key(1), jnp.zeros((T, D)))

    def loss(p, x):
        with jax.numpy_dtype_promotion("standard"):
            out = model.apply(p["attention"], x)
        return jnp.mean((out @ p["w_up"]) ** 2)

    return loss, {"attention": params}


@functools.cache
def _equinox_attention():
    eqx = pytest.importorskip("equinox")
    layer = eqx.nn.MultiheadAttention(HEADS, D, key=jax.random.key(2))
    params, static = eqx.partition(layer, eqx.is_array)

    def loss(p, x):
        with jax.numpy_dtype_promotion("standard"):
            out = eqx.combine(p["attention"], static)(x, x, x, mask=_causal())
        return jnp.mean((out @ p["w_up"]) ** 2)

    return loss, {"attention": params}


LIBRARIES = {
    "flax_nnx": _flax_attention,
    "haiku": _haiku_attention,
    "equinox": _equinox_attention,
}
CROSS_ENTROPY = {"where_padded": _padded_nll_where, "mask_mean": _padded_nll_mean}


def _case(precision, params, x):
    return PRECISIONS[precision](params, x)


# CI: one library and one padded cross-entropy; the rest run with -m slow.
_CI = {("flax_nnx", "autocast_float16"), ("where_padded", "hand_float16")}


# Flax attends through jax.nn.dot_product_attention: XLA:CPU has no float16 dot
# with a float32 result, so float16 Flax attention does not compile on the CPU.
_LEFT_OUT = {("flax_nnx", "hand_float16")}


def _params_of(names):
    return [
        pytest.param(name, precision, marks=() if (name, precision) in _CI else pytest.mark.slow)
        for name in names
        for precision in PRECISIONS
        if (name, precision) not in _LEFT_OUT
    ]


@pytest.mark.parametrize(("name", "precision"), _params_of(LIBRARIES))
def test_library_causal_attention_matches_the_oracle(name, precision):
    loss, library_params = LIBRARIES[name]()
    p, x = _params()
    args, policy = _case(precision, {**library_params, "w_up": p["w_up"]}, x)
    report = _check_against_oracle(loss, args, policy)
    # Finite weights: every masked -inf/-1e30/finfo.min is absorbed by softmax.
    assert report.first_nonfinite is None, str(report)


@pytest.mark.parametrize(("name", "precision"), _params_of(CROSS_ENTROPY))
def test_padded_cross_entropy_matches_the_oracle(name, precision):
    args, policy = _case(precision, *_params())
    report = _check_against_oracle(CROSS_ENTROPY[name], args, policy)
    if precision != "fp8_rowwise":  # float16 logits of the padded position overflow
        assert report.first_nonfinite is not None, str(report)


_ABORTING = """
import sys
import jax, jaxamp
from jaxamp._numerics import _compiled
_compiled.FAST_COMPILE_VALUES = int(sys.argv[1])  # 0: compiled as a large program
from tests.unit.test_numerics_provenance import PRECISIONS, ZOO, _params
jax.config.update("jax_numpy_dtype_promotion", "strict")
args, _ = PRECISIONS["hand_float16"](*_params())
report = jaxamp.numerics_report(ZOO["padded_cross_entropy"], *args, grad=True)
origin = report.first_nonfinite
print(origin.primitive, origin.phase, origin.source.rsplit(":", 1)[1])
"""


@pytest.mark.parametrize("fast_compile_values", [2**22, 0], ids=["unoptimized", "optimized"])
def test_hand_cast_float16_padded_cross_entropy_does_not_abort(fast_compile_values):
    # Its float32 shadow shares fused loops with float16 arithmetic, which LLVM's
    # x86 backend aborted on once vectorized 256 bits wide. Both ways the report
    # compiles (a small program unoptimized, a large one with 64-bit vectors) must
    # not. Run apart: an abort kills the process it happens in.
    assert compiler_options("cpu", 2**22)["xla_backend_optimization_level"] == 0
    assert compiler_options("cpu", 2**22 + 1)["xla_cpu_prefer_vector_width"] == 64
    done = subprocess.run(
        [sys.executable, "-c", _ABORTING, str(fast_compile_values)],
        cwd=Path(__file__).parents[2],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines, first = inspect.getsourcelines(_padded_cross_entropy)
    log_line = first + next(i for i, text in enumerate(lines) if "-jnp.log(" in text)
    # float16 probabilities underflow to 0: the log of a picked one is the loss's inf
    assert done.stdout.split() == ["log", "forward", str(log_line)]
