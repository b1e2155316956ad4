"""Engine adapters, one module or package per recipe (``llamacpp``, ``onnxruntime``), and the sidecar that hosts them.

:mod:`~lemonkit.backends.base` is the sidecar-engine protocol, :mod:`~lemonkit.backends.sidecar` the process that
hosts one engine, :mod:`~lemonkit.backends.transport` the server's side of the hop to it, and
:mod:`~lemonkit.backends.chat` the model-free chat formatting LLM engines share.

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
    "onnxruntime": "lemonkit.backends.onnx_embeddings:OnnxEmbeddingEngine",
    "faster-whisper": "lemonkit.backends.whisper:FasterWhisperEngine",
    "piper": "lemonkit.backends.tts.piper:PiperEngine",
    "kokoro": "lemonkit.backends.tts.kokoro:KokoroEngine",
    "hibari": "lemonkit.backends.tts.hibari:HibariEngine",
    "diffusers": "lemonkit.backends.images.diffusers_engine:DiffusersEngine",
    "ncnn": "lemonkit.backends.ncnn_upscale:NcnnUpscaleEngine",
}


def engine_class(recipe: str) -> Any:
    """The engine adapter class for ``recipe``.

    Raises:
        KeyError: No adapter serves this recipe.
    """
    module, _, name = RECIPES[recipe].partition(":")
    return getattr(importlib.import_module(module), name)
