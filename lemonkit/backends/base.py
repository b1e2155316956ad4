"""The protocol between a sidecar process and the engine it wraps.

A sidecar (:mod:`lemonkit.backends.sidecar`) owns exactly one :class:`Engine`.
It calls the engine's methods on one worker thread, one request at a time, in
arrival order; the engine never sees the event loop or HTTP. A streaming method
returns an iterator of OpenAI chunk dicts; the sidecar frames them as SSE,
checks ``cancelled`` for the engine, and turns exceptions into error answers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol, TypedDict

__all__ = ["ROUTES", "Cancelled", "Engine", "LoadSpec"]

Cancelled = Callable[[], bool]


class LoadSpec(TypedDict, total=False):
    """What the manager sends a sidecar to load (JSON over stdin)."""

    model_name: str
    recipe: str
    type: str  # "llm" | "embedding" | "reranking" | ...
    model_path: str
    mmproj_path: str | None
    chat_format: str | None
    options: dict[str, Any]  # resolved recipe options: ctx_size, llamacpp_args, ...


class Engine(Protocol):
    """One loaded model. Every method may raise :class:`lemonkit.errors.LemonkitError`."""

    def chat(self, body: dict[str, Any], *, cancelled: Cancelled) -> dict[str, Any] | Iterator[dict[str, Any]]:
        """``/v1/chat/completions``: a completion dict, or chunks when ``body["stream"]``."""
        ...

    def complete(self, body: dict[str, Any], *, cancelled: Cancelled) -> dict[str, Any] | Iterator[dict[str, Any]]:
        """``/v1/completions``."""
        ...

    def embed(self, body: dict[str, Any]) -> dict[str, Any]:
        """``/v1/embeddings`` (always float vectors; the front encodes base64)."""
        ...

    def rerank(self, body: dict[str, Any]) -> dict[str, Any]:
        """``/v1/rerank``."""
        ...

    def stats(self) -> dict[str, Any]:
        """``/v1/stats`` fields for the last request this engine served."""
        ...

    def info(self) -> dict[str, Any]:
        """Facts about the loaded model: ``ctx_size``, ``n_threads``, ``device``..."""
        ...

    def close(self) -> None: ...


#: sidecar path -> (engine method, takes ``cancelled``)
ROUTES: dict[str, tuple[str, bool]] = {
    "/v1/chat/completions": ("chat", True),
    "/v1/completions": ("complete", True),
    "/v1/embeddings": ("embed", False),
    "/v1/rerank": ("rerank", False),
}
