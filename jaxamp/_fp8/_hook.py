"""autocast's one hook into low-precision matmuls, for either recipe.

``_autocast/_caster.compute`` calls :func:`recipe_operands` for every
contraction and ``_autocast/_api.autocast`` calls :func:`recipe_weights` once
per evaluation; each dispatches on the recipe's type to its package's hook.
"""

from __future__ import annotations

from typing import Any

import jax.extend.core as jex

from jaxamp._fp8._fp4 import fp4_operands
from jaxamp._fp8._fp4_recipe import Float4Recipe
from jaxamp._fp8._matmul import FP8_PRIMITIVES, fp8_operands, fp8_weight_amaxes
from jaxamp._fp8._recipe import Float8Recipe
from jaxamp._fp8._scales import WeightAmaxes

__all__ = ["RECIPES", "Recipe", "recipe_operands", "recipe_weights"]

Recipe = Float8Recipe | Float4Recipe
RECIPES = (Float8Recipe, Float4Recipe)


def recipe_operands(
    recipe: Recipe, eqn: jex.JaxprEqn, x: Any, w: Any, plain: tuple, weights: WeightAmaxes | None
) -> tuple | None:
    """``(x, w, matmul)`` for a contraction the recipe runs, None for one it leaves to autocast.

    ``plain[i]``: operand ``i`` is a parameter, an input or a constant
    (autocast's PLAIN role); ``weights``: :func:`recipe_weights`' result.
    """
    if isinstance(recipe, Float4Recipe):
        return fp4_operands(recipe, eqn, x, w, plain)
    if eqn.primitive.name not in FP8_PRIMITIVES:
        return None
    return fp8_operands(recipe, x, w, plain, weights)


def recipe_weights(recipe: Recipe, closed: jex.ClosedJaxpr, inputs: Any) -> WeightAmaxes | None:
    """The step's weight amaxes from one fused reduction (tensorwise FP8 only), else None."""
    if isinstance(recipe, Float8Recipe):
        return fp8_weight_amaxes(recipe, closed, inputs)
    return None
