"""audio-api.md's generic tasks on both hosts, real HTTP, the bundled Piper voice and Whisper tiny.en:
``/v1/tasks/run`` (Piper speaks, Whisper hears it back; artifacts out and back in), ``/v1/tasks/stream`` (JSON and
SSE framing, the error event), ``/v1/tasks/batch`` (Whisper's native batch; a TTS model refused), the unload routes,
and the refusals: invalid inline audio, paths outside the allowed directories, malformed artifacts."""

from __future__ import annotations

import asyncio
import base64
import io
import json
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import soundfile

from lemonkit.client import AsyncClient, Client
from lemonkit.errors import Forbidden, InvalidArgument
from tests.support.hosts import Host
from tests.support.speech import SENTENCES, normalised_words, speech_wav, word_errors
from tests.support.waiting import until

WHISPER = "Whisper-Tiny-En-Bundled"
PIPER = "Piper-Joe-Medium-Bundled"
CHAT_MODEL = "SmolLM2-135M-Instruct-Bundled"


@pytest.fixture(scope="module")
def allowed(allowed: Path) -> Path:
    """The operator's allowed directory (two sentences and an artifact file), beside one that is not allowed."""
    root = allowed
    (root / "allowed" / "one.wav").write_bytes(speech_wav(SENTENCES[2]))
    (root / "allowed" / "two.wav").write_bytes(speech_wav(SENTENCES[3]))
    (root / "allowed" / "state.bin").write_bytes(b"\x00\x01opaque state")
    (root / "outside" / "speech.wav").write_bytes(speech_wav(SENTENCES[2]))
    return root


@pytest.fixture
def tasks(allowed_host: Host) -> Host:
    """A host whose operator allowed ``allowed/allowed`` for server-local files."""
    return allowed_host


def assert_error(response: httpx.Response, status: int, code: str) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "code"} and error["code"] == code, error
    return str(error["message"])


def sse_frames(raw: str) -> list[Any]:
    """The ``data:`` payloads of an SSE body, each one line followed by a blank line (pings dropped)."""
    frames = [frame for frame in raw.split("\n\n") if frame and not frame.startswith(":")]
    assert all(frame.startswith("data: ") and "\n" not in frame for frame in frames), frames
    return [json.loads(frame[6:]) if frame != "data: [DONE]" else "[DONE]" for frame in frames]


def wav_samples(b64: str) -> tuple[np.ndarray, int]:
    samples, rate = soundfile.read(io.BytesIO(base64.b64decode(b64)), dtype="float32")
    return samples, int(rate)


async def run(client: httpx.AsyncClient, model: str, request: dict[str, Any], route: str = "tasks/run", **top: Any):
    return await client.post(route, json={"model": model, "request": request, **top})


@pytest.mark.slow
async def test_piper_speaks_whisper_hears_and_artifacts_round_trip(tasks: Host, allowed: Path) -> None:
    sentence = SENTENCES[0]
    async with tasks.client() as client:
        spoken = await run(client, PIPER, {"text": sentence, "seed": 7, "max_tokens": 96, "options": {"speed": 1}})
        assert spoken.status_code == 200, spoken.text
        speech = spoken.json()
        samples, rate = wav_samples(speech["audio"])
        assert rate == speech["sample_rate"] == 22050 and speech["channels"] == 1 and speech["artifacts"] == []
        assert 2 < len(samples) / rate < 10 and float(np.abs(samples).max()) > 0.1
        assert speech["timing"]["audio_duration_ms"] > 2000 and speech["timing"]["ttfa_ms"] is not None

        # Piper's audio back in as a data: URI; Piper samples noise as it speaks, so tiny.en may mishear one word
        data_uri = "data:audio/wav;base64," + speech["audio"]
        options = {"word_timestamps": True, "language": "en", "temperature": 0}
        heard = await run(client, WHISPER, {"audio_base64": data_uri, "options": options})
        assert heard.status_code == 200, heard.text
        result = heard.json()
        assert word_errors(sentence, result["text"]) <= 1, result["text"]
        assert result["language"] == "en" and result["sample_rate"] == 16000 and result["timing"]["wall_ms"] > 0
        words = result["word_timestamps"]
        assert normalised_words(" ".join(w["word"] for w in words)) == normalised_words(result["text"])
        assert all(0 <= w["start_sample"] <= w["end_sample"] <= result["duration"] * 16000 + 1 for w in words)
        [alignment] = result["artifacts"]
        assert alignment["kind"] == "transcript_alignment" and alignment["meta"]["sample_rate"] == "16000"
        assert json.loads(base64.b64decode(alignment["payload"]))["words"] == words  # the same words, honestly

        # what one result returned goes back in a later request, with an inline and a path artifact beside it
        back = [
            alignment,
            {"id": "example.state", "kind": "custom", "payload": "", "meta": {"format": "example/1", "n": 1.0}},
            {"id": "example.state", "kind": "custom", "path": str(allowed / "allowed" / "state.bin")},
        ]
        again = await run(client, WHISPER, {"audio": str(allowed / "allowed" / "one.wav"), "artifacts": back})
        assert again.status_code == 200, again.text
        assert normalised_words(again.json()["text"]) == normalised_words(SENTENCES[2])
        assert "word_timestamps" not in again.json()  # not asked for this time
        resent = await run(client, PIPER, {"text": "Thank you.", "artifacts": back})
        assert resent.status_code == 200, resent.text


