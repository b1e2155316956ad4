"""Text-to-speech engines (``piper``, ``kokoro``, ``hibari``) and what they share.

Each engine module implements only how its library turns one piece of text into float32 samples
(:meth:`SpeechEngine.synthesize`) and which voices it has; this module does the rest of ``/v1/audio/speech``
and ``/v1/audio/voices``: reading the request, resolving the voice, checking the speed, cutting the text into
sentences (so a stream sends each sentence's audio as soon as it is synthesised), and shaping the answer:
an encoded file (:class:`~lemonkit.backends.protocol.Binary`), raw PCM chunks
(:class:`~lemonkit.backends.protocol.BinaryStream`), ``speech.audio.delta`` SSE events, or base64 WAV in JSON.

Voices. A request names an engine's own voice (``GET /v1/audio/voices`` lists them) or one of OpenAI's voices,
which map to the engine's voices so: the first voice of :data:`OPENAI_VOICES`'s preference list the model has,
else the model's first voice of the OpenAI voice's gender, else the model's default voice.

=========  ======  ==================================  ===========================
OpenAI     gender  Kokoro v1.0 (``kokoro-v1``)         Hibari
=========  ======  ==================================  ===========================
alloy      female  af_alloy                            heart
ash        male    am_adam                             fenrir
ballad     male    bm_lewis                            fable
coral      female  af_heart                            heart
echo       male    am_echo                             fenrir
fable      male    bm_fable                            fable
nova       female  af_nova                             kore
onyx       male    am_onyx                             fenrir
sage       female  af_sarah                            kore
shimmer    female  af_sky (the default, as Lemonade's) emma
verse      male    am_michael                          fenrir
=========  ======  ==================================  ===========================

The bundled Kokoro (Japanese voice styles speaking English) maps female names to ``jf_alpha`` and male ones
to ``jm_kumo``; the bundled Piper model has one voice (``joe``), which every name maps to; the bundled Hibari
has ``heart`` (other Hibari voices are other model files).

Speed. ``speed`` is a multiplier of the speaking rate, 0.25 to 4.0 as OpenAI's API takes (the route's schema
checks it). Piper takes the whole range (it divides the phoneme length scale); Kokoro and Hibari take 0.5 to
2.0, and answer 400 ``invalid_argument`` naming the range outside it.
"""

from __future__ import annotations

import base64
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from lemonkit.backends.protocol import NO_STATS, Binary, BinaryStream, Cancelled, LoadSpec, thread_count
from lemonkit.backends.task_engine import TaskRequest, stream_events, wav_base64
from lemonkit.errors import InvalidArgument, MissingArgument
from lemonkit.formats.audio_codec import ENCODINGS, MEDIA_TYPES, encode, pcm16

__all__ = [
    "OPENAI_VOICES",
    "RESPONSE_FORMATS",
    "SENTENCE_END",
    "SpeechEngine",
    "SpeechRequest",
    "l16_media_type",
    "package_version",
    "response_format",
    "sentences",
    "streaming_mode",
]

#: OpenAI voice -> (gender, engine voices it maps to, in order of preference)
OPENAI_VOICES: dict[str, tuple[str, tuple[str, ...]]] = {
    "alloy": ("female", ("af_alloy", "heart")),
    "ash": ("male", ("am_adam", "fenrir")),
    "ballad": ("male", ("bm_lewis", "fable")),
    "coral": ("female", ("af_heart", "heart")),
    "echo": ("male", ("am_echo", "fenrir")),
    "fable": ("male", ("bm_fable", "fable")),
    "nova": ("female", ("af_nova", "kore")),
    "onyx": ("male", ("am_onyx", "fenrir")),
    "sage": ("female", ("af_sarah", "kore")),
    "shimmer": ("female", ("af_sky", "emma")),
    "verse": ("male", ("am_michael", "fenrir")),
}
#: ``response_format`` values: the encodings of :func:`lemonkit.formats.audio_codec.encode`, and base64 WAV in JSON
RESPONSE_FORMATS = (*ENCODINGS, "json")
#: OpenAI's speed range, which the route accepts; engines may take less
SPEED_RANGE = (0.25, 4.0)

#: where one sentence (or line) of a text ends and the next begins
SENTENCE_END = re.compile(r"(?<=[.!?])\s+|(?<=[.!?][\"')\]])\s+|\n+")


