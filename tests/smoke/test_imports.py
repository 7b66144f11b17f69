"""jaxamp's modules import one another without circles.

The graph is read with ``ast`` from the sources, not from ``sys.modules``: every
import counts, at the top of a module, inside a function (a lazy import, which
hides a circle from Python but not from a reader) and under ``TYPE_CHECKING``
(a circle of types is still a circle of meaning). An edge goes to the module
an import names: ``from jaxamp._wire import gather_params`` reads
``jaxamp/_wire/__init__.py``, ``from jaxamp._autocast._values import ACTIVATION``
reads ``_values`` alone (Python runs the package's ``__init__`` first, but that
is Python's order, not a dependency of the importing module).

Imports that run only when a function is called are listed in :data:`DEFERRED`
with the reason each is deferred; a new one fails here until it is named.

Rooms (``jaxamp._autocast``, ``jaxamp._wire``, ``jaxamp._policy``: the first
level below ``jaxamp``) form layers too: collapsed to rooms, the graph has no
circle but for the upward imports named in :data:`UPWARD`.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "jaxamp"

# (importing module, imported module) -> why the import runs inside a function.
DEFERRED: dict[tuple[str, str], str] = {
    ("jaxamp", "jaxamp.flax"): "it imports flax, so it loads on first use (module __getattr__)",
}

# (importing module, imported module) -> why a lower room reads a higher one.
UPWARD: dict[tuple[str, str], str] = {
    ("jaxamp._policy", "jaxamp._wire._warnings"): (
        "Policy.cast_to_compute warns where its wire dtypes cannot take effect; "
        "_warnings is a leaf that reads a policy through a protocol"
    ),
    ("jaxamp._policy", "jaxamp._wire._explicit"): (
        "Policy.cast_to_compute gathers and places the gradient reduction under an explicit "
        "mesh; _explicit is a leaf that reads a policy through _warnings' protocol"
    ),
}


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")[: len(module.split(".")) - node.level + is_package]
    return ".".join([*base, *([node.module] if node.module else [])])


def _targets(node: ast.AST, module: str, is_package: bool, modules: dict) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom):
        base = _absolute(module, is_package, node)
        # ``from package import submodule`` reads the submodule.
        return [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
    if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module":
        arg = node.args[0] if node.args else None
        return [arg.value] if isinstance(arg, ast.Constant) else []
    return []


def _imports(module: str, path: Path, modules: dict) -> dict[str, bool]:
    """The jaxamp modules ``module`` imports -> whether the import is deferred."""
    tree = ast.parse(path.read_text(), str(path))
    deferred = {
        id(inner)
        for fn in ast.walk(tree)
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef)
        for inner in ast.walk(fn)
    }
    found: dict[str, bool] = {}
    for node in ast.walk(tree):
        for target in _targets(node, module, path.name == "__init__.py", modules):
            for runs in _run_by_import(target, module):
                if runs in modules and runs != module:
                    found[runs] = found.get(runs, True) and id(node) in deferred
    return found


def _run_by_import(target: str, module: str) -> list[str]:
    """``target`` and the packages above it whose ``__init__`` the import runs first.

    From inside a package, Python has begun running its ``__init__`` already:
    ``jaxamp._autocast._caster`` importing ``jaxamp._autocast._values`` runs
    ``_values`` alone; ``jaxamp._policy`` importing ``jaxamp._wire._warnings``
    runs ``jaxamp/_wire/__init__.py`` first.
    """
    parts = target.split(".")
    above = [".".join(parts[:i]) for i in range(2, len(parts))]
    return [p for p in above if not module.startswith(p + ".") and module != p] + [target]


def _graph() -> dict[str, dict[str, bool]]:
    modules = _modules()
    return {m: _imports(m, path, modules) for m, path in modules.items()}


def _circles(graph: dict[str, dict[str, bool]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in graph[node]:
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_circles():
    circles = _circles(_graph())
    assert not circles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in circles)


def _room(module: str) -> str:
    return ".".join(module.split(".")[:2])


def _is_upward(module: str, target: str) -> bool:
    # The named import, or the package __init__ it runs first.
    return any(
        module == importing and (target == imported or imported.startswith(target + "."))
        for importing, imported in UPWARD
    )


def test_rooms_have_no_circles_but_the_named_upward_imports():
    graph = _graph()
    rooms: dict[str, dict[str, bool]] = {_room(m): {} for m in graph}
    for module, targets in graph.items():
        for target in targets:
            if _room(module) != _room(target) and not _is_upward(module, target):
                rooms[_room(module)][_room(target)] = False
    circles = _circles(rooms)
    assert not circles, "circles between rooms:\n" + "\n".join(" <-> ".join(c) for c in circles)
    assert all(target in graph[module] for module, target in UPWARD), "an UPWARD import is gone"


def test_every_deferred_import_is_named():
    deferred = {
        (module, target)
        for module, targets in _graph().items()
        for target, lazy in targets.items()
        if lazy
    }
    assert deferred == set(DEFERRED), (
        f"unnamed: {sorted(deferred - set(DEFERRED))}; gone: {sorted(set(DEFERRED) - deferred)}"
    )


def test_internal_modules_do_not_import_the_public_surface():
    # ``jaxamp``, ``jaxamp.testing`` and ``jaxamp.flax`` re-export; nothing below reads them.
    public = {"jaxamp", "jaxamp.testing", "jaxamp.flax"}
    upward = [
        (module, target)
        for module, targets in _graph().items()
        for target in targets
        if target in public and not module.startswith(target + ".") and module not in public
    ]
    assert not upward, upward
