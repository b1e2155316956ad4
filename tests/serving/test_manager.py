"""The model manager on its own, in this process: what closing it leaves behind."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal

import psutil

from lemonkit.catalog.config import Settings
from lemonkit.catalog.registry import Registry
from lemonkit.errors import ModelLoadError
from lemonkit.serving.manager import ModelManager
from tests.support.tiny_models import TINY
from tests.support.waiting import until


async def test_closing_while_a_model_loads_leaves_no_sidecar() -> None:
    """A sidecar still starting when the manager closes is killed and reaped, not left running (a Jupyter server's
    loop goes on after its extension stops; an orphan would hold its model until the process exits)."""
    settings = Settings()
    manager = ModelManager(settings, Registry(settings.cache_dir))
    me = psutil.Process()

    async def sidecar() -> psutil.Process | None:
        for child in me.children():
            with contextlib.suppress(psutil.Error):  # a child that exited meanwhile (not the sidecar: it waits)
                if "lemonkit.backends.sidecar" in child.cmdline():
                    return child
        return None

    loading = asyncio.ensure_future(manager.load(TINY))
    process = await until(sidecar, "the sidecar to start")
    os.kill(process.pid, signal.SIGSTOP)  # it cannot announce itself ready now: the load stays under way
    try:
        await manager.close()
        outcome = (await asyncio.gather(loading, return_exceptions=True))[0]
        assert isinstance(outcome, (asyncio.CancelledError, ModelLoadError)), outcome
        assert not psutil.pid_exists(process.pid)  # killed, and reaped by the manager
    finally:
        if psutil.pid_exists(process.pid):
            process.kill()
