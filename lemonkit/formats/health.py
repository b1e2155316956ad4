"""Reading the ``/v1/health`` answer: which model of a kind is loaded. The server (a route without ``model``) and
the Python client (``model=None``) pick the same one."""

from __future__ import annotations

from typing import Any

__all__ = ["loaded_model"]


def loaded_model(health: dict[str, Any], kind: str) -> str | None:
    """The loaded model of type ``kind`` (``"llm"``, ``"embedding"``, ``"reranking"``): the last used first."""
    loaded = [m["model_name"] for m in health.get("all_models_loaded") or [] if m.get("type") == kind]
    if health.get("model_loaded") in loaded:
        return str(health["model_loaded"])
    return loaded[0] if loaded else None
