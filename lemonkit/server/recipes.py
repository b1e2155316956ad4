"""Recipe routes: ``GET /v1/recipes`` and ``POST /v1/recipes/run`` (spec: ``audio-api.md``).

The catalogue and the request's checks are :mod:`lemonkit.serving.recipe_pipelines`', the voice-chat pipeline is
:mod:`lemonkit.serving.voice_pipeline`'s; this module serves them and reaches the models (:class:`SidecarStages`: each
role's model held through the manager, as any inference route holds its one).

``stream: true`` answers with the event/done SSE envelope of ``/v1/tasks/stream``: ``task.stream.event`` frames,
then ``task.stream.done`` with the result and ``data: [DONE]``; a failure once the stream started is one
``{"type": "error", "error": {"message"}}`` frame. The stream opens only once the question is transcribed, so that
an unreadable or undecodable question is refused with its HTTP status, as without ``stream``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from lemonkit.backends.protocol import Upload
from lemonkit.catalog.model_info import a_model_of
from lemonkit.errors import LemonkitError, ModelNotApplicable
from lemonkit.formats import sse
from lemonkit.server.handler import LemonkitHandler
from lemonkit.server.tasks import task_error_event, task_event
from lemonkit.server.transcriptions import read_allowed_file
from lemonkit.serving import recipe_pipelines as recipes
from lemonkit.serving.voice_pipeline import Speaker, VoiceChat

__all__ = ["RecipeRunHandler", "RecipesHandler", "SidecarStages"]

log = logging.getLogger("lemonkit.server")


class SidecarStages:
    """The voice chat's models reached through their sidecars, each held with :meth:`ModelManager.use` for as long
    as the pipeline needs it, inside the run's one admission (:meth:`ModelManager.request`): toward the caller's
    limits and rate a run is one request, though the voice speaks while the reply is generated.

    Args:
        handler: The request's handler (its sidecar helpers, its manager).
    """

    def __init__(self, handler: LemonkitHandler) -> None:
        self.handler = handler
        self.manager = handler.service.manager

    async def transcribe(self, audio: bytes, model: str, options: dict[str, Any]) -> dict[str, Any]:
        async with self.manager.use(model) as loaded:
            body = {"model": model, **options, "word_timestamps": False, "stream": False}
            files = [Upload("question", audio)]
            return await self.handler.sidecar_json(loaded, "/v1/audio/transcriptions", body, files=files)

    async def chat(self, model: str, messages: list[dict[str, str]], options: dict[str, Any]) -> AsyncIterator[str]:
        async with self.manager.use(model) as loaded:
            body = {"model": model, "messages": messages, **options, "stream": True}
            response = await self.handler.sidecar_request(loaded, "/v1/chat/completions", body)
            # closed at once when the run ends early: that stops the generation
            async with contextlib.aclosing(self.handler.sidecar_events(loaded, response)) as chunks:
                async for chunk in chunks:
                    for choice in chunk.get("choices") or ():
                        yield (choice.get("delta") or {}).get("content") or ""

    @contextlib.asynccontextmanager
    async def speaker(self, model: str, options: dict[str, Any]) -> AsyncIterator[Speaker]:
        async with self.manager.use(model) as loaded:

            async def speak(text: str) -> tuple[bytes, int]:
                body = {"model": model, "input": text, **options, "response_format": "pcm"}
                response = await self.handler.sidecar_request(loaded, "/v1/audio/speech", body)
                pcm = await self.handler.sidecar_body(loaded, response)
                return pcm, int(response.headers["X-Sample-Rate"])

            yield speak


class RecipesHandler(LemonkitHandler):
    """``GET /v1/recipes``: every recipe with its roles (task, mode, default model, options) and whether it runs
    here; one that does not says why."""

    async def get(self) -> None:
        listed = []
        for recipe in recipes.RECIPES.values():
            entry = recipe.describe()
            if not recipe.unavailable:
                reason = await self._missing(recipe)
                if reason:
                    entry.update(available=False, unavailable_reason=reason)
            listed.append(entry)
        self.write_json({"recipes": listed})

    async def _missing(self, recipe: recipes.Recipe) -> str:
        """Why the recipe's default models cannot run here (``""``: they can)."""
        for role in recipe.roles:
            if role.default is None:
                continue
            try:
                await self.service.usable(role.default())
            except LemonkitError as exc:
                return f"its {role.name} model {role.default()} cannot run: {exc.message}"
        return ""


class RecipeRunHandler(LemonkitHandler):
    """``POST /v1/recipes/run``: the voice-chat recipe, answered as one JSON result or (``stream: true``) as the
    event/done envelope."""

    async def post(self) -> None:
        run = recipes.parse_run(self.json_body())
        for role in run.recipe.roles:
            info = await self.service.usable(run.models[role.name])
            if info.type != role.model_type:
                raise ModelNotApplicable(
                    f"models.{role.name}: {info.id} is {a_model_of(info.type)}; the {role.name} role needs "
                    f"a {role.model_type} model"
                )
        audio = run.audio
        if audio is None:
            audio = (
                await asyncio.to_thread(read_allowed_file, run.audio_path, self.service.settings.allowed_dirs)
            ).content
        chat = VoiceChat(run, SidecarStages(self), audio)
        async with self.service.manager.request(run.models[run.recipe.roles[0].name]):
            events = chat.events()
            try:
                if run.stream:
                    await self._stream(chat, events)
                elif await self.unless_gone(_drain(events)):
                    self.write_json(chat.result)
            finally:
                await events.aclose()  # a client that left stops every stage

    async def _stream(self, chat: VoiceChat, events: AsyncGenerator[dict[str, Any], None]) -> None:
        first: list[dict[str, Any]] = []

        async def begin() -> None:
            first.append(await anext(events))

        if not await self.unless_gone(begin()):  # an error before this point keeps its HTTP status
            return
        await self.sse_open()
        await self.pump(self._frames(chat, first[0], events))

    async def _frames(
        self, chat: VoiceChat, first: dict[str, Any], events: AsyncGenerator[dict[str, Any], None]
    ) -> AsyncIterator[bytes]:
        try:
            yield task_event({"type": "task.stream.event", "event": first})
            async for event in events:
                yield task_event({"type": "task.stream.event", "event": event})
            yield task_event({"type": "task.stream.done", "result": chat.result})
            yield sse.DONE
        except LemonkitError as exc:
            yield task_error_event(exc.message)
        except Exception:
            log.exception("voice chat failed")
            yield task_error_event("The recipe failed unexpectedly; see the log")


async def _drain(events: AsyncGenerator[dict[str, Any], None]) -> None:
    async for _ in events:
        pass
