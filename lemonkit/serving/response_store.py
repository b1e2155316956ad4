"""Stored Responses (``store: true`` on ``/v1/responses``), per user, on disk under the cache.

Each stored response keeps the conversation that produced it (as chat messages) and its own output, so a later
request's ``previous_response_id`` continues from there; ``GET`` and ``DELETE /v1/responses/{id}`` read and remove
it. Files live in ``<cache>/responses/<user>/<id>.json`` (the user as a hash: a name never becomes a path), written
atomically; an id from a request is checked (``resp_`` and URL-safe characters) before it names a file.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

from lemonkit.catalog.hf_cache import inside, read_json_object, safe_relpath
from lemonkit.formats.files import atomic_write_json

__all__ = ["ResponseStore", "valid_id"]

_ID = re.compile(r"resp_[A-Za-z0-9_-]{8,64}")


def valid_id(response_id: str) -> bool:
    """Whether ``response_id`` has the shape of the ids lemonkit gives (only those name files)."""
    return bool(_ID.fullmatch(response_id))


class ResponseStore:
    def __init__(self, cache_dir: Path) -> None:
        self.root = cache_dir / "responses"

    def _path(self, user: str, response_id: str) -> Path | None:
        if not valid_id(response_id):
            return None
        folder = hashlib.sha256(user.encode()).hexdigest()[:32]
        return inside(self.root, safe_relpath(f"{folder}/{response_id}.json", what="response id"))

    def save(self, user: str, response_id: str, record: dict[str, Any]) -> None:
        """Keep ``record`` (``response``, ``messages``, ``output``) as ``user``'s (blocking: call off the loop)."""
        path = self._path(user, response_id)
        if path is None:
            raise ValueError(f"not a response id: {response_id!r}")
        atomic_write_json(path, record)

    def load(self, user: str, response_id: str) -> dict[str, Any] | None:
        """``user``'s stored record of ``response_id``, or ``None`` (none, another user's, or not an id)."""
        path = self._path(user, response_id)
        if path is None:
            return None
        try:
            record = read_json_object(path)
        except ValueError:
            return None
        return record or None

    def delete(self, user: str, response_id: str) -> bool:
        path = self._path(user, response_id)
        if path is None or not path.exists():
            return False
        path.unlink()
        return True
