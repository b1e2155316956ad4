"""Files of the OpenAI Files API (``/v1/files``), per user, on disk under the cache.

A file lives in ``<cache>/files/<user>/`` (the user as a hash: a name never becomes a path) as two entries: its
bytes, ``<id>``, and its object, ``<id>.json``. An upload streams into a temporary file beside them and becomes
visible only when it is complete: the bytes are renamed into place first, then the object is written atomically, and
only ids with an object are listed or read, so nothing half-written is ever seen. Deleting removes the object first.

An id from a request is checked (``file-`` and URL-safe characters) before it names a path.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from lemonkit.catalog.hf_cache import inside, read_json_object, safe_relpath
from lemonkit.formats.files import atomic_write_json

__all__ = ["PURPOSES", "FileStore", "NewFile", "new_id", "valid_id"]

#: purposes a client may upload with; lemonkit writes ``batch_output`` itself
PURPOSES = ("batch", "user_data", "assistants", "fine-tune", "vision", "evals")
_ID = re.compile(r"file-[A-Za-z0-9_-]{8,64}")


def new_id() -> str:
    return "file-" + secrets.token_hex(12)


def valid_id(file_id: str) -> bool:
    """Whether ``file_id`` has the shape of the ids lemonkit gives (only those name files)."""
    return bool(_ID.fullmatch(file_id))


class NewFile:
    """A file being written: bytes go to a temporary file; :meth:`commit` makes it a file of the store.

    Use it as a context manager: leaving without a commit removes the temporary file.
    """

    def __init__(self, store: FileStore, user: str, filename: str, purpose: str, file_id: str | None = None) -> None:
        self.store, self.user, self.filename, self.purpose = store, user, filename, purpose
        self.folder = store.folder(user)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.id = file_id or new_id()
        self.temp = self.folder / f".{self.id}.part"
        self._out: IO[bytes] | None = open(self.temp, "wb")
        self.bytes = 0

    def write(self, data: bytes | memoryview) -> None:
        if self._out is None:
            return  # discarded meanwhile (the client left): the rest goes nowhere
        self._out.write(data)
        self.bytes += len(data)

    def commit(self) -> dict[str, Any]:
        """Make the file visible (its bytes synced, then its object written) and return its object."""
        assert self._out is not None
        self._out.flush()
        os.fsync(self._out.fileno())
        self._out.close()
        self._out = None
        os.replace(self.temp, self.folder / self.id)
        obj = {
            "id": self.id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": int(time.time()),
            "expires_at": None,
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
            "status_details": None,
        }
        atomic_write_json(self.folder / f"{self.id}.json", obj)
        return obj

    def discard(self) -> None:
        if self._out is not None:
            self._out.close()
            self._out = None
        with contextlib.suppress(FileNotFoundError):
            self.temp.unlink()

    def __enter__(self) -> NewFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.discard()


class FileStore:
    """The Files API's files (blocking methods: call them off the event loop).

    Args:
        cache_dir: The lemonkit cache; files live in its ``files/``.
    """

    def __init__(self, cache_dir: Path) -> None:
        self.root = cache_dir / "files"

    def folder(self, user: str) -> Path:
        return self.root / hashlib.sha256(user.encode()).hexdigest()[:32]

    def _path(self, user: str, file_id: str, suffix: str = "") -> Path | None:
        if not valid_id(file_id):
            return None
        return inside(self.root, safe_relpath(f"{self.folder(user).name}/{file_id}{suffix}", what="file id"))

    def create(self, user: str, filename: str, purpose: str, file_id: str | None = None) -> NewFile:
        """A new file of ``user``'s to write into (see :class:`NewFile`); ``file_id`` (one lemonkit made) gives a
        file written again the same id, replacing the first."""
        if file_id is not None and not valid_id(file_id):
            raise ValueError(f"not a file id: {file_id!r}")
        return NewFile(self, user, filename, purpose, file_id)

    def put(
        self, user: str, filename: str, purpose: str, chunks: Iterator[bytes], file_id: str | None = None
    ) -> dict[str, Any]:
        """Write a whole file from ``chunks`` and return its object."""
        with self.create(user, filename, purpose, file_id) as new:
            for chunk in chunks:
                new.write(chunk)
            return new.commit()

    def get(self, user: str, file_id: str) -> dict[str, Any] | None:
        """``user``'s file object of ``file_id``, or ``None`` (none, another user's, or not an id)."""
        meta = self._path(user, file_id, ".json")
        if meta is None:
            return None
        try:
            obj = read_json_object(meta)
        except ValueError:
            return None
        return obj or None

    def content(self, user: str, file_id: str) -> Path | None:
        """Where ``user``'s file ``file_id``'s bytes are, or ``None``."""
        if self.get(user, file_id) is None:
            return None
        return self._path(user, file_id)

    def list(self, user: str, purpose: str | None = None) -> list[dict[str, Any]]:
        """``user``'s file objects, newest first (ties: id order), optionally of one purpose."""
        folder = self.folder(user)
        objects = []
        for meta in folder.glob("file-*.json") if folder.is_dir() else ():
            try:
                obj = read_json_object(meta)
            except ValueError:
                continue
            if obj and (purpose is None or obj.get("purpose") == purpose):
                objects.append(obj)
        objects.sort(key=lambda o: (-int(o.get("created_at", 0)), o["id"]))
        return objects

    def delete(self, user: str, file_id: str) -> bool:
        """Remove ``user``'s file ``file_id``: whether there was one."""
        meta, data = self._path(user, file_id, ".json"), self._path(user, file_id)
        if meta is None or data is None or not meta.exists():
            return False
        meta.unlink()  # first: from now on it is not listed or read
        with contextlib.suppress(FileNotFoundError):
            data.unlink()
        return True
