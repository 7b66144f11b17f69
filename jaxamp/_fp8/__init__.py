"""FP8 matmuls with current scaling for autocast (see README.md in this folder)."""

from jaxamp._fp8._matmul import FP8_PRIMITIVES, fp8_matmul, fp8_operands, fp8_weight_amaxes
from jaxamp._fp8._native import uses_native
from jaxamp._fp8._recipe import FP8_PRESET, GEMMS, SCALINGS, Float8Recipe, as_recipe

__all__ = [
    "FP8_PRESET",
    "FP8_PRIMITIVES",
    "GEMMS",
    "SCALINGS",
    "Float8Recipe",
    "as_recipe",
    "fp8_matmul",
    "fp8_operands",
    "fp8_weight_amaxes",
    "uses_native",
]
