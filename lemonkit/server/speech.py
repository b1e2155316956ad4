"""Text-to-speech routes: ``POST /v1/audio/speech``, ``GET /v1/audio/voices`` (spec: ``openai-api.md``,
``audio-api.md``) and ``GET /v1/audio/models``, the speech models (what Open WebUI's model picker asks for).

The model's sidecar synthesises (:mod:`lemonkit.backends.tts`); these handlers check the request before anything
loads, then pass the sidecar's answer through: an encoded file or JSON as one body, raw PCM chunk by chunk
(flushed as each sentence is synthesised), or SSE events. A client that hangs up closes the sidecar request,
which stops the synthesis at its next sentence.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
from tornado.iostream import StreamClosedError

from lemonkit.backends.tts import response_format, streaming_mode
from lemonkit.catalog import config
from lemonkit.formats.health import loaded_model
from lemonkit.server.handler import LemonkitHandler
from lemonkit.server.openai import InferenceHandler, ModelRouteHandler
from lemonkit.serving.loaded_model import LoadedModel

__all__ = ["SpeechHandler", "SpeechModelsHandler", "VoicesHandler"]

#: sidecar answer headers passed on to the client
_PASSED_HEADERS = ("Content-Type", "X-Sample-Rate")


class SpeechHandler(InferenceHandler):
    """``POST /v1/audio/speech``."""

    schema = "audio/speech"
    sidecar_path = "/v1/audio/speech"
    serves = ("tts",)

    def json_body(self, *, optional: bool = False) -> dict[str, Any]:
        body = super().json_body(optional=optional)
        response_format(body)  # a stream of mp3, say: refused before the model loads
        return body

    async def run(self, model: LoadedModel, body: dict[str, Any]) -> None:
        stream = streaming_mode(body)
        # The sidecar opens an SSE answer early only for stream: true with stream_format absent or "sse": name
        # the mode explicitly, so a raw stream waits for its first bytes (and an early error keeps its status).
        upstream = {k: v for k, v in body.items() if k not in ("stream", "stream_format")}
        if stream is not None:
            upstream.update(stream=True, stream_format=stream)
        if stream == "sse":
            await self.sidecar_stream(model, self.sidecar_path, upstream)
            return
        response = await self.sidecar_request(model, self.sidecar_path, upstream)
        for name in _PASSED_HEADERS:
            if name in response.headers:
                self.set_header(name, response.headers[name])
        if stream == "audio":
            await self._relay(model, response)
            return
        content = await self.sidecar_body(model, response)
        # Flushed before finish(): Jupyter's finish() would set the Content-Type to JSON while headers are unsent
        self.set_header("Content-Length", str(len(content)))
        self.write(content)
        await self.flush()
        self.finish()

    async def _relay(self, model: LoadedModel, response: httpx.Response) -> None:
        """Each chunk of raw audio as the sidecar sends it, until it ends or the client leaves."""
        self.set_status(200)
        self._sse_open = True  # the headers go out with the first chunk: a later failure cannot change them

        async def run() -> None:
            try:
                async for chunk in response.aiter_raw():
                    self.write(chunk)
                    await self.flush()
            finally:
                await response.aclose()

        try:
            finished = await self.unless_gone(run())
        except StreamClosedError:
            return
        except httpx.TransportError:
            # the engine died mid-stream: end the connection without the last chunk, so that the client sees a
            # broken body rather than a short one that looks complete
            self.service.manager.discard(model)
            self.request.connection.close()  # type: ignore[union-attr]
            return
        if finished:
            self.finish()


class VoicesHandler(ModelRouteHandler):
    """``GET /v1/audio/voices?model=``: the model's voices (without ``model``: the loaded text-to-speech model,
    else :func:`lemonkit.catalog.config.default_speech_model`)."""

    sidecar_path = "/v1/audio/voices"
    serves = ("tts",)

    async def get(self) -> None:
        name = self.get_query_argument("model", None) or loaded_model(self.service.manager.health(), "tts")
        await self.serve_model({"model": name or config.default_speech_model()})

    async def run(self, model: LoadedModel, body: dict[str, Any]) -> None:
        answer = await self.sidecar_json(model, self.sidecar_path, body)
        # the spec's names, and the same voices as the {id, name} objects OpenAI-style speech clients list
        names = answer.get("voices") or []
        answer["data"] = [{"id": v, "name": v, "object": "voice"} for v in names if isinstance(v, str)]
        self.write_json(answer)


class SpeechModelsHandler(LemonkitHandler):
    """``GET /v1/audio/models``: the text-to-speech models this machine runs, as the speech clients that pick a
    voice model read them (``models``: ``{id, name}``; ``data``: OpenAI model objects)."""

    async def get(self) -> None:
        service = self.service

        def build() -> list[str]:
            return [
                info.id
                for info in service.registry.list(show_all=False)
                if info.type == "tts" and service.support.model(info, service.registry).supported
            ]

        names = await asyncio.to_thread(build)
        self.write_json(
            {
                "models": [{"id": n, "name": n} for n in names],
                "object": "list",
                "data": [{"id": n, "object": "model", "owned_by": "lemonkit"} for n in names],
            }
        )
