"""Layer sweep: every public layer class of flax.nnx, flax.linen, haiku and equinox.

The CI test runs every applicable layer once (forward, one 16-bit policy
alternating by position, plus the float32 policy's bit-identity), all layers of
a namespace in one compiled program; the ``slow`` test runs both 16-bit
policies, forward and the gradient with respect to the matmul weight and every
parameter and state leaf, and the large ResNets. Each records its coverage: enumerated,
applicable, skipped by reason. See README.md here.
"""

from __future__ import annotations

import functools
import importlib

import pytest

from tests.conformance import _args_layers, _layers, _sweep

POLICIES = ("mixed_bfloat16", "mixed_float16")

# namespace -> (module, base class path, adapter, specs, skipped classes)
NAMESPACES = {
    "flax.nnx": ("flax.nnx", "flax.nnx.Module", _layers.build_nnx, "NNX"),
    "flax.linen": ("flax.linen", "flax.linen.Module", _layers.build_linen, "LINEN"),
    "haiku": ("haiku", "haiku.Module", _layers.build_haiku, "HAIKU"),
    "haiku.nets": ("haiku.nets", "haiku.Module", _layers.build_haiku, "HAIKU_NETS"),
    "equinox.nn": ("equinox.nn", "equinox.Module", _layers.build_equinox, "EQUINOX"),
}

# Known failures left open, "namespace.Class": "open: <what fails>". Empty means none.
OPEN: dict[str, str] = {}


def _resolve(path: str):
    module, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(module), attr)


@functools.cache
def _enumerate(namespace: str, slow: bool):
    module_name, base, build, table = NAMESPACES[namespace]
    pytest.importorskip(module_name.split(".")[0])
    classes = _layers.layer_classes(importlib.import_module(module_name), _resolve(base))
    specs, skip = getattr(_args_layers, table), getattr(_args_layers, f"{table}_SKIP")
    return _layers.enumerate_layers(namespace, classes, build, specs, skip, slow)


def _report(namespace: str, cases, reasons, slow) -> str:
    total = len({c.name for c in cases} | set(reasons) | slow)
    applicable = total - len(reasons)
    lines = [
        f"{namespace}: enumerated {total}, applicable {applicable} "
        f"({100 * applicable / max(total, 1):.0f}%)"
        + (f", slow test only: {' '.join(sorted(slow))}" if slow else "")
    ]
    lines += [f"  skipped {name}: {reason}" for name, reason in sorted(reasons.items())]
    return "\n".join(lines)


def _failures(namespace: str, results) -> list[str]:
    out = []
    for case, policy, failures in results:
        key = f"{namespace}.{case.name}"
        if failures and key not in OPEN:
            out.append(f"{key} [{policy}]: {'; '.join(failures)}")
    return out


def _check(cases, policies, grad: bool) -> list:
    results = [(r.case, r.policy, r.failures) for r in _sweep.check_many(cases, policies)]
    if grad:
        grads = _layers.check_grads_many(cases, policies)
        results += [(c, p, g) for c, p, g in zip(cases, policies, grads, strict=True)]
    return results


@pytest.mark.parametrize("namespace", sorted(NAMESPACES))
def test_every_layer_once(namespace, record_property):
    cases, reasons, slow = _enumerate(namespace, slow=False)
    record_property("coverage", _report(namespace, cases, reasons, slow))
    policies = [POLICIES[i % 2] for i in range(len(cases))]
    failures = _failures(namespace, _check(cases, policies, grad=False))
    assert not failures, "\n".join(failures)


@pytest.mark.slow
@pytest.mark.parametrize("namespace", sorted(NAMESPACES))
def test_full_matrix(namespace, record_property):
    cases, reasons, slow = _enumerate(namespace, slow=True)
    record_property("coverage", _report(namespace, cases, reasons, slow))
    failures = []
    for policy in POLICIES:
        failures += _failures(namespace, _check(cases, [policy] * len(cases), grad=True))
    assert not failures, "\n".join(failures)
