"""FP8 and FP4 matmuls with current scaling for autocast (see README.md in this folder)."""

from jaxamp._fp8._fp4_recipe import FP4_PRESETS, Float4Recipe
from jaxamp._fp8._hook import RECIPES, Recipe, kept_scope, recipe_operands, recipe_weights
from jaxamp._fp8._matmul import (
    FP8_PRIMITIVES,
    fp8_matmul,
    fp8_operands,
    fp8_runs,
    fp8_weight_amaxes,
)
from jaxamp._fp8._native import uses_native
from jaxamp._fp8._recipe import FP8_PRESET, GEMMS, Float8Recipe
from jaxamp._fp8._scalings import SCALINGS, SCOPE_PREFIX, Scaling, names, scaling_of_scope

__all__ = [
    "FP4_PRESETS",
    "FP8_PRESET",
    "FP8_PRIMITIVES",
    "GEMMS",
    "RECIPES",
    "SCALINGS",
    "SCOPE_PREFIX",
    "Float4Recipe",
    "Float8Recipe",
    "Recipe",
    "Scaling",
    "fp8_matmul",
    "fp8_operands",
    "fp8_runs",
    "fp8_weight_amaxes",
    "kept_scope",
    "names",
    "recipe_operands",
    "recipe_weights",
    "scaling_of_scope",
    "uses_native",
]
