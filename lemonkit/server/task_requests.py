"""Checking one generic task request of audio-api.md (``/v1/tasks/run``, ``/stream``, an entry of ``/batch``).

:func:`read_task` validates the ``request`` object (``text``, ``audio`` or ``audio_base64``, ``voice_ref``,
``max_tokens``, ``seed``, ``options``, ``artifacts``), reads the server-local files it names (only inside the
operator's allowed directories, through :func:`lemonkit.server.transcriptions.read_allowed_file`) and decodes what it
carries inline, so that a malformed request is refused with 400 (or 403 for a path outside) before any model loads.
What comes out is the body the model's sidecar gets (see :mod:`lemonkit.backends.task_engine`). It blocks (files,
base64): call it in a worker thread.
"""

from __future__ import annotations

import base64
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lemonkit.backends.protocol import Upload
from lemonkit.backends.task_engine import ARTIFACT_KINDS
from lemonkit.errors import InvalidArgument, MissingArgument
from lemonkit.formats.audio_codec import UndecodableAudio
from lemonkit.formats.bodies import decode_base64
from lemonkit.server.transcriptions import read_allowed_file

__all__ = ["MAX_ARTIFACT_BYTES", "MAX_VOICE_REF_BYTES", "TaskInput", "as_text", "read_task"]

#: the payloads of one request (or one batch entry) may total at most this much
MAX_ARTIFACT_BYTES = 2 * 1024**3
#: an inline ``voice_ref`` (``{"type": "base64"}``) decodes to at most this much; larger ones go by path
MAX_VOICE_REF_BYTES = 5 * 1024**2


@dataclass
class TaskInput:
    """A checked task: the sidecar's fields and the files it carries (the audio, then the voice reference)."""

    fields: dict[str, Any] = field(default_factory=dict)
    files: list[Upload] = field(default_factory=list)


def as_text(value: object, what: str) -> str:
    """An ``options`` or ``meta`` value as the text a model reads: strings as they are, ``true``/``false``,
    numbers as written, a whole float without its fraction (``1.0`` is ``1``).

    Raises:
        InvalidArgument: Any other JSON value.
    """
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else repr(value)
    raise InvalidArgument(f"{what}: expected a string, number or boolean")


def _text_map(value: object, what: str) -> dict[str, str]:
    if not isinstance(value, dict):
        raise InvalidArgument(f"{what}: expected an object")
    return {str(k): as_text(v, f"{what}.{k}") for k, v in value.items()}


def _local(name: object, allowed: Sequence[Path], what: str) -> Upload:
    """A server-local file; a relative path is taken from the server's working directory (the spec's request
    base), and either way must lie inside an allowed directory."""
    if isinstance(name, str) and name and not os.path.isabs(name):
        name = os.path.join(os.getcwd(), name)
    return read_allowed_file(name, allowed, what=what)


def _wav(data: bytes, what: str) -> bytes:
    if data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        raise UndecodableAudio(f"{what}: not a WAV file (inline audio must be a base64 WAV)")
    return data


def _voice_ref(value: object, allowed: Sequence[Path], what: str) -> Upload:
    if isinstance(value, str):
        return _local(value, allowed, what)
    if not isinstance(value, dict):
        raise InvalidArgument(f"{what}: expected a path, or an object of type 'path' or 'base64'")
    if value.get("type") == "path":
        return _local(value.get("path"), allowed, f"{what}.path")
    if value.get("type") == "base64" and isinstance(value.get("data"), str):
        data = _wav(decode_base64(value["data"], what=f"{what}.data", noun="WAV file"), f"{what}.data")
        if len(data) > MAX_VOICE_REF_BYTES:
            raise InvalidArgument(f"{what}.data: an inline reference is at most 5 MiB; larger ones go by path")
        return Upload("voice_ref.wav", data, "audio/wav")
    raise InvalidArgument(f"{what}: expected a path, or an object of type 'path' (with path) or 'base64' (with data)")


