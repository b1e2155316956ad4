"""``POST /v1/audio/transcriptions/live`` on both hosts, driven by a raw HTTP/1.1 client that writes the chunked
body while it reads the answer: deltas before the upload ends, the transcript of espeak-ng speech, and each way a
body can go wrong (truncated, stalled, an oversized chunk) ending in an SSE ``error`` event, never a ``done``."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import struct
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from typing import Any
from urllib.parse import urlencode, urlsplit

import httpx
import numpy as np
import pytest

from lemonkit.formats.audio_codec import pcm16
from tests.support.hosts import API_KEY, Host, Standalone
from tests.support.speech import SENTENCES, speech_samples, word_error_rate
from tests.support.tiny_models import TINY

MODEL = "Whisper-Tiny-En-Bundled"
RATE = 16000
PATH = "audio/transcriptions/live"
IDLE_MS = 400
MAX_BODY = 64 * 1024
#: a safety net against a hang (the test fails), not a timing assertion
WAIT = 180


class LiveRequest:
    """One live request over a raw connection: chunks are written as the test decides, the answer is read as
    it comes (status, headers, then the SSE events of its chunked body)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.status = 0
        self._pending = b""
        self._body_done = False

    @classmethod
    async def open(cls, host: Host, query: dict[str, Any], first: bytes = b"") -> LiveRequest:
        url = urlsplit(f"{host.api}/{PATH}?{urlencode(query)}")
        reader, writer = await asyncio.open_connection(url.hostname, url.port)
        auth = f"Authorization: Bearer {host.token}\r\n" if host.token else ""
        head = f"POST {url.path}?{url.query} HTTP/1.1\r\nHost: {url.netloc}\r\n{auth}Transfer-Encoding: chunked\r\n\r\n"
        writer.write(head.encode())
        request = cls(reader, writer)
        if first:
            await request.send(first)
        return request

    async def send(self, data: bytes) -> None:
        self.writer.write(b"%x\r\n%b\r\n" % (len(data), data))
        await self.writer.drain()

    async def send_audio(self, samples: np.ndarray, chunk_ms: int = 100) -> None:
        step = RATE * chunk_ms // 1000
        for start in range(0, len(samples), step):
            await self.send(pcm16(samples[start : start + step]))

    async def end(self) -> None:
        self.writer.write(b"0\r\n\r\n")
        await self.writer.drain()

    async def half_close(self) -> None:
        """Stop sending (TCP FIN) without the terminating chunk; the answer can still be read."""
        self.writer.write_eof()

    async def _head(self) -> None:
        head = await asyncio.wait_for(self.reader.readuntil(b"\r\n\r\n"), WAIT)
        status_line, *lines = head.decode().split("\r\n")
        self.status = int(status_line.split()[1])
        self.headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines if line)}
        assert self.headers.get("transfer-encoding") == "chunked", head

    async def event(self) -> Any:
        """The next SSE payload (a dict, or ``"[DONE]"``); ``None`` once the answer ended."""
        if not self.status:
            await self._head()
            assert self.status == 200, self.status
            assert self.headers["content-type"] == "text/event-stream"
        while b"\n\n" not in self._pending:
            if self._body_done:
                assert not self._pending.strip(), self._pending
                return None
            size = int((await asyncio.wait_for(self.reader.readuntil(b"\r\n"), WAIT)).strip(), 16)
            data = await asyncio.wait_for(self.reader.readexactly(size + 2), WAIT)
            self._pending += data[:-2]
            self._body_done = size == 0
        frame, self._pending = self._pending.split(b"\n\n", 1)
        assert frame.startswith(b"data: "), frame
        payload = frame[6:].decode()
        return payload if payload == "[DONE]" else json.loads(payload)

    async def rest(self) -> list[Any]:
        """Every event up to the end of the answer."""
        events = []
        while (event := await self.event()) is not None:
            events.append(event)
        return events

    def close(self) -> None:
        self.writer.close()


def silence(seconds: float) -> np.ndarray:
    return np.zeros(int(seconds * RATE), dtype=np.float32)


