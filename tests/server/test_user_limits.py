"""Per-user limits on both personal hosts, through real HTTP (every request there is the owner's).

Each test gets a host with its own caches, configured with its limits (the Jupyter extension's ``user_*``
traitlets; ``lemonkit serve --user-*`` flags), and a model registered from the local test hub but not downloaded:
its first request downloads it, so a hub hold keeps that request under way for as long as the test needs.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import httpx
import numpy as np
import pytest
from tornado.httpclient import HTTPRequest
from tornado.websocket import WebSocketClientConnection, websocket_connect

from lemonkit.formats.audio_codec import pcm16
from tests.support.hosts import API_KEY, Host, Standalone
from tests.support.hub_server import HubServer
from tests.support.speech import SENTENCES, speech_samples, speech_wav, word_error_rate
from tests.support.waiting import until

PLAIN = "tiny-Q4_K_M.gguf"
WHISPER = "Whisper-Tiny-En-Bundled"
_ids = itertools.count()

pytestmark = pytest.mark.slow


@dataclass
class Env:
    host: Host
    hub: HubServer
    model: str

    def client(self) -> httpx.AsyncClient:
        return self.host.client()


@pytest.fixture
def user_limits() -> dict[str, int]:
    """The limits of the test's host (``max_active``, ``max_queued``, ``rate``); tests parametrize it."""
    return {}


@pytest.fixture
def jp_server_config(user_limits: dict[str, int]) -> dict[str, Any]:
    traitlets = {f"user_{name}": value for name, value in user_limits.items()}
    return {"ServerApp": {"jpserver_extensions": {"lemonkit": True}}, "LemonkitExtension": traitlets}


