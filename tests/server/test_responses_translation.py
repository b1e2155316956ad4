"""Responses API <-> chat completions translation, checked against the openai SDK's own types and client."""

from __future__ import annotations

import copy
import json
from typing import Any

import httpx2
import openai
import pydantic
import pytest
from openai.types.responses import FunctionTool, Response, ResponseStreamEvent

from lemonkit.errors import BackendError
from lemonkit.formats.schemas import validate
from lemonkit.server.response_stream import ResponseStream
from lemonkit.server.responses import from_chat_completion, to_chat_request

EVENTS: pydantic.TypeAdapter[ResponseStreamEvent] = pydantic.TypeAdapter(ResponseStreamEvent)
TIMINGS = {"cache_n": 14, "prompt_n": 1, "prompt_ms": 13.3, "predicted_n": 179, "predicted_ms": 1827.5}

#: the spec's non-streaming chat completion (reasoning model)
CHAT_COMPLETION: dict[str, Any] = {
    "id": "chatcmpl-cJjl2vW81HgtjvknoAdqxCGKeEtNOG4u",
    "object": "chat.completion",
    "created": 1793827645,
    "model": "Qwen3-0.6B-GGUF",
    "system_fingerprint": "b12109-13ec8f614",
    "choices": [
        {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": "The population of Paris is approximately **2.1 million**.",
                "reasoning_content": "Okay, so I need to find out the population of Paris.",
            },
            "finish_reason": "stop",
        }
    ],
    "usage": {
        "prompt_tokens": 15,
        "completion_tokens": 364,
        "total_tokens": 379,
        "prompt_tokens_details": {"cached_tokens": 3},
    },
    "timings": TIMINGS,
}


def _chunk(delta: dict[str, Any] | None = None, finish: str | None = None, **extra: Any) -> dict[str, Any]:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
    return {
        "id": "chatcmpl-NoEW",
        "object": "chat.completion.chunk",
        "created": 1793827645,
        "model": "/hub/Qwen3-0.6B-Q4_0.gguf",
        "choices": choices,
        **extra,
    }


#: a recorded llama.cpp stream with include_usage: role, reasoning, content, finish with timings, usage
CHUNKS: list[dict[str, Any]] = [
    _chunk({"role": "assistant", "content": None}),
    _chunk({"reasoning_content": "Okay"}),
    _chunk({"reasoning_content": ", Paris"}),
    _chunk({"reasoning_content": "."}),
    _chunk({"content": "About"}),
    _chunk({"content": " 2.1"}),
    _chunk({"content": " million."}),
    _chunk({}, "stop", timings=TIMINGS),
    _chunk(None, usage={"prompt_tokens": 15, "completion_tokens": 7, "total_tokens": 22,
                        "prompt_tokens_details": {"cached_tokens": 14}}),
]  # fmt: skip

TOOL_CHUNKS: list[dict[str, Any]] = [
    _chunk({"role": "assistant", "content": None}),
    _chunk({"content": "Let me check."}),
    _chunk(
        {
            "tool_calls": [
                {"index": 0, "id": "call_a", "type": "function", "function": {"name": "weather", "arguments": ""}}
            ]
        }
    ),
    _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}),
    _chunk(
        {
            "tool_calls": [
                {"index": 1, "id": "call_b", "type": "function", "function": {"name": "time", "arguments": "{}"}}
            ]
        }
    ),
    _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}),
    _chunk({}, "tool_calls"),
    _chunk(None, usage={"prompt_tokens": 30, "completion_tokens": 12, "total_tokens": 42}),
]


def _run(chunks: list[dict[str, Any]], **kw: Any) -> list[tuple[str, dict[str, Any]]]:
    stream = ResponseStream(response_id="resp_test", created_at=1793827678, model="Qwen3-0.6B-GGUF", **kw)
    events: list[tuple[str, dict[str, Any]]] = []
    for chunk in chunks:
        events += stream.feed(copy.deepcopy(chunk))
    events += stream.finish()
    return events


