"""Files written whole or not at all: the one atomic-write helper (a temp file beside the target, fsynced, then a
rename), so a reader or a crash never sees half a file; and the one measure of what a file or folder holds."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["atomic_write_bytes", "atomic_write_json", "atomic_write_text", "tree_bytes"]


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``path`` through a temp file beside it and a rename: readers see the old file or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    """:func:`atomic_write_bytes` of ``text`` in UTF-8."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: Path, data: Any) -> None:
    atomic_write_text(path, json.dumps(data, indent=2) + "\n")


def tree_bytes(path: Path) -> int:
    """The bytes of a file, or of every file under a folder, links followed (a hub snapshot links its blobs).

    Raises:
        OSError: ``path`` is not there, or cannot be read.
    """
    if not path.is_dir():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