@pytest.fixture(params=["jupyter", "standalone"])
def env(
    request: pytest.FixtureRequest,
    user_limits: dict[str, int],
    module_hub: HubServer,
    repo_files: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> Iterator[Env]:
    """A host with ``user_limits`` whose one model is registered from the test hub, not yet downloaded."""
    n = f"{os.getpid() % 1000}-{next(_ids)}"
    repo = f"lemonkit/fair-{n}-GGUF"
    module_hub.add_repo(repo, repo_files)
    (tmp_path / "cache").mkdir()
    entry = {"checkpoint": f"{repo}:Q4_K_M", "recipe": "llamacpp", "labels": ["chat"]}
    (tmp_path / "cache" / "user_models.json").write_text(json.dumps({f"fair-{n}": entry}))
    variables = {
        "HF_ENDPOINT": module_hub.url,
        "HF_HUB_OFFLINE": "0",
        "LEMONADE_CACHE_DIR": str(tmp_path / "cache"),
        "HF_HUB_CACHE": str(tmp_path / "hub"),
        "LEMONKIT_UPDATE_CHECK_INTERVAL": "0",
    }
    module_hub.reset()
    if request.param == "jupyter":
        from huggingface_hub import constants

        for key, value in variables.items():
            monkeypatch.setenv(key, value)  # read when the extension makes its settings and registry
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        yield Env(request.getfixturevalue("jupyter_host"), module_hub, f"user.fair-{n}")
    else:
        flags = [arg for name, value in user_limits.items() for arg in ("--user-" + name.replace("_", "-"), str(value))]
        server = Standalone({**variables, "LEMONADE_API_KEY": API_KEY}, args=tuple(flags))
        try:
            yield Env(Host("standalone", server.root, API_KEY), module_hub, f"user.fair-{n}")
        finally:
            server.stop()
    module_hub.reset()


def completion(model: str) -> dict[str, Any]:
    return {"model": model, "prompt": "Once upon a time", "max_tokens": 2}


def assert_too_many(response: httpx.Response) -> int:
    """The spec's 429: the error shape, its code, and a whole number of seconds in ``Retry-After``."""
    assert response.status_code == 429, response.text
    assert response.headers["Content-Type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "code"} and error["message"]
    assert (error["type"], error["code"]) == ("rate_limit_error", "rate_limit_exceeded")
    retry_after = int(response.headers["Retry-After"])
    assert retry_after >= 1
    return retry_after


@pytest.mark.parametrize("user_limits", [{"max_active": 1}])
async def test_a_second_request_at_once_is_refused_with_retry_after(env: Env) -> None:
    env.hub.hold(at=100_000, path=PLAIN)  # the first request stays under way, downloading its model
    async with env.client() as client:
        first = asyncio.ensure_future(client.post("completions", json=completion(env.model)))

        async def held() -> bool:
            jobs = (await client.get("downloads")).json()
            return any(j["model_name"] == env.model and j["bytes_downloaded"] == 100_000 for j in jobs)

        await until(held, "the first request's download to reach the hold")
        assert_too_many(await client.post("completions", json=completion(env.model)))
        chat = {"model": env.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        assert_too_many(await client.post("chat/completions", json=chat))
        assert not first.done()
        env.hub.release()
        answer = await first
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["text"] is not None
        again = await client.post("completions", json=completion(env.model))  # nothing under way now
        assert again.status_code == 200, again.text


@pytest.mark.parametrize("user_limits", [{"rate": 12}])
async def test_the_rate_limit_answers_429_then_recovers(env: Env) -> None:
    async with env.client() as client:
        served = 0
        while True:  # a minute's worth (12) may come at once, then one every 5 s
            response = await client.post("completions", json=completion(env.model))
            if response.status_code != 200:
                break
            served += 1
            assert served <= 20, "the rate limit never answered"
        retry_after = assert_too_many(response)
        assert served >= 12 and retry_after <= 5
        assert (await client.get("health")).status_code == 200  # routes that run no model are not metered
        await asyncio.sleep(retry_after)  # what the answer asked for: then a token is there again
        recovered = await client.post("completions", json=completion(env.model))
        assert recovered.status_code == 200, recovered.text


async def _realtime(host: Host) -> WebSocketClientConnection:
    url = host.root.replace("http://", "ws://", 1) + "realtime?" + urlencode({"model": WHISPER})
    return await websocket_connect(HTTPRequest(url, headers=host.headers))


async def _next(ws: WebSocketClientConnection, kind: str) -> dict[str, Any]:
    """The next message, which must be of type ``kind``."""
    raw = await asyncio.wait_for(ws.read_message(), 180)  # a safety net against a hang, not a timing assertion
    assert raw is not None, "the server closed the connection"
    message: dict[str, Any] = json.loads(raw)
    assert message["type"] == kind, message
    return message


async def _say(ws: WebSocketClientConnection, text: str) -> str:
    """One utterance, committed by hand; its transcript."""
    samples = np.concatenate([speech_samples(text), np.zeros(16000 // 2, dtype=np.float32)])
    for start in range(0, len(samples), 1600):
        audio = base64.b64encode(pcm16(samples[start : start + 1600])).decode()
        await ws.write_message(json.dumps({"type": "input_audio_buffer.append", "audio": audio}))
    await ws.write_message(json.dumps({"type": "input_audio_buffer.commit"}))
    await _next(ws, "input_audio_buffer.committed")
    return str((await _next(ws, "conversation.item.input_audio_transcription.completed"))["transcript"])


@pytest.mark.parametrize("user_limits", [{"max_active": 1, "rate": 2}])
async def test_a_realtime_session_holds_no_turn_between_utterances(env: Env) -> None:
    ws = await _realtime(env.host)  # its start is one request of the rate
    try:
        await _next(ws, "session.created")
        await ws.write_message(json.dumps({"type": "session.update", "session": {"turn_detection": None}}))
        await _next(ws, "session.updated")
        assert word_error_rate(SENTENCES[0], await _say(ws, SENTENCES[0])) <= 0.2
        async with env.client() as client:
            # max_active is 1, yet the open session leaves room for another request between its utterances
            between = await client.post("completions", json=completion(env.model))
            assert between.status_code == 200, between.text
        # the rate (2 a minute) is spent: the session's start and that request. Utterances are not charged
        # (the session was, when it started), so this one is transcribed
        assert word_error_rate(SENTENCES[1], await _say(ws, SENTENCES[1])) <= 0.2
    finally:
        ws.close()


@pytest.mark.parametrize("user_limits", [{"max_active": 1}])
async def test_a_voice_chat_is_one_request(env: Env) -> None:
    """Its voice speaks while its reply is generated (three models in use, two at once), yet with max_active 1 it
    is served (that it is charged once toward the rate is tests/serving/test_fairness.py's)."""
    question = base64.b64encode(speech_wav("Tell me a story about a cat.")).decode()
    options = {"conversation.temperature": 0, "conversation.max_tokens": 60}
    body = {"recipe": "voice-chat", "stream": True, "request": {"audio_base64": question, "options": options}}
    async with env.client() as client:
        async with client.stream("POST", "recipes/run", json=body) as response:
            assert response.status_code == 200
            frames = [json.loads(line[6:]) async for line in response.aiter_lines() if line.startswith("data: {")]
        assert frames[-1]["type"] == "task.stream.done", frames[-1]
        assert frames[-1]["result"]["text"] and frames[-1]["result"]["audio"]
        events = [f["event"] for f in frames if f["type"] == "task.stream.event"]
        roles = [e["role"] for e in events if not e["is_final"]]
        reply_ends = max(i for i, role in enumerate(roles) if role == "conversation")
        assert "tts" in roles[:reply_ends], roles  # the voice spoke while the reply was being generated
        after = await client.post("completions", json=completion(env.model))  # the run is no longer under way
        assert after.status_code == 200, after.text


@pytest.mark.parametrize("user_limits", [{"max_active": 1}])
async def test_a_request_whose_client_leaves_frees_its_place(env: Env) -> None:
    env.hub.hold(at=100_000, path=PLAIN)
    async with env.client() as client:

        async def job(check: Callable[[dict[str, Any]], bool]) -> bool:
            jobs = (await client.get("downloads")).json()
            return any(j["model_name"] == env.model and check(j) for j in jobs)

        leaver = env.client()
        leaving = asyncio.ensure_future(leaver.post("completions", json=completion(env.model)))
        await until(lambda: job(lambda j: j["bytes_downloaded"] == 100_000), "the first request at the hold")
        assert_too_many(await client.post("completions", json=completion(env.model)))
        leaving.cancel()
        await asyncio.gather(leaving, return_exceptions=True)
        await leaver.aclose()  # its connection closes: the server sees the client go

        # nobody waits for the download any more: it stops (and leaves the list), as did the request waiting for it
        async def stopped() -> bool:
            return not await job(lambda j: True)

        await until(stopped, "the download to stop")
        env.hub.release()
        again = await client.post("completions", json=completion(env.model))
        assert again.status_code == 200, again.text
