"""Engine adapters, one module per recipe, and the sidecar that hosts them.

Adapters import their engine lazily: the server process never imports an
inference library, only the sidecar does.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["RECIPES", "engine_class"]

#: recipe -> "module:Class" of its engine adapter
RECIPES: dict[str, str] = {
    "llamacpp": "lemonkit.backends.llamacpp:LlamaCppEngine",
}


def engine_class(recipe: str) -> Any:
    """The engine adapter class for ``recipe``.

    Raises:
        KeyError: No adapter serves this recipe.
    """
    module, _, name = RECIPES[recipe].partition(":")
    return getattr(importlib.import_module(module), name)
