"""The model manager: which models are loaded, in which sidecar, and for how long.

One manager per server, living on the server's event loop. It never does
inference or blocking IO on the loop: files are resolved in a thread, engines
run in sidecar processes it spawns and talks to over Unix sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any

from lemonkit._version import __version__
from lemonkit.backends.protocol import NO_STATS
from lemonkit.catalog.config import Settings
from lemonkit.catalog.recipe_options import RECIPE_OPTIONS, ResolvedOptions, check_runnable, resolve_options
from lemonkit.catalog.registry import ModelInfo, Registry
from lemonkit.catalog.system_info import llamacpp_backends
from lemonkit.errors import Forbidden, LemonkitError, ModelLoadError, ModelNotFound
from lemonkit.serving import caller
from lemonkit.serving.fairness import FairScheduler
from lemonkit.serving.load_plan import check_backend, llamacpp_build, plan_load, replace_options, set_pin
from lemonkit.serving.loaded_model import LoadedModel, connect_remote
from lemonkit.serving.memory import Evictor, auto_context_limit, memory_health
from lemonkit.serving.sidecar_processes import SidecarProcesses

__all__ = ["MODEL_TYPES", "ModelManager"]

log = logging.getLogger("lemonkit.manager")

#: the types /v1/health reports slots for
MODEL_TYPES = ("llm", "embedding", "reranking", "transcription", "image", "tts")


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
        self.sidecars = SidecarProcesses(settings)
        self._room = Evictor(settings, self._loaded, self._evict)
        self._background: set[asyncio.Task[None]] = set()
        #: sidecars spawned so far (concurrent requests for a model that is loading share one)
        self.loads_started = 0
        #: for /metrics, per model: loads that went through, requests admitted, and unloads by reason (``memory``,
        #: ``device``, ``count``, ``keep_alive``: evictions; ``request``: asked for; ``failed``)
        self.loads: Counter[str] = Counter()
        self.requests: Counter[str] = Counter()
        self.unloads: Counter[tuple[str, str]] = Counter()

    # -- queries -------------------------------------------------------------------------------------------------

    def loaded(self, name: str) -> LoadedModel | None:
        return self._loaded.get(name)

    def loaded_models(self) -> list[LoadedModel]:
        return list(self._loaded.values())

    async def generation_totals(self) -> dict[str, dict[str, Any]]:
        """Per model, what its engines generated since this server started
        (:meth:`lemonkit.serving.sidecar_processes.SidecarProcesses.generation_totals`)."""
        return await self.sidecars.generation_totals(self._loaded.values())

    # -- keep-alive ----------------------------------------------------------------------------------------------

    def keep_alive(self, name: str, seconds: float | None, *, given: bool = True) -> None:
        """Keep ``name`` loaded for ``seconds`` once idle, then unload it (``0``: as soon as it is idle; ``None``:
        while memory allows, the default). Each later idle moment starts the time again. ``given=False`` (a
        request that did not say) leaves the model's setting as it is."""
        model = self._loaded.get(name)
        if model is None or not given:
            return
        model.keep_alive = seconds
        model.disarm()
        if model.active == 0:
            model.arm(self._expire)

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

    # -- reports -------------------------------------------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        """The ``/v1/health`` answer: the loaded models with their slots and queues, the limits, the memory."""
        limit = self.settings.max_loaded_models
        return {
            "status": "ok",
            "version": __version__,
            "model_loaded": self._last_used if self._last_used in self._loaded else None,
            # each with its slots and queue, read without waiting on the model
            "all_models_loaded": [{**m.health(), **self.fairness.health(m.name)} for m in self._loaded.values()],
            "max_models": {kind: limit for kind in MODEL_TYPES},
            "memory": memory_health(self.settings, self._loaded.values()),
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
        return await model.stats()

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
        """Refuse a backend this machine cannot run, or (``installed``) one whose build is not installed
        (:func:`lemonkit.serving.load_plan.check_backend`)."""
        await check_backend(self.settings, recipe, backend, installed=installed)

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
            await asyncio.to_thread(self.registry.update_options, info.id, partial(replace_options, info, request))
        was_pinned = bool(saved.get("pinned"))
        model = await self._acquire(info, resolved, pinned=was_pinned if pinned is None else pinned, reload=reload)
        if pinned is not None:
            model.pinned = pinned
            if pinned != was_pinned:
                await asyncio.to_thread(self.registry.update_options, info.id, partial(set_pin, pinned))
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
                model.disarm()
                model.last_use = time.time()
                self._last_used, self._last_of[user], model.last_user = model.name, model.name, user
                try:
                    yield model
                finally:
                    model.active -= 1
                    model.last_use = time.time()
                    if model.active == 0:
                        model.idle.set()
                        model.arm(self._expire)

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
        self.sidecars.close()

    # -- internals -----------------------------------------------------------------------------------------------

    async def _load(self, info: ModelInfo, options: dict[str, Any], *, pinned: bool) -> LoadedModel:
        async with self._load_lock:
            previous = self._loaded.pop(info.id, None)
            if previous is not None:
                await self._stop(previous, drain=True)
            await self._room.by_count(info)
            model = await (
                connect_remote(info, self.settings.remote) if info.remote is not None else self._start(info, options)
            )
            model.pinned = pinned
            self._loaded[info.id] = model
            self.loads[info.id] += 1
            self.fairness.queue(info.id).set_capacity(model.slots)  # /v1/health reports them before any request
            self._last_used = info.id
            log.info("loaded %s (%s)", info.id, f"pid {model.process.pid}" if model.process else model.backend_url)
            return model

    async def _start(self, info: ModelInfo, options: dict[str, Any]) -> LoadedModel:
        """A local model's sidecar started, once there is room for it in memory (and on its GPU)."""
        plan = await plan_load(self.settings, self.registry, info, options)
        await self._room.in_memory(info, plan.host_bytes)
        build = site = None
        if info.recipe == "llamacpp":
            build, site = await llamacpp_build(self.settings, options)
            budget = await self._room.on_device(info, plan.files.main, options, plan.auto_limit)
            if budget is not None:
                plan.spec["device_budget"] = budget
        self.loads_started += 1
        model = await self.sidecars.spawn(info, plan.spec, options, site=site)
        model.model_path, model.build, model.host_bytes = plan.files.main, build, plan.host_bytes
        return model

    def auto_context_limit(self, path: Path, options: dict[str, Any]) -> int | None:
        """(Blocking: it reads the GGUF header.) The most tokens an automatic context of the model at ``path``
        may have, loaded with ``options`` (:func:`lemonkit.serving.memory.auto_context_limit`)."""
        return auto_context_limit(self.settings, path, options)

    def device_bytes(self, model: LoadedModel) -> int:
        """What ``model`` holds on its GPU (its engine's estimate for the layers it offloaded)."""
        return model.device_bytes

    async def _evict(self, victim: LoadedModel, reason: str) -> None:
        """Unload ``victim`` to make room for a load, once its requests finish (``reason``: what counts it in
        ``unloads``)."""
        await self._unload([victim], drain=True, reason=reason)

    async def _stop(self, model: LoadedModel, *, drain: bool) -> None:
        model.disarm()
        if drain and model.active:
            await model.idle.wait()  # let requests in flight finish before the process goes
        await self.sidecars.stop(model)
