"""The ``remote`` recipe against real upstreams on loopback: llama-cpp-python's own ``llama_cpp.server`` serving the
bundled SmolLM2, and a second ``lemonkit serve`` (with its own cache dir and key).

Registration, listing, chat and streaming run on both hosts; keys, allowed hosts, balancing and failover run on a
dedicated ``lemonkit serve`` (the "front") whose environment holds the upstream's key.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import TINY, Host, Standalone
from llama_cpp_server import MODEL_ID, LlamaCppServer

import lemonkit
from lemonkit.client import Client
from lemonkit.config import DEFAULT_CHAT_MODEL, DEFAULT_EMBEDDING_MODEL

pytestmark = pytest.mark.slow

UPSTREAM_KEY = "sk-upstream-remote-test-7f3a"
FRONT_KEY = "sk-front-remote-test"
HELLO = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def upstream() -> Iterator[LlamaCppServer]:
    server = LlamaCppServer()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def upstream_lemonkit() -> Iterator[Standalone]:
    """A second ``lemonkit serve``: its own cache dir, its key required."""
    cache = tempfile.mkdtemp(prefix="lemonkit-upstream-")
    server = Standalone({"LEMONADE_CACHE_DIR": cache, "LEMONADE_API_KEY": UPSTREAM_KEY})
    yield server
    server.stop()


@pytest.fixture(scope="module")
def front() -> Iterator[Standalone]:
    """The lemonkit under test for keys and policies: only 127.0.0.1 may be named; ``UPSTREAM_KEY`` holds the key."""
    cache = tempfile.mkdtemp(prefix="lemonkit-front-")
    env = {"LEMONADE_CACHE_DIR": cache, "LEMONADE_API_KEY": FRONT_KEY, "UPSTREAM_KEY": UPSTREAM_KEY}
    server = Standalone(env, args=("--remote-allowed-hosts", "127.0.0.1"))
    yield server
    server.stop()


def _front_host(front: Standalone) -> Host:
    return Host("standalone", front.root, FRONT_KEY)


def _remote(name: str, checkpoint: str, urls: list[str], **fields: Any) -> dict[str, Any]:
    body = {"model_name": name, "recipe": "remote", "checkpoint": checkpoint, **fields}
    return {**body, "remote_url": urls[0]} if len(urls) == 1 else {**body, "remote_urls": urls}


async def _register(client: httpx.AsyncClient, body: dict[str, Any]) -> None:
    response = await client.post("pull", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["status"] == "success"


async def _delete(client: httpx.AsyncClient, name: str) -> None:
    response = await client.post("delete", json={"model_name": name})
    assert response.status_code == 200, response.text


async def _sse(client: httpx.AsyncClient, body: dict[str, Any]) -> AsyncIterator[str]:
    async with client.stream("POST", "chat/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                yield line[len("data: ") :]


def _endpoints(health: dict[str, Any], name: str) -> list[dict[str, Any]]:
    entry = next(m for m in health["all_models_loaded"] if m["model_name"] == name)
    assert entry["recipe"] == "remote" and entry["pid"] is None
    endpoints: list[dict[str, Any]] = entry["endpoints"]
    return endpoints


async def test_register_list_chat_stream_and_errors(host: Host, upstream: LlamaCppServer) -> None:
    name = "user.remote-smol"
    async with host.client() as client:
        await _register(client, _remote(name, MODEL_ID, [upstream.url]))
        try:
            listed = (await client.get("models")).json()["data"]
            entry = next(m for m in listed if m["id"] == name)
            assert (entry["recipe"], entry["checkpoint"], entry["downloaded"]) == ("remote", MODEL_ID, True)
            assert entry["remote_urls"] == [upstream.url] and entry["labels"] == ["chat"] and entry["supported"]

            # a remote model takes no local slot: the local model loaded (max 1 per type) stays
            assert (await client.post("load", json={"model_name": TINY})).status_code == 200
            answer = await host.openai().chat.completions.create(model=name, messages=HELLO, max_tokens=8)  # type: ignore[arg-type]
            assert (answer.choices[0].message.content or "").strip()
            assert answer.usage is not None and answer.usage.completion_tokens > 0

            frames = [frame async for frame in _sse(client, {"model": name, "messages": HELLO, "max_tokens": 8})]
            assert frames[-1] == "[DONE]"
            chunks = [json.loads(frame) for frame in frames[:-1]]
            text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
            assert len(chunks) >= 3 and text.strip()

            too_long = {"model": name, "messages": [{"role": "user", "content": "word " * 3000}], "max_tokens": 4}
            refused = await client.post("chat/completions", json=too_long)
            assert refused.status_code == 400
            error = refused.json()["error"]
            assert set(error) == {"message", "type", "code"}
            assert error["code"] == "context_length_exceeded" and "maximum context length" in error["message"]

            response = await client.post("chat/completions", json={"model": name, "messages": HELLO, "max_tokens": 2})
            provenance = json.loads(response.headers["X-Lemonkit-Provenance"])
            assert (provenance["model"], provenance["recipe"], provenance["engine"]) == (name, "remote", "remote")

            health = (await client.get("health")).json()
            assert {m["model_name"] for m in health["all_models_loaded"]} == {TINY, name}
            endpoints = _endpoints(health, name)
            assert [(e["url"], e["state"]) for e in endpoints] == [(upstream.url, "ok")]
            assert endpoints[0]["requests"] == 4
        finally:
            await _delete(client, name)
        assert name not in [m["id"] for m in (await client.get("models")).json()["data"]]


async def test_python_api(front: Standalone, upstream: LlamaCppServer) -> None:
    name = "user.remote-python"

    def calls() -> None:
        with Client(front.root, token=FRONT_KEY) as client:
            model = lemonkit.pull(name, checkpoint=MODEL_ID, remote_url=upstream.url, progress=False, client=client)
            assert model["recipe"] == "remote" and model["downloaded"] is True
            try:
                result = client.chat("Say hello.", name, max_tokens=8)
                assert result.text.strip() and result.finish_reason in ("stop", "length")
                assert result.provenance["recipe"] == "remote"
                quiet = client.chat("Say hello.", name, stream=False, max_tokens=4)
                assert quiet.text.strip()
            finally:
                client.delete(name)

    await asyncio.to_thread(calls)


async def test_remote_lemonkit_with_a_key(front: Standalone, upstream_lemonkit: Standalone) -> None:
    """Another lemonkit upstream: chat and embeddings with the key from the front's environment, which never shows."""
    url = upstream_lemonkit.root + "api/v1"
    host = _front_host(front)
    async with host.client() as client:
        await _register(client, _remote("user.remote-lk-chat", DEFAULT_CHAT_MODEL, [url], api_key_env="UPSTREAM_KEY"))
        embed_body = _remote(
            "user.remote-lk-embed", DEFAULT_EMBEDDING_MODEL, [url], api_key_env="UPSTREAM_KEY", labels=["embeddings"]
        )
        await _register(client, embed_body)
        try:
            oai = host.openai()
            answer = await oai.chat.completions.create(model="user.remote-lk-chat", messages=HELLO, max_tokens=8)  # type: ignore[arg-type]
            assert (answer.choices[0].message.content or "").strip()
            vectors = await oai.embeddings.create(model="user.remote-lk-embed", input=["a cat", "a dog"])  # base64
            assert [len(v.embedding) for v in vectors.data] == [384, 384]
            floats = await client.post("embeddings", json={"model": "user.remote-lk-embed", "input": "a cat"})
            assert floats.json()["data"][0]["embedding"] == pytest.approx(vectors.data[0].embedding, abs=1e-5)

            seen = [
                (await client.get("models")).text,
                (await client.get("models/user.remote-lk-chat")).text,
                (await client.get("health")).text,
                Path(front.env["LEMONADE_CACHE_DIR"], "user_models.json").read_text(),
                "".join(front.log),
            ]
            assert all(UPSTREAM_KEY not in text for text in seen)
            assert "UPSTREAM_KEY" in seen[3]  # the variable's name is what the catalog keeps
        finally:
            await _delete(client, "user.remote-lk-chat")
            await _delete(client, "user.remote-lk-embed")


