"""The Hugging Face hub as the downloader sees it: a repo's file listing, a file's fetch metadata, the current commit.

Every name the hub gives (file paths, commits, blob ids, sha256s, ETags) is checked here, before anything builds a
path from it: a hostile ``HF_ENDPOINT`` or a man in the middle of plain http gets a download error, not a file
written outside the cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from lemonkit.catalog.hf_cache import etag_name, hub_hash, safe_relpath
from lemonkit.errors import DownloadError, InvalidArgument, LemonkitError, ModelNotFound

__all__ = ["Hub", "Listing", "RemoteFile", "is_hub_error", "retryable", "translate"]

_API_TIMEOUT = 30.0  # seconds for a hub metadata call (huggingface_hub's default is none)


@dataclass(frozen=True)
class RemoteFile:
    """One file of a repo at a commit, as the hub's ``?blobs=true`` listing describes it."""

    repo: str
    path: str
    commit: str
    size: int
    blob_id: str | None = None
    sha256: str | None = None

    @property
    def etags(self) -> set[str]:
        """The names its blob may have: the hub's ETag is the sha256 for LFS files, the git blob id otherwise."""
        return {e for e in (self.sha256, self.blob_id) if e}

    def checked(self) -> RemoteFile:
        """This file, once its path, commit and hashes are known to be safe as names (raises ValueError)."""
        safe_relpath(self.path, what="repo file")
        hub_hash(self.commit, what=f"{self.path}: commit")
        for value in self.etags:
            hub_hash(value, what=f"{self.path}: hash")
        return self


@dataclass(frozen=True)
class Listing:
    repo: str
    commit: str
    files: dict[str, RemoteFile]


def translate(exc: BaseException, what: str) -> LemonkitError:
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
            raise translate(exc, repo) from None
        if not info.sha:
            raise DownloadError(f"The hub's answer for {repo} names no commit")
        try:
            hub_hash(info.sha, what=f"{repo}: commit")
            files = {
                s.rfilename: RemoteFile(
                    repo=repo,
                    path=s.rfilename,
                    commit=info.sha,
                    size=s.size or 0,
                    blob_id=s.blob_id,
                    sha256=s.lfs.sha256 if s.lfs else None,
                ).checked()
                for s in info.siblings or []
            }
        except ValueError as exc:
            raise DownloadError(f"The hub's listing of {repo} is unsafe: {exc}") from None
        return Listing(repo=repo, commit=info.sha, files=files)

    def commit(self, repo: str) -> str | None:
        """The commit ``main`` points at now."""
        try:
            sha = self._api().model_info(repo, timeout=_API_TIMEOUT).sha
        except Exception as exc:
            raise translate(exc, repo) from None
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
            raise translate(exc, f"{remote.repo}/{remote.path}") from None
        if not meta.etag:
            raise DownloadError(f"The hub sent no ETag for {remote.repo}/{remote.path}")
        try:
            etag = etag_name(meta.etag, what=f"The hub's ETag for {remote.repo}/{remote.path}")
        except ValueError as exc:
            raise DownloadError(str(exc)) from None
        location = meta.location or url
        if _origin(location) != _origin(url):
            headers.pop("authorization", None)  # a signed CDN URL: the token stays with the hub
        return location, etag, meta.size, headers


def is_hub_error(exc: BaseException) -> bool:
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    return isinstance(exc, (HfHubHTTPError, OfflineModeIsEnabled))


def retryable(exc: BaseException) -> bool:
    from huggingface_hub.errors import HfHubHTTPError

    if isinstance(exc, HfHubHTTPError) and exc.response is not None:
        return exc.response.status_code in (408, 429) or exc.response.status_code >= 500
    return False


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urlsplit(url)
    return parts.scheme, (parts.hostname or "").lower(), parts.port
