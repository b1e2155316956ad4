"""``WS /realtime`` and ``/v1/realtime`` on both hosts: server VAD turns on espeak-ng speech fed in 100 ms chunks,
manual commits with ``turn_detection: null``, clearing, protocol errors, and OpenAI's own realtime client."""

from __future__ import annotations

import asyncio
import base64
import json
from typing import Any
from urllib.parse import urlencode, urlsplit

import numpy as np
import openai
import pytest
from tornado.httpclient import HTTPClientError, HTTPRequest
from tornado.websocket import WebSocketClientConnection, websocket_connect

from lemonkit.formats.audio_codec import pcm16
from tests.support.hosts import Host
from tests.support.speech import SENTENCES, normalised_words, speech_samples, word_error_rate
from tests.support.tiny_models import TINY

MODEL = "Whisper-Tiny-En-Bundled"
RATE = 16000
TRANSCRIPTION = "conversation.item.input_audio_transcription"
#: a safety net against a hang (the test fails), not a timing assertion
WAIT = 180


def _url(host: Host, path: str = "realtime", **query: str) -> str:
    return host.root.replace("http://", "ws://", 1) + path + ("?" + urlencode(query) if query else "")


async def _connect(host: Host, path: str = "realtime", **query: str) -> WebSocketClientConnection:
    return await websocket_connect(HTTPRequest(_url(host, path, **query), headers=host.headers))


async def _recv(ws: WebSocketClientConnection) -> dict[str, Any]:
    raw = await asyncio.wait_for(ws.read_message(), WAIT)
    assert raw is not None, "the server closed the connection"
    message: dict[str, Any] = json.loads(raw)
    return message


async def _until(ws: WebSocketClientConnection, kind: str) -> list[dict[str, Any]]:
    """Messages up to and including the first of type ``kind``."""
    seen = []
    while True:
        message = await _recv(ws)
        seen.append(message)
        if message["type"] == kind:
            return seen


async def _append(ws: WebSocketClientConnection, samples: np.ndarray, chunk_ms: int = 100) -> None:
    step = RATE * chunk_ms // 1000
    for start in range(0, len(samples), step):
        audio = base64.b64encode(pcm16(samples[start : start + step])).decode()
        await ws.write_message(json.dumps({"type": "input_audio_buffer.append", "audio": audio}))


def silence(seconds: float) -> np.ndarray:
    return np.zeros(int(seconds * RATE), dtype=np.float32)


async def _created(ws: WebSocketClientConnection) -> dict[str, Any]:
    created = await _recv(ws)
    assert created["type"] == "session.created", created
    assert created["session"]["id"].startswith("sess_")
    session: dict[str, Any] = created["session"]
    return session


@pytest.mark.slow
@pytest.mark.parametrize("path", ["realtime", "v1/realtime"])
async def test_server_vad_turn_in_100_ms_chunks(host: Host, path: str) -> None:
    spoken = SENTENCES[2]
    ws = await _connect(host, path, model=MODEL)
    try:
        session = await _created(ws)
        assert session["model"] == MODEL and session["turn_detection"]["silence_duration_ms"] == 800
        await _append(ws, np.concatenate([silence(0.5), speech_samples(spoken), silence(1.5)]))
        events = await _until(ws, f"{TRANSCRIPTION}.completed")
    finally:
        ws.close()
    kinds = [e["type"] for e in events]
    started, stopped, committed = (
        kinds.index(f"input_audio_buffer.{k}") for k in ("speech_started", "speech_stopped", "committed")
    )
    assert started < stopped < committed < len(kinds) - 1, kinds
    item = events[started]["item_id"]
    assert {e["item_id"] for e in events if "item_id" in e} == {item}, events
    # the speech starts after the half second of silence it follows, and stops before the silence ends
    assert (
        300
        <= events[started]["audio_start_ms"]
        < events[stopped]["audio_end_ms"]
        <= 500 + 1000 * len(speech_samples(spoken)) // RATE + 100
    )
    assert all(isinstance(e["delta"], str) for e in events if e["type"] == f"{TRANSCRIPTION}.delta")
    assert word_error_rate(spoken, events[-1]["transcript"]) <= 0.2, events[-1]


