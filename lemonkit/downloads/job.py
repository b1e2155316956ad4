"""A download job: one model's download, its state as clients see it, and its progress as SSE events.

A job (``model:<name>``) runs in its own worker thread and owns no event-loop time: handlers read snapshots of its
state and wait for changes. Pause and cancel set a flag and shut the socket of the request in flight, so a worker
blocked on a stalled read unwinds at once; every byte it received is already on disk.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from lemonkit.catalog.model_info import ModelInfo
from lemonkit.downloads.hub_api import RemoteFile
from lemonkit.errors import DownloadStopped, LemonkitError

__all__ = ["STOPPED", "Job", "Plan", "Stopped", "progress_events", "running_loop"]

#: statuses after which a job's worker is (or is about to be) gone
STOPPED = frozenset({"completed", "error", "paused", "cancelled"})
_NOTIFY_EVERY = 0.1  # seconds between progress wake-ups of subscribers


class Stopped(BaseException):
    """Unwinds a worker whose job was paused or cancelled (a BaseException: no ``except Exception`` swallows it)."""


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
        #: the users who asked for it (a shared server shows a job only to them and its admins)
        self.requested_by: set[str] = set()
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
        #: of those, the bytes its manager's per-model total already holds
        self.counted = 0
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
        if running_loop() is self._loop:
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
                "requested_by": sorted(self.requested_by),
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
            raise Stopped

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


def running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


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
