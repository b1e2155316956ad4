"""A loaded model, as the model manager holds it: a model resident in its sidecar process, or served elsewhere.

:class:`LoadedModel` is what a request holds while it uses a model (:meth:`lemonkit.serving.manager.ModelManager.use`):
its client (the sidecar's Unix socket, or a remote model's upstreams), the options it runs with, what its engine said
of itself on loading, and the manager's bookkeeping (in use, pinned, keep-alive). A sidecar's is started by
:mod:`lemonkit.serving.sidecar_processes`; a remote model's is :func:`connect_remote`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from lemonkit.backends import remote
from lemonkit.catalog.config import RemoteSettings
from lemonkit.catalog.model_info import ModelInfo
from lemonkit.catalog.placement import MiB
from lemonkit.catalog.recipe_options import AUTO_CTX_SIZE

__all__ = ["LoadedModel", "connect_remote"]


@dataclass(eq=False)
class LoadedModel:
    """A model resident in its sidecar process, or served elsewhere (``remote``: no process, an ``upstream``)."""

    info: ModelInfo
    process: asyncio.subprocess.Process | None
    socket_path: str | None
    client: httpx.AsyncClient
    recipe_options: dict[str, Any]
    engine_info: dict[str, Any]
    pinned: bool = False
    last_use: float = field(default_factory=time.time)
    active: int = 0
    #: whose request it served last (``/v1/stats`` tells a shared server's user only of their own)
    last_user: str | None = None
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    #: copies the sidecar's stderr into the log store (tagged with the model's name) until the process exits
    stderr_task: asyncio.Task[None] | None = None
    #: the main file the engine loaded (provenance: its commit and sha256)
    model_path: Path | None = None
    #: a remote model's endpoints (its ``client`` forwards to them)
    upstream: remote.Upstream | None = None
    #: the llama.cpp build installed apart that its sidecar runs on (``None``: lemonkit's own, or not llama.cpp)
    build: str | None = None
    #: host memory its sidecar is counted for (:func:`lemonkit.serving.memory.host_need`; 0: a remote model)
    host_bytes: int = 0
    #: seconds it stays loaded once idle, as a client last asked (Ollama's ``keep_alive``; ``None``: while memory
    #: allows), when that ends (``expires_at``, a Unix time while it is idle) and the timer that unloads it then
    keep_alive: float | None = None
    expires_at: float | None = None
    expiry: asyncio.TimerHandle | None = None

    @property
    def name(self) -> str:
        return self.info.id

    @property
    def running(self) -> bool:
        """Whether it can serve: its sidecar has not exited (a remote model's endpoints are tried per request)."""
        return self.process is None or self.process.returncode is None

    @property
    def slots(self) -> int:
        """Requests it serves at once (its engine's slots)."""
        return int(self.engine_info.get("slots", 1))

    @property
    def device_bytes(self) -> int:
        """What it holds on its GPU (its engine's estimate for the layers it offloaded)."""
        offload = self.engine_info.get("offload") or {}
        return int(offload.get("estimate_mb") or 0) * MiB if offload.get("layers") else 0

    @property
    def backend_url(self) -> str:
        if self.upstream is not None:
            return self.upstream.endpoints[0].url
        return f"unix:{self.socket_path}"

    def arm(self, expire: Callable[[LoadedModel], None]) -> None:
        """Start its keep-alive time, now that it is idle: ``expire`` gets it when the time is up (no time: it stays
        while memory allows; a remote model holds nothing here)."""
        if self.keep_alive is None or self.upstream is not None:
            return
        self.expires_at = time.time() + self.keep_alive
        self.expiry = asyncio.get_running_loop().call_later(self.keep_alive, expire, self)

    def disarm(self) -> None:
        """Stop its keep-alive time: it is in use, or going."""
        if self.expiry is not None:
            self.expiry.cancel()
        self.expiry = self.expires_at = None

    async def stats(self) -> dict[str, Any]:
        """Its engine's figures for the last request it served (``/v1/stats``), with where it ran."""
        response = await self.client.get("/stats")
        result: dict[str, Any] = response.json()
        if "backend" in self.engine_info:  # where it ran: the build, its devices and the layers on them
            offload = self.engine_info.get("offload") or {}
            result.update(
                backend=self.engine_info["backend"],
                device=self.engine_info.get("device", "cpu"),
                devices=[d["name"] for d in self.engine_info.get("devices", [])],
                gpu_layers=offload.get("layers", 0),
            )
        return result

    def health(self) -> dict[str, Any]:
        """Its entry in ``/v1/health``'s ``all_models_loaded``."""
        # where it runs, and on which kernels (whether its answers are batch-invariant, and with lemonkit's attention)
        placement: dict[str, Any] = {
            k: self.engine_info[k]
            for k in ("backend", "devices", "offload", "batch_invariant", "invariant_attention")
            if k in self.engine_info
        }
        return {
            "model_name": self.name,
            "checkpoint": self.info.checkpoint,
            "last_use": self.last_use,
            "type": self.info.type,
            "device": self.engine_info.get("device", "cpu"),
            "recipe": self.info.recipe,
            "pid": self.process.pid if self.process is not None else None,
            "recipe_options": self.reported_options(),
            "backend_url": self.backend_url,
            **placement,
            **({"memory_mb": round(self.host_bytes / MiB)} if self.host_bytes else {}),
            **({"endpoints": self.upstream.health()} if self.upstream is not None else {}),
        }

    def reported_options(self) -> dict[str, Any]:
        """The options it runs with, an automatic ``ctx_size`` (-1) given as the size the engine chose."""
        options = dict(self.recipe_options)
        if options.get("ctx_size") == AUTO_CTX_SIZE and self.engine_info.get("ctx_size"):
            options["ctx_size"] = self.engine_info["ctx_size"]
        return options


async def connect_remote(info: ModelInfo, settings: RemoteSettings) -> LoadedModel:
    """A remote model loaded: its upstreams checked, nothing started."""
    assert info.remote is not None
    key_env = info.remote.api_key_env
    key = await asyncio.to_thread(remote.read_api_key, key_env, settings) if key_env else None
    upstream = await remote.connect(info, settings, key)
    model = LoadedModel(
        info=info,
        process=None,
        socket_path=None,
        client=upstream.client,
        recipe_options={},
        engine_info={"engine": "remote", "device": "remote", "slots": upstream.slots},
        upstream=upstream,
    )
    model.idle.set()
    return model
