"""What :func:`jaxamp.precision_plan` returns: :class:`PlanRow` per low-bit product and
kind, :class:`PrecisionPlan` for the step, its ranking of parameter paths and
:meth:`PrecisionPlan.keep`, the recipe with ``high_precision`` naming the paths
to keep.

The plan is made in ``_api.py``.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import re
from typing import Any

from jaxamp._checks import is_int
from jaxamp._reporting import text_table

__all__ = ["PlanRow", "PrecisionPlan", "path_pattern"]


@dataclasses.dataclass(frozen=True)
class PlanRow:
    """One low-bit product of the step, in one direction.

    Attributes:
      path: the parameter path of its weight, ``jax.tree_util.keystr`` of the
        leaf of ``params`` as ``high_precision=`` matches it (``"['w']"``);
        None for a product no parameter names (two activations, or a weight
        seen through something ``high_precision`` cannot follow).
      source: ``"file.py:LINE"``, the user's line of the product.
      kind: ``"fprop"`` (the forward product), ``"dgrad"`` (the gradient of
        its activation operand) or ``"wgrad"`` (of its weight).
      flops: FLOPs of this product over the step (times the iterations of an
        enclosing scan): ``2 M N K``, the same for the three kinds.
      share: ``flops`` over the step's low-bit matmul FLOPs (every row's).
      error: the norm-wise relative error ``||low - ref|| / ||ref||`` of the
        low-bit product against the same product in the compute dtype, on the
        same operands (backward: the same cotangent), over every execution.
      sensitivity: of the path: the share of the step's deviation from the
        compute-dtype step that goes away when this path alone runs in the
        compute dtype (1: all of it; about 0: none; negative: the probe's
        deviation grew). None for a row with no path.
    """

    path: str | None
    source: str
    kind: str
    flops: int
    share: float
    error: float
    sensitivity: float | None


def path_pattern(path: str) -> str:
    """The ``high_precision`` regular expression that matches ``path`` and nothing else.

    Escaped and anchored at both ends, so ``['w']`` does not also keep ``['w']['b']``.

    >>> from jaxamp._plan._types import path_pattern
    >>> pattern = path_pattern("['blocks'][1]['w']")
    >>> pattern
    "^\\\\['blocks'\\\\]\\\\[1\\\\]\\\\['w'\\\\]$"
    >>> [bool(re.search(pattern, p)) for p in ("['blocks'][1]['w']", "['blocks'][11]['w']")]
    [True, False]
    """
    return "^" + re.escape(path) + "$"


@dataclasses.dataclass(frozen=True)
class PrecisionPlan:
    """Which products of a step lose most at low bits, and what keeping each path buys.

    Attributes:
      recipe: the recipe measured, with ``high_precision=None`` (every product
        it runs at low bits is measured; :meth:`keep` sets ``high_precision``).
      rows: one :class:`PlanRow` per low-bit product and kind, most sensitive
        path first (FLOPs break ties), the rows with no path last.
      paths: the parameter paths with low-bit products, in that order.
      deviation: the norm-wise relative deviation of the low-bit step from the
        compute-dtype step: of the gradient (``grad=True``) or of ``fun``'s
        floating outputs (``grad=False``).
      target: ``"gradient"`` or ``"output"``, what ``deviation`` measures.
    """

    recipe: Any
    rows: tuple[PlanRow, ...]
    paths: tuple[str, ...]
    deviation: float
    target: str

    def path_flops(self, path: str) -> int:
        """FLOPs of the step's low-bit products of ``path`` (every kind)."""
        return sum(r.flops for r in self.rows if r.path == path)

    @property
    def total_flops(self) -> int:
        """FLOPs of the step's low-bit products (every row): what ``keep(fraction=)`` divides."""
        return sum(r.flops for r in self.rows)

    def keep(self, *, count: int | None = None, fraction: float | None = None) -> Any:
        """The recipe with ``high_precision`` naming the paths to keep in the compute dtype.

        Args:
          count: keep the ``count`` most sensitive paths (all of them if fewer).
          fraction: a budget, the share of the step's low-bit matmul FLOPs
            (:attr:`total_flops`: forward and, with ``grad=True``, backward) to
            keep: down the ranking, each path that still fits in it is kept
            and one that does not is skipped (a greedy knapsack: the kept
            share is at most ``fraction``).

        Returns:
          ``dataclasses.replace(recipe, high_precision=...)``: one anchored,
          escaped pattern per kept path (:func:`path_pattern`), or None if none.

        Raises:
          TypeError: neither or both of ``count`` and ``fraction``; a ``count``
            that is no int or a ``fraction`` that is no real number.
          ValueError: a negative ``count``, a ``fraction`` outside ``[0, 1]``.
        """
        kept = self._chosen(count, fraction)
        patterns = tuple(path_pattern(p) for p in kept) or None
        return dataclasses.replace(self.recipe, high_precision=patterns)

    def _chosen(self, count: Any, fraction: Any) -> list[str]:
        if (count is None) == (fraction is None):
            raise TypeError("keep() takes exactly one of count= and fraction=.")
        if count is not None:
            if not is_int(count):
                raise TypeError(f"keep(count=...) must be an int; got {count!r}.")
            if count < 0:
                raise ValueError(f"keep(count=...) must be >= 0; got {count}.")
            return list(self.paths[:count])
        if not isinstance(fraction, numbers.Real) or isinstance(fraction, bool):
            raise TypeError(f"keep(fraction=...) must be a real number; got {fraction!r}.")
        if not 0.0 <= float(fraction) <= 1.0:
            raise ValueError(f"keep(fraction=...) must be in [0, 1]; got {fraction!r}.")
        budget, kept, spent = float(fraction) * self.total_flops, [], 0
        for path in self.paths:
            flops = self.path_flops(path)
            if spent + flops <= budget * (1 + 1e-9):
                kept.append(path)
                spent += flops
        return kept

    def __str__(self) -> str:
        header = ("path", "kind", "source", "FLOPs %", "error", "sensitivity")
        rows = [header, *(_cells(r) for r in self.rows)]
        title = (
            f"precision_plan of {self.recipe}: {len(self.paths)} paths, "
            f"{self.target} deviation {self.deviation:.3g} from the compute-dtype step"
        )
        return "\n".join([title, *text_table(rows)])


def _cells(row: PlanRow) -> tuple[str, ...]:
    sensitivity = "-" if row.sensitivity is None else f"{row.sensitivity:+.3f}"
    error = "nan" if math.isnan(row.error) else f"{row.error:.3g}"
    return (
        "-" if row.path is None else row.path,
        row.kind,
        row.source.rsplit("/", 1)[-1],
        f"{100 * row.share:.1f}",
        error,
        sensitivity,
    )
