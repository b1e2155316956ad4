"""The session's models: tiny random-weight GGUFs generated into the session's HF cache under :data:`TEST_REPO`,
registered as user models (``user.<name>``) in the session's lemonkit cache, and the names tests ask for."""

from __future__ import annotations

import json

from tests.support.session import CACHE_DIR, HF_CACHE

__all__ = ["EMBED", "GEMMA", "RERANK", "TEST_REPO", "TINY", "TINY_B", "VISION", "write_models"]

TEST_REPO = "lemonkit-test/tiny-GGUF"
TINY = "user.tiny-llama"
TINY_B = "user.tiny-llama-b"
EMBED = "user.tiny-embed"
RERANK = "user.tiny-rerank"
VISION = "user.tiny-vision"
#: the bundled Gemma 3 270M (real weights)
GEMMA = "Gemma-3-270m-GGUF"


def write_models() -> None:
    """Write the tiny models into the session's HF cache and register them (once, when the session starts)."""
    from lemonkit.testing.tiny_gguf import (
        write_tiny_bert_embedding,
        write_tiny_bert_reranker,
        write_tiny_llama,
        write_tiny_mmproj,
    )

    snapshot = HF_CACHE / f"models--{TEST_REPO.replace('/', '--')}" / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("a" * 40)
    write_tiny_llama(snapshot / "tiny-llama.gguf")
    write_tiny_llama(snapshot / "tiny-llama-b.gguf", seed=1)
    write_tiny_bert_embedding(snapshot / "tiny-embed.gguf")
    write_tiny_bert_reranker(snapshot / "tiny-rerank.gguf")
    write_tiny_mmproj(snapshot / "mmproj-tiny.gguf")
    (snapshot / "not-gguf.gguf").write_bytes(b"<html>this is not a model</html>")
    (snapshot / "broken-gguf.gguf").write_bytes(b"GGUF" + bytes(60))
    CACHE_DIR.mkdir(parents=True)
    entries = {
        "tiny-llama": {"checkpoint": f"{TEST_REPO}:tiny-llama.gguf", "recipe": "llamacpp", "labels": ["chat"]},
        "tiny-llama-b": {"checkpoint": f"{TEST_REPO}:tiny-llama-b.gguf", "recipe": "llamacpp", "labels": ["chat"]},
        "tiny-embed": {"checkpoint": f"{TEST_REPO}:tiny-embed.gguf", "recipe": "llamacpp", "labels": ["embeddings"]},
        "tiny-rerank": {"checkpoint": f"{TEST_REPO}:tiny-rerank.gguf", "recipe": "llamacpp", "labels": ["reranking"]},
        "tiny-vision": {
            "checkpoint": f"{TEST_REPO}:tiny-llama.gguf",
            "mmproj": "mmproj-tiny.gguf",
            "recipe": "llamacpp",
            "labels": ["chat", "vision"],
        },
        "not-gguf": {"checkpoint": f"{TEST_REPO}:not-gguf.gguf", "recipe": "llamacpp", "labels": ["chat"]},
        "broken-gguf": {"checkpoint": f"{TEST_REPO}:broken-gguf.gguf", "recipe": "llamacpp", "labels": ["chat"]},
    }
    (CACHE_DIR / "user_models.json").write_text(json.dumps(entries, indent=2))
