"""Audio in and out: decoding uploads to mono float32 samples, resampling, and encoding speech for the wire.

One place for what every audio route, engine and the Python API share. Decoding tries soundfile (libsndfile: WAV,
FLAC, OGG/Vorbis/Opus, MP3) and falls back to PyAV (FFmpeg: WebM, MP4/AAC, anything else it knows) when it is
installed; resampling is soxr. Encoding covers the ``response_format`` values of ``/v1/audio/speech``.

Everything here is CPU work: call it from a sidecar or a worker thread, never on an event loop.
"""

from __future__ import annotations

import io
import wave
from dataclasses import dataclass

import numpy as np

from lemonkit.errors import InvalidArgument

__all__ = [
    "ENCODINGS",
    "MEDIA_TYPES",
    "WHISPER_RATE",
    "Decoded",
    "UndecodableAudio",
    "decode",
    "encode",
    "from_pcm",
    "pcm16",
    "resample",
    "wav_bytes",
]

#: the rate Whisper (and the realtime route) work at
WHISPER_RATE = 16000

#: response_format -> Content-Type of the encoded body
MEDIA_TYPES = {
    "mp3": "audio/mpeg",
    "wav": "audio/wav",
    "flac": "audio/flac",
    "opus": "audio/ogg",
    "pcm": "audio/pcm",
}
#: the formats :func:`encode` produces
ENCODINGS = tuple(MEDIA_TYPES)

_SOUNDFILE_FORMATS = {
    "wav": ("WAV", "PCM_16"),
    "flac": ("FLAC", "PCM_16"),
    "opus": ("OGG", "OPUS"),
    "mp3": ("MP3", None),
}
#: the rates libopus encodes at; other rates are resampled to 48 kHz first
_OPUS_RATES = (8000, 12000, 16000, 24000, 48000)


class UndecodableAudio(InvalidArgument):
    """The bytes are not audio any installed decoder reads (400 ``invalid_audio``)."""

    code = "invalid_audio"


@dataclass(frozen=True)
class Decoded:
    """Mono float32 samples in [-1, 1] at ``sample_rate``."""

    samples: np.ndarray
    sample_rate: int

    @property
    def duration(self) -> float:
        """Seconds of audio."""
        return len(self.samples) / self.sample_rate if self.sample_rate else 0.0


def decode(data: bytes, *, sample_rate: int | None = WHISPER_RATE) -> Decoded:
    """Decode an audio file's bytes to mono float32, resampled to ``sample_rate`` (``None``: keep the file's).

    Raises:
        UndecodableAudio: No installed decoder reads the bytes, or they hold no audio.
    """
    if not data:
        raise UndecodableAudio("The audio file is empty")
    try:
        samples, rate = _soundfile(data)
    except UndecodableAudio:
        samples, rate = _pyav(data)
    if samples.size == 0:
        raise UndecodableAudio("The audio file holds no samples")
    if sample_rate is not None and rate != sample_rate:
        samples, rate = resample(samples, rate, sample_rate), sample_rate
    return Decoded(np.ascontiguousarray(samples, dtype=np.float32), rate)


def _soundfile(data: bytes) -> tuple[np.ndarray, int]:
    import soundfile

    try:
        samples, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except (soundfile.LibsndfileError, RuntimeError, TypeError, ValueError) as exc:
        raise UndecodableAudio(f"soundfile cannot read it: {exc}") from None
    return samples.mean(axis=1), int(rate)


def _pyav(data: bytes) -> tuple[np.ndarray, int]:
    try:
        import av
    except ImportError:
        raise UndecodableAudio(
            "The audio is not WAV, FLAC, OGG or MP3, and no decoder for other formats is installed "
            "(pip install av, or lemonkit[audio])"
        ) from None
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.audio:
                raise UndecodableAudio("The file has no audio stream")
            stream = container.streams.audio[0]
            rate = stream.codec_context.sample_rate or stream.rate
            resampler = av.AudioResampler(format="flt", layout="mono", rate=rate)
            parts = []
            for frame in container.decode(stream):
                for out in resampler.resample(frame):
                    parts.append(out.to_ndarray().reshape(-1))
            for out in resampler.resample(None):
                parts.append(out.to_ndarray().reshape(-1))
    except UndecodableAudio:
        raise
    except Exception as exc:  # PyAV raises its own FFmpegError family and ValueError
        raise UndecodableAudio(f"The audio could not be decoded: {exc}") from None
    if not parts:
        raise UndecodableAudio("The audio stream holds no samples")
    return np.concatenate(parts).astype(np.float32), int(rate)


def resample(samples: np.ndarray, rate: int, target: int) -> np.ndarray:
    """``samples`` (mono float32) resampled from ``rate`` to ``target`` Hz."""
    if rate == target or samples.size == 0:
        return samples.astype(np.float32, copy=False)
    import soxr

    return soxr.resample(samples.astype(np.float32, copy=False), rate, target, quality="HQ").astype(np.float32)


def from_pcm(data: bytes, *, sample_rate: int, channels: int = 1, sample_format: str = "s16le") -> np.ndarray:
    """Headerless interleaved PCM (``s16le`` or ``f32le``) to mono float32 at the same rate.

    Raises:
        InvalidArgument: An unknown ``sample_format``.
    """
    if sample_format == "s16le":
        usable = len(data) - len(data) % (2 * channels)
        samples = np.frombuffer(data[:usable], dtype="<i2").astype(np.float32) / 32768.0
    elif sample_format == "f32le":
        usable = len(data) - len(data) % (4 * channels)
        samples = np.frombuffer(data[:usable], dtype="<f4").astype(np.float32)
    else:
        raise InvalidArgument(f"sample_format must be s16le or f32le, not {sample_format!r}")
    if channels > 1:
        samples = samples.reshape(-1, channels).mean(axis=1)
    return samples


def pcm16(samples: np.ndarray) -> bytes:
    """Mono float32 samples as little-endian 16-bit PCM (clipped to [-1, 1])."""
    return (np.clip(samples, -1.0, 1.0) * 32767.0).astype("<i2").tobytes()


def wav_bytes(samples: np.ndarray, sample_rate: int) -> bytes:
    """A 16-bit mono WAV file of ``samples`` (the standard library's writer: no decoder needed to read it back)."""
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sample_rate)
        w.writeframes(pcm16(samples))
    return out.getvalue()


def encode(samples: np.ndarray, sample_rate: int, response_format: str) -> bytes:
    """``samples`` (mono float32) as a file of ``response_format`` (see :data:`MEDIA_TYPES`).

    ``pcm`` is headerless 16-bit little-endian at ``sample_rate``. Opus is resampled to 48 kHz when
    ``sample_rate`` is not one libopus encodes at.

    Raises:
        InvalidArgument: An unknown ``response_format``.
    """
    if response_format == "pcm":
        return pcm16(samples)
    if response_format == "wav":
        return wav_bytes(samples, sample_rate)
    if response_format not in _SOUNDFILE_FORMATS:
        raise InvalidArgument(f"response_format must be one of {', '.join(ENCODINGS)}, not {response_format!r}")
    import soundfile

    if response_format == "opus" and sample_rate not in _OPUS_RATES:
        samples, sample_rate = resample(samples, sample_rate, 48000), 48000
    container, subtype = _SOUNDFILE_FORMATS[response_format]
    out = io.BytesIO()
    soundfile.write(out, np.clip(samples, -1.0, 1.0), sample_rate, format=container, subtype=subtype)
    return out.getvalue()
