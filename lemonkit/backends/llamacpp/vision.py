"""Image input: an mmproj loaded next to the model, and prompts with images evaluated through llama.cpp's mtmd."""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Callable, Iterator
from typing import Any

from lemonkit.errors import InvalidArgument, ModelLoadError

__all__ = ["DecodeText", "Vision", "decode_data_url"]

#: Evaluates text tokens into the sequence being filled, from a position, with logits for the last token.
DecodeText = Callable[[list[int], int], None]


@contextlib.contextmanager
def _no_warmup(mtmd_cpp: Any) -> Iterator[None]:
    """mtmd's warmup encodes a dummy image on the loading thread; skipped, so that every ggml computation of the
    model runs on its decode thread (an OpenMP team on a second thread slowed decoding by about 30%)."""
    default = mtmd_cpp.mtmd_context_params_default

    def params() -> Any:
        p = default()
        p.warmup = False
        return p

    mtmd_cpp.mtmd_context_params_default = params
    try:
        yield
    finally:
        mtmd_cpp.mtmd_context_params_default = default


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
            with _no_warmup(mtmd_cpp):
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

    def prefill(self, prompt: str, images: list[bytes], *, seq: int, decode_text: DecodeText) -> int:
        """Tokenize ``prompt`` with its images through mtmd and evaluate it into sequence ``seq`` from position 0.

        Args:
            prompt: The rendered prompt, one :attr:`marker` per image.
            images: The image files, in the prompt's order.
            seq: The (emptied) sequence of the context to fill.
            decode_text: Evaluates text tokens at a position of ``seq``, logits for the last one.

        Returns:
            The positions the prompt fills; the last decode's last logits row predicts the next token.

        Raises:
            InvalidArgument: An image that does not decode, a marker count that does not match, or no room left.
        """
        handler = self._handler
        mtmd = handler._mtmd_cpp
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
                n_past = 0
                for i in range(mtmd.mtmd_input_chunks_size(chunks)):
                    n_past = self._eval_chunk(mtmd, mtmd.mtmd_input_chunks_get(chunks, i), n_past, seq, decode_text)
            finally:
                mtmd.mtmd_input_chunks_free(chunks)
        finally:
            for bm in bitmaps:
                mtmd.mtmd_bitmap_free(bm)
        return n_past

    def _eval_chunk(self, mtmd: Any, chunk: Any, n_past: int, seq: int, decode_text: DecodeText) -> int:
        llm = self._llm
        n_ctx = llm.n_ctx()
        if mtmd.mtmd_input_chunk_get_type(chunk) == mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT:
            n = ctypes.c_size_t()
            ptr = mtmd.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
            toks = [ptr[j] for j in range(n.value)]
            if n_past + len(toks) >= n_ctx:
                raise InvalidArgument("the prompt with its images exceeds the context size")
            decode_text(toks, n_past)
            return n_past + len(toks)
        if n_past + mtmd.mtmd_input_chunk_get_n_tokens(chunk) >= n_ctx:
            raise InvalidArgument("the prompt with its images exceeds the context size")
        new_past = self._lc.llama_pos(0)
        rc = mtmd.mtmd_helper_eval_chunk_single(
            self._handler.mtmd_ctx,
            llm._ctx.ctx,
            chunk,
            self._lc.llama_pos(n_past),
            self._lc.llama_seq_id(seq),
            llm.n_batch,
            True,  # logits for the last position: a prompt may end with its image
            ctypes.byref(new_past),
        )
        if rc != 0:
            raise InvalidArgument(f"evaluating an image failed (code {rc})")
        return int(new_past.value)


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
