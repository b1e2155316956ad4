"""Every family's tool calls through real HTTP, on a real running server.

Each model is a tiny generated GGUF that carries the family's real chat template and its special tokens. A grammar
(the request's ``grammar``, or the model's ``--grammar``) steers its sampling through that family's recorded output,
so the server parses a stream the engine really generates, token by token, as that family spells it: the call's
id and name come first, then the arguments in pieces, in the chat, Responses, Anthropic and Ollama APIs alike.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from lemonkit.backends.chat import FORMATS
from lemonkit.testing.tiny_gguf import CHATML_TEMPLATE, write_tiny_llama
from tests.support.hosts import API_KEY, Host, Standalone
from tests.support.streams import sse_events
from tests.support.tool_format_cases import ARGUMENTS, CASES, WEATHER, Case, history

REPO = "lemonkit-test/formats-GGUF"
THINKER = "user.fmt-thinker"
CODER = "user.fmt-coder"
FIM = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"]


def _name(case: Case) -> str:
    return "user.fmt-" + case.template.removesuffix(".jinja").replace(".", "-")


def _markers(case: Case) -> list[str]:
    extra = ["<|return|>", "<|call|>"] if case.format == "harmony" else []  # gpt-oss's own end tokens
    return [*FORMATS[case.format].markers, *extra]


async def _steer(client: httpx.AsyncClient, case: Case) -> str:
    """A GBNF grammar that admits exactly the case's output, each marker as the model's special token (``<[id]>``):
    a text literal never matches a control token, and real models write their markup as those tokens."""
    markers = sorted(_markers(case), key=len, reverse=True)
    ids = {}
    for marker in markers:
        tokens = (await client.post("tokenize", json={"model": _name(case), "content": marker})).json()["tokens"]
        assert len(tokens) == 1, (marker, tokens)
        ids[marker] = tokens[0]
    parts, text = [], case.output
    while text:
        hits = [(text.find(m), m) for m in markers if m in text]
        if not hits:
            parts.append(json.dumps(text, ensure_ascii=False))
            break
        j, marker = min(hits, key=lambda h: (h[0], -len(h[1])))
        if j:
            parts.append(json.dumps(text[:j], ensure_ascii=False))
        parts.append(f"<[{ids[marker]}]>")
        text = text[j + len(marker) :]
    return "root ::= " + " ".join(parts)


@pytest.fixture(scope="module")
def formats_host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Host]:
    root: Path = tmp_path_factory.mktemp("formats")
    snapshot = root / "hub" / f"models--{REPO.replace('/', '--')}" / "snapshots" / ("b" * 40)
    snapshot.mkdir(parents=True)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("b" * 40)
    entries = {}
    for case in CASES:
        file = case.template.removesuffix(".jinja") + ".gguf"
        write_tiny_llama(snapshot / file, chat_template=case.source, special_tokens=_markers(case))
        entries[_name(case).removeprefix("user.")] = {"checkpoint": f"{REPO}:{file}", "recipe": "llamacpp"}
    # a ChatML model whose prompt opens the reasoning, as Qwen3's and DeepSeek R1's do
    thinking = CHATML_TEMPLATE.replace(
        "{{- '<|im_start|>assistant\\n' }}", "{{- '<|im_start|>assistant\\n<think>\\n' }}"
    )
    assert thinking != CHATML_TEMPLATE
    write_tiny_llama(snapshot / "thinker.gguf", chat_template=thinking, special_tokens=["<think>", "</think>"])
    entries["fmt-thinker"] = {"checkpoint": f"{REPO}:thinker.gguf", "recipe": "llamacpp"}
    write_tiny_llama(snapshot / "coder.gguf", special_tokens=FIM)  # a model trained for fill-in-the-middle
    entries["fmt-coder"] = {"checkpoint": f"{REPO}:coder.gguf", "recipe": "llamacpp"}
    cache = root / "cache"
    cache.mkdir()
    (cache / "user_models.json").write_text(json.dumps(entries))
    server = Standalone(
        {"HF_HUB_CACHE": str(root / "hub"), "LEMONADE_CACHE_DIR": str(cache), "LEMONADE_API_KEY": API_KEY}
    )
    yield Host("standalone", server.root, API_KEY)
    server.stop()


def _body(case: Case, **extra: object) -> dict:
    body: dict = {
        "model": _name(case),
        "messages": history(case),
        "tools": [WEATHER],
        "temperature": 0,
        "max_tokens": 800,
        **extra,
    }
    if case.thinking is not None:
        body["chat_template_kwargs"] = {"enable_thinking": case.thinking}
    return body


def _check_id(case: Case, call_id: str) -> None:
    if FORMATS[case.format].call_ids == "mistral":
        assert len(call_id) == 9 and call_id.isalnum()  # what Mistral's templates accept back
    else:
        assert call_id.startswith("call_")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.template)
async def test_chat_stream_parses_the_family_format(formats_host: Host, case: Case) -> None:
    async with formats_host.client() as client:
        body = _body(case, grammar=await _steer(client, case), logprobs=True)
        chunks = await sse_events(client, "chat/completions", body)
        parts = [p for c in chunks for ch in c["choices"] for p in ch["delta"].get("tool_calls") or []]
        head, rest = parts[0], parts[1:]
        assert head["function"] == {"name": "get_weather", "arguments": ""} and head["type"] == "function"
        _check_id(case, head["id"])
        pieces = [p["function"]["arguments"] for p in rest]
        assert all("id" not in p and p["index"] == 0 for p in rest)
        assert len([p for p in pieces if p]) >= 2  # the arguments in pieces, as they were written
        assert json.loads("".join(pieces)) == ARGUMENTS
        deltas = [ch["delta"] for c in chunks for ch in c["choices"]]
        reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
        content = "".join(d.get("content") or "" for d in deltas)
        assert reasoning == (case.reasoning or "") and content == (case.content or "")
        finish = [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]]
        assert finish == ["tool_calls"]
        # the markup came as the family's special tokens, rendered as text for the parser
        tokens = [t["token"] for c in chunks for ch in c["choices"] for t in (ch["logprobs"] or {}).get("content", [])]
        assert any(t in _markers(case) for t in tokens) or not any(m in case.output for m in _markers(case))
        whole = (await client.post("chat/completions", json=body)).json()["choices"][0]
        (call,) = whole["message"]["tool_calls"]
        _check_id(case, call["id"])
        assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == ARGUMENTS
        assert whole["message"].get("reasoning_content") == case.reasoning
        assert whole["message"]["content"] == case.content and whole["finish_reason"] == "tool_calls"


async def test_every_api_streams_the_call(formats_host: Host) -> None:
    """Qwen3-Coder's XML calls, steered by the model's own ``--grammar``, in all four APIs."""
    (case,) = [c for c in CASES if c.format == "qwen3_coder"]
    model = _name(case)
    ask = [{"role": "user", "content": "Weather in Paris for three days?"}]
    async with formats_host.client() as client:
        grammar = await _steer(client, case)
        loaded = await client.post(
            "load", json={"model_name": model, "llamacpp_args": "--grammar " + shlex.quote(grammar)}
        )
        assert loaded.status_code == 200, loaded.text
        # OpenAI Responses: an output item for the call, then its arguments in deltas
        events = await sse_events(client, "responses", {"model": model, "input": ask, "tools": [_response_tool()]})
        kinds = [e["type"] for e in events]
        added = next(
            e for e in events if e["type"] == "response.output_item.added" and e["item"]["type"] == "function_call"
        )
        assert added["item"]["name"] == "get_weather"
        deltas = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
        assert len(deltas) >= 2 and json.loads("".join(deltas)) == ARGUMENTS
        assert kinds.index("response.output_item.added") < kinds.index("response.function_call_arguments.delta")
        # Anthropic: a tool_use block, its input in input_json_delta pieces
        anthropic_tool = {"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}
        events = await sse_events(
            client, "messages", {"model": model, "max_tokens": 800, "messages": ask, "tools": [anthropic_tool]}
        )
        start = next(
            e for e in events if e["type"] == "content_block_start" and e["content_block"]["type"] == "tool_use"
        )
        assert start["content_block"]["name"] == "get_weather"
        partial = [e["delta"]["partial_json"] for e in events if e.get("delta", {}).get("type") == "input_json_delta"]
        assert len([p for p in partial if p]) >= 2 and json.loads("".join(partial)) == ARGUMENTS
        stop = next(e for e in events if e["type"] == "message_delta")
        assert stop["delta"]["stop_reason"] == "tool_use"
    # Ollama: the call whole, its arguments an object (Ollama's shape)
    async with httpx.AsyncClient(base_url=formats_host.root, headers=formats_host.headers, timeout=120) as http:
        body = {"model": model, "messages": ask, "tools": [WEATHER], "stream": True}
        calls = []
        async with http.stream("POST", "api/chat", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.strip():
                    calls += json.loads(line).get("message", {}).get("tool_calls") or []
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [("get_weather", ARGUMENTS)]
        # a call goes out once its arguments are whole, before the text that follows it (LFM2 writes text after)
        (lfm2,) = [c for c in CASES if c.format == "lfm2"]
        async with formats_host.client() as client:
            steer = "--grammar " + shlex.quote(await _steer(client, lfm2))
            assert (await client.post("load", json={"model_name": _name(lfm2), "llamacpp_args": steer})).is_success
        order = []
        async with http.stream("POST", "api/chat", json={**body, "model": _name(lfm2)}) as response:
            async for line in response.aiter_lines():
                message = json.loads(line).get("message") or {}
                order += ["call"] * len(message.get("tool_calls") or []) + ["text"] * bool(message.get("content"))
        assert "call" in order and order.index("call") < order.index("text")


def _response_tool() -> dict:
    fn = WEATHER["function"]
    return {"type": "function", "name": fn["name"], "description": fn["description"], "parameters": fn["parameters"]}


async def test_reasoning_budget(formats_host: Host) -> None:
    body = {"model": THINKER, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 40, "temperature": 0}
    async with formats_host.client() as client:
        free = (await client.post("chat/completions", json=body)).json()["choices"][0]["message"]
        assert free["reasoning_content"] and not free["content"]  # noise never closes its reasoning

        async def reasoning_tokens(text: str) -> int:
            return len((await client.post("tokenize", json={"model": THINKER, "content": text})).json()["tokens"])

        for budget in ({"reasoning_budget": 5}, {"thinking": {"type": "enabled", "budget_tokens": 5}}):
            capped = (await client.post("chat/completions", json={**body, **budget})).json()["choices"][0]["message"]
            assert capped["reasoning_content"] and capped["content"]  # the close tag was written after 5 tokens
            assert await reasoning_tokens(capped["reasoning_content"]) <= 6
            assert capped["reasoning_content"] in free["reasoning_content"]  # the same greedy start, cut short
        # Anthropic's thinking budget reaches the engine
        messages = {
            "model": THINKER,
            "max_tokens": 40,
            "temperature": 0,
            "messages": [{"role": "user", "content": "hi"}],
        }
        answer = await client.post("messages", json={**messages, "thinking": {"type": "enabled", "budget_tokens": 5}})
        kinds = [b["type"] for b in answer.json()["content"]]
        assert kinds == ["thinking", "text"]
        # and the model's --reasoning-budget is the default
        await client.post("load", json={"model_name": THINKER, "llamacpp_args": "--reasoning-budget 5"})
        default = (await client.post("chat/completions", json=body)).json()["choices"][0]["message"]
        assert default["content"] and await reasoning_tokens(default["reasoning_content"]) <= 6
        # under a grammar the budget writes nothing: a forced close would break what the grammar allows
        steered = {**body, "reasoning_budget": 2, "grammar": 'root ::= "one two three four five"'}
        held = (await client.post("chat/completions", json=steered)).json()["choices"][0]["message"]
        assert held["reasoning_content"] == "one two three four five" and not held["content"]
        bad = await client.post("chat/completions", json={**body, "reasoning_budget": -2})
        assert bad.status_code == 400


async def test_fill_in_the_middle(formats_host: Host) -> None:
    """``suffix`` on completions (and Ollama's generate): the prompt laid out around the model's FIM tokens."""
    prefix, suffix = "def add(a, b):\n    return ", "\n\nprint(add(1, 2))\n"
    async with formats_host.client() as client:

        async def count(text: str) -> int:
            return len((await client.post("tokenize", json={"model": CODER, "content": text})).json()["tokens"])

        body = {"model": CODER, "prompt": prefix, "suffix": suffix, "max_tokens": 8, "grammar": 'root ::= "a + b"'}
        answer = (await client.post("completions", json=body)).json()
        assert answer["choices"][0]["text"] == "a + b"
        # BOS, the three FIM tokens, and the two texts
        assert answer["usage"]["prompt_tokens"] == 1 + 3 + await count(prefix) + await count(suffix)
        plain = (await client.post("completions", json={**body, "suffix": None})).json()
        assert plain["usage"]["prompt_tokens"] == 1 + await count(prefix)
    async with httpx.AsyncClient(base_url=formats_host.root, headers=formats_host.headers, timeout=120) as http:
        generated = await http.post(
            "api/generate",
            json={"model": CODER, "prompt": prefix, "suffix": suffix, "stream": False, "options": {"num_predict": 3}},
        )
        assert generated.status_code == 200 and generated.json()["done"]
        assert generated.json()["prompt_eval_count"] == answer["usage"]["prompt_tokens"]
