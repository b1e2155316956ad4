"""The answer cache through both hosts: a deterministic request that asks for it (the ``cache`` field or the
``X-Lemonkit-Cache`` header) is answered the second time from the cache, bit-identical and marked; anything else is
never cached; ``/v1/cache`` tells and clears. The bound (least recently used first) in-process."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from lemonkit.serving.answer_cache import AnswerCache, deterministic, kept_stream, key, replayed_stream
from tests.support.hosts import Host
from tests.support.tiny_models import EMBED, TINY

CHAT = {"model": TINY, "messages": [{"role": "user", "content": "Name a fruit."}], "max_tokens": 8}


async def _post(client: httpx.AsyncClient, route: str, body: dict[str, Any], **headers: str) -> httpx.Response:
    response = await client.post(route, json=body, headers=headers)
    assert response.status_code == 200, response.text
    return response


async def test_a_deterministic_request_is_answered_from_the_cache(host: Host) -> None:
    async with host.client() as client:
        assert (await client.delete("cache")).status_code == 200
        body = {**CHAT, "temperature": 0, "cache": True}
        first = await _post(client, "chat/completions", body)
        assert first.headers["X-Lemonkit-Cache"] == "miss"
        second = await _post(client, "chat/completions", body)
        assert second.headers["X-Lemonkit-Cache"] == "hit"
        assert second.headers["X-Lemonkit-Provenance"] == first.headers["X-Lemonkit-Provenance"]
        hit = second.json()
        assert hit["usage"].pop("cached_answer") is True
        assert hit == first.json()  # the first answer, id and timings included

        info = (await client.get("cache")).json()
        assert info["object"] == "answer_cache" and info["entries"] == 1 and info["hits"] >= 1
        assert 0 < info["bytes"] <= info["max_bytes"]

        # the same request with another seed, sampling or stream: not the cached answer
        seeded = await _post(client, "chat/completions", {**CHAT, "seed": 3, "cache": True})
        assert seeded.headers["X-Lemonkit-Cache"] == "miss"
        unseeded = await _post(client, "chat/completions", {**CHAT, "temperature": 0.9, "cache": True})
        assert "X-Lemonkit-Cache" not in unseeded.headers  # sampled without a seed: never cached
        not_asked = await _post(client, "chat/completions", {**CHAT, "temperature": 0})
        assert "X-Lemonkit-Cache" not in not_asked.headers
        assert not_asked.json()["choices"] == first.json()["choices"]

        # the header, for a client that cannot add a field (the openai SDK's extra_headers)
        by_header = await _post(client, "chat/completions", {**CHAT, "temperature": 0}, **{"X-Lemonkit-Cache": "use"})
        assert by_header.headers["X-Lemonkit-Cache"] == "hit"

        cleared = (await client.delete("cache")).json()
        assert cleared["deleted"] == 2
        assert (await client.get("cache")).json()["entries"] == 0
        assert (await _post(client, "chat/completions", body)).headers["X-Lemonkit-Cache"] == "miss"

        bad = await client.post("chat/completions", json={**CHAT, "cache": "yes"})
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_argument"


def _events(response: httpx.Response) -> list[dict[str, Any]]:
    return [json.loads(line[len("data: ") :]) for line in response.text.split("\n") if line.startswith("data: {")]


async def test_a_stream_is_kept_and_replayed_as_the_same_events(host: Host) -> None:
    async with host.client() as client:
        assert (await client.delete("cache")).status_code == 200
        body = {**CHAT, "temperature": 0, "cache": True, "stream": True, "stream_options": {"include_usage": True}}
        first = await _post(client, "chat/completions", body)
        assert first.headers["X-Lemonkit-Cache"] == "miss"
        second = await _post(client, "chat/completions", body)
        assert second.headers["X-Lemonkit-Cache"] == "hit"
        assert second.headers["Content-Type"].startswith("text/event-stream")
        assert second.text.endswith("data: [DONE]\n\n") and ": ping" not in second.text
        kept, replayed = _events(first), _events(second)
        assert len(kept) >= 3 and replayed[-1]["usage"].pop("cached_answer") is True
        assert replayed == kept  # the first stream's events, ids and timings included
        streamed = "".join(e["choices"][0]["delta"].get("content") or "" for e in kept if e["choices"])
        assert streamed

        # a stream and a whole answer are kept apart, and include_usage is part of the request
        whole = await _post(client, "chat/completions", {**CHAT, "temperature": 0, "cache": True})
        assert whole.headers["X-Lemonkit-Cache"] == "miss"
        assert whole.json()["choices"][0]["message"]["content"] == streamed
        without_usage = await _post(client, "chat/completions", {**body, "stream_options": {"include_usage": False}})
        assert without_usage.headers["X-Lemonkit-Cache"] == "miss"
        assert all(e.get("usage") is None for e in _events(without_usage))
        assert (await client.get("cache")).json()["entries"] == 3

    # the openai SDK reads a replayed stream as any other, on the chat and the Responses routes
    sdk = host.openai()
    texts = []
    for expected in ("miss", "hit"):
        raw = await sdk.chat.completions.with_raw_response.create(
            model=TINY, messages=CHAT["messages"], max_tokens=8, temperature=0, stream=True, extra_body={"cache": True}
        )
        assert raw.headers["X-Lemonkit-Cache"] == expected
        texts.append("".join([c.choices[0].delta.content or "" async for c in raw.parse() if c.choices]))
    assert texts == [streamed, streamed]
    replies = []
    for expected in ("miss", "hit"):
        raw = await sdk.responses.with_raw_response.create(
            model=TINY,
            input="Name a fruit.",
            max_output_tokens=8,
            temperature=0,
            stream=True,
            extra_body={"cache": True},
        )
        assert raw.headers["X-Lemonkit-Cache"] == expected
        events = [e async for e in raw.parse()]
        done = [e for e in events if e.type == "response.completed"]
        assert len(done) == 1 and events[0].type == "response.created"
        replies.append((done[0].response.id, done[0].response.output_text))
    assert replies[0] == replies[1] and replies[0][1]


def test_only_a_whole_stream_is_kept_and_its_usage_is_marked_when_replayed() -> None:
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    chunk = b'data: {"choices": [{"delta": {"content": "hi"}}]}\n\n'
    whole = (
        chunk
        + b": ping\n\n"
        + b"data: "
        + json.dumps({"choices": [], "usage": usage}).encode()
        + b"\n\ndata: [DONE]\n\n"
    )
    kept = kept_stream(whole)
    assert kept is not None and b"ping" not in kept and kept.endswith(b"data: [DONE]\n\n")
    assert kept_stream(chunk) is None  # cut short
    assert kept_stream(chunk + b'data: {"error": {"message": "x"}}\n\ndata: [DONE]\n\n') is None
    replayed = replayed_stream(kept)
    assert replayed.startswith(chunk)
    assert json.loads(replayed.split(b"\n\n")[1][len(b"data: ") :])["usage"] == {**usage, "cached_answer": True}
    completed = b"event: response.completed\ndata: " + json.dumps({"response": {"id": "r", "usage": usage}}).encode()
    marked = replayed_stream(completed + b"\n\n").split(b"\n")
    assert marked[0] == b"event: response.completed"
    assert json.loads(marked[1][len(b"data: ") :])["response"]["usage"]["cached_answer"] is True


async def test_embeddings_are_cached_whatever_their_fields(host: Host) -> None:
    async with host.client() as raw:
        assert (await raw.delete("cache")).status_code == 200  # both hosts share the session's cache
    client = host.openai()
    first = await client.embeddings.with_raw_response.create(model=EMBED, input="cache me", extra_body={"cache": True})
    second = await client.embeddings.with_raw_response.create(model=EMBED, input="cache me", extra_body={"cache": True})
    assert (first.headers["X-Lemonkit-Cache"], second.headers["X-Lemonkit-Cache"]) == ("miss", "hit")
    assert second.parse().data[0].embedding == first.parse().data[0].embedding


def test_deterministic_requests() -> None:
    assert deterministic({"temperature": 0})
    assert deterministic({"temperature": 1.2, "seed": 4})
    assert not deterministic({"temperature": 0.7})
    assert not deterministic({})
    assert not deterministic({"seed": True})
    assert deterministic({}, samples=False)


def test_the_key_is_what_decides_the_answer() -> None:
    model = {"model": "m", "file_sha256": "a" * 64, "revision": "r", "recipe_options": {"ctx_size": 512}, "engine": "e"}
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": 0}
    base = key("chat/completions", model, body)
    assert key("chat/completions", model, {**body, "stream": False, "user": "u", "cache": True}) == base
    assert key("chat/completions", model, dict(reversed(list(body.items())))) == base
    assert key("completions", model, body) != base
    assert key("chat/completions", {**model, "file_sha256": "b" * 64}, body) != base
    assert key("chat/completions", {**model, "recipe_options": {"ctx_size": 1024}}, body) != base
    assert key("chat/completions", model, {**body, "seed": 1}) != base
    streamed = key("chat/completions", model, {**body, "stream": True})
    assert streamed != base  # a stream is kept as its events, apart from the whole answer
    assert (
        key("chat/completions", model, {**body, "stream": True, "stream_options": {"include_usage": True}}) != streamed
    )


def test_the_bound_drops_the_least_recently_used(tmp_path: Path) -> None:
    cache = AnswerCache(tmp_path, max_bytes=300)
    answers = {name: (name * 100).encode() for name in "abcd"}  # 100 bytes each
    for name in "abc":
        cache.put("u", name * 64, answers[name])
    assert cache.get("u", "a" * 64) == answers["a"]  # a is now the most recent
    cache.put("u", "d" * 64, answers["d"])  # over the bound: b goes
    assert cache.get("u", "b" * 64) is None
    assert [cache.get("u", n * 64) for n in "acd"] == [answers[n] for n in "acd"]
    assert cache.info("u")["bytes"] == 300 and cache.info("u")["entries"] == 3
    assert cache.get("v", "a" * 64) is None  # each user has their own
    restarted = AnswerCache(tmp_path, max_bytes=300)  # the index is read back from disk
    assert restarted.info("u")["entries"] == 3 and restarted.get("u", "c" * 64) == answers["c"]
    assert AnswerCache(tmp_path, max_bytes=0).enabled is False
    with pytest.raises(ValueError):
        cache.get("u", "../../x")


async def test_the_python_api_tells_and_clears_the_cache(host: Host) -> None:
    import asyncio

    from lemonkit.client import Client

    def calls() -> None:
        with Client(host.root, token=host.token) as client:
            client.cache_clear()
            client.chat("Say one word.", model=TINY, temperature=0, max_tokens=4, stream=False, cache=True)
            info = client.cache_info()
            assert info["entries"] == 1 and info["bytes"] > 0
            assert client.cache_clear()["deleted"] == 1
            assert client.cache_info()["entries"] == 0

    await asyncio.to_thread(calls)
