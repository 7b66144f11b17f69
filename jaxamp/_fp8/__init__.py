"""FP8 matmuls with current scaling for autocast (see README.md in this folder)."""

from jaxamp._fp8._matmul import (
    FP8_PRIMITIVES,
    fp8_matmul,
    fp8_operands,
    fp8_runs,
    fp8_weight_amaxes,
)
from jaxamp._fp8._native import uses_native
from jaxamp._fp8._recipe import FP8_PRESET, GEMMS, Float8Recipe
from jaxamp._fp8._scalings import SCALINGS, SCOPE_PREFIX, Scaling, scaling_of_scope

__all__ = [
    "FP8_PRESET",
    "FP8_PRIMITIVES",
    "GEMMS",
    "SCALINGS",
    "SCOPE_PREFIX",
    "Float8Recipe",
    "Scaling",
    "fp8_matmul",
    "fp8_operands",
    "fp8_runs",
    "fp8_weight_amaxes",
    "scaling_of_scope",
    "uses_native",
]
