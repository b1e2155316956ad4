"""What ``/api/tags``, ``/api/show`` and ``/api/ps`` say of a model: its file, quantization, size, capabilities."""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from lemonkit.catalog.registry import ModelInfo
from lemonkit.formats.gguf_header import read_gguf_metadata

# -- what /api/tags, /api/show and /api/ps say of a model --------------------------------------------------------------


def _main_file(service: Any, info: ModelInfo) -> Path | None:
    for entry in service.registry.model_files(info):
        if entry["role"] == "main" and entry["exists"]:
            return Path(entry["path"])
    return None


def _quantization(metadata: dict[str, Any]) -> str:
    file_type = metadata.get("general.file_type")
    if not isinstance(file_type, int):
        return ""
    from gguf.constants import LlamaFileType

    try:
        return LlamaFileType(file_type).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except ValueError:
        return ""


def _parameter_size(metadata: dict[str, Any]) -> str:
    label = metadata.get("general.size_label")
    if isinstance(label, str) and label:
        return label
    count = metadata.get("general.parameter_count")
    if isinstance(count, int) and count > 0:
        for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
            if count >= size:
                return f"{count / size:.1f}{unit}".replace(".0", "")
    return ""


def describe_model(service: Any, info: ModelInfo) -> dict[str, Any]:
    """What the model-listing routes say of a model: its files' size, newest time and metadata (read off the
    GGUF header, never loading the model)."""
    files = [f for f in service.registry.model_files(info) if f["exists"]]
    size = sum(int(f["size_bytes"]) for f in files)
    times = [Path(f["path"]).stat().st_mtime for f in files if Path(f["path"]).exists()]
    main = _main_file(service, info)
    metadata = read_gguf_metadata(main) if main is not None and main.suffix == ".gguf" else {}
    family = str(metadata.get("general.architecture") or info.recipe)
    identity = f"{info.id}\n{info.checkpoint}\n{size}\n{max(times, default=0)}"
    return {
        "size": size,
        "modified_at": datetime.fromtimestamp(max(times, default=0), UTC).isoformat().replace("+00:00", "Z"),
        # Ollama's digest names a manifest; lemonkit's names the model's files as they are (not their contents)
        "digest": hashlib.sha256(identity.encode()).hexdigest(),
        "details": {
            "parent_model": "",
            "format": "gguf" if metadata else info.recipe,
            "family": family,
            "families": [family],
            "parameter_size": _parameter_size(metadata),
            "quantization_level": _quantization(metadata),
        },
        "metadata": metadata,
    }


def capabilities(info: ModelInfo, metadata: dict[str, Any]) -> list[str]:
    template = str(metadata.get("tokenizer.chat_template") or "")
    found = {"llm": ["completion"], "embedding": ["embedding"]}.get(info.type, [info.type])
    if info.type == "llm" and ("tools" in template or "tool" in info.labels):
        found.append("tools")
    if "vision" in info.labels or "mmproj" in info.checkpoints:
        found.append("vision")
    if "reasoning" in info.labels or "<think>" in template or "enable_thinking" in template:
        found.append("thinking")
    return found


def tag_of(info: ModelInfo) -> str:
    return info.id if ":" in info.id else f"{info.id}:latest"
