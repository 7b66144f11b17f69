"""Conformance sweep: every public function of the swept namespaces under autocast.

The CI test runs every applicable function once (forward, one 16-bit policy,
alternating by position, plus the float32 policy's bit-identity); the ``slow``
test runs the full matrix (both 16-bit policies, forward and grad). Each records
its coverage: enumerated, applicable, skipped by reason. See README.md here.
"""

from __future__ import annotations

import collections
import functools

import jax
import jax.numpy as jnp
import pytest

from tests.conformance import _excluded, _sweep

optax = pytest.importorskip("optax")

NAMESPACES = {
    "jax.numpy": jnp,
    "jax.nn": jax.nn,
    "jax.lax": jax.lax,
    "jax.scipy.special": jax.scipy.special,
    "jax.numpy.linalg": jnp.linalg,
    "jax.numpy.fft": jnp.fft,
    "optax.losses": optax.losses,
}
POLICIES = ("mixed_bfloat16", "mixed_float16")
CHUNK = 24  # functions per compiled program in the CI test

# Known failures left open, "namespace.name": "open: <what fails>". Empty means none.
OPEN: dict[str, str] = {}


@functools.cache
def _enumerate(namespace: str):
    cases, skipped = [], collections.Counter()
    reasons = {}
    for name, fun in _sweep.public_functions(NAMESPACES[namespace]):
        if name in _excluded.EXCLUDED:
            skipped[_excluded.EXCLUDED[name]] += 1
            reasons[name] = _excluded.EXCLUDED[name]
            continue
        case = _sweep.signature_of(namespace, name, fun)
        if isinstance(case, str):
            skipped[case] += 1
            reasons[name] = case
        else:
            cases.append(case)
    return cases, skipped, reasons


def _report(namespace: str, cases, skipped, reasons) -> str:
    total = len(cases) + sum(skipped.values())
    lines = [
        f"{namespace}: enumerated {total}, applicable {len(cases)} "
        f"({100 * len(cases) / max(total, 1):.0f}%)"
    ]
    for reason, count in skipped.most_common():
        names = sorted(n for n, r in reasons.items() if r == reason)
        lines.append(f"  skipped {count}: {reason}: {' '.join(names)}")
    return "\n".join(lines)


def _run(namespace: str, policies, grad: bool, record_property) -> list[str]:
    cases, skipped, reasons = _enumerate(namespace)
    record_property("coverage", _report(namespace, cases, skipped, reasons))
    if grad:
        results = [_sweep.check(c, p, grad=True) for c in cases for p in policies]
    else:  # every function once, the policy alternating, in chunks of one program each
        results = []
        for start in range(0, len(cases), CHUNK):
            chunk = cases[start : start + CHUNK]
            policies = [POLICIES[(start + i) % 2] for i in range(len(chunk))]
            results += _sweep.check_many(chunk, policies)
    failures = []
    for result in results:
        key = f"{namespace}.{result.case.name}"
        if result.failures and key not in OPEN:
            failures.append(f"{key} [{result.policy}]: {'; '.join(result.failures)}")
    return failures


@pytest.mark.parametrize("namespace", sorted(NAMESPACES))
def test_every_function_once(namespace, record_property):
    failures = _run(namespace, POLICIES, grad=False, record_property=record_property)
    assert not failures, "\n".join(failures)


@pytest.mark.slow
@pytest.mark.parametrize("namespace", sorted(NAMESPACES))
def test_full_matrix(namespace, record_property):
    failures = _run(namespace, POLICIES, grad=True, record_property=record_property)
    assert not failures, "\n".join(failures)
