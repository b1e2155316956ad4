"""Which files of a diffusers-layout repo a pipeline needs (the ``diffusers`` recipe's download plan).

A Stable Diffusion repo on the hub holds the diffusers layout (``model_index.json`` and one folder per component)
next to single-file checkpoints of the same weights (``sd_turbo.safetensors``, ``v1-5-pruned.ckpt``), often in
several precisions and formats (``.fp16.safetensors``, ``.bin``, ``.msgpack``, ``.onnx``). A pipeline needs the
index, each component's configuration and one copy of its weights: fp16 safetensors when the repo has them (half
the bytes; the engine loads them as float32), else safetensors, else PyTorch ``.bin``. The NSFW classifier
(``safety_checker``, 1.2 GB) is left out: the engine loads without it.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import PurePosixPath

__all__ = ["INDEX", "diffusers_files"]

INDEX = "model_index.json"
#: component folders never fetched
_SKIPPED_FOLDERS = frozenset({"safety_checker"})
#: weight formats, in the order they are preferred; other weight formats (ckpt, msgpack, h5, onnx) are skipped
_PREFERRED = (".fp16.safetensors", ".safetensors", ".fp16.bin", ".bin")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".ckpt", ".pt", ".pth", ".msgpack", ".h5", ".onnx", ".onnx_data", ".pb")
#: non-weight files a component folder needs
_CONFIG_SUFFIXES = (".json", ".txt", ".model")


def _format(name: str) -> str | None:
    """The preferred-format suffix a weight file has (sharded names included), else ``None``."""
    lowered = name.lower()
    for suffix in _PREFERRED:
        stem_suffix = suffix.rsplit(".", 1)[-1]
        if not lowered.endswith("." + stem_suffix):
            continue
        if suffix.startswith(".fp16") == (".fp16." in lowered or "-fp16" in lowered):
            return suffix
    return None


def diffusers_files(names: Iterable[str]) -> list[str]:
    """The files of a repo listing a diffusers pipeline loads from.

    Args:
        names: Every file path in the repo (``/`` separated).

    Returns:
        ``model_index.json``, every component's configuration files and one format of its weights, sorted; ``[]``
        when the repo has no ``model_index.json`` (it is no diffusers pipeline).
    """
    listed = list(names)
    if INDEX not in listed:
        return []
    chosen = [INDEX]
    folders: dict[str, list[str]] = {}
    for name in listed:
        path = PurePosixPath(name)
        if len(path.parts) == 2 and path.parts[0] not in _SKIPPED_FOLDERS:
            folders.setdefault(path.parts[0], []).append(name)
    for files in folders.values():
        weights = [f for f in files if f.lower().endswith(_WEIGHT_SUFFIXES)]
        chosen += [f for f in files if f not in weights and f.lower().endswith(_CONFIG_SUFFIXES)]
        by_format: dict[str, list[str]] = {}
        for f in weights:
            fmt = _format(f)
            if fmt is not None:
                by_format.setdefault(fmt, []).append(f)
        best = next((by_format[fmt] for fmt in _PREFERRED if fmt in by_format), [])
        chosen += best
    return sorted(chosen)
