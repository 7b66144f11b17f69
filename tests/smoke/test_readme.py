"""README.md: its code runs, its rules table is the code's, its numbers are the results'.

Every ```python block runs, in order, as a reader would paste them. Blocks share
one namespace (later snippets build on earlier ones) and run under JAX's default
"standard" dtype promotion, which is what users have: the suite's strict promotion
would reject optax's own adam and schedules.

The autocast rules table is generated from ``jaxamp.AUTOCAST_RULES`` (``python
docs/hooks.py``), and the numbers quoted from the examples are those of the
committed results in ``examples/results/``.
"""

import importlib.util
import re
from pathlib import Path

import jax
import pytest

import jaxamp

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
RESULTS = ROOT / "examples" / "results"
_FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)


def _blocks() -> list[tuple[int, str]]:
    text = README.read_text()
    return [(text.count("\n", 0, m.start()) + 1, m.group(1)) for m in _FENCE.finditer(text)]


BLOCKS = _blocks()
_RUN = {"namespace": {"__name__": "readme"}, "done": 0}


def test_readme_has_python_blocks():
    assert len(BLOCKS) >= 6, "README lost its executed examples"


@pytest.mark.parametrize("index", range(len(BLOCKS)), ids=[f"line{line}" for line, _ in BLOCKS])
def test_readme_block_runs(index, tmp_path, monkeypatch):
    _run_blocks_through(index, tmp_path, monkeypatch)


def _run_blocks_through(index, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # snippets that write files write them here
    monkeypatch.setenv("MPLBACKEND", "Agg")
    # Run any earlier blocks not yet run (e.g. when one test is selected alone).
    with jax.numpy_dtype_promotion("standard"):
        while _RUN["done"] <= index:
            line, source = BLOCKS[_RUN["done"]]
            code = compile("\n" * line + source, str(README), "exec")
            _RUN["done"] += 1
            exec(code, _RUN["namespace"])


def _load_hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_rules_table_is_generated_from_autocast_rules():
    hooks = _load_hooks()
    text = README.read_text()
    assert hooks.readme_with_rules_table(text) == text, "stale: run python docs/hooks.py"
    table = text[text.index(hooks.README_RULES_BEGIN) : text.index(hooks.README_RULES_END)]
    rows = re.findall(r"^\| `(\w+)` \| [^|]+ \| (.+) \|$", table, re.MULTILINE)
    listed = {p: kind for kind, names in rows for p in re.findall(r"`([^`]+)`", names)}
    assert listed == dict(jaxamp.AUTOCAST_RULES)


def _table(markdown: str, header_start: str = "| setup |") -> dict[str, dict[str, str]]:
    """The table whose header line starts with ``header_start``: first cell -> {column: cell}."""
    start = markdown.index(f"\n{header_start}") + 1
    lines = markdown[start:].split("\n\n")[0].strip().splitlines()
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    header, rows = cells[0], cells[2:]
    return {row[0]: dict(zip(header, row, strict=True)) for row in rows}


def test_readme_quotes_the_committed_example_results():
    readme = README.read_text()
    text = " ".join(readme.split())
    underflow = _table((RESULTS / "underflow.md").read_text())
    chance = float(underflow["mixed_float16_no_scaling"]["test acc"])
    scaled, f32 = (float(underflow[k]["test acc"]) for k in ("mixed_float16", "float32"))
    assert f"chance ({100 * chance:.1f}%)" in text
    assert f"({100 * scaled:.1f}% test accuracy, float32 {100 * f32:.1f}%)" in text

    charlm = _table((RESULTS / "charlm.md").read_text())
    setups = ("float32", "mixed_bfloat16", "autocast_bfloat16")
    bits = [f"{float(charlm[s]['valid bits/char']):.2f}" for s in setups]
    assert "{}, {} and {} validation bits per character".format(*bits) in text
    mib = [f"{float(charlm[s]['activations (residuals)'].split()[0]):.0f}" for s in setups]
    assert "activation memory {}, {} and {} MiB".format(*mib) in text

    digits = _table((RESULTS / "digits.md").read_text())
    quoted = _table(readme, "| setup | test acc |")
    assert quoted.keys() == digits.keys()
    for setup, row in quoted.items():
        ours = digits[setup]
        assert row["test acc"] == ours["test acc (mean +- std)"], setup
        for column in ("test loss", "skipped", "final scale", "activations (residuals)"):
            assert row[column] == ours[column], (setup, column)


def test_readme_precision_report_sample_is_what_it_prints(tmp_path, monkeypatch):
    # The sample must be true on every supported JAX version: it is compared to the
    # report of the README's own code, run here.
    text = README.read_text()
    start = text.index("The printed report")
    sample = re.search(r"```text\n(.*?)```", text[start:], re.S).group(1).strip()
    index = next(i for i, (_, src) in enumerate(BLOCKS) if "precision_report(jax.grad(" in src)
    _run_blocks_through(index, tmp_path, monkeypatch)
    ns = _RUN["namespace"]
    with jax.numpy_dtype_promotion("standard"):
        report = jaxamp.precision_report(jax.grad(ns["mixed_loss"]), ns["params"], ns["x"], ns["y"])
    assert str(report).strip() == sample


def test_readme_headline_names_fp8_and_the_numerics_monitor():
    headline = README.read_text().split("## Install")[0]
    assert '`autocast(loss_fn, "mixed_float8")`' in headline
    assert "`numerics_monitor`" in headline
    assert "CPU-minutes" in README.read_text().split("## A jitted")[0]
