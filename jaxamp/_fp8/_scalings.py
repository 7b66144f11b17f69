"""The FP8 and FP4 scalings: one table, ``SCALINGS``, from which everything naming one derives.

A scaling says which values of an operand share a scale, per operand kind
(``"act"``, ``"weight"``, ``"grad"``), whether its scales are always powers of
two, and whether JAX has a native GEMM for it; the FP4 formats (``nvfp4``,
``mxfp4``) also fix their element dtype and scale format. ``Float8Recipe``
validates against the FP8 entries (``names("fp8")``), ``Float4Recipe``
against the FP4 ones, ``_quantize.groups_for`` reads the groups, ``_native``
the native form, and ``precision_report`` reads a product's scaling back from
its name scope (``scope_name`` / ``scaling_of_scope``), and whether a recipe's
``high_precision`` kept it in the compute dtype (``KEPT_SCOPE`` / ``kept_in_scope``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import NamedTuple

__all__ = [
    "KEPT_SCOPE",
    "KINDS",
    "MX_BLOCK",
    "QUANTIZE_SCOPE",
    "SCALINGS",
    "SCOPE_PREFIX",
    "Groups",
    "Scaling",
    "block_size",
    "family_of",
    "kept_in_scope",
    "names",
    "native_scaling",
    "scaling_named",
    "scaling_of_scope",
    "scope_name",
]

KINDS = ("act", "weight", "grad")
BLOCK = 128  # blockwise: 1x128 activation/gradient tiles, 128x128 weight tiles
MX_BLOCK = 32  # mxfp8/mxfp4: 32 values along the contracting dim share an E8M0 scale
NV_BLOCK = 16  # nvfp4: 16 values share an E4M3 scale (16x16 tiles of weights)
SCOPE_PREFIX = "fp8_"
FP4_SCOPE_PREFIX = "fp4_"
# The name scope of a product a recipe's high_precision keeps in the compute dtype.
KEPT_SCOPE = "kept_high_precision"
# The name scope of an FP8 quantization (amax, scale, scaled saturating cast):
# numerics_report measures it as one op, its float8 output, not each of its steps.
QUANTIZE_SCOPE = "jaxamp_quantize"
# A scale's format: a float32 number, or an E4M3 number under a float32 per-tensor
# scale (NVFP4's two levels), or an E8M0 power of two (OCP MX).
SCALE_FORMATS = ("float32", "float8_e4m3fn", "float8_e8m0fnu")
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
      element: the element dtype's name where the scaling fixes it (the FP4
        formats: ``"float4_e2m1fn"``, a :class:`jaxamp.Float4Recipe` format);
        None: the ``Float8Recipe``'s float8 dtypes.
      scale_format: the format of the group scales (``SCALE_FORMATS``).
      tensor_scale: a float32 per-tensor scale above the group scales (NVFP4).
    """

    groups: Mapping[str, Groups]
    exact_scales: bool = False
    native: bool = False
    element: str | None = None
    scale_format: str = "float32"
    tensor_scale: bool = False

    @property
    def family(self) -> str:
        """``"fp4"`` for the float4 formats, ``"fp8"`` for the others."""
        return "fp8" if self.element is None else "fp4"

    def __post_init__(self):
        if not isinstance(self.groups, Mapping) or set(self.groups) != set(KINDS):
            got = sorted(self.groups) if isinstance(self.groups, Mapping) else self.groups
            raise ValueError(
                f"Scaling(groups=...) must map each operand kind {KINDS} to Groups; got {got!r}."
            )
        # A square tile shares one scale per row of it: still MX's 1x32 blocks.
        mx = {Groups(False, 1, MX_BLOCK), Groups(False, MX_BLOCK, MX_BLOCK)}
        if self.native and not (self.exact_scales and set(self.groups.values()) <= mx):
            raise ValueError(
                "Scaling(native=True) is jax.nn.scaled_matmul's form: every kind in "
                f"1x{MX_BLOCK} blocks or {MX_BLOCK}x{MX_BLOCK} tiles, with "
                f"exact_scales=True; got {dict(self.groups)}, exact_scales={self.exact_scales}."
            )
        if self.scale_format not in SCALE_FORMATS:
            raise ValueError(
                f"Scaling(scale_format=...) must be one of {SCALE_FORMATS}; "
                f"got {self.scale_format!r}."
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
    # OCP MX: 32 values along the contracting dim share a power-of-two scale;
    # weights in 32x32 tiles (one scale per tile, so every 1x32 block of either
    # product shares it): one set of codes serves the forward and the input
    # gradient, and a sharded weight is gathered once (NVFP4's 16x16 idea).
    "mxfp8": Scaling(
        {
            "act": Groups(False, 1, MX_BLOCK),
            "weight": Groups(False, MX_BLOCK, MX_BLOCK),
            "grad": Groups(False, 1, MX_BLOCK),
        },
        exact_scales=True,
        native=True,
    ),
    # NVFP4 (Transformer Engine): E2M1 elements, an E4M3 scale per 16 values
    # under a float32 per-tensor scale; 16x16 weight tiles (Float4Recipe's
    # weight_blocks_2d=False: the activations' 1x16).
    "nvfp4": Scaling(
        {
            "act": Groups(False, 1, NV_BLOCK),
            "weight": Groups(False, NV_BLOCK, NV_BLOCK),
            "grad": Groups(False, 1, NV_BLOCK),
        },
        element="float4_e2m1fn",
        scale_format="float8_e4m3fn",
        tensor_scale=True,
    ),
    # OCP MX v1.0 MXFP4: E2M1 elements, an E8M0 scale per 32 values.
    "mxfp4": Scaling.uniform(
        Groups(False, 1, MX_BLOCK),
        exact_scales=True,
        element="float4_e2m1fn",
        scale_format="float8_e8m0fnu",
    ),
}


