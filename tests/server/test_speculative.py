"""Speculative decoding with n-gram drafts (``--spec-type ngram-simple``): the tokens are those decoding one at a
time gives (greedy and seeded sampling, alone and beside other streams in one batch, under a grammar), and a
sequence that repeats itself accepts drafts, which ``timings`` reports."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx

from tests.support.hosts import API_KEY, Host, Standalone
from tests.support.tiny_models import TINY

SPEC = "--spec-type ngram-simple --draft-max 8"
#: a prompt whose continuation copies it: a draft-friendly workload
COPY = "red green blue red green blue red green blue red green blue red green blue red green blue"
PROMPTS = (COPY, "one two three four five six seven", "the quick brown fox jumps over the lazy dog and the")
SCHEMA = {
    "type": "json_schema",
    "json_schema": {
        "name": "item",
        "schema": {
            "type": "object",
            "properties": {"colour": {"type": "string", "enum": ["red", "green", "blue"]}, "n": {"type": "integer"}},
            "required": ["colour", "n"],
        },
    },
}


async def _load(client: httpx.AsyncClient, args: str) -> None:
    await client.post("unload", json={"model_name": TINY})
    response = await client.post("load", json={"model_name": TINY, "llamacpp_args": f"--parallel 4 {args}"})
    assert response.status_code == 200, response.text


async def _complete(client: httpx.AsyncClient, prompt: str, **fields: Any) -> dict[str, Any]:
    body = {"model": TINY, "prompt": prompt, "max_tokens": 48, "temperature": 0, **fields}
    response = await client.post("completions", json=body)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


async def _chat(client: httpx.AsyncClient, text: str) -> dict[str, Any]:
    messages = [{"role": "user", "content": text}]
    body = {"model": TINY, "messages": messages, "max_tokens": 48, "temperature": 0, "response_format": SCHEMA}
    response = await client.post("chat/completions", json=body)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


async def _workload(client: httpx.AsyncClient) -> dict[str, Any]:
    """Each prompt alone, then all of them at once with a seeded sampled one and a grammar one beside."""
    alone = [await _complete(client, p) for p in PROMPTS]
    together = await asyncio.gather(
        *(_complete(client, p) for p in PROMPTS),
        _complete(client, COPY, temperature=0.9, seed=11),
        _chat(client, "Pick a colour and a number."),
    )
    return {"alone": alone, "together": list(together)}


def _texts(answers: list[dict[str, Any]]) -> list[str]:
    return [a["choices"][0].get("text", a["choices"][0].get("message", {}).get("content")) for a in answers]


async def test_drafts_change_no_token_and_are_accepted_on_a_copying_prompt() -> None:
    server = Standalone({"LEMONADE_API_KEY": API_KEY})
    try:
        host = Host("standalone", server.root, API_KEY)
        async with host.client() as client:
            await _load(client, "")
            plain = await _workload(client)
            await _load(client, SPEC)
            drafted = await _workload(client)
            again = await _complete(client, COPY, temperature=0.9, seed=11)  # the seeded stream, alone this time
    finally:
        server.stop()
    assert _texts(drafted["alone"]) == _texts(plain["alone"])
    assert _texts(drafted["together"]) == _texts(plain["together"])
    assert _texts([again]) == _texts([drafted["together"][3]])  # reproducible by its seed, drafts or not
    for spec, base in zip(drafted["alone"] + drafted["together"], plain["alone"] + plain["together"], strict=True):
        assert spec["usage"]["completion_tokens"] == base["usage"]["completion_tokens"]
        assert "draft_n" not in base["timings"]
    json.loads(_texts(drafted["together"])[-1])  # the grammar's answer is still its JSON
    copying = drafted["alone"][0]["timings"]
    assert copying["draft_n"] > 0 and 0 < copying["draft_n_accepted"] <= copying["draft_n"], copying


async def test_the_flags_are_checked(host: Host) -> None:
    async with host.client() as client:
        for args, word in (("--spec-type eagle", "ngram-simple"), ("--spec-type ngram-simple --draft-max 0", "1")):
            refused = await client.post("load", json={"model_name": TINY, "llamacpp_args": args})
            assert refused.status_code == 400, refused.text
            assert word in refused.json()["error"]["message"]
