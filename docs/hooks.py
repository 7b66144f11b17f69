"""MkDocs hooks (see mkdocs.yml): output generated from the code, so it cannot go stale.

- ``<!-- autocast-rules-table -->`` becomes the table of ``jaxamp.AUTOCAST_RULES``
  grouped by rule kind.
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
_PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


def autocast_rules_table() -> str:
    """Markdown table of ``jaxamp.AUTOCAST_RULES``: one row per rule kind."""
    import jaxamp

    by_kind: dict[str, list[str]] = {}
    for primitive, kind in jaxamp.AUTOCAST_RULES.items():
        by_kind.setdefault(str(kind), []).append(primitive)
    rows = ["| rule | primitives |", "|---|---|"]
    for kind, primitives in by_kind.items():
        names = ", ".join(f"`{p}`" for p in sorted(primitives))
        rows.append(f"| `{kind}` | {names} |")
    return "\n".join(rows)


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
