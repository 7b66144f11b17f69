"""``jaxamp.Float4Recipe``: FP4 (NVFP4 or MXFP4) training recipes for autocast's dense matmuls."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxamp._fp8._recipe import _COMPUTE_DTYPES, GEMMS, _one_of, check_high_precision
from jaxamp._fp8._scalings import SCALINGS, block_size, names
from jaxamp._policy import Policy

__all__ = ["FP4_PRESETS", "SCALE_ROUNDINGS", "Float4Recipe"]

# The presets autocast accepts as strings: name -> format (the defaults otherwise).
FP4_PRESETS = {"mixed_nvfp4": "nvfp4", "mixed_mxfp4": "mxfp4"}
# How MXFP4 rounds its E8M0 block scale: OCP's floor(log2(amax)) - 2, or
# Transformer Engine's / JAX's ceil(log2(amax / 6)); nothing in between.
SCALE_ROUNDINGS = ("floor", "ceil")
_SEED_END = 2**32


def _check_bool(value: Any, argument: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(
            f"Float4Recipe({argument}=...) must be True or False; "
            f"got {type(value).__name__}: {value!r}."
        )
    return bool(value)


def _check_seed(seed: Any) -> int:
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)):
        raise TypeError(
            f"Float4Recipe(seed=...) must be an int in [0, 2**32); "
            f"got {type(seed).__name__}: {seed!r}."
        )
    if not 0 <= int(seed) < _SEED_END:
        raise ValueError(f"Float4Recipe(seed=...) must be in [0, 2**32); got {int(seed)}.")
    return int(seed)


def _check_format(fmt: Any, scale_rounding: Any) -> None:
    fp4 = names("fp4")
    if not isinstance(fmt, str) or fmt not in fp4:
        raise ValueError(
            f"Float4Recipe(format=...) must be one of {', '.join(map(repr, fp4))}; got {fmt!r}."
        )
    if not isinstance(scale_rounding, str) or scale_rounding not in SCALE_ROUNDINGS:
        raise ValueError(
            f"Float4Recipe(scale_rounding=...) must be one of "
            f"{', '.join(map(repr, SCALE_ROUNDINGS))}; got {scale_rounding!r}."
        )
    if SCALINGS[fmt].scale_format != "float8_e8m0fnu" and scale_rounding != "floor":
        raise ValueError(
            f"Float4Recipe(scale_rounding={scale_rounding!r}) is MXFP4's alone (its power-of-two "
            f"scale); format={fmt!r} computes its E4M3 block scales from the amax. "
            "Leave scale_rounding at its default or use format='mxfp4'."
        )


def _check_gemm(gemm: Any) -> None:
    if not isinstance(gemm, str) or gemm not in GEMMS:
        raise ValueError(
            f"Float4Recipe(gemm=...) must be one of {', '.join(map(repr, GEMMS))}; got {gemm!r}."
        )


@dataclasses.dataclass(frozen=True)
class Float4Recipe:
    r"""FP4 matmuls (NVFP4 or MXFP4) for :func:`jaxamp.autocast`, with their training recipe.

    Under ``jaxamp.autocast(fun, recipe)`` every ``dot_general`` with a
    parameter or input operand (autocast's PLAIN role) runs with
    ``float4_e2m1fn`` operands and block scales, float32 accumulation and a
    ``compute_dtype`` result; its two backward products too. Everything else
    (convolutions and products of two activations included) runs as under
    ``"mixed_bfloat16"`` (``recipe.policy``). ``"mixed_nvfp4"`` and
    ``"mixed_mxfp4"`` name the defaults. docs/fp4.md gives the formulas.

    Attributes:
      format: ``"nvfp4"`` (default): an E4M3 scale per 16 values under a
        float32 per-tensor scale (Transformer Engine's NVFP4 recipe).
        ``"mxfp4"``: an E8M0 (power-of-two) scale per 32 values (OCP MX v1.0).
        The formats are entries of ``SCALINGS`` in ``jaxamp/_fp8/_scalings.py``.
      hadamard: the weight-gradient product's operands (output gradient and
        activation) pass through a random-sign Hadamard transform of one block
        (16 or 32 points) along the token dim before they are quantized.
      stochastic_rounding: the output gradient is rounded stochastically to
        E2M1 in both backward products (unbiased; see ``seed``).
      weight_blocks_2d: NVFP4's weights in 16x16 tiles, whose codes serve the
        forward and the input-gradient product; False: 1x16 along each
        product's contracting dim. MXFP4 has 1x32 blocks for every operand.
      scale_rounding: MXFP4's block scale, ``"floor"`` (default, OCP:
        ``2**(floor(log2(amax)) - 2)``) or ``"ceil"`` (``2**ceil(log2(amax / 6))``,
        Transformer Engine's and JAX's). Only ``"floor"`` under NVFP4.
      high_precision: None, or a regular expression or tuple of them, each
        matched with ``re.search`` against ``jax.tree_util.keystr`` of the path
        of each leaf of ``fun``'s first argument (e.g. ``r"\['head'\]"``): a
        matmul with an operand from a matching leaf (seen through reshapes,
        transposes, jit/checkpoint/custom_jvp bodies and scan bodies, where a
        stacked leaf keeps every layer of the stack; not through casts) runs in
        the compute dtype.
      quantize_activation_products: quantize products of two activations
        (attention's QK and PV) too; by default they run in ``compute_dtype``.
      compute_dtype: the dtype of matmul results and of everything else,
        bfloat16 or float16.
      gemm: how the products run (the same codes and scales either way).
        ``"native"``: ``jax.nn.scaled_matmul``, JAX's block-scaled GEMM (cuDNN's
        FP4 GEMM on NVIDIA Blackwell). ``"emulated"``: float4 operands in a
        float32 product per block, scaled and summed in float32, which any
        backend runs. ``"auto"`` (default): native on NVIDIA GPUs of compute
        capability 10.0 or newer, emulated elsewhere.
      seed: the stochastic rounding's seed, an int in ``[0, 2**32)``. The
        random bits are a hash of the seed, each value's position and the bits
        of the whole gradient being rounded: the same seed and inputs give the
        same bits, a new step's gradient new ones, with no state to thread.

    Raises:
      ValueError: an unknown ``format``, ``scale_rounding`` or ``gemm``;
        ``scale_rounding="ceil"`` under NVFP4; ``gemm="native"``, when a
        product is traced, on a backend for which this JAX has no lowering of
        ``jax.nn.scaled_matmul``; a seed out of
        range; a ``high_precision`` pattern that is no regular expression.
      TypeError: a non-bool switch, a non-int seed, a ``high_precision`` that
        is no str or tuple of str, a ``compute_dtype`` that is not 16-bit.

    >>> import jax.numpy as jnp, jaxamp
    >>> str(jaxamp.Float4Recipe()), str(jaxamp.Float4Recipe("mxfp4", scale_rounding="ceil"))
    ('fp4:nvfp4', 'fp4:mxfp4,ceil')
    >>> str(jaxamp.Float4Recipe(hadamard=False, stochastic_rounding=False, seed=3))
    'fp4:nvfp4,no-hadamard,no-sr,seed=3'
    >>> x, w = jnp.ones((2, 32)), jnp.ones((32, 4))
    >>> jaxamp.autocast(lambda x, w: x @ w, "mixed_nvfp4")(x, w)[0, 0]
    Array(32., dtype=float32)
    """

    format: str = "nvfp4"
    hadamard: bool = True
    stochastic_rounding: bool = True
    weight_blocks_2d: bool = True
    scale_rounding: str = "floor"
    high_precision: Any = None
    quantize_activation_products: bool = False
    compute_dtype: Any = jnp.bfloat16
    gemm: str = "auto"
    seed: int = 0

    def __post_init__(self):
        _check_format(self.format, self.scale_rounding)
        _check_gemm(self.gemm)
        set_ = object.__setattr__
        for name in ("hadamard", "stochastic_rounding", "weight_blocks_2d"):
            set_(self, name, _check_bool(getattr(self, name), name))
        set_(
            self,
            "quantize_activation_products",
            _check_bool(self.quantize_activation_products, "quantize_activation_products"),
        )
        set_(self, "seed", _check_seed(self.seed))
        set_(self, "high_precision", check_high_precision(self.high_precision, "Float4Recipe"))
        dtype = _one_of(
            self.compute_dtype,
            _COMPUTE_DTYPES,
            "Float4Recipe(compute_dtype=...) is the dtype of matmul results and of "
            "everything that is not an FP4 matmul, and must be 16-bit: jnp.bfloat16 "
            "(default) or jnp.float16",
        )
        set_(self, "compute_dtype", dtype)

    def __str__(self) -> str:
        flags = [
            "no-hadamard" if not self.hadamard else "",
            "no-sr" if not self.stochastic_rounding else "",
            "weights-1d" if not self.weight_blocks_2d and self.format == "nvfp4" else "",
            "ceil" if self.scale_rounding != "floor" else "",
            "act-products" if self.quantize_activation_products else "",
            self.compute_dtype.name if self.compute_dtype != jnp.bfloat16 else "",
            self.gemm if self.gemm != "auto" else "",
            f"seed={self.seed}" if self.seed else "",
            "high-precision" if self.high_precision else "",
        ]
        return ",".join([f"fp4:{self.format}", *filter(None, flags)])

    @property
    def policy(self) -> Policy:
        """The 16-bit policy everything except the FP4 matmuls runs under."""
        return Policy(np.dtype(np.float32), self.compute_dtype, np.dtype(np.float32))

    @property
    def block(self) -> int:
        """Values per block along a product's contracting dim (16 or 32)."""
        return block_size(self.format)
