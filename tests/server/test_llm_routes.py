"""The OpenAI LLM routes through the openai SDK, on both hosts, on the tiny generated model."""

from __future__ import annotations

import base64
import json
import math
import struct

import pytest
from openai.types.chat import ChatCompletion

from lemonkit.testing.tiny_gguf import png_data_url
from tests.support.hosts import Host
from tests.support.tiny_models import EMBED, RERANK, TINY, VISION


def _tool(name: str, argument: str) -> dict:
    """A one-argument function tool; the length cap lets the random tiny model close the string in time."""
    schema = {"type": "object", "properties": {argument: {"type": "string", "maxLength": 8}}, "required": [argument]}
    return {"type": "function", "function": {"name": name, "parameters": schema}}


async def test_chat_completion(host: Host) -> None:
    client = host.openai()
    completion = await client.chat.completions.create(
        model=TINY, messages=[{"role": "user", "content": "hello"}], max_tokens=8, temperature=0
    )
    assert completion.object == "chat.completion"
    assert completion.model == TINY
    choice = completion.choices[0]
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert completion.usage is not None
    assert completion.usage.completion_tokens <= 8
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + completion.usage.completion_tokens
    raw = completion.model_dump()
    assert {"prompt_n", "predicted_n", "predicted_per_second"} <= set(raw["timings"])


