"""The FP8 scalings: one table, ``SCALINGS``, from which everything that names one derives.

A scaling says which values of an operand share a scale, per operand kind
(``"act"``, ``"weight"``, ``"grad"``), whether its scales are always powers of
two, and whether JAX has a native GEMM for it. ``Float8Recipe`` validates
against the table, ``_quantize.groups_for`` reads the groups, ``_native``
the native form, and ``precision_report`` reads a product's scaling back from
its name scope (``scope_name`` / ``scaling_of_scope``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import NamedTuple

__all__ = [
    "KINDS",
    "MX_BLOCK",
    "SCALINGS",
    "SCOPE_PREFIX",
    "Groups",
    "Scaling",
    "native_scaling",
    "scaling_named",
    "scaling_of_scope",
    "scope_name",
]

KINDS = ("act", "weight", "grad")
BLOCK = 128  # blockwise: 1x128 activation/gradient tiles, 128x128 weight tiles
MX_BLOCK = 32  # mxfp8: 32 values along the contracting dim share an E8M0 scale
SCOPE_PREFIX = "fp8_"
POW2_SUFFIX = "_pow2"


class Groups(NamedTuple):
    """Which values share a scale: ``rows`` (None: all) x ``block`` along C (None: all).

    ``whole_batch``: one group spans the batch dims too (one scale per operand).
    """

    whole_batch: bool
    rows: int | None
    block: int | None


@dataclasses.dataclass(frozen=True)
class Scaling:
    """One scaling mode of :class:`jaxamp.Float8Recipe`.

    Attributes:
      groups: operand kind (``"act"``, ``"weight"``, ``"grad"``) -> its groups,
        in the canonical layout ``[B, P, C]`` (``_quantize.py``).
      exact_scales: scales are always powers of two (``power_of_two_scale``
        is then implied).
      native: JAX has a native GEMM for it, ``jax.nn.scaled_matmul``, which
        ``Float8Recipe(gemm=...)`` chooses; it takes blocks of ``MX_BLOCK``
        along C with power-of-two (E8M0) scales.
    """

    groups: Mapping[str, Groups]
    exact_scales: bool = False
    native: bool = False

    def __post_init__(self):
        if not isinstance(self.groups, Mapping) or set(self.groups) != set(KINDS):
            got = sorted(self.groups) if isinstance(self.groups, Mapping) else self.groups
            raise ValueError(
                f"Scaling(groups=...) must map each operand kind {KINDS} to Groups; got {got!r}."
            )
        mx = Groups(False, 1, MX_BLOCK)
        if self.native and not (self.exact_scales and set(self.groups.values()) == {mx}):
            raise ValueError(
                "Scaling(native=True) is jax.nn.scaled_matmul's form: every kind in "
                f"{mx} with exact_scales=True; got {dict(self.groups)}, "
                f"exact_scales={self.exact_scales}."
            )
        object.__setattr__(self, "groups", dict(self.groups))

    @classmethod
    def uniform(cls, groups: Groups, **kwargs) -> Scaling:
        """The same groups for every operand kind."""
        return cls(dict.fromkeys(KINDS, groups), **kwargs)


SCALINGS: dict[str, Scaling] = {
    # One scale per operand, batch included.
    "tensorwise": Scaling.uniform(Groups(True, None, None)),
    # One per row along the contracting dim (torchao's rowwise).
    "rowwise": Scaling.uniform(Groups(False, 1, None)),
    # DeepSeek-V3: 1x128 activation/gradient tiles, 128x128 weight tiles.
    "blockwise": Scaling(
        {
            "act": Groups(False, 1, BLOCK),
            "weight": Groups(False, BLOCK, BLOCK),
            "grad": Groups(False, 1, BLOCK),
        }
    ),
    # OCP MX: 32 values along the contracting dim share a power-of-two scale.
    "mxfp8": Scaling.uniform(Groups(False, 1, MX_BLOCK), exact_scales=True, native=True),
}


def scaling_named(name: str) -> Scaling:
    """The table's entry for ``name``; a ValueError naming the registered ones if none."""
    if not isinstance(name, str) or name not in SCALINGS:
        raise ValueError(
            f"unknown FP8 scaling {name!r}: the registered ones are "
            f"{', '.join(map(repr, SCALINGS))} (jaxamp/_fp8/_scalings.py SCALINGS)."
        )
    return SCALINGS[name]


def native_scaling() -> str:
    """The name of the scaling whose products ``jax.nn.scaled_matmul`` runs."""
    return next(name for name, scaling in SCALINGS.items() if scaling.native)


def scope_name(scaling: str, power_of_two: bool) -> str:
    """The name scope of an FP8 product: ``precision_report`` reads the scaling back from it."""
    return f"{SCOPE_PREFIX}{scaling}{POW2_SUFFIX if power_of_two else ''}"


_SCOPE = re.compile(rf"(?<![\w]){re.escape(SCOPE_PREFIX)}(\w+)")


def scaling_of_scope(name_stack: str) -> str:
    """``"rowwise+pow2"`` from a name stack holding ``scope_name("rowwise", True)``; else ``""``.

    >>> scaling_of_scope("jvp(fp8_blockwise_pow2)/mul")
    'blockwise+pow2'
    """
    for match in _SCOPE.finditer(name_stack):
        name = match.group(1)
        base = name.removesuffix(POW2_SUFFIX)
        if base in SCALINGS:
            return base + ("+pow2" if base != name else "")
    return ""
