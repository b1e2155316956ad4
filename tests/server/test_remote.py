"""The ``remote`` recipe against real upstreams on loopback: llama-cpp-python's own ``llama_cpp.server`` serving the
bundled SmolLM2, and a second ``lemonkit serve`` (with its own cache dir and key).

Registration, listing, chat and streaming run on both hosts; keys, allowed hosts, balancing and failover run on a
dedicated ``lemonkit serve`` (the "front") whose environment holds the upstream's key.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import lemonkit
from lemonkit.catalog.config import DEFAULT_CHAT_MODEL, DEFAULT_EMBEDDING_MODEL
from lemonkit.client import Client
from tests.support.fault_upstream import fault_upstream
from tests.support.hosts import Host, Standalone
from tests.support.llama_cpp_server import MODEL_ID, LlamaCppServer
from tests.support.tiny_models import TINY

pytestmark = pytest.mark.slow

UPSTREAM_KEY = "sk-upstream-remote-test-7f3a"
FRONT_KEY = "sk-front-remote-test"
HELLO = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def upstream_lemonkit(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Standalone]:
    """A second ``lemonkit serve``: its own cache dir, its key required."""
    cache = str(tmp_path_factory.mktemp("upstream"))
    server = Standalone({"LEMONADE_CACHE_DIR": cache, "LEMONADE_API_KEY": UPSTREAM_KEY})
    yield server
    server.stop()


@pytest.fixture(scope="module")
def front(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Standalone]:
    """The lemonkit under test for keys and policies: only 127.0.0.1 may be named; the upstream's key is in its
    environment (``UPSTREAM_KEY``) and in its secrets file (``FILE_KEY``)."""
    cache = str(tmp_path_factory.mktemp("front"))
    secrets = Path(cache, "secrets.env")
    secrets.write_text(f"# keys of remote upstreams\nFILE_KEY={UPSTREAM_KEY}\n")
    secrets.chmod(0o600)
    env = {"LEMONADE_CACHE_DIR": cache, "LEMONADE_API_KEY": FRONT_KEY, "UPSTREAM_KEY": UPSTREAM_KEY}
    server = Standalone(env, args=("--remote-allowed-hosts", "127.0.0.1", "--secrets-file", str(secrets)))
    yield server
    server.stop()


@pytest.fixture
def jp_server_config() -> dict[str, Any]:
    """The Jupyter host of this module allows remote models on 127.0.0.1 only (its traitlet)."""
    return {
        "ServerApp": {"jpserver_extensions": {"lemonkit": True}},
        "LemonkitExtension": {"remote_allowed_hosts": ["127.0.0.1"]},
    }


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

            completion = await client.post("completions", json={"model": name, "prompt": "One, two,", "max_tokens": 4})
            assert completion.status_code == 200 and completion.json()["choices"][0]["text"]
            reply = await client.post("responses", json={"model": name, "input": "Say hello.", "max_output_tokens": 8})
            assert reply.status_code == 200 and reply.json()["output"][-1]["content"][0]["text"].strip()

            health = (await client.get("health")).json()
            assert {m["model_name"] for m in health["all_models_loaded"]} == {TINY, name}
            endpoints = _endpoints(health, name)
            assert [(e["url"], e["state"]) for e in endpoints] == [(upstream.url, "ok")]
            assert endpoints[0]["requests"] == 6

            # registering it again (another spelling of the same upstream added) unloads it; its next use has both
            urls = [upstream.url, upstream.url.replace("127.0.0.1", "127.0.0.1.")]
            await _register(client, _remote(name, MODEL_ID, urls))
            assert name not in [m["model_name"] for m in (await client.get("health")).json()["all_models_loaded"]]
            assert (
                await client.post("chat/completions", json={"model": name, "messages": HELLO, "max_tokens": 2})
            ).status_code == 200
            endpoints = _endpoints((await client.get("health")).json(), name)
            assert [e["url"] for e in endpoints] == urls
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
        command = [sys.executable, "-m", "lemonkit.cli", "pull", "user.remote-cli", "--checkpoint", MODEL_ID]
        env = {**os.environ, "LEMONKIT_URL": front.root, "LEMONKIT_TOKEN": FRONT_KEY}
        urls = [upstream.url, upstream.url.replace("127.0.0.1", "127.0.0.1.")]  # one upstream, two spellings
        done = subprocess.run(
            [*command, "--remote-url", urls[0], "--remote-url", urls[1]], env=env, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
        with Client(front.root, token=FRONT_KEY) as client:
            try:
                assert client.model("user.remote-cli")["remote_urls"] == urls
            finally:
                client.delete("user.remote-cli")

    await asyncio.to_thread(calls)


async def test_remote_lemonkit_with_a_key(front: Standalone, upstream_lemonkit: Standalone) -> None:
    """Another lemonkit upstream: chat (its key from the front's environment) and embeddings (from its secrets
    file); the key never shows."""
    url = upstream_lemonkit.root + "api/v1"
    host = _front_host(front)
    async with host.client() as client:
        await _register(client, _remote("user.remote-lk-chat", DEFAULT_CHAT_MODEL, [url], api_key_env="UPSTREAM_KEY"))
        embed_body = _remote(
            "user.remote-lk-embed", DEFAULT_EMBEDDING_MODEL, [url], api_key_env="FILE_KEY", labels=["embeddings"]
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


async def test_a_stream_cut_mid_way_ends_with_an_error_and_the_model_stays(
    front: Standalone, upstream: LlamaCppServer
) -> None:
    name = "user.remote-cut"
    async with fault_upstream() as (root, seen), _front_host(front).client() as client:
        await _register(client, _remote(name, MODEL_ID, [f"{root}/cut/v1", upstream.url]))
        try:
            body = {"model": name, "messages": HELLO, "max_tokens": 8}
            frames = [frame async for frame in _sse(client, body)]  # round-robin starts with the cut endpoint
            assert [json.loads(f)["choices"][0]["delta"]["content"] for f in frames[:1]] == ["Hel"]
            assert len(frames) == 2 and json.loads(frames[1])["error"]["code"] == "backend_error"
            assert len(seen.requests) == 1 and seen.requests[0]["body"]["model"] == MODEL_ID

            again = [frame async for frame in _sse(client, body)]  # not replayed: the next request, elsewhere
            assert again[-1] == "[DONE]" and len(seen.requests) == 1
            endpoints = _endpoints((await client.get("health")).json(), name)
            assert endpoints[0]["state"] == "down" and "mid-answer" in endpoints[0]["last_error"]
            assert endpoints[1]["state"] == "ok"
        finally:
            await _delete(client, name)


async def test_jupyter_traitlet_limits_hosts(jupyter_host: Host) -> None:
    async with jupyter_host.client() as client:
        refused = await client.post("pull", json=_remote("user.remote-far", "m", ["http://localhost:8000/v1"]))
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "remote_host_not_allowed"
        assert "LemonkitExtension.remote_allowed_hosts" in refused.json()["error"]["message"]


async def test_a_client_that_leaves_closes_the_upstream_request(front: Standalone) -> None:
    name = "user.remote-drip"
    async with fault_upstream() as (root, seen), _front_host(front).client() as client:
        await _register(client, _remote(name, "up-model", [f"{root}/drip/v1"]))
        try:
            body = {"model": name, "messages": HELLO, "stream": True}
            async with client.stream("POST", "chat/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        break  # the first event arrived: leave mid-stream
            async with asyncio.timeout(60):  # a bound on a hang, not a wait for time to pass
                await seen.closed.wait()
            assert not seen.release.is_set() and len(seen.requests) == 1
        finally:
            await _delete(client, name)


async def test_tool_calls_pass_through(front: Standalone, upstream_lemonkit: Standalone) -> None:
    """A forced tool call made upstream comes back as the client's own ``tool_calls``, whole and streamed."""
    url = upstream_lemonkit.root + "api/v1"
    host = _front_host(front)
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
            },
        }
    ]
    asked = {
        "model": "user.remote-lk-tools",
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": tools,
        "tool_choice": "required",
        "max_tokens": 48,
    }
    async with host.client() as client:
        await _register(client, _remote("user.remote-lk-tools", DEFAULT_CHAT_MODEL, [url], api_key_env="UPSTREAM_KEY"))
        try:
            whole = await host.openai().chat.completions.create(**asked)
            choice = whole.choices[0]
            assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
            (call,) = choice.message.tool_calls
            assert call.function.name == "get_weather"
            assert isinstance(json.loads(call.function.arguments)["city"], str)

            pieces: list[dict[str, Any]] = []
            finish = None
            async for data in _sse(client, asked):
                if data == "[DONE]":
                    break
                delta = json.loads(data)["choices"][0]
                pieces += delta["delta"].get("tool_calls") or []
                finish = delta.get("finish_reason") or finish
            assert finish == "tool_calls"
            assert {p["function"]["name"] for p in pieces if p["function"].get("name")} == {"get_weather"}
            arguments = "".join(p["function"].get("arguments") or "" for p in pieces)
            assert isinstance(json.loads(arguments)["city"], str)
        finally:
            await _delete(client, "user.remote-lk-tools")
