"""Every exception lives in ``lemonkit.errors``, each with a docstring, and the hierarchy drawn at its top is the
real one."""

from __future__ import annotations

import ast
from pathlib import Path

import lemonkit
from lemonkit import errors

PACKAGE = Path(lemonkit.__file__).parent


def _drawn(cls: type, depth: int = 0) -> list[str]:
    builtins = [b.__name__ for b in cls.__bases__ if b is not object and not b.__module__.startswith("lemonkit")]
    line = "    " * depth + f"{cls.__name__} {cls.status}" + (f" ({', '.join(builtins)})" if builtins and depth else "")
    subs = sorted((c for c in cls.__subclasses__() if c.__module__ == "lemonkit.errors"), key=lambda c: c.__name__)
    return [line, *(x for sub in subs for x in _drawn(sub, depth + 1))]


def test_the_drawn_hierarchy_is_the_real_one() -> None:
    tree = "\n".join("    " + line for line in _drawn(errors.LemonkitError))
    assert tree in (errors.__doc__ or "")


def test_every_public_exception_is_defined_in_errors_with_a_docstring() -> None:
    for path in PACKAGE.rglob("*.py"):
        if path.name == "errors.py" and path.parent == PACKAGE:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                bases = {getattr(b, "id", getattr(b, "attr", "")) for b in node.bases}
                assert not bases & {"Exception", "LemonkitError", "RuntimeError", "ValueError"}, (path, node.name)
    for name in errors.__all__:
        cls = getattr(errors, name)
        if isinstance(cls, type) and issubclass(cls, Exception):
            assert cls.__doc__ and cls.__doc__.strip(), name


def test_exported_members() -> None:
    """Every exception ``lemonkit.errors`` defines is in its ``__all__`` (as httpx tests its own), and ``__all__``
    names nothing else but what it defines."""
    defined = {
        name
        for name, value in vars(errors).items()
        if not name.startswith("_")
        and getattr(value, "__module__", None) == "lemonkit.errors"
        and (isinstance(value, type) or callable(value))
    }
    assert sorted(errors.__all__) == sorted(defined)
    assert errors.__all__ == sorted(errors.__all__)
