"""The audio calls of both clients (:class:`AudioCalls`): transcribe, align, speak, voice_chat, voices, run_task,
unload_models, each written once as steps (see :mod:`lemonkit.client.calls`).

Building each request and reading its answer are plain functions here (:class:`AudioRequest`, :func:`speech_of`,
...). The module functions (``lemonkit.transcribe``, ...) run the calls on the shared default client.
"""

from __future__ import annotations

import base64
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from lemonkit.catalog import config
from lemonkit.client.audio_clips import AudioClip, Speech
from lemonkit.client.calls import Request, Steps, call, traced
from lemonkit.client.model_calls import ModelCalls
from lemonkit.client.transcripts import Transcript
from lemonkit.client.voice_chat_reply import VoiceChatOptions, VoiceChatReply
from lemonkit.errors import InvalidArgument
from lemonkit.formats import audio_codec
from lemonkit.formats.health import loaded_model

if TYPE_CHECKING:
    from typing import Unpack

__all__ = [
    "AudioCalls",
    "AudioInput",
    "AudioRequest",
    "audio_upload",
    "voice_chat_body",
]

#: what ``transcribe`` and ``align`` take: a file's path, its bytes, samples (with ``sample_rate``), or a clip
AudioInput = str | os.PathLike[str] | bytes | bytearray | np.ndarray | AudioClip

#: leading bytes -> the file extension the upload is named with (the server decodes by content; this is for logs)
_MAGIC = ((b"RIFF", ".wav"), (b"fLaC", ".flac"), (b"OggS", ".ogg"), (b"ID3", ".mp3"), (b"\x1aE\xdf\xa3", ".webm"))


def audio_upload(source: AudioInput, sample_rate: int | None = None) -> tuple[tuple[str, bytes, str], Any]:
    """The multipart ``file`` for ``source``, and what a :class:`Transcript` keeps of it (to plot and play).

    Args:
        source: A path, an audio file's bytes, samples (1-D, or ``(frames, channels)``) or an :class:`AudioClip`.
        sample_rate: The rate of ``source`` when it is samples (required then; any rate: the server resamples).

    Raises:
        InvalidArgument: Samples without ``sample_rate``, or ``sample_rate`` with a file.
        FileNotFoundError: A path that does not exist.
    """
    if isinstance(source, np.ndarray):
        if not sample_rate:
            raise InvalidArgument("Audio given as samples needs its sample_rate= (samples per second)")
        source = AudioClip(source, sample_rate)
    elif sample_rate is not None and not isinstance(source, AudioClip):
        raise InvalidArgument("sample_rate= is for samples: an audio file carries its own rate")
    if isinstance(source, AudioClip):
        return ("audio.wav", source.to_bytes("wav"), "audio/wav"), source
    if isinstance(source, bytes | bytearray):
        data = bytes(source)
        suffix = next((ext for magic, ext in _MAGIC if data.startswith(magic)), "")
        return (f"audio{suffix}", data, "application/octet-stream"), data
    path = Path(source)
    data = path.read_bytes()
    return (path.name, data, "application/octet-stream"), data


def _options(**fields: Any) -> dict[str, Any]:
    return {k: v for k, v in fields.items() if v is not None}


