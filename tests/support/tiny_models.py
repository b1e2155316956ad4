"""The session's models: tiny random-weight GGUFs generated into the session's HF cache under :data:`TEST_REPO`,
registered as user models (``user.<name>``) in the session's lemonkit cache, and the names tests ask for."""

from __future__ import annotations

import json
from pathlib import Path

from tests.support.session import CACHE_DIR, HF_CACHE

__all__ = [
    "DRAFTED",
    "EMBED",
    "GEMMA",
    "GEMMA4_ASSISTANT",
    "GEMMA4_MTP",
    "GEMMA4_RANDOM_MTP",
    "HYBRID",
    "HYBRID_MTP",
    "HYBRID_MTP_RANDOM",
    "MAMBA",
    "MTP",
    "MTP_LABEL_ONLY",
    "OTHER_VOCAB",
    "RERANK",
    "TEST_REPO",
    "TINY",
    "TINY_B",
    "VISION",
    "WITH_COMPANION",
    "write_models",
]

TEST_REPO = "lemonkit-test/tiny-GGUF"
TINY = "user.tiny-llama"
TINY_B = "user.tiny-llama-b"
EMBED = "user.tiny-embed"
RERANK = "user.tiny-rerank"
VISION = "user.tiny-vision"
#: tiny-llama with tiny-llama-b as its "draft" checkpoint
DRAFTED = "user.tiny-llama-drafted"
#: tiny-llama in a repo of its own beside a draft companion (tiny-llama-draft.gguf, tiny-llama-b's weights)
WITH_COMPANION = "user.tiny-llama-companion"
#: a tiny llama whose vocabulary holds other words: no draft model for the others
OTHER_VOCAB = "user.tiny-other-vocab"
#: a tiny GLM-4.5-layout model with an MTP layer that drafts what the trunk says, labelled ``mtp``
MTP = "user.tiny-mtp"
#: tiny-llama labelled ``mtp``, whose file has no MTP layers
MTP_LABEL_ONLY = "user.tiny-llama-mtp-label"
#: a tiny Mamba (recurrent layers), labelled ``mtp``
MAMBA = "user.tiny-mamba"
#: a tiny LFM2 (recurrent convolutions beside attention), with tiny-llama's vocabulary, labelled ``mtp``
HYBRID = "user.tiny-lfm2"
#: a tiny Qwen3.5 (delta-net and attention) whose MTP layer drafts what the trunk says, labelled ``mtp``
HYBRID_MTP = "user.tiny-qwen35-mtp"
#: the same layout of random weights throughout, labelled ``mtp``: its head's drafts are mostly wrong
HYBRID_MTP_RANDOM = "user.tiny-qwen35"
COMPANION_REPO = "lemonkit-test/tiny-companion-GGUF"
#: a tiny Gemma 4 labelled ``mtp`` whose "draft" checkpoint is its assistant (a head in a file of its own, which
#: reads the target's cache), as Lemonade's Gemma-4-*-MTP-GGUF rows: the assistant drafts what the target says
GEMMA4_MTP = "user.tiny-gemma4-mtp"
#: the same layout of random weights, target and assistant: the assistant's drafts are mostly wrong
GEMMA4_RANDOM_MTP = "user.tiny-gemma4-random-mtp"
#: the random assistant alone, as a registered model (``-md`` with ``--spec-type draft-mtp``)
GEMMA4_ASSISTANT = "user.tiny-gemma4-assistant"
#: the bundled Gemma 3 270M (real weights)
GEMMA = "Gemma-3-270m-GGUF"