# -- request translation -----------------------------------------------------------------------


def test_string_input_becomes_one_user_message() -> None:
    chat = to_chat_request({"model": "m", "input": "Hi", "max_output_tokens": 5, "temperature": 0.1, "top_k": 3})
    assert chat == {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5,
                    "temperature": 0.1, "top_k": 3}  # fmt: skip
    validate("chat/completions", chat)


def test_items_instructions_tools_and_stream() -> None:
    body = {
        "model": "m",
        "instructions": "Be brief.",
        "input": [
            {"role": "developer", "content": "Use metric units."},
            {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
            {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": '{"city":"Paris"}'},
            {"type": "function_call", "call_id": "c2", "name": "time", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "21C"},
            {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "noon"}]},
            {"type": "reasoning", "summary": []},
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "And this?"},
                    {"type": "input_image", "image_url": "data:image/png;base64,AAAA", "detail": "low"},
                ],
            },
        ],
        "tools": [{"type": "function", "name": "weather", "parameters": {"type": "object"}, "strict": True}],
        "tool_choice": {"type": "function", "name": "weather"},
        "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}, "strict": True}},
        "stream": True,
        "top_p": 0.9,
        "repeat_penalty": 1.1,
    }
    validate("responses", body)
    chat = to_chat_request(body)
    validate("chat/completions", chat)
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "Use metric units."},
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city":"Paris"}'}},
                {"id": "c2", "type": "function", "function": {"name": "time", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "21C"},
        {"role": "tool", "tool_call_id": "c2", "content": "noon"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "And this?"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA", "detail": "low"}},
            ],
        },
    ]
    assert chat["tools"] == [
        {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}, "strict": True}}
    ]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "weather"}}
    assert chat["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "w", "schema": {"type": "object"}, "strict": True},
    }
    assert chat["stream"] is True and chat["stream_options"] == {"include_usage": True}
    assert chat["top_p"] == 0.9 and chat["repeat_penalty"] == 1.1 and "max_tokens" not in chat


# -- non-streaming -----------------------------------------------------------------------------


def test_chat_completion_becomes_a_response() -> None:
    out = from_chat_completion(CHAT_COMPLETION, response_id="resp_x", created_at=1793827678, model="Qwen3-0.6B-GGUF")
    resp = Response.model_validate(out)
    assert resp.id == "resp_x" and resp.object == "response" and resp.status == "completed"
    assert resp.created_at == 1793827678 and isinstance(out["completed_at"], int)
    assert resp.model == "Qwen3-0.6B-GGUF"
    assert resp.output_text == "The population of Paris is approximately **2.1 million**."
    reasoning, message = out["output"]
    assert reasoning["type"] == "reasoning" and reasoning["id"].startswith("rs_")
    assert reasoning["content"] == [
        {"type": "reasoning_text", "text": "Okay, so I need to find out the population of Paris."}
    ]
    assert message["id"].startswith("msg_") and message["role"] == "assistant" and message["status"] == "completed"
    assert message["content"] == [{"type": "output_text", "annotations": [], "logprobs": [], "text": resp.output_text}]
    assert out["usage"]["input_tokens"] == 15 and out["usage"]["output_tokens"] == 364
    assert out["usage"]["total_tokens"] == 379 and out["usage"]["input_tokens_details"]["cached_tokens"] == 3
    assert out["timings"] == TIMINGS
    json.dumps(out)


