"""Batches of the OpenAI Batch API (``/v1/batches``), per user, on disk under the cache: what makes them durable.

A batch lives in ``<cache>/batches/<user>/<id>/`` (the user as a hash): ``batch.json``, its object and who owns it,
rewritten atomically at each change of status; and ``journal.jsonl``, one line appended (and flushed to the OS, so a
killed server keeps it) as each request finishes, holding its output or error line. After a restart the journal
says which requests are done, so none is computed again; a line torn by the kill is cut off. The output and error
files are written from the journal once the batch ends, as files of the Files API
(:class:`~lemonkit.serving.file_store.FileStore`).

An id from a request is checked (``batch_`` and URL-safe characters) before it names a path.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

try:
    import fcntl
except ImportError:  # Windows: one server per cache
    fcntl = None  # type: ignore[assignment]

from lemonkit.catalog.hf_cache import inside, read_json_object, safe_relpath
from lemonkit.formats.files import atomic_write_json

__all__ = ["FINAL", "BatchRecord", "BatchStore", "Journal", "new_id", "valid_id"]

#: statuses a batch does not leave
FINAL = ("failed", "completed", "expired", "cancelled")
_ID = re.compile(r"batch_[A-Za-z0-9_-]{8,64}")


def new_id() -> str:
    return "batch_" + secrets.token_hex(12)


def valid_id(batch_id: str) -> bool:
    return bool(_ID.fullmatch(batch_id))


@dataclass
class BatchRecord:
    """A batch as kept: its API object and its owner (``name``, ``admin``, ``shared``: the identity its requests
    run as, after a restart too)."""

    folder: Path
    batch: dict[str, Any]
    owner: dict[str, Any]

    @property
    def id(self) -> str:
        return str(self.batch["id"])

    @property
    def journal_path(self) -> Path:
        return self.folder / "journal.jsonl"


class Journal:
    """The finished requests of one batch: read once (a torn last line cut off), then appended to.

    Each record is ``{"i": line index, "ok": bool, "line": the output or error line}``.

    Attributes:
        done: line index -> whether it succeeded, for every journaled request.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.done: dict[int, bool] = {}
        good = 0
        if path.exists():
            for raw in self._lines():
                if not raw.endswith(b"\n"):
                    break  # torn by a kill: the request runs again
                try:
                    record = json.loads(raw)
                except ValueError:
                    break
                self.done[int(record["i"])] = bool(record["ok"])
                good += len(raw)
            with open(path, "r+b") as f:
                f.truncate(good)
        self._out: IO[bytes] | None = open(path, "ab")

    def _lines(self) -> Iterator[bytes]:
        with open(self.path, "rb") as f:
            yield from f

    def records(self) -> Iterator[dict[str, Any]]:
        """The journaled records, in the order they finished (blocking)."""
        for raw in self._lines():
            if raw.endswith(b"\n"):
                yield json.loads(raw)

    def append(self, records: list[dict[str, Any]]) -> None:
        """Journal finished requests (blocking): written and flushed, so a killed process keeps them."""
        if self._out is None:
            return
        self._out.write(b"".join(json.dumps(r).encode() + b"\n" for r in records))
        self._out.flush()
        for r in records:
            self.done[int(r["i"])] = bool(r["ok"])

    def close(self) -> None:
        if self._out is not None:
            os.fsync(self._out.fileno())
            self._out.close()
            self._out = None


class BatchStore:
    """The Batch API's batches (blocking methods: call them off the event loop).

    Args:
        cache_dir: The lemonkit cache; batches live in its ``batches/``.
    """

    def __init__(self, cache_dir: Path) -> None:
        self.root = cache_dir / "batches"

    def _folder(self, user: str, batch_id: str) -> Path | None:
        if not valid_id(batch_id):
            return None
        user_folder = hashlib.sha256(user.encode()).hexdigest()[:32]
        return inside(self.root, safe_relpath(f"{user_folder}/{batch_id}", what="batch id"))

    def create(self, owner: dict[str, Any], batch: dict[str, Any]) -> BatchRecord:
        folder = self._folder(owner["name"], batch["id"])
        assert folder is not None
        folder.mkdir(parents=True, exist_ok=True)
        record = BatchRecord(folder, batch, owner)
        self.save(record)
        return record

    def save(self, record: BatchRecord) -> None:
        """Write the record's object (atomically: a reader sees the old or the new one)."""
        atomic_write_json(record.folder / "batch.json", {"batch": record.batch, "owner": record.owner})

    def _read(self, folder: Path) -> BatchRecord | None:
        try:
            data = read_json_object(folder / "batch.json")
        except ValueError:
            return None
        if not data:
            return None
        return BatchRecord(folder, data["batch"], data["owner"])

    def get(self, user: str, batch_id: str) -> BatchRecord | None:
        """``user``'s batch ``batch_id``, or ``None`` (none, another user's, or not an id)."""
        folder = self._folder(user, batch_id)
        return None if folder is None else self._read(folder)

    def of_user(self, user: str) -> list[BatchRecord]:
        """``user``'s batches, newest first."""
        folder = self._folder(user, "batch_00000000")
        assert folder is not None
        return self._sorted(folder.parent.glob("batch_*"))

    def unfinished(self) -> list[BatchRecord]:
        """Every user's batches that have not ended (what a starting server resumes), oldest first."""
        records = [r for r in self._sorted(self.root.glob("*/batch_*")) if r.batch["status"] not in FINAL]
        records.reverse()
        return records

    def _sorted(self, folders: Iterator[Path]) -> list[BatchRecord]:
        records = [r for f in folders if f.is_dir() and (r := self._read(f)) is not None]
        records.sort(key=lambda r: (-int(r.batch["created_at"]), r.id))
        return records

    def lock(self, record: BatchRecord) -> IO[bytes] | None:
        """Hold the right to run ``record`` (until the returned file is closed, or the process ends, a kill
        included); ``None`` when another server sharing this cache holds it."""
        handle = open(record.folder / "lock", "ab")
        if fcntl is not None:
            try:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                handle.close()
                return None
        return handle
