"""Loading, eviction, concurrency, disconnects and sidecar crashes, on both hosts."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import httpx
from conftest import TINY, TINY_B, Host

CHAT = {"messages": [{"role": "user", "content": "go"}], "temperature": 0}


async def _health(client: httpx.AsyncClient) -> dict:
    return (await client.get("health")).json()


async def _stream_lines(response: httpx.Response) -> list[str]:
    return [line async for line in response.aiter_lines() if line]


async def test_lru_eviction_with_max_one(host: Host) -> None:
    async with host.client() as client:
        assert (await client.post("load", json={"model_name": TINY})).status_code == 200
        assert (await client.post("load", json={"model_name": TINY_B})).status_code == 200
        assert [m["model_name"] for m in (await _health(client))["all_models_loaded"]] == [TINY_B]
        # a request naming the evicted model loads it again, evicting the other
        response = await client.post("chat/completions", json={"model": TINY, "max_tokens": 2, **CHAT})
        assert response.status_code == 200
        assert [m["model_name"] for m in (await _health(client))["all_models_loaded"]] == [TINY]


async def test_pinned_model_is_never_evicted(host: Host) -> None:
    async with host.client() as client:
        assert (await client.post("load", json={"model_name": TINY, "pinned": True})).status_code == 200
        response = await client.post("load", json={"model_name": TINY_B})
        assert response.status_code == 409 and response.json()["error"]["code"] == "slots_pinned_error"
        assert [m["model_name"] for m in (await _health(client))["all_models_loaded"]] == [TINY]


async def test_concurrent_requests_all_complete(host: Host) -> None:
    async def one(client: httpx.AsyncClient, i: int) -> str:
        body = {
            "model": TINY,
            "max_tokens": 40,
            "stream": True,
            **CHAT,
            "messages": [{"role": "user", "content": f"request {i}"}],
        }
        async with client.stream("POST", "chat/completions", json=body) as response:
            assert response.status_code == 200
            lines = await _stream_lines(response)
        assert lines[-1] == "data: [DONE]"
        finals = [json.loads(line[6:]) for line in lines[:-1]]
        assert finals[-1]["choices"][0]["finish_reason"] in ("stop", "length")
        return "".join(c["choices"][0]["delta"].get("content") or "" for c in finals if c["choices"])

    async with host.client() as client:
        texts = await asyncio.gather(*(one(client, i) for i in range(4)))
        health = await _health(client)
    assert all(texts)
    assert len(health["all_models_loaded"]) == 1  # the four requests shared one load


async def test_sidecar_killed_mid_stream_then_recovers(host: Host) -> None:
    async with host.client() as client:
        await client.post("load", json={"model_name": TINY, "ctx_size": 4096})
        pid = (await _health(client))["all_models_loaded"][0]["pid"]
        body = {"model": TINY, "max_tokens": 4000, "stream": True, **CHAT}
        async with client.stream("POST", "chat/completions", json=body) as response:
            lines = response.aiter_lines()
            first = await anext(lines)
            assert first.startswith("data: {")
            os.kill(pid, signal.SIGKILL)
            rest = [line async for line in lines if line]
        assert "data: [DONE]" not in rest
        error = json.loads(rest[-1][6:])["error"]
        assert error["status_code"] == 502 and error["message"]
        # the server is still up and the next request reloads the model in a new sidecar
        response = await client.post("chat/completions", json={"model": TINY, "max_tokens": 2, **CHAT})
        assert response.status_code == 200
        assert (await _health(client))["all_models_loaded"][0]["pid"] != pid


async def test_client_disconnect_stops_generation(host: Host) -> None:
    async with host.client() as client:
        await client.post("load", json={"model_name": TINY, "ctx_size": 4096})
        body = {"model": TINY, "max_tokens": 4000, "stream": True, **CHAT}
        async with client.stream("POST", "chat/completions", json=body) as response:
            lines = response.aiter_lines()
            for _ in range(3):
                await anext(lines)
        # the engine serves one request at a time: this one starts only once the abandoned one has stopped
        follow = {"model": TINY, "max_tokens": 3000, "stream": True, **CHAT}
        async with client.stream("POST", "chat/completions", json=follow) as response:
            await anext(response.aiter_lines())
            stats = (await client.get("stats")).json()
    assert 0 < stats["output_tokens"] < 1000  # the abandoned request stopped long before its 4000 tokens