async def test_refusals_before_any_model_runs(tasks: Host, allowed: Path) -> None:
    inside = str(allowed / "allowed" / "one.wav")
    not_wav = base64.b64encode(b"this is not a wav file at all").decode()
    async with tasks.client() as client:
        # invalid inline audio: not base64, base64 of something else, both forms at once
        assert "audio_base64" in assert_error(
            await run(client, WHISPER, {"audio_base64": "@@@"}), 400, "invalid_argument"
        )
        assert_error(await run(client, WHISPER, {"audio_base64": not_wav}), 400, "invalid_audio")
        both = await run(client, WHISPER, {"audio": inside, "audio_base64": not_wav})
        assert "only one of" in assert_error(both, 400, "invalid_argument")

        # server-local paths outside the allowed directories (absolute, relative, through "..", in an artifact)
        outside = str(allowed / "outside" / "speech.wav")
        for path in (outside, "speech.wav", f"{allowed}/allowed/../outside/speech.wav"):
            refused = await run(client, WHISPER, {"audio": path})
            assert "LEMONKIT_ALLOWED_DIRS" in assert_error(refused, 403, "forbidden")
        artifact = {"id": "x", "kind": "custom", "path": outside}
        message = assert_error(await run(client, WHISPER, {"audio": inside, "artifacts": [artifact]}), 403, "forbidden")
        assert message.startswith("artifacts[0] (x): path")

        # malformed artifacts, each named
        good = {"id": "example.state", "kind": "custom", "payload": ""}
        cases = {
            "artifacts[1] (example.tokens): unknown kind 'tokens'": {"id": "example.tokens", "kind": "tokens"},
            "artifacts[1]: id must be a non-empty string": {"id": "", "kind": "custom", "payload": ""},
            "artifacts[1] (a): give the bytes as payload": {"id": "a", "kind": "midi"},
            "artifacts[1] (b): payload: expected a base64": {"id": "b", "kind": "midi", "payload": "%%%"},
            "artifacts[1] (c): meta.m: expected a string, number or boolean": {
                "id": "c",
                "kind": "vad_state",
                "payload": "",
                "meta": {"m": [1]},
            },
        }
        for expected, bad in cases.items():
            response = await run(client, PIPER, {"text": "Hi.", "artifacts": [good, bad]})
            assert assert_error(response, 400, "invalid_argument").startswith(expected), response.text
        not_a_list = await run(client, PIPER, {"text": "Hi.", "artifacts": {"id": "x"}})
        assert_error(not_a_list, 400, "invalid_argument")
        assert_error(await run(client, PIPER, {"text": "Hi.", "options": {"voice": ["joe"]}}), 400, "invalid_argument")
        assert_error(await run(client, PIPER, {"text": "Hi.", "max_tokens": 0}), 400, "invalid_argument")
        assert_error(await run(client, PIPER, {"text": "Hi.", "seed": str(2**64)}), 400, "invalid_argument")

        # the model: unknown, not an audio model; the body itself
        assert_error(await run(client, "no-such-model", {"text": "Hi."}), 404, "model_not_found")
        assert_error(await run(client, CHAT_MODEL, {"text": "Hi."}), 400, "model_not_applicable")
        assert_error(await client.post("tasks/run", json={"model": PIPER}), 400, "missing_argument")
        assert_error(await client.post("tasks/run", json={"model": PIPER, "request": "Hi"}), 400, "invalid_argument")


