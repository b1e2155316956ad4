"""The ``onnxruntime`` recipe's embedding engine: a sentence-transformers model exported to ONNX, run by onnxruntime
with a ``tokenizers`` tokenizer, pooled and L2-normalised here as sentence-transformers does.

The model is a directory in the layout of sentence-transformers' hub repos with an ONNX export: ``onnx/model.onnx``
(or ``model.onnx``) taking ``input_ids``, ``attention_mask`` (and ``token_type_ids``) and returning the last hidden
state; ``tokenizer.json``; ``1_Pooling/config.json`` (mean or CLS pooling; mean without it); and
``sentence_bert_config.json``, whose ``max_seq_length`` is where inputs are truncated, as sentence-transformers
truncates them. The bundled all-MiniLM-L6-v2 is laid out this way by :mod:`lemonkit.catalog.minilm_bundle`.

Lemonade's ``onnxruntime`` recipe also classifies; this engine only embeds (classification models of the recipe are
listed as unsupported, see :mod:`lemonkit.catalog.support`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from lemonkit.backends.engine_devices import onnx_session
from lemonkit.backends.protocol import Cancelled, LoadSpec, thread_count
from lemonkit.errors import InvalidArgument, ModelLoadError, ModelNotApplicable

__all__ = ["OnnxEmbeddingEngine"]

#: inputs per onnxruntime run: padding to the longest costs little at this size, memory stays small
BATCH = 32


def _read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    value = json.loads(path.read_text(encoding="utf-8"))
    return value if isinstance(value, dict) else {}


class OnnxEmbeddingEngine:
    """One ONNX sentence-embedding model (see :class:`lemonkit.backends.protocol.Engine`).

    Args:
        spec: ``model_path`` (the model directory), ``type`` (must be ``embedding``), optional ``options``
            (``n_threads``).

    Raises:
        ModelLoadError: The directory lacks the model or its tokenizer, or onnxruntime cannot load it.
        InvalidArgument: ``n_threads`` is not a positive integer.
    """

    def __init__(self, spec: LoadSpec) -> None:
        import onnxruntime
        from tokenizers import Tokenizer

        if spec.get("type") != "embedding":
            raise ModelLoadError(f"lemonkit's onnxruntime engine serves embedding models, not {spec.get('type')!r}")
        threads = thread_count(spec.get("options") or {})
        root = Path(spec["model_path"])
        model = next((p for p in (root / "onnx" / "model.onnx", root / "model.onnx") if p.is_file()), None)
        if model is None or not (root / "tokenizer.json").is_file():
            raise ModelLoadError(f"{root} holds no onnx/model.onnx and tokenizer.json")

        pooling = _read_json(root / "1_Pooling" / "config.json")
        self._cls_pooling = bool(pooling.get("pooling_mode_cls_token")) and not pooling.get("pooling_mode_mean_tokens")
        self.max_tokens = int(_read_json(root / "sentence_bert_config.json").get("max_seq_length") or 512)
        try:
            self._tokenizer = Tokenizer.from_file(str(root / "tokenizer.json"))
            self._session, self._placed = onnx_session(onnxruntime, model, threads)
        except Exception as exc:  # onnxruntime and tokenizers raise their own exception types
            raise ModelLoadError(f"onnxruntime could not load {model}: {exc}") from exc
        self._tokenizer.enable_truncation(self.max_tokens)
        self._tokenizer.enable_padding(pad_id=self._tokenizer.token_to_id("[PAD]") or 0)
        self._inputs = {i.name for i in self._session.get_inputs()}
        self._threads = threads
        self._stats: dict[str, Any] = {}
        self._fingerprint = f"onnxruntime-{onnxruntime.__version__}"

    def embed(self, body: dict[str, Any]) -> dict[str, Any]:
        """``/v1/embeddings``: L2-normalised float vectors, one per input (truncated at ``max_seq_length`` tokens)."""
        raw = body.get("input")
        inputs = [raw] if isinstance(raw, str) else raw
        if not isinstance(inputs, list) or not inputs or not all(isinstance(s, str) for s in inputs):
            raise InvalidArgument("'input' must be a string or a non-empty array of strings")
        start = time.perf_counter()
        vectors, tokens = [], 0
        for i in range(0, len(inputs), BATCH):
            pooled, counted = self._run(inputs[i : i + BATCH])
            vectors.append(pooled)
            tokens += counted
        matrix = np.concatenate(vectors)
        matrix /= np.maximum(np.linalg.norm(matrix, axis=1, keepdims=True), 1e-12)
        elapsed = time.perf_counter() - start
        self._stats = {"input_tokens": tokens, "prompt_tokens": tokens, "output_tokens": 0}
        self._stats["time_to_first_token"] = elapsed
        return {
            "object": "list",
            "data": [{"object": "embedding", "index": i, "embedding": row.tolist()} for i, row in enumerate(matrix)],
            "model": body.get("model", ""),
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }

    def _run(self, texts: list[str]) -> tuple[np.ndarray, int]:
        encoded = self._tokenizer.encode_batch(texts)
        ids = np.array([e.ids for e in encoded], dtype=np.int64)
        mask = np.array([e.attention_mask for e in encoded], dtype=np.int64)
        feeds = {"input_ids": ids, "attention_mask": mask}
        if "token_type_ids" in self._inputs:
            feeds["token_type_ids"] = np.zeros_like(ids)
        hidden = self._session.run(None, feeds)[0]
        if self._cls_pooling:
            return hidden[:, 0, :].astype(np.float32), int(mask.sum())
        weights = mask[..., None].astype(np.float32)
        pooled = (hidden * weights).sum(axis=1) / np.maximum(weights.sum(axis=1), 1e-9)
        return pooled.astype(np.float32), int(mask.sum())

    def chat(self, body: dict[str, Any], *, cancelled: Cancelled) -> dict[str, Any] | Iterator[dict[str, Any]]:
        raise ModelNotApplicable("this is an embedding model: it does not serve chat completions")

    def complete(self, body: dict[str, Any], *, cancelled: Cancelled) -> dict[str, Any] | Iterator[dict[str, Any]]:
        raise ModelNotApplicable("this is an embedding model: it does not serve completions")

    def rerank(self, body: dict[str, Any]) -> dict[str, Any]:
        raise ModelNotApplicable("this is an embedding model: it does not rerank")

    def stats(self) -> dict[str, Any]:
        return dict(self._stats)

    def info(self) -> dict[str, Any]:
        return {
            "type": "embedding",
            "ctx_size": self.max_tokens,
            "n_threads": self._threads,
            "device": self._placed.device,
            "providers": self._session.get_providers(),
            "engine": self._fingerprint,
        }

    def close(self) -> None:
        self._session = None
