"""The one reading of a policy argument: every entry point that takes a policy calls ``resolve``.

``autocast``, ``numerics_report``, ``numerics_monitor`` and the Flax adapters
(``set_policy``, ``linen_policy`` and their overrides) all accept the same
forms, because they all go through here.
"""

from __future__ import annotations

from typing import Any

from jaxamp._fp8._fp4_recipe import FP4_PRESETS, Float4Recipe
from jaxamp._fp8._recipe import FP8_PRESET, Float8Recipe
from jaxamp._policy import Policy, get_policy

__all__ = ["resolve"]


Recipe = Float8Recipe | Float4Recipe


def _preset(spec: str) -> Recipe | None:
    """The recipe a preset name stands for (its defaults), else None."""
    name = spec.strip().lower()
    if name == FP8_PRESET:
        return Float8Recipe()
    if name in FP4_PRESETS:
        return Float4Recipe(format=FP4_PRESETS[name])
    return None


def resolve(spec: Policy | Recipe | str | Any) -> tuple[Policy, Recipe | None]:
    """``(policy, recipe)`` for a policy argument; ``recipe`` is None unless FP8/FP4 is asked for.

    Args:
      spec: anything :func:`jaxamp.get_policy` accepts (a ``Policy``, a
        ``jmp.Policy``, a preset, a bare dtype, a jmp-style string), or FP8
        matmuls: a ``jaxamp.Float8Recipe`` or ``"mixed_float8"`` (its defaults),
        or FP4 matmuls: a ``jaxamp.Float4Recipe``, ``"mixed_nvfp4"`` or
        ``"mixed_mxfp4"`` (its defaults with that format). A recipe's policy is
        its 16-bit one (``Float8Recipe.policy``, ``Float4Recipe.policy``).

    Raises:
      ValueError: a string that names none of these.
      TypeError: neither a string, a policy nor a recipe.

    >>> from jaxamp._resolve import resolve
    >>> policy, recipe = resolve("mixed_float8")
    >>> str(policy), str(recipe)
    ('params=float32,compute=bfloat16,output=float32', 'fp8:tensorwise')
    >>> str(resolve("mixed_mxfp4")[1])
    'fp4:mxfp4'
    >>> resolve("mixed_bfloat16")[1] is None
    True
    """
    if isinstance(spec, (Float8Recipe, Float4Recipe)):
        return spec.policy, spec
    recipe = _preset(spec) if isinstance(spec, str) else None
    if recipe is not None:
        return recipe.policy, recipe
    try:
        return get_policy(spec), None
    except (TypeError, ValueError) as error:
        fp4 = " or ".join(map(repr, FP4_PRESETS))
        raise type(error)(
            f"{error} FP8 matmuls: a jaxamp.Float8Recipe or {FP8_PRESET!r} (its defaults); "
            f"FP4 matmuls: a jaxamp.Float4Recipe, {fp4}."
        ) from None


def resolved_spec(spec: Any) -> Policy | Recipe:
    """The one object ``spec`` stands for: its recipe if it asks for FP8, else its policy."""
    policy, recipe = resolve(spec)
    return policy if recipe is None else recipe
