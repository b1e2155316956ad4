"""Handlers for the file-based speech-to-text routes (spec: ``openai-api.md`` and ``audio-api.md``).

``POST /v1/audio/transcriptions`` (OpenAI's), ``/v1/audio/transcriptions/details`` (words and segments in samples),
``/v1/audio/alignments`` (forced alignment of a known text) and ``/v1/batches/transcriptions`` (several files, one
event per file). Each takes ``multipart/form-data`` with ``file`` parts, or JSON naming a server-local ``audio``
path, which is read only inside the directories the operator allowed (``LEMONKIT_ALLOWED_DIRS``). Audio is decoded
in the model's sidecar, never here; this module only reads a local file (off the event loop) and shapes answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import stat
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import httpx

from lemonkit.backends.protocol import Upload
from lemonkit.catalog.hf_cache import in_allowed_dirs
from lemonkit.errors import Forbidden, InvalidArgument, InvalidRequest, LemonkitError, MissingArgument
from lemonkit.formats import schemas, sse
from lemonkit.formats.audio_codec import WHISPER_RATE
from lemonkit.formats.subtitles import to_srt, to_vtt
from lemonkit.server.handler import error_event
from lemonkit.server.openai import InferenceHandler
from lemonkit.serving.loaded_model import LoadedModel

__all__ = [
    "AlignmentHandler",
    "BatchTranscriptionHandler",
    "TranscriptionDetailsHandler",
    "TranscriptionHandler",
    "read_allowed_file",
]

#: the largest server-local audio file a request may name (an upload is bounded by the host's body size limit)
MAX_LOCAL_BYTES = 512 * 1024 * 1024
#: the fields the engines take, forwarded to the sidecar as they are
_ENGINE_FIELDS = ("model", "language", "prompt", "temperature", "text")
_PLAIN = "text/plain; charset=utf-8"


def read_allowed_file(name: object, allowed: Sequence[Path], *, what: str = "audio") -> Upload:
    """A server-local file a request names, read only when it lies inside an allowed directory.

    The path is resolved first (``..`` and every symlink followed) and checked against the resolved allowed
    directories, so a link inside an allowed directory that leads out of it is refused before anything is opened.
    Only a regular file is read (a FIFO or a device is refused without blocking).

    Args:
        name: The path from the request (absolute).
        allowed: The operator's allowed directories.
        what: The request field, for messages.

    Returns:
        The file's bytes as an :class:`Upload` named after the file.

    Raises:
        InvalidArgument: ``name`` is not an absolute path, not a regular file, or too large.
        Forbidden: It lies outside every allowed directory (403; nothing was opened).
    """
    if not isinstance(name, str) or not name or "\0" in name or not os.path.isabs(name):
        raise InvalidArgument(f"{what}: expected an absolute server-local path")
    path = in_allowed_dirs(name, allowed)
    if path is None:
        raise Forbidden(
            f"{what}: {name!r} is outside the directories the operator allowed for server-local files "
            "(LEMONKIT_ALLOWED_DIRS)"
        )
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        raise InvalidArgument(f"{what}: cannot open {name!r}: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(file.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise InvalidArgument(f"{what}: {name!r} is not a regular file")
        if info.st_size > MAX_LOCAL_BYTES:
            raise InvalidArgument(f"{what}: {name!r} is larger than {MAX_LOCAL_BYTES // 2**20} MiB")
        return Upload(path.name, file.read(), "application/octet-stream")


# -- answers -----------------------------------------------------------------------------------------------------


def _words(result: dict[str, Any]) -> list[dict[str, Any]]:
    return [w for segment in result.get("segments", []) for w in segment.get("words", [])]


def _sample(seconds: float) -> int:
    return round(float(seconds) * WHISPER_RATE)


def verbose_json(result: dict[str, Any], granularities: Sequence[str]) -> dict[str, Any]:
    """OpenAI's ``verbose_json``: segments (unless only words were asked for) and, for ``word``, the words."""
    answer: dict[str, Any] = {
        "task": "transcribe",
        "language": result["language"],
        "duration": result["duration"],
        "text": result["text"],
    }
    if "segment" in granularities or "word" not in granularities:
        answer["segments"] = [{k: v for k, v in s.items() if k != "words"} for s in result["segments"]]
    if "word" in granularities:
        answer["words"] = [{"word": w["word"].strip(), "start": w["start"], "end": w["end"]} for w in _words(result)]
    answer["timing"] = result["timing"]
    return answer


