"""The Python API (``lemonkit.chat``, ``Chat``, ``embed``, ``rerank``, ``structured``, ``models``, provenance and
replay) through ``lemonkit.Client`` against both hosts, real HTTP, on the tiny generated models."""

from __future__ import annotations

import asyncio
import hashlib
import json
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pydantic
import pytest

import lemonkit
from lemonkit.client import AsyncClient, Client, api_requests
from lemonkit.errors import NotEmbeddingModel
from tests.support.hosts import Host
from tests.support.session import HF_CACHE
from tests.support.tiny_models import EMBED, RERANK, TEST_REPO, TINY, TINY_B

SNAPSHOT = HF_CACHE / f"models--{TEST_REPO.replace('/', '--')}" / "snapshots" / ("a" * 40)


@pytest.fixture(autouse=True)
def defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    """The embedded defaults are bundled models of other branches: the tiny ones stand in for them."""
    monkeypatch.setenv("LEMONKIT_DEFAULT_CHAT_MODEL", TINY)
    monkeypatch.setenv("LEMONKIT_DEFAULT_EMBEDDING_MODEL", EMBED)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _in_thread(host: Host, calls: Any) -> Any:
    def run() -> Any:
        with Client(host.root, token=host.token) as client:
            return calls(client)

    return asyncio.to_thread(run)


async def test_chat_streams_to_stdout_and_carries_provenance(host: Host, capsys: pytest.CaptureFixture[str]) -> None:
    def calls(client: Client) -> lemonkit.ChatResult:
        client.unload()
        return client.chat("Say hello.", max_tokens=12, temperature=0.7)

    result = await _in_thread(host, calls)
    printed = capsys.readouterr().out
    assert result.text and printed == result.text + "\n"  # every token printed as it came, then a newline
    assert result.finish_reason == "length" and result.usage["completion_tokens"] == 12
    assert result.timings["predicted_n"] == 12
    assert len(result.raw) > 12 and result.raw[-1]["choices"] == []  # the chunks, the usage chunk last
    facts = result.provenance
    assert facts["model"] == TINY  # model=None, nothing loaded: the default chat model
    assert facts["checkpoint"] == f"{TEST_REPO}:tiny-llama.gguf"
    assert facts["revision"] == "a" * 40
    assert facts["file_sha256"] == _sha256(SNAPSHOT / "tiny-llama.gguf")
    assert facts["recipe_options"]["ctx_size"] > 0 and facts["engine"].startswith("llama-cpp-python-")
    assert facts["server_version"] == facts["lemonkit_version"] == lemonkit.__version__
    assert isinstance(facts["seed"], int) and facts["request"]["seed"] == facts["seed"]  # a seed was chosen
    assert facts["sampling"] == {"max_tokens": 12, "temperature": 0.7, "seed": facts["seed"]}
    assert facts["server"] == host.api and facts["wall_time_s"] > 0 and facts["route"] == "chat/completions"


async def test_replay_matches_a_seeded_request_and_reports_a_changed_one(host: Host) -> None:
    def calls(client: Client) -> tuple[Any, ...]:
        streamed = client.chat("Tell me a story.", TINY, max_tokens=16, temperature=1.0)
        again = lemonkit.replay(streamed, client=client)  # streamed first, replayed whole: same tokens
        # the same request on other weights: not a match, and the provenance says why
        other = client.chat(
            "Tell me a story.", TINY_B, max_tokens=16, temperature=1.0, seed=streamed.provenance["seed"]
        )
        other.provenance["request"]["model"] = TINY
        return streamed, again, lemonkit.replay(other, client=client)

    streamed, again, changed = await _in_thread(host, calls)
    assert again.matched and bool(again) and again.diff == "" and again.changed == {}
    assert again.result.text == streamed.text and again.result.provenance["seed"] == streamed.provenance["seed"]
    assert not changed.matched and changed.diff.startswith("--- original")
    assert set(changed.changed) >= {"model", "checkpoint", "file_sha256"}
    with pytest.raises(ValueError, match="replayed"):
        lemonkit.replay(lemonkit.ChatResult(text="typed in by hand"))


