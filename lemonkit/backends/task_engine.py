"""The engine side of audio-api.md's generic tasks (``/v1/tasks/run``, ``/stream``, ``/batch``).

The front (:mod:`lemonkit.server.tasks`) checks a task request and sends the sidecar one body: ``text``,
``max_tokens``, ``seed``, ``options`` (every value already text), ``artifacts`` (``id``, ``kind``, base64
``payload``, ``meta``), ``stream``, ``include_artifacts``, and the request's audio and voice reference as ``files``
(``has_audio`` and ``has_voice_ref`` say which are there, in that order). :class:`TaskRequest` reads that body back;
an engine maps the task onto what it does (speech for a text-to-speech model, a transcript for a speech-to-text one)
and returns a result, or for ``stream`` the events of :func:`stream_events`.

Results and events carry audio as base64 WAV (:func:`wav_base64`) and artifacts as :func:`artifact` builds them.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from lemonkit.backends.protocol import Upload
from lemonkit.errors import InvalidArgument
from lemonkit.formats.audio_codec import wav_bytes

__all__ = ["ARTIFACT_KINDS", "TaskRequest", "artifact", "batch_requests", "stream_events", "wav_base64"]

#: the artifact kinds audio-api.md names
ARTIFACT_KINDS = (
    "speaker_embedding",
    "style_embedding",
    "prompt_embedding",
    "acoustic_tokens",
    "midi",
    "transcript_alignment",
    "diarization_state",
    "vad_state",
    "custom",
)

_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


@dataclass(frozen=True)
class TaskRequest:
    """One task as the sidecar gets it (see the module's docstring).

    Attributes:
        text: ``request.text``.
        audio: The input audio (from ``audio`` or ``audio_base64``), still encoded.
        voice_ref: Reference audio for voice cloning, still encoded.
        max_tokens: ``request.max_tokens``.
        seed: ``request.seed``.
        options: Model-specific options, each value as text (``"12"``, ``"true"``).
        artifacts: The request's artifacts in array order: ``id``, ``kind``, base64 ``payload``, ``meta``.
        stream: Answer with :func:`stream_events`' events.
        include_artifacts: Streamed events carry artifacts too.
    """

    text: str | None
    audio: Upload | None
    voice_ref: Upload | None
    max_tokens: int | None
    seed: int | None
    options: dict[str, str]
    artifacts: list[dict[str, Any]]
    stream: bool
    include_artifacts: bool

    @classmethod
    def parse(cls, body: dict[str, Any], files: list[Upload] | None = None) -> TaskRequest:
        """The task of a sidecar body whose ``files`` are :class:`Upload` objects already.

        Args:
            body: The body (or one entry of a batch's ``requests``).
            files: Where its audio and voice reference are taken from, in order (default: ``body["files"]``); the
                ones taken are removed, so a batch's entries take theirs in turn.
        """
        files = list(body.get("files") or []) if files is None else files
        audio = files.pop(0) if body.get("has_audio") and files else None
        voice_ref = files.pop(0) if body.get("has_voice_ref") and files else None
        text = body.get("text")
        return cls(
            text=text if isinstance(text, str) else None,
            audio=audio,
            voice_ref=voice_ref,
            max_tokens=_integer(body.get("max_tokens")),
            seed=_integer(body.get("seed")),
            options={str(k): str(v) for k, v in (body.get("options") or {}).items()},
            artifacts=list(body.get("artifacts") or []),
            stream=body.get("stream") is True,
            include_artifacts=body.get("include_artifacts") is True,
        )

    def check_options(self, accepted: Mapping[str, str], family: str) -> None:
        """Refuse an option the engine does not take, naming those it does.

        Args:
            accepted: Option name -> what it does, for the message.
            family: The engine's name, for the message.

        Raises:
            InvalidArgument: An option outside ``accepted``.
        """
        for name in self.options:
            if name not in accepted:
                known = "; ".join(f"{k} ({v})" for k, v in accepted.items()) or "none"
                raise InvalidArgument(f"options.{name}: {family} models take no such option (they take: {known})")

    def flag(self, name: str) -> bool | None:
        """Option ``name`` as a boolean (``None`` when absent).

        Raises:
            InvalidArgument: It is not true/false/1/0/yes/no.
        """
        value = self.options.get(name)
        if value is None:
            return None
        if value.strip().lower() in _TRUE:
            return True
        if value.strip().lower() in _FALSE:
            return False
        raise InvalidArgument(f"options.{name}: expected true or false, got {value!r}")

    def number(self, name: str, low: float, high: float) -> float | None:
        """Option ``name`` as a number from ``low`` to ``high`` (``None`` when absent).

        Raises:
            InvalidArgument: It is not a number in that range.
        """
        value = self.options.get(name)
        if value is None:
            return None
        try:
            number = float(value)
        except ValueError:
            number = float("nan")
        if not low <= number <= high:
            raise InvalidArgument(f"options.{name}: expected a number from {low:g} to {high:g}, got {value!r}")
        return number


def batch_requests(body: dict[str, Any]) -> list[TaskRequest]:
    """The entries of a ``/v1/tasks/batch`` sidecar body (``requests``; their audio in ``files``, in entry order).

    Raises:
        InvalidArgument: ``requests`` is not a non-empty list of objects.
    """
    entries = body.get("requests")
    if not isinstance(entries, list) or not entries or not all(isinstance(e, dict) for e in entries):
        raise InvalidArgument("requests: expected a non-empty array of request objects")
    files: list[Upload] = list(body.get("files") or [])
    return [TaskRequest.parse(entry, files) for entry in entries]


def _integer(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def wav_base64(samples: np.ndarray, sample_rate: int) -> str:
    """Mono float32 ``samples`` as a base64 16-bit WAV file (the tasks API's ``audio``)."""
    return base64.b64encode(wav_bytes(samples, sample_rate)).decode()


def artifact(artifact_id: str, kind: str, payload: bytes, meta: Mapping[str, str] | None = None) -> dict[str, Any]:
    """One artifact of a result, shaped as a request takes it back: ``id``, ``kind``, base64 ``payload``, ``meta``."""
    out: dict[str, Any] = {"id": artifact_id, "kind": kind, "payload": base64.b64encode(payload).decode()}
    if meta:
        out["meta"] = dict(meta)
    return out


def stream_events(
    events: Iterator[dict[str, Any]],
    finish: Callable[[], dict[str, Any]],
    *,
    include_artifacts: bool,
    start: float | None = None,
) -> Iterator[dict[str, Any]]:
    """The sidecar's stream of one task: ``task.stream.event`` per event, then ``task.stream.done`` with the result.

    Each event goes out as soon as the engine produced it (``is_final: false``); a last event ``{"is_final": true}``
    closes the run, carrying the result's artifacts with ``include_artifacts``. The result's ``timing`` holds only
    ``ttft_ms``: from ``start`` (the engine is free and loaded) to the first event with output (with
    ``include_artifacts``, artifacts count as output).

    Args:
        events: The engine's partial outputs (``partial_text``, ``audio``, ``word_timestamps``...), as produced.
        finish: Called once ``events`` is exhausted: the whole result (``artifacts`` included).
        include_artifacts: The result's artifacts also go out in the stream, on its last event.
        start: ``time.perf_counter()`` when the run started (default: when the stream is first read).
    """
    start = time.perf_counter() if start is None else start
    first: float | None = None
    for event in events:
        if first is None and event:
            first = time.perf_counter() - start
        yield {"type": "task.stream.event", "event": {**event, "is_final": False}}
    result = finish()
    last: dict[str, Any] = {"is_final": True}
    if include_artifacts and result.get("artifacts"):
        last = {"artifacts": result["artifacts"], **last}
        first = first if first is not None else time.perf_counter() - start
    yield {"type": "task.stream.event", "event": last}
    result["timing"] = {"ttft_ms": round(first * 1000, 1) if first is not None else None}
    yield {"type": "task.stream.done", "result": result}
