"""The audio panels: ``TranscriptionPanel`` (a file or a microphone recording, transcribed, its words lit as they
play, their timing plot) and ``SpeechPanel`` (text, voice and speed to a player and a download).

As in every panel, the page never reaches the server: it sends the recorded or uploaded bytes to the kernel, which
transcribes or speaks through :class:`lemonkit.Client` and sends the audio, the words and the plot back.
"""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path
from typing import Any, ClassVar

import traitlets

from lemonkit.client import Client
from lemonkit.client.audio_clips import Speech
from lemonkit.client.transcripts import Transcript
from lemonkit.errors import InvalidArgument, InvalidRequest
from lemonkit.widgets.assets import esm
from lemonkit.widgets.panel import TaskPanel

__all__ = ["SpeechPanel", "TranscriptionPanel"]


def words_of(transcript: Transcript) -> dict[str, Any]:
    """What the page shows of a transcript."""
    return {
        "text": transcript.text,
        "language": transcript.language,
        "duration": transcript.duration,
        "model": transcript.model,
        "words": [
            {"word": w.word, "start": w.start, "end": w.end, "confidence": w.confidence} for w in transcript.words
        ],
    }


class _AudioPanel(TaskPanel):
    """A panel with a model picker of one task, a busy flag and an audio player."""

    #: the audio the player plays, and its media type
    audio = traitlets.Bytes(b"").tag(sync=True)
    audio_type = traitlets.Unicode("").tag(sync=True)


class TranscriptionPanel(_AudioPanel):
    """Transcribe an uploaded file or a recording from the browser's microphone; the words light up as the
    audio plays (click one to play from there), with their timing plot.

    Args:
        client: The client doing the work (default: :func:`lemonkit.default_client`).
        model: The speech-to-text model (default: a loaded one, else the first downloaded one).
        language: The language spoken (default: detected).

    Attributes:
        result: The last :class:`~lemonkit.client.transcripts.Transcript`.

    Example:
        >>> panel = lemonkit.TranscriptionPanel()
        >>> panel.transcribe("talk.wav").result().text
        'The quick brown fox.'
    """

    _esm = esm("transcription_panel")
    task = "transcription"
    #: where the audio came from: a file name, or ``recording``
    source = traitlets.Unicode("").tag(sync=True)
    #: the words shown: ``{"text", "language", "duration", "model", "words": [{"word", "start", "end",
    #: "confidence"}]}``, ``None`` before the first transcript
    transcript = traitlets.Dict(allow_none=True, default_value=None).tag(sync=True)
    #: the timing plot, PNG
    plot = traitlets.Bytes(b"").tag(sync=True)
    actions: ClassVar[frozenset[str]] = frozenset({"transcribe_upload", "refresh_models", "dismiss"})
    binary_actions: ClassVar[frozenset[str]] = frozenset({"transcribe_upload"})

    def __init__(self, *, client: Client | None = None, model: str | None = None, language: str | None = None):
        super().__init__(client=client, model=model)
        self.language = language
        self.result: Transcript | None = None

    def transcribe(
        self, audio: str | Path | bytes, media_type: str = "", name: str | None = None
    ) -> Future[Transcript]:
        """Transcribe an audio file (a path or its bytes) and show it; the future gives the transcript.

        Raises:
            InvalidRequest: A transcription is under way, or no model is available.
        """
        if isinstance(audio, bytes):
            data, name = audio, name or "audio"
        else:
            data, name = Path(audio).read_bytes(), name or Path(audio).name
        self._start()
        self.set_trait("transcript", None)
        self.plot = b""
        self.source = name
        self.audio_type = media_type or _media_type(name)
        self.audio = data
        return self.background(self._transcribe, data)

    def transcribe_upload(self, name: str, media_type: str, buffers: list[bytes]) -> Future[Transcript]:
        """From the page: the bytes of an uploaded file or a recording."""
        if len(buffers) != 1 or not buffers[0]:
            raise InvalidArgument("The page sent no audio")
        return self.transcribe(buffers[0], str(media_type), name=str(name))

    def _transcribe(self, data: bytes) -> Transcript:
        from lemonkit.client.plots import png

        try:
            transcript = self.client.transcribe(data, self.model, language=self.language)
            if "webm" in self.audio_type:
                self._playable(transcript)
            self.result = transcript
            self.transcript = words_of(transcript)
        finally:
            self.busy = False
        self.plot = png(transcript.plot())
        return transcript

    def _playable(self, transcript: Transcript) -> None:
        """A browser's recording (WebM from MediaRecorder) carries no duration, so its player cannot seek: play it
        as WAV instead."""
        clip = transcript.audio
        if clip is not None:
            self.audio_type = "audio/wav"
            self.audio = clip.to_bytes("wav")


