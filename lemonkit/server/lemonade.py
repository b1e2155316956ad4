"""Handlers for the Lemonade management and status routes (spec: ``lemonade-api.md``)."""

from __future__ import annotations

import asyncio
from typing import Any

from lemonkit.options import RECIPE_OPTIONS
from lemonkit.server.base import LemonkitHandler, allow_unauthenticated
from lemonkit.system_info import system_info

__all__ = ["HealthHandler", "LiveHandler", "LoadHandler", "StatsHandler", "SystemInfoHandler", "UnloadHandler"]


class LoadHandler(LemonkitHandler):
    schema = "load"

    async def post(self) -> None:
        body = self.json_body()
        options: dict[str, Any] = {k: body[k] for names in RECIPE_OPTIONS.values() for k in names if k in body}
        model = await self.service.manager.load(
            body["model_name"],
            options,
            save_options=bool(body.get("save_options")),
            pinned=body.get("pinned"),  # absent or null: keep the pin saved in recipe_options.json
        )
        self.write_json({"status": "success", "message": f"Loaded model: {model.name}"})


class UnloadHandler(LemonkitHandler):
    schema = "unload"

    async def post(self) -> None:
        body = self.json_body(optional=True)
        await self.service.manager.unload(body.get("model_name"))
        self.write_json({"status": "success", "message": "Model unloaded successfully"})


class HealthHandler(LemonkitHandler):
    async def get(self) -> None:
        self.write_json(self.service.manager.health())


class StatsHandler(LemonkitHandler):
    async def get(self) -> None:
        self.write_json(await self.service.manager.stats())


class SystemInfoHandler(LemonkitHandler):
    async def get(self) -> None:
        self.write_json(await asyncio.to_thread(system_info, self.service.settings.recipes))


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
