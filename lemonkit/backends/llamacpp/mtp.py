"""MTP drafts (llama-server's ``--spec-type draft-mtp``): the target's own next-n head proposes the next tokens.

Models trained with multi-token prediction (GLM-4.5, DeepSeek V3, MiMo, ...) carry one more block, the next-n
layer, that reads the trunk's last hidden state ``h`` at position ``p-1`` with the token at ``p`` and predicts the
token at ``p+1``. libllama runs that block in a context of its own (``LLAMA_CONTEXT_TYPE_MTP``) over the target's
weights, with a KV cache holding the block's layer alone. The batcher verifies the drafts in the target's step, so
they change the speed, never the output.

The head's cache must hold every position the target kept: after each target decode :meth:`MtpHead.mirror` decodes
each kept token at its position paired with the target's ``h`` one position earlier (libllama's staging API gives
the target's rows, ``llama_get_embeddings_nextn_ith``), all slots in one decode; the batcher's removals reach it
through :meth:`MtpHead.forget`. A draft decodes the slot's next token with the last ``h``, then each drafted token
with the head's own ``h``, one row per slot per decode, greedily, until the room is filled or the head's
probability of its pick falls under ``--spec-draft-p-min``; the drafted cells are dropped after, as the target's
verification decodes those positions again. Positions the head never saw (a prompt restored from the RAM cache or
a file) leave holes in its cache, and a missing ``h`` is zeros: drafts get worse there, outputs stay exact.

libllama exports the staging functions under C++ names only (``src/llama-ext.h``), so they are bound here.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Callable
from typing import Any

from lemonkit.backends.llamacpp.cpu_turns import Turn, any_cores, on_cores
from lemonkit.backends.llamacpp.draft_model import greedy_pick
from lemonkit.errors import ModelLoadError, ModelLoadRefused

__all__ = ["MtpHead", "mtp_layers"]

#: libllama's ``LLAMA_CONTEXT_TYPE_MTP``
_CONTEXT_TYPE_MTP = 1

#: the staging API's C++ symbols: name -> (symbol, argument types after the context, result type)
_STAGING: dict[str, tuple[str, list[Any], Any]] = {
    "set_embeddings_nextn": ("_Z26llama_set_embeddings_nextnP13llama_contextbb", [ctypes.c_bool, ctypes.c_bool], None),
    "get_embeddings_nextn_ith": (
        "_Z30llama_get_embeddings_nextn_ithP13llama_contexti",
        [ctypes.c_int32],
        ctypes.POINTER(ctypes.c_float),
    ),
}


def _staging(lc: Any) -> dict[str, Any]:
    """libllama's MTP staging functions, bound with ctypes."""
    lib = lc.llama_cpp._lib
    bound = {}
    for name, (symbol, args, result) in _STAGING.items():
        try:
            fn = getattr(lib, symbol)
        except AttributeError as exc:
            raise ModelLoadError(f"this llama.cpp build has no MTP support ({name} is missing)") from exc
        fn.argtypes = [ctypes.c_void_p, *args]
        fn.restype = result
        bound[name] = fn
    return bound


def mtp_layers(llm: Any) -> int:
    """How many next-n (MTP) layers a loaded ``llama_cpp.Llama`` carries."""
    import llama_cpp as lc

    return int(lc.llama_model_n_layer_nextn(llm._model.model))


