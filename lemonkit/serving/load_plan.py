"""What a load runs with: its backend checked against this machine, its files, its memory, its sidecar's spec.

The model manager resolves a load's options (:mod:`lemonkit.catalog.recipe_options`), refuses a backend this
machine cannot run or has not installed (:func:`check_backend`), and then plans the sidecar (:func:`plan_load`):
the model's files, a GGUF checked before anything is spawned, the cap on an automatic context, the host memory the
sidecar will take, and the :class:`~lemonkit.backends.protocol.LoadSpec` it is started with; a llama.cpp load
also names the build it runs on (:func:`llamacpp_build`). Saving a load's options and pin goes through
:func:`replace_options` and :func:`set_pin`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lemonkit.backends.protocol import LoadSpec
from lemonkit.catalog import llamacpp_builds
from lemonkit.catalog.config import Settings
from lemonkit.catalog.hardware import detect_devices
from lemonkit.catalog.model_info import ModelInfo, ResolvedFiles
from lemonkit.catalog.recipe_options import RECIPE_OPTIONS, drafts_with_head, is_unset
from lemonkit.catalog.registry import Registry
from lemonkit.catalog.system_info import backend_status
from lemonkit.errors import BackendNotInstalled, InvalidArgument, ModelLoadRefused, ModelNotFound
from lemonkit.formats.llamacpp_args import parse_llamacpp_args
from lemonkit.serving.memory import auto_context_limit, host_need

__all__ = [
    "LoadPlan",
    "check_backend",
    "draft_file",
    "head_file",
    "llamacpp_build",
    "plan_load",
    "replace_options",
    "set_pin",
]


async def check_backend(settings: Settings, recipe: str, backend: str, *, installed: bool) -> None:
    """Refuse a backend this machine cannot run, or (``installed``) one whose build is not installed.

    Raises:
        InvalidArgument: The recipe table has no such backend, or it cannot run here (an option value this
            machine cannot honour, as the spec's tables have it).
        BackendNotInstalled: ``installed`` and it is not installed, or must be rebuilt first; the message names the
            install action.
    """
    spec = settings.recipes.get(recipe, {}).get("backends", {}).get(backend)
    if spec is None:
        raise InvalidArgument(f"{recipe}_backend {backend!r}: lemonkit's recipe table has no such backend")
    cache = settings.cache_dir
    status = await asyncio.to_thread(lambda: backend_status(spec, detect_devices(), cache_dir=cache))
    if status["state"] == "unsupported":
        raise InvalidArgument(f"{recipe}_backend {backend!r} cannot run on this machine: {status['message']}")
    # a build of another llama-cpp-python release would load with the wrong bindings; a package that is only
    # older than lemonkit asks still runs
    stale = status["state"] == "update_required" and spec.get("build") not in (None, "cpu")
    if installed and (status["state"] == "installable" or stale):
        raise BackendNotInstalled(
            f"{recipe}:{backend} is {'not installed' if status['state'] == 'installable' else status['state']}"
            f" ({status['message']}); install it: {status['action']}"
        )


@dataclass
class LoadPlan:
    """What a local model's sidecar is started with."""

    files: ResolvedFiles
    spec: LoadSpec
    #: the host memory the sidecar will take (:func:`lemonkit.serving.memory.host_need`)
    host_bytes: int
    #: the cap on an automatic context (:func:`lemonkit.serving.memory.auto_context_limit`; ``None``: not llama.cpp,
    #: or a GGUF that says nothing of its layers)
    auto_limit: int | None


async def plan_load(settings: Settings, registry: Registry, info: ModelInfo, options: dict[str, Any]) -> LoadPlan:
    """Plan ``info``'s sidecar with ``options`` (the disk work in threads).

    Raises:
        ModelLoadError: A required checkpoint is not on disk.
        ModelLoadRefused: A llama.cpp model's file is not a GGUF.
    """
    files = await asyncio.to_thread(registry.resolve, info)
    auto_limit = None
    if info.recipe == "llamacpp":
        await asyncio.to_thread(_check_gguf, files.main)
        auto_limit = await asyncio.to_thread(auto_context_limit, settings, files.main, options)
    draft = head = None
    if info.recipe == "llamacpp":
        draft = await asyncio.to_thread(draft_file, registry, info, files, options)
        head = await asyncio.to_thread(head_file, registry, info, files, options)
    others = [files.mmproj, *(p for p in files.extra.values() if p != draft)]
    if head is not None and head not in others:
        others.append(head)
    host_bytes = await asyncio.to_thread(host_need, info, files.main, others, options, auto_limit, draft)
    spec: LoadSpec = {
        "model_name": info.id,
        "recipe": info.recipe,
        "type": info.type,
        "model_path": str(files.main),
        "mmproj_path": str(files.mmproj) if files.mmproj else None,
        "draft_path": str(draft) if draft else None,
        "mtp_path": str(head) if head else None,
        "chat_format": info.chat_format,
        "labels": list(info.labels),  # the mtp label's speculative defaults
        "options": options,
        "auto_ctx_limit": auto_limit,
    }
    return LoadPlan(files=files, spec=spec, host_bytes=host_bytes, auto_limit=auto_limit)


async def llamacpp_build(settings: Settings, options: dict[str, Any]) -> tuple[str | None, str | None]:
    """The llama.cpp build installed apart that a load with ``options`` runs on, and its site directory (``None``
    twice: lemonkit's own CPU build).

    Raises:
        BackendNotInstalled: A GPU backend whose build is not installed.
    """
    backend = str(options.get("llamacpp_backend") or "cpu")
    found = await asyncio.to_thread(llamacpp_builds.installed, settings.cache_dir, backend)
    if found is not None and not (backend == "cpu" and llamacpp_builds.own_version()):
        return backend, str(found.site)
    if backend != "cpu":
        raise BackendNotInstalled(
            f"llamacpp:{backend} is not installed; install it: POST /v1/install "
            f'{{"recipe": "llamacpp", "backend": "{backend}"}}'
        )
    return None, None


#: labels of rows whose "draft" checkpoint is a head of the target (MTP, DFlash), not a model that drafts alone
_HEAD_LABELS = frozenset({"mtp", "dflash"})


def draft_file(registry: Registry, info: ModelInfo, files: ResolvedFiles, options: dict[str, Any]) -> Path | None:
    """(Blocking.) The draft model a llama.cpp load speculates with, if any: the registered model ``-md`` names,
    else the row's ``draft`` checkpoint, else (with ``--spec-type draft-simple``) the one ``*draft*.gguf`` beside the
    model's file, as Lemonade finds draft companions.

    Raises:
        InvalidArgument: ``-md`` names no llama.cpp model of the registry, or ``draft-simple`` finds no draft model.
        ModelLoadError: That model is not downloaded.
    """
    args = parse_llamacpp_args(str(options.get("llamacpp_args") or ""))
    kinds = args.get("spec_type")
    if info.type != "llm" or kinds == ():
        return None
    name = args.get("model_draft")
    if name is not None:
        main = _named_model(registry, name)
        return main if kinds is None or "draft-simple" in kinds else None  # n-grams, or an MTP head (head_file)
    wanted = kinds is not None and "draft-simple" in kinds
    draft = files.extra.get("draft")
    if draft is not None and (wanted or (kinds is None and not _HEAD_LABELS & set(info.labels))):
        return draft
    if not wanted:
        return None
    companions = [
        p
        for p in sorted(files.main.parent.glob("*.gguf"))
        if "draft" in p.name.lower() and p != files.main and "mmproj" not in p.name.lower()
    ]
    if len(companions) != 1:
        found = f" ({len(companions)} *draft*.gguf files beside it: name one with -md)" if companions else ""
        raise InvalidArgument(
            f"llamacpp_args: --spec-type draft-simple needs a draft model{found}: name one with -md <registered "
            'model>, give the model a "draft" checkpoint, or put one *draft*.gguf beside its file'
        )
    return companions[0]


def head_file(registry: Registry, info: ModelInfo, files: ResolvedFiles, options: dict[str, Any]) -> Path | None:
    """(Blocking.) The MTP head in a file of its own that a ``draft-mtp`` load drafts with, if any: the registered
    model ``-md`` names with ``--spec-type draft-mtp``, else the ``draft`` checkpoint of a row labelled ``mtp``
    (Lemonade's Gemma 4 rows: the assistant). The engine checks that it is a head of the target.

    Raises:
        InvalidArgument: ``-md`` names no llama.cpp model of the registry.
        ModelLoadError: That model is not downloaded.
    """
    args = parse_llamacpp_args(str(options.get("llamacpp_args") or ""))
    if info.type != "llm" or not drafts_with_head(args, info.labels):
        return None
    name = args.get("model_draft")
    if name is not None:
        return _named_model(registry, name)
    return files.extra.get("draft") if "mtp" in info.labels else None


def _named_model(registry: Registry, name: str) -> Path:
    """The file of the local llama.cpp model ``-md`` names."""
    try:
        other = registry.get(name)
    except ModelNotFound as exc:
        raise InvalidArgument(f"llamacpp_args: -md {name}: no such model (GET /v1/models lists them)") from exc
    if other.recipe != "llamacpp" or other.remote is not None:
        raise InvalidArgument(f"llamacpp_args: -md {name}: a draft model must be a local llamacpp model")
    return registry.resolve(other).main


def _check_gguf(path: Path) -> None:
    """Refuse a file llama.cpp cannot even start on, before spawning anything."""
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelLoadRefused(f"{path.name} is not a GGUF file (magic {magic!r}); the llamacpp recipe needs GGUF")


def replace_options(info: ModelInfo, options: dict[str, Any], entry: dict[str, Any]) -> dict[str, Any]:
    """``save_options``: the request's options replace the saved ones; keys that are not options stay."""
    names = RECIPE_OPTIONS.get(info.recipe, ())
    kept = {k: v for k, v in entry.items() if k not in names}
    return {**kept, **{k: v for k, v in options.items() if not is_unset(k, v)}}


def set_pin(pinned: bool, entry: dict[str, Any]) -> dict[str, Any]:
    """A saved entry with ``pinned`` set (only ``true`` is written: an unpinned model has no key)."""
    entry = {k: v for k, v in entry.items() if k != "pinned"}
    return {**entry, "pinned": True} if pinned else entry