def _check_ending(events: list[Any]) -> str:
    """The text of a stream that ended well: deltas, one done whose text they add up to, ``[DONE]``."""
    assert events[-2:][-1] == "[DONE]", events
    done = events[-2]
    assert done["type"] == "transcript.text.done", events
    deltas = [e["delta"] for e in events[:-2]]
    assert all(e["type"] == "transcript.text.delta" for e in events[:-2]), events
    assert "".join(deltas) == done["text"]
    text: str = done["text"]
    return text


def _error(events: list[Any], code: str) -> dict[str, Any]:
    """The stream's error event (its last); no done, no ``[DONE]``."""
    assert events and "error" in events[-1], events
    assert not any(isinstance(e, dict) and e.get("type") == "transcript.text.done" for e in events), events
    assert "[DONE]" not in events
    error: dict[str, Any] = events[-1]["error"]
    assert error["code"] == code and error["message"] and error["type"], error
    return error


@pytest.mark.slow
async def test_a_delta_arrives_while_the_body_is_still_being_sent(host: Host) -> None:
    first, second = SENTENCES[0], SENTENCES[3]
    live = await LiveRequest.open(host, {"model": MODEL})
    try:
        # the first sentence and the pause after it: the server ends that utterance and says its words ...
        await live.send_audio(np.concatenate([silence(0.3), speech_samples(first), silence(1.5)]))
        event = await live.event()
        assert event.get("type") == "transcript.text.delta" and event["delta"].strip(), event
        # ... before the rest of the body exists
        await live.send_audio(np.concatenate([speech_samples(second), silence(0.5)]))
        await live.end()
        events = [event, *await live.rest()]
    finally:
        live.close()
    text = _check_ending(events)
    assert word_error_rate(f"{first} {second}", text) <= 0.2, text


