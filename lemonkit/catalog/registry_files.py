"""The registry's own files in lemonkit's cache dir: ``user_models.json`` and ``recipe_options.json``.

Another process (the CLI beside a server) may rewrite either at any time, so each is stat'ed at every look and
read again only when it changed (:class:`WatchedJson`); a file that cannot be read is logged and counts as empty,
left alone for the user to correct. Writes go through a temp file and a rename, the file re-read first so that an
entry the other process saved meanwhile is kept. :class:`SavedOptions` is ``recipe_options.json``: each model's
saved load options (``{model_id: {...}}``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from lemonkit.catalog.hf_cache import read_json_object, stat_key
from lemonkit.formats.files import atomic_write_json

__all__ = ["SavedOptions", "WatchedJson"]

log = logging.getLogger("lemonkit.registry")  # the registry's files: their errors are the registry's (its log tag)

_NEVER_READ = (-1, -1, -1)


class WatchedJson:
    """A JSON object file read again whenever it changes on disk.

    Args:
        path: The file.
        unreadable: What an unreadable file means, for the log (``"no user models loaded"``).
    """

    def __init__(self, path: Path, unreadable: str) -> None:
        self.path = path
        self._unreadable = unreadable
        self._key: tuple[int, int, int] | None = _NEVER_READ

    def changed(self) -> dict[str, Any] | None:
        """The file's object when it changed since the last look (``{}`` when it is gone or unreadable, which is
        logged), else ``None``."""
        key = stat_key(self.path)
        if key == self._key:
            return None
        self._key = key
        try:
            return read_json_object(self.path)
        except ValueError as exc:
            log.error("%s is unreadable (%s); %s", self.path, exc, self._unreadable)
            return {}

    def forget(self) -> None:
        """Read the file at the next look, changed or not."""
        self._key = _NEVER_READ

    def written(self) -> None:
        """This process has just written the file: the next look reads it only once another process changes it."""
        self._key = stat_key(self.path)


class SavedOptions:
    """``recipe_options.json``: per-model saved load options, thread-safe (a model's entry is read, changed and
    written as one step).

    Args:
        path: The file.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = WatchedJson(path, "ignoring saved options")
        self._lock = threading.RLock()
        self._options: dict[str, dict[str, Any]] = {}

    def refresh(self) -> None:
        """Read the file again if it changed."""
        with self._lock:
            options = self._file.changed()
            if options is not None:
                self._options = {k: dict(v) for k, v in options.items() if isinstance(v, dict)}

    def forget(self) -> None:
        """Read the file at the next look, changed or not."""
        self._file.forget()

    def get(self, model_id: str) -> dict[str, Any]:
        """The model's entry (a copy; ``{}`` when none).

        Args:
            model_id: The registered id (not an alias).

        Returns:
            Saved option names and values.
        """
        self.refresh()
        return dict(self._options.get(model_id, {}))

    def update(self, model_id: str, change: Callable[[dict[str, Any]], Mapping[str, Any]]) -> dict[str, Any]:
        """Read, change and write back the model's entry as one step.

        Args:
            model_id: The registered id (not an alias).
            change: Gets a copy of the current entry (``{}`` when none), returns the new one.

        Returns:
            The entry now on disk.

        Raises:
            OSError: The file cannot be written (the old file stays intact).
        """
        with self._lock:  # two saves at once must not both start from the same old entry
            self._file.forget()
            self.refresh()
            old = self._options.get(model_id, {})
            new = dict(change(dict(old)))
            if new != old:
                self.save(model_id, new)
            return new

    def save(self, model_id: str, options: Mapping[str, Any]) -> None:
        """Replace the model's entry, atomically (temp file + rename).

        Args:
            model_id: The registered id (not an alias).
            options: The whole new entry; empty removes it.

        Raises:
            OSError: The file cannot be written (the old file stays intact).
        """
        with self._lock:
            # Re-read first so an entry another process saved meanwhile is kept.
            self._file.forget()
            self.refresh()
            data = {k: dict(v) for k, v in self._options.items()}
            if options:
                data[model_id] = dict(options)
            else:
                data.pop(model_id, None)
            atomic_write_json(self.path, data)
            self._options = data
            self._file.written()
