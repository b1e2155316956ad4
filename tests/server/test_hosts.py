"""Both hosts: mounts, prefixes, the error shape, status and model routes (credentials: test_security)."""

from __future__ import annotations

import contextlib
import gc
import os
import socket

import httpx
import pytest

from lemonkit.backends.llamacpp.kernels import patched_attention
from tests.support.hosts import Host
from tests.support.tiny_models import GEMMA, TINY

PREFIXES = ["api/v1/", "v1/", "api/v0/", "v0/"]


def _assert_error(response: httpx.Response, status: int, code: str | None) -> None:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "code"} and error["message"]
    if code is not None:
        assert error["code"] == code


async def test_live_is_open(host: Host) -> None:
    async with httpx.AsyncClient() as client:
        response = await client.get(host.root + "live")
        assert response.status_code == 200 and response.json() == {"status": "ok"}
        head = await client.head(host.root + "live")
        assert head.status_code == 200 and head.content == b""


@pytest.mark.parametrize("prefix", PREFIXES)
async def test_every_prefix_serves(host: Host, prefix: str) -> None:
    async with httpx.AsyncClient(base_url=host.root + prefix, headers=host.headers) as client:
        response = await client.get("health")
        assert response.status_code == 200 and response.json()["status"] == "ok"


async def test_unknown_route_is_json_404(host: Host) -> None:
    async with host.client() as client:
        _assert_error(await client.get("no/such/route"), 404, "not_found")


async def test_models_list_and_get(host: Host) -> None:
    async with host.client() as client:
        listed = (await client.get("models")).json()
        ids = {m["id"] for m in listed["data"]}
        assert TINY in ids and GEMMA in ids  # the bundled model counts as downloaded
        assert all(m["downloaded"] for m in listed["data"])
        everything = (await client.get("models", params={"show_all": "true"})).json()
        assert "Qwen3-0.6B-GGUF" in {m["id"] for m in everything["data"]}
        assert len(everything["data"]) > len(listed["data"])
        one = (await client.get(f"models/{TINY}")).json()
        for field in (
            "id",
            "created",
            "object",
            "owned_by",
            "checkpoint",
            "recipe",
            "downloaded",
            "labels",
            "checkpoints",
            "checkpoint_status",
            "source",
            "recipe_options",
            "suggested",
            "update_available",
            "components",
        ):
            assert field in one, field
        assert one["object"] == "model" and one["owned_by"] == "lemonade" and one["created"] == 1234567890
        assert "path" not in one["checkpoint_status"][0]
        with_paths = (await client.get(f"models/{TINY}", params={"include_paths": "true"})).json()
        assert with_paths["checkpoint_status"][0]["path"].endswith("tiny-llama.gguf")
        latest = (await client.get(f"models/{TINY}:latest")).json()
        assert latest["id"] == TINY
        _assert_error(await client.get("models/no-such-model"), 404, "model_not_found")
        head = await client.head("models")
        assert head.status_code == 200 and head.content == b""


async def test_load_health_unload(host: Host) -> None:
    async with host.client() as client:
        response = await client.post("load", json={"model_name": TINY, "ctx_size": 256})
        assert response.json() == {"status": "success", "message": f"Loaded model: {TINY}"}
        health = (await client.get("health")).json()
        (loaded,) = health["all_models_loaded"]
        assert loaded["model_name"] == TINY and loaded["recipe"] == "llamacpp" and loaded["type"] == "llm"
        assert loaded["recipe_options"]["ctx_size"] == 256 and loaded["pid"] > 0 and loaded["backend_url"]
        # the kernels it runs on: batch-invariant, with lemonkit's attention wherever the build has it (CI's does)
        assert loaded["batch_invariant"] is True
        assert loaded["invariant_attention"] is (True if os.environ.get("CI") else patched_attention())
        assert health["model_loaded"] == TINY and health["max_models"]["llm"] == -1
        model = (await client.get(f"models/{TINY}")).json()
        assert model["context_length"] == 256
        response = await client.post("unload", json={"model_name": TINY})
        assert response.json()["status"] == "success"
        assert (await client.get("health")).json()["all_models_loaded"] == []
        _assert_error(await client.post("unload", json={"model_name": TINY}), 404, "model_not_found")


async def test_stats_after_request(host: Host) -> None:
    async with host.client() as client:
        body = {"model": TINY, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0}
        result = (await client.post("chat/completions", json=body)).json()
        stats = (await client.get("stats")).json()
    assert stats["output_tokens"] == result["usage"]["completion_tokens"]
    assert stats["input_tokens"] <= stats["prompt_tokens"] == result["usage"]["prompt_tokens"]
    assert len(stats["decode_token_times"]) >= stats["output_tokens"] - 1
    assert stats["time_to_first_token"] > 0 and stats["tokens_per_second"] > 0
    # where it ran: lemonkit's own CPU build, no layer on a GPU
    assert (stats["backend"], stats["device"], stats["devices"], stats["gpu_layers"]) == ("cpu", "cpu", [], 0)


async def test_system_info(host: Host) -> None:
    async with host.client() as client:
        info = (await client.get("system-info")).json()
    assert info["OS Version"] and info["Processor"] and info["Physical Memory"].endswith("GB")
    assert info["devices"]["cpu"]["cores"] >= 1
    cpu = info["recipes"]["llamacpp"]["backends"]["cpu"]
    assert cpu["state"] == "installed" and cpu["version"]
    assert info["recipes"]["llamacpp"]["backends"]["metal"]["state"] == "unsupported"


def _server_end(client_addr: tuple[str, int]) -> socket.socket:
    """The in-process Jupyter server's socket of the connection whose client end is ``client_addr``."""
    for candidate in gc.get_objects():
        if isinstance(candidate, socket.socket) and candidate.fileno() >= 0 and candidate.type == socket.SOCK_STREAM:
            with contextlib.suppress(OSError):
                if candidate.getpeername()[:2] == client_addr[:2]:
                    return candidate
    raise AssertionError(f"no server socket for {client_addr}")


@pytest.mark.parametrize("route", ["chat/completions", "responses"])
async def test_a_stream_sends_each_event_at_once(jupyter_host: Host, route: str) -> None:
    """While a stream is open its connection has TCP_NODELAY: Nagle's algorithm would hold a small event back
    until the client acknowledged the one before, which a client may delay by 40 ms or more. A chat stream is
    handed to the sidecar, which writes it on the same socket, and the connection closes at its end; a Responses
    stream is relayed by the server, and afterwards its connection is back to the default, for the next request."""
    body = {"model": TINY, "max_tokens": 400, "stream": True, "messages": [{"role": "user", "content": "go"}]}
    if route == "responses":
        body = {"model": TINY, "max_output_tokens": 400, "stream": True, "input": "go"}
    async with jupyter_host.client() as client:
        async with client.stream("POST", route, json=body) as response:
            assert response.status_code == 200
            lines = response.aiter_lines()
            while not (await anext(lines)).startswith("data: {"):
                pass
            client_addr = response.extensions["network_stream"].get_extra_info("client_addr")
            server = _server_end(client_addr)
            assert server.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
            async for _ in lines:
                pass
        if route == "chat/completions":
            assert response.headers["connection"] == "close"
            return
        after = await client.get("health")  # the same connection, kept alive
        assert after.status_code == 200
        assert server.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 0
