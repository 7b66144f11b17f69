"""Every ```python block of README.md runs, in order, as a reader would paste them.

Blocks share one namespace (later snippets build on earlier ones) and run under
JAX's default "standard" dtype promotion, which is what users have: the suite's
strict promotion would reject optax's own adam and schedules.
"""

import re
from pathlib import Path

import jax
import pytest

README = Path(__file__).resolve().parents[2] / "README.md"
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
    monkeypatch.chdir(tmp_path)  # snippets that write files write them here
    monkeypatch.setenv("MPLBACKEND", "Agg")
    # Run any earlier blocks not yet run (e.g. when one test is selected alone).
    with jax.numpy_dtype_promotion("standard"):
        while _RUN["done"] <= index:
            line, source = BLOCKS[_RUN["done"]]
            code = compile("\n" * line + source, str(README), "exec")
            _RUN["done"] += 1
            exec(code, _RUN["namespace"])
