"""Fetch and verify: one hub file into the cache, resumable, checked before anyone can see it.

Why not ``hf_hub_download``: in huggingface_hub 2.4 it streams each file into a process-unique temp file that
it deletes on any failure, and it buffers 10 MB before writing, so a pause, a killed server or a dropped
connection throws away what was fetched. Here each file streams into ``blobs/<etag>.incomplete`` (a stable name:
the next attempt, in this process or another, resumes it with an HTTP Range request), is checked (size, sha256 of
LFS files, git blob id of others) and only then renamed to ``blobs/<etag>`` and linked from
``snapshots/<commit>/<path>``. huggingface_hub still supplies the HTTP session (proxies, ``HF_HUB_OFFLINE``), headers
(``HF_TOKEN``), the metadata HEAD and its error classes; writers of one blob serialise on huggingface_hub's own lock
file.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lemonkit.catalog.hf_cache import HubCache, stat_key
from lemonkit.downloads.hub_api import Hub, RemoteFile, retryable
from lemonkit.downloads.job import Job, Plan, Stopped
from lemonkit.errors import DownloadError

__all__ = ["Fetcher"]

log = logging.getLogger("lemonkit.downloads")

_RETRIES = 5  # consecutive failed attempts (without progress) before a file's download gives up
_HASH_BLOCK = 1 << 20


class Fetcher:
    """Puts hub files into one cache; remembers which blobs it has verified (per inode and mtime).

    Args:
        cache: The Hugging Face cache the files go to.
        hub: Where they come from.
    """

    def __init__(self, cache: HubCache, hub: Hub) -> None:
        self.cache = cache
        self.hub = hub
        self._verified: dict[str, tuple[int, int, int] | None] = {}
        self._verified_lock = threading.Lock()

    def fetch(self, job: Job, index: int, remote: RemoteFile) -> None:
        """Make ``remote`` whole and verified in its snapshot, fetching only what is missing (worker thread)."""
        pointer = self.cache.pointer(remote.repo, remote.commit, remote.path)
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
        blob = self.cache.blob(remote.repo, etag)
        with self._blob_lock(job, self.cache.lock_dir(remote.repo) / f"{etag}.lock"):
            if pointer.is_file() and pointer.resolve() != blob:
                pointer.unlink()  # a corrupt copy under another name
            if blob.exists():
                job.start_file(index, remote, remote.size)
                if self._intact(job, blob, remote):
                    self.cache.link(blob, pointer)
                    job.end_file()
                    return
                blob.unlink()
                job.restart_file()
            partial = self.cache.partial(remote.repo, etag)
            try:
                self._download(job, index, remote, url, headers, partial)
            except Stopped:
                if job.status == "cancelled":
                    partial.unlink(missing_ok=True)  # under the lock: nobody else is writing it
                raise
            os.replace(partial, blob)
            self._mark_verified(blob)
            self.cache.link(blob, pointer)
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
                        if not retryable(exc) or failures + 1 >= _RETRIES:
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
        key = stat_key(blob)
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
            self._verified[str(blob)] = stat_key(blob)

    def discard_partials(self, plan: Plan | None) -> None:
        """Delete a plan's ``.incomplete`` files (under each blob's lock; one another writer holds stays)."""
        from filelock import FileLock, Timeout

        for remote in plan.files if plan else []:
            for etag in remote.etags:
                partial = self.cache.partial(remote.repo, etag)
                if not partial.exists():
                    continue
                lock_dir = self.cache.lock_dir(remote.repo)
                lock_dir.mkdir(parents=True, exist_ok=True)
                with contextlib.suppress(Timeout), FileLock(str(lock_dir / f"{etag}.lock"), timeout=0):
                    partial.unlink(missing_ok=True)


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


def _resumes_at(response: Any, offset: int) -> bool:
    """Whether a response to ``Range: bytes=<offset>-`` carries the file from ``offset`` on."""
    if response.status_code != 206:
        return False
    match = re.match(r"bytes (\d+)-", response.headers.get("Content-Range", ""))
    return match is not None and int(match[1]) == offset