def _artifacts(value: object, allowed: Sequence[Path], prefix: str) -> list[dict[str, Any]]:
    """The artifacts checked per the spec's table, each payload read and re-encoded as plain base64.

    Raises:
        InvalidArgument: A malformed entry (the message names it: ``artifacts[1] (id): ...``) or payloads over
            :data:`MAX_ARTIFACT_BYTES`.
        Forbidden: A ``path`` outside the allowed directories.
    """
    if not isinstance(value, list):
        raise InvalidArgument(f"{prefix}artifacts: expected an array")
    out, total = [], 0
    for index, entry in enumerate(value):
        label = f"{prefix}artifacts[{index}]"
        if not isinstance(entry, dict):
            raise InvalidArgument(f"{label}: expected an object with id, kind, and payload or path")
        artifact_id = entry.get("id")
        if not isinstance(artifact_id, str) or not artifact_id:
            raise InvalidArgument(f"{label}: id must be a non-empty string")
        label = f"{label} ({artifact_id})"
        kind = entry.get("kind")
        if kind is None:
            raise InvalidArgument(f"{label}: kind is required (one of {', '.join(ARTIFACT_KINDS)})")
        if kind not in ARTIFACT_KINDS:
            raise InvalidArgument(f"{label}: unknown kind {kind!r}")
        payload, path = entry.get("payload"), entry.get("path")
        if (payload is None) == (path is None):
            raise InvalidArgument(f"{label}: give the bytes as payload (base64) or as path, one of the two")
        if payload is not None:
            if not isinstance(payload, str):
                raise InvalidArgument(f"{label}: payload must be a base64 string")
            data = decode_base64(payload, what=f"{label}: payload", noun="payload", allow_empty=True)
        else:
            data = _local(path, allowed, f"{label}: path").content
        total += len(data)
        if total > MAX_ARTIFACT_BYTES:
            raise InvalidArgument(f"{prefix}artifacts: the payloads of one request total more than 2 GiB")
        checked: dict[str, Any] = {"id": artifact_id, "kind": kind, "payload": base64.b64encode(data).decode()}
        if entry.get("meta") is not None:
            checked["meta"] = _text_map(entry["meta"], f"{label}: meta")
        out.append(checked)
    return out


def _count(value: object, what: str, *, low: int, high: int | None = None) -> int:
    # a seed may come as a JSON string: numbers past 2^53 lose precision on the way through JSON
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < low or (high is not None and value > high):
        span = f"from {low} to {high}" if high is not None else f"of at least {low}"
        raise InvalidArgument(f"{what}: expected an integer {span}")
    return value


def read_task(
    request: object, allowed: Sequence[Path], *, where: str = "request", prefix: str = "", inline_audio: bool = True
) -> TaskInput:
    """One task request checked and its files read (see the module's docstring).

    Args:
        request: The ``request`` object (or one entry of a batch's ``requests``).
        allowed: The operator's allowed directories (``LEMONKIT_ALLOWED_DIRS``).
        where: How messages name the object (``request``, ``requests[2]``).
        prefix: How messages name its artifacts' array (empty, as the spec's examples do, or ``requests[2].``).
        inline_audio: Read ``audio_base64`` (``/v1/tasks/run``); elsewhere it is ignored, as the spec says.

    Returns:
        The sidecar's fields (``text``, ``max_tokens``, ``seed``, ``options``, ``artifacts``, ``has_audio``,
        ``has_voice_ref``) and files.

    Raises:
        MissingArgument: No ``request``.
        InvalidArgument: A malformed field; both ``audio`` and ``audio_base64``; inline audio that is not base64.
        UndecodableAudio: Inline audio that is not a WAV file (400 ``invalid_audio``).
        Forbidden: A path outside the allowed directories (403, nothing opened).
    """
    if request is None:
        raise MissingArgument(f"{where}: required argument is missing")
    if not isinstance(request, dict):
        raise InvalidArgument(f"{where}: expected an object")
    task = TaskInput()
    text = request.get("text")
    if text is not None and not isinstance(text, str):
        raise InvalidArgument(f"{where}.text: expected a string")
    task.fields["text"] = text
    inline = request.get("audio_base64") if inline_audio else None
    if inline is not None and request.get("audio") is not None:
        raise InvalidArgument(f"{where}: provide only one of audio and audio_base64")
    if inline is not None:
        if not isinstance(inline, str):
            raise InvalidArgument(f"{where}.audio_base64: expected a base64 string")
        data = decode_base64(inline, what=f"{where}.audio_base64", noun="WAV file")
        task.files.append(Upload("audio.wav", _wav(data, f"{where}.audio_base64"), "audio/wav"))
    elif request.get("audio") is not None:
        task.files.append(_local(request["audio"], allowed, f"{where}.audio"))
    task.fields["has_audio"] = bool(task.files)
    if request.get("voice_ref") is not None:
        task.files.append(_voice_ref(request["voice_ref"], allowed, f"{where}.voice_ref"))
    task.fields["has_voice_ref"] = request.get("voice_ref") is not None
    if request.get("max_tokens") is not None:
        task.fields["max_tokens"] = _count(request["max_tokens"], f"{where}.max_tokens", low=1)
    if request.get("seed") is not None:
        task.fields["seed"] = _count(request["seed"], f"{where}.seed", low=0, high=2**64 - 1)  # a uint64
    options, artifacts = request.get("options"), request.get("artifacts")
    task.fields["options"] = {} if options is None else _text_map(options, f"{where}.options")
    task.fields["artifacts"] = [] if artifacts is None else _artifacts(artifacts, allowed, prefix)
    return task
