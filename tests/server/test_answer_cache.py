"""The answer cache through both hosts: a deterministic request that asks for it (the ``cache`` field or the
``X-Lemonkit-Cache`` header) is answered the second time from the cache, bit-identical and marked; anything else is
never cached; ``/v1/cache`` tells and clears. The bound (least recently used first) in-process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from lemonkit.serving.answer_cache import AnswerCache, deterministic, key
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
