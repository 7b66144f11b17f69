"""What jaxamp's reports share: the aligned table their ``str()`` prints, and the
rule for which source files are jaxamp's own (a report names the user's line).

Used by ``_precision_report.py``, ``_wire/_communication_report.py``,
``_wire/_collectives.py``, ``_numerics/_numerics_report.py`` and
``_numerics/_sites.py``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence

__all__ = ["is_jaxamp_file", "text_table"]

# This installation's package folder, symbolic links resolved, with a trailing separator.
_JAXAMP_DIR = os.path.join(os.path.realpath(os.path.dirname(__file__)), "")
# Another installation's private modules (a program traced or dumped elsewhere).
_ANY_JAXAMP = re.compile(r"[/\\]jaxamp[/\\](_|flax[/\\])")


def text_table(rows: Sequence[Sequence[str]], indent: str = "", strip: bool = True) -> list[str]:
    """``rows`` as lines, each column left-aligned to its widest cell, two spaces apart.

    Args:
      rows: the header, then the rows; every row has the header's length.
      indent: put before every line.
      strip: drop the trailing spaces of each line.

    Returns:
      One line per row.

    >>> text_table([("op", "dtype"), ("dot", "bf16")])
    ['op   dtype', 'dot  bf16']
    """
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        indent + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows
    ]
    return [line.rstrip() for line in lines] if strip else lines


def is_jaxamp_file(file: str) -> bool:
    """Whether ``file`` is a module of jaxamp: this installation's or another's.

    >>> is_jaxamp_file(__file__), is_jaxamp_file("train.py")
    (True, False)
    """
    return os.path.realpath(file).startswith(_JAXAMP_DIR) or bool(_ANY_JAXAMP.search(file))
