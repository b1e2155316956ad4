"""The ``remote`` recipe's pieces: its transport (path mapping, body rewrite, key, balancing, failover, error mapping)
against a real tiny Tornado upstream that injects faults, the operator's host policy, keys, and row validation."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from lemonkit.backends.remote import Endpoint, RemoteTransport, Upstream, check_hosts, host_allowed, map_error
from lemonkit.backends.remote import read_api_key as read_key
from lemonkit.catalog.config import RemoteSettings
from lemonkit.catalog.model_rows import parse_row
from lemonkit.catalog.recipe_table import DEFAULT_RECIPES
from lemonkit.catalog.registry import Registry
from lemonkit.catalog.support import SupportPolicy
from lemonkit.errors import Forbidden, ModelLoadError
from tests.support.fault_upstream import fault_upstream
from tests.support.llama_cpp_server import free_port

KEY = "sk-upstream-unit"


def _client(*urls: str, key: str | None = KEY) -> httpx.AsyncClient:
    transport = RemoteTransport("user.m", "up-model", [Endpoint(u) for u in urls], api_key=key)
    return Upstream(transport, timeout=30).client


async def test_paths_body_and_key_are_mapped() -> None:
    async with fault_upstream() as (root, seen), _client(f"{root}/ok/v1") as client:
        tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
        body = {"model": "user.m", "messages": [], "ctx_size": 4096, "route_trace": True, "tools": tools}
        answer = (await client.post("/v1/chat/completions", json=body)).json()
        assert answer["path"] == "/ok/v1/chat/completions"
        assert answer["echo"] == {"model": "up-model", "messages": [], "tools": tools}
        embed = await client.post("/v1/embeddings", json={"model": "user.m", "input": "x", "encoding_format": "base64"})
        assert embed.json() == {"echo": {"model": "up-model", "input": "x"}, "path": "/ok/v1/embeddings"}
        assert (await client.post("/v1/completions", json={"prompt": "a"})).json()["path"] == "/ok/v1/completions"
        assert (await client.post("/v1/rerank", json={"query": "a"})).json()["path"] == "/ok/v1/rerank"
        assert [r["auth"] for r in seen.requests] == [f"Bearer {KEY}"] * 4
        other = await client.post("/v1/audio/transcriptions", json={})
        assert other.status_code == 404 and other.json()["error"]["code"] == "not_supported_remotely"
        assert (await client.get("/stats")).json()["tokens_per_second"] is None


async def test_stream_passes_through_unchanged() -> None:
    async with fault_upstream() as (root, _), _client(f"{root}/stream/v1") as client:
        async with client.stream("POST", "/v1/chat/completions", json={"stream": True}) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            raw = b"".join([chunk async for chunk in response.aiter_raw()])
    assert raw == b'data: {"n": 0}\n\ndata: {"n": 1}\n\ndata: {"n": 2}\n\ndata: [DONE]\n\n'


async def test_a_cut_stream_raises_and_marks_its_endpoint_down() -> None:
    endpoint = Endpoint("")
    async with fault_upstream() as (root, _):
        endpoint.url = f"{root}/cut/v1"
        async with Upstream(RemoteTransport("user.m", "up-model", [endpoint]), timeout=30).client as client:
            async with client.stream("POST", "/v1/chat/completions", json={"stream": True}) as response:
                with pytest.raises(httpx.TransportError):
                    async for _ in response.aiter_raw():
                        pass
    assert endpoint.ok is False and "mid-answer" in (endpoint.last_error or "")


@pytest.mark.parametrize(
    ("mode", "status", "code", "text"),
    [
        ("e500", 502, "upstream_error", "boom: the engine crashed"),
        ("vllm", 400, "upstream_error", "bad things"),
        ("ollama", 404, "upstream_error", "model 'x' not found"),
        ("auth", 502, "upstream_auth_error", "Invalid API key"),
    ],
)
async def test_upstream_errors_take_lemonkits_shape(mode: str, status: int, code: str, text: str) -> None:
    async with fault_upstream() as (root, _), _client(f"{root}/{mode}/v1") as client:
        response = await client.post("/v1/chat/completions", json={"messages": []})
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "code"} and error["code"] == code and text in error["message"]


def test_balances_round_robin_failed_endpoints_last() -> None:
    a, b = Endpoint("http://a/v1"), Endpoint("http://b/v1")
    transport = RemoteTransport("user.m", "up-model", [a, b])
    assert [transport.order() for _ in range(3)] == [[a, b], [b, a], [a, b]]
    b.failed("ConnectError")
    assert [transport.order() for _ in range(2)] == [[a, b], [a, b]]


@pytest.mark.parametrize("fault", ["close", "e503", "refused"])
async def test_fails_over_before_the_first_byte(fault: str) -> None:
    async with fault_upstream() as (root, seen):
        bad = f"http://127.0.0.1:{free_port()}/v1" if fault == "refused" else f"{root}/{fault}/v1"
        endpoints = [Endpoint(bad), Endpoint(f"{root}/ok/v1")]
        transport = RemoteTransport("user.m", "up-model", endpoints)
        async with Upstream(transport, timeout=30).client as client:
            for _ in range(2):  # whichever endpoint round-robin tries first, the answer comes from the good one
                response = await client.post("/v1/chat/completions", json={"messages": []})
                assert response.status_code == 200 and response.json()["path"] == "/ok/v1/chat/completions"
    assert endpoints[0].health()["state"] == "down" and endpoints[0].health()["last_error"]
    assert endpoints[1].health() == {
        "url": f"{root}/ok/v1",
        "state": "ok",
        "last_error": None,
        "requests": 2,
        "failures": 0,
    }
    assert [r["mode"] for r in seen.requests].count("ok") == 2


async def test_an_upstream_that_never_answers_times_out_without_a_retry() -> None:
    async with fault_upstream() as (root, seen):
        endpoints = [Endpoint(f"{root}/hang/v1"), Endpoint(f"{root}/ok/v1")]
        async with Upstream(RemoteTransport("user.m", "up-model", endpoints), timeout=0.2).client as client:
            response = await client.post("/v1/chat/completions", json={"messages": []})
    assert response.status_code == 504 and response.json()["error"]["code"] == "upstream_timeout"
    assert [r["mode"] for r in seen.requests] == ["hang"]  # the request is not run a second time elsewhere
    assert endpoints[0].ok is False


async def test_all_down_is_a_clear_502() -> None:
    async with fault_upstream() as (root, _):
        urls = [f"{root}/close/v1", f"http://127.0.0.1:{free_port()}/v1"]
        async with _client(*urls) as client:
            response = await client.post("/v1/chat/completions", json={"messages": []})
    assert response.status_code == 502
    error = response.json()["error"]
    assert error["code"] == "upstream_unreachable" and all(url in error["message"] for url in urls)


async def test_probe_checks_the_listing() -> None:
    async with fault_upstream() as (root, _):
        transport = RemoteTransport("user.m", "up-model", [])
        ok, nolist, failing = Endpoint(f"{root}/ok/v1"), Endpoint(f"{root}/nolist/v1"), Endpoint(f"{root}/e500/v1")
        for endpoint in (ok, nolist, failing):
            await transport.probe(endpoint)
        other = RemoteTransport("user.m", "not-served", [])
        unlisted = Endpoint(f"{root}/ok/v1")
        await other.probe(unlisted)
        await transport.aclose()
        await other.aclose()
    assert (ok.ok, nolist.ok, failing.ok) == (True, True, False)
    assert unlisted.ok is False and "does not serve 'not-served'" in (unlisted.last_error or "")


def test_map_error_reads_each_upstreams_shape() -> None:
    assert map_error(400, b"plain words", "http://u/v1") == (
        400,
        {"error": {"message": "plain words", "type": "invalid_request_error", "code": "upstream_error"}},
    )
    status, body = map_error(422, json.dumps({"detail": [{"loc": ["body"], "msg": "bad"}]}).encode(), "http://u")
    assert status == 422 and "bad" in body["error"]["message"]
    status, body = map_error(429, b'{"error": {"message": "slow down", "type": "rate_limit", "code": "busy"}}', "u")
    assert (status, body["error"]) == (429, {"message": "slow down", "type": "rate_limit", "code": "busy"})
    status, body = map_error(503, b"", "http://u/v1")
    assert status == 502 and "http://u/v1" in body["error"]["message"]


def test_allowed_hosts() -> None:
    assert host_allowed("http://anything:1/v1", None)
    assert host_allowed("http://GPU1.Lab.example.com/v1", [".example.com"])
    assert host_allowed("http://10.0.0.5:8000/v1", ["10.0.0.5"])
    assert not host_allowed("http://example.com.evil.net/v1", [".example.com"])
    assert not host_allowed("http://10.0.0.6/v1", ["10.0.0.5"])
    assert not host_allowed("http://10.0.0.6/v1", [])
    with pytest.raises(Forbidden) as refused:
        check_hosts(["http://10.0.0.5/v1", "http://evil/v1"], RemoteSettings(allowed_hosts=("10.0.0.5",)))
    assert refused.value.status == 403 and refused.value.code == "remote_host_not_allowed"
    assert "http://evil/v1" in refused.value.message and "10.0.0.5/v1" not in refused.value.message


def test_keys_come_from_the_environment_or_the_secrets_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    as_json, as_dotenv = tmp_path / "secrets.json", tmp_path / "secrets.env"
    as_json.write_text(json.dumps({"VLLM_KEY": "from-json"}))
    as_dotenv.write_text('# keys\nexport VLLM_KEY="from-dotenv"\nOTHER=x\n')
    assert read_key("VLLM_KEY", RemoteSettings(secrets_file=as_json)) == "from-json"
    assert read_key("VLLM_KEY", RemoteSettings(secrets_file=as_dotenv)) == "from-dotenv"
    monkeypatch.setenv("VLLM_KEY", "from-env")
    assert read_key("VLLM_KEY", RemoteSettings(secrets_file=as_json)) == "from-env"
    with pytest.raises(ModelLoadError) as missing:
        read_key("NO_SUCH_KEY_VAR", RemoteSettings(secrets_file=as_json))
    assert "NO_SUCH_KEY_VAR" in missing.value.message and "from-" not in missing.value.message
    monkeypatch.setenv("VLLM_KEY", "sk-secret\r\nX-Injected: 1")
    with pytest.raises(ModelLoadError) as unsafe:
        read_key("VLLM_KEY", RemoteSettings())
    assert "VLLM_KEY" in unsafe.value.message and "sk-secret" not in unsafe.value.message


@pytest.mark.parametrize(
    ("row", "problem"),
    [
        ({"remote_urls": ["ftp://h/v1"]}, "http"),
        ({"remote_urls": ["http:///v1"]}, "host"),
        ({"remote_urls": ["http://user:pw@h/v1"]}, "credentials"),
        ({"remote_urls": ["http://h/v1?x=1"]}, "query"),
        ({"remote_urls": []}, "remote_urls"),
        ({"remote_urls": ["http://h/v1"], "api_key_env": "LEMONADE_API_KEY"}, "credential of this server"),
        ({"remote_urls": ["http://h/v1"], "api_key_env": "A-B"}, "api_key_env"),
        ({"remote_urls": ["http://h/v1"], "labels": ["transcription"]}, "does not serve"),
    ],
)
def test_bad_remote_rows_are_refused(row: dict[str, Any], problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        parse_row("user.r", {"recipe": "remote", "checkpoint": "m", **row}, user=True)


def test_a_remote_row() -> None:
    row = {"recipe": "remote", "checkpoint": "llama3.2:1b", "remote_urls": ["http://h:11434/v1/", "http://h:11434/v1"]}
    info = parse_row("user.r", {**row, "labels": ["embeddings"], "api_key_env": "OLLAMA_KEY"}, user=True)
    assert info.remote is not None and info.remote.urls == ("http://h:11434/v1",)
    assert (info.type, info.checkpoint, info.remote.api_key_env) == ("embedding", "llama3.2:1b", "OLLAMA_KEY")


def test_a_registered_remote_model_counts_as_downloaded_and_keeps_no_key(tmp_path: Path) -> None:
    registry = Registry(tmp_path)
    row = {"recipe": "remote", "checkpoint": "org/big", "remote_urls": ["http://h/v1"], "api_key_env": "BIG_KEY"}
    info = registry.register("user.big", row)
    assert registry.is_downloaded(info) and registry.model_files(info) == []
    assert SupportPolicy(DEFAULT_RECIPES, devices={"cpu": {"available": True}}).model(info, registry).supported
    obj = registry.model_object(info)
    assert (obj["downloaded"], obj["remote_urls"], obj["source"]) == (True, ["http://h/v1"], "remote")
    assert json.loads(registry.user_models_path.read_text()) == {"big": row}
