"""The edge generators (``_edges.py``): linear algebra on non-square and
ill-conditioned matrices, constants at the compute dtype's range edges, float32
buffers receiving 16-bit updates; each case forward, ``grad`` of the sum and a
random-cotangent VJP. CI runs one case per reproducer class; ``slow`` all.
"""

from __future__ import annotations

import functools

import pytest

from tests.conformance import _edges, _sweep


@functools.cache
def _all_cases():
    return _edges.all_cases()


def _failures(pairs) -> list[str]:
    failures = []
    for case, policy in pairs:
        result = _sweep.check(case, policy, grad=True)
        key = f"{case.name} [{policy}]"
        found = result.failures + _edges.check_vjp(case, policy)
        if found and key not in _edges.OPEN:
            failures += [f"{key}: {f}" for f in found]
    return failures


def _coverage(selected: dict) -> str:
    lines = ["edges (tests/conformance/_edges.py): cases (case x policy) per axis"]
    for axis, pairs in selected.items():
        lines.append(f"  {axis}: {len(pairs)}, each forward, grad of the sum and a VJP")
    return "\n".join(lines)


def test_each_reproducer_class_once(record_property):
    by_name = {(c.name, p): (c, p) for pairs in _all_cases().values() for c, p in pairs}
    selected = {"one case per reproducer class (CI)": [by_name[key] for key in _edges.CI]}
    record_property("coverage", _coverage(selected))
    failures = _failures(selected["one case per reproducer class (CI)"])
    assert not failures, "\n".join(failures)


@pytest.mark.slow
@pytest.mark.parametrize("axis", sorted(_edges.all_cases()))
def test_every_edge_case(axis, record_property):
    pairs = _all_cases()[axis]
    record_property("coverage", _coverage({axis: pairs}))
    failures = _failures(pairs)
    assert not failures, "\n".join(failures)
