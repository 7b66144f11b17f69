"""The distribution: its name is free on the package index, the README installs it by that name.

``jaxamp`` on the package index is an unrelated project (0.0.4, "automatic mixed
precision in JAX"): ``pip install jaxamp`` installs it. This project is
distributed as ``jaxamp-train`` and imported as ``jaxamp``. The wheel itself is
built and installed in a fresh venv by ``.ci/run``.
"""

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DISTRIBUTION = "jaxamp-train"
# Names taken on the package index that a normalised name must not equal or
# collapse to once separators are dropped (PEP 503: runs of -_. are one "-").
TAKEN = ("jaxamp",)


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_distribution_name_is_not_confusable_with_a_taken_one():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["name"] == DISTRIBUTION
    for taken in TAKEN:
        assert normalize(project["name"]) != normalize(taken)
        assert normalize(project["name"]).replace("-", "") != normalize(taken).replace("-", "")


def test_the_wheel_holds_the_jaxamp_import_package():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setuptools["packages"]["find"]["include"] == ["jaxamp*"]


def test_readme_installs_the_distribution_by_name_and_explains_it():
    readme = (ROOT / "README.md").read_text()
    assert re.search(rf'^pip install "{DISTRIBUTION}\[flax\]"', readme, re.MULTILINE)
    # A non-editable install from a clone, and a word on why the name differs.
    assert re.search(r'^pip install "\.\[flax\]"', readme, re.MULTILINE)
    assert "`pip install jaxamp` would install an unrelated project" in readme
    assert not re.search(r"pip install -?e? ?\"?jaxamp[\"\[ \n]", readme)


def test_docs_extra_formats_signatures():
    # mkdocstrings-python formats signatures with ruff (or black) when one is installed.
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert any(re.match(r"(ruff|black)\b", requirement) for requirement in extras["docs"])
