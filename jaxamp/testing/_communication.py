"""The testing helpers over :func:`jaxamp.communication_report` (public in ``jaxamp.testing``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxamp._wire._collectives import communication_report
from jaxamp._wire._communication_report import Collective, CommunicationReport, as_dtype

__all__ = ["assert_gathers_in", "assert_reduces_in"]


def assert_gathers_in(
    target: Any, dtype: Any, args: tuple | list = (), kwargs: dict | None = None
) -> CommunicationReport:
    """Asserts that every all-gather of a floating parameter carries ``dtype``.

    A parameter all-gather is one whose data is an argument of the program
    (:attr:`Collective.parameter` is set): casts, layout changes and the
    elementwise steps of a quantization between the two are allowed. With
    FSDP-style sharding that is each weight's gather before its use. Two kinds
    are not judged, and a failure's message lists them under ``not judged``:
    gathers of integer or boolean arguments (token ids, masks: the partitioner
    may gather them too; no policy sets their dtype) and the
    :attr:`CommunicationReport.small_gathers` (vectors such as a norm's scale,
    which autocast keeps in float32 when it multiplies float32 statistics).
    Read ``report.collectives`` to check those. The assertion fails too when
    nothing is left to judge (it could not fail otherwise).

    Args:
      target: a :class:`CommunicationReport`, or a function to report on.
      dtype: the dtype every floating parameter all-gather must carry (e.g.
        ``policy.gather_dtype``).
      args: the function's positional arguments (with a report: empty).
      kwargs: its keyword arguments.

    Returns:
      The report, for further checks.

    Raises:
      AssertionError: listing the parameter all-gathers in another dtype, then
        those not judged.

    >>> import jaxamp
    >>> from jaxamp.testing import assert_gathers_in
    >>> empty = jaxamp.CommunicationReport((), 0, 1, "")
    >>> assert_gathers_in(empty, "bfloat16")
    Traceback (most recent call last):
    AssertionError: no floating parameter all-gather in the program (1 devices); nothing to check.
    """
    report = _report_of(target, args, kwargs)
    wanted = as_dtype(dtype, "dtype")
    small = {id(c) for c in report.small_gathers}
    gathers, skipped = [], []
    for c in report.collectives:
        if c.kind != "all-gather" or not c.parameter:
            continue
        # The argument's own dtype where known: a float weight quantized to an
        # integer for the wire is still judged.
        if not jnp.issubdtype(c.parameter_dtype or c.dtype, jnp.floating):
            skipped.append((c, "not floating"))
        elif id(c) in small:
            skipped.append((c, "small"))
        else:
            gathers.append(c)
    _check_all_in(report, gathers, wanted, "floating parameter all-gather", skipped)
    return report


def assert_reduces_in(
    target: Any, dtype: Any, args: tuple | list = (), kwargs: dict | None = None
) -> CommunicationReport:
    """Asserts that every floating all-reduce/reduce-scatter of the backward pass carries ``dtype``.

    Those are the gradient reductions: of weight gradients under FSDP/data
    parallelism (``policy.reduce_dtype``), and under tensor parallelism also
    the reductions of activation gradients (Megatron reduces those in the
    compute dtype: assert on the report's collectives there). Scalar
    reductions (a loss average, a finite check) are not checked. Fails too when
    there is none.

    Args:
      target: a :class:`CommunicationReport`, or a function to report on.
      dtype: the dtype every gradient reduction must carry.
      args: the function's positional arguments (with a report: empty).
      kwargs: its keyword arguments.

    Returns:
      The report, for further checks.

    Raises:
      AssertionError: listing the gradient reductions in another dtype.
    """
    report = _report_of(target, args, kwargs)
    wanted = as_dtype(dtype, "dtype")
    reductions = [
        c
        for c in report.collectives
        if c.kind in ("all-reduce", "reduce-scatter")
        and c.backward
        and c.shape
        and jnp.issubdtype(c.dtype, jnp.floating)
    ]
    _check_all_in(
        report, reductions, wanted, "gradient reduction (backward all-reduce/reduce-scatter)"
    )
    return report


def _report_of(target: Any, args: Any, kwargs: Any) -> CommunicationReport:
    if isinstance(target, CommunicationReport):
        if args or kwargs:
            raise TypeError("args and kwargs must be empty when target is a CommunicationReport.")
        return target
    if not callable(target):
        raise TypeError(
            "target must be a CommunicationReport or a callable; "
            f"got {type(target).__name__}: {target!r}."
        )
    return communication_report(target, *args, **(kwargs or {}))


def _check_all_in(
    report: CommunicationReport,
    found: list[Collective],
    wanted: np.dtype,
    what: str,
    skipped: Sequence[tuple[Collective, str]] = (),
) -> None:
    not_judged = "".join(f"\n  {_line(c)} ({why})" for c, why in skipped)
    not_judged = f"\nnot judged ({len(skipped)}):{not_judged}" if skipped else ""
    if not found:
        raise AssertionError(
            f"no {what} in the program ({report.num_devices} devices); nothing to check."
            + not_judged
        )
    wrong = [c for c in found if c.dtype != wanted]
    if wrong:
        listing = "\n  ".join(_line(c) for c in wrong)
        raise AssertionError(
            f"{len(wrong)} of {len(found)} ({what}) not in {wanted.name}:\n  {listing}" + not_judged
        )


def _line(c: Collective) -> str:
    return f"{c.kind} {c.dtype.name}[{','.join(map(str, c.shape))}] from {c.source}"
