"""OpenAI and llama-server request fields that shape generation: ``n``, ``best_of``, ``logit_bias``,
``parallel_tool_calls``, ``chat_template_kwargs``, ``grammar`` and ``suffix``, through real HTTP on both hosts."""

from __future__ import annotations

import json

import httpx

from tests.support.hosts import Host
from tests.support.streams import sse_events
from tests.support.tiny_models import TINY

HELLO = [{"role": "user", "content": "hello"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def _literal(text: str) -> str:
    """A GBNF grammar that admits exactly ``text``."""
    return "root ::= " + json.dumps(text)


async def test_chat_n_choices(host: Host) -> None:
    body = {"model": TINY, "messages": HELLO, "n": 3, "max_tokens": 6, "temperature": 1.0, "seed": 11}
    async with host.client() as client:
        whole = (await client.post("chat/completions", json=body)).json()
        assert [c["index"] for c in whole["choices"]] == [0, 1, 2]
        texts = [c["message"]["content"] for c in whole["choices"]]
        assert all(texts) and len(set(texts)) > 1  # three samples, seeds one apart
        assert whole["usage"]["completion_tokens"] <= 18
        assert whole["usage"]["completion_tokens"] > 6  # all three choices counted
        # streamed, each choice has its role, its deltas and its finish; the same seeds give the same texts
        chunks = await sse_events(client, "chat/completions", body)
        streamed = ["", "", ""]
        finished = set()
        roles = set()
        for chunk in chunks:
            for choice in chunk["choices"]:
                delta = choice["delta"]
                if delta.get("role") == "assistant":
                    roles.add(choice["index"])
                streamed[choice["index"]] += delta.get("content") or ""
                if choice["finish_reason"]:
                    finished.add(choice["index"])
        assert roles == finished == {0, 1, 2}
        assert streamed == texts
        bad = await client.post("chat/completions", json={**body, "n": 0})
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_argument"


async def test_completions_n_and_best_of(host: Host) -> None:
    base = {"model": TINY, "prompt": ["the", "hello"], "max_tokens": 5, "temperature": 1.0, "seed": 3}
    async with host.client() as client:
        two = (await client.post("completions", json={**base, "n": 2})).json()
        assert [c["index"] for c in two["choices"]] == [0, 1, 2, 3]  # prompt by prompt, n each
        best = (await client.post("completions", json={**base, "best_of": 3})).json()
        assert [c["index"] for c in best["choices"]] == [0, 1]
        assert all(c["logprobs"] is None for c in best["choices"])  # scored by logprobs, not asked for
        # each best one is the top-scoring of its prompt's three candidates (the n=3 run has the same seeds)
        three = (await client.post("completions", json={**base, "n": 3, "logprobs": 0})).json()
        for p in range(2):
            group = three["choices"][3 * p : 3 * p + 3]
            scores = [sum(c["logprobs"]["token_logprobs"]) / len(c["logprobs"]["token_logprobs"]) for c in group]
            assert best["choices"][p]["text"] == group[scores.index(max(scores))]["text"]
        for bad in ({"n": 3, "best_of": 2}, {"best_of": 2, "stream": True}, {"n": 99}):
            response = await client.post("completions", json={**base, **bad})
            assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_argument"


async def _token_id(client: httpx.AsyncClient, piece: str) -> int:
    """The id of the token whose text is ``piece`` (SPM adds a space to a text's start: try it in context)."""
    for content in (piece, "x" + piece, " " + piece):
        body = {"model": TINY, "content": content, "with_pieces": True}
        tokens = (await client.post("tokenize", json=body)).json()["tokens"]
        for token in tokens:
            if token["piece"] == piece:
                return int(token["id"])
    raise AssertionError(f"no token is {piece!r}")


async def test_logit_bias(host: Host) -> None:
    body = {"model": TINY, "messages": HELLO, "max_tokens": 4, "temperature": 0, "logprobs": True}
    async with host.client() as client:
        world, the = await _token_id(client, " world"), await _token_id(client, " the")

        async def tokens(bias: object) -> list[str]:
            answer = (await client.post("chat/completions", json={**body, "logit_bias": bias})).json()
            return [t["token"] for t in answer["choices"][0]["logprobs"]["content"]]

        assert await tokens({str(world): 100}) == [" world"] * 4
        assert await tokens({str(world): 100, str(the): 50}) == [" world"] * 4
        assert await tokens({str(world): -100, str(the): 50}) == [" the"] * 4  # -100 bans it
        assert await tokens([[world, False], [the, 50]]) == [" the"] * 4  # llama-server's list form
        for bad in ({"99999999": 1}, {"x": 1}, {"5": 101}, [1, 2]):
            response = await client.post("chat/completions", json={**body, "logit_bias": bad})
            assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_argument"


async def test_parallel_tool_calls_and_grammar(host: Host) -> None:
    two_calls = (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    )
    body = {
        "model": TINY,
        "messages": HELLO,
        "tools": [WEATHER],
        "grammar": _literal(two_calls),
        "max_tokens": 200,
        "temperature": 0,
    }
    async with host.client() as client:
        both = (await client.post("chat/completions", json=body)).json()
        choice = both["choices"][0]
        cities = [json.loads(c["function"]["arguments"])["city"] for c in choice["message"]["tool_calls"]]
        assert cities == ["Oslo", "Rome"] and choice["finish_reason"] == "tool_calls"
        one = (await client.post("chat/completions", json={**body, "parallel_tool_calls": False})).json()
        (call,) = one["choices"][0]["message"]["tool_calls"]
        assert json.loads(call["function"]["arguments"]) == {"city": "Oslo"}
        assert one["choices"][0]["finish_reason"] == "tool_calls"
        assert one["usage"]["completion_tokens"] < both["usage"]["completion_tokens"]  # generation stopped there
        # without tools the grammar just shapes the text
        text = (await client.post("chat/completions", json={**body, "tools": None, "grammar": _literal("yes")})).json()
        assert text["choices"][0]["message"]["content"] == "yes"
        completion = await client.post("completions", json={"model": TINY, "prompt": "x", "grammar": _literal("ok")})
        assert completion.json()["choices"][0]["text"] == "ok"
        for bad in (
            {"grammar": "root ::= ("},
            {"grammar": _literal("x"), "response_format": {"type": "json_object"}},
            {"grammar": _literal("x"), "tool_choice": "required"},
        ):
            response = await client.post("chat/completions", json={**body, **bad})
            assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_argument"


async def test_chat_template_kwargs_and_suffix(host: Host) -> None:
    body = {"model": TINY, "messages": HELLO, "max_tokens": 2}
    async with host.client() as client:
        ok = await client.post("chat/completions", json={**body, "chat_template_kwargs": {"enable_thinking": False}})
        assert ok.status_code == 200
        for bad in ({"messages": []}, {"not a name": 1}):
            response = await client.post("chat/completions", json={**body, "chat_template_kwargs": bad})
            assert response.status_code == 400 and "chat_template_kwargs" in response.json()["error"]["message"]
        response = await client.post("chat/completions", json={**body, "reasoning_effort": "extreme"})
        assert response.status_code == 400
        # the tiny model has no fill-in-the-middle tokens: suffix is refused saying so
        response = await client.post("completions", json={"model": TINY, "prompt": "def f(", "suffix": "):"})
        assert response.status_code == 400 and "fill-in-the-middle" in response.json()["error"]["message"]
