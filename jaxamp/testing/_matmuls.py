"""The testing helpers over :func:`jaxamp.precision_report` (public in ``jaxamp.testing``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from jaxamp._matmuls import precision_report
from jaxamp._precision_report import MatmulInfo, PrecisionReport

__all__ = ["assert_matmuls_aligned", "assert_matmuls_in"]


def _describe(m: MatmulInfo) -> str:
    return (
        f"{m.primitive} {m.lhs_shape} x {m.rhs_shape} operands "
        f"{'/'.join(m.operand_dtypes)} accumulating in {m.accumulation_dtype}"
    )


def assert_matmuls_in(
    fun: Callable,
    args: tuple | list,
    dtype: Any,
    *,
    kwargs: dict | None = None,
    accumulation: Any = None,
    min_fraction: float = 1.0,
) -> PrecisionReport:
    """Asserts that matmuls/convs of ``fun(*args)`` run with ``dtype`` operands.

    Args:
      fun: the function to trace (nothing runs).
      args: its positional arguments (arrays or ``jax.ShapeDtypeStruct``).
      dtype: the operand dtype every matmul must use.
      kwargs: its keyword arguments.
      accumulation: if given, the accumulation dtype every matmul must use.
      min_fraction: the fraction of matmul FLOPs that must be in ``dtype``
        (1.0: all of them; then ``accumulation`` is checked on every matmul).

    Returns:
      The report, for further checks.

    Raises:
      AssertionError: listing the offending matmuls.

    >>> import jax.numpy as jnp, jaxamp
    >>> from jaxamp.testing import assert_matmuls_in
    >>> f = jaxamp.autocast(lambda w, x: x @ w)
    >>> _ = assert_matmuls_in(f, (jnp.ones((4, 4)), jnp.ones((2, 4))), jnp.bfloat16,
    ...                       accumulation=jnp.float32)
    """
    name = np.dtype(dtype).name
    report = precision_report(fun, *args, **(kwargs or {}))
    wrong = [m for m in report.matmuls if m.compute_dtype != name]
    if accumulation is not None:
        acc = np.dtype(accumulation).name
        wrong += [m for m in report.matmuls if m.accumulation_dtype != acc and m not in wrong]
    fraction = report.fraction_in(name)
    if fraction < min_fraction or (min_fraction >= 1.0 and wrong):
        listing = "\n  ".join(_describe(m) for m in wrong) or "(none)"
        raise AssertionError(
            f"{100 * fraction:.1f}% of matmul FLOPs have {name} operands "
            f"(required: {100 * min_fraction:.1f}%"
            + (f", accumulating in {np.dtype(accumulation).name}" if accumulation else "")
            + f"). Offending ops:\n  {listing}\n{report}"
        )
    return report


def assert_matmuls_aligned(
    fun: Callable, args: tuple | list, *, kwargs: dict | None = None
) -> PrecisionReport:
    """Asserts every matmul/conv dim of ``fun(*args)`` is a Tensor Core multiple.

    >>> import jax.numpy as jnp, jaxamp
    >>> from jaxamp.testing import assert_matmuls_aligned
    >>> f = jaxamp.autocast(lambda w, x: x @ w, pad_to=8)
    >>> _ = assert_matmuls_aligned(f, (jnp.ones((5, 3)), jnp.ones((2, 5))))
    """
    report = precision_report(fun, *args, **(kwargs or {}))
    if report.misaligned:
        listing = "\n  ".join(
            f"{_describe(m)}: {m.dims} not all multiples of {m.multiple}" for m in report.misaligned
        )
        raise AssertionError(f"misaligned matmuls:\n  {listing}")
    return report
