"""Per-module precision overrides: which policy a Flax module runs under.

Haiku's ``set_policy(cls, policy)`` is the model: a policy per module class. A
key may also be a path string, so that one layer (say the logits ``"head"``)
can be kept in float32 while other layers of the same class are not.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jaxamp._policy import Policy
from jaxamp._resolve import resolve


def normalize_overrides(overrides: Mapping[Any, Any] | None) -> list[tuple[Any, Policy]]:
    """Checks ``overrides`` and returns ``(key, Policy)`` pairs in order.

    Keys are module classes (matched with ``isinstance``) or path strings such
    as ``"head"`` or ``"blocks/0/norm"`` (matching that module and everything
    inside it); values are anything :func:`jaxamp.autocast` accepts (a recipe
    stands for its 16-bit policy).
    """
    if overrides is None:
        return []
    if not isinstance(overrides, Mapping):
        raise TypeError(
            "overrides must be a dict mapping module classes or path strings to policies, "
            f"e.g. {{nnx.LayerNorm: 'float32'}}; got {type(overrides).__name__}: {overrides!r}."
        )
    pairs = []
    for key, spec in overrides.items():
        if not (isinstance(key, type) or (isinstance(key, str) and key)):
            raise TypeError(
                "overrides keys must be module classes or non-empty path strings such as "
                f"'head'; got {type(key).__name__}: {key!r}."
            )
        pairs.append((key, resolve(spec)[0]))
    return pairs


def policy_for(module: Any, path: str, default: Policy, pairs: list[tuple[Any, Policy]]) -> Policy:
    """The policy of ``module`` at ``path``: the first matching override, else ``default``.

    Path overrides are checked before class overrides: they are the more specific.
    """
    for key, policy in pairs:
        if isinstance(key, str) and (path == key or path.startswith(key + "/")):
            return policy
    for key, policy in pairs:
        if isinstance(key, type) and isinstance(module, key):
            return policy
    return default
