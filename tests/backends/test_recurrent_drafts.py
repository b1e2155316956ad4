"""Speculation on a recurrent (hybrid) model, in-process on the tiny LFM2: a rejected draft rolls the sequence's
state back into the state llama.cpp kept for that token, and that stays right whatever else the step decodes.

llama.cpp keeps those states where the sequence's last ubatch left it; a later ubatch of the same ``llama_decode``
gathering its own sequences into adjacent cells can move the sequence elsewhere, leaving the kept states behind.
The steps here are laid out so that it would: one slot drafts while the slots on either side of its cell decode
one token each, arriving after it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lemonkit.backends.llamacpp import LlamaCppEngine
from lemonkit.testing.tiny_gguf import write_tiny_lfm2
from tests.backends.test_llamacpp_batching import _complete, _together

PROMPTS = ("one two three four five six", "the quick brown fox jumps over", "red green blue yellow purple")


@pytest.fixture(scope="module")
def lfm2_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_lfm2(tmp_path_factory.mktemp("tiny") / "tiny-lfm2.gguf")


def _tokens(result: dict[str, Any]) -> list[str]:
    return list(result["choices"][0]["logprobs"]["tokens"])


def test_a_rejected_draft_beside_other_sequences_rolls_back_exactly(lfm2_path: Path) -> None:
    args = "--parallel 4 -b 64 --spec-type ngram-simple --spec-draft-n-max 4 --spec-draft-n-min 1"
    engine = LlamaCppEngine(
        {"model_path": str(lfm2_path), "type": "llm", "options": {"n_threads": 2, "llamacpp_args": args}}
    )
    try:
        batcher = engine._gen._batcher
        assert batcher._recurrent and batcher._spare is not None  # rolls back, and compacts its cells
        probe = {"temperature": 0, "max_tokens": 20}
        drafting: set[int] = set()
        wrong = [5, 9, 13]  # what the drafting slot proposes, in turn: mostly rejected

        def only_drafting(generating: list[Any]) -> bool:
            """The draft source of the test: each slot in ``drafting`` proposes four tokens, the others none."""
            for slot in generating:
                slot.draft = [wrong[(slot.n_gen + i) % len(wrong)] for i in range(4)] if slot.id in drafting else []
            return any(slot.draft for slot in generating)

        batcher._draft = only_drafting  # type: ignore[method-assign]
        # each prompt's own slot caches it, so that the first to arrive below takes slot 1, between the slots of
        # the two after it (and compaction lays the cells out in slot order)
        expected = [_complete(engine, PROMPTS[i], **probe) for i in (1, 0, 2)]
        expected = [expected[1], expected[0], expected[2]]
        cached = list(batcher._slots[1].tokens[:4])
        drafting.add(1)
        for _ in range(3):
            results = _together(engine, list(PROMPTS), **probe)
            assert batcher._slots[1].tokens[:4] == cached
            assert [_tokens(r) for r in results] == [_tokens(r) for r in expected]
            timings = results[0]["timings"]
            assert timings["draft_n"] > timings["draft_n_accepted"]  # it drafted, and rolled back
            assert all("draft_n" not in r["timings"] for r in results[1:])
    finally:
        engine.close()
