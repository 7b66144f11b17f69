"""The documentation site: it builds without warnings and every code sample in it runs.

- ``mkdocs build --strict`` succeeds (broken links, missing images and
  unresolvable API references are errors).
- Every ```python block of every page under docs/ runs; blocks of one page run
  in order in one namespace, the way a reader pastes them. They run under JAX's
  default ("standard") dtype promotion, as users run them, not the test suite's
  strict mode.
- Every public name of jaxamp (and of its public submodules) has an API entry.
- The numbers the primer quotes match the data the figure script produced.

The repository paths, modules and sections the pages cite are checked, with those
of the code and the other markdown files, by ``tests/smoke/test_references.py``.
"""

from __future__ import annotations

import doctest
import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import jax
import pytest

import jaxamp

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.md"))
# A fence may be indented (inside a content tab or an admonition): its body is dedented.
FENCE = re.compile(
    r"^(?P<indent>[ \t]*)```(?P<lang>[^\n`]*)\n(?P<body>.*?)^(?P=indent)```[ \t]*$",
    re.MULTILINE | re.DOTALL,
)
# Pages that teach by example must have executed examples (guards the extraction itself).
MUST_HAVE_CODE = ("index.md", "primer.md", "guide.md", "troubleshooting.md", "migration/")


def python_blocks(text: str) -> list[str]:
    """The bodies of the fenced blocks whose language is exactly ``python``."""
    return [
        textwrap.dedent(m["body"]) for m in FENCE.finditer(text) if m["lang"].strip() == "python"
    ]


def test_fence_extraction_sees_only_python_blocks():
    text = "a\n```python\nx = 1\n```\n```text\nimport torch\n```\n```python\ny = x\n```\n"
    assert python_blocks(text) == ["x = 1\n", "y = x\n"]
    tabbed = '=== "After"\n\n    ```python\n    if x:\n        z = 2\n    ```\n'
    assert python_blocks(tabbed) == ["if x:\n    z = 2\n"]


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(DOCS)) for p in PAGES])
def test_page_code_runs(page):
    blocks = python_blocks(page.read_text())
    rel = str(page.relative_to(DOCS))
    if rel.startswith(MUST_HAVE_CODE):
        assert blocks, f"{rel} is expected to carry executed examples but has no ```python block"
    # A real module, registered while the page runs: dataclasses (flax.struct,
    # TrainState subclasses) look their defining module up in sys.modules.
    module = types.ModuleType(f"docs_page_{page.stem.replace('-', '_')}")
    sys.modules[module.__name__] = module
    try:
        with jax.numpy_dtype_promotion("standard"):
            for number, block in enumerate(blocks, 1):
                code = compile(block, f"{rel} (python block {number})", "exec")
                exec(code, module.__dict__)
    finally:
        del sys.modules[module.__name__]


def _public_names(module) -> set[str]:
    return {n for n in getattr(module, "__all__", ()) if not n.startswith("_")}


def _api_directives() -> set[str]:
    found = set()
    for page in (DOCS / "api").glob("*.md"):
        found.update(re.findall(r"^::: ([\w.]+)", page.read_text(), re.MULTILINE))
    return found


def test_every_public_name_has_an_api_entry():
    documented = _api_directives()
    missing = [f"jaxamp.{n}" for n in _public_names(jaxamp) if f"jaxamp.{n}" not in documented]
    # Public submodules (jaxamp.flax, jaxamp.testing, ...): a `::: jaxamp.sub` directive
    # documents all of its members; otherwise each member needs its own.
    for sub in ("flax", "testing"):
        name = f"jaxamp.{sub}"
        if importlib.util.find_spec(name) is None or name in documented:
            continue
        module = importlib.import_module(name)
        missing += [f"{name}.{n}" for n in _public_names(module) if f"{name}.{n}" not in documented]
    assert not missing, f"add '::: name' entries under docs/api/ for: {sorted(missing)}"


def test_api_directives_name_real_objects():
    for directive in _api_directives():
        module_name, _, attr = directive.rpartition(".")
        if importlib.util.find_spec(directive) is not None:
            continue  # a module
        module = importlib.import_module(module_name)
        assert hasattr(module, attr), f"docs/api names {directive}, which does not exist"


def test_autocast_page_higher_order_table_matches_the_rules():
    # The hand-written table of higher-order primitives (the generated one covers all
    # rules): "run as traced" is the keep rule, anything rebuilt or inlined is recurse.
    page = (DOCS / "api" / "autocast.md").read_text()
    section = page[page.index("## Higher-order primitives") :]
    section = section[: section.index("\n## ")]
    listed = {}
    for names, handling in re.findall(r"^\| (.+?) \| (.+?) \|$", section, re.MULTILINE)[2:]:
        kind = "keep" if handling.startswith("run as traced") else "recurse"
        names = re.sub(r"\([^)]*\)", "", names)  # "(`.at[]`, `segment_sum`)" are examples
        listed.update(dict.fromkeys(re.findall(r"`([\w-]+)`", names), kind))
    rules = jaxamp.AUTOCAST_RULES
    wrong = {p: (kind, rules[p]) for p, kind in listed.items() if p in rules and rules[p] != kind}
    assert not wrong, f"the page says (page, rule): {wrong}"
    unlisted = {p for p, kind in rules.items() if kind == "recurse"} - listed.keys()
    assert not unlisted, f"recurse primitives missing from the page's table: {unlisted}"


