"""Memory, the limit on what stays loaded: what a sidecar will take, what lemonkit may use, and making room.

Before a load the manager counts the host memory the new sidecar will take (:func:`host_need`, from
:mod:`lemonkit.catalog.placement`'s estimates) and, for a llama.cpp load that offloads, the device memory of its
layers; :class:`Evictor` then unloads unpinned models, least recently used first, until it fits: within what
lemonkit may use (``LEMONKIT_MEMORY``, ``gpu_memory``; by default the machine's less a reserve) beside the loaded
models, and in what the system has available now. A fixed count per type (``max_loaded_models``) is applied the
same way. A model that fits nowhere, even with every unpinned model gone, is refused with the figures.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from lemonkit.catalog.config import Settings
from lemonkit.catalog.hardware import detect_devices
from lemonkit.catalog.model_info import ModelInfo
from lemonkit.catalog.placement import PROCESS_BYTES, MiB, context_limit, estimate, host_estimate
from lemonkit.catalog.recipe_options import (
    DEFAULT_DRAFT_MAX,
    DEFAULT_N_BATCH,
    DEFAULT_N_PARALLEL,
    draft_context,
    drafts_with_head,
    llamacpp_context_size,
    rollback_tokens,
)
from lemonkit.errors import ModelLoadError, SlotsPinned
from lemonkit.formats.files import tree_bytes
from lemonkit.formats.gguf_header import read_gguf_context_length, read_gguf_layout
from lemonkit.formats.llamacpp_args import parse_llamacpp_args
from lemonkit.serving.loaded_model import LoadedModel

__all__ = ["Evictor", "auto_context_limit", "device_capacity", "host_memory", "host_need", "memory_health"]

log = logging.getLogger("lemonkit.manager")  # evictions are the manager's: its log


def host_memory(cap: int | None) -> tuple[int, int]:
    """(bytes lemonkit's models may take in all, bytes the system has available now), both beyond a reserve for
    the server, the notebooks' kernels and everything else: a tenth of the memory, at most 2 GiB."""
    import psutil

    memory = psutil.virtual_memory()
    reserve = min(2 * 1024 * MiB, memory.total // 10)
    return (cap if cap is not None else memory.total - reserve), memory.available - reserve


def memory_health(settings: Settings, loaded: Iterable[LoadedModel]) -> dict[str, int]:
    """Host memory in MiB: what lemonkit's models may take (``limit_mb``), what the ``loaded`` ones are counted
    for, and what the system has free now beyond its reserve."""
    capacity, available = host_memory(settings.memory)
    return {
        "limit_mb": capacity // MiB,
        "models_mb": sum(m.host_bytes for m in loaded) // MiB,
        "available_mb": max(0, available) // MiB,
    }


def device_capacity(settings: Settings, backend: str) -> int | None:
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
    cap = settings.gpu_memory
    if cap is not None:
        return cap if total is None else min(cap, total)
    return total


def _offload(options: Mapping[str, Any]) -> tuple[str, dict[str, Any], bool]:
    """A llama.cpp load's backend, its parsed ``llamacpp_args``, and whether it offloads layers to a GPU (a GPU
    build, not told ``-ngl 0`` or ``--device none``)."""
    args = parse_llamacpp_args(str(options.get("llamacpp_args") or ""))
    backend = str(options.get("llamacpp_backend") or "cpu")
    return backend, args, backend != "cpu" and args.get("n_gpu_layers") != 0 and args.get("devices") != []


def _cache_args(info: ModelInfo, args: Mapping[str, Any], n_ctx: int) -> dict[str, Any]:
    """The estimates' batch, KV cache, recurrent state and MTP head arguments, from the load's flags (an embedding
    model's batch is its context)."""
    return {
        "n_ubatch": int(args.get("n_ubatch", 512)) if info.type == "llm" else n_ctx,
        "type_k": int(args.get("type_k", 1)),
        "type_v": int(args.get("type_v", 1)),
        # the slots, and at most the padding and retire sequences beside (see the llama.cpp engine)
        "n_seq": int(args.get("n_parallel", DEFAULT_N_PARALLEL)) + 2,
        "n_rs_seq": rollback_tokens(args, info.labels),
        "mtp": info.type == "llm" and drafts_with_head(args, info.labels),
    }


def auto_context_limit(settings: Settings, path: Path, options: dict[str, Any]) -> int | None:
    """(Blocking: it reads the GGUF header.) The most tokens an automatic context of the model at ``path`` may
    have, loaded with ``options``: what a quarter of the memory its KV cache lives in holds (the GPU's for a load
    that offloads, else the host's as :func:`host_memory` gives it); ``None`` when the file says nothing of its
    layers."""
    layout = read_gguf_layout(path)
    if layout is None:
        return None
    backend, args, on_gpu = _offload(options)
    memory = device_capacity(settings, backend) if on_gpu else None
    if memory is None:
        memory = host_memory(settings.memory)[0]
    return context_limit(layout, memory, type_k=int(args.get("type_k", 1)), type_v=int(args.get("type_v", 1)))


def host_need(
    info: ModelInfo,
    main: Path,
    others: list[Path | None],
    options: dict[str, Any],
    auto_limit: int | None = None,
    draft: Path | None = None,
) -> int:
    """(Blocking.) The host memory a sidecar for ``info`` will take (:func:`lemonkit.catalog.placement.host_estimate`):
    its files (``main``, the ``others`` present and a ``draft`` model) and, for a llama.cpp model, what its context
    takes on the CPU, and its draft model's context beside (it holds a sequence per slot)."""
    file_bytes = sum(tree_bytes(p) for p in (main, *others, draft) if p is not None and p.exists())
    layout = read_gguf_layout(main) if info.recipe == "llamacpp" else None
    if layout is None:
        return host_estimate(file_bytes)
    _, args, on_gpu = _offload(options)
    n_ctx = llamacpp_context_size(options.get("ctx_size"), read_gguf_context_length(main), auto_limit=auto_limit)
    cache_ram = max(0, int(args.get("cache_ram", 0))) * 2**20  # --cache-ram's bound; -1 (no bound) counts nothing
    need = host_estimate(
        file_bytes, layout, on_gpu=on_gpu, n_ctx=n_ctx, cache_ram=cache_ram, **_cache_args(info, args, n_ctx)
    )
    drafter = read_gguf_layout(draft) if draft is not None else None
    if drafter is not None:  # its file is counted above; it runs on the CPU, even beside a target on a GPU
        n_parallel, draft_max = (
            int(args.get("n_parallel", DEFAULT_N_PARALLEL)),
            int(args.get("draft_max", DEFAULT_DRAFT_MAX)),
        )
        # its context and batch as the engine builds them (its batch is the target's -b)
        n_draft = draft_context(n_ctx, n_parallel, draft_max)
        n_ubatch = int(args.get("n_batch", DEFAULT_N_BATCH))
        need += host_estimate(0, drafter, n_ctx=n_draft, n_ubatch=n_ubatch) - PROCESS_BYTES
    return need


def _least_recent(models: Iterable[LoadedModel]) -> LoadedModel | None:
    """The unpinned model of ``models`` used longest ago: the next to evict."""
    return min((m for m in models if not m.pinned), key=lambda m: m.last_use, default=None)


class Evictor:
    """Makes room for a load by evicting loaded models (never a pinned one, nor a remote one: it holds nothing here).

    Args:
        settings: The deployment's settings (``memory``, ``gpu_memory``, ``max_loaded_models``).
        loaded: The manager's loaded models, by name (read, never changed here).
        evict: Unloads a model to make room, once its requests finish, counting it under a reason (``memory``,
            ``device`` or ``count``).
    """

    def __init__(
        self,
        settings: Settings,
        loaded: Mapping[str, LoadedModel],
        evict: Callable[[LoadedModel, str], Awaitable[None]],
    ) -> None:
        self.settings = settings
        self._loaded = loaded
        self._evict = evict

    async def by_count(self, info: ModelInfo) -> None:
        """Keep the count of loaded models of ``info``'s type within the operator's ``max_loaded_models`` (none by
        default: memory decides, see :meth:`in_memory` and :meth:`on_device`).

        Raises:
            SlotsPinned: Every loaded model of the type is pinned.
        """
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
            victim = _least_recent(same_type)
            if victim is None:
                raise SlotsPinned(
                    f"Cannot load {info.id}: every loaded {info.type} model is pinned "
                    f"(max {limit} per type); unload one first"
                )
            log.info("evicting %s to make room for %s", victim.name, info.id)
            same_type.remove(victim)
            await self._evict(victim, "count")

    async def in_memory(self, info: ModelInfo, need: int) -> None:
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
            capacity, available = await asyncio.to_thread(host_memory, self.settings.memory)
            free = min(capacity - sum(m.host_bytes for m in held()), available)
            victim = _least_recent(held())
            if need <= free or victim is None:
                break
            log.info(
                "evicting %s (%d MiB) to make room for %s (%d MiB; %d MiB free)",
                victim.name,
                victim.host_bytes // MiB,
                info.id,
                need // MiB,
                max(0, free) // MiB,
            )
            await self._evict(victim, "memory")
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

    async def on_device(
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
        backend, args, on_gpu = _offload(options)
        if not on_gpu:
            return None
        capacity = await asyncio.to_thread(device_capacity, self.settings, backend)
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
            **_cache_args(info, args, n_ctx),
            kv_offload=bool(args.get("offload_kqv", True)),
        )

        def on_device() -> list[LoadedModel]:
            return [m for m in self._loaded.values() if m.build == backend and m.device_bytes]

        while guess.total > capacity - sum(m.device_bytes for m in on_device()):
            victim = _least_recent(on_device())
            if victim is None:
                break
            log.info(
                "evicting %s (%d MiB on llamacpp:%s) to make room for %s (%s)",
                victim.name,
                victim.device_bytes // MiB,
                backend,
                info.id,
                guess.describe(),
            )
            await self._evict(victim, "device")
        free = capacity - sum(m.device_bytes for m in on_device())
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
        held = ", ".join(f"{m.name} ({m.device_bytes // MiB} MiB, pinned)" for m in on_device())
        raise ModelLoadError(
            f"Cannot load {info.id} on llamacpp:{backend}: {guess.describe()}, but {max(0, free) // MiB} of "
            f"{capacity // MiB} MiB are free{' beside ' + held if held else ''}. Ask for fewer layers (-ngl N, or "
            "-ngl auto to fit), a smaller ctx_size, or unpin a model",
            status=400,
        )
