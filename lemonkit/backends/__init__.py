"""Engine adapters, one module or package per recipe (``llamacpp``, ``onnxruntime``), and the sidecar that hosts them.

:mod:`~lemonkit.backends.protocol` is the sidecar-engine protocol, :mod:`~lemonkit.backends.sidecar` the process that
hosts one engine, :mod:`~lemonkit.backends.transport` the server's side of the hop to it, and
:mod:`~lemonkit.backends.chat` the model-free chat formatting LLM engines share.

Adapters import their engine lazily: the server process never imports an
inference library, only the sidecar does.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

__all__ = ["RECIPES", "engine_class", "sidecar_env"]

#: recipes whose engine runs on ggml's CPU threads, and what their sidecars set:
#: - glibc's malloc asks for transparent huge pages on what it maps (glibc 2.35 on; ignored before, and where the
#:   kernel's THP mode is never): decoding walks every weight each token, and 4 KiB pages cost it TLB misses (Gemma 3
#:   270M on 2 threads: +10-15% tok/s on one stream, +4% on four);
#: - libgomp's workers sleep after 10,000 spins instead of 300,000: a sidecar waiting for its CPU turn
#:   (backends.llamacpp.cpu_turns) must not spin on the cores another's decode uses (one stream decoded as fast).
_GGML_RECIPES = frozenset({"llamacpp"})
_HUGE_PAGES = "glibc.malloc.hugetlb=1"
_SPIN = "10000"

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


def sidecar_env(recipe: str, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a sidecar serving ``recipe``: the server's, with huge pages and a short OpenMP spin for the
    recipes that run on ggml's CPU threads.

    What the operator set wins: a ``glibc.malloc.hugetlb`` tunable in ``GLIBC_TUNABLES``, ``GOMP_SPINCOUNT`` or
    ``OMP_WAIT_POLICY``.
    """
    env = dict(os.environ if environ is None else environ)
    tunables = env.get("GLIBC_TUNABLES", "")
    if recipe not in _GGML_RECIPES:
        return env
    if "glibc.malloc.hugetlb" not in tunables:
        env["GLIBC_TUNABLES"] = f"{tunables}:{_HUGE_PAGES}" if tunables else _HUGE_PAGES
    if "GOMP_SPINCOUNT" not in env and "OMP_WAIT_POLICY" not in env:
        env["GOMP_SPINCOUNT"] = _SPIN
    return env
