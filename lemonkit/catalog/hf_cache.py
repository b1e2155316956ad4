"""The Hugging Face hub cache, shared by the registry (which reads it) and the downloader (which writes it).

Layout, as huggingface_hub keeps it under ``HF_HUB_CACHE``::

    models--<owner>--<name>/
        refs/main                       the commit a complete pull left
        snapshots/<commit>/<path>       a relative symlink to the blob (a copy where symlinks fail)
        blobs/<etag>[.incomplete]       the bytes, named by the hub's ETag (sha256 of LFS files, git blob id else)
    .locks/models--<owner>--<name>/<etag>.lock

Also here: what a checkpoint string names (``owner/repo:variant``, shard sets, the GGUF a quant means), and the
one check every name passes before it becomes a path (:func:`safe_relpath`, :func:`inside`): checkpoints, variants,
mmproj files, shard names, the hub's file names, ETags and commits, whether from a request, the hub or a file.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import uuid
from collections.abc import Iterable
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import unquote

from lemonkit.catalog.diffusers_layout import INDEX, diffusers_files
from lemonkit.formats.files import atomic_write_text

__all__ = [
    "GGUF_RECIPES",
    "HubCache",
    "check_checkpoint",
    "check_repo_id",
    "checkpoint_files",
    "default_hf_cache",
    "etag_name",
    "hub_hash",
    "in_allowed_dirs",
    "inside",
    "is_file_like",
    "is_local",
    "local_path",
    "parse_checkpoint",
    "read_json_object",
    "safe_relpath",
    "select_gguf_files",
    "shard_prefix",
    "shard_set",
    "shards",
    "snapshot_files",
    "stat_key",
]

#: recipes whose checkpoints are GGUF files picked by quant name
GGUF_RECIPES = frozenset({"llamacpp"})
_SHARD_RE = re.compile(r"^(?P<prefix>.+)-(?P<index>\d{5})-of-(?P<total>\d{5})\.gguf$", re.IGNORECASE)
_HUB_HASH = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")  # a git commit / blob id (sha1) or an LFS sha256
_REPO_ID = re.compile(r"(?:[\w.-]+/)?[\w.-]{1,96}")


# -- names that become paths -------------------------------------------------------------------------------------


def _unsafe(name: str) -> str | None:
    """Why ``name`` is not a plain relative POSIX path, or ``None``."""
    if "\0" in name:
        return "contains NUL"
    if "\\" in name:
        return "contains a backslash"
    if name.startswith("/"):
        return "is absolute"
    parts = name.split("/")
    if any(part in ("", ".", "..") for part in parts):
        return "has an empty, '.' or '..' segment"
    return None


def safe_relpath(name: str, *, what: str) -> PurePosixPath:
    """``name`` as a relative POSIX path that cannot leave the directory it is joined to.

    Refused: NUL, backslashes, a leading ``/``, empty, ``.`` or ``..`` segments, in the name as given or
    percent-decoded (a hub URL or a proxy may decode it once).

    Args:
        name: A repo file path, a variant, a saved name.
        what: What the name is, for the error message.

    Raises:
        ValueError: The name is unsafe.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"{what}: expected a non-empty relative path, got {name!r}")
    reason = _unsafe(name) or _unsafe(unquote(name))
    if reason is not None:
        raise ValueError(f"{what} {name!r} {reason}")
    return PurePosixPath(name)


def in_allowed_dirs(path: str | Path, allowed: Iterable[Path]) -> Path | None:
    """``path`` resolved (symlinks followed) when it lies inside one of the operator's ``allowed`` directories
    (``LEMONKIT_ALLOWED_DIRS``), else ``None``: the one check for every server-local path a request names."""
    resolved = Path(path).resolve()
    if any(resolved.is_relative_to(root.expanduser().resolve()) for root in allowed):
        return resolved
    return None


def inside(base: Path, rel: str | PurePosixPath) -> Path:
    """``base / rel`` after checking that it resolves (symlinks followed) inside ``base``.

    Args:
        base: The directory the name must stay in (a repo's folder in the cache, an allowed directory).
        rel: A path relative to it, already checked by :func:`safe_relpath` where it came from outside.

    Raises:
        ValueError: The path, once resolved, is outside ``base``.
    """
    path = base / rel
    if not path.resolve().is_relative_to(base.resolve()):
        raise ValueError(f"{rel} leads outside {base}")
    return path


