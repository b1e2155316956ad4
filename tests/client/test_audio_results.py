"""The audio results of the Python API without a server: a :class:`Transcript` read from each answer shape
(``verbose_json``, ``details``, alignments), its plot, subtitles, DataFrame and HTML; :class:`Speech`/`AudioClip`
saved in every format and read back; the uploads ``transcribe`` builds from paths, bytes and samples."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from lemonkit.client.audio_calls import AudioRequest, audio_upload, speech_body, voices_of
from lemonkit.client.audio_clips import AudioClip, Speech, mono
from lemonkit.client.transcripts import Transcript, Word
from lemonkit.errors import InvalidArgument
from lemonkit.formats import audio_codec as audio
from tests.support.system_tools import tool

VERBOSE = {
    "text": " Hello there. General Kenobi.",
    "language": "en",
    "duration": 3.0,
    "segments": [
        {
            "id": 0,
            "start": 0.0,
            "end": 1.2,
            "text": " Hello there.",
            "avg_logprob": -0.2,
            "words": [
                {"word": " Hello", "start": 0.1, "end": 0.5, "probability": 0.9},
                {"word": " there.", "start": 0.5, "end": 1.1, "probability": 0.6},
            ],
        },
        {
            "id": 1,
            "start": 1.5,
            "end": 2.8,
            "text": " General Kenobi.",
            "words": [
                {"word": " General", "start": 1.5, "end": 2.0, "probability": 0.95},
                {"word": " Kenobi.", "start": 2.0, "end": 2.7, "probability": 0.3},
            ],
        },
    ],
}

DETAILS = {
    "text": "Hello there. General Kenobi.",
    "language": "en",
    "sample_rate": 16000,
    "timing": {"wall_ms": 120.0, "audio_duration_ms": 3000.0, "rtf": 0.04},
    "segments": [
        {"start_sample": 0, "end_sample": 19200, "text": "Hello there.", "confidence": 0.8},
        {"start_sample": 24000, "end_sample": 44800, "text": "General Kenobi.", "confidence": 0.7},
    ],
    "words": [
        {"word": "Hello", "start_sample": 1600, "end_sample": 8000, "confidence": 0.9},
        {"word": "there.", "start_sample": 8000, "end_sample": 17600, "confidence": 0.6},
        {"word": "General", "start_sample": 24000, "end_sample": 32000, "confidence": 0.95},
        {"word": "Kenobi.", "start_sample": 32000, "end_sample": 43200, "confidence": 0.3},
    ],
}

EXPECTED_WORDS = [
    Word("Hello", 0.1, 0.5, 0.9),
    Word("there.", 0.5, 1.1, 0.6),
    Word("General", 1.5, 2.0, 0.95),
    Word("Kenobi.", 2.0, 2.7, 0.3),
]


@pytest.fixture(scope="module")
def spoken(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("speech") / "spoken.wav"
    subprocess.run([tool("espeak-ng"), "-w", str(path), "The quick brown fox jumps over the lazy dog."], check=True)
    return path


@pytest.mark.parametrize("answer", [VERBOSE, DETAILS], ids=["verbose_json", "details"])
def test_a_transcript_from_either_answer(answer: dict[str, object]) -> None:
    transcript = Transcript.from_answer(answer, model="m")
    assert transcript.text == "Hello there. General Kenobi." and str(transcript) == transcript.text
    assert [(w.word, w.confidence) for w in transcript.words] == [(w.word, w.confidence) for w in EXPECTED_WORDS]
    for got, want in zip(transcript.words, EXPECTED_WORDS, strict=True):
        assert got.start == pytest.approx(want.start) and got.end == pytest.approx(want.end)
    assert [len(s.words) for s in transcript.segments] == [2, 2]  # details' loose words fall into their segments
    assert [s.text for s in transcript.segments] == ["Hello there.", "General Kenobi."]
    assert transcript.language == "en" and transcript.duration == pytest.approx(3.0) and transcript.model == "m"
    assert "words=4" in repr(transcript) and transcript.audio is None


def test_an_alignment_answer_in_seconds_and_samples() -> None:
    answer = {
        "text": "Hello there",
        "sample_rate": 16000,
        "words": [
            {"word": "Hello", "start": 0.1, "end": 0.5, "start_sample": 1600, "end_sample": 8000},
            {"word": "there", "start_sample": 8000, "end_sample": 17600, "probability": 0.5},
        ],
    }
    transcript = Transcript.from_answer(answer)
    assert transcript.words == [Word("Hello", 0.1, 0.5, None), Word("there", 0.5, 1.1, 0.5)]
    assert transcript.subtitle_segments() == [{"id": 0, "start": 0.1, "end": 1.1, "text": "Hello there"}]
    with pytest.raises(ValueError, match="start_sample"):
        Transcript.from_answer({"text": "x", "words": [{"word": "x", "start_sample": 3, "end_sample": 9}]})


def test_to_pandas_has_one_row_per_word() -> None:
    frame = Transcript.from_answer(VERBOSE).to_pandas()
    assert list(frame.columns) == ["word", "start", "end", "duration", "confidence", "segment"]
    assert frame["word"].tolist() == ["Hello", "there.", "General", "Kenobi."]
    assert frame["segment"].tolist() == [0, 0, 1, 1]
    assert frame["duration"].round(3).tolist() == [0.4, 0.6, 0.5, 0.7]


def test_html_shows_each_word_with_its_times() -> None:
    page = Transcript.from_answer(VERBOSE, model="Whisper <tiny>")._repr_html_()
    assert page.count('class="lk-word"') == 4
    assert 'title="2.00 to 2.70 s · confidence 30%"' in page and ">Kenobi.</span>" in page
    assert "Whisper &lt;tiny&gt;" in page  # escaped


def test_plot_draws_every_word_over_the_waveform(spoken: Path) -> None:
    from matplotlib.figure import Figure

    data = spoken.read_bytes()
    transcript = Transcript.from_answer(VERBOSE, model="m", source=data)
    figure = transcript.plot()
    assert isinstance(figure, Figure)
    (ax,) = figure.axes
    assert [t.get_text() for t in ax.texts] == ["Hello", "there.", "General", "Kenobi."]
    assert len(ax.collections) == 1  # the waveform's envelope
    spans = [p for p in ax.patches]
    assert len(spans) == 4
    alphas = [p.get_facecolor() for p in spans]
    assert alphas[2] != alphas[3]  # shaded by confidence
    clip = transcript.audio
    assert isinstance(clip, AudioClip) and ax.get_xlim()[1] == pytest.approx(max(3.0, clip.duration))
    figure.savefig(Path(spoken).with_suffix(".png"))
    # without audio: the words alone
    assert len(Transcript.from_answer(DETAILS).plot().axes[0].collections) == 0


def test_subtitles(spoken: Path) -> None:
    transcript = Transcript.from_answer(VERBOSE)
    srt = transcript.to_srt()
    assert "00:00:00,000 --> 00:00:01,200" in srt and "00:00:01,500 --> 00:00:02,800" in srt
    assert "Hello there." in srt and "General Kenobi." in srt
    vtt = transcript.to_vtt()
    assert vtt.startswith("WEBVTT") and "00:00:01.500 --> 00:00:02.800" in vtt


@pytest.mark.parametrize("suffix", [".wav", ".flac", ".mp3", ".ogg"])
def test_speech_saves_in_the_format_its_extension_names(spoken: Path, tmp_path: Path, suffix: str) -> None:
    clip = AudioClip.from_bytes(spoken.read_bytes())
    speech = Speech(clip.samples, clip.sample_rate, text="The quick brown fox", model="m", voice="v")
    path = speech.save(tmp_path / f"out{suffix}")
    back = audio.decode(path.read_bytes(), sample_rate=None)
    assert back.duration == pytest.approx(speech.duration, abs=0.1)  # mp3/opus pad a little
    if suffix in (".wav", ".flac"):  # lossless: the same samples (to 16-bit)
        assert back.sample_rate == speech.sample_rate
        np.testing.assert_allclose(back.samples, speech.samples, atol=2 / 32768)
    with pytest.raises(InvalidArgument, match=r"\.aiff"):
        speech.save(tmp_path / "out.aiff")


def test_speech_plays_inline_and_prints_plainly(spoken: Path) -> None:
    clip = AudioClip.from_bytes(spoken.read_bytes())
    speech = Speech(clip.samples, clip.sample_rate, text="The quick brown fox", model="Piper", voice=None)
    assert speech.samples.dtype == np.float32 and speech.duration == len(speech.samples) / speech.sample_rate
    page = speech._repr_html_()
    assert page.count("<audio controls") == 1 and "data:audio/wav;base64,UklGR" in page and "Piper" in page
    assert repr(speech).startswith(f"Speech({speech.duration:.2f} s at {speech.sample_rate} Hz")
    from IPython.display import Audio

    player = Audio(data=speech.samples, rate=speech.sample_rate, normalize=False)
    assert player.data[:4] == b"RIFF"


def test_mono_accepts_channels_either_way_and_integers() -> None:
    stereo = np.stack([np.full(100, 0.5), np.full(100, -0.5)])
    assert mono(stereo).tolist() == [0.0] * 100 and mono(stereo.T).shape == (100,)
    assert mono(np.array([16384, -32768], dtype=np.int16)).tolist() == [0.5, -1.0]
    with pytest.raises(InvalidArgument):
        mono(np.zeros((0,)))


def test_uploads_from_paths_bytes_and_samples(spoken: Path) -> None:
    data = spoken.read_bytes()
    (name, sent, _), kept = audio_upload(spoken)
    assert (name, sent, kept) == ("spoken.wav", data, data)
    (name, sent, _), kept = audio_upload(str(spoken))
    assert name == "spoken.wav" and sent == data
    (name, sent, _), kept = audio_upload(data)
    assert name == "audio.wav" and sent == data
    samples = np.sin(np.linspace(0, 440 * 2 * np.pi, 44100)).astype(np.float32) * 0.5
    (name, sent, kind), kept = audio_upload(samples, 44100)
    decoded = audio.decode(sent, sample_rate=None)
    assert (name, kind, decoded.sample_rate) == ("audio.wav", "audio/wav", 44100)  # sent at its own rate
    np.testing.assert_allclose(decoded.samples, samples, atol=2 / 32768)
    assert isinstance(kept, AudioClip) and kept.sample_rate == 44100
    with pytest.raises(InvalidArgument, match="sample_rate"):
        audio_upload(samples)
    with pytest.raises(InvalidArgument, match="own rate"):
        audio_upload(data, 16000)
    with pytest.raises(FileNotFoundError):
        audio_upload(spoken.with_name("missing.wav"))


def test_requests() -> None:
    samples = np.zeros(1600, dtype=np.float32)
    words = AudioRequest.transcription(samples, "W", sample_rate=16000, words=True, language="en", prompt=None)
    assert words.route == "audio/transcriptions/details" and words.form == {"model": "W", "language": "en"}
    plain = AudioRequest.transcription(samples, "W", sample_rate=16000, words=False, temperature=0.0)
    assert plain.route == "audio/transcriptions"
    assert plain.kwargs["data"] == {
        "model": "W",
        "temperature": "0.0",
        "response_format": "verbose_json",
        "timestamp_granularities[]": "segment",
    }
    aligned = AudioRequest.alignment(samples, "hi", "W", sample_rate=16000, language=None)
    assert aligned.route == "audio/alignments" and aligned.form == {"model": "W", "text": "hi"}
    assert speech_body("hi", "P", None, 1.0) == {"model": "P", "input": "hi", "speed": 1.0, "response_format": "wav"}
    assert voices_of({"voices": ["a", {"id": "b"}, {"name": "c"}]}) == ["a", "b", "c"]


def test_plain_python_needs_no_ipython(tmp_path: Path) -> None:
    script = f"""
import json, sys
import lemonkit
from lemonkit.client.transcripts import Transcript
transcript = Transcript.from_answer({VERBOSE!r}, model="m")
transcript.plot().savefig({str(tmp_path / "plot.png")!r})
print(transcript)
print(json.dumps([name for name in ("IPython", "anywidget", "ipywidgets") if name in sys.modules]))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120)
    text, loaded = done.stdout.splitlines()
    assert text == "Hello there. General Kenobi." and json.loads(loaded) == []
    assert (tmp_path / "plot.png").read_bytes()[:4] == b"\x89PNG"
