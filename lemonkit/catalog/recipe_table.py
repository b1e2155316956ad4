"""The recipe table: each recipe's backends, the devices they run on and the package that provides them.

Recipes are data (:data:`DEFAULT_RECIPES`): each backend names the devices it runs on and the Python distribution
that provides it, so a speech, TTS or image recipe is added by adding an entry, not code. An operator's JSON file
(``LEMONKIT_RECIPES``) is merged over the defaults by :func:`load_recipes`: a new row, or a changed field of one (an
index with prebuilt wheels for ``pip_args``, a pinned ``requirement``). What a row's state is on this machine is
:func:`lemonkit.catalog.system_info.backend_status`.
"""

from __future__ import annotations

import copy
import json
import os
from typing import Any

__all__ = ["DEFAULT_RECIPES", "load_recipes"]

#: recipe -> {"default_backend": name, "backends": {name: spec}}. A backend spec's keys, all optional:
#:   devices      device kinds it runs on ("cpu", "amd_gpu", "nvidia_gpu", "amd_npu", "vulkan": a Vulkan device
#:                ggml would use, "metal": Apple's GPU); none present -> unsupported
#:   os           platform.system() value it requires ("Darwin" for Metal)
#:   missing      message when its devices/OS are absent
#:   unsupported  message that makes it unsupported regardless (lemonkit has no engine for it)
#:   distribution PyPI distribution providing it (absent: part of lemonkit, always installed)
#:   module       top-level module that must be importable (checked with find_spec, without importing)
#:   min_version  oldest usable version; lemonkit's own requirement for the extra wins when installed
#:   extra        lemonkit extra that installs it, for the action text
#:   requirement  what ``POST /v1/install`` asks pip for (default: lemonkit's own requirement for the
#:                distribution in ``extra``, else ``distribution>=min_version``, else the distribution)
#:   pip_args     extra ``pip install`` arguments (``--extra-index-url ...``, ``--find-links DIR``)
#:   build        a llama.cpp backend lemonkit compiles (lemonkit.catalog.llamacpp_builds): its state is that of
#:                the build installed apart under the cache (for "cpu": lemonkit's own first)
#:   serves       deployment labels lemonkit's engine for the recipe serves, when fewer than the recipe's
#:                (``onnxruntime``: embeddings, not classification); models of the others are unsupported
DEFAULT_RECIPES: dict[str, dict[str, Any]] = {
    # llama.cpp: lemonkit's own CPU build (pip's, with lemonkit[llamacpp]) and the builds /v1/install compiles per
    # backend into the cache (lemonkit.catalog.llamacpp_builds); "build" names the backend whose CMake flags make it
    "llamacpp": {
        "default_backend": "cpu",
        "backends": {
            "cpu": {
                "devices": ["cpu"],
                "distribution": "llama-cpp-python",
                "module": "llama_cpp",
                "min_version": "0.3.36",
                "extra": "llamacpp",
                "build": "cpu",
            },
            "vulkan": {"devices": ["vulkan"], "build": "vulkan", "missing": "No Vulkan GPU found."},
            "cuda": {"devices": ["nvidia_gpu"], "build": "cuda", "missing": "No NVIDIA GPU found."},
            "rocm": {"devices": ["amd_gpu"], "build": "rocm", "missing": "No AMD GPU found."},
            "metal": {"devices": ["metal"], "os": "Darwin", "build": "metal", "missing": "Requires macOS"},
        },
    },
    "onnxruntime": {
        "default_backend": "cpu",
        "backends": {
            "cpu": {
                "devices": ["cpu"],
                "distribution": "onnxruntime",
                "module": "onnxruntime",
                "min_version": "1.17",
                "extra": "embeddings",
                "serves": ["embeddings"],
            },
        },
    },
    # speech-to-text and text-to-speech: one engine each, all on the CPU (CTranslate2 and ONNX Runtime)
    "faster-whisper": {
        "default_backend": "cpu",
        "backends": {
            "cpu": {
                "devices": ["cpu"],
                "distribution": "faster-whisper",
                "module": "faster_whisper",
                "min_version": "1.2.1",
                "extra": "audio",
            },
        },
    },
    "piper": {
        "default_backend": "cpu",
        "backends": {
            "cpu": {
                "devices": ["cpu"],
                "distribution": "piper-tts",
                "module": "piper",
                "min_version": "1.8.0",
                "extra": "audio",
            },
        },
    },
    "kokoro": {
        "default_backend": "cpu",
        "backends": {
            "cpu": {
                "devices": ["cpu"],
                "distribution": "kokoro-onnx",
                "module": "kokoro_onnx",
                "min_version": "0.6.1",
                "extra": "audio",
            },
        },
    },
    "hibari": {
        "default_backend": "cpu",
        "backends": {
            "cpu": {
                "devices": ["cpu"],
                "distribution": "hibari-tts",
                "module": "hibari",
                "min_version": "0.2.1",
                "extra": "audio",
            },
        },
    },
    "diffusers": {
        "default_backend": "cpu",
        "backends": {
            "cpu": {
                "devices": ["cpu"],
                "distribution": "diffusers",
                "module": "diffusers",
                "min_version": "0.42.1",
                "extra": "images",
            },
        },
    },
    # a model another server serves over an OpenAI-compatible API: lemonkit only forwards, nothing to install
    "remote": {"default_backend": "http", "backends": {"http": {}}},
    # image upscaling: Real-ESRGAN networks on ncnn's CPU path (its Vulkan path is never enabled)
    "ncnn": {
        "default_backend": "cpu",
        "backends": {
            "cpu": {
                "devices": ["cpu"],
                "distribution": "ncnn",
                "module": "ncnn",
                "min_version": "1.0.20240410",
                "extra": "upscale",
            },
        },
    },
}


def load_recipes(path: str | os.PathLike[str] | None = None) -> dict[str, dict[str, Any]]:
    """:data:`DEFAULT_RECIPES` with the operator's JSON file at ``path`` merged over it.

    The file has the same shape. A recipe or backend it names that is not in the defaults is added; for
    one that is, its ``default_backend`` and each backend field it gives replace the default's (``null``
    removes a field).

    Raises:
        ValueError: The file is unreadable or not shaped like the table.
    """
    recipes = copy.deepcopy(DEFAULT_RECIPES)
    if not path:
        return recipes
    try:
        with open(path, encoding="utf-8") as f:
            extra = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"recipes file {path}: {exc}") from None
    if not isinstance(extra, dict):
        raise ValueError(f"recipes file {path}: expected a JSON object of recipes")
    for name, table in extra.items():
        backends = table.get("backends", {}) if isinstance(table, dict) else None
        if not isinstance(backends, dict) or not all(isinstance(b, dict) for b in backends.values()):
            raise ValueError(f"recipes file {path}: {name}: expected {{'backends': {{name: {{...}}}}}}")
        target = recipes.setdefault(name, {"backends": {}})
        if table.get("default_backend"):
            target["default_backend"] = table["default_backend"]
        for backend, fields in backends.items():
            args = fields.get("pip_args")
            if args is not None and not (isinstance(args, list) and all(isinstance(a, str) for a in args)):
                raise ValueError(f"recipes file {path}: {name}.{backend}.pip_args: expected a list of strings")
            merged = {**target["backends"].get(backend, {}), **fields}
            target["backends"][backend] = {k: v for k, v in merged.items() if v is not None}
    return recipes
