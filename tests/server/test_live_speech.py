"""The pieces of live speech-to-text that need no server or engine: the RMS VAD, stable deltas out of revisable
interim transcripts, and the live bounds' checks (the sessions themselves are tested through the routes, on the
bundled Whisper: tests/server/test_live_transcription.py and test_realtime.py)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from lemonkit.catalog.config import LiveLimits
from lemonkit.errors import InvalidArgument
from lemonkit.formats.vad import RmsVad, VadSettings
from lemonkit.server.utterance import StableText

RATE = 16000


def tone(seconds: float, level: float = 0.1) -> np.ndarray:
    t = np.arange(int(seconds * RATE)) / RATE
    return (level * np.sqrt(2) * np.sin(2 * np.pi * 220 * t)).astype(np.float32)  # RMS = level


def quiet(seconds: float) -> np.ndarray:
    return np.zeros(int(seconds * RATE), dtype=np.float32)


def _feed(vad: RmsVad, audio: np.ndarray, piece: int) -> list[tuple[str, int]]:
    return [tuple(e) for start in range(0, len(audio), piece) for e in vad.feed(audio[start : start + piece])]


@pytest.mark.parametrize("piece", [160, 1600, 1234, 10**6])
def test_vad_finds_speech_in_pieces_of_any_size(piece: int) -> None:
    audio = np.concatenate([quiet(0.5), tone(1.0), quiet(0.3), tone(0.5), quiet(1.0)])
    events = _feed(RmsVad(VadSettings(), RATE), audio, piece)
    # one utterance: the 0.3 s gap is shorter than the 0.8 s of silence that ends one
    assert events == [("start", int(0.5 * RATE)), ("stop", int(2.3 * RATE))]


def test_vad_ignores_what_is_too_short_or_too_quiet() -> None:
    audio = np.concatenate([quiet(0.2), tone(0.2), quiet(1.0), tone(1.0, level=0.005), quiet(1.0)])
    assert _feed(RmsVad(VadSettings(), RATE), audio, 1600) == []
    # the same audio is speech to a VAD told so
    settings = VadSettings().updated({"threshold": 0.001, "prefix_padding_ms": 100})
    assert [kind for kind, _ in _feed(RmsVad(settings, RATE), audio, 1600)] == ["start", "stop", "start", "stop"]


@pytest.mark.parametrize(
    "changes", [{"threshold": -1}, {"threshold": 1.5}, {"silence_duration_ms": "800"}, {"prefix_padding_ms": True}]
)
def test_vad_settings_refuse_bad_values(changes: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgument):
        VadSettings().updated(changes)


def test_stable_text_sends_only_words_two_interims_agree_on() -> None:
    stable = StableText()
    assert stable.interim("Please call") == ""
    assert stable.interim("Please call Stella.") == "Please call"
    assert stable.interim("Please call Stella and ask") == ""  # "Stella." became "Stella"
    assert stable.interim("Please call Stella and ask her") == " Stella and ask"
    assert stable.final("Please call Stella and ask her to come.") == " her to come."
    assert stable.interim("Open the") == ""
    assert stable.final("Open the door.") == " Open the door."
    assert stable.text == "Please call Stella and ask her to come. Open the door."


def test_live_limits_refuse_negatives_and_an_unbounded_chunk() -> None:
    assert LiveLimits(idle_timeout_ms=0, total_timeout_ms=0, max_body_bytes=0).max_chunk_bytes > 0
    with pytest.raises(ValueError, match=r"idle_timeout_ms.*got -1"):
        LiveLimits(idle_timeout_ms=-1)
    with pytest.raises(ValueError, match=r"max_chunk_bytes.*more than 0"):
        LiveLimits(max_chunk_bytes=0)
