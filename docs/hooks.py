"""MkDocs hooks (see mkdocs.yml): tables generated from the code, so they cannot go stale.

A page that contains the line ``<!-- autocast-rules-table -->`` gets, in its
place, the table of ``jaxamp.AUTOCAST_RULES`` grouped by rule kind.
"""

from __future__ import annotations

from typing import Any

RULES_MARKER = "<!-- autocast-rules-table -->"


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


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    if RULES_MARKER in markdown:
        markdown = markdown.replace(RULES_MARKER, autocast_rules_table())
    return markdown
