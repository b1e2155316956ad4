"""Reading a sentence-transformers BERT model directory without torch: its config, pooling and safetensors weights.

Shared by the benchmarks' converters of the float32 weights (``bert_onnx.py``, ``minilm_gguf.py``).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["SentenceBert"]

_DTYPES = {"F32": np.float32, "F16": np.float16, "I64": np.int64}


@dataclass(frozen=True)
class SentenceBert:
    """A mean-pooled BERT sentence-transformers directory.

    Raises:
        ValueError: (from :meth:`open`) The directory is not one.
    """

    path: Path
    config: dict[str, Any]

    @classmethod
    def open(cls, path: Path) -> SentenceBert:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
        pooling = json.loads((path / "1_Pooling" / "config.json").read_text(encoding="utf-8"))
        if config.get("model_type") != "bert" or not pooling.get("pooling_mode_mean_tokens"):
            raise ValueError(f"{path} is not a mean-pooled BERT sentence-transformers model")
        return cls(path, config)

    @property
    def tokenizer_file(self) -> Path:
        return self.path / "tokenizer.json"

    @property
    def max_seq_length(self) -> int:
        """Tokens sentence-transformers keeps of an input (it truncates the rest)."""
        settings = self.path / "sentence_bert_config.json"
        if settings.exists():
            length = json.loads(settings.read_text(encoding="utf-8")).get("max_seq_length")
            if isinstance(length, int):
                return length
        return int(self.config["max_position_embeddings"])

    def tensors(self) -> Iterator[tuple[str, np.ndarray]]:
        """``(name, array)`` pairs of ``model.safetensors``, in name order (memory-mapped, not copied)."""
        path = self.path / "model.safetensors"
        with path.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header: dict[str, Any] = json.loads(f.read(size))
        data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + size)
        for name in sorted(k for k in header if k != "__metadata__"):
            entry = header[name]
            start, end = entry["data_offsets"]
            yield name, data[start:end].view(_DTYPES[entry["dtype"]]).reshape(entry["shape"])
