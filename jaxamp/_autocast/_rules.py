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
  Except where 16 bits would break a float32 value (a power or product feeding
  a sum, a division by a traced float32 value, a constant that underflows):
  then the equation runs in float32 (``_wide.py``).
- ``"keep"``: run exactly as traced; floating operands are cast back to their
  traced dtypes. Safe for anything (bit casts, callbacks, primitives whose
  params hold typed jaxprs).
- ``"recurse"``: a primitive autocast rebuilds with JAX's public API around
  its rewritten inner jaxprs or for its new operand dtypes (jit, custom_jvp,
  scan, while, cond, checkpoint, shard_map, the scatter family). Only the
  built-in handlers.

Integer, bool and complex values are never cast by any rule.

>>> import jaxamp
>>> jaxamp.AUTOCAST_RULES["dot_general"], jaxamp.AUTOCAST_RULES["exp"]
('compute', 'float32')
"""

from __future__ import annotations

import types

from jaxamp._autocast._control_flow import HIGHER_ORDER_RULES
from jaxamp._autocast._custom import LINALG_PRIMITIVES
from jaxamp._engine._contractions import MATMUL_PRIMITIVES

__all__ = ["AUTOCAST_RULES", "LINALG_PRIMITIVES", "MATMUL_PRIMITIVES", "RULE_KINDS"]

RULE_KINDS = ("compute", "float32", "follow", "keep", "recurse")


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
    # Special functions. erf and erfc approach a constant (erf -> +-1, erfc -> 0 or 2)
    # where callers form 1 + erf(z) or log(erfc(z)): in 16 bits the information is
    # gone (bfloat16's 1 + erf(-3.2) is 0). The criterion is in docs/api/autocast.md.
    "erf",
    "erfc",
    "erf_inv",
    "lgamma",
    "digamma",
    "polygamma",
    "zeta",
    "igamma",
    "igammac",
    "igamma_grad_a",
    "random_gamma",
    "bessel_i0e",
    "bessel_i1e",
    "regularized_incomplete_beta",
    # jax 0.12's polyval (jax 0.10's is a scan whose accumulator stays float32):
    # Horner's accumulation, and coefficients of rational approximations up to
    # 1.6e6 (expi's) that float16 cannot hold.
    "polynomial",
    # Linear algebra and FFT have no 16-bit kernels on most backends.
    *(p for p in LINALG_PRIMITIVES if p != "custom_linear_solve"),
    "fft",
    "complex",
    "conj",  # complex-valued: no 16-bit kernel (conj rejects float16)
)

_KEEP = (
    "bitcast_convert_type",  # reinterprets bits: the traced dtype is the meaning
    "reduce_precision",  # rounds to a stated format: the traced dtype is the meaning
    "reduce",  # variadic reduce: its computation jaxpr is typed
    "reduce_window",
    "select_and_scatter",
    "select_and_scatter_add",
    "select_and_gather_add",
    "custom_linear_solve",  # linear algebra: its matvec/solve jaxprs run as traced
    "custom_vjp_call",  # its fwd/bwd rules run at the dtypes they were written for
    # jax 0.12's frexp, ldexp, searchsorted, nonzero(size=), custom_root: typed
    # objects with their own AD rules (custom_root's implicit differentiation).
    "call_hi_primitive",
    "rng_bit_generator",  # the key's bits are its meaning
    "pure_callback",  # host code expects the traced dtypes
    "io_callback",
)

# Every primitive with a built-in higher-order rule, and only those: the handlers
# (keyed by _compat's name groups, e.g. jax 0.12's "eval_jaxpr" next to "call" and
# "closed_call") are the one list, so the table cannot name one without the other.
_RECURSE = tuple(HIGHER_ORDER_RULES)

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
    "rev",
    "sort",
    "top_k",
    "stop_gradient",
    "convert_element_type",
)

AUTOCAST_RULES: types.MappingProxyType[str, str] = types.MappingProxyType(
    {
        **dict.fromkeys(_FOLLOW_LISTED, "follow"),
        **dict.fromkeys(MATMUL_PRIMITIVES, "compute"),
        **dict.fromkeys(_FLOAT32, "float32"),
        **dict.fromkeys(_KEEP, "keep"),
        **dict.fromkeys(_RECURSE, "recurse"),
    }
)
"""Primitive name -> rule kind. First-order primitives not listed follow
(``"follow"``); unlisted higher-order primitives run as traced (``"keep"``),
with a warning that names them."""