def write_models() -> None:
    """Write the tiny models into the session's HF cache and register them (once, when the session starts)."""
    from lemonkit.testing.tiny_gguf import (
        WORDS,
        write_tiny_bert_embedding,
        write_tiny_bert_reranker,
        write_tiny_gemma4,
        write_tiny_gemma4_assistant,
        write_tiny_lfm2,
        write_tiny_llama,
        write_tiny_mamba,
        write_tiny_mmproj,
        write_tiny_mtp,
        write_tiny_qwen35,
    )

    snapshot = _snapshot(TEST_REPO)
    write_tiny_llama(snapshot / "tiny-llama.gguf")
    write_tiny_llama(snapshot / "tiny-llama-b.gguf", seed=1)
    write_tiny_bert_embedding(snapshot / "tiny-embed.gguf")
    write_tiny_bert_reranker(snapshot / "tiny-rerank.gguf")
    write_tiny_mmproj(snapshot / "mmproj-tiny.gguf")
    write_tiny_llama(snapshot / "tiny-other-vocab.gguf", words=[w[::-1] for w in WORDS])
    write_tiny_mtp(snapshot / "tiny-mtp.gguf", predictable=True)
    write_tiny_mamba(snapshot / "tiny-mamba.gguf")
    write_tiny_lfm2(snapshot / "tiny-lfm2.gguf")
    write_tiny_qwen35(snapshot / "tiny-qwen35-mtp.gguf", predictable=True)
    write_tiny_qwen35(snapshot / "tiny-qwen35.gguf")
    write_tiny_gemma4(snapshot / "tiny-gemma4-p.gguf", predictable=True)
    write_tiny_gemma4_assistant(snapshot / "tiny-gemma4-p-assistant.gguf", predictable=True)
    write_tiny_gemma4(snapshot / "tiny-gemma4.gguf", seed=2)
    write_tiny_gemma4_assistant(snapshot / "tiny-gemma4-assistant.gguf", seed=3)
    companion = _snapshot(COMPANION_REPO)
    write_tiny_llama(companion / "tiny-llama.gguf")
    write_tiny_llama(companion / "tiny-llama-draft.gguf", seed=1)
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
        "tiny-llama-drafted": {
            "checkpoints": {"main": f"{TEST_REPO}:tiny-llama.gguf", "draft": f"{TEST_REPO}:tiny-llama-b.gguf"},
            "recipe": "llamacpp",
            "labels": ["chat"],
        },
        "tiny-llama-companion": {
            "checkpoint": f"{COMPANION_REPO}:tiny-llama.gguf",
            "recipe": "llamacpp",
            "labels": ["chat"],
        },
        "tiny-other-vocab": {
            "checkpoint": f"{TEST_REPO}:tiny-other-vocab.gguf",
            "recipe": "llamacpp",
            "labels": ["chat"],
        },
        "tiny-mtp": {"checkpoint": f"{TEST_REPO}:tiny-mtp.gguf", "recipe": "llamacpp", "labels": ["chat", "mtp"]},
        "tiny-llama-mtp-label": {
            "checkpoint": f"{TEST_REPO}:tiny-llama.gguf",
            "recipe": "llamacpp",
            "labels": ["chat", "mtp"],
        },
        "tiny-mamba": {"checkpoint": f"{TEST_REPO}:tiny-mamba.gguf", "recipe": "llamacpp", "labels": ["chat", "mtp"]},
        "tiny-lfm2": {"checkpoint": f"{TEST_REPO}:tiny-lfm2.gguf", "recipe": "llamacpp", "labels": ["chat", "mtp"]},
        "tiny-qwen35-mtp": {
            "checkpoint": f"{TEST_REPO}:tiny-qwen35-mtp.gguf",
            "recipe": "llamacpp",
            "labels": ["chat", "mtp"],
        },
        "tiny-qwen35": {"checkpoint": f"{TEST_REPO}:tiny-qwen35.gguf", "recipe": "llamacpp", "labels": ["chat", "mtp"]},
        "tiny-gemma4-mtp": {
            "checkpoints": {
                "main": f"{TEST_REPO}:tiny-gemma4-p.gguf",
                "draft": f"{TEST_REPO}:tiny-gemma4-p-assistant.gguf",
            },
            "recipe": "llamacpp",
            "labels": ["chat", "mtp"],
        },
        "tiny-gemma4-random-mtp": {
            "checkpoints": {
                "main": f"{TEST_REPO}:tiny-gemma4.gguf",
                "draft": f"{TEST_REPO}:tiny-gemma4-assistant.gguf",
            },
            "recipe": "llamacpp",
            "labels": ["chat", "mtp"],
        },
        "tiny-gemma4-assistant": {
            "checkpoint": f"{TEST_REPO}:tiny-gemma4-assistant.gguf",
            "recipe": "llamacpp",
            "labels": ["chat"],
        },
        "not-gguf": {"checkpoint": f"{TEST_REPO}:not-gguf.gguf", "recipe": "llamacpp", "labels": ["chat"]},
        "broken-gguf": {"checkpoint": f"{TEST_REPO}:broken-gguf.gguf", "recipe": "llamacpp", "labels": ["chat"]},
    }
    (CACHE_DIR / "user_models.json").write_text(json.dumps(entries, indent=2))


def _snapshot(repo: str) -> Path:
    """An empty snapshot of ``repo`` in the session's HF cache, its ``main`` ref pointing at it."""
    snapshot = HF_CACHE / f"models--{repo.replace('/', '--')}" / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("a" * 40)
    return snapshot
