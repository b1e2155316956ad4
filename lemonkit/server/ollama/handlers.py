"""Ollama's routes that run a model (``chat``, ``generate``, ``embed``, ``embeddings``), and the handler they all
share: each translates to what the OpenAI routes run (:mod:`.translate`) and answers in Ollama's shapes, NDJSON
lines as a stream goes."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx

from lemonkit.catalog.model_info import a_model_of
from lemonkit.catalog.registry import ModelInfo
from lemonkit.errors import (
    InvalidArgument,
    InvalidJSON,
    LemonkitError,
    MissingArgument,
    ModelNotApplicable,
)
from lemonkit.server.handler import LemonkitHandler, as_lemonkit_error
from lemonkit.server.ollama.translate import (
    NDJSON,
    OllamaAnswer,
    chat_request,
    generate_request,
    now,
    parse_keep_alive,
)
from lemonkit.server.openai import embedding_dimensions
from lemonkit.serving.loaded_model import LoadedModel


def _check_positive(value: Any, field: str, expected: str) -> None:
    """A field that is absent (``None``) or a positive integer.

    Raises:
        InvalidArgument: Anything else (a bool is not a number here).
    """
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise InvalidArgument(f"{field}: expected {expected}, got {value!r}")


# -- handlers -------------------------------------------------------------------------------------------------------


class OllamaHandler(LemonkitHandler):
    """Ollama's error shape, NDJSON streams and model names (``name`` or ``model``, ``:latest`` or not)."""

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info", (None, None, None))[1]
        err = as_lemonkit_error(exc, status_code)
        if self._sse_open:
            return  # the stream's last line said it
        self.clear()
        self.set_status(err.status)
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps({"error": err.message}))

    def ollama_body(self) -> dict[str, Any]:
        body = self.json_body(optional=True)
        if not isinstance(body, dict):
            raise InvalidJSON("The body is not a JSON object")
        return body

    @staticmethod
    def model_name(body: dict[str, Any], field: str = "model") -> str:
        name = body.get(field) or body.get("name")
        if not name or not isinstance(name, str):
            raise MissingArgument(f"{field}: required (the model's name)")
        return name

    async def model_for(self, body: dict[str, Any], kind: str, needs: str) -> ModelInfo:
        """The model ``body`` names, which must run here and be of type ``kind``.

        Raises:
            ModelNotApplicable: A model of another type (the message ends with ``needs``).
        """
        info = await self.service.usable(self.model_name(body))
        if info.type != kind:
            raise ModelNotApplicable(f"{info.id} is {a_model_of(info.type)}; {needs}")
        return info

    async def ndjson_open(self) -> None:
        self.set_status(200)
        self.set_header("Content-Type", NDJSON)
        self.set_header("Cache-Control", "no-cache")
        self._sse_open = True
        await self.flush()

    @staticmethod
    def line(data: dict[str, Any]) -> bytes:
        return json.dumps(data).encode() + b"\n"


