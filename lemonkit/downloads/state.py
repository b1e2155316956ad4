"""``downloads.json``: the job list a server leaves for the next one, under the cache dir.

The jobs ``/v1/downloads`` lists are saved at each state change, so the next server lists them again: an
interrupted one as ``paused``, its progress read from the partial files. The bytes themselves are never in that
file: they are in ``blobs/<etag>.incomplete``. Its names become paths, so each is checked as the hub's are.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from lemonkit.catalog.hf_cache import check_repo_id, hub_hash, read_json_object, stat_key
from lemonkit.catalog.model_info import ModelInfo
from lemonkit.catalog.registry import Registry
from lemonkit.downloads.hub_api import RemoteFile
from lemonkit.downloads.job import STOPPED, Plan
from lemonkit.errors import LemonkitError, ModelNotFound
from lemonkit.formats.files import atomic_write_json

__all__ = ["STATE_FILE", "Revived", "SavedJobs"]

log = logging.getLogger("lemonkit.downloads")

STATE_FILE = "downloads.json"
_STATE_VERSION = 1

#: a saved job brought back: its model, its record (status, register, error, finished_at, plan), its progress on disk
Revived = tuple[ModelInfo, dict[str, Any], dict[str, Any]]


class SavedJobs:
    """Reads and writes ``downloads.json`` (in a thread: disk IO and directory stats).

    Args:
        path: The file.
        registry: Where saved jobs' models are looked up (and their files found).
        retention: Seconds a completed job stays listed.
    """

    def __init__(self, path: Path, registry: Registry, retention: float) -> None:
        self.path = path
        self.registry = registry
        self.retention = retention

    def read(self) -> list[tuple[str, Revived | None]]:
        """``downloads.json``'s entries, each revived (``None``: not worth restoring); runs in a thread."""
        try:
            data = read_json_object(self.path)
            entries = data.get("jobs", {})
            if not isinstance(entries, dict):
                raise ValueError("'jobs' is not an object")
        except ValueError as exc:
            log.warning("%s is unreadable (%s): starting without saved download jobs", self.path, exc)
            return []
        found: list[tuple[str, Revived | None]] = []
        for job_id, entry in entries.items():
            try:
                found.append((job_id, self._revive(job_id, entry)))
            except Exception as exc:  # one bad entry costs that job only
                log.warning("not restoring the download job %r from %s: %s", job_id, self.path, exc)
                found.append((job_id, None))
        return found

    def _revive(self, job_id: str, entry: Any) -> Revived | None:
        """A saved entry checked and parsed, with its model and progress on disk (``None``: an expired one).

        Raises:
            ValueError, TypeError, KeyError, LemonkitError: The entry is malformed or names an unknown model.
        """
        if not isinstance(entry, dict):
            raise TypeError("not an object")
        name, status, register = entry.get("model_name"), entry.get("status"), entry.get("register")
        if not isinstance(name, str) or job_id != f"model:{name}":
            raise ValueError(f"model_name {name!r} does not match the id")
        if status not in ("downloading", *STOPPED):
            raise ValueError(f"unknown status {status!r}")
        if register is not None and not isinstance(register, dict):
            raise TypeError("register is not an object")
        finished_at = entry.get("finished_at")
        finished_at = float(finished_at) if finished_at is not None else time.time()
        if status == "completed" and time.time() - finished_at >= self.retention:
            return None
        try:
            info = self.registry.get(name)
        except ModelNotFound:
            if register is None:
                raise
            info = self.registry.preview(name, register)  # stopped before its registration was saved
        error = None
        if entry.get("error") is not None:
            saved = entry["error"]
            if not 400 <= int(saved["status"]) < 600:
                raise ValueError(f"error status {saved['status']!r}")
            code = saved.get("code")
            error = LemonkitError(str(saved["message"]), status=int(saved["status"]), code=code and str(code))
            error.type = str(saved.get("type") or error.type)
        plan = _plan_from(entry.get("plan"))
        requested_by = entry.get("requested_by") or []
        if not isinstance(requested_by, list) or not all(isinstance(u, str) for u in requested_by):
            raise TypeError("requested_by is not a list of user names")
        record = {
            "status": status,
            "register": register,
            "error": error,
            "finished_at": finished_at,
            "plan": plan,
            "requested_by": set(requested_by),
        }
        return info, record, self._on_disk(plan) if plan is not None else {}

    def _on_disk(self, plan: Plan) -> dict[str, Any]:
        """How far ``plan`` is on disk: the files linked in their snapshot are whole; the first that is not is
        the current file, with what its partial blob holds."""
        done = 0
        cache = self.registry.cache
        for index, remote in enumerate(plan.files, start=1):
            if cache.pointer(remote.repo, remote.commit, remote.path).is_file():
                done += remote.size
                continue
            have = 0
            for etag in remote.etags:
                key = stat_key(cache.partial(remote.repo, etag))
                have = max(have, key[0] if key else 0)
            return {
                "file": remote.path,
                "file_index": index,
                "bytes_total": remote.size,
                "bytes_downloaded": min(have, remote.size),
                "completed_files_bytes": done,
            }
        if not plan.files:
            return {}
        last = plan.files[-1]
        return {
            "file": last.path,
            "file_index": len(plan.files),
            "bytes_total": last.size,
            "bytes_downloaded": last.size,
            "completed_files_bytes": done - last.size,
        }

    def write(self, records: dict[str, dict[str, Any]], gone: set[str]) -> None:
        try:
            entries = read_json_object(self.path).get("jobs")
        except ValueError:
            entries = None  # unreadable: what this server knows replaces it
        # entries another server sharing this cache dir wrote since we read the file stay
        kept = {k: v for k, v in entries.items() if k not in gone} if isinstance(entries, dict) else {}
        atomic_write_json(self.path, {"version": _STATE_VERSION, "jobs": {**kept, **records}})


def _plan_from(data: Any) -> Plan | None:
    """A plan as :meth:`Job.record` saved it, checked: its names become paths, so none may leave the cache.

    Raises:
        ValueError, TypeError, KeyError: It is malformed.
    """
    if data is None:
        return None
    files = []
    for f in data["files"]:
        remote = RemoteFile(
            repo=str(f["repo"]),
            path=str(f["path"]),
            commit=str(f["commit"]),
            size=int(f["size"]),
            blob_id=str(f["blob_id"]) if f.get("blob_id") is not None else None,
            sha256=str(f["sha256"]) if f.get("sha256") is not None else None,
        ).checked()
        check_repo_id(remote.repo, what="saved repo")
        files.append(remote)
    commits = {
        check_repo_id(str(repo), what="saved repo"): hub_hash(str(commit), what="saved commit")
        for repo, commit in dict(data["commits"]).items()
    }
    return Plan(files=files, commits=commits)