def hub_hash(value: str, *, what: str) -> str:
    """A commit id, git blob id or sha256 as the hub gives them: 40 or 64 lowercase hex digits.

    Raises:
        ValueError: It is anything else.
    """
    if not isinstance(value, str) or not _HUB_HASH.fullmatch(value):
        raise ValueError(f"{what} {value!r} is not a hub commit or hash")
    return value


def etag_name(raw: str, *, what: str) -> str:
    """The blob name an ETag gives, normalised as huggingface_hub does (``W/`` and quotes dropped), then checked.

    Raises:
        ValueError: What is left is not a sha256 or a git blob id.
    """
    value = raw.removeprefix("W/").strip('"') if isinstance(raw, str) else raw
    return hub_hash(value, what=what)


def check_repo_id(repo: str, *, what: str) -> str:
    """A hub repo id (``owner/name`` or ``name``) by huggingface_hub's rules: no ``--`` or ``..``, no edge ``-``/``.``.

    Raises:
        ValueError: It is not one.
    """
    if (
        not _REPO_ID.fullmatch(repo)
        or "--" in repo
        or ".." in repo
        or any(part[:1] in "-." or part[-1:] in "-." for part in repo.split("/"))
    ):
        raise ValueError(f"{what}: {repo!r} is not a Hugging Face repo id ('owner/name')")
    return repo


def check_checkpoint(checkpoint: str, *, what: str) -> None:
    """Check a checkpoint before any path is built from it.

    A local path (absolute or ``~``) only needs to be a path (no NUL): whether a request may name it is the
    server's call. A hub checkpoint needs a valid repo id and a variant that is a :func:`safe_relpath`.

    Raises:
        ValueError: The checkpoint is malformed.
    """
    if "\0" in checkpoint:
        raise ValueError(f"{what}: {checkpoint!r} contains NUL")
    if is_local(checkpoint):
        return
    repo, variant = parse_checkpoint(checkpoint)
    check_repo_id(repo, what=what)
    if variant is not None:
        safe_relpath(variant.removesuffix("/"), what=f"{what} variant")


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


def is_local(checkpoint: str) -> bool:
    """Whether a checkpoint is a server-local path (absolute or ``~``) rather than a hub repo."""
    return os.path.isabs(checkpoint) or checkpoint.startswith("~")


def local_path(checkpoint: str) -> Path:
    """The file a local checkpoint names (``~`` expanded; not resolved)."""
    return Path(checkpoint).expanduser()


def is_file_like(variant: str) -> bool:
    """Whether a variant names one file (it has an extension) rather than a quant or a folder."""
    suffix = PurePosixPath(variant).suffix
    return len(suffix) > 1 and suffix[1:].isalnum() and not suffix[1:].isdigit()


def shard_set(file: str) -> list[str]:
    """Every shard of the sharded GGUF ``file`` names (``-00001-of-00003.gguf``), or just ``file``."""
    shard = _SHARD_RE.match(file)
    if not shard:
        return [file]
    total = int(shard["total"])
    return [f"{shard['prefix']}-{i:05d}-of-{total:05d}.gguf" for i in range(1, total + 1)]


def shard_prefix(file: str) -> str | None:
    """The part of a shard's path before ``-0000i-of-0000N.gguf`` (``None``: not a shard)."""
    shard = _SHARD_RE.match(file)
    return shard["prefix"] if shard else None


def shards(path: Path) -> list[Path]:
    """Every shard of a sharded GGUF, given its first; any other path alone."""
    return [path.with_name(name) for name in shard_set(path.name)]


def select_gguf_files(names: Iterable[str], variant: str | None = None) -> list[str]:
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
    groups: dict[str, list[str]] = {}
    for name in names:
        path = name.replace("\\", "/")
        lower = path.lower()
        if not lower.endswith(".gguf") or "mmproj" in lower.rsplit("/", 1)[-1] or wanted not in lower:
            continue
        prefix = shard_prefix(path)
        groups[prefix if prefix is not None else path] = shard_set(path)
    if not groups:
        return []

    def rank(files: list[str]) -> tuple[bool, int, str]:
        first = files[0].lower()
        return (bool(bounded and not bounded.search(first)), len(first), first)

    return min(groups.values(), key=rank)


