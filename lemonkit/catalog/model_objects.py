"""The spec's model object (``GET /v1/models``, ``GET /v1/models/{id}``): what the API says about a registered model.

Built from the registry's view of it: its row, its checkpoints on disk, its saved options, a downloaded GGUF's
trained context, and whether the hub has a newer commit (:attr:`lemonkit.catalog.registry.Registry.update_check`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from lemonkit.catalog.hf_cache import GGUF_RECIPES
from lemonkit.catalog.model_info import COLLECTION_OMNI, ModelInfo
from lemonkit.formats.gguf_header import read_gguf_context_length

if TYPE_CHECKING:
    from lemonkit.catalog.registry import Registry

__all__ = ["max_context_window", "model_object"]


def max_context_window(
    registry: Registry, info: ModelInfo, status: Iterable[dict[str, Any]] | None = None
) -> int | None:
    """The largest context the model supports: the downloaded GGUF's metadata, else the catalog's figure.

    Args:
        registry: Where its files are looked up.
        info: The model.
        status: Its ``checkpoint_status(info, include_paths=True)``, when already computed.

    Returns:
        Tokens, or ``None`` when unknown.
    """
    if info.recipe in GGUF_RECIPES:
        entries = status if status is not None else registry.checkpoint_status(info, include_paths=True)
        main = next((s for s in entries if s["type"] == "main"), None)
        path = main.get("path") if main else None
        if path and str(path).lower().endswith(".gguf"):
            value = read_gguf_context_length(path)
            if value:
                return value
    return info.max_context_window


def model_object(
    registry: Registry, info: ModelInfo, *, include_paths: bool = False, context_length: int | None = None
) -> dict[str, Any]:
    """The spec's model object (``GET /v1/models``, ``GET /v1/models/{id}``) for a local model.

    Args:
        registry: Where its files, saved options and components are looked up.
        info: The model (an alias copy keeps its alias as ``id``).
        include_paths: Add absolute paths of present checkpoints to ``checkpoint_status``.
        context_length: The loaded ``ctx_size`` when the model is running.

    Returns:
        A JSON-ready dict; ``size``, ``max_context_window`` and ``context_length`` are omitted when unknown.
    """
    status = registry.checkpoint_status(info, include_paths=True)
    if info.recipe == COLLECTION_OMNI:
        downloaded = registry.is_downloaded(info)
    else:
        downloaded = all(s["present"] for s in status if s["required"])
    options = {**info.recipe_options, **registry.saved_options(info.target_id)}
    max_ctx = max_context_window(registry, info, status)
    configured = options.get("ctx_size")
    if context_length is None and isinstance(configured, int) and not isinstance(configured, bool) and configured > 0:
        context_length = configured
    if context_length is None:
        context_length = max_ctx
    if not include_paths:
        status = [{k: v for k, v in s.items() if k != "path"} for s in status]
    obj: dict[str, Any] = {
        "id": info.id,
        "created": 1234567890,
        "object": "model",
        "owned_by": "lemonade",
        "checkpoint": info.checkpoint,
        "recipe": info.recipe,
    }
    if info.size is not None:
        obj["size"] = info.size
    if max_ctx is not None:
        obj["max_context_window"] = max_ctx
    if context_length is not None:
        obj["context_length"] = context_length
    obj.update(
        downloaded=downloaded,
        update_available=downloaded and registry.update_check(info),
        suggested=info.suggested,
        labels=list(info.labels),
        components=list(info.components),
        checkpoints=dict(info.checkpoints),
        checkpoint_status=status,
        source=info.source,
        registry_source=info.registry_source,
        recipe_options=options,
    )
    if info.image_defaults:
        obj["image_defaults"] = dict(info.image_defaults)
    if info.remote is not None:  # where it is served; its key's value never leaves the server
        obj["remote_urls"] = list(info.remote.urls)
    if info.recipe == COLLECTION_OMNI:
        parts = registry.collection_parts(info)
        obj["models"] = [model_object(registry, part) for part in parts]
        # the collection's override ("": the omni loop uses the built-in prompt for its tools), as the spec has it
        obj["system_prompt"] = info.system_prompt or ""
    return obj
