"""Which models a panel's model picker offers: those serving its task (chat, transcription, tts, image, upscaling,
...)."""

from __future__ import annotations

from typing import Any

from lemonkit.catalog.model_info import DEPLOYMENT_LABELS, RECIPES
from lemonkit.client import Client

__all__ = ["choices", "serves"]


def serves(model: dict[str, Any], task: str) -> bool:
    """Whether a ``/v1/models`` entry serves ``task`` (a deployment label, or ``upscaling``): its labels say, else its
    recipe."""
    if "upscaling" in (model.get("labels") or ()):  # labelled ``image`` too, but it draws nothing from a prompt
        return task == "upscaling"
    labels = set(model.get("labels") or ()) & DEPLOYMENT_LABELS.keys()
    default = RECIPES.get(model.get("recipe", ""), ("chat", frozenset()))[0]
    return task in (labels or {default})


def choices(client: Client, task: str) -> tuple[list[str], str | None]:
    """The downloaded models serving ``task``, and the one to preselect (a loaded one first)."""
    models = [m["id"] for m in client.models() if serves(m, task) and m.get("supported", True)]
    loaded = {m["model_name"] for m in client.health().get("all_models_loaded", [])}
    return models, next((m for m in models if m in loaded), models[0] if models else None)
