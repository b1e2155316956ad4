"""Image input: an mmproj loaded next to the model, and prompts with images evaluated through llama.cpp's mtmd."""

from __future__ import annotations

import ctypes
import os
from typing import Any

from lemonkit.errors import InvalidArgument, ModelLoadError

__all__ = ["Vision", "decode_data_url"]


class Vision:
    """The mmproj of one loaded model.

    Args:
        llm: The loaded ``llama_cpp.Llama``.
        mmproj: Path of the multimodal projector GGUF.

    Raises:
        ModelLoadError: The mmproj does not load.
    """

    def __init__(self, llm: Any, mmproj: str) -> None:
        import llama_cpp

        try:
            from llama_cpp import mtmd_cpp
            from llama_cpp.llama_chat_format import MTMDChatHandler

            handler = MTMDChatHandler(clip_model_path=mmproj, verbose=False, use_gpu=False)
            handler._init_mtmd_context(llm)
        except (ValueError, RuntimeError, OSError, ImportError, AttributeError) as exc:
            raise ModelLoadError(f"could not load the mmproj {os.path.basename(mmproj)}: {exc}") from exc
        self._lc = llama_cpp
        self._llm = llm
        self._handler = handler
        #: the text that stands for one image in a prompt
        self.marker: str = mtmd_cpp.mtmd_default_marker().decode("utf-8")
        model = llm._model
        self._add_bos = bool(model.add_bos_token())
        bos = llm.token_bos()
        self._bos_text = model.token_get_text(bos) if self._add_bos and bos >= 0 else ""
        # mtmd logs every prompt and image to stderr on its own; route it through llama-cpp-python's
        # logger, which keeps only errors when verbose is off.
        from llama_cpp._logger import llama_log_callback

        mtmd_cpp.mtmd_log_set(llama_log_callback, None)
        mtmd_cpp.mtmd_helper_log_set(llama_log_callback, None)

    def prefill(self, prompt: str, images: list[bytes]) -> list[int]:
        """Tokenize ``prompt`` with its images through mtmd and evaluate it; return the positions as ids.

        Raises:
            InvalidArgument: An image that does not decode, a marker count that does not match, or no room left.
        """
        handler = self._handler
        mtmd = handler._mtmd_cpp
        llm = self._llm
        n_ctx = llm.n_ctx()
        bitmaps = []
        try:
            for data in images:
                try:
                    bitmaps.append(handler._create_bitmap_from_bytes(data))
                except ValueError as exc:
                    raise InvalidArgument(f"could not decode the image: {exc}") from exc
            if self._bos_text and prompt.startswith(self._bos_text):
                prompt = prompt[len(self._bos_text) :]  # mtmd adds the BOS itself (add_special): keep one
            text = mtmd.mtmd_input_text()
            raw = prompt.encode("utf-8")
            text.text = raw
            text.text_len = len(raw)
            text.add_special = self._add_bos
            text.parse_special = True
            chunks = mtmd.mtmd_input_chunks_init()
            try:
                arr = (mtmd.mtmd_bitmap_p_ctypes * len(bitmaps))(*bitmaps)
                if mtmd.mtmd_tokenize(handler.mtmd_ctx, chunks, ctypes.byref(text), arr, len(bitmaps)) != 0:
                    raise InvalidArgument("the number of images does not match the prompt's image markers")
                llm.reset()
                llm._ctx.kv_cache_clear()
                for i in range(mtmd.mtmd_input_chunks_size(chunks)):
                    self._eval_chunk(mtmd, mtmd.mtmd_input_chunks_get(chunks, i), n_ctx)
            finally:
                mtmd.mtmd_input_chunks_free(chunks)
        finally:
            for bm in bitmaps:
                mtmd.mtmd_bitmap_free(bm)
        return [int(t) for t in llm.input_ids[: llm.n_tokens]]

    def _eval_chunk(self, mtmd: Any, chunk: Any, n_ctx: int) -> None:
        llm = self._llm
        if mtmd.mtmd_input_chunk_get_type(chunk) == mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT:
            n = ctypes.c_size_t()
            ptr = mtmd.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
            toks = [ptr[j] for j in range(n.value)]
            if llm.n_tokens + len(toks) >= n_ctx:
                raise InvalidArgument("the prompt with its images exceeds the context size")
            llm.eval(toks)
            return
        if llm.n_tokens + mtmd.mtmd_input_chunk_get_n_tokens(chunk) >= n_ctx:
            raise InvalidArgument("the prompt with its images exceeds the context size")
        new_past = self._lc.llama_pos(0)
        rc = mtmd.mtmd_helper_eval_chunk_single(
            self._handler.mtmd_ctx,
            llm._ctx.ctx,
            chunk,
            self._lc.llama_pos(llm.n_tokens),
            self._lc.llama_seq_id(0),
            llm.n_batch,
            False,
            ctypes.byref(new_past),
        )
        if rc != 0:
            raise InvalidArgument(f"evaluating an image failed (code {rc})")
        llm.n_tokens = new_past.value


def decode_data_url(url: str) -> bytes:
    """The bytes of a base64 ``data:`` URL. Other URLs are refused: the engine fetches nothing."""
    import base64
    import binascii

    head, sep, payload = url.partition(",")
    if not url.startswith("data:") or not sep or not head.endswith(";base64"):
        raise InvalidArgument("image_url must be a base64 data: URL (data:image/...;base64,...)")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidArgument(f"image_url is not valid base64: {exc}") from exc
    if not data:
        raise InvalidArgument("image_url holds an empty image")
    return data