def test_plain_answer_has_only_a_message_and_echoes_the_request() -> None:
    chat = copy.deepcopy(CHAT_COMPLETION)
    del chat["choices"][0]["message"]["reasoning_content"]
    chat["choices"][0]["finish_reason"] = "length"
    request = {"model": "m", "input": "x", "instructions": "Be brief.", "max_output_tokens": 8, "temperature": 0.3,
               "tools": [{"type": "function", "name": "f", "parameters": {}}], "tool_choice": "none"}  # fmt: skip
    out = from_chat_completion(chat, response_id="resp_x", created_at=1, model="m", request=request)
    resp = Response.model_validate(out)
    assert [o.type for o in resp.output] == ["message"]
    assert (
        resp.status == "incomplete"
        and resp.incomplete_details
        and resp.incomplete_details.reason == "max_output_tokens"
    )
    assert resp.instructions == "Be brief." and resp.max_output_tokens == 8 and resp.temperature == 0.3
    assert resp.tool_choice == "none" and isinstance(resp.tools[0], FunctionTool) and resp.tools[0].name == "f"


def test_tool_calls_become_function_call_items() -> None:
    chat = {
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"c":1}'}}
                    ],
                },
                "finish_reason": "tool_calls",
            }
        ],
        "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3},
    }
    resp = Response.model_validate(from_chat_completion(chat, response_id="resp_x", created_at=1, model="m"))
    (call,) = resp.output
    assert call.type == "function_call" and call.call_id == "call_1" and call.name == "weather"
    assert call.arguments == '{"c":1}' and resp.output_text == ""


def test_completion_without_choices_is_a_backend_error() -> None:
    with pytest.raises(BackendError):
        from_chat_completion({"object": "chat.completion"}, response_id="resp_x", created_at=1, model="m")


# -- streaming ---------------------------------------------------------------------------------


def _check_events(events: list[tuple[str, dict[str, Any]]]) -> list[Any]:
    parsed = []
    for i, (name, data) in enumerate(events):
        assert data["type"] == name and data["sequence_number"] == i
        parsed.append(EVENTS.validate_python(data))
        json.dumps(data)
    return parsed


def test_stream_events_validate_and_carry_everything() -> None:
    events = _run(CHUNKS)
    _check_events(events)
    names = [name for name, _ in events]
    assert names == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",  # reasoning item, output_index 0
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",  # message item, output_index 1
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    by_name = [(n, d) for n, d in events]
    deltas = [d for n, d in by_name if n == "response.output_text.delta"]
    assert "".join(d["delta"] for d in deltas) == "About 2.1 million."
    message_id = events[10][1]["item"]["id"]
    assert {d["item_id"] for d in deltas} == {message_id} and {d["output_index"] for d in deltas} == {1}
    assert all(d["content_index"] == 0 for d in deltas)
    reasoning = [d for n, d in by_name if n == "response.reasoning_text.delta"]
    assert "".join(d["delta"] for d in reasoning) == "Okay, Paris." and reasoning[0]["output_index"] == 0

    completed = events[-1][1]
    assert completed["timings"] == TIMINGS
    resp = Response.model_validate(completed["response"])
    assert resp.status == "completed" and resp.output_text == "About 2.1 million."
    assert resp.id == "resp_test" and resp.model == "Qwen3-0.6B-GGUF"
    assert [o.type for o in resp.output] == ["reasoning", "message"]
    assert resp.output[1].id == message_id
    assert resp.usage is not None
    assert (resp.usage.input_tokens, resp.usage.output_tokens, resp.usage.total_tokens) == (15, 7, 22)
    assert resp.usage.input_tokens_details.cached_tokens == 14
    assert resp.usage.output_tokens_details.reasoning_tokens == 3


def test_stream_tool_calls() -> None:
    events = _run(TOOL_CHUNKS, request={"model": "m", "input": "x", "tools": [{"type": "function", "name": "weather"}]})
    _check_events(events)
    args = [d for n, d in events if n == "response.function_call_arguments.delta"]
    done = {d["output_index"]: d for n, d in events if n == "response.function_call_arguments.done"}
    assert done[1]["arguments"] == '{"city": "Paris"}' and done[2]["arguments"] == "{}"
    assert "".join(d["delta"] for d in args if d["output_index"] == 1) == '{"city": "Paris"}'
    resp = Response.model_validate(events[-1][1]["response"])
    assert [o.type for o in resp.output] == ["message", "function_call", "function_call"]
    assert resp.output_text == "Let me check."
    calls = [o for o in resp.output if o.type == "function_call"]
    assert [(c.call_id, c.name, c.arguments) for c in calls] == [
        ("call_a", "weather", '{"city": "Paris"}'),
        ("call_b", "time", "{}"),
    ]


