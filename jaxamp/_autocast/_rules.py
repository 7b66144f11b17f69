"""The public table of what :func:`jaxamp.autocast` does with each primitive.

A rule is one of these kinds (or a callable, see :func:`jaxamp.autocast`):

- ``"compute"``: matmul-like. Floating operands are cast to the policy's compute
  dtype, the primitive accumulates in float32 (``preferred_element_type``) and
  its result is cast to the compute dtype. torch.autocast's lower-precision list.
- ``"float32"``: precision-sensitive. Floating operands are cast to float32 and
  the result stays float32. torch.autocast's float32 list: exp/log family, pow,
  rsqrt, reductions (sum, prod, cumsum, ...), special functions, linear algebra.
- ``"follow"``: everything else (elementwise arithmetic, reshapes, max, ...).
  Operands that were traced with one dtype are brought to one dtype again:
  float32 if any of them is a float32-rule result (softmax, norm statistics and
  losses stay float32 once there), else the compute dtype if any is an
  activation, else they run as traced. Parameters and constants therefore
  follow the activation they meet: ``x_bf16 + bias_f32`` runs in bfloat16.
- ``"keep"``: run exactly as traced; floating operands are cast back to their
  traced dtypes. Safe for anything (bit casts, callbacks, primitives whose
  params hold typed jaxprs).
- ``"recurse"``: higher-order primitive whose inner jaxprs autocast rewrites
  (jit, custom_jvp, scan, while, cond, checkpoint). Only the built-in handlers.

Integer, bool and complex values are never cast by any rule.

>>> import jaxamp
>>> jaxamp.AUTOCAST_RULES["dot_general"], jaxamp.AUTOCAST_RULES["exp"]
('compute', 'float32')
"""

from __future__ import annotations

import types

__all__ = ["AUTOCAST_RULES", "RULE_KINDS"]

RULE_KINDS = ("compute", "float32", "follow", "keep", "recurse")

_COMPUTE = ("dot_general", "conv_general_dilated")

_FLOAT32 = (
    # exp/log family and powers (torch: exp, expm1, log, log1p, log2, log10, pow, rsqrt).
    "exp",
    "exp2",
    "expm1",
    "log",
    "log1p",
    "pow",
    "rsqrt",
    # Functions that overflow or lose accuracy in 16 bits (torch: tan, sinh, cosh, acos, asin).
    "tan",
    "sinh",
    "cosh",
    "asin",
    "acos",
    "atanh",
    "acosh",
    "asinh",
    # Reductions and scans: sums, means, variances, norms, softmax denominators.
    "reduce_sum",
    "reduce_prod",
    "reduce_window_sum",
    "cumsum",
    "cumprod",
    "cumlogsumexp",
    # Special functions.
    "erf_inv",
    "lgamma",
    "digamma",
    "polygamma",
    "zeta",
    "igamma",
    "igammac",
    "igamma_grad_a",
    "random_gamma_grad",
    "bessel_i0e",
    "bessel_i1e",
    "regularized_incomplete_beta",
    # Linear algebra and FFT have no 16-bit kernels on most backends.
    "cholesky",
    "eig",
    "eigh",
    "lu",
    "qr",
    "svd",
    "schur",
    "hessenberg",
    "householder_product",
    "triangular_solve",
    "tridiagonal",
    "tridiagonal_solve",
    "fft",
    "complex",
)

_KEEP = (
    "bitcast_convert_type",  # reinterprets bits: the traced dtype is the meaning
    "reduce",  # variadic reduce: its computation jaxpr is typed
    "reduce_window",
    "select_and_scatter",
    "select_and_scatter_add",
    "scatter",
    "scatter_add",
    "scatter_sub",
    "scatter_mul",
    "scatter_min",
    "scatter_max",
    "linear_solve",
    "custom_vjp_call",  # its fwd/bwd rules run at the dtypes they were written for
    "custom_vjp_call_jaxpr",
    "pure_callback",
    "io_callback",
)

_RECURSE = (
    "jit",
    "pjit",
    "closed_call",
    "core_call",
    "custom_jvp_call",
    "scan",
    "while",
    "cond",
    "remat2",
    "checkpoint",
)

_FOLLOW_LISTED = (
    "add",
    "sub",
    "mul",
    "div",
    "max",
    "min",
    "neg",
    "abs",
    "sign",
    "square",
    "sqrt",
    "integer_pow",
    "tanh",
    "logistic",
    "erf",
    "erfc",
    "sin",
    "cos",
    "select_n",
    "clamp",
    "reduce_max",
    "reduce_min",
    "argmax",
    "argmin",
    "broadcast_in_dim",
    "reshape",
    "transpose",
    "concatenate",
    "pad",
    "slice",
    "dynamic_slice",
    "dynamic_update_slice",
    "gather",
    "squeeze",
    "expand_dims",
    "rev",
    "stop_gradient",
    "convert_element_type",
)

AUTOCAST_RULES: types.MappingProxyType[str, str] = types.MappingProxyType(
    {
        **dict.fromkeys(_FOLLOW_LISTED, "follow"),
        **dict.fromkeys(_COMPUTE, "compute"),
        **dict.fromkeys(_FLOAT32, "float32"),
        **dict.fromkeys(_KEEP, "keep"),
        **dict.fromkeys(_RECURSE, "recurse"),
    }
)
"""Primitive name -> rule kind. Primitives not listed follow (``"follow"``);
unlisted higher-order primitives raise an error that says how to add a rule."""