async def test_missing_or_wrong_key_fails_the_load_clearly(front: Standalone, upstream_lemonkit: Standalone) -> None:
    url = upstream_lemonkit.root + "api/v1"
    async with _front_host(front).client() as client:
        await _register(client, _remote("user.remote-nokey", DEFAULT_CHAT_MODEL, [url], api_key_env="NO_SUCH_KEY_VAR"))
        await _register(client, _remote("user.remote-keyless", DEFAULT_CHAT_MODEL, [url]))
        try:
            missing = await client.post("load", json={"model_name": "user.remote-nokey"})
            assert missing.status_code == 500
            error = missing.json()["error"]
            assert error["code"] == "model_load_error" and "NO_SUCH_KEY_VAR" in error["message"]

            chat = {"model": "user.remote-keyless", "messages": HELLO, "max_tokens": 4}
            refused = await client.post("chat/completions", json=chat)
            assert refused.status_code == 500
            error = refused.json()["error"]
            assert error["code"] == "model_load_error" and "401" in error["message"] and url in error["message"]
        finally:
            await _delete(client, "user.remote-nokey")
            await _delete(client, "user.remote-keyless")


async def test_operator_policy_refuses_hosts_and_bad_urls(front: Standalone) -> None:
    async with _front_host(front).client() as client:
        for url in ("http://localhost:8000/v1", "https://api.example.com/v1"):
            refused = await client.post("pull", json=_remote("user.remote-far", "m", [url]))
            assert refused.status_code == 403
            error = refused.json()["error"]
            assert error["code"] == "remote_host_not_allowed" and url in error["message"]
        mixed = await client.post(
            "pull", json=_remote("user.remote-far", "m", ["http://127.0.0.1:1/v1", "http://x/v1"])
        )
        assert mixed.status_code == 403
        for body, code in (
            (_remote("user.remote-bad", "m", ["ftp://127.0.0.1/v1"]), "invalid_argument"),
            (_remote("user.remote-bad", "m", ["http://k:secret@127.0.0.1/v1"]), "invalid_argument"),
            ({"model_name": "user.remote-bad", "recipe": "remote", "checkpoint": "m"}, "missing_argument"),
            (
                _remote("user.remote-bad", "m", ["http://127.0.0.1/v1"], api_key_env="LEMONADE_API_KEY"),
                "invalid_argument",
            ),
            ({**_remote("user.remote-bad", "m", ["http://127.0.0.1/v1"]), "recipe": "llamacpp"}, "invalid_argument"),
        ):
            response = await client.post("pull", json=body)
            assert (response.status_code, response.json()["error"]["code"]) == (400, code), response.text
        names = [m["id"] for m in (await client.get("models", params={"show_all": "true"})).json()["data"]]
        assert "user.remote-far" not in names and "user.remote-bad" not in names


