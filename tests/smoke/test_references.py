"""Every repository path, module and BENCHMARKS.md section the prose cites exists.

Code comments and docstrings (every comment and string of every ``.py`` file), the
docs, the READMEs, BENCHMARKS.md and CHANGELOG.md cite

- repository paths: ``jaxamp/_engine/_compat.py``, ``tests/integration/``,
  ``benchmarks/results/<script>.json`` (a placeholder checks the folder before it),
  ``docs/figures/*.png`` (a glob must match), ``BENCHMARKS.md``;
- modules: ``python -m benchmarks.step_overhead``, ``tests.helpers``, and private
  modules and names of jaxamp (``jaxamp._engine._compat``);
- markdown links and their anchors: ``[the runs](BENCHMARKS.md#older-runs)``,
  ``../troubleshooting.md#matmuls-are-misaligned``;
- BENCHMARKS.md sections, by anchor (``BENCHMARKS.md#older-runs``) or by title
  (``BENCHMARKS.md, "Older runs"``; a table's section also by its script's name,
  ``BENCHMARKS.md, "step_overhead"``).

A moved file or a renamed heading fails here, naming the citing file and line,
instead of leaving a reader at a dead end. Paths outside the repository's own
folders (``/tmp/ckpt``, ``~/data``, URLs) are not citations and are not checked.
"""

from __future__ import annotations

import functools
import importlib
import io
import re
import tokenize
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("jaxamp", "tests", "examples", "benchmarks", "docs")
TOP_LEVEL = ("README.md", "CHANGELOG.md", "BENCHMARKS.md", "mkdocs.yml", "pyproject.toml")
THIS_FILE = Path(__file__).resolve()  # its docstring and self-checks cite examples on purpose

# Citations that look like repository paths but are not, each with the reason.
# Keys: (citing file, cited text).
ALLOWED: dict[tuple[str, str], str] = {
    ("jaxamp/_engine/README.md", "equinox/internal/_finalise_jaxpr.py"): (
        "a file of the equinox repository, the model the engine follows"
    ),
}

_NOT_PATH_BEFORE = r"(?<![\w./~:-])"  # not inside a longer path, a URL or a user path
_PATH = re.compile(_NOT_PATH_BEFORE + rf"((?:{'|'.join(FOLDERS)})/[\w./<>\[\]{{}}*-]*)")
_ROOT_FILE = re.compile(_NOT_PATH_BEFORE + r"([A-Z][A-Z_]*\.md|LICENSE)(?![\w/-])")
# A file name relative to the citing file's folder or a folder above it (``_rules.py``,
# ``_engine/_compat.py``), in backticks: how jaxamp's modules and READMEs cite their
# neighbours. Checked under jaxamp/ only: elsewhere such names are mostly what a script
# writes (``digits.md`` to ``--out``) or what a user has.
_NEIGHBOUR = re.compile(r"(?<=`)((?:\.\./)*[\w-]+(?:/[\w-]+)*\.(?:py|md))(?=`)")
# A private module's name relative to the citing file's folder or a folder above it,
# with what it holds (``_caster.follow``, ``_engine._visit.walk``): how jaxamp's modules
# and READMEs cite functions. Checked under jaxamp/ only, like _NEIGHBOUR, and only
# where jaxamp has a module of that name.
_RELATIVE_NAME = re.compile(r"(?<=`)(_[a-z]\w*(?:\.\w+)+)(?=`|\()")
_MODULE = re.compile(_NOT_PATH_BEFORE + r"((?:benchmarks|examples|tests)(?:\.\w+)+)")
_PRIVATE = re.compile(_NOT_PATH_BEFORE + r"(jaxamp(?:\.\w+)*\._\w+(?:\.\w+)*)")
_FILE_EXTENSIONS = ("md", "py", "json", "png", "yml", "toml", "txt")
_LINK = re.compile(r"(?<=\]\()([^)\s]+)(?=\))")
_ANCHORED = re.compile(_NOT_PATH_BEFORE + r"((?:[\w.-]+/)*[\w.-]+\.md)#([\w-]+)")
_SECTION_TITLE = re.compile(r"BENCHMARKS\.md(?:,|:| section| \(section| \()?\s*[\"“]([^\"”]+)[\"”]")
_PLACEHOLDER = re.compile(r"[<\[{]")
_FENCE = re.compile(r"^([ \t]*)```.*?^\1```[ \t]*$", re.MULTILINE | re.DOTALL)
_HEADING = re.compile(r"^(#{1,6})[ \t]+(.+?)[ \t]*#*[ \t]*$", re.MULTILINE)
# docs/ pages that are BENCHMARKS.md, CHANGELOG.md (pymdownx.snippets includes).
_INCLUDES = {"docs/benchmarks.md": "BENCHMARKS.md", "docs/changelog.md": "CHANGELOG.md"}


