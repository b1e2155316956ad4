"""Layers import only downward: a module may import its own layer and the layers below it, never one above.

From the bottom: formats (wire shapes, files, parsers: no model, no state) -> catalog (what a model is and where
its files are) -> engines (the sidecars and their engines, downloads) -> serving (the model manager and what it
runs on) -> the server and the Python client, side by side and never importing each other -> the notebook layer
(``api``, widgets, magics, the CLI). The README's architecture section draws the same picture.
"""

from __future__ import annotations

import ast
from pathlib import Path

import lemonkit

PACKAGE = Path(lemonkit.__file__).parent

FORMATS, CATALOG, ENGINES, SERVING, SIDES, NOTEBOOK = range(6)
#: each top-level package (or module) of lemonkit and its layer
LAYERS: dict[str, int] = {
    **dict.fromkeys(("_version", "errors", "formats"), FORMATS),
    "catalog": CATALOG,
    **dict.fromkeys(("backends", "downloads"), ENGINES),
    "serving": SERVING,
    **dict.fromkeys(("server", "client"), SIDES),
    **dict.fromkeys(("api", "widgets", "magics", "commands", "cli", "__main__", "__init__", "testing"), NOTEBOOK),
}
#: the server and the Python client share a layer and must not import each other
SIDE_BY_SIDE = {"server", "client"}
#: the one upward import, by design: a model list shown in a notebook is the model browser widget, imported when
#: Jupyter asks for its display (never on import; without anywidget it is a static table)
DISPLAY_HOOKS = {("client/results.py", "widgets")}


def _top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(path: Path) -> set[str]:
    """The lemonkit modules ``path`` imports, at the top or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "lemonkit":
                found |= {f"lemonkit.{a.name}" for a in node.names}
            elif node.module.startswith("lemonkit."):
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("lemonkit.")}
    return found


def test_every_module_has_a_layer() -> None:
    tops = {p.relative_to(PACKAGE).parts[0].removesuffix(".py") for p in PACKAGE.rglob("*.py")}
    assert tops - {"data"} <= set(LAYERS), sorted(tops - set(LAYERS))


def test_layers_import_only_downward() -> None:
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        source = (
            relative.parts[0].removesuffix(".py")
            if len(relative.parts) > 1 or relative.name != "__init__.py"
            else "__init__"
        )
        for target in sorted(_top(m) for m in _imports(path)):
            if target not in LAYERS or target == source or (str(relative), target) in DISPLAY_HOOKS:
                continue
            wrong = LAYERS[target] > LAYERS[source] or {source, target} == SIDE_BY_SIDE
            if wrong:
                upward.append(f"{relative} imports lemonkit.{target}")
    assert not upward, "\n".join(upward)


def test_no_two_modules_share_a_name() -> None:
    """A name says one job: no module or package is named like another anywhere in the tree (``server/speech.py``
    and a client ``speech.py`` would be two things under one name)."""
    seen: dict[str, list[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        if path.stem not in {"__init__", "__main__"}:
            seen.setdefault(path.stem, []).append(str(path.relative_to(PACKAGE)))
        elif path.stem == "__init__" and path.parent != PACKAGE:
            seen.setdefault(path.parent.name, []).append(f"{path.parent.relative_to(PACKAGE)}/")
    assert not {name: where for name, where in seen.items() if len(where) > 1}


def test_the_top_holds_only_packages_and_the_notebook_layer() -> None:
    """The top of the package is its role packages, the notebook layer and ``errors``/``_version``."""
    tops = {p.name.removesuffix(".py") for p in PACKAGE.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()}
    assert tops == set(LAYERS), sorted(tops ^ set(LAYERS))


def test_no_package_shadows_a_public_name() -> None:
    """Importing ``lemonkit.<package>`` sets that attribute of ``lemonkit``: a package named like a public function
    (``lemonkit.models()``) would replace it."""
    tops = {p.name.removesuffix(".py") for p in PACKAGE.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()}
    assert not tops & set(lemonkit.__all__)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported_at_import_time(path: Path, modules: set[str]) -> set[str]:
    """The lemonkit modules ``path`` imports when it is imported: at its top level (and in its classes' bodies and
    top-level blocks), not inside functions nor under ``if TYPE_CHECKING``."""
    found: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse)
                continue
            names: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                while name.startswith("lemonkit") and name not in modules and "." in name:
                    name = name.rsplit(".", 1)[0]
                if name in modules:
                    found.add(name)
                    break
            for field in ("body", "orelse", "finalbody"):
                inner = getattr(node, field, None)
                if isinstance(inner, list) and inner and isinstance(inner[0], ast.stmt):
                    visit(inner)
            for handler in getattr(node, "handlers", []):
                visit(handler.body)

    visit(ast.parse(path.read_text(encoding="utf-8")).body)
    return found - {_module_name(path)}


def test_no_import_circle_at_import_time() -> None:
    """No module needs, while it is being imported, a module that needs it back (a circle runs in whatever order
    the first import happens to start it, and breaks on a name not yet defined)."""
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {name: _imported_at_import_time(path, set(paths)) for name, path in paths.items()}
    circles = []
    for start in sorted(graph):
        stack, seen = [(start, [start])], set()
        while stack:
            name, trail = stack.pop()
            for nxt in sorted(graph[name]):
                if nxt == start:
                    circles.append(" -> ".join([*trail, start]))
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, [*trail, nxt]))
    assert not circles, "\n".join(sorted(set(circles))[:10])