@pytest.mark.slow
async def test_engines_refuse_what_they_cannot_do(tasks: Host, allowed: Path) -> None:
    inside = str(allowed / "allowed" / "one.wav")
    async with tasks.client() as client:
        unknown = await run(client, WHISPER, {"audio": inside, "options": {"beam": 3}})
        assert "options.beam" in assert_error(unknown, 400, "invalid_argument")
        assert_error(await run(client, WHISPER, {"text": "no audio"}), 400, "missing_argument")
        short = await run(client, WHISPER, {"audio": inside, "max_tokens": 6})  # a timestamp and a few words
        assert short.status_code == 200, short.text
        assert len(normalised_words(short.json()["text"])) < len(normalised_words(SENTENCES[2])), short.text
        unbounded = await run(client, WHISPER, {"audio": inside, "max_tokens": 10**12})  # clamped, as chat's is
        assert normalised_words(unbounded.json()["text"]) == normalised_words(SENTENCES[2]), unbounded.text
        clone = await run(client, PIPER, {"text": "Hi.", "voice_ref": inside})
        assert "voice_ref" in assert_error(clone, 400, "invalid_argument")
        assert_error(await run(client, PIPER, {"audio": inside, "text": "Hi."}), 400, "invalid_argument")
        assert_error(await run(client, PIPER, {"text": "Hi.", "options": {"speed": "fast"}}), 400, "invalid_argument")


@pytest.mark.slow
async def test_stream_as_json_and_as_sse(tasks: Host, allowed: Path) -> None:
    text = f"{SENTENCES[1]} {SENTENCES[5]}"
    async with tasks.client() as client:
        whole = await run(client, PIPER, {"text": text}, "tasks/stream")
        assert whole.status_code == 200 and whole.headers["content-type"].startswith("application/json")
        body = whole.json()
        events, result = body["events"], body["result"]
        # one per sentence as each is spoken, then the end of the run
        assert len(events) == 3 and [e["is_final"] for e in events] == [False, False, True] and "audio" not in events[2]
        pieces = [wav_samples(e["audio"])[0] for e in events[:2]]
        assert sum(len(p) for p in pieces) == len(wav_samples(result["audio"])[0])
        assert list(result["timing"]) == ["ttft_ms"] and result["timing"]["ttft_ms"] > 0

        sse = await run(client, PIPER, {"text": text}, "tasks/stream", stream_format="sse")
        assert sse.status_code == 200 and sse.headers["content-type"].startswith("text/event-stream")
        assert sse.headers["x-accel-buffering"] == "no"
        frames = sse_frames(sse.text)
        kinds = [f if f == "[DONE]" else f["type"] for f in frames]
        assert kinds == ["task.stream.event"] * 3 + ["task.stream.done", "[DONE]"]
        assert all(wav_samples(f["event"]["audio"])[0].size and not f["event"]["is_final"] for f in frames[:2])
        assert frames[-2]["result"]["sample_rate"] == 22050 and frames[2]["event"] == {"is_final": True}

        # Whisper streams a segment per event; include_artifacts puts the alignment on the last one
        path = str(allowed / "allowed" / "two.wav")
        request = {"audio": path, "audio_base64": "ignored here", "options": {"word_timestamps": "true"}}
        heard = await run(client, WHISPER, request, "tasks/stream", stream_format="sse", include_artifacts=True)
        frames = sse_frames(heard.text)
        assert frames[-1] == "[DONE]" and frames[-2]["type"] == "task.stream.done"
        streamed, last = [f["event"] for f in frames[:-3]], frames[-3]["event"]
        assert streamed and all(e["partial_text"]["language"] == "en" and e["word_timestamps"] for e in streamed)
        said = "".join(e["partial_text"]["text"] for e in streamed)
        assert (
            normalised_words(said) == normalised_words(frames[-2]["result"]["text"]) == normalised_words(SENTENCES[3])
        )
        assert last["is_final"] is True and last["artifacts"][0]["kind"] == "transcript_alignment"
        assert frames[-2]["result"]["artifacts"] == last["artifacts"]

        # refused before the stream starts: statuses; turned away once it started: the error event, no [DONE]
        assert_error(
            await run(client, PIPER, {"text": "Hi."}, "tasks/stream", stream_format="json"), 400, "invalid_argument"
        )
        bad = {"id": "x", "kind": "tokens", "payload": ""}
        early = await run(client, PIPER, {"text": "Hi.", "artifacts": [bad]}, "tasks/stream", stream_format="sse")
        assert_error(early, 400, "invalid_argument")
        late = await run(client, PIPER, {"text": "Hi.", "options": {"pitch": 2}}, "tasks/stream", stream_format="sse")
        assert late.status_code == 200 and late.headers["content-type"].startswith("text/event-stream")
        [error] = sse_frames(late.text)
        assert (
            error["type"] == "error"
            and set(error["error"]) == {"message"}
            and "options.pitch" in error["error"]["message"]
        )


