"""Ollama's API (``/api/...``) through the ``ollama`` library itself, on both hosts, with the generated tiny models.

The tiny chat model's weights are random: its text means nothing, but it is deterministic at temperature 0, so a
stream and a whole answer can be compared, and grammars (a JSON schema, a forced tool call) still shape it.
"""

from __future__ import annotations

import json
import math
from typing import Any

import httpx
import ollama
import pytest

from tests.support.hosts import Host
from tests.support.tiny_models import EMBED, TINY
from tests.support.waiting import until

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        # an enum: the random tiny model closes the call within a few tokens
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
            "required": ["city"],
        },
    },
}
GREEDY = {"temperature": 0, "num_predict": 8, "seed": 1}


def _client(host: Host) -> ollama.AsyncClient:
    return ollama.AsyncClient(host=host.root.rstrip("/"), headers=host.headers, timeout=120)


def _raw(host: Host) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=host.root + "api/", headers=host.headers, timeout=120)


async def _running(host: Host) -> list[str]:
    return [m.model for m in (await _client(host).ps()).models]


async def test_version_tags_and_show(host: Host) -> None:
    async with _raw(host) as raw:
        version = (await raw.get("version")).json()
        assert version["version"].count(".") == 2 and version["lemonkit"]
    client = _client(host)
    tags = {m.model: m for m in (await client.list()).models}
    tiny = tags[f"{TINY}:latest"]
    assert tiny.size and tiny.size > 0 and len(tiny.digest or "") == 64
    assert tiny.details is not None and (tiny.details.format, tiny.details.family) == ("gguf", "llama")
    assert f"{EMBED}:latest" in tags
    shown = await client.show(f"{TINY}:latest")
    assert shown.capabilities is not None and "completion" in shown.capabilities
    assert shown.modelinfo is not None and shown.modelinfo["general.architecture"] == "llama"
    assert shown.modelinfo["llama.context_length"] == 4096
    assert shown.parameters is not None and "num_ctx" in shown.parameters
    assert shown.template  # the GGUF's own chat template
    assert "embedding" in ((await client.show(EMBED)).capabilities or [])
    with pytest.raises(ollama.ResponseError) as missing:
        await client.show("no-such-model")
    assert missing.value.status_code == 404 and "no-such-model" in missing.value.error


async def test_chat_whole_and_streamed_agree(host: Host) -> None:
    client = _client(host)
    messages = [{"role": "user", "content": "Say something"}]
    whole = await client.chat(TINY, messages=messages, options=GREEDY)
    assert whole.done and whole.done_reason in ("stop", "length") and whole.message.role == "assistant"
    assert whole.message.content and 0 < (whole.eval_count or 0) <= 8 and (whole.prompt_eval_count or 0) > 0
    assert (whole.total_duration or 0) >= (whole.eval_duration or 0) > 0
    pieces = [part async for part in await client.chat(TINY, messages=messages, options=GREEDY, stream=True)]
    assert len(pieces) > 2 and pieces[-1].done and not any(p.done for p in pieces[:-1])
    assert "".join(p.message.content or "" for p in pieces) == whole.message.content
    assert pieces[-1].eval_count == whole.eval_count and pieces[-1].done_reason == whole.done_reason
    assert f"{TINY}:latest" in await _running(host)


async def test_chat_with_a_json_schema(host: Host) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    answer = await _client(host).chat(
        f"{TINY}:latest",
        messages=[{"role": "user", "content": "Is it ok? Answer in JSON."}],
        format=schema,
        options={"temperature": 0, "num_predict": 32},
    )
    assert isinstance(json.loads(answer.message.content or "")["ok"], bool)


