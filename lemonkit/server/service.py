"""What both hosts share: settings, registry and model manager, under one name in the app settings."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from lemonkit.catalog import accelerators
from lemonkit.catalog.config import Settings
from lemonkit.catalog.registry import ModelInfo, Registry
from lemonkit.catalog.support import SupportPolicy
from lemonkit.downloads import DownloadManager
from lemonkit.errors import AdminRequired
from lemonkit.serving import log_store
from lemonkit.serving.answer_cache import AnswerCache
from lemonkit.serving.batch_store import BatchStore
from lemonkit.serving.caller import current, tag_callers
from lemonkit.serving.file_store import FileStore
from lemonkit.serving.installer import Installer
from lemonkit.serving.manager import ModelManager
from lemonkit.serving.response_store import ResponseStore

__all__ = ["SETTINGS_KEY", "Service"]

#: key of the :class:`Service` in ``tornado.web.Application.settings``
SETTINGS_KEY = "lemonkit"


class Service:
    """The lemonkit state of one server process.

    Args:
        settings: Deployment settings; defaults to the environment's.
    """

    def __init__(self, settings: Settings | None = None) -> None:
        self.settings = settings or Settings()
        self.settings.cache_dir.mkdir(parents=True, exist_ok=True)
        self.registry = Registry(self.settings.cache_dir)
        self.support = SupportPolicy(self.settings.recipes)
        self.downloads = DownloadManager(self.settings, self.registry)
        self.manager = ModelManager(self.settings, self.registry, install=self.install)
        self.installer = Installer(self.settings, self.manager)
        self.responses = ResponseStore(self.settings.cache_dir)
        self.files = FileStore(self.settings.cache_dir)
        self.answers = AnswerCache(self.settings.cache_dir, self.settings.answer_cache_bytes)
        self.batch_store = BatchStore(self.settings.cache_dir)
        #: runs the batches (:mod:`lemonkit.server.batches`, which hosts start once their loop runs)
        self.batch_runner: Any = None
        log_store.install()  # the log stream starts with the server
        # the GPU drivers are asked once per process, in a child (about 2 s with Mesa's lavapipe): start now, so no
        # request waits for it
        threading.Thread(target=accelerators.detect, name="lemonkit-devices", daemon=True).start()
        tag_callers()  # records a shared server's user may see are theirs

    async def lookup(self, name: str) -> ModelInfo:
        """``registry.get`` off the event loop: it stats (and may re-read) user_models.json, which another
        server sharing the cache may have changed, on what can be a network file system.

        Raises:
            ModelNotFound: Nothing is registered under ``name``.
        """
        return await asyncio.to_thread(self.registry.get, name)

    async def usable(self, name: str) -> ModelInfo:
        """:meth:`lookup` of a model this machine runs: what pulling, loading and inference start from.

        Raises:
            ModelNotFound: Nothing is registered under ``name``.
            ModelNotSupported: The model's recipe (or registry, or a component) does not run here.
        """
        info = await self.lookup(name)
        return await asyncio.to_thread(self.support.require, info, self.registry)

    async def install(self, models: list[ModelInfo]) -> None:
        """Download ``models`` that a load or a first use needs: the one check of every model route that only a
        shared server's admins may start a download (see :class:`~lemonkit.serving.caller.Caller`).

        Raises:
            AdminRequired: A shared server's user who is not an admin (before any download starts).
            LemonkitError: The download failed.
        """
        if models and not current.get().admin:
            names = ", ".join(m.id for m in models)
            raise AdminRequired(
                f"{names} is not downloaded on this shared server, and only its admins may download models: "
                "ask one to pull it"
            )
        await self.downloads.install(models, by=current.get().name)  # who asked sees the job

    async def close(self) -> None:
        if self.batch_runner is not None:
            await self.batch_runner.close()
        await self.downloads.close()
        await self.manager.close()
