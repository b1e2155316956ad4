"""The tiny GGUF writers produce models llama.cpp really loads and runs, fast (real llama_cpp, no mocks)."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lemonkit.testing.tiny_gguf import write_tiny_bert_embedding, write_tiny_bert_reranker, write_tiny_llama

llama_cpp = pytest.importorskip("llama_cpp")

from llama_cpp import Llama  # noqa: E402

from lemonkit.backends.llama_rank import rank_scores  # noqa: E402  (needs llama_cpp)

Writer = Callable[..., Path]
WRITERS = [write_tiny_llama, write_tiny_bert_embedding, write_tiny_bert_reranker]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {writer.__name__: writer(root / f"{writer.__name__}.gguf") for writer in WRITERS}


@pytest.fixture(scope="module")
def chat_llm(models: dict[str, Path]) -> Llama:
    return llama_cpp.Llama(model_path=str(models["write_tiny_llama"]), n_ctx=512, n_threads=2, verbose=False)


@pytest.fixture(scope="module")
def embed_llm(models: dict[str, Path]) -> Llama:
    return llama_cpp.Llama(model_path=str(models["write_tiny_bert_embedding"]), embedding=True, verbose=False)


def load_reranker(path: Path, **kwargs: Any) -> Llama:
    return llama_cpp.Llama(
        model_path=str(path), embedding=True, pooling_type=llama_cpp.LLAMA_POOLING_TYPE_RANK, verbose=False, **kwargs
    )


@pytest.fixture(scope="module")
def rank_llm(models: dict[str, Path]) -> Llama:
    return load_reranker(models["write_tiny_bert_reranker"])


# --------------------------------------------------------------------------- writing


@pytest.mark.parametrize("writer", WRITERS, ids=lambda w: w.__name__)
def test_writing_is_deterministic(writer: Writer, tmp_path: Path) -> None:
    first = writer(tmp_path / "sub" / "a.gguf")  # creates missing parent dirs
    again = writer(tmp_path / "b.gguf")
    other = writer(tmp_path / "c.gguf", seed=1)
    assert first == tmp_path / "sub" / "a.gguf"
    assert first.read_bytes() == again.read_bytes()
    assert first.read_bytes() != other.read_bytes()
    assert first.stat().st_size < 2_000_000


# --------------------------------------------------------------------------- chat model


def test_llama_metadata_and_tokenizer_round_trip(chat_llm: Llama) -> None:
    llm = chat_llm
    assert llm.metadata["general.name"] == "tiny-llama-chatml"
    assert llm.chat_format == "chat_template.default"
    text = "hello world, The answer is 42! é ✓ 日本\n"
    tokens = llm.tokenize(text.encode())
    assert llm.detokenize(tokens).decode() == text  # byte fallback: any UTF-8 round-trips
    assert len(llm.tokenize(b"hello world", add_bos=False)) == 2
    chatml = llm.tokenize(b"<|im_start|>user", add_bos=False, special=True)
    assert llm.detokenize(chatml[:1], special=True) == b"<|im_start|>"


def test_llama_chat_returns_ascii_text_until_max_tokens(chat_llm: Llama) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    result = chat_llm.create_chat_completion(messages, max_tokens=32, temperature=0)
    choice = result["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert choice["message"]["content"] and choice["message"]["content"].isascii()
    # Special tokens are never picked, so only max_tokens ends a greedy reply.
    assert choice["finish_reason"] == "length"
    assert result["usage"]["completion_tokens"] == 32


def test_llama_stream_matches_non_stream_and_stays_ascii(chat_llm: Llama) -> None:
    messages = [{"role": "user", "content": "tell me a story"}]
    full = chat_llm.create_chat_completion(messages, max_tokens=64, temperature=0)
    chunks = list(chat_llm.create_chat_completion(messages, max_tokens=200, temperature=0, stream=True))
    text = "".join(chunk["choices"][0]["delta"].get("content") or "" for chunk in chunks)
    assert len(chunks) > 10
    assert text.startswith(full["choices"][0]["message"]["content"])
    # Byte tokens are zeroed so greedy output stays ASCII: streaming non-UTF-8 output would cost 12-15 ms a token
    # while llama-cpp-python holds back partial characters (speed itself is measured in benchmarks/, not here).
    assert text.isascii()


def test_llama_template_renders_tools_hermes_style(chat_llm: Llama) -> None:
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    template = chat_llm.metadata["tokenizer.chat_template"]
    formatter = Jinja2ChatFormatter(template, eos_token="<|im_end|>", bos_token="<s>")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    prompt = formatter(messages=messages, tools=tools).prompt
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>' in prompt
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")
    # A tool-enabled chat request runs end to end.
    result = chat_llm.create_chat_completion(messages, tools=tools, max_tokens=4, temperature=0)
    assert result["usage"]["prompt_tokens"] > 100


# --------------------------------------------------------------------------- embeddings


def test_bert_embedding_dim_and_distinct_vectors(embed_llm: Llama) -> None:
    texts = ["hello world", "other text", "Hello, World! Ünïcode ✓"]
    result = embed_llm.create_embedding(texts)
    vectors = np.array([item["embedding"] for item in result["data"]])
    assert vectors.shape == (3, 64)
    assert np.isfinite(vectors).all()
    assert not np.allclose(vectors[0], vectors[1])
    assert result["usage"]["prompt_tokens"] > 0
    again = np.array(embed_llm.create_embedding(["hello world"])["data"][0]["embedding"])
    np.testing.assert_allclose(again, vectors[0], atol=1e-5)  # batch composition: float noise only


def test_bert_tokenizes_ascii_without_unknowns(embed_llm: Llama) -> None:
    tokens = embed_llm.tokenize(b"The quick brown fox, #42 (jumps) over it!")
    unk = embed_llm.metadata["tokenizer.ggml.unknown_token_id"]
    assert str(unk) not in map(str, tokens)


# --------------------------------------------------------------------------- rerank


def test_rank_scores_one_finite_score_per_document(rank_llm: Llama) -> None:
    docs = ["the answer is 42", "water is wet", "people like long walks", "the answer is 42"]
    scores, n_tokens = rank_scores(rank_llm, "what is the answer", docs)
    assert len(scores) == len(docs)
    assert all(isinstance(s, float) and math.isfinite(s) for s in scores)
    assert len(set(scores[:3])) == 3
    assert scores[0] == pytest.approx(scores[3], abs=1e-5)
    assert rank_scores(rank_llm, "what is the answer", docs) == (scores, n_tokens)
    assert rank_scores(rank_llm, "something else", docs[:1])[0] != scores[:1]


def test_rank_prompt_layout_matches_llama_server(rank_llm: Llama) -> None:
    # WPM vocab: [CLS] query [SEP] document (no EOS), as llama.cpp's format_prompt_rerank builds it.
    query, doc = "what is it", "the answer"
    n_query = len(rank_llm.tokenize(query.encode(), add_bos=False))
    n_doc = len(rank_llm.tokenize(doc.encode(), add_bos=False))
    assert rank_scores(rank_llm, query, [doc])[1] == n_query + n_doc + 2
    assert rank_scores(rank_llm, query, []) == ([], 0)


def test_rank_scores_many_long_documents_across_batches(rank_llm: Llama) -> None:
    docs = [f"document {i}: " + "some long text about water and people " * (5 + i % 7) for i in range(40)]
    scores, n_tokens = rank_scores(rank_llm, "water", docs)
    assert n_tokens > 2 * rank_llm.n_batch  # several batches were needed
    assert len(scores) == 40 and all(math.isfinite(s) for s in scores)
    assert len(set(scores)) > 30
    # Batch composition does not change a document's score.
    alone = [rank_scores(rank_llm, "water", [doc])[0][0] for doc in (docs[0], docs[17], docs[39])]
    assert alone == pytest.approx([scores[0], scores[17], scores[39]], abs=1e-5)


def test_rank_truncates_a_document_longer_than_the_context(models: dict[str, Path]) -> None:
    llm = load_reranker(models["write_tiny_bert_reranker"], n_ctx=64)
    scores, n_tokens = rank_scores(llm, "water", ["water " * 500, "short"])
    assert n_tokens <= 2 * 64 and len(scores) == 2 and all(math.isfinite(s) for s in scores)
    with pytest.raises(ValueError, match="query is too long"):
        rank_scores(llm, "water " * 100, ["doc"])


def test_rank_scores_refuses_a_model_without_rank_pooling(embed_llm: Llama, chat_llm: Llama) -> None:
    for llm in (embed_llm, chat_llm):
        with pytest.raises(ValueError, match="LLAMA_POOLING_TYPE_RANK"):
            rank_scores(llm, "q", ["d"])