_MEDIA_TYPES = {
    ".wav": "audio/wav",
    ".flac": "audio/flac",
    ".mp3": "audio/mpeg",
    ".ogg": "audio/ogg",
    ".webm": "audio/webm",
}


def _media_type(name: str) -> str:
    """What the page's player is told the audio is (it sniffs the bytes when this is empty)."""
    return _MEDIA_TYPES.get(Path(name).suffix.lower(), "")


class SpeechPanel(_AudioPanel):
    """Type text, pick a voice and a speed, and hear it; the audio can be downloaded as WAV.

    Args:
        client: The client doing the work (default: :func:`lemonkit.default_client`).
        model: The text-to-speech model (default: a loaded one, else the first downloaded one).
        text: The text the box starts with.

    Attributes:
        result: The last :class:`~lemonkit.client.audio_clips.Speech`.

    Example:
        >>> panel = lemonkit.SpeechPanel()
        >>> panel.speak("Hello from lemonkit.").result().duration
        1.43
    """

    _esm = esm("speech_panel")
    task = "tts"
    text = traitlets.Unicode("").tag(sync=True)
    voices = traitlets.List(traitlets.Unicode()).tag(sync=True)
    voice = traitlets.Unicode("").tag(sync=True)
    speed = traitlets.Float(1.0).tag(sync=True)
    actions: ClassVar[frozenset[str]] = frozenset({"speak", "refresh_models", "dismiss"})
    page_fields: ClassVar[frozenset[str]] = frozenset({"speed"})

    def __init__(self, *, client: Client | None = None, model: str | None = None, text: str = "") -> None:
        super().__init__(client=client, model=model, text=text)
        self.result: Speech | None = None
        self.observe(lambda _: self.refresh_voices(), names="model")
        self.voices_ready = self.background(self._first_voices)

    def _first_voices(self) -> None:
        self.ready.result()  # the model the picker preselects
        self._read_voices()

    def refresh_voices(self) -> Future[None]:
        """Read the model's voices for the dropdown (keeping the chosen one when the model has it)."""
        return self.background(self._read_voices)

    def _read_voices(self) -> None:
        voices = self.client.voices(self.model) if self.model else []
        self.voices = voices
        if self.voice not in voices:
            self.voice = voices[0] if voices else ""

    def speak(self, text: str | None = None) -> Future[Speech]:
        """Speak ``text`` (default: the text box's) with the chosen voice and speed; the future gives the speech.

        Raises:
            InvalidRequest: Synthesis is under way, no model is available, or there is no text.
        """
        if text is not None:
            self.text = str(text)
        if not self.text.strip():
            raise InvalidRequest("There is no text to speak")
        self._start()
        return self.background(self._speak)

    def _speak(self) -> Speech:
        try:
            speech = self.client.speak(self.text, self.model, voice=self.voice or None, speed=self.speed)
            self.result = speech
            self.audio_type = "audio/wav"
            self.audio = speech.to_bytes("wav")
        finally:
            self.busy = False
        return speech
