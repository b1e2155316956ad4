"""The Python API's audio (``lemonkit.transcribe``, ``align``, ``speak``, ``voices``) through ``lemonkit.Client`` and
``AsyncClient`` against both hosts, real HTTP, on the bundled Whisper tiny.en and Piper voice: what ``speak`` says,
``transcribe`` hears; samples at 44.1 kHz in stereo; alignment of a known sentence; errors as lemonkit's
exceptions."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import numpy as np
import pytest

import lemonkit
from lemonkit.catalog.config import DEFAULT_SPEECH_MODEL, DEFAULT_TRANSCRIPTION_MODEL
from lemonkit.client import AsyncClient, Client
from lemonkit.errors import InvalidArgument, ModelNotApplicable, ModelNotFound
from lemonkit.formats.audio_codec import UndecodableAudio
from tests.support.hosts import Host
from tests.support.speech import SENTENCES, normalised_words, speech_samples, speech_wav, word_errors
from tests.support.tiny_models import TINY

SRT_CUE = re.compile(r"^(\d+)\n(\d\d:\d\d:\d\d,\d\d\d) --> (\d\d:\d\d:\d\d,\d\d\d)\n(.+)$", re.S)


def _in_thread(host: Host, calls: Any) -> Any:
    """Run sync client calls off the loop (the Jupyter host serves on this test's loop)."""

    def run() -> Any:
        with Client(host.root, token=host.token) as client:
            return calls(client)

    return asyncio.to_thread(run)


def _seconds(stamp: str) -> float:
    hours, minutes, rest = stamp.split(":")
    return int(hours) * 3600 + int(minutes) * 60 + float(rest.replace(",", "."))


def _check_timing(transcript: lemonkit.Transcript, duration: float) -> None:
    """Words in order, each inside the audio, with a confidence."""
    assert transcript.words
    for word in transcript.words:
        assert 0 <= word.start <= word.end <= duration + 0.05, word
        assert word.confidence is not None and 0 <= word.confidence <= 1
    starts = [w.start for w in transcript.words]
    assert starts == sorted(starts)


@pytest.mark.slow
async def test_what_speak_says_transcribe_hears(host: Host) -> None:
    sentence = SENTENCES[0]

    def calls(client: Client) -> tuple[lemonkit.Speech, lemonkit.Transcript]:
        speech = client.speak(sentence)  # model=None: the bundled Piper voice
        return speech, client.transcribe(speech)  # model=None: the bundled Whisper

    speech, transcript = await _in_thread(host, calls)
    assert isinstance(speech, lemonkit.Speech) and speech.samples.dtype == np.float32 and speech.samples.ndim == 1
    assert speech.sample_rate == 22050 and 2 < speech.duration < 10 and speech.model == DEFAULT_SPEECH_MODEL
    assert float(np.abs(speech.samples).max()) > 0.1  # speech, not silence
    assert speech.provenance["model"] == DEFAULT_SPEECH_MODEL and speech.provenance["route"] == "audio/speech"
    # Piper samples noise as it speaks, so no two runs sound alike: Whisper tiny may mishear one word of eleven
    assert word_errors(sentence, transcript.text) <= 1, transcript.text
    assert normalised_words(" ".join(w.word for w in transcript.words)) == normalised_words(transcript.text)
    _check_timing(transcript, speech.duration)
    assert transcript.model == transcript.provenance["model"] == DEFAULT_TRANSCRIPTION_MODEL
    assert transcript.language == "en" and transcript.duration == pytest.approx(speech.duration, abs=0.05)
    assert transcript.audio is speech  # kept: the plot draws its waveform
    assert len(transcript.plot().axes[0].texts) == len(transcript.words)

    cues = transcript.to_srt().strip().split("\n\n")
    parsed = [SRT_CUE.match(cue) for cue in cues]
    assert all(parsed) and [int(m.group(1)) for m in parsed if m] == list(range(1, len(cues) + 1))
    spans = [(_seconds(m.group(2)), _seconds(m.group(3))) for m in parsed if m]
    assert all(a <= b <= speech.duration + 0.05 for a, b in spans)
    assert normalised_words(" ".join(m.group(4) for m in parsed if m)) == normalised_words(transcript.text)
    assert transcript.to_vtt().startswith("WEBVTT")
    frame = transcript.to_pandas()
    assert len(frame) == len(transcript.words) and (frame["end"] >= frame["start"]).all()


@pytest.mark.slow
async def test_samples_at_any_rate_and_a_file(host: Host, tmp_path: Any) -> None:
    sentence = SENTENCES[3]
    stereo = np.stack([speech_samples(sentence, 44100)] * 2, axis=1)  # (frames, 2) at 44.1 kHz
    path = tmp_path / "spoken.wav"
    path.write_bytes(speech_wav(sentence, rate=8000))

    def calls(client: Client) -> tuple[lemonkit.Transcript, ...]:
        return (
            client.transcribe(stereo, sample_rate=44100),
            client.transcribe(path, DEFAULT_TRANSCRIPTION_MODEL, language="en", words=False),
        )

    from_samples, from_file = await _in_thread(host, calls)
    assert normalised_words(from_samples.text) == normalised_words(sentence)
    assert from_samples.audio is not None and from_samples.audio.sample_rate == 44100
    _check_timing(from_samples, len(stereo) / 44100)
    assert normalised_words(from_file.text) == normalised_words(sentence)
    assert from_file.words == [] and from_file.segments  # segments only, timed
    assert from_file.segments[0].start >= 0 and from_file.segments[-1].end <= from_file.duration + 0.05
    assert from_file.provenance["request"]["file"] == "spoken.wav"


@pytest.mark.slow
async def test_align_times_the_given_words(host: Host) -> None:
    sentence = SENTENCES[2]
    wav = speech_wav(sentence, rate=16000)
    duration = len(speech_samples(sentence, 16000)) / 16000

    aligned = await _in_thread(host, lambda client: client.align(wav, sentence))
    assert normalised_words(" ".join(w.word for w in aligned.words)) == normalised_words(sentence)
    _check_timing(aligned, duration)
    assert aligned.words[-1].end > duration / 2  # spread over the audio, not piled at its start
    assert aligned.provenance["route"] == "audio/alignments"


async def test_voices_and_a_chosen_voice(host: Host) -> None:
    def calls(client: Client) -> tuple[list[str], lemonkit.Speech, lemonkit.Speech]:
        voices = client.voices()
        return voices, client.speak("One two three.", voice=voices[0]), client.speak("One two three.", speed=2.0)

    voices, chosen, fast = await _in_thread(host, calls)
    assert voices and all(isinstance(v, str) and v for v in voices)
    assert chosen.voice == voices[0] and chosen.duration > 0.3
    assert fast.duration < chosen.duration * 0.8  # twice the speed: clearly shorter


@pytest.mark.slow
async def test_the_async_client(host: Host) -> None:
    async with AsyncClient(host.root, token=host.token) as client:
        speech = await client.speak(SENTENCES[5])
        transcript = await client.transcribe(speech.samples, sample_rate=speech.sample_rate)
        aligned = await client.align(speech, SENTENCES[5])
        voices = await client.voices(DEFAULT_SPEECH_MODEL)
    assert normalised_words(transcript.text) == normalised_words(SENTENCES[5])
    assert normalised_words(" ".join(w.word for w in aligned.words)) == normalised_words(SENTENCES[5]) and voices


async def test_errors_are_lemonkit_exceptions(host: Host) -> None:
    def calls(client: Client) -> list[Exception]:
        errors: list[Exception] = []
        for call in (
            lambda: client.transcribe(b"this is not audio"),
            lambda: client.transcribe(np.zeros(1600, dtype=np.float32), TINY, sample_rate=16000),
            lambda: client.speak("hi", DEFAULT_TRANSCRIPTION_MODEL),
            lambda: client.speak("hi", voice="no-such-voice"),
            lambda: client.transcribe(b"RIFF", "user.no-such-model"),
            lambda: client.transcribe(np.zeros(1600, dtype=np.float32)),
        ):
            with pytest.raises(lemonkit.LemonkitError) as caught:
                call()
            errors.append(caught.value)
        return errors

    undecodable, llm, stt_speaks, voice, missing, no_rate = await _in_thread(host, calls)
    assert isinstance(undecodable, UndecodableAudio) and undecodable.status == 400
    assert isinstance(llm, ModelNotApplicable) and isinstance(stt_speaks, ModelNotApplicable)
    assert isinstance(voice, InvalidArgument) and "no-such-voice" in voice.message
    assert isinstance(missing, ModelNotFound)
    assert isinstance(no_rate, InvalidArgument) and "sample_rate" in no_rate.message
