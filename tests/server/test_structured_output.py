"""Constrained output and length limits through the openai SDK, on both hosts, on the tiny generated model.

The tiny model's weights are random: what it writes is noise, so only a grammar can make it JSON. Many seeds make
the constraint, not luck, the reason every finished answer parses.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema

from tests.support.hosts import Host
from tests.support.tiny_models import TINY

SEEDS = range(20)
MAX_TOKENS = 200
MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "member": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    },
    "required": ["name", "age", "member"],
}


async def _answers(host: Host, response_format: dict[str, Any], *, stream: bool = False) -> list[tuple[str, str, int]]:
    """``(finish_reason, content, completion_tokens)`` for each seed."""
    client = host.openai()
    answers = []
    for seed in SEEDS:
        kwargs: dict[str, Any] = dict(
            model=TINY, messages=MESSAGES, response_format=response_format, max_tokens=MAX_TOKENS, seed=seed
        )
        if stream:
            chunks = [
                c
                async for c in await client.chat.completions.create(
                    stream=True, stream_options={"include_usage": True}, **kwargs
                )
            ]
            (finish,) = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
            content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            usage = chunks[-1].usage
        else:
            completion = await client.chat.completions.create(**kwargs)
            finish, content, usage = (
                completion.choices[0].finish_reason,
                completion.choices[0].message.content or "",
                completion.usage,
            )
        assert usage is not None
        answers.append((finish, content, usage.completion_tokens))
    return answers


def _check(answers: list[tuple[str, str, int]], schema: dict[str, Any] | None) -> None:
    finished = 0
    for finish, content, n in answers:
        # "length" exactly when max_tokens cut the answer; otherwise the grammar ended it
        assert finish in ("stop", "length"), finish
        assert (finish == "length") == (n == MAX_TOKENS), (finish, n)
        if finish == "stop":
            finished += 1
            value = json.loads(content)
            assert isinstance(value, dict)
            if schema is not None:
                jsonschema.validate(value, schema)
    assert finished >= len(answers) // 2, answers  # most end on their own, so the checks above ran


async def test_json_object_seeds(host: Host) -> None:
    _check(await _answers(host, {"type": "json_object"}), None)


async def test_json_schema_seeds(host: Host) -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    answers = await _answers(host, response_format)
    _check(answers, PERSON)
    assert all(finish == "stop" for finish, _, _ in answers)  # every string is bounded: each answer fits
    assert len({content for _, content, _ in answers}) > 1  # seeds matter: the answers are sampled
    _check(await _answers(host, response_format, stream=True), PERSON)


async def test_huge_max_tokens_is_clamped_to_the_context(host: Host) -> None:
    async with host.client() as raw:
        response = await raw.post("load", json={"model_name": TINY, "ctx_size": 256})
        assert response.status_code == 200, response.text
    client = host.openai()
    chat = await client.chat.completions.create(model=TINY, messages=MESSAGES, max_tokens=10**12, temperature=0)
    assert chat.usage is not None
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage.total_tokens == 256  # generated until the context was full
    stream = await client.completions.create(model=TINY, prompt="Once", max_tokens=10**12, temperature=0, stream=True)
    chunks = [c async for c in stream]
    assert chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == 256