@dataclass
class AudioRequest:
    """A multipart audio request (transcription or alignment): its route, form fields and file."""

    route: str
    form: dict[str, Any]
    file: tuple[str, bytes, str]
    kept: Any = field(repr=False)

    @classmethod
    def transcription(
        cls, source: AudioInput, model: str, *, sample_rate: int | None, words: bool, **options: Any
    ) -> AudioRequest:
        """``/v1/audio/transcriptions/details`` (timed words with confidences) with ``words``, else
        ``/v1/audio/transcriptions`` as ``verbose_json`` (timed segments)."""
        file, kept = audio_upload(source, sample_rate)
        form = {"model": model, **_options(**options)}
        if words:
            return cls("audio/transcriptions/details", form, file, kept)
        form.update({"response_format": "verbose_json", "timestamp_granularities[]": "segment"})
        return cls("audio/transcriptions", form, file, kept)

    @classmethod
    def alignment(cls, source: AudioInput, text: str, model: str, *, sample_rate: int | None, **options: Any) -> Any:
        file, kept = audio_upload(source, sample_rate)
        return cls("audio/alignments", {"model": model, "text": text, **_options(**options)}, file, kept)

    @property
    def kwargs(self) -> dict[str, Any]:
        """The ``request()`` arguments that send it."""
        form = {k: v if isinstance(v, str | list) else str(v) for k, v in self.form.items()}
        return {"data": form, "files": {"file": self.file}}

    def sent(self) -> Steps[Transcript]:
        """Send it; the answer as a :class:`~lemonkit.client.transcripts.Transcript` with its provenance."""
        answer, facts = yield from traced(self.route, {**self.form, "file": self.file[0]}, **self.kwargs)
        return Transcript.from_answer(answer, model=self.form["model"], provenance=facts, source=self.kept)


def speech_body(text: str, model: str, voice: str | None, speed: float) -> dict[str, Any]:
    """The ``/v1/audio/speech`` body: WAV, so that the rate travels with the samples."""
    return {"model": model, "input": text, **_options(voice=voice), "speed": speed, "response_format": "wav"}


def speech_of(body: dict[str, Any], wav: bytes, facts: dict[str, Any]) -> Speech:
    decoded = audio_codec.decode(wav, sample_rate=None)
    return Speech(
        decoded.samples,
        decoded.sample_rate,
        text=body["input"],
        model=body["model"],
        voice=body.get("voice"),
        speed=body["speed"],
        provenance=facts,
    )


def voices_of(answer: dict[str, Any]) -> list[str]:
    """The voice names of a ``/v1/audio/voices`` answer (names, or records with an ``id``/``name``)."""
    return [v if isinstance(v, str) else str(v.get("id") or v.get("name")) for v in answer.get("voices") or ()]


def _model(health: dict[str, Any], kind: str) -> str:
    """``model=None``: the loaded model of ``kind`` (``transcription``/``tts``), else the bundled default."""
    default = config.default_transcription_model() if kind == "transcription" else config.default_speech_model()
    return loaded_model(health, kind) or default


def task_body(
    model: str,
    *,
    text: str | None = None,
    audio: bytes | None = None,
    audio_path: str | None = None,
    options: dict[str, Any] | None = None,
    artifacts: list[dict[str, Any]] | None = None,
    seed: int | str | None = None,
    max_tokens: int | None = None,
) -> dict[str, Any]:
    """The ``/v1/tasks/run`` body of :meth:`AudioCalls.run_task`'s keywords: WAV bytes go inline
    (``audio_base64``), a server-local path as ``audio``.

    Raises:
        InvalidArgument: Both ``audio`` and ``audio_path``.
        TypeError: A keyword it does not know.
    """
    if audio is not None and audio_path is not None:
        raise InvalidArgument(
            "Give the task's audio as bytes (audio=) or as a server-local path (audio_path=), not both"
        )
    request = _options(
        text=text,
        audio_base64=base64.b64encode(audio).decode() if audio is not None else None,
        audio=audio_path,
        options=options,
        artifacts=artifacts,
        seed=seed,
        max_tokens=max_tokens,
    )
    return {"model": model, "request": request}


#: option -> the role-prefixed recipe option it is sent as (``POST /v1/recipes/run``)
_VOICE_CHAT_OPTIONS = {
    "language": "asr.language",
    "max_tokens": "conversation.max_tokens",
    "temperature": "conversation.temperature",
    "seed": "conversation.seed",
    "voice": "tts.voice",
    "speed": "tts.speed",
}
_VOICE_CHAT_MODELS = {"asr_model": "asr", "chat_model": "conversation", "tts_model": "tts"}


