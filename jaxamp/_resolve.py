"""The one reading of a policy argument: every entry point that takes a policy calls ``resolve``.

``autocast``, ``numerics_report``, ``numerics_monitor`` and the Flax adapters
(``set_policy``, ``linen_policy`` and their overrides) all accept the same
forms, because they all go through here.
"""

from __future__ import annotations

from typing import Any

from jaxamp._fp8._recipe import FP8_PRESET, Float8Recipe
from jaxamp._policy import Policy, get_policy

__all__ = ["resolve"]


def resolve(spec: Policy | Float8Recipe | str | Any) -> tuple[Policy, Float8Recipe | None]:
    """``(policy, recipe)`` for a policy argument; ``recipe`` is None unless FP8 is asked for.

    Args:
      spec: anything :func:`jaxamp.get_policy` accepts (a ``Policy``, a
        ``jmp.Policy``, a preset, a bare dtype, a jmp-style string), or FP8
        matmuls: a ``jaxamp.Float8Recipe`` or ``"mixed_float8"`` (its defaults),
        whose policy is the recipe's 16-bit one (``Float8Recipe.policy``).

    Raises:
      ValueError: a string that names none of these.
      TypeError: neither a string, a policy nor a recipe.

    >>> from jaxamp._resolve import resolve
    >>> policy, recipe = resolve("mixed_float8")
    >>> str(policy), str(recipe)
    ('params=float32,compute=bfloat16,output=float32', 'fp8:tensorwise')
    >>> resolve("mixed_bfloat16")[1] is None
    True
    """
    if isinstance(spec, Float8Recipe):
        return spec.policy, spec
    if isinstance(spec, str) and spec.strip().lower() == FP8_PRESET:
        recipe = Float8Recipe()
        return recipe.policy, recipe
    try:
        return get_policy(spec), None
    except (TypeError, ValueError) as error:
        raise type(error)(
            f"{error} FP8 matmuls: a jaxamp.Float8Recipe or {FP8_PRESET!r} (its defaults)."
        ) from None


def resolved_spec(spec: Any) -> Policy | Float8Recipe:
    """The one object ``spec`` stands for: its recipe if it asks for FP8, else its policy."""
    policy, recipe = resolve(spec)
    return policy if recipe is None else recipe
