"""autocast's one hook into low-precision matmuls, for either recipe.

``_autocast/_caster.compute`` calls :func:`recipe_operands` for every
contraction and ``_autocast/_api.autocast`` calls :func:`recipe_weights` once
per evaluation; each dispatches on the recipe's type to its package's hook.
"""

from __future__ import annotations

import contextlib
import re
import warnings
from typing import Any, NamedTuple

import jax
import jax.extend.core as jex

from jaxamp._fp8._fp4 import fp4_operands
from jaxamp._fp8._fp4_ragged import fp4_ragged_dot
from jaxamp._fp8._fp4_recipe import Float4Recipe
from jaxamp._fp8._matmul import fp8_operands, fp8_runs, fp8_weight_amaxes
from jaxamp._fp8._recipe import Float8Recipe
from jaxamp._fp8._scales import ALL_CONTRACTIONS, WeightAmaxes, weight_operands
from jaxamp._fp8._scalings import KEPT_SCOPE

__all__ = [
    "RECIPES",
    "PrePass",
    "Recipe",
    "first_arg_name",
    "kept_scope",
    "recipe_operands",
    "recipe_weights",
]

Recipe = Float8Recipe | Float4Recipe
RECIPES = (Float8Recipe, Float4Recipe)


class PrePass(NamedTuple):
    """What autocast's pre-pass found, once per evaluation (:func:`recipe_weights`).

    ``amaxes``: FP8 tensorwise weights' amaxes from one fused reduction, else
    None. ``high_precision``: ids of the contractions ``high_precision`` keeps
    in the compute dtype.
    """

    amaxes: WeightAmaxes | None
    high_precision: frozenset


def recipe_operands(
    recipe: Recipe, eqn: jex.JaxprEqn, x: Any, w: Any, plain: tuple, found: PrePass | None
) -> tuple | None:
    """``(x, w, matmul)`` for a contraction the recipe runs, None for one it leaves to autocast.

    ``plain[i]``: operand ``i`` is a parameter, an input or a constant
    (autocast's PLAIN role); ``found``: :func:`recipe_weights`' result.
    """
    if found is not None and id(eqn) in found.high_precision:
        return None  # the recipe's high_precision: the compute dtype
    if isinstance(recipe, Float4Recipe):
        return fp4_operands(recipe, eqn, x, w, plain, fp4_ragged_dot)
    if not fp8_runs(eqn):
        return None
    return fp8_operands(recipe, x, w, plain, None if found is None else found.amaxes)


def kept_scope(eqn: jex.JaxprEqn, found: PrePass | None) -> contextlib.AbstractContextManager:
    """The name scope ``KEPT_SCOPE`` for a contraction ``high_precision`` keeps, else none.

    Around the compute-dtype product that autocast runs in its place, forward and
    backward: ``precision_report`` lists the kept products from it. A name scope
    changes no value and no dtype.
    """
    if found is not None and id(eqn) in found.high_precision:
        return jax.named_scope(KEPT_SCOPE)
    return contextlib.nullcontext()


def recipe_weights(
    recipe: Recipe, closed: jex.ClosedJaxpr, inputs: Any, paths: list | None = None
) -> PrePass:
    """The per-evaluation pre-pass: what ``recipe_operands`` receives as ``found``.

    FP8 (tensorwise): the step's weight amaxes from one fused reduction. With
    ``high_precision``: the ids of the contractions one of whose operands is a
    matching leaf of ``fun``'s first argument (``paths``: each input's key path in
    ``(args, kwargs)``), seen through views and jit/checkpoint/custom_jvp/scan bodies.
    """
    amaxes = fp8_weight_amaxes(recipe, closed, inputs) if isinstance(recipe, Float8Recipe) else None
    if recipe.high_precision is None or paths is None:
        return PrePass(amaxes, frozenset())
    names = {i: name for i, path in enumerate(paths) if (name := first_arg_name(path))}
    _warn_unmatched(recipe, list(names.values()))
    patterns = recipe.high_precision
    matching = {i for i, name in names.items() if any(re.search(p, name) for p in patterns)}
    operands = weight_operands(closed, ALL_CONTRACTIONS, scans=True)
    ids = frozenset(eqn for (eqn, _), i in operands.items() if i in matching)
    _warn_unused(recipe, names, set(operands.values()))
    return PrePass(amaxes, ids)


def _warn_unused(recipe: Recipe, names: dict[int, str], operand_inputs: set[int]) -> None:
    """A pattern whose leaves reach no matmul it can see keeps nothing: say so, not silently.

    E.g. a weight used only inside a ``lax.cond`` branch or a ``while`` body (not
    followed), or a pattern that names only norms and biases.
    """
    for pattern in recipe.high_precision or ():
        hits = [i for i, name in names.items() if re.search(pattern, name)]
        if hits and not any(i in operand_inputs for i in hits):
            warnings.warn(
                f"{type(recipe).__name__}(high_precision=...): {pattern!r} matches "
                f"{[names[i] for i in hits[:3]]} but none of them is a matmul operand "
                "high_precision can follow (through views and jit, checkpoint, custom_jvp "
                "and scan bodies; not into cond branches or while bodies), so it keeps no "
                "matmul in the compute dtype.",
                UserWarning,
                stacklevel=3,
            )


def first_arg_name(path: tuple) -> str | None:
    """The keystr of ``path`` (in ``(args, kwargs)``) within ``args[0]``, else None."""
    first = (jax.tree_util.SequenceKey(0), jax.tree_util.SequenceKey(0))
    if tuple(path[:2]) != first:
        return None
    return jax.tree_util.keystr(tuple(path[2:]))


def _warn_unmatched(recipe: Recipe, names: list[str]) -> None:
    """A pattern that names no parameter keeps nothing: say so, not silently (a typo)."""
    for pattern in recipe.high_precision or ():
        if not any(re.search(pattern, name) for name in names):
            warnings.warn(
                f"{type(recipe).__name__}(high_precision=...): {pattern!r} matches no leaf of "
                f"fun's first argument, so no matmul is kept in the compute dtype for it. "
                f"Patterns are matched with re.search against jax.tree_util.keystr of each "
                f"leaf, e.g. {names[:3]}.",
                UserWarning,
                stacklevel=2,
            )