def _sources() -> list[Path]:
    files = [ROOT / name for name in TOP_LEVEL] + [ROOT / "conftest.py"]
    for folder in FOLDERS:
        files += sorted((ROOT / folder).rglob("*.md")) + sorted((ROOT / folder).rglob("*.py"))
    return [f for f in files if f.is_file() and f.resolve() != THIS_FILE]


def _python_prose(source: str) -> list[tuple[int, str]]:
    """(first line, text) of every comment run and string literal of a Python file."""
    chunks: list[tuple[int, str]] = []
    comment = ""  # a run of comment lines, one text line per source line
    comment_line = 0
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            if not comment:
                comment_line = token.start[0]
            gap = token.start[0] - comment_line - comment.count("\n")
            comment += "\n" * gap + token.string.lstrip("#").strip()
            continue
        if token.type in (tokenize.NL, tokenize.NEWLINE) and comment:
            continue  # a comment run goes on over line ends
        if comment:
            chunks.append((comment_line, comment))
            comment = ""
        if token.type == tokenize.STRING or token.type == getattr(tokenize, "FSTRING_MIDDLE", -1):
            chunks.append((token.start[0], token.string))
    if comment:
        chunks.append((comment_line, comment))
    return chunks


def _prose(path: Path) -> list[tuple[int, str]]:
    text = path.read_text()
    if path.suffix == ".py":
        return _python_prose(text)
    return [(1, text)]


def _citations(chunks: list[tuple[int, str]], pattern: re.Pattern) -> list[tuple[int, re.Match]]:
    found = []
    for first_line, text in chunks:
        for match in pattern.finditer(text):
            found.append((first_line + text.count("\n", 0, match.start()), match))
    return found


def _path_resolves(cited: str, base: Path) -> bool:
    """Whether a cited path exists (relative to the repository root, or to ``base``)."""
    placeholder = _PLACEHOLDER.search(cited)
    if placeholder:  # benchmarks/results/<script>.json: the folder before the placeholder
        cited = cited[: placeholder.start()].rpartition("/")[0]
    for start in (ROOT, base):
        if "*" in cited:
            if any(start.glob(cited)):
                return True
        elif (start / cited).exists():
            return True
    return False


def _module_resolves(dotted: str) -> bool:
    """A module of the repository (``benchmarks.report``), or a name inside one."""
    parts = dotted.split(".")
    if parts[-1] in _FILE_EXTENSIONS:
        return True  # a file name (examples.md, benchmarks.md): checked as a path
    path = ROOT
    for part in parts:
        if (path / part).is_dir():
            path = path / part
        else:  # the rest, if any, names something inside the module
            return (path / f"{part}.py").is_file()
    return True


