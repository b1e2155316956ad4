"""The download manager: every download job of one server, and the hub-facing work around them.

A pull plans its files from the hub's listing (every checkpoint of every component; :mod:`lemonkit.downloads.repo_files`
chooses them, and a delete's), registers a new model once the hub has them, then fetches them in a worker thread
(:mod:`lemonkit.downloads.fetch`); ``refs/main`` is written once every file of the pull is in place, so a model is
never reported downloaded while a file is missing or unverified. Jobs are listed and saved
(:mod:`lemonkit.downloads.state`) so a restarted server resumes them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import Counter
from typing import Any

from lemonkit.catalog.config import Settings
from lemonkit.catalog.hf_cache import check_repo_id, parse_checkpoint
from lemonkit.catalog.model_info import ModelInfo
from lemonkit.catalog.registry import Registry
from lemonkit.downloads.fetch import Fetcher
from lemonkit.downloads.hub_api import Hub, is_hub_error, translate
from lemonkit.downloads.job import Job, Plan, Stopped, running_loop
from lemonkit.downloads.repo_files import delete_files, plan_pull
from lemonkit.downloads.state import STATE_FILE, SavedJobs
from lemonkit.downloads.updates import UpdateChecker
from lemonkit.downloads.variants import list_variants
from lemonkit.errors import (
    DownloadError,
    DownloadStopped,
    InvalidArgument,
    LemonkitError,
    NotFound,
)

__all__ = ["DownloadManager"]

log = logging.getLogger("lemonkit.downloads")


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
        self._received: Counter[str] = Counter()  # bytes downloaded per model by jobs that have stopped
        self._threads: set[threading.Thread] = set()
        self.fetcher = Fetcher(registry.cache, self.hub)
        self.state_path = settings.cache_dir / STATE_FILE
        self.saved = SavedJobs(self.state_path, registry, settings.download_retention)
        self._restoring: asyncio.Future[None] | None = None
        self._saver: asyncio.Future[None] | None = None
        self._dirty = False
        #: ids of the downloads.json entries this server read or wrote (those it may drop; others stay)
        self._saved_ids: set[str] = set()
        self._written: dict[str, dict[str, Any]] = {}

    # -- jobs ------------------------------------------------------------------------------------------------------

    def get(self, job_id: str) -> Job | None:
        return self._jobs.get(job_id)

    def bytes_received(self) -> dict[str, int]:
        """Bytes taken off the network per model since this server started (``/metrics``)."""
        totals = Counter(self._received)
        for job in list(self._jobs.values()):
            totals[job.model_name] += job.received - job.counted
        return dict(totals)

    def jobs(self, *, visible_to: str | None = None) -> list[Job]:
        """Jobs ``GET /v1/downloads`` lists: those a ``subscribe=false`` pull made server-owned, and a load's
        while it lasts (call :meth:`restore` first for those a previous server left).

        Args:
            visible_to: Only the jobs this user asked for (a shared server's user who is not an admin).
        """
        self._prune()
        return [job for job in self._jobs.values() if job.saved and _visible(job, visible_to)]

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
        self,
        info: ModelInfo,
        *,
        owned: bool,
        listed: bool = False,
        register: dict[str, Any] | None = None,
        by: str | None = None,
    ) -> Job:
        """The job downloading ``info``: the running one (shared), or a new one.

        Args:
            info: The model (for a registration, the model it would be; it is registered once its files are
                found on the hub, so a bad checkpoint registers nothing).
            owned: The job outlives its HTTP subscribers (``subscribe=false``) and is listed.
            listed: The job is listed while it lasts although it pauses when its last subscriber leaves
                (``/v1/load``'s download).
            register: The ``user_models.json`` row to save for ``info.id``.
            by: The user asking for it (recorded: a shared server shows them the job).

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
                was_saved, known = job.saved, job.requested_by.copy()
                job.owned, job.listed = job.owned or owned, job.listed or listed
                job.requested_by.update([by] if by else [])
                if (job.saved and not was_saved) or job.requested_by != known:
                    self._save_soon()
                return job
            await job.wait_stopped()  # a paused or cancelled worker is unwinding: start afresh once it is gone
        new = Job(info, loop, owned=owned or bool(job and job.owned), listed=listed, register=register)
        new.requested_by = (job.requested_by if job else set()) | ({by} if by else set())
        self._jobs[new.id] = new
        if new.saved:
            self._save_soon()
        thread = threading.Thread(target=self._run, args=(new,), name=f"download {info.id}", daemon=True)
        self._threads.add(thread)
        thread.start()
        return new

    async def install(self, infos: list[ModelInfo], *, by: str | None = None) -> None:
        """Download ``infos``, each through its job (joining one that runs), listed in ``/v1/downloads`` while
        they run.

        The wait subscribes to the jobs: when it is cancelled (its client left) a job nobody else wants pauses,
        keeping its partial files for the next pull. ``by`` is the user whose request needs them.

        Raises:
            LemonkitError: The first failure, with the status and code a non-streaming pull answers with.
        """
        jobs: list[Job] = []
        try:
            for info in infos:
                job = await self.pull(info, owned=False, listed=True, by=by)
                self.subscribe(job)  # before any other await: an unwatched job pauses
                jobs.append(job)
            await _all_done(jobs)
        finally:
            for job in jobs:
                self.unsubscribe(job)

    async def control(self, job_id: str, action: str, *, visible_to: str | None = None) -> dict[str, Any]:
        """``POST /v1/downloads/control``.

        Args:
            visible_to: Only a job this user asked for; another is answered as if there were none.

        Raises:
            NotFound: No such job (and the action is not ``remove``).
        """
        await self.restore()
        job = self._jobs.get(job_id)
        if job is not None and not _visible(job, visible_to):
            job = None
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
            await asyncio.to_thread(self.fetcher.discard_partials, job.plan)
        self._save_soon()
        return job.snapshot()

    async def stop(self, job: Job, status: str = "cancelled") -> None:
        """Stop a job's worker and wait until it has unwound (delete does this first)."""
        if job.running:
            job.request_stop(status)
            await job.wait_stopped()
        if status == "cancelled":
            await asyncio.to_thread(self.fetcher.discard_partials, job.plan)
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
            found = await asyncio.to_thread(self.saved.read)
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
            job.requested_by = record["requested_by"]
            self._jobs[job_id] = job
            restored += 1
        if restored:
            log.info("restored %d download job(s) from %s", restored, self.state_path)

    def _save_soon(self) -> None:
        """Write the job list at a state change (on the loop): one write at a time, the latest state last."""
        if running_loop() is None or self._restoring is None:
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
                await asyncio.to_thread(self.saved.write, records, gone)
            except Exception:  # the download goes on; the next state change writes again
                log.exception("could not save the download jobs to %s", self.state_path)
            else:
                self._saved_ids, self._written = set(records), records

    # -- the worker ------------------------------------------------------------------------------------------------

    def _run(self, job: Job) -> None:
        try:
            plan = plan_pull(job, self.registry, self.hub)
            job.check()
            if job.register is not None:
                job.info = self.registry.register(job.info.id, job.register)
            job.begin(plan)
            self._set_planned(job, plan)
            self._saved_soon(job)
            for index, remote in enumerate(plan.files, start=1):
                job.check()
                self.fetcher.fetch(job, index, remote)
            for repo, commit in plan.commits.items():
                self.registry.cache.set_main_ref(repo, commit)
                self.updates.record(repo, commit)
            job.finish(done=True)
            log.info("downloaded %s (%d files, %d bytes fetched)", job.model_name, len(plan.files), job.received)
        except Stopped:
            if job.status == "cancelled":
                self.fetcher.discard_partials(job.plan)  # before running turns false: clients wait for that
            job.finish()
            log.info("download of %s %s", job.model_name, job.status)
        except Exception as exc:
            err = translate(exc, job.model_name)
            if not isinstance(exc, LemonkitError) and not is_hub_error(exc):
                log.exception("download of %s failed", job.model_name)
                err = DownloadError(f"Downloading {job.model_name} failed: {exc}", status=500)
            else:
                log.warning("download of %s failed: %s", job.model_name, err.message)
            self._set_planned(job, err)
            job.finish(err)
        finally:
            self._received[job.model_name] += job.received - job.counted
            job.counted = job.received
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

    def delete_files(self, info: ModelInfo, plan: Plan | None = None) -> int:
        """Remove ``info``'s files from the hub cache, keeping any another registered model needs (in a thread;
        :func:`lemonkit.downloads.repo_files.delete_files`); the number of snapshot entries removed."""
        return delete_files(self.registry, info, plan)

    # -- variants --------------------------------------------------------------------------------------------------

    def variants(self, checkpoint: str) -> dict[str, Any]:
        """``GET /v1/pull/variants`` (network: run it in a thread)."""
        repo = parse_checkpoint(checkpoint)[0]
        try:
            check_repo_id(repo, what="checkpoint")
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None
        if "/" not in repo:
            raise InvalidArgument(f"checkpoint: expected 'owner/repo', got {checkpoint!r}")
        return list_variants(checkpoint, self.hub.listing(repo))


def _visible(job: Job, user: str | None) -> bool:
    return user is None or user in job.requested_by


async def _all_done(jobs: list[Job]) -> None:
    """Wait until every job completed; the first failure raises and ends the other waits."""
    waits = [asyncio.ensure_future(job.wait_done()) for job in jobs]
    try:
        await asyncio.gather(*waits)
    finally:
        for wait in waits:
            wait.cancel()
