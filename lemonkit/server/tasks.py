"""audio-api.md's generic tasks: ``POST /v1/tasks/run``, ``/v1/tasks/stream``, ``/v1/tasks/batch``,
``/v1/tasks/unload_models`` and ``/v1/tasks/unload_all_models``.

A task is one ``request`` object (:mod:`lemonkit.server.task_requests` checks it and reads its files before any
model loads); the model's engine maps it onto what it does (:mod:`lemonkit.backends.task_engine`): a text-to-speech
model speaks ``text``, a speech-to-text model transcribes the audio. ``/run`` answers the result as JSON; ``/stream``
the engine's partial events and the result, as one JSON body or, with ``stream_format: "sse"``, as ``task.stream.event``
/ ``task.stream.done`` / ``[DONE]`` events written as the engine produces them. ``/batch`` runs entries through a
model's native batch path and refuses models that have none (400 ``model_not_applicable``) rather than running
entries one by one.

Once an SSE answer has started, a failure ends it with ``{"type": "error", "error": {"message"}}`` (the spec's
shape: no type, no status) and no ``[DONE]``; a client that leaves stops the engine at its next event.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
from tornado.iostream import StreamClosedError

from lemonkit.catalog.model_info import a_model_of
from lemonkit.catalog.registry import ModelInfo
from lemonkit.errors import BackendError, InvalidArgument, LemonkitError, ModelNotApplicable, ModelNotFound
from lemonkit.formats import sse
from lemonkit.formats.schema_nodes import BOOL, OBJ, STR, Arr, Obj, Str
from lemonkit.server.handler import LemonkitHandler
from lemonkit.server.openai import ModelRouteHandler
from lemonkit.server.task_requests import TaskInput, read_task
from lemonkit.serving.loaded_model import LoadedModel

__all__ = [
    "TaskBatchHandler",
    "TaskRunHandler",
    "TaskStreamHandler",
    "UnloadAllModelsHandler",
    "UnloadModelsHandler",
    "task_error_event",
    "task_event",
]

#: the model types whose engines take tasks
TASK_TYPES = ("tts", "transcription")
#: the model types whose engines have a native batch path (faster-whisper's batched pipeline)
BATCH_TYPES = ("transcription",)

_RUN = Obj({"model": STR, "request": OBJ}, required=["model", "request"])
_STREAM = Obj(
    {"model": STR, "request": OBJ, "stream_format": Str(["sse"]), "include_artifacts": BOOL},
    required=["model", "request"],
)
_BATCH = Obj({"model": STR, "requests": Arr(OBJ, min_items=1)}, required=["model", "requests"])
_UNLOAD = Obj({"model_ids": Arr(STR)}, required=["model_ids"])


def task_event(body: dict[str, Any]) -> bytes:
    """One frame of the tasks SSE envelope (``task.stream.event``, ``task.stream.done``, ``error``)."""
    return sse.frame(body)


def task_error_event(message: str) -> bytes:
    """The SSE frame that ends a task stream that failed after it started."""
    return task_event({"type": "error", "error": {"message": message}})


class TaskRunHandler(ModelRouteHandler):
    """``POST /v1/tasks/run``: one task, its result as JSON."""

    sidecar_path = "/v1/tasks/run"
    serves = TASK_TYPES
    body_schema = _RUN
    #: ``request.audio_base64`` is read (the other task routes ignore it)
    inline_audio = True
    task: TaskInput

    async def post(self) -> None:
        body = self.json_body()
        self.body_schema.check(body, "")
        info = await self.service.usable(body["model"])
        self.check_applicable(info)
        await self.read(body)
        if self.streams(body):
            await self.unless_gone(self._serve(info, body))  # an SSE client that leaves stops its run
        else:
            await self._serve(info, body)  # the spec: a JSON client that disconnects leaves its run to finish

    def streams(self, body: dict[str, Any]) -> bool:
        """Whether the answer is an event stream (else one JSON body)."""
        return False

    def check_applicable(self, info: ModelInfo) -> None:
        if info.type not in self.serves:
            raise ModelNotApplicable(
                f"{info.id} is {a_model_of(info.type)}; {self.request.path} runs tasks on audio models "
                "(text-to-speech and speech-to-text)"
            )

    async def read(self, body: dict[str, Any]) -> None:
        """Check the task and read its files, off the event loop."""
        allowed = self.service.settings.allowed_dirs
        self.task = await asyncio.to_thread(read_task, body.get("request"), allowed, inline_audio=self.inline_audio)

    async def run(self, model: LoadedModel, body: dict[str, Any]) -> None:
        response = await self.sidecar_request(model, self.sidecar_path, self.task.fields, files=self.task.files)
        content = await self.sidecar_body(model, response)  # passed on unparsed: it may carry megabytes of audio
        self.set_header("Content-Type", "application/json")
        self.finish(content)

    async def relay(self, model: LoadedModel, upstream: httpx.Response) -> AsyncIterator[bytes]:
        """A sidecar's task events as SSE frames; its error frame (or its death) becomes :func:`task_error_event`."""
        try:
            async with contextlib.aclosing(self.sidecar_feed(model, upstream)) as events:
                async for event in events:
                    yield sse.PING if event is None else sse.frame(event)
            yield sse.DONE
        except LemonkitError as exc:
            yield task_error_event(exc.message)


