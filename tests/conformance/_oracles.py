"""The oracles of the conformance sweep: autocast's outputs against float32's,
the hand-cast reference's and the ``"float32"`` policy's (the rules are in
``_sweep``'s docstring)."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

FACTOR = 4.0
# Integer/bool outputs: elements autocast may get wrong beyond the hand-cast
# reference's count. Zero: no function of the sweep needs ties broken differently.
DISCRETE_SLACK = 0
NOT_BIT_IDENTICAL = "float32 policy not bit-identical"


def is_floating(x: Any) -> bool:
    """Floating or complex (complex: FFTs, eigenvalues)."""
    return bool(jnp.issubdtype(jnp.result_type(x), jnp.inexact))


def rel_error(got: list, want: list) -> float:
    num = den = 0.0
    for g, w in zip(got, want, strict=True):
        g, w = np.asarray(g, np.complex128), np.asarray(w, np.complex128)
        ok = np.isfinite(w) & np.isfinite(g)
        num += float(np.sum(np.abs(g[ok] - w[ok]) ** 2))
        den += float(np.sum(np.abs(w[ok]) ** 2))
    return (num**0.5) / max(den**0.5, 1e-30)


def _wide(x: Any) -> np.ndarray:
    return np.asarray(x, np.complex128 if np.iscomplexobj(x) else np.float64)


def compare(want: list, got: list, exact: list, hand: list, dtype: Any) -> list[str]:
    failures = []
    if exact and any(  # empty: proven by the jaxpr (``_same_jaxpr``)
        not np.array_equal(np.asarray(e), np.asarray(w), equal_nan=True)
        for e, w in zip(exact, want, strict=True)
    ):
        failures.append(NOT_BIT_IDENTICAL)
    refs = hand if hand else want
    floating = [is_floating(w) for w in want]
    failures += _compare_discrete(*(_pick(xs, floating, False) for xs in (want, got, refs)))
    want, got, refs = (_pick(xs, floating, True) for xs in (want, got, refs))
    hand = refs if hand else []
    for g, w, h in zip(got, want, refs, strict=True):
        should = np.isfinite(np.asarray(w)) & np.isfinite(_wide(h))
        if np.any(should & ~np.isfinite(_wide(g))):
            failures.append("non-finite where float32 and the hand-cast reference are finite")
            break
    err = rel_error(got, want)
    ref = rel_error(hand, want) if hand else 0.0
    if err > FACTOR * ref + 8 * float(jnp.finfo(dtype).eps):
        failures.append(f"error {err:.3g} > {FACTOR} x hand-cast {ref:.3g}")
    return failures


def _pick(leaves: list, floating: list[bool], keep: bool) -> list:
    return [x for x, f in zip(leaves, floating, strict=True) if f == keep]


def _compare_discrete(want: list, got: list, hand: list) -> list[str]:
    """Integer and bool outputs: float32's dtypes, and no more mismatches than hand-cast."""
    if any(np.asarray(g).dtype != np.asarray(w).dtype for g, w in zip(got, want, strict=True)):
        return ["integer/bool output dtype differs from float32's"]
    wrong = sum(int(np.sum(np.asarray(g) != np.asarray(w))) for g, w in zip(got, want, strict=True))
    ref = sum(int(np.sum(np.asarray(h) != np.asarray(w))) for h, w in zip(hand, want, strict=True))
    if wrong > ref + DISCRETE_SLACK:
        return [f"{wrong} integer/bool elements differ from float32's > hand-cast {ref}"]
    return []