@pytest.mark.slow
async def test_stereo_float_at_48_khz(host: Host) -> None:
    rate, spoken = 48000, SENTENCES[4]
    mono = np.concatenate([speech_samples(spoken, rate), np.zeros(rate // 2, dtype=np.float32)])
    stereo = np.repeat(mono[:, None], 2, axis=1).astype("<f4").tobytes()
    query = {"model": MODEL, "sample_rate": rate, "channels": 2, "sample_format": "f32le", "language": "en"}
    live = await LiveRequest.open(host, query)
    try:
        for start in range(0, len(stereo), 38_400 - 5):  # chunks that split samples and frames
            await live.send(stereo[start : start + 38_400 - 5])
        await live.end()
        events = await live.rest()
    finally:
        live.close()
    assert word_error_rate(spoken, _check_ending(events)) <= 0.2, events


@pytest.mark.slow
async def test_a_body_cut_short_is_an_error_not_a_transcript(host: Host) -> None:
    live = await LiveRequest.open(host, {"model": MODEL})
    try:
        await live.send_audio(speech_samples(SENTENCES[1])[: RATE * 2])
        await live.half_close()  # no terminating chunk: the speaker did not stop, the connection did
        events = await live.rest()
    finally:
        live.close()
    _error(events, "truncated_body")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("framing", "code"),
    [
        (b"%x\r\n" % (8 * 1024 * 1024 + 1), "chunk_too_large"),  # declared, never sent: refused on its size line
        (b"not-hex\r\n", "malformed_body"),
        (b"4\r\nabcdXY", "malformed_body"),  # a chunk not followed by CRLF
    ],
)
async def test_bad_framing_is_an_error_event(host: Host, framing: bytes, code: str) -> None:
    live = await LiveRequest.open(host, {"model": MODEL}, first=pcm16(silence(0.2)))
    try:
        live.writer.write(framing)
        await live.writer.drain()
        events = await live.rest()
    finally:
        live.close()
    _error(events, code)


# -- a stall and a long body, on servers whose bounds are small ------------------------------------------------


@pytest.fixture
def jp_server_config(request: pytest.FixtureRequest) -> dict[str, Any]:
    config: dict[str, Any] = {"ServerApp": {"jpserver_extensions": {"lemonkit": True}}}
    if "limited_host" in request.fixturenames:
        config["LemonkitExtension"] = {"live_idle_timeout_ms": IDLE_MS, "live_max_body_bytes": MAX_BODY}
    return config


@pytest.fixture(scope="module")
def limited_standalone() -> Iterator[Standalone]:
    env = {"LEMONADE_API_KEY": API_KEY, "LEMONKIT_LIVE_MAX_BODY_BYTES": str(MAX_BODY)}
    server = Standalone(env, args=("--live-idle-timeout-ms", str(IDLE_MS)))
    yield server
    server.stop()


@pytest.fixture(params=["jupyter", "standalone"])
def limited_host(request: pytest.FixtureRequest) -> Host:
    """A host whose live bounds are :data:`IDLE_MS` and :data:`MAX_BODY` (traitlets in Jupyter; a flag and an
    environment variable standalone)."""
    if request.param == "jupyter":
        host: Host = request.getfixturevalue("jupyter_host")
        return host
    return Host("standalone", request.getfixturevalue("limited_standalone").root, API_KEY)


@pytest.mark.slow
async def test_a_body_over_the_bound_is_an_error_event(limited_host: Host) -> None:
    live = await LiveRequest.open(limited_host, {"model": MODEL})
    try:
        await live.send_audio(silence(3.0))  # 96 KB of PCM: the server stops reading past the bound
        events = await live.rest()
    finally:
        live.close()
    assert str(MAX_BODY) in _error(events, "body_too_large")["message"]


@pytest.mark.slow
async def test_a_stalled_body_is_an_error_event(limited_host: Host) -> None:
    live = await LiveRequest.open(limited_host, {"model": MODEL}, first=pcm16(silence(0.1)))
    try:
        events = await live.rest()  # nothing more is sent: the server stops waiting
    finally:
        live.close()
    assert str(IDLE_MS) in _error(events, "idle_timeout")["message"]


# -- refused before the stream starts: JSON errors with their status -----------------------------------------


async def _chunks(data: bytes) -> AsyncIterator[bytes]:
    yield data  # a body of unknown length: httpx sends it chunked


@pytest.mark.parametrize(
    ("query", "status", "code"),
    [
        ({}, 400, "missing_argument"),
        ({"model": MODEL, "sample_rate": 999}, 400, "invalid_argument"),
        ({"model": MODEL, "sample_rate": "fast"}, 400, "invalid_argument"),
        ({"model": MODEL, "channels": 17}, 400, "invalid_argument"),
        ({"model": MODEL, "sample_format": "u8"}, 400, "invalid_argument"),
        ({"model": TINY}, 400, "model_not_applicable"),
        ({"model": "no-such-model"}, 404, "model_not_found"),
    ],
)
async def test_bad_requests_are_json_errors(host: Host, query: dict[str, Any], status: int, code: str) -> None:
    async with host.client() as client:
        response = await client.post(PATH, params=query, content=_chunks(b"\0\0" * 1600))
    assert response.status_code == status, response.text
    assert response.json()["error"]["code"] == code


async def test_a_body_that_is_not_chunked_is_refused(host: Host) -> None:
    async with host.client() as client:
        response = await client.post(PATH, params={"model": MODEL}, content=b"\0\0" * 1600)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "not_chunked"


async def test_credentials_are_required(host: Host) -> None:
    async with httpx.AsyncClient(base_url=host.api + "/", timeout=30) as client:
        response = await client.post(PATH, params={"model": MODEL}, content=_chunks(b"\0\0"))
    assert response.status_code in (401, 403), response.text
    assert "error" in response.json()


@pytest.mark.parametrize(
    ("how", "needle"),
    [
        (["--live-idle-timeout-ms", "-1"], "must be 0 (no bound) or more, got -1"),
        (["--live-max-chunk-bytes", "0"], "max_chunk_bytes"),
        ({"LEMONKIT_LIVE_TOTAL_TIMEOUT_MS": "-5"}, "LEMONKIT_LIVE_TOTAL_TIMEOUT_MS"),
    ],
)
def test_a_bad_bound_stops_the_server_at_start(how: list[str] | dict[str, str], needle: str) -> None:
    args, env = (how, {}) if isinstance(how, list) else ([], how)
    result = subprocess.run(
        [sys.executable, "-m", "lemonkit.cli", "serve", "--port", "0", *args],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    assert needle in result.stderr and "Traceback" not in result.stderr, result.stderr


async def test_a_foreign_web_page_is_refused(standalone: Standalone) -> None:
    headers = {"Origin": "http://evil.example", "Authorization": f"Bearer {API_KEY}"}
    async with httpx.AsyncClient(base_url=standalone.root + "api/v1/", headers=headers, timeout=30) as client:
        response = await client.post(PATH, params={"model": MODEL}, content=_chunks(b"\0\0"))
    assert response.status_code == 403, response.text
    assert response.json()["error"]["code"] == "forbidden_origin"


@pytest.fixture(scope="module")
def deadline_standalone() -> Iterator[Standalone]:
    """A standalone server whose live bodies have a total deadline of :data:`IDLE_MS` and no idle bound."""
    env = {"LEMONADE_API_KEY": API_KEY, "LEMONKIT_LIVE_TOTAL_TIMEOUT_MS": str(IDLE_MS)}
    server = Standalone(env, args=("--live-idle-timeout-ms", "0"))
    yield server
    server.stop()


@pytest.mark.slow
async def test_a_body_past_the_total_deadline_is_an_error_event(deadline_standalone: Standalone) -> None:
    host = Host("standalone", deadline_standalone.root, API_KEY)
    live = await LiveRequest.open(host, {"model": MODEL}, first=pcm16(silence(0.1)))
    try:
        events = await live.rest()  # the body never ends: the deadline does
    finally:
        live.close()
    assert str(IDLE_MS) in _error(events, "total_timeout")["message"]


def _gone_client(host: Host) -> None:
    """One connection that pipelines ``GET health`` and a live request's head, then resets (RST) without reading:
    the server reads both, its answer to the first meets the reset, and the second is read from the buffer of a
    connection that is already closed."""
    url = urlsplit(f"{host.api}/{PATH}")
    auth = f"Authorization: Bearer {host.token}\r\n" if host.token else ""
    head = f"Host: {url.netloc}\r\n{auth}"
    health = f"GET {url.path.rsplit('/', 3)[0]}/health HTTP/1.1\r\n{head}\r\n"
    live = f"POST {url.path}?model={MODEL} HTTP/1.1\r\n{head}Transfer-Encoding: chunked\r\n\r\n"
    with socket.create_connection((url.hostname, url.port)) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.sendall((health + live).encode())


async def test_a_client_gone_before_the_body_is_read_is_no_500(
    host: Host, request: pytest.FixtureRequest, caplog: pytest.LogCaptureFixture
) -> None:
    """The route found the IOStream's socket gone (``None``) and answered 500 with an AttributeError."""
    caplog.set_level(logging.INFO)
    log: list[str] = request.getfixturevalue("standalone").log if host.kind == "standalone" else []
    start = len(log)

    def gone() -> int:  # the requests the server saw closed before it read them
        if host.kind == "standalone":  # its access log (warnings: every status from 400 on)
            return sum(f"499 POST {urlsplit(host.api).path}/{PATH}" in line for line in log[start:])
        return sum("closed the connection before the request was read" in r.getMessage() for r in caplog.records)

    def failed() -> list[str]:
        lines = [line for line in log[start:] if " 500 " in line or "Traceback" in line]
        return lines + [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]

    for _ in range(5):  # whether the reset reaches the server before or after it reads is the kernel's: try 5
        _gone_client(host)
    async with asyncio.timeout(WAIT):
        while gone() == 0 and not failed():
            await asyncio.sleep(0.05)
    async with host.client() as client:  # and the server serves on
        assert (await client.get("health")).status_code == 200
    assert failed() == []
