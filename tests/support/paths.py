"""Where the tests find the repository's files, whatever the depth of the module asking."""

from __future__ import annotations

from pathlib import Path

__all__ = ["DATA", "REPO", "TESTS"]

#: ``tests/``
TESTS = Path(__file__).resolve().parents[1]
#: the repository's root (``pyproject.toml``, ``notebooks/``, ``scripts/``)
REPO = TESTS.parent
#: ``tests/data/``: the files tests read (real chat templates, ...)
DATA = TESTS / "data"
