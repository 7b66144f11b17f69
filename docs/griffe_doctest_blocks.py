"""A griffe extension that renders bare ``>>>`` examples in docstrings as code.

jaxamp's docstrings carry runnable ``>>>`` examples (pytest runs them as
doctests) without an ``Examples:`` header. Markdown would otherwise read them
as prose, and ``[8, 4, 16]`` in an output line as a broken link. This wraps
each run of ``>>>`` lines, with its continuation and output lines up to the
next blank line, in a fenced ``pycon`` block. Loaded from mkdocs.yml.
"""

from __future__ import annotations

from typing import Any

import griffe


def fence_doctests(text: str) -> str:
    """Returns ``text`` with every bare doctest block fenced as ``pycon``.

    >>> print(fence_doctests("Intro.\\n\\n>>> 1 + 1\\n2\\n\\nMore."))
    Intro.
    <BLANKLINE>
    ```pycon
    >>> 1 + 1
    2
    ```
    <BLANKLINE>
    More.
    """
    out: list[str] = []
    in_fence = in_doctest = False
    indent = ""
    for line in text.splitlines():
        stripped = line.strip()
        if in_doctest and not stripped:
            out.append(f"{indent}```")
            in_doctest = False
        if stripped.startswith("```") and not in_doctest:
            in_fence = not in_fence
        elif stripped.startswith(">>>") and not in_fence and not in_doctest:
            indent = line[: len(line) - len(line.lstrip())]
            out.append(f"{indent}```pycon")
            in_doctest = True
        out.append(line)
    if in_doctest:
        out.append(f"{indent}```")
    return "\n".join(out)


class DoctestBlocks(griffe.Extension):
    """Fences the bare doctest examples of every docstring griffe loads."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None and ">>>" in obj.docstring.value:
            obj.docstring.value = fence_doctests(obj.docstring.value)