async def test_balancing_failover_and_all_down(front: Standalone) -> None:
    name = "user.remote-pair"
    first, second = LlamaCppServer(), LlamaCppServer()
    try:
        async with _front_host(front).client() as client:
            await _register(client, _remote(name, MODEL_ID, [first.url, second.url]))
            try:
                body = {"model": name, "messages": HELLO, "max_tokens": 2}
                for _ in range(4):
                    assert (await client.post("chat/completions", json=body)).status_code == 200
                endpoints = _endpoints((await client.get("health")).json(), name)
                assert [(e["state"], e["requests"]) for e in endpoints] == [("ok", 2), ("ok", 2)]

                second.kill()
                for _ in range(4):
                    answer = await client.post("chat/completions", json=body)
                    assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"] is not None
                streamed = [frame async for frame in _sse(client, body)]
                assert streamed[-1] == "[DONE]"
                endpoints = _endpoints((await client.get("health")).json(), name)
                assert endpoints[0]["state"] == "ok" and endpoints[1]["state"] == "down"
                assert endpoints[1]["last_error"] and endpoints[1]["failures"] >= 1

                first.kill()
                down = await client.post("chat/completions", json=body)
                assert down.status_code == 502
                error = down.json()["error"]
                assert error["code"] == "upstream_unreachable"
                assert first.url in error["message"] and second.url in error["message"]

                assert (await client.post("unload", json={"model_name": name})).status_code == 200
                load = await client.post("load", json={"model_name": name})
                assert load.status_code == 500
                error = load.json()["error"]
                assert error["code"] == "model_load_error"
                assert first.url in error["message"] and second.url in error["message"]
            finally:
                await _delete(client, name)
    finally:
        first.stop()
        second.stop()
