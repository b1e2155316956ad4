"""Per-model files and options: ``/v1/models/{id}/files`` and ``/v1/models/{id}/options`` (spec: ``openai-api.md``).

Options resolve through :func:`lemonkit.catalog.recipe_options.resolve_options`, the chain a load uses, so ``effective``
is what the next load of the model gets. Saving goes through :meth:`lemonkit.catalog.registry.Registry.update_options`
(one atomic read-modify-write of ``recipe_options.json``); every disk access runs in a thread.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from lemonkit.catalog.model_objects import max_context_window
from lemonkit.catalog.recipe_options import apply_changes, load_body, parse_changes, resolved_ctx_size
from lemonkit.catalog.registry import ModelInfo
from lemonkit.errors import LemonkitError, ModelLoadError, ModelNotFound
from lemonkit.server.handler import LemonkitHandler
from lemonkit.server.openai import _flag

__all__ = ["ModelFilesHandler", "ModelOptionsHandler"]


class ModelFilesHandler(LemonkitHandler):
    """``GET /v1/models/{id}/files``."""

    async def get(self, model_id: str) -> None:
        include_paths = _flag(self.get_query_argument("include_paths", None))
        registry = self.service.registry
        info = await self.service.lookup(model_id)
        if info.id != model_id:  # the spec takes only a listed id here: no alias, no ":latest"
            raise ModelNotFound(f"{model_id!r} is not a model id (it names {info.id!r}; use that)")
        try:
            files = await asyncio.to_thread(registry.model_files, info)
        except OSError as exc:
            raise ModelLoadError(f"Could not list the files of {model_id}: {exc}", status=404) from exc
        if not include_paths:  # absolute paths reveal usernames and the cache layout
            files = [{k: v for k, v in f.items() if k != "path"} for f in files]
        self.write_json({"model_id": info.id, "files": files})


class ModelOptionsHandler(LemonkitHandler):
    """``GET``, ``POST`` and ``DELETE /v1/models/{id}/options``."""

    async def get(self, model_id: str) -> None:
        info = await self.service.lookup(model_id)
        saved = await asyncio.to_thread(self.service.registry.saved_options, info.id)
        self.write_json(await self._describe(model_id, info, saved, saved))

    async def post(self, model_id: str) -> None:
        body = self.json_body()
        registry = self.service.registry
        info = await self.service.lookup(model_id)
        changes, dry_run = parse_changes(info.recipe, body)  # raises before anything is written
        backend = changes.get("llamacpp_backend")
        if backend is not None:  # one that cannot run here is refused; one not installed yet may be saved
            await self.service.manager.check_backend(info.recipe, str(backend), installed=False)
        if not dry_run:
            self.require_admin("changing a model's saved options")
        if dry_run:
            on_disk = await asyncio.to_thread(registry.saved_options, info.id)
            entry = apply_changes(on_disk, changes)
        else:
            entry = on_disk = await self._save(registry.update_options, info.id, lambda e: apply_changes(e, changes))
        self.write_json(await self._describe(model_id, info, on_disk, entry))

    async def delete(self, model_id: str) -> None:
        self.require_admin("clearing a model's saved options")
        info = await self.service.lookup(model_id)
        await self._save(self.service.registry.save_options, info.id, {})
        self.write_json(await self._describe(model_id, info, {}, {}))

    @staticmethod
    async def _save(write: Any, *args: Any) -> Any:
        try:
            return await asyncio.to_thread(write, *args)
        except OSError as exc:
            raise LemonkitError(f"Could not save recipe_options.json: {exc}", code="internal_error") from exc

    async def _describe(
        self, model_id: str, info: ModelInfo, saved: dict[str, Any], entry: dict[str, Any]
    ) -> dict[str, Any]:
        """The spec's answer: ``saved`` is the entry on disk, ``effective`` resolves ``entry`` (the would-be one
        under ``dry_run``)."""
        resolved = await self.service.manager.options_for(info, saved=entry)
        n_ctx_train = auto_limit = None
        if "ctx_size" in resolved.effective:  # the GGUF header's trained context, else the catalog's figure
            n_ctx_train = await asyncio.to_thread(max_context_window, self.service.registry, info)
            auto_limit = await asyncio.to_thread(self._auto_limit, info, resolved.effective)
        return {
            "model_name": model_id,
            "recipe": info.recipe,
            "saved": saved,
            "effective": load_body(model_id, resolved.effective),
            "defaults": load_body(model_id, resolved.defaults),
            "resolved_ctx_size": resolved_ctx_size(info, resolved.effective, n_ctx_train, auto_limit=auto_limit),
        }

    def _auto_limit(self, info: ModelInfo, effective: dict[str, Any]) -> int | None:
        """What an automatic context of ``info`` is capped at, as its load will work it out (its GGUF must be on
        disk: before a download the catalog's trained context is all there is)."""
        if info.recipe != "llamacpp":
            return None
        main = next((f for f in self.service.registry.model_files(info) if f["role"] == "main" and f["exists"]), None)
        return self.service.manager.auto_context_limit(Path(main["path"]), effective) if main else None
