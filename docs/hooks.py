"""MkDocs hooks (see mkdocs.yml): output generated from the code, so it cannot go stale.

- ``<!-- autocast-rules-table -->`` becomes the table of ``jaxamp.AUTOCAST_RULES``
  grouped by rule kind, each primitive of one supported JAX only marked with its
  versions (``jaxamp._engine._compat.VERSION_SPECIFIC_PRIMITIVES``), and a line
  listing all such primitives. README.md holds the same table, written there by
  ``python docs/hooks.py`` (``tests/smoke/test_readme.py`` checks it is current).
- ``<!-- output-of-previous-block -->`` becomes a ``text`` block holding what
  the ```python block just before it prints, run at build time (with ``jax``,
  ``jnp``, ``np``, ``optax`` and ``jaxamp`` already imported). Sample outputs
  such as a ``precision_report`` table are then always the current ones.
"""

from __future__ import annotations

import contextlib
import io
import re
import textwrap
from typing import Any

RULES_MARKER = "<!-- autocast-rules-table -->"
OUTPUT_MARKER = "<!-- output-of-previous-block -->"
# README.md's copy of the table sits between these two lines.
README_RULES_BEGIN = (
    "<!-- begin autocast-rules-table: generated from jaxamp.AUTOCAST_RULES by "
    "`python docs/hooks.py`; do not edit -->"
)
README_RULES_END = "<!-- end autocast-rules-table -->"
_PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)

# What each kind does, in one line (the docs page and jaxamp/_autocast/_rules.py say more).
RULE_SUMMARIES = {
    "compute": "operands cast to the compute dtype, float32 accumulation "
    "(`preferred_element_type`), result cast to the compute dtype; the backward products too",
    "float32": "operands cast to float32, result float32",
    "follow": "operands traced with one dtype get one dtype again: float32 if one is a "
    "float32-rule result, else the compute dtype if one is an activation, else as traced",
    "keep": "runs exactly as traced (operands cast back to their traced dtypes)",
    "recurse": "rebuilt with JAX's public API around its rewritten inner jaxprs (control "
    "flow, `jit`, `custom_jvp`, `checkpoint`, `shard_map`) or for its operands' new dtype "
    "(the scatter family)",
}


def autocast_rules_table() -> str:
    """Markdown table of ``jaxamp.AUTOCAST_RULES``: one row per rule kind, then
    the primitives that exist in one supported JAX only, with their versions."""
    import jaxamp
    from jaxamp._engine._compat import VERSION_SPECIFIC_PRIMITIVES as versions

    def label(primitive: str) -> str:
        note = f" ({versions[primitive]})" if primitive in versions else ""
        return f"`{primitive}`{note}"

    by_kind: dict[str, list[str]] = {}
    for primitive, kind in jaxamp.AUTOCAST_RULES.items():
        by_kind.setdefault(str(kind), []).append(primitive)
    rows = ["| rule | what it does | primitives |", "|---|---|---|"]
    for kind in sorted(by_kind):
        names = ", ".join(label(p) for p in sorted(by_kind[kind]))
        rows.append(f"| `{kind}` | {RULE_SUMMARIES[kind]} | {names} |")
    by_version: dict[str, list[str]] = {}
    for primitive, version in versions.items():
        by_version.setdefault(version, []).append(f"`{primitive}`")
    notes = "; ".join(f"{', '.join(sorted(ns))} ({v})" for v, ns in sorted(by_version.items()))
    return "\n".join(rows) + f"\n\nPrimitives of one supported JAX only: {notes}."


def readme_with_rules_table(readme: str) -> str:
    """``readme`` with the table between its rules markers generated anew."""
    begin = readme.index(README_RULES_BEGIN) + len(README_RULES_BEGIN)
    end = readme.index(README_RULES_END, begin)
    return f"{readme[:begin]}\n{autocast_rules_table()}\n{readme[end:]}"


def printed_output(code: str) -> str:
    """What ``code`` prints, run in a fresh namespace with the usual imports."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import jaxamp

    namespace = {"jax": jax, "jnp": jnp, "np": np, "optax": optax, "jaxamp": jaxamp}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(textwrap.dedent(code), "<docs block>", "exec"), namespace)
    return out.getvalue().rstrip("\n")


def _insert_outputs(markdown: str) -> str:
    while OUTPUT_MARKER in markdown:
        position = markdown.index(OUTPUT_MARKER)
        blocks = list(_PYTHON_BLOCK.finditer(markdown, 0, position))
        if not blocks:
            raise ValueError(f"{OUTPUT_MARKER} needs a ```python block before it")
        output = printed_output(blocks[-1].group(1))
        markdown = markdown.replace(OUTPUT_MARKER, f"```text\n{output}\n```", 1)
    return markdown


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    if RULES_MARKER in markdown:
        markdown = markdown.replace(RULES_MARKER, autocast_rules_table())
    return _insert_outputs(markdown)


if __name__ == "__main__":  # python docs/hooks.py: rewrite README.md's rules table
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root))  # this checkout's jaxamp, not another installed one
    readme = root / "README.md"
    readme.write_text(readme_with_rules_table(readme.read_text()))
