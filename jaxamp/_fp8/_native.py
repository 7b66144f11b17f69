"""The native form of an mxfp8 product: ``jax.nn.scaled_matmul`` on autocast's own quantization.

``jax.nn.scaled_matmul(a, b, a_scales, b_scales)`` is JAX's block-scaled GEMM:
float8 operands ``[B, M, K]``/``[B, N, K]`` and one float8_e8m0fnu scale per 32
values along K. On CUDA it lowers to XLA's ``__op$block_scaled_dot`` custom
call, which XLA runs as cuDNN's MXFP8 GEMM where cuDNN has one (Blackwell) and
otherwise expands into a dequantize and an ordinary dot; on ROCm it lowers to
the ``xla.scaled_dot`` composite; on CPU from jax 0.12 to a dequantize and a
float32 dot (jax 0.10 has no CPU lowering).

The operands and scales are those of the emulated form (``quantize`` in
``_quantize.py``: the same float8 values, the same power-of-two scales, so the
two forms differ only in the order the float32 sums are taken), not those of
``jax.nn.scaled_dot_general``, whose quantizer computes the same scales for
nonzero blocks but needs every dim of every product (forward and backward) to
be a multiple of 32 and turns an all-zero block into NaN on XLA:CPU (its E8M0
zero scale is the float32 subnormal 2**-127, flushed to 0 before it divides the
block). One quantizer for both forms keeps the padding rules, the NaN contract
and ``numerics_report``'s sites the same.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxamp._casting import F32
from jaxamp._engine import _compat as compat
from jaxamp._fp8._recipe import Float8Recipe
from jaxamp._fp8._scalings import MX_BLOCK, SCALINGS

__all__ = ["NATIVE_MIN_CAPABILITY", "native_lowers", "native_product", "platform", "uses_native"]

# cuDNN's MXFP8 GEMM needs the block-scaled Tensor Cores of Blackwell (sm_100).
NATIVE_MIN_CAPABILITY = 10.0


def platform() -> tuple[str, float]:
    """``(default backend, compute capability of its first device; 0.0 if none)``."""
    capability = getattr(jax.devices()[0], "compute_capability", None)
    try:
        major = float(capability) if capability else 0.0
    except (TypeError, ValueError):  # not a CUDA "major.minor"
        major = 0.0
    return jax.default_backend(), major


@functools.cache
def native_lowers(backend: str) -> bool:
    """Whether this JAX lowers ``jax.nn.scaled_matmul`` for ``backend`` (a tiny probe, cached)."""
    operand = jax.ShapeDtypeStruct((1, 1, MX_BLOCK), jnp.float8_e4m3fn)
    scale = jax.ShapeDtypeStruct((1, 1, 1), jnp.float8_e8m0fnu)
    try:
        jax.jit(jax.nn.scaled_matmul).lower(operand, operand, scale, scale)
    except NotImplementedError:  # "MLIR translation rule ... not found for platform"
        return False
    return True


def uses_native(recipe: Float8Recipe) -> bool:
    """Whether ``recipe``'s products run as ``jax.nn.scaled_matmul`` (decided when traced)."""
    if not SCALINGS[recipe.scaling].native or recipe.gemm == "emulated":
        return False
    backend, capability = platform()
    if recipe.gemm == "auto":
        return backend == "gpu" and capability >= NATIVE_MIN_CAPABILITY
    if not native_lowers(backend):
        raise ValueError(
            f"Float8Recipe(gemm='native'): jax {jax.__version__} has no lowering of "
            f"jax.nn.scaled_matmul for the {backend} backend (GPUs have one; CPUs from "
            "jax 0.12). Use gemm='auto' (native where it runs) or gemm='emulated'."
        )
    return True


def _whole_blocks(q: jax.Array) -> jax.Array:
    """``[B, P, KB, kb]`` -> ``[B, P, KB * 32]``: a K shorter than a block is zero-padded."""
    extra = MX_BLOCK - q.shape[3]
    if extra:
        q = jnp.pad(q, [(0, 0)] * 3 + [(0, extra)])
    return q.reshape(*q.shape[:2], -1)


def native_product(
    a: tuple[jax.Array, jax.Array], b: tuple[jax.Array, jax.Array], out_dtype: np.dtype
) -> jax.Array:
    """``[B, P, C] x [B, Q, C] -> [B, P, Q]`` from two MX-quantized operands, in one GEMM.

    The inverse scales are exact powers of two in ``[2**-126, 2**126]`` (or NaN),
    so the cast to float8_e8m0fnu is exact; the GEMM accumulates in float32.
    """
    (qa, inv_a), (qb, inv_b) = a, b
    e8m0 = jnp.float8_e8m0fnu
    out = jax.nn.scaled_matmul(
        _whole_blocks(qa),
        _whole_blocks(qb),
        inv_a.astype(e8m0),
        inv_b.astype(e8m0),
        preferred_element_type=F32,
    )
    return compat.vary_like(out, qa, qb).astype(out_dtype)