def plain_text(result: dict[str, Any], response_format: str) -> str:
    """The ``text``, ``srt`` or ``vtt`` body."""
    if response_format == "srt":
        return to_srt(result["segments"])
    if response_format == "vtt":
        return to_vtt(result["segments"])
    return str(result["text"]) + "\n"


def details(result: dict[str, Any]) -> dict[str, Any]:
    """audio-api.md's details: ``text``, ``language``, segments and words as sample offsets, ``sample_rate``."""
    answer: dict[str, Any] = {"text": result["text"], "language": result["language"]}
    answer["segments"] = [
        {
            "start_sample": _sample(s["start"]),
            "end_sample": _sample(s["end"]),
            "confidence": round(math.exp(s["avg_logprob"]), 4),
            "text": s["text"].strip(),
        }
        for s in result["segments"]
    ]
    answer["words"] = [
        {
            "word": w["word"].strip(),
            "start_sample": _sample(w["start"]),
            "end_sample": _sample(w["end"]),
            "confidence": w["probability"],
        }
        for w in _words(result)
    ]
    answer["sample_rate"] = WHISPER_RATE
    if "timing" in result:
        answer["timing"] = result["timing"]
    return answer


# -- requests ----------------------------------------------------------------------------------------------------


def _flag(name: str, value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in ("true", "1", "yes"):
        return True
    if lowered in ("false", "0", "no", ""):
        return False
    raise InvalidArgument(f"{name}: expected true or false, got {value!r}")


def _number(name: str, value: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise InvalidArgument(f"{name}: expected a number, got {value!r}") from None


def form_fields(arguments: dict[str, list[bytes]]) -> dict[str, Any]:
    """A multipart form's text fields as the JSON body they stand for (numbers and booleans parsed)."""
    body: dict[str, Any] = {}
    for key, values in arguments.items():
        texts = [v.decode("utf-8", "replace") for v in values]
        name = key.removesuffix("[]")
        if name == "timestamp_granularities":
            body[name] = [t for text in texts for t in text.split(",") if t]
        elif name == "temperature":
            body[name] = _number(name, texts[-1])
        elif name == "stream":
            body[name] = _flag(name, texts[-1])
        elif name != "file":
            body[name] = texts[-1]
    return body


class TranscriptionHandler(InferenceHandler):
    """``POST /v1/audio/transcriptions``: one file to text in ``response_format``, or ``transcript.text.*`` SSE."""

    schema = "audio/transcriptions"
    sidecar_path = "/v1/audio/transcriptions"
    serves = ("transcription",)
    #: the route takes several files (``file`` repeated; a list of ``audio`` paths)
    many = False
    uploads: list[Upload]

    async def post(self) -> None:
        body, self.uploads = self.audio_request()
        info = await self.service.usable(body["model"])
        self.check_applicable(info)
        self.check(body)
        if not self.uploads:
            self.uploads = await self.local_files(body)
        await self.unless_gone(self._serve(info, body))

    def check(self, body: dict[str, Any]) -> None:
        """Route-specific refusals, before the model loads."""

    def audio_request(self) -> tuple[dict[str, Any], list[Upload]]:
        """The validated fields and the uploaded files (none for the JSON form, which names ``audio``).

        Raises:
            InvalidRequest: The body is neither multipart/form-data nor JSON.
            MissingArgument: No ``file`` part (multipart) or no ``audio`` path (JSON).
        """
        content_type = self.request.headers.get("Content-Type", "")
        if content_type.startswith("multipart/form-data"):
            body = schemas.validate(self.schema or "", form_fields(self.request.body_arguments))
            parts = self.request.files.get("file", [])
            uploads = [
                Upload(p.filename or "audio", p.body, p.content_type or "application/octet-stream") for p in parts
            ]
            uploads += [Upload("audio", raw) for raw in self.request.body_arguments.get("file", [])]
            if not uploads:
                raise MissingArgument("file: required argument is missing (a multipart part with the audio)")
            if len(uploads) > 1 and not self.many:
                raise InvalidArgument("file: this route takes one file")
            return body, uploads
        if content_type.startswith("application/json") or self.request.body.lstrip()[:1] == b"{":
            body = self.json_body()
            if body.get("audio") is None:
                raise MissingArgument("audio: required argument is missing (a server-local path, or upload 'file')")
            return body, []
        raise InvalidRequest(
            "The request must be multipart/form-data with a 'file' part, or JSON naming a server-local 'audio' path",
            code="invalid_content_type",
        )

    async def local_files(self, body: dict[str, Any]) -> list[Upload]:
        """The JSON form's ``audio`` path(s), read off the event loop (see :func:`read_allowed_file`)."""
        names = body["audio"] if isinstance(body["audio"], list) else [body["audio"]]
        allowed = self.service.settings.allowed_dirs

        def read() -> list[Upload]:
            return [read_allowed_file(name, allowed) for name in names]

        return await asyncio.to_thread(read)

    def engine_body(self, body: dict[str, Any], *, words: bool, stream: bool = False) -> dict[str, Any]:
        out = {key: body[key] for key in _ENGINE_FIELDS if body.get(key) is not None}
        return {**out, "word_timestamps": words, "stream": stream}

    async def run(self, model: LoadedModel, body: dict[str, Any]) -> None:
        granularities = body.get("timestamp_granularities") or []
        fmt = body.get("response_format") or "json"
        words = fmt == "verbose_json" and "word" in granularities
        request = self.engine_body(body, words=words, stream=bool(body.get("stream")))
        if request["stream"]:
            await self.sidecar_stream(model, self.sidecar_path, request, files=self.uploads)
            return
        result = await self.sidecar_json(model, self.sidecar_path, request, files=self.uploads)
        if fmt == "json":
            self.write_json({"text": result["text"], "timing": result["timing"]})
        elif fmt == "verbose_json":
            self.write_json(verbose_json(result, granularities))
        else:
            self.set_header("Content-Type", "text/vtt; charset=utf-8" if fmt == "vtt" else _PLAIN)
            self.finish(plain_text(result, fmt))


class TranscriptionDetailsHandler(TranscriptionHandler):
    """``POST /v1/audio/transcriptions/details``: the transcript with segments and words in samples."""

    def check(self, body: dict[str, Any]) -> None:
        if body.get("stream"):
            raise InvalidArgument(
                "stream: this route does not stream (its answer carries segments and words); "
                "use /v1/audio/transcriptions for a streamed transcript"
            )

    async def run(self, model: LoadedModel, body: dict[str, Any]) -> None:
        request = self.engine_body(body, words=True)
        self.write_json(details(await self.sidecar_json(model, self.sidecar_path, request, files=self.uploads)))


class AlignmentHandler(TranscriptionHandler):
    """``POST /v1/audio/alignments``: the words of ``text`` on the audio's time line, in seconds and samples."""

    schema = "audio/alignments"
    sidecar_path = "/v1/audio/alignments"

    async def run(self, model: LoadedModel, body: dict[str, Any]) -> None:
        request = self.engine_body(body, words=True)
        self.write_json(await self.sidecar_json(model, self.sidecar_path, request, files=self.uploads))


class BatchTranscriptionHandler(TranscriptionHandler):
    """``POST /v1/batches/transcriptions``: SSE ``batch.transcription.result`` per file (with ``index`` and
    ``filename``) as each is done, then ``batch.transcription.done`` with the aggregate timing."""

    schema = "batches/transcriptions"
    sidecar_path = "/v1/batches/transcriptions"
    many = True

    async def run(self, model: LoadedModel, body: dict[str, Any]) -> None:
        words = "word" in (body.get("timestamp_granularities") or [])
        request = self.engine_body(body, words=words, stream=True)
        response = await self.sidecar_request(model, self.sidecar_path, request, files=self.uploads)
        await self.sse_open()
        await self.pump(self._results(model, response))

    async def _results(self, model: LoadedModel, upstream: httpx.Response) -> AsyncIterator[bytes]:
        try:
            async with contextlib.aclosing(self.sidecar_feed(model, upstream)) as events:
                async for event in events:
                    if event is None:
                        yield sse.PING
                        continue
                    if event.get("type") == "batch.transcription.result":
                        head = {k: event[k] for k in ("type", "index", "filename", "duration")}
                        event = {**head, **details(event)}
                    yield sse.frame(event)
            yield sse.DONE
        except LemonkitError as exc:
            yield error_event(exc)