async def test_the_provenance_header_on_every_inference_route(host: Host) -> None:
    chat = {"model": TINY, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with host.client() as client:
        for path, body in (
            ("chat/completions", chat),
            ("chat/completions", {**chat, "stream": True}),
            ("completions", {"model": TINY, "prompt": "a", "max_tokens": 2}),
            ("responses", {"model": TINY, "input": "hi", "max_output_tokens": 2}),
            ("embeddings", {"model": EMBED, "input": "hi"}),
            ("rerank", {"model": RERANK, "query": "q", "documents": ["a", "b"]}),
        ):
            response = await client.post(path, json=body)
            assert response.status_code == 200, response.text
            facts = json.loads(response.headers["X-Lemonkit-Provenance"])
            assert facts["model"] == body["model"] and facts["revision"] == "a" * 40, path
            assert facts["file_sha256"] == _sha256(SNAPSHOT / facts["file"])
        missing = await client.post("chat/completions", json={**chat, "model": "user.no-such-model"})
        assert missing.status_code == 404 and "X-Lemonkit-Provenance" not in missing.headers


async def test_model_none_is_the_loaded_llm(host: Host) -> None:
    def calls(client: Client) -> tuple[str, str]:
        client.load(TINY_B)
        client.embed("warm")  # an embedding model used last: still the LLM answers
        answer = client.chat("hi", stream=False, max_tokens=2)
        completion = client.complete("once upon", stream=False, max_tokens=3)
        return answer.provenance["model"], completion.provenance["model"]

    assert await _in_thread(host, calls) == (TINY_B, TINY_B)


async def test_embed_and_rerank(host: Host) -> None:
    texts = ["a cat sat", "stock markets fell", "a kitten slept"]

    def calls(client: Client) -> tuple[Any, ...]:
        vectors = client.embed(texts)
        one = client.embed("a cat sat")
        ranked = client.rerank("cats", texts)  # model=None: the downloaded reranking model
        by_vectors = api_requests.cosine_ranking(client.embed(["a cat sat", *texts]), texts, EMBED)
        return vectors, one, ranked, by_vectors

    vectors, one, ranked, by_vectors = await _in_thread(host, calls)
    assert isinstance(vectors, np.ndarray) and vectors.dtype == np.float32 and vectors.shape[0] == 3
    assert vectors.shape[1] > 0 and vectors.provenance["model"] == EMBED
    np.testing.assert_allclose(one[0], vectors[0], rtol=1e-5)
    assert ranked.method == "rerank" and ranked.model == RERANK
    assert sorted(r.index for r in ranked) == [0, 1, 2] and [r.document for r in ranked] == [
        texts[r.index] for r in ranked
    ]
    assert [r.score for r in ranked] == sorted((r.score for r in ranked), reverse=True)
    # the fallback without a reranker: the identical document ranks first, with cosine 1
    assert by_vectors.method == "embedding-cosine" and by_vectors[0].index == 0
    assert by_vectors[0].score == pytest.approx(1.0, abs=1e-5)


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=8)
    age: int = pydantic.Field(ge=0, le=120)
    member: bool


async def test_structured_with_pydantic_and_a_schema(host: Host) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["n"]}

    def calls(client: Client) -> tuple[Any, ...]:
        person = client.structured("Describe a person.", Person, TINY, max_tokens=200, seed=3)
        number = client.structured("Pick a number.", schema, TINY, max_tokens=50, seed=3)
        with pytest.raises(lemonkit.StructuredOutputError) as cut:
            client.structured("Describe a person.", Person, TINY, max_tokens=3)
        return person, number, cut.value

    person, number, cut = await _in_thread(host, calls)
    assert isinstance(person, Person) and len(person.name) <= 8 and 0 <= person.age <= 120
    assert isinstance(number, dict) and 1 <= number["n"] <= 9
    assert cut.result.finish_reason == "length" and isinstance(cut, ValueError)


