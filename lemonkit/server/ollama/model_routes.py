"""Ollama's routes about models rather than with them: ``version``, ``tags``, ``show``, ``ps``, ``pull``, ``delete``,
and ``create``/``copy``/``push``/``blobs``, which say what to use instead."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

from lemonkit._version import __version__
from lemonkit.downloads import Job, progress_events
from lemonkit.errors import NotImplementedRoute
from lemonkit.server.ollama.describe import capabilities, describe_model, tag_of
from lemonkit.server.ollama.handlers import OllamaHandler
from lemonkit.server.ollama.translate import (
    NEVER_EXPIRES,
    OLLAMA_API_VERSION,
)
from lemonkit.server.pulls import delete_model


class VersionHandler(OllamaHandler):
    async def get(self) -> None:
        self.write_json({"version": OLLAMA_API_VERSION, "lemonkit": __version__})


class TagsHandler(OllamaHandler):
    """``GET /api/tags``: the downloaded models this machine runs."""

    async def get(self) -> None:
        service = self.service

        def build() -> list[dict[str, Any]]:
            models = []
            for info in service.registry.list():
                if info.remote is not None or not service.support.model(info, service.registry).supported:
                    continue
                if not service.registry.is_downloaded(info):
                    continue
                described = describe_model(service, info)
                metadata = described.pop("metadata")
                models.append(
                    {
                        "name": tag_of(info),
                        "model": tag_of(info),
                        **described,
                        "capabilities": capabilities(info, metadata),
                    }
                )
            return models

        self.write_json({"models": await asyncio.to_thread(build)})


class ShowHandler(OllamaHandler):
    """``POST /api/show``: a model's details, metadata, template, parameters and capabilities."""

    async def post(self) -> None:
        body = self.ollama_body()
        info = await self.service.lookup(self.model_name(body))
        service = self.service
        loaded = service.manager.loaded(info.id)

        def build() -> dict[str, Any]:
            described = describe_model(service, info)
            metadata = described.pop("metadata")
            obj = service.registry.model_object(
                info, context_length=loaded.engine_info.get("ctx_size") if loaded else None
            )
            parameters = []
            if obj.get("context_length"):
                parameters.append(f"num_ctx {obj['context_length']}")
            options = obj.get("recipe_options") or {}
            if options.get("llamacpp_args"):
                parameters.append(f"llamacpp_args {json.dumps(options['llamacpp_args'])}")
            verbose = bool(body.get("verbose"))
            model_info = {k: v for k, v in metadata.items() if k != "tokenizer.chat_template" and (verbose or v != [])}
            modelfile = f"# Modelfile of lemonkit's {info.id}\nFROM {info.checkpoint}\n" + "".join(
                f"PARAMETER {p}\n" for p in parameters
            )
            return {
                "modelfile": modelfile,
                "parameters": "\n".join(parameters),
                "template": str(metadata.get("tokenizer.chat_template") or ""),
                "details": described["details"],
                "model_info": model_info,
                "capabilities": capabilities(info, metadata),
                "modified_at": described["modified_at"],
                "license": str(metadata.get("general.license") or ""),
            }

        self.write_json(await asyncio.to_thread(build))


class PsHandler(OllamaHandler):
    """``GET /api/ps``: the loaded models, with the memory each holds and when it unloads."""

    async def get(self) -> None:
        service = self.service
        loaded = [m for m in service.manager.loaded_models() if m.upstream is None]

        def build() -> list[dict[str, Any]]:
            models = []
            for model in loaded:
                described = describe_model(service, model.info)
                described.pop("metadata")
                device = service.manager.device_bytes(model)
                expires = model.expires_at
                models.append(
                    {
                        "name": tag_of(model.info),
                        "model": tag_of(model.info),
                        "size": model.host_bytes + device,
                        "digest": described["digest"],
                        "details": described["details"],
                        "expires_at": (
                            NEVER_EXPIRES
                            if expires is None
                            else datetime.fromtimestamp(expires, UTC).isoformat().replace("+00:00", "Z")
                        ),
                        "size_vram": device,
                        "context_length": int(model.engine_info.get("ctx_size") or 0),
                    }
                )
            return models

        self.write_json({"models": await asyncio.to_thread(build)})


class PullHandler(OllamaHandler):
    """``POST /api/pull``: the model's download job, its progress as Ollama's NDJSON lines."""

    async def post(self) -> None:
        self.require_admin("pulling a model")
        body = self.ollama_body()
        downloads = self.service.downloads
        await downloads.restore()
        info = await self.service.usable(self.model_name(body))
        job = await downloads.pull(info, owned=False, register=None, by=self.caller.name)
        downloads.subscribe(job)
        try:
            if not await self.unless_gone(asyncio.shield(job.planned)):
                return
            if body.get("stream") is False:
                if await self.unless_gone(job.wait_done()):
                    self.write_json({"status": "success"})
                return
            await self.ndjson_open()
            await self.pump(self._lines(job))
        finally:
            downloads.unsubscribe(job)

    async def _lines(self, job: Job) -> AsyncIterator[bytes]:
        yield self.line({"status": "pulling manifest"})
        async for event, data in progress_events(job, self.service.settings.ping_interval):
            if data is None or event == "ping":
                continue
            if event == "progress":
                name = str(data.get("file") or job.model_name)
                yield self.line(
                    {
                        "status": f"pulling {name}",
                        "digest": name,
                        "total": int(data.get("bytes_total") or 0),
                        "completed": int(data.get("bytes_downloaded") or 0),
                    }
                )
            elif event == "error":
                yield self.line({"error": str(data.get("error"))})
                return
        for status in ("verifying sha256 digest", "writing manifest", "success"):
            yield self.line({"status": status})


class DeleteHandler(OllamaHandler):
    """``DELETE /api/delete``: as ``POST /v1/delete``."""

    async def delete(self) -> None:
        self.require_admin("deleting a model")
        body = self.ollama_body()
        info = await self.service.lookup(self.model_name(body))
        await delete_model(self.service, info)
        self.write_json({})


class UnsupportedHandler(OllamaHandler):
    """Ollama routes that build or move model blobs, which lemonkit has no equivalent of: a 501 saying what to
    use instead."""

    what = ""

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedRoute(self.what)

    get = head = post = delete = _refuse


class CreateHandler(UnsupportedHandler):
    what = (
        "lemonkit has no Modelfiles or blobs: register a GGUF from a hub repo or an allowed directory with "
        "POST /api/v1/pull {model_name: 'user.NAME', checkpoint, recipe: 'llamacpp'}, and set ctx_size or "
        "llamacpp_args with POST /api/v1/models/{model}/options"
    )


class CopyHandler(UnsupportedHandler):
    what = (
        "lemonkit does not copy models: register another name for the same checkpoint with "
        "POST /api/v1/pull {model_name: 'user.NAME', checkpoint, recipe}"
    )


class PushHandler(UnsupportedHandler):
    what = "lemonkit does not publish models to a registry"


class BlobsHandler(UnsupportedHandler):
    what = "lemonkit has no blob store: models come from Hugging Face repos or allowed local directories"
