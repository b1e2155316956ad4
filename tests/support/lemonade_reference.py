"""Lemonade's own ``server_models.json``, the source of lemonkit's catalog facts, for the tests that compare.

It lives outside the repo, at ``../shared/reference/`` of a checkout (or of a directory above a worktree); the
tests that need it skip when it is not there.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.support.paths import REPO

_RELATIVE = Path("shared/reference/lemonade-server_models.json")
#: the reference file, or None when no directory above the repo holds one
REFERENCE: Path | None = next((p / _RELATIVE for p in REPO.parents if (p / _RELATIVE).is_file()), None)


def reference_path() -> Path:
    """The reference file; skips the calling test when it is absent."""
    if REFERENCE is None:
        pytest.skip("Lemonade's server_models.json is not at ../shared/reference/")
    return REFERENCE


def lemonade_catalog() -> dict[str, Any]:
    """Lemonade's catalog rows (skips the calling test when the reference file is absent)."""
    rows: dict[str, Any] = json.loads(reference_path().read_text(encoding="utf-8"))
    return rows


def overridden_catalog() -> dict[str, Any]:
    """Lemonade's rows as lemonkit ships them: with ``lemonkit/catalog/data/catalog_overrides.json`` applied (its fields
    set, its ``null`` fields removed; see ``scripts/sync_catalog.py``)."""
    path = REPO / "lemonkit" / "catalog" / "data" / "catalog_overrides.json"
    overrides = json.loads(path.read_text(encoding="utf-8"))
    return {
        name: {k: v for k, v in {**row, **overrides.get(name, {})}.items() if v is not None}
        for name, row in lemonade_catalog().items()
    }