def package_version(distribution: str) -> str:
    """The installed version of ``distribution`` (for ``info()``'s ``engine``)."""
    from importlib.metadata import version

    return version(distribution)


def l16_media_type(sample_rate: int) -> str:
    """The Content-Type of raw streamed PCM, as the spec writes it."""
    return f"audio/l16;rate={sample_rate};endianness=little-endian"


def sentences(text: str) -> list[str]:
    """``text`` cut after each sentence's end punctuation and at line breaks: the pieces a stream sends one by one."""
    return [piece.strip() for piece in SENTENCE_END.split(text) if piece and piece.strip()]


def streaming_mode(body: dict[str, Any]) -> str | None:
    """``"sse"`` (``stream_format: "sse"``), ``"audio"`` (``stream: true`` or ``stream_format: "audio"``) or
    ``None`` (one buffered answer)."""
    stream_format = body.get("stream_format")
    if stream_format == "sse":
        return "sse"
    if stream_format == "audio" or body.get("stream") is True:
        return "audio"
    return None


def response_format(body: dict[str, Any]) -> str:
    """The format of the answer: ``response_format``, by default ``mp3``, or ``pcm`` when streaming.

    Raises:
        InvalidArgument: An unknown format, or one other than ``pcm`` for a stream.
    """
    stream = streaming_mode(body)
    fmt = body.get("response_format") or ("pcm" if stream else "mp3")
    if fmt not in RESPONSE_FORMATS:
        raise InvalidArgument(f"response_format: expected one of {', '.join(RESPONSE_FORMATS)}, got {fmt!r}")
    if stream and fmt != "pcm":
        raise InvalidArgument(f"response_format: a stream carries pcm only, not {fmt!r}")
    return str(fmt)


@dataclass(frozen=True)
class SpeechRequest:
    """One ``/v1/audio/speech`` request, checked.

    Attributes:
        text: What to say.
        voice: The engine's own voice name (resolved from an OpenAI name).
        speed: Speaking-rate multiplier.
        response_format: One of :data:`RESPONSE_FORMATS`.
        stream: ``"audio"``, ``"sse"`` or ``None`` (see :func:`streaming_mode`).
        seed: For engines with random noise (Hibari): the same seed gives the same audio.
    """

    text: str
    voice: str
    speed: float
    response_format: str
    stream: str | None
    seed: int | None = None


