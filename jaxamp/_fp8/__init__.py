"""FP8 matmuls with current scaling for autocast (see README.md in this folder)."""

from jaxamp._fp8._matmul import FP8_PRIMITIVES, fp8_matmul, fp8_operands
from jaxamp._fp8._native import uses_native
from jaxamp._fp8._recipe import FP8_PRESET, GEMMS, SCALINGS, Float8Recipe

__all__ = [
    "FP8_PRESET",
    "FP8_PRIMITIVES",
    "GEMMS",
    "SCALINGS",
    "Float8Recipe",
    "fp8_matmul",
    "fp8_operands",
    "uses_native",
]
