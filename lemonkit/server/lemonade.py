"""Handlers for the Lemonade management and status routes (spec: ``lemonade-api.md``)."""

from __future__ import annotations

import asyncio
from typing import Any

from lemonkit.catalog.recipe_options import RECIPE_OPTIONS
from lemonkit.catalog.registry import COLLECTION_OMNI, ModelInfo, Registry
from lemonkit.catalog.system_info import system_info
from lemonkit.errors import InvalidArgument, ModelLoadRefused, ModelNotFound
from lemonkit.server.handler import API_PREFIXES, LemonkitHandler, allow_unauthenticated
from lemonkit.server.logs import LOG_STREAM_PATH

__all__ = ["HealthHandler", "LiveHandler", "LoadHandler", "StatsHandler", "SystemInfoHandler", "UnloadHandler"]


class LoadHandler(LemonkitHandler):
    """``POST /v1/load``: load a registered model, pulling what it lacks first ("Installs the model if necessary").

    The download is the model's job, listed in ``/v1/downloads`` while it runs and shared with any pull of it; a
    failure answers as a non-streaming pull would, and a client that hangs up leaves it paused. A collection
    pulls its missing components, then loads each in turn without the request's options (as the spec says).
    """

    schema = "load"

    async def post(self) -> None:
        await self.unless_gone(self._load(self.json_body()))

    async def _load(self, body: dict[str, Any]) -> None:
        service = self.service
        options = {k: body[k] for names in RECIPE_OPTIONS.values() for k in names if k in body}
        if options or body.get("save_options") or body.get("pinned") is not None:
            self.require_admin("loading a model with options (ctx_size, llamacpp_args, pinned, save_options...)")
        info = await service.usable(body["model_name"])
        if info.on_demand:
            raise ModelLoadRefused(
                f"{info.id} is an on-demand model: it loads on its first request to its route "
                "(/v1/images/upscale for an upscaler), not through /v1/load"
            )
        if info.recipe == COLLECTION_OMNI:
            parts, missing = await asyncio.to_thread(self._parts, service.registry, info)
            await service.install(missing)  # all of them before any load: a failure loads nothing
            for part in parts:
                if not part.on_demand:  # it loads on its first request
                    await service.manager.load(part.id)
            self.write_json({"status": "success", "message": f"Loaded model: {info.id}"})
            return
        model = await service.manager.load(
            info.id,
            options,
            save_options=bool(body.get("save_options")),
            pinned=body.get("pinned"),  # absent or null: keep the pin saved in recipe_options.json
            reload=self.caller.admin,  # a user's plain load of a shared model keeps the options it runs with
        )
        self.write_json({"status": "success", "message": f"Loaded model: {model.name}"})

    @staticmethod
    def _parts(registry: Registry, info: ModelInfo) -> tuple[list[ModelInfo], list[ModelInfo]]:
        """A collection's components, and those not downloaded.

        Raises:
            InvalidArgument: A component is no longer registered (as pulling it says).
        """
        parts = registry.collection_parts(info)
        if len(parts) != len(info.components):
            raise InvalidArgument(f"{info.id}: some of its components ({', '.join(info.components)}) are gone")
        return parts, [p for p in parts if not registry.is_downloaded(p)]


class UnloadHandler(LemonkitHandler):
    schema = "unload"

    async def post(self) -> None:
        self.require_admin("unloading a model that every user shares")
        body = self.json_body(optional=True)
        name = body.get("model_name")
        info = await self.service.lookup(name) if name is not None else None
        if info is not None and info.recipe == COLLECTION_OMNI:
            await self._unload_parts(info)
        else:
            await self.service.manager.unload(name)
        self.write_json({"status": "success", "message": "Model unloaded successfully"})

    async def _unload_parts(self, info: ModelInfo) -> None:
        """Unload a collection: each of its components that is loaded, as loading it loaded each.

        Raises:
            ModelNotFound: None of them is loaded.
        """
        manager = self.service.manager
        parts = await asyncio.to_thread(self.service.registry.collection_parts, info)
        loaded = [p.id for p in parts if manager.loaded(p.id) is not None]
        if not loaded:
            raise ModelNotFound(f"Model not loaded: {info.id} (none of its components is)")
        for part in loaded:
            await manager.unload(part)


class HealthHandler(LemonkitHandler):
    async def get(self) -> None:
        self.write_json({**self.service.manager.health(), **self._websocket()})

    def _websocket(self) -> dict[str, Any]:
        """Where ``WS /logs/stream`` is served: both hosts serve it on their one HTTP port, so the spec's
        ``websocket_port`` is the local port of this very connection (the bound port even with ``--port 0``; none
        on a Unix socket, and then the field is left out). ``websocket_path`` (lemonkit's own field) is where on
        that port: Jupyter mounts it under ``{base_url}lemonkit/``, not at the spec's ``/logs/stream``."""
        found: dict[str, Any] = {}
        stream = getattr(self.request.connection, "stream", None)
        sock = getattr(stream, "socket", None)
        address = sock.getsockname() if sock is not None else None
        if isinstance(address, tuple):  # (host, port) or IPv6's (host, port, flow, scope)
            found["websocket_port"] = address[1]
        # this route is {root}{prefix}health, and the WS routes hang off the same root
        path = self.request.path.rstrip("/")
        root = next((path[: -len(p + "health")] for p in API_PREFIXES if path.endswith(f"/{p}health")), None)
        if root is not None:
            found["websocket_path"] = root + LOG_STREAM_PATH
        return found


class StatsHandler(LemonkitHandler):
    """``GET /v1/stats``; a shared server's user who is not an admin gets the figures of their own last request
    only (none once another user's request followed it on that model)."""

    async def get(self) -> None:
        self.write_json(await self.service.manager.stats(only_of=self.caller.own_only))


class SystemInfoHandler(LemonkitHandler):
    async def get(self) -> None:
        settings = self.service.settings
        self.write_json(await asyncio.to_thread(system_info, settings.recipes, cache_dir=settings.cache_dir))


class LiveHandler(LemonkitHandler):
    """``/live``: the one route open without credentials."""

    auth_required = False

    @allow_unauthenticated
    async def get(self) -> None:
        self.write_json({"status": "ok"})

    @allow_unauthenticated
    async def head(self) -> None:
        self.set_header("Content-Type", "application/json")
        self.finish()
