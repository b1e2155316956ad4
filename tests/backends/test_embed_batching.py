"""Embeddings and rerank decode all the inputs of one request together: one ``llama_decode``, one sequence each.

llama.cpp's decode is counted by wrapping ``llama_cpp.llama_cpp.llama_decode`` (the function both
``Llama.embed`` and :mod:`lemonkit.backends.llama_rank` reach) for the test only; the real decode still runs on the
tiny generated models, and the batched results must equal the results of the inputs sent one by one.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import llama_cpp.llama_cpp as ll
import pytest

from lemonkit.backends.llamacpp import LlamaCppEngine
from lemonkit.testing.tiny_gguf import write_tiny_bert_embedding, write_tiny_bert_reranker

TEXTS = ["hello world", "the answer is yes", "a much longer third input with several more words in it", "x"]


@pytest.fixture
def decodes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The token count of each ``llama_decode`` call, in order."""
    calls: list[int] = []
    real = ll.llama_decode

    def counting(ctx: Any, batch: Any) -> int:
        calls.append(batch.n_tokens)
        return int(real(ctx, batch))

    monkeypatch.setattr(ll, "llama_decode", counting)
    return calls


@pytest.fixture
def embedder(tmp_path: Path) -> Iterator[LlamaCppEngine]:
    engine = LlamaCppEngine({"model_path": str(write_tiny_bert_embedding(tmp_path / "e.gguf")), "type": "embedding"})
    yield engine
    engine.close()


@pytest.fixture
def reranker(tmp_path: Path) -> Iterator[LlamaCppEngine]:
    engine = LlamaCppEngine({"model_path": str(write_tiny_bert_reranker(tmp_path / "r.gguf")), "type": "reranking"})
    yield engine
    engine.close()


def test_embeddings_of_one_request_share_one_decode(embedder: LlamaCppEngine, decodes: list[int]) -> None:
    batched = embedder.embed({"model": "e", "input": TEXTS})
    assert len(decodes) == 1, decodes  # every input in the same batch
    assert decodes[0] == batched["usage"]["prompt_tokens"]  # ... all their tokens, each input its own sequence
    for i, text in enumerate(TEXTS):
        decodes.clear()
        alone = embedder.embed({"model": "e", "input": text})
        assert len(decodes) == 1
        assert batched["data"][i]["embedding"] == pytest.approx(alone["data"][0]["embedding"], abs=1e-5)


def test_rerank_of_one_request_shares_one_decode(reranker: LlamaCppEngine, decodes: list[int]) -> None:
    query = "what is the answer"
    batched = reranker.rerank({"model": "r", "query": query, "documents": TEXTS})
    assert len(decodes) == 1, decodes
    assert decodes[0] == batched["usage"]["prompt_tokens"]
    scores = {r["index"]: r["relevance_score"] for r in batched["results"]}
    for i, text in enumerate(TEXTS):
        decodes.clear()
        (alone,) = reranker.rerank({"model": "r", "query": query, "documents": [text]})["results"]
        assert len(decodes) == 1
        assert scores[i] == pytest.approx(alone["relevance_score"], abs=1e-5)
    assert len(set(scores.values())) > 1  # the documents are told apart: the sequences did not mix
