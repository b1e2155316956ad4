"""A draft model in the target's sidecar (llama-server's ``--spec-type draft-simple`` with ``-md``).

A small model of the same vocabulary proposes the next tokens; the batcher verifies them in the target's step
(:mod:`~lemonkit.backends.llamacpp.batch`), so drafts change the speed, never the output. The draft model has its own
context with a sequence per slot, whose cached tokens follow the slot's by their common prefix: a step decodes
only what the slot gained since (its prompt once, then the tokens it accepted), for every drafting slot in one
``llama_decode``, then drafts greedily one row per slot per decode until the slot's room is filled or the draft
model's own probability of its pick falls under ``--spec-draft-p-min``.

It runs on ggml's fast kernels whatever the target's: its logits only choose drafts, which the target's own
sampler checks.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

from lemonkit.backends.llamacpp.batch import parallel_context
from lemonkit.backends.llamacpp.cpu_turns import Turn, any_cores, on_cores
from lemonkit.backends.llamacpp.prompt_cache import common_prefix
from lemonkit.errors import ModelLoadError, ModelLoadRefused

__all__ = ["DraftModel", "check_vocab", "greedy_pick"]

#: how far two vocabularies' sizes may differ for one to draft for the other (llama-server's rule: added tokens at
#: the end)
VOCAB_SIZE_SLACK = 128


#: the candidates a draft's confidence is normalised over: llama-server's draft sampler keeps its top 10 before the
#: softmax whose first probability ``--spec-draft-p-min`` bounds, so the same p-min drafts as far here
DRAFT_TOP_K = 10


def greedy_pick(np: Any, logits: Any) -> tuple[int, float]:
    """A logits row's greedy token and its probability among the row's :data:`DRAFT_TOP_K` best (a draft's
    confidence in it)."""
    token = int(logits.argmax())
    top = np.partition(logits, -DRAFT_TOP_K)[-DRAFT_TOP_K:] if len(logits) > DRAFT_TOP_K else logits
    total = float(np.exp(top - logits[token]).sum())
    return token, 1.0 / total if total > 0 and math.isfinite(total) else 0.0


def check_vocab(tv: Any, dv: Any, name: str) -> None:
    """Refuse a draft model whose tokens are not the target's: the same tokenizer type, BOS/EOS and texts for every
    id both have, and sizes within :data:`VOCAB_SIZE_SLACK`.

    Args:
        tv: The target's ``llama_vocab`` pointer.
        dv: The draft model's.
        name: The draft model's file name, for the messages.

    Raises:
        ModelLoadRefused: They differ; the message says where.
    """
    import llama_cpp as lc

    checks = (
        ("tokenizer type", lc.llama_vocab_type(tv), lc.llama_vocab_type(dv)),
        ("add-BOS setting", lc.llama_vocab_get_add_bos(tv), lc.llama_vocab_get_add_bos(dv)),
        ("BOS token", lc.llama_vocab_bos(tv), lc.llama_vocab_bos(dv)),
        ("EOS token", lc.llama_vocab_eos(tv), lc.llama_vocab_eos(dv)),
    )
    for what, mine, theirs in checks:
        if mine != theirs:
            raise ModelLoadRefused(f"draft model {name}: its {what} differs from the target's ({theirs} vs {mine})")
    n_target, n_draft = lc.llama_vocab_n_tokens(tv), lc.llama_vocab_n_tokens(dv)
    if abs(n_target - n_draft) > VOCAB_SIZE_SLACK:
        raise ModelLoadRefused(
            f"draft model {name}: its vocabulary has {n_draft} tokens and the target's {n_target}; a draft model "
            "must share the target's tokenizer"
        )
    for token in range(min(n_target, n_draft)):
        if lc.llama_vocab_get_text(tv, token) != lc.llama_vocab_get_text(dv, token):
            text = lc.llama_vocab_get_text(dv, token).decode("utf-8", "replace")
            raise ModelLoadRefused(
                f"draft model {name}: token {token} is {text!r} there but not in the target; a draft model must "
                "share the target's tokenizer"
            )


class DraftModel:
    """A loaded draft model with a sequence for each of the target's slots.

    Args:
        path: The draft GGUF.
        target: The target's ``llama_cpp.Llama`` (for the vocabulary check).
        n_seq: The target's slots.
        n_ctx: Context positions (the target's, with room for drafts: a slot may fill the target's).
        n_batch: Rows per decode.
        threads: llama.cpp's one-token and batch threads.
        is_eog: Whether a token ends generation (a draft stops after it).
        kwargs: More ``Llama()`` arguments (offload).

    Raises:
        ModelLoadRefused: Its vocabulary is not the target's.
        ModelLoadError: It does not load.
    """

    def __init__(
        self,
        path: str,
        *,
        target: Any,
        n_seq: int,
        n_ctx: int,
        n_batch: int,
        threads: tuple[int, int],
        is_eog: Callable[[int], bool],
        repack: bool,
        turn: Turn = any_cores,
        **kwargs: Any,
    ) -> None:
        import os

        import llama_cpp as lc
        import numpy as np

        name = os.path.basename(path)
        try:
            with parallel_context(n_seq, repack=repack):
                self._llm = lc.Llama(
                    model_path=path,
                    n_ctx=n_ctx,
                    n_batch=n_batch,
                    n_ubatch=n_batch,
                    n_threads=threads[0],
                    n_threads_batch=threads[1],
                    flash_attn=True,
                    use_mmap=False,
                    verbose=False,
                    **kwargs,
                )
        except (ValueError, RuntimeError, OSError) as exc:
            raise ModelLoadError(f"llama.cpp could not load the draft model {name}: {exc}") from exc
        try:
            check_vocab(target._model.vocab, self._llm._model.vocab, name)
            model = self._llm._model.model
            if lc.llama_model_is_recurrent(model) or lc.llama_model_is_hybrid(model):
                # its drafted tokens are dropped after each draft, which a recurrent state cannot do
                raise ModelLoadRefused(f"the draft model {name} has recurrent layers; use an attention-only one")
        except BaseException:
            self._llm.close()
            raise
        self.name = name
        self._lc = lc
        self._np = np
        self._ctx = self._llm._ctx.ctx
        self._mem = lc.llama_get_memory(self._ctx)
        self._n_vocab = self._llm.n_vocab()
        self._target_vocab = target.n_vocab()
        self._is_eog = is_eog
        self._threads = threads
        self._turn = turn
        self._n_batch = n_batch
        self._cached: list[list[int]] = [[] for _ in range(n_seq)]  # per sequence: the ids its cells hold
        self._batch = lc.llama_batch_init(n_batch, 0, 1)
        b = self._batch
        self._tok = np.ctypeslib.as_array(b.token, shape=(n_batch,))
        self._pos = np.ctypeslib.as_array(b.pos, shape=(n_batch,))
        self._logits = np.ctypeslib.as_array(b.logits, shape=(n_batch,))
        np.ctypeslib.as_array(b.n_seq_id, shape=(n_batch,))[:] = 1

    def draft(self, wants: list[tuple[int, list[int], int]], p_min: float) -> list[list[int]]:
        """Drafts for ``(seq, tokens, room)``: up to ``room`` tokens to follow ``tokens`` in sequence ``seq``."""
        picks: dict[int, tuple[int, float]] = {}
        rows: list[tuple[int, list[int], int]] = []  # (seq, ids to decode, position of the first)
        for seq, tokens, _ in wants:
            cached = self._cached[seq]
            keep = min(common_prefix(cached, tokens), len(tokens) - 1)  # the last is decoded for its logits
            if keep < len(cached):
                self._lc.llama_memory_seq_rm(self._mem, seq, keep, -1)
                del cached[keep:]
            rows.append((seq, tokens[keep:], keep))
        if not self._decode_rows(rows, picks):
            return [[] for _ in wants]
        drafts: dict[int, list[int]] = {seq: [] for seq, _, _ in wants}
        rooms = {seq: room for seq, _, room in wants}
        while picks:
            step: list[tuple[int, list[int], int]] = []
            for seq, (token, p) in picks.items():
                if p < p_min or token >= self._target_vocab:
                    continue
                draft = drafts[seq]
                draft.append(token)
                if len(draft) < rooms[seq] and not self._is_eog(token):
                    step.append((seq, [token], len(self._cached[seq])))
            picks = {}
            if step and not self._decode_rows(step, picks):
                break
        return [drafts[seq] for seq, _, _ in wants]

    def _decode_rows(self, rows: list[tuple[int, list[int], int]], picks: dict[int, tuple[int, float]]) -> bool:
        """Decode each sequence's ids in as few decodes as the batch allows, and put each sequence's pick after its
        last id in ``picks``; False if the context had no room (then it starts over empty)."""
        lc = self._lc
        pending = [(seq, list(ids), pos) for seq, ids, pos in rows if ids]
        while pending:
            n, due, rest = 0, [], []
            for seq, ids, pos in pending:
                part = ids[: self._n_batch - n]
                if not part:
                    rest.append((seq, ids, pos))
                    continue
                for i, token in enumerate(part):
                    self._tok[n + i] = token
                    self._pos[n + i] = pos + i
                    self._batch.seq_id[n + i][0] = seq
                self._logits[n : n + len(part)] = 0
                if len(part) == len(ids):
                    self._logits[n + len(part) - 1] = 1
                    due.append((seq, n + len(part) - 1))
                else:
                    rest.append((seq, ids[len(part) :], pos + len(part)))
                self._cached[seq].extend(part)
                n += len(part)
            self._batch.n_tokens = n
            with on_cores(self._turn, self._threads) as given:
                lc.llama_set_n_threads(self._ctx, *given)
                rc = int(lc.llama_decode(self._ctx, self._batch))
            if rc != 0:
                lc.llama_memory_clear(self._mem, False)
                for cached in self._cached:
                    cached.clear()
                return False
            for seq, idx in due:
                picks[seq] = self._pick(idx)
            pending = rest
        return True

    def _pick(self, idx: int) -> tuple[int, float]:
        """The draft model's greedy token at logits row ``idx``, with its probability."""
        np = self._np
        logits = np.ctypeslib.as_array(self._lc.llama_get_logits_ith(self._ctx, idx), shape=(self._n_vocab,))
        return greedy_pick(np, logits)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._lc.llama_batch_free(self._batch)
        self._llm.close()