async def test_chat_history_save_and_load(host: Host, tmp_path: Path) -> None:
    def calls(client: Client) -> tuple[Any, ...]:
        chat = lemonkit.Chat(TINY, system="Be brief.", client=client, max_tokens=4)
        first = chat.send("hello", stream=False)
        chat.send("again", stream=False, max_tokens=2)
        chat.save(tmp_path / "chat.json")
        loaded = lemonkit.Chat.load(tmp_path / "chat.json", client=client)
        before = list(loaded.messages)
        third = loaded.send("and once more", stream=False)
        with pytest.raises(lemonkit.InvalidRequest):
            loaded.send("lost", max_tokens=-5)
        return chat, first, before, loaded, third

    chat, first, before, loaded, third = await _in_thread(host, calls)
    assert [m["role"] for m in chat.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert chat.messages[2]["content"] == first.text
    assert before == chat.messages and loaded.sampling == {"max_tokens": 4} and loaded.model == TINY
    assert third.provenance["request"]["messages"] == [*chat.messages, {"role": "user", "content": "and once more"}]
    assert len(loaded.messages) == 7 and loaded.messages[-1]["content"] == third.text  # the failed turn left none
    saved = json.loads((tmp_path / "chat.json").read_text())
    assert saved["messages"] == chat.messages and saved["system"] == "Be brief."
    loaded.reset()
    assert loaded.messages == [{"role": "system", "content": "Be brief."}]


async def test_models_list(host: Host) -> None:
    def calls(client: Client) -> tuple[Any, ...]:
        return client.models(), client.models(all=True), client.stats()

    downloaded, every, stats = await _in_thread(host, calls)
    assert isinstance(downloaded, lemonkit.ModelList) and TINY in [m["id"] for m in downloaded]
    assert len(every) > len(downloaded)
    frame = downloaded.to_pandas()
    assert frame.loc[TINY, "recipe"] == "llamacpp" and bool(frame.loc[TINY, "downloaded"])
    bundle = downloaded._repr_mimebundle_()
    assert "text/html" in bundle or "application/vnd.jupyter.widget-view+json" in bundle
    assert set(stats) >= {"tokens_per_second", "output_tokens"}


async def test_async_client_api(host: Host, capsys: pytest.CaptureFixture[str]) -> None:
    async with AsyncClient(host.root, token=host.token) as client:
        streamed = await client.chat("hi", TINY, max_tokens=6, seed=5)
        whole = await client.chat("hi", TINY, stream=False, max_tokens=6, seed=5)
        vectors = await client.embed(["a", "b"])
        ranked = await client.rerank("q", ["a", "b"], RERANK)
        models = await client.models()
        await client.unload()
    assert capsys.readouterr().out == streamed.text + "\n"
    assert streamed.text == whole.text and whole.provenance["revision"] == "a" * 40
    assert vectors.shape[0] == 2 and ranked.method == "rerank" and TINY in [m["id"] for m in models]


async def test_errors_are_lemonkit_errors(host: Host) -> None:
    def calls(client: Client) -> None:
        with pytest.raises(lemonkit.ModelNotFound):
            client.chat("hi", "user.no-such-model")
        with pytest.raises(lemonkit.InvalidRequest) as bad:
            client.chat("hi", TINY, max_tokens=-5)
        assert bad.value.status == 400
        with pytest.raises(NotEmbeddingModel) as wrong:
            client.embed("hi", TINY)
        assert (wrong.value.status, wrong.value.code) == (501, "model_not_applicable")

    await _in_thread(host, calls)


def test_the_openai_client_reaches_the_same_server(monkeypatch: pytest.MonkeyPatch, standalone: Any) -> None:
    from tests.support.hosts import API_KEY

    monkeypatch.setenv("LEMONKIT_URL", standalone.root)
    monkeypatch.setenv("LEMONKIT_TOKEN", API_KEY)
    client = Client()
    assert lemonkit.openai_url(client) == standalone.root + "api/v1"
    oai = lemonkit.openai_client(client, max_retries=0)
    assert oai.api_key == API_KEY and TINY in [m.id for m in oai.models.list()]
    answer = oai.chat.completions.with_raw_response.create(
        model=TINY, messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert json.loads(answer.headers["x-lemonkit-provenance"])["model"] == TINY
    assert isinstance(lemonkit.async_openai_client(client), __import__("openai").AsyncOpenAI)
    httpx.post(standalone.root + "api/v1/unload", headers={"Authorization": f"Bearer {API_KEY}"}, json={})


async def test_tool_calls_streamed_and_whole(host: Host, capsys: pytest.CaptureFixture[str]) -> None:
    tools = [
        {
            "type": "function",
            "function": {
                "name": "lookup",
                "parameters": {
                    "type": "object",
                    "properties": {"q": {"type": "string", "maxLength": 8}},
                    "required": ["q"],
                },
            },
        }
    ]

    def calls(client: Client) -> tuple[lemonkit.ChatResult, lemonkit.ChatResult]:
        kwargs: dict[str, Any] = {"tools": tools, "tool_choice": "required", "max_tokens": 64, "seed": 11}
        return client.chat("find", TINY, **kwargs), client.chat("find", TINY, stream=False, **kwargs)

    streamed, whole = await _in_thread(host, calls)
    for result in (streamed, whole):
        (call,) = result.tool_calls
        assert result.finish_reason == "tool_calls" and call["function"]["name"] == "lookup" and call["id"]
        assert isinstance(json.loads(call["function"]["arguments"])["q"], str)
        assert result.message["tool_calls"] == result.tool_calls
    assert streamed.tool_calls[0]["function"] == whole.tool_calls[0]["function"]  # the same seed, folded alike


def test_the_module_functions_are_not_shadowed_by_submodules() -> None:
    import importlib
    import pkgutil

    for module in pkgutil.iter_modules(lemonkit.__path__):
        importlib.import_module(f"lemonkit.{module.name}")
    for name in ("chat", "complete", "embed", "rerank", "structured", "models", "map", "replay", "load", "stats"):
        assert callable(getattr(lemonkit, name)) and not isinstance(getattr(lemonkit, name), type(lemonkit)), name
    assert "lemonkit.chat(" in (lemonkit.chat.__doc__ or "") and "Client()" not in (lemonkit.chat.__doc__ or "")
