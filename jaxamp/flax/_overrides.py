"""Per-module precision overrides: which policy a Flax module runs under.

Haiku's ``set_policy(cls, policy)`` is the model: a policy per module class. A
key may also be a path string, so that one layer (say the logits ``"head"``)
can be kept in float32 while other layers of the same class are not.

The matching rule for a path key: its parts (split on ``/`` or ``.``) must
appear, in order and next to each other, in the module's path, so a key names
a module at any depth and everything inside it. ``"head"`` matches ``head``
and ``decoder/head`` (and ``decoder/head/proj``); ``"decoder.head"`` and
``"decoder/head"`` are the same key; ``"blocks/0"`` matches the first block.
When several path keys match, the one naming the deepest module wins (then
the longer key); path keys win over class keys. A key that matches no module
is an error: a typo would otherwise leave that layer silently in 16 bits.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from typing import Any

from jaxamp._policy import Policy
from jaxamp._resolve import resolve

# How many module paths an unmatched-key error lists (a large model has thousands).
_LISTED_PATHS = 30


def split_path(path: str) -> tuple[str, ...]:
    """``"decoder.head"`` and ``"decoder/head"`` -> ``("decoder", "head")``."""
    return tuple(part for part in path.replace(".", "/").split("/") if part)


def normalize_overrides(overrides: Mapping[Any, Any] | None) -> list[tuple[Any, Policy]]:
    """Checks ``overrides`` and returns ``(key, Policy)`` pairs in order.

    Keys are module classes (matched with ``isinstance``) or path strings such
    as ``"head"``, ``"decoder/head"`` or ``"blocks.0.norm"`` (see the module
    docstring for the rule); values are anything :func:`jaxamp.autocast` accepts
    (a recipe stands for its 16-bit policy).
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
        if not (isinstance(key, type) or (isinstance(key, str) and split_path(key))):
            raise TypeError(
                "overrides keys must be module classes or non-empty path strings such as "
                f"'head' or 'decoder/head'; got {type(key).__name__}: {key!r}."
            )
        pairs.append((key, resolve(spec)[0]))
    return pairs


def _match_depth(key: str, path: tuple[str, ...]) -> int:
    """How deep in ``path`` the module named by ``key`` sits (0: ``key`` matches nowhere)."""
    parts = split_path(key)
    for end in range(len(path), len(parts) - 1, -1):
        if path[end - len(parts) : end] == parts:
            return end
    return 0


def matching_key(module: Any, path: tuple[str, ...], pairs: list[tuple[Any, Policy]]) -> Any:
    """The override key that decides ``module`` at ``path``, or None when none matches."""
    best, best_rank = None, (0, 0)
    for key, _ in pairs:
        if isinstance(key, str):
            rank = (_match_depth(key, path), len(split_path(key)))
            if rank[0] and rank > best_rank:
                best, best_rank = key, rank
    if best is not None:
        return best
    for key, _ in pairs:
        if isinstance(key, type) and isinstance(module, key):
            return key
    return None


def policy_for(
    module: Any, path: tuple[str, ...], default: Policy | None, pairs: list[tuple[Any, Policy]]
) -> Policy | None:
    """The policy of ``module`` at ``path``: the matching override's, else ``default``."""
    key = matching_key(module, path, pairs)
    return default if key is None else dict(pairs)[key]


def _key_matches(key: Any, module: Any, path: tuple[str, ...]) -> bool:
    if isinstance(key, str):
        return _match_depth(key, path) > 0
    return isinstance(module, key)


def _closest_paths(key: str, paths: list[tuple[str, ...]]) -> list[str]:
    """Module paths whose last parts are closest to ``key`` (``'hed'`` -> ``'decoder/head'``)."""
    parts = split_path(key)
    by_tail: dict[str, list[str]] = {}
    for path in paths:
        for tail in {"/".join(path[-len(parts) :]), "/".join(path)}:
            by_tail.setdefault(tail, []).append("/".join(path))
    close = difflib.get_close_matches("/".join(parts), list(by_tail), n=3, cutoff=0.5)
    return list(dict.fromkeys(full for tail in close for full in sorted(by_tail[tail])))[:5]


def check_all_matched(
    pairs: list[tuple[Any, Policy]], seen: Iterable[tuple[Any, tuple[str, ...]]]
) -> None:
    """Raises ValueError naming the override keys that match none of the ``seen`` modules.

    ``seen`` holds ``(module, path)`` pairs. The error lists the closest paths.
    """
    seen = list(seen)
    unused = [key for key, _ in pairs if not any(_key_matches(key, m, path) for m, path in seen)]
    if not unused:
        return
    paths = sorted({"/".join(path) for _, path in seen if path})
    names = sorted({type(module).__name__ for module, _ in seen})
    hints = []
    for key in unused:
        if isinstance(key, str):
            close = _closest_paths(key, [path for _, path in seen if path])
            hint = f"closest paths: {', '.join(repr(p) for p in close)}" if close else ""
        else:
            key = key.__name__
            hint = f"module classes in the model: {', '.join(names)}"
        hints.append(f"{key!r}" + (f" ({hint})" if hint else ""))
    listed = ", ".join(repr(p) for p in paths[:_LISTED_PATHS]) or "(none)"
    if len(paths) > _LISTED_PATHS:
        listed += f", ... ({len(paths)} in all)"
    raise ValueError(
        f"overrides keys matched no module: {'; '.join(hints)}. A path key matches a module "
        "whose path contains its parts ('head' matches 'decoder/head'; '.' or '/' separate "
        f"parts); the module paths are: {listed}."
    )