class MtpHead:
    """The next-n head of a loaded target (loaded with its MTP layers), with a sequence for each of its slots.

    Args:
        target: The target's ``llama_cpp.Llama``.
        n_seq: The target's slots.
        n_ctx: Context positions (the target's, with room for drafts).
        n_batch: Rows per decode.
        threads: llama.cpp's one-token and batch threads.
        is_eog: Whether a token ends generation (a draft stops after it).

    Raises:
        ModelLoadRefused: The model has no MTP layers.
        ModelLoadError: libllama could not make the head's context.
    """

    def __init__(
        self,
        target: Any,
        *,
        n_seq: int,
        n_ctx: int,
        n_batch: int,
        threads: tuple[int, int],
        is_eog: Callable[[int], bool],
        turn: Turn = any_cores,
    ) -> None:
        import llama_cpp as lc
        import numpy as np

        if mtp_layers(target) <= 0:
            raise ModelLoadRefused(
                "--spec-type draft-mtp: this model has no MTP (next-n) layers; use ngram-simple, ngram-mod or a "
                "draft model (draft-simple)"
            )
        self._lc, self._np = lc, np
        self._fn = _staging(lc)
        model = target._model.model
        params = type(target.context_params).from_buffer_copy(target.context_params)
        params.ctx_type = _CONTEXT_TYPE_MTP
        params.n_ctx, params.n_batch, params.n_ubatch = n_ctx, n_batch, n_batch
        params.n_seq_max, params.kv_unified = n_seq, True
        params.embeddings = False
        self._ctx = lc.llama_init_from_model(model, params)
        if not self._ctx:
            raise ModelLoadError("llama.cpp could not make the MTP head's context")
        self._target = target._ctx.ctx
        # the target keeps every row's h (unmasked, indexed by batch row); the head its output rows' (masked)
        self._fn["set_embeddings_nextn"](self._target, True, False)
        self._fn["set_embeddings_nextn"](self._ctx, True, True)
        self._mem = lc.llama_get_memory(self._ctx)
        self._batch = lc.llama_batch_ext_init(self._ctx)
        self._n_embd = int(lc.llama_model_n_embd(model))
        self._n_vocab = target.n_vocab()
        self._n_batch = n_batch
        self._is_eog = is_eog
        self._threads = threads
        self._turn = turn
        self._zeros = np.zeros(self._n_embd, dtype=np.float32)
        self._n = [0] * n_seq  # per sequence: the positions after the last one its cache holds
        self._h: list[tuple[int, Any] | None] = [None] * n_seq  # the target's h at a position, for the next row

    def forget(self, seq: int, start: int) -> None:
        """The target dropped positions ``start`` onwards of ``seq``: so does the head."""
        if self._n[seq] > start:
            self._lc.llama_memory_seq_rm(self._mem, seq, start if start > 0 else -1, -1)
            self._n[seq] = start
        h = self._h[seq]
        if h is not None and h[0] >= start:
            self._h[seq] = None

    def mirror(self, kept: list[tuple[int, int, list[int], int]]) -> None:
        """After a target decode: ``(seq, position, tokens, row)`` for each run of tokens the target decoded from
        batch row ``row`` and kept, into the head's cache, each paired with the target's ``h`` one position back."""
        rows: list[tuple[int, int, int, Any]] = []  # (seq, token, position, h pointer or array)
        last: list[tuple[int, int, int]] = []
        for seq, pos, tokens, row in kept:
            if not tokens:
                continue
            if self._n[seq] > pos:
                self.forget(seq, pos)
            h = self._h[seq]
            first = h[1] if h is not None and h[0] == pos - 1 else self._zeros
            for i, token in enumerate(tokens):
                rows.append((seq, token, pos + i, first if i == 0 else self._target_h(row + i - 1)))
            last.append((seq, pos + len(tokens) - 1, row + len(tokens) - 1))
        if not rows:
            return
        for start in range(0, len(rows), self._n_batch):
            if not self._process(rows[start : start + self._n_batch], ()):
                return
        np = self._np
        for seq, pos, row in last:
            h = np.ctypeslib.as_array(self._target_h(row), shape=(self._n_embd,)).copy()
            self._h[seq] = (pos, h)
            self._n[seq] = pos + 1

    def draft(self, wants: list[tuple[int, list[int], int]], p_min: float) -> list[list[int]]:
        """Drafts for ``(seq, tokens, room)``: up to ``room`` tokens to follow ``tokens`` in sequence ``seq``, whose
        last token the target has sampled and not decoded yet."""
        np = self._np
        drafts: dict[int, list[int]] = {seq: [] for seq, _, _ in wants}
        rooms = {seq: room for seq, _, room in wants}
        step: list[tuple[int, int, int, Any]] = []
        for seq, tokens, _ in wants:
            pos = len(tokens) - 1
            if self._n[seq] > pos:
                self.forget(seq, pos)
            h = self._h[seq]
            step.append((seq, tokens[-1], pos, h[1] if h is not None and h[0] == pos - 1 else self._zeros))
        first = {seq: pos for seq, _, pos, _ in step}
        while step:
            picks = self._process(step, range(len(step)))
            if picks is None:
                break
            following = []
            for (seq, _, pos, _), (token, p, h) in zip(step, picks, strict=True):
                if p < p_min or token >= self._n_vocab:
                    continue
                draft = drafts[seq]
                draft.append(token)
                if len(draft) < rooms[seq] and not self._is_eog(token):
                    following.append((seq, token, pos + 1, np.ctypeslib.as_array(h, shape=(self._n_embd,)).copy()))
            step = following
        for seq, pos in first.items():  # the target's verification decodes these positions again
            self._lc.llama_memory_seq_rm(self._mem, seq, pos, -1)
        return [drafts[seq] for seq, _, _ in wants]

    def _target_h(self, row: int) -> Any:
        return self._fn["get_embeddings_nextn_ith"](self._target, row)

    def _process(
        self, rows: list[tuple[int, int, int, Any]], outputs: range | tuple[()]
    ) -> list[tuple[int, float, Any]] | None:
        """Decode ``rows`` in the head's context, the indices in ``outputs`` with logits; each output's greedy
        token, its probability and the head's ``h`` pointer. None if the decode failed (then the cache starts over
        empty)."""
        lc, np = self._lc, self._np
        b = self._batch
        lc.llama_batch_ext_clear(b)
        float_p = ctypes.POINTER(ctypes.c_float)
        pos = lc.llama_pos()
        for i, (seq, token, position, h) in enumerate(rows):
            idx = lc.llama_batch_ext_add_token(b, seq, token)
            pos.value = position
            lc.llama_batch_ext_set_pos(b, idx, ctypes.byref(pos))
            data = h if not isinstance(h, np.ndarray) else h.ctypes.data_as(float_p)
            lc.llama_batch_ext_set_embd_token(b, idx, lc.llama_embd(ctypes.cast(data, float_p), 1, self._n_embd))
            if i in outputs:
                lc.llama_batch_ext_set_output_logits(b, idx, True)
        with on_cores(self._turn, self._threads) as given:
            lc.llama_set_n_threads(self._ctx, *given)
            rc = int(lc.llama_process(self._ctx, lc.LLAMA_PROCESS_TYPE_DECODE, b))
        if rc != 0:
            lc.llama_memory_clear(self._mem, False)
            self._n = [0] * len(self._n)
            return None
        out = []
        for i in outputs:
            logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(self._ctx, i), shape=(self._n_vocab,))
            token, p = greedy_pick(np, logits)
            out.append((token, p, self._fn["get_embeddings_nextn_ith"](self._ctx, i)))
        return out

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._lc.llama_batch_ext_free(self._batch)
        with contextlib.suppress(Exception):
            self._lc.llama_free(self._ctx)