class TaskStreamHandler(TaskRunHandler):
    """``POST /v1/tasks/stream``: the events of one task and its result, as one JSON body or as SSE."""

    body_schema = _STREAM
    inline_audio = False

    def streams(self, body: dict[str, Any]) -> bool:
        return body.get("stream_format") == "sse"

    async def _serve(self, info: ModelInfo, body: dict[str, Any]) -> None:
        self.task.fields.update(stream=True, include_artifacts=body.get("include_artifacts") is True)
        if body.get("stream_format") != "sse":
            await super()._serve(info, body)
            return
        # The stream starts now: everything checkable was checked; a model that fails to load, or a request the
        # engine turns away, ends it with an error event (as the spec says)
        await self.sse_open()
        try:
            async with self.service.manager.use(info.id) as model:
                response = await self.sidecar_request(model, self.sidecar_path, self.task.fields, files=self.task.files)
                await self.pump(self.relay(model, response))
        except LemonkitError as exc:
            with contextlib.suppress(StreamClosedError):
                await self.sse_write(task_error_event(exc.message))
                self.finish()

    async def run(self, model: LoadedModel, body: dict[str, Any]) -> None:
        response = await self.sidecar_request(model, self.sidecar_path, self.task.fields, files=self.task.files)
        events: list[dict[str, Any]] = []
        result: dict[str, Any] | None = None
        async for item in self.sidecar_events(model, response):
            if item.get("type") == "task.stream.event":
                events.append(item["event"])
            elif item.get("type") == "task.stream.done":
                result = item["result"]
        if result is None:
            raise BackendError(f"The engine of {model.name} ended the stream without a result")
        self.write_json({"events": events, "result": result})


class TaskBatchHandler(TaskRunHandler):
    """``POST /v1/tasks/batch``: entries through the model's native batch path, as SSE ``task.batch.result`` (with
    the entry's ``index``) as each is done, then ``task.batch.done``."""

    sidecar_path = "/v1/tasks/batch"
    body_schema = _BATCH
    inline_audio = False
    tasks: list[TaskInput]

    def streams(self, body: dict[str, Any]) -> bool:
        return True

    def check_applicable(self, info: ModelInfo) -> None:
        super().check_applicable(info)
        if info.type not in BATCH_TYPES:
            raise ModelNotApplicable(
                f"{info.id} is {a_model_of(info.type)}, whose engine has no native batch path; /v1/tasks/batch runs "
                "only models that batch natively (speech-to-text models do) and never runs entries one by one: "
                "send each to /v1/tasks/run instead"
            )

    async def read(self, body: dict[str, Any]) -> None:
        allowed = self.service.settings.allowed_dirs

        def read_all() -> list[TaskInput]:
            return [
                read_task(entry, allowed, where=f"requests[{i}]", prefix=f"requests[{i}].", inline_audio=False)
                for i, entry in enumerate(body["requests"])
            ]

        self.tasks = await asyncio.to_thread(read_all)

    async def run(self, model: LoadedModel, body: dict[str, Any]) -> None:
        fields = {"requests": [t.fields for t in self.tasks], "stream": True}
        files = [upload for t in self.tasks for upload in t.files]
        response = await self.sidecar_request(model, self.sidecar_path, fields, files=files)
        await self.sse_open()
        await self.pump(self.relay(model, response))


class UnloadModelsHandler(LemonkitHandler):
    """``POST /v1/tasks/unload_models``: ``{"unloaded": [...], "not_found": [...]}``. Each loaded target is unloaded
    once the requests it is serving finish; ids that name no model are reported, models not loaded are skipped."""

    async def post(self) -> None:
        self.require_admin("unloading models that every user shares")
        body = self.json_body()
        _UNLOAD.check(body, "")
        names = list(dict.fromkeys(body["model_ids"]))  # each once, in the order given
        outcomes = await asyncio.gather(*(self._unload(name) for name in names))
        self.write_json(
            {
                "unloaded": [n for n, outcome in zip(names, outcomes, strict=True) if outcome == "unloaded"],
                "not_found": [n for n, outcome in zip(names, outcomes, strict=True) if outcome == "not_found"],
            }
        )

    async def _unload(self, name: str) -> str:
        try:
            info = await self.service.lookup(name)
        except ModelNotFound:
            return "not_found"
        if self.service.manager.loaded(info.id) is None:
            return "skipped"
        try:
            await self.service.manager.unload(info.id, drain=True)
        except ModelNotFound:  # unloaded meanwhile by another request
            return "skipped"
        return "unloaded"


class UnloadAllModelsHandler(LemonkitHandler):
    """``POST /v1/tasks/unload_all_models``: ``{"unloaded": [...]}``, each once the requests it serves finish."""

    async def post(self) -> None:
        self.require_admin("unloading models that every user shares")
        fields = self.json_body(optional=True)
        if fields:  # {"model_ids": [...]} sent here by mistake must not unload everything
            raise InvalidArgument(
                f"{', '.join(sorted(fields))[:200]}: this route takes no fields (it unloads every model); "
                "use /v1/tasks/unload_models to choose"
            )
        self.write_json({"unloaded": await self.service.manager.unload(drain=True)})