async def test_chat_stream_with_usage(host: Host) -> None:
    client = host.openai()
    stream = await client.chat.completions.create(
        model=TINY,
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert usage_chunk.usage.completion_tokens == 12 or finals[0].choices[0].finish_reason == "stop"
    # the same request without streaming produces the same text (greedy)
    whole = await client.chat.completions.create(
        model=TINY, messages=[{"role": "user", "content": "hello"}], max_tokens=12, temperature=0
    )
    assert whole.choices[0].message.content == text


async def test_chat_stream_is_sse_and_ends_with_done(host: Host) -> None:
    body = {"model": TINY, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True}
    async with host.client() as client, client.stream("POST", "chat/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line async for line in response.aiter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[6:]) for line in lines[:-1] if line.startswith("data: ")]
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert "timings" in events[-1]


async def test_seed_reproducible_and_stop(host: Host) -> None:
    client = host.openai()
    kwargs = {"model": TINY, "messages": [{"role": "user", "content": "tell"}], "max_tokens": 16, "temperature": 1.0}
    a = await client.chat.completions.create(seed=7, **kwargs)
    b = await client.chat.completions.create(seed=7, **kwargs)
    assert a.choices[0].message.content == b.choices[0].message.content
    text = a.choices[0].message.content or ""
    assert len(text) > 4
    stop = text[2:4]
    c = await client.chat.completions.create(seed=7, stop=[stop], **kwargs)
    assert stop not in (c.choices[0].message.content or "")
    assert c.choices[0].finish_reason == "stop"


async def test_tool_choice_required_gives_valid_call(host: Host) -> None:
    client = host.openai()
    tools = [_tool("get_weather", "city")]
    completion = await client.chat.completions.create(
        model=TINY,
        messages=[{"role": "user", "content": "weather?"}],
        tools=tools,
        tool_choice="required",
        max_tokens=64,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments)["city"], str)


async def test_a_prompt_over_the_context_says_how_to_raise_it(host: Host) -> None:
    async with host.client() as client:
        assert (await client.post("load", json={"model_name": TINY, "ctx_size": 256})).status_code == 200
        long = " ".join(["word"] * 600)
        response = await client.post(
            "chat/completions", json={"model": TINY, "messages": [{"role": "user", "content": long}]}
        )
        error = response.json()["error"]
        assert response.status_code == 400 and error["code"] == "invalid_argument"
        assert "more than the context size (256)" in error["message"]
        assert f"{TINY} was trained for 4096 tokens and is loaded with 256" in error["message"]
        assert '"ctx_size": N' in error["message"] and f"/v1/models/{TINY}/options" in error["message"]
        # Anthropic's count_tokens counts it all the same
        counted = await client.post(
            "messages/count_tokens", json={"model": TINY, "messages": [{"role": "user", "content": long}]}
        )
        assert counted.status_code == 200 and counted.json()["input_tokens"] > 600
        await client.post("unload", json={"model_name": TINY})


async def test_stored_responses_continue_and_are_removable(host: Host) -> None:
    import openai

    client = host.openai()
    ask = {"model": TINY, "max_output_tokens": 4, "temperature": 0}
    first = await client.responses.create(input="My name is Ada and I like maths.", store=True, **ask)
    again = await client.responses.retrieve(first.id)
    assert again.id == first.id and again.output_text == first.output_text
    alone = await client.responses.create(input="What is my name?", **ask)
    follow = await client.responses.create(input="What is my name?", previous_response_id=first.id, store=True, **ask)
    # the earlier turn and its answer were the prompt's start
    assert follow.usage is not None and alone.usage is not None and first.usage is not None
    assert follow.usage.input_tokens >= alone.usage.input_tokens + first.usage.output_tokens
    # a stream is stored too, and a chain goes on from it
    events = [
        e
        async for e in await client.responses.create(
            input="And then?", previous_response_id=follow.id, store=True, stream=True, **ask
        )
    ]
    (done,) = [e for e in events if e.type == "response.completed"]
    assert (await client.responses.retrieve(done.response.id)).output_text == done.response.output_text
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(alone.id)  # not asked to be stored
    with pytest.raises(openai.NotFoundError):
        await client.responses.create(input="x", previous_response_id="resp_" + "x" * 32, **ask)
    for response in (first, follow, done.response):
        deleted = await client.responses.delete(response.id)
        assert deleted is None or getattr(deleted, "deleted", True)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(response.id)
    async with host.client() as raw:
        bad = await raw.get("responses/..%2F..%2Fuser_models")  # not an id: nothing is read
        assert bad.status_code == 404 and bad.json()["error"]["code"] == "response_not_found"


async def test_completions(host: Host) -> None:
    client = host.openai()
    result = await client.completions.create(model=TINY, prompt=["one", "two"], max_tokens=4, temperature=0)
    assert result.object == "text_completion"
    assert sorted(c.index for c in result.choices) == [0, 1]
    stream = await client.completions.create(model=TINY, prompt="one", max_tokens=4, temperature=0, stream=True)
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == next(
        c.text for c in result.choices if c.index == 0
    )


async def test_responses(host: Host) -> None:
    client = host.openai()
    response = await client.responses.create(model=TINY, input="hello", max_output_tokens=8, temperature=0)
    # the tiny model never stops by itself: the token limit cuts every answer
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.output_text
    events = [
        e
        async for e in await client.responses.create(
            model=TINY, input="hello", max_output_tokens=8, temperature=0, stream=True
        )
    ]
    types = [e.type for e in events]
    assert types[0] == "response.created" and types[-1] == "response.completed"
    assert "response.output_item.added" in types and "response.output_text.delta" in types
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == response.output_text == events[-1].response.output_text


async def test_embeddings_float_and_base64(host: Host) -> None:
    client = host.openai()
    # the SDK asks for base64 by default and decodes it
    result = await client.embeddings.create(model=EMBED, input=["hello world", "something else"])
    assert [d.index for d in result.data] == [0, 1]
    a, b = (d.embedding for d in result.data)
    assert len(a) == len(b) > 0 and a != b
    assert math.isclose(sum(x * x for x in a), 1.0, rel_tol=1e-3)
    async with host.client() as raw:
        response = await raw.post(
            "embeddings", json={"model": EMBED, "input": "hello world", "encoding_format": "float"}
        )
        floats = response.json()["data"][0]["embedding"]
        response = await raw.post(
            "embeddings", json={"model": EMBED, "input": "hello world", "encoding_format": "base64"}
        )
        encoded = response.json()["data"][0]["embedding"]
    decoded = struct.unpack(f"<{len(floats)}f", base64.b64decode(encoded))
    assert decoded == pytest.approx(floats, abs=1e-6)
    assert floats == pytest.approx(a, abs=1e-5)


@pytest.mark.parametrize("path", ["rerank", "reranking", "reranker"])
async def test_rerank(host: Host, path: str) -> None:
    documents = ["the cat sat", "stock markets fell", "a dog ran", "cats purr"]
    async with host.client() as client:
        response = await client.post(path, json={"model": RERANK, "query": "cat", "documents": documents})
    assert response.status_code == 200, response.text
    results = response.json()["results"]
    assert sorted(r["index"] for r in results) == [0, 1, 2, 3]
    scores = [r["relevance_score"] for r in results]
    assert scores == sorted(scores, reverse=True)
    assert len(set(scores)) > 1


async def test_vision_image_url_through_the_sdk(host: Host) -> None:
    client = host.openai()

    async def ask(url: str | None) -> ChatCompletion:
        content: list[dict] = [{"type": "text", "text": "what is this?"}]
        if url:
            content.append({"type": "image_url", "image_url": {"url": url}})
        return await client.chat.completions.create(
            model=VISION, messages=[{"role": "user", "content": content}], max_tokens=6, temperature=0
        )

    text_only, red, blue = (
        await ask(None),
        await ask(png_data_url((220, 20, 20))),
        await ask(png_data_url((20, 20, 220))),
    )
    assert red.usage.prompt_tokens > text_only.usage.prompt_tokens  # the image became tokens the model saw
    assert red.choices[0].message.content != blue.choices[0].message.content
    async with host.client() as raw:
        bad = {
            "model": VISION,
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}],
                }
            ],
        }
        response = await raw.post("chat/completions", json=bad)
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_argument"


async def test_logprobs_and_streamed_tool_calls(host: Host) -> None:
    client = host.openai()
    result = await client.chat.completions.create(
        model=TINY,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    tokens = result.choices[0].logprobs.content
    assert len(tokens) == 4 and all(t.logprob <= 0 and len(t.top_logprobs) == 2 for t in tokens)
    assert "".join(t.token for t in tokens) == result.choices[0].message.content
    tools = [_tool("lookup", "q")]
    stream = await client.chat.completions.create(
        model=TINY,
        messages=[{"role": "user", "content": "find"}],
        tools=tools,
        tool_choice={"type": "function", "function": {"name": "lookup"}},
        max_tokens=64,
        stream=True,
    )
    chunks = [c async for c in stream]
    parts = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert parts[0].id and parts[0].function.name == "lookup" and all(p.index == 0 for p in parts)
    arguments = "".join(p.function.arguments or "" for p in parts)
    assert isinstance(json.loads(arguments)["q"], str)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
