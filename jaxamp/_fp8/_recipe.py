"""``jaxamp.Float8Recipe``: which FP8 formats and scaling groups autocast's matmuls use."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxamp._fp8._scalings import SCALINGS, names, native_scaling
from jaxamp._policy import Policy

__all__ = ["FP8_PRESET", "GEMMS", "SCALINGS", "Float8Recipe"]

# How an mxfp8 product runs: "native" is jax.nn.scaled_matmul (cuDNN's MXFP8 GEMM
# on Blackwell), "emulated" the float8 dot_general per block, "auto" picks (_native.py).
GEMMS = ("auto", "native", "emulated")

# The float8 formats with a saturating cast and an IEEE-like layout that FP8
# Tensor Cores (Hopper, Ada, Blackwell) and XLA take as matmul operands.
_FP8_DTYPES = {
    "float8_e4m3fn": jnp.float8_e4m3fn,
    "float8_e5m2": jnp.float8_e5m2,
}
_COMPUTE_DTYPES = ("bfloat16", "float16")
_REDUCE_DTYPES = ("float32", "bfloat16", "float16")

FP8_PRESET = "mixed_float8"


def _as_dtype(value: Any) -> np.dtype | None:
    """``value`` as a NumPy dtype, or None if it names none."""
    try:
        return np.dtype(jnp.dtype(value))
    except TypeError:
        return None


def _fp8_dtype(value: Any, argument: str, default: str) -> np.dtype:
    dtype = _as_dtype(value)
    if dtype is None or dtype.name not in _FP8_DTYPES:
        raise TypeError(
            f"Float8Recipe({argument}=...) must be jnp.float8_e4m3fn or jnp.float8_e5m2 "
            f"(e.g. {argument}=jnp.{default}); got {dtype.name if dtype else repr(value)}. "
            "For a 16-bit policy "
            "use autocast(fun, 'mixed_bfloat16') instead of a Float8Recipe."
        )
    return dtype


def _one_of(value: Any, allowed: Any, what: str) -> np.dtype:
    # ``what`` says what the argument is and which dtypes it takes.
    dtype = _as_dtype(value)
    if dtype is None or dtype.name not in allowed:
        raise TypeError(f"{what}; got {dtype.name if dtype else repr(value)}.")
    return dtype


def _compute_dtype(value: Any) -> np.dtype:
    return _one_of(
        value,
        _COMPUTE_DTYPES,
        "Float8Recipe(compute_dtype=...) is the dtype of matmul results and of "
        "everything that is not a matmul, and must be 16-bit: jnp.bfloat16 (default) "
        "or jnp.float16",
    )


def _reduce_dtype(value: Any) -> np.dtype:
    return _one_of(
        value,
        _REDUCE_DTYPES,
        "Float8Recipe(reduce_dtype=...) is the dtype weight gradients are reduced "
        "across devices in: jnp.float32 (default), jnp.bfloat16 or jnp.float16",
    )


def _check_gemm(gemm: Any, scaling: str) -> None:
    if not isinstance(gemm, str) or gemm not in GEMMS:
        raise ValueError(
            f"Float8Recipe(gemm=...) must be one of {', '.join(map(repr, GEMMS))}; got {gemm!r}."
        )
    if gemm == "native" and not SCALINGS[scaling].native:
        raise ValueError(
            f"Float8Recipe(gemm='native') needs scaling={native_scaling()!r} (the one scaling "
            f"with a native block-scaled GEMM in JAX); got scaling={scaling!r}. Leave gemm='auto'."
        )


def check_high_precision(patterns: Any, owner: str) -> tuple[str, ...] | None:
    """``high_precision`` as a tuple of regular expressions (None stays None); ``owner``: the
    recipe class, for the messages."""
    if patterns is None:
        return None
    items = (patterns,) if isinstance(patterns, str) else patterns
    if not isinstance(items, tuple) or not all(isinstance(p, str) for p in items):
        raise TypeError(
            f"{owner}(high_precision=...) must be None, a regular expression or a tuple "
            f"of them (str), matched against jax.tree_util.keystr of each parameter's path; "
            f"got {type(patterns).__name__}: {patterns!r}."
        )
    for pattern in items:
        try:
            re.compile(pattern)
        except re.error as error:
            raise ValueError(
                f"{owner}(high_precision=...): {pattern!r} is not a regular expression ({error})."
            ) from None
    return items


@dataclasses.dataclass(frozen=True)
class Float8Recipe:
    """FP8 matmuls with current (dynamic) scaling, for :func:`jaxamp.autocast`.

    Under ``jaxamp.autocast(fun, recipe)`` everything runs as under
    ``"mixed_bfloat16"`` (with ``compute_dtype``) except the matmuls and
    convolutions: each operand ``x`` is quantized per scaling group as
    ``q = saturating_cast(x * s)`` with ``s = fp8_max / amax(|x|)`` over the
    group (``s = 1`` where the amax is 0), the product of the ``q`` accumulates
    in float32 and is multiplied by ``1 / (s_lhs * s_rhs)`` per group, in
    ``compute_dtype``. The backward products take the incoming gradient in
    ``gradient_dtype``, scaled the same way. ``"mixed_float8"`` names the
    default recipe. See docs/fp8.md for the recipes and when each pays.

    Attributes:
      scaling: the scaling groups. ``"tensorwise"``: one scale per operand.
        ``"rowwise"``: one per row of the left operand and per column of the
        right one, along the contracting dimension (torchao's rowwise).
        ``"blockwise"``: 1x128 tiles of activations and gradients, 128x128
        tiles of weights, along the contracting dimension (DeepSeek-V3).
        ``"mxfp8"``: blocks of 32 along the contracting dimension with
        power-of-two scales (OCP MX, NVIDIA Blackwell), weights in 32x32
        tiles (each 1x32 block of either product shares its tile's scale). Convolutions are
        quantized tensorwise under every recipe. The scalings are the table
        ``SCALINGS`` in ``jaxamp/_fp8/_scalings.py``.
      forward_dtype: the format of activations and weights.
      gradient_dtype: the format of the incoming gradients of the backward
        matmuls (e5m2's range by default, as Transformer Engine's HYBRID).
      power_of_two_scale: round each scale down to a power of two (always on
        for ``"mxfp8"``): scaling is then exact.
      compute_dtype: the dtype of matmul results and of everything else,
        bfloat16 or float16.
      gemm: how ``"mxfp8"`` products run (the same quantized operands and
        scales either way). ``"native"``: ``jax.nn.scaled_matmul``, JAX's
        block-scaled GEMM (cuDNN's MXFP8 kernel on NVIDIA Blackwell).
        ``"emulated"``: a float8 ``dot_general`` per block of 32, scaled and
        summed in float32, which any backend runs. ``"auto"`` (default):
        native on NVIDIA GPUs of compute capability 10.0 or newer, emulated
        elsewhere. The other scalings have no native form and run as
        ``"emulated"``.
      reduce_dtype: the dtype of the weight-gradient products' results, which
        the SPMD partitioner reduces across devices (all-reduce or
        reduce-scatter) when the weights are sharded: ``jnp.float32``
        (default, as FSDP2's and Megatron's usual choice) or a 16-bit dtype
        (half the bytes; the gradient is rounded before the sum).
        ``recipe.policy.reduce_dtype``.
      high_precision: None, or a regular expression or tuple of them, each
        matched with ``re.search`` against ``jax.tree_util.keystr`` of the path
        of each leaf of ``fun``'s first argument: a matmul with an operand from
        a matching leaf runs in the compute dtype (as :class:`jaxamp.Float4Recipe`'s).

    Raises:
      ValueError: an unknown ``scaling`` or ``gemm``; ``gemm="native"`` with
        a scaling other than ``"mxfp8"``, or, when a product is traced, on a
        backend for which this JAX has no lowering of ``jax.nn.scaled_matmul``.
      TypeError: a non-float8 ``forward_dtype``/``gradient_dtype``, a
        ``compute_dtype`` that is not 16-bit, a ``reduce_dtype`` that is not
        float32/bfloat16/float16, a non-bool ``power_of_two_scale``, a
        ``high_precision`` that is no str or tuple of str (ValueError: no
        regular expression).

    >>> import jax.numpy as jnp, jaxamp
    >>> recipe = jaxamp.Float8Recipe(scaling="rowwise")
    >>> str(recipe), recipe.forward_dtype, recipe.gradient_dtype
    ('fp8:rowwise', dtype(float8_e4m3fn), dtype(float8_e5m2))
    >>> recipe == jaxamp.Float8Recipe("rowwise", jnp.float8_e4m3fn)
    True
    >>> x, w = jnp.ones((2, 32)), jnp.ones((32, 4))
    >>> jaxamp.autocast(lambda x, w: x @ w, "mixed_float8")(x, w).dtype
    dtype('float32')
    """

    scaling: str = "tensorwise"
    forward_dtype: Any = jnp.float8_e4m3fn
    gradient_dtype: Any = jnp.float8_e5m2
    power_of_two_scale: bool = False
    compute_dtype: Any = jnp.bfloat16
    gemm: str = "auto"
    reduce_dtype: Any = jnp.float32
    high_precision: Any = None

    def __post_init__(self):
        fp8 = names("fp8")  # the FP4 formats are Float4Recipe's
        if not isinstance(self.scaling, str) or self.scaling not in fp8:
            fp4 = " (FP4: jaxamp.Float4Recipe(format=...))" if self.scaling in SCALINGS else ""
            raise ValueError(
                f"Float8Recipe(scaling=...) must be one of {', '.join(map(repr, fp8))}; "
                f"got {self.scaling!r}{fp4}."
            )
        _check_gemm(self.gemm, self.scaling)
        if not isinstance(self.power_of_two_scale, (bool, np.bool_)):
            raise TypeError(
                "Float8Recipe(power_of_two_scale=...) must be True or False; "
                f"got {type(self.power_of_two_scale).__name__}: {self.power_of_two_scale!r}."
            )
        set_ = object.__setattr__
        set_(
            self, "forward_dtype", _fp8_dtype(self.forward_dtype, "forward_dtype", "float8_e4m3fn")
        )
        set_(
            self, "gradient_dtype", _fp8_dtype(self.gradient_dtype, "gradient_dtype", "float8_e5m2")
        )
        set_(self, "power_of_two_scale", bool(self.power_of_two_scale))
        set_(self, "compute_dtype", _compute_dtype(self.compute_dtype))
        set_(self, "reduce_dtype", _reduce_dtype(self.reduce_dtype))
        set_(self, "high_precision", check_high_precision(self.high_precision, "Float8Recipe"))

    def __repr__(self) -> str:
        return (
            f"Float8Recipe(scaling={self.scaling!r}, forward_dtype={self.forward_dtype.name}, "
            f"gradient_dtype={self.gradient_dtype.name}, "
            f"power_of_two_scale={self.power_of_two_scale}, "
            f"compute_dtype={self.compute_dtype.name}, gemm={self.gemm!r}, "
            f"reduce_dtype={self.reduce_dtype.name}, high_precision={self.high_precision!r})"
        )

    def __str__(self) -> str:
        pow2 = (
            ",pow2" if self.power_of_two_scale and not SCALINGS[self.scaling].exact_scales else ""
        )
        gemm = f",{self.gemm}" if self.gemm != "auto" else ""
        reduce = f",reduce={self.reduce_dtype.name}" if self.reduce_dtype != np.float32 else ""
        high = ",high-precision" if self.high_precision else ""
        return f"fp8:{self.scaling}{pow2}{gemm}{reduce}{high}"

    @property
    def policy(self) -> Policy:
        """The 16-bit policy everything except the matmuls runs under."""
        return Policy(np.float32, self.compute_dtype, np.float32, reduce_dtype=self.reduce_dtype)

    @property
    def exact_scales(self) -> bool:
        """Whether scales are powers of two (``power_of_two_scale``, or a scaling such as
        ``"mxfp8"`` whose scales always are)."""
        return self.power_of_two_scale or SCALINGS[self.scaling].exact_scales
