"""Request validation: valid bodies pass, and every kind of bad input names its path."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from lemonkit.errors import InvalidArgument, InvalidJSON, MissingArgument
from lemonkit.formats.schemas import FORBIDDEN_LLAMACPP_FLAGS, ROUTES, validate

CHAT_FULL: dict[str, Any] = {
    "model": "Qwen3-0.6B-GGUF",
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "developer", "content": [{"type": "text", "text": "Really."}]},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is in this image?"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA", "detail": "low"}},
            ],
        },
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "look", "arguments": '{"x": 1}'}}],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "a red circle"},
        {"role": "assistant", "content": "A red circle.", "reasoning_content": "hmm"},
    ],
    "stream": True,
    "stream_options": {"include_usage": True},
    "stop": ["\n\n", "END"],
    "logprobs": True,
    "top_logprobs": 3,
    "temperature": 0.7,
    "repeat_penalty": 1.1,
    "frequency_penalty": -0.5,
    "presence_penalty": 2,
    "seed": 42,
    "top_k": 40,
    "top_p": 0.95,
    "min_p": 0.05,
    "tools": [
        {
            "type": "function",
            "function": {
                "name": "look",
                "description": "Look closer",
                "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}},
                "strict": True,
            },
        }
    ],
    "tool_choice": {"type": "function", "function": {"name": "look"}},
    "response_format": {
        "type": "json_schema",
        "json_schema": {"name": "answer", "schema": {"type": "object"}, "strict": True},
    },
    "max_tokens": 64,
    "max_completion_tokens": 64,
    "enable_thinking": False,
    "thinking": {"type": "enabled"},
    "ctx_size": -1,
    "route_trace": False,
    "some_future_openai_field": {"anything": [1, 2]},
}

RESPONSES_FULL: dict[str, Any] = {
    "model": "Llama-3.2-1B-Instruct-GGUF",
    "input": [
        {"role": "user", "content": "Hi"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello"}]},
        {
            "type": "message",
            "role": "user",
            "content": [
                {"type": "input_text", "text": "What is this?"},
                {"type": "input_image", "image_url": "data:image/png;base64,AAAA"},
            ],
        },
        {"type": "function_call", "call_id": "c1", "name": "look", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "a circle"},
    ],
    "instructions": "Be brief.",
    "max_output_tokens": 100,
    "temperature": 0.2,
    "top_p": 1,
    "top_k": 20,
    "repeat_penalty": 1.0,
    "stream": False,
    "tools": [{"type": "function", "name": "look", "parameters": {"type": "object"}}],
    "tool_choice": "auto",
    "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
    "ctx_size": 4096,
}

VALID: list[tuple[str, Any]] = [
    ("chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
    ("chat/completions", CHAT_FULL),
    ("chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stop": "x"}),
    ("chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}),
    ("chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}], "thinking": False}),
    ("chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stop": None, "seed": None}),
    (
        "chat/completions",
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_object"}},
    ),
    ("completions", {"model": "m", "prompt": "Once"}),
    ("completions", {"model": "m", "prompt": ["a", "b"], "echo": True, "logprobs": 2, "stop": ["."], "max_tokens": 8}),
    ("completions", {"model": "m", "prompt": "x", "logprobs": True, "stream": True, "top_p": 0}),
    ("responses", {"model": "m", "input": "What is the population of Paris?"}),
    ("responses", RESPONSES_FULL),
    ("embeddings", {"model": "m", "input": "hello"}),
    ("embeddings", {"model": "m", "input": ["a", "b"], "encoding_format": "base64", "dimensions": 64}),
    ("rerank", {"model": "m", "query": "q", "documents": ["a", "b"], "top_n": 1, "return_documents": True}),
    ("load", {"model_name": "Qwen3-0.6B-GGUF"}),
    (
        "load",
        {
            "model_name": "Qwen3-0.6B-GGUF",
            "ctx_size": 8192,
            "llamacpp_backend": "cpu",
            "llamacpp_args": "--flash-attn on --no-mmap -np 2 --temp=0.5",
            "save_options": True,
            "pinned": True,
        },
    ),
    ("load", {"model_name": "whisper", "whispercpp_backend": "cpu", "whispercpp_args": "--convert"}),
    ("load", {"model_name": "sd-turbo", "steps": 4, "cfg_scale": 1.0, "width": 512, "height": 512}),
    ("unload", {}),
    ("unload", {"model_name": "Qwen3-0.6B-GGUF"}),
    ("unload", None),  # an empty body
]


@pytest.mark.parametrize(("route", "body"), VALID)
def test_valid_bodies_pass(route: str, body: Any) -> None:
    before = copy.deepcopy(body)
    out = validate(route, body)
    assert out == (before if body is not None else {})


@pytest.mark.parametrize("route", sorted(ROUTES))
@pytest.mark.parametrize("body", [[], "text", 3, True, [{"model": "m"}]])
def test_non_object_body_is_invalid_json(route: str, body: Any) -> None:
    with pytest.raises(InvalidJSON, match="not a JSON object") as exc:
        validate(route, body)
    assert exc.value.status == 400 and exc.value.code == "invalid_json"


MISSING: list[tuple[str, dict[str, Any], str]] = [
    ("chat/completions", {"model": "m"}, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "model"),
    ("chat/completions", {"model": None, "messages": [{"role": "user", "content": "hi"}]}, "model"),
    ("completions", {"model": "m"}, "prompt"),
    ("completions", {"prompt": "x"}, "model"),
    ("responses", {"model": "m"}, "input"),
    ("responses", {"input": "x"}, "model"),
    ("embeddings", {"model": "m"}, "input"),
    ("embeddings", {"input": "x"}, "model"),
    ("rerank", {"model": "m", "documents": ["a"]}, "query"),
    ("rerank", {"model": "m", "query": "q"}, "documents"),
    ("load", {"ctx_size": 10}, "model_name"),
]


@pytest.mark.parametrize(("route", "body", "name"), MISSING)
def test_missing_argument_names_it(route: str, body: dict[str, Any], name: str) -> None:
    with pytest.raises(MissingArgument) as exc:
        validate(route, body)
    assert exc.value.message.startswith(f"{name}:")
    assert exc.value.status == 400 and exc.value.code == "missing_argument"


def _chat(**kw: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw}


def _msgs(*messages: Any) -> dict[str, Any]:
    return {"model": "m", "messages": list(messages)}


U = {"role": "user", "content": "hi"}

INVALID: list[tuple[str, dict[str, Any], str]] = [
    # chat: types at depth
    ("chat/completions", _msgs(U, {"role": "user", "content": 5}), "messages[1].content: expected string or array"),
    ("chat/completions", {"model": "m", "messages": "hi"}, "messages: expected array"),
    ("chat/completions", _msgs(), "messages: expected at least 1 item"),
    ("chat/completions", _msgs("hi"), "messages[0]: expected object"),
    ("chat/completions", _msgs({"content": "hi"}), "messages[0].role: required"),
    ("chat/completions", _msgs({"role": "bot", "content": "hi"}), "messages[0].role: expected one of"),
    ("chat/completions", _msgs({"role": "user"}), "messages[0].content: required"),
    (
        "chat/completions",
        _msgs(U, {"role": "user", "content": [{"type": "image_url", "image_url": {"url": 1}}]}),
        "messages[1].content[0].image_url.url: expected string",
    ),
    (
        "chat/completions",
        _msgs({"role": "user", "content": [{"type": "image_url", "image_url": "data:..."}]}),
        "messages[0].content[0].image_url: expected object",
    ),
    (
        "chat/completions",
        _msgs({"role": "user", "content": [{"type": "video", "video": {}}]}),
        "messages[0].content[0].type: expected one of text, image_url",
    ),
    (
        "chat/completions",
        _msgs({"role": "user", "content": [{"type": "text"}]}),
        "messages[0].content[0].text: required",
    ),
    (
        "chat/completions",
        _msgs({"role": "system", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}),
        "messages[0].content[0].type: expected one of text",
    ),
    ("chat/completions", _msgs({"role": "tool", "content": "x"}), "messages[0].tool_call_id: required"),
    (
        "chat/completions",
        _msgs({"role": "tool", "content": "x", "tool_call_id": 3}),
        "messages[0].tool_call_id: expected string",
    ),
    (
        "chat/completions",
        _msgs({"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {}}}]}),
        "messages[0].tool_calls[0].function.arguments: expected string",
    ),
    ("chat/completions", _msgs({"role": "assistant", "tool_calls": {}}), "messages[0].tool_calls: expected array"),
    # chat: scalars
    ("chat/completions", _chat(stream="yes"), "stream: expected boolean"),
    ("chat/completions", _chat(stream_options={"include_usage": 1}), "stream_options.include_usage: expected boolean"),
    ("chat/completions", _chat(stop=3), "stop: expected string or array"),
    ("chat/completions", _chat(stop=["a", 1]), "stop[1]: expected string"),
    ("chat/completions", _chat(logprobs=1), "logprobs: expected boolean"),
    ("chat/completions", _chat(top_logprobs=21), "top_logprobs: must be between 0 and 20"),
    ("chat/completions", _chat(temperature="0.5"), "temperature: expected number, got string"),
    ("chat/completions", _chat(temperature=True), "temperature: expected number, got boolean"),
    ("chat/completions", _chat(temperature=float("nan")), "temperature: expected a finite number"),
    ("chat/completions", _chat(repeat_penalty=0.9), "repeat_penalty: must be between 1 and 2"),
    ("chat/completions", _chat(repeat_penalty=2.5), "repeat_penalty: must be between 1 and 2"),
    ("chat/completions", _chat(frequency_penalty=-3), "frequency_penalty: must be between -2 and 2"),
    ("chat/completions", _chat(presence_penalty=2.1), "presence_penalty: must be between -2 and 2"),
    ("chat/completions", _chat(seed=1.5), "seed: expected integer, got number"),
    ("chat/completions", _chat(seed=False), "seed: expected integer, got boolean"),
    ("chat/completions", _chat(top_k="40"), "top_k: expected integer"),
    ("chat/completions", _chat(top_p=1.01), "top_p: must be between 0 and 1"),
    ("chat/completions", _chat(top_p=-0.1), "top_p: must be between 0 and 1"),
    ("chat/completions", _chat(min_p=2), "min_p: must be between 0 and 1"),
    ("chat/completions", _chat(max_tokens=0), "max_tokens: must be >= 1"),
    ("chat/completions", _chat(max_tokens=True), "max_tokens: expected integer, got boolean"),
    ("chat/completions", _chat(max_completion_tokens=-5), "max_completion_tokens: must be >= 1"),
    ("chat/completions", _chat(enable_thinking="no"), "enable_thinking: expected boolean"),
    ("chat/completions", _chat(thinking="off"), "thinking: expected boolean or object"),
    ("chat/completions", _chat(thinking={"type": 1}), "thinking.type: expected string"),
    ("chat/completions", _chat(ctx_size=-2), "ctx_size: must be >= -1"),
    ("chat/completions", _chat(ctx_size="4096"), "ctx_size: expected integer"),
    ("chat/completions", _chat(model=3), "model: expected string"),
    # chat: tools
    ("chat/completions", _chat(tools={}), "tools: expected array"),
    ("chat/completions", _chat(tools=[{"type": "function"}]), "tools[0].function: required"),
    (
        "chat/completions",
        _chat(tools=[{"type": "web", "function": {"name": "f"}}]),
        "tools[0].type: expected one of function",
    ),
    ("chat/completions", _chat(tools=[{"type": "function", "function": {}}]), "tools[0].function.name: required"),
    (
        "chat/completions",
        _chat(tools=[{"type": "function", "function": {"name": "f", "parameters": "{}"}}]),
        "tools[0].function.parameters: expected object",
    ),
    ("chat/completions", _chat(tool_choice="any"), "tool_choice: expected one of auto, none, required"),
    ("chat/completions", _chat(tool_choice=1), "tool_choice: expected string or object"),
    ("chat/completions", _chat(tool_choice={"type": "function"}), "tool_choice.function: required"),
    (
        "chat/completions",
        _chat(tool_choice={"type": "function", "function": {"name": 1}}),
        "tool_choice.function.name: expected string",
    ),
    # chat: response_format
    (
        "chat/completions",
        _chat(response_format={"type": "yaml"}),
        "response_format.type: expected one of text, json_object, json_schema",
    ),
    ("chat/completions", _chat(response_format={}), "response_format.type: required"),
    ("chat/completions", _chat(response_format="json"), "response_format: expected object"),
    ("chat/completions", _chat(response_format={"type": "json_schema"}), "response_format.json_schema: required"),
    (
        "chat/completions",
        _chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": []}}),
        "response_format.json_schema.schema: expected object",
    ),
    (
        "chat/completions",
        _chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "strict": "yes"}}),
        "response_format.json_schema.strict: expected boolean",
    ),
    # completions
    ("completions", {"model": "m", "prompt": 5}, "prompt: expected string or array"),
    ("completions", {"model": "m", "prompt": ["a", 5]}, "prompt[1]: expected string"),
    ("completions", {"model": "m", "prompt": []}, "prompt: expected at least 1 item"),
    ("completions", {"model": "m", "prompt": "x", "echo": "yes"}, "echo: expected boolean"),
    ("completions", {"model": "m", "prompt": "x", "logprobs": "2"}, "logprobs: expected boolean or integer"),
    ("completions", {"model": "m", "prompt": "x", "logprobs": -1}, "logprobs: must be between 0 and 20"),
    ("completions", {"model": "m", "prompt": "x", "repeat_penalty": 3}, "repeat_penalty: must be between 1 and 2"),
    ("completions", {"model": "m", "prompt": "x", "stop": {}}, "stop: expected string or array"),
    # responses
    ("responses", {"model": "m", "input": 3}, "input: expected string or array"),
    ("responses", {"model": "m", "input": []}, "input: expected at least 1 item"),
    (
        "responses",
        {"model": "m", "input": [{"role": "user", "content": 3}]},
        "input[0].content: expected string or array",
    ),
    ("responses", {"model": "m", "input": [{"role": "bot", "content": "x"}]}, "input[0].role: expected one of"),
    ("responses", {"model": "m", "input": [{"content": "x"}]}, "input[0].role: required"),
    ("responses", {"model": "m", "input": [{"type": "web_search_call"}]}, "input[0].type: expected one of message"),
    (
        "responses",
        {"model": "m", "input": [{"role": "user", "content": [{"type": "input_text", "text": 1}]}]},
        "input[0].content[0].text: expected string",
    ),
    (
        "responses",
        {"model": "m", "input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
        "input[0].content[0].type: expected one of input_text",
    ),
    (
        "responses",
        {"model": "m", "input": [{"type": "function_call_output", "output": "x"}]},
        "input[0].call_id: required",
    ),
    ("responses", {"model": "m", "input": "x", "instructions": ["a"]}, "instructions: expected string"),
    ("responses", {"model": "m", "input": "x", "max_output_tokens": 0}, "max_output_tokens: must be >= 1"),
    ("responses", {"model": "m", "input": "x", "temperature": "hot"}, "temperature: expected number"),
    ("responses", {"model": "m", "input": "x", "top_p": 2}, "top_p: must be between 0 and 1"),
    ("responses", {"model": "m", "input": "x", "top_k": 1.5}, "top_k: expected integer"),
    ("responses", {"model": "m", "input": "x", "repeat_penalty": 0}, "repeat_penalty: must be between 1 and 2"),
    ("responses", {"model": "m", "input": "x", "stream": 1}, "stream: expected boolean"),
    (
        "responses",
        {"model": "m", "input": "x", "tools": [{"type": "web_search"}]},
        "tools[0].type: expected one of function",
    ),
    ("responses", {"model": "m", "input": "x", "tools": [{"type": "function"}]}, "tools[0].name: required"),
    ("responses", {"model": "m", "input": "x", "tool_choice": "always"}, "tool_choice: expected one of auto, none"),
    (
        "responses",
        {"model": "m", "input": "x", "text": {"format": {"type": "xml"}}},
        "text.format.type: expected one of",
    ),
    # embeddings
    ("embeddings", {"model": "m", "input": 1}, "input: expected string or array"),
    ("embeddings", {"model": "m", "input": ["a", None]}, "input[1]: expected string, got null"),
    ("embeddings", {"model": "m", "input": []}, "input: expected at least 1 item"),
    (
        "embeddings",
        {"model": "m", "input": "a", "encoding_format": "int8"},
        "encoding_format: expected one of float, base64",
    ),
    ("embeddings", {"model": "m", "input": "a", "dimensions": "64"}, "dimensions: expected integer"),
    ("embeddings", {"model": "m", "input": "a", "dimensions": 0}, "dimensions: must be >= 1"),
    # rerank
    ("rerank", {"model": "m", "query": 1, "documents": ["a"]}, "query: expected string"),
    ("rerank", {"model": "m", "query": "q", "documents": []}, "documents: expected at least 1 item"),
    ("rerank", {"model": "m", "query": "q", "documents": "a"}, "documents: expected array"),
    ("rerank", {"model": "m", "query": "q", "documents": ["a", {"text": "b"}]}, "documents[1]: expected string"),
    ("rerank", {"model": "m", "query": "q", "documents": ["a"], "top_n": "1"}, "top_n: expected integer"),
    (
        "rerank",
        {"model": "m", "query": "q", "documents": ["a"], "return_documents": 1},
        "return_documents: expected boolean",
    ),
    # load / unload
    ("load", {"model_name": 5}, "model_name: expected string"),
    ("load", {"model_name": "m", "save_options": "true"}, "save_options: expected boolean"),
    ("load", {"model_name": "m", "ctx_size": 4096.0}, "ctx_size: expected integer"),
    (
        "load",
        {"model_name": "m", "llamacpp_backend": "tpu"},
        "llamacpp_backend: expected one of vulkan, rocm, metal, cuda, cpu",
    ),
    ("load", {"model_name": "m", "llamacpp_args": ["--no-mmap"]}, "llamacpp_args: expected string"),
    ("load", {"model_name": "m", "llamacpp_args": "--foo 'unclosed"}, "llamacpp_args: cannot parse"),
    ("load", {"model_name": "m", "pinned": "yes"}, "pinned: expected boolean"),
    ("load", {"model_name": "m", "whispercpp_args": "--model x.bin"}, "whispercpp_args: --model is not allowed"),
    ("unload", {"model_name": 1}, "model_name: expected string"),
]


@pytest.mark.parametrize(("route", "body", "message"), INVALID, ids=[m for _, _, m in INVALID])
def test_invalid_argument_names_the_path(route: str, body: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidArgument) as exc:
        validate(route, body)
    assert exc.value.message.startswith(message), exc.value.message
    assert exc.value.status == 400 and exc.value.code == "invalid_argument"


@pytest.mark.parametrize("flag", sorted(FORBIDDEN_LLAMACPP_FLAGS))
@pytest.mark.parametrize("form", ["{flag} 1", "--no-mmap {flag} 1", "--no-mmap {flag}=1", "'{flag}' x"])
def test_forbidden_llamacpp_flags(flag: str, form: str) -> None:
    args = form.format(flag=flag)
    with pytest.raises(InvalidArgument) as exc:
        validate("load", {"model_name": "m", "llamacpp_args": args})
    assert exc.value.message == f"llamacpp_args: {flag} is not allowed (lemonkit sets it)"


def test_spec_forbidden_list_is_covered() -> None:
    # the spec's list for POST /v1/load, plus the aliases the brief calls out; -ngl is the spec's too, but where
    # Lemonade chooses the offload itself, lemonkit's builds let the model's options choose it (llama-server's -ngl)
    spec = {"-m", "--port", "--ctx-size", "--jinja", "--mmproj", "--embeddings", "--reranking"}
    aliases = {"--model", "-c", "--embedding", "--rerank"}
    assert spec | aliases <= FORBIDDEN_LLAMACPP_FLAGS
    assert not {"-ngl", "--n-gpu-layers", "--gpu-layers"} & FORBIDDEN_LLAMACPP_FLAGS


@pytest.mark.parametrize("args", ["--no-mmap -np 2", "--temp=0.5 --ctx-checkpoints 4", "--spec-draft-n-max 3", "-cb"])
def test_allowed_llamacpp_args(args: str) -> None:
    validate("load", {"model_name": "m", "llamacpp_args": args})


def test_unknown_route_is_a_programming_error() -> None:
    with pytest.raises(KeyError):
        validate("nope", {})


def test_long_conversation_validates() -> None:
    body = _msgs(*([U, {"role": "assistant", "content": "x" * 1000}] * 2000))
    assert validate("chat/completions", body)["messages"][-1]["content"] == "x" * 1000


def test_pull_control_and_delete_bodies() -> None:
    validate("pull", {"model_name": "user.x", "checkpoint": "o/r:Q4_K_M", "recipe": "llamacpp", "vision": True})
    validate("pull", {"model_name": "user.k", "recipe": "collection.omni", "components": ["a", "b"]})
    validate("pull", {"model_name": "m", "stream": True, "subscribe": False, "do_not_upgrade": True})
    validate("downloads/control", {"id": "model:m", "action": "remove"})
    validate("delete", {"model_name": "m"})
    with pytest.raises(MissingArgument, match="model_name"):
        validate("pull", {"checkpoint": "o/r"})
    with pytest.raises(InvalidArgument, match="subscribe: expected boolean"):
        validate("pull", {"model_name": "m", "subscribe": "no"})
    with pytest.raises(InvalidArgument, match=r"components: expected at least 1 item"):
        validate("pull", {"model_name": "m", "components": []})
    with pytest.raises(InvalidArgument, match="action: expected one of pause, cancel, remove"):
        validate("downloads/control", {"id": "model:m", "action": "resume"})
    with pytest.raises(MissingArgument, match="id"):
        validate("downloads/control", {"action": "pause"})