@pytest.mark.slow
async def test_a_client_that_leaves_the_stream_stops_the_run(tasks: Host) -> None:
    long_text = " ".join(f"This is sentence number {n} of a long story." for n in range(60))
    body = {"model": PIPER, "request": {"text": long_text}, "stream_format": "sse"}
    async with tasks.client() as client:
        async with client.stream("POST", "tasks/stream", json=body) as response:
            first = await anext(aiter(response.aiter_lines()))
        assert json.loads(first[6:])["type"] == "task.stream.event"
        # the sidecar serves one request at a time, in order: this answer comes once the abandoned run stopped
        assert (await client.get("audio/voices", params={"model": PIPER})).status_code == 200
        spoken = (await client.get("stats")).json()["audio"]["audio_duration_ms"]
    assert spoken < 60 * 1500 / 2  # far less than the 60 sentences (about 1.5 s each)


@pytest.mark.slow
async def test_a_json_client_that_leaves_lets_the_run_finish(tasks: Host) -> None:
    """The spec: "a JSON client that disconnects leaves its run to finish" (an SSE client's stops, above)."""
    long_text = " ".join(f"This is sentence number {n} of a long story." for n in range(60))
    body = {"model": PIPER, "request": {"text": long_text}}

    async def busy(client: httpx.AsyncClient) -> bool:
        health = (await client.get("health")).json()
        return any(m["model_name"] == PIPER and m["slots"]["busy"] for m in health["all_models_loaded"])

    async with tasks.client() as client:
        await client.post("load", json={"model_name": PIPER})
        leaving = asyncio.ensure_future(client.post("tasks/stream", json=body))
        await until(lambda: busy(client), "the run to start")
        leaving.cancel()  # the client hangs up mid-run
        with pytest.raises(asyncio.CancelledError):
            await leaving
        assert await busy(client)  # the run goes on without its client
        await until(lambda: _not(busy(client)), "the run to finish")
        spoken = (await client.get("stats")).json()["audio"]["audio_duration_ms"]
    assert spoken > 60 * 1000  # all 60 sentences (about 1.5 s each), not a run cut short


async def _not(check: Any) -> bool:
    return not await check


@pytest.mark.slow
async def test_batch_on_whisper_and_refused_on_tts(tasks: Host, allowed: Path) -> None:
    entries = [{"audio": str(allowed / "allowed" / name)} for name in ("one.wav", "two.wav")]
    async with tasks.client() as client:
        response = await client.post("tasks/batch", json={"model": WHISPER, "requests": entries})
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        frames = sse_frames(response.text)
        assert frames[-1] == "[DONE]" and frames[-2]["type"] == "task.batch.done"
        assert frames[-2]["result_count"] == 2 and frames[-2]["timing"]["audio_duration_ms"] > 0
        results = {f["index"]: f["result"] for f in frames[:-2] if f["type"] == "task.batch.result"}
        assert sorted(results) == [0, 1] and all(r["timing"] is None for r in results.values())
        assert normalised_words(results[0]["text"]) == normalised_words(SENTENCES[2])
        assert normalised_words(results[1]["text"]) == normalised_words(SENTENCES[3])

        refused = await client.post("tasks/batch", json={"model": PIPER, "requests": [{"text": "Hi."}]})
        assert "native batch" in assert_error(refused, 400, "model_not_applicable")
        mixed = [entries[0], {**entries[1], "options": {"language": "en"}}]
        differing = await client.post("tasks/batch", json={"model": WHISPER, "requests": mixed})
        assert "requests[1].options" in assert_error(differing, 400, "invalid_argument")
        bad = [entries[0], {**entries[1], "artifacts": [{"id": "t", "kind": "tokens", "payload": ""}]}]
        named = await client.post("tasks/batch", json={"model": WHISPER, "requests": bad})
        assert assert_error(named, 400, "invalid_argument").startswith("requests[1].artifacts[0] (t): unknown kind")
        assert_error(await client.post("tasks/batch", json={"model": WHISPER, "requests": []}), 400, "invalid_argument")