class _ModelRun(OllamaHandler):
    """``/api/chat`` and ``/api/generate``: an empty request loads (``keep_alive: 0``: unloads) the model."""

    #: the key of the text in each line: ``message`` (chat) or ``response`` (generate)
    kind = "chat"

    async def post(self) -> None:
        start = time.perf_counter_ns()
        body = self.ollama_body()
        info = await self.model_for(body, "llm", f"/api/{self.kind} needs a chat model")
        keep_alive = parse_keep_alive(body.get("keep_alive"))
        num_ctx = (body.get("options") or {}).get("num_ctx") if isinstance(body.get("options"), dict) else None
        _check_positive(num_ctx, "options.num_ctx", "a positive number of tokens")
        ctx_size = num_ctx if self.caller.admin else None  # a shared server's models load with their saved options
        if self._empty(body):
            await self.unless_gone(self._load_only(info, body, keep_alive, ctx_size))
            return
        path, request = self.request_for(body, info.id)
        await self.unless_gone(self._run(info, body, path, request, keep_alive, ctx_size, start))

    def _empty(self, body: dict[str, Any]) -> bool:
        raise NotImplementedError

    def request_for(self, body: dict[str, Any], model_id: str) -> tuple[str, dict[str, Any]]:
        raise NotImplementedError

    def piece(self, text: str, thinking: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
        """The part of a line that carries ``text``: a ``message`` (chat) or a ``response`` (generate)."""
        raise NotImplementedError

    async def _load_only(self, info: ModelInfo, body: dict[str, Any], keep_alive: float | None, ctx: Any) -> None:
        manager = self.service.manager
        if body.get("keep_alive") is not None and keep_alive == 0:
            if manager.loaded(info.id) is not None:
                await manager.unload(info.id)
            reason = "unload"
        else:
            async with manager.use(info.id, ctx_size=ctx):
                pass
            manager.keep_alive(info.id, keep_alive, given="keep_alive" in body)
            reason = "load"
        self.write_json(
            {
                "model": body.get("model") or body.get("name"),
                "created_at": now(),
                **self.piece("", "", []),
                "done": True,
                "done_reason": reason,
            }
        )

    async def _run(
        self,
        info: ModelInfo,
        body: dict[str, Any],
        path: str,
        request: dict[str, Any],
        keep_alive: float | None,
        ctx_size: int | None,
        start: int,
    ) -> None:
        manager = self.service.manager
        name = body.get("model") or body.get("name")
        stream = body.get("stream") is not False
        try:
            async with manager.use(info.id, ctx_size=ctx_size) as model:
                ready = time.perf_counter_ns()
                upstream = await self.sidecar_request(model, path, request)
                answer = OllamaAnswer()
                if stream:
                    await self.ndjson_open()
                    await self.pump(self._lines(model, upstream, answer, name, start, ready))
                else:
                    async with contextlib.aclosing(self.sidecar_events(model, upstream)) as events:
                        async for chunk in events:
                            answer.step(chunk)
                    message = self.piece(
                        answer.content, answer.reasoning, [answer.call(i) for i in sorted(answer.calls)]
                    )
                    self.write_json(
                        {
                            "model": name,
                            "created_at": now(),
                            **message,
                            "done": True,
                            "done_reason": answer.done_reason,
                            **answer.figures(start, ready),
                        }
                    )
        finally:
            manager.keep_alive(info.id, keep_alive, given="keep_alive" in body)

    async def _lines(
        self, model: LoadedModel, upstream: httpx.Response, answer: OllamaAnswer, name: Any, start: int, ready: int
    ) -> AsyncIterator[bytes]:
        try:
            async with contextlib.aclosing(self.sidecar_events(model, upstream)) as events:
                async for chunk in events:
                    text, thinking, calls = answer.step(chunk)
                    if text or thinking or calls:
                        yield self.line(
                            {"model": name, "created_at": now(), **self.piece(text, thinking, calls), "done": False}
                        )
        except LemonkitError as exc:
            yield self.line({"error": exc.message})
            return
        yield self.line(
            {
                "model": name,
                "created_at": now(),
                **self.piece("", "", []),
                "done": True,
                "done_reason": answer.done_reason,
                **answer.figures(start, ready),
            }
        )


class ChatHandler(_ModelRun):
    """``POST /api/chat``."""

    kind = "chat"

    def _empty(self, body: dict[str, Any]) -> bool:
        return not body.get("messages")

    def request_for(self, body: dict[str, Any], model_id: str) -> tuple[str, dict[str, Any]]:
        return "/v1/chat/completions", chat_request(body, model_id)

    def piece(self, text: str, thinking: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if thinking:
            message["thinking"] = thinking
        if calls:
            message["tool_calls"] = calls
        return {"message": message}


class GenerateHandler(_ModelRun):
    """``POST /api/generate``."""

    kind = "generate"

    def _empty(self, body: dict[str, Any]) -> bool:
        return not body.get("prompt") and not body.get("images")

    def request_for(self, body: dict[str, Any], model_id: str) -> tuple[str, dict[str, Any]]:
        return generate_request(body, model_id)

    def piece(self, text: str, thinking: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
        return {"response": text, **({"thinking": thinking} if thinking else {})}


class EmbedHandler(OllamaHandler):
    """``POST /api/embed`` (``input``: a string or a list) and the older ``POST /api/embeddings`` (``prompt``)."""

    legacy = False

    async def post(self) -> None:
        start = time.perf_counter_ns()
        body = self.ollama_body()
        info = await self.model_for(body, "embedding", "/api/embed needs an embedding model")
        field = "prompt" if self.legacy else "input"
        texts = body.get(field)
        if isinstance(texts, str):
            texts = [texts]
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
            raise MissingArgument(f"{field}: required, a string{'' if self.legacy else ' or a list of strings'}")
        if body.get("truncate") is False:
            raise InvalidArgument(
                "truncate: lemonkit's embedding engines cut an input at the model's context; false is not supported"
            )
        keep_alive = parse_keep_alive(body.get("keep_alive"))
        dimensions = body.get("dimensions")
        _check_positive(dimensions, "dimensions", "a positive number")
        request = {"model": info.id, "input": texts}
        await self.unless_gone(self._run(info, body, request, dimensions, keep_alive, start))

    async def _run(
        self,
        info: ModelInfo,
        body: dict[str, Any],
        request: dict[str, Any],
        dimensions: int | None,
        keep_alive: float | None,
        start: int,
    ) -> None:
        manager = self.service.manager
        try:
            async with manager.use(info.id) as model:
                ready = time.perf_counter_ns()
                result = await self.sidecar_json(model, "/v1/embeddings", request)
        finally:
            manager.keep_alive(info.id, keep_alive, given="keep_alive" in body)
        vectors = [item["embedding"] for item in sorted(result["data"], key=lambda d: d["index"])]
        if dimensions is not None:
            vectors = embedding_dimensions(vectors, dimensions, info.id)
        if self.legacy:
            self.write_json({"embedding": vectors[0]})
            return
        end = time.perf_counter_ns()
        self.write_json(
            {
                "model": body.get("model") or body.get("name"),
                "embeddings": vectors,
                "total_duration": end - start,
                "load_duration": ready - start,
                "prompt_eval_count": int((result.get("usage") or {}).get("prompt_tokens") or 0),
            }
        )


class EmbeddingsHandler(EmbedHandler):
    legacy = True