@pytest.mark.slow
async def test_interim_transcripts_come_while_the_speaker_talks(host: Host) -> None:
    spoken = SENTENCES[0]
    speech = speech_samples(spoken)
    ws = await _connect(host, model=MODEL)
    try:
        await _created(ws)
        await _append(ws, np.concatenate([silence(0.3), speech[: RATE * 2]]))
        # no pause yet: the utterance is still open, and its interim text comes before any more audio is sent
        before = await _until(ws, f"{TRANSCRIPTION}.delta")
        await _append(ws, np.concatenate([speech[RATE * 2 :], silence(1.5)]))
        after = await _until(ws, f"{TRANSCRIPTION}.completed")
    finally:
        ws.close()
    assert [e["type"] for e in before] == ["input_audio_buffer.speech_started", f"{TRANSCRIPTION}.delta"]
    item = before[0]["item_id"]
    assert before[1]["item_id"] == item and before[1]["delta"].strip()
    assert normalised_words(before[1]["delta"])[0] == "please", before[1]
    assert after[-1]["item_id"] == item
    assert word_error_rate(spoken, after[-1]["transcript"]) <= 0.2, after[-1]


@pytest.mark.slow
async def test_session_update_sets_the_model_and_the_vad(host: Host) -> None:
    ws = await _connect(host)
    try:
        await _created(ws)
        update = {"model": MODEL, "turn_detection": {"type": "server_vad", "silence_duration_ms": 500}}
        await ws.write_message(json.dumps({"type": "session.update", "session": update}))
        updated = await _recv(ws)
    finally:
        ws.close()
    assert updated["type"] == "session.updated", updated
    session = updated["session"]
    assert session["model"] == MODEL
    assert session["turn_detection"] == {
        "type": "server_vad",
        "threshold": 0.01,
        "silence_duration_ms": 500,
        "prefix_padding_ms": 250,
    }


@pytest.mark.slow
async def test_turn_detection_null_waits_for_the_commit(host: Host) -> None:
    spoken = SENTENCES[5]
    ws = await _connect(host, model=MODEL)
    try:
        await _created(ws)
        await ws.write_message(json.dumps({"type": "session.update", "session": {"turn_detection": None}}))
        updated = await _recv(ws)
        assert updated["type"] == "session.updated" and updated["session"]["turn_detection"] is None
        await _append(ws, np.concatenate([silence(0.5), speech_samples(spoken), silence(1.5)]))
        await ws.write_message(json.dumps({"type": "input_audio_buffer.commit"}))
        # messages keep their order: the first one after the audio is the commit's, so no VAD or interim
        # message came for all that speech and silence
        committed = await _recv(ws)
        assert committed["type"] == "input_audio_buffer.committed", committed
        completed = await _recv(ws)
    finally:
        ws.close()
    assert completed["type"] == f"{TRANSCRIPTION}.completed" and completed["item_id"] == committed["item_id"]
    assert word_error_rate(spoken, completed["transcript"]) <= 0.2, completed


@pytest.mark.slow
async def test_clear_drops_the_buffer(host: Host) -> None:
    ws = await _connect(host, model=MODEL)
    try:
        await _created(ws)
        await ws.write_message(json.dumps({"type": "session.update", "session": {"turn_detection": None}}))
        await _recv(ws)
        await _append(ws, speech_samples(SENTENCES[3]))
        await ws.write_message(json.dumps({"type": "input_audio_buffer.clear"}))
        assert (await _recv(ws))["type"] == "input_audio_buffer.cleared"
        await ws.write_message(json.dumps({"type": "input_audio_buffer.commit"}))
        error = await _recv(ws)
    finally:
        ws.close()
    assert error["type"] == "error" and error["error"]["code"] == "input_audio_buffer_commit_empty", error