def checkpoint_files(recipe: str, variant: str | None, names: Iterable[str], *, partial: bool = False) -> list[str]:
    """The repo files one hub checkpoint needs, chosen from the repo's file list (the rules of the row schema).

    Args:
        recipe: The model's recipe (GGUF recipes pick a quant; diffusers takes a pipeline's files, see
            :func:`lemonkit.catalog.diffusers_layout.diffusers_files`; others take a folder or the whole repo).
        variant: The part after ``repo:`` (a quant, a file path, a folder), or ``None``.
        names: Every file path in the repo (``/`` separated).
        partial: Return those of the needed files that are in ``names`` (an incomplete download's).

    Returns:
        The needed paths (every shard of a sharded GGUF), or ``[]`` when the repo does not hold them all.
    """
    listed = list(names)
    present = set(listed)
    if variant is not None and is_file_like(variant):
        files = shard_set(variant)
    elif recipe in GGUF_RECIPES:
        files = select_gguf_files(listed, variant)
    elif recipe == "diffusers" and not variant:
        files = diffusers_files(listed)
    elif variant:
        prefix = variant.strip("/") + "/"
        files = sorted(n for n in listed if n.startswith(prefix))
    else:
        files = sorted(listed)
    if partial:
        return [f for f in files if f in present]
    return files if files and all(f in present for f in files) else []


# -- small files -------------------------------------------------------------------------------------------------


def read_json_object(path: Path) -> dict[str, Any]:
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