def test_stream_hitting_the_token_limit_is_incomplete() -> None:
    events = _run([_chunk({"content": "Once upon"}), _chunk({}, "length")])
    _check_events(events)
    resp = Response.model_validate(events[-1][1]["response"])
    assert events[-1][0] == "response.completed" and resp.status == "incomplete"
    assert resp.output_text == "Once upon"


def test_empty_stream_still_answers_with_a_message() -> None:
    stream = ResponseStream(response_id="resp_e", created_at=1, model="m")
    assert [n for n, _ in stream.start()] == ["response.created", "response.in_progress"]
    assert stream.start() == []
    events = stream.finish()
    assert stream.finish() == []
    assert events[-1][0] == "response.completed"
    resp = Response.model_validate(events[-1][1]["response"])
    assert [o.type for o in resp.output] == ["message"] and resp.output_text == ""
    assert events[0][1]["sequence_number"] == 2


# -- through the openai SDK's client -----------------------------------------------------------


def _sdk_client(chunks: list[dict[str, Any]], completion: dict[str, Any]) -> openai.OpenAI:
    """An SDK client whose transport validates and translates what it sends, like the server does."""

    def handler(request: httpx2.Request) -> httpx2.Response:
        body = validate("responses", json.loads(request.content))
        chat = to_chat_request(body)
        validate("chat/completions", chat)
        if not body.get("stream"):
            out = from_chat_completion(
                completion, response_id="resp_sdk", created_at=1, model=body["model"], request=body
            )
            return httpx2.Response(200, json=out)
        events = _run(chunks, request=body)
        sse = "".join(f"event: {n}\ndata: {json.dumps(d)}\n\n" for n, d in events) + "data: [DONE]\n\n"
        return httpx2.Response(200, content=sse.encode(), headers={"content-type": "text/event-stream"})

    http = httpx2.Client(transport=httpx2.MockTransport(handler))
    return openai.OpenAI(base_url="http://lemonkit.test/api/v1", api_key="x", http_client=http, max_retries=0)


def test_sdk_parses_non_streaming() -> None:
    client = _sdk_client(CHUNKS, CHAT_COMPLETION)
    resp = client.responses.create(model="Qwen3-0.6B-GGUF", input="What is the population of Paris?")
    assert resp.output_text == "The population of Paris is approximately **2.1 million**."
    assert resp.usage is not None and resp.usage.total_tokens == 379


def test_sdk_parses_streaming() -> None:
    client = _sdk_client(CHUNKS, CHAT_COMPLETION)
    seen = list(client.responses.create(model="Qwen3-0.6B-GGUF", input="Paris?", stream=True))
    assert [e.sequence_number for e in seen] == list(range(len(seen)))
    text = "".join(e.delta for e in seen if e.type == "response.output_text.delta")
    assert text == "About 2.1 million."
    assert seen[-1].type == "response.completed" and seen[-1].response.output_text == text


def test_sdk_stream_helper_accumulates() -> None:
    client = _sdk_client(TOOL_CHUNKS, CHAT_COMPLETION)
    with client.responses.stream(
        model="m",
        input=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[
            {"type": "function", "name": "weather", "parameters": {"type": "object", "properties": {}}, "strict": False}
        ],
    ) as stream:
        for _ in stream:
            pass
        final = stream.get_final_response()
    assert final.output_text == "Let me check."
    assert [o.type for o in final.output] == ["message", "function_call", "function_call"]

    client = _sdk_client(CHUNKS, CHAT_COMPLETION)
    with client.responses.stream(model="m", input="Paris?") as stream:
        final = stream.get_final_response()
    assert final.output_text == "About 2.1 million."
