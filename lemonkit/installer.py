"""Installing and removing recipe backends (``POST /v1/install``, ``/v1/uninstall``): pip in a subprocess.

A backend is a row of the recipe table (:attr:`lemonkit.config.Settings.recipes`): the
distribution that provides it and how to install it. pip runs as an asyncio subprocess
with its output read line by line (into the log store, and to the caller for SSE
progress), one pip at a time: two pips writing one environment corrupt it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shlex
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from lemonkit import logs
from lemonkit.config import Settings
from lemonkit.errors import BackendUnsupported, InstallError, InvalidArgument
from lemonkit.manager import LoadedModel, ModelManager
from lemonkit.system_info import backend_status, detect_devices, install_requirement, refresh_installed

__all__ = ["Installer"]

log = logging.getLogger("lemonkit.installer")

#: called with each line pip prints
LineSink = Callable[[str], None]


class Installer:
    """Runs pip for the backends of ``settings.recipes``.

    Args:
        settings: Where the recipe table and the pip command come from.
        manager: Unloads the models of a backend before it is uninstalled.
    """

    def __init__(self, settings: Settings, manager: ModelManager) -> None:
        self.settings = settings
        self.manager = manager
        self._lock = asyncio.Lock()

    def spec(self, recipe: str, backend: str) -> Mapping[str, Any]:
        """The recipe table's row for ``recipe:backend``.

        Raises:
            InvalidArgument: The table has no such recipe or backend (a value its schema does not list).
        """
        table = self.settings.recipes.get(recipe)
        if table is None:
            raise InvalidArgument(f"recipe: unknown recipe {recipe!r} (known: {', '.join(self.settings.recipes)})")
        backends: dict[str, Any] = table.get("backends", {})
        if backend not in backends:
            raise InvalidArgument(f"backend: {recipe} has no backend {backend!r} (known: {', '.join(backends)})")
        spec: Mapping[str, Any] = backends[backend]
        return spec

    async def status(self, recipe: str, backend: str) -> dict[str, Any]:
        """The backend's ``/v1/system-info`` entry as of now (read off the loop: it reads /proc, /sys, metadata)."""
        spec = self.spec(recipe, backend)
        return await asyncio.to_thread(lambda: backend_status(spec, detect_devices()))

    async def check_install(self, recipe: str, backend: str, *, force: bool = False) -> dict[str, Any]:
        """The backend's status, if ``install`` may go ahead.

        Raises:
            InvalidArgument: Unknown recipe or backend.
            BackendUnsupported: The backend cannot run here and ``force`` is false, or it has no package.
        """
        spec = self.spec(recipe, backend)
        status = await self.status(recipe, backend)
        if status["state"] == "unsupported":
            if not force:
                raise BackendUnsupported(
                    f"{recipe}:{backend} is not supported on this machine ({status['message']}); "
                    "send force=true to install it anyway"
                )
            if not spec.get("distribution"):
                raise BackendUnsupported(f"{recipe}:{backend} has no package to install ({status['message']})")
        return status

    def check_uninstall(self, recipe: str, backend: str) -> str:
        """The distribution ``uninstall`` would remove.

        Raises:
            InvalidArgument: Unknown recipe or backend, or one that is part of lemonkit.
        """
        dist = self.spec(recipe, backend).get("distribution")
        if not dist:
            raise InvalidArgument(f"backend: {recipe}:{backend} is part of lemonkit and cannot be uninstalled")
        return str(dist)

    async def install(
        self, recipe: str, backend: str, *, force: bool = False, on_line: LineSink | None = None
    ) -> dict[str, Any]:
        """Install or update the backend's package to the version lemonkit wants; returns its new status.

        Raises:
            InvalidArgument: Unknown recipe or backend.
            BackendUnsupported: The backend cannot run here and ``force`` is false, or it has no package.
            InstallError: pip failed, or the backend still is not usable after it succeeded.
        """
        spec = self.spec(recipe, backend)
        status = await self.check_install(recipe, backend, force=force)
        if not spec.get("distribution"):
            return status  # part of lemonkit itself: always installed
        requirement = await asyncio.to_thread(install_requirement, spec)
        pip_args = [str(a) for a in spec.get("pip_args", ())]
        await self._pip(["install", "--progress-bar", "off", *pip_args, requirement], on_line)
        status = await self.status(recipe, backend)
        if status["state"] in ("installable", "update_required"):
            raise InstallError(
                f"pip installed {requirement}, yet {recipe}:{backend} is {status['state']}: {status['message']}"
            )
        log.info("installed backend %s:%s (%s %s)", recipe, backend, spec["distribution"], status.get("version"))
        return status

    async def uninstall(self, recipe: str, backend: str, *, on_line: LineSink | None = None) -> dict[str, Any]:
        """Unload the models that run on the backend's package, then uninstall it; returns its new status.

        Raises:
            InvalidArgument: Unknown recipe or backend, or one that is part of lemonkit.
            InstallError: pip failed.
        """
        dist = self.check_uninstall(recipe, backend)
        table = self.settings.recipes[recipe]
        # every backend of the recipe that this package provides goes with it
        gone = {name for name, b in table["backends"].items() if b.get("distribution") == dist}

        def runs_on_it(model: LoadedModel) -> bool:
            if model.info.recipe != recipe:
                return False
            chosen = model.recipe_options.get(f"{recipe}_backend")
            return (chosen if chosen in table["backends"] else table.get("default_backend")) in gone

        unloaded = await self.manager.unload_where(runs_on_it)
        if unloaded:
            log.info("unloaded %s before uninstalling %s", ", ".join(unloaded), dist)
        await self._pip(["uninstall", "--yes", dist], on_line)
        log.info("uninstalled backend %s:%s (%s)", recipe, backend, dist)
        return await self.status(recipe, backend)

    async def _pip(self, args: list[str], on_line: LineSink | None) -> None:
        """Run ``pip <args>`` to completion, one at a time, passing on each line of its output.

        Raises:
            InstallError: pip could not start or exited non-zero; the message ends with its last lines.
        """
        command = [*self.settings.pip_command, args[0], "--disable-pip-version-check", "--no-input", *args[1:]]
        if self._lock.locked() and on_line is not None:
            on_line("Waiting for another backend install or uninstall to finish")
        async with self._lock:
            log.info("running %s", shlex.join(command))
            try:
                process = await asyncio.create_subprocess_exec(
                    *command,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.STDOUT,  # one stream: errors stay in order with the rest
                    env={**os.environ, "PYTHONUNBUFFERED": "1"},  # lines as pip prints them, not in 8 KiB bursts
                )
            except OSError as exc:
                raise InstallError(f"cannot run {command[0]}: {exc}") from None
            assert process.stdout is not None
            tail: deque[str] = deque(maxlen=5)
            try:
                async for line in logs.read_lines(process.stdout):
                    tail.append(line)
                    logs.STORE.add(logs.line_severity(line), "pip", line)
                    if on_line is not None:
                        on_line(line)
                code = await process.wait()
            finally:
                if process.returncode is None:  # cancelled (the server is stopping)
                    process.kill()
                # even a failed pip may have changed the environment
                await asyncio.to_thread(refresh_installed)
        if code != 0:
            raise InstallError(f"pip {args[0]} failed (exit status {code}): {' | '.join(tail)}")
