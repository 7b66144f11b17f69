"""The edge generators (``_edges.py``): linear algebra on non-square and
ill-conditioned matrices, constants at the compute dtype's range edges, float32
buffers receiving 16-bit updates; each case forward, ``grad`` of the sum and a
random-cotangent VJP. CI runs one case per reproducer class; ``slow`` all.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest

from tests.conformance import _edges, _sweep

# The coverage table's generator -> its axis in ``_edges.all_cases``.
GENERATORS = {
    "linalg_cases": "linalg: non-square, ill-conditioned",
    "constant_cases": "constants at the range's edges",
    "buffer_cases": "float32 buffers, 16-bit updates",
}


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


def test_the_coverage_table_counts_the_generated_cases():
    # README.md's edges table says how many (case, policy) pairs each generator adds.
    text = Path(__file__).with_name("README.md").read_text()
    table = dict(re.findall(r"^\| `(\w+_cases)` \|.*\| (\d+)[ |]", text, re.MULTILINE))
    counts = {axis: len(pairs) for axis, pairs in _all_cases().items()}
    assert sorted(counts) == sorted(GENERATORS.values())
    assert {g: int(n) for g, n in table.items()} == {g: counts[a] for g, a in GENERATORS.items()}
    total = sum(counts.values())
    assert f"the {total} cases run {3 * total} checks" in " ".join(text.split())


@pytest.mark.slow
@pytest.mark.parametrize("axis", sorted(_edges.all_cases()))
def test_every_edge_case(axis, record_property):
    pairs = _all_cases()[axis]
    record_property("coverage", _coverage({axis: pairs}))
    failures = _failures(pairs)
    assert not failures, "\n".join(failures)
