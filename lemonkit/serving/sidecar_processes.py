"""The sidecar processes of one model manager: started, watched, stopped, and what their engines generated.

Each loaded local model runs in ``python -m lemonkit.backends.sidecar`` on a Unix socket in a private 0700 directory.
The load spec goes to its stdin; the first line of its stdout says it is ready (or why not), after which stdout
and stderr are copied into the log store under the model's name. Closing its stdin ends it; one that does not
exit is killed, and every process started is reaped. A process's generation totals are taken before it stops, so
``/metrics`` counts what an unloaded model generated.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import sys
import tempfile
from collections import deque
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import httpx

from lemonkit.backends import handoff, sidecar_env
from lemonkit.backends.protocol import LoadSpec
from lemonkit.backends.transport import connect
from lemonkit.catalog.config import Settings
from lemonkit.catalog.model_info import ModelInfo
from lemonkit.errors import BackendUnavailable, InvalidArgument, LemonkitError, ModelLoadError, ModelLoadRefused
from lemonkit.formats.generation_metrics import add_totals
from lemonkit.serving import log_store
from lemonkit.serving.loaded_model import LoadedModel

__all__ = ["SidecarProcesses"]

#: errors an engine raises at load that are the request's or the registered model's fault, kept as what they are
_REFUSALS: dict[str, type[LemonkitError]] = {
    InvalidArgument.code: InvalidArgument,
    ModelLoadRefused.code: ModelLoadRefused,
}

log = logging.getLogger("lemonkit.manager")  # the manager's processes: its log


class SidecarProcesses:
    """Starts and stops the sidecars of one manager, and keeps the generation totals of those that have exited.

    Args:
        settings: The deployment's settings (``ping_interval``, ``sidecar_timeout``, the recipe table).
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._run_dir = Path(tempfile.mkdtemp(prefix="lemonkit-"))  # 0700: only we reach the sockets
        self._counter = 0
        self._captures: set[asyncio.Task[None]] = set()
        self._retired: dict[str, dict[str, Any]] = {}

    async def spawn(
        self, info: ModelInfo, spec: LoadSpec, options: dict[str, Any], *, site: str | None = None
    ) -> LoadedModel:
        """Start ``info``'s sidecar and wait for it to load; ``site`` goes first on its ``PYTHONPATH`` (a llama.cpp
        build installed apart, whose ``llama_cpp`` it then imports).

        Raises:
            BackendUnavailable: The engine's libraries do not load (the backend must be reinstalled).
            ModelLoadError: The sidecar failed to load the model, or did not say it was ready in time.
        """
        self._counter += 1
        socket_path = str(self._run_dir / f"{self._counter}.sock")
        env = sidecar_env(spec["recipe"])
        if site is not None:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (site, env.get("PYTHONPATH")) if p)
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "lemonkit.backends.sidecar",
            "--socket",
            socket_path,
            "--ping-interval",
            str(self.settings.ping_interval),
            env=env,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        assert process.stdin is not None and process.stdout is not None and process.stderr is not None
        stderr_tail: deque[str] = deque(maxlen=5)  # why a load failed, when the sidecar could not say
        stderr_task = self._capture(process.stderr, info.id, stderr_tail)
        process.stdin.write(json.dumps(spec).encode() + b"\n")
        try:
            async with asyncio.timeout(self.settings.sidecar_timeout):
                line = await process.stdout.readline()
        except TimeoutError:
            line = b""
        except asyncio.CancelledError:  # the server is closing: the sidecar must not outlive its load
            await _end(process)
            raise
        message = json.loads(line) if line.strip() else {}
        if not message.get("ready"):
            await _end(process)
            await asyncio.wait([stderr_task], timeout=5)  # the pipe's last lines, now that the process is gone
            error = message.get("error") or {}
            reason = error.get("message") or " | ".join(stderr_tail)
            if error.get("code") == "backend_unavailable":  # the engine's libraries do not load: not the model's fault
                recipe = info.recipe
                table = self.settings.recipes.get(recipe, {})
                backend = options.get(f"{recipe}_backend") or table.get("default_backend", "cpu")
                raise BackendUnavailable(
                    f"Failed to load {info.id}: the {recipe}:{backend} backend does not start ({reason}); reinstall "
                    f'it: POST /v1/install {{"recipe": "{recipe}", "backend": "{backend}"}}'
                    + (' (add "force": true to compile it again)' if recipe == "llamacpp" else "")
                )
            refused = _REFUSALS.get(str(error.get("code")))
            if refused is not None:  # the engine refused the model's files or options: the request's fault, a 400
                raise refused(f"Failed to load {info.id}: {reason}")
            raise ModelLoadError(f"Failed to load {info.id}: {reason or 'the engine process exited'}")
        self._capture(process.stdout, info.id)  # after the ready line, stdout is engine chatter: keep draining it
        client = connect(socket_path)
        model = LoadedModel(
            info=info,
            process=process,
            socket_path=socket_path,
            client=client,
            recipe_options=options,
            engine_info=message.get("info", {}),
            stderr_task=stderr_task,
        )
        model.idle.set()
        return model

    def _capture(self, stream: asyncio.StreamReader, tag: str, tail: deque[str] | None = None) -> asyncio.Task[None]:
        task = asyncio.create_task(log_store.capture(stream, tag, tail=tail))
        self._captures.add(task)  # the loop keeps only weak references to tasks
        task.add_done_callback(self._captures.discard)
        return task

    async def stop(self, model: LoadedModel) -> None:
        """End ``model``'s sidecar (a remote model has none: its client closes), its totals kept first."""
        process = model.process
        if process is not None and process.returncode is None:
            self._retired[model.name] = add_totals(self._retired.get(model.name, {}), await _totals_of(model))
            assert process.stdin is not None
            process.stdin.close()  # the sidecar exits when its stdin closes
            try:
                async with asyncio.timeout(5):
                    await process.wait()
            except TimeoutError:
                await _end(process)
        if model.stderr_task is not None:
            await asyncio.wait([model.stderr_task], timeout=1)  # its last lines reach the log before "unloaded"
        await model.client.aclose()
        if model.socket_path is not None:
            for path in (model.socket_path, handoff.path_for(model.socket_path)):
                with contextlib.suppress(OSError):
                    os.unlink(path)
        log.info("unloaded %s", model.name)

    async def generation_totals(self, loaded: Iterable[LoadedModel]) -> dict[str, dict[str, Any]]:
        """Per model, what its engines generated since this server started
        (:mod:`lemonkit.formats.generation_metrics`): the ``loaded`` sidecars' own figures, asked for now, and those
        of sidecars that have exited."""
        running = [m for m in loaded if m.process is not None]
        live = await asyncio.gather(*(_totals_of(m) for m in running))
        out = dict(self._retired)
        for model, totals in zip(running, live, strict=True):
            out[model.name] = add_totals(out.get(model.name, {}), totals)
        return {name: totals for name, totals in out.items() if totals}

    def close(self) -> None:
        """Stop copying output and remove the sockets' directory (once every sidecar has stopped)."""
        for capture in self._captures:
            capture.cancel()
        shutil.rmtree(self._run_dir, ignore_errors=True)


async def _totals_of(model: LoadedModel) -> dict[str, Any]:
    """A sidecar's generation totals (``{}`` from one that does not answer at once: a scrape never waits)."""
    try:
        response = await model.client.get("/metrics", timeout=2)
        totals: dict[str, Any] = response.json() if response.status_code == 200 else {}
    except (httpx.HTTPError, ValueError):
        return {}
    return totals


async def _end(process: asyncio.subprocess.Process) -> None:
    """Kill ``process`` unless it has exited, and reap it."""
    if process.returncode is None:
        process.kill()
    await process.wait()
