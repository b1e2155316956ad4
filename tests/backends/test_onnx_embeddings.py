"""The ``onnxruntime`` recipe's embedding engine on the bundled all-MiniLM-L6-v2 (converted once into a temp cache):
its vectors, truncation at the model's window, token counts, and the errors of a directory it cannot load."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from lemonkit.backends.onnx_embeddings import OnnxEmbeddingEngine
from lemonkit.catalog.config import DEFAULT_EMBEDDING_MODEL
from lemonkit.catalog.registry import Registry
from lemonkit.errors import InvalidArgument, ModelLoadError, ModelNotApplicable


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cache = tmp_path_factory.mktemp("onnx-cache")
    registry = Registry(cache, hf_cache=cache / "hub")
    return registry.resolve(registry.get(DEFAULT_EMBEDDING_MODEL)).main


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[OnnxEmbeddingEngine]:
    engine = OnnxEmbeddingEngine({"model_path": str(model_dir), "type": "embedding", "options": {"n_threads": 1}})
    yield engine
    engine.close()


def _vectors(engine: OnnxEmbeddingEngine, texts: list[str]) -> np.ndarray:
    return np.array([d["embedding"] for d in engine.embed({"model": "m", "input": texts})["data"]])


def test_vectors_are_unit_length_and_batch_independent(engine: OnnxEmbeddingEngine) -> None:
    texts = [f"sentence number {i} about {'cats' if i % 2 else 'markets'}" for i in range(40)]  # more than a batch
    answer = engine.embed({"model": "m", "input": texts})
    vectors = np.array([d["embedding"] for d in answer["data"]])
    assert vectors.shape == (40, 384) and [d["index"] for d in answer["data"]] == list(range(40))
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-6)
    one = _vectors(engine, [texts[7]])[0]  # alone: no padding
    assert np.dot(one, vectors[7]) > 1 - 1e-6
    # "hello world" is [CLS] hello world [SEP]
    assert engine.embed({"model": "m", "input": "hello world"})["usage"] == {"prompt_tokens": 4, "total_tokens": 4}
    assert engine.stats()["input_tokens"] == 4 and engine.info()["ctx_size"] == engine.max_tokens == 256
    assert np.linalg.norm(_vectors(engine, [""])[0]) == pytest.approx(1.0)  # [CLS] [SEP]: an input like any other


def test_inputs_are_truncated_at_the_window(engine: OnnxEmbeddingEngine) -> None:
    long, longer = "word " * 300, "word " * 400 + "something else entirely"
    a, b = _vectors(engine, [long, longer])
    assert np.dot(a, b) > 1 - 1e-6  # both cut at 256 tokens: the tail is never read
    assert engine.stats()["input_tokens"] == 2 * engine.max_tokens


@pytest.mark.parametrize("value", [[], None, ["ok", 3], {"text": "x"}])
def test_bad_input(engine: OnnxEmbeddingEngine, value: object) -> None:
    with pytest.raises(InvalidArgument):
        engine.embed({"model": "m", "input": value})


def test_other_routes_are_not_applicable(engine: OnnxEmbeddingEngine) -> None:
    with pytest.raises(ModelNotApplicable):
        engine.chat({"messages": []}, cancelled=lambda: False)
    with pytest.raises(ModelNotApplicable):
        engine.rerank({"query": "q", "documents": ["d"]})


def test_directories_it_cannot_load(model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="serves embedding models"):
        OnnxEmbeddingEngine({"model_path": str(model_dir), "type": "llm"})
    partial = tmp_path / "no-tokenizer"
    shutil.copytree(model_dir / "onnx", partial / "onnx")
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json"):
        OnnxEmbeddingEngine({"model_path": str(partial), "type": "embedding"})
    (partial / "tokenizer.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="could not load"):
        OnnxEmbeddingEngine({"model_path": str(partial), "type": "embedding"})
    with pytest.raises(InvalidArgument, match="n_threads"):
        OnnxEmbeddingEngine({"model_path": str(model_dir), "type": "embedding", "options": {"n_threads": "2"}})