def names(family: str) -> tuple[str, ...]:
    """The registered scalings of ``family``: ``"fp8"`` (Float8Recipe's) or ``"fp4"``.

    >>> names("fp4")
    ('nvfp4', 'mxfp4')
    """
    return tuple(name for name, scaling in SCALINGS.items() if scaling.family == family)


def scaling_named(name: str) -> Scaling:
    """The table's entry for ``name``; a ValueError naming the registered ones if none."""
    if not isinstance(name, str) or name not in SCALINGS:
        raise ValueError(
            f"unknown FP8 scaling {name!r}: the registered ones are "
            f"{', '.join(map(repr, SCALINGS))} (jaxamp/_fp8/_scalings.py SCALINGS)."
        )
    return SCALINGS[name]


def block_size(name: str) -> int:
    """Values per block of the FP4 format ``name`` along a contracting dim (16 or 32)."""
    block = scaling_named(name).groups["act"].block
    if block is None:
        raise ValueError(f"scaling {name!r} has no blocks along the contracting dim.")
    return block


def native_scaling(element: str = "", scale: str = "float8_e8m0fnu") -> str:
    """The scaling whose products ``jax.nn.scaled_matmul`` runs: ``"mxfp8"``; for
    ``float4_e2m1fn`` operands the FP4 format with ``scale`` block scales (``""``: none).

    >>> native_scaling(), native_scaling("float4_e2m1fn", "float8_e4m3fn")
    ('mxfp8', 'nvfp4')
    """
    if element in {s.element for s in SCALINGS.values() if s.element}:
        named = (n for n, s in SCALINGS.items() if (s.element, s.scale_format) == (element, scale))
        return next(named, "")
    return next(name for name, scaling in SCALINGS.items() if scaling.native)


def family_of(label: str) -> str:
    """``"fp4"`` for an FP4 format's label (``"nvfp4"``), else ``"fp8"`` (``"rowwise+pow2"``)."""
    base = label.split("+")[0]
    return SCALINGS[base].family if base in SCALINGS else "fp8"


def scope_name(scaling: str, power_of_two: bool) -> str:
    """The name scope of a low-precision product: ``precision_report`` reads the scaling from it.

    >>> scope_name("nvfp4", False)
    'fp4_nvfp4'
    """
    fp4 = scaling in SCALINGS and SCALINGS[scaling].family == "fp4"
    prefix = FP4_SCOPE_PREFIX if fp4 else SCOPE_PREFIX
    return f"{prefix}{scaling}{POW2_SUFFIX if power_of_two and not fp4 else ''}"


_SCOPE = re.compile(rf"(?<![\w])(?:{re.escape(SCOPE_PREFIX)}|{re.escape(FP4_SCOPE_PREFIX)})(\w+)")


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


_KEPT = re.compile(rf"(?<![\w]){KEPT_SCOPE}(?![\w])")


def kept_in_scope(name_stack: str) -> bool:
    """Whether a name stack holds ``KEPT_SCOPE``: a product ``high_precision`` kept.

    >>> kept_in_scope("transpose(jvp(kept_high_precision))"), kept_in_scope("fp4_nvfp4")
    (True, False)
    """
    return _KEPT.search(name_stack) is not None