class SpeechEngine:
    """The part of a text-to-speech engine every library shares (see :class:`lemonkit.backends.protocol.Engine`).

    A subclass loads its model in ``__init__`` (after calling this one's), sets :attr:`sample_rate` and
    :attr:`voice_genders`, and implements :meth:`synthesize`.

    Args:
        spec: The sidecar's load spec; ``options.n_threads`` (default: physical cores).

    Raises:
        InvalidArgument: ``n_threads`` is not a positive integer.
    """

    #: the library's name and version, for ``info()``
    engine = ""
    #: Hz of what :meth:`synthesize` returns
    sample_rate = 24000
    #: the speeds this engine takes
    speed_range: tuple[float, float] = SPEED_RANGE
    #: seconds of silence put between two sentences (for engines that trim each sentence's own)
    sentence_pause = 0.0
    #: ``options`` a task takes (audio-api.md's ``/v1/tasks/run``), with what each does
    task_options = {"voice": "one of the model's voices, or an OpenAI voice name", "speed": "speaking-rate multiplier"}

    def __init__(self, spec: LoadSpec) -> None:
        self.spec = spec
        self.n_threads = thread_count(spec.get("options") or {})
        #: where the engine runs, for /v1/health ("gpu" where its ONNX Runtime build offered one)
        self.device = "cpu"
        #: the model's voices, default first -> "female", "male" or "" (unknown)
        self.voice_genders: dict[str, str] = {}
        self._stats: dict[str, Any] = {}

    # -- what an engine module implements -------------------------------------------------------------------------

    def synthesize(self, text: str, voice: str, speed: float, seed: int | None) -> np.ndarray:
        """One sentence (or line) of ``text`` as mono float32 samples at :attr:`sample_rate`; empty when it has
        nothing to say."""
        raise NotImplementedError

    @property
    def default_voice(self) -> str:
        """The voice used when a request names none."""
        return next(iter(self.voice_genders))

    # -- the routes -----------------------------------------------------------------------------------------------

    def voices(self, body: dict[str, Any]) -> dict[str, Any]:
        """``/v1/audio/voices``: the model's own voices, and which of them each OpenAI voice name means."""
        return {
            "voices": list(self.voice_genders),
            "default": self.default_voice,
            "openai_voices": {name: self.resolve_voice(name) for name in OPENAI_VOICES},
        }

    def speak(self, body: dict[str, Any], *, cancelled: Cancelled) -> Binary | BinaryStream | dict[str, Any] | Any:
        """``/v1/audio/speech``: an encoded file, base64 WAV in JSON, raw PCM chunks or SSE events.

        Raises:
            InvalidArgument: No ``input``, an unknown voice or format, a speed outside :attr:`speed_range`,
                a non-PCM format to stream, or an input with nothing to say.
        """
        request = self.request(body)
        pieces = self._pieces(request, cancelled)
        headers = {"X-Sample-Rate": str(self.sample_rate)}
        if request.stream == "audio":
            return BinaryStream((pcm16(p) for p in pieces), l16_media_type(self.sample_rate), headers)
        if request.stream == "sse":
            return self._events(pieces)
        parts = list(pieces)
        samples = np.concatenate(parts) if parts else np.zeros(0, dtype=np.float32)
        if request.response_format == "json":
            return self._json_audio(samples, request.voice)
        fmt = request.response_format
        return Binary(encode(samples, self.sample_rate, fmt), MEDIA_TYPES[fmt], headers)

    def run_task(self, body: dict[str, Any], *, cancelled: Cancelled) -> dict[str, Any] | Iterator[dict[str, Any]]:
        """``/v1/tasks/run`` and ``/stream``: the task's ``text`` spoken (see :mod:`lemonkit.backends.task_engine`).

        ``options``: :attr:`task_options`. ``seed`` is used by engines that sample noise; ``max_tokens`` and
        artifacts are not read (these models generate no tokens and take no state).

        Returns:
            ``{"audio" (base64 WAV), "sample_rate", "channels", "duration", "voice", "artifacts", "timing"}``; with
            ``stream`` the events of :func:`~lemonkit.backends.task_engine.stream_events`, one per sentence (its
            ``audio``, a WAV of that sentence).

        Raises:
            MissingArgument: No ``text``.
            InvalidArgument: Input audio or a ``voice_ref`` (these models read no audio and clone no voice), an
                option they do not take, an unknown voice, a speed outside :attr:`speed_range`.
        """
        start = time.perf_counter()
        task = TaskRequest.parse(body)
        task.check_options(self.task_options, "text-to-speech")
        if task.audio is not None:
            raise InvalidArgument("request.audio: this text-to-speech model reads no input audio; send request.text")
        if task.voice_ref is not None:
            raise InvalidArgument(
                f"request.voice_ref: this model cannot clone a voice from reference audio; choose one of its voices "
                f"({', '.join(self.voice_genders)}) with options.voice"
            )
        if not task.text or not task.text.strip():
            raise MissingArgument("request.text: the text to speak is required")
        speed = task.number("speed", *self.speed_range)
        request = SpeechRequest(
            text=task.text,
            voice=self.resolve_voice(task.options.get("voice")),
            speed=1.0 if speed is None else speed,
            response_format="wav",
            stream=None,
            seed=task.seed,
        )
        parts: list[np.ndarray] = []

        def events() -> Iterator[dict[str, Any]]:
            for samples in self._pieces(request, cancelled):
                parts.append(samples)
                yield {"audio": wav_base64(samples, self.sample_rate)}

        def finish() -> dict[str, Any]:
            samples = np.concatenate(parts) if parts else np.zeros(0, dtype=np.float32)
            return {**self._json_audio(samples, request.voice), "channels": 1, "artifacts": []}

        if task.stream:
            return stream_events(events(), finish, include_artifacts=task.include_artifacts, start=start)
        for _ in events():
            pass
        return finish()

    def _json_audio(self, samples: np.ndarray, voice: str) -> dict[str, Any]:
        """Speech as base64 WAV in JSON, with its rate, length, voice and timing."""
        return {
            "audio": wav_base64(samples, self.sample_rate),
            "format": "wav",
            "sample_rate": self.sample_rate,
            "duration": len(samples) / self.sample_rate,
            "voice": voice,
            "timing": self._timing(),
        }

    def request(self, body: dict[str, Any]) -> SpeechRequest:
        """``body`` checked and its voice resolved.

        Raises:
            InvalidArgument: See :meth:`speak`.
        """
        text = body.get("input")
        if not isinstance(text, str) or not text.strip():
            raise InvalidArgument("input: the text to speak must be a non-empty string")
        speed = body.get("speed")
        speed = 1.0 if speed is None else speed
        low, high = self.speed_range
        if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not low <= speed <= high:
            raise InvalidArgument(f"speed: this model speaks at {low} to {high} times its normal rate, not {speed!r}")
        stream = streaming_mode(body)
        fmt = response_format(body)
        seed = body.get("seed")
        return SpeechRequest(
            text=text,
            voice=self.resolve_voice(body.get("voice")),
            speed=float(speed),
            response_format=fmt,
            stream=stream,
            seed=seed if isinstance(seed, int) and not isinstance(seed, bool) else None,
        )

    def resolve_voice(self, name: Any) -> str:
        """The model's voice that ``name`` (its own, or an OpenAI voice, case-insensitive) means.

        Raises:
            InvalidArgument: ``name`` is neither.
        """
        if name is None or name == "":
            return self.default_voice
        if isinstance(name, str):
            own = {v.lower(): v for v in self.voice_genders}
            if name.lower() in own:
                return own[name.lower()]
            if name.lower() in OPENAI_VOICES:
                gender, preferred = OPENAI_VOICES[name.lower()]
                for candidate in preferred:
                    if candidate in self.voice_genders:
                        return candidate
                same = [v for v, g in self.voice_genders.items() if g == gender]
                return same[0] if same else next(iter(self.voice_genders))
        raise InvalidArgument(
            f"voice: {name!r} is not a voice of this model; use one of {', '.join(self.voice_genders)} "
            f"or an OpenAI voice ({', '.join(OPENAI_VOICES)})"
        )

    # -- synthesis ------------------------------------------------------------------------------------------------

    def _pieces(self, request: SpeechRequest, cancelled: Cancelled) -> Iterator[np.ndarray]:
        """Each sentence's samples as it is synthesised; the timing goes to :meth:`stats`.

        Raises:
            InvalidArgument: The whole input has nothing to say (raised before anything is produced).
        """
        start = time.perf_counter()
        self._stats = {"wall": 0.0, "first": None, "samples": 0}
        pause = np.zeros(int(self.sentence_pause * self.sample_rate), dtype=np.float32)
        for text in sentences(request.text):
            if cancelled():
                return
            samples = np.asarray(self.synthesize(text, request.voice, request.speed, request.seed), dtype=np.float32)
            if samples.size == 0:
                continue
            if self._stats["samples"] and pause.size:
                samples = np.concatenate([pause, samples])
            self._stats["samples"] += samples.size
            self._stats["wall"] = time.perf_counter() - start
            if self._stats["first"] is None:
                self._stats["first"] = self._stats["wall"]
            yield samples
        if not self._stats["samples"]:
            raise InvalidArgument("input: the text has nothing this model can speak")

    def _events(self, pieces: Iterator[np.ndarray]) -> Iterator[dict[str, Any]]:
        """``speech.audio.delta`` per sentence (base64 16-bit PCM), then ``speech.audio.done``."""
        for samples in pieces:
            yield {"type": "speech.audio.delta", "audio": base64.b64encode(pcm16(samples)).decode()}
        yield {
            "type": "speech.audio.done",
            "sample_rate": self.sample_rate,
            "duration": self._stats["samples"] / self.sample_rate,
            "timing": self._timing(),
        }

    def _timing(self) -> dict[str, Any]:
        wall, audio = self._stats.get("wall") or 0.0, (self._stats.get("samples") or 0) / self.sample_rate
        first = self._stats.get("first")
        return {
            "wall_ms": round(wall * 1000, 1),
            "audio_duration_ms": round(audio * 1000, 1),
            "rtf": round(wall / audio, 4) if audio else None,
            "ttfa_ms": round(first * 1000, 1) if first is not None else None,
        }

    # -- the rest of the engine protocol --------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        timing = self._timing() if self._stats else {}
        return {
            **NO_STATS,
            "time_to_first_token": (timing.get("ttfa_ms") or 0) / 1000 if timing else None,
            **({"audio": timing} if timing else {}),
        }

    def info(self) -> dict[str, Any]:
        return {
            "type": "tts",
            "n_threads": self.n_threads,
            "device": self.device,
            "engine": self.engine,
            "sample_rate": self.sample_rate,
            "voices": list(self.voice_genders),
        }

    def close(self) -> None:
        """Nothing to release: the process exits."""