def test_primer_quotes_the_figure_data():
    data = json.loads((DOCS / "figures" / "fp16_underflow.json").read_text())
    primer = (DOCS / "primer.md").read_text()
    for key, value in data["summary"].items():
        quoted = f"{100 * value:.1f}%"
        assert quoted in primer, f"primer.md should quote {key} = {quoted} (from the JSON)"
    steps = data["settings"]["steps"]
    assert f"skipped none in {steps} steps" in primer
    assert data["skipped_steps"] == 0


def test_troubleshooting_names_the_report_columns_that_exist():
    report = jaxamp.precision_report(
        lambda a, b: a @ b, jax.numpy.ones((3, 5)), jax.numpy.ones((5, 2))
    )
    header = str(report).splitlines()[0].split()
    page = (DOCS / "troubleshooting.md").read_text()
    described = re.findall(r"^- `(\w+)`(?:, `(\w+)`)?:", page, re.MULTILINE)
    columns = {name for pair in described for name in pair if name}
    assert {"lhs", "rhs", "FLOPs", "dims"} <= columns
    assert columns <= set(header), (
        f"columns described but not in the report: {columns - set(header)}"
    )


def _load_docs_module(name):
    spec = importlib.util.spec_from_file_location(name, DOCS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _load_make_figures():
    return _load_docs_module("make_figures")


def test_griffe_extension_rewrites_docstrings():
    # The mkdocstrings extension that fences bare doctests and strips Sphinx roles.
    module = _load_docs_module("griffe_markdown")
    assert doctest.testmod(module).failed == 0
    text = "Args:\n  x: see :data:`jaxamp.AUTOCAST_RULES`.\n\n>>> f([8])\n[8, 4, 16]\n"
    assert module.strip_roles(module.fence_doctests(text)).splitlines() == [
        "Args:",
        "  x: see `jaxamp.AUTOCAST_RULES`.",
        "",
        "```pycon",
        ">>> f([8])",
        "[8, 4, 16]",
        "```",
    ]


def test_figure_facts_come_from_finfo():
    facts = _load_make_figures().format_facts()
    assert {k: (f["exponent_bits"], f["mantissa_bits"]) for k, f in facts.items()} == {
        "float32": (8, 23),
        "float16": (5, 10),
        "bfloat16": (8, 7),
    }
    for f in facts.values():
        assert 1 + f["exponent_bits"] + f["mantissa_bits"] == f["bits"]
    assert facts["float16"]["max"] == 65504.0
    assert facts["float16"]["smallest_subnormal"] == 2.0**-24


def test_underflow_run_measures_real_underflow():
    # A short version of the run behind docs/figures/fp16_underflow.png.
    with jax.numpy_dtype_promotion("standard"):
        record = _load_make_figures().underflow_run(steps=30, probe_every=15, hidden=32)
    assert record["step"] == [0, 15, 30]
    assert record["skipped_steps"] == 0 and record["loss_scale"] == [2.0**15] * 3
    unscaled, scaled = record["share_unscaled"], record["share_scaled"]
    assert all(0.0 <= s <= u <= 1.0 for s, u in zip(scaled, unscaled, strict=True))
    # Training shrinks the gradients: float16 without scaling already loses entries.
    assert unscaled[-1] > 0.0
    assert record["loss"][0] is None and record["loss"][-1] < record["loss"][1]


def test_site_builds_strict(tmp_path):
    for package in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python"):
        if importlib.util.find_spec(package.split(".")[0]) is None:
            pytest.skip(f"{package} is not installed: pip install -e '.[docs]'")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    log = result.stdout + result.stderr
    assert result.returncode == 0, log
    assert "WARNING" not in log, log
    # The API pages were rendered from the docstrings: every public name has an anchor.
    html = "".join(page.read_text() for page in (tmp_path / "api").rglob("index.html"))
    assert ":::" not in html
    anchors = set(re.findall(r'id="(jaxamp[\w.]*)"', html))
    expected = {f"jaxamp.{n}" for n in _public_names(jaxamp)}
    for sub in ("flax", "testing"):
        if importlib.util.find_spec(f"jaxamp.{sub}") is not None:
            module = importlib.import_module(f"jaxamp.{sub}")
            expected |= {f"jaxamp.{sub}.{n}" for n in _public_names(module)}
    assert expected <= anchors, f"not rendered: {sorted(expected - anchors)}"
    assert "backoff_factor" in (tmp_path / "api" / "loss-scales" / "index.html").read_text()
    # Sample output generated at build time (docs/hooks.py) from the block above it.
    troubleshooting = (tmp_path / "troubleshooting" / "index.html").read_text()
    assert "output-of-previous-block" not in troubleshooting
    assert "M=30*" in troubleshooting
    # The rules table is generated from the code by docs/hooks.py at build time.
    autocast_page = (tmp_path / "api" / "autocast" / "index.html").read_text()
    missing_rules = [p for p in jaxamp.AUTOCAST_RULES if f"<code>{p}</code>" not in autocast_page]
    assert not missing_rules, f"autocast rules not in the generated table: {missing_rules}"
