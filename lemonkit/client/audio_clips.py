"""Audio as the Python API hands it out: :class:`AudioClip` (samples and a rate that play inline and save to a file)
and :class:`Speech`, what :func:`lemonkit.speak` returns.

Decoding and encoding are :mod:`lemonkit.formats.audio_codec`'s (soundfile, PyAV); nothing here needs IPython except the
inline player, which is only built when a notebook asks for it.
"""

from __future__ import annotations

import base64
import html
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from lemonkit.errors import InvalidArgument
from lemonkit.formats import audio_codec

__all__ = ["SAVE_FORMATS", "AudioClip", "Speech"]

#: file extension -> the ``lemonkit.formats.audio_codec.encode`` format written for it
SAVE_FORMATS = {".wav": "wav", ".flac": "flac", ".mp3": "mp3", ".ogg": "opus", ".opus": "opus"}


@dataclass
class AudioClip:
    """Mono float32 samples in [-1, 1] and their rate; plays inline in a notebook.

    Attributes:
        samples: The samples (a 1-D float32 array).
        sample_rate: Samples per second.
    """

    samples: np.ndarray
    sample_rate: int

    def __post_init__(self) -> None:
        self.samples = mono(self.samples)
        self.sample_rate = int(self.sample_rate)

    @classmethod
    def from_bytes(cls, data: bytes) -> AudioClip:
        """Decode an audio file's bytes (WAV, FLAC, OGG, MP3, WebM, ...) at the file's own rate.

        Raises:
            UndecodableAudio: No installed decoder reads them.
        """
        decoded = audio_codec.decode(data, sample_rate=None)
        return cls(decoded.samples, decoded.sample_rate)

    @property
    def duration(self) -> float:
        """Seconds of audio."""
        return len(self.samples) / self.sample_rate if self.sample_rate else 0.0

    def to_bytes(self, format: str = "wav") -> bytes:
        """The audio as a file's bytes: ``wav``, ``flac``, ``mp3``, ``opus`` (Ogg) or ``pcm`` (16-bit, no header).

        Raises:
            InvalidArgument: An unknown format.
        """
        return audio_codec.encode(self.samples, self.sample_rate, format)

    def save(self, path: str | Path) -> Path:
        """Write the audio to ``path``, in the format its extension names (``.wav``, ``.flac``, ``.mp3``, ``.ogg``).

        Returns:
            The path written.

        Raises:
            InvalidArgument: An extension none of those.

        Example:
            >>> lemonkit.speak("Hello there.").save("hello.flac")
            PosixPath('hello.flac')
        """
        target = Path(path)
        format = SAVE_FORMATS.get(target.suffix.lower())
        if format is None:
            raise InvalidArgument(f"Save as one of {', '.join(SAVE_FORMATS)}, not {target.suffix or 'no extension'!r}")
        target.write_bytes(self.to_bytes(format))
        return target

    def player_html(self) -> str:
        """An ``<audio>`` element holding the audio as WAV."""
        data = base64.b64encode(self.to_bytes("wav")).decode("ascii")
        return f'<audio controls preload="auto" src="data:audio/wav;base64,{data}"></audio>'

    def _repr_html_(self) -> str:
        return self.player_html()

    def _ipython_display_(self) -> None:
        from IPython.display import Audio, display

        display(Audio(data=self.samples, rate=self.sample_rate, normalize=False))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.duration:.2f} s at {self.sample_rate} Hz)"


@dataclass(repr=False)
class Speech(AudioClip):
    """Speech synthesised by :func:`lemonkit.speak`: an :class:`AudioClip` that knows what it says.

    Attributes:
        text: What was spoken.
        model: The text-to-speech model.
        voice: The voice (``None``: the model's default).
        speed: The speed asked for.
        provenance: Model, checkpoint, versions, wall time and the request (see :class:`~lemonkit.ChatResult`).
    """

    text: str = ""
    model: str | None = None
    voice: str | None = None
    speed: float = 1.0
    provenance: dict[str, Any] = field(default_factory=dict)

    def _repr_html_(self) -> str:
        caption = html.escape(f"{self.model} · {self.voice or 'default voice'} · {self.duration:.2f} s")
        return f'<div class="lk-speech">{self.player_html()}<div style="font-size: 0.85em">{caption}</div></div>'

    def __repr__(self) -> str:
        text = self.text if len(self.text) <= 40 else self.text[:37] + "..."
        return (
            f"Speech({self.duration:.2f} s at {self.sample_rate} Hz, model={self.model!r}, voice={self.voice!r}, "
            f"text={text!r})"
        )


def mono(samples: Any) -> np.ndarray:
    """``samples`` as a 1-D float32 array: a ``(frames, channels)`` array is averaged, integers are scaled to [-1, 1].

    Raises:
        InvalidArgument: Not 1-D or 2-D, or empty.
    """
    array = np.asarray(samples)
    if np.issubdtype(array.dtype, np.integer):
        array = array.astype(np.float32) / float(np.iinfo(array.dtype).max + 1)
    if array.ndim == 2:
        channels_first = array.shape[0] < array.shape[1] and array.shape[0] <= 16
        array = array.mean(axis=0 if channels_first else 1)
    if array.ndim != 1 or array.size == 0:
        raise InvalidArgument(f"Audio samples must be a non-empty 1-D or (frames, channels) array, not {array.shape}")
    return np.ascontiguousarray(array, dtype=np.float32)