def voice_chat_body(question: AudioInput, options: VoiceChatOptions) -> dict[str, Any]:
    """The ``voice-chat`` recipe's ``POST /v1/recipes/run`` body: the question inline (base64), each option under its
    role's prefix, those not given left out (the recipe's defaults, ``GET /v1/recipes``)."""
    given: dict[str, Any] = {k: v for k, v in options.items() if v is not None}
    (_, data, _), _ = audio_upload(question, given.get("sample_rate"))
    request: dict[str, Any] = {
        "audio_base64": base64.b64encode(data).decode(),
        "options": {prefixed: given[k] for k, prefixed in _VOICE_CHAT_OPTIONS.items() if k in given},
    }
    if "system_prompt" in given:
        request["text"] = given["system_prompt"]
    if "history" in given:
        request["artifacts"] = given["history"].artifacts
    models = {role: given[k] for k, role in _VOICE_CHAT_MODELS.items() if k in given}
    return {"recipe": "voice-chat", "models": models, "request": request}


def voice_chat_of(body: dict[str, Any], answer: dict[str, Any], facts: dict[str, Any]) -> VoiceChatReply:
    """The :class:`~lemonkit.client.voice_chat_reply.VoiceChatReply` of the recipe's JSON result."""
    decoded = audio_codec.decode(base64.b64decode(answer["audio"]), sample_rate=None)
    models, options = answer.get("models") or {}, body["request"]["options"]
    speech = Speech(
        decoded.samples,
        decoded.sample_rate,
        text=answer["text"],
        model=models.get("tts"),
        voice=options.get("tts.voice"),
        speed=options.get("tts.speed") or 1.0,
        provenance=facts,
    )
    return VoiceChatReply(
        text=answer["text"],
        transcript=answer["transcript"],
        speech=speech,
        language=answer.get("language"),
        models=models,
        timing=answer.get("timing") or {},
        artifacts=answer.get("artifacts") or [],
        provenance=facts,
    )


