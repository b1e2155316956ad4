"""Speech for tests: known sentences spoken by espeak-ng, as WAV bytes at any rate and channel count, and the same
audio as MP3, FLAC, OGG/Opus or WebM (ffmpeg). Nothing is committed: every clip is made when a test asks."""

from __future__ import annotations

import functools
import io
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import soundfile
import soxr

from tests.support.system_tools import tool

__all__ = ["FORMATS", "SENTENCES", "convert", "normalised_words", "speech_wav", "word_error_rate", "word_errors"]

#: sentences espeak-ng says clearly enough for Whisper tiny.en to transcribe them word for word (beam 5)
SENTENCES = (
    "Please call Stella and ask her to bring these things from the store.",
    "I would like to order a cup of coffee, please.",
    "My name is John and I live in London.",
    "Open the door and turn on the light.",
    "We will meet at the library tomorrow morning.",
    "Thank you very much for your help.",
)

#: container -> ffmpeg arguments producing it from a WAV on stdin
FORMATS = {
    "mp3": ["-f", "mp3", "-c:a", "libmp3lame", "-b:a", "64k"],
    "flac": ["-f", "flac"],
    "ogg": ["-f", "ogg", "-c:a", "libopus", "-b:a", "32k"],
    "webm": ["-f", "webm", "-c:a", "libopus", "-b:a", "32k"],
}


@functools.lru_cache(maxsize=32)
def _espeak(text: str) -> tuple[bytes, int]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "speech.wav"
        subprocess.run([tool("espeak-ng"), "-w", str(out), text], check=True, capture_output=True, timeout=60)
        samples, rate = soundfile.read(out, dtype="float32")
    return samples.astype(np.float32).tobytes(), int(rate)


def speech_samples(text: str, rate: int = 16000) -> np.ndarray:
    """``text`` spoken by espeak-ng, mono float32 at ``rate`` Hz."""
    raw, native = _espeak(text)
    samples = np.frombuffer(raw, dtype=np.float32)
    return samples if native == rate else soxr.resample(samples, native, rate).astype(np.float32)


def speech_wav(text: str, *, rate: int = 16000, channels: int = 1, silence: float = 0.0) -> bytes:
    """``text`` spoken by espeak-ng as a 16-bit WAV file of ``rate`` Hz and ``channels`` channels (the same
    signal in each), with ``silence`` seconds of quiet before it."""
    samples = speech_samples(text, rate)
    if silence:
        samples = np.concatenate([np.zeros(int(silence * rate), dtype=np.float32), samples])
    frames = np.repeat(samples[:, None], channels, axis=1)
    out = io.BytesIO()
    soundfile.write(out, frames, rate, format="WAV", subtype="PCM_16")
    return out.getvalue()


def convert(wav: bytes, container: str) -> bytes:
    """``wav`` re-encoded as ``container`` (a key of :data:`FORMATS`) by ffmpeg."""
    result = subprocess.run(
        [tool("ffmpeg"), "-hide_banner", "-loglevel", "error", "-i", "pipe:0", *FORMATS[container], "pipe:1"],
        input=wav,
        capture_output=True,
        check=True,
        timeout=60,
    )
    return result.stdout


def normalised_words(text: str) -> list[str]:
    """Lower-case words without punctuation, for comparing transcripts."""
    cleaned = "".join(c.lower() if c.isalnum() or c == "'" else " " for c in text)
    return cleaned.split()


def word_errors(reference: str, hypothesis: str) -> int:
    """Word-level Levenshtein distance: words substituted, dropped or added."""
    ref, hyp = normalised_words(reference), normalised_words(hypothesis)
    row = list(range(len(hyp) + 1))
    for i, word in enumerate(ref, 1):
        previous, row[0] = row[0], i
        for j, guess in enumerate(hyp, 1):
            previous, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, previous + (word != guess))
    return row[-1]


def word_error_rate(reference: str, hypothesis: str) -> float:
    """Word-level Levenshtein distance over the reference's word count."""
    return word_errors(reference, hypothesis) / max(len(normalised_words(reference)), 1)
