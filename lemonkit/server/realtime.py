"""``WS /realtime`` (and ``/v1/realtime``, ...): realtime speech-to-text over a WebSocket, as OpenAI's realtime
clients speak it (spec: openai-api.md, ``WS /realtime``).

The client appends base64 PCM16 at 16 kHz; the server's VAD (or the client's commits, with ``turn_detection:
null``) cuts it into utterances, each answered with interim ``...transcription.delta`` messages (the whole
interim text of the item so far: each replaces the one before) and a final ``...transcription.completed``.
The work is :mod:`lemonkit.server.utterance`'s; this module only speaks the protocol.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
from typing import Any

from tornado.websocket import WebSocketClosedError

from lemonkit.catalog.model_info import a_model_of
from lemonkit.errors import InvalidArgument, InvalidJSON, LemonkitError, MissingArgument, ModelNotApplicable
from lemonkit.formats.audio_codec import WHISPER_RATE, from_pcm
from lemonkit.formats.bodies import parse_json
from lemonkit.formats.vad import VadSettings
from lemonkit.server.handler import LemonkitWebSocket
from lemonkit.server.utterance import SidecarTranscriber, SpeechInput, new_id

__all__ = ["RealtimeHandler"]

_TRANSCRIPTION = "conversation.item.input_audio_transcription"
#: the models that serve this route (spec: "Model Labels")
REALTIME_LABEL = "realtime-transcription"


def _session_fields(session: dict[str, Any]) -> tuple[Any, Any]:
    """``(model, turn_detection)`` of a ``session.update``, in the spec's flat shape or OpenAI's nested one
    (``audio.input.transcription.model``, ``audio.input.turn_detection``); ``...`` where absent."""
    audio = session.get("audio")
    audio_in = audio.get("input") if isinstance(audio, dict) else None
    audio_in = audio_in if isinstance(audio_in, dict) else {}
    transcription = session.get("input_audio_transcription") or audio_in.get("transcription")
    nested_model = transcription.get("model", ...) if isinstance(transcription, dict) else ...
    return session.get("model", nested_model), session.get("turn_detection", audio_in.get("turn_detection", ...))


class RealtimeHandler(LemonkitWebSocket):
    """One realtime session per connection; ``?model=`` names its model (or a ``session.update`` does)."""

    _speech: SpeechInput | None = None
    _model: str | None = None
    _vad: VadSettings | None = VadSettings()
    _previous_item: str | None = None

    async def open(self, *args: Any, **kwargs: Any) -> None:
        self.set_nodelay(True)  # small events, each wanted at once (see LemonkitHandler.no_delay)
        self._id = new_id("sess")
        self._warming: asyncio.Task[None] | None = None
        refused: LemonkitError | None = None
        model = self.get_query_argument("model", None)
        if model:
            try:
                await self._use_model(model)
            except LemonkitError as err:
                refused = err  # the session still opens: a session.update may name a model that serves
        await self._send({"type": "session.created", "session": self._session()})
        if refused is not None:
            self.send_error_message(refused)

    def on_close(self) -> None:
        if self._speech is not None:
            self._speech.close()
        if self._warming is not None:
            self._warming.cancel()

    async def on_message(self, message: str | bytes) -> None:
        try:
            msg = parse_json(message, "message")
            if not isinstance(msg, dict):
                raise InvalidJSON("The message is not a JSON object")
            kind = msg.get("type")
            handle = {
                "session.update": self._update,
                "input_audio_buffer.append": self._append,
                "input_audio_buffer.commit": self._commit,
                "input_audio_buffer.clear": self._clear,
            }.get(kind if isinstance(kind, str) else "")
            if handle is None:
                raise InvalidArgument(
                    f"type: unknown message type {kind!r}; expected session.update or input_audio_buffer.append, "
                    ".commit or .clear",
                    code="unknown_event",
                )
            await handle(msg)
        except LemonkitError as err:
            self.send_error_message(err)

    # -- client events ---------------------------------------------------------------------------------------

    async def _update(self, msg: dict[str, Any]) -> None:
        session = msg.get("session")
        if not isinstance(session, dict):
            raise InvalidArgument("session: expected an object")
        model, turn_detection = _session_fields(session)
        vad = self._vad
        if turn_detection is None:
            vad = None
        elif turn_detection is not ...:
            if not isinstance(turn_detection, dict):
                raise InvalidArgument("session.turn_detection: expected an object or null")
            vad = (self._vad or VadSettings()).updated(turn_detection)
        if model is not ... and model is not None and not isinstance(model, str):
            raise InvalidArgument("session.model: expected a string")
        if isinstance(model, str) and model and model != self._model:
            await self._use_model(model, vad)
        elif vad != self._vad:
            self._vad = vad
            self._restart()
        await self._send({"type": "session.updated", "session": self._session()})

    async def _append(self, msg: dict[str, Any]) -> None:
        audio = msg.get("audio")
        if not isinstance(audio, str):
            raise InvalidArgument("audio: expected base64-encoded PCM16 (16 kHz mono) as a string")
        try:
            pcm = base64.b64decode(audio, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidArgument("audio: not valid base64", code="invalid_audio") from None
        speech = self._require_speech()
        await speech.feed(from_pcm(pcm, sample_rate=WHISPER_RATE))

    async def _commit(self, msg: dict[str, Any]) -> None:
        await self._require_speech().commit()

    async def _clear(self, msg: dict[str, Any]) -> None:
        if self._speech is not None:
            self._speech.clear()
        await self._send({"type": "input_audio_buffer.cleared"})

    # -- the session -----------------------------------------------------------------------------------------

    async def _use_model(self, name: str, vad: VadSettings | Any | None = ...) -> None:
        """Switch the session to the model ``name`` (checked: a speech-to-text model this machine runs).

        Raises:
            ModelNotFound, ModelNotSupported, ModelNotApplicable: It is not one.
        """
        info = await self.service.usable(name)
        if REALTIME_LABEL not in info.labels:
            raise ModelNotApplicable(
                f"{info.id} is not labelled {REALTIME_LABEL!r} (it is {a_model_of(info.type)}): it cannot serve "
                "realtime transcription"
            )
        self._model = info.id
        if vad is not ...:
            self._vad = vad
        self._restart()
        if self._warming is not None:
            self._warming.cancel()
        self._warming = asyncio.ensure_future(self._warm(info.id))

    async def _warm(self, model: str) -> None:
        """Load the model now, so that the first transcript does not wait for it."""
        try:
            await self.service.manager.warm(model)
        except LemonkitError as err:
            self.send_error_message(err)

    def _restart(self) -> None:
        """A new speech input for the current model and turn detection (audio buffered so far is dropped)."""
        if self._speech is not None:
            self._speech.close()
        self._speech = None
        if self._model is not None:
            transcriber = SidecarTranscriber(self, self._model)
            self._speech = SpeechInput(
                transcriber, self, sample_rate=WHISPER_RATE, vad=self._vad, busy=transcriber.busy
            )

    def _require_speech(self) -> SpeechInput:
        if self._speech is None:
            raise MissingArgument(
                "model: this session has none; connect with ?model=<name> or send a session.update naming one"
            )
        return self._speech

    def _session(self) -> dict[str, Any]:
        return {
            "id": self._id,
            "object": "realtime.session",
            "model": self._model,
            "modalities": ["text"],
            "input_audio_format": "pcm16",
            "input_audio_transcription": {"model": self._model},
            "turn_detection": self._vad.to_json() if self._vad is not None else None,
        }

    async def _send(self, event: dict[str, Any]) -> None:
        with contextlib.suppress(WebSocketClosedError):
            await self.write_message(json.dumps({"event_id": new_id("event"), **event}))

    # -- the speech input's listener -------------------------------------------------------------------------

    async def speech_started(self, item: str, ms: int) -> None:
        await self._send({"type": "input_audio_buffer.speech_started", "audio_start_ms": ms, "item_id": item})

    async def speech_stopped(self, item: str, ms: int) -> None:
        await self._send({"type": "input_audio_buffer.speech_stopped", "audio_end_ms": ms, "item_id": item})

    async def committed(self, item: str) -> None:
        previous, self._previous_item = self._previous_item, item
        await self._send({"type": "input_audio_buffer.committed", "previous_item_id": previous, "item_id": item})

    async def interim(self, item: str, text: str) -> None:
        await self._send({"type": f"{_TRANSCRIPTION}.delta", "item_id": item, "content_index": 0, "delta": text})

    async def completed(self, item: str, text: str) -> None:
        await self._send(
            {"type": f"{_TRANSCRIPTION}.completed", "item_id": item, "content_index": 0, "transcript": text}
        )

    async def failed(self, item: str, error: LemonkitError) -> None:
        self.send_error_message(error)
