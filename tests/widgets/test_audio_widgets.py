"""The audio panels driven from Python against both hosts (the page's side is tests/widgets/test_audio_browser.py): the
speech panel's voices and synthesis, the transcription panel's upload (as the page sends it: bytes in a buffer)
with its words and plot, and errors in the banner."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from concurrent.futures import Future
from typing import TypeVar

import pytest

import lemonkit
from lemonkit import Client
from lemonkit.catalog.config import DEFAULT_SPEECH_MODEL, DEFAULT_TRANSCRIPTION_MODEL
from lemonkit.errors import InvalidRequest
from lemonkit.formats import audio_codec as audio
from lemonkit.widgets import SpeechPanel, TranscriptionPanel
from lemonkit.widgets.assets import esm
from tests.support.hosts import Host
from tests.support.speech import SENTENCES, normalised_words, speech_wav

T = TypeVar("T")


def done(future: Future[T]) -> Awaitable[T]:
    """Wait for a widget's background work without blocking the loop the Jupyter host serves on."""
    return asyncio.wrap_future(future)


def client_of(host: Host) -> Client:
    return Client(host.api, token=host.token)


def test_the_audio_panels_inline_the_shared_building_blocks() -> None:
    for panel in ("transcription_panel", "speech_panel"):
        code = esm(panel)
        assert "./shared.js" not in code and code.count("export function audioPlayer(") == 1
        assert code.count("export default") == 1
    assert lemonkit.TranscriptionPanel is TranscriptionPanel and lemonkit.SpeechPanel is SpeechPanel


async def test_speech_panel_lists_voices_and_speaks(host: Host) -> None:
    panel = SpeechPanel(client=client_of(host), model=DEFAULT_SPEECH_MODEL, text="Thank you very much.")
    await done(panel.voices_ready)
    voices = await asyncio.to_thread(panel.client.voices, DEFAULT_SPEECH_MODEL)
    assert panel.voices == voices and panel.voice == voices[0]
    assert DEFAULT_SPEECH_MODEL in panel.models and DEFAULT_TRANSCRIPTION_MODEL not in panel.models

    panel.speed = 1.5
    speech = await done(panel.speak())
    assert speech.text == "Thank you very much." and speech.voice == voices[0] and speech.speed == 1.5
    assert panel.result is speech and not panel.busy and panel.error is None
    assert panel.audio_type == "audio/wav" and panel.audio[:4] == b"RIFF"
    assert audio.decode(panel.audio, sample_rate=None).duration == pytest.approx(speech.duration, abs=0.01)

    panel.text = " "
    with pytest.raises(InvalidRequest, match="no text"):
        panel.speak()


@pytest.mark.slow
async def test_transcription_panel_transcribes_an_upload(host: Host) -> None:
    sentence = SENTENCES[4]
    wav = speech_wav(sentence, rate=22050)
    panel = TranscriptionPanel(client=client_of(host), model=DEFAULT_TRANSCRIPTION_MODEL)
    await done(panel.ready)
    assert DEFAULT_TRANSCRIPTION_MODEL in panel.models and DEFAULT_SPEECH_MODEL not in panel.models

    transcript = await done(panel.transcribe_upload("meeting.wav", "audio/wav", [wav]))  # as the page sends it
    assert normalised_words(transcript.text) == normalised_words(sentence)
    shown = panel.transcript
    assert shown is not None and shown["text"] == transcript.text and shown["model"] == DEFAULT_TRANSCRIPTION_MODEL
    assert [w["word"] for w in shown["words"]] == [w.word for w in transcript.words]
    assert all(0 <= w["start"] <= w["end"] for w in shown["words"])
    assert panel.source == "meeting.wav" and panel.audio == wav and panel.audio_type == "audio/wav"
    assert panel.plot[:8] == b"\x89PNG\r\n\x1a\n" and panel.result is transcript and not panel.busy


async def test_transcription_panel_errors_in_the_banner(host: Host) -> None:
    panel = TranscriptionPanel(client=client_of(host), model=DEFAULT_TRANSCRIPTION_MODEL)
    await done(panel.ready)
    failed = panel.transcribe(b"not audio at all", name="notes.txt")
    with pytest.raises(lemonkit.LemonkitError):
        await done(failed)
    assert panel.error is not None and panel.error["code"] == "invalid_audio" and not panel.busy
    panel._on_message(panel, {"action": "transcribe_upload", "args": ["empty.wav", "audio/wav"]}, [])
    assert panel.error == {"message": "The page sent no audio", "code": "invalid_argument"}