def _private_name_resolves(dotted: str) -> bool:
    """``jaxamp._engine._compat`` or ``jaxamp._autocast._rules.AUTOCAST_RULES`` exists."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:end]))
        except ImportError:
            continue
        for name in parts[end:]:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


def markdown_slug(text: str) -> str:
    """The anchor Python-Markdown's toc extension (the docs site) gives a heading.

    >>> markdown_slug("compile_scaling --model gpt: compile time on a GPT")
    'compile_scaling-model-gpt-compile-time-on-a-gpt'
    """
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def github_slug(text: str) -> str:
    """The anchor GitHub gives a heading of a rendered markdown file.

    >>> github_slug("compile_scaling --model gpt: compile time on a GPT")
    'compile_scaling---model-gpt-compile-time-on-a-gpt'
    """
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def _headings(markdown: str) -> list[tuple[str, str | None]]:
    """(text as rendered, explicit ``{ #id }``) of each heading outside fenced code."""
    headings = []
    for match in _HEADING.finditer(_FENCE.sub("", markdown)):
        title = match.group(2)
        explicit = re.search(r"\s*\{\s*#([\w-]+)\s*\}$", title)
        if explicit:
            title = title[: explicit.start()]
        title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", title)  # a link renders as its text
        headings.append((title.replace("`", "").replace("*", ""), explicit and explicit[1]))
    return headings


def _heading_texts(markdown: str) -> list[str]:
    return [title for title, _ in _headings(markdown)]


def _slugs(headings, slug, suffix: str) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for title, explicit in headings:
        base = explicit or slug(title)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else base + suffix.format(count))  # duplicate titles
    return found


@functools.cache
def anchors(path: Path) -> frozenset[str]:
    """The heading anchors of a markdown file.

    A docs/ page is read on the docs site only; a file outside docs/ on GitHub and,
    when a docs page includes it (BENCHMARKS.md, CHANGELOG.md), on the site too:
    its anchors are the ones both give.
    """
    rel = _rel(path)
    if rel in _INCLUDES:
        path = ROOT / _INCLUDES[rel]
    headings = _headings(path.read_text())
    site = _slugs(headings, markdown_slug, "_{}")
    if rel.startswith("docs/") and rel not in _INCLUDES:
        return frozenset(site)
    return frozenset(site & _slugs(headings, github_slug, "-{}"))


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name


# A check takes the citing file and the match, and says what is wrong (None: nothing).
def _check_path(citing: Path, match: re.Match) -> str | None:
    if not _path_resolves(match.group(1).rstrip(".-"), citing.parent):
        return "does not exist"
    return None


def _check_neighbour(citing: Path, match: re.Match) -> str | None:
    cited = match.group(1)
    if not _rel(citing).startswith("jaxamp/") or cited.split("/")[0] in FOLDERS:
        return None  # see _NEIGHBOUR; repository paths are checked as such
    folders = [citing.parent, *(p for p in citing.parent.parents if p.is_relative_to(ROOT))]
    if not any((folder / cited).exists() for folder in folders):
        return "is not a file next to this one or in a folder above it"
    return None


def _relative_name_resolves(dotted: str, folder: Path) -> bool | None:
    """Whether ``_module.name`` relative to ``folder`` exists; None if no such module."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        path = folder.joinpath(*parts[:end])
        if path.with_suffix(".py").is_file() or (path / "__init__.py").is_file():
            module = ".".join(path.relative_to(ROOT).parts)
            return _private_name_resolves(f"{module}.{'.'.join(parts[end:])}".rstrip("."))
    return None


def _check_relative_name(citing: Path, match: re.Match) -> str | None:
    dotted = match.group(1)
    if not _rel(citing).startswith("jaxamp/") or dotted.rsplit(".", 1)[-1] in _FILE_EXTENSIONS:
        return None  # see _RELATIVE_NAME; file names are checked by _check_neighbour
    folders = [citing.parent, *(p for p in citing.parent.parents if p.is_relative_to(ROOT))]
    for folder in folders:
        found = _relative_name_resolves(dotted, folder)
        if found is not None:
            return None if found else "does not exist in that module"
    # A README may name a module of a sibling package once it has introduced it
    # (``_compat.bind_eqn`` for jaxamp/_engine/_compat.py): any module of that name will do.
    module = dotted.split(".")[0]
    homes = {p.parent for p in (ROOT / "jaxamp").rglob(f"{module}.py")}
    homes |= {p.parent for p in (ROOT / "jaxamp").rglob(f"{module}/__init__.py")}
    if not homes:  # not one of ours: JAX's own ``_prim.expand``, say (a renamed module's
        return None  # file is still caught where it is cited as a file, ``_rules.py``)
    if not any(_relative_name_resolves(dotted, home) for home in homes):
        return "does not exist in that module"
    return None


def _check_module(citing: Path, match: re.Match) -> str | None:
    if not _module_resolves(match.group(1).rstrip(".")):
        return "is not a module of the repository"
    return None


def _check_private_name(citing: Path, match: re.Match) -> str | None:
    if not _private_name_resolves(match.group(1).rstrip(".")):
        return "does not exist in jaxamp"
    return None


def _check_link(citing: Path, match: re.Match) -> str | None:
    target = match.group(1)
    if citing.suffix != ".md" or re.match(r"[a-z]+:", target) or target.startswith("/"):
        return None  # not a markdown link, a URL, or a site-absolute link
    if target.startswith("#"):
        return None if target[1:] in anchors(citing) else "is not a heading anchor here"
    if not (citing.parent / target.split("#")[0]).exists():
        return "links to a file that does not exist"
    return None


def _check_anchor(citing: Path, match: re.Match) -> str | None:
    file, anchor = match.groups()
    found = [p.resolve() for p in (citing.parent / file, ROOT / file) if p.is_file()]
    if not found or "/docs/api/" in found[0].as_posix():
        return None  # a missing file is reported as a path; API anchors come from mkdocstrings
    return None if anchor in anchors(found[0]) else f"is not a heading anchor of {file}"


def _check_section_title(citing: Path, match: re.Match) -> str | None:
    title = re.sub(r"\s+", " ", match.group(1))  # a title may wrap over lines
    headings = _heading_texts((ROOT / "BENCHMARKS.md").read_text())
    # A table's heading is "script: what it measures"; the script's name alone cites it too.
    names = {heading.split(": ")[0] for heading in headings if ": " in heading}
    if title not in headings and title not in names:
        return f"({title!r}) is not a section title of BENCHMARKS.md"
    return None


CHECKS = (
    (_PATH, _check_path),
    (_ROOT_FILE, _check_path),
    (_NEIGHBOUR, _check_neighbour),
    (_RELATIVE_NAME, _check_relative_name),
    (_MODULE, _check_module),
    (_PRIVATE, _check_private_name),
    (_LINK, _check_link),
    (_ANCHORED, _check_anchor),
    (_SECTION_TITLE, _check_section_title),
)


def _problems_in(path: Path) -> list[str]:
    """``file:line: 'cited' what is wrong`` for each stale citation in ``path``."""
    chunks = _prose(path)
    rel = _rel(path)
    problems = []
    for pattern, check in CHECKS:
        for line, match in _citations(chunks, pattern):
            why = check(path, match)
            cited = match.group(0).rstrip(".-")
            if why and (rel, cited) not in ALLOWED:
                problems.append(f"{rel}:{line}: {cited!r} {why}")
    return problems


SOURCES = _sources()


def test_the_sources_and_patterns_cover_what_is_cited():
    names = {_rel(p) for p in SOURCES}
    assert {"README.md", "CHANGELOG.md", "docs/guide.md", "jaxamp/_policy.py"} <= names
    readme = _prose(ROOT / "README.md")
    assert "examples/digits.py" in {m.group(1) for _, m in _citations(readme, _PATH)}
    comment = _python_prose("x = 1\n# see BENCHMARKS.md,\n\n# \"Older\n# runs\"\ny = 'z'\n")
    assert comment == [(2, 'see BENCHMARKS.md,\n\n"Older\nruns"'), (6, "'z'")]
    cited = _citations([(3, 'a\nBENCHMARKS.md, "Older\n    runs"')], _SECTION_TITLE)
    assert [(line, m.group(1)) for line, m in cited] == [(4, "Older\n    runs")]
    assert "older-runs" in anchors(ROOT / "BENCHMARKS.md")
    assert anchors(ROOT / "docs" / "benchmarks.md") == anchors(ROOT / "BENCHMARKS.md")


def test_placeholders_globs_and_user_paths():
    assert _path_resolves("benchmarks/results/<script>[_<model>].json", ROOT)
    assert not _path_resolves("benchmarks/gone/<script>.json", ROOT)
    assert _path_resolves("docs/figures/*.png", ROOT)
    assert not _path_resolves("docs/figures/*.gif", ROOT)
    user_paths = "/tmp/jaxamp/tests/x.py ~/docs/a.md https://x.org/docs/b.md ../docs/c.py"
    assert not [m.group(1) for m in _PATH.finditer(user_paths)]
    readme = ROOT / "jaxamp" / "_autocast" / "README.md"
    assert _check_neighbour(readme, _NEIGHBOUR.search("`_rules.py`")) is None
    assert _check_neighbour(readme, _NEIGHBOUR.search("`_engine/_compat.py`")) is None
    assert _check_neighbour(readme, _NEIGHBOUR.search("`_gone.py`"))
    for name, ok in [
        ("_caster.keep", True),
        ("_engine._visit.walk", True),
        ("_visit.walk", True),  # a sibling package's module
        ("_caster.gone", False),
        ("_prim.expand", True),  # no module of jaxamp: someone else's private name
    ]:
        assert (_check_relative_name(readme, _RELATIVE_NAME.search(f"`{name}`")) is None) == ok
    assert _module_resolves("benchmarks.report") and not _module_resolves("benchmarks.gone")
    assert _module_resolves("examples.md")
    assert _private_name_resolves("jaxamp._policy.Policy")
    assert not _private_name_resolves("jaxamp._policy.Gone")
    assert not _private_name_resolves("jaxamp._gone")


STALE = """# Notes

See `jaxamp/_gone.py`, the runs (BENCHMARKS.md#gone-runs), BENCHMARKS.md, "Gone
section", `python -m benchmarks.gone`, `jaxamp._autocast._gone`, [here](#nowhere),
[there](nothing.md) and tests/gone/.
Fine: `jaxamp/_policy.py`, BENCHMARKS.md#older-runs, BENCHMARKS.md, "Older
runs", BENCHMARKS.md, "step_overhead", [notes](#notes), /tmp/tests/gone.py,
`benchmarks/results/<script>.json`.
"""


def test_stale_citations_are_found(tmp_path):
    markdown = tmp_path / "notes.md"
    markdown.write_text(STALE)
    python = tmp_path / "notes.py"  # the same text as comments
    python.write_text("".join(f"# {line}\n" for line in STALE.splitlines()) + "x = 1\n")
    for path in (markdown, python):
        found = [problem.split(": ", 1)[1] for problem in _problems_in(path)]
        cited = [problem[: problem.rindex("' ") + 1] for problem in found]
        links = ["'#nowhere'", "'nothing.md'"] if path == markdown else []
        assert cited == [
            "'jaxamp/_gone.py'",
            "'tests/gone/'",
            "'benchmarks.gone'",
            "'jaxamp._autocast._gone'",
            *links,
            "'BENCHMARKS.md#gone-runs'",
            repr('BENCHMARKS.md, "Gone\nsection"'),
        ], found


@pytest.mark.parametrize("path", SOURCES, ids=[_rel(p) for p in SOURCES])
def test_every_cited_path_module_and_section_exists(path):
    problems = _problems_in(path)
    assert not problems, "stale citations:\n" + "\n".join(problems)


def test_allowed_exceptions_are_still_cited():
    for (citing, cited), why in ALLOWED.items():
        assert why, f"give the reason for allowing {cited!r} in {citing}"
        assert cited in (ROOT / citing).read_text(), f"{citing} no longer cites {cited!r}"
