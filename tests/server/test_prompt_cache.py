"""The prompt-prefix cache through both hosts: a request reuses the tokens its prompt shares with the model's
context, reports them (``timings.cache_n``, ``usage.prompt_tokens_details.cached_tokens``, ``/v1/stats``
``cache_tokens``), and greedy output does not change."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from lemonkit.catalog.config import DEFAULT_CHAT_MODEL
from tests.support.hosts import Host
from tests.support.session import HF_CACHE
from tests.support.tiny_models import TEST_REPO, TINY

GREEDY = {"temperature": 0, "seed": 7}


async def _post(client: httpx.AsyncClient, route: str, body: dict[str, Any]) -> dict[str, Any]:
    response = await client.post(route, json=body)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


async def _fresh(client: httpx.AsyncClient, model: str) -> None:
    """Unload ``model`` if loaded, so its next request starts from an empty context."""
    await client.post("unload", json={"model_name": model})  # 404 when not loaded: fine


async def _cached(client: httpx.AsyncClient, result: dict[str, Any]) -> int:
    """The reused prompt tokens of ``result``, checked against its timings and ``/v1/stats``."""
    cached = result["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert 0 <= cached <= result["usage"]["prompt_tokens"]
    assert result["timings"]["cache_n"] == cached
    assert result["timings"]["prompt_n"] == result["usage"]["prompt_tokens"] - cached
    stats = (await client.get("stats")).json()
    assert stats["cache_tokens"] == cached and stats["prompt_tokens"] == result["usage"]["prompt_tokens"]
    assert stats["input_tokens"] == stats["prompt_tokens"] - cached
    return int(cached)


async def _second_turn_reuses_first(client: httpx.AsyncClient, model: str, max_tokens: int) -> None:
    """Turn two repeats turn one's messages: it reuses them, and answers as a freshly loaded model does."""
    await _fresh(client, model)
    first = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
    one = await _post(client, "chat/completions", {"model": model, "messages": first, "max_tokens": 8, **GREEDY})
    assert await _cached(client, one) == 0  # nothing in a fresh context
    answer = one["choices"][0]["message"]["content"]
    second = [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": "Another one."}]
    body = {"model": model, "messages": second, "max_tokens": max_tokens, **GREEDY}
    two = await _post(client, "chat/completions", body)
    cached = await _cached(client, two)
    assert 0 < cached < two["usage"]["prompt_tokens"]
    # at least the system and first user turn were reused (the answer may render differently in the template)
    assert cached >= one["usage"]["prompt_tokens"] - 8

    await _fresh(client, model)
    again = await _post(client, "chat/completions", body)
    assert await _cached(client, again) == 0
    assert again["choices"][0]["message"]["content"] == two["choices"][0]["message"]["content"]
    assert again["usage"]["completion_tokens"] == two["usage"]["completion_tokens"]


def _tokens(text: str) -> list[int]:
    """TINY's tokens for a raw completion prompt, as the engine tokenizes it (BOS first when the model adds one)."""
    from llama_cpp import Llama

    path = next((HF_CACHE / f"models--{TEST_REPO.replace('/', '--')}").glob("snapshots/*/tiny-llama.gguf"))
    vocab = Llama(str(path), vocab_only=True, verbose=False)
    try:
        return list(vocab.tokenize(text.encode(), add_bos=bool(vocab._model.add_bos_token()), special=True))
    finally:
        vocab.close()


def _shared(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


async def test_tiny_second_turn_reuses_the_first(host: Host) -> None:
    async with host.client() as client:
        await _second_turn_reuses_first(client, TINY, max_tokens=12)


async def test_tiny_stream_reports_reuse_in_its_usage_chunk(host: Host) -> None:
    body = {"model": TINY, "messages": [{"role": "user", "content": "stream me " * 6}], "max_tokens": 6, **GREEDY}
    async with host.client() as client:
        await _fresh(client, TINY)
        whole = await _post(client, "chat/completions", body)
        stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
        chunks = [json.loads(c) for c in await _events(client, "chat/completions", stream)]
    usage, timings = chunks[-1]["usage"], chunks[-1]["timings"]
    assert usage["prompt_tokens"] == whole["usage"]["prompt_tokens"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == timings["cache_n"] == usage["prompt_tokens"] - 1
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == whole["choices"][0]["message"]["content"]


async def _events(client: httpx.AsyncClient, route: str, body: dict[str, Any]) -> list[str]:
    """The JSON payloads of a streamed answer's server-sent events."""
    events: list[str] = []
    async with client.stream("POST", route, json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                events.append(line[len("data: ") :])
    return events


async def test_tiny_unrelated_prompt_reuses_only_the_shared_prefix(host: Host) -> None:
    a, b = "alpha beta gamma delta epsilon", "zulu yankee xray whiskey victor"
    expected = _shared(_tokens(a), _tokens(b))  # BOS, if the model adds one
    async with host.client() as client:
        await _fresh(client, TINY)
        # one slot: with more, an unrelated prompt goes to a free slot rather than share a token with a cached one
        load = {"model_name": TINY, "llamacpp_args": "--parallel 1"}
        assert (await client.post("load", json=load)).status_code == 200
        first = await _post(client, "completions", {"model": TINY, "prompt": a, "max_tokens": 4, **GREEDY})
        assert await _cached(client, first) == 0
        assert first["usage"]["prompt_tokens"] == len(_tokens(a))
        stream = {"model": TINY, "prompt": b, "max_tokens": 4, "stream": True, **GREEDY}
        stream["stream_options"] = {"include_usage": True}
        last = json.loads((await _events(client, "completions", stream))[-1])
        assert last["usage"]["prompt_tokens_details"]["cached_tokens"] == expected
        assert last["timings"]["cache_n"] == expected
        assert (await client.get("stats")).json()["cache_tokens"] == expected


async def test_responses_api_reports_cached_input_tokens(host: Host) -> None:
    async with host.client() as client:
        await _fresh(client, TINY)
        body = {"model": TINY, "input": "the cache test " * 8, "max_output_tokens": 4, **GREEDY}
        await _post(client, "responses", body)
        again = await _post(client, "responses", body)
        events = [json.loads(e) for e in await _events(client, "responses", {**body, "stream": True})]
    usage = again["usage"]
    assert usage["input_tokens_details"]["cached_tokens"] == usage["input_tokens"] - 1  # one re-evaluated for logits
    (done,) = [e for e in events if e["type"] == "response.completed"]
    assert done["response"]["usage"]["input_tokens_details"] == usage["input_tokens_details"]


@pytest.mark.slow
async def test_bundled_chat_model_second_turn_reuses_the_first(host: Host) -> None:
    async with host.client() as client:
        await _second_turn_reuses_first(client, DEFAULT_CHAT_MODEL, max_tokens=24)
        await _fresh(client, DEFAULT_CHAT_MODEL)


async def test_cache_prompt_false_evaluates_the_whole_prompt(host: Host) -> None:
    body = {"model": TINY, "messages": [{"role": "user", "content": "again " * 6}], "max_tokens": 6, **GREEDY}
    async with host.client() as client:
        await _fresh(client, TINY)
        first = await _post(client, "chat/completions", body)
        cached = await _post(client, "chat/completions", body)
        assert await _cached(client, cached) == cached["usage"]["prompt_tokens"] - 1
        whole = await _post(client, "chat/completions", {**body, "cache_prompt": False})  # what replay sends
        assert await _cached(client, whole) == 0
        assert whole["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
        refused = await client.post("chat/completions", json={**body, "cache_prompt": "no"})
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "invalid_argument"


async def _alternate(client: httpx.AsyncClient, llamacpp_args: str, a1: str, b: str, a2: str) -> dict[str, Any]:
    """Load TINY with one slot and ``llamacpp_args``, complete ``a1``, ``b``, then ``a2``; the last answer."""
    await _fresh(client, TINY)
    load = {"model_name": TINY, "llamacpp_args": f"--parallel 1 {llamacpp_args}"}
    assert (await client.post("load", json=load)).status_code == 200
    for prompt in (a1, b):
        await _post(client, "completions", {"model": TINY, "prompt": prompt, "max_tokens": 4, **GREEDY})
    return await _post(client, "completions", {"model": TINY, "prompt": a2, "max_tokens": 8, **GREEDY})


async def test_two_contexts_alternated_in_one_slot_reuse_their_prefix_from_ram(host: Host) -> None:
    """With ``--cache-ram`` a prompt another one displaces from the slot waits in host memory: the first context,
    asked again after the second, reuses its shared prefix, and answers as it does without the cache."""
    a = "alpha beta gamma delta epsilon zeta eta theta iota kappa " * 4
    b = "zulu yankee xray whiskey victor uniform tango sierra romeo " * 4
    a1, a2 = a + "lambda", a + "omicron"
    shared = _shared(_tokens(a1), _tokens(a2))
    assert shared > _shared(_tokens(b), _tokens(a2)) + 20  # the test means something only if the prefix is long
    async with host.client() as client:
        cached = await _alternate(client, "--cache-ram 16", a1, b, a2)
        assert await _cached(client, cached) == min(shared, cached["usage"]["prompt_tokens"] - 1)
        plain = await _alternate(client, "", a1, b, a2)
        assert await _cached(client, plain) == _shared(_tokens(b), _tokens(a2))  # the slot held b only
        await _fresh(client, TINY)
    assert cached["choices"][0]["text"] == plain["choices"][0]["text"]
    assert cached["usage"]["completion_tokens"] == plain["usage"]["completion_tokens"]