@pytest.mark.parametrize(
    ("message", "code"),
    [
        ("{not json", "invalid_json"),
        ('["a"]', "invalid_json"),
        ('{"type": "response.create"}', "unknown_event"),
        ('{"type": 5}', "unknown_event"),
        ('{"type": "input_audio_buffer.append", "audio": "not base64!"}', "invalid_audio"),
        ('{"type": "input_audio_buffer.append", "audio": 5}', "invalid_argument"),
        ('{"type": "session.update", "session": {"turn_detection": {"threshold": -1}}}', "invalid_argument"),
        ('{"type": "session.update", "session": {"turn_detection": "on"}}', "invalid_argument"),
        ('{"type": "session.update", "session": {"model": "no-such-model"}}', "model_not_found"),
        (json.dumps({"type": "session.update", "session": {"model": TINY}}), "model_not_applicable"),
    ],
)
async def test_bad_messages_get_error_messages(host: Host, message: str, code: str) -> None:
    ws = await _connect(host)  # no model: nothing loads
    try:
        await _created(ws)
        await ws.write_message(message)
        error = await _recv(ws)
        # the session goes on: a good message after the bad one is answered
        await ws.write_message(json.dumps({"type": "input_audio_buffer.clear"}))
        after = await _recv(ws)
    finally:
        ws.close()
    assert error["type"] == "error" and error["error"]["code"] == code, error
    assert error["error"]["message"] and error["error"]["type"]
    assert after["type"] == "input_audio_buffer.cleared"


async def test_audio_needs_a_model(host: Host) -> None:
    ws = await _connect(host)
    try:
        session = await _created(ws)
        assert session["model"] is None
        await _append(ws, silence(0.1))
        error = await _recv(ws)
    finally:
        ws.close()
    assert error["type"] == "error" and error["error"]["code"] == "missing_argument", error


async def test_a_model_that_is_not_realtime_is_refused(host: Host) -> None:
    ws = await _connect(host, model=TINY)
    try:
        session = await _created(ws)
        error = await _recv(ws)
    finally:
        ws.close()
    assert error["type"] == "error" and error["error"]["code"] == "model_not_applicable", error
    assert session["model"] is None


async def test_credentials_are_required(host: Host) -> None:
    with pytest.raises(HTTPClientError) as refused:
        await websocket_connect(_url(host, model=MODEL))
    assert refused.value.code in (401, 403)
    if host.kind == "standalone":  # browsers cannot set a WebSocket's headers: the key may come in the query
        ws = await websocket_connect(_url(host, api_key=host.token or ""))
        try:
            await _created(ws)
        finally:
            ws.close()


async def test_health_says_where_to_connect(host: Host) -> None:
    async with host.client() as client:
        health = (await client.get("health")).json()
    root = urlsplit(host.root)
    # the WebSocket routes hang off one root: the log stream's path names it
    path = health["websocket_path"].rsplit("/", 2)[0] + "/realtime"
    url = f"ws://{root.hostname}:{health['websocket_port']}{path}"
    ws = await websocket_connect(HTTPRequest(url, headers=host.headers))
    try:
        await _created(ws)
    finally:
        ws.close()


@pytest.mark.slow
async def test_openai_realtime_client(host: Host) -> None:
    spoken = SENTENCES[1]
    client = openai.AsyncOpenAI(base_url=host.api, api_key=host.token or "none", max_retries=0)
    samples = np.concatenate([silence(0.3), speech_samples(spoken), silence(1.5)])
    async with client.realtime.connect(model=MODEL) as connection:
        created = await asyncio.wait_for(connection.recv(), WAIT)
        assert created.type == "session.created"
        for start in range(0, len(samples), RATE // 10):
            await connection.input_audio_buffer.append(
                audio=base64.b64encode(pcm16(samples[start : start + 1600])).decode()
            )
        while True:
            event = await asyncio.wait_for(connection.recv(), WAIT)
            assert event.type != "error", event
            if event.type == f"{TRANSCRIPTION}.completed":
                break
    assert word_error_rate(spoken, event.transcript) <= 0.2, event.transcript


async def test_a_foreign_web_page_is_refused(host: Host) -> None:
    # Jupyter skips its Origin check for token-authenticated requests (a page cannot hold the token), so a
    # foreign page there is one without the token; standalone, the browser policy refuses it even with the key
    headers = {"Origin": "http://evil.example", **(host.headers if host.kind == "standalone" else {})}
    with pytest.raises(HTTPClientError) as refused:
        await websocket_connect(HTTPRequest(_url(host, model=MODEL), headers=headers))
    assert refused.value.code in (401, 403) if host.kind == "jupyter" else refused.value.code == 403
