"""FP8 matmuls with current scaling for autocast (see README.md in this folder)."""

from jaxamp._fp8._matmul import FP8_PRIMITIVES, fp8_matmul, fp8_operands
from jaxamp._fp8._recipe import FP8_PRESET, SCALINGS, Float8Recipe, as_recipe

__all__ = [
    "FP8_PRESET",
    "FP8_PRIMITIVES",
    "SCALINGS",
    "Float8Recipe",
    "as_recipe",
    "fp8_matmul",
    "fp8_operands",
]
