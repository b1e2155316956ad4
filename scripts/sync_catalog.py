#!/usr/bin/env python3
"""Keep lemonkit's built-in catalog in step with Lemonade's ``server_models.json``.

    python scripts/sync_catalog.py PATH/TO/lemonade/server_models.json [--catalog FILE] [--write]

Lemonade's model names, checkpoints, labels, sizes and flags are facts: every row of Lemonade's catalog
becomes lemonkit's row of the same name, whatever its recipe (lemonkit lists the rows it cannot run as
unsupported). A row lemonkit already has keeps lemonkit's own fields (:data:`LEMONKIT_FIELDS`: the bundled
weights, aliases, chat format, context window); every other field is Lemonade's, so a field Lemonade drops
goes. Rows only lemonkit has are kept as they are; rows new to lemonkit are appended in Lemonade's order.

Overrides (``lemonkit/catalog/data/catalog_overrides.json``, :data:`OVERRIDES`) are the exception: a Lemonade name that
lemonkit runs on another engine than Lemonade's, from another checkpoint (Lemonade's ``Whisper-*`` rows are
whisper.cpp GGML files; lemonkit runs them on faster-whisper from CTranslate2 repos). An override's fields replace
Lemonade's in the written row, ``null`` removes one, so the catalog states what lemonkit really loads and
downloads.

Prints the differences. Exit status: 0 in step (or brought in step by ``--write``), 1 differences found, 2 bad
input.
The file is written atomically (temp file + rename) with a fixed key order, so a sync's diff is small.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lemonkit.catalog.hf_cache import atomic_write_text

CATALOG = Path(__file__).resolve().parents[1] / "lemonkit" / "catalog" / "data" / "server_models.json"
#: Lemonade name -> the fields lemonkit sets (``null``: removes) on Lemonade's row
OVERRIDES = CATALOG.with_name("catalog_overrides.json")

#: fields lemonkit adds to a row; Lemonade's value wins should Lemonade ever set one
LEMONKIT_FIELDS = ("max_context_window", "chat_format", "aliases", "bundled")
#: the order of a row's keys; keys not named here come between these and lemonkit's, alphabetically
KEY_ORDER = (
    "checkpoint",
    "checkpoints",
    "mmproj",
    "components",
    "recipe",
    "labels",
    "size",
    "suggested",
    "source",
    "registry_source",
    "recipe_options",
    "image_defaults",
)

Catalog = dict[str, dict[str, Any]]


def load(path: Path) -> Catalog:
    """A catalog file: a JSON object of rows, each an object with a string ``recipe``.

    Raises:
        ValueError: The file is unreadable or not shaped like a catalog.
    """
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object of models")
    for name, row in data.items():
        if not isinstance(row, dict) or not isinstance(row.get("recipe"), str):
            raise ValueError(f"{path}: {name}: expected an object with a string 'recipe'")
    return data


def _rank(key: str) -> tuple[int, int, str]:
    if key in KEY_ORDER:
        return (0, KEY_ORDER.index(key), "")
    if key in LEMONKIT_FIELDS:
        return (2, LEMONKIT_FIELDS.index(key), "")
    return (1, 0, key)


def _ordered(row: Mapping[str, Any]) -> dict[str, Any]:
    return {key: row[key] for key in sorted(row, key=_rank)}


def load_overrides(path: Path) -> Catalog:
    """The overrides file: a JSON object of Lemonade names -> objects of fields (absent file: none).

    Raises:
        ValueError: The file is unreadable or not shaped so.
    """
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: {exc}") from None
    if not isinstance(data, dict) or not all(isinstance(row, dict) for row in data.values()):
        raise ValueError(f"{path}: expected a JSON object of models, each an object of fields")
    return data


def overridden(row: Mapping[str, Any], override: Mapping[str, Any] | None) -> dict[str, Any]:
    """``row`` with ``override``'s fields set (``None`` values remove the field)."""
    out = {**row, **(override or {})}
    return {key: value for key, value in out.items() if value is not None}


def merge(lemonkit: Catalog, lemonade: Catalog, overrides: Catalog | None = None) -> Catalog:
    """lemonkit's catalog with Lemonade's facts brought over, then lemonkit's overrides (see the module docstring)."""
    overrides = overrides or {}
    merged: Catalog = {}
    for name, row in lemonkit.items():
        upstream = lemonade.get(name)
        if upstream is None:
            merged[name] = _ordered(row)
        else:
            own = {key: row[key] for key in LEMONKIT_FIELDS if key in row and key not in upstream}
            merged[name] = _ordered(overridden({**upstream, **own}, overrides.get(name)))
    for name, row in lemonade.items():
        if name not in merged:
            merged[name] = _ordered(overridden(row, overrides.get(name)))
    return merged


def _show(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def differences(old: Catalog, new: Catalog) -> list[str]:
    """One line per added row and per changed field, in ``new``'s order."""
    lines = []
    for name, row in new.items():
        before = old.get(name)
        if before is None:
            lines.append(f"+ {name}: new {row['recipe']} model")
            continue
        for key in [*row, *(k for k in before if k not in row)]:
            if before.get(key) != row.get(key):
                was = _show(before[key]) if key in before else "(absent)"
                now = _show(row[key]) if key in row else "(absent)"
                lines.append(f"~ {name}: {key}: {was} -> {now}")
    return lines


def dumps(catalog: Catalog) -> str:
    """The file's text: four-space indents, lists of plain values on one line."""

    def fmt(value: Any, indent: int) -> str:
        pad = " " * (indent + 4)
        if isinstance(value, dict) and value:
            items = ",\n".join(f"{pad}{_show(k)}: {fmt(v, indent + 4)}" for k, v in value.items())
            return "{\n" + items + "\n" + " " * indent + "}"
        if isinstance(value, list) and any(isinstance(v, (dict, list)) for v in value):
            items = ",\n".join(pad + fmt(v, indent + 4) for v in value)
            return "[\n" + items + "\n" + " " * indent + "]"
        return _show(value)

    return fmt(catalog, 0) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("lemonade", type=Path, help="Lemonade's server_models.json")
    parser.add_argument("--catalog", type=Path, default=CATALOG, help="lemonkit's catalog (default: %(default)s)")
    parser.add_argument(
        "--overrides", type=Path, default=OVERRIDES, help="lemonkit's overrides of Lemonade rows (default: %(default)s)"
    )
    parser.add_argument("--write", action="store_true", help="update the catalog file")
    args = parser.parse_args(argv)
    try:
        lemonade, lemonkit = load(args.lemonade), load(args.catalog)
        overrides = load_overrides(args.overrides)
        text = args.catalog.read_text(encoding="utf-8")
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    merged = merge(lemonkit, lemonade, overrides)
    lines = differences(lemonkit, merged)
    if not lines and dumps(merged) != text:
        lines.append(f"~ {args.catalog.name}: key order or layout differs from the canonical form")
    for line in lines:
        print(line)
    kept = sum(name not in lemonade for name in merged)
    print(f"{len(lines)} difference(s); {len(lemonade)} Lemonade models, {kept} lemonkit-only kept")
    if lines and args.write:
        atomic_write_text(args.catalog, dumps(merged))
        print(f"wrote {args.catalog}")
        return 0
    return 1 if lines else 0


if __name__ == "__main__":
    sys.exit(main())