async def loaded(client: httpx.AsyncClient) -> set[str]:
    return {m["model_name"] for m in (await client.get("health")).json()["all_models_loaded"]}


@pytest.mark.slow
async def test_unload_models_and_all_models(tasks: Host) -> None:
    async with tasks.client() as client:
        assert (await client.post("tasks/unload_all_models")).status_code == 200  # the module's server: a clean slate
        # a long reply: the unload comes while it streams, and waits for it rather than cutting it off
        text = " ".join(SENTENCES * 2)
        async with client.stream(
            "POST", "tasks/stream", json={"model": PIPER, "request": {"text": text}, "stream_format": "sse"}
        ) as stream:
            frames: list[str] = []
            pending: asyncio.Future[httpx.Response] | None = None
            async for line in stream.aiter_lines():
                if not line.startswith("data: "):
                    continue
                frames.append(line)
                if pending is None:  # the run is under way: unload it (and a model not loaded, and no model)
                    assert json.loads(line[6:])["type"] == "task.stream.event"
                    ids = [PIPER, "no-such-model", WHISPER]
                    pending = asyncio.ensure_future(client.post("tasks/unload_models", json={"model_ids": ids}))
        rest = frames
        assert rest[-1] == "data: [DONE]" and json.loads(rest[-2][6:])["type"] == "task.stream.done"
        assert pending is not None
        answer = await pending
        assert answer.status_code == 200 and answer.json() == {"unloaded": [PIPER], "not_found": ["no-such-model"]}
        assert PIPER not in await loaded(client)

        assert (await run(client, PIPER, {"text": "Hello again."})).status_code == 200  # reloads transparently
        assert PIPER in await loaded(client)
        everything = await client.post("tasks/unload_all_models")
        assert everything.status_code == 200 and PIPER in everything.json()["unloaded"]
        assert set(everything.json()) == {"unloaded"} and not await loaded(client)
        none_left = await client.post("tasks/unload_all_models")
        assert none_left.json() == {"unloaded": []}

        assert_error(await client.post("tasks/unload_models", json={}), 400, "missing_argument")
        assert_error(await client.post("tasks/unload_all_models", json={"model_ids": [PIPER]}), 400, "invalid_argument")
        assert_error(await client.post("tasks/unload_models", json={"model_ids": PIPER}), 400, "invalid_argument")


@pytest.mark.slow
async def test_the_python_client_runs_tasks(tasks: Host, allowed: Path) -> None:
    def calls(client: Client) -> tuple[dict[str, Any], ...]:
        speech = client.run_task(PIPER, text=SENTENCES[4], options={"voice": "joe"})
        heard = client.run_task(WHISPER, audio=base64.b64decode(speech["audio"]), options={"language": "en"})
        local = client.run_task(WHISPER, audio_path=str(allowed / "allowed" / "one.wav"))
        with pytest.raises(Forbidden):
            client.run_task(WHISPER, audio_path=str(allowed / "outside" / "speech.wav"))
        with pytest.raises(InvalidArgument):
            client.run_task(WHISPER, audio=b"RIFF", audio_path=str(allowed / "allowed" / "one.wav"))
        return speech, heard, local, client.unload_models([PIPER, "no-such-model"])

    def in_thread() -> tuple[dict[str, Any], ...]:
        with Client(tasks.root, token=tasks.token) as client:
            return calls(client)

    speech, heard, local, unloaded = await asyncio.to_thread(in_thread)
    assert speech["voice"] == "joe" and word_errors(SENTENCES[4], heard["text"]) <= 1, heard["text"]
    assert normalised_words(local["text"]) == normalised_words(SENTENCES[2])
    assert unloaded == {"unloaded": [PIPER], "not_found": ["no-such-model"]}

    async with AsyncClient(tasks.root, token=tasks.token) as client:
        spoken = await client.run_task(PIPER, text="Hello again.", seed=str(2**64 - 1))  # a uint64, as text
        assert wav_samples(spoken["audio"])[1] == 22050
        assert await client.unload_models([PIPER]) == {"unloaded": [PIPER], "not_found": []}
        with pytest.raises(TypeError):
            await client.run_task(PIPER, txt="a typo")
