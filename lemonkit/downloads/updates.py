"""``update_available``: whether the hub has moved on from a downloaded model's local copy."""

from __future__ import annotations

import logging
import queue
import threading
import time

from lemonkit.catalog.hf_cache import is_local, parse_checkpoint
from lemonkit.catalog.model_info import ModelInfo
from lemonkit.catalog.registry import Registry
from lemonkit.downloads.hub_api import Hub
from lemonkit.errors import LemonkitError

__all__ = ["UpdateChecker"]

log = logging.getLogger("lemonkit.downloads")


class UpdateChecker:
    """``update_available``: the hub's current commit of a downloaded model's repo vs the local ``refs/main``.

    Called from ``Registry.model_object`` (so from ``/v1/models``); it answers from a cache and never waits on the
    network: a missing or stale entry queues a refresh in a background thread and reads as ``False`` until then.
    Offline (``HF_HUB_OFFLINE``) it is always ``False``.
    """

    def __init__(self, hub: Hub, registry: Registry, interval: float) -> None:
        self.hub = hub
        self.registry = registry
        self.interval = interval
        self._known: dict[str, tuple[str | None, float]] = {}
        self._pending: set[str] = set()
        self._queue: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def __call__(self, info: ModelInfo) -> bool:
        from huggingface_hub import constants

        if (
            info.bundled is not None
            or info.registry_source != "huggingface"
            or not info.checkpoint
            or is_local(info.checkpoint)
            or constants.is_offline_mode()
        ):
            return False
        repo = parse_checkpoint(info.checkpoint)[0]
        local = self.registry.cache.main_ref(repo)
        if not local:
            return False
        with self._lock:
            known = self._known.get(repo)
            if (known is None or time.monotonic() - known[1] >= self.interval) and repo not in self._pending:
                self._pending.add(repo)
                self._queue.put(repo)
                if self._thread is None:
                    self._thread = threading.Thread(target=self._work, name="update checks", daemon=True)
                    self._thread.start()
        return known is not None and known[0] is not None and known[0] != local

    def record(self, repo: str, commit: str | None) -> None:
        with self._lock:
            self._known[repo] = (commit, time.monotonic())

    def _work(self) -> None:
        while (repo := self._queue.get()) is not None:
            try:
                commit = self.hub.commit(repo)
            except LemonkitError as exc:
                log.debug("update check of %s failed: %s", repo, exc.message)
                commit = None
            self.record(repo, commit)
            with self._lock:
                self._pending.discard(repo)

    def close(self) -> None:
        self._queue.put(None)
