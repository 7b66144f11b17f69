"""Per-class specifics for the layer sweep (``_layers.py``): what a signature cannot say.

A class not listed here is built from its signature and ``_layers.COMMON`` alone,
on a ``(2, 4)`` input, called as ``layer(h)``. ``SKIP`` holds each class the sweep
does not build, with its one-line reason.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from tests.conformance._layers import Spec

IDS = np.array([1, 5], np.int32)  # token ids for embeddings (vocabulary of 8)
W2 = np.linspace(-1.0, 1.0, 16, dtype=np.float32).reshape(4, 4)  # a second matmul operand
CONTRACT = (((1,), (0,)), ((), ()))
SEQ = (2, 3, 4)  # batch, time, features
LEN = (2, 6, 4)  # batch, length, channels (one spatial dimension)
ABSTRACT = "abstract base class: no layer of its own (its subclasses are swept)"


# -- flax.nnx ------------------------------------------------------------------------


def _nnx_rngs():
    from flax import nnx

    return nnx.Rngs(0)


def _nnx_linear():
    from flax import nnx

    return nnx.Linear(4, 4, rngs=_nnx_rngs())


def _nnx_cell(layer, h):
    return layer(layer.initialize_carry(h.shape, rngs=_nnx_rngs()), h)


def _nnx(name):
    from flax import nnx

    return getattr(nnx, name)


NNX_SKIP = {"Module": ABSTRACT, "RNNCellBase": ABSTRACT}
BATCH = (8, 4)  # batch statistics of 2 rows normalise to +-1 whatever the input
NNX = {
    "BatchNorm": Spec({"use_running_average": False}, x=BATCH),
    "Bidirectional": Spec(
        x=SEQ,
        make=lambda: _nnx("Bidirectional")(
            _nnx("RNN")(_nnx("GRUCell")(4, 4, rngs=_nnx_rngs())),
            _nnx("RNN")(_nnx("GRUCell")(4, 4, rngs=_nnx_rngs())),
        ),
    ),
    "Conv": Spec(x=LEN),
    "ConvTranspose": Spec(x=LEN),
    "Dict": Spec(make=lambda: _nnx("Dict")(a=_nnx_linear()), call=lambda m, h: m["a"](h)),
    "Einsum": Spec({"einsum_str": "bi,ij->bj", "kernel_shape": (4, 4)}),
    "Embed": Spec(call=lambda m, h: (m(IDS) + h, m.attend(h))),
    "GRUCell": Spec(call=_nnx_cell),
    "GroupNorm": Spec({"num_groups": 2}),
    "LSTMCell": Spec(call=_nnx_cell),
    "List": Spec(make=lambda: _nnx("List")([_nnx_linear()]), call=lambda m, h: m[0](h)),
    "LoRA": Spec({"b_initializer": jax.nn.initializers.normal(1.0)}),
    "LoRALinear": Spec({"b_initializer": jax.nn.initializers.normal(1.0)}),
    "MultiHeadAttention": Spec({"decode": False}, x=SEQ),
    "OptimizedLSTMCell": Spec(call=_nnx_cell),
    "RNN": Spec(x=SEQ, make=lambda: _nnx("RNN")(_nnx("LSTMCell")(4, 4, rngs=_nnx_rngs()))),
    "RoPE": Spec({"max_seq_len": 8}, x=(2, 3, 2, 4)),  # flax >= 0.12.9: batch, time, heads, dim
    "Sequential": Spec(make=lambda: _nnx("Sequential")(_nnx_linear(), jax.nn.relu)),
    "SimpleCell": Spec(call=_nnx_cell),
    "SpectralNorm": Spec(
        make=lambda: _nnx("SpectralNorm")(_nnx_linear(), rngs=_nnx_rngs()),
        call=lambda m, h: m(h, update_stats=True),
    ),
    "WeightNorm": Spec(make=lambda: _nnx("WeightNorm")(_nnx_linear(), rngs=_nnx_rngs())),
}


# -- flax.linen ----------------------------------------------------------------------


def _nn(name):
    from flax import linen

    return getattr(linen, name)


def _linen_cell(layer, h):
    return layer(layer.initialize_carry(jax.random.key(0), h.shape), h)


def _fp8_dot(layer, h):
    return layer(h, jnp.asarray(W2), CONTRACT)


LINEN_SKIP = {"Module": ABSTRACT, "RNNCellBase": ABSTRACT}
LINEN = {
    "BatchNorm": Spec({"use_running_average": False}, x=BATCH),
    "Bidirectional": Spec(
        x=SEQ,
        make=lambda: _nn("Bidirectional")(
            _nn("RNN")(_nn("GRUCell")(4)), _nn("RNN")(_nn("GRUCell")(4))
        ),
    ),
    "Conv": Spec({"kernel_size": (3,)}, x=LEN),
    "ConvLSTMCell": Spec({"kernel_size": (3,)}, x=LEN, call=_linen_cell),
    "ConvLocal": Spec({"kernel_size": (3,)}, x=LEN),
    "ConvTranspose": Spec({"kernel_size": (3,)}, x=LEN),
    "Dropout": Spec({"deterministic": False}),
    "Einsum": Spec({"shape": (4, 4), "einsum_str": "bi,ij->bj"}),
    "Embed": Spec(call=lambda m, h: (m(IDS) + h, m.attend(h))),
    "Fp8DirectDotGeneralOp": Spec(call=_fp8_dot),
    "Fp8DotGeneral": Spec(call=_fp8_dot),
    "Fp8DotGeneralOp": Spec(call=_fp8_dot),
    "Fp8Einsum": Spec(call=lambda m, h: m("bi,ij->bj", h, jnp.asarray(W2))),
    "GRUCell": Spec(call=_linen_cell),
    "GroupNorm": Spec({"num_groups": 2}),
    "LSTMCell": Spec(call=_linen_cell),
    "MGUCell": Spec(call=_linen_cell),
    "MultiHeadAttention": Spec(x=SEQ),
    "MultiHeadDotProductAttention": Spec(x=SEQ),
    "NANOOFp8DotGeneralOp": Spec(call=_fp8_dot),
    "OptimizedLSTMCell": Spec(call=_linen_cell),
    "RNN": Spec(x=SEQ, make=lambda: _nn("RNN")(_nn("LSTMCell")(4))),
    "SelfAttention": Spec(x=SEQ),
    "Sequential": Spec(make=lambda: _nn("Sequential")([_nn("Dense")(4), jax.nn.relu])),
    "SimpleCell": Spec(call=_linen_cell),
    "SpectralNorm": Spec(
        make=lambda: _nn("SpectralNorm")(_nn("Dense")(4)),
        call=lambda m, h: m(h, update_stats=True),
    ),
    "WeightNorm": Spec(make=lambda: _nn("WeightNorm")(_nn("Dense")(4))),
}


# -- haiku and haiku.nets ------------------------------------------------------------


def _hk(name):
    import haiku as hk

    return getattr(hk, name)


def _core(layer, h):
    return layer(h, layer.initial_state(h.shape[0]))


def _training(layer, h):
    return layer(h, is_training=True)


IMG = (2, 4, 4, 4)  # batch, height, width, channels
VOL = (1, 4, 4, 4, 4)
HAIKU_SKIP = {"Module": ABSTRACT, "RNNCore": ABSTRACT}
HAIKU = {
    "AvgPool": Spec(x=LEN),
    "BatchNorm": Spec(x=BATCH, call=_training),
    "Conv1D": Spec(x=LEN),
    "Conv1DLSTM": Spec({"input_shape": (6,)}, x=LEN, call=_core),
    "Conv1DTranspose": Spec(x=LEN),
    "Conv2D": Spec(x=IMG),
    "Conv2DLSTM": Spec({"input_shape": (4, 4)}, x=IMG, call=_core),
    "Conv2DTranspose": Spec(x=IMG),
    "Conv3D": Spec(x=VOL),
    "Conv3DLSTM": Spec({"input_shape": (4, 4, 4)}, x=VOL, call=_core),
    "Conv3DTranspose": Spec(x=VOL),
    "ConvND": Spec(x=LEN),
    "ConvNDTranspose": Spec(x=LEN),
    "DeepRNN": Spec(make=lambda: _hk("DeepRNN")([_hk("LSTM")(4), _hk("GRU")(4)]), call=_core),
    "DepthwiseConv1D": Spec(x=LEN),
    "DepthwiseConv2D": Spec(x=IMG),
    "DepthwiseConv3D": Spec(x=VOL),
    "EMAParamsTree": Spec(call=lambda m, h: m({"linear": {"w": h}})),
    "Embed": Spec(call=lambda m, h: m(IDS) + h),
    "Flatten": Spec(x=SEQ),
    "GRU": Spec(call=_core),
    "GroupNorm": Spec(x=SEQ),
    "IdentityCore": Spec(call=_core),
    "InstanceNorm": Spec(x=SEQ),
    "LSTM": Spec(call=_core),
    "MaxPool": Spec(x=LEN),
    "MultiHeadAttention": Spec({"w_init_scale": 1.0}, x=SEQ, call=lambda m, h: m(h, h, h)),
    "Reshape": Spec({"output_shape": (-1,)}, x=SEQ),
    "ResetCore": Spec(
        make=lambda: _hk("ResetCore")(_hk("LSTM")(4)),
        call=lambda m, h: m((h, jnp.array([True, False])), m.initial_state(2)),
    ),
    "SNParamsTree": Spec(call=lambda m, h: m({"linear": {"w": h}})),
    "SeparableDepthwiseConv2D": Spec(x=IMG),
    "Sequential": Spec(make=lambda: _hk("Sequential")([_hk("Linear")(4), jax.nn.relu])),
    "VanillaRNN": Spec(call=_core),
}

_BIG_RESNET = Spec(x=(1, 32, 32, 3), call=_training, slow=True)
HAIKU_NETS_SKIP = {}
HAIKU_NETS = {
    "MobileNetV1": Spec({"strides": (1, 2), "channels": (4, 8)}, x=(2, 8, 8, 3), call=_training),
    "ResNet": Spec(
        # Strides 1: batch statistics of a 1x1 map over 2 images normalise to +-1.
        {
            "blocks_per_group": (1, 1, 1, 1),
            "channels_per_group": (4, 4, 4, 4),
            "bottleneck": False,
            "strides": (1, 1, 1, 1),
        },
        x=(2, 8, 8, 3),
        call=_training,
    ),
    **{f"ResNet{d}": _BIG_RESNET for d in (18, 34, 50, 101, 152, 200)},
    "VectorQuantizer": Spec(call=_training),
    "VectorQuantizerEMA": Spec(call=_training),
}


# -- equinox.nn ----------------------------------------------------------------------


def _eqx(name):
    import equinox as eqx

    return getattr(eqx.nn, name)


def _key():
    return jax.random.key(0)


def _stateful(name, *args, **kwargs):
    import equinox as eqx

    return lambda: eqx.nn.make_with_state(_eqx(name))(*args, **kwargs)


def _eqx_linear():
    return _eqx("Linear")(4, 4, key=_key())


def _shared():
    pair = (_eqx("Embedding")(4, 4, key=_key()), _eqx_linear())
    return _eqx("Shared")(pair, lambda p: p[1].weight, lambda p: p[0].weight)


EQX_LEN, EQX_IMG, EQX_VOL = (4, 6), (4, 6, 6), (4, 4, 4, 4)  # channels first, no batch
EQUINOX_SKIP = {
    "StatefulLayer": ABSTRACT,
    "StateIndex": "a key into eqx.nn.State, not a layer (swept through BatchNorm, SpectralNorm)",
}
EQUINOX = {
    **{
        f"Adaptive{op}Pool{d}d": Spec(x=x)
        for op in ("Avg", "Max")
        for d, x in ((1, EQX_LEN), (2, EQX_IMG), (3, EQX_VOL))
    },
    **{
        f"{op}Pool{d}d": Spec({"kernel_size": 2}, x=x)
        for op in ("Avg", "Max")
        for d, x in ((1, EQX_LEN), (2, EQX_IMG), (3, EQX_VOL))
    },
    "AdaptivePool": Spec({"operation": jnp.max}, x=EQX_LEN),
    "BatchNorm": Spec(
        x=BATCH,
        make=_stateful("BatchNorm", 4, axis_name="batch"),
        call=lambda m, h, s: jax.vmap(m, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(
            h, s
        ),
    ),
    **{
        f"{c}{d}": Spec(x=x)
        for c in ("Conv", "ConvTranspose")
        for d, x in (("", EQX_LEN), ("1d", EQX_LEN), ("2d", EQX_IMG), ("3d", EQX_VOL))
    },
    "Dropout": Spec(call=lambda m, h, s: m(h, key=jax.random.key(1))),
    "Embedding": Spec(call=lambda m, h, s: jax.vmap(m)(jnp.asarray(IDS)) + h),
    "GRUCell": Spec(x=(4,), call=lambda m, h, s: m(h, jnp.zeros(4))),
    "GroupNorm": Spec({"channels": 4}, x=(4, 3)),
    "LSTMCell": Spec(x=(4,), call=lambda m, h, s: m(h, (jnp.zeros(4), jnp.zeros(4)))),
    "Lambda": Spec({"fn": jax.nn.gelu}),
    "LayerNorm": Spec(x=(4,)),
    "Linear": Spec(x=(4,)),
    "MLP": Spec(x=(4,)),
    "MultiheadAttention": Spec(x=(3, 4), call=lambda m, h, s: m(h, h, h)),
    "Pool": Spec({"init": -jnp.inf, "operation": jax.lax.max, "kernel_size": 2}, x=EQX_LEN),
    "RMSNorm": Spec(x=(4,)),
    "RotaryPositionalEmbedding": Spec(x=(3, 4)),
    "Sequential": Spec(
        x=(4,), make=lambda: _eqx("Sequential")([_eqx_linear(), _eqx("Lambda")(jax.nn.relu)])
    ),
    "Shared": Spec(x=(4,), make=_shared, call=lambda m, h, s: m()[1](h)),
    "SpectralNorm": Spec(
        x=(4,),
        make=lambda: _stateful("SpectralNorm", _eqx_linear(), "weight", key=_key())(),
        call=lambda m, h, s: m(h, s),
    ),
    "WeightNorm": Spec(x=(4,), make=lambda: _eqx("WeightNorm")(_eqx_linear())),
}
