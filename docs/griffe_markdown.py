"""A griffe extension that turns jaxamp's reST-flavoured docstrings into clean Markdown.

Loaded by mkdocstrings (see mkdocs.yml). Two rewrites, both on the text only:

- Bare ``>>>`` examples (pytest runs them as doctests; they have no
  ``Examples:`` header) are fenced as ``pycon`` code. Markdown would otherwise
  read them as prose, and ``[8, 4, 16]`` in an output line as a broken link.
- Sphinx roles such as ``:func:`jaxamp.loss_scaling``` or ``:data:`X``` become
  inline code, instead of showing the role name as text.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:func|meth|class|data|attr|mod|obj|exc|const):`~?([^`]+)`")


def fence_doctests(text: str) -> str:
    """Returns ``text`` with every bare doctest block fenced as ``pycon``.

    >>> fence_doctests("Intro.\\n\\n>>> 1 + 1\\n2\\n\\nMore.").splitlines()
    ['Intro.', '', '```pycon', '>>> 1 + 1', '2', '```', '', 'More.']
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


def strip_roles(text: str) -> str:
    """Replaces Sphinx cross-reference roles with inline code.

    >>> strip_roles("See :func:`jaxamp.loss_scaling` and :class:`~jaxamp.Policy`.")
    'See `jaxamp.loss_scaling` and `jaxamp.Policy`.'
    """
    return _ROLE.sub(lambda m: f"`{m.group(1)}`", text)


class DocstringMarkdown(griffe.Extension):
    """Applies :func:`fence_doctests` and :func:`strip_roles` to every docstring."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = strip_roles(fence_doctests(obj.docstring.value))
