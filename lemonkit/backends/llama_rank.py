"""Reranking scores from a llama.cpp reranker through llama-cpp-python's low-level API.

llama-cpp-python has no rerank call, and its high-level ``Llama.embed()`` reads ``n_embd``
floats per sequence where RANK pooling produces only ``n_cls_out`` (the classifier head's
outputs). So this module does what llama.cpp's server does for ``/rerank``: build one
(query, document) prompt per document, decode several of them per batch as separate
sequences, and read each sequence's score with ``llama_get_embeddings_seq``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import llama_cpp
from llama_cpp import llama_cpp as ll

if TYPE_CHECKING:
    from llama_cpp import Llama

__all__ = ["rank_scores"]


def rank_scores(llm: Llama, query: str, documents: list[str]) -> tuple[list[float], int]:
    """Score each document's relevance to ``query``; return (scores in input order, prompt tokens).

    ``llm`` must be a reranking model loaded with ``embedding=True`` and
    ``pooling_type=llama_cpp.LLAMA_POOLING_TYPE_RANK``. Scores are raw classifier outputs
    (logits; higher is more relevant), like llama.cpp's server. A pair longer than the
    context or physical batch has its document truncated, as cross-encoders do.
    """
    ctx = llm.ctx
    if not llm.context_params.embeddings or ll.llama_pooling_type(ctx) != llama_cpp.LLAMA_POOLING_TYPE_RANK:
        raise ValueError(
            "rank_scores needs a reranking model loaded with embedding=True and "
            "pooling_type=LLAMA_POOLING_TYPE_RANK; this context does not use rank pooling"
        )
    if not documents:
        return [], 0

    # A pooled sequence must fit in one physical batch (ubatch) and in the context.
    limit = min(ll.llama_n_ctx(ctx), ll.llama_n_batch(ctx), ll.llama_n_ubatch(ctx))
    prompts = _prompts(llm, query, documents, limit)
    scores: list[float] = []
    batch = ll.llama_batch_init(limit, 0, 1)
    try:
        for group in _groups(prompts, limit, ll.llama_n_seq_max(ctx)):
            scores.extend(_decode_group(llm, batch, group))
    finally:
        ll.llama_batch_free(batch)
        # Decoding bypassed the Llama object, so its record of what the context holds is stale.
        llm.reset()
    return scores, sum(len(p) for p in prompts)


def _prompts(llm: Llama, query: str, documents: list[str], limit: int) -> list[list[int]]:
    """One token list per (query, document) pair, laid out as llama.cpp's ``format_prompt_rerank``."""

    def tokenize(text: str, special: bool = False) -> list[int]:
        return llm.tokenize(text.encode("utf-8"), add_bos=False, special=special)

    template = ll.llama_model_chat_template(llm.model, b"rerank")
    if template is not None:
        # Decoder rerankers (e.g. Qwen3-Reranker) ship a prompt with {query} and {document}.
        prompt = template.decode("utf-8").replace("{query}", query)
        return [tokenize(prompt.replace("{document}", doc), special=True)[:limit] for doc in documents]

    # Cross-encoders: [BOS/CLS] query [EOS] [SEP] document [EOS], each marker only if the vocab
    # asks for it (a WPM/BERT vocab gives [CLS] query [SEP] document); SEP stands in for no EOS.
    vocab = ll.llama_model_get_vocab(llm.model)
    eos = ll.llama_vocab_eos(vocab)
    if eos == llama_cpp.LLAMA_TOKEN_NULL:
        eos = ll.llama_vocab_sep(vocab)
    end = [eos] if ll.llama_vocab_get_add_eos(vocab) else []
    head = [ll.llama_vocab_bos(vocab)] if ll.llama_vocab_get_add_bos(vocab) else []
    head += tokenize(query) + end
    head += [ll.llama_vocab_sep(vocab)] if ll.llama_vocab_get_add_sep(vocab) else []
    room = limit - len(head) - len(end)
    if room < 0:
        raise ValueError(f"the query is too long to rerank: with its markers it exceeds {limit} tokens")
    return [head + tokenize(doc)[:room] + end for doc in documents]


def _groups(prompts: list[list[int]], max_tokens: int, max_seqs: int) -> Iterator[list[list[int]]]:
    """Pack consecutive prompts into batches of at most ``max_tokens`` tokens and ``max_seqs`` sequences."""
    group: list[list[int]] = []
    n_tokens = 0
    for prompt in prompts:
        if group and (n_tokens + len(prompt) > max_tokens or len(group) == max_seqs):
            yield group
            group, n_tokens = [], 0
        group.append(prompt)
        n_tokens += len(prompt)
    if group:
        yield group


def _decode_group(llm: Llama, batch: ll.llama_batch, group: list[list[int]]) -> list[float]:
    """Decode each prompt of ``group`` as its own sequence (seq_id = position) and read its score."""
    ctx = llm.ctx
    # Clear first: sequences left from an earlier batch (or an earlier call) would share seq ids.
    # A BERT context has no memory: the pointer is NULL and llama_memory_clear ignores it.
    ll.llama_memory_clear(ll.llama_get_memory(ctx), True)
    i = 0
    for seq_id, prompt in enumerate(group):
        for pos, token in enumerate(prompt):
            batch.token[i] = token
            batch.pos[i] = pos  # type: ignore[call-overload]  # the bindings' stub types pos as 2-D
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq_id
            batch.logits[i] = True  # embedding contexts output every token; say so to avoid a warning
            i += 1
    batch.n_tokens = i
    status = ll.llama_decode(ctx, batch)
    if status != 0:
        raise RuntimeError(f"llama_decode failed with status {status} while reranking")
    scores: list[float] = []
    for seq_id in range(len(group)):
        # RANK pooling yields n_cls_out floats per sequence; the first is the relevance score.
        out = ll.llama_get_embeddings_seq(ctx, seq_id)
        if not out:
            raise RuntimeError(f"llama.cpp returned no rank output for sequence {seq_id}")
        scores.append(float(out[0]))
    ll.llama_memory_clear(ll.llama_get_memory(ctx), True)
    return scores