class AudioCalls:
    """Mixed into both clients."""

    @call
    def transcribe(
        self,
        audio: AudioInput,
        model: str | None = None,
        *,
        sample_rate: int | None = None,
        language: str | None = None,
        prompt: str | None = None,
        temperature: float | None = None,
        words: bool = True,
    ) -> Steps[Transcript]:
        """Transcribe speech, every word with its start, end and confidence.

        Args:
            audio: A file's path, its bytes (WAV, FLAC, OGG/Opus, MP3, WebM, ...), samples (a numpy array, with
                ``sample_rate``), or an :class:`~lemonkit.client.audio_clips.AudioClip` such as :func:`lemonkit.speak`'s
                result.
            model: A speech-to-text model; ``None``: the loaded one, else the bundled default
                (``lemonkit.catalog.config.default_transcription_model()``, ``LEMONKIT_DEFAULT_TRANSCRIPTION_MODEL``).
            sample_rate: The rate of ``audio`` given as samples (any: the server resamples).
            language: The language spoken (``"en"``, ...); ``None`` or ``"auto"`` detects it.
            prompt: Text that guides the spelling and style (names, terms).
            temperature: Sampling temperature (default: the model's, 0).
            words: Time every word (``/v1/audio/transcriptions/details``); ``False``: segments only (faster).

        Returns:
            A :class:`~lemonkit.client.transcripts.Transcript` (``.words``, ``.segments``, ``.plot()``, ``.to_srt()``,
            ``.to_pandas()``), with its ``provenance``.

        Raises:
            InvalidArgument: Samples without ``sample_rate``.
            UndecodableAudio: The server cannot decode the audio (400 ``invalid_audio``).
            ModelNotApplicable: ``model`` is not a speech-to-text model.
            ModelNotFound: ``model`` is not registered.
            ServerUnavailable: No server could be reached or started.

        Example:
            >>> transcript = lemonkit.Client().transcribe("talk.wav")
            >>> transcript.text, transcript.words[0]
            ('The quick brown fox.', Word(word='The', start=0.0, end=0.22, confidence=0.93))
        """
        request = AudioRequest.transcription(
            audio,
            model or _model((yield from ModelCalls.health.steps(self)), "transcription"),
            sample_rate=sample_rate,
            words=words,
            language=language,
            prompt=prompt,
            temperature=temperature,
        )
        return (yield from request.sent())

    @call
    def align(
        self,
        audio: AudioInput,
        text: str,
        model: str | None = None,
        *,
        sample_rate: int | None = None,
        language: str | None = None,
    ) -> Steps[Transcript]:
        """Find where each word of a known ``text`` is spoken in ``audio`` (forced alignment).

        Args:
            audio: As :meth:`transcribe`'s.
            text: What is said.
            model: A speech-to-text model that aligns (Whisper); ``None`` as :meth:`transcribe`.
            sample_rate: As :meth:`transcribe`'s.
            language: The language spoken (default: the model's).

        Returns:
            A :class:`~lemonkit.client.transcripts.Transcript` whose words are ``text``'s, timed.

        Raises:
            LemonkitError: As :meth:`transcribe`.

        Example:
            >>> [(w.word, round(w.start, 2)) for w in lemonkit.Client().align("talk.wav", "The quick brown fox").words]
            [('The', 0.0), ('quick', 0.24), ('brown', 0.6), ('fox', 0.92)]
        """
        model = model or _model((yield from ModelCalls.health.steps(self)), "transcription")
        request = AudioRequest.alignment(audio, text, model, sample_rate=sample_rate, language=language)
        return (yield from request.sent())

    @call
    def speak(
        self, text: str, model: str | None = None, *, voice: str | None = None, speed: float = 1.0
    ) -> Steps[Speech]:
        """Synthesise speech; in a notebook the result plays inline.

        Args:
            text: What to say.
            model: A text-to-speech model; ``None``: the loaded one, else the bundled default
                (``lemonkit.catalog.config.default_speech_model()``, ``LEMONKIT_DEFAULT_SPEECH_MODEL``).
            voice: One of :meth:`voices` (OpenAI's voice names map to the model's); ``None``: its default.
            speed: Speaking rate (1.0 normal, 2.0 twice as fast).

        Returns:
            A :class:`~lemonkit.client.audio_clips.Speech`: ``.samples`` (float32), ``.sample_rate``, ``.duration``,
            ``.save(path)``, with its ``provenance``.

        Raises:
            InvalidArgument: An unknown voice or a bad speed.
            ModelNotApplicable: ``model`` is not a text-to-speech model.
            LemonkitError: As :meth:`transcribe`.

        Example:
            >>> speech = lemonkit.Client().speak("Hello from lemonkit.", speed=1.1)
            >>> speech.sample_rate, round(speech.duration, 1)
            (22050, 1.4)
        """
        body = speech_body(text, model or _model((yield from ModelCalls.health.steps(self)), "tts"), voice, speed)
        wav, facts = yield from traced("audio/speech", body, json=body, raw=True)
        return speech_of(body, wav, facts)

    @call
    def voice_chat(self, question: AudioInput, **options: Unpack[VoiceChatOptions]) -> Steps[VoiceChatReply]:
        """Answer a spoken question with speech: transcription, then chat, then speech, in one call.

        It is one request to the server's ``voice-chat`` recipe (``POST /v1/recipes/run``) rather than three calls:
        the server speaks each sentence of the reply while the rest is generated, so the turn ends sooner, and the
        audio crosses the connection once each way.

        Args:
            question: A file's path, its bytes, samples (a numpy array, with ``sample_rate``) or an
                :class:`~lemonkit.client.audio_clips.AudioClip` (as :meth:`transcribe` takes).
            **options: All keyword-only: ``sample_rate`` (of ``question`` given as samples); ``system_prompt``
                (the chat model's instructions; default: a spoken-conversation prompt); ``history`` (the previous
                turn's :class:`~lemonkit.client.voice_chat_reply.VoiceChatReply`: the conversation goes on from it);
                ``asr_model``, ``chat_model``, ``tts_model`` (default: the recipe's, ``GET /v1/recipes``);
                ``language`` (spoken; default: detected); ``max_tokens``, ``temperature``, ``seed`` (the chat
                model's; ``temperature=0``: the same question gets the same reply); ``voice`` (one of
                :meth:`voices`), ``speed`` (speaking rate, 1.0 normal).

        Returns:
            A :class:`~lemonkit.client.voice_chat_reply.VoiceChatReply`: ``.text``, ``.transcript``, ``.speech`` (plays
            inline in a notebook, ``.save(path)``), ``.timing``.

        Raises:
            InvalidArgument: Samples without ``sample_rate``, a bad option.
            UndecodableAudio: The server cannot decode the question.
            ModelNotApplicable: A model that does not play its role.
            ModelNotFound: A model that is not registered.
            ServerUnavailable: No server could be reached or started.

        Example:
            >>> reply = lemonkit.Client().voice_chat("question.wav", max_tokens=40)
            >>> reply.transcript, reply.text
            ('What color is the sky?', 'The sky is blue.')
            >>> reply.save("answer.wav")
            PosixPath('answer.wav')
        """
        body = voice_chat_body(question, options)
        answer, facts = yield from traced("recipes/run", body)
        return voice_chat_of(body, answer, facts)

    @call
    def voices(self, model: str | None = None) -> Steps[list[str]]:
        """The voices of a text-to-speech model.

        Args:
            model: The model; ``None`` as :meth:`speak`'s.

        Returns:
            Voice names for :meth:`speak`'s ``voice``.

        Raises:
            ModelNotApplicable: ``model`` is not a text-to-speech model.
            LemonkitError: As :meth:`transcribe`.

        Example:
            >>> lemonkit.Client().voices()
            ['en_US-joe-medium']
        """
        model = model or _model((yield from ModelCalls.health.steps(self)), "tts")
        return voices_of((yield Request("GET", "audio/voices", {"params": {"model": model}})))

    @call
    def run_task(self, model: str, **request: Any) -> Steps[dict[str, Any]]:
        """Run one generic task (audio-api.md's ``/v1/tasks/run``): text to speech, or speech to text.

        Args:
            model: An audio model: a text-to-speech model speaks ``text``; a speech-to-text model transcribes
                ``audio``.
            request: The task's fields, each keyword-only and optional: ``text`` (what a text-to-speech model
                says), ``audio`` (a WAV file's bytes, sent inline) or ``audio_path`` (a file on the server, inside
                its allowed directories), ``options`` (the model's: ``{"word_timestamps": True}``,
                ``{"voice": "joe"}``...), ``artifacts`` (what a result returned, sent back), ``seed``
                (a uint64 past 2**53 as text), ``max_tokens``.

        Returns:
            The result as the server gives it: ``text``/``language``/``word_timestamps`` or ``audio`` (base64 WAV)
            with ``sample_rate``, ``artifacts``, ``timing``.

        Raises:
            InvalidArgument: Both ``audio`` and ``audio_path``, or a request the server refuses (400).
            TypeError: A field it does not know.
            Forbidden: ``audio_path`` outside the server's allowed directories.
            LemonkitError: As :meth:`transcribe`.

        Example:
            >>> result = lemonkit.Client().run_task("Piper-Joe-Medium-Bundled", text="Hello.")
            >>> result["sample_rate"]
            22050
        """
        result: dict[str, Any] = yield Request("POST", "tasks/run", {"json": task_body(model, **request)})
        return result

    @call
    def unload_models(self, model_ids: list[str]) -> Steps[dict[str, Any]]:
        """Unload these models once the requests they serve finish (``/v1/tasks/unload_models``).

        Returns:
            ``{"unloaded": [...], "not_found": [...]}`` (models not loaded are in neither).

        Raises:
            AdminRequired: A shared server's user who is not an admin.
        """
        body = {"model_ids": list(model_ids)}
        result: dict[str, Any] = yield Request("POST", "tasks/unload_models", {"json": body})
        return result
