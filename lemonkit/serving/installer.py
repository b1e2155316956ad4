"""Installing and removing recipe backends (``POST /v1/install``, ``/v1/uninstall``): pip in a subprocess.

A backend is a row of the recipe table (:attr:`lemonkit.catalog.config.Settings.recipes`): the
distribution that provides it and how to install it. pip runs as an asyncio subprocess
with its output read line by line (into the log store, and to the caller for SSE
progress), one pip at a time: two pips writing one environment corrupt it.

llama.cpp's rows are builds (:mod:`lemonkit.catalog.llamacpp_builds`): ``install`` compiles lemonkit's llama-cpp-python
release with the backend's CMake flags (``pip wheel``, at low CPU priority, so the models being served keep their
cores), installs the wheel into a directory of its own under the cache (``pip install --target``) and checks that
it imports; ``uninstall`` removes that directory. Neither ever touches the server's own environment, so the build
``pip install lemonkit[llamacpp]`` made, the one the server itself runs, stays whatever the API is asked.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import shlex
import shutil
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from lemonkit.catalog import llamacpp_builds
from lemonkit.catalog.config import Settings
from lemonkit.catalog.hardware import detect_devices, gpu_archs
from lemonkit.catalog.system_info import (
    backend_status,
    install_requirement,
    lemonkit_requires,
    refresh_installed,
    wanted_llamacpp,
)
from lemonkit.errors import BackendUnsupported, InstallError, InvalidArgument, PrerequisitesMissing
from lemonkit.serving import log_store
from lemonkit.serving.loaded_model import LoadedModel
from lemonkit.serving.manager import ModelManager

__all__ = ["Installer"]

log = logging.getLogger("lemonkit.installer")

#: called with each line pip prints, and how far a build is (percent) where its line says
LineSink = Callable[[str, "int | None"], None]
#: ninja's progress: "[123/460] ..."
_NINJA = re.compile(r"^\s*\[(\d+)/(\d+)\]")


class Installer:
    """Runs pip for the backends of ``settings.recipes``.

    Args:
        settings: Where the recipe table and the pip command come from.
        manager: Unloads the models of a backend before it is uninstalled.
    """

    def __init__(self, settings: Settings, manager: ModelManager) -> None:
        self.settings = settings
        self.manager = manager
        self._lock = asyncio.Lock()  # one pip at a time
        self._builds = asyncio.Lock()  # one build change at a time: each is several pips and renames

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
        cache = self.settings.cache_dir
        return await asyncio.to_thread(lambda: backend_status(spec, detect_devices(), cache_dir=cache))

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
            if not spec.get("distribution") and not spec.get("build"):
                raise BackendUnsupported(f"{recipe}:{backend} has no package to install ({status['message']})")
        build = spec.get("build")
        if build and not (build == "cpu" and llamacpp_builds.own_version()):
            plan = await self._plan(str(build))
            if plan.missing:
                raise PrerequisitesMissing(
                    f"Building {recipe}:{backend} needs what this machine lacks: "
                    + "; ".join(str(m) for m in plan.missing)
                )
        return status

    async def _plan(self, backend: str) -> llamacpp_builds.Plan:
        archs = gpu_archs(backend, await asyncio.to_thread(detect_devices))
        return llamacpp_builds.plan(backend, gpu_archs=archs)

    def check_uninstall(self, recipe: str, backend: str) -> str:
        """The distribution ``uninstall`` would remove.

        Raises:
            InvalidArgument: Unknown recipe or backend, or one that is part of lemonkit.
        """
        spec = self.spec(recipe, backend)
        if spec.get("build"):
            return llamacpp_builds.DISTRIBUTION
        dist = spec.get("distribution")
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
        if spec.get("build"):
            return await self._install_build(recipe, backend, str(spec["build"]), force=force, on_line=on_line)
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
        """Unload the models that run on the backend's package, then uninstall it; returns its new status. A
        package lemonkit's own installation requires stays (the server runs on it), as lemonkit's own llama.cpp does.

        Raises:
            InvalidArgument: Unknown recipe or backend, or one that is part of lemonkit.
            InstallError: pip failed.
        """
        dist = self.check_uninstall(recipe, backend)
        spec = self.spec(recipe, backend)
        if spec.get("build"):
            return await self._uninstall_build(recipe, backend, str(spec["build"]), on_line=on_line)
        table = self.settings.recipes[recipe]
        # every backend of the recipe that this package provides goes with it
        gone = {name for name, b in table["backends"].items() if b.get("distribution") == dist}

        def runs_on_it(model: LoadedModel) -> bool:
            if model.info.recipe != recipe:
                return False
            chosen = model.recipe_options.get(f"{recipe}_backend")
            return (chosen if chosen in table["backends"] else table.get("default_backend")) in gone

        if await asyncio.to_thread(lemonkit_requires, dist):
            # part of the server's own installation (a lemonkit extra): removing it would break what the server runs
            message = f"{dist} came with lemonkit's own installation, which the server runs on: it stays"
            log.info("uninstall of %s:%s: %s", recipe, backend, message)
            if on_line is not None:
                on_line(message, 100)
            return await self.status(recipe, backend)
        unloaded = await self.manager.unload_where(runs_on_it)
        if unloaded:
            log.info("unloaded %s before uninstalling %s", ", ".join(unloaded), dist)
        await self._pip(["uninstall", "--yes", dist], on_line)
        log.info("uninstalled backend %s:%s (%s)", recipe, backend, dist)
        return await self.status(recipe, backend)

    # -- llama.cpp builds ------------------------------------------------------------------------------------------

    def _runs_on_build(self, backend: str) -> Callable[[LoadedModel], bool]:
        return lambda model: model.info.recipe == "llamacpp" and model.build == backend

    async def _install_build(
        self, recipe: str, name: str, backend: str, *, force: bool, on_line: LineSink | None
    ) -> dict[str, Any]:
        """Build ``backend`` (or reuse its cached wheel), install it apart and check it imports."""
        if self._builds.locked() and on_line is not None:
            on_line("Waiting for another backend build to finish", None)
        async with self._builds:
            return await self._install_build_locked(recipe, name, backend, force=force, on_line=on_line)

    async def _install_build_locked(
        self, recipe: str, name: str, backend: str, *, force: bool, on_line: LineSink | None
    ) -> dict[str, Any]:
        cache = self.settings.cache_dir
        if backend == "cpu" and llamacpp_builds.own_version():
            if on_line is not None:
                on_line(
                    "llamacpp:cpu is lemonkit's own llama-cpp-python, installed with lemonkit: nothing to build", 100
                )
            return await self.status(recipe, name)
        version = await asyncio.to_thread(wanted_llamacpp)
        if not version:
            raise InstallError("no llama-cpp-python release to build: lemonkit's metadata names none")
        existing = await asyncio.to_thread(llamacpp_builds.installed, cache, backend)
        if existing is not None and existing.version == version and not force:
            try:  # installed, and still whole? (an install over a damaged one mends it from the kept wheel)
                await self._check_build(backend, existing.site, on_line)
            except InstallError as exc:
                if on_line is not None:
                    on_line(f"llamacpp:{backend} is installed but broken ({exc.message}): installing it again", None)
            else:
                if on_line is not None:
                    on_line(f"llamacpp:{backend} {version} is installed; send force=true to build it again", 100)
                return await self.status(recipe, name)
        plan = await self._plan(backend)
        wheels = llamacpp_builds.wheel_dir(self.settings.backend_wheels, backend, version, plan.key(version))
        wheel = None if force else next(iter(sorted(wheels.glob("*.whl"))), None)
        if wheel is None:
            wheel = await self._build_wheel(plan, version, wheels, on_line)
        elif on_line is not None:
            on_line(f"Using {wheel}, built before with the same flags (force=true compiles again)", None)
        await self._place(plan, version, wheel, on_line)
        await self._redetect()
        status = await self.status(recipe, name)
        if status["state"] != "installed" and status["state"] != "unsupported":
            raise InstallError(f"{recipe}:{name} was built, yet it is {status['state']}: {status['message']}")
        log.info("installed backend %s:%s (llama-cpp-python %s, %s)", recipe, name, version, " ".join(plan.cmake_args))
        return status

    async def _build_wheel(
        self, plan: llamacpp_builds.Plan, version: str, wheels: Path, on_line: LineSink | None
    ) -> Path:
        """Compile llama-cpp-python ``version`` with ``plan``'s flags into ``wheels`` (written whole or not at all)."""
        sources = self.settings.backend_wheels / "src"
        sdist = next(iter(sorted(sources.glob(f"llama_cpp_python-{version}.tar.gz"))), None)
        if sdist is None:
            partial = sources.with_name(f"src.partial-{os.getpid()}")
            await asyncio.to_thread(shutil.rmtree, partial, True)
            requirement = f"{llamacpp_builds.DISTRIBUTION}=={version}"
            await self._pip(["download", "--no-deps", "--no-binary", ":all:", "-d", str(partial), requirement], on_line)
            got = sorted(partial.glob("*.tar.gz"))
            if not got:
                raise InstallError(f"pip download {requirement} brought no source archive")
            sources.mkdir(parents=True, exist_ok=True)
            sdist = sources / got[0].name
            os.replace(got[0], sdist)
            await asyncio.to_thread(shutil.rmtree, partial, True)
        for what, where in plan.found.items():
            if on_line is not None:
                on_line(f"{what}: {where}", 0)
        partial = wheels.with_name(f"{wheels.name}.partial-{os.getpid()}")
        await asyncio.to_thread(shutil.rmtree, partial, True)
        env = {**plan.env, "CMAKE_ARGS": " ".join(plan.cmake_args)}
        # --no-cache-dir: pip's own wheel cache does not know CMAKE_ARGS, and would hand back a build of other flags
        args = ["wheel", "--no-deps", "--no-cache-dir", "--verbose", "-w", str(partial), str(sdist)]
        started = time.monotonic()
        await self._pip(args, on_line, env=env, background=True)
        built = sorted(partial.glob("*.whl"))
        if not built:
            raise InstallError("pip wheel finished without a wheel")
        await asyncio.to_thread(shutil.rmtree, wheels, True)
        os.replace(partial, wheels)
        log.info("built %s in %.0f s", built[0].name, time.monotonic() - started)
        return wheels / built[0].name

    async def _place(self, plan: llamacpp_builds.Plan, version: str, wheel: Path, on_line: LineSink | None) -> None:
        """Install ``wheel`` into the build's directory: beside it first, checked, then renamed into place."""
        root = llamacpp_builds.build_dir(self.settings.cache_dir, plan.backend)
        partial = root.with_name(f"{root.name}.partial-{os.getpid()}")
        await asyncio.to_thread(shutil.rmtree, partial, True)
        args = ["install", "--no-deps", "--no-compile", "--progress-bar", "off", "--target", str(partial / "site")]
        await self._pip([*args, str(wheel)], on_line)
        await self._check_build(plan.backend, partial / "site", on_line)
        record = {
            "backend": plan.backend,
            "version": version,
            "cmake_args": list(plan.cmake_args),
            "wheel": str(wheel),
            "built": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        (partial / "build.json").write_text(json.dumps(record, indent=1), encoding="utf-8")
        unloaded = await self.manager.unload_where(self._runs_on_build(plan.backend))
        if unloaded:
            log.info("unloaded %s before replacing llamacpp:%s", ", ".join(unloaded), plan.backend)
        old = root.with_name(f"{root.name}.old-{os.getpid()}")
        if root.exists():
            os.replace(root, old)
        os.replace(partial, root)
        await asyncio.to_thread(shutil.rmtree, old, True)

    async def _check_build(self, backend: str, site: Path, on_line: LineSink | None) -> None:
        """Import the build in a fresh interpreter: its libraries load, and the backend's own library is there.

        Raises:
            InstallError: It does not import, or the flags did not make the backend's library.
        """
        library = llamacpp_builds.BACKEND_LIBRARY.get(backend)
        if library is not None and not any((site / "llama_cpp" / "lib").glob(f"lib{library}.*")):
            raise InstallError(f"the build has no lib{library}: the {backend} flags did not take effect")
        code = "import llama_cpp; print(llama_cpp.__version__, llama_cpp.llama_supports_gpu_offload())"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            code,
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        out, _ = await process.communicate()
        text = out.decode(errors="replace").strip()
        if process.returncode != 0:
            raise InstallError(f"the {backend} build does not import: {text.splitlines()[-1] if text else 'no output'}")
        if on_line is not None:
            on_line(f"llama_cpp imports from the build (version, GPU offload): {text.splitlines()[-1]}", 100)

    async def _uninstall_build(
        self, recipe: str, name: str, backend: str, *, on_line: LineSink | None
    ) -> dict[str, Any]:
        """Remove the build installed apart, after unloading the models on it; lemonkit's own stays."""
        root = llamacpp_builds.build_dir(self.settings.cache_dir, backend)
        async with self._builds:
            unloaded = await self.manager.unload_where(self._runs_on_build(backend))
            if unloaded:
                log.info("unloaded %s before uninstalling llamacpp:%s", ", ".join(unloaded), backend)
            if root.exists():
                gone = root.with_name(f"{root.name}.removing-{os.getpid()}")
                os.replace(root, gone)  # no longer a build from this instant, however the removal goes
                await asyncio.to_thread(shutil.rmtree, gone, True)
                message = f"Removed llamacpp:{backend} ({root})"
            else:
                message = f"llamacpp:{backend} has no build installed through the API"
            if backend == "cpu" and llamacpp_builds.own_version():
                message += "; lemonkit's own llama-cpp-python, which the server runs on, stays"
        log.info("%s", message)
        if on_line is not None:
            on_line(message, 100)
        await self._redetect()
        return await self.status(recipe, name)

    async def _redetect(self) -> None:
        """The default backend again, after builds changed."""
        await self.manager.detect_backends(again=True)

    async def _pip(
        self,
        args: list[str],
        on_line: LineSink | None,
        *,
        env: Mapping[str, str] | None = None,
        background: bool = False,
    ) -> None:
        """Run ``pip <args>`` to completion, one at a time, passing on each line of its output.

        Args:
            env: More environment (a build's ``CMAKE_ARGS``).
            background: Run at the lowest CPU priority (a compile must not slow the models being served).

        Raises:
            InstallError: pip could not start or exited non-zero; the message ends with its last lines.
        """
        command = [*self.settings.pip_command, args[0], "--disable-pip-version-check", "--no-input", *args[1:]]
        if self._lock.locked() and on_line is not None:
            on_line("Waiting for another backend install or uninstall to finish", None)
        async with self._lock:
            log.info("running %s", shlex.join(command))
            try:
                process = await asyncio.create_subprocess_exec(
                    *command,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.STDOUT,  # one stream: errors stay in order with the rest
                    # lines as pip prints them, not in 8 KiB bursts
                    env={**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"},
                    preexec_fn=(lambda: os.nice(19)) if background and hasattr(os, "nice") else None,
                )
            except OSError as exc:
                raise InstallError(f"cannot run {command[0]}: {exc}") from None
            assert process.stdout is not None
            tail: deque[str] = deque(maxlen=5)
            try:
                async for line in log_store.read_lines(process.stdout):
                    tail.append(line)
                    log_store.STORE.add(log_store.line_severity(line), "pip", line)
                    if on_line is not None:
                        step = _NINJA.match(line)
                        on_line(line, int(99 * int(step[1]) / max(1, int(step[2]))) if step else None)
                code = await process.wait()
            finally:
                if process.returncode is None:  # cancelled (the server is stopping)
                    process.kill()
                # even a failed pip may have changed the environment
                await asyncio.to_thread(refresh_installed)
        if code != 0:
            raise InstallError(f"pip {args[0]} failed (exit status {code}): {' | '.join(tail)}")