async def test_a_forced_tool_call_whole_and_streamed(host: Host) -> None:
    async with _raw(host) as raw:
        body: dict[str, Any] = {
            "model": TINY,
            "messages": [{"role": "user", "content": "Weather in Paris?"}],
            "tools": [WEATHER],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},  # lemonkit's extension
            "options": {"temperature": 0, "num_predict": 48},
            "stream": False,
        }
        whole = (await raw.post("chat", json=body)).json()
        (call,) = whole["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather" and call["function"]["arguments"]["city"] in ("Paris", "Rome")
        assert call["id"]
        async with raw.stream("POST", "chat", json={**body, "stream": True}) as response:
            assert response.headers["content-type"].startswith("application/x-ndjson")
            lines = [json.loads(line) async for line in response.aiter_lines() if line]
    streamed = [c for line in lines for c in line["message"].get("tool_calls", [])]
    assert [c["function"] for c in streamed] == [call["function"]] and lines[-1]["done"]
    # the call goes back as history, with its result, and the model answers
    history = [
        *body["messages"],
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_name": "get_weather", "content": "18 degrees"},
    ]
    after = await _client(host).chat(TINY, messages=history, tools=[WEATHER], options=GREEDY)
    assert after.done and after.message.role == "assistant"


async def test_generate_raw_and_templated(host: Host) -> None:
    client = _client(host)
    templated = await client.generate(TINY, prompt="Once upon a time", options=GREEDY)
    assert templated.done and templated.response and (templated.eval_count or 0) > 0
    raw = await client.generate(TINY, prompt="Once upon a time", raw=True, options=GREEDY)
    assert raw.done and raw.response and raw.response != templated.response  # no chat template around it
    pieces = [p async for p in await client.generate(TINY, prompt="Once upon a time", options=GREEDY, stream=True)]
    assert "".join(p.response or "" for p in pieces) == templated.response and pieces[-1].done
    async with _raw(host) as http:
        refused = await http.post("generate", json={"model": TINY, "prompt": "x", "suffix": "y"})
    assert refused.status_code == 400 and "suffix" in refused.json()["error"]


async def test_load_keep_alive_and_unload(host: Host) -> None:
    client = _client(host)
    await client.generate(TINY, prompt="", keep_alive=-1)  # an empty prompt loads the model
    (running,) = (await client.ps()).models
    assert running.model == f"{TINY}:latest" and running.size and running.size > 0 and running.size_vram == 0
    assert running.expires_at is not None and running.expires_at.year > 2200  # until memory is needed
    await client.chat(TINY, messages=[{"role": "user", "content": "hi"}], options=GREEDY, keep_alive="10m")
    (running,) = (await client.ps()).models
    assert running.expires_at is not None and running.expires_at.year < 2200
    async with _raw(host) as raw:
        unloaded = (await raw.post("generate", json={"model": TINY, "keep_alive": 0})).json()
    assert unloaded["done"] and unloaded["done_reason"] == "unload"
    assert await _running(host) == []
    # keep_alive 0 on a request: the model goes once the answer is out
    await client.chat(TINY, messages=[{"role": "user", "content": "hi"}], options=GREEDY, keep_alive=0)

    async def gone() -> bool:
        return await _running(host) == []

    await until(gone, "the model to unload after keep_alive 0")


async def test_embed_and_the_older_embeddings(host: Host) -> None:
    client = _client(host)
    both = await client.embed(EMBED, input=["a red apple", "a green pear"])
    assert len(both.embeddings) == 2 and len(both.embeddings[0]) == len(both.embeddings[1]) > 8
    assert (both.prompt_eval_count or 0) > 0
    cut = await client.embed(EMBED, input="a red apple", dimensions=8)
    (vector,) = cut.embeddings
    assert len(vector) == 8 and math.isclose(math.fsum(v * v for v in vector), 1.0, rel_tol=1e-5)
    norm = math.sqrt(math.fsum(v * v for v in both.embeddings[0][:8]))
    assert vector == pytest.approx([v / norm for v in both.embeddings[0][:8]], rel=1e-4, abs=1e-6)
    older = await client.embeddings(EMBED, prompt="a red apple")
    assert list(older.embedding) == pytest.approx(both.embeddings[0], rel=1e-4, abs=1e-6)
    with pytest.raises(ollama.ResponseError) as wrong:
        await client.embed(TINY, input="x")
    assert wrong.value.status_code == 400


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        ({"messages": [{"role": "user", "content": "hi"}]}, 400, "model"),
        ({"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}, 404, "no-such-model"),
        ({"model": TINY, "messages": [{"role": "user", "content": "hi"}], "options": {"mirostat": 2}}, 400, "mirostat"),
        ({"model": TINY, "messages": [{"role": "user", "content": "hi"}], "options": {"num_gpu": 9}}, 400, "-ngl"),
        ({"model": TINY, "messages": [{"role": "user", "content": "hi"}], "keep_alive": "soon"}, 400, "keep_alive"),
        ({"model": TINY, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "role"),
        ({"model": TINY, "messages": [{"role": "user", "content": "hi"}], "format": "yaml"}, 400, "format"),
        ({"model": EMBED, "messages": [{"role": "user", "content": "hi"}]}, 400, "chat model"),
    ],
)
async def test_chat_errors_are_ollamas_shape(host: Host, body: dict[str, Any], status: int, words: str) -> None:
    async with _raw(host) as raw:
        response = await raw.post("chat", json=body)
    assert response.status_code == status and set(response.json()) == {"error"}
    assert words in response.json()["error"]


async def test_routes_without_an_equivalent_say_what_to_use(host: Host) -> None:
    async with _raw(host) as raw:
        for method, path in (("POST", "create"), ("POST", "copy"), ("POST", "push"), ("HEAD", "blobs/sha256:00")):
            response = await raw.request(method, path, json={"model": "x"} if method == "POST" else None)
            assert response.status_code == 501, (path, response.text)
            if method == "POST":
                assert "lemonkit" in response.json()["error"]


async def test_ollama_routes_need_the_same_credentials(host: Host) -> None:
    async with httpx.AsyncClient(base_url=host.root + "api/", timeout=60) as anonymous:
        response = await anonymous.get("tags")
    assert response.status_code in (401, 403)
