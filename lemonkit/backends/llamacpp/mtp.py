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

Gemma 4 ships its MTP head as a file of its own, an "assistant" (architecture ``gemma4-assistant``; Lemonade's
``Gemma-4-*-MTP-GGUF`` rows name it as their ``draft`` checkpoint): a few layers with no keys or values of their own,
which attend over the last two layers of the target's KV cache (libllama shares those layers and the cells when the
head's context is made with ``ctx_other`` set to the target's). Its cache is the target's, so nothing is mirrored:
the head keeps only each slot's last ``h``, and every drafted token is decoded at the position of the slot's next
token (the assistant's own rule, as in llama-server), reading the target's cells before it.

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

__all__ = ["HEAD_ARCHS", "MtpHead", "mtp_layers"]

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
    """The next-n head of a loaded target (loaded with its MTP layers), or a head file sharing the target's cache
    (a Gemma 4 assistant), with a sequence for each of the target's slots.

    Args:
        target: The target's ``llama_cpp.Llama``.
        n_seq: The target's slots.
        n_ctx: Context positions (the target's, with room for drafts).
        n_batch: Rows per decode.
        threads: llama.cpp's one-token and batch threads.
        is_eog: Whether a token ends generation (a draft stops after it).
        head_path: The head's own GGUF (``gemma4-assistant``), or None for the target's next-n layers.
        n_gpu_layers: Where the head file's layers go: with the target's cache (all on its GPU, or none).

    Raises:
        ModelLoadRefused: The model has no MTP layers, or the head file is no head of this target.
        ModelLoadError: libllama could not load the head file or make the head's context.
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
        head_path: str | None = None,
        n_gpu_layers: int = 0,
    ) -> None:
        import llama_cpp as lc
        import numpy as np

        self._lc, self._np = lc, np
        self._fn = _staging(lc)
        self._head_model: Any = None
        #: the head reads the target's cache (a head file): nothing to mirror, every draft row at one position
        self._shared = head_path is not None
        params = type(target.context_params).from_buffer_copy(target.context_params)
        params.ctx_type = _CONTEXT_TYPE_MTP
        params.n_ctx, params.n_batch, params.n_ubatch = n_ctx, n_batch, n_batch
        params.n_seq_max, params.kv_unified = n_seq, True
        params.embeddings = False
        if head_path is not None:
            model = self._head_model = _load_head(lc, target, head_path, n_gpu_layers)
            # the cache is the target's: its size, its sequences (the slots and the batcher's own), its layout
            params.n_ctx = lc.llama_n_ctx(target._ctx.ctx)
            params.n_seq_max = lc.llama_n_seq_max(target._ctx.ctx)
            # its decodes hold a row per drafting slot: a compute buffer and logits for as many sequences (llama.cpp
            # sizes its outputs by them), not for a batch
            n_batch = params.n_batch = params.n_ubatch = params.n_seq_max
            params.n_outputs_max = params.n_outputs_max_per_seq = 0
            params.n_rs_seq = 0
            params.ctx_other = target._ctx.ctx
        else:
            if mtp_layers(target) <= 0:
                raise ModelLoadRefused(
                    "--spec-type draft-mtp: this model has no MTP (next-n) layers; use ngram-simple, ngram-mod or a "
                    "draft model (draft-simple)"
                )
            model = target._model.model
        self._ctx = lc.llama_init_from_model(model, params)
        if not self._ctx:
            self._free_head()
            raise ModelLoadError("llama.cpp could not make the MTP head's context")
        self._target = target._ctx.ctx
        # the target keeps every row's h (unmasked, indexed by batch row); the head its output rows' (masked)
        self._fn["set_embeddings_nextn"](self._target, True, False)
        self._fn["set_embeddings_nextn"](self._ctx, True, True)
        self._mem = lc.llama_get_memory(self._ctx)
        self._batch = lc.llama_batch_ext_init(self._ctx)
        self._n_embd = int(lc.llama_model_n_embd(target._model.model))
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
        if self._n[seq] > start and not self._shared:
            self._lc.llama_memory_seq_rm(self._mem, seq, start if start > 0 else -1, -1)
            self._n[seq] = start
        h = self._h[seq]
        if h is not None and h[0] >= start:
            self._h[seq] = None

    def mirror(self, kept: list[tuple[int, int, list[int], int]]) -> None:
        """After a target decode: ``(seq, position, tokens, row)`` for each run of tokens the target decoded from
        batch row ``row`` and kept, into the head's cache, each paired with the target's ``h`` one position back (a
        head reading the target's cache keeps only the last ``h``)."""
        rows: list[tuple[int, int, int, Any]] = []  # (seq, token, position, h pointer or array)
        last: list[tuple[int, int, int]] = []
        for seq, pos, tokens, row in kept:
            if not tokens:
                continue
            if self._n[seq] > pos:
                self.forget(seq, pos)
            last.append((seq, pos + len(tokens) - 1, row + len(tokens) - 1))
            if self._shared:
                continue
            h = self._h[seq]
            first = h[1] if h is not None and h[0] == pos - 1 else self._zeros
            for i, token in enumerate(tokens):
                rows.append((seq, token, pos + i, first if i == 0 else self._target_h(row + i - 1)))
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
            if self._n[seq] > pos and not self._shared:
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
                    # a head file drafts every token at the next token's position, over the target's cells
                    at = pos if self._shared else pos + 1
                    following.append((seq, token, at, np.ctypeslib.as_array(h, shape=(self._n_embd,)).copy()))
            step = following
        for seq, pos in first.items() if not self._shared else ():  # the target decodes these positions again
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
            if not self._shared:  # the target's cache is not the head's to clear
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
        self._free_head()

    def _free_head(self) -> None:
        if self._head_model is not None:
            self._lc.llama_model_free(self._head_model)
            self._head_model = None


#: the architectures of heads that come as files of their own and read the target's cache, with their targets'
HEAD_ARCHS = {"gemma4-assistant": ("gemma4",)}


def _arch(lc: Any, model: Any) -> str:
    buf = ctypes.create_string_buffer(128)
    n = lc.llama_model_meta_val_str(model, b"general.architecture", buf, len(buf))
    return buf.value.decode() if n > 0 else "unknown"


def _load_head(lc: Any, target: Any, path: str, n_gpu_layers: int) -> Any:
    """Load a head file for ``target``: a ``gemma4-assistant`` GGUF whose vocabulary and hidden size are the
    target's.

    Raises:
        ModelLoadError: llama.cpp cannot load it.
        ModelLoadRefused: It is no head of this target.
    """
    import os

    from lemonkit.backends.llamacpp.draft_model import check_vocab

    name = os.path.basename(path)
    params = lc.llama_model_default_params()
    params.n_gpu_layers = n_gpu_layers
    params.use_mmap = False
    model = lc.llama_model_load_from_file(path.encode(), params)
    if not model:
        raise ModelLoadError(f"llama.cpp could not load the MTP head {name}")
    try:
        arch, target_arch = _arch(lc, model), _arch(lc, target._model.model)
        if arch not in HEAD_ARCHS:
            raise ModelLoadRefused(
                f"{name} is a {arch} model, not an MTP head ({', '.join(HEAD_ARCHS)}): draft with it as a draft "
                "model (--spec-type draft-simple -md <model>)"
            )
        if target_arch not in HEAD_ARCHS[arch]:
            # it reads the target's cache as its own architecture lays it out: another one would crash llama.cpp
            raise ModelLoadRefused(
                f"the MTP head {name} ({arch}) drafts for {', '.join(HEAD_ARCHS[arch])} models, and this one is "
                f"{target_arch}: it is the head of another model"
            )
        width, wanted = lc.llama_model_n_embd_out(model), lc.llama_model_n_embd(target._model.model)
        if width != wanted:
            raise ModelLoadRefused(
                f"the MTP head {name} reads hidden states of {width} values and this model's have {wanted}: it is "
                "the head of another model"
            )
        check_vocab(target._model.vocab, lc.llama_model_get_vocab(model), name)
    except BaseException:
        lc.llama_model_free(model)
        raise
    return model
