"""Handlers for the OpenAI-compatible routes (spec: ``openai-api.md``)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import math
import secrets
import struct
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
from tornado.iostream import StreamClosedError

from lemonkit.catalog.model_info import a_model_of
from lemonkit.catalog.registry import COLLECTION_OMNI, ModelInfo
from lemonkit.catalog.support import Support
from lemonkit.errors import InvalidArgument, LemonkitError, ModelNotApplicable, NotEmbeddingModel, NotFound
from lemonkit.formats import schemas, sse
from lemonkit.formats.headers import CACHE_HEADER, PROVENANCE_HEADER
from lemonkit.server import provenance, response_stream, responses
from lemonkit.server.handler import LemonkitHandler, error_event
from lemonkit.server.omni_loop import OmniChat
from lemonkit.serving import answer_cache
from lemonkit.serving.loaded_model import LoadedModel

__all__ = [
    "ChatCompletionsHandler",
    "CompletionsHandler",
    "EmbeddingsHandler",
    "ModelHandler",
    "ModelRouteHandler",
    "ModelsHandler",
    "RerankHandler",
    "ResponsesHandler",
    "StoredResponseHandler",
    "embedding_dimensions",
]

log = logging.getLogger("lemonkit.server")


def _flag(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes")


class ModelRouteHandler(LemonkitHandler):
    """A route that runs a model, whatever its method: resolve, load on first use, forward to the model's
    sidecar. Subclasses add the method (``post`` for :class:`InferenceHandler`)."""

    #: the sidecar route this handler forwards to
    sidecar_path = ""
    #: model types this route serves
    serves: tuple[str, ...] = ("llm",)

    async def serve_model(self, body: dict[str, Any]) -> None:
        """Run ``body`` (a checked request naming its ``model``) on its model."""
        await self.serve_on(await self.service.usable(body["model"]), body)

    async def serve_on(self, info: ModelInfo, body: dict[str, Any]) -> None:
        """Run ``body`` on ``info``, the model it names."""
        self.check_applicable(info)
        await self.unless_gone(self._serve(info, body))  # a client that leaves also ends a first-use download

    #: the answer cache keeps this route's deterministic answers, under this name (None: never)
    cache_route: str | None = None
    #: whether the route samples (embeddings and rerank do not: their answers are always deterministic)
    samples = True
    #: whether the cache keeps the route's streams too (as their events: answer_cache.kept_stream)
    cache_streams = False
    _cache_key: str | None = None
    _held: Any = None

    async def _serve(self, info: ModelInfo, body: dict[str, Any]) -> None:
        # a shared server's model loads with its saved options unless an admin asks otherwise
        ctx_size = body.get("ctx_size") if self.caller.admin else None
        cached = self._cache_wanted(body)
        loaded = self.service.manager.loaded(info.id)
        if cached and loaded is not None and await self._from_cache(loaded, body):
            return  # answered without waiting for a turn at the model
        async with self.service.manager.use(info.id, ctx_size=ctx_size) as model:
            self.set_header(PROVENANCE_HEADER, await provenance.header_value(model))
            if cached and loaded is not model and await self._from_cache(model, body):
                return
            await self.run(model, body)
        await self._send_held()

    # -- the answer cache (lemonkit.serving.answer_cache) --------------------------------------------------------

    def _cache_wanted(self, body: dict[str, Any]) -> bool:
        """Whether to answer ``body`` from the cache and keep its answer: asked for (the ``cache`` field, else the
        ``X-Lemonkit-Cache: use`` header), on a route that caches, for a deterministic request (streamed where the
        route keeps streams).
        Takes ``cache`` out of ``body`` (the engine does not know it).

        Raises:
            InvalidArgument: ``cache`` is not a boolean.
        """
        if self.cache_route is None:
            return False
        asked = body.pop("cache", None)
        if asked is not None and not isinstance(asked, bool):
            raise InvalidArgument(f"cache: expected true or false, got {asked!r}")
        if asked is None:
            asked = self.request.headers.get(CACHE_HEADER, "").strip().lower() in ("use", "1", "true", "yes")
        return (
            asked
            and self.service.answers.enabled
            and (not body.get("stream") or self.cache_streams)
            and answer_cache.deterministic(body, samples=self.samples)
            and self.cacheable(body)
        )

    def cacheable(self, body: dict[str, Any]) -> bool:
        """Whether the route's answer to ``body`` depends on nothing but the request and the model."""
        return True

    async def _lookup(self, model: LoadedModel, body: dict[str, Any]) -> tuple[str | None, bytes | None]:
        """``body``'s key and the cache's bytes for it (``None``: not there). Weights whose sha256 is unknown (a
        large file outside the hub cache) have no key: never cached."""
        facts = json.loads(await provenance.header_value(model))
        if facts.get("file_sha256") is None:
            return None, None
        key = answer_cache.key(self.cache_route or "", facts, body)
        return key, await asyncio.to_thread(self.service.answers.get, self.caller.name, key)

    @staticmethod
    def _marked(data: bytes) -> dict[str, Any]:
        """A kept whole answer, marked as a cached answer."""
        answer: dict[str, Any] = json.loads(data)
        if isinstance(answer.get("usage"), dict):
            answer["usage"]["cached_answer"] = True
        return answer

    async def _from_cache(self, model: LoadedModel, body: dict[str, Any]) -> bool:
        """Answer from the cache when it holds the answer; else note the key, so :meth:`write_json` (or, for a
        stream, :meth:`pump`) keeps the answer."""
        key, data = await self._lookup(model, body)
        if data is None:
            self._cache_key = key
            if key is not None:
                self.set_header(CACHE_HEADER, "miss")
            return False
        self.set_header(PROVENANCE_HEADER, await provenance.header_value(model))
        self.set_header(CACHE_HEADER, "hit")
        if body.get("stream"):
            await self.sse_open()
            with contextlib.suppress(StreamClosedError):
                await self.sse_write(answer_cache.replayed_stream(data))
                self.finish()
            return True
        super().write_json(self._marked(data))
        return True

    async def cached(self, body: dict[str, Any]) -> dict[str, Any] | None:
        """The answer cache's answer to ``body``, a request of this route, without running it (``None``: it is not
        there, or not a request the cache keeps). Loads the model if it is not loaded: the key names the options it
        runs with.

        Raises:
            LemonkitError: ``body`` is not a valid request of this route, or its model cannot be loaded.
        """
        if self.schema is not None:
            body = schemas.validate(self.schema, body)
        info = await self.service.usable(body["model"])
        self.check_applicable(info)
        if info.recipe == COLLECTION_OMNI or body.get("stream") or not self._cache_wanted(body):
            return None
        model = self.service.manager.loaded(info.id)
        if model is None:
            async with self.service.manager.use(info.id) as model:
                data = (await self._lookup(model, body))[1]
        else:
            data = (await self._lookup(model, body))[1]
        return None if data is None else self._marked(data)

    def write_json(self, data: Any, status: int = 200) -> None:
        if self._cache_key is not None and status == 200:
            self._held = data  # sent once the cache keeps it (_send_held): the same request asked next is a hit
            return
        super().write_json(data, status)

    async def _send_held(self) -> None:
        """Keep the answer :meth:`write_json` held in the answer cache, then send it."""
        data, self._held = self._held, None
        key, self._cache_key = self._cache_key, None
        if data is None or key is None:
            return
        payload = json.dumps(data)  # once: the cache keeps the bytes the client gets
        try:
            await asyncio.to_thread(self.service.answers.put, self.caller.name, key, payload.encode())
        except (OSError, ValueError) as exc:
            log.warning("the answer cache could not keep an answer: %s", exc)
        self.write_encoded(payload)

    def _can_hand_off(self, model: LoadedModel) -> bool:
        # a stream the cache keeps passes through here (pump), where its events are seen
        return self._cache_key is None and super()._can_hand_off(model)

    async def pump(self, frames: AsyncIterator[bytes]) -> None:
        if self._cache_key is None:
            await super().pump(frames)
            return
        await super().pump(self._keeping(frames, self._cache_key))

    async def _keeping(self, frames: AsyncIterator[bytes], key: str) -> AsyncIterator[bytes]:
        """``frames`` as they come; a stream that ends whole is kept in the answer cache before its last frame goes
        out, so the same request sent once this one has ended is a hit. A client that leaves ends this generator
        before that: nothing is kept."""
        self._cache_key = None  # kept here, not by write_json
        sent = bytearray()
        async for frame in frames:
            sent += frame
            if sent.endswith(sse.DONE):
                try:  # off the event loop: reading a long stream's events back takes a while
                    await asyncio.to_thread(self._keep_stream, key, bytes(sent))
                except (OSError, ValueError) as exc:
                    log.warning("the answer cache could not keep a stream: %s", exc)
            yield frame

    def _keep_stream(self, key: str, sent: bytes) -> None:
        kept = answer_cache.kept_stream(sent)
        if kept is not None:
            self.service.answers.put(self.caller.name, key, kept)

    def check_applicable(self, info: ModelInfo) -> None:
        if info.type not in self.serves:
            raise ModelNotApplicable(
                f"{info.id} is {a_model_of(info.type)}; {self.request.path} needs {self.serves[0]}"
            )

    async def run(self, model: LoadedModel, body: dict[str, Any]) -> None:
        if body.get("stream"):
            await self.sidecar_stream(model, self.sidecar_path, body)
        else:
            self.write_json(self.shape(await self.sidecar_json(model, self.sidecar_path, body), body))

    def shape(self, result: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
        """Adapt the engine's answer to what the client asked for (non-streaming)."""
        return result


class InferenceHandler(ModelRouteHandler):
    """A ``POST`` route that runs a model: validate the body, then :meth:`serve_model`."""

    async def post(self) -> None:
        await self.serve_model(self.json_body())


class ChatCompletionsHandler(InferenceHandler):
    schema = "chat/completions"
    sidecar_path = "/v1/chat/completions"
    cache_route = "chat/completions"
    cache_streams = True

    async def serve_on(self, info: ModelInfo, body: dict[str, Any]) -> None:
        if info.recipe == COLLECTION_OMNI:  # the server-side tool loop over the collection's components
            await self.unless_gone(OmniChat(self, info, body).serve())
            return
        await super().serve_on(info, body)


class CompletionsHandler(InferenceHandler):
    schema = "completions"
    sidecar_path = "/v1/completions"
    cache_route = "completions"
    cache_streams = True


class ResponsesHandler(InferenceHandler):
    """The Responses API, served by translating to and from the model's chat completions."""

    schema = "responses"
    sidecar_path = "/v1/chat/completions"
    cache_route = "responses"
    cache_streams = True
    _history: list[dict[str, Any]] = []

    def cacheable(self, body: dict[str, Any]) -> bool:
        # a stored conversation may change or go, and a response asked to be stored must be stored anew
        return body.get("previous_response_id") is None and not body.get("store")

    async def serve_on(self, info: ModelInfo, body: dict[str, Any]) -> None:
        previous = body.get("previous_response_id")
        if previous is not None:  # before any load: an unknown id is the client's mistake
            record = await asyncio.to_thread(self.service.responses.load, self.caller.name, previous)
            if record is None:
                raise NotFound(
                    f"Previous response with id {previous!r} not found (stored with store: true, by this user)",
                    code="previous_response_not_found",
                )
            # the conversation goes on; the earlier instructions do not (as OpenAI's previous_response_id)
            self._history = [m for m in record["messages"] + record["output"] if m.get("role") != "system"]
        await super().serve_on(info, body)

    def _chat(self, body: dict[str, Any]) -> dict[str, Any]:
        chat = responses.to_chat_request(body)
        if self._history:
            messages = chat["messages"]
            system = messages[:1] if body.get("instructions") else []
            chat["messages"] = system + self._history + messages[len(system) :]
        return chat

    async def _store(self, body: dict[str, Any], chat: dict[str, Any], response: dict[str, Any]) -> None:
        """Keep a response asked to be stored, with the conversation it continues (``store: true``; the
        default is not to, so nothing piles up on disk unasked)."""
        if not body.get("store"):
            return
        record = {
            "response": response,
            "messages": chat["messages"],
            "output": responses.output_messages(response.get("output") or []),
        }
        await asyncio.to_thread(self.service.responses.save, self.caller.name, response["id"], record)

    async def run(self, model: LoadedModel, body: dict[str, Any]) -> None:
        chat = self._chat(body)
        response_id = "resp_" + secrets.token_urlsafe(24)
        created_at = int(time.time())
        if not body.get("stream"):
            result = await self.sidecar_json(model, self.sidecar_path, chat)
            response = responses.from_chat_completion(
                result, response_id=response_id, created_at=created_at, model=body["model"], request=body
            )
            await self._store(body, chat, response)
            self.write_json(response)
            return
        upstream = await self.sidecar_request(model, self.sidecar_path, chat)
        stream = response_stream.ResponseStream(
            response_id=response_id, created_at=created_at, model=body["model"], request=body
        )
        await self.sse_open()
        await self.pump(self._events(model, upstream, stream, body, chat))

    async def _events(
        self,
        model: LoadedModel,
        upstream: httpx.Response,
        stream: response_stream.ResponseStream,
        body: dict[str, Any],
        chat: dict[str, Any],
    ) -> AsyncIterator[bytes]:
        try:
            async with contextlib.aclosing(self.sidecar_feed(model, upstream)) as chunks:
                async for chunk in chunks:
                    if chunk is None:
                        yield sse.PING
                        continue
                    yield b"".join(sse.frame(data, name) for name, data in stream.feed(chunk))
            events = stream.finish()
            for name, data in events:
                if name == "response.completed":
                    await self._store(body, chat, data["response"])
            yield b"".join(sse.frame(data, name) for name, data in events) + sse.DONE
        except LemonkitError as exc:
            yield error_event(exc)


class StoredResponseHandler(LemonkitHandler):
    """``GET`` and ``DELETE /v1/responses/{id}``: a response this user stored (``store: true``)."""

    async def get(self, response_id: str) -> None:
        record = await asyncio.to_thread(self.service.responses.load, self.caller.name, response_id)
        if record is None:
            raise NotFound(f"No stored response with id {response_id!r}", code="response_not_found")
        self.write_json(record["response"])

    async def delete(self, response_id: str) -> None:
        if not await asyncio.to_thread(self.service.responses.delete, self.caller.name, response_id):
            raise NotFound(f"No stored response with id {response_id!r}", code="response_not_found")
        self.write_json({"id": response_id, "object": "response", "deleted": True})


class EmbeddingsHandler(InferenceHandler):
    schema = "embeddings"
    sidecar_path = "/v1/embeddings"
    serves = ("embedding",)
    cache_route = "embeddings"
    samples = False

    def check_applicable(self, info: ModelInfo) -> None:
        if info.type == "llm" and info.recipe == "llamacpp":
            raise NotEmbeddingModel(f"{info.id} is not an embedding model; load one labelled 'embeddings'")
        super().check_applicable(info)

    async def run(self, model: LoadedModel, body: dict[str, Any]) -> None:
        self.write_json(self.shape(await self.sidecar_json(model, self.sidecar_path, body), body))

    def shape(self, result: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
        if body.get("dimensions") is not None:
            vectors = embedding_dimensions(
                [item["embedding"] for item in result["data"]], body["dimensions"], body["model"]
            )
            for item, vector in zip(result["data"], vectors, strict=True):
                item["embedding"] = vector
        if body.get("encoding_format") == "base64":
            for item in result["data"]:
                vector = item["embedding"]
                item["embedding"] = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
        return result


def embedding_dimensions(vectors: list[list[float]], dimensions: int, model: str) -> list[list[float]]:
    """``vectors`` cut to their first ``dimensions`` values and scaled back to unit length, as OpenAI's
    ``dimensions`` and Ollama's do (the leading values carry the most for Matryoshka-trained models).

    Raises:
        InvalidArgument: More dimensions than the model's vectors have.
    """
    if vectors and dimensions > len(vectors[0]):
        raise InvalidArgument(f"dimensions: {model}'s embeddings have {len(vectors[0])}, fewer than {dimensions}")
    cut = []
    for vector in vectors:
        head = vector[:dimensions]
        norm = math.sqrt(sum(v * v for v in head)) or 1.0
        cut.append([v / norm for v in head])
    return cut


class RerankHandler(InferenceHandler):
    schema = "rerank"
    sidecar_path = "/v1/rerank"
    serves = ("reranking",)
    cache_route = "rerank"
    samples = False

    async def run(self, model: LoadedModel, body: dict[str, Any]) -> None:
        self.write_json(await self.sidecar_json(model, self.sidecar_path, body))


class ModelsHandler(LemonkitHandler):
    """``GET/HEAD /v1/models``: the downloaded models this machine runs; ``show_all`` adds the rest of the
    registry, each model that does not run here with its ``unsupported_reason``."""

    async def get(self) -> None:
        show_all = _flag(self.get_query_argument("show_all", None))
        include_paths = _flag(self.get_query_argument("include_paths", None))
        service = self.service

        def build() -> list[dict[str, Any]]:
            objects = []
            for info in service.registry.list(show_all=show_all):
                support = service.support.model(info, service.registry)
                if show_all or support.supported:
                    objects.append(_model_object(self, info, support, include_paths))
            return objects

        self.write_json({"object": "list", "data": await asyncio.to_thread(build)})

    async def head(self) -> None:
        self.set_header("Content-Type", "application/json")
        self.finish()


class ModelHandler(LemonkitHandler):
    """``GET /v1/models/{id}``."""

    async def get(self, model_id: str) -> None:
        include_paths = _flag(self.get_query_argument("include_paths", None))
        service = self.service
        info = await service.lookup(model_id)

        def build() -> dict[str, Any]:
            return _model_object(self, info, service.support.model(info, service.registry), include_paths)

        self.write_json(await asyncio.to_thread(build))


def _model_object(handler: LemonkitHandler, info: ModelInfo, support: Support, include_paths: bool) -> dict[str, Any]:
    """The spec's model object, with whether the model runs on this machine."""
    model = handler.service.manager.loaded(info.target_id)
    context_length = model.engine_info.get("ctx_size") if model else None
    obj = handler.service.registry.model_object(info, include_paths=include_paths, context_length=context_length)
    return {**obj, **support.fields()}
