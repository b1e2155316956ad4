"""Anthropic's Messages API through the ``anthropic`` SDK itself, on both hosts, with the generated tiny model
(random weights: deterministic at temperature 0, shaped by grammars when a tool call is forced)."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import pytest

from lemonkit.catalog.config import DEFAULT_CHAT_MODEL
from tests.support.hosts import Host
from tests.support.tiny_models import EMBED, TINY

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
        "required": ["city"],
    },
}
ASK = [{"role": "user", "content": "Say something"}]
GREEDY = {"temperature": 0}  # the SDK has no sampling arguments any more; the API still takes them


def _client(host: Host) -> anthropic.AsyncAnthropic:
    # Jupyter and the hub read the Authorization header: the SDK's auth_token sends the token there
    return anthropic.AsyncAnthropic(base_url=host.root.rstrip("/"), auth_token=host.token, max_retries=0, timeout=120)


async def test_a_message_whole_and_streamed(host: Host) -> None:
    client = _client(host)
    whole = await client.messages.create(model=TINY, max_tokens=8, extra_body=GREEDY, messages=ASK)
    assert whole.type == "message" and whole.role == "assistant" and whole.model == TINY
    (block,) = whole.content
    assert block.type == "text" and block.text
    assert whole.stop_reason in ("end_turn", "max_tokens") and 0 < whole.usage.output_tokens <= 8
    assert whole.usage.input_tokens > 0
    async with client.messages.stream(model=TINY, max_tokens=8, extra_body=GREEDY, messages=ASK) as stream:
        pieces = [text async for text in stream.text_stream]
        final = await stream.get_final_message()
    assert len(pieces) > 1 and "".join(pieces) == block.text
    assert final.content[0].text == block.text and final.usage.output_tokens == whole.usage.output_tokens
    assert final.stop_reason == whole.stop_reason


async def test_the_events_of_a_stream(host: Host) -> None:
    body = {"model": TINY, "max_tokens": 6, "temperature": 0, "messages": ASK, "stream": True, "system": "Be brief."}
    async with httpx.AsyncClient(base_url=host.api + "/", headers=host.headers, timeout=120) as http:
        async with http.stream("POST", "messages", json=body) as response:
            assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
            events = [json.loads(line[6:]) async for line in response.aiter_lines() if line.startswith("data: ")]
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["message_start", "ping"] and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds[2] == "content_block_start" and events[2]["content_block"] == {"type": "text", "text": ""}
    assert kinds.count("content_block_stop") == 1 and kinds.index("content_block_stop") == len(kinds) - 3
    assert all(e["delta"]["type"] == "text_delta" for e in events if e["type"] == "content_block_delta")
    assert events[-2]["usage"]["output_tokens"] > 0 and events[-2]["delta"]["stop_reason"] in ("end_turn", "max_tokens")


async def test_a_stop_sequence_is_named(host: Host) -> None:
    client = _client(host)
    free = await client.messages.create(model=TINY, max_tokens=12, extra_body=GREEDY, messages=ASK)
    text = free.content[0].text
    stop = text[3:5] if len(text) >= 5 else text[-1]  # a piece the model will write again at temperature 0
    cut = await client.messages.create(
        model=TINY, max_tokens=12, extra_body=GREEDY, messages=ASK, stop_sequences=[stop]
    )
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert text.startswith(cut.content[0].text if cut.content else "") and stop not in (
        cut.content[0].text if cut.content else ""
    )


async def test_a_forced_tool_whole_streamed_and_answered(host: Host) -> None:
    # the bundled SmolLM2: the tiny model's vocabulary has no end token a finished call could end on
    model = DEFAULT_CHAT_MODEL
    client = _client(host)
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    forced = {"type": "tool", "name": "get_weather"}
    whole = await client.messages.create(
        model=model, max_tokens=48, extra_body=GREEDY, messages=ask, tools=[WEATHER], tool_choice=forced
    )
    (call,) = [b for b in whole.content if b.type == "tool_use"]
    assert call.name == "get_weather" and call.input["city"] in ("Paris", "Rome") and call.id
    assert whole.stop_reason == "tool_use"
    async with client.messages.stream(
        model=model, max_tokens=48, extra_body=GREEDY, messages=ask, tools=[WEATHER], tool_choice=forced
    ) as stream:
        events = [event async for event in stream]
        final = await stream.get_final_message()
    pieces = [
        e.delta.partial_json for e in events if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
    ]
    assert len(pieces) > 1 and json.loads("".join(pieces)) == call.input  # the arguments came in pieces
    starts = [e.content_block for e in events if e.type == "content_block_start"]
    assert starts[-1].type == "tool_use" and starts[-1].name == "get_weather"
    assert [b.input for b in final.content if b.type == "tool_use"] == [call.input]
    # the result goes back in a user turn, and the model answers in text
    history: list[Any] = [
        *ask,
        {"role": "assistant", "content": [{"type": "tool_use", "id": call.id, "name": call.name, "input": call.input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "18 degrees"}]},
    ]
    after = await client.messages.create(
        model=model, max_tokens=8, extra_body=GREEDY, messages=history, tools=[WEATHER]
    )
    assert after.role == "assistant" and after.stop_reason in ("end_turn", "max_tokens", "tool_use")


async def test_an_output_format_is_followed(host: Host) -> None:
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    answer = await _client(host).messages.create(
        model=TINY,
        max_tokens=32,
        messages=[{"role": "user", "content": "Is it ok?"}],
        output_config={"format": {"type": "json_schema", "schema": schema}},
        extra_body=GREEDY,
    )
    assert isinstance(json.loads(answer.content[0].text)["ok"], bool)


async def test_count_tokens_follows_the_prompt(host: Host) -> None:
    client = _client(host)
    short = await client.messages.count_tokens(model=TINY, messages=ASK)
    longer = await client.messages.count_tokens(model=TINY, messages=ASK, system="You are a careful assistant.")
    assert 0 < short.input_tokens < longer.input_tokens
    answered = await client.messages.create(model=TINY, max_tokens=2, messages=ASK)
    assert answered.usage.input_tokens == short.input_tokens  # what the model evaluated


@pytest.mark.parametrize(
    ("body", "status", "kind", "words"),
    [
        ({"model": TINY, "messages": ASK}, 400, "invalid_request_error", "max_tokens"),
        ({"model": "no-such-model", "max_tokens": 4, "messages": ASK}, 404, "not_found_error", "no-such-model"),
        ({"model": EMBED, "max_tokens": 4, "messages": ASK}, 400, "invalid_request_error", "chat model"),
        (
            {"model": TINY, "max_tokens": 4, "messages": ASK, "mcp_servers": []},
            400,
            "invalid_request_error",
            "mcp_servers",
        ),
        (
            {"model": TINY, "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "document"}]}]},
            400,
            "invalid_request_error",
            "document",
        ),
        (
            {"model": TINY, "max_tokens": 4, "messages": ASK, "tools": [{"type": "web_search_20250305", "name": "w"}]},
            400,
            "invalid_request_error",
            "server tools",
        ),
    ],
)
async def test_errors_have_anthropics_shape(
    host: Host, body: dict[str, Any], status: int, kind: str, words: str
) -> None:
    async with httpx.AsyncClient(base_url=host.api + "/", headers=host.headers, timeout=120) as http:
        response = await http.post("messages", json=body)
    assert response.status_code == status, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == kind and words in error["error"]["message"]


async def test_the_sdk_raises_its_own_errors(host: Host) -> None:
    with pytest.raises(anthropic.NotFoundError):
        await _client(host).messages.create(model="no-such-model", max_tokens=4, messages=ASK)


async def test_the_standalone_host_takes_anthropics_key_header(standalone: Any) -> None:
    from tests.support.hosts import API_KEY

    client = anthropic.AsyncAnthropic(base_url=standalone.root.rstrip("/"), api_key=API_KEY, max_retries=0)
    answer = await client.messages.create(model=TINY, max_tokens=2, messages=ASK)
    assert answer.content
    with pytest.raises(anthropic.AuthenticationError):
        await anthropic.AsyncAnthropic(
            base_url=standalone.root.rstrip("/"), api_key="wrong", max_retries=0
        ).messages.create(model=TINY, max_tokens=2, messages=ASK)
