"""The model manager: which models are loaded, in which sidecar, and for how long.

One manager per server, living on the server's event loop. It never does
inference or blocking IO on the loop: files are resolved in a thread, engines
run in sidecar processes it spawns and talks to over Unix sockets.
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
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx

from lemonkit._version import __version__
from lemonkit.backends import handoff, remote, sidecar_env
from lemonkit.backends.protocol import NO_STATS, LoadSpec
from lemonkit.backends.transport import connect
from lemonkit.catalog import llamacpp_builds
from lemonkit.catalog.config import Settings
from lemonkit.catalog.hardware import detect_devices
from lemonkit.catalog.placement import MiB, context_limit, estimate, host_estimate
from lemonkit.catalog.recipe_options import (
    AUTO_CTX_SIZE,
    RECIPE_OPTIONS,
    ResolvedOptions,
    check_runnable,
    is_unset,
    llamacpp_context_size,
    resolve_options,
)
from lemonkit.catalog.registry import ModelInfo, Registry
from lemonkit.catalog.system_info import backend_status, llamacpp_backends
from lemonkit.errors import (
    BackendNotInstalled,
    BackendUnavailable,
    Forbidden,
    InvalidArgument,
    LemonkitError,
    ModelLoadError,
    ModelLoadRefused,
    ModelNotFound,
    SlotsPinned,
)
from lemonkit.formats.generation_metrics import add_totals
from lemonkit.formats.gguf_header import read_gguf_context_length, read_gguf_layout
from lemonkit.formats.llamacpp_args import parse_llamacpp_args
from lemonkit.serving import caller
from lemonkit.serving import log_store as logs
from lemonkit.serving.fairness import FairScheduler

__all__ = ["MODEL_TYPES", "RECIPE_OPTIONS", "LoadedModel", "ModelManager"]

log = logging.getLogger("lemonkit.manager")

#: the types /v1/health reports slots for
MODEL_TYPES = ("llm", "embedding", "reranking", "transcription", "image", "tts")


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
    #: host memory its sidecar is counted for (:func:`lemonkit.catalog.placement.host_estimate`; 0: a remote model)
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
    def backend_url(self) -> str:
        if self.upstream is not None:
            return self.upstream.endpoints[0].url
        return f"unix:{self.socket_path}"

    def health(self) -> dict[str, Any]:
        placement: dict[str, Any] = {
            k: self.engine_info[k] for k in ("backend", "devices", "offload") if k in self.engine_info
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


class ModelManager:
    """Loads, tracks, evicts and unloads models.

    Args:
        settings: The deployment's settings.
        registry: Where model names are looked up.
        install: Downloads models that are not downloaded (the server's download jobs); without it a load of
            such a model fails.
    """

    def __init__(
        self,
        settings: Settings,
        registry: Registry,
        *,
        install: Callable[[list[ModelInfo]], Awaitable[None]] | None = None,
    ) -> None:
        self.settings = settings
        self.registry = registry
        self._install = install
        self._loaded: dict[str, LoadedModel] = {}
        self._loading: dict[str, asyncio.Task[LoadedModel]] = {}
        self._load_lock = asyncio.Lock()
        self._last_used: str | None = None
        self._last_of: dict[str, str] = {}  # user -> the model of their last request
        self.fairness = FairScheduler(settings.user_limits, max_queue=settings.max_queue)
        self._run_dir = Path(tempfile.mkdtemp(prefix="lemonkit-"))  # 0700: only we reach the sockets
        self._counter = 0
        self._captures: set[asyncio.Task[None]] = set()
        self._background: set[asyncio.Task[None]] = set()
        #: sidecars spawned so far (concurrent requests for a model that is loading share one)
        self.loads_started = 0
        #: for /metrics, per model: loads that went through, requests admitted, unloads by reason (``memory``,
        #: ``device``, ``count``, ``keep_alive``: evictions; ``request``: asked for), and the generation totals of
        #: sidecars that have exited
        self.loads: Counter[str] = Counter()
        self.requests: Counter[str] = Counter()
        self.unloads: Counter[tuple[str, str]] = Counter()
        self._retired: dict[str, dict[str, Any]] = {}

    # -- queries -------------------------------------------------------------------------------------------------

    def loaded(self, name: str) -> LoadedModel | None:
        return self._loaded.get(name)

    def loaded_models(self) -> list[LoadedModel]:
        return list(self._loaded.values())

    async def generation_totals(self) -> dict[str, dict[str, Any]]:
        """Per model, what its engines generated since this server started (:mod:`lemonkit.formats.generation_metrics`):
        the loaded sidecars' own figures, asked for now, and those of sidecars that have exited."""
        loaded = [m for m in self._loaded.values() if m.process is not None]
        live = await asyncio.gather(*(self._totals_of(m) for m in loaded))
        out = dict(self._retired)
        for model, totals in zip(loaded, live, strict=True):
            out[model.name] = add_totals(out.get(model.name, {}), totals)
        return {name: totals for name, totals in out.items() if totals}

    async def _totals_of(self, model: LoadedModel) -> dict[str, Any]:
        """A sidecar's generation totals (``{}`` from one that does not answer at once: a scrape never waits)."""
        try:
            response = await model.client.get("/metrics", timeout=2)
            totals: dict[str, Any] = response.json() if response.status_code == 200 else {}
        except (httpx.HTTPError, ValueError):
            return {}
        return totals

    # -- keep-alive ----------------------------------------------------------------------------------------------

    def keep_alive(self, name: str, seconds: float | None, *, given: bool = True) -> None:
        """Keep ``name`` loaded for ``seconds`` once idle, then unload it (``0``: as soon as it is idle; ``None``:
        while memory allows, the default). Each later idle moment starts the time again. ``given=False`` (a
        request that did not say) leaves the model's setting as it is."""
        model = self._loaded.get(name)
        if model is None or not given:
            return
        model.keep_alive = seconds
        self._disarm(model)
        if model.active == 0:
            self._arm(model)

    def _arm(self, model: LoadedModel) -> None:
        if model.keep_alive is None or model.upstream is not None:
            return
        model.expires_at = time.time() + model.keep_alive
        model.expiry = asyncio.get_running_loop().call_later(model.keep_alive, self._expire, model)

    def _disarm(self, model: LoadedModel) -> None:
        if model.expiry is not None:
            model.expiry.cancel()
        model.expiry = model.expires_at = None

    def _expire(self, model: LoadedModel) -> None:
        model.expiry = None
        if self._loaded.get(model.name) is not model or model.active:
            return
        log.info("unloading %s: idle for its keep_alive of %gs", model.name, model.keep_alive or 0)
        self.unloads[model.name, "keep_alive"] += 1
        task = asyncio.get_running_loop().create_task(self._unload_quietly(model))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _unload_quietly(self, model: LoadedModel) -> None:
        await self._unload([model], reason="")

    def health(self) -> dict[str, Any]:

        limit = self.settings.max_loaded_models
        return {
            "status": "ok",
            "version": __version__,
            "model_loaded": self._last_used if self._last_used in self._loaded else None,
            # each with its slots and queue, read without waiting on the model
            "all_models_loaded": [{**m.health(), **self.fairness.health(m.name)} for m in self._loaded.values()],
            "max_models": {kind: limit for kind in MODEL_TYPES},
            "memory": self._memory_health(),
        }

    def _memory_health(self) -> dict[str, int]:
        """Host memory in MiB: what lemonkit's models may take (``limit_mb``), what the loaded ones are counted
        for, and what the system has free now beyond its reserve."""
        capacity, available = _host_memory(self.settings.memory)
        return {
            "limit_mb": capacity // MiB,
            "models_mb": sum(m.host_bytes for m in self._loaded.values()) // MiB,
            "available_mb": max(0, available) // MiB,
        }

    async def stats(self, *, only_of: str | None = None) -> dict[str, Any]:
        """``/v1/stats``: the engine's figures for the last request any model served.

        Args:
            only_of: This user's last request instead, given only while it is the last its model served (else no
                figures, as before any request): a shared server's user must not learn what another asked.
        """
        last = self._last_used if only_of is None else self._last_of.get(only_of)
        model = self._loaded.get(last or "")
        if model is None or (only_of is not None and model.last_user != only_of):
            return dict(NO_STATS)
        response = await model.client.get("/stats")
        result: dict[str, Any] = response.json()
        if "backend" in model.engine_info:  # where it ran: the build, its devices and the layers on them
            offload = model.engine_info.get("offload") or {}
            result.update(
                backend=model.engine_info["backend"],
                device=model.engine_info.get("device", "cpu"),
                devices=[d["name"] for d in model.engine_info.get("devices", [])],
                gpu_layers=offload.get("layers", 0),
            )
        return result

    # -- options -------------------------------------------------------------------------------------------------

    async def options_for(
        self, info: ModelInfo, request: dict[str, Any] | None = None, *, saved: dict[str, Any] | None = None
    ) -> ResolvedOptions:
        """``info``'s options through the priority chain (see :mod:`lemonkit.catalog.recipe_options`), reading its saved
        entry unless ``saved`` is given."""
        if saved is None:
            saved = await asyncio.to_thread(self.registry.saved_options, info.id)
        await self.detect_backends()
        return resolve_options(info, self.settings, saved, request)

    async def detect_backends(self, *, again: bool = False) -> None:
        """Work out the default llama.cpp backend (the best build installed for this machine), once, off the loop."""
        if self.settings.detected_llamacpp_backend is None or again:
            _, default = await asyncio.to_thread(llamacpp_backends, self.settings.recipes, self.settings.cache_dir)
            self.settings.detected_llamacpp_backend = default

    async def check_backend(self, recipe: str, backend: str, *, installed: bool) -> None:
        """Refuse a backend this machine cannot run, or (``installed``) one whose build is not installed.

        Raises:
            InvalidArgument: The recipe table has no such backend, or it cannot run here (an option value this
                machine cannot honour, as the spec's tables have it).
            BackendNotInstalled: ``installed`` and it is not installed, or must be rebuilt first; the message names the
                install action.
        """
        spec = self.settings.recipes.get(recipe, {}).get("backends", {}).get(backend)
        if spec is None:
            raise InvalidArgument(f"{recipe}_backend {backend!r}: lemonkit's recipe table has no such backend")
        cache = self.settings.cache_dir
        status = await asyncio.to_thread(lambda: backend_status(spec, detect_devices(), cache_dir=cache))
        if status["state"] == "unsupported":
            raise InvalidArgument(f"{recipe}_backend {backend!r} cannot run on this machine: {status['message']}")
        # a build of another llama-cpp-python release would load with the wrong bindings; a package that is only
        # older than lemonkit asks still runs
        stale = status["state"] == "update_required" and spec.get("build") not in (None, "cpu")
        if installed and (status["state"] == "installable" or stale):
            raise BackendNotInstalled(
                f"{recipe}:{backend} is {'not installed' if status['state'] == 'installable' else status['state']}"
                f" ({status['message']}); install it: {status['action']}"
            )

    # -- lifecycle -----------------------------------------------------------------------------------------------

    async def load(
        self,
        name: str,
        options: dict[str, Any] | None = None,
        *,
        save_options: bool = False,
        pinned: bool | None = None,
        reload: bool = True,
    ) -> LoadedModel:
        """Load ``name`` (or return it if it is loaded with the same options).

        Args:
            name: Model id or alias.
            options: Load options from the request (top of the priority chain).
            save_options: Also persist ``options`` to ``recipe_options.json`` (replacing its options, keeping
                ``pinned``).
            pinned: ``True`` never evicts this model to make room, ``False`` allows it again; either is saved in
                ``recipe_options.json`` once the model is loaded. ``None`` keeps the saved (or current) pin.
            reload: Reload a loaded model whose resolved options differ from what this request resolves to.

        Raises:
            ModelNotFound: ``name`` is not registered.
            InvalidArgument: An option cannot be honoured here.
            LemonkitError: Downloading the model failed (as a non-streaming pull answers).
            SlotsPinned: Every loaded model of this type is pinned.
            ModelLoadError: The sidecar failed to start or to load the model.
        """
        info = await asyncio.to_thread(self.registry.get, name)
        saved = await asyncio.to_thread(self.registry.saved_options, info.id)
        request = {k: v for k, v in (options or {}).items() if k in RECIPE_OPTIONS.get(info.recipe, ())}
        resolved = (await self.options_for(info, request, saved=saved)).effective
        check_runnable(resolved)  # before a download: what the load would refuse is refused now
        table = self.settings.recipes.get(info.recipe)
        if table is not None and info.remote is None:  # a backend that is missing is a 400 naming its install
            backend = resolved.get(f"{info.recipe}_backend") or table.get("default_backend")
            await self.check_backend(info.recipe, str(backend), installed=True)
        await self._download(info)
        if save_options:
            await asyncio.to_thread(self.registry.update_options, info.id, partial(_replace_options, info, request))
        was_pinned = bool(saved.get("pinned"))
        model = await self._acquire(info, resolved, pinned=was_pinned if pinned is None else pinned, reload=reload)
        if pinned is not None:
            model.pinned = pinned
            if pinned != was_pinned:
                await asyncio.to_thread(self.registry.update_options, info.id, partial(_set_pin, pinned))
        return model

    async def _acquire(self, info: ModelInfo, resolved: dict[str, Any], *, pinned: bool, reload: bool) -> LoadedModel:
        """The loaded ``info`` with ``resolved`` options, sharing a load under way and starting one when needed."""
        while True:
            current = self._loaded.get(info.id)
            if current is not None and (not reload or current.recipe_options == resolved):
                current.pinned = current.pinned or pinned
                self._last_used = current.name
                return current
            pending = self._loading.get(info.id)
            if pending is None or pending.done():
                break
            with contextlib.suppress(LemonkitError):
                await asyncio.shield(pending)  # share a load that is under way, then decide again
            if not reload or (not pending.cancelled() and pending.exception() is not None):
                return await asyncio.shield(pending)  # its model, or its failure: not a second attempt
        task = asyncio.create_task(self._load(info, resolved, pinned=pinned))
        self._loading[info.id] = task
        try:
            return await asyncio.shield(task)
        finally:
            if self._loading.get(info.id) is task and task.done():
                del self._loading[info.id]

    @contextlib.asynccontextmanager
    async def use(self, name: str, *, ctx_size: int | None = None, metered: bool = True) -> AsyncIterator[LoadedModel]:
        """Hold ``name`` loaded for the duration of one request, loading it on first use, once the caller (the
        request's :data:`lemonkit.serving.caller.current`) is admitted and has their turn at it (see
        :mod:`lemonkit.serving.fairness`).

        Args:
            name: The model's id.
            ctx_size: The context size a first load uses.
            metered: Charge the request to the caller's rate; a session's utterances are not, the session was.

        Raises:
            TooManyRequests: The caller is over a per-user limit (nothing was done).
            QueueFull: The model's queue (all users) is full (nothing was done).
            ModelLoadError: The model failed to download or load.
        """
        user = caller.current.get().name
        async with self.fairness.admission(user, name, metered=metered):
            self.requests[name] += 1
            await self._ready(name, ctx_size)
            async with self.fairness.turn(name, user) as turn:
                model = await self._ready(name, ctx_size)  # it may have been evicted while this request waited
                turn.set_capacity(model.slots)
                model.active += 1
                model.idle.clear()
                self._disarm(model)
                model.last_use = time.time()
                self._last_used, self._last_of[user], model.last_user = model.name, model.name, user
                try:
                    yield model
                finally:
                    model.active -= 1
                    model.last_use = time.time()
                    if model.active == 0:
                        model.idle.set()
                        self._arm(model)

    @contextlib.asynccontextmanager
    async def request(self, first: str) -> AsyncIterator[None]:
        """Admit one request of the caller that uses several models in turn or at once (each with :meth:`use`
        inside the block): it counts once toward the caller's limits and rate, however its uses overlap.

        Args:
            first: The model it uses first (whose queue decides whether it may wait).

        Raises:
            TooManyRequests: The caller is over a per-user limit (nothing was done).
            QueueFull: The model's queue (all users) is full (nothing was done).
        """
        async with self.fairness.admission(caller.current.get().name, first):
            yield

    async def warm(self, name: str) -> LoadedModel:
        """Load ``name`` for a session that will use it per utterance (each a :meth:`use` of its own): the
        session's start is admitted and charged to the caller's rate here, but holds no turn and no admission
        while the model loads or afterwards.

        Raises:
            TooManyRequests: The caller is over a per-user limit.
            QueueFull: The model's queue (all users) is full.
            ModelLoadError: The model failed to download or load.
        """
        async with self.fairness.admission(caller.current.get().name, name):
            pass
        return await self._ready(name, None)

    def busy(self, name: str) -> bool:
        """Whether ``name`` is serving a request, or has requests waiting for their turn."""
        return self.fairness.busy(name)

    async def _ready(self, name: str, ctx_size: int | None) -> LoadedModel:
        """``name`` loaded (downloaded first if need be)."""
        model = self._loaded.get(name)
        if model is None or not model.running:
            await self._download(await asyncio.to_thread(self.registry.get, name), as_load_error=True)
            options = {"ctx_size": ctx_size} if ctx_size is not None else None
            model = await self.load(name, options, reload=False)
        return model

    async def _download(self, info: ModelInfo, *, as_load_error: bool = False) -> None:
        """Download ``info`` first if it is not downloaded ("downloading and loading the model if it is not
        loaded"); ``as_load_error`` reports a failure as the inference routes do (500 ``model_load_error``)."""
        if self._install is None or await asyncio.to_thread(self.registry.is_downloaded, info):
            return
        try:
            await self._install([info])
        except LemonkitError as exc:
            if not as_load_error or isinstance(exc, Forbidden):  # a refused caller is not a failed load
                raise
            raise ModelLoadError(f"Downloading {info.id} failed: {exc.message}") from exc

    async def unload(self, name: str | None = None, *, drain: bool = False) -> list[str]:
        """Unload one model (by id or alias) or, without a name, all of them.

        Args:
            name: The model; ``None``: every loaded model.
            drain: Let the requests it is serving finish first (a request that comes meanwhile loads it afresh).

        Returns:
            The ids of the models unloaded.

        Raises:
            ModelNotFound: ``name`` is not loaded.
        """
        if name is None:
            victims = list(self._loaded.values())
        else:
            info = await asyncio.to_thread(self.registry.get, name)
            model = self._loaded.get(info.id)
            if model is None:
                raise ModelNotFound(f"Model not loaded: {name}")
            victims = [model]
        return await self._unload(victims, drain=drain)

    async def unload_where(self, predicate: Callable[[LoadedModel], bool]) -> list[str]:
        """Unload every loaded model ``predicate`` selects (those of a backend that is being uninstalled)."""
        return await self._unload([m for m in self._loaded.values() if predicate(m)])

    async def _unload(self, victims: list[LoadedModel], *, drain: bool = False, reason: str = "request") -> list[str]:
        for model in victims:
            self._loaded.pop(model.name, None)
            if reason:
                self.unloads[model.name, reason] += 1
        await asyncio.gather(*(self._stop(m, drain=drain) for m in victims))
        return [m.name for m in victims]

    def discard(self, model: LoadedModel) -> None:
        """Forget a model whose sidecar failed; the next request loads it afresh."""
        if model.upstream is not None:
            # one upstream failing is not the model failing: its endpoint is marked down, and closing the client
            # would break the requests other endpoints are serving
            return
        if self._loaded.get(model.name) is model:
            del self._loaded[model.name]
            self.unloads[model.name, "failed"] += 1
            log.warning("sidecar for %s failed; it will be reloaded on next use", model.name)
        if model.process is not None and model.process.returncode is None:
            model.process.kill()
        closing = asyncio.get_running_loop().create_task(model.client.aclose())
        self._background.add(closing)  # keep a reference until it is done
        closing.add_done_callback(self._background.discard)

    async def close(self) -> None:
        loading = list(self._loading.values())
        for task in loading:
            task.cancel()
        await asyncio.gather(*loading, return_exceptions=True)  # each kills the sidecar it was starting
        await self.unload()
        for capture in self._captures:
            capture.cancel()
        shutil.rmtree(self._run_dir, ignore_errors=True)

    # -- internals -----------------------------------------------------------------------------------------------

    async def _load(self, info: ModelInfo, options: dict[str, Any], *, pinned: bool) -> LoadedModel:
        async with self._load_lock:
            previous = self._loaded.pop(info.id, None)
            if previous is not None:
                await self._stop(previous, drain=True)
            await self._make_room(info)
            model = await (self._connect(info) if info.remote is not None else self._start(info, options))
            model.pinned = pinned
            self._loaded[info.id] = model
            self.loads[info.id] += 1
            self.fairness.queue(info.id).set_capacity(model.slots)  # /v1/health reports them before any request
            self._last_used = info.id
            log.info("loaded %s (%s)", info.id, f"pid {model.process.pid}" if model.process else model.backend_url)
            return model

    async def _start(self, info: ModelInfo, options: dict[str, Any]) -> LoadedModel:
        files = await asyncio.to_thread(self.registry.resolve, info)
        auto_limit = None
        if info.recipe == "llamacpp":
            await asyncio.to_thread(_check_gguf, files.main)
            auto_limit = await asyncio.to_thread(self.auto_context_limit, files.main, options)
        host_bytes = await asyncio.to_thread(
            _host_need, info, files.main, [files.mmproj, *files.extra.values()], options, auto_limit
        )
        await self._make_room_in_memory(info, host_bytes)
        spec: LoadSpec = {
            "model_name": info.id,
            "recipe": info.recipe,
            "type": info.type,
            "model_path": str(files.main),
            "mmproj_path": str(files.mmproj) if files.mmproj else None,
            "chat_format": info.chat_format,
            "options": options,
            "auto_ctx_limit": auto_limit,
        }
        build = None
        env_path: str | None = None
        if info.recipe == "llamacpp":
            backend = str(options.get("llamacpp_backend") or "cpu")
            found = await asyncio.to_thread(llamacpp_builds.installed, self.settings.cache_dir, backend)
            if found is not None and not (backend == "cpu" and llamacpp_builds.own_version()):
                build, env_path = backend, str(found.site)
            elif backend != "cpu":
                raise BackendNotInstalled(
                    f"llamacpp:{backend} is not installed; install it: POST /v1/install "
                    f'{{"recipe": "llamacpp", "backend": "{backend}"}}'
                )
            budget = await self._make_room_on_device(info, files.main, options, auto_limit)
            if budget is not None:
                spec["device_budget"] = budget
        model = await self._spawn(info, spec, options, site=env_path)
        model.model_path = files.main
        model.build = build
        model.host_bytes = host_bytes
        return model

    def auto_context_limit(self, path: Path, options: dict[str, Any]) -> int | None:
        """(Blocking: it reads the GGUF header.) The most tokens an automatic context of the model at ``path``
        may have, loaded with ``options``: what a quarter of the memory its KV cache lives in holds (the GPU's
        for a load that offloads, else the host's as :func:`_host_memory` gives it); ``None`` when the file
        says nothing of its layers."""
        layout = read_gguf_layout(path)
        if layout is None:
            return None
        args = parse_llamacpp_args(str(options.get("llamacpp_args") or ""))
        backend = str(options.get("llamacpp_backend") or "cpu")
        on_gpu = backend != "cpu" and args.get("n_gpu_layers") != 0 and args.get("devices") != []
        memory = self._device_capacity(backend) if on_gpu else None
        if memory is None:
            memory = _host_memory(self.settings.memory)[0]
        return context_limit(layout, memory, type_k=int(args.get("type_k", 1)), type_v=int(args.get("type_v", 1)))

    def device_bytes(self, model: LoadedModel) -> int:
        """What ``model`` holds on its GPU (its engine's estimate for the layers it offloaded)."""
        offload = model.engine_info.get("offload") or {}
        return int(offload.get("estimate_mb") or 0) * MiB if offload.get("layers") else 0

    async def _make_room_on_device(
        self, info: ModelInfo, path: Path, options: dict[str, Any], auto_limit: int | None = None
    ) -> int | None:
        """Before a load on a GPU build: unload unpinned models on the same backend's devices, least recently used
        first, until ``info`` fits with all the layers it asks for; returns the device bytes it may take.

        Eviction comes before offloading fewer layers (Lemonade evicts too): a model split between GPU and CPU
        runs at a fraction of its speed, and the model asked for now is the one in use. With ``-ngl auto`` a model
        that still does not fit gets fewer layers (as many as the rest holds, none at worst: it then runs on the
        CPU); one that asks for a number of layers, or ``all``, is refused with the figures.

        Returns:
            The bytes left for it on the device, or ``None`` where nothing is known of the device's memory.

        Raises:
            ModelLoadError: A fixed ``-ngl`` does not fit even with every unpinned model unloaded (status 400).
        """
        backend = str(options.get("llamacpp_backend") or "cpu")
        if backend == "cpu":
            return None
        args = parse_llamacpp_args(str(options.get("llamacpp_args") or ""))
        if args.get("devices") == [] or args.get("n_gpu_layers") == 0:
            return None
        capacity = await asyncio.to_thread(self._device_capacity, backend)
        layout = await asyncio.to_thread(read_gguf_layout, path)
        if capacity is None or layout is None:
            return None
        requested = args.get("n_gpu_layers", "auto")
        layers = layout.n_layer + 1 if requested in ("auto", "all") else int(requested)
        n_ctx_train = await asyncio.to_thread(read_gguf_context_length, path)
        n_ctx = llamacpp_context_size(options.get("ctx_size"), n_ctx_train, auto_limit=auto_limit)
        guess = estimate(
            layout,
            layers,
            n_ctx=n_ctx,
            n_ubatch=int(args.get("n_ubatch", 512)) if info.type == "llm" else n_ctx,
            type_k=int(args.get("type_k", 1)),
            type_v=int(args.get("type_v", 1)),
            kv_offload=bool(args.get("offload_kqv", True)),
        )

        def on_device() -> list[LoadedModel]:
            return [m for m in self._loaded.values() if m.build == backend and self.device_bytes(m)]

        while guess.total > capacity - sum(self.device_bytes(m) for m in on_device()):
            candidates = [m for m in on_device() if not m.pinned]
            if not candidates:
                break
            victim = min(candidates, key=lambda m: m.last_use)
            log.info(
                "evicting %s (%d MiB on llamacpp:%s) to make room for %s (%s)",
                victim.name,
                self.device_bytes(victim) // MiB,
                backend,
                info.id,
                guess.describe(),
            )
            self._loaded.pop(victim.name, None)
            self.unloads[victim.name, "device"] += 1
            await self._stop(victim, drain=True)
        free = capacity - sum(self.device_bytes(m) for m in on_device())
        if guess.total <= free or requested == "auto":
            if guess.total > free:
                log.info(
                    "%s gets fewer layers than its %d: %d MiB of llamacpp:%s are free",
                    info.id,
                    layers,
                    max(0, free) // MiB,
                    backend,
                )
            return max(0, free)
        held = ", ".join(f"{m.name} ({self.device_bytes(m) // MiB} MiB, pinned)" for m in on_device())
        raise ModelLoadError(
            f"Cannot load {info.id} on llamacpp:{backend}: {guess.describe()}, but {max(0, free) // MiB} of "
            f"{capacity // MiB} MiB are free{' beside ' + held if held else ''}. Ask for fewer layers (-ngl N, or "
            "-ngl auto to fit), a smaller ctx_size, or unpin a model",
            status=400,
        )

    def _device_capacity(self, backend: str) -> int | None:
        """Bytes of device memory lemonkit may use for ``backend``'s models: its devices' memory as their drivers
        report it, capped by the operator's ``gpu_memory``; ``None`` when neither is known."""
        devices = detect_devices()
        if backend == "vulkan":
            sizes = [d.get("memory_gb") for d in devices.get("vulkan", []) if d.get("available")]
        elif backend == "cuda":
            sizes = [d.get("vram_gb") for d in devices.get("nvidia_gpu", [])]
        elif backend == "rocm":
            sizes = [d.get("vram_gb") for d in devices.get("amd_gpu", [])]
        else:
            sizes = []
        known = [int(float(s) * 1024 * MiB) for s in sizes if s]
        total = sum(known) if known else None
        cap = self.settings.gpu_memory
        if cap is not None:
            return cap if total is None else min(cap, total)
        return total

    async def _connect(self, info: ModelInfo) -> LoadedModel:
        """A remote model: its upstreams checked, nothing started."""
        assert info.remote is not None
        settings = self.settings.remote
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

    async def _make_room(self, info: ModelInfo) -> None:
        """Keep the count of loaded models of ``info``'s type within the operator's ``max_loaded_models`` (none by
        default: memory decides, see :meth:`_make_room_in_memory` and :meth:`_make_room_on_device`)."""
        limit = self.settings.max_loaded_models
        if limit < 0 or info.remote is not None:
            return  # a remote model holds no memory here: it neither takes a slot nor makes room
        # on-demand models (upscalers) have slots of their own: upscaling a generated image keeps its generator
        same_type = [
            m
            for m in self._loaded.values()
            if (m.info.type, m.info.on_demand) == (info.type, info.on_demand) and m.upstream is None
        ]
        while len(same_type) >= limit:
            candidates = [m for m in same_type if not m.pinned]
            if not candidates:
                raise SlotsPinned(
                    f"Cannot load {info.id}: every loaded {info.type} model is pinned "
                    f"(max {limit} per type); unload one first"
                )
            victim = min(candidates, key=lambda m: m.last_use)
            log.info("evicting %s to make room for %s", victim.name, info.id)
            self._loaded.pop(victim.name, None)
            self.unloads[victim.name, "count"] += 1
            same_type.remove(victim)
            await self._stop(victim, drain=True)

    async def _make_room_in_memory(self, info: ModelInfo, need: int) -> None:
        """Before a load: unload unpinned models, least recently used first, of any type, until ``need`` bytes of
        host memory are free, both within what lemonkit may use (``memory``; default the machine's, less a
        reserve) beside the loaded models' estimates, and in what the system has available now (other programs,
        a model that outgrew its estimate). Memory is the one limit by default, as in Ollama: several models stay
        loaded while they fit, and the least recently used makes room for the one asked for now.

        Raises:
            ModelLoadError: It does not fit even with every unpinned model unloaded (status 400, with the figures).
        """

        def held() -> list[LoadedModel]:
            return [m for m in self._loaded.values() if m.host_bytes]

        while True:
            capacity, available = await asyncio.to_thread(_host_memory, self.settings.memory)
            free = min(capacity - sum(m.host_bytes for m in held()), available)
            candidates = [m for m in held() if not m.pinned]
            if need <= free or not candidates:
                break
            victim = min(candidates, key=lambda m: m.last_use)
            log.info(
                "evicting %s (%d MiB) to make room for %s (%d MiB; %d MiB free)",
                victim.name,
                victim.host_bytes // MiB,
                info.id,
                need // MiB,
                max(0, free) // MiB,
            )
            self._loaded.pop(victim.name, None)
            self.unloads[victim.name, "memory"] += 1
            await self._stop(victim, drain=True)
        if need <= free:
            return
        pinned = ", ".join(f"{m.name} ({m.host_bytes // MiB} MiB, pinned)" for m in held())
        limit = "LEMONKIT_MEMORY" if self.settings.memory is not None else "this machine's memory less its reserve"
        raise ModelLoadError(
            f"Cannot load {info.id}: it needs about {need // MiB} MiB of memory, but {max(0, free) // MiB} MiB are "
            f"free of the {capacity // MiB} MiB lemonkit may use ({limit}){' beside ' + pinned if pinned else ''}. "
            "Ask for a smaller ctx_size, unpin a model, or raise the limit",
            status=400,
        )

    def _capture(self, stream: asyncio.StreamReader, tag: str, tail: deque[str] | None = None) -> asyncio.Task[None]:
        task = asyncio.create_task(logs.capture(stream, tag, tail=tail))
        self._captures.add(task)  # the loop keeps only weak references to tasks
        task.add_done_callback(self._captures.discard)
        return task

    async def _spawn(
        self, info: ModelInfo, spec: LoadSpec, options: dict[str, Any], *, site: str | None = None
    ) -> LoadedModel:
        """Start ``info``'s sidecar and wait for it to load; ``site`` goes first on its ``PYTHONPATH`` (a llama.cpp
        build installed apart, whose ``llama_cpp`` it then imports)."""
        self._counter += 1
        self.loads_started += 1
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

    async def _stop(self, model: LoadedModel, *, drain: bool) -> None:
        self._disarm(model)
        if drain and model.active:
            await model.idle.wait()  # let requests in flight finish before the process goes
        process = model.process
        if process is not None and process.returncode is None:
            self._retired[model.name] = add_totals(self._retired.get(model.name, {}), await self._totals_of(model))
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


def _host_memory(cap: int | None) -> tuple[int, int]:
    """(bytes lemonkit's models may take in all, bytes the system has available now), both beyond a reserve for
    the server, the notebooks' kernels and everything else: a tenth of the memory, at most 2 GiB."""
    import psutil

    memory = psutil.virtual_memory()
    reserve = min(2 * 1024 * MiB, memory.total // 10)
    return (cap if cap is not None else memory.total - reserve), memory.available - reserve


def _tree_bytes(path: Path) -> int:
    """The bytes of a file, or of every file under a directory (links followed: a hub snapshot links its blobs)."""
    if not path.is_dir():
        return path.stat().st_size if path.exists() else 0
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _host_need(
    info: ModelInfo, main: Path, others: list[Path | None], options: dict[str, Any], auto_limit: int | None = None
) -> int:
    """The host memory a sidecar for ``info`` will take (:func:`lemonkit.catalog.placement.host_estimate`)."""
    file_bytes = _tree_bytes(main) + sum(_tree_bytes(p) for p in others if p is not None)
    layout = read_gguf_layout(main) if info.recipe == "llamacpp" else None
    if layout is None:
        return host_estimate(file_bytes)
    args = parse_llamacpp_args(str(options.get("llamacpp_args") or ""))
    backend = str(options.get("llamacpp_backend") or "cpu")
    on_gpu = backend != "cpu" and args.get("n_gpu_layers") != 0 and args.get("devices") != []
    n_ctx = llamacpp_context_size(options.get("ctx_size"), read_gguf_context_length(main), auto_limit=auto_limit)
    return host_estimate(
        file_bytes,
        layout,
        on_gpu=on_gpu,
        n_ctx=n_ctx,
        n_ubatch=int(args.get("n_ubatch", 512)) if info.type == "llm" else n_ctx,
        type_k=int(args.get("type_k", 1)),
        type_v=int(args.get("type_v", 1)),
    )


async def _end(process: asyncio.subprocess.Process) -> None:
    """Kill ``process`` unless it has exited, and reap it."""
    if process.returncode is None:
        process.kill()
    await process.wait()


def _replace_options(info: ModelInfo, options: dict[str, Any], entry: dict[str, Any]) -> dict[str, Any]:
    """``save_options``: the request's options replace the saved ones; keys that are not options stay."""
    names = RECIPE_OPTIONS.get(info.recipe, ())
    kept = {k: v for k, v in entry.items() if k not in names}
    return {**kept, **{k: v for k, v in options.items() if not is_unset(k, v)}}


def _set_pin(pinned: bool, entry: dict[str, Any]) -> dict[str, Any]:
    entry = {k: v for k, v in entry.items() if k != "pinned"}
    return {**entry, "pinned": True} if pinned else entry


def _check_gguf(path: Path) -> None:
    """Refuse a file llama.cpp cannot even start on, before spawning anything."""
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelLoadRefused(f"{path.name} is not a GGUF file (magic {magic!r}); the llamacpp recipe needs GGUF")
