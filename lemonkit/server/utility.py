"""llama-server's utility routes (``POST /tokenize``, ``POST /detokenize``, ``GET /props``, ``GET /slots``,
``POST /slots/{id}?action=save|restore|erase``), under every API prefix, for a llama.cpp model named by ``model``
(in the body, or the query). Without one they take the loaded chat model, as llama-server, which serves one model,
does."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx

from lemonkit.catalog.hf_cache import safe_relpath
from lemonkit.errors import BackendError, InvalidArgument, MissingArgument, error_from_body
from lemonkit.formats.health import loaded_model
from lemonkit.server.openai import InferenceHandler, ModelRouteHandler
from lemonkit.serving.loaded_model import LoadedModel

__all__ = ["DetokenizeHandler", "PropsHandler", "SlotActionHandler", "SlotsHandler", "TokenizeHandler"]


class _LlamaRoute(ModelRouteHandler):
    serves: tuple[str, ...] = ("llm", "embedding", "reranking")

    def model_named(self, body: dict[str, Any]) -> dict[str, Any]:
        """``body`` with its ``model``: the one it names, else the loaded chat model."""
        name = body.get("model") or loaded_model(self.service.manager.health(), "llm")
        if not isinstance(name, str) or not name:
            raise MissingArgument("model: required (no chat model is loaded to default to)")
        return {**body, "model": name}

    async def run(self, model: LoadedModel, body: dict[str, Any]) -> None:
        self.write_json(await self.sidecar_json(model, self.sidecar_path, body))


class TokenizeHandler(_LlamaRoute, InferenceHandler):
    """``POST /v1/tokenize`` (``content``, ``add_special``, ``with_pieces``)."""

    sidecar_path = "/v1/tokenize"

    async def post(self) -> None:
        await self.serve_model(self.model_named(self.json_body()))


class DetokenizeHandler(_LlamaRoute, InferenceHandler):
    """``POST /v1/detokenize`` (``tokens``)."""

    sidecar_path = "/v1/detokenize"

    async def post(self) -> None:
        await self.serve_model(self.model_named(self.json_body()))


class PropsHandler(_LlamaRoute):
    """``GET /v1/props?model=``: the model's context, slots, chat template and sampling defaults (loaded first)."""

    async def get(self) -> None:
        await self.serve_model(self.model_named({"model": self.get_query_argument("model", None)}))

    async def run(self, model: LoadedModel, body: dict[str, Any]) -> None:
        self.write_json(await sidecar_read(model, "/props"))


async def sidecar_read(model: LoadedModel, path: str) -> dict[str, Any]:
    """A sidecar's answer to a ``GET`` of its state (read on its loop, never queued behind generations).

    Raises:
        BackendError: The sidecar is unreachable or answered with an error.
    """
    try:
        response = await model.client.get(path, timeout=30)
    except httpx.TransportError as exc:
        raise BackendError(f"The engine of {model.name} is not responding ({exc})", status=502) from None
    if response.status_code != 200:
        raise error_from_body(response.status_code, response.json(), response.text)
    answer: dict[str, Any] = response.json()
    return answer


class SlotsHandler(_LlamaRoute):
    """``GET /v1/slots?model=``: each slot of a loaded llama.cpp model (without ``model``: of every one, each
    slot with its ``model``). It never loads a model: slots exist only while one is loaded."""

    async def get(self) -> None:
        manager = self.service.manager
        name = self.get_query_argument("model", None)
        if name is not None:
            info = await self.service.lookup(name)
            chosen = [m for m in manager.loaded_models() if m.name == info.id]
        else:
            chosen = [m for m in manager.loaded_models() if m.info.recipe == "llamacpp" and m.upstream is None]
        answers = await asyncio.gather(*(sidecar_read(m, "/slots") for m in chosen))
        self.write_json(
            [{**slot, "model": m.name} for m, answer in zip(chosen, answers, strict=True) for slot in answer["slots"]]
        )


class SlotActionHandler(_LlamaRoute):
    """``POST /v1/slots/{id}?action=save|restore|erase`` (llama-server's, ``{"filename"}`` in the body for save and
    restore): an idle slot's cached prompt written to a file, read back into the slot (which continues from it), or
    dropped. The files live under the server's cache, one folder per model (``<cache_dir>/slots/<model>/``, the
    server's ``--slot-save-path``); the model is loaded first if it is not. On a shared server only an admin may:
    a saved prompt is another user's text."""

    serves = ("llm",)
    sidecar_path = "/v1/slots/action"

    async def post(self, slot_id: str) -> None:
        self.require_admin("save, restore or erase a slot's prompt")
        body = self.json_body(optional=True)
        action = self.get_query_argument("action", None)
        if action not in ("save", "restore", "erase"):
            raise InvalidArgument(f"action must be save, restore or erase, got {action!r}")
        filename = body.get("filename")
        if action != "erase":
            if not isinstance(filename, str):
                raise MissingArgument(f"filename: required to {action} a slot")
            try:
                parts = safe_relpath(filename, what="filename").parts
            except ValueError as exc:
                raise InvalidArgument(str(exc)) from None
            if len(parts) != 1:
                raise InvalidArgument(f"filename {filename!r} must name a file, not a path")
        model = body.get("model") or self.get_query_argument("model", None)
        request = {"id_slot": int(slot_id), "action": action, "filename": filename}
        await self.serve_model(self.model_named({**request, "model": model} if model else request))

    async def run(self, model: LoadedModel, body: dict[str, Any]) -> None:
        request = {"id_slot": body["id_slot"], "action": body["action"]}
        if body["filename"] is not None:
            folder = self.service.settings.cache_dir / "slots" / safe_relpath(model.name, what="model").name
            path = folder / body["filename"]
            if body["action"] == "restore" and not await asyncio.to_thread(path.is_file):
                raise InvalidArgument(f"no saved prompt named {body['filename']!r} for {model.name}")
            await asyncio.to_thread(Path.mkdir, folder, parents=True, exist_ok=True)
            request["path"] = str(path)
        answer = await self.sidecar_json(model, self.sidecar_path, request)
        self.write_json({**answer, **({"filename": body["filename"]} if body["filename"] is not None else {})})