def stat_key(path: Path) -> tuple[int, int, int] | None:
    """``(size, mtime_ns, inode)``: changes when the file is rewritten or replaced; ``None`` when absent."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns, st.st_ino


def default_hf_cache() -> Path:
    env = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if env:
        return Path(env).expanduser()
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE).expanduser()


def snapshot_files(snapshot: Path) -> list[str]:
    """Every file path in a snapshot, ``/`` separated."""
    names = []
    for dirpath, _, filenames in os.walk(snapshot):
        rel = Path(dirpath).relative_to(snapshot).as_posix()
        names += [f if rel == "." else f"{rel}/{f}" for f in filenames]
    return names


# -- the cache ---------------------------------------------------------------------------------------------------


class HubCache:
    """One Hugging Face hub cache directory: where a repo's snapshots, blobs, refs and locks are.

    Every path a method returns for a name stays inside the repo's folder (:func:`inside`); the names themselves
    are checked where they come in (requests, the hub's answers, saved files).
    """

    def __init__(self, root: Path) -> None:
        self.root = root

    def repo_dir(self, repo: str) -> Path:
        return self.root / _repo_folder(repo)

    def lock_dir(self, repo: str) -> Path:
        return self.root / ".locks" / _repo_folder(repo)

    def blob(self, repo: str, etag: str) -> Path:
        return inside(self.repo_dir(repo), PurePosixPath("blobs", hub_hash(etag, what="ETag")))

    def partial(self, repo: str, etag: str) -> Path:
        """Where a blob's bytes accumulate until the file is whole and verified."""
        blob = self.blob(repo, etag)
        return blob.with_name(blob.name + ".incomplete")

    def pointer(self, repo: str, commit: str, path: str) -> Path:
        """``snapshots/<commit>/<path>``, the name huggingface_hub reads a file by."""
        rel = PurePosixPath("snapshots", hub_hash(commit, what="commit")) / safe_relpath(path, what="repo file")
        return inside(self.repo_dir(repo), rel)

    def main_ref(self, repo: str) -> str:
        """The commit ``refs/main`` names (``""`` when none)."""
        try:
            return (self.repo_dir(repo) / "refs" / "main").read_text(encoding="utf-8").strip()
        except OSError:
            return ""

    def set_main_ref(self, repo: str, commit: str) -> None:
        atomic_write_text(self.repo_dir(repo) / "refs" / "main", hub_hash(commit, what="commit"))

    def snapshots(self, repo: str) -> list[Path]:
        """Snapshot dirs of a cached repo: the one ``refs/main`` names first, then the others, newest first."""
        try:
            dirs = [p for p in (self.repo_dir(repo) / "snapshots").iterdir() if p.is_dir()]
        except OSError:
            return []
        main = self.main_ref(repo)

        def order(p: Path) -> tuple[bool, float]:
            with contextlib.suppress(OSError):
                return (p.name != main, -p.stat().st_mtime)
            return (True, 0.0)

        return sorted(dirs, key=order)

    def locate(self, recipe: str, checkpoint: str) -> Path | None:
        """The local path of one checkpoint when its bytes are complete, else ``None``."""
        if is_local(checkpoint):
            path = local_path(checkpoint)
            return path if path.exists() else None
        repo, variant = parse_checkpoint(checkpoint)
        for snapshot in self.snapshots(repo):
            try:
                found = self._find(snapshot, variant, quant=recipe in GGUF_RECIPES)
            except ValueError:  # a name that leads outside the repo's folder is never "found"
                return None
            if found is not None and (recipe != "diffusers" or variant or (found / INDEX).is_file()):
                return found  # a diffusers pipeline is no pipeline without its model_index.json
        return None

    @staticmethod
    def _find(snapshot: Path, variant: str | None, *, quant: bool) -> Path | None:
        # Hub downloads land in blobs/*.incomplete and are linked into snapshots/ only when complete, so a
        # snapshot entry that resolves to a file is a whole file; a dangling link is not.
        storage = snapshot.parent.parent
        base = PurePosixPath("snapshots", snapshot.name)

        def entry(name: str) -> Path:
            return inside(storage, base / safe_relpath(name, what="checkpoint file"))

        if variant is not None and is_file_like(variant):
            files = [entry(f) for f in shard_set(variant)]
            return files[0] if all(f.is_file() for f in files) else None
        if quant:
            names = [f for f in snapshot_files(snapshot) if f.lower().endswith(".gguf")]
            chosen = [entry(f) for f in select_gguf_files(names, variant)]
            return chosen[0] if chosen and all(f.is_file() for f in chosen) else None
        folder = entry(variant.removesuffix("/")) if variant else snapshot
        with contextlib.suppress(OSError):
            if folder.is_dir() and any(p.is_file() for p in folder.rglob("*")):
                return folder
        return None

    def link(self, blob: Path, pointer: Path) -> None:
        """``pointer`` -> ``blob``, relative as huggingface_hub makes it, replaced atomically."""
        pointer.parent.mkdir(parents=True, exist_ok=True)
        tmp = pointer.with_name(f".{pointer.name}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            os.symlink(os.path.relpath(blob, pointer.parent), tmp)
        except OSError:  # no symlinks here: a copy, as huggingface_hub falls back to
            shutil.copyfile(blob, tmp)
        try:
            os.replace(tmp, pointer)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def remove_checkpoint(
        self, repo: str, recipe: str, variant: str | None, users: list[tuple[str, str | None]]
    ) -> int:
        """Unlink one checkpoint's snapshot entries and the blobs nothing else links, keeping what ``users``
        (``(recipe, variant)`` of other checkpoints of the repo) need; returns the entries removed."""
        storage = self.repo_dir(repo)
        removed = 0
        blobs: set[Path] = set()
        for snapshot in sorted((storage / "snapshots").glob("*")):
            names = snapshot_files(snapshot)
            mine = set(checkpoint_files(recipe, variant, names, partial=True))
            for other_recipe, other_variant in users:
                mine -= set(checkpoint_files(other_recipe, other_variant, names, partial=True))
            for name in mine:
                pointer = snapshot / name
                if pointer.is_symlink():
                    blobs.add(pointer.resolve())
                pointer.unlink(missing_ok=True)
                removed += 1
        referenced = set()
        for snapshot in (storage / "snapshots").glob("*"):
            referenced |= {(snapshot / name).resolve() for name in snapshot_files(snapshot)}
        for blob in blobs - referenced:
            if blob.is_relative_to(storage.resolve()):  # only the cache's own blobs go
                blob.unlink(missing_ok=True)
        for snapshot in (storage / "snapshots").glob("*"):
            for dirpath, _, _ in sorted(os.walk(snapshot), key=lambda w: -len(w[0])):
                with contextlib.suppress(OSError):
                    os.rmdir(dirpath)  # only empty folders go
        return removed

    def remove_if_empty(self, repo: str) -> None:
        """Remove a repo with nothing left in any snapshot entirely (refs, partial files, locks)."""
        storage = self.repo_dir(repo)
        snapshots = storage / "snapshots"
        if snapshots.exists() and any(snapshots.iterdir()):
            return
        if storage.exists():
            shutil.rmtree(storage, ignore_errors=True)
            shutil.rmtree(self.lock_dir(repo), ignore_errors=True)


def _repo_folder(repo: str) -> str:
    from huggingface_hub.file_download import repo_folder_name

    return repo_folder_name(repo_id=check_repo_id(repo, what="repo"), repo_type="model")
